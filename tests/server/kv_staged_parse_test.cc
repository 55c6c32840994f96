// A unary AppendAttend's q, k and v are parsed from gRPC's slices straight
// into the backend's host tensor memory (AttentionBackend::AllocateHostTensor:
// page-locked on CUDA), and its o is allocated there too: the parse gives the
// message protobuf would give (one-piece or the client's slices encoding), and
// a server's calls reach the backend's allocator (counted by the CPU backend).
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "backend/cpu/cpu_backend.h"
#include "common/tensor_wire_slices.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "server/native/kv_messages.h"
#include "server/native/kv_service.h"
#include "server/server.h"
#include "spdlog/spdlog.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

// Counts what it hands out; each block is heap memory.
struct CountingAllocator {
  int calls = 0;
  int64_t bytes = 0;
  std::vector<const char*> blocks;
  HostTensorAllocator Fn() {
    return [this](int64_t n) {
      ++calls;
      bytes += n;
      std::shared_ptr<char> p(new char[size_t(n)], std::default_delete<char[]>());
      blocks.push_back(p.get());
      return p;
    };
  }
};

// `wire` cut into pieces of at most `piece` bytes, as gRPC may receive it.
grpc::ByteBuffer Pieces(const std::string& wire, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < wire.size(); at += piece) {
    slices.emplace_back(wire.data() + at, std::min(piece, wire.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// The staged parse's message with the staged bytes put back in: what
// protobuf parses from the same bytes.
std::string Rejoined(v1::AppendAttendRequest request, const KvStagedInputs& s) {
  if (s.q) request.mutable_q()->set_data(std::string(s.q.get(), size_t(s.q_bytes)));
  if (s.k) request.mutable_k()->set_data(std::string(s.k.get(), size_t(s.k_bytes)));
  if (s.v) request.mutable_v()->set_data(std::string(s.v.get(), size_t(s.v_bytes)));
  return request.SerializeAsString();
}

v1::AppendAttendRequest Request(std::mt19937* rng, int n) {
  Part part{1, 0, Random(rng, n * kKvRow), Random(rng, n * kKvRow), Random(rng, n * kQRow), {}};
  v1::AppendAttendRequest r = MakeCall("cache-1", {part});
  r.set_request_id("req-7");
  return r;
}

TEST(ParseAppendAttendStagedTest, OnePieceMessageInAnySlicing) {
  std::mt19937 rng(3);
  const v1::AppendAttendRequest sent = Request(&rng, 40);
  const std::string wire = sent.SerializeAsString();
  for (size_t piece : {wire.size(), size_t{4096}, size_t{7}, size_t{1}}) {
    grpc::ByteBuffer buffer = Pieces(wire, piece);
    CountingAllocator alloc;
    v1::AppendAttendRequest request;
    KvStagedInputs staged;
    const grpc::Status st = ParseAppendAttendStaged(&buffer, alloc.Fn(), &request, &staged);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(buffer.Length(), 0u) << "the raw bytes go with the parse";
    EXPECT_TRUE(request.q().data().empty());
    EXPECT_TRUE(request.k().data().empty());
    EXPECT_TRUE(request.v().data().empty());
    ASSERT_EQ(alloc.calls, 3) << "q, k and v each land in the allocator's memory";
    EXPECT_EQ(staged.q.get(), alloc.blocks[0]);
    EXPECT_EQ(staged.q_bytes, int64_t(sent.q().data().size()));
    EXPECT_EQ(staged.k_bytes, int64_t(sent.k().data().size()));
    EXPECT_EQ(staged.v_bytes, int64_t(sent.v().data().size()));
    EXPECT_EQ(Rejoined(request, staged), wire) << "piece " << piece;

    // The call's views read the staged bytes, and the charge counts them.
    const KvCall call = KvCallOf(request, CallMeta(), &staged);
    EXPECT_EQ(call.q.bytes.data(), staged.q.get());
    EXPECT_EQ(call.k.bytes.size(), sent.k().data().size());
    EXPECT_FALSE(call.v.absent);
    // All but the data fields' tags and lengths (a few bytes each).
    EXPECT_EQ(call.request_bytes,
              int64_t(request.ByteSizeLong()) + staged.q_bytes + staged.k_bytes + staged.v_bytes);
    EXPECT_GE(call.request_bytes, int64_t(sent.ByteSizeLong()) - 3 * 6);
  }
}

// The client's encoding: the message without data, then each tensor once
// more holding only its data as a slice of its own.
TEST(ParseAppendAttendStagedTest, ClientSlicesEncoding) {
  std::mt19937 rng(5);
  const v1::AppendAttendRequest sent = Request(&rng, 33);
  v1::AppendAttendRequest stripped = sent;
  TensorWireSlices tensors;
  using R = v1::AppendAttendRequest;
  tensors.TakeData(R::kQFieldNumber, stripped.mutable_q()->mutable_data());
  tensors.TakeData(R::kKFieldNumber, stripped.mutable_k()->mutable_data());
  tensors.TakeData(R::kVFieldNumber, stripped.mutable_v()->mutable_data());
  grpc::ByteBuffer buffer = tensors.Encode(stripped);
  CountingAllocator alloc;
  v1::AppendAttendRequest request;
  KvStagedInputs staged;
  ASSERT_TRUE(ParseAppendAttendStaged(&buffer, alloc.Fn(), &request, &staged).ok());
  EXPECT_EQ(alloc.calls, 3);
  EXPECT_EQ(Rejoined(request, staged), sent.SerializeAsString());
}

// Protobuf merges a tensor's occurrences: the last data wins, and fields of
// every occurrence stay. An occurrence with empty data empties it.
TEST(ParseAppendAttendStagedTest, RepeatedOccurrencesMergeAsProtobuf) {
  std::mt19937 rng(9);
  const v1::AppendAttendRequest a = Request(&rng, 8);
  v1::AppendAttendRequest b;
  b.mutable_q()->set_data(std::string(100, 'x'));
  b.mutable_k()->add_shape(99);
  v1::AppendAttendRequest c;
  c.mutable_v()->set_data("");  // proto3 omits it: spell the field out below
  std::string wire = a.SerializeAsString() + b.SerializeAsString();
  // v { data: "" } by hand: tag(v, LEN) len 2 { tag(data, LEN) 0 }.
  wire.push_back(static_cast<char>(v1::AppendAttendRequest::kVFieldNumber << 3 | 2));
  wire.push_back(2);
  wire.push_back(static_cast<char>(v1::Tensor::kDataFieldNumber << 3 | 2));
  wire.push_back(0);
  v1::AppendAttendRequest expected;
  ASSERT_TRUE(expected.ParseFromString(wire));
  ASSERT_TRUE(expected.v().data().empty());
  grpc::ByteBuffer buffer = Pieces(wire, 1000);
  CountingAllocator alloc;
  v1::AppendAttendRequest request;
  KvStagedInputs staged;
  ASSERT_TRUE(ParseAppendAttendStaged(&buffer, alloc.Fn(), &request, &staged).ok());
  EXPECT_EQ(staged.q_bytes, 100);
  EXPECT_EQ(staged.v, nullptr);
  EXPECT_EQ(Rejoined(request, staged), expected.SerializeAsString());
}

// Bytes that are no message fail as the plain parse fails; a tensor with both
// data and a shared-memory span keeps its data in the message (the span's
// check refuses it); no memory left is RESOURCE_EXHAUSTED naming the field.
TEST(ParseAppendAttendStagedTest, ErrorsAndFallbacks) {
  for (const std::string& bad : {std::string("\xff\xff\xff", 3), std::string("\x0a\x05q", 3)}) {
    grpc::ByteBuffer plain_buffer = Pieces(bad, 2);
    v1::AppendAttendRequest plain_request;
    const grpc::Status plain = ParseAppendAttend(&plain_buffer, &plain_request);
    grpc::ByteBuffer buffer = Pieces(bad, 2);
    CountingAllocator alloc;
    v1::AppendAttendRequest request;
    KvStagedInputs staged;
    const grpc::Status st = ParseAppendAttendStaged(&buffer, alloc.Fn(), &request, &staged);
    EXPECT_FALSE(st.ok());
    EXPECT_EQ(st.error_code(), plain.error_code());
    EXPECT_EQ(st.error_message(), plain.error_message());
    EXPECT_EQ(buffer.Length(), 0u);
    EXPECT_EQ(alloc.calls, 0);
  }
  std::mt19937 rng(1);
  v1::AppendAttendRequest both = Request(&rng, 4);
  both.mutable_q()->mutable_shm()->set_region("r");
  grpc::ByteBuffer buffer = Pieces(both.SerializeAsString(), 64);
  CountingAllocator alloc;
  v1::AppendAttendRequest request;
  KvStagedInputs staged;
  ASSERT_TRUE(ParseAppendAttendStaged(&buffer, alloc.Fn(), &request, &staged).ok());
  EXPECT_EQ(request.q().data(), both.q().data());
  EXPECT_EQ(staged.q, nullptr);
  EXPECT_EQ(alloc.calls, 2);

  grpc::ByteBuffer again = Pieces(Request(&rng, 4).SerializeAsString(), 64);
  const grpc::Status none = ParseAppendAttendStaged(
      &again, [](int64_t) { return std::shared_ptr<char>(); }, &request, &staged);
  EXPECT_EQ(none.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(none.error_message(), "q.data")) << none.error_message();
  EXPECT_EQ(staged.q, nullptr);
}

// A real server on the CPU backend: a unary step's q, k, v and o are the
// backend's host tensors, O matches the float64 reference, and what a call
// holds is released when it is answered; a refused call appends nothing.
class StagedServerTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(); }
  void Start() {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.kv_cache_bytes = int64_t{64} << 20;
    o.kv_page_size = kPage;
    auto backend = std::make_unique<CpuBackend>(2);
    backend_ = backend.get();
    auto server = AttnServer::Create(o, std::move(backend));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    stub_ = v1::KvCache::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(4096);
    v1::CreateCacheResponse resp;
    ASSERT_TRUE(stub_->CreateCache(&ctx, r, &resp).ok());
    cache_ = resp.stats().cache_id();
    grpc::ClientContext sctx;
    v1::CreateSequencesRequest s;
    s.set_cache_id(cache_);
    s.add_sequences()->set_sequence_id(1);
    v1::CreateSequencesResponse sresp;
    ASSERT_TRUE(stub_->CreateSequences(&sctx, s, &sresp).ok());
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }
  Part Step(Context* ctx, int n) {
    Part p{1,
           ctx->length(),
           Random(&rng_, n * kKvRow),
           Random(&rng_, n * kKvRow),
           Random(&rng_, n * kQRow),
           {}};
    return p;
  }
  int32_t Length() {
    grpc::ClientContext ctx;
    v1::GetCacheStatsRequest r;
    r.set_cache_id(cache_);
    r.add_sequence_ids(1);
    v1::GetCacheStatsResponse resp;
    EXPECT_TRUE(stub_->GetCacheStats(&ctx, r, &resp).ok());
    return resp.sequences_size() == 1 && resp.sequences(0).lengths_size() == 1
               ? resp.sequences(0).lengths(0)
               : -1;
  }

  CpuBackend* backend_ = nullptr;
  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::string cache_;
  std::mt19937 rng_{21};
};

TEST_F(StagedServerTest, StepTensorsAreTheBackendsHostTensors) {
  Context ctx;
  for (int step = 0; step < 3; ++step) {
    const int n = step == 0 ? 24 : 1;
    const Part part = Step(&ctx, n);
    const CpuBackend::HostTensorCounts before = backend_->host_tensor_counts();
    v1::AppendAttendResponse resp;
    grpc::ClientContext cctx;
    const grpc::Status st = stub_->AppendAttend(&cctx, MakeCall(cache_, {part}), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ctx.k.insert(ctx.k.end(), part.k.begin(), part.k.end());
    ctx.v.insert(ctx.v.end(), part.v.begin(), part.v.end());
    CheckResponse(resp, {part}, {&ctx}, Mods());
    const CpuBackend::HostTensorCounts after = backend_->host_tensor_counts();
    // q, k, v parsed into the backend's memory, and o allocated there.
    const int64_t q = int64_t{n} * kQRow * 4, kv = int64_t{n} * kKvRow * 4;
    EXPECT_EQ(after.allocations - before.allocations, 4) << "step " << step;
    EXPECT_EQ(after.bytes - before.bytes, q + 2 * kv + q) << "step " << step;
  }
  // Held until answered: nothing is left once the calls are done (the
  // response's slices may go a moment after the client has them).
  for (int i = 0; i < 200 && backend_->host_tensor_counts().live_bytes != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(backend_->host_tensor_counts().live_bytes, 0);
}

TEST_F(StagedServerTest, RefusedCallChangesNothing) {
  Context ctx;
  Part part = Step(&ctx, 4);
  part.expected = 3;  // the sequence is empty
  v1::AppendAttendResponse resp;
  grpc::ClientContext cctx;
  const grpc::Status st = stub_->AppendAttend(&cctx, MakeCall(cache_, {part}), &resp);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(Length(), 0);
  for (int i = 0; i < 200 && backend_->host_tensor_counts().live_bytes != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(backend_->host_tensor_counts().live_bytes, 0);
}

// The A/B switch: with ATTNSERVE_KV_HOST_TENSORS=0 the step parses into the
// message and o is heap memory, as before; the answer is the same.
class HostTensorsOffTest : public StagedServerTest {
 protected:
  void SetUp() override {
    setenv("ATTNSERVE_KV_HOST_TENSORS", "0", 1);
    Start();
    unsetenv("ATTNSERVE_KV_HOST_TENSORS");
  }
};

TEST_F(HostTensorsOffTest, StepsRunOnTheMessagesBytes) {
  Context ctx;
  const Part part = Step(&ctx, 5);
  v1::AppendAttendResponse resp;
  grpc::ClientContext cctx;
  const grpc::Status st = stub_->AppendAttend(&cctx, MakeCall(cache_, {part}), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ctx.k = part.k;
  ctx.v = part.v;
  CheckResponse(resp, {part}, {&ctx}, Mods());
  EXPECT_EQ(backend_->host_tensor_counts().allocations, 0);
}

}  // namespace
}  // namespace attnserve
