#include "backend/backend_factory.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve {
namespace {

std::vector<std::unique_ptr<AttentionBackend>> One(std::unique_ptr<AttentionBackend> b) {
  std::vector<std::unique_ptr<AttentionBackend>> v;
  v.push_back(std::move(b));
  return v;
}

#if ATTNSERVE_HAVE_CUDA
absl::StatusOr<std::vector<std::unique_ptr<AttentionBackend>>> MakeCudaBackends(
    const std::vector<int>& listed) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return count.status();
  std::vector<int> devices = listed;
  if (devices.empty()) {
    for (int i = 0; i < *count; ++i) devices.push_back(i);
  }
  std::vector<std::unique_ptr<AttentionBackend>> backends;
  for (int d : devices) {
    if (d >= *count) {
      return absl::UnavailableError(
          absl::StrCat("--devices: CUDA device ", d, " requested, ", *count, " visible"));
    }
    absl::StatusOr<std::unique_ptr<AttentionBackend>> b = MakeCudaBackend(d);
    if (!b.ok()) return b.status();
    backends.push_back(*std::move(b));
  }
  return backends;
}
#endif

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<AttentionBackend>>> MakeCpuBackends(int count,
                                                                               int threads) {
  if (count < 1 || count > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu_devices: expected a count in [1, 64], got ", count));
  }
  if (count == 1) return One(MakeCpuBackend(threads));
  const int total =
      threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::unique_ptr<AttentionBackend>> backends;
  for (int i = 0; i < count; ++i) backends.push_back(MakeCpuBackend(std::max(1, total / count)));
  return backends;
}

absl::StatusOr<std::vector<int>> ParseDeviceList(const std::string& devices) {
  std::vector<int> out;
  if (devices == "all") return out;
  for (absl::string_view part : absl::StrSplit(devices, ',')) {
    int d = -1;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--devices: expected \"all\" or comma-separated GPU indices such as 0,1; got \"", devices,
          "\""));
    }
    if (std::find(out.begin(), out.end(), d) != out.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices: device ", d, " listed twice in \"", devices, "\""));
    }
    out.push_back(d);
  }
  return out;
}

absl::StatusOr<std::vector<std::unique_ptr<AttentionBackend>>> MakeBackends(
    const BackendOptions& options) {
  absl::StatusOr<std::vector<int>> devices = ParseDeviceList(options.devices);
  if (!devices.ok()) return devices.status();
  if (options.kind == "cpu") return MakeCpuBackends(options.cpu_devices, options.cpu_threads);
  if (options.kind == "cuda" || options.kind == "auto") {
#if ATTNSERVE_HAVE_CUDA
    const bool any_gpu = CudaDeviceCount().ok();
    if (any_gpu || options.kind == "cuda") return MakeCudaBackends(*devices);
#else
    if (options.kind == "cuda") {
      return absl::UnavailableError(
          "backend: \"cuda\" requested but this build has no CUDA backend");
    }
#endif
    return MakeCpuBackends(options.cpu_devices, options.cpu_threads);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("backend: expected one of auto, cpu, cuda; got \"", options.kind, "\""));
}

}  // namespace attnserve
