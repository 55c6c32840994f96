// The gRPC port's credentials: plain text or TLS (mutual with a client CA),
// with bearer-token authentication on every call when an Authenticator is
// given. TLS uses gRPC's file-watcher certificate provider, which re-reads
// the certificate, key and client CA every reload interval, so rotated files
// are served without a restart. Authentication runs as gRPC's server auth
// metadata processor, before any service sees the call: a refused call ends
// with UNAUTHENTICATED and reaches no handler; an accepted one goes on to
// its service, which maps the same token to its tenant (server/tenant.h).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/server_credentials.h"
#include "server/auth/authenticator.h"
#include "server/security/tls_files.h"

namespace attnserve {

// Methods any caller may use without a token: the standard health service
// (Kubernetes probes), server reflection (the schema only) and KServe's
// ServerLive / ServerReady.
bool IsOpenMethod(absl::string_view path);

// `auth` may be null (no authentication); it must outlive the server.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeGrpcServerCredentials(
    const TlsFiles& tls, const Authenticator* auth);

}  // namespace attnserve
