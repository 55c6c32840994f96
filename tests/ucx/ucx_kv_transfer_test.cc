// K/V sequences moved between two real servers (CPU backend, loopback) with
// the pages over UCX (server/ucx/kv_bulk.h; UCX_TLS from the environment: the
// test runs over tcp and over sm,tcp): the receiver holds byte for byte the
// source's rows; a move cut mid-way resumes where the receiver stands and
// still ends with the same rows; a receiver without UCX takes the pages in the
// gRPC streams and the result says why; a receiver too small refuses over UCX
// as over gRPC; lanes split the sequences; UCX exports past their limits
// (or without a thread) are refused naming why; UCX exports' windows and
// imports' chunks are charged to the server's --max_buffered_bytes share
// without tokens too.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "attnserve/v1/kv_transfer.grpc.pb.h"
#include "backend/backend_factory.h"
#include "client/kv_transfer.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "server/buffered_shares.h"
#include "server/native/kv_transfer_service.h"
#include "server/server.h"
#include "server/ucx/kv_bulk.h"

namespace attnserve {
namespace {

constexpr int kHq = 4, kHkv = 2, kD = 16, kLayers = 3;

struct Server {
  std::unique_ptr<AttnServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvCache::Stub> kv;
  std::unique_ptr<v1::KvTransfer::Stub> transfer;
};

// `max_buffered_bytes` 0: the default budget.
Server StartServer(bool ucx, int64_t max_buffered_bytes = 0) {
  ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.kv_cache_bytes = int64_t{256} << 20;
  o.kv_page_size = 16;
  o.max_buffered_bytes = max_buffered_bytes;
  if (ucx) o.ucx_port = -1;  // any free port
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

std::string RandomBf16(std::mt19937* rng, int64_t n) {
  std::normal_distribution<float> normal;
  std::string out(size_t(n) * 2, '\0');
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = FloatToBf16(normal(*rng));
    std::memcpy(out.data() + i * 2, &h, 2);
  }
  return out;
}

void SetTensor(v1::Tensor* t, std::vector<int64_t> shape, std::string data) {
  t->set_dtype(v1::BF16);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(std::move(data));
}

using Rows = std::map<std::pair<uint64_t, int32_t>, std::string>;

// A cache of `sequences` sequences of `tokens` rows at every layer, appended
// `step` rows at a time for all of them (a page per step: each sequence's
// pages then alternate with the others', not one run of consecutive pages).
void MakeCache(Server& s, const std::string& cache, v1::DType cache_dtype, int sequences,
               int tokens, uint32_t seed, int step = 1 << 30, Rows* appended = nullptr,
               int64_t capacity_tokens = 0) {
  std::mt19937 rng(seed);
  std::map<std::pair<uint64_t, int32_t>, std::string> ks, vs;
  {
    v1::CreateCacheRequest r;
    r.set_cache_id(cache);
    r.mutable_geometry()->set_num_layers(kLayers);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::BF16);
    r.mutable_geometry()->set_cache_dtype(cache_dtype);
    r.set_page_size(16);
    r.set_capacity_tokens(capacity_tokens > 0 ? capacity_tokens
                                              : int64_t{sequences} * kLayers * (tokens + 16));
    grpc::ClientContext ctx;
    v1::CreateCacheResponse resp;
    const grpc::Status st = s.kv->CreateCache(&ctx, r, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  {
    v1::CreateSequencesRequest r;
    r.set_cache_id(cache);
    for (int i = 0; i < sequences; ++i) r.add_sequences()->set_sequence_id(uint64_t(100 + i));
    grpc::ClientContext ctx;
    v1::CreateSequencesResponse resp;
    const grpc::Status st = s.kv->CreateSequences(&ctx, r, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  for (int done = 0; done < tokens; done += step) {
    const int n = std::min(step, tokens - done);
    for (int layer = 0; layer < kLayers; ++layer) {
      v1::AppendAttendRequest r;
      r.set_cache_id(cache);
      r.set_layer(layer);
      for (int i = 0; i < sequences; ++i) {
        v1::SequenceStep* seq = r.add_sequences();
        seq->set_sequence_id(uint64_t(100 + i));
        seq->set_num_new_tokens(n);
        seq->set_expected_length(done);
      }
      const int64_t rows = int64_t{sequences} * n;
      std::string k = RandomBf16(&rng, rows * kHkv * kD);
      std::string v = RandomBf16(&rng, rows * kHkv * kD);
      const size_t each = size_t(n) * kHkv * kD * 2;
      for (int i = 0; i < sequences; ++i) {
        ks[{uint64_t(100 + i), layer}] += k.substr(size_t(i) * each, each);
        vs[{uint64_t(100 + i), layer}] += v.substr(size_t(i) * each, each);
      }
      SetTensor(r.mutable_q(), {0, kHq, kD}, "");
      SetTensor(r.mutable_k(), {rows, kHkv, kD}, std::move(k));
      SetTensor(r.mutable_v(), {rows, kHkv, kD}, std::move(v));
      grpc::ClientContext ctx;
      v1::AppendAttendResponse resp;
      const grpc::Status st = s.kv->AppendAttend(&ctx, r, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
    }
  }
  if (appended != nullptr) {
    for (const auto& [key, k] : ks) (*appended)[key] = k + vs[key];
  }
}

// What a cache holds, chunking aside: per (sequence, layer) its K, V and
// scales as one string (an export over gRPC).
Rows CacheRows(Server& s, const std::string& cache) {
  v1::ExportSequencesRequest r;
  r.set_cache_id(cache);
  grpc::ClientContext ctx;
  auto reader = s.transfer->ExportSequences(&ctx, r);
  std::map<std::pair<uint64_t, int32_t>, std::string> k, v, ks, vs;
  v1::KvChunk c;
  while (reader->Read(&c)) {
    const std::pair<uint64_t, int32_t> key{c.sequence_id(), c.layer()};
    k[key] += c.k();
    v[key] += c.v();
    ks[key] += c.k_scale();
    vs[key] += c.v_scale();
  }
  const grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  Rows rows;
  for (const auto& [key, bytes] : k) rows[key] = bytes + v[key] + ks[key] + vs[key];
  return rows;
}

int64_t PagesUsed(Server& s, const std::string& cache) {
  v1::GetCacheStatsRequest r;
  r.set_cache_id(cache);
  grpc::ClientContext ctx;
  v1::GetCacheStatsResponse resp;
  if (!s.kv->GetCacheStats(&ctx, r, &resp).ok()) return -1;
  return resp.stats().pages_used();
}

MoveOptions UcxMove(int64_t capacity_tokens) {
  MoveOptions o;
  o.data_plane = "ucx";
  o.create.emplace();
  o.create->set_capacity_tokens(capacity_tokens);
  return o;
}

class UcxKvTransferTest : public ::testing::TestWithParam<v1::DType> {};

TEST_P(UcxKvTransferTest, ReceiverHoldsTheSameRows) {
  Server a = StartServer(true), b = StartServer(true);
  Rows appended;
  ASSERT_NO_FATAL_FAILURE(MakeCache(a, "kv0", GetParam(), 6, 200, 1, /*step=*/16, &appended));
  MoveOptions o = UcxMove(6 * kLayers * 256);
  o.max_chunk_bytes = 16 << 10;  // many chunks in flight
  absl::StatusOr<MoveResult> moved = MoveCache(a.channel, b.channel, "kv0", o);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->data_plane, "ucx") << moved->data_plane_fallback;
  EXPECT_EQ(moved->sequences, 6);
  EXPECT_EQ(moved->resumes, 0);
  EXPECT_EQ(moved->dest_stats.sequences(), 6);
  const Rows want = CacheRows(a, "kv0");
  ASSERT_EQ(want.size(), size_t{6 * kLayers});
  int64_t total = 0;
  for (const auto& [key, bytes] : want) total += int64_t(bytes.size());
  EXPECT_EQ(moved->bytes, total);
  EXPECT_TRUE(CacheRows(b, "kv0") == want) << "the receiver's rows differ from the source's";
  // BF16 pages hold the appended rows as they were sent (FP8 ones their codes).
  if (GetParam() == v1::BF16) EXPECT_TRUE(want == appended) << "the export differs from the rows";
  b.server->Shutdown(absl::ZeroDuration());
  a.server->Shutdown(absl::ZeroDuration());
}

TEST_P(UcxKvTransferTest, LanesSplitTheSequences) {
  Server a = StartServer(true), b = StartServer(true);
  ASSERT_NO_FATAL_FAILURE(MakeCache(a, "kv0", GetParam(), 7, 100, 2));
  MoveOptions o = UcxMove(7 * kLayers * 128);
  o.lanes = 3;
  absl::StatusOr<MoveResult> moved = MoveCache(a.channel, b.channel, "kv0", o);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->lanes, 3);
  EXPECT_EQ(moved->data_plane, "ucx");
  EXPECT_EQ(moved->sequences, 7);
  EXPECT_TRUE(CacheRows(b, "kv0") == CacheRows(a, "kv0"));
  b.server->Shutdown(absl::ZeroDuration());
  a.server->Shutdown(absl::ZeroDuration());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, UcxKvTransferTest, ::testing::Values(v1::BF16, v1::FP8_E4M3),
                         [](const auto& info) {
                           return std::string(info.param == v1::BF16 ? "Bf16" : "Fp8");
                         });

// The export is cut once the receiver holds rows (evidence: pages in use in
// its cache), part way through: the move resumes from the receiver's resume
// point (a resume that sent from the start would be refused: those sequences
// are live or staged) and ends with the source's rows. On a loaded machine
// the cut may land after the end: up to three tries, each into a cache of
// its own.
TEST(UcxKvTransferCutTest, CutExportResumesWhereTheReceiverStands) {
  Server a = StartServer(true), b = StartServer(true);
  ASSERT_NO_FATAL_FAILURE(MakeCache(a, "kv0", v1::BF16, 24, 1000, 3));
  const Rows want = CacheRows(a, "kv0");
  absl::StatusOr<MoveResult> moved = absl::UnknownError("not run");
  std::string dest;
  for (int attempt = 0; attempt < 3; ++attempt) {
    dest = absl::StrCat("kv-try", attempt);
    MoveOptions o = UcxMove(24 * kLayers * 1024);
    o.dest_cache_id = dest;
    o.max_chunk_bytes = 8 << 10;  // small chunks: the transfer takes a while
    std::atomic<int> exports{0};
    std::thread cutter;
    o.data_plane_started_for_testing = [&](std::function<void()> cut) {
      if (exports.fetch_add(1) > 0) return;
      cutter = std::thread([&b, dest, cut] {
        const absl::Time until = absl::Now() + absl::Seconds(30);
        while (PagesUsed(b, dest) <= 0 && absl::Now() < until) {
        }
        cut();
      });
    };
    moved = MoveCache(a.channel, b.channel, "kv0", o);
    if (cutter.joinable()) cutter.join();
    ASSERT_TRUE(moved.ok()) << moved.status();
    EXPECT_EQ(exports.load(), moved->resumes + 1);
    if (moved->resumes >= 1) break;
  }
  EXPECT_EQ(moved->data_plane, "ucx");
  EXPECT_GE(moved->resumes, 1) << "three cuts came after the end";
  EXPECT_EQ(moved->sequences, 24);
  EXPECT_EQ(moved->dest_stats.sequences(), 24);
  EXPECT_TRUE(CacheRows(b, dest) == want);
  b.server->Shutdown(absl::ZeroDuration());
  a.server->Shutdown(absl::ZeroDuration());
}

// A move refused at its third sequence (the receiver holds that id) keeps
// the two before it live; run again with the same transfer id once the id is
// freed, it resumes after them: the receiver keeps exactly the other four
// sequences' bytes this time (none of the first two is sent again).
TEST(UcxKvTransferCutTest, ARerunResumesAfterTheCommittedSequences) {
  Server a = StartServer(true), b = StartServer(true);
  ASSERT_NO_FATAL_FAILURE(MakeCache(a, "kv0", v1::BF16, 6, 100, 6));
  // ids 100..102, room for all six of the source's
  ASSERT_NO_FATAL_FAILURE(
      MakeCache(b, "kv0", v1::BF16, 3, 20, 7, 1 << 30, nullptr, 6 * kLayers * 128));
  {
    v1::FreeSequencesRequest r;
    r.set_cache_id("kv0");
    r.add_sequence_ids(100);
    r.add_sequence_ids(101);
    grpc::ClientContext ctx;
    v1::FreeSequencesResponse resp;
    ASSERT_TRUE(b.kv->FreeSequences(&ctx, r, &resp).ok());
  }
  MoveOptions o;
  o.data_plane = "ucx";
  o.transfer_id = "rerun-1";
  absl::StatusOr<MoveResult> refused = MoveCache(a.channel, b.channel, "kv0", o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  {
    v1::FreeSequencesRequest r;
    r.set_cache_id("kv0");
    r.add_sequence_ids(102);
    grpc::ClientContext ctx;
    v1::FreeSequencesResponse resp;
    ASSERT_TRUE(b.kv->FreeSequences(&ctx, r, &resp).ok());
  }
  const Rows want = CacheRows(a, "kv0");
  int64_t rest = 0;
  for (const auto& [key, bytes] : want) {
    if (key.first >= 102) rest += int64_t(bytes.size());
  }
  absl::StatusOr<MoveResult> moved = MoveCache(a.channel, b.channel, "kv0", o);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->data_plane, "ucx");
  EXPECT_EQ(moved->bytes, rest) << "the rerun sent committed sequences again";
  EXPECT_EQ(moved->sequences, 6);
  EXPECT_TRUE(CacheRows(b, "kv0") == want);
  b.server->Shutdown(absl::ZeroDuration());
  a.server->Shutdown(absl::ZeroDuration());
}

// A receiver started without --ucx_port: the move asks for UCX, gets the
// reason in the first answer and sends the pages in the gRPC streams.
TEST(UcxKvTransferFallbackTest, ReceiverWithoutUcxTakesTheChunksOverGrpc) {
  Server a = StartServer(true), b = StartServer(false);
  ASSERT_NO_FATAL_FAILURE(MakeCache(a, "kv0", v1::BF16, 4, 150, 4));
  absl::StatusOr<MoveResult> moved =
      MoveCache(a.channel, b.channel, "kv0", UcxMove(4 * kLayers * 160));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->data_plane, "grpc");
  EXPECT_TRUE(absl::StrContains(moved->data_plane_fallback, "no UCX"))
      << moved->data_plane_fallback;
  EXPECT_EQ(moved->resumes, 0);
  EXPECT_EQ(moved->sequences, 4);
  EXPECT_TRUE(CacheRows(b, "kv0") == CacheRows(a, "kv0"));
  b.server->Shutdown(absl::ZeroDuration());
  a.server->Shutdown(absl::ZeroDuration());
}

// A source started without --ucx_port sends nothing over UCX: the export
// says so and the move goes on in the gRPC streams.
TEST(UcxKvTransferFallbackTest, SourceWithoutUcxExportsOverGrpc) {
  Server a = StartServer(false), b = StartServer(true);
  ASSERT_NO_FATAL_FAILURE(MakeCache(a, "kv0", v1::BF16, 4, 150, 8));
  absl::StatusOr<MoveResult> moved =
      MoveCache(a.channel, b.channel, "kv0", UcxMove(4 * kLayers * 160));
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->data_plane, "grpc");
  EXPECT_TRUE(absl::StrContains(moved->data_plane_fallback, "the source offers no UCX"))
      << moved->data_plane_fallback;
  EXPECT_EQ(moved->sequences, 4);
  EXPECT_TRUE(CacheRows(b, "kv0") == CacheRows(a, "kv0"));
  b.server->Shutdown(absl::ZeroDuration());
  a.server->Shutdown(absl::ZeroDuration());
}

// The receiver's refusals come back over UCX with the gRPC import's code and
// message: a cache too small for the second sequence is RESOURCE_EXHAUSTED,
// the first stays live (all or nothing per sequence), the second is not.
TEST(UcxKvTransferQuotaTest, ReceiverTooSmallRefusesWithTheImportsStatus) {
  Server a = StartServer(true), b = StartServer(true);
  ASSERT_NO_FATAL_FAILURE(MakeCache(a, "kv0", v1::BF16, 2, 160, 5));
  absl::StatusOr<MoveResult> moved =
      MoveCache(a.channel, b.channel, "kv0", UcxMove(kLayers * (160 + 80)));
  ASSERT_FALSE(moved.ok());
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kResourceExhausted) << moved.status();
  EXPECT_TRUE(absl::StrContains(moved.status().message(), "over UCX")) << moved.status();
  v1::GetCacheStatsRequest r;
  r.set_cache_id("kv0");
  grpc::ClientContext ctx;
  v1::GetCacheStatsResponse resp;
  ASSERT_TRUE(b.kv->GetCacheStats(&ctx, r, &resp).ok());
  EXPECT_EQ(resp.stats().sequences(), 1);
  b.server->Shutdown(absl::ZeroDuration());
  a.server->Shutdown(absl::ZeroDuration());
}

// Waits until `done` holds, at most 10 seconds.
bool WaitUntil(const std::function<bool()>& done) {
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

v1::ExportSequencesRequest ExportOverUcx(const std::string& cache, const ucx::BulkOffer& offer) {
  v1::ExportSequencesRequest r;
  r.set_cache_id(cache);
  v1::KvDataPlane* plane = r.mutable_data_plane();
  plane->set_transport("ucx");
  plane->set_host(offer.host);
  plane->set_port(offer.port);
  plane->set_ticket(offer.ticket);
  return r;
}

grpc::Status RunExport(Server& s, const v1::ExportSequencesRequest& r) {
  grpc::ClientContext ctx;
  auto reader = s.transfer->ExportSequences(&ctx, r);
  v1::KvChunk chunk;
  while (reader->Read(&chunk)) {
  }
  return reader->Finish();
}

// UCX exports running at once are counted per server and per tenant: one
// more is refused with RESOURCE_EXHAUSTED naming the flag before it reserves
// or sends anything; an export whose thread does not start is refused the
// same way and gives back what it took (a later export runs).
TEST(UcxKvTransferLimitTest, ExportsOverTheLimitsAreRefusedNamingTheFlag) {
  Server src = StartServer(true);
  ASSERT_NE(src.server, nullptr);
  MakeCache(src, "c", v1::BF16, 2, 40, 1);
  // The first export holds (its receiver's first apply waits) until released.
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> applied{0};
  auto held = ucx::BulkReceiver::Start("127.0.0.1", [&](const KvTransferChunk&) {
    ++applied;
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return release; });
    return absl::OkStatus();
  });
  ASSERT_TRUE(held.ok()) << held.status();
  auto other = ucx::BulkReceiver::Start("127.0.0.1",
                                        [](const KvTransferChunk&) { return absl::OkStatus(); });
  ASSERT_TRUE(other.ok()) << other.status();
  SetUcxExportLimits(1, 0);
  grpc::Status first;
  std::thread running([&] { first = RunExport(src, ExportOverUcx("c", (*held)->offer())); });
  ASSERT_TRUE(WaitUntil([&] { return applied > 0; })) << "the first export did not start";
  grpc::Status second = RunExport(src, ExportOverUcx("c", (*other)->offer()));
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << second.error_message();
  EXPECT_TRUE(absl::StrContains(second.error_message(), "--ucx_max_exports allows (1)"))
      << second.error_message();
  SetUcxExportLimits(0, 1);
  second = RunExport(src, ExportOverUcx("c", (*other)->offer()));
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << second.error_message();
  EXPECT_TRUE(absl::StrContains(second.error_message(), "--ucx_max_exports_per_tenant"))
      << second.error_message();
  EXPECT_EQ((*other)->chunks(), 0);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  running.join();
  EXPECT_TRUE(first.ok()) << first.error_message();

  SetUcxExportLimits(1, 1);
  ucx::fail_thread_start_for_test = 1;  // the export's sender thread
  const grpc::Status no_thread = RunExport(src, ExportOverUcx("c", (*other)->offer()));
  ucx::fail_thread_start_for_test = 0;
  EXPECT_EQ(no_thread.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << no_thread.error_message();
  EXPECT_TRUE(absl::StrContains(no_thread.error_message(), "UCX export's thread"))
      << no_thread.error_message();
  const grpc::Status after = RunExport(src, ExportOverUcx("c", (*other)->offer()));
  EXPECT_TRUE(after.ok()) << after.error_message();
  EXPECT_GT((*other)->chunks(), 0);
  SetUcxExportLimits(kDefaultUcxMaxExports, kDefaultUcxMaxExportsPerTenant);
}

// Without tokens, a UCX export's window (8 chunks of the whole cache here)
// is charged to the server's budget for bytes outside gRPC and the streams
// (server/buffered_shares.h): with room for one and a half windows, a second
// export while the first runs is refused RESOURCE_EXHAUSTED naming
// max_buffered_bytes before it sends anything, and one after it runs.
TEST(UcxKvTransferBudgetTest, ExportWindowsAreChargedToTheServersBudget) {
  // 2 sequences x 40 tokens x 3 layers, K and V of 2 heads x 16 BF16 each.
  const int64_t cache_bytes = 2 * 40 * kLayers * 2 * kHkv * kD * 2;
  const int64_t window = ucx::BulkOptions{}.window * cache_bytes;
  const int64_t budget = 6 * window;
  ASSERT_EQ(SplitBufferedBytes(budget).outside, window * 3 / 2);
  Server src = StartServer(true, budget);
  ASSERT_NE(src.server, nullptr);
  ASSERT_NO_FATAL_FAILURE(MakeCache(src, "c", v1::BF16, 2, 40, 1));
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> applied{0};
  auto held = ucx::BulkReceiver::Start("127.0.0.1", [&](const KvTransferChunk&) {
    ++applied;
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return release; });
    return absl::OkStatus();
  });
  ASSERT_TRUE(held.ok()) << held.status();
  auto other = ucx::BulkReceiver::Start("127.0.0.1",
                                        [](const KvTransferChunk&) { return absl::OkStatus(); });
  ASSERT_TRUE(other.ok()) << other.status();
  grpc::Status first;
  std::thread running([&] { first = RunExport(src, ExportOverUcx("c", (*held)->offer())); });
  ASSERT_TRUE(WaitUntil([&] { return applied > 0; })) << "the first export did not start";
  const grpc::Status second = RunExport(src, ExportOverUcx("c", (*other)->offer()));
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << second.error_message();
  EXPECT_TRUE(absl::StrContains(second.error_message(), "max_buffered_bytes"))
      << second.error_message();
  EXPECT_EQ((*other)->chunks(), 0);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  running.join();
  EXPECT_TRUE(first.ok()) << first.error_message();
  // The first export's window was given back.
  const grpc::Status after = RunExport(src, ExportOverUcx("c", (*other)->offer()));
  EXPECT_TRUE(after.ok()) << after.error_message();
  EXPECT_GT((*other)->chunks(), 0);
  src.server->Shutdown(absl::ZeroDuration());
}

// Without tokens, each chunk a UCX import receives is charged to the
// receiving server's budget from its frame on: a chunk (one layer of a
// 2,048-token sequence, 256 KiB) over that share (128 KiB) is refused
// RESOURCE_EXHAUSTED naming max_buffered_bytes, and the move stops with it.
TEST(UcxKvTransferBudgetTest, ImportChunksAreChargedToTheServersBudget) {
  const int64_t budget = int64_t{512} << 10;
  ASSERT_EQ(SplitBufferedBytes(budget).outside, int64_t{128} << 10);
  Server a = StartServer(true), b = StartServer(true, budget);
  ASSERT_NE(b.server, nullptr);
  ASSERT_NO_FATAL_FAILURE(MakeCache(a, "kv0", v1::BF16, 1, 2048, 3));
  absl::StatusOr<MoveResult> moved =
      MoveCache(a.channel, b.channel, "kv0", UcxMove(kLayers * (2048 + 16)));
  ASSERT_FALSE(moved.ok());
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kResourceExhausted) << moved.status();
  EXPECT_TRUE(absl::StrContains(moved.status().message(), "max_buffered_bytes")) << moved.status();
  EXPECT_EQ(PagesUsed(b, "kv0"), -1) << "the refused import's cache stayed";
  b.server->Shutdown(absl::ZeroDuration());
  a.server->Shutdown(absl::ZeroDuration());
}

// The gauge `name` (no labels) in Prometheus text; -1 when absent.
double Gauge(const std::string& text, const std::string& name) {
  const std::string key = "\n" + name + "{} ";
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size()));
}

// --max_buffered_bytes bounds everything together: gRPC's quota, the
// streams' and HTTP's share and the share UCX transfers and pushes charge
// add up to it (each was half of it: 1.5 x B together), and /metrics says
// each with what UCX holds now (nothing, no transfer running).
TEST(UcxKvTransferBudgetTest, TheSharesAddUpToTheBudget) {
  const int64_t budget = int64_t{64} << 20;
  ServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.ucx_port = -1;
  o.max_buffered_bytes = budget;
  o.metrics_enabled = true;
  o.metrics_host = "127.0.0.1";
  o.metrics_port = 0;
  auto server = AttnServer::Create(o, MakeCpuBackend(1));
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  httplib::Client metrics("127.0.0.1", (*server)->metrics_port());
  httplib::Result scrape = metrics.Get("/metrics");
  ASSERT_TRUE(scrape);
  const std::string& text = scrape->body;
  const double grpc = Gauge(text, "attnserve_grpc_buffered_bytes_limit");
  const double streams = Gauge(text, "attnserve_http_buffered_bytes_limit");
  const double outside = Gauge(text, "attnserve_ucx_buffered_bytes_limit");
  EXPECT_GT(grpc, 0) << text;
  EXPECT_GT(streams, 0) << text;
  EXPECT_GT(outside, 0) << text;
  EXPECT_EQ(grpc + streams + outside, double(budget)) << text;
  EXPECT_EQ(Gauge(text, "attnserve_ucx_buffered_bytes"), 0) << text;
  (*server)->Shutdown(absl::ZeroDuration());
}

}  // namespace
}  // namespace attnserve
