// How a client channel reaches a secured attnserve: TLS (server verified
// against a CA file, or the system roots), mutual TLS (a client certificate
// and key), and a bearer token sent as `authorization: Bearer <token>` on
// every call. The token goes in through a client interceptor rather than
// gRPC call credentials, because gRPC refuses call credentials on a
// plain-text channel, and a token without TLS is a legitimate set-up behind a
// mesh that encrypts (SECURITY.md says when).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/support/channel_arguments.h"

namespace attnserve {

struct ChannelSecurity {
  bool tls = false;           // TLS with the system's roots unless tls_ca_file is set
  std::string tls_ca_file;    // PEM roots to verify the server with (implies tls)
  std::string tls_cert_file;  // mutual TLS: this client's PEM certificate chain
  std::string tls_key_file;   // ... and its PEM private key
  std::string token;          // bearer token; empty: none

  bool uses_tls() const { return tls || !tls_ca_file.empty() || !tls_cert_file.empty(); }
};

// A channel to `target` with `args` and `security`. INVALID_ARGUMENT naming
// the field when a file cannot be read or the certificate comes without its
// key (or the other way round).
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeSecureChannel(
    const std::string& target, const ChannelSecurity& security, const grpc::ChannelArguments& args);

}  // namespace attnserve
