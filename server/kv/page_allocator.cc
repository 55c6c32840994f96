// Slabs, free list and reference counts of one cache; see page_allocator.h.
#include "server/kv/page_allocator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

bool DeviceBudget::TryTake(int64_t bytes) {
  int64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (used + bytes > limit_) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return true;
}

PageAllocator::PageAllocator(AttentionBackend* backend, std::shared_ptr<DeviceBudget> budget,
                             int page_size, int64_t page_bytes, int64_t capacity_pages,
                             bool fp8_e4m3, int64_t v_page_bytes, bool v_in_k)
    : backend_(backend),
      budget_(std::move(budget)),
      page_bytes_(page_bytes),
      v_page_bytes_(v_in_k ? 0 : (v_page_bytes < 0 ? page_bytes : v_page_bytes)),
      capacity_pages_(capacity_pages) {
  kv_.page_size = page_size;
  kv_.fp8_e4m3 = fp8_e4m3;
  kv_.v_in_k = v_in_k;
  while ((1 << kv_.page_shift) < page_size) ++kv_.page_shift;
  // Worked example: 100,000 pages over 32 slabs is 3,125 per slab, rounded up
  // to 4,096: the cache grows in steps of 4,096 pages and 25 slabs hold it.
  while ((int64_t{kMaxKvSlabs} << kv_.slab_shift) < capacity_pages) ++kv_.slab_shift;
}

PageAllocator::~PageAllocator() {
  for (int s = 0; s < kv_.num_slabs; ++s) {
    backend_->FreeKvMemory(kv_.k_slabs[s]);
    if (kv_.v_slabs[s] != nullptr) backend_->FreeKvMemory(kv_.v_slabs[s]);
  }
  budget_->Give(bytes_allocated());
}

absl::Status PageAllocator::AddSlab() {
  const int64_t bytes = slab_bytes();
  if (!budget_->TryTake(bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the device's K/V budget (--kv_cache_bytes ", budget_->limit(), ") has ",
        budget_->limit() - budget_->used(), " bytes left, a slab of this cache needs ", bytes));
  }
  const int64_t k_bytes = page_bytes_ << kv_.slab_shift;
  absl::StatusOr<void*> k = backend_->AllocateKvMemory(k_bytes);
  if (!k.ok()) {
    budget_->Give(bytes);
    return k.status();
  }
  // V in K's pages: no V slab (and none charged).
  absl::StatusOr<void*> v =
      kv_.v_in_k ? absl::StatusOr<void*>(nullptr) : backend_->AllocateKvMemory(bytes - k_bytes);
  if (!v.ok()) {
    backend_->FreeKvMemory(*k);
    budget_->Give(bytes);
    return v.status();
  }
  const int s = kv_.num_slabs;
  kv_.k_slabs[s] = *k;
  kv_.v_slabs[s] = *v;
  kv_.num_slabs = s + 1;
  const int64_t first = int64_t{s} << kv_.slab_shift;
  const int64_t end = std::min(first + (int64_t{1} << kv_.slab_shift), capacity_pages_);
  refs_.resize(size_t(end), 0);
  // Lowest ids on top, so pages are handed out in address order.
  for (int64_t p = end - 1; p >= first; --p) free_.push_back(static_cast<int32_t>(p));
  return absl::OkStatus();
}

absl::Status PageAllocator::ReserveAll() {
  while ((int64_t{kv_.num_slabs} << kv_.slab_shift) < capacity_pages_) {
    absl::Status added = AddSlab();
    if (!added.ok()) return added;
  }
  return absl::OkStatus();
}

absl::Status PageAllocator::Allocate(int64_t n, std::vector<int32_t>* pages) {
  if (n > pages_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("K/V cache full: the call needs ", n, " pages, ", pages_free(),
                     " are free (capacity ", capacity_pages_,
                     " pages); free or truncate "
                     "sequences, or create the cache with a larger capacity"));
  }
  while (static_cast<int64_t>(free_.size()) < n) {
    absl::Status added = AddSlab();
    if (!added.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("K/V pool: the call needs ", n, " pages, ",
                                                       free_.size(), " are allocated and free; ",
                                                       added.message()));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t p = free_.back();
    free_.pop_back();
    refs_[p] = 1;
    pages->push_back(p);
  }
  used_ += n;
  return absl::OkStatus();
}

void PageAllocator::Release(int32_t page) {
  if (--refs_[page] == 0) {
    free_.push_back(page);
    --used_;
  }
}

}  // namespace attnserve
