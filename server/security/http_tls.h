// The cpp-httplib server behind an HTTP port (/metrics, KServe v2 REST):
// plain HTTP, or HTTPS with the same certificate, key and client CA as the
// gRPC port. Debian's libcpp-httplib is built with OpenSSL, so its SSLServer
// is used; the certificate, key and client CA are handed to each handshake
// from the newest version of the files (re-read when they change), so a
// rotated certificate is served without a restart. Include only where
// ATTNSERVE_HAVE_HTTPLIB is defined.
#pragma once

#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
#error "build with CPPHTTPLIB_OPENSSL_SUPPORT (server/CMakeLists.txt sets it)"
#endif
#include <httplib.h>

#include <memory>

#include "absl/status/statusor.h"
#include "server/security/tls_files.h"

namespace attnserve {

class TlsReloader;

// An httplib server and what keeps its certificates current.
struct HttpServerWithTls {
  HttpServerWithTls();
  HttpServerWithTls(HttpServerWithTls&&) noexcept;
  ~HttpServerWithTls();
  std::shared_ptr<TlsReloader> tls;  // null for plain HTTP
  std::unique_ptr<httplib::Server> server;
};

// Plain when `tls` is off; otherwise HTTPS (TLS 1.2 or later), requiring a
// client certificate signed by the client CA when one is set.
// INVALID_ARGUMENT naming the flag when the files do not load.
absl::StatusOr<HttpServerWithTls> MakeHttpServer(const TlsFiles& tls);

}  // namespace attnserve
