// The decode loop of `attnctl load-kv` (see load_kv_loop.h): groups of
// sequences on their own threads, prefill then per-token, per-layer
// append-and-attend steps, the client-side K/V history for --check and
// --stateless, and the tally of latencies and the server's timing.
#include "client/cli/load_kv_loop.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/cli/attention_flags.h"
#include "client/cli/load_recorder.h"
#include "client/inputs.h"
#include "client/ucx_transport.h"
#include "client/verify.h"
#include "common/dtype.h"

namespace attnserve {
namespace cli {
namespace {

constexpr char kCheckFailed[] = "CHECK_FAILED";
// Random tensors cycled through when nothing checks their values: drawing
// fresh normals for every step would cost the client more than the step.
constexpr int kPoolSize = 4;

// Measured steps, errors and the server's timing, from many threads.
class Tally {
 public:
  // `client_us`: the part of `latency` this process spent building the
  // request and reading the response (the rest is the wire and the server).
  void Step(absl::Duration latency, const ForwardTiming& t, int64_t kv_bytes, int64_t client_us) {
    absl::MutexLock lock(&mu_);
    latencies_ms_.push_back(absl::ToDoubleMilliseconds(latency));
    outside_ms_.push_back(absl::ToDoubleMilliseconds(latency) - t.total_us / 1e3);
    total_us_ += t.total_us;
    client_us_ += client_us;
    queue_us_ += t.queue_us;
    h2d_us_ += t.host_to_device_us;
    compute_us_ += t.compute_us;
    d2h_us_ += t.device_to_host_us;
    batch_sum_ += t.batch_size;
    kv_bytes_ += kv_bytes;
  }
  void Checked() {
    absl::MutexLock lock(&mu_);
    ++checked_;
  }
  void Error(const std::string& code, const std::string& message) {
    absl::MutexLock lock(&mu_);
    ++errors_by_code_[code];
    if (first_error_.empty()) first_error_ = absl::StrCat(code, ": ", message);
  }
  void Error(const absl::Status& status, const std::string& what) {
    Error(absl::StatusCodeToString(status.code()), absl::StrCat(what, ": ", status.message()));
  }

  void Summarize(DecodeLoopResult* r) {
    absl::MutexLock lock(&mu_);
    r->errors_by_code = errors_by_code_;
    for (const auto& [code, n] : errors_by_code_) r->errors += n;
    r->first_error = first_error_;
    r->checked = checked_;
    const int64_t n = static_cast<int64_t>(latencies_ms_.size());
    r->steps = n;
    if (r->decode_s > 0) r->tbps = kv_bytes_ / r->decode_s / 1e12;
    if (n == 0) return;
    std::sort(latencies_ms_.begin(), latencies_ms_.end());
    r->p50_ms = NearestRank(latencies_ms_, 0.50);  // as attnctl load reports them
    r->p99_ms = NearestRank(latencies_ms_, 0.99);
    r->max_ms = latencies_ms_.back();
    r->queue_ms = queue_us_ / 1e3 / n;
    r->h2d_ms = h2d_us_ / 1e3 / n;
    r->compute_ms = compute_us_ / 1e3 / n;
    r->d2h_ms = d2h_us_ / 1e3 / n;
    r->server_total_ms = total_us_ / 1e3 / n;
    r->client_ms = client_us_ / 1e3 / n;
    std::sort(outside_ms_.begin(), outside_ms_.end());
    r->outside_p50_ms = NearestRank(outside_ms_, 0.50);
    r->mean_batch_size = static_cast<double>(batch_sum_) / n;
  }

 private:
  absl::Mutex mu_;
  std::vector<double> latencies_ms_ ABSL_GUARDED_BY(mu_);
  std::vector<double> outside_ms_ ABSL_GUARDED_BY(mu_);  // latency - server total
  int64_t total_us_ ABSL_GUARDED_BY(mu_) = 0, client_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t queue_us_ ABSL_GUARDED_BY(mu_) = 0, h2d_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t compute_us_ ABSL_GUARDED_BY(mu_) = 0, d2h_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t batch_sum_ ABSL_GUARDED_BY(mu_) = 0, kv_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t checked_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int64_t> errors_by_code_ ABSL_GUARDED_BY(mu_);
  std::string first_error_ ABSL_GUARDED_BY(mu_);
};

// The K and V rows one sequence holds at one layer, as the server should.
struct History {
  std::string k, v;
  int64_t length = 0;
};

// One step's output, whichever call produced it.
struct StepOutput {
  HostTensor o;
  ForwardTiming timing;
};

// A random `fraction` of the pages of a history of `before` tokens, sorted;
// empty (everything) when that is all of them.
std::vector<int32_t> PickPages(int32_t before, int page_size, double fraction,
                               std::mt19937_64* rng) {
  const int32_t pages = (before + page_size - 1) / page_size;
  const int32_t want = std::max<int32_t>(1, static_cast<int32_t>(std::llround(fraction * pages)));
  if (fraction >= 1.0 || want >= pages) return {};
  // Floyd's sampling: `want` distinct pages in O(want).
  std::vector<char> taken(size_t(pages), 0);
  for (int32_t j = pages - want; j < pages; ++j) {
    const int32_t t = std::uniform_int_distribution<int32_t>(0, j)(*rng);
    taken[size_t(taken[size_t(t)] ? j : t)] = 1;
  }
  std::vector<int32_t> picked;
  for (int32_t p = 0; p < pages; ++p) {
    if (taken[size_t(p)]) picked.push_back(p);
  }
  return picked;
}

// Whether token `t` of a sequence that had `before` tokens before a step
// naming `pages` is attended: a named page's, or one on a page holding the
// step's new tokens (the partial last history page too).
bool Attended(int64_t t, int64_t before, int page_size, const std::vector<int32_t>& pages) {
  if (pages.empty() || t / page_size >= before / page_size) return true;
  return std::binary_search(pages.begin(), pages.end(), static_cast<int32_t>(t / page_size));
}

// Tokens a one-token step after `before` tokens attends with `pages`.
int64_t AttendedTokens(int64_t before, int page_size, const std::vector<int32_t>& pages) {
  if (pages.empty()) return before + 1;
  const int64_t first_new = before / page_size;
  int64_t n = before + 1 - first_new * page_size;
  for (int32_t p : pages) n += p < first_new ? page_size : 0;
  return n;
}

// One group of sequences and everything its thread owns.
class Group {
 public:
  // `page_size`: the cache's (attend_pages count in its pages).
  Group(const DecodeLoopConfig& c, std::vector<uint64_t> ids, uint64_t seed, bool keep_history,
        int page_size)
      : c_(c), ids_(std::move(ids)), rng_(seed), keep_(keep_history), page_size_(page_size) {
    if (keep_) history_.assign(ids_.size(), std::vector<History>(c.layers));
    if (!keep_) {
      // The prompt chunks and decode tensors are reused, so draw them once.
      const int64_t chunk = std::min(c.prompt, c.prefill_chunk);
      const int64_t g = static_cast<int64_t>(ids_.size());
      prefill_q_ = Random(chunk, c.heads_q);
      prefill_k_ = Random(chunk, c.heads_kv);
      prefill_v_ = RandomV(chunk);
      for (int i = 0; i < kPoolSize; ++i) {
        pool_.push_back({Random(g, c.heads_q), Random(g, c.heads_kv), RandomV(g)});
      }
    }
  }

  const std::vector<uint64_t>& ids() const { return ids_; }
  // The cache's page size, known once it is created.
  void set_page_size(int page_size) { page_size_ = page_size; }

  // Every later call of this group goes through `arena` (null: the message).
  void UseArena(std::unique_ptr<ShmArena> arena) { arena_ = std::move(arena); }
  // Every later AppendAttend of this group goes over `ucx` (null: gRPC).
  void UseUcx(std::unique_ptr<UcxStepConnection> ucx) { ucx_ = std::move(ucx); }
  // Unregisters and removes the arena, if any.
  absl::Status CloseArena() { return arena_ == nullptr ? absl::OkStatus() : arena_->Close(); }

  // Appends every sequence's prompt at every layer (chunked), with Q unless
  // the loop is stateless (then only the client's history is built).
  bool Prefill(KvClient* kv, const std::string& cache_id, Tally* tally,
               DecodeLoopProgress* progress) {
    for (size_t s = 0; s < ids_.size(); ++s) {
      for (int layer = 0; layer < c_.layers; ++layer) {
        for (int offset = 0; offset < c_.prompt; offset += c_.prefill_chunk) {
          const int n = std::min(c_.prefill_chunk, c_.prompt - offset);
          HostTensor q, k, v;
          if (keep_) {
            q = Random(n, c_.heads_q);
            k = Random(n, c_.heads_kv);
            v = RandomV(n);
            Append(s, layer, k, v, 0, n);
          } else {
            q = *prefill_q_.SliceRows(0, n);
            k = *prefill_k_.SliceRows(0, n);
            if (!c_.v_in_k) v = *prefill_v_.SliceRows(0, n);
          }
          if (c_.stateless) continue;
          AppendAttendInputs in;
          in.cache_id = cache_id;
          in.layer = layer;
          in.sequences = {{ids_[s], offset, n, c_.prefill_attend ? n : 0}};
          in.options.causal = true;
          if (c_.prefill_attend) in.q = q;
          in.k = std::move(k);
          in.v = std::move(v);
          absl::StatusOr<AppendAttendResult> r = ucx_ != nullptr     ? ucx_->AppendAttend(in)
                                                 : arena_ != nullptr ? kv->AppendAttend(in, *arena_)
                                                                     : kv->AppendAttend(in);
          if (!r.ok()) {
            tally->Error(r.status(), absl::StrCat("prefill of sequence ", ids_[s], " layer ", layer,
                                                  " at ", offset));
            return false;
          }
          if (c_.check && c_.prefill_attend &&
              !CheckOutput({s}, layer, q, /*causal=*/true, r->o, tally)) {
            return false;
          }
        }
      }
      progress->prefilled.fetch_add(1, std::memory_order_relaxed);
    }
    return true;
  }

  // Generated token `t` (0-based) at `layer`: one call for the whole group.
  // Returns false when the step failed (already counted).
  bool Step(int t, int layer, AttentionClient& client, KvClient* kv, AppendAttendStream* stream,
            const std::string& cache_id, bool measured, Tally* tally) {
    const int64_t g = static_cast<int64_t>(ids_.size());
    const int32_t before = c_.prompt + t;
    HostTensor q, k, v;
    if (keep_) {
      q = Random(g, c_.heads_q);
      k = Random(g, c_.heads_kv);
      v = RandomV(g);
      for (int64_t s = 0; s < g; ++s) Append(s, layer, k, v, s, 1);
    } else {
      const Tensors& p = pool_[(t * c_.layers + layer) % kPoolSize];
      q = p.q;
      k = p.k;
      v = p.v;
    }
    const absl::Time sent = absl::Now();
    absl::Duration client_time;  // building the request and reading the answer
    absl::StatusOr<StepOutput> out;
    // Per sequence, the history pages this step attends (empty: all).
    std::vector<std::vector<int32_t>> pages(ids_.size());
    int64_t attended = 0;
    for (size_t s = 0; s < ids_.size(); ++s) {
      if (c_.attend_fraction < 1.0) {
        pages[s] = PickPages(before, page_size_, c_.attend_fraction, &rng_);
      }
      attended += AttendedTokens(before, page_size_, pages[s]);
    }
    if (c_.stateless) {
      out = Stateless(client, layer, q);
    } else {
      AppendAttendInputs in;
      in.cache_id = cache_id;
      in.layer = layer;
      for (size_t s = 0; s < ids_.size(); ++s) {
        in.sequences.push_back({ids_[s], before, 1, 1, pages[s]});
      }
      in.q = c_.check ? q : std::move(q);
      in.k = std::move(k);
      in.v = std::move(v);
      v1::AppendAttendRequest request = MakeAppendAttendRequest(std::move(in));
      client_time += absl::Now() - sent;
      absl::StatusOr<AppendAttendResult> r;
      if (stream == nullptr) {
        r = Unary(kv, std::move(request), &client_time);
      } else if (arena_ != nullptr) {
        r = stream->Call(std::move(request), *arena_);
      } else {
        r = stream->Call(std::move(request));
      }
      if (r.ok()) {
        out = StepOutput{std::move(r->o), r->timing};
      } else {
        out = r.status();
      }
    }
    const absl::Duration latency = absl::Now() - sent;
    if (!out.ok()) {
      tally->Error(out.status(), absl::StrCat("token ", t, " layer ", layer));
      return false;
    }
    if (measured) {
      const int64_t row_bytes =
          int64_t{c_.heads_kv} * (c_.head_dim + (c_.v_in_k ? 0 : Dv())) * DTypeSize(c_.dtype);
      tally->Step(latency, out->timing, attended * row_bytes,
                  absl::ToInt64Microseconds(client_time));
    }
    if (!c_.check) return true;
    std::vector<size_t> all(ids_.size());
    for (size_t s = 0; s < all.size(); ++s) all[s] = s;
    return CheckOutput(all, layer, q, /*causal=*/false, out->o, tally, &pages);
  }

 private:
  struct Tensors {
    HostTensor q, k, v;
  };

  HostTensor Random(int64_t rows, int heads) {
    return RandomTensor(c_.dtype, {rows, heads, c_.head_dim}, &rng_);
  }
  // A step's v rows; none (nothing on the wire) when V lives in K.
  HostTensor RandomV(int64_t rows) {
    if (c_.v_in_k) return HostTensor();
    return RandomTensor(c_.dtype, {rows, c_.heads_kv, Dv()}, &rng_);
  }
  int Dv() const { return c_.head_dim_v > 0 ? c_.head_dim_v : c_.head_dim; }

  // Rows [first, first + n) of k/v become sequence `s`'s next rows at `layer`.
  // With v_in_k the reference's V is the first Dv elements of each K head.
  void Append(size_t s, int layer, const HostTensor& k, const HostTensor& v, int64_t first,
              int64_t n) {
    History& h = history_[s][layer];
    const size_t row = k.bytes().size() / std::max<int64_t>(1, k.dim(0));
    h.k.append(k.bytes(), first * row, n * row);
    if (c_.v_in_k) {
      const size_t es = DTypeSize(c_.dtype), head = es * c_.head_dim, part = es * Dv();
      for (int64_t r = first; r < first + n; ++r) {
        for (int hd = 0; hd < c_.heads_kv; ++hd) {
          h.v.append(k.bytes(), r * row + hd * head, part);
        }
      }
    } else {
      const size_t v_row = v.bytes().size() / std::max<int64_t>(1, v.dim(0));
      h.v.append(v.bytes(), first * v_row, n * v_row);
    }
    h.length += n;
  }

  // Adds the time spent placing the request in the arena and reading the
  // response to *client_time.
  absl::StatusOr<AppendAttendResult> Unary(KvClient* kv, v1::AppendAttendRequest request,
                                           absl::Duration* client_time) {
    if (ucx_ != nullptr) {
      absl::StatusOr<v1::AppendAttendResponse> r = ucx_->AppendAttend(&request);
      if (!r.ok()) return r.status();
      const absl::Time answered = absl::Now();
      absl::StatusOr<AppendAttendResult> result =
          AppendAttendResultFromProto(request, *std::move(r));
      *client_time += absl::Now() - answered;
      return result;
    }
    ShmOutputSpans spans;
    if (arena_ != nullptr) {
      const absl::Time start = absl::Now();
      absl::StatusOr<ShmOutputSpans> placed = PlaceAppendAttendInArena(*arena_, &request);
      if (!placed.ok()) return placed.status();
      spans = *placed;
      *client_time += absl::Now() - start;
    }
    // The request's tensor bytes go onto the wire (not copied); its shapes
    // stay for the check below.
    absl::StatusOr<v1::AppendAttendResponse> r = kv->AppendAttend(&request);
    if (!r.ok()) return r.status();
    const absl::Time answered = absl::Now();
    if (arena_ != nullptr) {
      const absl::Status taken = TakeAppendAttendOutputs(*arena_, spans, &*r);
      if (!taken.ok()) return taken;
    }
    absl::StatusOr<AppendAttendResult> result = AppendAttendResultFromProto(request, *std::move(r));
    *client_time += absl::Now() - answered;
    return result;
  }

  // The varlen call over the whole context of sequences `rows` at `layer`,
  // with their queries q (rows in the same order); with `pages` (per row, a
  // one-token step's attend_pages) only the tokens that step attended.
  AttentionInputs ContextInputs(const std::vector<size_t>& rows, int layer, const HostTensor& q,
                                bool causal,
                                const std::vector<std::vector<int32_t>>* pages = nullptr) const {
    AttentionInputs in;
    in.q = q;
    std::string k, v;
    std::vector<int> q_lengths, k_lengths;
    const int64_t q_rows = q.dim(0) / static_cast<int64_t>(rows.size());
    const size_t row = static_cast<size_t>(DTypeSize(c_.dtype)) * c_.heads_kv * c_.head_dim;
    const size_t v_row = static_cast<size_t>(DTypeSize(c_.dtype)) * c_.heads_kv * Dv();
    for (size_t i = 0; i < rows.size(); ++i) {
      const History& h = history_[rows[i]][layer];
      q_lengths.push_back(static_cast<int>(q_rows));
      if (pages == nullptr || (*pages)[i].empty()) {
        k += h.k;
        v += h.v;
        k_lengths.push_back(static_cast<int>(h.length));
        continue;
      }
      int64_t kept = 0;
      for (int64_t t = 0; t < h.length; ++t) {
        if (!Attended(t, h.length - 1, page_size_, (*pages)[i])) continue;
        k.append(h.k, size_t(t) * row, row);
        v.append(h.v, size_t(t) * v_row, v_row);
        ++kept;
      }
      k_lengths.push_back(static_cast<int>(kept));
    }
    const int64_t total =
        static_cast<int64_t>(k.size()) / (int64_t{c_.heads_kv} * c_.head_dim * DTypeSize(c_.dtype));
    in.k = *HostTensor::FromBytes(c_.dtype, {total, c_.heads_kv, c_.head_dim}, std::move(k));
    in.v = *HostTensor::FromBytes(c_.dtype, {total, c_.heads_kv, Dv()}, std::move(v));
    in.cu_seqlens_q = CuSeqlensFromLengths(q_lengths);
    in.cu_seqlens_k = CuSeqlensFromLengths(k_lengths);
    in.options.causal = causal;
    return in;
  }

  absl::StatusOr<StepOutput> Stateless(AttentionClient& client, int layer, const HostTensor& q) {
    std::vector<size_t> all(ids_.size());
    for (size_t s = 0; s < all.size(); ++s) all[s] = s;
    AttentionInputs in = ContextInputs(all, layer, q, /*causal=*/false);
    v1::ForwardRequest request = MakeForwardRequest(std::move(in));
    absl::StatusOr<v1::ForwardResponse> r =
        arena_ != nullptr ? client.Forward(std::move(request), *arena_) : client.Forward(request);
    if (!r.ok()) return r.status();
    if (r->error_code() != 0) return StatusFromRpcCode(r->error_code(), r->error_message());
    absl::StatusOr<ForwardResult> result = ForwardResultFromProto(*std::move(r));
    if (!result.ok()) return result.status();
    return StepOutput{std::move(result->o), result->timing};
  }

  // Holds `o` to the float64 reference of the queries q over the sequences'
  // whole context.
  bool CheckOutput(const std::vector<size_t>& rows, int layer, const HostTensor& q, bool causal,
                   const HostTensor& o, Tally* tally,
                   const std::vector<std::vector<int32_t>>* pages = nullptr) {
    const AttentionInputs in = ContextInputs(rows, layer, q, causal, pages);
    ForwardResult result;
    result.o = o;
    absl::StatusOr<VerifyReport> report = VerifyForward(in, result);
    std::string failure;
    if (!report.ok()) {
      failure = std::string(report.status().message());
    } else if (!report->passed) {
      failure = report->failure;
    }
    if (failure.empty()) {
      tally->Checked();
      return true;
    }
    tally->Error(kCheckFailed,
                 absl::StrCat("layer ", layer, ", sequences from ", ids_[rows[0]], " at length ",
                              history_[rows[0]][layer].length, ": ", failure));
    return false;
  }

  const DecodeLoopConfig& c_;
  const std::vector<uint64_t> ids_;
  std::mt19937_64 rng_;
  const bool keep_;
  int page_size_;
  std::vector<std::vector<History>> history_;  // [sequence in group][layer]
  HostTensor prefill_q_, prefill_k_, prefill_v_;
  std::vector<Tensors> pool_;
  std::unique_ptr<ShmArena> arena_;
  std::unique_ptr<UcxStepConnection> ucx_;
};

// Bytes one group's arena needs: the largest call it sends (a prefill chunk
// of one sequence, or a decode step of `rows` sequences; the stateless loop's
// whole context at the last token), its inputs and O, plus alignment.
uint64_t ArenaBytes(const DecodeLoopConfig& c, int64_t rows) {
  const int64_t es = DTypeSize(c.dtype);
  const int64_t q_row = int64_t{c.heads_q} * c.head_dim * es;
  // K rows and V rows (none when V lives in K; MLA's V may be narrower):
  // q, k, v and O (O no wider than q) at most twice the widest row each.
  const int64_t kv_row = int64_t{c.heads_kv} * c.head_dim * es;
  const int64_t v_row =
      c.v_in_k ? 0 : int64_t{c.heads_kv} * std::max(c.head_dim, c.head_dim_v) * es;
  auto call = [&](int64_t q_rows, int64_t kv_rows) {
    return q_rows * 2 * q_row + kv_rows * (kv_row + v_row);
  };
  const int64_t chunk = std::min(c.prompt, c.prefill_chunk);
  int64_t bytes = std::max(call(chunk, chunk), call(rows, rows));
  if (c.stateless) bytes = std::max(bytes, call(rows, rows * (c.prompt + c.tokens)));
  return static_cast<uint64_t>(bytes) + 4 * kShmAlignment;
}

// The page size the server will use for page_size 0, to size the capacity.
int EffectivePageSize(AttentionClient& client, int page_size) {
  if (page_size > 0) return page_size;
  absl::StatusOr<v1::GetServerInfoResponse> info = client.GetServerInfo();
  if (info.ok() && info->kv().default_page_size() > 0) return info->kv().default_page_size();
  return 256;  // the largest allowed: capacity is then enough for any default
}

}  // namespace

absl::Status ValidateDecodeLoopConfig(const DecodeLoopConfig& c) {
  const struct {
    const char* flag;
    int value;
    int min;
  } checks[] = {{"sequences", c.sequences, 1},
                {"prompt", c.prompt, 0},
                {"tokens", c.tokens, 1},
                {"warmup_tokens", c.warmup_tokens, 0},
                {"layers", c.layers, 1},
                {"heads_q", c.heads_q, 1},
                {"heads_kv", c.heads_kv, 1},
                {"head_dim", c.head_dim, 1},
                {"head_dim_v", c.head_dim_v, 0},
                {"concurrency", c.groups, 1},
                {"prefill_chunk", c.prefill_chunk, 1},
                {"page_size", c.page_size, 0}};
  for (const auto& ch : checks) {
    if (ch.value < ch.min) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", ch.flag, " must be >= ", ch.min, ", got ", ch.value));
    }
  }
  if (c.warmup_tokens >= c.tokens) {
    return absl::InvalidArgumentError(absl::StrCat("--warmup_tokens (", c.warmup_tokens,
                                                   ") must be < --tokens (", c.tokens, ")"));
  }
  if (c.groups > c.sequences) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--concurrency (", c.groups, " groups) must be <= --sequences (", c.sequences, ")"));
  }
  if (c.heads_q % c.heads_kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--heads_q (", c.heads_q, ") must be a multiple of --heads_kv (", c.heads_kv, ")"));
  }
  if (!(c.attend_fraction > 0.0 && c.attend_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--attend_fraction must be in (0, 1], got ", c.attend_fraction));
  }
  if (c.stateless && c.attend_fraction < 1.0) {
    return absl::InvalidArgumentError(
        "--attend_fraction names pages of a cache; --stateless has none");
  }
  if (c.ucx_port > 0 && (c.stream || c.stateless || c.shm != ShmMode::kNone)) {
    return absl::InvalidArgumentError(
        "--transport=ucx carries unary steps of the K/V loop: not with --stream, --stateless or "
        "--shm");
  }
  if (c.stateless && c.stream) {
    return absl::InvalidArgumentError(
        "--stateless sends unary Forward calls; --stream applies to the K/V loop only");
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeLoopResult> RunDecodeLoop(AttentionClient& client, const DecodeLoopConfig& c,
                                               DecodeLoopProgress* progress) {
  DecodeLoopResult result;
  result.impl = c.stateless ? "attnserve_stateless" : "attnserve_kv";
  result.transport = c.ucx_port > 0 ? "ucx" : ShmTransportName(c.shm);
  KvClient kv(client, c.moved);
  std::vector<uint64_t> all_ids;
  for (int s = 0; s < c.sequences; ++s) all_ids.push_back(static_cast<uint64_t>(s));

  // Sequences split into contiguous groups of near-equal size, each with its
  // own arena, registered before anything else so a refusal leaves no cache.
  const bool keep = c.check || c.stateless;
  std::vector<std::unique_ptr<Group>> groups;
  for (int g = 0; g < c.groups; ++g) {
    const int begin = c.sequences * g / c.groups, end = c.sequences * (g + 1) / c.groups;
    groups.push_back(std::make_unique<Group>(
        c, std::vector<uint64_t>(all_ids.begin() + begin, all_ids.begin() + end), c.seed + g, keep,
        /*page_size=*/0));
    if (c.ucx_port > 0) {
      absl::StatusOr<std::unique_ptr<UcxStepConnection>> ucx =
          UcxStepConnection::Connect(c.ucx_host, c.ucx_port, c.ucx_authorization);
      if (!ucx.ok()) {
        return absl::Status(ucx.status().code(),
                            absl::StrCat("UCX connection to ", c.ucx_host, ":", c.ucx_port, ": ",
                                         ucx.status().message()));
      }
      groups.back()->UseUcx(*std::move(ucx));
    }
    if (c.shm == ShmMode::kNone) continue;
    ProtocolChoice shm;
    shm.shm = c.shm;
    shm.shm_prefix = c.shm_prefix;
    absl::StatusOr<std::unique_ptr<ShmArena>> arena =
        MakeArena(client, shm, ArenaBytes(c, end - begin));
    if (!arena.ok()) return arena.status();
    groups.back()->UseArena(*std::move(arena));
  }

  if (!c.stateless) {
    const int64_t page = EffectivePageSize(client, c.page_size);
    const int64_t per_sequence = (c.prompt + c.tokens + page - 1) / page * page;
    CacheSpec spec;
    spec.geometry = {
        c.layers,     c.heads_kv, c.head_dim, c.dtype, c.fp8_cache ? DType::kFP8E4M3 : DType{0},
        c.head_dim_v, c.v_in_k};
    spec.page_size = c.page_size;
    spec.capacity_tokens = per_sequence * c.layers * c.sequences;
    spec.device = c.device;
    absl::StatusOr<v1::CacheStats> stats = kv.CreateCache(spec);
    if (!stats.ok()) {
      const bool unimplemented = stats.status().code() == absl::StatusCode::kUnimplemented;
      return absl::Status(
          stats.status().code(),
          absl::StrCat("CreateCache: ", stats.status().message(),
                       unimplemented ? " (this server has no KvCache service)" : ""));
    }
    result.cache_id = stats->cache_id();
    result.page_size = stats->page_size();
    std::vector<SequenceSpec> specs;
    for (uint64_t id : all_ids) specs.push_back(SequenceSpec(id));
    absl::StatusOr<v1::CacheStats> created = kv.CreateSequences(result.cache_id, specs);
    if (!created.ok()) {
      kv.DropCache(result.cache_id).IgnoreError();
      return absl::Status(created.status().code(),
                          absl::StrCat("CreateSequences: ", created.status().message()));
    }
  }

  for (auto& group : groups) group->set_page_size(result.page_size);

  Tally tally;
  std::vector<char> ok(groups.size(), 1);  // not vector<bool>: one thread writes each
  const absl::Time prefill_start = absl::Now();
  {
    std::vector<std::thread> threads;
    for (size_t g = 0; g < groups.size(); ++g) {
      threads.emplace_back([&, g] {
        ok[g] = groups[g]->Prefill(&kv, result.cache_id, &tally, progress);
        if (!ok[g]) progress->errors.fetch_add(1, std::memory_order_relaxed);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  result.prefill_s = absl::ToDoubleSeconds(absl::Now() - prefill_start);

  // Streams shared round-robin by the groups: with fewer channels than
  // groups, several groups' steps are in flight on one stream.
  std::vector<std::unique_ptr<AppendAttendStream>> streams;
  if (c.stream) {
    const int n = std::min<int>(client.num_channels(), c.groups);
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<std::unique_ptr<AppendAttendStream>> s = kv.OpenStream(result.cache_id, i);
      if (!s.ok()) return s.status();
      streams.push_back(*std::move(s));
    }
  }

  progress->decoding = true;
  absl::Barrier warmed_up(static_cast<int>(groups.size()));
  absl::Mutex start_mu;
  absl::Time measure_start = absl::Now();
  {
    std::vector<std::thread> threads;
    for (size_t g = 0; g < groups.size(); ++g) {
      threads.emplace_back([&, g] {
        Group& group = *groups[g];
        AppendAttendStream* stream = streams.empty() ? nullptr : streams[g % streams.size()].get();
        for (int t = 0; t < c.tokens; ++t) {
          if (c.warmup_tokens > 0 && t == c.warmup_tokens) {
            // Every group reaches the measured tokens before the clock starts.
            if (warmed_up.Block()) {
              absl::MutexLock lock(&start_mu);
              measure_start = absl::Now();
            }
          }
          if (!ok[g]) continue;  // a failed group still meets the barrier
          const bool measured = t >= c.warmup_tokens;
          for (int layer = 0; layer < c.layers && ok[g]; ++layer) {
            ok[g] = group.Step(t, layer, client, &kv, stream, result.cache_id, measured, &tally);
            if (ok[g]) progress->steps.fetch_add(1, std::memory_order_relaxed);
          }
          if (ok[g]) {
            progress->tokens.fetch_add(static_cast<int64_t>(group.ids().size()),
                                       std::memory_order_relaxed);
          } else {
            progress->errors.fetch_add(1, std::memory_order_relaxed);
          }
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }
  const absl::Time decode_end = absl::Now();
  {
    absl::MutexLock lock(&start_mu);
    result.decode_s = absl::ToDoubleSeconds(decode_end - measure_start);
  }
  for (auto& s : streams) {
    const absl::Status st = s->Finish();
    if (!st.ok()) tally.Error(st, "AppendAttendStream");
  }
  result.generated = int64_t{c.sequences} * (c.tokens - c.warmup_tokens);
  for (size_t g = 0; g < groups.size(); ++g) {
    // A group that failed generated nothing worth counting.
    if (!ok[g]) {
      result.generated -=
          static_cast<int64_t>(groups[g]->ids().size()) * (c.tokens - c.warmup_tokens);
    }
  }
  if (result.decode_s > 0) result.tokens_per_s = result.generated / result.decode_s;

  if (!c.stateless && !c.keep_cache) {
    absl::StatusOr<v1::CacheStats> freed = kv.FreeSequences(result.cache_id, all_ids);
    if (freed.ok()) {
      result.pages_used_after_free = freed->pages_used();
    } else {
      tally.Error(freed.status(), "FreeSequences");
    }
    const absl::Status dropped = kv.DropCache(result.cache_id);
    if (!dropped.ok()) tally.Error(dropped, "DropCache");
  }
  for (auto& group : groups) {
    const absl::Status closed = group->CloseArena();
    if (!closed.ok()) tally.Error(closed, "SharedMemory.Unregister");
  }
  tally.Summarize(&result);
  result.moved_retries = kv.moved_retries();
  const auto gone = result.errors_by_code.find("NOT_FOUND");
  result.reprefills = gone == result.errors_by_code.end() ? 0 : gone->second;
  return result;
}

}  // namespace cli
}  // namespace attnserve
