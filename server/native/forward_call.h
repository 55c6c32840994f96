// attnserve.v1 Forward messages as the core's AttentionCall and back: views
// into the request (nothing copied), a sink that has the backend write O and
// LSE straight into the response's buffers, and the response's common parts.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "attnserve/v1/attention.pb.h"
#include "server/core/call.h"
#include "server/executor.h"

namespace attnserve {

TensorView ViewOf(const v1::Tensor& tensor);
StatedOptions OptionsOf(const v1::AttentionOptions& options);
// Views of the options' score modifiers and masks (fields 10..14), each
// present when set.
ScoreModsView ModsOf(const v1::AttentionOptions& options);

// The call for `request` (which must outlive it) with `meta`'s tenant,
// deadline and cancellation; its sink writes into `response`.
AttentionCall ForwardCallOf(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                            CallMeta meta);

// Sets what every answer carries (request_id, backend, timing) and drops
// partial outputs of a failed call.
void FinishForwardResponse(const v1::ForwardRequest& request, const absl::Status& status,
                           const WorkTimings& timings, const std::string& backend,
                           v1::ForwardResponse* response);

// The executor's WorkTimings as the wire's ServerTiming.
void FillServerTiming(const WorkTimings& timings, v1::ServerTiming* out);

// Makes `out` an FP32 tensor of `shape`, its data `bytes` zero bytes (or
// none when the bytes are written elsewhere).
void ShapeFloatTensor(const std::vector<int64_t>& shape, int64_t bytes, v1::Tensor* out);

}  // namespace attnserve
