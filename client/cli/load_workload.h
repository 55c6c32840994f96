// What `attnctl load` sends: a fixed set of Forward (or Echo) requests, built
// once before the run, with what one request is worth (tokens, FLOPs) and,
// with --check, the float64 reference each response is held to.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/cli/load_flags.h"
#include "client/cli/load_recorder.h"
#include "client/inputs.h"
#include "client/v2_client.h"
#include "client/verify.h"

namespace attnserve {
namespace cli {

// The requests a run cycles through. All inputs share one shape, so what a
// request is worth is one number each.
struct Workload {
  std::vector<v1::ForwardRequest> requests;
  // --protocol=v2 without shared memory: `requests` converted once
  // (ToModelInferRequest), so a call costs the same client work as Forward's.
  std::vector<inference::ModelInferRequest> v2_requests;
  std::vector<ForwardVerifier> verifiers;  // one per request with --check
  InputsSummary summary;
  std::string options;
  int64_t tokens_per_request = 0;  // query tokens: B*Sq or Tq
  double flops_per_request = 0.0;  // 0 for Echo: it computes nothing
  bool echo = false;               // --rpc=echo: send to Echo instead of Forward
};

// config.inputs random inputs of the attention flags' shape (seeds
// config.seed, config.seed + 1, ...) with their references when config.check.
// INVALID_ARGUMENT naming the flag for a bad shape or option.
absl::StatusOr<Workload> BuildWorkload(const LoadConfig& config);

// docs/design.md §5: 4*B*Hq*Sq*Sk*D, halved for causal with Sq = Sk; per
// sequence for varlen.
double FlopsOf(const AttentionInputs& in, const InputsSummary& s);

// One Forward/Echo call's end as the Recorder takes it: `status` is the
// transport's, a response's own error_code (streams) overrides it, and with
// --check a response that does not match input `input`'s reference becomes
// CHECK_FAILED. `response` (null when the call failed) is consumed.
Completion ForwardCompletion(const Workload& w, int input, absl::Time sent, absl::Status status,
                             v1::ForwardResponse* response);

}  // namespace cli
}  // namespace attnserve
