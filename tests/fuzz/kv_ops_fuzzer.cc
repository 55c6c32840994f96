// libFuzzer target: K/V-sequence operation sequences (create cache, create and
// fork sequences, append-and-attend, truncate, free, drop) in the order the
// input picks, through the server's own decoding (server/native/kv_messages.h,
// server/core/kv_runner.h) and the pool (server/kv/kv_pool.h) on a real executor and the CPU
// backend, checked after every operation against a model of what the pool should hold:
//   - each call succeeds exactly when the model says it may (a refusal must
//     have a reason the model sees: an unknown id, a wrong expected length, a
//     full cache, a malformed request), and a refused call changes nothing;
//   - every sequence's lengths, the sequence count and the pages in use agree
//     with the model (pages: at most the unshared count, at least the longest
//     sequence's);
//   - every append-and-attend output equals the float64 reference over the
//     context the model holds (client/verify.h's tolerance), so a wrong page,
//     a lost copy-on-write or a stale block table shows as a wrong answer;
//   - when everything is freed no page is in use, and when the cache is
//     dropped the device budget is whole again.
// The input is a byte program (FuzzedDataProvider); seeds: make_seeds.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnserve/v1/kv.pb.h"
#include "backend/backend_factory.h"
#include "backend/paged_kv.h"
#include "client/verify.h"
#include "common/dtype.h"
#include "server/core/kv_runner.h"
#include "server/executor.h"
#include "server/kv/kv_pool.h"
#include "server/native/field_names.h"
#include "server/native/kv_messages.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_check.h"

namespace attnserve {
namespace {

// Small limits keep each input fast and make "full" reachable. The budget is
// no multiple of a page, so a cache's capacity rarely fills whole slabs.
constexpr int64_t kBudgetBytes = 100000;
constexpr RequestLimits kLimits{int64_t{1} << 20, 96};
constexpr char kTenant[] = "fuzz";

struct Harness {
  explicit Harness(bool inline_calls)
      : backend(MakeCpuBackend(1)),
        executor(backend.get(), MakeExecutorOptions(inline_calls)),
        pool(KvPoolOptions{kBudgetBytes, 16, absl::ZeroDuration()},
             {KvDevice{backend.get(), &executor, 0}}),
        runner(&pool, "cpu", kLimits, nullptr) {
    spdlog::set_level(spdlog::level::off);
  }
  // `inline_calls`: every call that finds the executor idle runs on the
  // submitting thread (ExecutorOptions::inline_max_cost, the server's
  // --inline_max_cost), saving the hand-off to the launcher and back.
  static ExecutorOptions MakeExecutorOptions(bool inline_calls) {
    ExecutorOptions o;
    o.max_queue_size = 8;
    o.batching = true;  // calls of one cache and layer may share a launch
    o.batch_max_delay = absl::Microseconds(50);
    if (inline_calls) o.inline_max_cost = int64_t{1} << 40;
    return o;
  }
  std::unique_ptr<AttentionBackend> backend;
  Executor executor;
  KvPool pool;
  KvRunner runner;
};

[[noreturn]] void Fail(const std::string& what) { FuzzFail("kv_ops_fuzzer", what); }

// Tensor values: kPoolValues random multiples of 1/8 in [-2, 2] (exactly
// representable in every dtype), encoded once per dtype. One tensor has at
// most 3 steps x 40 rows of at most 4 heads of 16 (Program::Build).
constexpr int64_t kPoolValues = int64_t{1} << 16;
static_assert(kPoolValues >= 3 * 40 * 4 * 16, "a tensor must fit in the pool");
const std::string& ValuePool(DType t) {
  static const auto* pools = [] {
    auto* p = new std::map<DType, std::string>();
    for (DType d : {DType::kFP32, DType::kFP16, DType::kBF16}) {
      std::string bytes(size_t(kPoolValues * DTypeSize(d)), '\0');
      uint64_t state = 1;
      for (int64_t i = 0; i < kPoolValues; ++i) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        const float x = static_cast<float>(static_cast<int>((state >> 33) % 33) - 16) / 8.0f;
        StoreFromFloat(bytes.data(), d, i, x);
      }
      p->emplace(d, std::move(bytes));
    }
    return p;
  }();
  return pools->at(t);
}

// Fails with `what` unless `ok`; `what` (often a StrCat over the state) is
// built only on failure (built for every check, the messages cost more than
// several of the calls they check).
#define EXPECT_OR_FAIL(ok, what) \
  do {                           \
    if (!(ok)) Fail(what);       \
  } while (false)

int64_t PagesFor(int64_t tokens, int page_size) { return (tokens + page_size - 1) / page_size; }

// What the pool should hold: per sequence, per layer, the K and V rows
// ([len, Hkv, D] in the cache's dtype) appended so far.
struct ModelSeq {
  std::vector<std::string> k, v;
};

class Program {
 public:
  // `handoff` and `inline_calls`: the two harnesses (Harness's argument);
  // the input's seed picks one per program.
  Program(Harness* handoff, Harness* inline_calls, FuzzedDataProvider* in)
      : handoff_(handoff), inline_(inline_calls), h_(handoff), in_(in) {}

  void Run() {
    if (!CreateCache()) return;
    const int ops = in_->ConsumeIntegralInRange(1, 40);
    for (int i = 0; i < ops && in_->remaining_bytes() > 0; ++i) {
      switch (in_->ConsumeIntegralInRange(0, 6)) {
        case 0: CreateSequences(); break;
        case 1:
        case 2: Append(/*pipelined=*/false); break;
        case 3: Append(/*pipelined=*/true); break;
        case 4: Truncate(); break;
        case 5: Free(); break;
        case 6: Stats(); break;
      }
      CheckState();
    }
    // Free everything: no page may stay in use.
    std::vector<uint64_t> all;
    for (const auto& [id, seq] : model_) all.push_back(id);
    EXPECT_OR_FAIL(cache_->Free(all).ok(), "freeing every live sequence failed");
    model_.clear();
    EXPECT_OR_FAIL(cache_->Stats().pages_used == 0, "pages in use after every sequence was freed");
    EXPECT_OR_FAIL(h_->pool.DropCache(kTenant, cache_->id()).ok(),
                   "DropCache of a live cache failed");
    cache_.reset();
    // The executor thread may still hold the last call's closure (and with it
    // the cache) for a moment after its callback ran: wait for the evidence.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (h_->pool.Stats().devices[0].bytes_used != 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(100));
    }
    EXPECT_OR_FAIL(h_->pool.Stats().devices[0].bytes_used == 0,
                   "the device's K/V budget is not whole 10 s after the cache was dropped");
  }

 private:
  int Hkv() const { return geometry_.num_heads_kv; }
  int D() const { return geometry_.head_dim; }
  int64_t RowBytes(int heads) const { return int64_t{heads} * D() * DTypeSize(geometry_.dtype); }
  int32_t Len(const ModelSeq& s, int layer) const {
    return static_cast<int32_t>(s.k[size_t(layer)].size() / size_t(RowBytes(Hkv())));
  }
  // A slice of ValuePool at an offset the input's seed picks: rows differ
  // from call to call (so a wrong page or a stale table shows as a wrong
  // answer) at the cost of one copy; converting each element here instead
  // was most of the harness's own time.
  std::string Rows(int64_t rows, int heads) {
    const int64_t n = rows * heads * D();
    EXPECT_OR_FAIL(n <= kPoolValues, "a tensor larger than the value pool");
    seed_ = seed_ * 6364136223846793005ULL + 1442695040888963407ULL;
    const int64_t first = int64_t((seed_ >> 33) % uint64_t(kPoolValues - n + 1));
    const size_t width = size_t(DTypeSize(geometry_.dtype));
    return ValuePool(geometry_.dtype).substr(size_t(first) * width, size_t(n) * width);
  }
  uint64_t PickId() { return in_->ConsumeIntegralInRange<uint64_t>(0, 7); }

  bool CreateCache() {
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(in_->ConsumeIntegralInRange(1, 3));
    r.mutable_geometry()->set_num_heads_kv(in_->ConsumeIntegralInRange(1, 2));
    r.mutable_geometry()->set_head_dim(in_->PickValueInArray({8, 16}));
    r.mutable_geometry()->set_dtype(in_->PickValueInArray({v1::FP32, v1::FP16, v1::BF16}));
    r.set_page_size(in_->PickValueInArray({0, 16, 32}));
    if (in_->ConsumeBool()) {
      r.set_capacity_tokens(in_->ConsumeIntegralInRange<int64_t>(1, 600));
    } else {
      r.set_capacity_bytes(in_->ConsumeIntegralInRange<int64_t>(1, kBudgetBytes));
    }
    r.set_reserve(in_->ConsumeBool());
    heads_q_mult_ = in_->ConsumeIntegralInRange(1, 2);
    seed_ = in_->ConsumeIntegral<uint64_t>();
    // Both ways a call reaches the backend: handed to the executor's threads
    // (batching, the completer, two calls in flight queued behind each other)
    // or run on this thread when the executor is idle (--inline_max_cost).
    h_ = (seed_ & 1) != 0 ? inline_ : handoff_;
    absl::StatusOr<std::shared_ptr<KvCache>> cache =
        h_->pool.CreateCache(kTenant, DecodeCreateCache(r));
    if (!cache.ok()) {
      EXPECT_OR_FAIL(!cache.status().message().empty(), "CreateCache refused without a message");
      EXPECT_OR_FAIL(h_->pool.Stats().caches == 0, "a refused CreateCache left a cache");
      EXPECT_OR_FAIL(h_->pool.Stats().devices[0].bytes_used == 0,
                     "a refused CreateCache took budget");
      return false;
    }
    cache_ = *std::move(cache);
    geometry_ = cache_->geometry();
    page_size_ = cache_->page_size();
    capacity_ = cache_->Stats().capacity_pages;
    return true;
  }

  void CreateSequences() {
    v1::CreateSequencesRequest r;
    r.set_cache_id(cache_->id());
    const int n = in_->ConsumeIntegralInRange(0, 3);
    bool valid = true;
    std::set<uint64_t> fresh;
    for (int i = 0; i < n; ++i) {
      v1::SequenceSpec* s = r.add_sequences();
      s->set_sequence_id(PickId());
      valid = valid && model_.count(s->sequence_id()) == 0 && fresh.insert(s->sequence_id()).second;
      if (!in_->ConsumeBool()) continue;
      s->set_fork_from(PickId());
      auto src = model_.find(s->fork_from());  // sources exist before the call
      if (src == model_.end()) {
        valid = false;
        continue;
      }
      int32_t shortest = INT32_MAX, longest = 0;
      for (int l = 0; l < geometry_.num_layers; ++l) {
        shortest = std::min(shortest, Len(src->second, l));
        longest = std::max(longest, Len(src->second, l));
      }
      if (in_->ConsumeBool()) {
        s->set_fork_length(in_->ConsumeIntegralInRange(-1, longest + 1));
        valid = valid && s->fork_length() >= 0 && s->fork_length() <= shortest;
      } else {
        valid = valid && shortest == longest;
      }
    }
    const absl::Status status = cache_->CreateSequences(DecodeSequences(r));
    // A valid call may find the device's budget too small for the sequences'
    // bookkeeping (charged per sequence); that refusal took nothing.
    if (valid && status.code() == absl::StatusCode::kResourceExhausted &&
        h_->pool.Stats().devices[0].bytes_used + n * KvSequenceBytes(geometry_.num_layers) >
            kBudgetBytes) {
      return;
    }
    EXPECT_OR_FAIL(status.ok() == valid,
                   absl::StrCat("CreateSequences: the model expected ", valid ? "OK" : "a refusal",
                                ", got ", status.ToString()));
    if (!status.ok()) return;
    for (const v1::SequenceSpec& s : r.sequences()) {
      ModelSeq seq;
      seq.k.resize(size_t(geometry_.num_layers));
      seq.v.resize(size_t(geometry_.num_layers));
      if (s.has_fork_from()) {
        const ModelSeq& src = model_.at(s.fork_from());
        for (int l = 0; l < geometry_.num_layers; ++l) {
          const int32_t len = s.has_fork_length() ? s.fork_length() : Len(src, l);
          seq.k[size_t(l)] = src.k[size_t(l)].substr(0, size_t(len * RowBytes(Hkv())));
          seq.v[size_t(l)] = src.v[size_t(l)].substr(0, size_t(len * RowBytes(Hkv())));
        }
      }
      model_.emplace(s.sequence_id(), std::move(seq));
    }
  }

  // One request: 1..3 steps at one layer. `corrupt` picks one way to make it
  // malformed (0: none).
  struct Built {
    v1::AppendAttendRequest request;
    bool valid = true;         // what the model expects, corruption aside
    int64_t pages_needed = 0;  // upper bound (a copy-on-write counted)
  };
  Built Build(int layer, const std::map<uint64_t, int32_t>& lengths_before) {
    Built b;
    v1::AppendAttendRequest& r = b.request;
    r.set_cache_id(cache_->id());
    r.set_layer(layer);
    const int n = in_->ConsumeIntegralInRange(1, 3);
    int64_t tq = 0, tk = 0;
    std::set<uint64_t> ids;
    for (int i = 0; i < n; ++i) {
      v1::SequenceStep* s = r.add_sequences();
      s->set_sequence_id(PickId());
      auto known = lengths_before.find(s->sequence_id());
      const int32_t len = known == lengths_before.end() ? 0 : known->second;
      s->set_expected_length(
          in_->ConsumeProbability<float>() < 0.9f ? len : in_->ConsumeIntegralInRange(0, len + 2));
      s->set_num_new_tokens(in_->ConsumeIntegralInRange(0, 40));
      s->set_num_queries(in_->ConsumeIntegralInRange(0, 4));
      b.valid = b.valid && known != lengths_before.end() && ids.insert(s->sequence_id()).second &&
                s->expected_length() == len;
      const int64_t after = int64_t{len} + s->num_new_tokens();
      b.pages_needed += PagesFor(after, page_size_) - PagesFor(len, page_size_);
      if (s->num_new_tokens() > 0 && len % page_size_ != 0) ++b.pages_needed;
      tq += s->num_queries();
      tk += s->num_new_tokens();
    }
    b.valid =
        b.valid && layer >= 0 && layer < geometry_.num_layers && tq + tk <= kLimits.max_tokens;
    const int hq = Hkv() * heads_q_mult_;
    auto fill = [&](v1::Tensor* t, int64_t rows, int heads) {
      t->set_dtype(static_cast<v1::DType>(geometry_.dtype));
      t->add_shape(rows);
      t->add_shape(heads);
      t->add_shape(D());
      t->set_data(Rows(rows, heads));
    };
    fill(r.mutable_q(), tq, hq);
    fill(r.mutable_k(), tk, Hkv());
    fill(r.mutable_v(), tk, Hkv());
    r.mutable_options()->set_causal(in_->ConsumeBool());
    r.mutable_options()->set_return_lse(in_->ConsumeBool());
    switch (in_->ConsumeIntegralInRange(0, 12)) {  // mostly well-formed
      case 1:
        r.mutable_k()->set_dtype(geometry_.dtype == DType::kFP32 ? v1::FP16 : v1::FP32);
        break;
      case 2: r.mutable_q()->set_shape(0, tq + 1); break;
      case 3: r.mutable_v()->mutable_data()->push_back('x'); break;
      case 4: r.mutable_sequences(0)->set_num_queries(-1); break;
      case 5: r.mutable_q()->set_shape(2, D() + 8); break;
      case 6: r.mutable_options()->set_window_left(-5); break;
      case 7: r.set_cache_id("no-such-cache"); break;
      default: break;
    }
    if (r.q().shape(0) != tq || r.k().dtype() != r.q().dtype() ||
        r.v().data().size() != r.k().data().size() || r.sequences(0).num_queries() < 0 ||
        r.q().shape(2) != D() || r.options().window_left() == -5 || r.cache_id() != cache_->id()) {
      b.valid = false;
    }
    return b;
  }

  // Submits `request` through the native decoding and the server's K/V
  // runner; `done` is notified with *result set (OK: *out holds the outputs).
  absl::Status Submit(const v1::AppendAttendRequest& request, KvResult* out,
                      absl::Notification* done, absl::Status* result) {
    CallMeta meta;
    meta.tenant = kTenant;
    auto call = std::make_shared<KvCall>(KvCallOf(request, std::move(meta)));
    h_->runner.Start(
        call.get(), NativeFieldNames(),
        [call, out, done, result](const absl::Status& s, const WorkTimings&, KvResult* produced) {
          if (s.ok()) *out = std::move(*produced);
          *result = s;
          done->Notify();
        });
    return absl::OkStatus();
  }

  void Append(bool pipelined) {
    const int layer = in_->ConsumeIntegralInRange(-1, geometry_.num_layers);
    std::map<uint64_t, int32_t> lengths;
    for (const auto& [id, seq] : model_) {
      if (layer >= 0 && layer < geometry_.num_layers) lengths[id] = Len(seq, layer);
    }
    const int64_t used_before = cache_->Stats().pages_used;
    Built first = Build(layer, lengths);
    if (!pipelined) {
      Run(first, layer, used_before);
      return;
    }
    // Two calls in flight at once; the second expects the first's lengths, so
    // the pool must queue it behind the first (KvCache::Admit) when they share
    // a sequence. Only well-formed pairs: the model cannot order two outcomes.
    if (!first.valid || first.pages_needed + used_before > capacity_ / 2) return;
    std::map<uint64_t, int32_t> after = lengths;
    for (const v1::SequenceStep& s : first.request.sequences()) {
      after[s.sequence_id()] += s.num_new_tokens();
    }
    Built second = Build(layer, after);
    if (!second.valid || first.pages_needed + second.pages_needed + used_before > capacity_) return;
    KvResult c1, c2;
    absl::Notification d1, d2;
    absl::Status r1, r2;
    const absl::Status s1 = Submit(first.request, &c1, &d1, &r1);
    const absl::Status s2 = Submit(second.request, &c2, &d2, &r2);
    if (s1.ok()) d1.WaitForNotification();
    if (s2.ok()) d2.WaitForNotification();
    const absl::Status a = s1.ok() ? r1 : s1;
    const absl::Status b = s2.ok() ? r2 : s2;
    // The executor's queue may be full (RESOURCE_EXHAUSTED naming the queue):
    // then the calls stop there, in order.
    EXPECT_OR_FAIL(a.ok() || IsQueueFull(a), absl::StrCat("pipelined call 1: ", a.ToString()));
    if (a.ok()) Apply(first.request, &c1);
    EXPECT_OR_FAIL(
        b.ok() || IsQueueFull(b) || (!a.ok() && b.code() == absl::StatusCode::kFailedPrecondition),
        absl::StrCat("pipelined call 2 (call 1: ", a.ToString(), "): ", b.ToString()));
    if (b.ok()) Apply(second.request, &c2);
  }

  static bool IsQueueFull(const absl::Status& s) {
    return s.code() == absl::StatusCode::kResourceExhausted &&
           s.message().find("queue") != std::string::npos;
  }

  void Run(const Built& b, int layer, int64_t used_before) {
    KvResult call;
    absl::Notification done;
    absl::Status result;
    absl::Status status = Submit(b.request, &call, &done, &result);
    if (status.ok()) {
      done.WaitForNotification();
      status = result;
    }
    if (!status.ok()) {
      EXPECT_OR_FAIL(!status.message().empty(), "AppendAttend refused without a message");
      const bool full = status.code() == absl::StatusCode::kResourceExhausted &&
                        used_before + b.pages_needed > capacity_;
      EXPECT_OR_FAIL(
          !b.valid || full || IsQueueFull(status),
          absl::StrCat("AppendAttend at layer ", layer, " refused a call the model accepts (",
                       used_before, " pages used, ", b.pages_needed, " needed at most, capacity ",
                       capacity_, "): ", status.ToString()));
      return;
    }
    EXPECT_OR_FAIL(b.valid, absl::StrCat("AppendAttend accepted a call the model refuses: ",
                                         b.request.ShortDebugString().substr(0, 400)));
    Apply(b.request, &call);
  }

  // An OK call: its lengths and every step's output against the reference
  // over the model's context after the append; then the model takes the rows.
  void Apply(const v1::AppendAttendRequest& r, KvResult* call) {
    const int layer = r.layer();
    const int hq = static_cast<int>(r.q().shape(1));
    const int64_t q_row = RowBytes(hq), kv_row = RowBytes(Hkv());
    EXPECT_OR_FAIL(call->lengths.size() == size_t(r.sequences_size()),
                   "lengths: one per step expected");
    int64_t q0 = 0, k0 = 0;
    for (int i = 0; i < r.sequences_size(); ++i) {
      const v1::SequenceStep& s = r.sequences(i);
      ModelSeq& seq = model_.at(s.sequence_id());
      seq.k[size_t(layer)].append(r.k().data(), size_t(k0 * kv_row),
                                  size_t(s.num_new_tokens() * kv_row));
      seq.v[size_t(layer)].append(r.v().data(), size_t(k0 * kv_row),
                                  size_t(s.num_new_tokens() * kv_row));
      const int32_t len = Len(seq, layer);
      EXPECT_OR_FAIL(
          call->lengths[size_t(i)] == len,
          absl::StrCat("step ", i, ": length ", call->lengths[size_t(i)], ", model ", len));
      const int nq = s.num_queries();
      if (nq > 0) {
        AttentionInputs in;
        const DType t = geometry_.dtype;
        in.q = *HostTensor::FromBytes(t, {1, nq, hq, D()},
                                      r.q().data().substr(size_t(q0 * q_row), size_t(nq * q_row)));
        in.k = *HostTensor::FromBytes(t, {1, len, Hkv(), D()}, seq.k[size_t(layer)]);
        in.v = *HostTensor::FromBytes(t, {1, len, Hkv(), D()}, seq.v[size_t(layer)]);
        in.options.causal = r.options().causal();
        in.options.return_lse = r.options().return_lse();
        ForwardResult out;
        out.o = *HostTensor::FromBytes(t, {1, nq, hq, D()},
                                       call->o.substr(size_t(q0 * q_row), size_t(nq * q_row)));
        if (r.options().return_lse()) {
          const int64_t tq = r.q().shape(0);
          std::vector<float> lse;
          for (int h = 0; h < hq; ++h) {
            for (int j = 0; j < nq; ++j) {
              lse.push_back(LoadAsFloat(call->lse.data(), DType::kFP32, h * tq + q0 + j));
            }
          }
          out.lse = *HostTensor::FromFloats(DType::kFP32, {1, hq, nq}, lse);
        }
        absl::StatusOr<VerifyReport> report = VerifyForward(in, out);
        EXPECT_OR_FAIL(report.ok() && report->passed,
                       absl::StrCat("step ", i, " (sequence ", s.sequence_id(), ", context ", len,
                                    ", layer ", layer, "): output differs from the reference: ",
                                    report.ok() ? report->failure : report.status().ToString()));
      }
      q0 += nq;
      k0 += s.num_new_tokens();
    }
  }

  void Truncate() {
    if (model_.empty()) return;
    const uint64_t id = PickId();
    std::optional<int32_t> layer;
    if (in_->ConsumeBool()) layer = in_->ConsumeIntegralInRange(-1, geometry_.num_layers);
    auto it = model_.find(id);
    int32_t shortest = 0;
    if (it != model_.end()) {
      shortest = INT32_MAX;
      for (int l = 0; l < geometry_.num_layers; ++l) {
        if (!layer.has_value() || *layer == l) shortest = std::min(shortest, Len(it->second, l));
      }
    }
    const int32_t length = in_->ConsumeIntegralInRange(-1, std::min(shortest, 2000) + 2);
    const bool valid = it != model_.end() &&
                       (!layer.has_value() || (*layer >= 0 && *layer < geometry_.num_layers)) &&
                       length >= 0 && length <= shortest;
    const absl::Status status = cache_->Truncate(id, layer, length);
    EXPECT_OR_FAIL(status.ok() == valid,
                   absl::StrCat("Truncate: the model expected ", valid ? "OK" : "a refusal",
                                ", got ", status.ToString()));
    if (!status.ok()) return;
    for (int l = 0; l < geometry_.num_layers; ++l) {
      if (layer.has_value() && *layer != l) continue;
      it->second.k[size_t(l)].resize(size_t(length * RowBytes(Hkv())));
      it->second.v[size_t(l)].resize(size_t(length * RowBytes(Hkv())));
    }
  }

  void Free() {
    v1::FreeSequencesRequest r;
    const int n = in_->ConsumeIntegralInRange(0, 3);
    bool valid = true;
    std::set<uint64_t> seen;
    for (int i = 0; i < n; ++i) {
      r.add_sequence_ids(PickId());
      valid = valid && model_.count(r.sequence_ids(i)) > 0 && seen.insert(r.sequence_ids(i)).second;
    }
    const absl::Status status =
        cache_->Free(std::vector<uint64_t>(r.sequence_ids().begin(), r.sequence_ids().end()));
    EXPECT_OR_FAIL(status.ok() == valid,
                   absl::StrCat("Free: the model expected ", valid ? "OK" : "a refusal", ", got ",
                                status.ToString()));
    if (status.ok()) {
      for (uint64_t id : r.sequence_ids()) model_.erase(id);
    }
  }

  void Stats() {
    v1::CacheStats out;
    FillCacheStats(cache_->Stats(), &out);
    EXPECT_OR_FAIL(out.pages_used() + out.pages_free() == capacity_,
                   "pages used + free != capacity");
    EXPECT_OR_FAIL(h_->pool.Stats().devices[0].bytes_used <= kBudgetBytes, "budget exceeded");
  }

  void CheckState() {
    const KvCacheStats stats = cache_->Stats();
    EXPECT_OR_FAIL(stats.sequences == int64_t(model_.size()),
                   absl::StrCat("sequences: pool ", stats.sequences, ", model ", model_.size()));
    int64_t unshared = 0, longest = 0;
    for (const auto& [id, seq] : model_) {
      absl::StatusOr<std::vector<int32_t>> lengths = cache_->Lengths(id);
      EXPECT_OR_FAIL(lengths.ok(), absl::StrCat("sequence ", id, " missing from the pool"));
      for (int l = 0; l < geometry_.num_layers; ++l) {
        EXPECT_OR_FAIL((*lengths)[size_t(l)] == Len(seq, l),
                       absl::StrCat("sequence ", id, " layer ", l, ": pool length ",
                                    (*lengths)[size_t(l)], ", model ", Len(seq, l)));
        unshared += PagesFor(Len(seq, l), page_size_);
        longest = std::max(longest, PagesFor(Len(seq, l), page_size_));
      }
    }
    EXPECT_OR_FAIL(
        stats.pages_used <= unshared && stats.pages_used >= longest,
        absl::StrCat("pages used ", stats.pages_used, " outside [", longest, ", ", unshared, "]"));
  }

  Harness* const handoff_;
  Harness* const inline_;
  Harness* h_;
  FuzzedDataProvider* const in_;
  std::shared_ptr<KvCache> cache_;
  KvGeometry geometry_;
  int page_size_ = 16;
  int64_t capacity_ = 0;
  int heads_q_mult_ = 1;
  uint64_t seed_ = 1;
  std::map<uint64_t, ModelSeq> model_;
};

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  // They live for the process, as the server's do.
  static Harness* handoff = new Harness(/*inline_calls=*/false);
  static Harness* inline_calls = new Harness(/*inline_calls=*/true);
  FuzzedDataProvider in(data, size);
  Program(handoff, inline_calls, &in).Run();
  return 0;
}
