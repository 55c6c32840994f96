// CheckTlsFiles; see tls_files.h.
#include "server/security/tls_files.h"

#include <openssl/err.h>
#include <openssl/ssl.h>

#include <memory>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "unknown error";
  char buffer[256];
  ERR_error_string_n(code, buffer, sizeof(buffer));
  return buffer;
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& tls) {
  if (!tls.enabled()) {
    if (!tls.key_file.empty() || !tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "tls_cert: expected a certificate file when --tls_key or --tls_client_ca is set, got "
          "none");
    }
    return absl::OkStatus();
  }
  if (tls.key_file.empty()) {
    return absl::InvalidArgumentError("tls_key: expected the private key of --tls_cert, got none");
  }
  if (tls.reload_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("tls_reload_interval: expected > 0, got ",
                                                   absl::FormatDuration(tls.reload_interval)));
  }
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_server_method()),
                                                        &SSL_CTX_free);
  if (ctx == nullptr) return absl::InternalError("TLS: " + OpenSslError());
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), tls.cert_file.c_str()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_cert: cannot load '", tls.cert_file, "': ", OpenSslError()));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_key: cannot load '", tls.key_file, "': ", OpenSslError()));
  }
  if (SSL_CTX_check_private_key(ctx.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("tls_key: '", tls.key_file,
                                                   "' does not match the certificate in '",
                                                   tls.cert_file, "': ", OpenSslError()));
  }
  if (tls.mutual() &&
      SSL_CTX_load_verify_locations(ctx.get(), tls.client_ca_file.c_str(), nullptr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_client_ca: cannot load '", tls.client_ca_file, "': ", OpenSslError()));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
