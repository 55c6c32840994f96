// The Hopper (sm_90a) forward kernel: FlashAttention's loop with wgmma for
// both GEMMs (S = Q K^T from shared memory, O += P V with P from registers),
// Q/K/V tiles brought in by TMA into 128-byte-swizzled shared memory and a
// multi-stage K/V ring completing on mbarriers, a producer warpgroup and two
// consumer warpgroups of 64 query rows each (Sm90Schedule says how they
// overlap). The mask rules, softcap, the empty-row epilogue and the final
// normalisation are the portable kernel's (attn_fwd_kernel.cuh, detail::).
// Included only by the generated *_sm90.cu files (built for sm_90a only).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_kernel.cuh"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/generated/sm90_wgmma.h"
#include "backend/cuda/hopper/attn_fwd_sm90.h"
#include "backend/cuda/hopper/sm90_primitives.cuh"

namespace attnserve {
namespace cuda {
namespace sm90 {

constexpr int kBlockM = 128;           // query rows per CTA: two consumer warpgroups x 64
constexpr int kConsumerThreads = 256;  // the two consumer warpgroups
// setmaxnreg moves registers only within the CTA's launch allocation (168 x
// 384 threads = 64512): the producer warpgroup's release must cover the
// consumers' request, or setmaxnreg.inc waits forever (32 / 240 hung). 24 /
// 240 made the dynamic schedule's producer spill (its item hand-off: 44-64
// bytes); at 40 / 232 ptxas reports one 4-byte spill, in the D = 256
// unbanded instantiations (bench/NOTES-cuda.md, round 9).
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 == 168 * 384,
              "setmaxnreg must redistribute exactly the launch's registers");

constexpr bool WarpSpecialized(Sm90Schedule s) { return s != Sm90Schedule::kTmaSync; }
constexpr int ThreadsOf(Sm90Schedule s) {
  return WarpSpecialized(s) ? kConsumerThreads + 128 : kConsumerThreads;
}

// One online-softmax step over this thread's two rows of an S tile (in place:
// S becomes P = exp2(S * score_log2 - max)); corr[half] is the factor the
// row's O and sum must be scaled by for the new max (applied to the sum here,
// to O by the caller, which may do it later: the P V of the previous tile can
// still be in flight). row_max in raw-score units; row_sum thread-partial.
template <int kNTiles>
__device__ __forceinline__ void SoftmaxStep(float (&s)[1][kNTiles][4], float (&row_max)[2],
                                            float (&row_sum)[2], float (&corr)[2],
                                            float score_log2) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = row_max[half];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
      mx = fmaxf(mx, fmaxf(s[0][nt][half * 2], s[0][nt][half * 2 + 1]));
    mx = detail::QuadMax(mx);
    // A row that has seen only masked keys keeps max -inf; subtracting 0
    // instead keeps exp2(-inf - -inf) from turning into NaN.
    const float mx_log2 = mx == -INFINITY ? 0.f : mx * score_log2;
    corr[half] = detail::Exp2(row_max[half] * score_log2 - mx_log2);
    row_max[half] = mx;
    float sum = row_sum[half] * corr[half];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = detail::Exp2(fmaf(s[0][nt][half * 2 + e], score_log2, -mx_log2));
        s[0][nt][half * 2 + e] = pv;
        sum += pv;
      }
    row_sum[half] = sum;
  }
}

template <int kDTiles>
__device__ __forceinline__ void RescaleO(float (&o)[1][kDTiles][4], const float (&corr)[2]) {
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) {
    o[0][dt][0] *= corr[0];
    o[0][dt][1] *= corr[0];
    o[0][dt][2] *= corr[1];
    o[0][dt][3] *= corr[1];
  }
}

// P (fp32 S fragments) -> wgmma A fragments, one per k16 step of keys: the
// S accumulators of n8 tiles 2kk and 2kk+1 are exactly that A fragment.
template <typename T, int kNTiles>
__device__ __forceinline__ void ConvertP(const float (&s)[1][kNTiles][4],
                                         uint32_t (&pa)[kNTiles / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < kNTiles / 2; ++kk) {
    pa[kk][0] = detail::PackPair<T>(s[0][2 * kk][0], s[0][2 * kk][1]);
    pa[kk][1] = detail::PackPair<T>(s[0][2 * kk][2], s[0][2 * kk][3]);
    pa[kk][2] = detail::PackPair<T>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
    pa[kk][3] = detail::PackPair<T>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
  }
}

template <int kA, int kB, int kC>
__device__ __forceinline__ float (&Flat(float (&x)[kA][kB][kC]))[kA * kB * kC] {
  return reinterpret_cast<float(&)[kA * kB * kC]>(x);
}

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
};

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
  return true;
}

// The kernel. Non-persistent schedules: one CTA per work item (grid x =
// items). kPersistent: one CTA per SM walks items blockIdx.x, + gridDim.x, ...
// while its producer already loads the next item's Q and K/V during this
// one's last tiles and epilogue. kPersistentDynamic: the same, but after its
// first item (blockIdx.x) a CTA's producer draws each next one from
// F.item_counters[0] and passes it to the consumers through a 2-slot ring in
// shared memory (item_slot, sched_full / sched_empty).
// kFp8Qk: Q and K are FP8 E4M3 codes (1 byte; 128-column boxes) and S =
// Q K^T runs on FP8 wgmma (k32 steps: 32 bytes of a 128-byte row, as a k16
// step of 16-bit values is); V, P and O stay T (BF16).
template <int kHeadDim, int kBlockN, int kStages, int kQSlots, typename T, bool kIsBanded,
          Sm90Schedule kSchedule, bool kFp8Qk>
__global__ void __launch_bounds__(ThreadsOf(kSchedule), 1)
    AttnFwdSm90Kernel(const __grid_constant__ Sm90FwdLaunch L) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Mask = detail::MaskPolicy<kIsBanded>;
  constexpr bool kWS = WarpSpecialized(kSchedule);
  constexpr bool kPingPong =
      kSchedule != Sm90Schedule::kTmaSync && kSchedule != Sm90Schedule::kWarpSpecialized;
  constexpr bool kOverlap = kSchedule == Sm90Schedule::kPingPongOverlap ||
                            kSchedule == Sm90Schedule::kPersistent ||
                            kSchedule == Sm90Schedule::kPersistentDynamic;
  constexpr bool kDynamic = kSchedule == Sm90Schedule::kPersistentDynamic;
  constexpr bool kPersistent = kSchedule == Sm90Schedule::kPersistent || kDynamic;
  constexpr int kDBlocks = kHeadDim / 64;  // 64-column (128-byte) swizzle blocks of a V row
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  // Q and K rows: 128-byte boxes of kQKCols elements (64 16-bit or 128 FP8).
  constexpr int kQKCols = kFp8Qk ? 128 : 64;
  constexpr int kQKBlocks = (kHeadDim + kQKCols - 1) / kQKCols;
  constexpr int kQKSteps = kHeadDim * (kFp8Qk ? 1 : 2) / 32;  // k16 (k32 FP8) steps of Q K^T
  constexpr int kQBytes = kQKBlocks * kBlockM * 128;
  constexpr int kKBytes = kQKBlocks * kBlockN * 128;  // one K tile
  constexpr int kVBytes = kBlockN * kHeadDim * 2;     // one V tile
  constexpr int kConsumerWarps = kConsumerThreads / 32;
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0, "tile shape");
  static_assert(kQSlots == 1 || kQSlots == 2, "Q slots");

  // ---- Shared memory: Q [kQSlots][kQKBlocks][128 rows][128 bytes] (the
  // k-th item of the CTA in slot k % kQSlots), the K ring
  // [kStages][kQKBlocks][kBlockN][128 bytes], the V ring
  // [kStages][kDBlocks][kBlockN][64], each block 1024-byte aligned (the
  // 128-byte swizzle repeats every 8 rows), then the mbarriers and the
  // dynamic schedule's item slots (Sm90SmemBytes reserves 256 bytes).
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (SmemAddr(smem_raw) & 1023)) & 1023);
  unsigned char* sQ = smem;
  unsigned char* sK = smem + kQSlots * kQBytes;
  T* sV = reinterpret_cast<T*>(sK + kStages * kKBytes);
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sK + kStages * (kKBytes + kVBytes));  // [kQSlots]
  uint64_t* q_empty = q_full + 2;         // [kQSlots]: every consumer warp ran its last Q K^T
  uint64_t* k_full = q_empty + 2;         // [kStages]: K tile landed
  uint64_t* v_full = k_full + kStages;    // [kStages]: V tile landed
  uint64_t* k_empty = v_full + kStages;   // [kStages]: every consumer warp is done with the K tile
  uint64_t* v_empty = k_empty + kStages;  // [kStages]: ... with the V tile
  uint64_t* sched_full = v_empty + kStages;  // [2]: kPersistentDynamic: item_slot[i] written
  uint64_t* sched_empty = sched_full + 2;    // [2]: every consumer warp has read it
  int* item_slot = reinterpret_cast<int*>(sched_empty + 2);
  static_assert((4 + 4 * kStages + 4) * 8 + 2 * 4 <= 256,
                "the mbarriers and item slots outgrow the 256 bytes Sm90SmemBytes reserves");

  const FwdLaunch& F = L.fwd;
  const AttnParams& p = F.p;
  const int num_items = F.num_m_blocks * p.batch * p.num_heads_q;
  const int first_item = kPersistent ? blockIdx.x : blockIdx.y * gridDim.x + blockIdx.x;
  const int item_step = kPersistent ? gridDim.x : num_items;
  const int tid = threadIdx.x;
  // The k-th work item of this CTA (>= num_items: none left). Static
  // schedules stride; kPersistentDynamic's producer draws it and publishes it
  // in item_slot[k % 2], where lane 0 of every consumer warp reads it once
  // and passes it to its lanes (the thread that reads is the one whose
  // arrival on sched_empty releases the slot: racecheck saw the other lanes'
  // reads unordered with the producer's next store when all lanes read).
  auto produce_item = [&](int k) {
    if constexpr (!kDynamic) {
      return first_item + k * item_step;
    } else {
      const int slot = k & 1;
      if (k >= 2) MbarWait(&sched_empty[slot], ((k >> 1) - 1) & 1);
      const int item =
          k == 0 ? first_item : static_cast<int>(gridDim.x) + atomicAdd(&F.item_counters[0], 1);
      item_slot[slot] = item;
      MbarArrive(&sched_full[slot]);  // release: the consumers' wait acquires the store
      return item;
    }
  };
  auto consume_item = [&](int k) {
    if constexpr (!kDynamic) {
      return first_item + k * item_step;
    } else {
      const int slot = k & 1;
      int item = 0;
      if (threadIdx.x % 32 == 0) {
        MbarWait(&sched_full[slot], (k >> 1) & 1);
        item = item_slot[slot];
        MbarArrive(&sched_empty[slot]);
      }
      return __shfl_sync(0xffffffffu, item, 0);
    }
  };

  if (tid == 0) {
    for (int s = 0; s < kQSlots; ++s) {
      MbarInit(&q_full[s], 1);
      MbarInit(&q_empty[s], kConsumerWarps);
    }
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&k_full[s], 1);
      MbarInit(&v_full[s], 1);
      MbarInit(&k_empty[s], kConsumerWarps);
      MbarInit(&v_empty[s], kConsumerWarps);
    }
    for (int s = 0; s < 2; ++s) {
      MbarInit(&sched_full[s], 1);
      MbarInit(&sched_empty[s], kConsumerWarps);
    }
    FenceBarrierInit();
  }
  __syncthreads();

  // ---- Producer side (one thread): TMA boxes of 64 columns. K and V of a
  // tile are released separately (K once S = Q K^T is done, V after P V), so
  // the next K can load while this tile's P V still reads V. g: the tile's
  // index in the CTA's whole sequence of K/V tiles (ring slot and phase).
  auto load_q = [&](const Sm90Tile& t, int slot) {
    MbarArriveExpectTx(&q_full[slot], kQBytes);
#pragma unroll
    for (int db = 0; db < kQKBlocks; ++db) {
      TmaLoad4d(sQ + slot * kQBytes + db * kBlockM * 128, &L.q, &q_full[slot], db * kQKCols, t.head,
                t.q_row0 + t.m0, t.map_b);
    }
  };
  auto load_kv = [&](const Sm90Tile& t, int g, int it) {
    const int stage = g % kStages;
    const int key0 = t.k_row0 + (t.n_end - 1 - it) * kBlockN;
    // The stage's previous tiles (g - kStages) must be consumed first.
    const uint32_t parity = ((g / kStages) - 1) & 1;
    if (g >= kStages) MbarWait(&k_empty[stage], parity);
    MbarArriveExpectTx(&k_full[stage], kKBytes);
#pragma unroll
    for (int db = 0; db < kQKBlocks; ++db) {
      TmaLoad4d(sK + stage * kKBytes + db * kBlockN * 128, &L.k, &k_full[stage], db * kQKCols,
                t.kv_head, key0, t.map_b);
    }
    if (g >= kStages) MbarWait(&v_empty[stage], parity);
    MbarArriveExpectTx(&v_full[stage], kVBytes);
#pragma unroll
    for (int db = 0; db < kDBlocks; ++db) {
      TmaLoad4d(sV + (stage * kDBlocks + db) * kBlockN * 64, &L.v, &v_full[stage], db * 64,
                t.kv_head, key0, t.map_b);
    }
  };

  int ctid = tid;  // thread index among the consumers
  if constexpr (kWS) {
    if (tid < 128) {
      SetMaxRegsDec<kProducerRegs>();
      if (tid == 0) {
        PrefetchTensorMap(&L.q);
        PrefetchTensorMap(&L.k);
        PrefetchTensorMap(&L.v);
        int g = 0, items_done = 0;
        for (int k = 0;; ++k) {
          const int item = produce_item(k);
          if (item >= num_items) break;
          Sm90Tile t;
          if (!DecodeTile<kBlockN, kIsBanded>(F, item, &t) || t.n_begin >= t.n_end) continue;
          // The slot's previous item (kQSlots items back) must have run
          // its last Q K^T before its Q is overwritten.
          const int slot = items_done % kQSlots;
          if (items_done >= kQSlots) MbarWait(&q_empty[slot], (items_done / kQSlots - 1) & 1);
          load_q(t, slot);
          for (int it = 0; it < t.n_end - t.n_begin; ++it) load_kv(t, g + it, it);
          g += t.n_end - t.n_begin;
          ++items_done;
        }
        if constexpr (kDynamic) {
          // The last CTA to stop drawing leaves the counters zero for the
          // next launch (every other CTA has drawn its last item by then:
          // the fences order each CTA's last draw before its count).
          __threadfence();
          if (atomicAdd(&F.item_counters[1], 1) == static_cast<int>(gridDim.x) - 1) {
            __threadfence();
            F.item_counters[0] = 0;
            F.item_counters[1] = 0;
          }
        }
      }
      return;
    }
    SetMaxRegsInc<kConsumerRegs>();
    ctid = tid - 128;
  }

  // ---- Consumers: warpgroup wg owns rows m0 + 64 wg .. + 63 of each item.
  const int wg = ctid / 128;
  const int warp = (ctid / 32) % 4;
  const int lane = ctid % 32;
  const int quad = lane % 4;
  const bool use_softcap = p.softcap > 0.f;
  const float score_log2 = use_softcap ? 1.f : F.scale_log2;
  const unsigned char* q_wg = sQ;  // this warpgroup's 64 rows of the item's Q slot (per item)

  float o[1][kDTiles][4];
  float row_max[2], row_sum[2];
  float corr[2] = {1.f, 1.f};
  float s[1][kNTiles][4];
  uint32_t pa[kNTiles / 2][4];

  // S = Q K^T for the stage's K tile: kQKSteps k-steps, each a K-major
  // descriptor pair advanced 32 bytes inside the 128-byte rows, 128-byte
  // boxes apart.
  auto gemm_qk = [&](int stage) {
    FenceRegs(Flat(s));
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kQKSteps; ++kk) {
      const int db = kk / 4, kin = (kk % 4) * 32;
      const uint64_t a = SmemDesc(q_wg + db * kBlockM * 128 + kin, 16, 1024);
      const uint64_t bd = SmemDesc(sK + stage * kKBytes + db * kBlockN * 128 + kin, 16, 1024);
      if constexpr (kFp8Qk) {
        WgmmaE4m3<kBlockN>::SS(Flat(s), a, bd, kk > 0 ? 1 : 0);
      } else {
        Wgmma<kBlockN, T>::SS(Flat(s), a, bd, kk > 0 ? 1 : 0);
      }
    }
    WgmmaCommit();
    FenceRegs(Flat(s));
  };
  // O += P V: V is the MN-major B operand (keys x 64 d-columns per block,
  // blocks kBlockN x 128 bytes apart = LBO); a k16 step is 16 keys = 2048 B.
  auto gemm_pv = [&](int stage) {
    FenceRegs(Flat(o));
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk) FenceRegs(pa[kk]);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk) {
      const uint64_t bd =
          SmemDesc(sV + stage * kDBlocks * kBlockN * 64 + kk * 16 * 64, kBlockN * 128, 1024);
      Wgmma<kHeadDim, T>::RS(Flat(o), pa[kk], bd);
    }
    WgmmaCommit();
    FenceRegs(Flat(o));
  };
  auto release = [&](uint64_t* bar) {
    if (lane == 0) MbarArrive(bar);
  };
  // Ping-pong turns: warpgroup wg issues its GEMMs between NamedBarSync on
  // its barrier (1 + wg) and NamedBarArrive on the other's; warpgroup 1
  // grants the first turn, and warpgroup 0 takes a last, empty one, so every
  // arrival is matched. Both warpgroups take the same turns (same items).
  auto turn_begin = [&]() {
    if constexpr (kPingPong) NamedBarSync(1 + wg, kConsumerThreads);
  };
  auto turn_end = [&]() {
    if constexpr (kPingPong) NamedBarArrive(1 + (wg ^ 1), kConsumerThreads);
  };
  if (kPingPong && wg == 1) NamedBarArrive(1, kConsumerThreads);

  int g = 0, items_done = 0;
  for (int k = 0;; ++k) {
    const int item = consume_item(k);
    if (item >= num_items) break;
    Sm90Tile t;
    if (!DecodeTile<kBlockN, kIsBanded>(F, item, &t)) continue;
    const detail::QueryRows qr{1, t.head, SeqStartQ(p, t.b)};
    if (t.n_begin >= t.n_end) {
      detail::StoreEmptyRows<T, kBlockM, kConsumerThreads>(F, qr, t.b, 0, t.m0, t.sq, ctid);
      continue;
    }
    const int num_tiles = t.n_end - t.n_begin;               // tile it is key tile n_end - 1 - it
    const int row0 = t.m0 + wg * 64 + warp * 16 + lane / 4;  // the thread's first row (second: + 8)
    // Without a producer warpgroup, thread 0 loads Q and the first kStages
    // tiles, then refills the stage tile it - 1 used once both warpgroups
    // released it (load_kv waits for that). Non-persistent: one item.
    if constexpr (!kWS) {
      if (ctid == 0) {
        load_q(t, 0);
        for (int it = 0; it < kStages && it < num_tiles; ++it) load_kv(t, it, it);
      }
    }
    auto refill = [&](int it) {
      if constexpr (!kWS) {
        const int next = it - 1 + kStages;
        if (ctid == 0 && it >= 1 && next < num_tiles) load_kv(t, next, next);
      }
    };
    // Softcap, mask and the online-softmax step of key tile n, S -> P.
    auto softmax = [&](int n) {
      if (use_softcap) detail::SoftcapScores(s, F.softcap_in, F.softcap_out);
      const int key0 = n * kBlockN;
      if (Mask::TileNeedsMask(key0, kBlockN, t.sk, t.lo_last, t.hi_first)) {
        detail::MaskScores(s, p, key0, row0, t.sq, 1, t.sq, t.sk, quad);
      }
      SoftmaxStep(s, row_max, row_sum, corr, score_log2);
    };
    // Varlen: the V tile of key tile n reaching past the sequence holds the
    // next sequence's rows (a dense map zero-fills there). P is 0 for them
    // but 0 x Inf or NaN is not, so before P V reads the tile the consumers
    // zero those rows (whole 128-byte rows: the swizzle moves chunks only
    // within a row), fence the stores into wgmma's (async) proxy and meet at
    // named barrier 3. Only the sequence's last key tile, once per item; the
    // test is uniform over the consumers, so all or none reach the barrier.
    auto clear_v_tail = [&](int stage, int n) {
      const int valid = t.sk - n * kBlockN;  // rows < valid are the sequence's
      if (!IsVarlen(p) || valid >= kBlockN) return;
      uint4* tile = reinterpret_cast<uint4*>(sV + stage * kDBlocks * kBlockN * 64);
      for (int c = ctid; c < kDBlocks * kBlockN * 8; c += kConsumerThreads) {
        if ((c / 8) % kBlockN >= valid) tile[c] = make_uint4(0, 0, 0, 0);
      }
      FenceProxyAsyncShared();
      NamedBarSync(3, kConsumerThreads);
    };

#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[0][dt][e] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
    const int q_slot = items_done % kQSlots;
    q_wg = sQ + q_slot * kQBytes + wg * 64 * 128;
    MbarWait(&q_full[q_slot], (items_done / kQSlots) & 1);
    // K tile it is consumed once its S landed; after the item's last Q K^T
    // so is its Q slot, which the producer refills with a later item's Q
    // while this one's last P V and epilogue run.
    auto release_k = [&](int stage, int it) {
      release(&k_empty[stage]);
      if (it == num_tiles - 1) release(&q_empty[q_slot]);
    };
    if constexpr (!kOverlap) {
      for (int it = 0; it < num_tiles; ++it) {
        const int stage = (g + it) % kStages;
        const uint32_t parity = ((g + it) / kStages) & 1;
        refill(it);
        MbarWait(&k_full[stage], parity);
        turn_begin();
        gemm_qk(stage);
        turn_end();
        WgmmaWait<0>();
        FenceRegs(Flat(s));
        release_k(stage, it);
        softmax(t.n_end - 1 - it);
        RescaleO(o, corr);
        ConvertP<T>(s, pa);
        MbarWait(&v_full[stage], parity);
        clear_v_tail(stage, t.n_end - 1 - it);
        gemm_pv(stage);
        WgmmaWait<0>();
        FenceRegs(Flat(o));
        release(&v_empty[stage]);
      }
    } else {
      // Tile 0: S and P only (O is still zero).
      const int first = g % kStages;
      MbarWait(&k_full[first], (g / kStages) & 1);
      turn_begin();
      gemm_qk(first);
      turn_end();
      WgmmaWait<0>();
      FenceRegs(Flat(s));
      release_k(first, 0);
      softmax(t.n_end - 1);
      ConvertP<T>(s, pa);
      for (int it = 1; it < num_tiles; ++it) {
        const int stage = (g + it) % kStages;
        const int prev = (g + it - 1) % kStages;
        MbarWait(&k_full[stage], ((g + it) / kStages) & 1);
        MbarWait(&v_full[prev], ((g + it - 1) / kStages) & 1);
        clear_v_tail(prev, t.n_end - it);
        turn_begin();
        gemm_qk(stage);  // S of tile it ...
        RescaleO(o, corr);
        gemm_pv(prev);  // ... while O += P V of tile it - 1
        turn_end();
        WgmmaWait<1>();  // S landed; P V may still run during the softmax
        FenceRegs(Flat(s));
        release_k(stage, it);
        softmax(t.n_end - 1 - it);
        WgmmaWait<0>();
        FenceRegs(Flat(o));
        release(&v_empty[prev]);
        ConvertP<T>(s, pa);
      }
      const int last = (g + num_tiles - 1) % kStages;
      MbarWait(&v_full[last], ((g + num_tiles - 1) / kStages) & 1);
      clear_v_tail(last, t.n_begin);
      turn_begin();
      RescaleO(o, corr);
      gemm_pv(last);
      turn_end();
      WgmmaWait<0>();
      FenceRegs(Flat(o));
      release(&v_empty[last]);
    }
    g += num_tiles;
    ++items_done;

    // ---- Epilogue: O normalised once, LSE, straight from the fragments.
    float lse[2];
    detail::NormalizeRows<1, kDTiles>(o, row_max, row_sum, score_log2, lse);
    T* o_ptr = static_cast<T*>(p.o);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = row0 + half * 8;
      if (m >= t.sq) continue;
      T* dst = o_ptr + QOffset(p, qr.q_start + m, t.head);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + quad * 2;
        if (col < p.head_dim) {
          *reinterpret_cast<uint32_t*>(dst + col) =
              detail::PackPair<T>(o[0][dt][half * 2], o[0][dt][half * 2 + 1]);
        }
      }
      if (p.lse != nullptr && quad == 0) p.lse[LseOffset(p, t.b, t.head, m)] = lse[half];
    }
  }
  if (kPingPong && wg == 0) NamedBarSync(1, kConsumerThreads);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace sm90

// Launches the instantiation: tensor maps over the request's Q, K and V
// (dense: [B, S, H, D]; varlen: one batch of all T rows, the kernel starting
// each sequence at its cu_seqlens offset; one box = one 128-byte row of 64
// columns, 128 for FP8 codes, x the tile's rows); a CTA per work item (m
// block, batch, query head), or one per SM for the persistent schedules.
// launch.num_splits must be 1 (the planner never splits here). kFp8Qk: p.q
// and p.k hold FP8 E4M3 codes (Plan::fp8_qk), the rest is BF16.
template <int kHeadDim, typename T, bool kIsBanded, Sm90Schedule kSchedule, bool kFp8Qk,
          bool kLongKeys>
cudaError_t RunAttnFwdSm90(const FwdLaunch& launch, cudaStream_t stream) {
  constexpr TileConfig kTile = kLongKeys ? Sm90LongKeyTileFor(kHeadDim) : Sm90TileFor(kHeadDim);
  static_assert(kTile.head_dim == kHeadDim, "head dim missing from its Hopper tile table");
  const AttnParams& p = launch.p;
  if (launch.num_splits != 1 || launch.pack_gqa != 1) return cudaErrorInvalidValue;
  // kPersistentDynamic draws items from the workspace's counters.
  if (kSchedule == Sm90Schedule::kPersistentDynamic && launch.item_counters == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t items = int64_t{launch.num_m_blocks} * p.batch * p.num_heads_q;
  if (items == 0) return cudaSuccess;  // no query rows (a tensor map cannot be empty)
  if (items > 0x7fffffff) return cudaErrorInvalidConfiguration;
  // TMA needs 16-byte aligned bases (the staging buffers are 256-aligned).
  for (const void* ptr : {p.q, p.k, p.v}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return cudaErrorMisalignedAddress;
  }
  const DType qk_dtype = kFp8Qk ? DType::kFP8E4M3 : p.dtype;
  const bool varlen = IsVarlen(p);
  const int64_t batch = varlen ? 1 : p.batch;
  const int64_t q_rows = varlen ? p.total_q : p.seqlen_q;
  const int64_t kv_rows = varlen ? p.total_k : p.seqlen_k;
  if (kv_rows == 0) return cudaErrorInvalidValue;  // PlanForward keeps Sk = 0 portable
  Sm90FwdLaunch l;
  l.fwd = launch;
  cudaError_t err = EncodeRowsTensorMap(&l.q, p.q, qk_dtype, batch, q_rows, p.num_heads_q,
                                        p.head_dim, sm90::kBlockM);
  if (err == cudaSuccess) {
    err = EncodeRowsTensorMap(&l.k, p.k, qk_dtype, batch, kv_rows, p.num_heads_kv, p.head_dim,
                              kTile.block_n);
  }
  if (err == cudaSuccess) {
    err = EncodeRowsTensorMap(&l.v, p.v, p.dtype, batch, kv_rows, p.num_heads_kv, p.head_dim,
                              kTile.block_n);
  }
  if (err != cudaSuccess) return err;
  constexpr int kQKBytes = kFp8Qk ? 1 : 2;
  auto kernel =
      sm90::AttnFwdSm90Kernel<kHeadDim, kTile.block_n, kTile.stages, Sm90QSlots(kTile, kQKBytes), T,
                              kIsBanded, kSchedule, kFp8Qk>;
  constexpr int kSmem = Sm90SmemBytes(kTile, kQKBytes);
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  dim3 grid;
  if constexpr (kSchedule == Sm90Schedule::kPersistent ||
                kSchedule == Sm90Schedule::kPersistentDynamic) {
    // One CTA per SM (the tiles' smem allows no second one).
    int device = 0, sms = 0;
    err = cudaGetDevice(&device);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    grid = dim3(static_cast<unsigned>(items < sms ? items : sms));
  } else {
    if (p.num_heads_q > 65535) return cudaErrorInvalidConfiguration;
    grid = dim3(static_cast<unsigned>(items / p.num_heads_q), p.num_heads_q);
  }
  kernel<<<grid, sm90::ThreadsOf(kSchedule), kSmem, stream>>>(l);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attnserve
