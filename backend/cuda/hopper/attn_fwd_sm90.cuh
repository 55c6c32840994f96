// The Hopper (sm_90a) forward kernel: FlashAttention's loop with wgmma for
// both GEMMs (S = Q K^T from shared memory, O += P V with P from registers),
// Q/K/V tiles brought in by TMA into 128-byte-swizzled shared memory and a
// multi-stage K/V ring completing on mbarriers, a producer warpgroup and two
// consumer warpgroups of 64 query rows each (Sm90Schedule says how they
// overlap). The kernel composes three pieces:
//  - sm90_fwd_tile_scheduler.cuh: which work items (m block, batch, head) a
//    CTA runs, in what order (static striding or drawn from a counter);
//  - sm90_fwd_mainloop.cuh: the producer's TMA loads and the consumers' scan
//    of an item's key tiles (Q K^T, online softmax, P V);
//  - sm90_fwd_epilogue.cuh: O normalised and written, with the LSE.
// sm90_fwd_config.cuh holds the tile sizes, schedule flags and smem layout.
// Included only by the generated *_sm90.cu files and the bench-only schedule
// ablation (built for sm_90a only).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_kernel.cuh"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/fp8_vt_layout.h"
#include "backend/cuda/hopper/attn_fwd_sm90.h"
#include "backend/cuda/hopper/sm90_fwd_config.cuh"
#include "backend/cuda/hopper/sm90_fwd_epilogue.cuh"
#include "backend/cuda/hopper/sm90_fwd_mainloop.cuh"
#include "backend/cuda/hopper/sm90_fwd_tile_scheduler.cuh"
#include "backend/cuda/hopper/sm90_primitives.cuh"
#include "backend/cuda/mods_prefix.cuh"

namespace attnserve {
namespace cuda {
namespace sm90 {

// The kernel: the warp-specialised schedules' producer warpgroup (128
// threads, one of which issues TMA) hands the consumers each item's tiles;
// kTmaSync has no producer (consumer thread 0 loads, see Sm90FwdMainloop).
// kFp8Qk: Q and K are FP8 E4M3 codes (1 byte; 128-column boxes) and S =
// Q K^T runs on FP8 wgmma (k32 steps: 32 bytes of a 128-byte row, as a k16
// step of 16-bit values is); V, P and O stay T (BF16) unless kFp8Pv. kMods
// (the dynamic schedule only): ALiBi, sinks and the block mask; kElemMods 1
// also the additive bias and element mask, 2 a 16-bit bias alone read in
// whole rows (Sm90FwdConfig). kHeadDimV: V's and O's head dim (MLA shapes).
// kFp8Pv (with kFp8Qk): P V on FP8 wgmma too, P requantised to E4M3 per tile
// and V read as V^T's codes (fp8_vt_layout.h).
template <int kHeadDim, int kBlockN, int kStages, int kQSlots, typename T, bool kIsBanded,
          Sm90Schedule kSchedule, bool kFp8Qk, bool kMods, int kElemMods = 0,
          int kHeadDimV = kHeadDim, bool kFp8Pv = false, bool kPolyExp2 = false>
__global__ void __launch_bounds__(ThreadsOf(kSchedule), 1)
    AttnFwdSm90Kernel(const __grid_constant__ Sm90FwdLaunch L) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = Sm90FwdConfig<kHeadDim, kBlockN, kStages, kQSlots, T, kIsBanded, kSchedule, kFp8Qk,
                            kMods, kElemMods, kHeadDimV, kFp8Pv, kPolyExp2>;
  using Scheduler = Sm90TileScheduler<kSchedule>;
  using Epilogue = Sm90FwdEpilogue<Cfg>;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Sm90FwdSmem<Cfg> sm(smem_raw);
  const FwdLaunch& F = L.fwd;
  const AttnParams& p = F.p;
  const int num_items = F.num_m_blocks * p.batch * p.num_heads_q;
  const Scheduler scheduler(F, sm, num_items);
  const int tid = threadIdx.x;

  sm.FillOnes(tid);
  if (tid == 0) {
    sm.InitPipelineBarriers();
    scheduler.InitBarriers();
    FenceBarrierInit();
  }
  __syncthreads();

  int ctid = tid;  // thread index among the consumers
  if constexpr (Cfg::kWS) {
    if (tid < 128) {
      SetMaxRegsDec<kProducerRegs>();
      if constexpr (Cfg::kMods) {
        // Warp 0 walks each item's block-mask row (WalkBlockRow needs the
        // whole warp) and publishes it with the item; lane 0 loads.
        if (tid < 32) {
          const int64_t* prefix = ModsPrefixOf(F);  // varlen block mask: rows_before
          // A block mask: items drawn in OrderItemsKernel's order, each
          // with its walk (none read here), else walked here.
          const int4* order = HasBlockMask(p) ? ItemOrderOf(F, num_items) : nullptr;
          Sm90FwdProducer<Cfg> producer(L, sm);
          if (tid == 0) producer.PrefetchMaps();
          for (int k = 0;; ++k) {
            int drawn = 0;  // lane 0: the index drawn (its order entry)
            const int item = scheduler.DrawItem(k, order, num_items, &drawn);
            Sm90Tile t;
            t.num_tiles = 0;
            t.e_top = -1;
            t.top_excess = 0;
            const bool ok = item < num_items && DecodeTile<kBlockN, kIsBanded>(F, item, &t);
            if (ok && HasBlockMask(p)) {
              if (order == nullptr) {
                WalkBlockRow<kBlockN>(p, prefix, &t);
              } else if (tid == 0) {  // only lane 0 publishes and loads
                Scheduler::ItemWalkAt(order, drawn, &t);
              }
            }
            scheduler.Publish(k, item, t);
            if (item >= num_items) break;
            if (ok && t.num_tiles > 0 && tid == 0) producer.LoadItem(t);
            __syncwarp();
          }
          if (tid == 0) scheduler.ProducerFinish();
        }
      } else if (tid == 0) {
        Sm90FwdProducer<Cfg> producer(L, sm);
        producer.PrefetchMaps();
        for (int k = 0;; ++k) {
          const int item = scheduler.ProducerItem(k);
          if (item >= num_items) break;
          Sm90Tile t;
          if (!DecodeTile<kBlockN, kIsBanded>(F, item, &t) || t.num_tiles <= 0) continue;
          producer.LoadItem(t);
        }
        scheduler.ProducerFinish();
      }
      return;
    }
    SetMaxRegsInc<kConsumerRegs>();
    ctid = tid - 128;
  }

  Sm90FwdAccum<Cfg> acc;
  Sm90FwdMainloop<Cfg> mainloop(L, sm, ctid, acc);
  mainloop.BeginTurns();
  for (int k = 0;; ++k) {
    Sm90Tile walk;  // kMods: the producer's walk of the item
    int item;
    if constexpr (Cfg::kMods) {
      item = scheduler.ConsumerItemWalk(k, &walk);
    } else {
      item = scheduler.ConsumerItem(k);
    }
    if (item >= num_items) break;
    Sm90Tile t;
    if (!DecodeTile<kBlockN, kIsBanded>(F, item, &t)) continue;
    if constexpr (Cfg::kMods) {
      t.num_tiles = walk.num_tiles;
      t.e_top = walk.e_top;
      t.top_excess = walk.top_excess;
    }
    const detail::QueryRows qr{1, t.head, SeqStartQ(p, t.b)};
    if (t.num_tiles <= 0) {
      Epilogue::StoreEmpty(F, qr, t, ctid);
      continue;
    }
    const int row0 = mainloop.Row0(t);
    mainloop.Mma(t, row0);
    Epilogue::Store(F, qr, t, row0, mainloop.quad, acc.o, acc.row_max, acc.row_sum, acc.psum,
                    mainloop.score_log2);
  }
  mainloop.EndTurns();
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace sm90

// Launches the instantiation: tensor maps over the request's Q, K and V
// (dense: [B, S, H, D]; varlen: one batch of all T rows, the kernel starting
// each sequence at its cu_seqlens offset; one box = one 128-byte row of 64
// columns, 128 for FP8 codes, x the tile's rows); a CTA per work item (m
// block, batch, query head), or one per SM for the persistent schedules
// (the schedule's Sm90TileScheduler picks).
// launch.num_splits must be 1 (the planner never splits here). kFp8Qk: p.q
// and p.k hold FP8 E4M3 codes (Plan::fp8_qk), the rest is BF16 (but for
// kFp8Pv's V^T codes).
// Score modifiers (HasScoreMods) run the kMods instantiation, which only the
// 16-bit default schedule has (Sm90SupportsMods); the others refuse them
// with cudaErrorNotSupported, as the default schedule does a bias of another
// dtype than FP16/BF16 and a block mask whose key blocks the tile's
// key tiles do not divide (D 192's 112 keys, the long-key tile's 192).
// kHeadDimV != kHeadDim: MLA shapes (HeadDimV(p) differing from head_dim) on
// kSm90DvTileTable's tile, 16-bit on the default schedule only.
// kFp8Pv: p.v is V^T's codes (one map over its rows, boxes of kVtChunk keys).
template <int kHeadDim, typename T, bool kIsBanded, Sm90Schedule kSchedule, bool kFp8Qk,
          bool kLongKeys, int kHeadDimV, bool kFp8Pv>
cudaError_t RunAttnFwdSm90(const FwdLaunch& launch, cudaStream_t stream) {
  constexpr bool kDistinctV = kHeadDimV != kHeadDim;
  static_assert(!kDistinctV || (!kFp8Qk && !kLongKeys && kSchedule == kDefaultSm90Schedule),
                "a distinct value dim: 16-bit, the default schedule, kSm90DvTileTable's tile");
  constexpr TileConfig kTile = kDistinctV  ? Sm90DvTileFor(kHeadDim, kHeadDimV)
                               : kLongKeys ? Sm90LongKeyTileFor(kHeadDim)
                                           : Sm90TileFor(kHeadDim);
  static_assert(kTile.head_dim == kHeadDim, "head dim missing from its Hopper tile table");
  const AttnParams& p = launch.p;
  // The V map's columns (and the epilogue's O rows): Dv where it differs.
  const int64_t v_dim = kDistinctV ? HeadDimV(p) : p.head_dim;
  if (launch.num_splits != 1 || launch.pack_gqa != 1) return cudaErrorInvalidValue;
  // Which kernel: the bias / element mask one (kElemMods), the register
  // modifiers' one (ALiBi, block mask, sinks beside them), or the plain one
  // (no modifier, or sinks alone: only its epilogue differs).
  const bool any_mods = HasScoreMods(p);
  const bool elem_mods = p.bias != nullptr || p.mask != nullptr;
  const bool mods = elem_mods || p.alibi_slopes != nullptr || HasBlockMask(p);
  if (any_mods) {
    constexpr bool kHasMods = kSchedule == Sm90Schedule::kPersistentDynamic && !kFp8Qk;
    if (!kHasMods) return cudaErrorNotSupported;
    if (p.bias != nullptr && p.bias_dtype != DType::kFP16 && p.bias_dtype != DType::kBF16) {
      return cudaErrorNotSupported;
    }
    if (HasBlockMask(p) && !Sm90BlockMaskFits(kTile.block_n, p.block_q, p.block_k)) {
      return cudaErrorNotSupported;
    }
  }
  using Scheduler = sm90::Sm90TileScheduler<kSchedule>;
  // The dynamic scheduler draws items from the workspace's counters.
  if (Scheduler::kNeedsCounters && launch.item_counters == nullptr) return cudaErrorInvalidValue;
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
  constexpr int kVtChunk = kTile.block_n % 128 == 0 ? 128 : 64;  // Sm90FwdConfig::kVtChunk
  if (err == cudaSuccess) {
    err = kFp8Pv ? EncodeVtTensorMap(&l.v, p.v, VtWidth(p), p.head_dim, p.num_heads_kv, kVtChunk,
                                     kHeadDimV)
                 : EncodeRowsTensorMap(&l.v, p.v, p.dtype, batch, kv_rows, p.num_heads_kv, v_dim,
                                       kTile.block_n);
  }
  if (err != cudaSuccess) return err;
  constexpr int kQKBytes = kFp8Qk ? 1 : 2;
  constexpr int kVBytes = kFp8Pv ? 1 : 2;
  constexpr int kVDim = kDistinctV ? kHeadDimV : 0;  // Sm90SmemBytes' v_dim
  constexpr int kQSlots = Sm90QSlots(kTile, kQKBytes, kVDim, kVBytes);
  void (*kernel)(const Sm90FwdLaunch) =
      sm90::AttnFwdSm90Kernel<kHeadDim, kTile.block_n, kTile.stages, kQSlots, T, kIsBanded,
                              kSchedule, kFp8Qk, false, false, kHeadDimV, kFp8Pv>;
  int fp8_smem = 0;  // kFp8Pv with one more stage: its smem
  if constexpr (kFp8Pv) {
    // Plan::fp8_extra_stage: the tile with one more K/V stage.
    constexpr TileConfig kTile1 = {kTile.head_dim,  kTile.block_m,    kTile.block_n,
                                   kTile.num_warps, kTile.stages + 1, kTile.regs};
    constexpr int kQSlots1 = Sm90QSlots(kTile1, 1, 0, 1);
    static_assert(Sm90SmemBytes(kTile1, 1, 0, 1) <= kSm90MaxSmemBytes, "FP8 extra stage");
    if (launch.extra_stage) {
      fp8_smem = Sm90SmemBytes(kTile1, 1, 0, 1);
      kernel = launch.poly_exp2 ? sm90::AttnFwdSm90Kernel<kHeadDim, kTile.block_n, kTile1.stages,
                                                          kQSlots1, T, kIsBanded, kSchedule, kFp8Qk,
                                                          false, 0, kHeadDimV, kFp8Pv, true>
                                : sm90::AttnFwdSm90Kernel<kHeadDim, kTile.block_n, kTile1.stages,
                                                          kQSlots1, T, kIsBanded, kSchedule, kFp8Qk,
                                                          false, 0, kHeadDimV, kFp8Pv, false>;
    } else if (launch.poly_exp2) {
      kernel = sm90::AttnFwdSm90Kernel<kHeadDim, kTile.block_n, kTile.stages, kQSlots, T, kIsBanded,
                                       kSchedule, kFp8Qk, false, 0, kHeadDimV, kFp8Pv, true>;
    }
  }
  using ElemCfg = sm90::Sm90FwdConfig<kHeadDim, kTile.block_n, kTile.stages, kQSlots, T, kIsBanded,
                                      kSchedule, kFp8Qk, true, 1, kHeadDimV, kFp8Pv>;
  if constexpr (kSchedule == Sm90Schedule::kPersistentDynamic && !kFp8Qk) {
    // A 16-bit bias alone whose rows are whole 16-byte chunks (dense, Sk a
    // multiple of 8, an aligned base): the whole-row kernel where it fits.
    const bool bias_rows = ElemCfg::kBiasRowsFit && p.bias != nullptr && p.mask == nullptr &&
                           !varlen && p.seqlen_k % 8 == 0 &&
                           reinterpret_cast<uintptr_t>(p.bias) % 16 == 0;
    if (bias_rows) {
      if constexpr (ElemCfg::kBiasRowsFit) {
        kernel = sm90::AttnFwdSm90Kernel<kHeadDim, kTile.block_n, kTile.stages, kQSlots, T,
                                         kIsBanded, kSchedule, kFp8Qk, true, 2, kHeadDimV>;
      }
    } else if (elem_mods) {
      kernel = sm90::AttnFwdSm90Kernel<kHeadDim, kTile.block_n, kTile.stages, kQSlots, T, kIsBanded,
                                       kSchedule, kFp8Qk, true, 1, kHeadDimV>;
    } else if (mods) {
      kernel = sm90::AttnFwdSm90Kernel<kHeadDim, kTile.block_n, kTile.stages, kQSlots, T, kIsBanded,
                                       kSchedule, kFp8Qk, true, false, kHeadDimV>;
    }
  }
  constexpr int kSmem = Sm90SmemBytes(kTile, kQKBytes, kVDim, kVBytes);
  static_assert(ElemCfg::kBaseSmemBytes == kSmem, "the kernel's and the plan's smem layouts");
  // The kElemMods kernel adds its prefetch buffer where it fits.
  const int smem = fp8_smem > 0 ? fp8_smem : elem_mods ? ElemCfg::kSmemBytes : kSmem;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  dim3 grid;
  err = Scheduler::Grid(items, p.num_heads_q, &grid);
  if (err != cudaSuccess) return err;
  // A block mask: the item order the producer draws through, first.
  if constexpr (kSchedule == Sm90Schedule::kPersistentDynamic && !kFp8Qk) {
    int4* order = HasBlockMask(p) ? ItemOrderOf(launch, items) : nullptr;
    if (order != nullptr) {
      // One CTA per query head: its items, longest first.
      const int64_t per_head = items / p.num_heads_q;
      sm90::OrderItemsKernel<kTile.block_n, kIsBanded>
          <<<static_cast<unsigned>(p.num_heads_q), sm90::kOrderThreads, 0, stream>>>(
              launch, static_cast<int>(items), static_cast<int>(per_head), order);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  }
  kernel<<<grid, sm90::ThreadsOf(kSchedule), smem, stream>>>(l);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attnserve
