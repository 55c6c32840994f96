// The one seam between authentication and per-tenant state: the tenant a
// call acts for. K/V caches (server/kv/) and KServe v2 shared-memory regions
// (server/kserve/shm_registry.h) are scoped to it; another tenant's cache or
// region answers exactly as one that never existed. With --auth_tokens_file
// the gRPC port's auth processor (server/security/grpc_credentials.h) puts
// the verified tenant in the call's auth context before any service runs,
// and the HTTP side authenticates in its pre-routing handler; without it
// everyone is the tenant "default".
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server_context.h"
#include "server/auth/authenticator.h"
#include "server/security/grpc_credentials.h"

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

// The tenant a gRPC call was authenticated as. A call that reached a service
// without one ran with authentication off (or on an open method, which uses
// no tenant state): "default".
inline std::string TenantOf(const grpc::CallbackServerContext* context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
  if (auth != nullptr) {
    const std::vector<grpc::string_ref> values = auth->FindPropertyValues(kTenantProperty);
    if (!values.empty()) return std::string(values.front().data(), values.front().size());
  }
  return kDefaultTenant;
}

}  // namespace attnserve
