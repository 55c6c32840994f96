// The two-server fixture of the --handoff_peer tests: two CPU servers on
// 127.0.0.1, each the other's peer, raw KvCache stubs to each, and the steps
// and checks those tests share (kv_step_test_util.h).
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "attnserve/v1/kv_transfer.grpc.pb.h"
#include "backend/backend_factory.h"
#include "common/cache_id_header.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/server/kv_step_test_util.h"

namespace attnserve {

// A port nothing listens on now (each server must know the other's before
// either starts).
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

inline std::string Address(int port) { return absl::StrCat("127.0.0.1:", port); }

class KvHandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    port_[0] = FreePort();
    port_[1] = FreePort();
    for (int i = 0; i < 2; ++i) Start(i);
  }
  void TearDown() override {
    for (auto& s : server_) {
      if (s != nullptr) s->Shutdown(absl::Seconds(5));
    }
  }

  // Server i (0: A, 1: B) on its port, the other as its peer.
  void Start(int i) {
    ServerOptions o;
    o.host = "127.0.0.1";
    o.port = port_[i];
    o.kv_cache_bytes = int64_t{64} << 20;
    o.kv_page_size = kPage;
    o.handoff.peer = Address(port_[1 - i]);
    o.handoff.linger = absl::Seconds(5);
    o.metrics_enabled = metrics_;
    o.metrics_host = "127.0.0.1";
    o.metrics_port = 0;
    if (tune_) tune_(i, &o);
    auto server = AttnServer::Create(o, MakeCpuBackend(2));
    ASSERT_TRUE(server.ok()) << server.status();
    server_[i] = *std::move(server);
    ASSERT_TRUE(server_[i]->Start().ok());
    stub_[i] = v1::KvCache::NewStub(
        grpc::CreateChannel(Address(port_[i]), grpc::InsecureChannelCredentials()));
  }

  void CreateCache(int i, const std::string& id, const std::vector<uint64_t>& sequences) {
    grpc::ClientContext ctx;
    v1::CreateCacheRequest r;
    r.mutable_geometry()->set_num_layers(1);
    r.mutable_geometry()->set_num_heads_kv(kHkv);
    r.mutable_geometry()->set_head_dim(kD);
    r.mutable_geometry()->set_dtype(v1::FP32);
    r.set_capacity_tokens(4096);
    r.set_cache_id(id);
    v1::CreateCacheResponse resp;
    ASSERT_TRUE(stub_[i]->CreateCache(&ctx, r, &resp).ok());
    grpc::ClientContext seq_ctx;
    v1::CreateSequencesRequest s;
    s.set_cache_id(id);
    for (uint64_t sid : sequences) s.add_sequences()->set_sequence_id(sid);
    v1::CreateSequencesResponse s_resp;
    ASSERT_TRUE(stub_[i]->CreateSequences(&seq_ctx, s, &s_resp).ok());
  }

  // A part appending `n` tokens with `nq` queries; `ctx` gains the tokens.
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

  // AppendAttend on server i; `moved_to` gets the trailing metadata.
  grpc::Status Call(int i, const v1::AppendAttendRequest& r, v1::AppendAttendResponse* resp,
                    std::string* moved_to = nullptr) {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kCacheIdHeader, r.cache_id());
    const grpc::Status status = stub_[i]->AppendAttend(&ctx, r, resp);
    if (moved_to != nullptr) {
      const auto& trailers = ctx.GetServerTrailingMetadata();
      auto it = trailers.find(kMovedToHeader);
      *moved_to = it == trailers.end() ? "" : std::string(it->second.data(), it->second.size());
    }
    return status;
  }

  // Whether server i holds `cache`, asked through KvTransfer (not gated: a
  // KvCache call would fetch the cache from the peer).
  bool Holds(int i, const std::string& cache) {
    auto transfer = v1::KvTransfer::NewStub(
        grpc::CreateChannel(Address(port_[i]), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::ExportSequencesRequest r;
    r.set_cache_id(cache);
    auto reader = transfer->ExportSequences(&ctx, r);
    v1::KvChunk chunk;
    while (reader->Read(&chunk)) {
    }
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok() || status.error_code() == grpc::StatusCode::NOT_FOUND)
        << status.error_message();
    return status.ok();
  }

  grpc::Status Stats(int i, const std::string& cache, v1::GetCacheStatsResponse* resp) {
    grpc::ClientContext ctx;
    v1::GetCacheStatsRequest r;
    r.set_cache_id(cache);
    return stub_[i]->GetCacheStats(&ctx, r, resp);
  }

  // Drains server i on a thread; joined by Joined().
  void DrainInBackground(int i) {
    drain_ = std::thread([this, i] { server_[i]->Shutdown(absl::Seconds(20)); });
  }
  // Waits (for evidence: a moved-to answer) until server i has moved `cache`.
  void WaitMoved(int i, const std::string& cache) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      v1::GetCacheStatsResponse resp;
      if (Stats(i, cache, &resp).error_code() == grpc::StatusCode::UNAVAILABLE) return;
      absl::SleepFor(absl::Milliseconds(2));
    }
    FAIL() << "server " << i << " never answered moved-to for " << cache;
  }
  void Joined() {
    if (drain_.joinable()) drain_.join();
  }

  bool metrics_ = false;  // serve /metrics (set before SetUp)
  // Changes server i's options before it starts (set before SetUp).
  std::function<void(int i, ServerOptions* options)> tune_;
  int port_[2] = {0, 0};
  std::unique_ptr<AttnServer> server_[2];
  std::unique_ptr<v1::KvCache::Stub> stub_[2];
  std::thread drain_;
  std::mt19937 rng_{7};
};

}  // namespace attnserve
