// Forward and AppendAttend calls whose tensors lie in shared-memory regions
// (Tensor.shm, output_shm): the inputs as views of their spans, the outputs
// bound to theirs. A call without shared memory passes through unchanged.
#pragma once

#include <optional>

#include "absl/status/status.h"
#include "attnserve/v1/attention.pb.h"
#include "attnserve/v1/kv.pb.h"
#include "server/core/call.h"
#include "server/core/kv_runner.h"
#include "server/native/shm_tensors.h"

namespace attnserve {

// q, k, v (read `how`) and options.bias (on the host) of `request` into
// `call`, whose views ForwardCallOf made.
absl::Status ForwardShmInputs(const v1::ForwardRequest& request, ShmRead how, ShmCall* shm,
                              AttentionCall* call);

// With output_shm: `call`'s sink writes o (and lse) into their spans, in
// place (the backend writes there), and `response` carries their dtype,
// shape and span without data. The spans' byte_size is checked against the
// outputs when the sink runs, before compute: a call refused then writes
// nothing. `call` and `response` must outlive the sink.
absl::Status BindForwardShmOutputs(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                                   ShmCall* shm, AttentionCall* call);

// AppendAttend's q, k and v (read where they lie: the caller has the pool
// check the regions before the append commits, so a shrink during the call
// appends nothing) and k_scale, v_scale (copied) into `call`.
absl::Status KvShmInputs(const v1::AppendAttendRequest& request, ShmCall* shm, KvCall* call);

// The output spans of an AppendAttend, checked before it runs: o's and lse's
// byte_size against the sizes q's shape gives (a span too small must fail
// before the append).
struct KvShmOutputs {
  std::optional<ShmOutput> o, lse;
};
absl::StatusOr<KvShmOutputs> KvShmOutputSpans(const v1::AppendAttendRequest& request, ShmCall* shm);

// Where the launch may write o in place: a mapped (host) o span; nothing for
// a CUDA region's (the pool's outputs are host memory) or without one.
KvOutputPlace KvShmOutputPlace(const KvShmOutputs& outputs);

// Moves o (and lse) of a successful call's `response` (FillAppendAttendResponse's)
// into their spans (o only names its span when `o_in_place`: the launch wrote
// it there); the response then carries only their dtype, shape and span.
// FAILED_PRECONDITION naming the region when it is no longer intact.
absl::Status DeliverKvShm(const KvShmOutputs& outputs, bool o_in_place,
                          v1::AppendAttendResponse* response);

}  // namespace attnserve
