// One K/V cache's sequences, claims, reservations and expiry; see kv_cache.h.
#include "server/kv/kv_cache.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

int64_t PagesFor(int64_t tokens, int page_size) { return (tokens + page_size - 1) / page_size; }

absl::Status SequenceNotFound(uint64_t id) {
  return absl::NotFoundError(absl::StrCat("sequence ", id,
                                          " not found in this cache (never created, freed or "
                                          "expired): create it again and re-prefill"));
}

absl::Status TooManyIds(const char* field, size_t n) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected at most ", kMaxKvIdsPerCall, " per call, got ", n));
}

// attend_pages of step `index` against the history it names (`len` tokens at
// `layer`): every index a page of that history, strictly increasing.
absl::Status CheckAttendPages(const KvStep& st, int index, int32_t len, int32_t layer,
                              int page_size, const FieldNames& names) {
  const absl::Span<const int32_t> pages = st.attend_pages;
  if (pages.empty()) return absl::OkStatus();
  const std::string field = names.step(index, "attend_pages");
  if (len == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": sequence ", st.sequence_id, " has no tokens at layer ", layer,
                     ", so there are no history pages to choose: expected none, got ", pages.size(),
                     "; nothing was appended"));
  }
  const int64_t history_pages = PagesFor(len, page_size);
  for (size_t j = 0; j < pages.size(); ++j) {
    if (pages[j] < 0 || pages[j] >= history_pages || (j > 0 && pages[j] <= pages[j - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": expected strictly increasing page indices in [0, ", history_pages,
          ") (sequence ", st.sequence_id, " has ", len, " tokens at layer ", layer, " in pages of ",
          page_size, "), got ", field, "[", j, "] = ", pages[j], "; nothing was appended"));
    }
  }
  return absl::OkStatus();
}

// The first page of the sequence that holds a new token, or none (-1).
int64_t FirstNewPage(const KvStep& st, int32_t len, int page_size) {
  return st.num_new > 0 ? len / page_size : -1;
}

// How many pages step `st` attends: all of them, or with attend_pages the
// named history pages plus the pages holding the new tokens.
int64_t AttendedPageCount(const KvStep& st, int32_t len, int page_size) {
  const int64_t all = PagesFor(int64_t{len} + st.num_new, page_size);
  if (st.attend_pages.empty()) return all;
  const int64_t first_new = FirstNewPage(st, len, page_size);
  int64_t named = 0;
  for (int32_t p : st.attend_pages) named += first_new < 0 || p < first_new;
  return named + (first_new < 0 ? 0 : all - first_new);
}

// Writes the pages step `st` attends out of `table` (its pages after the
// append) to `out`, in token order, and returns the tokens they hold. Only
// the sequence's last page may be partial, and it stays last, so the new
// rows land at the end of the compacted sequence, where the launch appends.
int32_t AttendedPages(const std::vector<int32_t>& table, const KvStep& st, int32_t len,
                      int page_size, int32_t* out) {
  const int64_t after = int64_t{len} + st.num_new;
  if (st.attend_pages.empty()) {
    std::copy(table.begin(), table.end(), out);
    return static_cast<int32_t>(after);
  }
  const int64_t first_new = FirstNewPage(st, len, page_size);
  int64_t tokens = 0;
  auto take = [&](int64_t page) {
    *out++ = table[size_t(page)];
    tokens += std::min<int64_t>(page_size, after - page * page_size);
  };
  for (int32_t p : st.attend_pages) {
    if (first_new < 0 || p < first_new) take(p);
  }
  if (first_new >= 0) {
    for (int64_t p = first_new; p < static_cast<int64_t>(table.size()); ++p) take(p);
  }
  return static_cast<int32_t>(tokens);
}

}  // namespace

absl::Status KvLedger::Charge(const std::string& tenant, int device, int64_t pages, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (tenants_ != nullptr) {
    auto it = held_.find(tenant);
    const int64_t held_pages = it == held_.end() ? 0 : it->second.pages;
    const int64_t held_bytes = it == held_.end() ? 0 : it->second.bytes[device];
    RETURN_IF_ERROR(
        tenants_->CheckKv(tenant, held_pages, pages, held_bytes, bytes, device_budget_));
    // Reservations are honoured: what was reserved can always be allocated.
    const int64_t total = device_total_[device];
    if (bytes > 0 && total + bytes > device_budget_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "device ", device, ": the K/V budget (--kv_cache_bytes ", device_budget_, ") has ",
          device_budget_ - total, " bytes not reserved by caches, this needs ", bytes,
          " (a cache reserves its capacity when it is created)"));
    }
  }
  Held& h = held_[tenant];
  h.pages += pages;
  h.bytes[device] += bytes;
  device_total_[device] += bytes;
  return absl::OkStatus();
}

void KvLedger::Refund(const std::string& tenant, int device, int64_t pages, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(tenant);
  if (it == held_.end()) return;
  it->second.pages -= pages;
  it->second.bytes[device] -= bytes;
  device_total_[device] -= bytes;
  if (it->second.pages == 0 && it->second.bytes[device] == 0) it->second.bytes.erase(device);
  if (it->second.pages == 0 && it->second.bytes.empty()) held_.erase(it);
}

namespace {

std::vector<std::unique_ptr<PageAllocator>> MakeShards(const std::vector<KvShardSpec>& specs,
                                                       const KvGeometry& g, int page_size) {
  std::vector<std::unique_ptr<PageAllocator>> shards;
  for (const KvShardSpec& spec : specs) {
    shards.push_back(std::make_unique<PageAllocator>(
        spec.backend, spec.budget, page_size, KvKPageBytes(g, page_size), spec.capacity_pages,
        IsFp8Cache(g), KvVPageBytes(g, page_size), g.v_in_k));
  }
  return shards;
}

std::vector<int32_t> ShardBases(const std::vector<KvShardSpec>& specs) {
  std::vector<int32_t> bases;
  int64_t next = 0;
  for (const KvShardSpec& spec : specs) {
    bases.push_back(static_cast<int32_t>(next));
    next += spec.capacity_pages;
  }
  return bases;
}

std::vector<int> DevicesOf(const std::vector<KvShardSpec>& specs) {
  std::vector<int> devices;
  for (const KvShardSpec& spec : specs) devices.push_back(spec.device);
  return devices;
}

}  // namespace

KvCache::KvCache(std::string tenant, std::string id, const KvGeometry& geometry, int page_size,
                 int64_t capacity_pages, int device, AttentionBackend* backend,
                 std::shared_ptr<DeviceBudget> budget, std::shared_ptr<KvLedger> ledger)
    : KvCache(std::move(tenant), std::move(id), geometry, page_size,
              {KvShardSpec{device, backend, std::move(budget), capacity_pages}},
              std::move(ledger)) {}

KvCache::KvCache(std::string tenant, std::string id, const KvGeometry& geometry, int page_size,
                 const std::vector<KvShardSpec>& shards, std::shared_ptr<KvLedger> ledger)
    : tenant_(std::move(tenant)),
      id_(std::move(id)),
      geometry_(geometry),
      page_size_(page_size),
      device_(shards.front().device),
      devices_(DevicesOf(shards)),
      budget_(shards.front().budget),
      ledger_(std::move(ledger)),
      shards_(MakeShards(shards, geometry, page_size)),
      shard_base_(ShardBases(shards)),
      allocator_(*shards_.front()),
      last_used_(absl::Now()) {}

KvCache::~KvCache() {
  absl::MutexLock lock(&mu_);
  if (ledger_ != nullptr) {
    ledger_->Refund(tenant_, device_, bookkeeping_pages_, bookkeeping_bytes_);
    if (joined_) {
      for (size_t i = 0; i < shards_.size(); ++i) {
        ledger_->Refund(tenant_, devices_[i], shards_[i]->capacity_pages(),
                        shards_[i]->ceiling_bytes());
      }
    }
  }
  budget_->Give(bookkeeping_bytes_);
}

absl::Status KvCache::Join() {
  absl::MutexLock lock(&mu_);
  if (ledger_ == nullptr || joined_) return absl::OkStatus();
  // Each shard's capacity is charged to its device, all or nothing.
  for (size_t i = 0; i < shards_.size(); ++i) {
    const absl::Status charged = ledger_->Charge(tenant_, devices_[i], shards_[i]->capacity_pages(),
                                                 shards_[i]->ceiling_bytes());
    if (!charged.ok()) {
      for (size_t j = 0; j < i; ++j) {
        ledger_->Refund(tenant_, devices_[j], shards_[j]->capacity_pages(),
                        shards_[j]->ceiling_bytes());
      }
      return charged;
    }
  }
  joined_ = true;
  return absl::OkStatus();
}

int KvCache::ShardOf(int32_t page) const {
  return static_cast<int>(std::upper_bound(shard_base_.begin(), shard_base_.end(), page) -
                          shard_base_.begin()) -
         1;
}

void KvCache::AddRefPage(int32_t page) {
  const int s = ShardOf(page);
  shards_[size_t(s)]->AddRef(page - shard_base_[size_t(s)]);
}

void KvCache::ReleasePage(int32_t page) {
  const int s = ShardOf(page);
  shards_[size_t(s)]->Release(page - shard_base_[size_t(s)]);
}

int32_t KvCache::RefsOf(int32_t page) const {
  const int s = ShardOf(page);
  return shards_[size_t(s)]->refs(page - shard_base_[size_t(s)]);
}

absl::Status KvCache::ChargeSequences(int64_t count) {
  const int64_t bytes = count * KvSequenceBytes(geometry_.num_layers);
  const int64_t after = bookkeeping_bytes_ + bytes;
  const int64_t pb = page_bytes();
  const int64_t pages_after = (after + pb - 1) / pb;
  const int64_t pages = pages_after - bookkeeping_pages_;
  if (count > 0) {
    if (ledger_ != nullptr) RETURN_IF_ERROR(ledger_->Charge(tenant_, device_, pages, bytes));
    if (!budget_->TryTake(bytes)) {
      if (ledger_ != nullptr) ledger_->Refund(tenant_, device_, pages, bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat("the device's K/V budget (--kv_cache_bytes ", budget_->limit(), ") has ",
                       budget_->limit() - budget_->used(), " bytes left, the bookkeeping of ",
                       count, " sequence(s) of ", geometry_.num_layers, " layers needs ", bytes));
    }
  } else {
    if (ledger_ != nullptr) ledger_->Refund(tenant_, device_, -pages, -bytes);
    budget_->Give(-bytes);
  }
  bookkeeping_bytes_ = after;
  bookkeeping_pages_ = pages_after;
  return absl::OkStatus();
}

int64_t KvCache::page_bytes() const { return KvGeometryPageBytes(geometry_, page_size_); }

absl::Status KvCache::ReserveAll() {
  absl::MutexLock lock(&mu_);
  for (const auto& shard : shards_) RETURN_IF_ERROR(shard->ReserveAll());
  return absl::OkStatus();
}

void KvCache::Touch() {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
}

absl::StatusOr<KvCache::Sequence*> KvCache::Find(uint64_t id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return SequenceNotFound(id);
  return &it->second;
}

absl::Status KvCache::CreateSequences(const std::vector<KvSequenceSpec>& specs,
                                      const FieldNames& names) {
  if (specs.size() > size_t{kMaxKvIdsPerCall}) return TooManyIds("sequences", specs.size());
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  // Check everything first: all or nothing.
  std::set<uint64_t> new_ids;
  for (size_t i = 0; i < specs.size(); ++i) {
    const KvSequenceSpec& s = specs[i];
    if (sequences_.count(s.sequence_id) > 0 || !new_ids.insert(s.sequence_id).second) {
      return absl::AlreadyExistsError(absl::StrCat(names.step(static_cast<int>(i), "sequence_id"),
                                                   " ", s.sequence_id,
                                                   " already exists in the cache"));
    }
    if (!s.fork_from.has_value()) continue;
    auto src = sequences_.find(*s.fork_from);
    if (src == sequences_.end()) {
      return absl::NotFoundError(absl::StrCat(names.step(static_cast<int>(i), "fork_from"),
                                              ": sequence ", *s.fork_from,
                                              " not found in this cache"));
    }
    const std::vector<int32_t>& lens = src->second.lengths;
    const int32_t shortest = *std::min_element(lens.begin(), lens.end());
    const int32_t longest = *std::max_element(lens.begin(), lens.end());
    if (s.fork_length.has_value() ? (*s.fork_length < 0 || *s.fork_length > shortest)
                                  : shortest != longest) {
      return absl::InvalidArgumentError(absl::StrCat(
          names.step(static_cast<int>(i), "fork_length"), ": expected ",
          s.fork_length.has_value() ? "a value in [0, "
                                    : "to be set (the source's lengths differ "
                                      "by layer: [",
          shortest, s.fork_length.has_value() ? "]" : absl::StrCat(", ", longest, "])"), ", got ",
          s.fork_length.has_value() ? absl::StrCat(*s.fork_length) : "unset"));
    }
  }
  // Last of the checks: what it charges is the only thing to undo.
  RETURN_IF_ERROR(ChargeSequences(static_cast<int64_t>(specs.size())));
  const absl::Time now = absl::Now();
  for (const KvSequenceSpec& s : specs) {
    Sequence seq;
    seq.pages.resize(size_t(geometry_.num_layers));
    seq.lengths.assign(size_t(geometry_.num_layers), 0);
    if (spanning()) seq.segments.resize(size_t(geometry_.num_layers));
    seq.last_used = now;
    if (s.fork_from.has_value()) {
      Sequence& src = sequences_.at(*s.fork_from);
      src.last_used = now;
      for (int l = 0; l < geometry_.num_layers; ++l) {
        const int32_t len = s.fork_length.value_or(src.lengths[l]);
        // Shares every page the prefix touches, the partial last one too: the
        // first append that writes into it copies it (Reserve).
        if (spanning()) seq.segments[l] = src.segments[l];
        const int64_t n = spanning() ? KeepSegments(&seq.segments[l], len, page_size_)
                                     : PagesFor(len, page_size_);
        seq.pages[l].assign(src.pages[l].begin(), src.pages[l].begin() + n);
        for (int32_t p : seq.pages[l]) AddRefPage(p);
        seq.lengths[l] = len;
      }
    }
    sequences_.emplace(s.sequence_id, std::move(seq));
  }
  return absl::OkStatus();
}

void KvCache::TruncateLayer(Sequence& s, int layer, int32_t length) {
  std::vector<int32_t>& pages = s.pages[layer];
  const int64_t keep = spanning() ? KeepSegments(&s.segments[layer], length, page_size_)
                                  : PagesFor(length, page_size_);
  for (size_t i = size_t(keep); i < pages.size(); ++i) ReleasePage(pages[i]);
  pages.resize(size_t(keep));
  s.lengths[layer] = length;
}

absl::Status KvCache::Truncate(uint64_t sequence_id, std::optional<int32_t> layer, int32_t length) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  auto found = Find(sequence_id);
  if (!found.ok()) return found.status();
  Sequence& s = **found;
  if (layer.has_value() && (*layer < 0 || *layer >= geometry_.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: expected [0, ", geometry_.num_layers, "), got ", *layer));
  }
  if (s.active_calls > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence_id, " has ", s.active_calls,
                     " append-and-attend call(s) in flight; truncate after they complete"));
  }
  const int first = layer.value_or(0);
  const int last = layer.has_value() ? *layer + 1 : geometry_.num_layers;
  for (int l = first; l < last; ++l) {
    if (length < 0 || length > s.lengths[l]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "length: expected [0, ", s.lengths[l], "] (the length at layer ", l, "), got ", length));
    }
  }
  for (int l = first; l < last; ++l) TruncateLayer(s, l, length);
  s.last_used = absl::Now();
  return absl::OkStatus();
}

void KvCache::ReleaseSequence(Sequence& s) {
  for (std::vector<int32_t>& layer : s.pages) {
    for (int32_t p : layer) ReleasePage(p);
    layer.clear();
  }
  for (std::vector<KvSegment>& layer : s.segments) layer.clear();
  ChargeSequences(-1).IgnoreError();  // a refund cannot fail
}

absl::Status KvCache::Free(const std::vector<uint64_t>& sequence_ids) {
  if (sequence_ids.size() > size_t{kMaxKvIdsPerCall}) {
    return TooManyIds("sequence_ids", sequence_ids.size());
  }
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  std::set<uint64_t> seen;
  for (size_t i = 0; i < sequence_ids.size(); ++i) {
    auto found = Find(sequence_ids[i]);
    if (!found.ok()) return found.status();
    if (!seen.insert(sequence_ids[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence_ids[", i, "]: ", sequence_ids[i], " is listed twice"));
    }
    if ((*found)->active_calls > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", sequence_ids[i], " has ", (*found)->active_calls,
                       " append-and-attend call(s) in flight; free it after they complete"));
    }
  }
  for (uint64_t id : sequence_ids) {
    ReleaseSequence(sequences_.at(id));
    sequences_.erase(id);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> KvCache::FreeWhenIdle(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  auto found = Find(sequence_id);
  if (!found.ok()) return found.status();
  if ((*found)->active_calls > 0) {
    (*found)->free_when_idle = true;
    return false;
  }
  ReleaseSequence(**found);
  sequences_.erase(sequence_id);
  return true;
}

absl::StatusOr<std::vector<int32_t>> KvCache::Lengths(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto found = Find(sequence_id);
  if (!found.ok()) return found.status();
  return (*found)->lengths;
}

KvCacheStats KvCache::Stats() {
  absl::MutexLock lock(&mu_);
  KvCacheStats s;
  s.cache_id = id_;
  s.geometry = geometry_;
  s.page_size = page_size_;
  s.device = device_;
  s.page_bytes = allocator_.page_bytes();
  for (size_t i = 0; i < shards_.size(); ++i) {
    const PageAllocator& a = *shards_[i];
    s.shards.push_back({devices_[i], a.capacity_pages(), a.pages_used(), a.bytes_allocated()});
    s.capacity_pages += a.capacity_pages();
    s.pages_used += a.pages_used();
    s.bytes_allocated += a.bytes_allocated();
  }
  s.sequences = static_cast<int64_t>(sequences_.size());
  s.expired_sequences = expired_;
  for (const auto& [id, seq] : sequences_) {
    for (int32_t len : seq.lengths) s.tokens += len;
  }
  return s;
}

absl::StatusOr<bool> KvCache::Admit(const std::shared_ptr<Ticket>& ticket) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  for (uint64_t id : ticket->sequence_ids) {
    auto found = sequences_.find(id);
    if (found == sequences_.end()) return SequenceNotFound(id);
    if (found->second.free_when_idle) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", id,
                       " is ending (sequence_end arrived while calls were in flight); it is freed "
                       "when they complete"));
    }
  }
  for (uint64_t id : ticket->sequence_ids) ++sequences_.at(id).active_calls;
  ++active_calls_;
  // It may go unless an earlier call (running or waiting) holds one of its pairs.
  std::set<Key> blocked = claimed_;
  for (const std::shared_ptr<Ticket>& w : waiting_) {
    for (uint64_t id : w->sequence_ids) blocked.insert({id, w->layer});
  }
  for (uint64_t id : ticket->sequence_ids) {
    if (blocked.count({id, ticket->layer}) > 0) {
      waiting_.push_back(ticket);
      return false;
    }
  }
  for (uint64_t id : ticket->sequence_ids) claimed_.insert({id, ticket->layer});
  return true;
}

std::vector<std::shared_ptr<KvCache::Ticket>> KvCache::Release(const Ticket& ticket) {
  absl::MutexLock lock(&mu_);
  last_used_ = absl::Now();
  --active_calls_;
  for (uint64_t id : ticket.sequence_ids) {
    claimed_.erase({id, ticket.layer});
    auto it = sequences_.find(id);
    if (it != sequences_.end()) {
      --it->second.active_calls;
      it->second.last_used = last_used_;
      // The last call on a sequence whose end came while it ran frees it.
      if (it->second.active_calls == 0 && it->second.free_when_idle) {
        ReleaseSequence(it->second);
        sequences_.erase(it);
      }
    }
  }
  // Waiting calls go in arrival order: one may pass another only when they
  // share no pair.
  std::vector<std::shared_ptr<Ticket>> ready;
  std::set<Key> blocked = claimed_;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    const Ticket& w = **it;
    bool free = true;
    for (uint64_t id : w.sequence_ids) free = free && blocked.count({id, w.layer}) == 0;
    for (uint64_t id : w.sequence_ids) blocked.insert({id, w.layer});
    if (free) {
      for (uint64_t id : w.sequence_ids) claimed_.insert({id, w.layer});
      ready.push_back(*it);
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  return ready;
}

absl::Status KvCache::Reserve(int32_t layer, const std::vector<KvStep>& steps, KvReservation* r,
                              const FieldNames& names) {
  if (spanning()) {
    return absl::InternalError(
        absl::StrCat("cache '", id_, "' spans devices: use ReserveSpanning"));
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  last_used_ = now;
  // First pass: lengths and the number of pages, so allocation is all or nothing.
  int64_t needed = 0;
  int64_t widest = 1;
  for (size_t i = 0; i < steps.size(); ++i) {
    const KvStep& st = steps[i];
    auto found = Find(st.sequence_id);
    if (!found.ok()) return found.status();
    const Sequence& s = **found;
    const int32_t len = s.lengths[layer];
    if (st.expected_length != kAnyLength && st.expected_length != len) {
      return absl::FailedPreconditionError(absl::StrCat(
          names.step(static_cast<int>(i), "expected_length"), ": sequence ", st.sequence_id,
          " has ", len, " tokens at layer ", layer, ", the call expected ", st.expected_length,
          " (a retry of a call that already applied, or a call out of order); nothing was "
          "appended"));
    }
    RETURN_IF_ERROR(CheckAttendPages(st, static_cast<int>(i), len, layer, page_size_, names));
    const int64_t after = int64_t{len} + st.num_new;
    needed += PagesFor(after, page_size_) - static_cast<int64_t>(s.pages[layer].size());
    const bool partial = len % page_size_ != 0;
    if (st.num_new > 0 && partial && allocator_.refs(s.pages[layer].back()) > 1) ++needed;
    widest = std::max(widest, AttendedPageCount(st, len, page_size_));
  }
  std::vector<int32_t> fresh;
  absl::Status allocated = allocator_.Allocate(needed, &fresh);
  if (!allocated.ok()) return allocated;
  r->fresh = fresh;
  r->stride = static_cast<int32_t>(widest);
  r->block_table.assign(steps.size() * size_t(widest), 0);
  r->seqlens.clear();
  r->lengths.clear();
  r->tables.clear();
  r->copy_src.clear();
  r->copy_dst.clear();
  r->replaced.clear();
  size_t next = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const KvStep& st = steps[i];
    Sequence& s = sequences_.at(st.sequence_id);
    s.last_used = now;
    const int32_t len = s.lengths[layer];
    std::vector<int32_t> table = s.pages[layer];
    if (st.num_new > 0 && len % page_size_ != 0 && allocator_.refs(table.back()) > 1) {
      // Copy-on-write: the shared partial last page is copied by the launch
      // itself (paged_kv.h step 1) into a page of this sequence's own.
      r->copy_src.push_back(table.back());
      r->copy_dst.push_back(fresh[next]);
      r->replaced.push_back(table.back());
      table.back() = fresh[next++];
    }
    const int64_t after = int64_t{len} + st.num_new;
    while (static_cast<int64_t>(table.size()) < PagesFor(after, page_size_)) {
      table.push_back(fresh[next++]);
    }
    r->seqlens.push_back(
        AttendedPages(table, st, len, page_size_, r->block_table.data() + i * size_t(widest)));
    r->lengths.push_back(static_cast<int32_t>(after));
    r->tables.push_back(std::move(table));
  }
  r->pages = allocator_.pages();
  r->active = true;
  return absl::OkStatus();
}

absl::Status KvCache::ReserveSpanning(int32_t layer, const std::vector<KvStep>& steps,
                                      KvReservation* r, const FieldNames& names) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  last_used_ = now;
  const size_t n_shards = shards_.size();
  std::vector<int64_t> free_pages(n_shards);
  for (size_t sh = 0; sh < n_shards; ++sh) free_pages[sh] = shards_[sh]->pages_free();
  // First pass: each step's placement, so allocation is all or nothing.
  struct StepPlan {
    KvPlacement at;
    bool copy = false;  // copy-on-write of a shared partial last page
  };
  std::vector<StepPlan> plans(steps.size());
  std::vector<int64_t> needed(n_shards, 0);
  for (size_t i = 0; i < steps.size(); ++i) {
    const KvStep& st = steps[i];
    auto found = Find(st.sequence_id);
    if (!found.ok()) return found.status();
    const Sequence& s = **found;
    const int32_t len = s.lengths[layer];
    if (st.expected_length != kAnyLength && st.expected_length != len) {
      return absl::FailedPreconditionError(absl::StrCat(
          names.step(static_cast<int>(i), "expected_length"), ": sequence ", st.sequence_id,
          " has ", len, " tokens at layer ", layer, ", the call expected ", st.expected_length,
          " (a retry of a call that already applied, or a call out of order); nothing was "
          "appended"));
    }
    if (!st.attend_pages.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          names.step(static_cast<int>(i), "attend_pages"), ": expected none on cache '", id_,
          "', which spans ", n_shards, " devices (its pages are numbered per device), got ",
          st.attend_pages.size(), "; nothing was appended"));
    }
    const std::vector<KvSegment>& segs = s.segments[layer];
    StepPlan& plan = plans[i];
    if (st.num_new == 0) {  // attend only: nothing placed
      plan.at = {segs.empty() ? 0 : segs.back().shard, true};
      continue;
    }
    int64_t extend = -1;
    if (!segs.empty()) {
      const KvSegment& last = segs.back();
      const int64_t tokens = int64_t{len} - last.token_begin;
      const int64_t held = static_cast<int64_t>(s.pages[layer].size()) - last.page_begin;
      plan.copy = tokens % page_size_ != 0 && RefsOf(s.pages[layer].back()) > 1;
      extend = PagesFor(tokens + st.num_new, page_size_) - held + (plan.copy ? 1 : 0);
      // A segment grows to at most its device's share of the cache over the
      // layers, so one long sequence spreads each layer over the devices
      // (whose launches then run at once) instead of filling one first.
      const int64_t cap = std::max<int64_t>(
          1, shards_[size_t(last.shard)]->capacity_pages() / geometry_.num_layers);
      if (PagesFor(tokens + st.num_new, page_size_) > cap) {
        extend = std::numeric_limits<int64_t>::max();
      }
    }
    const int64_t open = PagesFor(st.num_new, page_size_);
    plan.at = PlaceAppend(free_pages, segs.empty() ? -1 : segs.back().shard, extend, open);
    if (plan.at.shard < 0) {
      std::string free_list;
      for (size_t sh = 0; sh < n_shards; ++sh) {
        absl::StrAppend(&free_list, sh == 0 ? "" : ", ", "device ", devices_[sh], ": ",
                        free_pages[sh]);
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          names.step(static_cast<int>(i), "num_new_tokens"), ": sequence ", st.sequence_id,
          " needs ", open, " free pages on one device for its ", st.num_new,
          " new tokens (an append is not split across devices); the cache's free pages are ",
          free_list, "; nothing was appended"));
    }
    if (!plan.at.extend) plan.copy = false;
    const int64_t pages = plan.at.extend ? extend : open;
    free_pages[size_t(plan.at.shard)] -= pages;
    needed[size_t(plan.at.shard)] += pages;
  }
  std::vector<std::vector<int32_t>> fresh(n_shards);
  for (size_t sh = 0; sh < n_shards; ++sh) {
    if (needed[sh] == 0) continue;
    const absl::Status allocated = shards_[sh]->Allocate(needed[sh], &fresh[sh]);
    if (!allocated.ok()) {
      for (size_t j = 0; j < sh; ++j) {
        for (int32_t p : fresh[j]) shards_[j]->Release(p);
      }
      return allocated;
    }
  }
  r->fresh.clear();
  for (size_t sh = 0; sh < n_shards; ++sh) {
    for (int32_t p : fresh[sh]) r->fresh.push_back(shard_base_[sh] + p);
  }
  r->block_table.clear();
  r->stride = 1;
  r->seqlens.clear();
  r->copy_src.clear();
  r->copy_dst.clear();
  r->lengths.clear();
  r->tables.clear();
  r->replaced.clear();
  r->parts.clear();
  r->segments.clear();
  std::vector<size_t> next(n_shards, 0);
  auto take = [&](int sh) {
    return shard_base_[size_t(sh)] + fresh[size_t(sh)][next[size_t(sh)]++];
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const KvStep& st = steps[i];
    Sequence& s = sequences_.at(st.sequence_id);
    s.last_used = now;
    const int32_t len = s.lengths[layer];
    const int64_t after = int64_t{len} + st.num_new;
    std::vector<int32_t> table = s.pages[layer];
    std::vector<KvSegment> segs = s.segments[layer];
    const StepPlan& plan = plans[i];
    const int sh = plan.at.shard;
    int32_t copy_src = -1, copy_dst = -1;
    if (st.num_new > 0) {
      if (plan.at.extend) {
        if (plan.copy) {
          const int32_t page = take(sh);
          copy_src = table.back() - shard_base_[size_t(sh)];
          copy_dst = page - shard_base_[size_t(sh)];
          r->replaced.push_back(table.back());
          table.back() = page;
        }
      } else {
        segs.push_back({sh, len, static_cast<int32_t>(table.size())});
      }
      const KvSegment& last = segs.back();
      while (static_cast<int64_t>(table.size()) <
             last.page_begin + PagesFor(after - last.token_begin, page_size_)) {
        table.push_back(take(sh));
      }
    }
    if (segs.empty()) {  // no token: an empty part answers the queries
      KvSpanPart part;
      part.step = static_cast<int32_t>(i);
      part.shard = sh;
      part.last = true;
      r->parts.push_back(std::move(part));
    }
    for (size_t k = 0; k < segs.size(); ++k) {
      const bool last = k + 1 == segs.size();
      const int64_t token_end = last ? after : segs[k + 1].token_begin;
      const size_t page_end = last ? table.size() : size_t(segs[k + 1].page_begin);
      KvSpanPart part;
      part.step = static_cast<int32_t>(i);
      part.shard = segs[k].shard;
      part.last = last;
      part.tokens = static_cast<int32_t>(token_end - segs[k].token_begin);
      part.new_tokens = last ? st.num_new : 0;
      const int32_t base = shard_base_[size_t(segs[k].shard)];
      for (size_t p = size_t(segs[k].page_begin); p < page_end; ++p) {
        part.pages.push_back(table[p] - base);
      }
      if (last) {
        part.copy_src = copy_src;
        part.copy_dst = copy_dst;
      }
      r->parts.push_back(std::move(part));
    }
    r->lengths.push_back(static_cast<int32_t>(after));
    r->tables.push_back(std::move(table));
    r->segments.push_back(std::move(segs));
  }
  r->shard_pages.clear();
  for (const auto& shard : shards_) r->shard_pages.push_back(shard->pages());
  r->shard_devices = devices_;
  r->active = true;
  return absl::OkStatus();
}

void KvCache::Commit(int32_t layer, const std::vector<KvStep>& steps, KvReservation* r) {
  absl::MutexLock lock(&mu_);
  if (!r->active) return;
  for (size_t i = 0; i < steps.size(); ++i) {
    Sequence& s = sequences_.at(steps[i].sequence_id);  // held by the call's claim
    s.pages[layer] = std::move(r->tables[i]);
    s.lengths[layer] = r->lengths[i];
    if (!r->segments.empty()) s.segments[layer] = std::move(r->segments[i]);
  }
  for (int32_t p : r->replaced) ReleasePage(p);
  r->segments.clear();
  r->active = false;
}

void KvCache::Rollback(KvReservation* r) {
  absl::MutexLock lock(&mu_);
  if (!r->active) return;
  for (int32_t p : r->fresh) ReleasePage(p);
  r->active = false;
}

int64_t KvCache::ExpireIdle(absl::Time cutoff, bool* idle) {
  absl::MutexLock lock(&mu_);
  int64_t removed = 0;
  for (auto it = sequences_.begin(); it != sequences_.end();) {
    if (it->second.active_calls == 0 && it->second.last_used < cutoff) {
      ReleaseSequence(it->second);
      it = sequences_.erase(it);
      ++removed;
    } else {
      ++it;
    }
  }
  expired_ += removed;
  *idle = active_calls_ == 0 && last_used_ < cutoff;
  return removed;
}

}  // namespace attnserve
