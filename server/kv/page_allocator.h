// The pages of one K/V cache (DESIGN §6): slabs of a power-of-two number of
// pages, allocated through the backend as the cache grows, a free list over
// them (O(1) allocate and free) and a reference count per page (forks share
// pages). Memory comes from the device's K/V budget (--kv_cache_bytes), shared
// by every cache of the device. Not thread-safe: the owning cache locks.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "backend/backend.h"
#include "backend/paged_kv.h"

namespace attnserve {

// The K/V byte budget of one device, shared by all its caches.
class DeviceBudget {
 public:
  explicit DeviceBudget(int64_t limit_bytes) : limit_(limit_bytes) {}
  // Takes `bytes` if they fit under the limit.
  bool TryTake(int64_t bytes);
  void Give(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }
  int64_t used() const { return used_.load(std::memory_order_relaxed); }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

class PageAllocator {
 public:
  // `page_bytes`: bytes of one page's K (V is the same again; for an FP8
  // cache, `fp8_e4m3`, its codes and scales: KvPageBytes). The slab size
  // is capacity / kMaxKvSlabs rounded up to a power of two of pages.
  // `backend` must outlive the allocator. The budget is shared: a cache can
  // outlive its pool (an executor's completion callback may hold the last
  // reference after the pool is gone), and its pages go back on destruction.
  // page_bytes is one page's K; v_page_bytes its V (-1: as K's; 0 with
  // v_in_k: V lives in K's pages, no V slabs).
  PageAllocator(AttentionBackend* backend, std::shared_ptr<DeviceBudget> budget, int page_size,
                int64_t page_bytes, int64_t capacity_pages, bool fp8_e4m3 = false,
                int64_t v_page_bytes = -1, bool v_in_k = false);
  // Frees every slab and returns its bytes to the budget.
  ~PageAllocator();
  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  // Allocates every slab the capacity needs now (CreateCache's reserve).
  absl::Status ReserveAll();

  // n fresh pages (reference count 1) appended to *pages, or none:
  // RESOURCE_EXHAUSTED naming the pages needed and free.
  absl::Status Allocate(int64_t n, std::vector<int32_t>* pages);
  void AddRef(int32_t page) { ++refs_[page]; }
  // Drops one reference; the page returns to the free list at zero.
  void Release(int32_t page);
  int32_t refs(int32_t page) const { return refs_[page]; }

  const KvPages& pages() const { return kv_; }
  // Whose memory the slabs are (copies in and out of pages go through it).
  AttentionBackend* backend() const { return backend_; }
  int64_t capacity_pages() const { return capacity_pages_; }
  int64_t pages_used() const { return used_; }
  int64_t pages_free() const { return capacity_pages_ - used_; }
  int64_t page_bytes() const { return page_bytes_ + v_page_bytes_; }  // K and V
  int64_t slab_bytes() const { return page_bytes() << kv_.slab_shift; }
  int64_t bytes_allocated() const { return int64_t{kv_.num_slabs} * slab_bytes(); }
  // What bytes_allocated() reaches at full capacity (the last slab is whole).
  int64_t ceiling_bytes() const {
    const int64_t per_slab = int64_t{1} << kv_.slab_shift;
    return (capacity_pages_ + per_slab - 1) / per_slab * slab_bytes();
  }

 private:
  // One more slab: its pages (those under the capacity) join the free list.
  absl::Status AddSlab();

  AttentionBackend* const backend_;
  const std::shared_ptr<DeviceBudget> budget_;
  const int64_t page_bytes_;    // K's
  const int64_t v_page_bytes_;  // V's: 0 when V lives in K's pages
  const int64_t capacity_pages_;
  KvPages kv_{};
  std::vector<int32_t> free_;  // a stack of free page ids
  std::vector<int32_t> refs_;  // per page id
  int64_t used_ = 0;
};

}  // namespace attnserve
