// `attnctl info`: GetServerInfo as readable text, or as JSON (proto field
// names) with --json for scripts.
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/command.h"
#include "client/cli/common.h"

ABSL_FLAG(bool, json, false, "Print the GetServerInfo response as JSON.");

namespace attnserve {
namespace cli {
namespace {

std::string Bytes(int64_t n) {
  if (n >= (int64_t{1} << 30) && n % (int64_t{1} << 30) == 0) {
    return absl::StrCat(n >> 30, " GiB");
  }
  if (n >= (int64_t{1} << 20)) return absl::StrCat(n / double(1 << 20), " MiB");
  return absl::StrCat(n, " bytes");
}

void PrintText(const v1::GetServerInfoResponse& info) {
  std::cout << "version:    " << info.version() << "\n"
            << "backend:    " << info.backend();
  if (info.cpu_threads() > 0) std::cout << " (" << info.cpu_threads() << " CPU threads)";
  std::cout << "\n";
  if (info.devices().empty()) {
    std::cout << "devices:    none\n";
  } else {
    for (const v1::DeviceInfo& d : info.devices()) {
      std::cout << "device " << d.index() << ":   " << d.name() << ", compute capability "
                << d.compute_capability_major() << "." << d.compute_capability_minor() << ", "
                << Bytes(d.total_memory_bytes()) << "\n";
    }
  }
  std::vector<std::string> dtypes;
  for (int t : info.dtypes()) dtypes.push_back(v1::DType_Name(static_cast<v1::DType>(t)));
  std::cout << "dtypes:     " << absl::StrJoin(dtypes, ", ") << "\n"
            << "head dims:  " << info.min_head_dim() << " to " << info.max_head_dim()
            << ", multiples of " << info.head_dim_multiple()
            << (info.max_head_dim_qk() > 0
                    ? absl::StrCat("; with V's own (MLA): Q/K up to ", info.max_head_dim_qk(),
                                   ", V up to ", info.max_head_dim_v())
                    : std::string())
            << "\n"
            << "limits:     request " << Bytes(info.limits().max_request_bytes()) << ", "
            << info.limits().max_tokens() << " tokens, queue " << info.limits().max_queue_size()
            << "\n"
            << "features:   " << absl::StrJoin(info.features(), ", ") << "\n";
  if (info.has_kv()) {
    const v1::KvInfo& kv = info.kv();
    std::cout << "kv cache:   pages of " << absl::StrJoin(kv.page_sizes(), "/")
              << " tokens (default " << kv.default_page_size() << "), "
              << Bytes(kv.cache_bytes_per_device()) << " per device, idle timeout "
              << (kv.idle_timeout_ms() > 0 ? absl::StrCat(kv.idle_timeout_ms(), " ms") : "none")
              << "\n";
  }
}

}  // namespace

int RunInfo(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError("info", "info takes no arguments, got '" + args[0] + "'");
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = MakeClientFromFlags();
  if (!client.ok()) return UsageError("info", std::string(client.status().message()));
  absl::StatusOr<v1::GetServerInfoResponse> info = (*client)->GetServerInfo();
  if (!info.ok()) return PrintError("GetServerInfo failed", info.status());
  if (!absl::GetFlag(FLAGS_json)) {
    PrintText(*info);
    return kExitOk;
  }
  return PrintJson(*info);
}

}  // namespace cli
}  // namespace attnserve
