// The two ways `attnctl load` drives a Workload for one step: a closed loop
// (N callers, each sending its next request when the last returns) and an
// open loop (Poisson arrivals, latency from the scheduled arrival), each over
// unary calls or ForwardStream. Both report every call to a Recorder.
#pragma once

#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/cli/load_flags.h"
#include "client/cli/load_recorder.h"
#include "client/cli/load_workload.h"
#include "client/v2_client.h"

namespace attnserve {
namespace cli {

// `callers` threads, each with at most one request in flight, until `stop`.
// With `v2` (--protocol=v2; null otherwise) the calls are its ModelInfer,
// caller c using shared-memory slot c.
void RunClosedLoop(AttentionClient& client, V2Client* v2, const Workload& w,
                   const LoadConfig& config, int callers, absl::Time stop, Recorder& rec);

// Poisson arrivals at `rate` req/s until `stop` (at most
// config.max_outstanding in flight), then waits for the requests in flight.
// With `v2`: its ModelInfer, tensors in the message.
void RunOpenLoop(AttentionClient& client, V2Client* v2, const Workload& w, const LoadConfig& config,
                 double rate, absl::Time stop, Recorder& rec);

}  // namespace cli
}  // namespace attnserve
