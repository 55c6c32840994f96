// A stand-in for libnvidia-ml.so.1, built as a module for gpu_monitor_test so
// NvmlMonitor's success path runs on a machine without a GPU. It exports the
// six NVML functions NvmlMonitor calls, with nvml.h's signatures (see
// server/gpu_monitor.cc), and knows two GPUs:
//   bus id 0000:1b:00.0: 80 GiB, 3 GiB + 12345 bytes used, 37 % busy
//   bus id 0000:3d:00.0: 40 GiB, 1 GiB used, 100 % busy
// Bus ids are parsed as NVML does ("domain:bus:device.function" in hex, so
// "00000000:1B:00.0" names the first one too). Every call but nvmlErrorString
// fails with NVML_ERROR_UNINITIALIZED outside nvmlInit_v2/nvmlShutdown.
// fake_nvml_* hooks (looked up with dlsym) let the test count inits and make
// calls fail.
#include <atomic>
#include <cstdio>

namespace {

// nvmlReturn_t values (nvml.h).
constexpr int kSuccess = 0;
constexpr int kUninitialized = 1;
constexpr int kInvalidArgument = 2;
constexpr int kNotSupported = 3;
constexpr int kNotFound = 6;
constexpr int kGpuIsLost = 15;

struct NvmlMemory {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
struct NvmlUtilization {
  unsigned int gpu;
  unsigned int memory;
};

struct FakeDevice {
  unsigned int bus;  // domain 0, device 0, function 0
  unsigned long long total;
  unsigned long long used;
  unsigned int gpu_percent;
};
constexpr unsigned long long kGiB = 1ull << 30;
FakeDevice g_devices[2] = {{0x1b, 80 * kGiB, 3 * kGiB + 12345, 37},
                           {0x3d, 40 * kGiB, 1 * kGiB, 100}};

std::atomic<int> g_inits{0};
std::atomic<int> g_init_result{kSuccess};
std::atomic<int> g_lost_device{-1};     // index into g_devices: reads fail
std::atomic<int> g_no_utilization{-1};  // index into g_devices: utilisation unsupported

int IndexOf(void* device) {
  for (int i = 0; i < 2; ++i) {
    if (device == &g_devices[i]) return i;
  }
  return -1;
}

}  // namespace

extern "C" {

int nvmlInit_v2() {
  const int r = g_init_result.load();
  if (r == kSuccess) g_inits.fetch_add(1);
  return r;
}

int nvmlShutdown() {
  int n = g_inits.load();
  while (n > 0 && !g_inits.compare_exchange_weak(n, n - 1)) {
  }
  return n > 0 ? kSuccess : kUninitialized;
}

int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  if (g_inits.load() == 0) return kUninitialized;
  if (bus_id == nullptr || device == nullptr) return kInvalidArgument;
  unsigned int domain, bus, dev, fn;
  char tail;
  if (std::sscanf(bus_id, "%x:%x:%x.%x%c", &domain, &bus, &dev, &fn, &tail) != 4) {
    return kInvalidArgument;
  }
  for (FakeDevice& d : g_devices) {
    if (domain == 0 && bus == d.bus && dev == 0 && fn == 0) {
      *device = &d;
      return kSuccess;
    }
  }
  return kNotFound;
}

int nvmlDeviceGetMemoryInfo(void* device, NvmlMemory* memory) {
  if (g_inits.load() == 0) return kUninitialized;
  const int i = IndexOf(device);
  if (i < 0 || memory == nullptr) return kInvalidArgument;
  if (i == g_lost_device.load()) return kGpuIsLost;
  memory->total = g_devices[i].total;
  memory->used = g_devices[i].used;
  memory->free = g_devices[i].total - g_devices[i].used;
  return kSuccess;
}

int nvmlDeviceGetUtilizationRates(void* device, NvmlUtilization* utilization) {
  if (g_inits.load() == 0) return kUninitialized;
  const int i = IndexOf(device);
  if (i < 0 || utilization == nullptr) return kInvalidArgument;
  if (i == g_lost_device.load()) return kGpuIsLost;
  if (i == g_no_utilization.load()) return kNotSupported;
  utilization->gpu = g_devices[i].gpu_percent;
  utilization->memory = 5;
  return kSuccess;
}

const char* nvmlErrorString(int result) {
  switch (result) {
    case kSuccess: return "Success";
    case kUninitialized: return "Uninitialized";
    case kInvalidArgument: return "Invalid Argument";
    case kNotSupported: return "Not Supported";
    case kNotFound: return "Not Found";
    case 9: return "Driver Not Loaded";
    case kGpuIsLost: return "GPU is lost";
  }
  return "Unknown Error";
}

// Test hooks.
int fake_nvml_active_inits() { return g_inits.load(); }
void fake_nvml_set_init_result(int result) { g_init_result.store(result); }
void fake_nvml_set_lost_device(int index) { g_lost_device.store(index); }
void fake_nvml_set_no_utilization(int index) { g_no_utilization.store(index); }

}  // extern "C"
