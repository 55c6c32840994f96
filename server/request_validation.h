// Every check of a ForwardRequest before any work is done, and FillParams,
// which turns a valid request into the AttnParams a backend runs. Errors name
// the wire field, the expected value and the actual one (docs/design.md §2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "backend/make_params.h"
#include "backend/params.h"

namespace attnserve {

// The server's configured limits (ServerOptions); over them is RESOURCE_EXHAUSTED.
struct RequestLimits {
  int64_t max_request_bytes = int64_t{1} << 30;  // the serialised ForwardRequest
  int64_t max_tokens = int64_t{1} << 22;         // B*Sq + B*Sk (dense) or Tq + Tk (varlen)
};

// request_id is echoed in every response and logged (cut to kMaxLoggedIdChars):
// longer is INVALID_ARGUMENT for Forward, ForwardStream, Echo and the K/V
// AppendAttend calls alike.
inline constexpr size_t kMaxRequestIdBytes = 1024;

// Head dims the contract accepts (docs/design.md §2); a backend may support fewer
// and says so through CanImplement (UNIMPLEMENTED).
inline constexpr int kMinHeadDim = 8;
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kHeadDimMultiple = 8;

// q, k and v bytes that lie outside the request's messages, in memory the
// caller lends the request (the KServe v2 front-end's shared-memory regions,
// read in place): a view whose data() is set stands for that tensor's `data`,
// which is then empty; a default view means the tensor's own `data`. They are
// validated and counted against max_request_bytes like bytes in the message.
struct LentInputs {
  absl::string_view q, k, v;
};

// OK, INVALID_ARGUMENT for a request that breaks the contract, or
// RESOURCE_EXHAUSTED for one over `limits`.
absl::Status ValidateForwardRequest(const v1::ForwardRequest& request, const RequestLimits& limits,
                                    const LentInputs& lent = {});

// Params for a request that passed ValidateForwardRequest, through
// MakeAttnParams (defaults and normalisation): input pointers into `request`
// or `lent` (which must outlive the params), o and lse null (the caller binds
// outputs).
AttnParams FillParams(const v1::ForwardRequest& request, const LentInputs& lent = {});

// The wire options as MakeAttnParams takes them (which normalises them), for
// FillParams and the K/V front-end (kv_request.cc), whose calls carry the same
// options.
AttnOptions OptionsFromWire(const v1::AttentionOptions& options);
// The options' checks of ValidateForwardRequest (INVALID_ARGUMENT naming
// options.<field>), including the softmax_scale/softcap ranges of
// backend/score_range.h, and q/k/v_descale (set only for FP8_E4M3 `dtype`,
// a v1::DType value, and then finite in (0, kMaxDescale]); `head_dim` is the
// validated D (the default scale depends on it).
absl::Status ValidateOptions(const v1::AttentionOptions& options, int64_t head_dim, int dtype);
// request_id: at most kMaxRequestIdBytes (INVALID_ARGUMENT naming it).
absl::Status ValidateRequestId(const std::string& id);
// A tensor's dtype is known, its dims are in range and its data has exactly
// prod(shape) * sizeof(dtype) bytes; errors name `name`.<field>.
absl::Status ValidateTensorBytes(const char* name, const v1::Tensor& tensor);

// ValidateForwardRequest, then FillParams.
absl::StatusOr<AttnParams> ValidateAndFillParams(const v1::ForwardRequest& request,
                                                 const RequestLimits& limits,
                                                 const LentInputs& lent = {});

// Elements of LSE (Hq per query row) for filled params.
int64_t LseElements(const AttnParams& params);

// Bytes of LSE (FP32 elements) for filled params.
int64_t LseBytes(const AttnParams& params);

// Makes `lse` the LSE tensor Forward returns for `request` (filled `params`):
// FP32, dense [B, Hq, Sq] or varlen [Hq, Tq], its data sized (zero-filled)
// unless `with_data` is false (LSE written elsewhere: data left empty).
void ShapeLseTensor(const v1::ForwardRequest& request, const AttnParams& params, v1::Tensor* lse,
                    bool with_data = true);

}  // namespace attnserve
