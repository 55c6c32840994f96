// Test certificates with OpenSSL; see test_certs.h.
#include "tests/security/test_certs.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace attnserve {
namespace testing {
namespace {

std::string ToPem(X509* cert) {
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(bio, cert);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(bio);
  return out;
}

std::string ToPem(EVP_PKEY* key) {
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(bio);
  return out;
}

void AddExtension(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  if (ext == nullptr) throw std::runtime_error("X509V3_EXT_conf_nid failed");
  X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
}

X509* NewCert(EVP_PKEY* key, const std::string& cn) {
  static std::atomic<long> serial{1};
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), serial++);
  X509_gmtime_adj(X509_getm_notBefore(cert), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert), 7 * 24 * 3600);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  return cert;
}

}  // namespace

struct TestCa::Impl {
  EVP_PKEY* key = nullptr;
  X509* cert = nullptr;
  ~Impl() {
    X509_free(cert);
    EVP_PKEY_free(key);
  }
};

TestCa::TestCa(const std::string& name) : impl_(std::make_unique<Impl>()) {
  impl_->key = EVP_EC_gen("P-256");
  impl_->cert = NewCert(impl_->key, name);
  X509_set_issuer_name(impl_->cert, X509_get_subject_name(impl_->cert));
  AddExtension(impl_->cert, impl_->cert, NID_basic_constraints, "critical,CA:TRUE");
  AddExtension(impl_->cert, impl_->cert, NID_key_usage, "critical,keyCertSign,cRLSign");
  AddExtension(impl_->cert, impl_->cert, NID_subject_key_identifier, "hash");
  X509_sign(impl_->cert, impl_->key, EVP_sha256());
  pem_ = {ToPem(impl_->cert), ToPem(impl_->key)};
}

TestCa::~TestCa() = default;

Pem TestCa::Issue(const std::string& common_name, bool server) const {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* cert = NewCert(key, common_name);
  X509_set_issuer_name(cert, X509_get_subject_name(impl_->cert));
  AddExtension(cert, impl_->cert, NID_basic_constraints, "critical,CA:FALSE");
  AddExtension(cert, impl_->cert, NID_key_usage, "critical,digitalSignature,keyEncipherment");
  AddExtension(cert, impl_->cert, NID_ext_key_usage, server ? "serverAuth" : "clientAuth");
  AddExtension(cert, impl_->cert, NID_authority_key_identifier, "keyid:always");
  if (server) AddExtension(cert, impl_->cert, NID_subject_alt_name, "DNS:localhost,IP:127.0.0.1");
  X509_sign(cert, impl_->key, EVP_sha256());
  Pem pem{ToPem(cert), ToPem(key)};
  X509_free(cert);
  EVP_PKEY_free(key);
  return pem;
}

void WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("rename " + tmp);
}

std::string MakeTempDir(const std::string& prefix) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/" + prefix + "XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp " + pattern);
  return pattern;
}

std::string PresentedCommonName(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string cn;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
    SSL* ssl = SSL_new(ctx);
    static const unsigned char kAlpn[] = {2, 'h', '2'};
    SSL_set_alpn_protos(ssl, kAlpn, sizeof(kAlpn));
    SSL_set_fd(ssl, fd);
    if (SSL_connect(ssl) == 1) {
      if (X509* peer = SSL_get1_peer_certificate(ssl)) {
        char buffer[256] = {0};
        X509_NAME_get_text_by_NID(X509_get_subject_name(peer), NID_commonName, buffer,
                                  sizeof(buffer));
        cn = buffer;
        X509_free(peer);
      }
    }
    SSL_free(ssl);
    SSL_CTX_free(ctx);
  }
  close(fd);
  return cn;
}

}  // namespace testing
}  // namespace attnserve
