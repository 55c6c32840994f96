// Host-visible interface of the Hopper (sm_90a) forward kernel family: its
// launch struct (the portable FwdLaunch plus the TMA tensor maps of Q, K and
// V), the warpgroup schedules the kernel template can be built with, and the
// launch entry points. nvcc-safe; the kernels are in attn_fwd_sm90.cuh and
// only compiled for sm_90a (backend/cuda/CMakeLists.txt, attn_cuda_sm90).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/paged_attn.h"
#include "backend/paged_kv.h"
#include "backend/params.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// What the Hopper kernel reads: the launch of the portable path (params,
// derived scales, m blocks) and one 4-d tensor map per input over its
// [B, S, H, D] layout (D innermost), boxes of 64 columns x block rows.
struct Sm90FwdLaunch {
  FwdLaunch fwd;
  CUtensorMap q;
  CUtensorMap k;
  CUtensorMap v;
};

// Fills `map` over a dense [batch, rows, heads, head_dim] FP16/BF16 (or FP8
// E4M3) tensor at device address `base` with boxes of 64 (FP8: 128) columns,
// one 128-byte row, x box_rows rows of one head, 128-byte swizzled (what the
// wgmma descriptors expect). cuTensorMapEncodeTiled
// is looked up through the runtime (cudaGetDriverEntryPointByVersion), so
// nothing links libcuda. cudaErrorInvalidValue when the driver lacks it or
// rejects the shape.
cudaError_t EncodeRowsTensorMap(CUtensorMap* map, const void* base, DType dtype, int64_t batch,
                                int64_t rows, int64_t heads, int64_t head_dim, int box_rows);

// Fills `map` over V^T's E4M3 codes at `base` (fp8_vt_layout.h: heads x
// head_dim rows of `width` columns) as a 4-d map (columns, rows, heads, 1)
// with boxes of box_cols columns (128 or 64: one 128- or 64-byte swizzled
// row, the swizzle matching) x box_rows rows of one head; rows past head_dim
// read as zeros.
cudaError_t EncodeVtTensorMap(CUtensorMap* map, const void* base, int64_t width, int64_t head_dim,
                              int64_t heads, int box_cols, int box_rows);

// One instantiation (generated/*_sm90.cu): kHeadDim 64/128/192/256, T __half
// or __nv_bfloat16, kIsBanded as the portable kernel's; kFp8Qk (T BF16): Q
// and K are FP8 E4M3 codes and Q K^T runs on FP8 wgmma (Plan::fp8_qk);
// kLongKeys: kSm90LongKeyTileTable's tile (TileKind::kLongKeys), else
// kSm90TileTable's. Score modifiers (HasScoreMods): ALiBi, an FP16/BF16
// bias, an element mask, sinks and a block mask run on the default
// schedule without kFp8Qk (a block mask only where Sm90BlockMaskFits);
// anything else is cudaErrorNotSupported. kHeadDimV != kHeadDim: MLA shapes
// (HeadDimV(params) differing; kSm90DvTileTable's pairs), FP16/BF16 on the
// default schedule. kFp8Pv (with kFp8Qk; Plan::fp8_pv): P V on FP8 wgmma
// too, p.v holding V^T's codes (fp8_vt_layout.h) and p.v_descale V's descale.
template <int kHeadDim, typename T, bool kIsBanded, Sm90Schedule kSchedule, bool kFp8Qk = false,
          bool kLongKeys = false, int kHeadDimV = kHeadDim, bool kFp8Pv = false>
cudaError_t RunAttnFwdSm90(const FwdLaunch& launch, cudaStream_t stream);

// What the Hopper decode kernel reads over a cache's pages: the portable
// paged launch and one tensor map per slab for K and V (num_slabs of each),
// each over the slab's rows (pages_per_slab x page_size rows of [Hkv, D]),
// boxes of 64 columns x min(page_size, 64) rows. About 8 KB: a kernel
// parameter (CUDA 12.1+ allows 32 KB).
struct Sm90PagedDecodeLaunch {
  PagedFwdLaunch paged;
  CUtensorMap k[kMaxKvSlabs];
  CUtensorMap v[kMaxKvSlabs];
};

// EncodeRowsTensorMap for a batch of one, remembered per (base, geometry):
// a cache's slabs are encoded once, not on every decode step (the driver call
// costs about a microsecond, and a step may read 64 slab maps per layer).
// Thread-safe.
cudaError_t CachedRowsTensorMap(CUtensorMap* map, const void* base, DType dtype, int64_t rows,
                                int64_t heads, int64_t head_dim, int box_rows);

// The Hopper decode kernel (attn_decode_sm90.cuh; generated/attn_decode_*_sm90.cu):
// kHeadDim 64/96/128 (kSm90DecodeTileTable), over the request's K/V (dense
// or varlen; tensor maps as the prefill kernel's) or a cache's pages (one
// tensor map per slab); the launch as the portable decode tile's
// (PlanForward's splits, the fused combine).
template <int kHeadDim, typename T, bool kIsBanded>
cudaError_t RunAttnDecodeSm90(const FwdLaunch& launch, cudaStream_t stream);
template <int kHeadDim, typename T, bool kIsBanded>
cudaError_t RunAttnDecodeSm90(const PagedFwdLaunch& launch, cudaStream_t stream);

}  // namespace cuda
}  // namespace attnserve
