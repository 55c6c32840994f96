// --handoff_peer over UCX: a drained server pushes its caches' pages to the
// peer over UCX when the peer's import offers it (the peer runs with a UCX
// port), else in the gRPC stream; --handoff_transport ucx refuses the
// fallback and grpc never asks. Two CPU servers on 127.0.0.1 (UCX_TLS picks
// tcp or shared memory), each the other's peer; what carried the pages is
// read from both servers' log lines. After the move every sequence is live
// on the peer with its id and length, and the next step's O and LSE are held
// to the float64 reference over the whole history.
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "server/buffered_shares.h"
#include "server/ucx/kv_bulk.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/server/kv_handoff_fixture.h"

namespace attnserve {
namespace {

class UcxHandoffTest : public KvHandoffTest {
 protected:
  // transport[i]: server i's --handoff_transport; ucx[i]: whether it
  // listens for UCX (its imports offer it).
  void Configure(const std::string& transport0, bool ucx0, bool ucx1) {
    tune_ = [=](int i, ServerOptions* o) {
      if (i == 0) o->handoff.transport = transport0;
      if (i == 0) o->max_buffered_bytes = budget0_;
      if (i == 0 ? ucx0 : ucx1) o->ucx_port = -1;
    };
    sink_ = std::make_shared<spdlog::sinks::ostream_sink_mt>(log_);
    spdlog::default_logger()->sinks().push_back(sink_);
    KvHandoffTest::SetUp();
  }
  void SetUp() override {}
  void TearDown() override {
    Joined();
    KvHandoffTest::TearDown();
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  std::string Log() {
    spdlog::default_logger()->flush();
    return log_.str();
  }

  // Two sequences on server 0, one checked step each: `c1`, `c2` hold them.
  void Fill(Context* c1, Context* c2) {
    CreateCache(0, "moving", {1, 2});
    std::vector<Part> parts = {Step(1, c1, 300, 4), Step(2, c2, 517, 3)};
    v1::AppendAttendResponse resp;
    ASSERT_TRUE(Call(0, MakeCall("moving", parts), &resp).ok());
    CheckResponse(resp, parts, {c1, c2}, Mods());
  }

  // Server 1 holds both sequences with their lengths, and a step there
  // matches the reference.
  void CheckOnPeer(Context* c1, Context* c2) {
    v1::GetCacheStatsResponse stats;
    ASSERT_TRUE(Stats(1, "moving", &stats).ok());
    EXPECT_EQ(stats.stats().sequences(), 2);
    EXPECT_EQ(stats.stats().tokens(), c1->length() + c2->length());
    std::vector<Part> parts = {Step(1, c1, 1, 1), Step(2, c2, 1, 1)};
    v1::AppendAttendResponse resp;
    ASSERT_TRUE(Call(1, MakeCall("moving", parts), &resp).ok());
    CheckResponse(resp, parts, {c1, c2}, Mods());
  }

  int64_t budget0_ = 0;  // server 0's --max_buffered_bytes (0: the default)
  std::ostringstream log_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

TEST_F(UcxHandoffTest, DrainPushesOverUcxWhenThePeerOffersIt) {
  Configure("auto", /*ucx0=*/false, /*ucx1=*/true);
  Context c1, c2;
  Fill(&c1, &c2);
  DrainInBackground(0);
  WaitMoved(0, "moving");
  Joined();
  const std::string log = Log();
  EXPECT_NE(log.find("takes its chunks over UCX"), std::string::npos) << log;
  EXPECT_NE(log.find("moved to " + Address(port_[1]) + " over ucx: 2 sequences"), std::string::npos)
      << log;
  CheckOnPeer(&c1, &c2);
}

TEST_F(UcxHandoffTest, FallsBackToGrpcWhenThePeerHasNoUcx) {
  Configure("auto", /*ucx0=*/true, /*ucx1=*/false);
  Context c1, c2;
  Fill(&c1, &c2);
  DrainInBackground(0);
  WaitMoved(0, "moving");
  Joined();
  const std::string log = Log();
  EXPECT_NE(log.find("takes its chunks in the gRPC stream: the receiver offers no UCX"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("moved to " + Address(port_[1]) + " over grpc: 2 sequences"),
            std::string::npos)
      << log;
  CheckOnPeer(&c1, &c2);
}

TEST_F(UcxHandoffTest, GrpcTransportNeverAsksForUcx) {
  Configure("grpc", /*ucx0=*/true, /*ucx1=*/true);
  Context c1, c2;
  Fill(&c1, &c2);
  DrainInBackground(0);
  WaitMoved(0, "moving");
  Joined();
  const std::string log = Log();
  EXPECT_EQ(log.find("takes its chunks over UCX"), std::string::npos) << log;
  EXPECT_NE(log.find("over grpc: 2 sequences"), std::string::npos) << log;
  CheckOnPeer(&c1, &c2);
}

// ucx refuses the fallback: the push fails before any page is sent, the
// cache stays on the draining server (and goes with it).
TEST_F(UcxHandoffTest, UcxTransportWithoutPeerUcxMovesNothing) {
  Configure("ucx", /*ucx0=*/true, /*ucx1=*/false);
  Context c1, c2;
  Fill(&c1, &c2);
  server_[0]->Shutdown(absl::Seconds(20));
  const std::string log = Log();
  EXPECT_NE(
      log.find("handoff_transport: ucx, but the peer " + Address(port_[1]) + " offers no UCX"),
      std::string::npos)
      << log;
  EXPECT_FALSE(Holds(1, "moving"));
}

// The peer names a UCX port but its import refuses UCX (here: its receiver's
// thread does not start): with ucx the push fails, and the cache the import
// created on the peer goes with it (R1-F5: it was left there, empty).
TEST_F(UcxHandoffTest, APeerThatRefusesUcxKeepsNoCacheOfAFailedPush) {
  Configure("ucx", /*ucx0=*/true, /*ucx1=*/true);
  Context c1, c2;
  Fill(&c1, &c2);
  ucx::fail_thread_start_for_test = 1;  // the peer's receiver, the first data-plane thread
  server_[0]->Shutdown(absl::Seconds(20));
  ucx::fail_thread_start_for_test = 0;
  const std::string log = Log();
  EXPECT_NE(log.find("takes its chunks in the gRPC stream: the UCX data plane did not start"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("data_plane: \"ucx\" required, not offered"), std::string::npos) << log;
  EXPECT_FALSE(Holds(1, "moving"));
  v1::GetCacheStatsResponse stats;
  EXPECT_EQ(Stats(1, "moving", &stats).error_code(), grpc::StatusCode::NOT_FOUND);
}

// A push's send window (8 chunks of at least one page each) is charged to
// the server's budget for bytes outside gRPC and the streams (a quarter of
// --max_buffered_bytes, server/buffered_shares.h): one that can never fit is
// refused, and the cache stays.
TEST_F(UcxHandoffTest, APushWhoseWindowCannotFitTheBudgetIsRefused) {
  // 24 KiB for the window; 8 pages of this cache's layer are 32 KiB.
  budget0_ = 96 << 10;
  ASSERT_EQ(SplitBufferedBytes(budget0_).outside, 24 << 10);
  Configure("auto", /*ucx0=*/true, /*ucx1=*/true);
  Context c1;
  CreateCache(0, "moving", {1});
  std::vector<Part> parts = {Step(1, &c1, 40, 1)};
  v1::AppendAttendResponse resp;
  ASSERT_TRUE(Call(0, MakeCall("moving", parts), &resp).ok());
  server_[0]->Shutdown(absl::Seconds(20));
  const std::string log = Log();
  EXPECT_NE(log.find("max_buffered_bytes: a push's window of 32768 bytes does not fit"),
            std::string::npos)
      << log;
  EXPECT_FALSE(Holds(1, "moving"));
}

}  // namespace
}  // namespace attnserve
