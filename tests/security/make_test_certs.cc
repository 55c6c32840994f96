// make_test_certs DIR: writes a CA, a server certificate (SAN localhost,
// 127.0.0.1) and a client certificate into DIR (ca.pem, server.pem,
// server.key, client.pem, client.key) for the tests that drive attnctl and
// the Python client over TLS.
#include <cstdio>
#include <string>

#include "tests/security/test_certs.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_test_certs DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  attnserve::testing::TestCa ca("attnserve test CA");
  const attnserve::testing::Pem server = ca.Issue("attnserve-test-server", true);
  const attnserve::testing::Pem client = ca.Issue("attnserve-test-client", false);
  using attnserve::testing::WriteFileAtomically;
  WriteFileAtomically(dir + "/ca.pem", ca.cert_pem());
  WriteFileAtomically(dir + "/server.pem", server.cert);
  WriteFileAtomically(dir + "/server.key", server.key);
  WriteFileAtomically(dir + "/client.pem", client.cert);
  WriteFileAtomically(dir + "/client.key", client.key);
  return 0;
}
