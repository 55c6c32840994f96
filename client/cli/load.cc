// `attnctl load`: a load generator for the Attention service. Closed loop
// (--concurrency: N callers, each sending its next request when the previous
// one returns) or open loop (--rate: Poisson arrivals at R req/s, latency
// measured from the scheduled arrival so a slow server cannot hide its queue),
// unary Forward or ForwardStream, over one or more channels. Each step (one
// concurrency or rate) runs a warm-up, then a measurement window, and reports
// throughput, latency percentiles, errors by status code and the server's own
// timing breakdown; --csv/--jsonl append one row per step, --check verifies
// every response against a float64 reference computed once per input.
// --rpc=echo sends the same requests to Echo instead (the server validates and
// returns q's bytes without compute): the transport ceiling Forward's numbers
// are compared with.
//
// This file only runs the steps. The parts: load_flags (flags -> LoadConfig),
// load_workload (requests, references, a response -> Completion),
// load_recorder (the per-step tally), load_loops (closed and open loops),
// load_progress (the stderr line), load_report (table, CSV, JSON Lines).
// A decode-loop mode (K/V sequences: per-layer append-and-attend steps,
// docs/design.md §6) plugs in as its own workload and loop files that report
// Completions to the same Recorder, chosen by a LoadConfig field in RunStep
// below, leaving the Forward workload, both loops and the report untouched.
#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cli/command.h"
#include "client/cli/common.h"
#include "client/cli/load_flags.h"
#include "client/cli/load_loops.h"
#include "client/cli/load_progress.h"
#include "client/cli/load_recorder.h"
#include "client/cli/load_report.h"
#include "client/cli/load_workload.h"

namespace attnserve {
namespace cli {
namespace {

constexpr char kCmd[] = "load";

void PrintPreamble(const LoadConfig& config, const Workload& w, const AttentionClient& client,
                   absl::Duration build_time) {
  const std::string calls =
      config.protocol.v2 ? absl::StrCat("unary ModelInfer, protocol ", config.protocol.ToString())
      : config.echo      ? "unary Echo (no compute), protocol native"
      : config.stream    ? "ForwardStream, protocol native"
                         : "unary Forward, protocol native";
  std::cout << "load:     " << w.summary.ToString() << ", " << w.options << ", seed " << config.seed
            << ", " << w.requests.size() << " inputs\n"
            << "          " << calls << ", " << client.num_channels() << " channel(s), warmup "
            << absl::FormatDuration(config.warmup) << ", measure "
            << absl::FormatDuration(config.duration) << ", check " << (config.check ? "on" : "off")
            << " (inputs" << (config.check ? " and references" : "") << " built in "
            << Fixed(absl::ToDoubleSeconds(build_time), 2) << " s)\n"
            << "          per request: " << w.tokens_per_request << " query tokens, "
            << (config.echo ? "no compute (TFLOP/s reported as 0)"
                            : absl::StrCat(Fixed(w.flops_per_request / 1e9, 3), " GFLOP"))
            << "\n";
}

// Runs step `r` (its mode and level set) and fills in its measurements.
void RunStep(AttentionClient& client, V2Client* v2, const Workload& w, const LoadConfig& config,
             StepResult* r) {
  const absl::Time start = absl::Now();
  const absl::Time window_start = start + config.warmup;
  const absl::Time stop = window_start + config.duration;
  Recorder rec(window_start, stop, w.tokens_per_request, w.flops_per_request);
  {
    Progress progress(StepLabel(*r), rec, start, window_start, stop);
    if (r->mode == "closed") {
      RunClosedLoop(client, v2, w, config, r->concurrency, stop, rec);
    } else {
      RunOpenLoop(client, v2, w, config, r->rate, stop, rec);
    }
  }
  rec.Summarize(r);
}

}  // namespace

int RunLoad(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError(kCmd, "load takes no arguments, got '" + args[0] + "'");
  absl::StatusOr<LoadConfig> config = LoadConfigFromFlags();
  if (!config.ok()) return UsageError(kCmd, config.status().message());

  const absl::Time build_start = absl::Now();
  absl::StatusOr<Workload> w = BuildWorkload(*config);
  if (!w.ok()) return UsageError(kCmd, w.status().message());

  absl::StatusOr<std::unique_ptr<AttentionClient>> client = MakeClientFromFlags(config->channels);
  if (!client.ok()) return UsageError(kCmd, client.status().message());
  if (!config->wait_for_ready) {
    (*client)->Connect(std::min(config->timeout, absl::Seconds(10))).IgnoreError();
  }
  // --protocol=v2: one shared-memory slot per caller of the largest step.
  std::unique_ptr<V2Client> v2;
  if (config->protocol.v2) {
    const int slots = config->concurrency.empty() ? 0
                                                  : *std::max_element(config->concurrency.begin(),
                                                                      config->concurrency.end());
    absl::StatusOr<std::unique_ptr<V2Client>> made =
        V2Client::Create(client->get(), config->protocol.shm, slots,
                         V2SlotBytes(w->requests.front()), config->protocol.shm_prefix);
    if (!made.ok()) return PrintError("--protocol=v2", made.status());
    v2 = *std::move(made);
  }
  PrintPreamble(*config, *w, **client, absl::Now() - build_start);
  PrintHeader();

  bool check_failed = false;
  bool all_failed = true;
  const bool closed = config->rates.empty();
  const size_t steps = closed ? config->concurrency.size() : config->rates.size();
  for (size_t i = 0; i < steps; ++i) {
    StepResult r;
    r.mode = closed ? "closed" : "open";
    if (closed) {
      r.concurrency = config->concurrency[i];
    } else {
      r.rate = config->rates[i];
    }
    RunStep(**client, v2.get(), *w, *config, &r);
    PrintRow(r);
    // A --check run is a correctness run: any error fails it.
    check_failed |= config->check && r.errors > 0;
    all_failed &= r.requests == r.errors;
    if (!config->csv.empty()) {
      const absl::Status st = AppendCsv(config->csv, r, *w, *config);
      if (!st.ok()) return PrintError("--csv", st);
    }
    if (!config->jsonl.empty()) {
      const absl::Status st = AppendJson(config->jsonl, r, *w, *config);
      if (!st.ok()) return PrintError("--jsonl", st);
    }
  }
  if (check_failed) {
    std::cout << "FAIL: --check run with errors (see errors by code above)\n";
    return kExitFailure;
  }
  if (all_failed) {
    std::cout << "FAIL: no request succeeded\n";
    return kExitFailure;
  }
  return kExitOk;
}

}  // namespace cli
}  // namespace attnserve
