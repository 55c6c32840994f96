// FP16/BF16/FP8 E4M3 <-> float conversions of common/dtype.h: exact round
// trips, round-to-nearest-even ties, subnormals, overflow, infinities and NaN.
// FP8's decode is checked on all 256 codes against values computed here from
// the OCP spec's definition, not from the code under test.
#include "common/dtype.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

bool IsFp16Nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool IsBf16Nan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0; }

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kFP16), 2);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_EQ(DTypeSize(DType::kFP32), 4);
  EXPECT_EQ(DTypeName(DType::kFP16), "FP16");
  EXPECT_EQ(DTypeName(DType::kBF16), "BF16");
  EXPECT_EQ(DTypeName(DType::kFP32), "FP32");
  EXPECT_EQ(DTypeSize(DType::kFP8E4M3), 1);
  EXPECT_EQ(DTypeName(DType::kFP8E4M3), "FP8_E4M3");
  EXPECT_EQ(DTypeName(static_cast<DType>(9)), "UNKNOWN");
}

// The OCP FP8 E4M3 value of `code` straight from the spec: sign, biased
// exponent E (bias 7), mantissa M; E = 0 is subnormal, (-1)^S * 2^-6 * M/8;
// otherwise (-1)^S * 2^(E-7) * (1 + M/8); S.1111.111 is NaN; no infinities.
double SpecE4M3(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

TEST(DTypeTest, Fp8E4M3DecodesAll256Codes) {
  int nans = 0;
  for (int code = 0; code < 256; ++code) {
    const double want = SpecE4M3(code);
    const float got = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << code;
      ++nans;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << "code " << code;
    EXPECT_EQ(std::signbit(got), code >= 128) << "code " << code;  // -0 for 0x80
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff
  // Landmarks of the spec's table.
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);  // largest finite
  EXPECT_EQ(Fp8E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), 0.015625f);     // smallest normal 2^-6
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0.001953125f);  // smallest subnormal 2^-9
  EXPECT_EQ(Fp8E4M3ToFloat(0x07), 0.013671875f);  // largest subnormal 7 * 2^-9
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x78), 256.0f);  // E = 15 is finite in E4M3
}

// Every code except NaN survives decode -> encode, and the float view agrees.
TEST(DTypeTest, Fp8E4M3RoundTripsEveryCode) {
  for (int code = 0; code < 256; ++code) {
    const float f = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    if (std::isnan(f)) {
      EXPECT_EQ(FloatToFp8E4M3(f) & 0x7f, 0x7f) << code;
      continue;
    }
    EXPECT_EQ(FloatToFp8E4M3(f), code) << "code " << code << " = " << f;
    EXPECT_EQ(RoundTo(DType::kFP8E4M3, f), f) << code;
  }
}

// Encoding any float picks the nearest code (ties to the even mantissa) and
// saturates: checked against a brute-force search over the finite codes.
TEST(DTypeTest, Fp8E4M3EncodeIsNearestEvenAndSaturates) {
  std::vector<float> probes;
  for (int code = 0; code < 0x7f; ++code) {  // positive finite codes
    const float a = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    const float b = code + 1 < 0x7f ? Fp8E4M3ToFloat(static_cast<uint8_t>(code + 1)) : 480.0f;
    const float mid = 0.5f * (a + b);  // the tie (exact in float)
    for (float x : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f),
                    a + 0.25f * (b - a), a + 0.75f * (b - a)}) {
      probes.push_back(x);
      probes.push_back(-x);
    }
  }
  for (float x : probes) {
    // Brute force: the finite code of least distance; on a tie, the even mantissa.
    int best = -1;
    double best_d = 0;
    for (int code = 0; code < 256; ++code) {
      const double v = SpecE4M3(code);
      if (std::isnan(v) || (std::signbit(v) != std::signbit(x))) continue;
      const double d = std::fabs(v - x);
      if (best < 0 || d < best_d || (d == best_d && (code & 1) == 0)) {
        best = code;
        best_d = d;
      }
    }
    EXPECT_EQ(FloatToFp8E4M3(x), best) << "x = " << x;
  }
  EXPECT_EQ(FloatToFp8E4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(470.0f), 0x7e);  // saturates instead of NaN
  EXPECT_EQ(FloatToFp8E4M3(1e30f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(FloatToFp8E4M3(0.0009765625f), 0x00);  // 2^-10: tie between 0 and 2^-9 -> even 0
  EXPECT_EQ(FloatToFp8E4M3(0.0029296875f), 0x02);  // 1.5 * 2^-9: tie -> even mantissa 2
  EXPECT_EQ(FloatToFp8E4M3(1e-20f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-1e-20f), 0x80);
}

TEST(DTypeTest, Fp8E4M3BufferAccess) {
  uint8_t buf[3] = {};
  StoreFromFloat(buf, DType::kFP8E4M3, 1, -2.5f);
  EXPECT_EQ(buf[1], 0xc2);  // -1.25 * 2^1: S=1, E=8, M=2
  EXPECT_EQ(LoadAsFloat(buf, DType::kFP8E4M3, 1), -2.5f);
  EXPECT_EQ(RoundTo(DType::kFP8E4M3, 0.3f), 0.3125f);  // nearest code: 1.25 * 2^-2
}

// Every non-NaN fp16 bit pattern survives fp16 -> float -> fp16.
TEST(DTypeTest, Fp16RoundTripsEveryValue) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = Fp16ToFloat(bits);
    if (IsFp16Nan(bits)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(IsFp16Nan(FloatToFp16(f))) << h;
      continue;
    }
    ASSERT_EQ(FloatToFp16(f), bits) << "fp16 bits " << h << " -> " << f;
  }
}

TEST(DTypeTest, Bf16RoundTripsEveryValue) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = Bf16ToFloat(bits);
    if (IsBf16Nan(bits)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(IsBf16Nan(FloatToBf16(f))) << h;
      continue;
    }
    ASSERT_EQ(FloatToBf16(f), bits) << "bf16 bits " << h;
  }
}

TEST(DTypeTest, Fp16KnownValues) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(FloatToFp16(0.0f), 0x0000);
  EXPECT_EQ(FloatToFp16(-0.0f), 0x8000);
  EXPECT_FLOAT_EQ(Fp16ToFloat(0x3555), 0.333251953125f);
}

// Ties go to the even mantissa, in the normal and the subnormal range.
TEST(DTypeTest, Fp16RoundsTiesToEven) {
  // Between 1 and 1 + 2^-10 the midpoint is 1 + 2^-11: ties to 1 (even).
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // Between 1 + 2^-10 (odd) and 1 + 2^-9 (even): ties up.
  EXPECT_EQ(FloatToFp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Just above the midpoint rounds up.
  EXPECT_EQ(FloatToFp16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Subnormal grid 2^-24: 0.5 * 2^-24 ties to 0, 1.5 * 2^-24 ties to 2 * 2^-24.
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToFp16(std::ldexp(3.0f, -25)), 0x0002);
  EXPECT_EQ(FloatToFp16(std::ldexp(5.0f, -25)), 0x0002);
}

TEST(DTypeTest, Fp16Subnormals) {
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(Fp16ToFloat(0x03ff), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(Fp16ToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToFp16(std::ldexp(1023.0f, -24)), 0x03ff);
  // The largest subnormal plus half an ulp rounds up into the normal range.
  EXPECT_EQ(FloatToFp16(std::ldexp(1023.5f, -24)), 0x0400);
  // Far below the grid: zero with the sign kept.
  EXPECT_EQ(FloatToFp16(1e-30f), 0x0000);
  EXPECT_EQ(FloatToFp16(-1e-30f), 0x8000);
}

TEST(DTypeTest, Fp16OverflowInfNan) {
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bff);  // below the midpoint to 2^16: stays finite
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);  // the midpoint ties to inf (even)
  EXPECT_EQ(FloatToFp16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToFp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(IsFp16Nan(FloatToFp16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isinf(Fp16ToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(Fp16ToFloat(0x7e00)));
}

TEST(DTypeTest, Bf16RoundingAndSpecials) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // Midpoint between 1 and 1 + 2^-7 ties to 1 (even); the next one ties up.
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(FloatToBf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3f81);
  // Subnormal fp32 values keep bf16's subnormal encoding.
  EXPECT_EQ(FloatToBf16(std::ldexp(1.0f, -133)), 0x0001);
  // The largest finite float rounds to inf.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_TRUE(IsBf16Nan(FloatToBf16(std::numeric_limits<float>::quiet_NaN())));
  // A NaN whose payload sits only in the low 16 bits must not become inf.
  EXPECT_TRUE(IsBf16Nan(FloatToBf16(BitsFloat(0x7f800001u))));
}

TEST(DTypeTest, LoadStoreAndRoundTo) {
  uint16_t h[2] = {};
  float f[2] = {};
  StoreFromFloat(h, DType::kFP16, 1, 0.5f);
  EXPECT_EQ(h[1], 0x3800);
  EXPECT_EQ(LoadAsFloat(h, DType::kFP16, 1), 0.5f);
  StoreFromFloat(h, DType::kBF16, 0, -3.0f);
  EXPECT_EQ(LoadAsFloat(h, DType::kBF16, 0), -3.0f);
  StoreFromFloat(f, DType::kFP32, 1, 0.1f);
  EXPECT_EQ(LoadAsFloat(f, DType::kFP32, 1), 0.1f);
  EXPECT_EQ(RoundTo(DType::kFP32, 0.1f), 0.1f);
  EXPECT_EQ(RoundTo(DType::kFP16, 0.1f), Fp16ToFloat(FloatToFp16(0.1f)));
  EXPECT_EQ(RoundTo(DType::kBF16, 0.1f), Bf16ToFloat(FloatToBf16(0.1f)));
  EXPECT_NE(RoundTo(DType::kBF16, 0.1f), 0.1f);
}

}  // namespace
}  // namespace attnserve
