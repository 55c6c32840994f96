// The interface every compute backend implements (CPU, CUDA), and the
// description of a backend that GetServerInfo reports.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/params.h"

namespace attnserve {

// Where the time of one Forward call went, in microseconds.
struct BackendTimings {
  int64_t host_to_device_us = 0;
  int64_t compute_us = 0;
  int64_t device_to_host_us = 0;
};

struct DeviceDescription {
  int index = 0;
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int64_t total_memory_bytes = 0;
  // "0000:1b:00.0" style (cudaDeviceGetPCIBusId); empty for CPU. Names the
  // device to tools such as NVML, whose indices need not match CUDA's.
  std::string pci_bus_id;
};

struct BackendDescription {
  std::string name;  // "cpu" or "cuda": the value of ForwardResponse.backend
  std::vector<DeviceDescription> devices;
  std::vector<DType> dtypes;
  int min_head_dim = 8;
  int max_head_dim = 256;
  int head_dim_multiple = 8;
  int cpu_threads = 0;
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  virtual const BackendDescription& Describe() const = 0;

  // OK if Forward can run `params`; UNIMPLEMENTED (naming what is missing) for
  // a valid combination this backend does not support; INVALID_ARGUMENT for
  // params that break the contract's invariants.
  virtual absl::Status CanImplement(const AttnParams& params) const = 0;

  // Computes attention. Every pointer in `params` (q, k, v, o, lse,
  // cu_seqlens) is HOST memory; a device backend stages it itself. Writes all
  // of o (and lse when non-null). Never throws or aborts: device errors come
  // back as INTERNAL, allocation failures as RESOURCE_EXHAUSTED.
  // Calls may come from any thread, but not concurrently: the server's
  // executor serialises them per backend instance.
  virtual absl::Status Forward(const AttnParams& params, BackendTimings* timings) = 0;
};

}  // namespace attnserve
