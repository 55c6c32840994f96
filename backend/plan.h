// Plan: what a backend decided it will launch for one call, returned by
// CanImplement and handed back to Forward/StartForward, so a launch is planned
// (and its params checked) once per request and never re-derived on the way.
// POD and nvcc-safe like params.h: the CUDA launch code reads it.
#pragma once

#include <cstdint>

namespace attnserve {

// Which tile table of the CUDA kernel a launch uses (backend/cuda/attn_fwd.h).
enum class TileKind : int32_t {
  kPrefill = 0,   // kTileTable: the general 128-row tiles
  kDecode = 1,    // kDecodeTileTable: one 16-row tile for short query runs
  kBanded = 2,    // kBandedTileTable: banded requests with a tile of their own
  kLongKeys = 3,  // kSm90LongKeyTileTable: Hopper prefill over a long key range
};

// Which kernel family runs a launch (backend/cuda): the portable mma.sync
// kernel (sm80+, every feature) or the Hopper wgmma/TMA kernels (sm_90a,
// dense prefill; backend/cuda/hopper/).
enum class KernelFamily : int32_t {
  kPortable = 0,
  kSm90 = 1,
};

struct Plan {
  // The kernel's head dim serving params.head_dim: the smallest compiled one
  // >= D (a D=80 call runs the 96 kernel). 0 for a backend without
  // instantiations (the CPU backend) or a dtype served by a generic kernel
  // (the CUDA FP32 path).
  int32_t kernel_head_dim = 0;
  TileKind tile_kind = TileKind::kPrefill;
  KernelFamily kernel_family = KernelFamily::kPortable;
  // True when the call has a causal and/or sliding-window band (the kernel
  // then skips key tiles outside it and masks the boundary tiles), or score
  // modifiers and masks (their kernels live in the banded instantiations).
  bool banded = false;
  // FP8 E4M3 calls on the Hopper prefill kernel: Q K^T runs on the FP8 codes
  // (FP8 wgmma), the descales folded into the softmax scale; without
  // fp8_pv, V is dequantised to BF16 first and P V runs in BF16. Otherwise an FP8 call's
  // Q, K and V are all dequantised and the BF16 kernel of this plan runs.
  bool fp8_qk = false;
  // With fp8_qk, where the tile's key width allows it: P V runs on FP8 wgmma
  // too (P requantised to E4M3 per tile, V transposed to V^T's codes instead
  // of dequantised; tolerance.h states the accuracy rule).
  bool fp8_pv = false;
  // With fp8_pv (PlanForward sets it): a quarter of P's exp2 on the FMA pipe
  // (a polynomial) rather than the MUFU unit, which the softmax of an FP8
  // tile otherwise keeps as busy as the tensor cores (16 exp2 per clock per SM).
  bool fp8_poly_exp2 = false;
  // With fp8_pv: one more K/V stage than the tile's (the FP8 tiles, half
  // the bytes, leave room), for the faster GEMMs' loads.
  bool fp8_extra_stage = false;
  int32_t num_splits = 1;       // split-KV: partial (O, LSE) per split, then a combine
  int32_t pack_gqa = 1;         // query heads of one KV head packed into M (1 = off)
  int64_t workspace_bytes = 0;  // split tickets + fp32 partials when num_splits > 1
};

// True when two plans launch the same kernel the same way (everything but the
// workspace, which grows with the rows): batch-invariant calls share a launch
// only then (docs/design.md §3).
inline bool SamePlanned(const Plan& a, const Plan& b) {
  return a.kernel_head_dim == b.kernel_head_dim && a.tile_kind == b.tile_kind &&
         a.kernel_family == b.kernel_family && a.banded == b.banded && a.fp8_qk == b.fp8_qk &&
         a.fp8_pv == b.fp8_pv && a.fp8_poly_exp2 == b.fp8_poly_exp2 &&
         a.fp8_extra_stage == b.fp8_extra_stage && a.num_splits == b.num_splits &&
         a.pack_gqa == b.pack_gqa;
}

}  // namespace attnserve
