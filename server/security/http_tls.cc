// HTTPS for the HTTP ports with certificates re-read on change; see
// http_tls.h. OpenSSL calls CertCallback during each handshake, before the
// server's certificate is sent, and the callback installs the newest
// certificate, key, chain and client-CA store on that one connection.
#include "server/security/http_tls.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <cstdio>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "server/http_connection.h"
#include "server/security/file_watch.h"
#include "spdlog/spdlog.h"

namespace attnserve {

namespace {

// One version of the files, parsed.
struct TlsMaterial {
  TlsMaterial() = default;
  TlsMaterial(const TlsMaterial&) = delete;
  TlsMaterial& operator=(const TlsMaterial&) = delete;
  ~TlsMaterial() {
    X509_free(leaf);
    if (chain != nullptr) sk_X509_pop_free(chain, X509_free);
    EVP_PKEY_free(key);
    X509_STORE_free(client_ca);
  }
  X509* leaf = nullptr;
  STACK_OF(X509) * chain = nullptr;  // intermediates after the leaf
  EVP_PKEY* key = nullptr;
  X509_STORE* client_ca = nullptr;  // null without mutual TLS
};

std::unique_ptr<BIO, decltype(&BIO_free)> OpenFile(const std::string& path) {
  return {BIO_new_file(path.c_str(), "r"), &BIO_free};
}

absl::StatusOr<std::shared_ptr<const TlsMaterial>> LoadMaterial(const TlsFiles& files) {
  RETURN_IF_ERROR(CheckTlsFiles(files));  // names the flag on any problem
  auto m = std::make_shared<TlsMaterial>();
  auto cert = OpenFile(files.cert_file);
  if (cert == nullptr)
    return absl::InvalidArgumentError("tls_cert: cannot open " + files.cert_file);
  m->leaf = PEM_read_bio_X509(cert.get(), nullptr, nullptr, nullptr);
  m->chain = sk_X509_new_null();
  while (X509* extra = PEM_read_bio_X509(cert.get(), nullptr, nullptr, nullptr)) {
    sk_X509_push(m->chain, extra);
  }
  ERR_clear_error();  // the loop ends on "no start line"
  auto key = OpenFile(files.key_file);
  if (key == nullptr) return absl::InvalidArgumentError("tls_key: cannot open " + files.key_file);
  m->key = PEM_read_bio_PrivateKey(key.get(), nullptr, nullptr, nullptr);
  if (m->leaf == nullptr || m->key == nullptr) {
    return absl::InvalidArgumentError("tls_cert, tls_key: the files changed while being read");
  }
  // CheckTlsFiles read the files once; this is what will be served, read
  // again, so it is checked again: a copy in progress can pair them wrongly.
  if (X509_check_private_key(m->leaf, m->key) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        "tls_key: does not match the certificate (the files changed while being read)");
  }
  if (files.mutual()) {
    m->client_ca = X509_STORE_new();
    if (X509_STORE_load_file(m->client_ca, files.client_ca_file.c_str()) != 1) {
      ERR_clear_error();
      return absl::InvalidArgumentError("tls_client_ca: cannot load " + files.client_ca_file);
    }
  }
  return std::shared_ptr<const TlsMaterial>(std::move(m));
}

}  // namespace

// The newest TlsMaterial, swapped when a FileWatcher sees the files change.
class TlsReloader {
 public:
  explicit TlsReloader(const TlsFiles& files, std::shared_ptr<const TlsMaterial> first)
      : files_(files), current_(std::move(first)) {}

  void StartWatching() {
    watcher_ = std::make_unique<FileWatcher>(
        std::vector<std::string>{files_.cert_file, files_.key_file, files_.client_ca_file},
        files_.reload_interval, [this] { Reload(); });
  }

  std::shared_ptr<const TlsMaterial> current() const {
    absl::MutexLock lock(&mu_);
    return current_;
  }

  // SSL_CTX_set_cert_cb: 1 = go on, 0 = fail the handshake.
  static int CertCallback(SSL* ssl, void* arg) {
    const std::shared_ptr<const TlsMaterial> m = static_cast<TlsReloader*>(arg)->current();
    if (SSL_use_certificate(ssl, m->leaf) != 1 || SSL_use_PrivateKey(ssl, m->key) != 1 ||
        SSL_set1_chain(ssl, m->chain) != 1) {
      return 0;
    }
    if (m->client_ca != nullptr && SSL_set1_verify_cert_store(ssl, m->client_ca) != 1) return 0;
    return 1;
  }

 private:
  void Reload() {
    absl::StatusOr<std::shared_ptr<const TlsMaterial>> m = LoadMaterial(files_);
    if (!m.ok()) {
      // Half-written files (a copy in progress) land here too; the next
      // change is picked up on the next check.
      spdlog::error("https: keeping the previous certificate: {}",
                    std::string(m.status().message()));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      current_ = *std::move(m);
    }
    spdlog::info("https: reloaded the certificate and key from {}", files_.cert_file);
  }

  const TlsFiles files_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TlsMaterial> current_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<FileWatcher> watcher_;  // last: stops first
};

HttpServerWithTls::HttpServerWithTls() = default;
HttpServerWithTls::HttpServerWithTls(HttpServerWithTls&&) noexcept = default;
HttpServerWithTls::~HttpServerWithTls() {
  server.reset();  // no handshake may run once the reloader is gone
}

absl::StatusOr<HttpServerWithTls> MakeHttpServer(const TlsFiles& files) {
  HttpServerWithTls out;
  if (!files.enabled()) {
    out.server = std::make_unique<HttpServer>();
    return out;
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const TlsMaterial> first, LoadMaterial(files));
  auto reloader = std::make_shared<TlsReloader>(files, std::move(first));
  const bool mutual = files.mutual();
  TlsReloader* raw = reloader.get();
  auto server = std::make_unique<HttpsServer>([raw, mutual](SSL_CTX& ctx) {
    SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
    SSL_CTX_set_cert_cb(&ctx, &TlsReloader::CertCallback, raw);
    if (mutual) {
      SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    }
    return true;
  });
  if (!server->is_valid()) return absl::InternalError("https: could not create the TLS context");
  reloader->StartWatching();
  out.tls = std::move(reloader);
  out.server = std::move(server);
  return out;
}

}  // namespace attnserve
