// The Hopper forward kernel's work items and the tile schedulers that hand
// them to a CTA's producer and consumers:
//  - Sm90StaticTileScheduler<false>: one CTA per item (grid = items).
//  - Sm90StaticTileScheduler<true>: one CTA per SM striding over the items
//    (CTA c takes c, c + grid, ...).
//  - Sm90DynamicTileScheduler: one CTA per SM; after its first item
//    (blockIdx.x) the producer draws each next one from a global counter and
//    passes it to the consumers through a 2-slot ring in shared memory.
// Every scheduler: ProducerItem(k) / ConsumerItem(k) give the CTA's k-th item
// (>= num_items: none left), both sides calling with k = 0, 1, ... in turn.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_kernel.cuh"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/hopper/sm90_fwd_config.cuh"
#include "backend/cuda/hopper/sm90_primitives.cuh"
#include "backend/cuda/mods_prefix.cuh"
#include "backend/cuda/mods_prefix.h"

namespace attnserve {
namespace cuda {
namespace sm90 {

// A CTA's work item: 128 query rows (m block) of one query head of one
// sequence, and the key tiles [n_begin, n_end) they can see (scanned right
// to left: the partial / band-edge tile first, as the portable kernel does).
// Tensor-map coordinates: dense maps are [B, S, H, D] (the sequence is batch
// b, its rows from 0); varlen maps one [1, T, H, D] batch (the sequence's
// rows from its cu_seqlens offset).
struct Sm90Tile {
  int b, head, kv_head, m0;
  int sq, sk;                 // this sequence's lengths
  int q_row0, k_row0, map_b;  // its first Q and K/V row, and batch, in the maps
  int n_begin, n_end;
  int lo_last, hi_first;  // band-interior tiles: [lo(last row), hi(first row)]
  // The key tiles scanned: num_tiles of them, right to left (KeyTileAt).
  // Without a block mask all of [n_begin, n_end) (e_top = -1); with one, the
  // band's tiles inside the row's kept key blocks: the walk starts
  // top_excess tiles below the top of CSR entry e_top's block and goes down
  // through entries e_top, e_top - 1, ... (WalkBlockRow).
  int num_tiles;
  int e_top, top_excess;
};

// The it-th key tile of item t's scan (it = 0: the rightmost). kBlockN
// divides block_k (RunAttnFwdSm90 checks), so a tile lies in one key block.
template <int kBlockN, bool kMods>
__device__ __forceinline__ int KeyTileAt(const AttnParams& p, const Sm90Tile& t, int it) {
  if (!kMods || t.e_top < 0) return t.n_end - 1 - it;
  const int tpb = p.block_k / kBlockN;  // key tiles per key block
  const int v = it + t.top_excess;
  return (__ldg(p.block_col_idx + t.e_top - v / tpb) + 1) * tpb - 1 - v % tpb;
}

// Item t's walk over its CSR row of the block mask, by a whole warp: the
// kept blocks' entries are strictly increasing, so those meeting the band's
// tiles [n_begin, n_end) are one run [e_lo, e_hi), found by counting with
// ballots (one round of loads per 32 entries, not a serial search); only the
// run's end entries can be cut by the band. prefix: the launch's staged
// offsets (varlen; ModsPrefixOf), which give the row without a walk over
// the earlier sequences.
template <int kBlockN>
__device__ __forceinline__ void WalkBlockRow(const AttnParams& p, const int64_t* prefix,
                                             Sm90Tile* t) {
  const int lane = threadIdx.x % 32;
  const int tpb = p.block_k / kBlockN;
  const bool varlen = IsVarlen(p);
  const int64_t row = StagedBlockRow(p, varlen ? __ldg(prefix + p.batch + 1 + t->b) : 0,
                                     varlen ? __ldg(prefix + 2 * p.batch + 1) : 0, t->b, t->head,
                                     t->m0 / p.block_q);
  const int e0 = __ldg(p.block_row_ptr + row);
  const int e1 = __ldg(p.block_row_ptr + row + 1);
  int below_end = 0, before_begin = 0;
  for (int base = e0; base < e1; base += 32) {
    const int e = base + lane;
    const bool in = e < e1;
    const int c = in ? __ldg(p.block_col_idx + e) : 0;
    below_end += __popc(__ballot_sync(0xffffffffu, in && c * tpb < t->n_end));
    before_begin += __popc(__ballot_sync(0xffffffffu, in && (c + 1) * tpb <= t->n_begin));
    if (__any_sync(0xffffffffu, in && c * tpb >= t->n_end)) break;  // the rest lie past the band
  }
  const int e_lo = e0 + before_begin, e_hi = e0 + below_end;
  t->e_top = e_hi - 1;
  t->top_excess = 0;
  t->num_tiles = 0;
  if (e_hi > e_lo) {
    const int c_top = __ldg(p.block_col_idx + e_hi - 1);
    const int c_bot = __ldg(p.block_col_idx + e_lo);
    t->top_excess = max(0, (c_top + 1) * tpb - t->n_end);
    t->num_tiles = (e_hi - e_lo) * tpb - t->top_excess - max(0, t->n_begin - c_bot * tpb);
  }
}

// Work item `index` of num_m_blocks x batch x heads: m blocks fastest (the
// CTAs running together share one head's K/V in L2), in MaskPolicy's order
// (banded: the most key tiles first). False when its rows lie past Sq.
template <int kBlockN, bool kIsBanded>
__device__ __forceinline__ bool DecodeTile(const FwdLaunch& F, int index, Sm90Tile* t) {
  using Mask = detail::MaskPolicy<kIsBanded>;
  const AttnParams& p = F.p;
  const int per_head = F.num_m_blocks * p.batch;
  t->head = index / per_head;
  const int rest = index % per_head;
  t->b = rest / F.num_m_blocks;
  t->m0 = Mask::MBlock(rest % F.num_m_blocks, F.num_m_blocks) * kBlockM;
  t->sq = SeqLenQ(p, t->b);
  if (t->m0 >= t->sq) return false;
  t->sk = SeqLenK(p, t->b);
  const bool varlen = IsVarlen(p);
  t->q_row0 = varlen ? static_cast<int>(SeqStartQ(p, t->b)) : 0;
  t->k_row0 = varlen ? static_cast<int>(SeqStartK(p, t->b)) : 0;
  t->map_b = varlen ? 0 : t->b;
  t->kv_head = KVHead(p, t->head);
  int lo_first, hi_last;
  VisibleKeys(p, t->m0, t->sq, t->sk, &lo_first, &t->hi_first);
  VisibleKeys(p, min(t->sq, t->m0 + kBlockM) - 1, t->sq, t->sk, &t->lo_last, &hi_last);
  Mask::KeyTiles(lo_first, hi_last, t->sk, kBlockN, &t->n_begin, &t->n_end);
  t->num_tiles = t->n_end - t->n_begin;
  t->e_top = -1;
  t->top_excess = 0;
  return true;
}

constexpr int kOrderThreads = 512;
// Buckets of kept-block counts; counts past the last share it.
constexpr int kOrderBuckets = 512;

// Item `index`'s walk of its CSR row (WalkBlockRow's num_tiles, e_top,
// top_excess, by one thread: the run of entries meeting the band's key
// tiles [n_begin, n_end) found by binary searches, the entries being
// sorted) as an order entry {index, num_tiles, e_top, top_excess}; *kept
// its kept blocks inside the band (0 when its rows lie past Sq).
template <int kBlockN, bool kIsBanded>
__device__ __forceinline__ int4 ItemWalk(const FwdLaunch& F, const int64_t* prefix, int index,
                                         int* kept) {
  const AttnParams& p = F.p;
  int4 e = make_int4(index, 0, -1, 0);
  *kept = 0;
  Sm90Tile t;
  if (!DecodeTile<kBlockN, kIsBanded>(F, index, &t) || t.num_tiles <= 0) return e;
  const bool varlen = IsVarlen(p);
  const int64_t row =
      StagedBlockRow(p, varlen ? __ldg(prefix + p.batch + 1 + t.b) : 0,
                     varlen ? __ldg(prefix + 2 * p.batch + 1) : 0, t.b, t.head, t.m0 / p.block_q);
  const int e0 = __ldg(p.block_row_ptr + row);
  const int e1 = __ldg(p.block_row_ptr + row + 1);
  const int tpb = p.block_k / kBlockN;
  int e_lo = e0, e_hi = e1;  // unbanded: every kept block lies below n_end
  if constexpr (kIsBanded) {
    // The first entry at or past key block c.
    auto lower = [&](int c) {
      int lo = e0, hi = e1;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (__ldg(p.block_col_idx + mid) < c) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      return lo;
    };
    e_lo = lower(t.n_begin / tpb);
    e_hi = lower((t.n_end + tpb - 1) / tpb);
  }
  e.z = e_hi - 1;
  if (e_hi > e_lo) {
    const int c_top = __ldg(p.block_col_idx + e_hi - 1);
    const int c_bot = __ldg(p.block_col_idx + e_lo);
    e.w = max(0, (c_top + 1) * tpb - t.n_end);
    e.y = (e_hi - e_lo) * tpb - e.w - max(0, t.n_begin - c_bot * tpb);
    *kept = e_hi - e_lo;
  }
  return e;
}

// Writes CTA x's segment of the order: the items of query head x,
// order[x * seg_items ...], by kept blocks, most first (a counting sort over
// kOrderBuckets; within a count, about their natural order), each with its
// walk (ItemWalk), so the producer drawing it reads no CSR. The dynamic
// scheduler, drawing through the order, starts each head's long items first
// and ends on the short ones, so its CTAs finish together; heads stay in
// turn, so the CTAs running together still share one head's K/V in L2.
// Run on the forward kernel's stream, before it.
template <int kBlockN, bool kIsBanded>
__global__ void __launch_bounds__(kOrderThreads)
    OrderItemsKernel(const FwdLaunch F, int num_items, int seg_items, int4* order) {
  __shared__ int bucket_start[kOrderBuckets];
  __shared__ int warp_sum[kOrderThreads / 32];
  const int seg0 = blockIdx.x * seg_items;
  const int seg1 = min(num_items, seg0 + seg_items);
  const int tid = threadIdx.x;
  const int64_t* prefix = ModsPrefixOf(F);
  // Bucket r holds the items of kOrderBuckets - 1 - r kept blocks (clamped):
  // ascending r is the order wanted. A thread's first kKeep walks stay in
  // registers between the passes; later ones are walked again.
  constexpr int kKeep = 4;
  int4 walks[kKeep];
  int buckets[kKeep];
  auto walk = [&](int i, int* bucket) {
    int kept;
    const int4 e = ItemWalk<kBlockN, kIsBanded>(F, prefix, i, &kept);
    *bucket = kOrderBuckets - 1 - min(kept, kOrderBuckets - 1);
    return e;
  };
  static_assert(kOrderBuckets == kOrderThreads, "one bucket per thread in the scan");
  bucket_start[tid] = 0;
  __syncthreads();
  {
    int k = 0;
    for (int i = seg0 + tid; i < seg1; i += kOrderThreads, ++k) {
      int bucket;
      const int4 e = walk(i, &bucket);
      if (k < kKeep) {
        walks[k] = e;
        buckets[k] = bucket;
      }
      atomicAdd(&bucket_start[bucket], 1);
    }
  }
  __syncthreads();
  // Exclusive scan of the counts: thread tid owns bucket tid.
  const int lane = tid % 32, warp = tid / 32;
  const int count = bucket_start[tid];
  int incl = count;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kOrderThreads / 32 ? warp_sum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kOrderThreads / 32) warp_sum[lane] = w;
  }
  __syncthreads();
  bucket_start[tid] = incl - count + (warp > 0 ? warp_sum[warp - 1] : 0);
  __syncthreads();
  {
    int k = 0;
    for (int i = seg0 + tid; i < seg1; i += kOrderThreads, ++k) {
      int4 e;
      int bucket;
#pragma unroll
      for (int q = 0; q < kKeep; ++q) {
        if (q == k) {
          e = walks[q];
          bucket = buckets[q];
        }
      }
      if (k >= kKeep) e = walk(i, &bucket);
      order[seg0 + atomicAdd(&bucket_start[bucket], 1)] = e;
    }
  }
}

// Persistent grids: one CTA per SM (the tiles' smem allows no second one),
// never more than there are items.
inline cudaError_t PersistentGrid(int64_t items, dim3* grid) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  *grid = dim3(static_cast<unsigned>(items < sms ? items : sms));
  return cudaSuccess;
}

// Static schedules: the k-th item is a function of the CTA alone.
template <bool kPersistent_>
struct Sm90StaticTileScheduler {
  static constexpr bool kPersistent = kPersistent_;
  static constexpr bool kNeedsCounters = false;
  const int first_item;
  const int item_step;

  template <class Smem>
  __device__ __forceinline__ Sm90StaticTileScheduler(const FwdLaunch&, const Smem&, int num_items)
      : first_item(kPersistent ? blockIdx.x : blockIdx.y * gridDim.x + blockIdx.x),
        item_step(kPersistent ? gridDim.x : num_items) {}

  __device__ __forceinline__ void InitBarriers() const {}
  __device__ __forceinline__ int ProducerItem(int k) const { return first_item + k * item_step; }
  __device__ __forceinline__ int ConsumerItem(int k) const { return first_item + k * item_step; }
  __device__ __forceinline__ void ProducerFinish() const {}

  // Non-persistent: x the items of one head, y the query heads.
  static cudaError_t Grid(int64_t items, int num_heads_q, dim3* grid) {
    if constexpr (kPersistent) {
      return PersistentGrid(items, grid);
    } else {
      if (num_heads_q > 65535) return cudaErrorInvalidConfiguration;
      *grid = dim3(static_cast<unsigned>(items / num_heads_q), num_heads_q);
      return cudaSuccess;
    }
  }
};

// kPersistentDynamic: F.item_counters[0] is the next item to draw (past the
// grid's first ones), [1] counts the CTAs done; both zero at rest.
struct Sm90DynamicTileScheduler {
  static constexpr bool kPersistent = true;
  static constexpr bool kNeedsCounters = true;
  const FwdLaunch& F;
  uint64_t* const sched_full;   // [2]: item_slot[i] written
  uint64_t* const sched_empty;  // [2]: every consumer warp has read it
  int* const item_slot;         // [2]
  const int first_item;

  template <class Smem>
  __device__ __forceinline__ Sm90DynamicTileScheduler(const FwdLaunch& launch, const Smem& sm, int)
      : F(launch),
        sched_full(sm.sched_full()),
        sched_empty(sm.sched_empty()),
        item_slot(sm.item_slot()),
        first_item(blockIdx.x) {}

  // One thread; the caller fences the inits.
  __device__ __forceinline__ void InitBarriers() const {
    for (int s = 0; s < 2; ++s) {
      MbarInit(&sched_full[s], 1);
      MbarInit(&sched_empty[s], kConsumerThreads / 32);
    }
  }

  // The producer thread draws item k and publishes it in item_slot[k % 2].
  __device__ __forceinline__ int ProducerItem(int k) const {
    const int slot = k & 1;
    if (k >= 2) MbarWait(&sched_empty[slot], ((k >> 1) - 1) & 1);
    const int item =
        k == 0 ? first_item : static_cast<int>(gridDim.x) + atomicAdd(&F.item_counters[0], 1);
    item_slot[slot * kItemSlotInts] = item;
    MbarArrive(&sched_full[slot]);  // release: the consumers' wait acquires the store
    return item;
  }

  // kMods: the producer warp draws item k (lane 0, once slot k % 2 is free;
  // every lane gets it), computes its walk (WalkBlockRow), then lane 0
  // publishes both (Publish).
  // order (a block-masked launch's OrderItemsKernel, or null): the drawn
  // index (*drawn) names item order[*drawn].x (its walk: ItemWalkAt).
  __device__ __forceinline__ int DrawItem(int k, const int4* order, int num_items,
                                          int* drawn) const {
    int item = 0;
    if (threadIdx.x % 32 == 0) {
      if (k >= 2) MbarWait(&sched_empty[k & 1], ((k >> 1) - 1) & 1);
      item = k == 0 ? first_item : static_cast<int>(gridDim.x) + atomicAdd(&F.item_counters[0], 1);
      *drawn = item;
      if (order != nullptr && item < num_items) item = __ldg(&order[item].x);
    }
    return __shfl_sync(0xffffffffu, item, 0);
  }
  // Lane 0's drawn item's walk from its order entry (read again after
  // DecodeTile rather than held through it: the producer has 40 registers).
  __device__ __forceinline__ static void ItemWalkAt(const int4* order, int drawn, Sm90Tile* t) {
    const int4 e = __ldg(order + drawn);
    t->num_tiles = e.y;
    t->e_top = e.z;
    t->top_excess = e.w;
  }
  __device__ __forceinline__ void Publish(int k, int item, const Sm90Tile& t) const {
    if (threadIdx.x % 32 != 0) return;
    int* s = item_slot + (k & 1) * kItemSlotInts;
    s[0] = item;
    s[1] = t.num_tiles;
    s[2] = t.e_top;
    s[3] = t.top_excess;
    MbarArrive(&sched_full[k & 1]);
  }
  // The consumers' side of Publish: item k, and its walk into t.
  __device__ __forceinline__ int ConsumerItemWalk(int k, Sm90Tile* t) const {
    const int slot = k & 1;
    int v[kItemSlotInts] = {0, 0, 0, 0};
    if (threadIdx.x % 32 == 0) {
      MbarWait(&sched_full[slot], (k >> 1) & 1);
#pragma unroll
      for (int i = 0; i < kItemSlotInts; ++i) v[i] = item_slot[slot * kItemSlotInts + i];
      MbarArrive(&sched_empty[slot]);
    }
#pragma unroll
    for (int i = 0; i < kItemSlotInts; ++i) v[i] = __shfl_sync(0xffffffffu, v[i], 0);
    t->num_tiles = v[1];
    t->e_top = v[2];
    t->top_excess = v[3];
    return v[0];
  }

  // Lane 0 of every consumer warp reads the slot once and passes it to its
  // lanes: the reading thread must be the one whose arrival on sched_empty
  // releases the slot, or the other lanes' reads race the producer's next
  // store.
  __device__ __forceinline__ int ConsumerItem(int k) const {
    const int slot = k & 1;
    int item = 0;
    if (threadIdx.x % 32 == 0) {
      MbarWait(&sched_full[slot], (k >> 1) & 1);
      item = item_slot[slot * kItemSlotInts];
      MbarArrive(&sched_empty[slot]);
    }
    return __shfl_sync(0xffffffffu, item, 0);
  }

  // After the producer's last draw: the last CTA to stop drawing leaves the
  // counters zero for the next launch (every other CTA has drawn its last
  // item by then: the fences order each CTA's last draw before its count).
  __device__ __forceinline__ void ProducerFinish() const {
    __threadfence();
    if (atomicAdd(&F.item_counters[1], 1) == static_cast<int>(gridDim.x) - 1) {
      __threadfence();
      F.item_counters[0] = 0;
      F.item_counters[1] = 0;
    }
  }

  static cudaError_t Grid(int64_t items, int, dim3* grid) { return PersistentGrid(items, grid); }
};

template <Sm90Schedule kSchedule>
struct Sm90TileSchedulerFor {
  using type = Sm90StaticTileScheduler<kSchedule == Sm90Schedule::kPersistent>;
};
template <>
struct Sm90TileSchedulerFor<Sm90Schedule::kPersistentDynamic> {
  using type = Sm90DynamicTileScheduler;
};
template <Sm90Schedule kSchedule>
using Sm90TileScheduler = typename Sm90TileSchedulerFor<kSchedule>::type;

}  // namespace sm90
}  // namespace cuda
}  // namespace attnserve
