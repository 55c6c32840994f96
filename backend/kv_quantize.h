// The host side of FP8 K/V caches (paged_kv.h): quantising one (token, kv
// head) row of 16-bit values into E4M3 codes and its scale by the contract's
// rule, shared by the CPU backend's append and the tests. The CUDA append
// (backend/cuda/kv_quantize.cuh) computes the same scale and codes.
#pragma once

#include <cmath>
#include <cstdint>

#include "backend/paged_kv.h"
#include "common/dtype.h"

namespace attnserve {

// Quantises elements [elem0, elem0 + d) of `x` (values of dtype `t`) into
// codes[0 .. d) and returns the row's scale: Fp8RowScale(max |x|), code =
// E4M3 of x / scale rounded to nearest even (saturating at +-448).
inline float QuantiseFp8Row(const void* x, DType t, int64_t elem0, int d, uint8_t* codes) {
  float max_abs = 0.0f;
  for (int c = 0; c < d; ++c) max_abs = std::fmax(max_abs, std::fabs(LoadAsFloat(x, t, elem0 + c)));
  const float scale = Fp8RowScale(max_abs);
  for (int c = 0; c < d; ++c) codes[c] = FloatToFp8E4M3(LoadAsFloat(x, t, elem0 + c) / scale);
  return scale;
}

}  // namespace attnserve
