// Export and import of K/V sequences; see kv_transfer.h.
#include "server/kv/kv_transfer.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {
int64_t PagesFor(int64_t tokens, int page_size) { return (tokens + page_size - 1) / page_size; }
}  // namespace

// The transfer's one way into a cache's pages and sequences (a friend of
// KvCache): every method takes the cache's lock.
class KvTransferAccess {
 public:
  static AttentionBackend* Backend(KvCache& c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return c.allocator_.backend();
  }
  static KvPages Pages(KvCache& c) {
    absl::MutexLock lock(&c.mu_);
    return c.allocator_.pages();
  }

  // The sequence's lengths now, and (pin) one reference on each page that
  // holds its rows [token_begin, end) at each layer, end being token_end or
  // the layer's length: one lock, so the pages match the lengths. NOT_FOUND
  // for an unknown sequence; INVALID_ARGUMENT when the range is not there.
  static absl::Status PinSequence(KvCache& c, uint64_t id, int32_t token_begin,
                                  std::optional<int32_t> token_end, bool pin,
                                  std::vector<int32_t>* ends,
                                  std::vector<std::vector<int32_t>>* pinned) {
    absl::MutexLock lock(&c.mu_);
    auto found = c.Find(id);
    if (!found.ok()) return found.status();
    const KvCache::Sequence& s = **found;
    for (size_t l = 0; l < s.lengths.size(); ++l) {
      const int32_t end = token_end.value_or(s.lengths[l]);
      if (end > s.lengths[l] || token_begin > s.lengths[l]) {
        return absl::InvalidArgumentError(
            absl::StrCat(token_end.has_value() ? "token_end" : "token_begin", ": sequence ", id,
                         " has ", s.lengths[l], " tokens at layer ", l, ", the export asks for [",
                         token_begin, ", ", end, ")"));
      }
    }
    ends->clear();
    pinned->assign(s.lengths.size(), {});
    for (size_t l = 0; l < s.lengths.size(); ++l) {
      const int32_t end = token_end.value_or(s.lengths[l]);
      ends->push_back(end);
      if (!pin) continue;
      for (int64_t p = token_begin / c.page_size_; p < PagesFor(end, c.page_size_); ++p) {
        c.allocator_.AddRef(s.pages[l][size_t(p)]);
        (*pinned)[l].push_back(s.pages[l][size_t(p)]);
      }
    }
    return absl::OkStatus();
  }
  static std::vector<uint64_t> SequenceIds(KvCache& c) {
    absl::MutexLock lock(&c.mu_);
    std::vector<uint64_t> ids;
    for (const auto& [id, s] : c.sequences_) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    return ids;
  }
  static void Release(KvCache& c, const std::vector<int32_t>& pages) {
    absl::MutexLock lock(&c.mu_);
    for (int32_t p : pages) c.allocator_.Release(p);
  }
  static absl::Status Allocate(KvCache& c, int64_t n, std::vector<int32_t>* pages) {
    absl::MutexLock lock(&c.mu_);
    c.last_used_ = absl::Now();
    return c.allocator_.Allocate(n, pages);
  }
  // One sequence's bookkeeping (+1 charges, all or nothing; -1 refunds).
  static absl::Status ChargeSequence(KvCache& c, int64_t count) {
    absl::MutexLock lock(&c.mu_);
    return c.ChargeSequences(count);
  }
  // The sequence, for the check at its first chunk: absent (token_begin 0)
  // or holding `length` tokens at every layer.
  static absl::Status CheckTarget(KvCache& c, uint64_t id, int32_t token_begin) {
    absl::MutexLock lock(&c.mu_);
    return CheckTargetLocked(c, id, token_begin);
  }

  // Makes the staged rows live: a new sequence (its bookkeeping was charged
  // by ChargeSequence), or rows appended to one holding token_begin tokens
  // at every layer (its rows [base, token_begin) are copied into the first
  // staged page, then its partial last page is replaced).
  static absl::Status Install(KvCache& c, uint64_t id, int32_t token_begin, int32_t base,
                              std::vector<std::vector<int32_t>>* staged,
                              const std::vector<int32_t>& lengths, int64_t row_bytes,
                              int64_t scale_bytes) {
    absl::MutexLock lock(&c.mu_);
    RETURN_IF_ERROR(CheckTargetLocked(c, id, token_begin));
    const absl::Time now = absl::Now();
    c.last_used_ = now;
    if (token_begin == 0) {
      KvCache::Sequence seq;
      seq.pages = std::move(*staged);
      seq.lengths = lengths;
      seq.last_used = now;
      c.sequences_.emplace(id, std::move(seq));
      return absl::OkStatus();
    }
    KvCache::Sequence& s = c.sequences_.at(id);
    const int ps = c.page_size_;
    const KvPages kv = c.allocator_.pages();
    AttentionBackend* backend = c.allocator_.backend();
    if (token_begin % ps != 0) {
      // Copy the live partial page's rows into the first staged page first:
      // a failed copy leaves the sequence as it was.
      for (size_t l = 0; l < s.pages.size(); ++l) {
        if ((*staged)[l].empty()) continue;
        RETURN_IF_ERROR(CopyPageRows(backend, kv, c.geometry_, s.pages[l].back(),
                                     (*staged)[l].front(), token_begin - base, row_bytes,
                                     scale_bytes));
      }
    }
    for (size_t l = 0; l < s.pages.size(); ++l) {
      if ((*staged)[l].empty()) continue;
      std::vector<int32_t>& live = s.pages[l];
      const size_t keep = size_t(base / ps);
      for (size_t i = keep; i < live.size(); ++i) c.allocator_.Release(live[i]);
      live.resize(keep);
      live.insert(live.end(), (*staged)[l].begin(), (*staged)[l].end());
      s.lengths[l] = lengths[l];
      (*staged)[l].clear();
    }
    s.last_used = now;
    return absl::OkStatus();
  }

 private:
  static absl::Status CheckTargetLocked(KvCache& c, uint64_t id, int32_t token_begin)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu_) {
    auto it = c.sequences_.find(id);
    if (token_begin == 0) {
      if (it == c.sequences_.end()) return absl::OkStatus();
      return absl::AlreadyExistsError(absl::StrCat(
          "chunk.sequence_id: sequence ", id, " already exists in cache '", c.id_,
          "' (an import with token_begin 0 creates it); free it first or import another id"));
    }
    if (it == c.sequences_.end()) {
      return absl::NotFoundError(
          absl::StrCat("chunk.sequence_id: sequence ", id, " not found in cache '", c.id_,
                       "': an import with token_begin ", token_begin,
                       " appends to a sequence holding ", token_begin, " tokens at every layer"));
    }
    if (it->second.active_calls > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk.sequence_id: sequence ", id, " has ", it->second.active_calls,
                       " append-and-attend call(s) in flight; import after they complete"));
    }
    for (size_t l = 0; l < it->second.lengths.size(); ++l) {
      if (it->second.lengths[l] != token_begin) {
        return absl::FailedPreconditionError(
            absl::StrCat("header.token_begin: sequence ", id, " has ", it->second.lengths[l],
                         " tokens at layer ", l, ", the import appends from ", token_begin,
                         "; nothing was appended"));
      }
    }
    return absl::OkStatus();
  }

  // Rows [0, rows) of page `from` into page `to` (K, V and FP8 scales).
  static absl::Status CopyPageRows(AttentionBackend* backend, const KvPages& kv,
                                   const KvGeometry& g, int32_t from, int32_t to, int32_t rows,
                                   int64_t row_bytes, int64_t scale_bytes);
};

namespace {

// The head dim of K's rows or V's (`v`): MLA caches' V rows have head_dim_v.
int32_t SideDim(const KvGeometry& g, bool v) { return v ? KvHeadDimV(g) : g.head_dim; }
// Whether the pages hold V rows of their own (not with v_in_k: V is part of K).
bool HasV(const KvGeometry& g) { return !g.v_in_k; }

// Bytes of one token row of K (or V, `v`) as it sits in a page and on the
// wire; 0 for V when V lives inside K (chunks then carry no v).
int64_t RowBytes(const KvGeometry& g, bool v) {
  if (v && !HasV(g)) return 0;
  return int64_t{g.num_heads_kv} * SideDim(g, v) * (IsFp8Cache(g) ? 1 : DTypeSize(g.cache_dtype));
}
// FP8 caches: bytes of one token row's scales (one FP32 per KV head).
int64_t ScaleRowBytes(const KvGeometry& g, bool v) {
  if (v && !HasV(g)) return 0;
  return IsFp8Cache(g) ? 4 * g.num_heads_kv : 0;
}
// Payload bytes of `rows` token rows: K, V and their scales.
int64_t PayloadBytes(const KvGeometry& g, int64_t rows) {
  return rows * (RowBytes(g, false) + RowBytes(g, true) + ScaleRowBytes(g, false) +
                 ScaleRowBytes(g, true));
}

char* SlabOf(const KvPages& kv, bool v, int32_t page) {
  return static_cast<char*>(v ? kv.v_slabs[PageSlab(kv, page)] : kv.k_slabs[PageSlab(kv, page)]);
}
// Byte offset of (page, token) in its K or V slab: codes are 1 byte, else the element.
int64_t RowOffset(const KvPages& kv, const KvGeometry& g, bool v, int32_t page, int32_t token) {
  const int64_t elem = IsFp8Cache(g) ? 1 : DTypeSize(g.cache_dtype);
  return PageRowOffset(kv, page, token, g.num_heads_kv, SideDim(g, v), 0) * elem;
}
// Byte offset of page's scale block ([Hkv, page_size] FP32) in its K or V slab.
int64_t ScaleBlockOffset(const KvPages& kv, const KvGeometry& g, bool v, int32_t page) {
  return PageScaleOffset(kv, page, 0, g.num_heads_kv, SideDim(g, v), 0);
}

// Reads rows [a, b) of `page` (K or V, `v`; b may pass the page's end into
// the pages that follow it in its slab, RunEnd) into `rows` and, for FP8, their
// scales into `scales` ([b - a, Hkv] FP32, token-major as on the wire).
absl::Status ReadPageRows(AttentionBackend* backend, const KvPages& kv, const KvGeometry& g,
                          int32_t page, bool v, int32_t a, int32_t b, char* rows, char* scales,
                          std::vector<float>* block) {
  if (v && !HasV(g)) return absl::OkStatus();
  char* slab = SlabOf(kv, v, page);
  RETURN_IF_ERROR(backend->CopyFromKvMemory(rows, slab + RowOffset(kv, g, v, page, a),
                                            (b - a) * RowBytes(g, v)));
  if (!IsFp8Cache(g)) return absl::OkStatus();
  const int32_t hkv = g.num_heads_kv;
  block->resize(size_t(hkv) * kv.page_size);
  RETURN_IF_ERROR(backend->CopyFromKvMemory(block->data(), slab + ScaleBlockOffset(kv, g, v, page),
                                            int64_t(block->size()) * 4));
  float* out = reinterpret_cast<float*>(scales);
  for (int32_t t = a; t < b; ++t) {
    for (int32_t h = 0; h < hkv; ++h) {
      out[size_t(t - a) * hkv + h] = (*block)[size_t(h) * kv.page_size + t];
    }
  }
  return absl::OkStatus();
}

// Writes rows [a, b) of `page` (a run, as ReadPageRows) from `rows` (and FP8
// scales, token-major).
absl::Status WritePageRows(AttentionBackend* backend, const KvPages& kv, const KvGeometry& g,
                           int32_t page, bool v, int32_t a, int32_t b, const char* rows,
                           const char* scales, std::vector<float>* block) {
  if (v && !HasV(g)) return absl::OkStatus();
  char* slab = SlabOf(kv, v, page);
  RETURN_IF_ERROR(
      backend->CopyToKvMemory(slab + RowOffset(kv, g, v, page, a), rows, (b - a) * RowBytes(g, v)));
  if (!IsFp8Cache(g)) return absl::OkStatus();
  const int32_t hkv = g.num_heads_kv;
  block->resize(size_t(hkv) * kv.page_size);
  char* at = slab + ScaleBlockOffset(kv, g, v, page);
  // The page's other rows may hold scales already (an earlier chunk).
  RETURN_IF_ERROR(backend->CopyFromKvMemory(block->data(), at, int64_t(block->size()) * 4));
  std::vector<float> in(size_t(b - a) * hkv);
  std::memcpy(in.data(), scales, in.size() * 4);
  for (int32_t t = a; t < b; ++t) {
    for (int32_t h = 0; h < hkv; ++h) {
      (*block)[size_t(h) * kv.page_size + t] = in[size_t(t - a) * hkv + h];
    }
  }
  return backend->CopyToKvMemory(at, block->data(), int64_t(block->size()) * 4);
}

// Where rows [t, stop) of one layer (its pages from `first_page`, token
// units) run contiguously in a slab: consecutive page ids of one slab hold
// consecutive rows (PageRowOffset), so one copy moves a run of them instead
// of one copy per page. FP8 caches go page by page (each page's scales are a
// block of their own). Returns the run's end (> t).
int32_t RunEnd(const KvPages& kv, const KvGeometry& g, const std::vector<int32_t>& pages,
               int64_t first_page, int32_t t, int32_t stop, int ps) {
  int32_t end = std::min(stop, t / ps * ps + ps);
  if (IsFp8Cache(g)) return end;
  int32_t last = pages[size_t(t / ps - first_page)];
  while (end < stop) {
    const int32_t next = pages[size_t(end / ps - first_page)];
    if (next != last + 1 || PageSlab(kv, next) != PageSlab(kv, last)) break;
    last = next;
    end = std::min(stop, end + ps);
  }
  return end;
}

absl::Status InvalidArgument(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

bool ValidTransferId(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::string MakeTransferId() {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat("xfer-", absl::ToUnixMicros(absl::Now()), "-",
                      counter.fetch_add(1, std::memory_order_relaxed));
}

}  // namespace

absl::Status KvTransferAccess::CopyPageRows(AttentionBackend* backend, const KvPages& kv,
                                            const KvGeometry& g, int32_t from, int32_t to,
                                            int32_t rows, int64_t row_bytes, int64_t scale_bytes) {
  if (rows <= 0) return absl::OkStatus();
  // K's rows are the widest (V's are K's width or narrower, or none).
  std::string buf(size_t(rows * row_bytes), '\0');
  std::string scales(size_t(rows * scale_bytes), '\0');
  std::vector<float> block;
  for (bool v : {false, true}) {
    RETURN_IF_ERROR(
        ReadPageRows(backend, kv, g, from, v, 0, rows, buf.data(), scales.data(), &block));
    RETURN_IF_ERROR(
        WritePageRows(backend, kv, g, to, v, 0, rows, buf.data(), scales.data(), &block));
  }
  return absl::OkStatus();
}

uint32_t KvChunkCrc32c(const KvTransferChunk& c) {
  uint32_t crc = 0;
  for (const std::string* s : {&c.k, &c.v, &c.k_scale, &c.v_scale}) {
    crc = Crc32cExtend(crc, s->data(), s->size());
  }
  return crc;
}

namespace {

// Export and import move one device's pages; a cache whose sequences span
// devices has no such form (yet): refused, naming the cache.
absl::Status RefuseSpanning(const KvCache& cache, const char* what) {
  if (!cache.spanning()) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat("cache_id: cache '", cache.id(), "' spans ",
                                               cache.devices().size(), " devices; ", what,
                                               " moves the pages of a cache on one device only"));
}

}  // namespace

// --- Export ---

absl::StatusOr<std::unique_ptr<KvExporter>> KvExporter::Start(std::shared_ptr<KvCache> cache,
                                                              const KvExportOptions& o) {
  RETURN_IF_ERROR(RefuseSpanning(*cache, "an export"));
  const KvGeometry& g = cache->geometry();
  const int ps = cache->page_size();
  if (o.token_begin < 0) {
    return InvalidArgument("token_begin", absl::StrCat("expected >= 0, got ", o.token_begin));
  }
  if (o.token_end.has_value() && *o.token_end < o.token_begin) {
    return InvalidArgument("token_end", absl::StrCat("expected >= token_begin (", o.token_begin,
                                                     "), got ", *o.token_end));
  }
  if (o.max_chunk_bytes < 0) {
    return InvalidArgument("max_chunk_bytes",
                           absl::StrCat("expected >= 0 (0: 4 MiB), got ", o.max_chunk_bytes));
  }
  if (!o.transfer_id.empty() && !ValidTransferId(o.transfer_id)) {
    return InvalidArgument("transfer_id", "expected 1..128 characters of [A-Za-z0-9._-]");
  }
  if (o.sequence_ids.size() > size_t{kMaxKvIdsPerCall}) {
    return InvalidArgument("sequence_ids", absl::StrCat("expected at most ", kMaxKvIdsPerCall,
                                                        " per call, got ", o.sequence_ids.size()));
  }
  std::vector<uint64_t> ids = o.sequence_ids;
  {
    std::set<uint64_t> seen;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!seen.insert(ids[i]).second) {
        return InvalidArgument(absl::StrCat("sequence_ids[", i, "]"),
                               absl::StrCat(ids[i], " is listed twice"));
      }
    }
  }
  if (ids.empty()) ids = KvTransferAccess::SequenceIds(*cache);

  std::unique_ptr<KvExporter> e(new KvExporter());
  e->cache_ = cache;
  KvTransferHeader& h = e->header_;
  h.transfer_id = o.transfer_id.empty() ? MakeTransferId() : o.transfer_id;
  h.source_cache_id = cache->id();
  h.geometry = g;
  h.source_page_size = ps;
  h.token_begin = o.token_begin;
  const std::set<uint64_t> committed =
      o.resume.has_value() ? std::set<uint64_t>(o.resume->committed_sequence_ids.begin(),
                                                o.resume->committed_sequence_ids.end())
                           : std::set<uint64_t>();
  bool resume_found = !(o.resume.has_value() && o.resume->sequence_id.has_value());
  for (size_t i = 0; i < ids.size(); ++i) {
    Pinned pin;
    pin.sequence_id = ids[i];
    // Pinned as they are now; a concurrent append copies a shared partial page.
    RETURN_IF_ERROR(KvTransferAccess::PinSequence(*cache, ids[i], o.token_begin, o.token_end,
                                                  committed.count(ids[i]) == 0, &pin.ends,
                                                  &pin.pages));
    KvTransferSequence seq;
    seq.sequence_id = ids[i];
    seq.lengths = pin.ends;
    for (int32_t end : pin.ends) h.total_bytes += PayloadBytes(g, end - o.token_begin);
    h.sequences.push_back(std::move(seq));
    if (committed.count(ids[i]) == 0) e->pinned_.push_back(std::move(pin));
  }
  // The resume point: skip to (layer, token) of its sequence.
  if (!resume_found) {
    const KvResumePoint& r = *o.resume;
    for (size_t i = 0; i < e->pinned_.size(); ++i) {
      if (e->pinned_[i].sequence_id != *r.sequence_id) continue;
      const Pinned& p = e->pinned_[i];
      if (r.layer < 0 || r.layer >= g.num_layers || r.token < o.token_begin ||
          r.token > p.ends[size_t(r.layer)]) {
        return InvalidArgument(
            "resume", absl::StrCat("sequence ", *r.sequence_id, " layer ", r.layer, " token ",
                                   r.token, " is outside what the export sends"));
      }
      // Sequences before it are committed or (listed before it) were sent.
      for (size_t k = 0; k < i; ++k) {
        for (const std::vector<int32_t>& layer : e->pinned_[k].pages) {
          KvTransferAccess::Release(*cache, layer);
        }
      }
      e->pinned_.erase(e->pinned_.begin(), e->pinned_.begin() + long(i));
      e->layer_ = r.layer;
      e->token_ = r.token;
      resume_found = true;
      break;
    }
    if (!resume_found) {
      return InvalidArgument("resume.sequence_id",
                             absl::StrCat("sequence ", *r.sequence_id,
                                          " is not among the uncommitted sequences exported"));
    }
  } else {
    e->token_ = o.token_begin;
  }
  const int64_t max_bytes = o.max_chunk_bytes == 0 ? kDefaultKvChunkBytes : o.max_chunk_bytes;
  e->rows_per_chunk_ = std::max<int64_t>(1, max_bytes / PayloadBytes(g, ps)) * ps;
  e->max_chunk_payload_ = PayloadBytes(g, e->rows_per_chunk_);
  // What is left from the start position.
  for (size_t i = 0; i < e->pinned_.size(); ++i) {
    for (int32_t l = 0; l < g.num_layers; ++l) {
      int32_t from = o.token_begin;
      if (i == 0 && l < e->layer_) continue;
      if (i == 0 && l == e->layer_) from = e->token_;
      e->remaining_bytes_ += PayloadBytes(g, e->pinned_[i].ends[size_t(l)] - from);
    }
  }
  e->start_bytes_ = e->remaining_bytes_;
  if (o.read_ahead) {
    {
      absl::MutexLock lock(&e->ahead_mu_);
      e->ahead_want_ = true;  // the first chunk, at once
    }
    KvExporter* raw = e.get();
    e->ahead_ = std::thread([raw] { raw->ReadAhead(); });
  }
  return e;
}

void KvExporter::ReadAhead() {
  while (true) {
    {
      absl::MutexLock lock(&ahead_mu_);
      auto wanted = [this]() ABSL_SHARED_LOCKS_REQUIRED(ahead_mu_) {
        return ahead_want_ || ahead_stop_;
      };
      ahead_mu_.Await(absl::Condition(&wanted));
      if (ahead_stop_) return;
    }
    absl::StatusOr<bool> more = Read(&ahead_chunk_);
    absl::MutexLock lock(&ahead_mu_);
    ahead_want_ = false;
    ahead_result_ = std::move(more);
  }
}

KvExporter::~KvExporter() {
  if (ahead_.joinable()) {
    {
      absl::MutexLock lock(&ahead_mu_);
      ahead_stop_ = true;
    }
    ahead_.join();
  }
  if (cache_ == nullptr) return;
  for (const Pinned& p : pinned_) {
    for (const std::vector<int32_t>& layer : p.pages) KvTransferAccess::Release(*cache_, layer);
  }
}

absl::StatusOr<bool> KvExporter::Next(KvTransferChunk* chunk) {
  if (!ahead_.joinable()) return Read(chunk);
  absl::MutexLock lock(&ahead_mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(ahead_mu_) { return ahead_result_.has_value(); };
  ahead_mu_.Await(absl::Condition(&ready));
  absl::StatusOr<bool> result = *std::move(ahead_result_);
  ahead_result_.reset();
  if (!result.ok() || !*result) {
    ahead_result_ = result;  // the end (or the error) stays the answer
    return result;
  }
  std::swap(*chunk, ahead_chunk_);
  ahead_want_ = true;  // the next one, while the caller sends this one
  return result;
}

absl::StatusOr<bool> KvExporter::Read(KvTransferChunk* chunk) {
  if (seq_ >= pinned_.size()) return false;
  Pinned& p = pinned_[seq_];
  const KvGeometry& g = header_.geometry;
  const int ps = header_.source_page_size;
  const int32_t end = p.ends[size_t(layer_)];
  // Whole source pages: the chunk ends on a page boundary (or at the end).
  const int64_t page_start = int64_t{token_} / ps * ps;
  const int32_t stop = static_cast<int32_t>(std::min<int64_t>(end, page_start + rows_per_chunk_));
  const int32_t n = stop - token_;
  chunk->sequence_id = p.sequence_id;
  chunk->layer = layer_;
  chunk->token_begin = token_;
  chunk->num_tokens = n;
  chunk->k.resize(size_t(n * RowBytes(g, false)));
  chunk->v.resize(size_t(n * RowBytes(g, true)));
  chunk->k_scale.resize(size_t(n * ScaleRowBytes(g, false)));
  chunk->v_scale.resize(size_t(n * ScaleRowBytes(g, true)));
  const KvPages kv = KvTransferAccess::Pages(*cache_);
  AttentionBackend* backend = KvTransferAccess::Backend(*cache_);
  const int64_t first_page = header_.token_begin / ps;
  std::vector<float> block;
  for (int32_t t = token_; t < stop;) {
    const int32_t in_page = t % ps;
    const int32_t take = RunEnd(kv, g, p.pages[size_t(layer_)], first_page, t, stop, ps) - t;
    const int32_t page = p.pages[size_t(layer_)][size_t(t / ps - first_page)];
    const size_t at = size_t(t - token_);
    for (bool v : {false, true}) {
      std::string& rows = v ? chunk->v : chunk->k;
      std::string& scales = v ? chunk->v_scale : chunk->k_scale;
      const int64_t row = RowBytes(g, v), srow = ScaleRowBytes(g, v);
      if (row == 0) continue;
      RETURN_IF_ERROR(ReadPageRows(backend, kv, g, page, v, in_page, in_page + take,
                                   rows.data() + at * size_t(row),
                                   srow > 0 ? scales.data() + at * size_t(srow) : nullptr, &block));
    }
    t += take;
  }
  chunk->crc32c = KvChunkCrc32c(*chunk);
  remaining_bytes_ -= chunk->payload_bytes();
  token_ = stop;
  chunk->sequence_end = false;
  if (token_ == end) {
    ++layer_;
    token_ = header_.token_begin;
    if (layer_ == g.num_layers) {
      chunk->sequence_end = true;
      // This sequence's pins go now: the rest of the export does not read them.
      for (const std::vector<int32_t>& layer : p.pages) KvTransferAccess::Release(*cache_, layer);
      p.pages.clear();
      layer_ = 0;
      ++seq_;
    }
  }
  return true;
}

absl::Status ExportCache(KvPool& pool, const std::string& tenant, const std::string& cache_id,
                         const KvExportOptions& options, const KvChunkSink& sink) {
  ASSIGN_OR_RETURN(std::shared_ptr<KvCache> cache, pool.Find(tenant, cache_id));
  ASSIGN_OR_RETURN(std::unique_ptr<KvExporter> exporter, KvExporter::Start(cache, options));
  bool first = true;
  KvTransferChunk chunk;
  while (true) {
    ASSIGN_OR_RETURN(const bool more, exporter->Next(&chunk));
    if (!more) break;
    RETURN_IF_ERROR(sink(first ? &exporter->header() : nullptr, std::move(chunk)));
    chunk = KvTransferChunk();
    first = false;
  }
  return absl::OkStatus();
}

// --- Import ---

KvImportSession::KvImportSession(KvImportSessions* owner, std::string tenant,
                                 KvTransferHeader header, std::shared_ptr<KvCache> cache,
                                 bool created_cache)
    : owner_(owner),
      tenant_(std::move(tenant)),
      transfer_id_(header.transfer_id),
      cache_(std::move(cache)),
      created_cache_(created_cache) {
  absl::MutexLock lock(&mu_);
  header_ = std::move(header);
  token_ = header_.token_begin;
  last_active_ = absl::Now();
}

KvImportSession::~KvImportSession() {
  absl::MutexLock lock(&mu_);
  DropStaged();
}

void KvImportSession::DropStaged() {
  for (std::vector<int32_t>& layer : staged_.pages) KvTransferAccess::Release(*cache_, layer);
  if (staged_.charged) KvTransferAccess::ChargeSequence(*cache_, -1).IgnoreError();
  bytes_received_ -= staged_.bytes;
  staged_ = Staged();
  started_ = false;
  layer_ = 0;
  token_ = header_.token_begin;
}

int64_t KvImportSession::StagedPages() {
  int64_t n = 0;
  for (const std::vector<int32_t>& layer : staged_.pages) n += static_cast<int64_t>(layer.size());
  return n;
}

KvResumePoint KvImportSession::ResumeLocked() const {
  KvResumePoint r;
  r.committed_sequence_ids = committed_;
  if (started_ && next_seq_ < header_.sequences.size()) {
    r.sequence_id = header_.sequences[next_seq_].sequence_id;
    r.layer = layer_;
    r.token = token_;
  }
  return r;
}

KvImportProgress KvImportSession::Progress() {
  absl::MutexLock lock(&mu_);
  KvImportProgress p;
  p.resume = ResumeLocked();
  p.bytes_received = bytes_received_;
  return p;
}

bool KvImportSession::Done() {
  absl::MutexLock lock(&mu_);
  return next_seq_ >= header_.sequences.size();
}

void KvImportSession::Detach() {
  bool done = false;
  bool undo = false;  // the cache this import created holds nothing of it
  {
    absl::MutexLock lock(&mu_);
    attached_ = false;
    last_active_ = absl::Now();
    done = next_seq_ >= header_.sequences.size();
    // Nothing to resume from (no row kept): the resume creates it again.
    undo = !done && created_cache_ && committed_.empty() && !started_;
  }
  if (done || undo) owner_->Forget(this);
  if (undo) owner_->DropEmptyCreated(tenant_, cache_);
}

namespace {

bool SameGeometry(const KvGeometry& a, const KvGeometry& b) {
  return a.num_layers == b.num_layers && a.num_heads_kv == b.num_heads_kv &&
         a.head_dim == b.head_dim && a.dtype == b.dtype && a.cache_dtype == b.cache_dtype &&
         KvHeadDimV(a) == KvHeadDimV(b) && a.v_in_k == b.v_in_k;
}

}  // namespace

absl::Status KvImportSession::SameHeader(const KvTransferHeader& h) {
  absl::MutexLock lock(&mu_);
  const KvTransferHeader& o = header_;
  bool same = h.transfer_id == o.transfer_id && h.source_cache_id == o.source_cache_id &&
              SameGeometry(h.geometry, o.geometry) && h.source_page_size == o.source_page_size &&
              h.token_begin == o.token_begin && h.total_bytes == o.total_bytes &&
              h.sequences.size() == o.sequences.size();
  for (size_t i = 0; same && i < h.sequences.size(); ++i) {
    same = h.sequences[i].sequence_id == o.sequences[i].sequence_id &&
           h.sequences[i].lengths == o.sequences[i].lengths;
  }
  if (same) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "header: transfer '", o.transfer_id,
      "' was started with another header (its sequences, lengths or geometry differ: the source "
      "changed since); finish it with the same header or start a new transfer_id"));
}

absl::Status KvImportSession::Check(const KvTransferChunk& c) {
  const KvTransferHeader& h = header_;
  const KvGeometry& g = h.geometry;
  if (next_seq_ >= h.sequences.size()) {
    return InvalidArgument(
        "chunk.sequence_id",
        absl::StrCat("every sequence of transfer '", transfer_id_,
                     "' is live; expected no more chunks, got sequence ", c.sequence_id));
  }
  const KvTransferSequence& seq = h.sequences[next_seq_];
  if (c.sequence_id != seq.sequence_id) {
    return InvalidArgument(
        "chunk.sequence_id",
        absl::StrCat("expected ", seq.sequence_id, " (the header's order), got ", c.sequence_id));
  }
  if (c.layer != layer_) {
    return InvalidArgument("chunk.layer", absl::StrCat("expected ", layer_, " (sequence ",
                                                       seq.sequence_id, "), got ", c.layer));
  }
  if (c.token_begin != token_) {
    return InvalidArgument("chunk.token_begin",
                           absl::StrCat("expected ", token_, " (sequence ", seq.sequence_id,
                                        " layer ", layer_, "), got ", c.token_begin));
  }
  const int32_t end = seq.lengths[size_t(layer_)];
  const int32_t lo = end == token_ ? 0 : 1;
  if (c.num_tokens < lo || c.num_tokens > end - token_) {
    return InvalidArgument(
        "chunk.num_tokens",
        absl::StrCat("expected [", lo, ", ", end - token_, "] (sequence ", seq.sequence_id,
                     " layer ", layer_, " ends at ", end, "), got ", c.num_tokens));
  }
  // With v_in_k, v and v_scale are empty: V is part of K's rows.
  const struct {
    const char* field;
    size_t size;
    int64_t row;
  } sizes[] = {{"chunk.k", c.k.size(), RowBytes(g, false)},
               {"chunk.v", c.v.size(), RowBytes(g, true)},
               {"chunk.k_scale", c.k_scale.size(), ScaleRowBytes(g, false)},
               {"chunk.v_scale", c.v_scale.size(), ScaleRowBytes(g, true)}};
  for (const auto& sz : sizes) {
    if (static_cast<int64_t>(sz.size) != c.num_tokens * sz.row) {
      return InvalidArgument(
          sz.field, absl::StrCat("expected ", c.num_tokens * sz.row, " bytes (", c.num_tokens,
                                 " rows of ", sz.row, "), got ", sz.size));
    }
  }
  const bool last = layer_ == g.num_layers - 1 && token_ + c.num_tokens == end;
  if (c.sequence_end != last) {
    return InvalidArgument(
        "chunk.sequence_end",
        absl::StrCat("expected ", last ? "true" : "false", " (sequence ", seq.sequence_id,
                     " layer ", layer_, " tokens [", token_, ", ", token_ + c.num_tokens,
                     ")), got ", c.sequence_end ? "true" : "false"));
  }
  const uint32_t crc = KvChunkCrc32c(c);
  if (crc != c.crc32c) {
    owner_->checksum_failures_.fetch_add(1, std::memory_order_relaxed);
    return absl::DataLossError(absl::StrCat(
        "chunk.crc32c: expected ", crc, " (CRC-32C of the chunk's k, v, k_scale, v_scale), got ",
        c.crc32c, " for sequence ", seq.sequence_id, " layer ", layer_, " tokens [", token_, ", ",
        token_ + c.num_tokens, "); the chunk was not kept: send it again"));
  }
  return absl::OkStatus();
}

absl::Status KvImportSession::Stage(const KvTransferChunk& c) {
  const KvTransferHeader& h = header_;
  const KvGeometry& g = h.geometry;
  KvCache& cache = *cache_;
  const int ps = cache.page_size();
  const uint64_t id = h.sequences[next_seq_].sequence_id;
  if (!started_) {
    // The sequence's first chunk: the target's state, then its bookkeeping.
    RETURN_IF_ERROR(KvTransferAccess::CheckTarget(cache, id, h.token_begin));
    if (h.token_begin == 0) {
      RETURN_IF_ERROR(KvTransferAccess::ChargeSequence(cache, 1));
      staged_.charged = true;
    }
    staged_.pages.assign(size_t(g.num_layers), {});
    staged_.base = h.token_begin / ps * ps;
    started_ = true;
  }
  if (c.num_tokens == 0) return absl::OkStatus();
  std::vector<int32_t>& pages = staged_.pages[size_t(c.layer)];
  const int64_t need = PagesFor(int64_t{c.token_begin} + c.num_tokens - staged_.base, ps) -
                       static_cast<int64_t>(pages.size());
  if (need > 0) {
    absl::Status allocated = KvTransferAccess::Allocate(cache, need, &pages);
    if (!allocated.ok()) {
      DropStaged();
      return absl::Status(
          allocated.code(),
          absl::StrCat(allocated.message(), " (importing sequence ", id, " of transfer '",
                       transfer_id_,
                       "': its staged rows were returned; a resume starts it again)"));
    }
  }
  const KvPages kv = KvTransferAccess::Pages(cache);
  AttentionBackend* backend = KvTransferAccess::Backend(cache);
  std::vector<float> block;
  const int32_t stop = c.token_begin + c.num_tokens;
  for (int32_t t = c.token_begin; t < stop;) {
    const int32_t in_page = t % ps;
    const int32_t take = RunEnd(kv, g, pages, staged_.base / ps, t, stop, ps) - t;
    const int32_t page = pages[size_t((t - staged_.base) / ps)];
    const size_t at = size_t(t - c.token_begin);
    for (bool v : {false, true}) {
      const std::string& rows = v ? c.v : c.k;
      const std::string& scales = v ? c.v_scale : c.k_scale;
      const int64_t row = RowBytes(g, v), srow = ScaleRowBytes(g, v);
      if (row == 0) continue;
      RETURN_IF_ERROR(WritePageRows(
          backend, kv, g, page, v, in_page, in_page + take, rows.data() + at * size_t(row),
          srow > 0 ? scales.data() + at * size_t(srow) : nullptr, &block));
    }
    t += take;
  }
  return absl::OkStatus();
}

absl::Status KvImportSession::Install() {
  const KvTransferHeader& h = header_;
  const KvTransferSequence& seq = h.sequences[next_seq_];
  return KvTransferAccess::Install(
      *cache_, seq.sequence_id, h.token_begin, staged_.base, &staged_.pages, seq.lengths,
      std::max(RowBytes(h.geometry, false), RowBytes(h.geometry, true)),
      ScaleRowBytes(h.geometry, false));
}

absl::StatusOr<KvImportProgress> KvImportSession::Accept(const KvTransferChunk& c) {
  absl::MutexLock lock(&mu_);
  last_active_ = absl::Now();
  cache_->Touch();
  RETURN_IF_ERROR(Check(c));
  RETURN_IF_ERROR(Stage(c));
  const KvTransferSequence& seq = header_.sequences[next_seq_];
  bytes_received_ += c.payload_bytes();
  staged_.bytes += c.payload_bytes();
  owner_->bytes_imported_.fetch_add(c.payload_bytes(), std::memory_order_relaxed);
  token_ += c.num_tokens;
  KvImportProgress progress;
  if (token_ == seq.lengths[size_t(layer_)]) {
    ++layer_;
    token_ = header_.token_begin;
  }
  if (layer_ == header_.geometry.num_layers) {
    const absl::Status installed = Install();
    if (!installed.ok()) {
      // The target changed under the import (created, appended to, freed):
      // the sequence's rows go and a resume starts it again.
      DropStaged();
      return installed;
    }
    // The live sequence holds the pages and the bookkeeping charge now.
    staged_ = Staged();
    started_ = false;
    committed_.push_back(seq.sequence_id);
    ++next_seq_;
    layer_ = 0;
    token_ = header_.token_begin;
    owner_->sequences_imported_.fetch_add(1, std::memory_order_relaxed);
    progress.sequence_committed = true;
  }
  progress.resume = ResumeLocked();
  progress.bytes_received = bytes_received_;
  return progress;
}

// --- Sessions ---

KvImportSessions::KvImportSessions(KvPool* pool, const KvImportOptions& options)
    : pool_(pool), options_(options) {
  if (options_.idle_timeout > absl::ZeroDuration()) {
    expiry_ = std::thread([this] {
      const absl::Duration period = IdleScanPeriod(options_.idle_timeout);
      while (true) {
        {
          absl::MutexLock lock(&mu_);
          auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
          if (mu_.AwaitWithTimeout(absl::Condition(&stop), period)) return;
        }
        ExpireIdle(absl::Now());
      }
    });
  }
}

KvImportSessions::~KvImportSessions() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (expiry_.joinable()) expiry_.join();
}

namespace {

absl::Status CheckHeader(const KvTransferHeader& h, const KvCache& cache) {
  if (!ValidTransferId(h.transfer_id)) {
    return InvalidArgument("header.transfer_id",
                           absl::StrCat("expected 1..128 characters of [A-Za-z0-9._-], got '",
                                        h.transfer_id.substr(0, 64), "'"));
  }
  const KvGeometry& a = h.geometry;
  const KvGeometry& b = cache.geometry();
  const std::pair<const char*, std::pair<int, int>> fields[] = {
      {"header.geometry.num_layers", {a.num_layers, b.num_layers}},
      {"header.geometry.num_heads_kv", {a.num_heads_kv, b.num_heads_kv}},
      {"header.geometry.head_dim", {a.head_dim, b.head_dim}},
      {"header.geometry.head_dim_v", {KvHeadDimV(a), KvHeadDimV(b)}},
      {"header.geometry.v_in_k", {a.v_in_k ? 1 : 0, b.v_in_k ? 1 : 0}},
      {"header.geometry.dtype", {static_cast<int>(a.dtype), static_cast<int>(b.dtype)}},
      {"header.geometry.cache_dtype",
       {static_cast<int>(a.cache_dtype == DType{0} ? a.dtype : a.cache_dtype),
        static_cast<int>(b.cache_dtype)}}};
  for (const auto& [field, v] : fields) {
    if (v.first != v.second) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": the receiving cache '", cache.id(), "' has ", v.second, ", the transfer ",
          v.first, " (a cache's geometry and page dtype are fixed at creation)"));
    }
  }
  const int32_t ps = h.source_page_size;
  if (ps < kMinPageSize || ps > kMaxPageSize || (ps & (ps - 1)) != 0) {
    return InvalidArgument("header.source_page_size",
                           absl::StrCat("expected a power of two in [16, 256], got ", ps));
  }
  if (h.token_begin < 0) {
    return InvalidArgument("header.token_begin",
                           absl::StrCat("expected >= 0, got ", h.token_begin));
  }
  if (h.sequences.size() > size_t{kMaxKvIdsPerCall}) {
    return InvalidArgument("header.sequences", absl::StrCat("expected at most ", kMaxKvIdsPerCall,
                                                            ", got ", h.sequences.size()));
  }
  std::set<uint64_t> seen;
  for (size_t i = 0; i < h.sequences.size(); ++i) {
    const KvTransferSequence& s = h.sequences[i];
    const std::string field = absl::StrCat("header.sequences[", i, "]");
    if (!seen.insert(s.sequence_id).second) {
      return InvalidArgument(field + ".sequence_id",
                             absl::StrCat(s.sequence_id, " is listed twice"));
    }
    if (static_cast<int>(s.lengths.size()) != a.num_layers) {
      return InvalidArgument(
          field + ".lengths",
          absl::StrCat("expected ", a.num_layers, " (one per layer), got ", s.lengths.size()));
    }
    for (size_t l = 0; l < s.lengths.size(); ++l) {
      // A sequence longer than the cache's capacity could never be staged.
      if (s.lengths[l] < h.token_begin ||
          int64_t{s.lengths[l]} > cache.capacity_pages() * cache.page_size()) {
        return InvalidArgument(
            absl::StrCat(field, ".lengths[", l, "]"),
            absl::StrCat("expected [", h.token_begin, ", ",
                         cache.capacity_pages() * cache.page_size(), "], got ", s.lengths[l]));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<KvImportSession>> KvImportSessions::Attach(
    const std::string& tenant, const std::string& cache_id,
    const std::optional<KvImportCreate>& create, const KvTransferHeader& header) {
  if (!ValidTransferId(header.transfer_id)) {
    return InvalidArgument("header.transfer_id",
                           absl::StrCat("expected 1..128 characters of [A-Za-z0-9._-], got '",
                                        header.transfer_id.substr(0, 64), "'"));
  }
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find({tenant, header.transfer_id});
  if (it != sessions_.end()) {
    std::shared_ptr<KvImportSession> s = it->second;
    if (s->cache_->id() != cache_id) {
      return InvalidArgument(
          "cache_id", absl::StrCat("transfer '", header.transfer_id, "' imports into cache '",
                                   s->cache_->id(), "', got '", cache_id.substr(0, 128), "'"));
    }
    RETURN_IF_ERROR(s->SameHeader(header));
    // The cache must still be the tenant's (not dropped since the cut).
    ASSIGN_OR_RETURN(std::shared_ptr<KvCache> live, pool_->Find(tenant, cache_id));
    if (live != s->cache_) {
      return absl::NotFoundError(absl::StrCat("cache '", cache_id, "' was dropped since transfer '",
                                              header.transfer_id, "' began"));
    }
    absl::MutexLock session_lock(&s->mu_);
    if (s->attached_) {
      // ABORTED: a conflict that ends with the other stream (often a cut one
      // the server has not closed yet); the sender retries.
      return absl::AbortedError(
          absl::StrCat("header.transfer_id: another stream is importing transfer '",
                       header.transfer_id, "'; resume after it ends"));
    }
    s->attached_ = true;
    s->last_active_ = absl::Now();
    return s;
  }
  absl::StatusOr<std::shared_ptr<KvCache>> cache = pool_->Find(tenant, cache_id);
  bool created = false;
  if (absl::IsNotFound(cache.status()) && create.has_value()) {
    KvCreateCache c;
    c.geometry = header.geometry;
    c.page_size = header.source_page_size;
    c.capacity_tokens = create->capacity_tokens;
    c.capacity_bytes = create->capacity_bytes;
    c.cache_id = cache_id;
    c.device = create->device;
    c.reserve = create->reserve;
    cache = pool_->CreateCache(tenant, c);
    if (!cache.ok()) {
      return absl::Status(cache.status().code(),
                          absl::StrCat("create: ", cache.status().message()));
    }
    created = true;
  }
  if (!cache.ok()) return cache.status();
  absl::Status usable = RefuseSpanning(**cache, "an import");
  if (usable.ok()) usable = CheckHeader(header, **cache);
  if (!usable.ok()) {
    // A refused import leaves no cache of its own behind.
    if (created) pool_->DropCache(tenant, cache_id).IgnoreError();
    return usable;
  }
  auto session = std::make_shared<KvImportSession>(this, tenant, header, *cache, created);
  {
    absl::MutexLock session_lock(&session->mu_);
    session->attached_ = true;
  }
  sessions_.emplace(std::make_pair(tenant, header.transfer_id), session);
  return session;
}

void KvImportSessions::Forget(const KvImportSession* session) {
  std::shared_ptr<KvImportSession> gone;  // destroyed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find({session->tenant_, session->transfer_id_});
  if (it != sessions_.end() && it->second.get() == session) {
    gone = std::move(it->second);
    sessions_.erase(it);
  }
}

void KvImportSessions::DropEmptyCreated(const std::string& tenant,
                                        const std::shared_ptr<KvCache>& cache) {
  // Under the lock Attach creates and finds caches under: no import attaches
  // to it meanwhile, and another import into it (a second transfer) keeps it.
  absl::MutexLock lock(&mu_);
  for (const auto& [key, s] : sessions_) {
    if (s->cache_ == cache) return;
  }
  absl::StatusOr<std::shared_ptr<KvCache>> live = pool_->Find(tenant, cache->id());
  if (!live.ok() || *live != cache || cache->Stats().sequences > 0) return;
  pool_->DropCache(tenant, cache->id()).IgnoreError();
}

void KvImportSessions::ExpireIdle(absl::Time now) {
  const absl::Time cutoff = now - options_.idle_timeout;
  std::vector<std::shared_ptr<KvImportSession>> gone;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      KvImportSession& s = *it->second;
      bool idle = false;
      {
        absl::MutexLock session_lock(&s.mu_);
        idle = !s.attached_ && s.last_active_ < cutoff;
      }
      if (idle) {
        gone.push_back(std::move(it->second));
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  expired_.fetch_add(static_cast<int64_t>(gone.size()), std::memory_order_relaxed);
  // Staged pages go back as the sessions are destroyed, outside the lock; a
  // cache an expired import created and made nothing live in goes too.
  for (std::shared_ptr<KvImportSession>& s : gone) {
    bool undo = false;
    {
      absl::MutexLock lock(&s->mu_);
      undo = s->created_cache_ && s->committed_.empty();
    }
    std::shared_ptr<KvCache> cache = s->cache_;
    const std::string tenant = s->tenant_;
    s.reset();
    if (undo) DropEmptyCreated(tenant, cache);
  }
}

KvImportStats KvImportSessions::Stats() {
  std::vector<std::shared_ptr<KvImportSession>> sessions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, s] : sessions_) sessions.push_back(s);
  }
  KvImportStats st;
  st.sessions = static_cast<int64_t>(sessions.size());
  for (const std::shared_ptr<KvImportSession>& s : sessions) {
    absl::MutexLock lock(&s->mu_);
    st.staged_pages += s->StagedPages();
  }
  st.expired_sessions = expired_.load(std::memory_order_relaxed);
  st.sequences_imported = sequences_imported_.load(std::memory_order_relaxed);
  st.bytes_imported = bytes_imported_.load(std::memory_order_relaxed);
  st.checksum_failures = checksum_failures_.load(std::memory_order_relaxed);
  return st;
}

int64_t KvMaxChunkBytes(const KvGeometry& g, int32_t page_size, int64_t max_chunk_bytes) {
  const int64_t max_bytes = max_chunk_bytes == 0 ? kDefaultKvChunkBytes : max_chunk_bytes;
  const int64_t page = std::max<int64_t>(1, PayloadBytes(g, page_size));
  return std::max<int64_t>(1, max_bytes / page) * page;
}

}  // namespace attnserve
