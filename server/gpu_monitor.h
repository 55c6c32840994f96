// Live GPU readings for /metrics (nv_gpu_memory_used_bytes, nv_gpu_utilization)
// from NVML, the library nvidia-smi reads. NVML is loaded at run time with
// dlopen, so attnserve neither builds nor links against it and a machine
// without the driver still serves (without these two gauges).
//
//   absl::StatusOr<std::unique_ptr<NvmlMonitor>> m = NvmlMonitor::Create(devices);
//   if (m.ok()) {
//     metrics.SetDeviceUsageSource([mon = std::shared_ptr<NvmlMonitor>(std::move(*m))] {
//       return mon->Read();
//     });
//   } else {
//     // log m.status() once; only nv_gpu_memory_total_bytes is exported
//   }
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "server/metrics.h"

namespace attnserve {

class NvmlMonitor {
 public:
  // The soname the driver installs (also in containers run with the NVIDIA
  // container toolkit).
  static constexpr char kDefaultLibrary[] = "libnvidia-ml.so.1";

  // Loads `library` (tests pass a fake), initialises NVML and finds each of
  // `devices` by its pci_bus_id: NVML's own indices need not match CUDA's
  // (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER), the bus id names the same GPU
  // to both. Reads every device once, so a device NVML cannot report on fails
  // here rather than at each scrape. UNAVAILABLE, saying why, when the library
  // cannot be loaded (no driver, or a fully static binary that cannot load
  // shared libraries) or lacks NVML's functions, when NVML fails to initialise,
  // or when a device has no bus id, is not found or cannot be read;
  // INVALID_ARGUMENT when `devices` is empty.
  static absl::StatusOr<std::unique_ptr<NvmlMonitor>> Create(
      const std::vector<DeviceDescription>& devices, const std::string& library = kDefaultLibrary);

  ~NvmlMonitor();  // nvmlShutdown
  NvmlMonitor(const NvmlMonitor&) = delete;
  NvmlMonitor& operator=(const NvmlMonitor&) = delete;

  // One reading per device, in the order given to Create, with DeviceUsage::
  // index the device's CUDA index. A device whose reading fails this time
  // (e.g. it fell off the bus) is left out rather than reported as 0. Safe to
  // call from several threads at once (NVML is thread-safe and the monitor is
  // immutable after Create); two NVML queries per device, microseconds each.
  std::vector<DeviceUsage> Read() const;

 private:
  struct Api;  // NVML's entry points, resolved by dlsym (gpu_monitor.cc)
  struct Device {
    int cuda_index;
    void* handle;  // nvmlDevice_t
  };
  NvmlMonitor(std::unique_ptr<const Api> api, std::vector<Device> devices);

  std::unique_ptr<const Api> api_;
  std::vector<Device> devices_;
};

}  // namespace attnserve
