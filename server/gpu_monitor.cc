// NvmlMonitor: NVML's memory and utilisation readings through dlopen/dlsym, so
// the build needs neither nvml.h nor libnvidia-ml (see gpu_monitor.h).
#include "server/gpu_monitor.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

// The part of NVML's C API (nvml.h; "NVML API Reference Guide") this file
// calls, declared here with nvml.h's layout:
//   nvmlReturn_t      a C enum (int); NVML_SUCCESS = 0
//   nvmlDevice_t      an opaque pointer (struct nvmlDevice_st*)
//   nvmlMemory_t      { unsigned long long total, free, used; }  bytes
//   nvmlUtilization_t { unsigned int gpu, memory; }  percent of the last
//                     sample period in which a kernel ran / memory was busy
// Functions: nvmlInit_v2, nvmlShutdown, nvmlDeviceGetHandleByPciBusId_v2,
// nvmlDeviceGetMemoryInfo, nvmlDeviceGetUtilizationRates, nvmlErrorString.
using NvmlReturn = int;
constexpr NvmlReturn kNvmlSuccess = 0;
using NvmlDevice = void*;
struct NvmlMemory {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
struct NvmlUtilization {
  unsigned int gpu;
  unsigned int memory;
};

// True if this process has a dynamic loader, i.e. its executable (the first
// object dl_iterate_phdr reports) names an ELF interpreter. A fully static
// attnserve (the CPU build with ATTNSERVE_STATIC) has none, and glibc's dlopen
// from a static binary loads a second libc beside the linked one: a fully
// static attnserve crashed that way loading libcuda on an H100
// (cmake/static_link.cmake). Two gauges are not worth that risk.
bool HasDynamicLoader() {
  bool found = false;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          if (info->dlpi_phdr[i].p_type == PT_INTERP) *static_cast<bool*>(data) = true;
        }
        return 1;  // the executable only
      },
      &found);
  return found;
}

}  // namespace

struct NvmlMonitor::Api {
  NvmlReturn (*init)() = nullptr;      // nvmlInit_v2
  NvmlReturn (*shutdown)() = nullptr;  // nvmlShutdown
  // nvmlDeviceGetHandleByPciBusId_v2
  NvmlReturn (*handle_by_pci_bus_id)(const char* bus_id, NvmlDevice* device) = nullptr;
  // nvmlDeviceGetMemoryInfo
  NvmlReturn (*memory_info)(NvmlDevice device, NvmlMemory* memory) = nullptr;
  // nvmlDeviceGetUtilizationRates
  NvmlReturn (*utilization_rates)(NvmlDevice device, NvmlUtilization* utilization) = nullptr;
  const char* (*error_string)(NvmlReturn result) = nullptr;  // nvmlErrorString

  std::string Error(NvmlReturn result) const {
    const char* text = error_string(result);
    return absl::StrCat(text != nullptr ? text : "unknown error", " (nvmlReturn_t ", result, ")");
  }

  // Fills usage->memory_used_bytes and usage->utilization. On failure returns
  // NVML's result and names the call that failed in *failed_call.
  NvmlReturn ReadDevice(NvmlDevice device, DeviceUsage* usage, const char** failed_call) const {
    NvmlMemory memory{};
    NvmlReturn r = memory_info(device, &memory);
    if (r != kNvmlSuccess) {
      *failed_call = "nvmlDeviceGetMemoryInfo";
      return r;
    }
    NvmlUtilization utilization{};
    r = utilization_rates(device, &utilization);
    if (r != kNvmlSuccess) {
      *failed_call = "nvmlDeviceGetUtilizationRates";
      return r;
    }
    usage->memory_used_bytes = static_cast<int64_t>(memory.used);
    usage->utilization = std::clamp(utilization.gpu / 100.0, 0.0, 1.0);
    return kNvmlSuccess;
  }
};

absl::StatusOr<std::unique_ptr<NvmlMonitor>> NvmlMonitor::Create(
    const std::vector<DeviceDescription>& devices, const std::string& library) {
  if (devices.empty()) return absl::InvalidArgumentError("NVML monitor: no devices to monitor");
  if (!HasDynamicLoader()) {
    return absl::UnavailableError(
        absl::StrCat("NVML: this binary is fully statically linked and cannot load ", library));
  }
  dlerror();
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::UnavailableError(absl::StrCat("NVML: cannot load ", library, ": ",
                                               why != nullptr ? why : "dlopen failed",
                                               " (no NVIDIA driver visible to this process?)"));
  }
  auto api = std::make_unique<Api>();
  const char* missing = nullptr;
  auto resolve = [&](const char* name, auto* fn) {
    void* sym = dlsym(handle, name);
    if (sym == nullptr && missing == nullptr) missing = name;
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(sym);
  };
  resolve("nvmlInit_v2", &api->init);
  resolve("nvmlShutdown", &api->shutdown);
  resolve("nvmlDeviceGetHandleByPciBusId_v2", &api->handle_by_pci_bus_id);
  resolve("nvmlDeviceGetMemoryInfo", &api->memory_info);
  resolve("nvmlDeviceGetUtilizationRates", &api->utilization_rates);
  resolve("nvmlErrorString", &api->error_string);
  if (missing != nullptr) {
    dlclose(handle);
    return absl::UnavailableError(
        absl::StrCat("NVML: ", library, " has no ", missing, " (not NVML, or a driver too old)"));
  }
  const NvmlReturn init = api->init();
  if (init != kNvmlSuccess) {
    const std::string why = api->Error(init);
    dlclose(handle);
    return absl::UnavailableError(absl::StrCat("NVML: nvmlInit_v2 failed: ", why));
  }
  // From here on the library stays loaded even if this fails or the monitor
  // is destroyed: nvmlShutdown balances nvmlInit_v2 (NVML counts them), but
  // NVML may keep threads or exit handlers of its own, and unmapping its code
  // under them would crash. One mapping per process is no cost.
  auto fail = [&](std::string message) {
    api->shutdown();
    return absl::UnavailableError(std::move(message));
  };
  std::vector<Device> found;
  for (const DeviceDescription& d : devices) {
    if (d.pci_bus_id.empty()) {
      return fail(absl::StrCat("NVML: CUDA device ", d.index, " (", d.name,
                               ") has no PCI bus id to find it by"));
    }
    NvmlDevice device = nullptr;
    const NvmlReturn r = api->handle_by_pci_bus_id(d.pci_bus_id.c_str(), &device);
    if (r != kNvmlSuccess) {
      return fail(absl::StrCat("NVML: no device at PCI bus id ", d.pci_bus_id, " (CUDA device ",
                               d.index, ", ", d.name, "): ", api->Error(r)));
    }
    DeviceUsage probe;
    const char* failed_call = "";
    const NvmlReturn read = api->ReadDevice(device, &probe, &failed_call);
    if (read != kNvmlSuccess) {
      return fail(absl::StrCat("NVML: ", failed_call, " for PCI bus id ", d.pci_bus_id,
                               " (CUDA device ", d.index, "): ", api->Error(read)));
    }
    found.push_back(Device{d.index, device});
  }
  return std::unique_ptr<NvmlMonitor>(new NvmlMonitor(std::move(api), std::move(found)));
}

NvmlMonitor::NvmlMonitor(std::unique_ptr<const Api> api, std::vector<Device> devices)
    : api_(std::move(api)), devices_(std::move(devices)) {}

NvmlMonitor::~NvmlMonitor() { api_->shutdown(); }

std::vector<DeviceUsage> NvmlMonitor::Read() const {
  std::vector<DeviceUsage> usage;
  usage.reserve(devices_.size());
  for (const Device& d : devices_) {
    DeviceUsage u;
    u.index = d.cuda_index;
    const char* failed_call = "";
    if (api_->ReadDevice(d.handle, &u, &failed_call) == kNvmlSuccess) usage.push_back(u);
  }
  return usage;
}

}  // namespace attnserve
