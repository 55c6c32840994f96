// V2Client: the `attention` model over the KServe v2 protocol
// (inference.GRPCInferenceService on the native port, docs/kserve.md), for
// attnctl's --protocol=v2. A native ForwardRequest goes out as a
// ModelInferRequest and the answer comes back as a ForwardResponse, so
// `attnctl forward` and `attnctl load` keep one request type, one verifier and
// one report for both protocols.
//
// With shared memory (--shm=system), tensors leave the gRPC message: the
// client creates one POSIX shm region per slot (a slot serves one call at a
// time: one caller of the closed loop), registers it with
// SystemSharedMemoryRegister, copies each request's inputs into it and reads
// the outputs back from it (ForwardStaged: only when it must, as a client
// that produces and consumes its tensors in the region would). --shm=cuda
// does the same with device memory of GPU 0 exported as a CUDA IPC handle
// (CudaSharedMemoryRegister); it needs a CUDA build of attnctl, without one
// Create answers FAILED_PRECONDITION saying so.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "client/attention_client.h"
#include "client/shm_arena.h"
#include "inference/grpc_service.grpc.pb.h"

namespace attnserve {

// The KServe v2 model the client calls.
inline constexpr char kV2AttentionModel[] = "attention";

// The same three choices as the native calls' arenas (client/shm_arena.h).
using V2Shm = ShmMode;
inline absl::StatusOr<V2Shm> ParseV2Shm(absl::string_view name) { return ParseShmMode(name); }
inline const char* V2ShmName(V2Shm shm) { return ShmModeName(shm); }

// The v2 request for `request` (model `attention`, its tensors in
// raw_input_contents, its options as parameters, o and, with return_lse, lse
// requested).
inference::ModelInferRequest ToModelInferRequest(const v1::ForwardRequest& request);
// The native response for a v2 one: o and lse from raw_output_contents (moved),
// the timing and backend from the response parameters. INTERNAL naming the
// output when the server sent a malformed one.
absl::StatusOr<v1::ForwardResponse> FromModelInferResponse(
    inference::ModelInferResponse&& response);

// Bytes one slot needs for `request`: its inputs plus its outputs.
int64_t V2SlotBytes(const v1::ForwardRequest& request);

class V2Client {
 public:
  // Borrows `client`'s channels (it must outlive this). With shm, creates and
  // registers `slots` regions of `slot_bytes` each; the server must run with
  // --allow_client_shm. System keys start with `key_prefix` (with tokens,
  // "/attnserve.<tenant>.").
  static absl::StatusOr<std::unique_ptr<V2Client>> Create(
      AttentionClient* client, V2Shm shm, int slots, int64_t slot_bytes,
      const std::string& key_prefix = kDefaultShmKeyPrefix);
  // Unregisters and removes the regions.
  ~V2Client();

  // A slot's region (system: a POSIX shm object; cuda: device memory).
  struct Region;

  V2Shm shm() const { return shm_; }

  // ModelInfer of `request`; with shm, its tensors go through region `slot`
  // (one call per slot at a time).
  absl::StatusOr<v1::ForwardResponse> Forward(const v1::ForwardRequest& request, int slot = 0);
  // Forward through region `slot` for a caller that sends the same inputs
  // again and again (attnctl load): the inputs are written into the region
  // only when it last held others (`input` names them: one number per distinct
  // request), and the outputs are read back only with `read_outputs`;
  // without, the response's o and lse have their dtype and shape but no
  // bytes (they are in the region). Needs shared memory.
  absl::StatusOr<v1::ForwardResponse> ForwardStaged(const v1::ForwardRequest& request, int input,
                                                    int slot, bool read_outputs);
  // ModelInfer of a request already converted (ToModelInferRequest), so a load
  // test converts each input once; tensors in the message.
  absl::StatusOr<v1::ForwardResponse> Infer(const inference::ModelInferRequest& request);
  // The same without blocking (`request` is copied); `done` runs once on a
  // gRPC thread.
  void InferAsync(const inference::ModelInferRequest& request,
                  std::function<void(absl::StatusOr<v1::ForwardResponse>)> done);

 private:
  V2Client(AttentionClient* client, V2Shm shm);
  absl::Status Register(Region* region);
  // The region of `slot` (slots share regions round-robin); needs shared memory.
  Region* RegionFor(int slot) const;
  // `input` < 0: always write the inputs.
  absl::StatusOr<v1::ForwardResponse> InferThroughRegion(const v1::ForwardRequest& request,
                                                         int input, bool read_outputs,
                                                         Region* region);
  inference::GRPCInferenceService::Stub& Stub();

  AttentionClient* const client_;
  const V2Shm shm_;
  std::vector<std::unique_ptr<inference::GRPCInferenceService::Stub>> stubs_;
  std::vector<std::unique_ptr<Region>> regions_;
  int registered_ = 0;  // regions_[0, registered_) are registered with the server
  std::atomic<uint64_t> next_{0};
};

}  // namespace attnserve
