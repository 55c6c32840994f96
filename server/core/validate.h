// Every structural check of a call before any work is done, for every
// protocol: errors name the field through the front-end's FieldNames, with
// the expected value and the actual one (docs/design.md §2). The checks run
// cheapest first and stop at the first failure, so one message names one field.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "backend/make_params.h"
#include "backend/params.h"
#include "server/core/call.h"
#include "server/core/field_names.h"
#include "server/kv/kv_cache.h"

namespace attnserve {

// The server's configured limits (ServerOptions); over them is RESOURCE_EXHAUSTED.
struct RequestLimits {
  int64_t max_request_bytes = int64_t{1} << 30;  // a call's bytes (AttentionCall::request_bytes)
  int64_t max_tokens = int64_t{1} << 22;         // B*Sq + B*Sk (dense) or Tq + Tk (varlen)
};

// Ids are echoed in every answer and logged: longer is INVALID_ARGUMENT.
inline constexpr size_t kMaxRequestIdBytes = 1024;
// A log line keeps at most this many of an id's characters.
inline constexpr size_t kMaxLoggedIdChars = 128;

// Head dims the contract accepts (docs/design.md §2); a backend may support
// fewer and says so through CanImplement (UNIMPLEMENTED).
inline constexpr int kMinHeadDim = 8;
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kHeadDimMultiple = 8;

// OK and the params to run (input pointers into the call's views, o and lse
// null: the sink binds them), INVALID_ARGUMENT for a call that breaks the
// contract, or RESOURCE_EXHAUSTED for one over `limits`.
absl::StatusOr<AttnParams> ValidateAttentionCall(const AttentionCall& call,
                                                 const RequestLimits& limits,
                                                 const FieldNames& names);

// O's and LSE's sizes and shapes for a valid call's params.
OutputLayout OutputLayoutOf(const AttnParams& params, absl::Span<const int64_t> q_shape, bool dense,
                            bool return_lse);

// A K/V call against its cache's geometry: ids, layer, steps, the q/k/v rows
// the steps imply, and the options.
absl::Status ValidateKvCall(const KvCall& call, const KvGeometry& geometry,
                            const RequestLimits& limits, const FieldNames& names);

// The options' checks (named through `names.option`); `head_dim` is the
// validated D (the default scale depends on it), `dtype` the inputs'
// (descales are FP8-only).
absl::Status ValidateOptions(const StatedOptions& options, int64_t head_dim, int dtype,
                             const FieldNames& names);
// A tensor's dtype is known, its dims are in range and it has exactly
// prod(shape) * sizeof(dtype) bytes; errors name `name`.<field>.
absl::Status ValidateTensor(const char* name, const TensorView& tensor, const FieldNames& names);
// An id of at most kMaxRequestIdBytes.
absl::Status ValidateRequestId(absl::string_view id, const FieldNames& names);

// The stated options as MakeAttnParams takes them (which fills the defaults).
AttnOptions ToAttnOptions(const StatedOptions& options);

}  // namespace attnserve
