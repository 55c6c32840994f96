// The CUDA backend's FP8 (E4M3) path, step one: dequantise q, k and v on the
// device (code x descale, rounded to BF16) into a scratch buffer, so the BF16
// kernels run them unchanged and write O as BF16 (the contract's O dtype for
// FP8 inputs). This is a correct path, not a fast one: it moves the inputs
// through memory twice more than a native FP8 kernel would, and computes at
// BF16 tensor-core rate. A native FP8 wgmma (QGMMA) kernel that consumes the
// codes and folds the descales into the softmax scale and the output is the
// path to the 1000 TFLOP/s target; it is not built (bench/NOTES-cuda.md).
// nvcc-safe and free of Abseil, like attn_fwd.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/params.h"

namespace attnserve {
namespace cuda {

// The BF16 call FP8 params `p` become: dtype BF16 and descales 1, pointers and
// sizes unchanged. What the planner sees for an FP8 call (it plans the kernel
// that will run), and, with the pointers moved, what DequantiseFp8 yields.
inline AttnParams Bf16View(const AttnParams& p) {
  AttnParams b = p;
  b.dtype = DType::kBF16;
  b.q_descale = b.k_descale = b.v_descale = 1.0f;
  return b;
}

// Bytes of device scratch DequantiseFp8 needs for `p`: BF16 copies of q, k
// and v, each 256-byte aligned.
int64_t Fp8ScratchBytes(const AttnParams& p);

// Queues on `stream` the conversion of FP8 `dev`'s q, k and v (device
// memory) into BF16 copies at `scratch` (device memory of Fp8ScratchBytes(dev)
// bytes, 256-byte aligned), and sets *bf16 to Bf16View(dev) reading those
// copies (o, lse and cu_seqlens stay dev's). q/k/v must be 8-byte aligned
// (the staging layout aligns them to 256).
cudaError_t DequantiseFp8(const AttnParams& dev, void* scratch, cudaStream_t stream,
                          AttnParams* bf16);

}  // namespace cuda
}  // namespace attnserve
