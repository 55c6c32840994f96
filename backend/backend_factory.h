// Picks and builds the backend the server runs on (--backend=auto|cpu|cuda).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "backend/backend.h"

namespace attnserve {

struct BackendOptions {
  std::string kind = "auto";  // "auto": CUDA if a GPU is usable, else CPU
  int cpu_threads = 0;        // 0: one per hardware thread
  int cuda_device = 0;        // device index for the CUDA backend
};

// INVALID_ARGUMENT for an unknown kind; UNAVAILABLE when "cuda" is asked for
// and this build has no CUDA backend or no GPU is usable.
absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeBackend(const BackendOptions& options);

// Implemented by backend/cpu.
std::unique_ptr<AttentionBackend> MakeCpuBackend(int threads);

// Implemented by backend/cuda when built (ATTNSERVE_HAVE_CUDA); UNAVAILABLE
// when no usable device is present.
absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaBackend(int device);

}  // namespace attnserve
