// Same-host tensors over the native API (shm.proto's SharedMemory, Tensor.shm,
// output_shm) on a real server (CPU backend) on a real port: Forward,
// ForwardStream, Echo and AppendAttend (unary and stream) with q, k, v, o and
// lse in POSIX shared memory give the bytes the same calls give over the
// socket, and match the float64 reference; bad spans are refused naming the
// field with nothing appended; a region unregistered or shrunk fails the
// call that names it and no other; another tenant's region is unknown.
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "attnserve/v1/shm.grpc.pb.h"
#include "backend/backend_factory.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "server/shm/shm_registry.h"
#include "tests/kserve/shm_test_util.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {
namespace {

constexpr size_t kRegionBytes = 1 << 20;
// Forward's dense case: B, Sq, Sk, Hq, Hkv, D.
constexpr int kB = 1, kSq = 5, kSk = 9;

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

// Moves `t`'s data into `object` at `offset` and names that span instead.
void MoveToShm(v1::Tensor* t, TestShmObject* object, const std::string& region, uint64_t offset) {
  std::memcpy(object->data() + offset, t->data().data(), t->data().size());
  t->mutable_shm()->set_region(region);
  t->mutable_shm()->set_offset(offset);
  t->mutable_shm()->set_byte_size(t->data().size());
  t->clear_data();
}

v1::SharedTensor Span(const std::string& region, uint64_t offset, uint64_t bytes) {
  v1::SharedTensor s;
  s.set_region(region);
  s.set_offset(offset);
  s.set_byte_size(bytes);
  return s;
}

void SetTensor(v1::Tensor* t, std::vector<int64_t> shape, const std::vector<float>& data) {
  t->set_dtype(v1::FP32);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(Bytes(data));
}

// A dense FP32 Forward with LSE: q [1, kSq, kHq, kD], k and v [1, kSk, kHkv, kD].
v1::ForwardRequest DenseForward(std::mt19937* rng, bool causal) {
  v1::ForwardRequest r;
  r.set_request_id("f");
  SetTensor(r.mutable_q(), {kB, kSq, kHq, kD}, Random(rng, int64_t{kB} * kSq * kQRow));
  SetTensor(r.mutable_k(), {kB, kSk, kHkv, kD}, Random(rng, int64_t{kB} * kSk * kKvRow));
  SetTensor(r.mutable_v(), {kB, kSk, kHkv, kD}, Random(rng, int64_t{kB} * kSk * kKvRow));
  r.mutable_options()->set_causal(causal);
  r.mutable_options()->set_return_lse(true);
  return r;
}

constexpr uint64_t kOBytes = uint64_t{kB} * kSq * kQRow * 4;
constexpr uint64_t kLseBytes = uint64_t{kB} * kHq * kSq * 4;

// O and LSE bytes of `r` (a DenseForward request as bytes) against the
// float64 reference.
::testing::AssertionResult MatchesReference(const v1::ForwardRequest& r, const std::string& o_bytes,
                                            const std::string& lse_bytes) {
  if (o_bytes.size() != kOBytes || lse_bytes.size() != kLseBytes) {
    return ::testing::AssertionFailure() << "o " << o_bytes.size() << " lse " << lse_bytes.size();
  }
  AttnPointers ptr;
  ptr.q = r.q().data().data();
  ptr.k = r.k().data().data();
  ptr.v = r.v().data().data();
  AttnOptions options;
  options.causal = r.options().causal();
  const AttnParams p =
      MakeAttnParams(DenseShape(DType::kFP32, kB, kSq, kSk, kHq, kHkv, kD), options, ptr);
  const ReferenceOutput ref = ReferenceAttention(p);
  const float* o = reinterpret_cast<const float*>(o_bytes.data());
  const float* lse = reinterpret_cast<const float*>(lse_bytes.data());
  for (size_t i = 0; i < ref.o.size(); ++i) {
    if (!(std::abs(o[i] - ref.o[i]) <= tolerance::kFp32Rtol * std::abs(ref.o[i]) + 1e-4)) {
      return ::testing::AssertionFailure() << "o[" << i << "] " << o[i] << " vs " << ref.o[i];
    }
  }
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    if (!(std::abs(lse[i] - ref.lse[i]) <=
          tolerance::kFp32Rtol * std::abs(ref.lse[i]) + tolerance::kFp32LseAtol)) {
      return ::testing::AssertionFailure() << "lse[" << i << "] " << lse[i] << " vs " << ref.lse[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// A real server with shared memory allowed (and, given tokens, tenants).
class NativeShmTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(/*allow=*/true, ""); }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  void Start(bool allow, const std::string& tokens_file) {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.kv_cache_bytes = int64_t{64} << 20;
    o.kv_page_size = kPage;
    o.kserve.allow_client_shm = allow;
    o.auth.tokens_file = tokens_file;
    auto server = AttnServer::Create(o, MakeCpuBackend(2));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                       grpc::InsecureChannelCredentials());
    attention_ = v1::Attention::NewStub(channel);
    kv_ = v1::KvCache::NewStub(channel);
    shm_ = v1::SharedMemory::NewStub(channel);
  }

  void Authorize(grpc::ClientContext* ctx) const {
    if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
  }

  grpc::Status Register(const std::string& name, const TestShmObject& object,
                        uint64_t bytes = kRegionBytes) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::RegisterRegionRequest r;
    r.set_name(name);
    r.mutable_system()->set_key(object.key());
    r.set_byte_size(bytes);
    v1::RegisterRegionResponse resp;
    return shm_->Register(&ctx, r, &resp);
  }
  grpc::Status Unregister(const std::string& name) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::UnregisterRegionRequest r;
    r.set_name(name);
    v1::UnregisterRegionResponse resp;
    return shm_->Unregister(&ctx, r, &resp);
  }
  grpc::Status Forward(const v1::ForwardRequest& r, v1::ForwardResponse* resp) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    return attention_->Forward(&ctx, r, resp);
  }
  grpc::Status Append(const v1::AppendAttendRequest& r, v1::AppendAttendResponse* resp) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    return kv_->AppendAttend(&ctx, r, resp);
  }

  std::string CreateCache() {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(4096);
    v1::CreateCacheResponse resp;
    EXPECT_TRUE(kv_->CreateCache(&ctx, r, &resp).ok());
    return resp.stats().cache_id();
  }
  void CreateSequences(const std::string& cache, std::vector<uint64_t> ids) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::CreateSequencesRequest r;
    r.set_cache_id(cache);
    for (uint64_t id : ids) r.add_sequences()->set_sequence_id(id);
    v1::CreateSequencesResponse resp;
    ASSERT_TRUE(kv_->CreateSequences(&ctx, r, &resp).ok());
  }
  int32_t Length(const std::string& cache, uint64_t id) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::GetCacheStatsRequest r;
    r.set_cache_id(cache);
    r.add_sequence_ids(id);
    v1::GetCacheStatsResponse resp;
    if (!kv_->GetCacheStats(&ctx, r, &resp).ok() || resp.sequences_size() != 1) return -1;
    return resp.sequences(0).lengths(0);
  }
  // A part of `n` new tokens and `nq` queries for sequence `id`; `ctx` gains them.
  Part Step(uint64_t id, Context* ctx, int n, int nq) {
    Part p{id,
           ctx->length(),
           Random(&rng_, n * kKvRow),
           Random(&rng_, n * kKvRow),
           Random(&rng_, nq * kQRow),
           {}};
    ctx->k.insert(ctx->k.end(), p.k.begin(), p.k.end());
    ctx->v.insert(ctx->v.end(), p.v.begin(), p.v.end());
    return p;
  }
  // `r` with q, k and v moved into `object` (region `name`) from offset 0 and
  // o and lse given spans after them; returns where o and lse lie.
  std::pair<uint64_t, uint64_t> KvOverShm(v1::AppendAttendRequest* r, TestShmObject* object,
                                          const std::string& name) {
    uint64_t at = 0;
    for (v1::Tensor* t : {r->mutable_q(), r->mutable_k(), r->mutable_v()}) {
      const uint64_t bytes = t->data().size();
      MoveToShm(t, object, name, at);
      at += (bytes + 255) / 256 * 256;
    }
    const uint64_t tq = static_cast<uint64_t>(r->q().shape(0));
    const uint64_t o_at = at, lse_at = at + (tq * kQRow * 4 + 255) / 256 * 256;
    *r->mutable_output_shm()->mutable_o() = Span(name, o_at, tq * kQRow * 4);
    *r->mutable_output_shm()->mutable_lse() = Span(name, lse_at, tq * kHq * 4);
    return {o_at, lse_at};
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::Attention::Stub> attention_;
  std::unique_ptr<v1::KvCache::Stub> kv_;
  std::unique_ptr<v1::SharedMemory::Stub> shm_;
  std::string token_;
  std::mt19937 rng_{29};
};

// q, k and v from a region, o and lse into it: the bytes of the same call
// over the socket, and the reference's.
TEST_F(NativeShmTest, ForwardOverShmGivesTheBytesOfTheSocketCall) {
  TestShmObject object(kRegionBytes, "fwd");
  ASSERT_TRUE(object.ok());
  ASSERT_TRUE(Register("r", object).ok());
  for (bool causal : {false, true}) {
    const v1::ForwardRequest bytes_request = DenseForward(&rng_, causal);
    v1::ForwardResponse want;
    ASSERT_TRUE(Forward(bytes_request, &want).ok());
    ASSERT_TRUE(MatchesReference(bytes_request, want.o().data(), want.lse().data()));

    v1::ForwardRequest r = bytes_request;
    MoveToShm(r.mutable_q(), &object, "r", 0);
    MoveToShm(r.mutable_k(), &object, "r", 4096);
    MoveToShm(r.mutable_v(), &object, "r", 8192);
    *r.mutable_output_shm()->mutable_o() = Span("r", 16384, kOBytes);
    *r.mutable_output_shm()->mutable_lse() = Span("r", 20480, kLseBytes);
    std::memset(object.data() + 16384, 0x7f, kOBytes);
    v1::ForwardResponse got;
    const grpc::Status s = Forward(r, &got);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(got.o().data().empty());
    EXPECT_EQ(got.o().shm().region(), "r");
    EXPECT_EQ(got.o().shm().offset(), 16384u);
    EXPECT_EQ(std::vector<int64_t>(got.o().shape().begin(), got.o().shape().end()),
              (std::vector<int64_t>{kB, kSq, kHq, kD}));
    EXPECT_TRUE(got.lse().data().empty());
    EXPECT_EQ(std::string(object.data() + 16384, kOBytes), want.o().data());
    EXPECT_EQ(std::string(object.data() + 20480, kLseBytes), want.lse().data());

    // Only o in the region: lse comes in the response.
    r.mutable_output_shm()->clear_lse();
    ASSERT_TRUE(Forward(r, &got).ok());
    EXPECT_EQ(got.lse().data(), want.lse().data());
  }
}

TEST_F(NativeShmTest, ForwardStreamAndEchoOverShm) {
  TestShmObject object(kRegionBytes, "fstream");
  ASSERT_TRUE(object.ok());
  ASSERT_TRUE(Register("r", object).ok());
  grpc::ClientContext ctx;
  auto stream = attention_->ForwardStream(&ctx);
  for (int i = 0; i < 3; ++i) {
    const v1::ForwardRequest bytes_request = DenseForward(&rng_, i % 2 == 1);
    v1::ForwardResponse want;
    ASSERT_TRUE(Forward(bytes_request, &want).ok());
    v1::ForwardRequest r = bytes_request;
    const uint64_t base = uint64_t(i) * 65536;
    MoveToShm(r.mutable_q(), &object, "r", base);
    MoveToShm(r.mutable_k(), &object, "r", base + 4096);
    MoveToShm(r.mutable_v(), &object, "r", base + 8192);
    *r.mutable_output_shm()->mutable_o() = Span("r", base + 16384, kOBytes);
    ASSERT_TRUE(stream->Write(r));
    v1::ForwardResponse got;
    ASSERT_TRUE(stream->Read(&got));
    ASSERT_EQ(got.error_code(), 0) << got.error_message();
    EXPECT_EQ(std::string(object.data() + base + 16384, kOBytes), want.o().data());
    EXPECT_EQ(got.lse().data(), want.lse().data());
    EXPECT_TRUE(MatchesReference(bytes_request, std::string(object.data() + base + 16384, kOBytes),
                                 got.lse().data()));
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());

  // Echo: o = q, region to region.
  v1::ForwardRequest r = DenseForward(&rng_, false);
  const std::string q = r.q().data();
  MoveToShm(r.mutable_q(), &object, "r", 0);
  MoveToShm(r.mutable_k(), &object, "r", 4096);
  MoveToShm(r.mutable_v(), &object, "r", 8192);
  r.mutable_options()->set_return_lse(false);
  *r.mutable_output_shm()->mutable_o() = Span("r", 300000, q.size());
  grpc::ClientContext echo_ctx;
  v1::ForwardResponse echo;
  const grpc::Status s = attention_->Echo(&echo_ctx, r, &echo);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(std::string(object.data() + 300000, q.size()), q);
  EXPECT_TRUE(echo.o().data().empty());
  EXPECT_EQ(echo.o().shm().offset(), 300000u);
}

// AppendAttend unary: the same step over the socket (one sequence) and over
// shared memory (its twin) gives the same bytes and the same lengths.
TEST_F(NativeShmTest, AppendAttendOverShmGivesTheBytesOfTheSocketCall) {
  TestShmObject object(kRegionBytes, "kv");
  ASSERT_TRUE(object.ok());
  ASSERT_TRUE(Register("r", object).ok());
  const std::string cache = CreateCache();
  CreateSequences(cache, {1, 2});
  Context a, b;
  for (int step = 0; step < 3; ++step) {
    Part pa = Step(1, &a, step == 0 ? 7 : 1, step == 0 ? 7 : 1);
    Part pb = pa;
    pb.id = 2;
    b = a;
    v1::AppendAttendResponse want, got;
    ASSERT_TRUE(Append(MakeCall(cache, {pa}), &want).ok());
    CheckResponse(want, {pa}, {&a}, Mods());
    v1::AppendAttendRequest r = MakeCall(cache, {pb});
    const auto [o_at, lse_at] = KvOverShm(&r, &object, "r");
    const grpc::Status s = Append(r, &got);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(got.o().data().empty());
    EXPECT_EQ(got.o().shm().offset(), o_at);
    EXPECT_EQ(got.lengths(0), a.length());
    EXPECT_EQ(std::string(object.data() + o_at, want.o().data().size()), want.o().data());
    EXPECT_EQ(std::string(object.data() + lse_at, want.lse().data().size()), want.lse().data());
  }
  EXPECT_EQ(Length(cache, 1), Length(cache, 2));
}

// A decode loop on AppendAttendStream, every step's tensors in the region,
// each step checked against the reference.
TEST_F(NativeShmTest, DecodeLoopOverShmOnTheStream) {
  TestShmObject object(kRegionBytes, "loop");
  ASSERT_TRUE(object.ok());
  ASSERT_TRUE(Register("r", object).ok());
  const std::string cache = CreateCache();
  CreateSequences(cache, {5});
  Context ctx;
  grpc::ClientContext stream_ctx;
  auto stream = kv_->AppendAttendStream(&stream_ctx);
  for (int step = 0; step < 6; ++step) {
    const int n = step == 0 ? 19 : 1;
    Part p = Step(5, &ctx, n, n);
    v1::AppendAttendRequest r = MakeCall(cache, {p});
    const auto [o_at, lse_at] = KvOverShm(&r, &object, "r");
    ASSERT_TRUE(stream->Write(r));
    v1::AppendAttendResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ASSERT_EQ(resp.error_code(), 0) << resp.error_message();
    resp.mutable_o()->set_data(std::string(object.data() + o_at, size_t(n) * kQRow * 4));
    resp.mutable_lse()->set_data(std::string(object.data() + lse_at, size_t(n) * kHq * 4));
    CheckResponse(resp, {p}, {&ctx}, Mods());
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(Length(cache, 5), ctx.length());
}

// Every bad span is INVALID_ARGUMENT naming the field, and nothing is appended.
TEST_F(NativeShmTest, BadSpansAreRefusedNamingTheFieldAndChangeNothing) {
  TestShmObject object(kRegionBytes, "bad");
  ASSERT_TRUE(object.ok());
  ASSERT_TRUE(Register("r", object).ok());
  const std::string cache = CreateCache();
  CreateSequences(cache, {3});
  Context ctx;
  Part first = Step(3, &ctx, 4, 4);
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Append(MakeCall(cache, {first}), &resp).ok());
  Context scratch = ctx;
  const Part p = Step(3, &scratch, 2, 2);

  struct Case {
    const char* what;
    std::function<void(v1::AppendAttendRequest*)> spoil;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"offset outside",
       [](auto* r) { r->mutable_k()->mutable_shm()->set_offset(kRegionBytes); },
       {"k.shm", "exceeds"}},
      {"byte_size not k's",
       [](auto* r) { r->mutable_k()->mutable_shm()->set_byte_size(8); },
       {"k.shm.byte_size", "expected 256"}},
      {"unknown region",
       [](auto* r) { r->mutable_v()->mutable_shm()->set_region("nope"); },
       {"v.shm", "'nope'"}},
      {"misaligned",
       [](auto* r) { r->mutable_q()->mutable_shm()->set_offset(2); },
       {"q.shm.offset"}},
      {"data and shm",
       [](auto* r) { r->mutable_q()->set_data(std::string(512, '\0')); },
       {"q.shm", "both"}},
      {"o span too small",
       [](auto* r) { r->mutable_output_shm()->mutable_o()->set_byte_size(4); },
       {"output_shm.o.byte_size", "expected 512"}},
      {"lse span outside",
       [](auto* r) { r->mutable_output_shm()->mutable_lse()->set_offset(kRegionBytes - 4); },
       {"output_shm.lse", "exceeds"}},
      {"lse without return_lse",
       [](auto* r) { r->mutable_options()->set_return_lse(false); },
       {"output_shm.lse", "return_lse"}},
  };
  for (const Case& c : cases) {
    v1::AppendAttendRequest r = MakeCall(cache, {p});
    KvOverShm(&r, &object, "r");
    c.spoil(&r);
    v1::AppendAttendResponse refused;
    const grpc::Status s = Append(r, &refused);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.what << ": " << s.error_message();
    for (const std::string& w : c.words) {
      EXPECT_NE(s.error_message().find(w), std::string::npos)
          << c.what << ": " << s.error_message();
    }
    EXPECT_EQ(Length(cache, 3), ctx.length()) << c.what;
  }

  // Forward: the same rules, and an o span too small is refused before compute.
  v1::ForwardRequest f = DenseForward(&rng_, false);
  MoveToShm(f.mutable_q(), &object, "r", 0);
  MoveToShm(f.mutable_k(), &object, "r", 4096);
  MoveToShm(f.mutable_v(), &object, "r", 8192);
  *f.mutable_output_shm()->mutable_o() = Span("r", 16384, kOBytes - 4);
  std::memset(object.data() + 16384, 0x55, kOBytes);
  v1::ForwardResponse fr;
  grpc::Status s = Forward(f, &fr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("output_shm.o.byte_size"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(std::string(object.data() + 16384, kOBytes), std::string(kOBytes, 0x55));
  f.mutable_output_shm()->clear_o();
  f.mutable_q()->mutable_shm()->set_byte_size(kOBytes + 4);
  s = Forward(f, &fr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("q.shm.byte_size"), std::string::npos) << s.error_message();
}

// Unregistered mid-stream: the next request naming it fails (naming it), the
// stream goes on, and after registering again the requests work.
TEST_F(NativeShmTest, UnregisteredRegionFailsTheNextRequestAndTheStreamGoesOn) {
  TestShmObject object(kRegionBytes, "unreg");
  ASSERT_TRUE(object.ok());
  ASSERT_TRUE(Register("gone", object).ok());
  const std::string cache = CreateCache();
  CreateSequences(cache, {7});
  Context ctx;
  grpc::ClientContext stream_ctx;
  auto stream = kv_->AppendAttendStream(&stream_ctx);
  auto step = [&](bool registered) {
    Context next = ctx;
    Part p = Step(7, &next, 3, 3);
    v1::AppendAttendRequest r = MakeCall(cache, {p});
    const auto [o_at, lse_at] = KvOverShm(&r, &object, "gone");
    ASSERT_TRUE(stream->Write(r));
    v1::AppendAttendResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    if (!registered) {
      EXPECT_EQ(resp.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << resp.error_message();
      EXPECT_NE(resp.error_message().find("'gone'"), std::string::npos) << resp.error_message();
      EXPECT_EQ(Length(cache, 7), ctx.length());
      return;
    }
    ASSERT_EQ(resp.error_code(), 0) << resp.error_message();
    ctx = next;
    resp.mutable_o()->set_data(std::string(object.data() + o_at, 3 * kQRow * 4));
    resp.mutable_lse()->set_data(std::string(object.data() + lse_at, 3 * kHq * 4));
    CheckResponse(resp, {p}, {&ctx}, Mods());
  };
  step(true);
  ASSERT_TRUE(Unregister("gone").ok());
  step(false);
  step(false);
  ASSERT_TRUE(Register("gone", object).ok());
  step(true);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// A region its owner shrank fails the calls that name it (FAILED_PRECONDITION
// naming it), appends nothing, and other calls go on.
TEST_F(NativeShmTest, ShrunkRegionFailsTheCall) {
  TestShmObject object(kRegionBytes, "shrink");
  ASSERT_TRUE(object.ok());
  ASSERT_TRUE(Register("small", object).ok());
  const std::string cache = CreateCache();
  CreateSequences(cache, {9});
  Context ctx;
  const Part p = Step(9, &ctx, 2, 2);
  v1::AppendAttendRequest r = MakeCall(cache, {p});
  KvOverShm(&r, &object, "small");
  v1::ForwardRequest f = DenseForward(&rng_, false);
  MoveToShm(f.mutable_q(), &object, "small", 0);
  MoveToShm(f.mutable_k(), &object, "small", 4096);
  MoveToShm(f.mutable_v(), &object, "small", 8192);
  ASSERT_TRUE(object.Truncate(4096));
  v1::AppendAttendResponse resp;
  grpc::Status s = Append(r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("'small'"), std::string::npos) << s.error_message();
  EXPECT_EQ(Length(cache, 9), 0);
  v1::ForwardResponse fr;
  s = Forward(f, &fr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("'small'"), std::string::npos) << s.error_message();
  // The same step over the socket still works.
  ASSERT_TRUE(Append(MakeCall(cache, {p}), &resp).ok());
  CheckResponse(resp, {p}, {&ctx}, Mods());
}

// Registration: status lists what was registered; off without --allow_client_shm.
TEST_F(NativeShmTest, StatusListsRegionsAndOffIsFailedPrecondition) {
  TestShmObject object(kRegionBytes, "status");
  ASSERT_TRUE(object.ok());
  ASSERT_TRUE(Register("listed", object, 4096).ok());
  EXPECT_EQ(Register("listed", object).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  {
    grpc::ClientContext ctx;
    v1::RegionStatusRequest r;
    v1::RegionStatusResponse resp;
    ASSERT_TRUE(shm_->Status(&ctx, r, &resp).ok());
    ASSERT_EQ(resp.regions_size(), 1);
    EXPECT_EQ(resp.regions(0).name(), "listed");
    EXPECT_EQ(resp.regions(0).system().key(), object.key());
    EXPECT_EQ(resp.regions(0).byte_size(), 4096u);
  }
  {
    grpc::ClientContext ctx;
    v1::RegionStatusRequest r;
    r.set_name("other");
    v1::RegionStatusResponse resp;
    EXPECT_EQ(shm_->Status(&ctx, r, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    v1::RegisterRegionRequest r;
    r.set_name("neither");
    r.set_byte_size(16);
    v1::RegisterRegionResponse resp;
    const grpc::Status s = shm_->Register(&ctx, r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("memory"), std::string::npos) << s.error_message();
  }

  Start(/*allow=*/false, "");
  EXPECT_EQ(Register("listed", object).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  v1::ForwardRequest f = DenseForward(&rng_, false);
  MoveToShm(f.mutable_q(), &object, "listed", 0);
  v1::ForwardResponse fr;
  const grpc::Status s = Forward(f, &fr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("--allow_client_shm"), std::string::npos) << s.error_message();
}

// With tokens on, a tenant's region is its own: another tenant naming it is
// answered like an unknown name, and its status lists nothing.
TEST_F(NativeShmTest, AnotherTenantCannotUseYourRegion) {
  const std::string tokens = ::testing::TempDir() + "/native_shm_tokens";
  {
    std::ofstream out(tokens);
    out << "token-of-tenant-alpha-0123456789 alpha\ntoken-of-tenant-beta-01234567890 beta\n";
  }
  Start(/*allow=*/true, tokens);
  TestShmObject object(kRegionBytes, "mine", ShmKeyPrefix("alpha"));
  ASSERT_TRUE(object.ok());
  token_ = "token-of-tenant-alpha-0123456789";
  grpc::Status s = Register("mine", object);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const v1::ForwardRequest bytes_request = DenseForward(&rng_, true);
  v1::ForwardRequest f = bytes_request;
  MoveToShm(f.mutable_q(), &object, "mine", 0);
  MoveToShm(f.mutable_k(), &object, "mine", 4096);
  MoveToShm(f.mutable_v(), &object, "mine", 8192);
  v1::ForwardResponse fr;
  s = Forward(f, &fr);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(MatchesReference(bytes_request, fr.o().data(), fr.lse().data()));

  token_ = "token-of-tenant-beta-01234567890";
  s = Forward(f, &fr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("unable to find shared memory region: 'mine'"),
            std::string::npos)
      << s.error_message();
  grpc::ClientContext ctx;
  Authorize(&ctx);
  v1::RegionStatusResponse listed;
  ASSERT_TRUE(shm_->Status(&ctx, v1::RegionStatusRequest(), &listed).ok());
  EXPECT_EQ(listed.regions_size(), 0);
  // Its own key under another tenant's prefix is refused.
  EXPECT_EQ(Register("theirs", object).error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

}  // namespace
}  // namespace attnserve
