// NvmlMonitor without a GPU: a library that is missing or is not NVML gives
// UNAVAILABLE; against fake_nvml.cc (a stand-in libnvidia-ml with canned
// readings for two bus ids) devices are found by bus id, not by index, the
// readings come through, and init/shutdown balance.
#include "server/gpu_monitor.h"

#include <dlfcn.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::DoubleEq;
using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;
// fake_nvml.cc's two GPUs.
constexpr char kBusA[] = "0000:1b:00.0";  // 3 GiB + 12345 used, 37 %
constexpr char kBusB[] = "0000:3d:00.0";  // 1 GiB used, 100 %

DeviceDescription Gpu(int index, std::string bus_id) {
  DeviceDescription d;
  d.index = index;
  d.name = "Fake GPU";
  d.total_memory_bytes = 80 * kGiB;
  d.pci_bus_id = std::move(bus_id);
  return d;
}

// The fake's hooks. dlopen of the same path returns the instance NvmlMonitor
// loads, so the hooks steer what the monitor sees.
class FakeNvml : public ::testing::Test {
 protected:
  void SetUp() override {
    lib_ = dlopen(FAKE_NVML_PATH, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(lib_, nullptr) << dlerror();
    active_inits_ = reinterpret_cast<int (*)()>(dlsym(lib_, "fake_nvml_active_inits"));
    set_init_result_ = reinterpret_cast<void (*)(int)>(dlsym(lib_, "fake_nvml_set_init_result"));
    set_lost_device_ = reinterpret_cast<void (*)(int)>(dlsym(lib_, "fake_nvml_set_lost_device"));
    set_no_utilization_ =
        reinterpret_cast<void (*)(int)>(dlsym(lib_, "fake_nvml_set_no_utilization"));
    ASSERT_TRUE(active_inits_ && set_init_result_ && set_lost_device_ && set_no_utilization_);
    set_init_result_(0);
    set_lost_device_(-1);
    set_no_utilization_(-1);
    ASSERT_EQ(active_inits_(), 0);
  }
  void TearDown() override {
    if (active_inits_ != nullptr) {
      EXPECT_EQ(active_inits_(), 0) << "nvmlInit_v2 without nvmlShutdown";
    }
  }

  absl::StatusOr<std::unique_ptr<NvmlMonitor>> Create(
      const std::vector<DeviceDescription>& devices) {
    return NvmlMonitor::Create(devices, FAKE_NVML_PATH);
  }

  void* lib_ = nullptr;
  int (*active_inits_)() = nullptr;
  void (*set_init_result_)(int) = nullptr;
  void (*set_lost_device_)(int) = nullptr;
  void (*set_no_utilization_)(int) = nullptr;
};

TEST(NvmlMonitorTest, MissingLibraryIsUnavailable) {
  auto m = NvmlMonitor::Create({Gpu(0, kBusA)}, "libattnserve-no-such-nvml.so.1");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(m.status().message(), HasSubstr("libattnserve-no-such-nvml.so.1"));
}

TEST(NvmlMonitorTest, DefaultLibraryIsTheDriversSoname) {
  EXPECT_STREQ(NvmlMonitor::kDefaultLibrary, "libnvidia-ml.so.1");
}

TEST(NvmlMonitorTest, LibraryWithoutNvmlIsUnavailable) {
  auto m = NvmlMonitor::Create({Gpu(0, kBusA)}, "libm.so.6");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(m.status().message(), HasSubstr("nvmlInit_v2"));
}

TEST_F(FakeNvml, NoDevicesIsInvalid) {
  auto m = Create({});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(FakeNvml, ReadsEachDeviceByBusIdUnderItsCudaIndex) {
  // CUDA's order differs from the fake's (as under CUDA_VISIBLE_DEVICES=1,0):
  // CUDA device 0 is the fake's second GPU.
  auto m = Create({Gpu(0, kBusB), Gpu(1, kBusA)});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(active_inits_(), 1);
  const std::vector<DeviceUsage> usage = (*m)->Read();
  ASSERT_EQ(usage.size(), 2u);
  EXPECT_EQ(usage[0].index, 0);
  EXPECT_EQ(usage[0].memory_used_bytes, 1 * kGiB);
  EXPECT_THAT(usage[0].utilization, DoubleEq(1.0));
  EXPECT_EQ(usage[1].index, 1);
  EXPECT_EQ(usage[1].memory_used_bytes, 3 * kGiB + 12345);
  EXPECT_THAT(usage[1].utilization, DoubleEq(0.37));
  m->reset();
  EXPECT_EQ(active_inits_(), 0);
}

TEST_F(FakeNvml, UnknownBusIdIsUnavailable) {
  auto m = Create({Gpu(0, kBusA), Gpu(1, "0000:af:00.0")});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(m.status().message(), HasSubstr("0000:af:00.0"));
  EXPECT_THAT(m.status().message(), HasSubstr("CUDA device 1"));
  EXPECT_THAT(m.status().message(), HasSubstr("Not Found"));
}

TEST_F(FakeNvml, MissingBusIdIsUnavailable) {
  auto m = Create({Gpu(0, "")});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(m.status().message(), HasSubstr("no PCI bus id"));
}

TEST_F(FakeNvml, InitFailureIsUnavailable) {
  set_init_result_(9);  // NVML_ERROR_DRIVER_NOT_LOADED
  auto m = Create({Gpu(0, kBusA)});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(m.status().message(), HasSubstr("nvmlInit_v2"));
  EXPECT_THAT(m.status().message(), HasSubstr("Driver Not Loaded"));
}

TEST_F(FakeNvml, UnreadableDeviceFailsCreate) {
  set_no_utilization_(0);  // as some devices (e.g. MIG) report
  auto m = Create({Gpu(0, kBusA)});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(m.status().message(), HasSubstr("nvmlDeviceGetUtilizationRates"));
  EXPECT_THAT(m.status().message(), HasSubstr("Not Supported"));
}

TEST_F(FakeNvml, DeviceLostAfterCreateIsLeftOut) {
  auto m = Create({Gpu(0, kBusA), Gpu(1, kBusB)});
  ASSERT_TRUE(m.ok()) << m.status();
  set_lost_device_(0);  // the fake's first GPU: CUDA device 0
  std::vector<DeviceUsage> usage = (*m)->Read();
  ASSERT_EQ(usage.size(), 1u);
  EXPECT_EQ(usage[0].index, 1);
  EXPECT_EQ(usage[0].memory_used_bytes, 1 * kGiB);
  set_lost_device_(-1);
  EXPECT_EQ((*m)->Read().size(), 2u);
}

TEST_F(FakeNvml, ConcurrentReads) {
  auto m = Create({Gpu(0, kBusA), Gpu(1, kBusB)});
  ASSERT_TRUE(m.ok()) << m.status();
  const NvmlMonitor& monitor = **m;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        const std::vector<DeviceUsage> u = monitor.Read();
        if (u.size() != 2 || u[0].memory_used_bytes != 3 * kGiB + 12345 ||
            u[1].memory_used_bytes != 1 * kGiB) {
          wrong.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST_F(FakeNvml, TwoMonitorsShareOneNvml) {
  auto a = Create({Gpu(0, kBusA)});
  auto b = Create({Gpu(0, kBusA)});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(active_inits_(), 2);
  a->reset();
  ASSERT_EQ((*b)->Read().size(), 1u);
  b->reset();
}

}  // namespace
}  // namespace attnserve
