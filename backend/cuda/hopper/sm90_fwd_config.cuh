// The Hopper forward kernel's compile-time configuration (tile shape and
// Sm90Schedule flags, Sm90FwdConfig) and its shared-memory layout
// (Sm90FwdSmem), shared by the mainloop, the epilogue and the tile
// schedulers. Included only by attn_fwd_sm90.cuh's pieces (sm_90a only).
#pragma once

#include <cstdint>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/hopper/sm90_primitives.cuh"

namespace attnserve {
namespace cuda {
namespace sm90 {

constexpr int kBlockM = 128;           // query rows per CTA: two consumer warpgroups x 64
constexpr int kConsumerThreads = 256;  // the two consumer warpgroups
// setmaxnreg moves registers only within the CTA's launch allocation (168 x
// 384 threads): the producer's release must cover the consumers' request, or
// setmaxnreg.inc waits forever. 40 keeps the dynamic schedule's producer
// (its item hand-off) from spilling.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 == 168 * 384,
              "setmaxnreg must redistribute exactly the launch's registers");

// Ints of a dynamic scheduler's item slot: the item, then (kMods) its key
// tile walk (Sm90Tile's num_tiles, e_top, top_excess).
constexpr int kItemSlotInts = 4;

constexpr bool WarpSpecialized(Sm90Schedule s) { return s != Sm90Schedule::kTmaSync; }
constexpr int ThreadsOf(Sm90Schedule s) {
  return WarpSpecialized(s) ? kConsumerThreads + 128 : kConsumerThreads;
}

// Everything the kernel template's parameters fix: the schedule's features
// (Sm90Schedule in attn_fwd_plan.h) and the tile's sizes. kMods: an
// instantiation for calls with score modifiers (HasScoreMods) that act in
// registers: ALiBi, sinks, a block mask. kElemMods (with kMods): also an
// additive bias and an element mask, whose per-element reads and prefetch
// buffer the others do not carry. The plain one carries none of their code
// but the sinks' epilogue (a sinks-only call runs there). kHeadDimV_: V's
// and O's head dim (MLA shapes; kHeadDim_ otherwise): P V, O and the V ring
// run over it, Q K^T over kHeadDim_.
// kFp8Pv_ (with kFp8Qk_): P V on FP8 wgmma, V's ring holding V^T's codes;
// kPolyExp2_ (with it): Plan::fp8_poly_exp2.
template <int kHeadDim_, int kBlockN_, int kStages_, int kQSlots_, typename T_, bool kIsBanded_,
          Sm90Schedule kSchedule_, bool kFp8Qk_, bool kMods_ = false, int kElemMods_ = 0,
          int kHeadDimV_ = kHeadDim_, bool kFp8Pv_ = false, bool kPolyExp2_ = false>
struct Sm90FwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  // O rows of their own head dim (params' HeadDimV) rather than head_dim.
  static constexpr bool kDistinctV = kHeadDimV_ != kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kQSlots = kQSlots_;
  static constexpr bool kIsBanded = kIsBanded_;
  static constexpr Sm90Schedule kSchedule = kSchedule_;
  static constexpr bool kFp8Qk = kFp8Qk_;
  static constexpr bool kMods = kMods_;
  static constexpr bool kElemMods = kMods_ && kElemMods_ != 0;
  // kElemMods_ 2: a 16-bit bias alone over rows of 16-byte multiples, read
  // in whole rows (Sm90FwdMainloop::PrefetchBiasRows) instead of fragment
  // words; RunAttnFwdSm90 picks it where kBiasRowsFit.
  static constexpr bool kBiasRows = kElemMods && kElemMods_ == 2;
  static constexpr bool kFp8Pv = kFp8Pv_;
  // kFp8Pv: keys of a V^T box, one swizzled row (128 or 64 bytes; the
  // stage holds kBlockN / kVtChunk boxes of kHeadDimV rows), and P's scale
  // 2^kPExp before it is rounded to E4M3 (P <= 1 becomes <= 256 < 448, the
  // largest code, and values down to 2^-14 stay normal; the row sum carries
  // the same factor, so O's normalisation cancels it and the LSE subtracts it).
  static constexpr int kVtChunk = kBlockN % 128 == 0 ? 128 : 64;
  static constexpr int kPExp = kFp8Pv ? 8 : 0;
  // kFp8Pv: a quarter of P's exp2 by Exp2Poly (Plan::fp8_poly_exp2).
  static constexpr bool kPolyExp2 = kFp8Pv && kPolyExp2_;

  // A producer warpgroup issues the TMA loads (else consumer thread 0 does).
  static constexpr bool kWS = WarpSpecialized(kSchedule);
  // Named barriers alternate the two consumer warpgroups' GEMMs.
  static constexpr bool kPingPong =
      kSchedule != Sm90Schedule::kTmaSync && kSchedule != Sm90Schedule::kWarpSpecialized;
  // Tile j's softmax runs while tile j - 1's P V is in flight.
  static constexpr bool kOverlap = kSchedule == Sm90Schedule::kPingPongOverlap ||
                                   kSchedule == Sm90Schedule::kPersistent ||
                                   kSchedule == Sm90Schedule::kPersistentDynamic;
  static constexpr bool kDynamic = kSchedule == Sm90Schedule::kPersistentDynamic;
  static constexpr bool kPersistent = kSchedule == Sm90Schedule::kPersistent || kDynamic;
  // The epilogue adds attention sinks: every kernel a modifier call can
  // reach (the default schedule without kFp8Qk, RunAttnFwdSm90).
  static constexpr bool kSinks = kMods || (kDynamic && !kFp8Qk);

  static constexpr int kDBlocks = kHeadDimV / 64;  // 64-column (128-byte) swizzle blocks of a V row
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kDTiles = kHeadDimV / 8;
  // Q and K rows: 128-byte boxes of kQKCols elements (64 16-bit or 128 FP8).
  static constexpr int kQKCols = kFp8Qk ? 128 : 64;
  static constexpr int kQKBlocks = (kHeadDim + kQKCols - 1) / kQKCols;
  static constexpr int kQKSteps = kHeadDim * (kFp8Qk ? 1 : 2) / 32;  // k16 (k32 FP8) steps of Q K^T
  static constexpr int kQBytes = kQKBlocks * kBlockM * 128;
  static constexpr int kKBytes = kQKBlocks * kBlockN * 128;               // one K tile
  static constexpr int kVBytes = kBlockN * kHeadDimV * (kFp8Pv ? 1 : 2);  // one V tile
  // P's A fragments per thread: one per k16 step (k32 for FP8 P V) of keys.
  static constexpr int kPSteps = kFp8Pv ? kBlockN / 32 : kNTiles / 2;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  // Shared memory without and (kElemMods) with the bias / mask prefetch buffer
  // (a word per fragment pair per consumer thread, Sm90FwdMainloop::
  // PrefetchMods), kept where it fits (else those pairs are read when the
  // tile is scored).
  // kFp8Pv: a 1024-byte swizzle atom of E4M3 ones, the B of the row sums'
  // wgmma (Sm90FwdSmem::ones).
  static constexpr int kOnesBytes = kFp8Pv ? 1024 : 0;
  static constexpr int kBaseSmemBytes = (kQSlots * kBlockM + kStages * kBlockN) * kQKBlocks * 128 +
                                        kStages * kVBytes + kOnesBytes + 1024 + 256;
  static constexpr int kPreBytesWanted = kConsumerThreads * 2 * kNTiles * 4;
  static constexpr int kPreBytes =
      kElemMods && kBaseSmemBytes + kPreBytesWanted <= kSm90MaxSmemBytes ? kPreBytesWanted : 0;
  static constexpr int kSmemBytes = kBaseSmemBytes + kPreBytes;
  // Whole bias rows: the buffer holds a key tile's 128 rows, rows of 8k
  // 16-byte chunks (the swizzle), a warp-wide copy step whole rows.
  static constexpr bool kBiasRowsFit =
      kPreBytes >= kBlockM * kBlockN * 2 && kNTiles % 8 == 0 && 32 % kNTiles == 0;
  static_assert(kHeadDim % 64 == 0 && kHeadDimV % 64 == 0 && kBlockN % 16 == 0, "tile shape");
  static_assert(!kDistinctV || !kFp8Qk, "a distinct value dim runs 16-bit Q K^T");
  static_assert(!kFp8Pv || (kFp8Qk && Sm90Fp8PvFits(kBlockN)), "FP8 P V: FP8 Q K^T, k32 steps");
  static_assert(kQSlots == 1 || kQSlots == 2, "Q slots");
};

// Shared memory: Q [kQSlots][kQKBlocks][128 rows][128 bytes] (the k-th item
// of the CTA in slot k % kQSlots), the K ring [kStages][kQKBlocks][kBlockN]
// [128 bytes], the V ring [kStages][kDBlocks][kBlockN][64], each block
// 1024-byte aligned (the 128-byte swizzle repeats every 8 rows), then the
// mbarriers and the dynamic scheduler's item slots (Sm90SmemBytes reserves
// 256 bytes; a slot is an item and its block-mask walk, kItemSlotInts ints).
template <class Cfg>
struct Sm90FwdSmem {
  using T = typename Cfg::T;
  static_assert((4 + 4 * Cfg::kStages + 4) * 8 + 2 * kItemSlotInts * 4 <= 256,
                "the mbarriers and item slots outgrow the 256 bytes Sm90SmemBytes reserves");

  unsigned char* base;  // 1024-byte aligned

  // smem_raw: the kernel's dynamic shared memory (aligned up to 1024 here).
  __device__ __forceinline__ explicit Sm90FwdSmem(unsigned char* smem_raw)
      : base(smem_raw + ((1024 - (SmemAddr(smem_raw) & 1023)) & 1023)) {}

  __device__ __forceinline__ unsigned char* sQ() const { return base; }
  __device__ __forceinline__ unsigned char* sK() const {
    return base + Cfg::kQSlots * Cfg::kQBytes;
  }
  __device__ __forceinline__ T* sV() const {
    return reinterpret_cast<T*>(sK() + Cfg::kStages * Cfg::kKBytes);
  }
  // kFp8Pv: Cfg::kOnesBytes of E4M3 1.0 (FillOnes), 1024-byte aligned after the V ring
  __device__ __forceinline__ unsigned char* ones() const {
    return sK() + Cfg::kStages * (Cfg::kKBytes + Cfg::kVBytes);
  }
  // [kQSlots]: Q landed
  __device__ __forceinline__ uint64_t* q_full() const {
    return reinterpret_cast<uint64_t*>(ones() + Cfg::kOnesBytes);
  }
  // [kQSlots]: every consumer warp ran its last Q K^T
  __device__ __forceinline__ uint64_t* q_empty() const { return q_full() + 2; }
  // [kStages]: K tile landed
  __device__ __forceinline__ uint64_t* k_full() const { return q_empty() + 2; }
  // [kStages]: V tile landed
  __device__ __forceinline__ uint64_t* v_full() const { return k_full() + Cfg::kStages; }
  // [kStages]: every consumer warp is done with the K tile
  __device__ __forceinline__ uint64_t* k_empty() const { return v_full() + Cfg::kStages; }
  // [kStages]: ... with the V tile
  __device__ __forceinline__ uint64_t* v_empty() const { return k_empty() + Cfg::kStages; }
  // [2]: the dynamic scheduler's item_slot[i] written
  __device__ __forceinline__ uint64_t* sched_full() const { return v_empty() + Cfg::kStages; }
  // [2]: every consumer warp has read it
  __device__ __forceinline__ uint64_t* sched_empty() const { return sched_full() + 2; }
  // [2][kItemSlotInts]
  __device__ __forceinline__ int* item_slot() const {
    return reinterpret_cast<int*>(sched_empty() + 2);
  }
  // kElemMods: the bias / mask prefetch buffer (Cfg::kPreBytes), after the
  // 256 bytes of mbarriers and item slots.
  __device__ __forceinline__ unsigned char* pre() const {
    return reinterpret_cast<unsigned char*>(q_full()) + 256;
  }

  // kFp8Pv: threads tid < 256 write the ones and fence them into the async
  // proxy (wgmma reads them); the caller's barrier follows.
  __device__ __forceinline__ void FillOnes(int tid) const {
    if constexpr (Cfg::kFp8Pv) {
      static_assert(Cfg::kOnesBytes == 256 * 4, "one word per thread");
      if (tid < 256) reinterpret_cast<uint32_t*>(ones())[tid] = 0x38383838u;  // E4M3 1.0
      FenceProxyAsyncShared();
    }
  }

  // The Q slots' and the K/V ring's mbarriers (one thread; the caller fences).
  __device__ __forceinline__ void InitPipelineBarriers() const {
    for (int s = 0; s < Cfg::kQSlots; ++s) {
      MbarInit(&q_full()[s], 1);
      MbarInit(&q_empty()[s], Cfg::kConsumerWarps);
    }
    for (int s = 0; s < Cfg::kStages; ++s) {
      MbarInit(&k_full()[s], 1);
      MbarInit(&v_full()[s], 1);
      MbarInit(&k_empty()[s], Cfg::kConsumerWarps);
      MbarInit(&v_empty()[s], Cfg::kConsumerWarps);
    }
  }
};

}  // namespace sm90
}  // namespace cuda
}  // namespace attnserve
