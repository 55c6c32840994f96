// The one seam between authentication and per-tenant state: the tenant a
// call acts for. K/V caches (server/kv/) and KServe v2 shared-memory regions
// (server/kserve/shm_registry.h) are scoped to it; another tenant's cache or
// region answers exactly as one that never existed. With --auth_tokens_file
// the gRPC port's auth processor (server/security/grpc_credentials.h) and
// the HTTP side's pre-routing handler refuse calls without a valid token
// before any service runs, and the services map the token to its tenant
// here; without it everyone is the tenant "default".
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server_context.h"
#include "server/auth/authenticator.h"

namespace attnserve {

inline constexpr char kDefaultTenant[] = "default";

// The tenant of an HTTP call's Authorization header: `auth` null means
// authentication is off ("default"); otherwise UNAUTHENTICATED or the tenant.
// `count`: record the call in the tenant's counters (once per call).
inline absl::StatusOr<std::string> TenantForCall(const Authenticator* auth,
                                                 absl::string_view authorization,
                                                 bool count = true) {
  if (auth == nullptr) return std::string(kDefaultTenant);
  return auth->Authenticate(authorization, count);
}

// The tenant of a call whose token was withdrawn (a reloaded tokens file)
// between the check at the door and the lookup: a name no tokens file can
// hold (parentheses and a space), so it owns nothing and sees nothing; it
// stays printable because /metrics renders tenant names as labels.
inline constexpr char kWithdrawnTenant[] = "(token withdrawn)";

// The tenant a gRPC call acts for: "default" when authentication is off
// (`auth` null); otherwise the tenant of the call's own bearer token. The
// port's auth processor (server/security/grpc_credentials.h) has already
// refused calls without a valid token; the lookup is repeated here rather
// than carried over, because gRPC 1.51 hands that processor the
// connection's auth context, which calls with different tokens share.
inline std::string TenantOf(const Authenticator* auth, const grpc::CallbackServerContext* context) {
  if (auth == nullptr) return kDefaultTenant;
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return kWithdrawnTenant;
  absl::StatusOr<std::string> tenant =
      auth->Authenticate(absl::string_view(it->second.data(), it->second.size()), /*count=*/false);
  return tenant.ok() ? *tenant : std::string(kWithdrawnTenant);
}

}  // namespace attnserve
