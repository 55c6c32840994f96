// The one rule for who waits for a device: per-tenant FIFOs served by
// deficit round robin (DRR) weighted by each request's cost, so a tenant that
// floods a device with large requests takes its share of the device, not all
// of it, and another tenant's few small calls run between the flood's.
//
// How it works: each tenant with queued work sits in a ring. On its turn a
// tenant's deficit grows by one quantum; it is served while its oldest item
// costs no more than its deficit (each served item's cost is taken off), then
// the turn passes on. Over time every backlogged tenant gets the same cost per
// round, whatever its item sizes. A tenant whose queue empties leaves the ring
// and forgets its deficit (no saving up credit while idle).
//
// Items that ride along in another tenant's launch (TakeIf: the batcher's
// coalescing) are charged to their own tenant, whose deficit may go below
// zero: it pays on its next turns. Items put back at the front (PushFront: a
// packed launch that failed, rerun one by one) skip the ring; their cost was
// charged when they were first taken.
//
// Order: one tenant's items leave in arrival order (Pop, and TakeIf scans
// each tenant front to back), so calls of one K/V sequence and layer, which
// belong to one tenant, keep their order.
//
// Admission (HasRoom): the queue holds at most `limit` items, except that a
// tenant holding fewer than its fair share (limit / tenants with queued
// items, itself counted) is still admitted, so a flood that fills the queue
// does not lock the others out. The total stays under 2 × limit.
//
// Not thread-safe: the executor guards it with its own mutex.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "backend/make_params.h"
#include "backend/paged_kv.h"
#include "backend/params.h"

namespace attnserve {

// What one request costs the device, in byte-equivalents: the larger of the
// bytes it moves (Q, K, V in; O out) and its attention FLOPs divided by
// kCostFlopsPerByte. A request is either bandwidth-bound (decode: few queries
// over a long K/V) or compute-bound (prefill: FLOPs grow with Tq × Tk while
// bytes grow with Tq + Tk); the larger term is the one that takes device
// time, so neither a flood of long prefills nor one of long decodes is
// under-charged. Causal masking and windows are ignored (an upper bound).
// Every request also costs kCostPerRequest (its launch and bookkeeping), so a
// flood of tiny requests is not nearly free.
inline constexpr int64_t kCostFlopsPerByte = 64;
inline constexpr int64_t kCostPerRequest = 4096;
int64_t RequestCost(const AttnParams& p);
// The same from a call's shape (a K/V call's query and new rows, before its
// params exist).
int64_t RequestCost(const AttnShape& shape);
// A K/V call once its pages are reserved: its query rows against each
// sequence's whole context (seqlens_k), which it reads from the cache.
int64_t RequestCost(const PagedAttnParams& p);

template <typename T>
class FairQueue {
 public:
  // `quantum`: cost added to a tenant's deficit per turn. Any positive value
  // gives the same long-run shares; a larger one lets a tenant run more small
  // items back to back per turn.
  explicit FairQueue(int64_t quantum = int64_t{1} << 20)
      : quantum_(std::max<int64_t>(1, quantum)) {}

  bool empty() const { return size_ == 0; }
  int64_t size() const { return size_; }

  // Whether an item of `tenant` may join (see the class comment).
  bool HasRoom(const std::string& tenant, int64_t limit) const {
    if (size_ < limit) return true;
    auto it = tenants_.find(tenant);
    const int64_t held = it == tenants_.end() ? 0 : static_cast<int64_t>(it->second.items.size());
    const int64_t sharing = static_cast<int64_t>(ring_.size()) + (held == 0 ? 1 : 0);
    return held < limit / sharing;
  }

  void Push(const std::string& tenant, int64_t cost, T item) {
    Tenant& t = tenants_[tenant];
    if (t.items.empty()) ring_.push_back(tenant);
    t.items.push_back(Entry{std::max<int64_t>(0, cost), std::move(item)});
    ++size_;
  }

  // Ahead of every tenant, in LIFO order among themselves (push the last first).
  void PushFront(T item) {
    front_.push_front(std::move(item));
    ++size_;
  }

  // The next item by DRR. Requires !empty().
  T Pop() {
    --size_;
    if (!front_.empty()) {
      T item = std::move(front_.front());
      front_.pop_front();
      return item;
    }
    while (true) {
      if (current_ >= ring_.size()) current_ = 0;
      Tenant& t = tenants_[ring_[current_]];
      if (!t.turn_started) {
        t.deficit += quantum_;
        t.turn_started = true;
      }
      if (t.items.front().cost <= t.deficit) {
        Entry e = std::move(t.items.front());
        t.items.pop_front();
        t.deficit -= e.cost;
        if (t.items.empty()) LeaveRing(current_);
        return std::move(e.item);
      }
      t.turn_started = false;
      ++current_;
    }
  }

  // Moves out, in order, every item for which `take(const T&)` says yes,
  // charging each to its tenant; the front lane is scanned first, then the
  // tenants from the one whose turn it is. `take` may keep state (a token
  // budget): it is asked once per item.
  template <typename Take>
  void TakeIf(Take take, std::vector<T>* out) {
    for (auto it = front_.begin(); it != front_.end();) {
      if (take(*it)) {
        out->push_back(std::move(*it));
        it = front_.erase(it);
        --size_;
      } else {
        ++it;
      }
    }
    const std::vector<std::string> order = RingFromCurrent();
    for (const std::string& name : order) {
      Tenant& t = tenants_[name];
      for (auto it = t.items.begin(); it != t.items.end();) {
        if (take(it->item)) {
          t.deficit -= it->cost;
          out->push_back(std::move(it->item));
          it = t.items.erase(it);
          --size_;
        } else {
          ++it;
        }
      }
      if (t.items.empty()) {
        auto pos = std::find(ring_.begin(), ring_.end(), name);
        LeaveRing(static_cast<size_t>(pos - ring_.begin()));
      }
    }
  }

  // Items queued per tenant (tenants with none left out); the front lane is
  // not counted under any tenant.
  std::map<std::string, int64_t> Depths() const {
    std::map<std::string, int64_t> depths;
    for (const auto& [name, t] : tenants_) {
      if (!t.items.empty()) depths[name] = static_cast<int64_t>(t.items.size());
    }
    return depths;
  }

 private:
  struct Entry {
    int64_t cost;
    T item;
  };
  struct Tenant {
    std::deque<Entry> items;
    int64_t deficit = 0;
    bool turn_started = false;
  };

  // Removes ring_[index] (its queue is empty) and its state; the turn passes
  // to the next tenant, which now sits at `index`.
  void LeaveRing(size_t index) {
    tenants_.erase(ring_[index]);
    ring_.erase(ring_.begin() + static_cast<std::ptrdiff_t>(index));
    if (index < current_) --current_;
    if (current_ >= ring_.size()) current_ = 0;
  }

  std::vector<std::string> RingFromCurrent() const {
    std::vector<std::string> order;
    for (size_t i = 0; i < ring_.size(); ++i) order.push_back(ring_[(current_ + i) % ring_.size()]);
    return order;
  }

  const int64_t quantum_;
  std::deque<T> front_;
  std::map<std::string, Tenant> tenants_;  // only tenants with queued items
  std::vector<std::string> ring_;          // their turn order (arrival of first item)
  size_t current_ = 0;                     // whose turn it is
  int64_t size_ = 0;
};

}  // namespace attnserve
