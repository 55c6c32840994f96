// The accepted range of softmax_scale and softcap: inside it every backend's
// score arithmetic stays finite and accurate; outside it a request is refused
// (INVALID_ARGUMENT) instead of answering with NaN. One place for the rule:
// the server's request validation and the backend's CheckParams both use it.
//
// Why these numbers. The kernels compute a score as
//   no softcap: (q·k) * softmax_scale * log2(e), then exp2 of differences;
//   softcap:    tanh((q·k) * (softmax_scale / softcap)) * softcap * log2(e)
// (the CPU backend folds the factor into q before the dot product, the CUDA
// kernels multiply the float32 dot product by it). The largest |q·k| finite
// FP16 inputs can give is D * 65504^2 = 256 * 65504^2 ~ 1.1e12, so a factor
// up to 1e26 keeps every product below 1e26 * 1.443 * 1.1e12 ~ 1.6e38, under
// FLT_MAX = 3.4e38 with 2x to spare. A larger factor overflows to inf and
// inf - inf in the softmax is NaN (softmax_scale = 2e38 did exactly that; so
// did softcap = 1e-45 or 1e-39, which make softmax_scale / softcap overflow).
// softcap itself is bounded by 1e26 so that softcap * log2(e) is finite and
// the rounding error of a tiny pre-tanh value, times softcap, stays far below
// float precision (about softcap * 2.3e-38 for FP16 inputs: 2.3e-12 at the
// bound; softcap = 3e38 made softcap * log2(e) inf and the output NaN).
// No lower bound on softmax_scale is needed: a tiny scale gives (correctly)
// near-uniform weights. BF16 and FP32 inputs can hold products beyond 1.1e12
// (up to inf); for them the same bounds hold while |q·k| <= 1.1e12, and
// larger products are a matter of the data (Inf/NaN in, Inf/NaN out).
//
// FP8 (E4M3) inputs: an element is its code (|code| <= 448) times its tensor's
// descale. Descales are bounded by kMaxDescale = 128 so that every dequantised
// value, 448 * 128 = 57344, lies inside FP16's range (65504): the FP16
// analysis above then covers FP8 unchanged, with no rule of its own. 128 is
// far above practical descales (amax / 448: an amax of 57344). No lower bound
// beyond > 0: a tiny descale makes tiny values (underflowing to 0 in BF16
// staging), which is a valid, near-uniform attention, never a NaN.
// Header-only and free of Abseil so CUDA code can include it.
#pragma once

#include <cmath>

namespace attnserve {

// softmax_scale: finite, > 0 and at most this.
inline constexpr float kMaxSoftmaxScale = 1e26f;
// softcap: 0 (off), or at most this and at least softmax_scale / kMaxSoftcapFactor.
inline constexpr float kMaxSoftcap = 1e26f;
// The factor softmax_scale / softcap applied before tanh: at most this.
inline constexpr float kMaxSoftcapFactor = 1e26f;

// q_descale, k_descale, v_descale (FP8 only): finite, > 0 and at most this.
inline constexpr float kMaxDescale = 128.0f;

// The contract's default when the request leaves softmax_scale unset.
inline float DefaultSoftmaxScale(int head_dim) {
  return 1.0f / std::sqrt(static_cast<float>(head_dim));
}

// The smallest softcap (other than 0) accepted together with `softmax_scale`.
inline float MinSoftcap(float softmax_scale) { return softmax_scale / kMaxSoftcapFactor; }

inline bool SoftmaxScaleInRange(float softmax_scale) {
  return std::isfinite(softmax_scale) && softmax_scale > 0.0f && softmax_scale <= kMaxSoftmaxScale;
}

inline bool DescaleInRange(float descale) {
  return std::isfinite(descale) && descale > 0.0f && descale <= kMaxDescale;
}

// For a softmax_scale that is in range.
inline bool SoftcapInRange(float softcap, float softmax_scale) {
  if (softcap == 0.0f) return true;
  return std::isfinite(softcap) && softcap <= kMaxSoftcap && softcap >= MinSoftcap(softmax_scale);
}

}  // namespace attnserve
