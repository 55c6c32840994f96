// Tensors of the KServe v2 protocol as attnserve reads and writes them: data
// type names, the bytes of an input (raw_input_contents, typed contents or a
// shared-memory region) and where an output goes (the response or a region).
// Shared by every model of the front-end (model.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "backend/params.h"
#include "google/protobuf/map.h"
#include "inference/grpc_service.pb.h"
#include "server/core/call.h"
#include "server/shm/shm_registry.h"

namespace attnserve {

using V2Parameters = google::protobuf::Map<std::string, inference::InferParameter>;

// "FP16", "BF16", "FP32" -> DType; INVALID_ARGUMENT naming `where` otherwise.
absl::StatusOr<DType> ParseFloatDatatype(const std::string& where, const std::string& datatype);

// A tensor's place in a shared-memory region (the shared_memory_region,
// shared_memory_offset and shared_memory_byte_size parameters).
struct ShmRef {
  std::string region;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};
// The reference in `params`, if any; INVALID_ARGUMENT naming `where` when the
// parameters are incomplete or of the wrong type.
absl::StatusOr<std::optional<ShmRef>> ShmRefOf(const std::string& where,
                                               const V2Parameters& params);

// Tensor bytes in a shared-memory region that the server uses where they lie
// (inputs read, outputs written, in place: no request-sized copy), and the
// reference that keeps the region mapped while it does. `data` is null when
// the bytes must be copied instead (InPlace says when); it is a device
// address on `device` for a CUDA region's bytes (kHostMemory otherwise).
struct InPlaceBytes {
  std::shared_ptr<ShmRegion> region;
  char* data = nullptr;
  uint64_t size = 0;
  int device = kHostMemory;
  absl::string_view view() const { return absl::string_view(data, size); }
};

// Tensors in place start at a multiple of this: the widest element the
// backends read or write (FP32, and LSE), so no kernel sees a misaligned one.
inline constexpr uint64_t kInPlaceAlignment = 4;

// Which regions' bytes InPlace hands out where they lie.
enum class InPlaceKinds {
  kMapped,          // a system region's (host memory)
  kMappedOrDevice,  // and a CUDA region's (device memory: q, k, v, o, lse only)
  kDevice,          // a CUDA region's only (a system region's bytes are copied)
};

// `ref`'s bytes in `region` (acquired, so in bounds) in place when `kinds`
// takes the region's kind: a system region mapped here, the bytes aligned to
// kInPlaceAlignment; a CUDA region (a device address, any alignment: the
// CUDA backend copies a misaligned span within the device). Data null
// otherwise (those go through ShmRegion::Read and Write). Only q, k, v, o
// and lse may be device memory: the core reads the others on the host.
InPlaceBytes InPlace(std::shared_ptr<ShmRegion> region, const ShmRef& ref,
                     InPlaceKinds kinds = InPlaceKinds::kMapped);

// The first error of CheckIntact over the regions of `inputs` read in place
// (those with data): after compute, a region the client shrank meanwhile
// fails the call instead of answering from bytes that were not its own.
absl::Status CheckInPlaceIntact(absl::Span<const InPlaceBytes> inputs);

// Where a request's tensors come from.
struct InputSource {
  inference::ModelInferRequest* request = nullptr;
  const ShmRegistry* shm = nullptr;
  std::string tenant;
};

// raw_input_contents holds one entry per input whose data is neither in its
// typed `contents` nor in shared memory, in the order of `inputs` (as
// tritonclient sends them); INVALID_ARGUMENT when the counts differ.
absl::Status CheckRawInputCount(const inference::ModelInferRequest& request);

// The bytes of input `index` of `source.request`: a copy of its shared-memory
// bytes, its fp32_contents (FP32) or int_contents (INT32) packed
// little-endian, or its raw_input_contents entry (moved out, not copied).
// With `in_place`, shared-memory bytes that can be read in place (InPlace
// with `kinds`) are not copied: *in_place holds them and the returned string
// is empty.
absl::StatusOr<std::string> TakeInputBytes(const InputSource& source, int index,
                                           InPlaceBytes* in_place = nullptr,
                                           InPlaceKinds kinds = InPlaceKinds::kMapped);

// The index in request.inputs of each of `names` (-1 for one not given);
// INVALID_ARGUMENT for an input of model `model` with another name, or one
// given twice.
absl::StatusOr<std::vector<int>> IndexInputs(const inference::ModelInferRequest& request,
                                             const std::string& model,
                                             absl::Span<const char* const> names);

// Input `index` as the core's tensor view: its FP16/BF16/FP32 datatype, its
// shape (the request's) and its bytes (TakeInputBytes: held in *storage, or
// where they lie when `in_place` takes them, as `kinds` says; a CUDA
// region's bytes then stay on their device, view.device). INVALID_ARGUMENT
// naming the input otherwise.
absl::StatusOr<TensorView> TakeFloatTensor(const InputSource& source, int index,
                                           std::string* storage, InPlaceBytes* in_place = nullptr,
                                           InPlaceKinds kinds = InPlaceKinds::kMapped);

// The int64 value of request parameter `name` given as int64, uint64, or a
// decimal string; `where` names it in errors.
absl::StatusOr<int64_t> IntParameter(const std::string& where, const inference::InferParameter& p);
// A uint64 parameter (ids) given as uint64, a non-negative int64, or a
// decimal string.
absl::StatusOr<uint64_t> Uint64Parameter(const std::string& where,
                                         const inference::InferParameter& p);
// A string parameter.
absl::StatusOr<std::string> StringParameter(const std::string& where,
                                            const inference::InferParameter& p);
// A float parameter given as double, int64, uint64 or a decimal string.
absl::StatusOr<double> DoubleParameter(const std::string& where,
                                       const inference::InferParameter& p);
// A bool parameter given as bool or "true"/"false".
absl::StatusOr<bool> BoolParameter(const std::string& where, const inference::InferParameter& p);

}  // namespace attnserve
