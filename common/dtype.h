// Host-side element types: sizes, names, and conversions between FP16/BF16 bit
// patterns and float. Used by the CPU backend, the reference, tests and clients.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "backend/params.h"

namespace attnserve {

inline constexpr int64_t DTypeSize(DType t) { return t == DType::kFP32 ? 4 : 2; }

inline constexpr std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFP16: return "FP16";
    case DType::kBF16: return "BF16";
    case DType::kFP32: return "FP32";
  }
  return "UNKNOWN";
}

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// BF16 is the upper half of an fp32; rounding to nearest even, NaN kept quiet.
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 <-> binary32, round to nearest even, subnormals and inf/NaN kept.
inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return BitsFloat(sign | ((exp + 112u) << 23) | (man << 13));
  // Zero or subnormal: value = man * 2^-24.
  const float mag = std::ldexp(static_cast<float>(man), -24);
  return sign ? -mag : mag;
}
inline uint16_t FloatToFp16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf (>= 65520)
  if (abs < 0x38800000u) {                        // below 2^-14: subnormal or zero
    // Adding 0.5 (as fp32) aligns the binary point so the FPU rounds to the
    // fp16 subnormal grid (2^-24) with round-to-nearest-even for us.
    const float r = BitsFloat(abs) + 0.5f;
    return sign | static_cast<uint16_t>(FloatBits(r) - 0x3f000000u);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // round mantissa to 10 bits, ties to even
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

// Reads element i of a buffer holding `t` values, as float.
inline float LoadAsFloat(const void* data, DType t, int64_t i) {
  switch (t) {
    case DType::kFP16: return Fp16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16: return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFP32: return static_cast<const float*>(data)[i];
  }
  return 0.0f;
}
// Writes float x as element i of a buffer holding `t` values (rounding to t).
inline void StoreFromFloat(void* data, DType t, int64_t i, float x) {
  switch (t) {
    case DType::kFP16: static_cast<uint16_t*>(data)[i] = FloatToFp16(x); return;
    case DType::kBF16: static_cast<uint16_t*>(data)[i] = FloatToBf16(x); return;
    case DType::kFP32: static_cast<float*>(data)[i] = x; return;
  }
}
// x rounded to the precision of t and back (for low-precision references).
inline float RoundTo(DType t, float x) {
  switch (t) {
    case DType::kFP16: return Fp16ToFloat(FloatToFp16(x));
    case DType::kBF16: return Bf16ToFloat(FloatToBf16(x));
    case DType::kFP32: return x;
  }
  return x;
}

}  // namespace attnserve
