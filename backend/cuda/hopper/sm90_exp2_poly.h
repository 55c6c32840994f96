// Exp2Poly: 2^x on the FMA and integer pipes instead of MUFU, for a quarter
// of the FP8 P V softmax's exponentials (Plan::fp8_poly_exp2). Host and
// device, so the host tests can sweep every input (cuda_fp8_pv_test).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ATTNSERVE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTNSERVE_HOST_DEVICE inline
#endif

namespace attnserve {
namespace cuda {
namespace sm90 {

// x clamped to [-126, 127] (so -inf and +inf, which the kernel's masked keys
// and nothing else produce, stay finite: unclamped, x >= 127.5 carried j past
// the exponent field into the sign and gave NaN or garbage, and +inf gave
// inf - inf), rounded to the nearest integer j by the 1.5 * 2^23 trick, 2^(x
// - j) by a cubic on [-0.5, 0.5] (relative error under 2^-11.9, against
// E4M3's 2^-4), j added to the exponent field. Below -126 it returns 2^-126
// (an E4M3 zero after any scale the kernel uses), above 127 2^127; a NaN
// argument (only E4M3 NaN codes in Q or K make one) returns 2^-126, as the
// row max ignores it too.
ATTNSERVE_HOST_DEVICE float Exp2Poly(float x) {
  x = fminf(fmaxf(x, -126.f), 127.f);
  const float t = x + 12582912.f;  // 1.5 * 2^23: the low mantissa bits hold j
  const float f = x - (t - 12582912.f);
  const float p = fmaf(fmaf(fmaf(0.05286327f, f, 0.2419271f), f, 0.69355154f), f, 1.f);
#if defined(__CUDA_ARCH__)
  return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
#else
  uint32_t pb, tb;
  std::memcpy(&pb, &p, 4);
  std::memcpy(&tb, &t, 4);
  const uint32_t rb = pb + (tb << 23);
  float r;
  std::memcpy(&r, &rb, 4);
  return r;
#endif
}

}  // namespace sm90
}  // namespace cuda
}  // namespace attnserve

#undef ATTNSERVE_HOST_DEVICE
