// The tolerance constants of docs/design.md §4 in one place, for every checker of
// an attention result against the float64 reference: the tests' CheckOutput
// (tests/common/attn_test_util.cc) and the client's `attnctl --verify` / `load
// --check` (client/verify.cc). Header-only and free of GoogleTest, so the
// client can use it.
//
// The policy (FlashAttention's), with ref the float64 reference and ref_lowp
// the same function evaluated in the input dtype (reference_attention.h):
//   O, FP16/BF16:   max|out - ref| <= 2 * max|ref_lowp - ref| + OutputFloor(dtype).
//   O, FP8_E4M3:    the BF16 rule: ref is float64 on the dequantised inputs
//                   (code * descale), ref_lowp the BF16 computation on them
//                   rounded to BF16 (O is BF16), floor kBf16OutputFloor.
//   O, FP32:        every element |out - ref| <= kFp32Rtol * max|ref of its vector| + kFp32Atol,
//                   a vector being one query row of one head.
//   LSE, FP16/BF16 (and FP8_E4M3): max|lse - ref| <= 2 * max|lse_lowp - ref| + kLowpLseFloor.
//   LSE, FP32:      every element |lse - ref| <= kFp32Rtol * |ref| + kFp32LseAtol.
//   Rows that see no key: O exactly 0 and LSE exactly -inf (with sinks, LSE
//   is sink[h] and held to the LSE rule above).
#pragma once

#include "backend/params.h"

namespace attnserve {
namespace tolerance {

// FP32 inputs: relative error under kFp32Rtol, measured per output vector
// (one query row of one head). Per vector, not per element: an element that is
// a near-zero sum of terms of both signs carries the absolute error of the
// terms (fp32 scores of magnitude |s| are off by ~|s|·2^-24, which moves every
// weight by that relative amount), so a per-element relative bound would fail
// any correct fp32 kernel whenever scores are large; a vector's largest element
// is the honest scale. A wrong mask, scale or normalisation moves whole vectors
// by far more than 1e-5 of that scale. kFp32Atol only covers all-tiny vectors.
inline constexpr double kFp32Rtol = 1e-5;
inline constexpr double kFp32Atol = 1e-6;

// One ulp at 1.0 (2^-10): O is a convex combination of V rows (|v| ~ 1), so a
// correct kernel's only error is one final rounding; the floor keeps cases
// where the low-precision reference is exact (Sk = 1) from demanding bit
// equality.
inline constexpr double kFp16OutputFloor = 1e-3;
// Same reasoning with bf16's 8-bit mantissa: one ulp at 1.0 is 2^-7.
inline constexpr double kBf16OutputFloor = 8e-3;

// LSE (always FP32 on the wire) of FP32 inputs: the relative rule with this
// floor; LSE values are O(1..10), so the floor is rarely what decides.
inline constexpr double kFp32LseAtol = 1e-5;
// LSE of FP16/BF16 inputs: 2 * max|lse_lowp - lse| + this floor. A backend
// computes LSE in fp32 from the rounded inputs, so its own error is ~1e-6; the
// floor only matters when the low-precision reference happens to be exact.
inline constexpr double kLowpLseFloor = 1e-4;

// The absolute floor of O's bound for inputs of dtype `t` (FP32: kFp32Atol).
inline constexpr double OutputFloor(DType t) {
  switch (t) {
    case DType::kFP16: return kFp16OutputFloor;
    case DType::kBF16:
    case DType::kFP8E4M3:  // O is BF16
      return kBf16OutputFloor;
    case DType::kFP32: return kFp32Atol;
  }
  return 0.0;
}

}  // namespace tolerance
}  // namespace attnserve
