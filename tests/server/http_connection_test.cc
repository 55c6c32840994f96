// What one connection to the KServe v2 HTTP port can make the server hold or
// wait for, over HTTP and HTTPS (issue 27, findings 8 and 12): a body refused
// early or left unread is not read as the next request, a request line,
// header block or chunk size line too long is refused before it is held,
// bodies the server cannot charge first are refused, slow TLS handshakes and
// slow heads do not stall a probe, and 200 simultaneous connections are all
// served.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/security/test_certs.h"

namespace attnserve {
namespace {

// A client whose peer resets the connection gets EPIPE, not a signal
// (OpenSSL writes without MSG_NOSIGNAL).
const bool kSigpipeIgnored = [] { return signal(SIGPIPE, SIG_IGN) != SIG_ERR; }();

constexpr size_t kMiB = size_t{1} << 20;
// What a client pushes at a connection the server should have ended; the old
// server read all of it.
constexpr size_t kPushBytes = 64 * kMiB;
// Well above what the socket buffers and the server's 1 MiB linger absorb.
constexpr size_t kAbsorbedBytes = 32 * kMiB;

int ConnectTcp(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  // Blocking I/O that gives up rather than hang a test on a server that
  // stops reading or answering.
  timeval timeout{20, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  return fd;
}

// One client connection, plain or TLS (verifying nothing: the certificate is
// not what these tests are about).
class Connection {
 public:
  static std::unique_ptr<Connection> Open(int port, SSL_CTX* tls) {
    const int fd = ConnectTcp(port);
    if (fd < 0) return nullptr;
    auto c = std::unique_ptr<Connection>(new Connection(fd));
    if (tls != nullptr) {
      c->ssl_ = SSL_new(tls);
      SSL_set_fd(c->ssl_, fd);
      if (SSL_connect(c->ssl_) != 1) return nullptr;
    }
    return c;
  }
  ~Connection() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    close(fd_);
  }

  // Bytes sent, or -1 with error() set.
  ssize_t Send(const char* data, size_t size) {
    errno = 0;
    if (ssl_ == nullptr) {
      const ssize_t n = send(fd_, data, size, MSG_NOSIGNAL);
      if (n < 0) error_ = errno;
      return n;
    }
    ERR_clear_error();
    const int n = SSL_write(ssl_, data, static_cast<int>(size));
    if (n <= 0) {
      error_ = errno != 0 ? errno : -1;
      return -1;
    }
    return n;
  }
  bool SendAll(const std::string& text) {
    for (size_t sent = 0; sent < text.size();) {
      const ssize_t n = Send(text.data() + sent, text.size() - sent);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }

  // Sends `byte` in 1 MiB pieces until a send fails or `limit` bytes are
  // sent; returns the bytes sent.
  size_t PushUntilRefused(char byte, size_t limit) {
    const std::string piece(kMiB, byte);
    size_t sent = 0;
    while (sent < limit) {
      const ssize_t n = Send(piece.data(), piece.size());
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    return sent;
  }

  // Reads one response (its head, and a body of its Content-Length) and
  // returns its status line: "" when the connection ends first.
  std::string StatusLine() {
    std::string head;
    while (head.find("\r\n\r\n") == std::string::npos) {
      char c;
      if (Recv(&c, 1) <= 0) return "";
      head.push_back(c);
    }
    const size_t at = head.find("Content-Length: ");
    size_t length = at == std::string::npos ? 0 : std::stoul(head.substr(at + 16));
    std::string body(4096, '\0');
    while (length > 0) {
      const ssize_t n = Recv(&body[0], std::min(length, body.size()));
      if (n <= 0) return "";
      length -= static_cast<size_t>(n);
    }
    return head.substr(0, head.find("\r\n"));
  }

  int error() const { return error_; }

 private:
  ssize_t Recv(char* data, size_t size) {
    return ssl_ == nullptr ? recv(fd_, data, size, 0)
                           : SSL_read(ssl_, data, static_cast<int>(size));
  }

  explicit Connection(int fd) : fd_(fd) {}
  const int fd_;
  SSL* ssl_ = nullptr;
  int error_ = 0;
};

bool ResetOrClosed(int error) { return error == EPIPE || error == ECONNRESET; }

struct CertFiles {
  CertFiles() : dir(testing::MakeTempDir("attnserve_http_conn_")), ca("test CA") {
    const testing::Pem server = ca.Issue("server-one", true);
    testing::WriteFileAtomically(dir + "/ca.pem", ca.cert_pem());
    testing::WriteFileAtomically(dir + "/server.pem", server.cert);
    testing::WriteFileAtomically(dir + "/server.key", server.key);
  }
  std::string dir;
  testing::TestCa ca;
};

// Parameter: true for HTTPS.
class HttpConnectionTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.backend.kind = "cpu";
    options.backend.cpu_threads = 1;
    options.kserve.http_enabled = true;
    options.kserve.http_host = "127.0.0.1";
    options.kserve.http_port = 0;
    options.metrics_enabled = true;
    options.metrics_host = "127.0.0.1";
    options.metrics_port = 0;
    options.max_request_bytes = 1 << 20;
    if (tls()) {
      certs_ = std::make_unique<CertFiles>();
      options.tls = {certs_->dir + "/server.pem", certs_->dir + "/server.key", "",
                     absl::Seconds(10)};
      client_ctx_ = SSL_CTX_new(TLS_client_method());
      SSL_CTX_set_verify(client_ctx_, SSL_VERIFY_NONE, nullptr);
    }
    absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::ZeroDuration());
    if (client_ctx_ != nullptr) SSL_CTX_free(client_ctx_);
  }

  bool tls() const { return GetParam(); }
  std::unique_ptr<Connection> Open() { return Connection::Open(server_->http_port(), client_ctx_); }
  std::unique_ptr<Connection> OpenMetrics() {
    return Connection::Open(server_->metrics_port(), client_ctx_);
  }

  // GET /v2/health/ready on a fresh connection: the status, or -1.
  int Ready(absl::Duration* took) {
    const absl::Time begin = absl::Now();
    std::unique_ptr<httplib::Client> client =
        tls() ? std::make_unique<httplib::Client>(
                    absl::StrCat("https://localhost:", server_->http_port()))
              : std::make_unique<httplib::Client>("127.0.0.1", server_->http_port());
    client->enable_server_certificate_verification(false);
    client->set_connection_timeout(20, 0);
    client->set_read_timeout(20, 0);
    httplib::Result res = client->Get("/v2/health/ready");
    *took = absl::Now() - begin;
    return res ? res->status : -1;
  }

  std::unique_ptr<CertFiles> certs_;
  SSL_CTX* client_ctx_ = nullptr;
  std::unique_ptr<AttnServer> server_;
};

// Finding 8 (a): a body refused on its Content-Length, by a request that did
// not ask to close, was read as the next request line (eight 60 MiB bodies
// took the server to 428 MB). Now the connection ends after the 413.
TEST_P(HttpConnectionTest, BodyRefusedEarlyIsNotReadAsTheNextRequest) {
  std::unique_ptr<Connection> c = Open();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(
      c->SendAll(absl::StrCat("POST /v2/models/attention/infer HTTP/1.1\r\nHost: x\r\n"
                              "Inference-Header-Content-Length: 2\r\nContent-Length: ",
                              60 * kMiB, "\r\n\r\n")));
  EXPECT_EQ(c->StatusLine(), "HTTP/1.1 413 Payload Too Large");
  const size_t pushed = c->PushUntilRefused('x', kPushBytes);
  EXPECT_LT(pushed, kAbsorbedBytes) << "the server read the refused body";
  EXPECT_TRUE(ResetOrClosed(c->error())) << "send failed with " << c->error();
}

// The same for a body a handler answers without reading (repository index
// takes no body): the connection ends after the answer.
TEST_P(HttpConnectionTest, BodyLeftUnreadByItsHandlerIsNotReadAsTheNextRequest) {
  std::unique_ptr<Connection> c = Open();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->SendAll(absl::StrCat("POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n",
                                      "Content-Length: ", 512 << 10, "\r\n\r\n")));
  EXPECT_EQ(c->StatusLine(), "HTTP/1.1 200 OK");
  const size_t pushed = c->PushUntilRefused('x', kPushBytes);
  EXPECT_LT(pushed, kAbsorbedBytes) << "the server read the unread body on";
  EXPECT_TRUE(ResetOrClosed(c->error())) << "send failed with " << c->error();
}

// Finding 12 (b): a 400 MiB request line with no newline was read whole (414
// MB) before its 414. Now it is refused once it passes 64 KiB.
TEST_P(HttpConnectionTest, LongRequestLineIsRefusedBeforeItIsHeld) {
  std::unique_ptr<Connection> c = Open();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->SendAll("GET /"));
  const size_t pushed = c->PushUntilRefused('a', kPushBytes);
  EXPECT_LT(pushed, kAbsorbedBytes) << "the server read the whole line";
  EXPECT_TRUE(ResetOrClosed(c->error())) << "send failed with " << c->error();
  // OpenSSL may not read after a failed write; the plain answer is read back.
  if (!tls()) {
    EXPECT_EQ(c->StatusLine(), "HTTP/1.1 414 URI Too Long");
  }
}

// A header block of many small lines, each within httplib's 8 KiB, 1 MiB in
// all: refused with 431 (httplib would read all of it and route the request).
TEST_P(HttpConnectionTest, LongHeaderBlockIsRefused) {
  std::unique_ptr<Connection> c = Open();
  ASSERT_NE(c, nullptr);
  std::string head = "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n";
  for (int i = 0; head.size() < kMiB; ++i) {
    absl::StrAppend(&head, "X-Filler-", i, ": ", std::string(1000, 'f'), "\r\n");
  }
  head += "\r\n";
  // The server may end the connection before the whole block is sent.
  (void)c->SendAll(head);
  if (!tls() || c->error() == 0) {
    EXPECT_EQ(c->StatusLine(), "HTTP/1.1 431 Request Header Fields Too Large");
  } else {
    EXPECT_TRUE(ResetOrClosed(c->error())) << c->error();
  }
}

// A chunked body cannot be charged before it is read: refused with 411 on
// its headers (httplib read it, and read a chunk size line whole).
TEST_P(HttpConnectionTest, ChunkedBodyIsRefusedBeforeItIsRead) {
  std::unique_ptr<Connection> c = Open();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(
      c->SendAll("POST /v2/models/attention/infer HTTP/1.1\r\nHost: x\r\n"
                 "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1"));
  EXPECT_EQ(c->StatusLine(), "HTTP/1.1 411 Length Required");
  const size_t pushed = c->PushUntilRefused('0', kPushBytes);
  EXPECT_LT(pushed, kAbsorbedBytes) << "the server read the body";
  EXPECT_TRUE(ResetOrClosed(c->error())) << "send failed with " << c->error();
}

// /metrics takes no body: one is refused (413), not read into memory (httplib
// had no bound: a body was read whole, then answered 404), and a chunk size
// line, which httplib reads before any bound applies, is cut at 64 KiB.
TEST_P(HttpConnectionTest, MetricsPortTakesNoBody) {
  std::unique_ptr<Connection> c = OpenMetrics();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->SendAll(absl::StrCat("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: ", kMiB,
                                      "\r\n\r\n", std::string(kMiB, 'b'))));
  EXPECT_EQ(c->StatusLine(), "HTTP/1.1 413 Payload Too Large");

  c = OpenMetrics();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(
      c->SendAll("POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1"));
  const size_t pushed = c->PushUntilRefused('0', kPushBytes);
  EXPECT_LT(pushed, kAbsorbedBytes) << "the server read the whole line";
  EXPECT_TRUE(ResetOrClosed(c->error())) << "send failed with " << c->error();
  if (!tls()) {
    EXPECT_EQ(c->StatusLine(), "HTTP/1.1 400 Bad Request");
  }
}

// Finding 12: slow clients (HTTPS: trickling their handshake, or their head
// after it) do not stop /v2/health/ready answering; more of them than the 8
// workers httplib's pool had.
TEST_P(HttpConnectionTest, SlowClientsDoNotStallTheReadinessProbe) {
  constexpr int kSlow = 24;
  std::vector<std::unique_ptr<Connection>> heads;  // handshake done (HTTPS), head trickled
  std::vector<int> handshakes;                     // HTTPS: a ClientHello trickled
  for (int i = 0; i < kSlow; ++i) {
    heads.push_back(Open());
    ASSERT_NE(heads.back(), nullptr);
    if (tls()) {
      handshakes.push_back(ConnectTcp(server_->http_port()));
      ASSERT_GE(handshakes.back(), 0);
    }
  }
  // The first bytes of a TLS record of 512 bytes (a ClientHello), then junk.
  const std::string hello = std::string("\x16\x03\x01\x02\x00\x01", 6);
  const std::string head = "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Slow: ";
  std::atomic<bool> stop{false};
  std::atomic<int> rounds{0};
  std::thread trickle([&] {
    for (size_t i = 0; !stop.load(); ++i) {
      for (auto& c : heads) c->Send(i < head.size() ? &head[i] : "a", 1);
      const char byte = i < hello.size() ? hello[i] : 'h';
      for (int fd : handshakes) (void)!send(fd, &byte, 1, MSG_NOSIGNAL);
      rounds.fetch_add(1);
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  // Evidence the slow clients are under way: some bytes have gone out.
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (rounds.load() < 3 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(10));
  absl::Duration took;
  const int status = Ready(&took);
  stop.store(true);
  trickle.join();
  for (int fd : handshakes) close(fd);
  EXPECT_EQ(status, 200);
  // Generous for a loaded 2-core machine; a stalled pool takes tens of seconds.
  EXPECT_LT(took, absl::Seconds(4));
}

// Finding 12: 200 simultaneous connections (40 of them failed against the
// old backlog of 5) are all served.
TEST_P(HttpConnectionTest, TwoHundredSimultaneousConnectionsAreServed) {
  constexpr int kClients = 200;
  absl::Notification go;
  std::atomic<int> served{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&] {
      go.WaitForNotification();
      std::unique_ptr<Connection> c = Open();
      if (c == nullptr) return;
      if (!c->SendAll("GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) {
        return;
      }
      if (c->StatusLine() == "HTTP/1.1 200 OK") served.fetch_add(1);
    });
  }
  const absl::Time begin = absl::Now();
  go.Notify();
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(served.load(), kClients) << "in " << absl::Now() - begin;
}

// Requests after one another on a kept-alive connection, the second sent
// before the first is answered, are both served: the loop around httplib
// keeps what it read ahead.
TEST_P(HttpConnectionTest, KeptAliveConnectionServesPipelinedRequests) {
  std::unique_ptr<Connection> c = Open();
  ASSERT_NE(c, nullptr);
  const std::string get = "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_TRUE(c->SendAll(get + get));
  EXPECT_EQ(c->StatusLine(), "HTTP/1.1 200 OK");
  EXPECT_EQ(c->StatusLine(), "HTTP/1.1 200 OK");
}

INSTANTIATE_TEST_SUITE_P(HttpAndHttps, HttpConnectionTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Https" : "Http";
                         });

// A head trickled a byte at a time, each within the read timeout, is cut at
// the head timeout (10 s) with 408: httplib alone would wait for ever.
using HttpHeadTimeoutTest = HttpConnectionTest;

TEST_P(HttpHeadTimeoutTest, TrickledHeadIsCutAtTheHeadTimeout) {
  std::unique_ptr<Connection> c = Open();
  ASSERT_NE(c, nullptr);
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    const std::string head = "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    for (size_t i = 0; !stop.load() && c->Send(i < head.size() ? &head[i] : "s", 1) == 1; ++i) {
      absl::SleepFor(absl::Milliseconds(200));
    }
  });
  const absl::Time begin = absl::Now();
  const std::string status = c->StatusLine();  // gives up after 20 s
  const absl::Duration took = absl::Now() - begin;
  stop.store(true);
  trickle.join();
  EXPECT_EQ(status, "HTTP/1.1 408 Request Timeout") << "after " << took;
  EXPECT_GE(took, absl::Seconds(9));
}

INSTANTIATE_TEST_SUITE_P(Http, HttpHeadTimeoutTest, ::testing::Values(false),
                         [](const ::testing::TestParamInfo<bool>&) { return "Http"; });

}  // namespace
}  // namespace attnserve
