// Every check of a ForwardRequest before any work is done, and FillParams,
// which turns a valid request into the AttnParams a backend runs. Errors name
// the wire field, the expected value and the actual one (DESIGN.md §2).
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "backend/params.h"

namespace attnserve {

// The server's configured limits (ServerOptions); over them is RESOURCE_EXHAUSTED.
struct RequestLimits {
  int64_t max_request_bytes = int64_t{1} << 30;  // the serialised ForwardRequest
  int64_t max_tokens = int64_t{1} << 22;         // B*Sq + B*Sk (dense) or Tq + Tk (varlen)
};

// request_id is echoed in every response and logged (cut to kMaxLoggedIdChars):
// longer is INVALID_ARGUMENT for Forward, ForwardStream and Echo alike.
inline constexpr size_t kMaxRequestIdBytes = 1024;

// Head dims the contract accepts (DESIGN.md §2); a backend may support fewer
// and says so through CanImplement (UNIMPLEMENTED).
inline constexpr int kMinHeadDim = 8;
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kHeadDimMultiple = 8;

// OK, INVALID_ARGUMENT for a request that breaks the contract, or
// RESOURCE_EXHAUSTED for one over `limits`.
absl::Status ValidateForwardRequest(const v1::ForwardRequest& request, const RequestLimits& limits);

// Params for a request that passed ValidateForwardRequest: sizes from the
// shapes, input pointers into `request` (which must outlive the params), o and
// lse null (the caller binds output buffers), softmax_scale defaulting to
// 1/sqrt(D), causal folded into window_right = 0, unset windows kNoWindow.
AttnParams FillParams(const v1::ForwardRequest& request);

// ValidateForwardRequest, then FillParams.
absl::StatusOr<AttnParams> ValidateAndFillParams(const v1::ForwardRequest& request,
                                                 const RequestLimits& limits);

// Elements of O (like Q) and of LSE (Hq per query row) for filled params.
int64_t OutputElements(const AttnParams& params);
int64_t LseElements(const AttnParams& params);

// Makes `lse` the LSE tensor Forward returns for `request` (filled `params`):
// FP32, dense [B, Hq, Sq] or varlen [Hq, Tq], its data sized (zero-filled).
void ShapeLseTensor(const v1::ForwardRequest& request, const AttnParams& params, v1::Tensor* lse);

}  // namespace attnserve
