// The soak test's traffic (scripts/soak.sh): closed-loop workers
// send a mix of calls to a running server for --duration, and one K/V worker
// runs whole cache lifetimes, until the time is up. The mix, per Forward worker
// call:
//   valid      46%  every option (dtypes, GQA, causal, windows, softcap,
//                   scale, varlen, LSE); every --check_every-th answer is
//                   checked against the float64 reference (client/verify.h)
//   invalid    16%  malformed requests: must be refused with INVALID_ARGUMENT
//   cancelled  16%  a larger request cancelled 0-3 ms after it was sent
//   deadline    8%  a larger request with a 1-3 ms deadline (expires in the queue)
//   stream      7%  ForwardStream opened, a few requests written, abandoned
//                   unread, then cancelled
//   echo        7%  Echo (validation without compute)
// (the K/V worker's calls, about a seventh of all, dilute these shares; the
// summary prints the measured ones).
// K/V worker: create a cache, two sequences, prefill, decode steps at two
// layers, a fork, truncate, free, drop (one cache in ten, the first among
// them, is left for --kv_idle_timeout to expire); every output checked
// against the reference.
// Prints one summary line per outcome and "soak_load: ..." totals; exits 1
// on a wrong answer, an invalid request accepted, or a status no call of its
// kind may end with (INTERNAL, UNKNOWN, UNAVAILABLE, ...).
// --mode=peak sends only valid requests (the throughput reference).
// --hostile_streams=N: beside the mix, N ForwardStreams are kept open that
// write ~1 MiB requests and never read (each replaced by a fresh one every
// 5 s, so what they hold is steady), and Forward calls carrying two
// `authorization` headers; the server must back-pressure the streams (their
// writes block) and answer the rest with a status of their kind.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/attention_client.h"
#include "client/inputs.h"
#include "client/kv_client.h"
#include "client/verify.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(60), "How long to send traffic");
ABSL_FLAG(int, workers, 4, "Closed-loop Forward workers");
ABSL_FLAG(int, kv_workers, 1, "K/V cache-lifetime workers");
ABSL_FLAG(int, check_every, 4, "Check every N-th valid answer against the reference");
ABSL_FLAG(std::string, mode, "mixed", "mixed (the soak) or peak (valid requests only)");
ABSL_FLAG(int, hostile_streams, 0,
          "Never-reading ForwardStreams kept open beside the mix (0: none)");

namespace attnserve {
namespace {

enum Kind {
  kValid,
  kInvalid,
  kCancelled,
  kDeadline,
  kStream,
  kEcho,
  kKv,
  kNeverReading,
  kDuplicateAuth,
  kNumKinds
};
const char* const kKindNames[] = {"valid", "invalid", "cancelled",     "deadline",      "stream",
                                  "echo",  "kv",      "never_reading", "duplicate_auth"};

// Outcome counts per kind and status code, and the failures that fail the run.
class Tally {
 public:
  void Add(Kind kind, absl::StatusCode code) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[{kind, code}];
  }
  void Bad(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (bad_.size() < 20) bad_.push_back(what);
    ++num_bad_;
  }
  void Checked() { checked_.fetch_add(1, std::memory_order_relaxed); }
  int Print(absl::Duration elapsed) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t total = 0, valid_ok = 0;
    std::map<Kind, int64_t> per_kind;
    for (const auto& [key, n] : counts_) {
      std::printf("soak_load outcome kind=%s status=%s count=%lld\n", kKindNames[key.first],
                  absl::StatusCodeToString(key.second).c_str(), static_cast<long long>(n));
      total += n;
      per_kind[key.first] += n;
      if (key.first == kValid && key.second == absl::StatusCode::kOk) valid_ok = n;
    }
    const double s = absl::ToDoubleSeconds(elapsed);
    for (const auto& [kind, n] : per_kind) {
      std::printf("soak_load share kind=%s calls=%lld fraction=%.3f\n", kKindNames[kind],
                  static_cast<long long>(n), total > 0 ? double(n) / double(total) : 0.0);
    }
    for (const std::string& b : bad_) std::printf("soak_load FAILURE %s\n", b.c_str());
    std::printf(
        "soak_load: %lld calls in %.1f s (%.1f/s), %lld valid OK (%.1f/s), %lld answers "
        "checked against the reference, %lld failures\n",
        static_cast<long long>(total), s, double(total) / s, static_cast<long long>(valid_ok),
        double(valid_ok) / s, static_cast<long long>(checked_.load()),
        static_cast<long long>(num_bad_));
    return num_bad_ == 0 ? 0 : 1;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<Kind, absl::StatusCode>, int64_t> counts_;
  std::vector<std::string> bad_;
  int64_t num_bad_ = 0;
  std::atomic<int64_t> checked_{0};
};

// A valid call prepared once: its wire request and its reference.
struct Prepared {
  std::string name;
  AttentionInputs inputs;
  v1::ForwardRequest request;
  std::shared_ptr<ForwardVerifier> verifier;
};

std::vector<Prepared> ValidCases() {
  struct Case {
    const char* name;
    AttentionShape shape;
    void (*options)(ForwardOptions*);
  };
  const auto dense = DenseAttentionShape;
  AttentionShape varlen = dense(DType::kBF16, 1, 0, 0, 4, 2, 64);
  varlen.seqlens_q = {17, 1, 40};
  varlen.seqlens_k = {33, 70, 40};
  const std::vector<Case> cases = {
      {"fp16_plain", dense(DType::kFP16, 2, 64, 64, 4, 4, 64), [](ForwardOptions*) {}},
      {"bf16_gqa_causal_lse", dense(DType::kBF16, 1, 96, 96, 8, 2, 64),
       [](ForwardOptions* o) {
         o->causal = true;
         o->return_lse = true;
       }},
      {"fp32_window", dense(DType::kFP32, 1, 48, 80, 2, 1, 32),
       [](ForwardOptions* o) {
         o->window_left = 16;
         o->window_right = 4;
       }},
      {"fp16_softcap_scale", dense(DType::kFP16, 1, 40, 120, 4, 2, 128),
       [](ForwardOptions* o) {
         o->softcap = 30.0f;
         o->softmax_scale = 0.07f;
       }},
      {"bf16_decode", dense(DType::kBF16, 4, 1, 200, 8, 1, 64),
       [](ForwardOptions* o) { o->return_lse = true; }},
      {"bf16_varlen_causal", varlen,
       [](ForwardOptions* o) {
         o->causal = true;
         o->return_lse = true;
       }},
  };
  std::vector<Prepared> out;
  uint64_t seed = 1;
  for (const Case& c : cases) {
    absl::StatusOr<AttentionInputs> in = MakeRandomInputs(c.shape, seed++);
    if (!in.ok()) continue;
    c.options(&in->options);
    in->request_id = c.name;
    Prepared p;
    p.name = c.name;
    p.inputs = *in;
    p.request = MakeForwardRequest(*in);
    absl::StatusOr<ForwardVerifier> v = ForwardVerifier::Create(*in);
    if (!v.ok()) continue;
    p.verifier = std::make_shared<ForwardVerifier>(*std::move(v));
    out.push_back(std::move(p));
  }
  return out;
}

// Malformed requests, each refused with INVALID_ARGUMENT.
std::vector<v1::ForwardRequest> InvalidCases(const std::vector<Prepared>& valid) {
  std::vector<v1::ForwardRequest> out;
  v1::ForwardRequest r = valid[0].request;
  r.mutable_q()->set_shape(3, 12);  // head dim
  out.push_back(r);
  r = valid[0].request;
  r.mutable_k()->mutable_data()->resize(10);  // byte length
  out.push_back(r);
  r = valid[1].request;
  r.mutable_options()->set_softcap(3e38f);  // out of range
  out.push_back(r);
  r = valid[1].request;
  r.mutable_options()->set_softmax_scale(2e38f);
  out.push_back(r);
  r = valid[2].request;
  r.mutable_v()->set_dtype(v1::FP16);  // dtypes differ
  out.push_back(r);
  r = valid[2].request;
  r.set_request_id(std::string(5000, 'x'));  // over kMaxRequestIdBytes
  out.push_back(r);
  r = valid[5].request;
  r.set_cu_seqlens_k(1, 1000);  // past k's rows
  out.push_back(r);
  r = valid[0].request;
  r.mutable_options()->set_window_left(-3);
  out.push_back(r);
  return out;
}

class Soak {
 public:
  Soak(AttentionClient* client, absl::Time end, Tally* tally)
      : client_(client),
        kv_(*client),
        end_(end),
        tally_(tally),
        valid_(ValidCases()),
        invalid_(InvalidCases(valid_)) {
    // A larger request, so cancellation and deadlines meet it queued or running.
    big_ = MakeForwardRequest(
        *MakeRandomInputs(DenseAttentionShape(DType::kFP16, 2, 384, 384, 8, 8, 64), 99));
  }

  void ForwardWorker(uint64_t seed, bool peak) {
    std::mt19937_64 rng(seed);
    int64_t n = 0;
    while (absl::Now() < end_) {
      const int roll = int(rng() % 100);
      if (peak || roll < 46) {
        Valid(valid_[rng() % valid_.size()], ++n % absl::GetFlag(FLAGS_check_every) == 0);
      } else if (roll < 62) {
        Invalid(invalid_[rng() % invalid_.size()]);
      } else if (roll < 78) {
        Cancelled(absl::Microseconds(int64_t(rng() % 3000)));
      } else if (roll < 86) {
        Deadline(absl::Microseconds(1000 + int64_t(rng() % 2000)));
      } else if (roll < 93) {
        AbandonedStream(1 + int(rng() % 4));
      } else {
        const absl::StatusOr<v1::ForwardResponse> r =
            client_->Echo(valid_[rng() % valid_.size()].request);
        Expect(kEcho, r.status(), {absl::StatusCode::kOk});
      }
    }
  }

  // Keeps one never-reading stream open at a time (replaced every 5 s) and
  // sends a Forward with two `authorization` headers once a second.
  void HostileWorker(uint64_t seed) {
    std::mt19937_64 rng(seed);
    const v1::ForwardRequest big = MakeForwardRequest(
        *MakeRandomInputs(DenseAttentionShape(DType::kFP32, 1, 1024, 64, 4, 4, 64), seed));
    while (absl::Now() < end_) {
      NeverReadingStream(big, std::min(end_, absl::Now() + absl::Seconds(5)));
      DuplicateAuthorization(valid_[rng() % valid_.size()].request);
    }
  }

  void KvWorker(uint64_t seed) {
    std::mt19937_64 rng(seed);
    int loop = 0;
    while (absl::Now() < end_) KvLifetime(&rng, ++loop);
  }

 private:
  void Expect(Kind kind, const absl::Status& s, std::initializer_list<absl::StatusCode> allowed) {
    tally_->Add(kind, s.code());
    for (absl::StatusCode c : allowed) {
      if (s.code() == c) return;
    }
    tally_->Bad(absl::StrCat(kKindNames[kind], " call ended with ", s.ToString()));
  }

  void Valid(const Prepared& p, bool check) {
    absl::StatusOr<v1::ForwardResponse> r = client_->Forward(p.request);
    Expect(kValid, r.status(), {absl::StatusCode::kOk});
    if (!r.ok() || !check) return;
    Verify(p, *std::move(r));
  }

  void Verify(const Prepared& p, v1::ForwardResponse&& response) {
    absl::StatusOr<ForwardResult> result = ForwardResultFromProto(std::move(response));
    absl::StatusOr<VerifyReport> report =
        result.ok() ? p.verifier->Check(*result) : absl::StatusOr<VerifyReport>(result.status());
    tally_->Checked();
    if (!report.ok() || !report->passed) {
      tally_->Bad(absl::StrCat("wrong answer for ", p.name, ": ",
                               report.ok() ? report->failure : report.status().ToString()));
    }
  }

  void Invalid(const v1::ForwardRequest& request) {
    const absl::StatusOr<v1::ForwardResponse> r = client_->Forward(request);
    Expect(kInvalid, r.status(), {absl::StatusCode::kInvalidArgument});
  }

  // A raw callback-API call on the client's channel, so it can be cancelled.
  void Cancelled(absl::Duration after) {
    auto stub = v1::Attention::NewStub(client_->channel(0));
    grpc::ClientContext context;
    client_->Prepare(CallOptions(), &context);
    v1::ForwardResponse response;
    absl::Notification done;
    grpc::Status status;
    stub->async()->Forward(&context, &big_, &response, [&](grpc::Status s) {
      status = std::move(s);
      done.Notify();
    });
    done.WaitForNotificationWithTimeout(after);
    context.TryCancel();
    done.WaitForNotification();
    Expect(kCancelled, ToAbslStatus(status), {absl::StatusCode::kOk, absl::StatusCode::kCancelled});
  }

  void Deadline(absl::Duration timeout) {
    CallOptions call;
    call.timeout = timeout;
    const absl::StatusOr<v1::ForwardResponse> r = client_->Forward(big_, call);
    Expect(kDeadline, r.status(), {absl::StatusCode::kOk, absl::StatusCode::kDeadlineExceeded});
  }

  // Writes `n` requests, reads nothing, cancels: the server must let the
  // stream's held responses go.
  void AbandonedStream(int n) {
    auto stub = v1::Attention::NewStub(client_->channel(0));
    grpc::ClientContext context;
    auto stream = stub->ForwardStream(&context);
    bool wrote = true;
    for (int i = 0; i < n && wrote; ++i) {
      v1::ForwardRequest r = valid_[size_t(i) % valid_.size()].request;
      r.set_request_id(absl::StrCat("abandoned-", i));
      wrote = stream->Write(r);
    }
    context.TryCancel();
    const grpc::Status s = stream->Finish();
    Expect(kStream, ToAbslStatus(s), {absl::StatusCode::kCancelled, absl::StatusCode::kOk});
  }

  // Writes `request` until the server stops reading (the writer blocks on
  // flow control) and reads nothing; cancels at `until`. A write that fails
  // before the cancel means the server dropped the stream: allowed only as
  // RESOURCE_EXHAUSTED (a stream cap), reported by Finish.
  // On a connection of its own, as an attacker's would be: on one shared
  // with the valid traffic, gRPC's flow-control window (which its bandwidth
  // estimate widens as that traffic runs) let each new stream push more
  // before the server's pause stopped it, so what the stream held rose
  // through the run.
  void NeverReadingStream(const v1::ForwardRequest& request, absl::Time until) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // not the shared connection
    auto stub = v1::Attention::NewStub(grpc::CreateCustomChannel(
        absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext context;
    auto stream = stub->ForwardStream(&context);
    std::thread writer([&] {
      while (stream->Write(request)) {
      }
    });
    absl::SleepFor(std::max(absl::ZeroDuration(), until - absl::Now()));
    context.TryCancel();
    writer.join();
    const grpc::Status s = stream->Finish();
    Expect(kNeverReading, ToAbslStatus(s),
           {absl::StatusCode::kCancelled, absl::StatusCode::kResourceExhausted});
  }

  // Two `authorization` headers: refused as UNAUTHENTICATED when the server
  // checks tokens, served (OK) when it does not.
  void DuplicateAuthorization(const v1::ForwardRequest& request) {
    auto stub = v1::Attention::NewStub(client_->channel(0));
    grpc::ClientContext context;
    client_->Prepare(CallOptions(), &context);
    context.AddMetadata("authorization", "Bearer junk");
    context.AddMetadata("authorization", "Bearer junk-too");
    v1::ForwardResponse response;
    const grpc::Status s = stub->Forward(&context, request, &response);
    Expect(kDuplicateAuth, ToAbslStatus(s),
           {absl::StatusCode::kOk, absl::StatusCode::kUnauthenticated});
  }

  // ---- K/V ----
  static constexpr int kLayers = 2, kHq = 4, kHkv = 2, kD = 64;

  // One sequence's context at each layer ([len, Hkv, D] rows).
  struct Context {
    HostTensor k[kLayers], v[kLayers];
  };

  HostTensor Random(int64_t rows, int heads, std::mt19937_64* rng) {
    return RandomTensor(DType::kFP16, {rows, heads, kD}, rng);
  }

  // One call on one sequence: appends `new_rows`, asks `nq` queries, checks
  // the answer against the reference over the context after the append.
  bool Step(const std::string& cache, int layer, uint64_t id, Context* ctx, int new_rows, int nq,
            std::mt19937_64* rng) {
    AppendAttendInputs in;
    in.cache_id = cache;
    in.layer = layer;
    const int32_t len = int32_t(ctx->k[layer].dim(0));
    in.sequences = {{id, len, new_rows, nq}};
    in.q = Random(nq, kHq, rng);
    in.k = Random(new_rows, kHkv, rng);
    in.v = Random(new_rows, kHkv, rng);
    in.options.causal = true;
    absl::StatusOr<AppendAttendResult> r = kv_.AppendAttend(in);
    Expect(kKv, r.status(), {absl::StatusCode::kOk});
    if (!r.ok()) return false;
    ctx->k[layer] = *ConcatRows({ctx->k[layer], in.k}, DType::kFP16, {0, kHkv, kD});
    ctx->v[layer] = *ConcatRows({ctx->v[layer], in.v}, DType::kFP16, {0, kHkv, kD});
    const int64_t total = ctx->k[layer].dim(0);
    AttentionInputs ref;
    ref.q = *HostTensor::FromBytes(DType::kFP16, {1, nq, kHq, kD}, in.q.bytes());
    ref.k = *HostTensor::FromBytes(DType::kFP16, {1, total, kHkv, kD}, ctx->k[layer].bytes());
    ref.v = *HostTensor::FromBytes(DType::kFP16, {1, total, kHkv, kD}, ctx->v[layer].bytes());
    ref.options.causal = true;
    ForwardResult out;
    out.o = *HostTensor::FromBytes(DType::kFP16, {1, nq, kHq, kD}, r->o.bytes());
    absl::StatusOr<VerifyReport> report = VerifyForward(ref, out);
    tally_->Checked();
    if (!report.ok() || !report->passed) {
      tally_->Bad(absl::StrCat("wrong K/V answer (sequence ", id, ", layer ", layer, ", context ",
                               total,
                               "): ", report.ok() ? report->failure : report.status().ToString()));
      return false;
    }
    return true;
  }

  void KvLifetime(std::mt19937_64* rng, int loop) {
    CacheSpec spec;
    spec.geometry = {kLayers, kHkv, kD, DType::kFP16};
    spec.page_size = 16;
    spec.capacity_tokens = 512;
    absl::StatusOr<v1::CacheStats> cache = kv_.CreateCache(spec);
    Expect(kKv, cache.status(), {absl::StatusCode::kOk});
    if (!cache.ok()) return;
    const std::string id = cache->cache_id();
    Expect(kKv, kv_.CreateSequences(id, {{1}, {2}}).status(), {absl::StatusCode::kOk});
    std::map<uint64_t, Context> ctx;
    for (uint64_t s : {1, 2}) {
      for (int l = 0; l < kLayers; ++l) {
        ctx[s].k[l] = Random(0, kHkv, rng);
        ctx[s].v[l] = Random(0, kHkv, rng);
      }
    }
    bool ok = true;
    for (int l = 0; l < kLayers && ok; ++l) {
      for (uint64_t s : {1, 2}) ok = ok && Step(id, l, s, &ctx[s], 24 + int(s) * 5, 4, rng);
    }
    for (int t = 0; t < 6 && ok && absl::Now() < end_; ++t) {
      for (int l = 0; l < kLayers && ok; ++l) {
        for (uint64_t s : {1, 2}) ok = ok && Step(id, l, s, &ctx[s], 1, 1, rng);
      }
    }
    if (ok) {
      // A fork of sequence 1's first 20 tokens (a shared partial page), then
      // an append that must copy it before writing.
      Expect(kKv, kv_.CreateSequences(id, {{3, 1, 20}}).status(), {absl::StatusCode::kOk});
      for (int l = 0; l < kLayers; ++l) {
        ctx[3].k[l] = *ctx[1].k[l].SliceRows(0, 20);
        ctx[3].v[l] = *ctx[1].v[l].SliceRows(0, 20);
      }
      for (int l = 0; l < kLayers && ok; ++l) ok = Step(id, l, 3, &ctx[3], 3, 2, rng);
      Expect(kKv, kv_.Truncate(id, 1, 10, std::nullopt).status(), {absl::StatusCode::kOk});
      Expect(kKv, kv_.FreeSequences(id, {2}).status(), {absl::StatusCode::kOk});
    }
    // One cache in ten, the first among them, is left behind for the idle
    // timeout to remove: with scripts/soak.sh's timeout, the first expires
    // during the warm-up fifth.
    if (loop % 10 != 1) Expect(kKv, kv_.DropCache(id), {absl::StatusCode::kOk});
  }

  AttentionClient* const client_;
  KvClient kv_;
  const absl::Time end_;
  Tally* const tally_;
  const std::vector<Prepared> valid_;
  const std::vector<v1::ForwardRequest> invalid_;
  v1::ForwardRequest big_;
};

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  using namespace attnserve;
  absl::ParseCommandLine(argc, argv);
  ClientOptions options;
  options.num_channels = 2;
  options.default_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<AttentionClient>> client =
      AttentionClient::Create(absl::GetFlag(FLAGS_target), options);
  if (!client.ok()) {
    std::fprintf(stderr, "soak_load: %s\n", client.status().ToString().c_str());
    return 2;
  }
  const bool peak = absl::GetFlag(FLAGS_mode) == "peak";
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::GetFlag(FLAGS_duration);
  Tally tally;
  Soak soak(client->get(), end, &tally);
  std::vector<std::thread> threads;
  for (int i = 0; i < absl::GetFlag(FLAGS_workers); ++i) {
    threads.emplace_back([&, i] { soak.ForwardWorker(1000 + uint64_t(i), peak); });
  }
  for (int i = 0; i < (peak ? 0 : absl::GetFlag(FLAGS_kv_workers)); ++i) {
    threads.emplace_back([&, i] { soak.KvWorker(2000 + uint64_t(i)); });
  }
  for (int i = 0; i < (peak ? 0 : absl::GetFlag(FLAGS_hostile_streams)); ++i) {
    threads.emplace_back([&, i] { soak.HostileWorker(3000 + uint64_t(i)); });
  }
  for (std::thread& t : threads) t.join();
  return tally.Print(absl::Now() - start);
}
