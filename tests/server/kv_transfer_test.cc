// Moving K/V sequences between two real servers (CPU backend, 127.0.0.1:0)
// with KvTransfer and client/kv_transfer.h: the receiver holds the same rows
// (its export is byte-identical, chunk boundaries aside) and attends like the
// source; a cut stream resumes without resending what the receiver kept; a
// corrupted chunk is DATA_LOSS naming chunk.crc32c with nothing of its
// sequence live; quotas, ALREADY_EXISTS and tenancy on the receiving side;
// a cut import's staged pages go after --kv_import_idle_timeout.
#include "client/kv_transfer.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "attnserve/v1/kv_transfer.grpc.pb.h"
#include "backend/backend_factory.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "server/server.h"

namespace attnserve {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 16, kLayers = 3;
constexpr char kTokenA[] = "token-of-tenant-a-0123456789";
constexpr char kTokenB[] = "token-of-tenant-b-0123456789";

// A cache's head dims: K's (and Q's), V's (MLA: its own width, 0 = d), and
// whether V is the first dv elements of each K row (the steps send no v).
struct Geo {
  int d = kD;
  int dv = 0;
  bool v_in_k = false;
  int Dv() const { return dv > 0 ? dv : d; }
};

struct Server {
  std::unique_ptr<AttnServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvCache::Stub> kv;
  std::unique_ptr<v1::KvTransfer::Stub> transfer;
};

struct ServerSpec {
  int page_size = 16;
  std::string tokens_file;  // empty: no authentication
  absl::Duration import_idle_timeout = absl::Seconds(60);
};

ServerSpec Spec(int page_size, std::string tokens_file = "",
                absl::Duration import_idle_timeout = absl::Seconds(60)) {
  ServerSpec spec;
  spec.page_size = page_size;
  spec.tokens_file = std::move(tokens_file);
  spec.import_idle_timeout = import_idle_timeout;
  return spec;
}

Server StartServer(const ServerSpec& spec) {
  ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.kv_cache_bytes = int64_t{64} << 20;
  o.kv_page_size = spec.page_size;
  o.kv_import_idle_timeout = spec.import_idle_timeout;
  o.auth.tokens_file = spec.tokens_file;
  Server s;
  auto server = AttnServer::Create(o, MakeCpuBackend(2));
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return s;
  s.server = *std::move(server);
  EXPECT_TRUE(s.server->Start().ok());
  s.channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", s.server->port()),
                                  grpc::InsecureChannelCredentials());
  s.kv = v1::KvCache::NewStub(s.channel);
  s.transfer = v1::KvTransfer::NewStub(s.channel);
  return s;
}

void Authorize(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", absl::StrCat("Bearer ", token));
}

std::multimap<std::string, std::string> AuthMetadata(const std::string& token) {
  return {{"authorization", absl::StrCat("Bearer ", token)}};
}

// Values of `dtype` (FP32, FP16 or BF16) as bytes, from standard normals.
std::string RandomRows(std::mt19937* rng, v1::DType dtype, int64_t n) {
  std::normal_distribution<float> normal;
  std::string out;
  for (int64_t i = 0; i < n; ++i) {
    const float x = normal(*rng);
    if (dtype == v1::BF16 || dtype == v1::FP16) {
      const uint16_t h = dtype == v1::BF16 ? FloatToBf16(x) : FloatToFp16(x);
      out.append(reinterpret_cast<const char*>(&h), 2);
    } else {
      out.append(reinterpret_cast<const char*>(&x), 4);
    }
  }
  return out;
}

void SetTensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape, std::string data) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(std::move(data));
}

v1::CreateCacheRequest CacheRequest(const std::string& id, v1::DType dtype, v1::DType cache_dtype,
                                    int page_size, int64_t capacity_tokens, const Geo& geo = {}) {
  v1::CreateCacheRequest r;
  r.set_cache_id(id);
  r.mutable_geometry()->set_num_layers(kLayers);
  r.mutable_geometry()->set_num_heads_kv(kHkv);
  r.mutable_geometry()->set_head_dim(geo.d);
  r.mutable_geometry()->set_head_dim_v(geo.dv);
  r.mutable_geometry()->set_v_in_k(geo.v_in_k);
  r.mutable_geometry()->set_dtype(dtype);
  r.mutable_geometry()->set_cache_dtype(cache_dtype);
  r.set_page_size(page_size);
  r.set_capacity_tokens(capacity_tokens);
  return r;
}

grpc::Status CreateCache(Server& s, const v1::CreateCacheRequest& r,
                         const std::string& token = "") {
  grpc::ClientContext ctx;
  Authorize(&ctx, token);
  v1::CreateCacheResponse resp;
  return s.kv->CreateCache(&ctx, r, &resp);
}

// Sequences with per-layer lengths, filled by append-only steps.
void Fill(Server& s, const std::string& cache, v1::DType dtype,
          const std::map<uint64_t, std::vector<int32_t>>& lengths, std::mt19937* rng,
          const std::string& token = "", const Geo& geo = {}) {
  {
    grpc::ClientContext ctx;
    Authorize(&ctx, token);
    v1::CreateSequencesRequest r;
    r.set_cache_id(cache);
    for (const auto& [id, lens] : lengths) r.add_sequences()->set_sequence_id(id);
    v1::CreateSequencesResponse resp;
    const grpc::Status st = s.kv->CreateSequences(&ctx, r, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  for (int layer = 0; layer < kLayers; ++layer) {
    v1::AppendAttendRequest r;
    r.set_cache_id(cache);
    r.set_layer(layer);
    int64_t rows = 0;
    for (const auto& [id, lens] : lengths) {
      v1::SequenceStep* step = r.add_sequences();
      step->set_sequence_id(id);
      step->set_num_new_tokens(lens[size_t(layer)]);
      rows += lens[size_t(layer)];
    }
    SetTensor(r.mutable_q(), dtype, {0, kHq, geo.d}, "");
    SetTensor(r.mutable_k(), dtype, {rows, kHkv, geo.d},
              RandomRows(rng, dtype, rows * kHkv * geo.d));
    if (!geo.v_in_k) {
      SetTensor(r.mutable_v(), dtype, {rows, kHkv, geo.Dv()},
                RandomRows(rng, dtype, rows * kHkv * geo.Dv()));
    }
    grpc::ClientContext ctx;
    Authorize(&ctx, token);
    v1::AppendAttendResponse resp;
    const grpc::Status st = s.kv->AppendAttend(&ctx, r, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
}

absl::StatusOr<v1::GetCacheStatsResponse> Stats(Server& s, const std::string& cache,
                                                std::vector<uint64_t> ids = {},
                                                const std::string& token = "") {
  grpc::ClientContext ctx;
  Authorize(&ctx, token);
  v1::GetCacheStatsRequest r;
  r.set_cache_id(cache);
  for (uint64_t id : ids) r.add_sequence_ids(id);
  v1::GetCacheStatsResponse resp;
  const grpc::Status st = s.kv->GetCacheStats(&ctx, r, &resp);
  if (!st.ok()) return absl::Status(absl::StatusCode(st.error_code()), st.error_message());
  return resp;
}

// Every chunk of an export, in order (the first with its header).
absl::StatusOr<std::vector<v1::KvChunk>> ExportAll(Server& s, const v1::ExportSequencesRequest& r,
                                                   const std::string& token = "") {
  grpc::ClientContext ctx;
  Authorize(&ctx, token);
  auto reader = s.transfer->ExportSequences(&ctx, r);
  std::vector<v1::KvChunk> chunks;
  v1::KvChunk c;
  while (reader->Read(&c)) chunks.push_back(c);
  const grpc::Status st = reader->Finish();
  if (!st.ok()) return absl::Status(absl::StatusCode(st.error_code()), st.error_message());
  return chunks;
}

// What a cache holds, chunking aside: per (sequence, layer) the rows' K, V
// and scales concatenated.
using Rows = std::map<std::pair<uint64_t, int32_t>, std::string>;
Rows RowsOf(const std::vector<v1::KvChunk>& chunks) {
  std::map<std::pair<uint64_t, int32_t>, std::string> k, v, ks, vs;
  for (const v1::KvChunk& c : chunks) {
    const std::pair<uint64_t, int32_t> key{c.sequence_id(), c.layer()};
    k[key] += c.k();
    v[key] += c.v();
    ks[key] += c.k_scale();
    vs[key] += c.v_scale();
  }
  Rows rows;
  for (const auto& [key, bytes] : k) rows[key] = bytes + v[key] + ks[key] + vs[key];
  return rows;
}

Rows CacheRows(Server& s, const std::string& cache, const std::string& token = "") {
  v1::ExportSequencesRequest r;
  r.set_cache_id(cache);
  auto chunks = ExportAll(s, r, token);
  EXPECT_TRUE(chunks.ok()) << chunks.status();
  return chunks.ok() ? RowsOf(*chunks) : Rows();
}

// One decode step (one new token, one query) for every sequence at `layer`;
// the same seed gives both servers the same inputs.
std::vector<std::string> DecodeStep(Server& s, const std::string& cache, v1::DType dtype,
                                    const std::map<uint64_t, std::vector<int32_t>>& lengths,
                                    int layer, uint32_t seed, const Geo& geo = {}) {
  std::mt19937 rng(seed);
  v1::AppendAttendRequest r;
  r.set_cache_id(cache);
  r.set_layer(layer);
  for (const auto& [id, lens] : lengths) {
    v1::SequenceStep* step = r.add_sequences();
    step->set_sequence_id(id);
    step->set_expected_length(lens[size_t(layer)]);
    step->set_num_new_tokens(1);
    step->set_num_queries(1);
  }
  const int64_t n = static_cast<int64_t>(lengths.size());
  SetTensor(r.mutable_q(), dtype, {n, kHq, geo.d}, RandomRows(&rng, dtype, n * kHq * geo.d));
  SetTensor(r.mutable_k(), dtype, {n, kHkv, geo.d}, RandomRows(&rng, dtype, n * kHkv * geo.d));
  if (!geo.v_in_k) {
    SetTensor(r.mutable_v(), dtype, {n, kHkv, geo.Dv()},
              RandomRows(&rng, dtype, n * kHkv * geo.Dv()));
  }
  r.mutable_options()->set_causal(true);
  r.mutable_options()->set_return_lse(true);
  grpc::ClientContext ctx;
  v1::AppendAttendResponse resp;
  const grpc::Status st = s.kv->AppendAttend(&ctx, r, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return {resp.o().data(), resp.lse().data()};
}

std::vector<float> AsFloats(const std::string& bytes, v1::DType dtype) {
  std::vector<float> out;
  if (dtype == v1::BF16 || dtype == v1::FP16) {
    for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
      uint16_t h;
      std::memcpy(&h, bytes.data() + i, 2);
      out.push_back(dtype == v1::BF16 ? Bf16ToFloat(h) : Fp16ToFloat(h));
    }
  } else {
    out.resize(bytes.size() / 4);
    std::memcpy(out.data(), bytes.data(), out.size() * 4);
  }
  return out;
}

// Polls `done` until it holds or 10 s pass (evidence, not a fixed sleep).
template <typename F>
bool Eventually(F done) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (absl::Now() < end) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return done();
}

// Lengths that cross page boundaries of both 16 and 32, differ by layer,
// and include an empty sequence.
const std::map<uint64_t, std::vector<int32_t>> kLengths = {
    {3, {1, 1, 1}}, {7, {40, 40, 40}}, {9, {16, 17, 15}}, {11, {0, 0, 0}}, {42, {70, 33, 64}}};

struct MoveCase {
  const char* name;
  v1::DType dtype;
  v1::DType cache_dtype;
  int source_page, dest_page;
  Geo geo = {};
};

class KvTransferMoveTest : public ::testing::TestWithParam<MoveCase> {};

TEST_P(KvTransferMoveTest, ReceiverHoldsTheSameRowsAndAttendsLikeTheSource) {
  const MoveCase& c = GetParam();
  Server src = StartServer(Spec(c.source_page));
  Server dst = StartServer(Spec(c.dest_page));
  grpc::Status created =
      CreateCache(src, CacheRequest("kv0", c.dtype, c.cache_dtype, 0, 8192, c.geo));
  ASSERT_TRUE(created.ok()) << created.error_message();
  // The receiver's cache exists already, with its own page size.
  created = CreateCache(dst, CacheRequest("kv0", c.dtype, c.cache_dtype, 0, 8192, c.geo));
  ASSERT_TRUE(created.ok()) << created.error_message();
  std::mt19937 rng(11);
  Fill(src, "kv0", c.dtype, kLengths, &rng, "", c.geo);

  MoveOptions options;
  options.max_chunk_bytes = 1;  // one source page per chunk: many chunks
  absl::StatusOr<MoveResult> moved = MoveCache(src.channel, dst.channel, "kv0", options);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->sequences, static_cast<int64_t>(kLengths.size()));
  EXPECT_EQ(moved->resumes, 0);
  EXPECT_EQ(moved->bytes_resent, 0);

  // Same ids and lengths.
  std::vector<uint64_t> ids;
  for (const auto& [id, lens] : kLengths) ids.push_back(id);
  auto before = Stats(src, "kv0", ids);
  auto after = Stats(dst, "kv0", ids);
  ASSERT_TRUE(before.ok() && after.ok());
  EXPECT_EQ(after->stats().page_size(), c.dest_page);
  EXPECT_EQ(after->stats().sequences(), static_cast<int64_t>(kLengths.size()));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(before->sequences(int(i)).DebugString(), after->sequences(int(i)).DebugString());
  }
  // Byte for byte the same rows (and FP8 scales), and exactly what was sent.
  const Rows src_rows = CacheRows(src, "kv0");
  EXPECT_EQ(src_rows, CacheRows(dst, "kv0"));
  int64_t total = 0;
  for (const auto& [key, bytes] : src_rows) total += static_cast<int64_t>(bytes.size());
  EXPECT_EQ(moved->bytes, total);

  // The same decode step on both attends over the same context.
  for (int layer = 0; layer < kLayers; ++layer) {
    const auto a = DecodeStep(src, "kv0", c.dtype, kLengths, layer, 100 + layer, c.geo);
    const auto b = DecodeStep(dst, "kv0", c.dtype, kLengths, layer, 100 + layer, c.geo);
    ASSERT_EQ(a[0].size(), kLengths.size() * kHq * c.geo.Dv() * (c.dtype == v1::FP32 ? 4 : 2));
    if (c.source_page == c.dest_page) {
      EXPECT_EQ(a[0], b[0]) << "layer " << layer;
      EXPECT_EQ(a[1], b[1]) << "layer " << layer;
      continue;
    }
    // Another page size may change the order of the softmax's sums: O
    // agrees to the output dtype's rounding (2 units in the last place).
    const std::vector<float> oa = AsFloats(a[0], c.dtype), ob = AsFloats(b[0], c.dtype);
    ASSERT_EQ(oa.size(), ob.size());
    const float ulp = c.dtype == v1::BF16   ? 1.0f / 128
                      : c.dtype == v1::FP16 ? 1.0f / 1024
                                            : 1.0f / (1 << 22);
    for (size_t i = 0; i < oa.size(); ++i) {
      ASSERT_LE(std::fabs(oa[i] - ob[i]), 2 * ulp * std::max(1.0f, std::fabs(oa[i])))
          << "layer " << layer << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Caches, KvTransferMoveTest,
    ::testing::Values(
        MoveCase{"Fp32SamePages", v1::FP32, v1::DTYPE_UNSPECIFIED, 16, 16},
        MoveCase{"Bf16ToLargerPages", v1::BF16, v1::DTYPE_UNSPECIFIED, 16, 32},
        MoveCase{"Fp16SamePages", v1::FP16, v1::DTYPE_UNSPECIFIED, 16, 16},
        MoveCase{"Fp16ToSmallerPages", v1::FP16, v1::DTYPE_UNSPECIFIED, 32, 16},
        MoveCase{"Fp8FromFp16ToLargerPages", v1::FP16, v1::FP8_E4M3, 16, 32},
        MoveCase{"Fp8ToSmallerPages", v1::BF16, v1::FP8_E4M3, 32, 16},
        MoveCase{"Fp8SamePages", v1::BF16, v1::FP8_E4M3, 16, 16},
        // MLA caches: V pages of their own width, and K-only pages.
        MoveCase{"MlaValueDimSamePages", v1::FP32, v1::DTYPE_UNSPECIFIED, 16, 16,
                 Geo{24, 16, false}},
        MoveCase{"MlaVInKToLargerPages", v1::BF16, v1::DTYPE_UNSPECIFIED, 16, 32,
                 Geo{24, 16, true}},
        MoveCase{"MlaVInKSamePages", v1::FP32, v1::DTYPE_UNSPECIFIED, 16, 16, Geo{24, 0, true}},
        MoveCase{"MlaFp8ValueDimToSmallerPages", v1::BF16, v1::FP8_E4M3, 32, 16,
                 Geo{24, 16, false}},
        MoveCase{"MlaFp8VInKSamePages", v1::BF16, v1::FP8_E4M3, 16, 16, Geo{24, 16, true}}),
    [](const ::testing::TestParamInfo<MoveCase>& info) { return info.param.name; });

class KvTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = StartServer(Spec(16));
    ASSERT_TRUE(
        CreateCache(src_, CacheRequest("kv0", v1::BF16, v1::DTYPE_UNSPECIFIED, 0, 8192)).ok());
    std::mt19937 rng(5);
    Fill(src_, "kv0", v1::BF16, kLengths, &rng);
  }
  Server src_;
};

TEST_F(KvTransferTest, CreatesTheCacheFromTheHeader) {
  Server dst = StartServer(Spec(32));
  MoveOptions options;
  options.dest_cache_id = "moved";
  options.create.emplace();
  options.create->set_capacity_tokens(4096);
  auto moved = MoveCache(src_.channel, dst.channel, "kv0", options);
  ASSERT_TRUE(moved.ok()) << moved.status();
  auto stats = Stats(dst, "moved");
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->stats().page_size(), 16);  // the source's
  EXPECT_EQ(stats->stats().sequences(), static_cast<int64_t>(kLengths.size()));
  EXPECT_EQ(CacheRows(src_, "kv0"), CacheRows(dst, "moved"));
  // Without `create` an unknown cache is NOT_FOUND.
  MoveOptions bare;
  bare.dest_cache_id = "absent";
  auto refused = MoveCache(src_.channel, dst.channel, "kv0", bare);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << refused.status();
}

// An MLA cache's export carries its geometry: chunks of K rows alone with
// v_in_k (no v), a receiver created from the header takes the same geometry,
// and one whose cache has another value geometry refuses naming the field.
TEST_F(KvTransferTest, MlaGeometryTravelsInTheHeaderAndAMismatchIsRefused) {
  const Geo absorbed{24, 16, true};
  ASSERT_TRUE(
      CreateCache(src_, CacheRequest("mla", v1::BF16, v1::DTYPE_UNSPECIFIED, 0, 4096, absorbed))
          .ok());
  std::mt19937 rng(9);
  Fill(src_, "mla", v1::BF16, kLengths, &rng, "", absorbed);
  v1::ExportSequencesRequest r;
  r.set_cache_id("mla");
  auto chunks = ExportAll(src_, r);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_FALSE(chunks->empty());
  EXPECT_EQ(chunks->front().header().geometry().head_dim_v(), 16);
  EXPECT_TRUE(chunks->front().header().geometry().v_in_k());
  for (const v1::KvChunk& c : *chunks) {
    EXPECT_TRUE(c.v().empty());
    EXPECT_EQ(c.k().size(), size_t(c.num_tokens()) * kHkv * 24 * 2);
  }

  Server dst = StartServer(Spec(16));
  MoveOptions options;
  options.dest_cache_id = "mla";
  options.create.emplace();
  options.create->set_capacity_tokens(4096);
  auto moved = MoveCache(src_.channel, dst.channel, "mla", options);
  ASSERT_TRUE(moved.ok()) << moved.status();
  auto stats = Stats(dst, "mla");
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->stats().geometry().head_dim_v(), 16);
  EXPECT_TRUE(stats->stats().geometry().v_in_k());
  EXPECT_EQ(CacheRows(src_, "mla"), CacheRows(dst, "mla"));

  // Receivers whose cache differs in V's geometry: refused by name, nothing kept.
  const struct {
    const char* id;
    Geo geo;
    const char* field;
  } others[] = {{"sep", Geo{24, 16, false}, "header.geometry.v_in_k"},
                {"wide", Geo{24, 8, true}, "header.geometry.head_dim_v"},
                {"plain", Geo{}, "header.geometry.head_dim"}};
  for (const auto& o : others) {
    ASSERT_TRUE(
        CreateCache(dst, CacheRequest(o.id, v1::BF16, v1::DTYPE_UNSPECIFIED, 0, 4096, o.geo)).ok());
    MoveOptions into;
    into.dest_cache_id = o.id;
    auto refused = MoveCache(src_.channel, dst.channel, "mla", into);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_NE(refused.status().message().find(o.field), std::string::npos) << refused.status();
    auto after = Stats(dst, o.id);
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(after->stats().sequences(), 0);
  }
}

TEST_F(KvTransferTest, CutStreamResumesWithoutResendingKeptChunks) {
  Server dst = StartServer(Spec(16));
  MoveOptions options;
  options.max_chunk_bytes = 1;
  options.create.emplace();
  options.create->set_capacity_tokens(4096);
  // The import breaks twice: before chunk 4 and (counting across resumes)
  // before chunk 9, mid-sequence both times.
  options.fault_for_testing = [](int64_t index, const v1::KvChunk&) {
    return index == 4 || index == 9 ? absl::UnavailableError("cut") : absl::OkStatus();
  };
  auto moved = MoveCache(src_.channel, dst.channel, "kv0", options);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->resumes, 2);
  // Every chunk the receiver kept stayed kept: nothing was sent twice.
  EXPECT_EQ(moved->bytes_resent, 0);
  const Rows rows = CacheRows(src_, "kv0");
  int64_t total = 0;
  for (const auto& [key, bytes] : rows) total += static_cast<int64_t>(bytes.size());
  EXPECT_EQ(moved->bytes, total);
  EXPECT_EQ(rows, CacheRows(dst, "kv0"));
}

TEST_F(KvTransferTest, HardCutResumesAndSendsAgainOnlyWhatWasInFlight) {
  Server dst = StartServer(Spec(16));
  MoveOptions options;
  options.max_chunk_bytes = 1;
  options.create.emplace();
  options.create->set_capacity_tokens(4096);
  // The connection is cut (not half-closed) before chunk 6: chunks in
  // flight may be lost, and only those are sent again.
  options.fault_for_testing = [](int64_t index, const v1::KvChunk&) {
    return index == 6 ? absl::CancelledError("cut") : absl::OkStatus();
  };
  auto moved = MoveCache(src_.channel, dst.channel, "kv0", options);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->resumes, 1);
  const Rows rows = CacheRows(src_, "kv0");
  int64_t total = 0;
  for (const auto& [key, bytes] : rows) total += static_cast<int64_t>(bytes.size());
  // Everything once, plus at most the six chunks written before the cut.
  EXPECT_EQ(moved->bytes - moved->bytes_resent, total);
  int64_t first_six = 0;
  {
    v1::ExportSequencesRequest r;
    r.set_cache_id("kv0");
    r.set_max_chunk_bytes(1);
    auto all = ExportAll(src_, r);
    ASSERT_TRUE(all.ok());
    for (size_t i = 0; i < 6; ++i) {
      const v1::KvChunk& c = (*all)[i];
      first_six += static_cast<int64_t>(c.k().size() + c.v().size());
    }
  }
  EXPECT_LE(moved->bytes_resent, first_six);
  EXPECT_EQ(rows, CacheRows(dst, "kv0"));
}

// An import stream the test drives chunk by chunk.
class ImportStream {
 public:
  ImportStream(Server& s, const std::string& token = "") {
    Authorize(&ctx_, token);
    // A server that waits for more than the test sends fails the test.
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    stream_ = s.transfer->ImportSequences(&ctx_);
  }
  // The opening message; the first answer (false: the stream ended).
  bool Open(const std::string& cache_id, const v1::KvTransferHeader& header,
            v1::ImportSequencesResponse* answer, const v1::CreateCacheRequest* create = nullptr) {
    v1::ImportSequencesRequest r;
    r.set_cache_id(cache_id);
    *r.mutable_header() = header;
    if (create != nullptr) *r.mutable_create() = *create;
    return stream_->Write(r) && stream_->Read(answer);
  }
  bool Send(v1::KvChunk chunk) {
    v1::ImportSequencesRequest r;
    chunk.clear_header();
    *r.mutable_chunk() = std::move(chunk);
    return stream_->Write(r);
  }
  grpc::Status Close() {
    stream_->WritesDone();
    v1::ImportSequencesResponse r;
    while (stream_->Read(&r)) last_ = r;
    return stream_->Finish();
  }
  void Cut() { ctx_.TryCancel(); }
  grpc::Status Finish() {
    v1::ImportSequencesResponse r;
    while (stream_->Read(&r)) last_ = r;
    return stream_->Finish();
  }
  const v1::ImportSequencesResponse& last() const { return last_; }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ImportSequencesRequest, v1::ImportSequencesResponse>>
      stream_;
  v1::ImportSequencesResponse last_;
};

std::vector<v1::KvChunk> SourceChunks(Server& s, const std::string& transfer_id,
                                      std::vector<uint64_t> ids = {}) {
  v1::ExportSequencesRequest r;
  r.set_cache_id("kv0");
  r.set_transfer_id(transfer_id);
  r.set_max_chunk_bytes(1);
  for (uint64_t id : ids) r.add_sequence_ids(id);
  auto chunks = ExportAll(s, r);
  EXPECT_TRUE(chunks.ok()) << chunks.status();
  return chunks.ok() ? *chunks : std::vector<v1::KvChunk>();
}

TEST_F(KvTransferTest, ChecksumMismatchIsDataLossAndNothingOfTheSequenceIsLive) {
  Server dst = StartServer(Spec(16));
  ASSERT_TRUE(CreateCache(dst, CacheRequest("kv0", v1::BF16, v1::DTYPE_UNSPECIFIED, 0, 4096)).ok());
  // Sequence 7 (one chunk per page: 3 chunks per layer), then 42.
  std::vector<v1::KvChunk> chunks = SourceChunks(src_, "crc-1", {7, 42});
  ASSERT_GT(chunks.size(), 10u);
  const v1::KvTransferHeader header = chunks[0].header();
  // Sequence 42's fifth chunk has one bit flipped in V; its checksum is the original's.
  size_t bad = 0;
  for (size_t i = 0, seen = 0; i < chunks.size(); ++i) {
    if (chunks[i].sequence_id() == 42 && ++seen == 5) bad = i;
  }
  ASSERT_GT(bad, 0u);
  v1::KvChunk corrupt = chunks[bad];
  (*corrupt.mutable_v())[3] ^= 0x10;
  {
    ImportStream s(dst);
    v1::ImportSequencesResponse answer;
    ASSERT_TRUE(s.Open("kv0", header, &answer));
    for (size_t i = 0; i < bad; ++i) ASSERT_TRUE(s.Send(chunks[i]));
    s.Send(corrupt);
    const grpc::Status st = s.Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS) << st.error_message();
    EXPECT_NE(st.error_message().find("chunk.crc32c"), std::string::npos) << st.error_message();
  }
  // Sequence 7 is live; nothing of 42 is.
  EXPECT_TRUE(Stats(dst, "kv0", {7}).ok());
  EXPECT_EQ(Stats(dst, "kv0", {42}).status().code(), absl::StatusCode::kNotFound);
  // A resume sends the refused chunk again (the receiver kept the ones before it).
  {
    ImportStream s(dst);
    v1::ImportSequencesResponse answer;
    ASSERT_TRUE(s.Open("kv0", header, &answer));
    ASSERT_EQ(answer.resume().committed_sequence_ids_size(), 1);
    ASSERT_TRUE(answer.resume().has_sequence_id());
    EXPECT_EQ(answer.resume().sequence_id(), 42u);
    EXPECT_EQ(answer.resume().layer(), chunks[bad].layer());
    EXPECT_EQ(answer.resume().token(), chunks[bad].token_begin());
    for (size_t i = bad; i < chunks.size(); ++i) ASSERT_TRUE(s.Send(chunks[i]));
    const grpc::Status st = s.Close();
    EXPECT_TRUE(st.ok()) << st.error_message();
    EXPECT_TRUE(s.last().done());
  }
  const Rows src_rows = CacheRows(src_, "kv0");
  const Rows dst_rows = CacheRows(dst, "kv0");
  for (uint64_t id : {7, 42}) {
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(src_rows.at({id, l}), dst_rows.at({id, l})) << id << " " << l;
    }
  }
}

TEST_F(KvTransferTest, AlreadyExistsLeavesTheReceiversSequence) {
  Server dst = StartServer(Spec(16));
  ASSERT_TRUE(CreateCache(dst, CacheRequest("kv0", v1::BF16, v1::DTYPE_UNSPECIFIED, 0, 4096)).ok());
  std::mt19937 rng(99);
  Fill(dst, "kv0", v1::BF16, {{42, {5, 5, 5}}}, &rng);
  const Rows before = CacheRows(dst, "kv0");
  MoveOptions options;
  options.sequence_ids = {7, 42};
  auto moved = MoveCache(src_.channel, dst.channel, "kv0", options);
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kAlreadyExists) << moved.status();
  EXPECT_NE(moved.status().message().find("42"), std::string::npos);
  auto stats = Stats(dst, "kv0", {7, 42});
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->sequences(1).lengths(0), 5);  // 42 as it was
  const Rows after = CacheRows(dst, "kv0");
  EXPECT_EQ(before.at({42, 0}), after.at({42, 0}));
  // 7 came before it and is live; no staged page is left behind.
  EXPECT_EQ(stats->sequences(0).lengths(0), 40);
  auto src_stats = Stats(src_, "kv0", {7});
  ASSERT_TRUE(src_stats.ok());
  // Pages used: 42's own (1 per layer) plus 7's (3 per layer at 16 per page).
  EXPECT_EQ(stats->stats().pages_used(), 3 + 3 * 3);
}

TEST_F(KvTransferTest, AppendsARangeToASequenceHoldingItsPrefix) {
  // A prefill engine hands over a sequence in two pieces: [0, 20) then the rest.
  Server dst = StartServer(Spec(32));
  ASSERT_TRUE(CreateCache(dst, CacheRequest("kv0", v1::BF16, v1::DTYPE_UNSPECIFIED, 0, 4096)).ok());
  MoveOptions first;
  first.sequence_ids = {7};
  first.token_end = 20;
  ASSERT_TRUE(MoveCache(src_.channel, dst.channel, "kv0", first).ok());
  auto mid = Stats(dst, "kv0", {7});
  ASSERT_TRUE(mid.ok());
  EXPECT_EQ(mid->sequences(0).lengths(2), 20);
  MoveOptions rest;
  rest.sequence_ids = {7};
  rest.token_begin = 20;
  auto moved = MoveCache(src_.channel, dst.channel, "kv0", rest);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(CacheRows(src_, "kv0").at({7, 1}), CacheRows(dst, "kv0").at({7, 1}));
  const auto a = DecodeStep(src_, "kv0", v1::BF16, {{7, {40, 40, 40}}}, 1, 3);
  const auto b = DecodeStep(dst, "kv0", v1::BF16, {{7, {40, 40, 40}}}, 1, 3);
  const std::vector<float> oa = AsFloats(a[0], v1::BF16), ob = AsFloats(b[0], v1::BF16);
  for (size_t i = 0; i < oa.size(); ++i) {
    ASSERT_LE(std::fabs(oa[i] - ob[i]), 2.0f / 128 * std::max(1.0f, std::fabs(oa[i]))) << i;
  }
  // Appending again from 20 now finds 40 tokens: FAILED_PRECONDITION, nothing changes.
  auto again = MoveCache(src_.channel, dst.channel, "kv0", rest);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
}

std::string TokensFile(const std::string& name, const std::string& b_quota) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream out(path);
  out << kTokenA << " a\n" << kTokenB << " b " << b_quota << "\n";
  return path;
}

TEST_F(KvTransferTest, QuotaOnTheReceiverIsResourceExhaustedAndStagedPagesGoBack) {
  // Tenant b may reserve 40 pages of K/V over all its caches.
  Server dst = StartServer(Spec(16, TokensFile("kv_transfer_quota", "kv_pages=40")));
  MoveOptions options;
  options.dest_metadata = AuthMetadata(kTokenB);
  options.create.emplace();
  // A cache over the quota: refused when the import creates it.
  options.create->set_capacity_tokens(41 * 16);
  auto over = MoveCache(src_.channel, dst.channel, "kv0", options);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("kv_pages"), std::string::npos) << over.status();
  EXPECT_EQ(Stats(dst, "kv0", {}, kTokenB).status().code(), absl::StatusCode::kNotFound);
  // Within the quota but smaller than the transfer (3 + 9 + 4 + 0 + 12 pages
  // for the five sequences at 16 per page): the sequence that does not fit
  // is refused mid-way, its staged pages go back, the ones before stay live.
  options.create->set_capacity_tokens(20 * 16);
  options.max_chunk_bytes = 1;
  auto full = MoveCache(src_.channel, dst.channel, "kv0", options);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  auto stats = Stats(dst, "kv0", {}, kTokenB);
  ASSERT_TRUE(stats.ok()) << stats.status();
  // 3 (seq 3) + 9 (seq 7) + 4 (seq 9) + 0 (seq 11) fit; 42 needed 12 more.
  EXPECT_EQ(stats->stats().sequences(), 4);
  EXPECT_EQ(stats->stats().pages_used(), 3 + 9 + 4);
}

TEST_F(KvTransferTest, AnotherTenantCannotExportOrImportACacheItDoesNotOwn) {
  const std::string tokens = TokensFile("kv_transfer_tenants", "");
  Server a = StartServer(Spec(16, tokens));
  ASSERT_TRUE(
      CreateCache(a, CacheRequest("kv0", v1::BF16, v1::DTYPE_UNSPECIFIED, 0, 4096), kTokenA).ok());
  std::mt19937 rng(1);
  Fill(a, "kv0", v1::BF16, {{1, {20, 20, 20}}}, &rng, kTokenA);
  // b cannot export a's cache: it reads like one that never existed.
  v1::ExportSequencesRequest r;
  r.set_cache_id("kv0");
  EXPECT_EQ(ExportAll(a, r, kTokenB).status().code(), absl::StatusCode::kNotFound);
  // b cannot import into a's cache: without `create` NOT_FOUND ...
  MoveOptions options;
  options.dest_metadata = AuthMetadata(kTokenB);
  auto into = MoveCache(src_.channel, a.channel, "kv0", options);
  EXPECT_EQ(into.status().code(), absl::StatusCode::kNotFound) << into.status();
  // ... and with it, b gets a cache of its own; a's is untouched.
  options.create.emplace();
  options.create->set_capacity_tokens(2048);
  ASSERT_TRUE(MoveCache(src_.channel, a.channel, "kv0", options).ok());
  auto as = Stats(a, "kv0", {}, kTokenA);
  auto bs = Stats(a, "kv0", {}, kTokenB);
  ASSERT_TRUE(as.ok() && bs.ok());
  EXPECT_EQ(as->stats().sequences(), 1);
  EXPECT_EQ(bs->stats().sequences(), static_cast<int64_t>(kLengths.size()));
}

TEST_F(KvTransferTest, IdleTimeoutReturnsACutImportsStagedPages) {
  Server dst = StartServer(Spec(16, "", absl::Milliseconds(300)));
  ASSERT_TRUE(CreateCache(dst, CacheRequest("kv0", v1::BF16, v1::DTYPE_UNSPECIFIED, 0, 4096)).ok());
  std::vector<v1::KvChunk> chunks = SourceChunks(src_, "idle-1", {42});
  ASSERT_GT(chunks.size(), 4u);
  {
    ImportStream s(dst);
    v1::ImportSequencesResponse answer;
    ASSERT_TRUE(s.Open("kv0", chunks[0].header(), &answer));
    for (size_t i = 0; i < 4; ++i) ASSERT_TRUE(s.Send(chunks[i]));
    // Staged pages count in the cache while the import is open.
    ASSERT_TRUE(Eventually([&] {
      auto st = Stats(dst, "kv0");
      return st.ok() && st->stats().pages_used() == 4;
    }));
    s.Cut();
    s.Finish();
  }
  // After the timeout without a resume they go back.
  ASSERT_TRUE(Eventually([&] {
    auto st = Stats(dst, "kv0");
    return st.ok() && st->stats().pages_used() == 0;
  }));
  // The transfer is gone: a resume starts from nothing.
  ImportStream s(dst);
  v1::ImportSequencesResponse answer;
  ASSERT_TRUE(s.Open("kv0", chunks[0].header(), &answer));
  EXPECT_FALSE(answer.resume().has_sequence_id());
  EXPECT_EQ(answer.bytes_received(), 0);
  s.Cut();
  s.Finish();
}

TEST_F(KvTransferTest, ChunksOutOfOrderAreRefusedNamingTheField) {
  Server dst = StartServer(Spec(16));
  ASSERT_TRUE(CreateCache(dst, CacheRequest("kv0", v1::BF16, v1::DTYPE_UNSPECIFIED, 0, 4096)).ok());
  std::vector<v1::KvChunk> chunks = SourceChunks(src_, "order-1", {7});
  ImportStream s(dst);
  v1::ImportSequencesResponse answer;
  ASSERT_TRUE(s.Open("kv0", chunks[0].header(), &answer));
  ASSERT_TRUE(s.Send(chunks[0]));
  s.Send(chunks[2]);  // skips chunk 1
  const grpc::Status st = s.Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("chunk.token_begin"), std::string::npos) << st.error_message();
  EXPECT_EQ(Stats(dst, "kv0", {7}).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace attnserve
