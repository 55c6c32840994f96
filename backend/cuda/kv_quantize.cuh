// Device side of FP8 K/V caches (paged_kv.h): decoding E4M3 codes and the
// contract's quantisation of one (token, kv head) row, bit for bit the host's
// (backend/kv_quantize.h): the same fp32 scale (Fp8RowScale, IEEE division),
// x / scale in fp32, then E4M3 rounded to nearest even, saturating at 448.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/paged_kv.h"

namespace attnserve {
namespace cuda {

__device__ __forceinline__ float Fp8Decode(uint32_t code) {
  __nv_fp8_e4m3 x;
  x.__x = static_cast<__nv_fp8_storage_t>(code & 0xffu);
  return static_cast<float>(x);
}

// The two codes in the low 16 bits of `two` (the lower byte first), exactly:
// every E4M3 value is an FP16 one.
__device__ __forceinline__ float2 Fp8DecodePair(uint32_t two) {
  const __half2_raw raw =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(raw));
}

__device__ __forceinline__ uint8_t Fp8Encode(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

template <typename T>
__device__ __forceinline__ float KvToFloat(T x);
template <>
__device__ __forceinline__ float KvToFloat<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float KvToFloat<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// One warp quantises `d` (<= 256) values of `src` into `codes` and returns
// the row's scale (every lane). Lane l handles elements l, l + 32, ...
template <typename T>
__device__ __forceinline__ float QuantiseRowWarp(const T* src, int d, uint8_t* codes, int lane) {
  float x[8];
  float max_abs = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int c = lane + 32 * e;
    x[e] = c < d ? KvToFloat<T>(src[c]) : 0.0f;
    max_abs = fmaxf(max_abs, fabsf(x[e]));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2)
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, off));
  const float scale = Fp8RowScale(max_abs);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int c = lane + 32 * e;
    if (c < d) codes[c] = Fp8Encode(x[e] / scale);
  }
  return scale;
}

}  // namespace cuda
}  // namespace attnserve
