// The gRPC port's credentials and the token check on every call; see
// grpc_credentials.h. Built on gRPC's C API (grpc_security.h): the C++
// wrappers of gRPC 1.51 allow an auth metadata processor on TLS credentials
// only, while tokens must also work on a plain-text port (behind a mesh that
// terminates TLS), and the C API offers the file-watcher provider for both
// halves of mutual TLS.
#include "server/security/grpc_credentials.h"

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

absl::string_view View(const grpc_slice& slice) {
  return absl::string_view(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(slice)),
                           GRPC_SLICE_LENGTH(slice));
}

// gRPC's server auth filter calls this with a call's initial metadata (the
// ":path" pseudo-header included) before any service sees the call. It runs
// on a transport thread and answers at once: Authenticate is a hash and a few
// comparisons, no I/O.
void ProcessAuthMetadata(void* state, grpc_auth_context* /*connection*/, const grpc_metadata* md,
                         size_t num_md, grpc_process_auth_metadata_done_cb done, void* user_data) {
  const auto* auth = static_cast<const Authenticator*>(state);
  absl::string_view path;
  const grpc_metadata* authorization = nullptr;
  for (size_t i = 0; i < num_md; ++i) {
    const absl::string_view key = View(md[i].key);
    if (key == ":path") path = View(md[i].value);
    if (key == "authorization") authorization = &md[i];
  }
  if (IsOpenMethod(path)) {
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
    return;
  }
  absl::StatusOr<std::string> tenant = auth->Authenticate(
      authorization == nullptr ? absl::string_view() : View(authorization->value));
  if (!tenant.ok()) {
    const std::string message(tenant.status().message());
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_UNAUTHENTICATED, message.c_str());
    return;
  }
  // Nothing is added to `context`: in gRPC 1.51 it is the connection's, shared
  // by every call on it whatever its token (server/tenant.h looks the tenant
  // up per call instead).
  done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
}

// grpc::ServerCredentials over C-core credentials we built ourselves. gRPC
// calls AddPortToServer (a private virtual of the base class, overridden
// here) when the server binds.
class CoreServerCredentials final : public grpc::ServerCredentials {
 public:
  explicit CoreServerCredentials(grpc_server_credentials* credentials)
      : credentials_(credentials) {}
  ~CoreServerCredentials() override { grpc_server_credentials_release(credentials_); }

  // The processor is set on the C credentials (MakeGrpcServerCredentials);
  // a C++ one is not supported here.
  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {}

 private:
  int AddPortToServer(const std::string& address, grpc_server* server) override {
    return grpc_server_add_http2_port(server, address.c_str(), credentials_);
  }

  grpc_server_credentials* const credentials_;
};

grpc_server_credentials* MakeTlsCredentials(const TlsFiles& tls) {
  // The provider's interval is whole seconds, at least one.
  const auto interval = static_cast<unsigned int>(std::max<int64_t>(
      1, absl::ToInt64Seconds(absl::Ceil(tls.reload_interval, absl::Seconds(1)))));
  grpc_tls_certificate_provider* provider = grpc_tls_certificate_provider_file_watcher_create(
      tls.key_file.c_str(), tls.cert_file.c_str(),
      tls.mutual() ? tls.client_ca_file.c_str() : nullptr, interval);
  grpc_tls_credentials_options* options = grpc_tls_credentials_options_create();
  grpc_tls_credentials_options_set_certificate_provider(options, provider);
  grpc_tls_certificate_provider_release(provider);  // the options hold their own reference
  grpc_tls_credentials_options_watch_identity_key_cert_pairs(options);
  if (tls.mutual()) {
    grpc_tls_credentials_options_watch_root_certs(options);
    grpc_tls_credentials_options_set_cert_request_type(
        options, GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    grpc_tls_credentials_options_set_cert_request_type(options,
                                                       GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc_tls_server_credentials_create(options);  // takes the options
}

}  // namespace

bool IsOpenMethod(absl::string_view path) {
  return absl::StartsWith(path, "/grpc.health.v1.Health/") ||
         absl::StartsWith(path, "/grpc.reflection.v1alpha.ServerReflection/") ||
         path == "/inference.GRPCInferenceService/ServerLive" ||
         path == "/inference.GRPCInferenceService/ServerReady";
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeGrpcServerCredentials(
    const TlsFiles& tls, const Authenticator* auth) {
  RETURN_IF_ERROR(CheckTlsFiles(tls));
  if (!tls.enabled() && auth == nullptr) return grpc::InsecureServerCredentials();
  grpc_init();  // the C credentials below need the library up; balanced below
  grpc_server_credentials* credentials =
      tls.enabled() ? MakeTlsCredentials(tls) : grpc_insecure_server_credentials_create();
  if (auth != nullptr) {
    grpc_server_credentials_set_auth_metadata_processor(
        credentials, grpc_auth_metadata_processor{&ProcessAuthMetadata, nullptr,
                                                  const_cast<Authenticator*>(auth)});
  }
  auto result = std::make_shared<CoreServerCredentials>(credentials);
  grpc_shutdown();  // CoreServerCredentials holds its own library reference
  return result;
}

}  // namespace attnserve
