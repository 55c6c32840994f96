// Where a KServe v2 model's outputs o and lse go (the response, or a
// shared-memory region a request names), and the response parameters every
// model adds: one planning step before the call and one delivery step after
// it, shared by attention and attention_kv (model.h).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "inference/grpc_service.pb.h"
#include "server/core/call.h"
#include "server/executor.h"
#include "server/kserve/v2_tensors.h"

namespace attnserve {

// One output to deliver.
struct V2Output {
  std::string name;  // "o" or "lse"
  std::optional<ShmRef> shm;
  // Held until the output is written, so an unregister cannot unmap it.
  std::shared_ptr<ShmRegion> region;
  // The backend writes the output straight into the region (PlaceOutputs),
  // so delivering it writes nothing.
  bool in_place = false;
};

// The outputs of `source.request`: those it lists (o and lse only, each at
// most once, their regions acquired now), or o plus lse when *return_lse
// without a list. Listing lse sets *return_lse. INVALID_ARGUMENT naming the
// output for anything else; `model` names the model in errors.
absl::Status PlanOutputs(const InputSource& source, const std::string& model, bool* return_lse,
                         std::vector<V2Output>* outputs);

// INVALID_ARGUMENT naming the output and its region when `out` goes to a
// region given fewer than `bytes` bytes.
absl::Status CheckOutputFits(const V2Output& out, uint64_t bytes);

// Just before compute, given o's and lse's byte counts (lse 0 when not
// wanted): checks that every output going to a region fits (CheckOutputFits),
// then points *o and *lse at the place in their region of those the backend
// can write in place (InPlace), marking them in_place; the others stay null
// (the response's buffer, copied by DeliverOutputs). So a region too small
// fails the request before it runs, and a system region's outputs are never
// copied. With `devices`, an output in a CUDA region is placed too (a device
// address; *devices says on which device), so the backend writes it there;
// without, it is written through ShmRegion::Write after the call.
absl::Status PlaceOutputs(std::vector<V2Output>* outputs, int64_t o_bytes, int64_t lse_bytes,
                          void** o, float** lse, OutputDevices* devices = nullptr);

// An output as a call produced it: dtype and shape, and its bytes unless the
// backend wrote them in place.
struct ProducedTensor {
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;
  std::string bytes;
};

// A sink (server/core/call.h) for `outputs`: PlaceOutputs (with `devices`,
// the call's output_devices, CUDA regions are written where they lie), then
// the bytes not placed in a region go to `o` and `lse`, whose dtypes and
// shapes it sets. `outputs`, `o`, `lse` and `devices` must outlive the call.
OutputSink V2Sink(std::vector<V2Output>* outputs, ProducedTensor* o, ProducedTensor* lse,
                  OutputDevices* devices = nullptr);

// Moves o and lse (the call's outputs) into `response` or writes them
// into their regions (outputs already written in place only get their
// metadata). Every region must fit, and be intact (ShmRegion::CheckIntact:
// not shrunk by its client during the call), before any is written, so a
// failed delivery writes nothing.
absl::Status DeliverOutputs(std::vector<V2Output>* outputs, ProducedTensor* o, ProducedTensor* lse,
                            inference::ModelInferResponse* response);

// Where the call's time went and what ran it, as response parameters
// (queue_us, compute_us, total_us, batch_size, device, backend).
void SetTimingParameters(const WorkTimings& timing, const std::string& backend,
                         inference::ModelInferResponse* response);

}  // namespace attnserve
