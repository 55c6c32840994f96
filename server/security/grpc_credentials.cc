// The gRPC port's credentials and the token check on every call; see
// grpc_credentials.h. Built on gRPC's C API (grpc_security.h): the C++
// wrappers of gRPC 1.51 allow an auth metadata processor on TLS credentials
// only, while tokens must also work on a plain-text port (behind a mesh that
// terminates TLS), and the C API offers the file-watcher provider for both
// halves of mutual TLS.
#include "server/security/grpc_credentials.h"

#include <fcntl.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "server/security/file_watch.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

absl::string_view View(const grpc_slice& slice) {
  return absl::string_view(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(slice)),
                           GRPC_SLICE_LENGTH(slice));
}

absl::StatusOr<std::string> ReadWhole(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  }
  return text.str();
}

// The key and certificate chain as one PEM text (key first), or
// INVALID_ARGUMENT when they do not load or the key is not the leaf's.
absl::StatusOr<std::string> MatchedIdentity(const TlsFiles& tls) {
  ASSIGN_OR_RETURN(const std::string cert, ReadWhole(tls.cert_file, "tls_cert"));
  ASSIGN_OR_RETURN(const std::string key, ReadWhole(tls.key_file, "tls_key"));
  std::unique_ptr<BIO, decltype(&BIO_free)> cert_bio(
      BIO_new_mem_buf(cert.data(), static_cast<int>(cert.size())), &BIO_free);
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(
      BIO_new_mem_buf(key.data(), static_cast<int>(key.size())), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> leaf(
      cert_bio ? PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr) : nullptr,
      &X509_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(
      key_bio ? PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr) : nullptr,
      &EVP_PKEY_free);
  const bool matched =
      leaf != nullptr && pkey != nullptr && X509_check_private_key(leaf.get(), pkey.get()) == 1;
  ERR_clear_error();
  if (leaf == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_cert: no certificate in '", tls.cert_file, "'"));
  }
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_key: no private key in '", tls.key_file, "'"));
  }
  if (!matched) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls_key: '", tls.key_file, "' does not match the certificate in '", tls.cert_file, "'"));
  }
  return absl::StrCat(key, key.empty() || key.back() == '\n' ? "" : "\n", cert);
}

// What gRPC's file-watcher provider reads on the gRPC port: not the
// operator's files, which a copy in progress can show as a mismatched pair,
// but one in-memory file holding the last pair that loaded and matched.
// A new version replaces it in one step (dup2 onto the same descriptor) and
// carries a later modification time (whole seconds, as the provider
// compares), so a provider read that straddles a swap sees the times differ
// and reads again rather than pair an old key with a new certificate.
class VerifiedIdentity {
 public:
  static absl::StatusOr<std::unique_ptr<VerifiedIdentity>> Create(const TlsFiles& tls) {
    ASSIGN_OR_RETURN(const std::string pem, MatchedIdentity(tls));
    std::unique_ptr<VerifiedIdentity> identity(new VerifiedIdentity(tls));
    RETURN_IF_ERROR(identity->Publish(pem));
    VerifiedIdentity* raw = identity.get();
    identity->watcher_ =
        std::make_unique<FileWatcher>(std::vector<std::string>{tls.cert_file, tls.key_file},
                                      tls.reload_interval, [raw] { raw->Reload(); });
    return identity;
  }
  ~VerifiedIdentity() {
    watcher_.reset();  // no Reload runs past here
    if (fd_ >= 0) close(fd_);
  }

  // The path the provider opens for both the key and the certificate.
  std::string path() const {
    absl::MutexLock lock(&mu_);
    return absl::StrCat("/proc/self/fd/", fd_);
  }

 private:
  explicit VerifiedIdentity(const TlsFiles& tls) : tls_(tls) {}

  void Reload() {
    absl::StatusOr<std::string> pem = MatchedIdentity(tls_);
    absl::Status published = pem.ok() ? Publish(*pem) : pem.status();
    if (!published.ok()) {
      spdlog::error("grpc tls: keeping the previous certificate and key: {}",
                    std::string(published.message()));
      return;
    }
    spdlog::info("grpc tls: reloaded the certificate and key from {}", tls_.cert_file);
  }

  absl::Status Publish(const std::string& pem) {
    const int fd = memfd_create("attnserve-tls-identity", MFD_CLOEXEC);
    if (fd < 0) return absl::InternalError("tls: memfd_create failed");
    bool ok = write(fd, pem.data(), pem.size()) == static_cast<ssize_t>(pem.size());
    absl::MutexLock lock(&mu_);
    stamp_ = std::max<time_t>(stamp_ + 1, time(nullptr));
    const timespec times[2] = {{stamp_, 0}, {stamp_, 0}};
    ok = ok && futimens(fd, times) == 0;
    if (ok && fd_ >= 0) ok = dup2(fd, fd_) == fd_;
    if (!ok) {
      close(fd);
      return absl::InternalError("tls: could not publish the new certificate and key");
    }
    if (fd_ < 0) {
      fd_ = fd;
    } else {
      close(fd);  // fd_ now refers to the new file
    }
    return absl::OkStatus();
  }

  const TlsFiles tls_;
  mutable absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_) = -1;
  time_t stamp_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<FileWatcher> watcher_;  // last: stops first
};

// The processor's state: the authenticator (null: tokens off, every call
// passes) and what must live as long as the C credentials, which gRPC
// destroys (and this with them) when the server no longer needs them.
struct ProcessorState {
  const Authenticator* auth = nullptr;
  std::unique_ptr<VerifiedIdentity> identity;
};

// gRPC's server auth filter calls this with a call's initial metadata (the
// ":path" pseudo-header included) before any service sees the call. It runs
// on a transport thread and answers at once: Authenticate is a hash and a few
// comparisons, no I/O.
void ProcessAuthMetadata(void* state, grpc_auth_context* /*connection*/, const grpc_metadata* md,
                         size_t num_md, grpc_process_auth_metadata_done_cb done, void* user_data) {
  const Authenticator* auth = static_cast<const ProcessorState*>(state)->auth;
  if (auth == nullptr) {
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
    return;
  }
  absl::string_view path;
  const grpc_metadata* authorization = nullptr;
  int authorizations = 0;
  for (size_t i = 0; i < num_md; ++i) {
    const absl::string_view key = View(md[i].key);
    if (key == ":path") path = View(md[i].value);
    if (key == "authorization") {
      authorization = &md[i];
      ++authorizations;
    }
  }
  if (IsOpenMethod(path)) {
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
    return;
  }
  // Two headers would let this check one token while a service reads the
  // other (server/tenant.h): a call must say who it is exactly once.
  if (authorizations > 1) {
    auth->Authenticate(absl::string_view()).status().IgnoreError();  // counted as refused
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_UNAUTHENTICATED,
         "expected exactly one 'authorization' header, got several");
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

grpc_server_credentials* MakeTlsCredentials(const TlsFiles& tls, const VerifiedIdentity& identity) {
  // The provider's interval is whole seconds, at least one.
  const auto interval = static_cast<unsigned int>(std::max<int64_t>(
      1, absl::ToInt64Seconds(absl::Ceil(tls.reload_interval, absl::Seconds(1)))));
  const std::string pem = identity.path();
  grpc_tls_certificate_provider* provider = grpc_tls_certificate_provider_file_watcher_create(
      pem.c_str(), pem.c_str(), tls.mutual() ? tls.client_ca_file.c_str() : nullptr, interval);
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
  auto state = std::make_unique<ProcessorState>();
  state->auth = auth;
  if (tls.enabled()) {
    ASSIGN_OR_RETURN(state->identity, VerifiedIdentity::Create(tls));
  }
  grpc_init();  // the C credentials below need the library up; balanced below
  grpc_server_credentials* credentials = tls.enabled() ? MakeTlsCredentials(tls, *state->identity)
                                                       : grpc_insecure_server_credentials_create();
  // Set even without tokens: its destroy hook is what keeps the identity
  // file alive exactly as long as the credentials that read it.
  grpc_server_credentials_set_auth_metadata_processor(
      credentials, grpc_auth_metadata_processor{
                       &ProcessAuthMetadata,
                       [](void* s) { delete static_cast<ProcessorState*>(s); }, state.release()});
  auto result = std::make_shared<CoreServerCredentials>(credentials);
  grpc_shutdown();  // CoreServerCredentials holds its own library reference
  return result;
}

}  // namespace attnserve
