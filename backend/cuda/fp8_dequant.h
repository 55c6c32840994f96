// The CUDA backend's FP8 (E4M3) path, step one: dequantise the inputs on the
// device (code x descale, rounded to BF16) into a scratch buffer, so BF16
// kernels run them and write O as BF16 (the contract's O dtype for FP8
// inputs). On the Hopper prefill kernel (Plan::fp8_qk) only V is
// dequantised: Q K^T runs on the FP8 codes (FP8 wgmma) with the descales in
// the softmax scale. With Plan::fp8_pv as well, V is not dequantised but
// transposed (its codes as V^T, fp8_vt_layout.h) and P V runs on FP8 wgmma
// too. Elsewhere (the portable kernel, decode) all three are dequantised, and
// the GEMMs run at BF16 rate.
// nvcc-safe and free of Abseil, like attn_fwd.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/params.h"

namespace attnserve {
namespace cuda {

// Bytes of device scratch DequantiseFp8 needs for `p`: BF16 copies of v (or,
// fp8_pv, V^T's codes) and, unless fp8_qk (Plan::fp8_qk), of q and k, each
// 256-byte aligned.
int64_t Fp8ScratchBytes(const AttnParams& p, bool fp8_qk, bool fp8_pv);

// Queues on `stream` the conversion of FP8 `dev`'s v, and unless fp8_qk its
// q and k (device memory), into BF16 copies at `scratch` (device memory of
// Fp8ScratchBytes(dev, fp8_qk) bytes, 256-byte aligned), and sets *bf16 to the call
// the kernel runs: dtype BF16, reading the copies (fp8_qk: q and k stay the
// codes, with their descales; the other descales become 1); o, lse and
// cu_seqlens stay dev's. fp8_pv (Plan::fp8_pv, with fp8_qk): v becomes V^T's
// codes in the scratch (fp8_vt_layout.h) and keeps its descale, which the
// kernel's epilogue applies. q/k/v must be 8-byte aligned (the staging
// layout aligns them to 256).
cudaError_t DequantiseFp8(const AttnParams& dev, bool fp8_qk, bool fp8_pv, void* scratch,
                          cudaStream_t stream, AttnParams* bf16);

}  // namespace cuda
}  // namespace attnserve
