// The UCX transport's framing under random and hostile bytes: the prefix
// parser and the step-header parser never crash, accept only what they
// should, and name the field they refuse.
#include <cstring>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "server/ucx/frame.h"
#include "server/ucx/kv_steps.h"

namespace attnserve {
namespace ucx {
namespace {

std::string Bytes(std::mt19937_64* rng, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>((*rng)() & 0xff);
  return out;
}

absl::StatusOr<FramePrefix> Parse(const std::string& bytes, Receiver r = Receiver::kServer,
                                  FrameLimits limits = FrameLimits()) {
  return ParsePrefix(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), limits, r);
}

FramePrefix Step(uint32_t header, uint64_t q, uint64_t k, uint64_t v) {
  FramePrefix p;
  p.type = FrameType::kStep;
  p.header_bytes = header;
  p.payload_bytes = {q, k, v, 0};
  return p;
}

TEST(UcxFrameTest, RoundTripsAValidStep) {
  const FramePrefix p = Step(100, 1 << 20, 4096, 4096);
  absl::StatusOr<FramePrefix> back = Parse(EncodePrefix(p));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->type, FrameType::kStep);
  EXPECT_EQ(back->header_bytes, 100u);
  EXPECT_EQ(back->payload_bytes[kQ], uint64_t{1} << 20);
  EXPECT_EQ(back->payload_total(), (uint64_t{1} << 20) + 8192);
}

TEST(UcxFrameTest, RandomBytesAreRefusedNamingTheField) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const std::string bytes = Bytes(&rng, kPrefixBytes);
    absl::StatusOr<FramePrefix> p = Parse(bytes);
    // 2^-32 odds of the right magic; the rest must say why.
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(std::string(p.status().message()).find("magic"), std::string::npos);
    }
  }
}

TEST(UcxFrameTest, EveryMutationOfAValidPrefixIsParsedOrRefusedNeverBeyondLimits) {
  std::mt19937_64 rng(11);
  FrameLimits limits;
  limits.max_header_bytes = 1 << 16;
  limits.max_frame_bytes = 1 << 24;
  const std::string base = EncodePrefix(Step(64, 1024, 512, 512));
  for (int i = 0; i < 200000; ++i) {
    std::string bytes = base;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) bytes[rng() % kPrefixBytes] = static_cast<char>(rng() & 0xff);
    absl::StatusOr<FramePrefix> p = Parse(bytes, Receiver::kServer, limits);
    if (!p.ok()) {
      EXPECT_FALSE(p.status().message().empty());
      continue;
    }
    // Whatever parses is within every limit: the listener allocates these sizes.
    EXPECT_LE(p->header_bytes,
              p->type == FrameType::kHello ? limits.max_hello_bytes : limits.max_header_bytes);
    EXPECT_LE(p->header_bytes + p->payload_total(), limits.max_frame_bytes);
    EXPECT_TRUE(p->type == FrameType::kHello || p->type == FrameType::kStep);
  }
}

TEST(UcxFrameTest, SizesOverTheLimitsNameTheField) {
  FrameLimits limits;
  limits.max_header_bytes = 1000;
  limits.max_frame_bytes = 10000;
  absl::StatusOr<FramePrefix> p =
      Parse(EncodePrefix(Step(1001, 0, 0, 0)), Receiver::kServer, limits);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("header_bytes: expected at most 1000, got 1001"),
            std::string::npos)
      << p.status();
  p = Parse(EncodePrefix(Step(10, 20000, 0, 0)), Receiver::kServer, limits);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("payload_bytes[0] (q)"), std::string::npos)
      << p.status();
  // Each under the limit, together over it; and sizes whose sum would wrap.
  p = Parse(EncodePrefix(Step(10, 4000, 4000, 4000)), Receiver::kServer, limits);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("frame bytes"), std::string::npos) << p.status();
  p = Parse(EncodePrefix(Step(0, ~uint64_t{0}, 2, 0)), Receiver::kServer, limits);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("payload_bytes[0] (q)"), std::string::npos);
  // A hello carries no payloads; a step no fourth one.
  FramePrefix hello;
  hello.type = FrameType::kHello;
  hello.payload_bytes[1] = 5;
  p = Parse(EncodePrefix(hello));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("payload_bytes[1]"), std::string::npos);
  FramePrefix step = Step(1, 1, 1, 1);
  step.payload_bytes[3] = 1;
  p = Parse(EncodePrefix(step));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("payload_bytes[3]"), std::string::npos);
}

TEST(UcxFrameTest, EachSideAcceptsOnlyItsFrameTypes) {
  FramePrefix reply;
  reply.type = FrameType::kStepReply;
  absl::StatusOr<FramePrefix> p = Parse(EncodePrefix(reply), Receiver::kServer);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("type: expected 1 (hello) or 3 (step), got 4"),
            std::string::npos)
      << p.status();
  EXPECT_FALSE(Parse(EncodePrefix(Step(1, 1, 1, 1)), Receiver::kClient).ok());
  EXPECT_TRUE(Parse(EncodePrefix(reply), Receiver::kClient).ok());
  EXPECT_FALSE(Parse(std::string(kPrefixBytes - 1, '\0')).ok());
}

TEST(UcxFrameTest, StepHeaderParserTakesRandomBytesWithoutCrashing) {
  std::mt19937_64 rng(3);
  int parsed = 0;
  for (int i = 0; i < 50000; ++i) {
    const std::string bytes = Bytes(&rng, rng() % 256);
    absl::StatusOr<v1::AppendAttendRequest> r = ParseStepHeader(bytes);
    if (r.ok()) {
      ++parsed;
      EXPECT_TRUE(r->q().data().empty() && r->k().data().empty() && r->v().data().empty());
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  // Random bytes rarely parse as a message; some do (proto is permissive).
  EXPECT_LT(parsed, 50000);
}

TEST(UcxFrameTest, StepHeaderRefusesTensorBytesAndSharedMemoryNamingTheField) {
  v1::AppendAttendRequest r;
  r.set_cache_id("c");
  r.mutable_k()->set_data("xx");
  absl::StatusOr<v1::AppendAttendRequest> parsed = ParseStepHeader(r.SerializeAsString());
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(std::string(parsed.status().message()).find("k.data: expected empty over UCX"),
            std::string::npos)
      << parsed.status();
  r.mutable_k()->clear_data();
  r.mutable_q()->mutable_shm()->set_region("r");
  parsed = ParseStepHeader(r.SerializeAsString());
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(std::string(parsed.status().message()).find("q.shm"), std::string::npos);
  r.mutable_q()->clear_shm();
  r.mutable_output_shm()->mutable_o()->set_region("r");
  parsed = ParseStepHeader(r.SerializeAsString());
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(std::string(parsed.status().message()).find("output_shm"), std::string::npos);
  r.clear_output_shm();
  EXPECT_TRUE(ParseStepHeader(r.SerializeAsString()).ok());
}

}  // namespace
}  // namespace ucx
}  // namespace attnserve
