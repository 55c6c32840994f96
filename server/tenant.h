// The one seam between authentication and per-tenant state: the tenant a
// call acts for. K/V caches (server/kv/) and KServe v2 shared-memory regions
// (server/shm/shm_registry.h) are scoped to it; another tenant's cache or
// region answers exactly as one that never existed. With --auth_tokens_file
// the gRPC port's auth processor (server/security/grpc_credentials.h) and
// the HTTP side's pre-routing handler refuse calls without a valid token
// before any service runs, and the services map the token to its tenant
// here; without it everyone is the tenant "default". Streams re-check their
// token per request (StreamTenant): a withdrawn token stops an open stream.
#pragma once

#include <atomic>
#include <iterator>
#include <memory>
#include <optional>
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

// The call's one `authorization` header; none when it carries none or more
// than one (the port's auth processor refuses the latter, and a lookup here
// must never pick a different one than the processor checked).
inline std::optional<absl::string_view> SoleAuthorization(
    const grpc::CallbackServerContext* context) {
  const auto range = context->client_metadata().equal_range("authorization");
  if (range.first == range.second || std::next(range.first) != range.second) return std::nullopt;
  return absl::string_view(range.first->second.data(), range.first->second.size());
}

// The tenant a gRPC call acts for: "default" when authentication is off
// (`auth` null); otherwise the tenant of the call's own bearer token, or
// kWithdrawnTenant (server/auth/tenants.h), which owns nothing and is refused
// by every stateful call. The port's auth processor has already refused calls
// without exactly one valid token; the lookup is repeated here rather than
// carried over, because gRPC 1.51 hands that processor the connection's auth
// context, which calls with different tokens share.
inline std::string TenantOf(const Authenticator* auth, const grpc::CallbackServerContext* context) {
  if (auth == nullptr) return kDefaultTenant;
  const std::optional<absl::string_view> header = SoleAuthorization(context);
  if (!header.has_value()) return kWithdrawnTenant;
  absl::StatusOr<std::string> tenant = auth->Authenticate(*header, /*count=*/false);
  return tenant.ok() ? *tenant : std::string(kWithdrawnTenant);
}

// A stream's tenant, fixed when it opens, and the token it opened with, so
// each request on it can check that the token has not been withdrawn since
// (one atomic load while the tokens file is unchanged).
class StreamTenant {
 public:
  StreamTenant(const Authenticator* auth, const grpc::CallbackServerContext* context)
      : auth_(auth) {
    if (auth == nullptr) {
      tenant_ = kDefaultTenant;
      return;
    }
    // Before the lookup: a reload after it makes the first request look again.
    generation_.store(auth->reloads(), std::memory_order_release);
    tenant_ = TenantOf(auth, context);
    const std::optional<absl::string_view> header = SoleAuthorization(context);
    if (tenant_ == kWithdrawnTenant || !header.has_value()) return;
    absl::StatusOr<TokenDigest> digest = Authenticator::DigestOfHeader(*header);
    if (!digest.ok()) return;
    digest_ = *digest;
    valid_ = true;
  }
  StreamTenant(const StreamTenant&) = delete;
  StreamTenant& operator=(const StreamTenant&) = delete;

  const std::string& tenant() const { return tenant_; }

  // OK while the stream's token still names its tenant (always, without
  // authentication); UNAUTHENTICATED once a reloaded tokens file withdrew it.
  absl::Status StillValid() const {
    if (auth_ == nullptr) return absl::OkStatus();
    if (!valid_) {
      return absl::UnauthenticatedError(
          "the stream's bearer token names no tenant: open a new stream with exactly one "
          "current token");
    }
    return auth_->StillValid(digest_, tenant_, &generation_);
  }

 private:
  const Authenticator* const auth_;
  std::string tenant_;
  TokenDigest digest_{};
  bool valid_ = false;
  mutable std::atomic<int64_t> generation_{0};
};

// What a stream's per-request start captures (copyable, shared by its copies).
inline std::shared_ptr<const StreamTenant> StreamTenantOf(
    const Authenticator* auth, const grpc::CallbackServerContext* context) {
  return std::make_shared<const StreamTenant>(auth, context);
}

}  // namespace attnserve
