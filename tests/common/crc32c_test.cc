// CRC-32C against published check values (RFC 3720 B.4, the CRC catalogue's
// "123456789"), and the SSE4.2 path against the table on random data.
#include "common/crc32c.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(Crc32c, CheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(Crc32c(s.data(), s.size()), 0xE3069283u);
  EXPECT_EQ(Crc32cExtendPortable(0, s.data(), s.size()), 0xE3069283u);
}

TEST(Crc32c, Rfc3720Vectors) {
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF), up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[size_t(i)] = uint8_t(i);
    down[size_t(i)] = uint8_t(31 - i);
  }
  for (auto* f : {&Crc32cExtend, &Crc32cExtendPortable}) {
    EXPECT_EQ(f(0, zeros.data(), 32), 0x8A9136AAu);
    EXPECT_EQ(f(0, ones.data(), 32), 0x62A8AB43u);
    EXPECT_EQ(f(0, up.data(), 32), 0x46DD794Eu);
    EXPECT_EQ(f(0, down.data(), 32), 0x113FDB5Cu);
  }
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, HardwareMatchesTableOnRandomData) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> data(1 << 16);
  for (uint8_t& b : data) b = uint8_t(rng());
  std::uniform_int_distribution<size_t> pick(0, data.size());
  for (int i = 0; i < 200; ++i) {
    // Unaligned starts and odd lengths reach every branch of both forms.
    size_t a = pick(rng), b = pick(rng);
    if (a > b) std::swap(a, b);
    EXPECT_EQ(Crc32cExtend(0, data.data() + a, b - a),
              Crc32cExtendPortable(0, data.data() + a, b - a))
        << "bytes [" << a << ", " << b << ")";
  }
  if (!Crc32cHardware()) GTEST_SKIP() << "no SSE4.2: only the table form ran";
}

TEST(Crc32c, ExtendIsConcatenation) {
  const std::string s = "The quick brown fox jumps over the lazy dog";
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    const uint32_t part = Crc32cExtend(Crc32c(s.data(), cut), s.data() + cut, s.size() - cut);
    EXPECT_EQ(part, Crc32c(s.data(), s.size()));
  }
  EXPECT_EQ(Crc32c(s.data(), s.size()), 0x22620404u);
}

}  // namespace
}  // namespace attnserve
