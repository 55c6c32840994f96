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
#include <grpcpp/client_context.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "client/cli/attention_flags.h"
#include "client/cli/command.h"
#include "client/cli/common.h"
#include "client/inputs.h"
#include "client/verify.h"

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
          "Check every response against the float64 reference of its input (DESIGN.md's "
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

constexpr char kCmd[] = "load";
constexpr char kCheckFailed[] = "CHECK_FAILED";
constexpr char kClientBacklog[] = "CLIENT_BACKLOG";

// The fixed set of requests a run cycles through, with what one request is
// worth (all inputs share one shape, so one number each).
struct Workload {
  std::vector<v1::ForwardRequest> requests;
  std::vector<ForwardVerifier> verifiers;  // one per request with --check
  InputsSummary summary;
  std::string options;
  int64_t tokens_per_request = 0;  // query tokens: B*Sq or Tq
  double flops_per_request = 0.0;  // 0 for Echo: it computes nothing
  bool echo = false;               // --rpc=echo: send to Echo instead of Forward
};

// DESIGN.md §5: 4*B*Hq*Sq*Sk*D, halved for causal with Sq = Sk; per sequence
// for varlen.
double FlopsOf(const AttentionInputs& in, const InputsSummary& s) {
  const double per_pair = 4.0 * s.heads_q * s.head_dim;
  auto seq = [&](int64_t sq, int64_t sk) {
    return per_pair * sq * sk * (in.options.causal && sq == sk ? 0.5 : 1.0);
  };
  if (!s.varlen) return s.batch * seq(s.seqlen_q, s.seqlen_k);
  double flops = 0.0;
  for (size_t b = 0; b + 1 < in.cu_seqlens_q.size(); ++b) {
    flops += seq(in.cu_seqlens_q[b + 1] - in.cu_seqlens_q[b],
                 in.cu_seqlens_k[b + 1] - in.cu_seqlens_k[b]);
  }
  return flops;
}

// One step's results, as reported and written to CSV/JSON.
struct StepResult {
  std::string mode;  // "closed" or "open"
  int concurrency = 0;
  double rate = 0.0;
  double seconds = 0.0;
  int64_t requests = 0;  // completed in the window, failed or not
  int64_t errors = 0;
  std::map<std::string, int64_t> errors_by_code;
  double req_per_s = 0.0, tokens_per_s = 0.0, tflops = 0.0;
  double p50_ms = 0, p90_ms = 0, p95_ms = 0, p99_ms = 0, max_ms = 0, mean_ms = 0;
  // Means over successful responses of the server's timing, in ms.
  double queue_ms = 0, h2d_ms = 0, compute_ms = 0, d2h_ms = 0;
  double mean_batch_size = 0;  // requests per backend launch, as the server reports
  // Successful responses by the device that ran them (ServerTiming.device).
  std::map<int, int64_t> requests_by_device;
  std::string first_error;
};

// Collects completions from many threads. Only those ending inside the
// measurement window count; everything counts toward the progress line.
class Recorder {
 public:
  Recorder(const Workload& w, absl::Time window_start, absl::Time window_end)
      : w_(w), window_start_(window_start), window_end_(window_end) {}

  // `response` is consumed when set (decoded for --check).
  void Record(int input, absl::Time sent, absl::Status status, v1::ForwardResponse* response) {
    const absl::Time done = absl::Now();
    if (status.ok() && response->error_code() != 0) {
      status = absl::Status(static_cast<absl::StatusCode>(response->error_code()),
                            response->error_message());
    }
    std::string code = status.ok() ? "" : absl::StatusCodeToString(status.code());
    std::string failure = status.ok() ? "" : absl::StrCat(code, ": ", status.message());
    if (status.ok() && !w_.verifiers.empty()) {
      failure = CheckResponse(input, response);
      if (!failure.empty()) {
        code = kCheckFailed;
        failure = absl::StrCat(kCheckFailed, ": ", failure);
      }
    }
    completed_.fetch_add(1, std::memory_order_relaxed);
    if (!code.empty()) failed_.fetch_add(1, std::memory_order_relaxed);
    if (done < window_start_ || done > window_end_) return;
    absl::MutexLock lock(&mu_);
    if (!code.empty()) {
      ++errors_by_code_[code];
      if (first_failure_.empty() && !failure.empty()) first_failure_ = failure;
      return;
    }
    latencies_ms_.push_back(absl::ToDoubleMilliseconds(done - sent));
    const v1::ServerTiming& t = response->timing();
    queue_us_ += t.queue_us();
    h2d_us_ += t.host_to_device_us();
    compute_us_ += t.compute_us();
    d2h_us_ += t.device_to_host_us();
    batch_size_sum_ += std::max(1, t.batch_size());
    ++requests_by_device_[t.device()];
  }

  // An arrival the client could not send (open loop, too many in flight).
  void RecordDropped() {
    completed_.fetch_add(1, std::memory_order_relaxed);
    failed_.fetch_add(1, std::memory_order_relaxed);
    const absl::Time now = absl::Now();
    if (now < window_start_ || now > window_end_) return;
    absl::MutexLock lock(&mu_);
    ++errors_by_code_[kClientBacklog];
  }

  int64_t completed() const { return completed_.load(std::memory_order_relaxed); }
  int64_t failed() const { return failed_.load(std::memory_order_relaxed); }

  void Summarize(StepResult* r) {
    absl::MutexLock lock(&mu_);
    r->seconds = absl::ToDoubleSeconds(window_end_ - window_start_);
    const int64_t ok = static_cast<int64_t>(latencies_ms_.size());
    for (const auto& [code, n] : errors_by_code_) r->errors += n;
    r->errors_by_code = errors_by_code_;
    r->first_error = first_failure_;
    r->requests_by_device = requests_by_device_;
    r->requests = ok + r->errors;
    r->req_per_s = ok / r->seconds;
    r->tokens_per_s = r->req_per_s * w_.tokens_per_request;
    r->tflops = r->req_per_s * w_.flops_per_request / 1e12;
    if (ok == 0) return;
    std::sort(latencies_ms_.begin(), latencies_ms_.end());
    // Nearest rank: the smallest latency with at least q of the samples at or
    // below it.
    auto pct = [&](double q) {
      const int64_t rank = static_cast<int64_t>(std::ceil(q * ok));
      return latencies_ms_[std::clamp<int64_t>(rank - 1, 0, ok - 1)];
    };
    r->p50_ms = pct(0.50);
    r->p90_ms = pct(0.90);
    r->p95_ms = pct(0.95);
    r->p99_ms = pct(0.99);
    r->max_ms = latencies_ms_.back();
    double sum = 0;
    for (double l : latencies_ms_) sum += l;
    r->mean_ms = sum / ok;
    r->queue_ms = queue_us_ / 1e3 / ok;
    r->h2d_ms = h2d_us_ / 1e3 / ok;
    r->compute_ms = compute_us_ / 1e3 / ok;
    r->d2h_ms = d2h_us_ / 1e3 / ok;
    r->mean_batch_size = static_cast<double>(batch_size_sum_) / ok;
  }

 private:
  // "" when the response matches its reference, else why not.
  std::string CheckResponse(int input, v1::ForwardResponse* response) {
    // The timing is needed after the tensors are moved out.
    v1::ForwardResponse decoded;
    *decoded.mutable_timing() = response->timing();
    absl::StatusOr<ForwardResult> result = ForwardResultFromProto(std::move(*response));
    *response = std::move(decoded);
    if (!result.ok()) return std::string(result.status().message());
    absl::StatusOr<VerifyReport> report = w_.verifiers[input].Check(*result);
    if (!report.ok()) return std::string(report.status().message());
    return report->passed ? "" : report->failure;
  }

  const Workload& w_;
  const absl::Time window_start_, window_end_;
  std::atomic<int64_t> completed_{0}, failed_{0};
  absl::Mutex mu_;
  std::vector<double> latencies_ms_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> errors_by_code_ ABSL_GUARDED_BY(mu_);
  std::string first_failure_ ABSL_GUARDED_BY(mu_);  // "CODE: message"
  int64_t queue_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t h2d_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t compute_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t d2h_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t batch_size_sum_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int64_t> requests_by_device_ ABSL_GUARDED_BY(mu_);
};

// Deadline of a stream that must outlive the step by one call's timeout.
void SetStreamDeadline(grpc::ClientContext* ctx, absl::Time stop) {
  const absl::Duration timeout = absl::GetFlag(FLAGS_timeout);
  if (timeout != absl::InfiniteDuration()) ctx->set_deadline(absl::ToChronoTime(stop + timeout));
  if (absl::GetFlag(FLAGS_wait_for_ready)) ctx->set_wait_for_ready(true);
}

// Closed loop: `callers` threads, each with at most one request in flight.
void RunClosedLoop(AttentionClient& client, const Workload& w, int callers, bool stream,
                   absl::Time stop, Recorder& rec) {
  const int n = static_cast<int>(w.requests.size());
  std::vector<std::thread> threads;
  for (int c = 0; c < callers; ++c) {
    threads.emplace_back([&, c] {
      int input = c % n;
      if (!stream) {
        while (absl::Now() < stop) {
          const absl::Time sent = absl::Now();
          absl::StatusOr<v1::ForwardResponse> r =
              w.echo ? client.Echo(w.requests[input]) : client.Forward(w.requests[input]);
          rec.Record(input, sent, r.status(), r.ok() ? &*r : nullptr);
          input = (input + 1) % n;
        }
        return;
      }
      auto stub = v1::Attention::NewStub(client.channel(c % client.num_channels()));
      grpc::ClientContext ctx;
      SetStreamDeadline(&ctx, stop);
      auto rw = stub->ForwardStream(&ctx);
      v1::ForwardResponse response;
      while (absl::Now() < stop) {
        const absl::Time sent = absl::Now();
        if (!rw->Write(w.requests[input]) || !rw->Read(&response)) break;
        rec.Record(input, sent, absl::OkStatus(), &response);
        input = (input + 1) % n;
      }
      rw->WritesDone();
      while (rw->Read(&response)) {
      }
      const grpc::Status st = rw->Finish();
      // A stream that broke takes the request in flight with it.
      if (!st.ok()) rec.Record(input, absl::Now(), ToAbslStatus(st), nullptr);
    });
  }
  for (std::thread& t : threads) t.join();
}

// One ForwardStream of the open loop: a writer side shared by the dispatcher
// (under write_mu) and a reader thread that matches responses by request_id.
struct OpenStream {
  grpc::ClientContext ctx;
  std::unique_ptr<v1::Attention::Stub> stub;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ForwardRequest, v1::ForwardResponse>> rw;
  // This stream's own copies, because request_id is set before each write.
  std::vector<v1::ForwardRequest> requests;
  absl::Mutex mu;
  std::map<std::string, std::pair<int, absl::Time>> pending ABSL_GUARDED_BY(mu);
  std::thread reader;
};

// Open loop: Poisson arrivals at `rate` req/s until `stop`, then waits for
// the requests in flight.
void RunOpenLoop(AttentionClient& client, const Workload& w, double rate, bool stream,
                 absl::Time stop, Recorder& rec) {
  const int n = static_cast<int>(w.requests.size());
  const int max_outstanding = absl::GetFlag(FLAGS_max_outstanding);
  std::atomic<int> outstanding{0};
  std::vector<std::unique_ptr<OpenStream>> streams;
  if (stream) {
    for (int i = 0; i < client.num_channels(); ++i) {
      auto s = std::make_unique<OpenStream>();
      s->stub = v1::Attention::NewStub(client.channel(i));
      SetStreamDeadline(&s->ctx, stop);
      s->rw = s->stub->ForwardStream(&s->ctx);
      s->requests = w.requests;
      s->reader = std::thread([&rec, &outstanding, s = s.get()] {
        v1::ForwardResponse response;
        while (s->rw->Read(&response)) {
          std::pair<int, absl::Time> sent;
          {
            absl::MutexLock lock(&s->mu);
            auto it = s->pending.find(response.request_id());
            if (it == s->pending.end()) continue;
            sent = it->second;
            s->pending.erase(it);
          }
          rec.Record(sent.first, sent.second, absl::OkStatus(), &response);
          outstanding.fetch_sub(1);
        }
      });
      streams.push_back(std::move(s));
    }
  }
  std::mt19937_64 rng(std::random_device{}());
  std::exponential_distribution<double> gap(rate);
  absl::Time next = absl::Now();
  for (int64_t i = 0;; ++i) {
    next += absl::Seconds(gap(rng));
    if (next >= stop) break;
    absl::SleepFor(next - absl::Now());
    if (outstanding.load() >= max_outstanding) {
      rec.RecordDropped();
      continue;
    }
    const int input = static_cast<int>(i % n);
    outstanding.fetch_add(1);
    if (!stream) {
      auto done = [&rec, &outstanding, input, sent = next](absl::StatusOr<v1::ForwardResponse> r) {
        rec.Record(input, sent, r.status(), r.ok() ? &*r : nullptr);
        outstanding.fetch_sub(1);
      };
      if (w.echo) {
        client.EchoAsync(w.requests[input], CallOptions(), std::move(done));
      } else {
        client.ForwardAsync(w.requests[input], CallOptions(), std::move(done));
      }
      continue;
    }
    OpenStream& s = *streams[i % streams.size()];
    const std::string id = absl::StrCat(i);
    absl::MutexLock lock(&s.mu);
    s.pending[id] = {input, next};
    s.requests[input].set_request_id(id);
    s.rw->Write(s.requests[input]);
  }
  // Requests in flight get one call timeout to finish.
  const absl::Time give_up = absl::Now() + std::min(absl::GetFlag(FLAGS_timeout), absl::Hours(1));
  while (outstanding.load() > 0 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  for (auto& s : streams) {
    s->rw->WritesDone();
    s->reader.join();
    const grpc::Status st = s->rw->Finish();
    absl::MutexLock lock(&s->mu);
    for (const auto& [id, sent] : s->pending) {
      rec.Record(sent.first, sent.second,
                 st.ok() ? absl::DeadlineExceededError("no response on the stream")
                         : ToAbslStatus(st),
                 nullptr);
      outstanding.fetch_sub(1);
    }
  }
  // Unary calls still in flight hold references to `rec` and `outstanding`.
  while (outstanding.load() > 0) absl::SleepFor(absl::Milliseconds(5));
}

std::string Fixed(double x, int digits) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << x;
  return os.str();
}

std::string StepLabel(const StepResult& r) {
  return r.mode == "closed" ? absl::StrCat("concurrency=", r.concurrency)
                            : absl::StrCat("rate=", r.rate);
}

std::string ErrorsString(const StepResult& r) {
  std::vector<std::string> parts;
  for (const auto& [code, n] : r.errors_by_code) parts.push_back(absl::StrCat(code, ":", n));
  return absl::StrJoin(parts, ";");
}

// "0:510;1:498": successful requests per device.
std::string DevicesString(const StepResult& r) {
  std::vector<std::string> parts;
  for (const auto& [device, n] : r.requests_by_device) parts.push_back(absl::StrCat(device, ":", n));
  return absl::StrJoin(parts, ";");
}

void PrintHeader() {
  std::cout << std::left << std::setw(18) << "step" << std::right << std::setw(10) << "req/s"
            << std::setw(12) << "tokens/s" << std::setw(9) << "TFLOP/s" << std::setw(9) << "p50"
            << std::setw(9) << "p90" << std::setw(9) << "p95" << std::setw(9) << "p99"
            << std::setw(9) << "max" << std::setw(9) << "queue" << std::setw(9) << "h2d"
            << std::setw(9) << "compute" << std::setw(9) << "d2h" << std::setw(7) << "batch"
            << std::setw(8) << "errors"
            << "\n"
            << std::string(48, ' ') << "latency ms (client)" << std::string(17, ' ')
            << "server ms (mean)\n";
}

void PrintRow(const StepResult& r) {
  std::cout << std::left << std::setw(18) << StepLabel(r) << std::right << std::setw(10)
            << Fixed(r.req_per_s, 1) << std::setw(12) << Fixed(r.tokens_per_s, 0) << std::setw(9)
            << Fixed(r.tflops, 4) << std::setw(9) << Fixed(r.p50_ms, 2) << std::setw(9)
            << Fixed(r.p90_ms, 2) << std::setw(9) << Fixed(r.p95_ms, 2) << std::setw(9)
            << Fixed(r.p99_ms, 2) << std::setw(9) << Fixed(r.max_ms, 2) << std::setw(9)
            << Fixed(r.queue_ms, 2) << std::setw(9) << Fixed(r.h2d_ms, 2) << std::setw(9)
            << Fixed(r.compute_ms, 2) << std::setw(9) << Fixed(r.d2h_ms, 2) << std::setw(7)
            << Fixed(r.mean_batch_size, 1) << std::setw(8) << r.errors << "\n";
  if (r.errors > 0) std::cout << "  errors by code: " << ErrorsString(r) << "\n";
  if (r.requests_by_device.size() > 1) {
    std::cout << "  requests by device: " << DevicesString(r) << "\n";
  }
  if (!r.first_error.empty()) {
    std::cout << "  first error: " << r.first_error << "\n";
  }
  std::cout << std::flush;
}

// The columns shared by the CSV header, CSV rows and JSON objects, in order.
// Values are numbers except where `quoted`.
struct Field {
  std::string name;
  std::string value;
  bool quoted;
};

std::vector<Field> Fields(const StepResult& r, const Workload& w) {
  const InputsSummary& s = w.summary;
  auto num = [](double x) { return absl::StrCat(x); };
  return {{"label", absl::GetFlag(FLAGS_label), true},
          {"mode", r.mode, true},
          {"concurrency", absl::StrCat(r.concurrency), false},
          {"rate", num(r.rate), false},
          {"channels", absl::StrCat(absl::GetFlag(FLAGS_channels)), false},
          {"stream", absl::GetFlag(FLAGS_stream) ? "true" : "false", false},
          {"layout", s.varlen ? "varlen" : "dense", true},
          {"dtype", std::string(DTypeName(s.dtype)), true},
          {"batch", absl::StrCat(s.batch), false},
          {"seqlen_q", absl::StrCat(s.seqlen_q), false},
          {"seqlen_k", absl::StrCat(s.seqlen_k), false},
          {"heads_q", absl::StrCat(s.heads_q), false},
          {"heads_kv", absl::StrCat(s.heads_kv), false},
          {"head_dim", absl::StrCat(s.head_dim), false},
          {"options", w.options, true},
          {"seconds", num(r.seconds), false},
          {"requests", absl::StrCat(r.requests), false},
          {"errors", absl::StrCat(r.errors), false},
          {"errors_by_code", ErrorsString(r), true},
          {"req_per_s", num(r.req_per_s), false},
          {"tokens_per_s", num(r.tokens_per_s), false},
          {"tflops", num(r.tflops), false},
          {"p50_ms", num(r.p50_ms), false},
          {"p90_ms", num(r.p90_ms), false},
          {"p95_ms", num(r.p95_ms), false},
          {"p99_ms", num(r.p99_ms), false},
          {"max_ms", num(r.max_ms), false},
          {"mean_ms", num(r.mean_ms), false},
          {"queue_ms", num(r.queue_ms), false},
          {"host_to_device_ms", num(r.h2d_ms), false},
          {"compute_ms", num(r.compute_ms), false},
          {"device_to_host_ms", num(r.d2h_ms), false},
          {"mean_batch_size", num(r.mean_batch_size), false},
          {"requests_by_device", DevicesString(r), true},
          {"check", absl::GetFlag(FLAGS_check) ? "true" : "false", false}};
}

// `text` as a JSON string literal: quotes and backslashes escaped, control
// characters dropped.
std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

// `text` as one quoted CSV cell; a '"' in free text (--label) becomes '\''.
std::string Quoted(std::string text) {
  std::replace(text.begin(), text.end(), '"', '\'');
  return absl::StrCat("\"", text, "\"");
}

absl::Status AppendCsv(const std::string& path, const std::vector<Field>& fields) {
  bool is_new = true;
  {
    std::ifstream in(path);
    is_new = !in.good() || in.peek() == std::ifstream::traits_type::eof();
  }
  std::ofstream out(path, std::ios::app);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  std::vector<std::string> names, values;
  for (const Field& f : fields) {
    names.push_back(f.name);
    values.push_back(f.quoted ? Quoted(f.value) : f.value);
  }
  if (is_new) out << absl::StrJoin(names, ",") << "\n";
  out << absl::StrJoin(values, ",") << "\n";
  return out ? absl::OkStatus() : absl::UnavailableError(absl::StrCat("cannot write ", path));
}

absl::Status AppendJson(const std::string& path, const std::vector<Field>& fields,
                        const StepResult& r) {
  std::ofstream out(path, std::ios::app);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  std::vector<std::string> members;
  for (const Field& f : fields) {
    if (f.name == "errors_by_code") continue;  // an object below instead
    members.push_back(
        absl::StrCat("\"", f.name, "\":", f.quoted ? JsonString(f.value) : f.value));
  }
  std::vector<std::string> codes;
  for (const auto& [code, n] : r.errors_by_code) {
    codes.push_back(absl::StrCat("\"", code, "\":", n));
  }
  members.push_back(absl::StrCat("\"errors_by_code\":{", absl::StrJoin(codes, ","), "}"));
  out << "{" << absl::StrJoin(members, ",") << "}\n";
  return out ? absl::OkStatus() : absl::UnavailableError(absl::StrCat("cannot write ", path));
}

// Prints a live line to stderr once a second until `done`: on a terminal it
// rewrites itself, otherwise one line per second.
class Progress {
 public:
  Progress(const std::string& label, const Recorder& rec, absl::Time start, absl::Time window_start,
           absl::Time stop)
      : thread_([=, &rec] { Loop(label, rec, start, window_start, stop); }) {}
  ~Progress() {
    done_.Notify();
    thread_.join();
  }

 private:
  void Loop(const std::string& label, const Recorder& rec, absl::Time start,
            absl::Time window_start, absl::Time stop) {
    const bool tty = isatty(2);
    int64_t last = 0;
    while (!done_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
      const absl::Time now = absl::Now();
      const int64_t completed = rec.completed();
      const std::string phase =
          absl::StrCat(now < window_start ? "warmup " : "measure ",
                       Fixed(absl::ToDoubleSeconds(now - start), 0), "/",
                       Fixed(absl::ToDoubleSeconds(stop - start), 0), "s");
      std::cerr << (tty ? "\r" : "") << "[" << label << " " << phase << "] " << completed
                << " done, " << completed - last << " req/s, " << rec.failed() << " errors"
                << (tty ? "   " : "\n") << std::flush;
      last = completed;
    }
    if (tty) std::cerr << "\r" << std::string(72, ' ') << "\r" << std::flush;
  }

  absl::Notification done_;
  std::thread thread_;
};

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

absl::StatusOr<Workload> BuildWorkload(DType dtype, uint64_t seed, int count, bool check,
                                       bool echo) {
  Workload w;
  w.echo = echo;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<AttentionInputs> in = RandomInputsFromFlags(dtype, seed + i);
    if (!in.ok()) return in.status();
    absl::Status st = OptionsFromFlags(&in->options);
    if (!st.ok()) return st;
    if (i == 0) {
      absl::StatusOr<InputsSummary> s = SummarizeInputs(*in);
      if (!s.ok()) return s.status();
      w.summary = *s;
      w.options = OptionsString(in->options);
      w.tokens_per_request = s->total_q;
      w.flops_per_request = echo ? 0.0 : FlopsOf(*in, *s);
    }
    if (check) {
      absl::StatusOr<ForwardVerifier> v = ForwardVerifier::Create(*in);
      if (!v.ok()) return v.status();
      w.verifiers.push_back(*std::move(v));
    }
    w.requests.push_back(MakeForwardRequest(*std::move(in)));
  }
  return w;
}

}  // namespace

int RunLoad(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError(kCmd, "load takes no arguments, got '" + args[0] + "'");
  if (FlagWasSet("concurrency") && FlagWasSet("rate")) {
    return UsageError(kCmd,
                      "--concurrency (closed loop) and --rate (open loop) exclude each other");
  }
  std::vector<int> levels;
  std::vector<double> rates;
  if (!absl::GetFlag(FLAGS_rate).empty()) {
    absl::StatusOr<std::vector<double>> r = ParseRates(absl::GetFlag(FLAGS_rate));
    if (!r.ok()) return UsageError(kCmd, r.status().message());
    rates = *r;
  } else {
    const std::string text = absl::GetFlag(FLAGS_concurrency);
    absl::StatusOr<std::vector<int>> c = ParseLengthList("concurrency", text.empty() ? "1" : text);
    if (!c.ok()) return UsageError(kCmd, c.status().message());
    for (int v : *c) {
      if (v < 1) {
        return UsageError(kCmd, absl::StrCat("--concurrency: each value must be >= 1, got ", v));
      }
    }
    levels = *c;
  }
  const absl::Duration warmup = absl::GetFlag(FLAGS_warmup);
  const absl::Duration duration = absl::GetFlag(FLAGS_duration);
  if (warmup < absl::ZeroDuration() || warmup == absl::InfiniteDuration()) {
    return UsageError(kCmd, "--warmup must be a finite duration >= 0, e.g. 2s");
  }
  if (duration <= absl::ZeroDuration() || duration == absl::InfiniteDuration()) {
    return UsageError(kCmd, "--duration must be a finite duration > 0, e.g. 10s");
  }
  for (const auto& [flag, value, min] :
       {std::tuple{"channels", absl::GetFlag(FLAGS_channels), 1},
        std::tuple{"inputs", absl::GetFlag(FLAGS_inputs), 1},
        std::tuple{"max_outstanding", absl::GetFlag(FLAGS_max_outstanding), 1}}) {
    if (value < min) {
      return UsageError(kCmd, absl::StrCat("--", flag, " must be >= ", min, ", got ", value));
    }
  }
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return UsageError(kCmd, absl::StrCat("--dtype: ", dtype.status().message()));
  const uint64_t seed = absl::GetFlag(FLAGS_seed).value_or(std::random_device()());
  const bool check = absl::GetFlag(FLAGS_check);
  const bool stream = absl::GetFlag(FLAGS_stream);
  const std::string rpc = absl::GetFlag(FLAGS_rpc);
  if (rpc != "forward" && rpc != "echo") {
    return UsageError(kCmd, absl::StrCat("--rpc: expected forward or echo, got '", rpc, "'"));
  }
  const bool echo = rpc == "echo";
  if (echo && check) {
    return UsageError(kCmd,
                      "--check does not apply to --rpc=echo: Echo returns q's bytes, not "
                      "attention, so there is nothing to verify");
  }
  if (echo && stream) {
    return UsageError(kCmd,
                      "--stream does not apply to --rpc=echo: Echo is unary only (there is no "
                      "streaming echo)");
  }

  const absl::Time build_start = absl::Now();
  absl::StatusOr<Workload> w =
      BuildWorkload(*dtype, seed, absl::GetFlag(FLAGS_inputs), check, echo);
  if (!w.ok()) return UsageError(kCmd, w.status().message());

  absl::StatusOr<std::unique_ptr<AttentionClient>> client =
      MakeClientFromFlags(absl::GetFlag(FLAGS_channels));
  if (!client.ok()) return UsageError(kCmd, client.status().message());
  if (!absl::GetFlag(FLAGS_wait_for_ready)) {
    (*client)->Connect(std::min(absl::GetFlag(FLAGS_timeout), absl::Seconds(10))).IgnoreError();
  }

  const char* calls = echo ? "unary Echo (no compute)" : stream ? "ForwardStream" : "unary Forward";
  std::cout << "load:     " << w->summary.ToString() << ", " << w->options << ", seed " << seed
            << ", " << w->requests.size() << " inputs\n"
            << "          " << calls << ", "
            << (*client)->num_channels() << " channel(s), warmup " << absl::FormatDuration(warmup)
            << ", measure " << absl::FormatDuration(duration) << ", check "
            << (check ? "on" : "off") << " (inputs"
            << (check ? " and references" : "") << " built in "
            << Fixed(absl::ToDoubleSeconds(absl::Now() - build_start), 2) << " s)\n"
            << "          per request: " << w->tokens_per_request << " query tokens, "
            << (echo ? "no compute (TFLOP/s reported as 0)"
                     : absl::StrCat(Fixed(w->flops_per_request / 1e9, 3), " GFLOP"))
            << "\n";
  PrintHeader();

  bool check_failed = false;
  bool all_failed = true;
  const size_t steps = rates.empty() ? levels.size() : rates.size();
  for (size_t i = 0; i < steps; ++i) {
    StepResult r;
    r.mode = rates.empty() ? "closed" : "open";
    if (rates.empty()) {
      r.concurrency = levels[i];
    } else {
      r.rate = rates[i];
    }
    const absl::Time start = absl::Now();
    const absl::Time window_start = start + warmup;
    const absl::Time stop = window_start + duration;
    Recorder rec(*w, window_start, stop);
    {
      Progress progress(StepLabel(r), rec, start, window_start, stop);
      if (rates.empty()) {
        RunClosedLoop(**client, *w, r.concurrency, stream, stop, rec);
      } else {
        RunOpenLoop(**client, *w, r.rate, stream, stop, rec);
      }
    }
    rec.Summarize(&r);
    PrintRow(r);
    // A --check run is a correctness run: any error fails it.
    check_failed |= check && r.errors > 0;
    all_failed &= r.requests == r.errors;
    const std::vector<Field> fields = Fields(r, *w);
    if (const std::string path = absl::GetFlag(FLAGS_csv); !path.empty()) {
      const absl::Status st = AppendCsv(path, fields);
      if (!st.ok()) return PrintError("--csv", st);
    }
    if (const std::string path = absl::GetFlag(FLAGS_jsonl); !path.empty()) {
      const absl::Status st = AppendJson(path, fields, r);
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
