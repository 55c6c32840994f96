// Picks and builds the backends the server runs on (--backend=auto|cpu|cuda,
// --devices): one CPU backend, or one CUDA backend per chosen GPU.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/backend.h"

namespace attnserve {

struct BackendOptions {
  std::string kind = "auto";  // "auto": CUDA if a GPU is usable, else CPU
  int cpu_threads = 0;        // 0: one per hardware thread
  // CUDA devices to serve on: "all" (every visible one) or a comma-separated
  // list of CUDA indices such as "0,2". The CPU backend ignores it.
  std::string devices = "all";
  // The CPU backend as this many devices (--cpu_devices), numbered from 0,
  // each a backend with its own threads (cpu_threads split between them)
  // and, in the server, its own executor and K/V pool: what CI runs where
  // a server with several GPUs would (caches that span devices).
  int cpu_devices = 1;
};

// Parses BackendOptions::devices: "all" (returned as an empty list) or
// distinct non-negative indices. INVALID_ARGUMENT naming --devices otherwise.
absl::StatusOr<std::vector<int>> ParseDeviceList(const std::string& devices);

// INVALID_ARGUMENT for an unknown kind or a bad device list; UNAVAILABLE when
// "cuda" is asked for and this build has no CUDA backend, no GPU is usable or
// a listed device does not exist. "auto" falls back to the CPU only when no
// GPU is usable at all, never when a listed device is missing.
absl::StatusOr<std::vector<std::unique_ptr<AttentionBackend>>> MakeBackends(
    const BackendOptions& options);

// Implemented by backend/cpu.
std::unique_ptr<AttentionBackend> MakeCpuBackend(int threads);
// `count` CPU devices sharing `threads` (0: one per hardware thread), at
// least one thread each; INVALID_ARGUMENT naming --cpu_devices unless count
// is in [1, 64].
absl::StatusOr<std::vector<std::unique_ptr<AttentionBackend>>> MakeCpuBackends(int count,
                                                                               int threads);

// Implemented by backend/cuda when built (ATTNSERVE_HAVE_CUDA); UNAVAILABLE
// when no usable device is present.
absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaBackend(int device);
// Visible CUDA devices; UNAVAILABLE (with the driver's reason) when none.
absl::StatusOr<int> CudaDeviceCount();

}  // namespace attnserve
