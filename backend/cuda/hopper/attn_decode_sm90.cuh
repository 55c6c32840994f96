// The Hopper (sm_90a) decode kernel: the portable decode tile's math (16
// packed query rows, 4 warps splitting each 64-key tile, mma.sync, the fused
// split combine) fed by a producer warp whose TMA loads bring whole K/V tiles
// (64 keys x 64 columns a box, 128-byte swizzled) into a kStages-deep ring
// completing on mbarriers. Why: decode only streams K/V, and the portable
// kernel's cp.async loads (16 bytes per thread, issued by the warps that also
// compute) leave it short of DRAM bandwidth, stalled on L1TEX. One thread
// issues a tile in 2 x D/64 instructions, the copy engine moves it without
// registers or LSU work, and the ring keeps kStages tiles (about 100 KB per
// CTA) in flight while four warps compute. Whole boxes, not a bulk copy per
// row (slower than the portable kernel), which for a cache's pages means a
// tensor map per slab and a box per page (pages of 16: 4 boxes per 64-column
// block of a tile). Figures: bench/NOTES-cuda.md.
// Included only by the generated attn_decode_*_sm90.cu files (sm_90a only).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_kernel.cuh"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/hopper/attn_fwd_sm90.h"
#include "backend/cuda/hopper/sm90_primitives.cuh"
#include "backend/cuda/kv_rows.cuh"
#include "backend/cuda/paged_attn.h"

namespace attnserve {
namespace cuda {
namespace sm90 {

constexpr int kDecodeComputeWarps = 4;
constexpr int kDecodeThreads = (kDecodeComputeWarps + 1) * 32;  // + the producer warp
constexpr int kMaxStages = 8;

// Element offset of the 8-element chunk at (row, col) of a TMA tile of
// kBlockN rows in 64-column blocks, 128-byte swizzled: chunk c of a row is
// stored at c ^ (row % 8); row8 = row % 8 (the lane's, known up front).
template <int kBlockN>
__device__ __forceinline__ int SwizzledChunk(int row, int col, int row8) {
  return (col / 64) * (kBlockN * 64) + row * 64 + ((((col % 64) / 8) ^ row8) * 8);
}

// The K/V sources: the request's tensors (Sm90FwdLaunch: one map each) or a
// cache's pages (Sm90PagedDecodeLaunch: a map per slab), and the portable
// row source of the same memory (for the sequence lengths and the grid).
template <typename T, typename Launch>
struct DecodeSource;
template <typename T>
struct DecodeSource<T, Sm90FwdLaunch> {
  using Rows = ContiguousRows<T>;
  static constexpr bool kPaged = false;
  __device__ __forceinline__ static const FwdLaunch& RowsLaunch(const Sm90FwdLaunch& l) {
    return l.fwd;
  }
};
template <typename T>
struct DecodeSource<T, Sm90PagedDecodeLaunch> {
  using Rows = PagedRows<T>;
  static constexpr bool kPaged = true;
  __device__ __forceinline__ static const PagedFwdLaunch& RowsLaunch(
      const Sm90PagedDecodeLaunch& l) {
    return l.paged;
  }
};

template <int kHeadDim, int kBlockN, int kStages, typename T, bool kIsBanded, typename Launch>
__device__ __forceinline__ void AttnDecodeSm90Body(const Launch& launch) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace detail;
  using Mask = MaskPolicy<kIsBanded>;
  using Source = DecodeSource<T, Launch>;
  using Rows = typename Source::Rows;
  constexpr int kBlockM = 16;
  constexpr int kWarpKeys = kBlockN / kDecodeComputeWarps;  // keys of a tile one warp computes
  constexpr int kNTiles = kWarpKeys / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kDBlocks = (kHeadDim + 63) / 64;  // 64-column TMA boxes per row
  constexpr int kQStride = kHeadDim + 8;          // Q: padded rows (conflict-free ldmatrix)
  constexpr uint32_t kQRowBytes = kHeadDim * sizeof(T);
  constexpr int kTileElems = kDBlocks * kBlockN * 64;  // one K or V tile
  constexpr TileConfig kTile{kHeadDim, kBlockM, kBlockN, kDecodeComputeWarps + 1, kStages, 0};
  constexpr int kQBytes = Sm90DecodeQBytes(kTile);
  constexpr int kSmemFloats = (Sm90DecodeSmemBytes(kTile) - 1024) / 4;  // past the alignment slack
  static_assert(kWarpKeys == 16 && kQRowBytes % 16 == 0 && kStages <= kMaxStages, "tile shape");
  static_assert((kDecodeComputeWarps - 1) * (kHeadDim / 2 + 4) * 32 * 4 <= kStages * kTileElems * 2,
                "the warps' states must fit the K buffers they are merged through");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (SmemAddr(smem_raw) & 1023)) & 1023);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = reinterpret_cast<T*>(smem + kQBytes);  // [kStages][kDBlocks][kBlockN][64], swizzled
  T* sV = sK + kStages * kTileElems;             // likewise
  __shared__ uint64_t q_full;                    // Q rows landed
  __shared__ uint64_t kv_full[kMaxStages];       // the stage's K and V tiles landed
  __shared__ uint64_t kv_empty[kMaxStages];      // every compute warp is done with the stage

  const FwdLaunch& L = Rows::Fwd(Source::RowsLaunch(launch));
  const AttnParams& p = L.p;
  CtaWork w;
  if (!LocateCta<kBlockM, kBlockN, kIsBanded, Rows>(Source::RowsLaunch(launch), &w)) return;
  const QueryRows qr{L.pack_gqa, w.head, SeqStartQ(p, w.b)};
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const bool fused = L.num_splits > 1 && L.fused_combine;
  if (w.n_begin >= w.n_end) {
    StoreEmptyRows<T, kBlockM, kDecodeThreads>(L, qr, w.b, w.split, w.m0, w.rows, tid);
    if (fused) {
      FinishCtaSplit<T, kBlockM, kDecodeThreads>(L, qr, w, reinterpret_cast<float*>(smem),
                                                 kSmemFloats, tid);
    }
    return;
  }
  if (tid == 0) {
    MbarInit(&q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&kv_full[s], 1);
      MbarInit(&kv_empty[s], kDecodeComputeWarps);
    }
    FenceBarrierInit();
  }
  __syncthreads();

  const int num_tiles = w.n_end - w.n_begin;  // tile i is key tile n_end - 1 - i
  const int q_rows = min(kBlockM, w.rows - w.m0);
  float acc_o[1][kDTiles][4];
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const bool use_softcap = p.softcap > 0.f;
  const float score_log2 = use_softcap ? 1.f : L.scale_log2;
  const bool producer = warp == kDecodeComputeWarps;
  if (producer) {
    // Q: one bulk copy per packed row (lanes), then thread 0 issues every
    // tile's K and V boxes. Dense K/V: the map's batch coordinate is b;
    // varlen: one [1, total_k] map and the sequence's first row. Pages: per
    // box of min(page_size, 64) keys, the page's slab map and its row in the
    // slab; a box past the sequence reloads its last one. Rows past the
    // sequence are masked (P = 0) and their V rows zeroed below.
    const T* q = static_cast<const T*>(p.q);
    if (lane == 0) MbarArriveExpectTx(&q_full, q_rows * kQRowBytes);
    __syncwarp();
    if (lane < q_rows) {
      int h;
      const int64_t row = qr.Row(w.m0 + lane, &h);
      BulkLoad(sQ + lane * kQStride, q + QOffset(p, row, h), kQRowBytes, &q_full);
    }
    // A split launch writes its partials and reads them back (the fused
    // combine) through L2: K and V, read once, go in at evict-first priority
    // so they do not push the partials out. Unsplit launches leave L2's
    // priorities as they are (evict-first bought them nothing). One load form
    // either way: a branch per box slows the producer thread over pages of 16.
    const uint64_t policy = L2Policy(L.num_splits > 1);
    auto load_box = [&](T* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                        int c3) { TmaLoad4dPolicy(dst, map, bar, c0, c1, c2, c3, policy); };
    if (lane == 0) {
      for (int i = 0; i < num_tiles; ++i) {
        const int stage = i % kStages;
        if (i >= kStages) MbarWait(&kv_empty[stage], ((i / kStages) - 1) & 1);
        MbarArriveExpectTx(&kv_full[stage], 2 * kTileElems * sizeof(T));
        const int key0 = (w.n_end - 1 - i) * kBlockN;
        T* k_dst = sK + stage * kTileElems;
        T* v_dst = sV + stage * kTileElems;
        if constexpr (Source::kPaged) {
          const PagedKv& kv = launch.paged.kv;
          const int32_t* table = kv.block_table + int64_t{w.b} * kv.block_table_stride;
          const int page_size = kv.pages.page_size;
          const int box = min(page_size, kBlockN);
          for (int r = 0; r < kBlockN; r += box) {
            const int key = min(key0 + r, w.sk - 1) & ~(box - 1);
            const int32_t page = __ldg(table + (key >> kv.pages.page_shift));
            const int slab = PageSlab(kv.pages, page);
            const int row = static_cast<int>(PageSlabRow(kv.pages, page, key & (page_size - 1)));
#pragma unroll
            for (int db = 0; db < kDBlocks; ++db) {
              const int at = db * kBlockN * 64 + r * 64;
              load_box(k_dst + at, &launch.k[slab], &kv_full[stage], db * 64, w.kv_head, row, 0);
              load_box(v_dst + at, &launch.v[slab], &kv_full[stage], db * 64, w.kv_head, row, 0);
            }
          }
        } else {
          const bool varlen = IsVarlen(p);
          const int row0 = (varlen ? SeqStartK(p, w.b) : 0) + key0;
          const int batch = varlen ? 0 : w.b;
#pragma unroll
          for (int db = 0; db < kDBlocks; ++db) {
            const int at = db * kBlockN * 64;
            load_box(k_dst + at, &launch.k, &kv_full[stage], db * 64, w.kv_head, row0, batch);
            load_box(v_dst + at, &launch.v, &kv_full[stage], db * 64, w.kv_head, row0, batch);
          }
        }
      }
    }
    // Reconverged before the CTA barriers below: lanes 1..31 must not reach
    // them while lane 0 still issues loads (racecheck saw FinishSplit's
    // ticket flag raced when they did).
    __syncwarp();
  } else {
    // Q rows past the problem are zeroed (their results are never stored).
    for (int idx = tid; idx < (kBlockM - q_rows) * kQStride; idx += kDecodeComputeWarps * 32) {
      sQ[q_rows * kQStride + idx] = T(0.f);
    }
    NamedBarSync(1, kDecodeComputeWarps * 32);
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
    const int quad = lane % 4;
    const int row0 = w.m0 + lane / 4;
    const int warp_key0 = warp * kWarpKeys;
    const int row8 = lane % 8;  // every row a lane addresses below is row8 mod 8
    // ldmatrix lane addresses: Q (A) as the portable kernel's; K (B of
    // Q K^T): key warp_key0 + lane % 8 + 8 (lane / 16), column 8 ((lane / 8)
    // % 2) of each k16 step; V (B of P V, transposed): key warp_key0 + lane %
    // 8 + 8 ((lane / 8) % 2), column 8 (lane / 16) of each n16 pair.
    const T* q_lane = sQ + (lane % 16) * kQStride + (lane / 16) * 8;
    const int k_row = warp_key0 + (lane % 8) + (lane / 16) * 8;
    const int k_col = ((lane / 8) % 2) * 8;
    const int v_row = warp_key0 + (lane % 8) + ((lane / 8) % 2) * 8;
    const int v_col = (lane / 16) * 8;
    MbarWait(&q_full, 0);
    for (int i = 0; i < num_tiles; ++i) {
      const int stage = i % kStages;
      MbarWait(&kv_full[stage], (i / kStages) & 1);
      const T* tK = sK + stage * kTileElems;
      T* tV = sV + stage * kTileElems;
      // V rows past the sequence hold the next sequence's values (varlen),
      // a page's stale rows or zeros: P is 0 there, but 0 x NaN is not, so
      // this warp zeroes its own such rows (whole 128-byte rows of every
      // box) before its P V reads them.
      const int key0 = (w.n_end - 1 - i) * kBlockN + warp_key0;
      const int past = w.sk - key0;  // this warp's rows >= past are past the sequence
      const bool zeroed = past < kWarpKeys;
      if (zeroed) {
        for (int c = lane; c < kWarpKeys * kDBlocks * 8; c += 32) {
          const int r = c / (kDBlocks * 8);
          if (r < past) continue;
          const int db = (c / 8) % kDBlocks;
          *reinterpret_cast<uint4*>(tV + db * kBlockN * 64 + (warp_key0 + r) * 64 + (c % 8) * 8) =
              make_uint4(0, 0, 0, 0);
        }
        __syncwarp();
      }
      // S = Q K^T over this warp's 16 keys (two n8 tiles).
      float s[1][kNTiles][4];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t a[4], bfrag[4];
        LdMatrixX4(a, q_lane + kk * 16);
        LdMatrixX4(bfrag, tK + SwizzledChunk<kBlockN>(k_row, kk * 16 + k_col, row8));
        Mma16816<T>(s[0][0], a, bfrag[0], bfrag[1]);
        Mma16816<T>(s[0][1], a, bfrag[2], bfrag[3]);
      }
      if (use_softcap) SoftcapScores(s, L.softcap_in, L.softcap_out);
      if (Mask::TileNeedsMask(key0, kWarpKeys, w.sk, w.lo_last, w.hi_first)) {
        MaskScores(s, p, key0, row0, w.rows, L.pack_gqa, w.sq, w.sk, quad);
      }
      OnlineSoftmax(s, row_max, row_sum, acc_o, score_log2);
      // O += P V: P (two n8 tiles of S) is one k16 A fragment.
      uint32_t pa[4];
      pa[0] = PackPair<T>(s[0][0][0], s[0][0][1]);
      pa[1] = PackPair<T>(s[0][0][2], s[0][0][3]);
      pa[2] = PackPair<T>(s[0][1][0], s[0][1][1]);
      pa[3] = PackPair<T>(s[0][1][2], s[0][1][3]);
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t bfrag[4];
        LdMatrixX4Trans(bfrag, tV + SwizzledChunk<kBlockN>(v_row, dp * 16 + v_col, row8));
        Mma16816<T>(acc_o[0][2 * dp], pa, bfrag[0], bfrag[1]);
        Mma16816<T>(acc_o[0][2 * dp + 1], pa, bfrag[2], bfrag[3]);
      }
      if (zeroed) FenceProxyAsyncShared();  // the zeros, before TMA refills the stage
      __syncwarp();
      if (lane == 0) MbarArrive(&kv_empty[stage]);
    }
  }
  // Every thread (the producer too: the merge and the combine have CTA barriers).
  FinishDecodeTile<T, kDecodeComputeWarps, kDTiles, kQStride, kDecodeThreads>(
      L, qr, w, acc_o, row_max, row_sum, score_log2, !producer, reinterpret_cast<float*>(sK), sQ,
      reinterpret_cast<float*>(smem), kSmemFloats);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// Up to two CTAs per SM (kSm90DecodeTileTable sizes the ring for that; the
// planner's splits aim at one, kSm90DecodeCtasPerSm, the faster).
template <int kHeadDim, int kBlockN, int kStages, typename T, bool kIsBanded>
__global__ void __launch_bounds__(kDecodeThreads, 2)
    AttnDecodeSm90Kernel(const __grid_constant__ Sm90FwdLaunch L) {
  AttnDecodeSm90Body<kHeadDim, kBlockN, kStages, T, kIsBanded>(L);
}
template <int kHeadDim, int kBlockN, int kStages, typename T, bool kIsBanded>
__global__ void __launch_bounds__(kDecodeThreads, 2)
    PagedAttnDecodeSm90Kernel(const __grid_constant__ Sm90PagedDecodeLaunch L) {
  AttnDecodeSm90Body<kHeadDim, kBlockN, kStages, T, kIsBanded>(L);
}

}  // namespace sm90

// The portable decode grid: x = (batch, split, m block), y = KV heads when
// packed, else query heads; tensor maps over the request's K and V (one box
// = 64 columns x 64 keys of one head).
template <int kHeadDim, typename T, bool kIsBanded>
cudaError_t RunAttnDecodeSm90(const FwdLaunch& launch, cudaStream_t stream) {
  constexpr TileConfig kTile = Sm90DecodeTileFor(kHeadDim);
  static_assert(kTile.head_dim == kHeadDim && kTile.num_warps * 32 == sm90::kDecodeThreads,
                "head dim missing from kSm90DecodeTileTable");
  const AttnParams& p = launch.p;
  for (const void* ptr : {p.q, p.k, p.v}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return cudaErrorMisalignedAddress;
  }
  Sm90FwdLaunch l;
  l.fwd = launch;
  const bool varlen = IsVarlen(p);
  const int64_t batch = varlen ? 1 : p.batch;
  const int64_t rows = varlen ? p.total_k : p.seqlen_k;
  if (rows == 0) return cudaErrorInvalidValue;  // PlanForward keeps Sk = 0 portable
  cudaError_t err = EncodeRowsTensorMap(&l.k, p.k, p.dtype, batch, rows, p.num_heads_kv, p.head_dim,
                                        kTile.block_n);
  if (err == cudaSuccess) {
    err = EncodeRowsTensorMap(&l.v, p.v, p.dtype, batch, rows, p.num_heads_kv, p.head_dim,
                              kTile.block_n);
  }
  if (err != cudaSuccess) return err;
  return LaunchTileKernel(
      sm90::AttnDecodeSm90Kernel<kHeadDim, kTile.block_n, kTile.stages, T, kIsBanded>, kTile,
      Sm90DecodeSmemBytes(kTile), launch, l, stream);
}

// Over a cache's pages: one tensor map per slab for K and V (CachedRowsTensorMap:
// encoded once per slab), boxes of min(page_size, 64) keys; the grid as above.
template <int kHeadDim, typename T, bool kIsBanded>
cudaError_t RunAttnDecodeSm90(const PagedFwdLaunch& launch, cudaStream_t stream) {
  constexpr TileConfig kTile = Sm90DecodeTileFor(kHeadDim);
  static_assert(kTile.head_dim == kHeadDim && kTile.num_warps * 32 == sm90::kDecodeThreads,
                "head dim missing from kSm90DecodeTileTable");
  const AttnParams& p = launch.fwd.p;
  if (reinterpret_cast<uintptr_t>(p.q) % 16 != 0) return cudaErrorMisalignedAddress;
  const KvPages& pages = launch.kv.pages;
  static_assert(sizeof(Sm90PagedDecodeLaunch) <= 32000, "kernel parameters are limited to 32 KB");
  Sm90PagedDecodeLaunch l;  // only num_slabs maps of each are encoded (and read)
  l.paged = launch;
  const int64_t rows = (int64_t{1} << pages.slab_shift) * pages.page_size;
  const int box = pages.page_size < kTile.block_n ? pages.page_size : kTile.block_n;
  for (int s = 0; s < pages.num_slabs; ++s) {
    cudaError_t err = CachedRowsTensorMap(&l.k[s], pages.k_slabs[s], p.dtype, rows, p.num_heads_kv,
                                          p.head_dim, box);
    if (err == cudaSuccess) {
      err = CachedRowsTensorMap(&l.v[s], pages.v_slabs[s], p.dtype, rows, p.num_heads_kv,
                                p.head_dim, box);
    }
    if (err != cudaSuccess) return err;
  }
  return LaunchTileKernel(
      sm90::PagedAttnDecodeSm90Kernel<kHeadDim, kTile.block_n, kTile.stages, T, kIsBanded>, kTile,
      Sm90DecodeSmemBytes(kTile), launch.fwd, l, stream);
}

}  // namespace cuda
}  // namespace attnserve
