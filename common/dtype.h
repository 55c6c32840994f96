// Host-side element types: sizes, names, and conversions between FP16/BF16/FP8
// bit patterns and float. Used by the CPU backend, the reference, tests and clients.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace attnserve {

// Values match attnserve.v1.DType on the wire. kFP8E4M3: OCP FP8 E4M3 codes
// (1 byte), each tensor with its own descale factor (AttnParams::q_descale..).
enum class DType : int32_t { kFP16 = 1, kBF16 = 2, kFP32 = 3, kFP8E4M3 = 4 };

inline constexpr int64_t DTypeSize(DType t) {
  switch (t) {
    case DType::kFP32: return 4;
    case DType::kFP8E4M3: return 1;
    case DType::kFP16:
    case DType::kBF16: return 2;
  }
  return 2;
}

inline constexpr std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFP16: return "FP16";
    case DType::kBF16: return "BF16";
    case DType::kFP32: return "FP32";
    case DType::kFP8E4M3: return "FP8_E4M3";
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

// OCP FP8 E4M3 (the "fn" variant: no infinities): 1 sign bit, 4 exponent bits
// with bias 7, 3 mantissa bits. Exponent 0 is subnormal (m * 2^-9); S.1111.111
// is NaN, so the largest finite value is S.1111.110 = 1.75 * 2^8 = 448.
inline constexpr uint8_t kFp8E4M3Max = 0x7e;  // +448
inline constexpr uint8_t kFp8E4M3NaN = 0x7f;

inline float Fp8E4M3ToFloat(uint8_t code) {
  const int e = (code >> 3) & 0xf;
  const int m = code & 0x7;
  if (e == 0xf && m == 0x7) return BitsFloat(((code & 0x80u) << 24) | 0x7fc00000u);
  // Normal: (1 + m/8) * 2^(e-7) = (8 + m) * 2^(e-10); subnormal: m * 2^-9 =
  // 2m * 2^-10. The integer part is exact and so is the power-of-two scaling.
  const float mag = static_cast<float>(e == 0 ? 2 * m : (8 + m) << e) * (1.0f / 1024.0f);
  return (code & 0x80u) ? -mag : mag;
}

// Round to nearest even, saturating: finite values past 448 and infinities
// become +-448 (what FP8 quantisers do: E4M3 has no infinity), NaN stays NaN.
inline uint8_t FloatToFp8E4M3(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | kFp8E4M3NaN;
  if (abs >= 0x43e00000u) return sign | kFp8E4M3Max;  // >= 448
  if (abs < 0x3c800000u) {                            // below 2^-6: subnormal or zero
    // m = a * 2^9 rounded to even; m = 8 is the smallest normal, whose code is 8 too.
    return sign | static_cast<uint8_t>(std::nearbyint(BitsFloat(abs) * 512.0f));
  }
  // Round the 23-bit mantissa to 3 bits (ties to even); a carry moves into the
  // exponent, which is what the encoding wants. Rebias 127 -> 7.
  const uint32_t rounded = abs + 0x7ffffu + ((abs >> 20) & 1u);
  const uint32_t code = (rounded >> 20) - (120u << 3);
  return sign | static_cast<uint8_t>(code > kFp8E4M3Max ? kFp8E4M3Max : code);
}

// Reads element i of a buffer holding `t` values, as float (FP8: the decoded
// code, without its tensor's descale).
inline float LoadAsFloat(const void* data, DType t, int64_t i) {
  switch (t) {
    case DType::kFP16: return Fp16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16: return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kFP32: return static_cast<const float*>(data)[i];
    case DType::kFP8E4M3: return Fp8E4M3ToFloat(static_cast<const uint8_t*>(data)[i]);
  }
  return 0.0f;
}
// Writes float x as element i of a buffer holding `t` values (rounding to t).
inline void StoreFromFloat(void* data, DType t, int64_t i, float x) {
  switch (t) {
    case DType::kFP16: static_cast<uint16_t*>(data)[i] = FloatToFp16(x); return;
    case DType::kBF16: static_cast<uint16_t*>(data)[i] = FloatToBf16(x); return;
    case DType::kFP32: static_cast<float*>(data)[i] = x; return;
    case DType::kFP8E4M3: static_cast<uint8_t*>(data)[i] = FloatToFp8E4M3(x); return;
  }
}
// x rounded to the precision of t and back (for low-precision references).
inline float RoundTo(DType t, float x) {
  switch (t) {
    case DType::kFP16: return Fp16ToFloat(FloatToFp16(x));
    case DType::kBF16: return Bf16ToFloat(FloatToBf16(x));
    case DType::kFP32: return x;
    case DType::kFP8E4M3: return Fp8E4M3ToFloat(FloatToFp8E4M3(x));
  }
  return x;
}

}  // namespace attnserve
