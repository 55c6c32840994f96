// The TLS files of a listening port (--tls_cert, --tls_key, --tls_client_ca)
// and the one check both the gRPC and HTTP sides run on them at start, so a
// wrong path or a key that does not match the certificate fails the start
// with a message naming the flag rather than as failed handshakes later.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace attnserve {

struct TlsFiles {
  std::string cert_file;       // PEM certificate chain, leaf first
  std::string key_file;        // PEM private key of the leaf
  std::string client_ca_file;  // PEM CA bundle; set: clients must present a certificate it signed
  // How often the files are checked for a new version (certificate rotation).
  absl::Duration reload_interval = absl::Seconds(10);

  bool enabled() const { return !cert_file.empty(); }
  bool mutual() const { return !client_ca_file.empty(); }
};

// OK when TLS is off, or when the certificate and key load, match, and the
// client CA (if set) loads; INVALID_ARGUMENT naming the flag otherwise.
absl::Status CheckTlsFiles(const TlsFiles& tls);

}  // namespace attnserve
