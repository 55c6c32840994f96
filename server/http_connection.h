// The HTTP ports' servers: cpp-httplib's request parser and routing, with our
// own loop around each connection, because httplib's (in Debian's compiled
// 0.11.4) reads a request line or header line whole before checking its
// length, and keeps reading a connection whose body it refused as the next
// request. Ours reads through a stream that bounds a request head's bytes and
// time before httplib holds them, and ends a connection after any response
// that says `Connection: close`. Include only where ATTNSERVE_HAVE_HTTPLIB is
// defined.
#pragma once

#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
#error "build with CPPHTTPLIB_OPENSSL_SUPPORT (server/CMakeLists.txt sets it)"
#endif
#include <httplib.h>
#include <openssl/ssl.h>

#include <cstddef>
#include <functional>

#include "absl/time/time.h"

namespace attnserve {

struct HttpConnectionLimits {
  // A request line and its headers together, and any one line of a chunked
  // body (its size lines): past this the connection is answered 414 (request
  // line) or 431 and closed. httplib's own limits, 8 KiB per line, stay.
  size_t max_head_bytes = 64 * 1024;
  // From a request's first byte (or, over TLS, from the connection's accept
  // for the handshake) to the end of its head: past this the connection is
  // answered 408 and closed, however steadily the client trickles.
  absl::Duration head_timeout = absl::Seconds(10);
};

// For the handlers of these servers (a pre-routing handler reserving a body's
// bytes before httplib reads it): `release` runs once the request this thread
// is serving has its response ready to send, or has ended without one. False,
// with `release` run at once, on a thread serving no connection of theirs.
bool ReleaseWhenAnswered(std::function<void()> release);

// Both servers take no request body (httplib answers 413) until the owner
// sets a payload length: httplib's default is unbounded.

// Plain HTTP.
class HttpServer final : public httplib::Server {
 public:
  explicit HttpServer(const HttpConnectionLimits& limits = {});

 private:
  bool process_and_close_socket(socket_t sock) override;

  const HttpConnectionLimits limits_;
};

// HTTPS: the TLS handshake is ours too, under the head timeout.
class HttpsServer final : public httplib::SSLServer {
 public:
  HttpsServer(const std::function<bool(SSL_CTX& ctx)>& setup_ssl_ctx,
              const HttpConnectionLimits& limits = {});

 private:
  bool process_and_close_socket(socket_t sock) override;

  const HttpConnectionLimits limits_;
};

}  // namespace attnserve
