// Real certificates for the transport-security tests, made with OpenSSL at
// test time (nothing secret is committed): a CA, certificates it signs for
// servers (SAN localhost and 127.0.0.1) and clients, all P-256.
#pragma once

#include <memory>
#include <string>

namespace attnserve {
namespace testing {

struct Pem {
  std::string cert;
  std::string key;
};

class TestCa {
 public:
  explicit TestCa(const std::string& name);
  ~TestCa();
  const std::string& cert_pem() const { return pem_.cert; }
  // A certificate this CA signs: for a server (SAN DNS:localhost,
  // IP:127.0.0.1, extendedKeyUsage serverAuth) or a client (clientAuth).
  Pem Issue(const std::string& common_name, bool server) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Pem pem_;
};

// Writes `text` to `path` through a temporary file and rename(2), the way
// certificate tooling replaces files, so a reader never sees half of it.
void WriteFileAtomically(const std::string& path, const std::string& text);

// A fresh directory under $TEST_TMPDIR or /tmp.
std::string MakeTempDir(const std::string& prefix);

// The subject common name of the certificate a TLS server at 127.0.0.1:port
// presents (a bare handshake offering ALPN h2, verifying nothing), or "" when
// the handshake fails.
std::string PresentedCommonName(int port);

}  // namespace testing
}  // namespace attnserve
