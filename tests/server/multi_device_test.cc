// Several backends in one server (one per GPU in production): the pool sends
// each request to the executor with the least queued work, every response names the device
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
  // Items without tensors (the pool tests') are accepted and not computed.
  absl::StatusOr<Plan> CanImplement(const AttnParams& p) const override {
    return p.q == nullptr ? absl::StatusOr<Plan>(Plan()) : inner_->CanImplement(p);
  }
  absl::Status Forward(const Plan& plan, const AttnParams& p, BackendTimings* t) override {
    Enter();
    return inner_->Forward(plan, p, t);
  }
  // Launches of items without tensors are held at the gate and not packed.
  absl::StatusOr<std::unique_ptr<PendingLaunch>> StartForward(const Plan& plan,
                                                              const PackedBatch& batch) override {
    if (batch.members().front()->q != nullptr) return AttentionBackend::StartForward(plan, batch);
    Enter();
    return std::unique_ptr<PendingLaunch>(new Done());
  }
  void SetOpen(bool open) {
    absl::MutexLock lock(&mu_);
    open_ = open;
  }
  // Waits until `n` launches have reached the gate.
  void AwaitEntered(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return entered_ >= n; };
    mu_.Await(absl::Condition(&reached));
  }

 private:
  class Done : public PendingLaunch {
   public:
    absl::Status Finish(BackendTimings*) override { return absl::OkStatus(); }
  };
  void Enter() {
    absl::MutexLock lock(&mu_);
    ++entered_;
    mu_.Await(absl::Condition(&open_));
  }

  std::unique_ptr<AttentionBackend> inner_;
  BackendDescription description_;
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  int entered_ ABSL_GUARDED_BY(mu_) = 0;
};

// Tensor-free items of two sizes, costed as the real calls would be: a small
// prefill (1 x 256 x 256, Hq = Hkv = 16, D 128, BF16: the serving notes'
// "small" request) and a decode step (one query and one new row, Hq 32,
// Hkv 8, D 128: a K/V step's size).
struct ItemShape {
  int32_t heads_q, heads_kv, head_dim, seqlen_q, seqlen_k;
};
constexpr ItemShape kSmall{16, 16, 128, 256, 256};
constexpr ItemShape kStep{32, 8, 128, 1, 1};

// Submits tagged items without tensors and records which device ran each and
// how many requests shared its launch.
class DeviceLog {
 public:
  WorkItem Item(int tag, const ItemShape& shape) {
    WorkItem w;
    w.params.dtype = DType::kBF16;
    w.params.batch = 1;
    w.params.num_heads_q = shape.heads_q;
    w.params.num_heads_kv = shape.heads_kv;
    w.params.head_dim = shape.head_dim;
    w.params.seqlen_q = shape.seqlen_q;
    w.params.seqlen_k = shape.seqlen_k;
    w.params.total_q = shape.seqlen_q;
    w.params.total_k = shape.seqlen_k;
    w.done = [this, tag](const absl::Status& st, const WorkTimings& t) {
      EXPECT_TRUE(st.ok()) << st;
      absl::MutexLock lock(&mu_);
      device_of_[tag] = t.device;
      batch_of_[tag] = t.batch_size;
    };
    return w;
  }
  std::map<int, int> device_of() {
    absl::MutexLock lock(&mu_);
    return device_of_;
  }
  std::map<int, int> batch_of() {
    absl::MutexLock lock(&mu_);
    return batch_of_;
  }
  // Requests each device ran.
  std::map<int, int> per_device() {
    absl::MutexLock lock(&mu_);
    std::map<int, int> count;
    for (auto [tag, device] : device_of_) ++count[device];
    return count;
  }

 private:
  absl::Mutex mu_;
  std::map<int, int> device_of_ ABSL_GUARDED_BY(mu_);
  std::map<int, int> batch_of_ ABSL_GUARDED_BY(mu_);
};

// Devices that cannot keep up (held at their gates) while requests keep
// coming: each gets between 40% and 60% of them. The old rule (full launches
// outstanding, ties to device 0) sent all 64 small requests to device 0,
// since they add up to less than one launch's token budget.
TEST(ExecutorPoolTest, SaturatingLoadSplitsBetweenDevices) {
  for (const auto& [shape, count] : {std::pair{kSmall, 64}, std::pair{kStep, 512}}) {
    SCOPED_TRACE(count);
    LabelledBackend gpu0(0), gpu1(1);
    ExecutorOptions options;
    options.batching = true;  // the server's default batch budget and delay
    options.max_queue_size = 1024;
    ExecutorPool pool({&gpu0, &gpu1}, options);
    DeviceLog log;
    gpu0.SetOpen(false);
    gpu1.SetOpen(false);
    for (int i = 0; i < count; ++i) ASSERT_TRUE(pool.Submit(log.Item(i, shape)).ok());
    gpu0.SetOpen(true);
    gpu1.SetOpen(true);
    ASSERT_TRUE(pool.WaitIdle(absl::Seconds(30)));
    std::map<int, int> per_device = log.per_device();
    ASSERT_EQ(per_device[0] + per_device[1], count);
    for (int d : {0, 1}) {
      EXPECT_GE(per_device[d], count * 40 / 100) << "device " << d;
      EXPECT_LE(per_device[d], count * 60 / 100) << "device " << d;
    }
  }
}

// Low load: each device is busy with one step, and a burst of steps arrives
// together. They join one device's forming batch and run as one launch, not
// half a batch on each device (bench/NOTES-serving.md, "Multi-GPU").
TEST(ExecutorPoolTest, AtLowLoadABurstOfStepsBatchesOnOneDevice) {
  LabelledBackend gpu0(0), gpu1(1);
  ExecutorOptions options;
  options.batching = true;
  ExecutorPool pool({&gpu0, &gpu1}, options);
  DeviceLog log;
  gpu0.SetOpen(false);
  gpu1.SetOpen(false);
  ASSERT_TRUE(pool.Submit(log.Item(100, kStep)).ok());
  gpu0.AwaitEntered(1);
  ASSERT_TRUE(pool.Submit(log.Item(101, kStep)).ok());  // the idle device takes it
  gpu1.AwaitEntered(1);
  constexpr int kBurst = 8;
  for (int i = 0; i < kBurst; ++i) ASSERT_TRUE(pool.Submit(log.Item(i, kStep)).ok());
  gpu0.SetOpen(true);
  gpu1.SetOpen(true);
  ASSERT_TRUE(pool.WaitIdle(absl::Seconds(10)));
  std::map<int, int> device_of = log.device_of();
  std::map<int, int> batch_of = log.batch_of();
  EXPECT_NE(device_of[100], device_of[101]);
  for (int i = 0; i < kBurst; ++i) {
    EXPECT_EQ(device_of[i], device_of[0]) << i;
    EXPECT_EQ(batch_of[i], kBurst) << i;
  }
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
  // A large request holds device 0, so the small ones prefer device 1 ...
  ASSERT_TRUE(pool.Submit(log.Item(0, ItemShape{16, 16, 128, 4096, 4096})).ok());
  gpu0.AwaitEntered(1);
  ASSERT_TRUE(pool.Submit(log.Item(1, kSmall)).ok());
  gpu1.AwaitEntered(1);
  ASSERT_TRUE(pool.Submit(log.Item(2, kSmall)).ok());
  ASSERT_TRUE(pool.Submit(log.Item(3, kSmall)).ok());
  // ... until its queue is full: then device 0 takes them.
  ASSERT_TRUE(pool.Submit(log.Item(4, kSmall)).ok());
  ASSERT_TRUE(pool.Submit(log.Item(5, kSmall)).ok());
  // Every queue full: refused.
  EXPECT_EQ(pool.Submit(log.Item(6, kSmall)).code(), absl::StatusCode::kResourceExhausted);
  gpu0.SetOpen(true);
  gpu1.SetOpen(true);
  ASSERT_TRUE(pool.WaitIdle(absl::Seconds(10)));
  std::map<int, int> device_of = log.device_of();
  ASSERT_EQ(device_of.size(), 6u);
  for (int i : {0, 4, 5}) EXPECT_EQ(device_of[i], 0) << i;
  for (int i : {1, 2, 3}) EXPECT_EQ(device_of[i], 1) << i;
}

TEST(ExecutorPoolTest, WithoutBatchingEqualRequestsAlternate) {
  LabelledBackend gpu0(0), gpu1(1);
  ExecutorPool pool({&gpu0, &gpu1}, ExecutorOptions{});  // batching off
  DeviceLog log;
  gpu0.SetOpen(false);
  gpu1.SetOpen(false);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(pool.Submit(log.Item(i, kStep)).ok());
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
  ExecutorPool pool({&gpu3, &gpu7}, options);
  ASSERT_EQ(pool.size(), 2);
  DeviceLog log;
  gpu3.SetOpen(false);
  gpu7.SetOpen(false);
  // One long request occupies a device; the short ones that follow all go to
  // the other, whose queued work stays below the long one's.
  ASSERT_TRUE(pool.Submit(log.Item(0, ItemShape{16, 16, 128, 4096, 4096})).ok());
  for (int i = 1; i <= 4; ++i) ASSERT_TRUE(pool.Submit(log.Item(i, kSmall)).ok());
  gpu3.SetOpen(true);
  gpu7.SetOpen(true);
  ASSERT_TRUE(pool.WaitIdle(absl::Seconds(10)));
  std::map<int, int> device_of = log.device_of();
  ASSERT_EQ(device_of.size(), 5u);
  const int long_device = device_of[0];
  ASSERT_TRUE(long_device == 3 || long_device == 7) << long_device;
  for (int i = 1; i <= 4; ++i) EXPECT_NE(device_of[i], long_device) << "request " << i;
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
