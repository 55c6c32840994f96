// Request parameters that every attention model of the KServe v2 front-end
// reads alike: the attention options (causal, window_left, window_right,
// softcap, softmax_scale, return_lse, batch_invariant: the core's
// StatedOptions) and
// the parameters the protocol and Triton's clients send for themselves.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "inference/grpc_service.pb.h"
#include "server/core/call.h"

namespace attnserve {

// The option names, for error messages.
inline constexpr char kAttentionOptionNames[] =
    "causal, window_left, window_right, softcap, softmax_scale, return_lse, batch_invariant";

// Parameters the protocol and Triton's clients define for themselves (Triton
// reserves the "triton_" prefix; perf_analyzer sends
// triton_enable_empty_final_response); they do not change the result.
bool IsProtocolParameter(const std::string& name);

// Applies parameter `name` to `options` when it is an attention option (true),
// or leaves them alone (false). INVALID_ARGUMENT naming parameters['name'] for
// a value of the wrong type or range.
absl::StatusOr<bool> ApplyAttentionOption(const std::string& name,
                                          const inference::InferParameter& p,
                                          StatedOptions* options);

}  // namespace attnserve
