// The tolerance constants of docs/design.md §4 in one place, for every checker of
// an attention result against the float64 reference: the tests' CheckOutput
// (tests/common/attn_test_util.cc) and the client's `attnctl --verify` / `load
// --check` (client/verify.cc). Header-only and free of GoogleTest, so the
// client can use it.
//
// The policy (FlashAttention's), with ref the float64 reference and ref_lowp
// the same function evaluated in the input dtype (reference_attention.h):
//   O, FP16/BF16:   max|out - ref| <= 2 * max|ref_lowp - ref| + OutputFloor(dtype).
//   O, FP8_E4M3:    the BF16 rule plus Fp8PBound(keys, max|v|): ref is float64
//                   on the dequantised inputs (code * descale), ref_lowp the
//                   BF16 computation on them rounded to BF16 (O is BF16),
//                   floor kBf16OutputFloor; the added term is what rounding
//                   the softmax weights P to E4M3 for an FP8 P V may cost
//                   (kFp8PRtol below), keys the most keys any query row
//                   sees (Sk, the longest sequence's for varlen), max|v| the
//                   largest |code * v_descale| of V.
//   O, FP32:        every element |out - ref| <= kFp32Rtol * max|ref of its vector| + kFp32Atol,
//                   a vector being one query row of one head.
//   LSE, FP16/BF16 (and FP8_E4M3): max|lse - ref| <= 2 * max|lse_lowp - ref| + kLowpLseFloor.
//   LSE, FP32:      every element |lse - ref| <= kFp32Rtol * |ref| + kFp32LseAtol.
//   O, FP8 K/V cache (pages of E4M3 codes with a scale per token and KV head,
//                   Q and O FP16/BF16): the rule of O's dtype, with ref float64
//                   over the dequantised cache (code * scale, exact) and
//                   ref_lowp the dtype's computation on those values rounded
//                   to the dtype (ReferenceAttention(p, KvRowScales)); see
//                   kFp8CodeRtol for what the quantisation itself costs.
//   Rows that see no key: O exactly 0 and LSE exactly -inf (with sinks, LSE
//   is sink[h] and held to the LSE rule above).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/params.h"
#include "common/dtype.h"

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

// FP8 K/V caches. Against the dequantised cache a kernel has no more error
// than a 16-bit one: it multiplies codes (exact in FP16/BF16) by their scale in
// fp32, which is no worse than rounding the product to the dtype, so the
// dtype's rule above holds there. What the quantisation costs against the
// 16-bit K/V the append received is a separate, stated bound: an E4M3 code
// rounds x / scale to nearest with 3 mantissa bits, a relative error of at
// most 2^-4 (half an ulp of 1.xxx), and codes below 2^-6 (subnormal) are off by
// at most 2^-10 in code units, which is below 2^-4 of the row's largest code
// (448). So every K or V element moves by at most kFp8CodeRtol times its row's
// max |x|. For O = sum_j p_j v_j that means: V's share moves O by at most
// kFp8CodeRtol * max_j |v_j| (a convex combination); K's moves each score by
// at most delta = softmax_scale * kFp8CodeRtol * sum_d |q_d| * max|k_j|, so each
// weight by a factor within exp(+-2 delta), and O by at most
// (exp(2 delta) - 1) * max_j |v_j|. Fp8CacheBound is that bound.
inline constexpr double kFp8CodeRtol = 1.0 / 16;

// The largest |O_fp8 - O_16bit| the quantisation may cause for a query row
// whose largest score shift is `delta` (above) and whose keys' V rows have
// largest |v| `max_abs_v`.
inline double Fp8CacheBound(double delta, double max_abs_v) {
  return (kFp8CodeRtol + (std::exp(2.0 * delta) - 1.0)) * max_abs_v;
}

// FP8 inputs: a kernel may run P V on FP8 codes (CUDA's Hopper prefill,
// Plan::fp8_pv): each weight p_j = exp(s_j - m) in [0, 1] (m the row's
// running max when its tile is scanned) is scaled by 2^8 and rounded to
// nearest E4M3, and O is normalised by the sum of those rounded weights, so
// it stays a convex combination of V rows (the tensor core sums them with
// O). A normal E4M3 value (>= 2^-6) is off by at most half an ulp, 2^-4 of
// itself (3 mantissa bits); a subnormal one (spacing 2^-9) by at most
// 2^-10, i.e. 2^-18 once the 2^8 is taken off. Later rescaling by
// exp(m - M) <= 1 (M the final max) only shrinks both. So with weights
// w_j = exp(s_j - M), rounded ones u_j = w_j + d_j, L = sum_j w_j >= 1 (the
// top key has w = u = 1), n visible keys and O = sum_j u_j v_j / sum_j u_j:
//   O - O_exact = sum_j d_j (v_j - O) / L,
// where |d_j| <= 2^-4 u_j or 2^-18, sum_j u_j |v_j - O| <= max|v| sum_j u_j
// (a mean absolute deviation about the u-weighted mean of values in
// [-max|v|, max|v|]), sum_j u_j <= (1 + 2^-4) L + n 2^-18 and |v_j - O| <=
// 2 max|v|:
//   |O - O_exact| <= (2^-4 (1 + 2^-4 + n 2^-18) + n 2^-17) max|v|
//                 <= (2^-4 + 2^-8 + n (2^-17 + 2^-22)) max|v|.
// (A kernel normalising by the unrounded weights' sum instead leaves O
// biased by the flushed weights' share of it: at constant V and many tiny
// weights, O = v / (1 + their sum); cuda_fp8_pv_test checks O = v there.)
// V itself is exact (its codes are the inputs; the descale is applied to O
// in fp32), and the tensor core's accumulation of the E4M3 products (fp32
// accumulators) adds rounding far below this. A kernel may compute the
// weights with an exp2 of relative error up to 2^-11 (Plan::fp8_poly_exp2's
// polynomial): the weights' errors then grow by 2^-11 of themselves, which
// the extra 2^-9 in kFp8PRtol covers. The bound is loose for diffuse rows
// (the rounding errors are unbiased and average out) and tight for a row
// dominated by a few keys, which is where a wrong pairing of P and V shows:
// it moves O by a whole |v_a - v_b|.
inline constexpr double kFp8PRtol = 1.0 / 16 + 1.0 / 256 + 1.0 / 512;
inline constexpr double kFp8PAtol = 1.0 / (1 << 17) + 1.0 / (1 << 22);

// The FP8 term of O's bound for rows of at most `keys` visible keys and V
// values of largest magnitude `max_abs_v` (code * v_descale).
inline double Fp8PBound(int64_t keys, double max_abs_v) {
  return (kFp8PRtol + static_cast<double>(keys) * kFp8PAtol) * max_abs_v;
}

// Fp8PBound for the call `p` with host-memory inputs: its longest sequence's
// keys and V's largest |code * v_descale|. 0 for other dtypes.
inline double Fp8PTerm(const AttnParams& p) {
  if (p.dtype != DType::kFP8E4M3) return 0.0;
  int64_t keys = 0;
  for (int b = 0; b < p.batch; ++b) keys = std::max<int64_t>(keys, SeqLenK(p, b));
  double max_v = 0.0;
  const int64_t nv = p.total_k * p.num_heads_kv * HeadDimV(p);
  for (int64_t i = 0; i < nv; ++i) {
    max_v = std::max(max_v, std::fabs(static_cast<double>(LoadAsFloat(p.v, p.dtype, i)) *
                                      static_cast<double>(p.v_descale)));
  }
  return Fp8PBound(keys, max_v);
}

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
