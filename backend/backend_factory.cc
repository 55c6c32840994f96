#include "backend/backend_factory.h"

#include "absl/strings/str_cat.h"

namespace attnserve {

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeBackend(const BackendOptions& options) {
  if (options.kind == "cpu") return MakeCpuBackend(options.cpu_threads);
  if (options.kind == "cuda" || options.kind == "auto") {
#if ATTNSERVE_HAVE_CUDA
    auto cuda = MakeCudaBackend(options.cuda_device);
    if (cuda.ok() || options.kind == "cuda") return cuda;
#else
    if (options.kind == "cuda") {
      return absl::UnavailableError("backend: \"cuda\" requested but this build has no CUDA backend");
    }
#endif
    return MakeCpuBackend(options.cpu_threads);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("backend: expected one of auto, cpu, cuda; got \"", options.kind, "\""));
}

}  // namespace attnserve
