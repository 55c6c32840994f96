// The one seam between authentication and per-tenant state: the tenant a
// call acts for. K/V caches (server/kv/) and KServe v2 shared-memory regions
// (server/kserve/shm_registry.h) are scoped to it; another tenant's cache or
// region answers NOT_FOUND. Until attnserve authenticates callers everyone is
// the tenant "default"; TenantForCall is where a verified identity will map to
// a tenant, and nothing else changes.
#pragma once

#include <string>

#include "absl/strings/string_view.h"
#include "grpcpp/server_context.h"

namespace attnserve {

inline constexpr char kDefaultTenant[] = "default";

// `authorization`: the call's authorization header (HTTP) or metadata (gRPC),
// unverified and ignored for now.
inline std::string TenantForCall(absl::string_view /*authorization*/) { return kDefaultTenant; }

// TenantForCall on a gRPC call's "authorization" metadata.
inline std::string TenantOf(const grpc::CallbackServerContext* context) {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  return TenantForCall(it == metadata.end()
                           ? absl::string_view()
                           : absl::string_view(it->second.data(), it->second.size()));
}

}  // namespace attnserve
