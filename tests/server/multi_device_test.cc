// Several backends in one server (one per GPU in production): the pool sends
// each request to the least-loaded executor, every response names the device
// that ran it, and results stay correct. CPU backends stand in for GPUs here;
// scripts/device/gpu-serving.sh runs the same over two real GPUs.
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "backend/backend_factory.h"
#include "client/attention_client.h"
#include "client/inputs.h"
#include "client/verify.h"
#include "gtest/gtest.h"
#include "server/executor_pool.h"
#include "server/server.h"

namespace attnserve {
namespace {

// A CPU backend that describes itself as device `index` and can hold its
// launches until the test opens a gate.
class LabelledBackend : public AttentionBackend {
 public:
  explicit LabelledBackend(int index) : inner_(MakeCpuBackend(1)) {
    description_ = inner_->Describe();
    DeviceDescription d;
    d.index = index;
    d.name = absl::StrCat("stand-in ", index);
    description_.devices = {d};
  }
  const BackendDescription& Describe() const override { return description_; }
  // Items without tensors (the pool test's) are accepted and not computed.
  absl::StatusOr<Plan> CanImplement(const AttnParams& p) const override {
    return p.q == nullptr ? absl::StatusOr<Plan>(Plan()) : inner_->CanImplement(p);
  }
  absl::Status Forward(const Plan& plan, const AttnParams& p, BackendTimings* t) override {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&open_));
    }
    return p.q == nullptr ? absl::OkStatus() : inner_->Forward(plan, p, t);
  }
  void SetOpen(bool open) {
    absl::MutexLock lock(&mu_);
    open_ = open;
  }

 private:
  std::unique_ptr<AttentionBackend> inner_;
  BackendDescription description_;
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
};

// Submits tagged items without tensors and records which device ran each.
class DeviceLog {
 public:
  WorkItem Item(int tag, int64_t tokens) {
    WorkItem w;
    w.params.batch = tag;
    w.params.total_q = tokens;
    w.done = [this, tag](const absl::Status& st, const WorkTimings& t) {
      EXPECT_TRUE(st.ok()) << st;
      absl::MutexLock lock(&mu_);
      device_of_[tag] = t.device;
    };
    return w;
  }
  std::map<int, int> device_of() {
    absl::MutexLock lock(&mu_);
    return device_of_;
  }

 private:
  absl::Mutex mu_;
  std::map<int, int> device_of_ ABSL_GUARDED_BY(mu_);
};

TEST(ExecutorPoolTest, FillsOneDeviceUpToALaunchBeforeTheNext) {
  LabelledBackend gpu0(0), gpu1(1);
  ExecutorOptions options;
  options.batching = true;
  options.batch_max_tokens = 100;
  ExecutorPool pool({&gpu0, &gpu1}, options);
  DeviceLog log;
  gpu0.SetOpen(false);
  gpu1.SetOpen(false);
  // Ten requests of 10 tokens make one launch's worth on device 0; the
  // eleventh finds it full and goes to device 1.
  for (int i = 0; i < 11; ++i) ASSERT_TRUE(pool.Submit(log.Item(i, 10)).ok());
  gpu0.SetOpen(true);
  gpu1.SetOpen(true);
  ASSERT_TRUE(pool.WaitIdle(absl::Seconds(10)));
  std::map<int, int> device_of = log.device_of();
  ASSERT_EQ(device_of.size(), 11u);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(device_of[i], 0) << i;
  EXPECT_EQ(device_of[10], 1);
}

TEST(ExecutorPoolTest, AFullQueuePassesRequestsToTheOtherDevice) {
  LabelledBackend gpu0(0), gpu1(1);
  ExecutorOptions options;
  options.batching = true;
  options.max_queue_size = 2;
  ExecutorPool pool({&gpu0, &gpu1}, options);
  DeviceLog log;
  gpu0.SetOpen(false);
  gpu1.SetOpen(false);
  auto await_picked = [&](int device) {
    for (int i = 0; i < 5000 && pool.executor(device).queued() > 0; ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
  };
  // Device 0: one running (held) and two queued; then its queue is full.
  ASSERT_TRUE(pool.Submit(log.Item(0, 10)).ok());
  await_picked(0);
  ASSERT_TRUE(pool.Submit(log.Item(1, 10)).ok());
  ASSERT_TRUE(pool.Submit(log.Item(2, 10)).ok());
  ASSERT_TRUE(pool.Submit(log.Item(3, 10)).ok());  // device 0 full: device 1
  await_picked(1);
  ASSERT_TRUE(pool.Submit(log.Item(4, 10)).ok());
  ASSERT_TRUE(pool.Submit(log.Item(5, 10)).ok());
  // Every queue full: refused.
  EXPECT_EQ(pool.Submit(log.Item(6, 10)).code(), absl::StatusCode::kResourceExhausted);
  gpu0.SetOpen(true);
  gpu1.SetOpen(true);
  ASSERT_TRUE(pool.WaitIdle(absl::Seconds(10)));
  std::map<int, int> device_of = log.device_of();
  ASSERT_EQ(device_of.size(), 6u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(device_of[i], 0) << i;
  for (int i = 3; i < 6; ++i) EXPECT_EQ(device_of[i], 1) << i;
}

TEST(ExecutorPoolTest, WithoutBatchingBalancesTokens) {
  LabelledBackend gpu0(0), gpu1(1);
  ExecutorPool pool({&gpu0, &gpu1}, ExecutorOptions{});  // batching off
  DeviceLog log;
  gpu0.SetOpen(false);
  gpu1.SetOpen(false);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(pool.Submit(log.Item(i, 10)).ok());
  gpu0.SetOpen(true);
  gpu1.SetOpen(true);
  ASSERT_TRUE(pool.WaitIdle(absl::Seconds(10)));
  std::map<int, int> device_of = log.device_of();
  ASSERT_EQ(device_of.size(), 6u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(device_of[i], i % 2) << i;
}

TEST(ExecutorPoolTest, SendsWorkToTheLeastLoadedDevice) {
  LabelledBackend gpu3(3), gpu7(7);
  ExecutorOptions options;
  options.batching = true;
  options.batch_max_tokens = 100;
  ExecutorPool pool({&gpu3, &gpu7}, options);
  ASSERT_EQ(pool.size(), 2);
  absl::Mutex mu;
  std::vector<std::pair<int, int>> done;  // (tag, device)
  auto item = [&](int tag, int64_t tokens) {
    WorkItem w;
    w.params.batch = tag;
    w.params.total_q = tokens;
    w.done = [&, tag](const absl::Status& st, const WorkTimings& t) {
      EXPECT_TRUE(st.ok()) << st;
      absl::MutexLock lock(&mu);
      done.push_back({tag, t.device});
    };
    return w;
  };
  gpu3.SetOpen(false);
  gpu7.SetOpen(false);
  // One long request occupies a device; the short ones that follow all go to
  // the other, whose outstanding tokens stay below the long one's.
  ASSERT_TRUE(pool.Submit(item(0, 1000)).ok());
  for (int i = 1; i <= 4; ++i) ASSERT_TRUE(pool.Submit(item(i, 10)).ok());
  gpu3.SetOpen(true);
  gpu7.SetOpen(true);
  ASSERT_TRUE(pool.WaitIdle(absl::Seconds(10)));
  absl::MutexLock lock(&mu);
  ASSERT_EQ(done.size(), 5u);
  int long_device = -1;
  for (auto [tag, device] : done) {
    if (tag == 0) long_device = device;
  }
  ASSERT_TRUE(long_device == 3 || long_device == 7) << long_device;
  for (auto [tag, device] : done) {
    if (tag != 0) {
      EXPECT_NE(device, long_device) << "request " << tag;
    }
  }
}

TEST(MultiDeviceServerTest, SpreadsRequestsAndStaysCorrect) {
  std::vector<std::unique_ptr<AttentionBackend>> backends;
  backends.push_back(std::make_unique<LabelledBackend>(0));
  backends.push_back(std::make_unique<LabelledBackend>(1));
  LabelledBackend* gpu0 = static_cast<LabelledBackend*>(backends[0].get());
  LabelledBackend* gpu1 = static_cast<LabelledBackend*>(backends[1].get());
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  // A launch's worth is a couple of these requests (24..54 rows each), so
  // with both devices held the queue spills over to the second.
  options.batch_max_tokens = 64;
  absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Create(options, std::move(backends));
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  auto client = AttentionClient::Create(absl::StrCat("127.0.0.1:", (*server)->port()));
  ASSERT_TRUE(client.ok()) << client.status();

  absl::StatusOr<v1::GetServerInfoResponse> info = (*client)->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->devices_size(), 2);
  EXPECT_EQ(info->devices(0).index(), 0);
  EXPECT_EQ(info->devices(1).index(), 1);

  constexpr int kRequests = 16;
  std::vector<AttentionInputs> inputs;
  for (int i = 0; i < kRequests; ++i) {
    AttentionShape s;
    s.dtype = DType::kFP16;
    s.heads_q = 4;
    s.heads_kv = 2;
    s.head_dim = 32;
    s.batch = 1;
    s.seqlen_q = 8 + i;
    s.seqlen_k = 16 + i;
    absl::StatusOr<AttentionInputs> in = MakeRandomInputs(s, 500 + i);
    ASSERT_TRUE(in.ok());
    inputs.push_back(*std::move(in));
  }
  absl::Mutex mu;
  int finished = 0;
  std::vector<absl::StatusOr<v1::ForwardResponse>> responses(kRequests, absl::UnknownError("none"));
  gpu0->SetOpen(false);
  gpu1->SetOpen(false);
  for (int i = 0; i < kRequests; ++i) {
    (*client)->ForwardAsync(MakeForwardRequest(inputs[i]), CallOptions(),
                            [&, i](absl::StatusOr<v1::ForwardResponse> r) {
                              absl::MutexLock lock(&mu);
                              responses[i] = std::move(r);
                              ++finished;
                            });
  }
  // Everything admitted (at most one launch per device has started) before
  // the devices run, so the spread does not depend on timing.
  for (int i = 0; i < 5000 && (*server)->queued_requests() < kRequests - 2; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  gpu0->SetOpen(true);
  gpu1->SetOpen(true);
  {
    absl::MutexLock lock(&mu);
    auto all = [&]() { return finished == kRequests; };
    mu.Await(absl::Condition(&all));
  }
  std::set<int> devices;
  for (int i = 0; i < kRequests; ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(responses[i].ok()) << responses[i].status();
    devices.insert(responses[i]->timing().device());
    absl::StatusOr<ForwardResult> result = ForwardResultFromProto(*std::move(responses[i]));
    ASSERT_TRUE(result.ok()) << result.status();
    absl::StatusOr<VerifyReport> report = VerifyForward(inputs[i], *result);
    ASSERT_TRUE(report.ok() && report->passed) << (report.ok() ? report->failure : "");
  }
  EXPECT_EQ(devices, std::set<int>({0, 1}));
  (*server)->Shutdown(absl::Seconds(5));
}

TEST(DeviceListTest, ParsesAllAndIndicesAndNamesTheFlagOnErrors) {
  EXPECT_TRUE(ParseDeviceList("all")->empty());
  EXPECT_EQ(*ParseDeviceList("1"), std::vector<int>({1}));
  EXPECT_EQ(*ParseDeviceList("0, 2"), std::vector<int>({0, 2}));
  for (const char* bad : {"", "x", "0,", "-1", "0,0", "1.5"}) {
    absl::StatusOr<std::vector<int>> r = ParseDeviceList(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("--devices"), std::string::npos) << r.status();
  }
}

TEST(DeviceListTest, CpuBackendIsOneWhateverTheList) {
  BackendOptions o;
  o.kind = "cpu";
  o.cpu_threads = 1;
  o.devices = "0,1";
  auto b = MakeBackends(o);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->size(), 1u);
  o.devices = "zero";
  EXPECT_EQ(MakeBackends(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve
