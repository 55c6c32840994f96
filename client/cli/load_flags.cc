// The flags of `attnctl load` (closed/open loop, timing, channels, outputs)
// and their checks into a LoadConfig. The attention-call flags it shares with
// forward (shape, --dtype, --seed, options) are in attention_flags.cc.
#include "client/cli/load_flags.h"

#include <cmath>
#include <random>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cli/attention_flags.h"
#include "client/cli/common.h"
#include "client/host_tensor.h"

ABSL_FLAG(std::string, concurrency, "",
          "Closed loop: comma-separated numbers of concurrent callers, one step each (e.g. "
          "1,4,16). Default 1 when --rate is not given.");
ABSL_FLAG(std::string, rate, "",
          "Open loop: comma-separated request rates in req/s, one step each; arrivals are "
          "Poisson and latency counts from the scheduled arrival. Excludes --concurrency.");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(2),
          "Warm-up before each step's measurement window; its requests are not reported.");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(10),
          "Measurement window of each step: requests completing inside it are reported.");
ABSL_FLAG(int, channels, 1,
          "gRPC channels (separate HTTP/2 connections); callers and streams rotate over them.");
ABSL_FLAG(std::string, rpc, "forward",
          "forward: attention calls. echo: the Echo RPC, which validates like Forward and returns "
          "q's bytes without compute (the transport ceiling; unary only, no --check, TFLOP/s 0).");
ABSL_FLAG(bool, stream, false,
          "Use ForwardStream (one stream per caller, or per channel in open loop) instead of "
          "unary Forward.");
ABSL_FLAG(int, inputs, 4,
          "Distinct random inputs (seeds --seed, --seed+1, ...) sent in turn; each is built, and "
          "with --check its reference computed, once before the run.");
ABSL_FLAG(bool, check, false,
          "Check every response against the float64 reference of its input (docs/design.md's "
          "tolerance); a mismatch counts as an error CHECK_FAILED. With --check any error makes "
          "the exit code 1.");
ABSL_FLAG(int, max_outstanding, 1024,
          "Open loop: most requests in flight; an arrival beyond it is not sent and counts as an "
          "error CLIENT_BACKLOG (the server is slower than --rate).");
ABSL_FLAG(std::string, csv, "",
          "Append one row per step to this CSV file (header written when the file is new).");
ABSL_FLAG(std::string, label, "",
          "Free text written as the `label` column of --csv/--jsonl rows (e.g. batching=off), so "
          "runs against differently configured servers can share one file and one plot.");
ABSL_FLAG(std::string, jsonl, "",
          "Append one JSON object per step to this file (JSON Lines: one object a line).");

namespace attnserve {
namespace cli {
namespace {

absl::StatusOr<std::vector<double>> ParseRates(const std::string& text) {
  std::vector<double> rates;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    double r = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(item), &r) || !(r > 0) || !std::isfinite(r)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rate: '", item, "' is not a positive number of requests per second (e.g. 10,50,100)"));
    }
    rates.push_back(r);
  }
  return rates;
}

absl::StatusOr<std::vector<int>> ParseConcurrency(const std::string& text) {
  absl::StatusOr<std::vector<int>> c = ParseLengthList("concurrency", text.empty() ? "1" : text);
  if (!c.ok()) return c.status();
  for (int v : *c) {
    if (v < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--concurrency: each value must be >= 1, got ", v));
    }
  }
  return c;
}

}  // namespace

absl::StatusOr<LoadConfig> LoadConfigFromFlags() {
  if (FlagWasSet("concurrency") && FlagWasSet("rate")) {
    return absl::InvalidArgumentError(
        "--concurrency (closed loop) and --rate (open loop) exclude each other");
  }
  LoadConfig c;
  if (!absl::GetFlag(FLAGS_rate).empty()) {
    absl::StatusOr<std::vector<double>> r = ParseRates(absl::GetFlag(FLAGS_rate));
    if (!r.ok()) return r.status();
    c.rates = *std::move(r);
  } else {
    absl::StatusOr<std::vector<int>> n = ParseConcurrency(absl::GetFlag(FLAGS_concurrency));
    if (!n.ok()) return n.status();
    c.concurrency = *std::move(n);
  }
  c.warmup = absl::GetFlag(FLAGS_warmup);
  c.duration = absl::GetFlag(FLAGS_duration);
  if (c.warmup < absl::ZeroDuration() || c.warmup == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("--warmup must be a finite duration >= 0, e.g. 2s");
  }
  if (c.duration <= absl::ZeroDuration() || c.duration == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("--duration must be a finite duration > 0, e.g. 10s");
  }
  c.channels = absl::GetFlag(FLAGS_channels);
  c.inputs = absl::GetFlag(FLAGS_inputs);
  c.max_outstanding = absl::GetFlag(FLAGS_max_outstanding);
  for (const auto& [flag, value] :
       {std::tuple{"channels", c.channels}, std::tuple{"inputs", c.inputs},
        std::tuple{"max_outstanding", c.max_outstanding}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be >= 1, got ", value));
    }
  }
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--dtype: ", dtype.status().message()));
  }
  c.dtype = *dtype;
  c.seed = absl::GetFlag(FLAGS_seed).value_or(std::random_device()());
  c.check = absl::GetFlag(FLAGS_check);
  c.stream = absl::GetFlag(FLAGS_stream);
  const std::string rpc = absl::GetFlag(FLAGS_rpc);
  if (rpc != "forward" && rpc != "echo") {
    return absl::InvalidArgumentError(
        absl::StrCat("--rpc: expected forward or echo, got '", rpc, "'"));
  }
  c.echo = rpc == "echo";
  if (c.echo && c.check) {
    return absl::InvalidArgumentError(
        "--check does not apply to --rpc=echo: Echo returns q's bytes, not attention, so there "
        "is nothing to verify");
  }
  if (c.echo && c.stream) {
    return absl::InvalidArgumentError(
        "--stream does not apply to --rpc=echo: Echo is unary only (there is no streaming echo)");
  }
  absl::StatusOr<ProtocolChoice> protocol = ProtocolFromFlags();
  if (!protocol.ok()) return protocol.status();
  c.protocol = *protocol;
  if (!c.protocol.v2 && c.protocol.shm != ShmMode::kNone) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shm=", ShmModeName(c.protocol.shm),
                     " in load needs --protocol=v2 (native shared memory is in forward and "
                     "load-kv)"));
  }
  if (c.protocol.v2 && (c.echo || c.stream)) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.echo ? "--rpc=echo" : "--stream",
        " does not apply to --protocol=v2: the load test sends unary ModelInfer calls"));
  }
  if (c.protocol.shm != V2Shm::kNone && !c.rates.empty()) {
    return absl::InvalidArgumentError(
        "--shm needs the closed loop (--concurrency): each caller owns one region, and the "
        "open loop has no bound on the calls in flight but --max_outstanding");
  }
  c.csv = absl::GetFlag(FLAGS_csv);
  c.jsonl = absl::GetFlag(FLAGS_jsonl);
  c.label = absl::GetFlag(FLAGS_label);
  c.timeout = absl::GetFlag(FLAGS_timeout);
  c.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  return c;
}

}  // namespace cli
}  // namespace attnserve
