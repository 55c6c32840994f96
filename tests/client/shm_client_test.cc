// ShmArena and the shared-memory calls of the C++ client against an
// in-process CPU server with --allow_client_shm: Forward through an arena
// held to the float64 reference and equal, byte for byte, to the same call
// over the message; append-and-attend (unary and stream) through an arena
// equal to the same steps over the message on a twin sequence; the arena's
// spans and bounds; Close unregistering the region and unlinking its object;
// and the refusals (a server without --allow_client_shm, a build without
// CUDA).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "client/inputs.h"
#include "client/kv_client.h"
#include "client/shm_arena.h"
#include "client/verify.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/loopback_server.h"
#include "tests/client/shm_leftovers.h"

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Keys of this test process only, so parallel tests never see each other's.
std::string KeyPrefix() { return absl::StrCat("/attnserve.default.shmclient", getpid(), "-"); }

class ShmClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = LoopbackServer::Start(/*allow_client_shm=*/true);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = AttentionClient::Create(server_->target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override {
    // Whatever a test did, it leaves no object and no registration behind.
    EXPECT_THAT(ShmObjectsUnder(KeyPrefix()), IsEmpty());
    auto regions = RegisteredRegions(server_->target());
    ASSERT_TRUE(regions.ok()) << regions.status();
    EXPECT_THAT(*regions, IsEmpty());
  }

  std::unique_ptr<ShmArena> MakeArena(uint64_t bytes) {
    ShmArenaOptions options;
    options.byte_size = bytes;
    options.key_prefix = KeyPrefix();
    auto arena = ShmArena::Create(*client_, options);
    EXPECT_TRUE(arena.ok()) << arena.status();
    return arena.ok() ? *std::move(arena) : nullptr;
  }

  static LoopbackServer* server_;
  std::unique_ptr<AttentionClient> client_;
};

LoopbackServer* ShmClientTest::server_ = nullptr;

TEST_F(ShmClientTest, ForwardThroughArenaMatchesReferenceAndMessage) {
  std::unique_ptr<ShmArena> arena = MakeArena(1 << 20);
  ASSERT_NE(arena, nullptr);
  const AttentionShape shapes[] = {DenseAttentionShape(DType::kFP16, 2, 24, 40, 4, 2, 32), [] {
                                     AttentionShape s;
                                     s.dtype = DType::kBF16;
                                     s.heads_q = 4;
                                     s.heads_kv = 2;
                                     s.head_dim = 16;
                                     s.seqlens_q = {5, 0, 17};
                                     s.seqlens_k = {9, 4, 17};
                                     return s;
                                   }()};
  for (const AttentionShape& shape : shapes) {
    absl::StatusOr<AttentionInputs> in = MakeRandomInputs(shape, 11);
    ASSERT_TRUE(in.ok()) << in.status();
    in->options.causal = true;
    in->options.return_lse = true;
    absl::StatusOr<ForwardResult> shm = client_->Forward(*in, *arena);
    ASSERT_TRUE(shm.ok()) << shm.status();
    absl::StatusOr<VerifyReport> report = VerifyForward(*in, *shm);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->passed) << report->failure;
    EXPECT_TRUE(report->lse_checked);
    absl::StatusOr<ForwardResult> message = client_->Forward(*in);
    ASSERT_TRUE(message.ok()) << message.status();
    EXPECT_EQ(shm->o.bytes(), message->o.bytes());
    ASSERT_TRUE(shm->lse.has_value());
    EXPECT_EQ(shm->lse->bytes(), message->lse->bytes());
  }
}

// The raw call puts no tensor bytes in the message and reads O from the
// arena: the response's O matches what the mapping holds at the span.
TEST_F(ShmClientTest, RawForwardSendsSpansNotBytes) {
  std::unique_ptr<ShmArena> arena = MakeArena(1 << 20);
  ASSERT_NE(arena, nullptr);
  absl::StatusOr<AttentionInputs> in =
      MakeRandomInputs(DenseAttentionShape(DType::kFP32, 1, 8, 8, 2, 2, 16), 3);
  ASSERT_TRUE(in.ok()) << in.status();
  v1::ForwardRequest request = MakeForwardRequest(*in);
  absl::StatusOr<ShmOutputSpans> spans = PlaceForwardInArena(*arena, &request);
  ASSERT_TRUE(spans.ok()) << spans.status();
  for (const v1::Tensor* t : {&request.q(), &request.k(), &request.v()}) {
    EXPECT_TRUE(t->data().empty());
    EXPECT_EQ(t->shm().region(), arena->name());
    EXPECT_EQ(t->shm().offset() % kShmAlignment, 0u);
    EXPECT_EQ(t->shm().byte_size(), 8u * 2 * 16 * 4);
  }
  EXPECT_EQ(request.output_shm().o().byte_size(), 8u * 2 * 16 * 4);
  EXPECT_FALSE(request.output_shm().has_lse());
  absl::StatusOr<v1::ForwardResponse> response = client_->Forward(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(response->o().data().empty());
  EXPECT_EQ(response->o().shm().offset(), spans->o.offset);
  const std::string in_place(arena->host_data() + spans->o.offset, spans->o.size);
  ASSERT_TRUE(TakeForwardOutputs(*arena, *spans, &*response).ok());
  EXPECT_EQ(response->o().data(), in_place);
  EXPECT_FALSE(response->o().has_shm());
}

TEST_F(ShmClientTest, AppendAttendThroughArenaEqualsMessage) {
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const auto& f = info->features();
  if (std::find(f.begin(), f.end(), "kv_cache") == f.end()) {
    GTEST_SKIP() << "this server build has no KvCache service";
  }
  constexpr int kHq = 4, kHkv = 2, kD = 32;
  KvClient kv(*client_);
  CacheSpec spec;
  spec.geometry = {1, kHkv, kD, DType::kFP16};
  spec.page_size = 16;
  spec.capacity_tokens = 1024;
  auto cache = kv.CreateCache(spec);
  ASSERT_TRUE(cache.ok()) << cache.status();
  // Sequence 1 goes through the arena, its twin 2 over the message.
  ASSERT_TRUE(kv.CreateSequences(cache->cache_id(), {{1}, {2}}).ok());
  std::unique_ptr<ShmArena> arena = MakeArena(1 << 20);
  ASSERT_NE(arena, nullptr);
  auto stream = kv.OpenStream(cache->cache_id());
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::mt19937_64 rng(5);
  int length = 0;
  // A prefill of 20 with queries, an append without, then decode steps:
  // unary, then on the stream.
  const int steps[][2] = {{20, 20}, {7, 0}, {1, 1}, {1, 1}, {1, 1}, {1, 1}};
  for (int i = 0; i < 6; ++i) {
    const auto [n, nq] = steps[i];
    AppendAttendInputs in;
    in.cache_id = cache->cache_id();
    in.sequences = {{1, length, n, nq}};
    in.options.causal = true;
    in.options.return_lse = nq > 0;
    if (nq > 0) in.q = RandomTensor(DType::kFP16, {nq, kHq, kD}, &rng);
    in.k = RandomTensor(DType::kFP16, {n, kHkv, kD}, &rng);
    in.v = RandomTensor(DType::kFP16, {n, kHkv, kD}, &rng);
    const bool on_stream = i >= 4;
    absl::StatusOr<AppendAttendResult> shm =
        on_stream ? (*stream)->Call(in, *arena) : kv.AppendAttend(in, *arena);
    ASSERT_TRUE(shm.ok()) << "step " << i << ": " << shm.status();
    in.sequences[0].sequence_id = 2;
    absl::StatusOr<AppendAttendResult> message =
        on_stream ? (*stream)->Call(in) : kv.AppendAttend(in);
    ASSERT_TRUE(message.ok()) << "step " << i << ": " << message.status();
    length += n;
    EXPECT_THAT(shm->lengths, ElementsAre(length));
    EXPECT_EQ(shm->o.shape(), message->o.shape()) << "step " << i;
    EXPECT_EQ(shm->o.bytes(), message->o.bytes()) << "step " << i;
    EXPECT_EQ(shm->lse.has_value(), nq > 0);
    if (nq > 0) {
      EXPECT_EQ(shm->lse->bytes(), message->lse->bytes()) << "step " << i;
    }
  }
  EXPECT_TRUE((*stream)->Finish().ok());
  kv.DropCache(cache->cache_id()).IgnoreError();
}

TEST_F(ShmClientTest, SpansAreAlignedAndBounded) {
  std::unique_ptr<ShmArena> arena = MakeArena(4096);
  ASSERT_NE(arena, nullptr);
  EXPECT_EQ(arena->mode(), ShmMode::kSystem);
  EXPECT_EQ(arena->key(), KeyPrefix() + arena->name());
  auto a = arena->Allocate(10);
  auto b = arena->Allocate(300);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->offset, 0u);
  EXPECT_EQ(b->offset, kShmAlignment);
  EXPECT_EQ(arena->used(), kShmAlignment + 300);
  auto too_big = arena->Allocate(4096);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.status().message(), HasSubstr("do not fit its 4096 bytes"));
  arena->Reset();
  EXPECT_TRUE(arena->Allocate(4096).ok());
  // A call that does not fit is refused before anything is sent.
  absl::StatusOr<AttentionInputs> in =
      MakeRandomInputs(DenseAttentionShape(DType::kFP32, 1, 64, 64, 2, 2, 16), 1);
  ASSERT_TRUE(in.ok());
  auto refused = client_->Forward(*in, *arena);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
}

TEST_F(ShmClientTest, CloseUnregistersAndUnlinks) {
  std::unique_ptr<ShmArena> arena = MakeArena(4096);
  ASSERT_NE(arena, nullptr);
  auto regions = RegisteredRegions(server_->target());
  ASSERT_TRUE(regions.ok()) << regions.status();
  EXPECT_THAT(*regions, ElementsAre(arena->name()));
  EXPECT_THAT(ShmObjectsUnder(KeyPrefix()), ElementsAre(arena->key()));
  const std::string key = arena->key();
  EXPECT_TRUE(arena->Close().ok());
  EXPECT_TRUE(arena->Close().ok());  // twice is harmless
  EXPECT_EQ(shm_open(key.c_str(), O_RDONLY, 0), -1);
  EXPECT_EQ(errno, ENOENT);
  // TearDown checks the server lists nothing.
}

// With unlink_after_register the name is gone once the server holds the
// object, and calls still reach the memory.
TEST_F(ShmClientTest, UnlinkAfterRegisterKeepsTheMemory) {
  ShmArenaOptions options;
  options.byte_size = 1 << 16;
  options.key_prefix = KeyPrefix();
  options.unlink_after_register = true;
  auto arena = ShmArena::Create(*client_, options);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_THAT(ShmObjectsUnder(KeyPrefix()), IsEmpty());
  absl::StatusOr<AttentionInputs> in =
      MakeRandomInputs(DenseAttentionShape(DType::kFP16, 1, 16, 16, 2, 2, 32), 9);
  ASSERT_TRUE(in.ok());
  absl::StatusOr<ForwardResult> out = client_->Forward(*in, **arena);
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<VerifyReport> report = VerifyForward(*in, *out);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->passed) << report->failure;
}

TEST_F(ShmClientTest, BadOptionsAreRefused) {
  ShmArenaOptions options;
  options.byte_size = 0;
  EXPECT_EQ(ShmArena::Create(*client_, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.byte_size = 64;
  options.key_prefix = "attnserve.default.";  // no leading "/"
  auto bad = ShmArena::Create(*client_, options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("key prefix"));
  options.mode = ShmMode::kNone;
  EXPECT_EQ(ShmArena::Create(*client_, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The key is taken: ALREADY_EXISTS, and the other owner's object stays.
  options.mode = ShmMode::kSystem;
  options.key_prefix = KeyPrefix();
  options.name = "taken";
  const std::string key = KeyPrefix() + "taken";
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  close(fd);
  EXPECT_EQ(ShmArena::Create(*client_, options).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(ShmObjectsUnder(KeyPrefix()), ElementsAre(key));
  shm_unlink(key.c_str());
}

TEST_F(ShmClientTest, CudaNeedsACudaBuild) {
  if (ShmCudaAvailable()) GTEST_SKIP() << "a CUDA build: attnctl_shm_test covers --shm=cuda";
  ShmArenaOptions options;
  options.mode = ShmMode::kCuda;
  options.byte_size = 64;
  auto arena = ShmArena::Create(*client_, options);
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(arena.status().message(), HasSubstr("built without CUDA"));
}

// A server without --allow_client_shm refuses the registration; the error
// names the flag and the object is gone again.
TEST(ShmClientRefusalTest, ServerWithoutAllowClientShm) {
  auto server = LoopbackServer::Start(/*allow_client_shm=*/false);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = AttentionClient::Create((*server)->target());
  ASSERT_TRUE(client.ok());
  ShmArenaOptions options;
  options.byte_size = 4096;
  options.key_prefix = KeyPrefix();
  auto arena = ShmArena::Create(**client, options);
  EXPECT_EQ(arena.status().code(), absl::StatusCode::kFailedPrecondition) << arena.status();
  EXPECT_THAT(arena.status().message(), HasSubstr("--allow_client_shm"));
  EXPECT_THAT(ShmObjectsUnder(KeyPrefix()), IsEmpty());
}

}  // namespace
}  // namespace attnserve
