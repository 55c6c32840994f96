// `attnctl health`: asks grpc.health.v1.Health/Check and prints the serving
// status. Exit 0 only for SERVING, so it works as a container HEALTHCHECK or a
// readiness script.
#include <iostream>

#include "absl/flags/flag.h"
#include "client/cli/command.h"
#include "client/cli/common.h"

ABSL_FLAG(std::string, service, "",
          "Health service name to ask about; empty means the server as a whole.");

namespace attnserve {
namespace cli {

int RunHealth(const std::vector<std::string>& args) {
  if (!args.empty())
    return UsageError("health", "health takes no arguments, got '" + args[0] + "'");
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = MakeClientFromFlags();
  if (!client.ok()) return UsageError("health", std::string(client.status().message()));
  absl::StatusOr<HealthStatus> status = (*client)->HealthCheck(absl::GetFlag(FLAGS_service));
  if (!status.ok()) return PrintError("health check failed", status.status());
  std::cout << HealthStatusName(*status) << "\n";
  return *status == HealthStatus::kServing ? kExitOk : kExitFailure;
}

}  // namespace cli
}  // namespace attnserve
