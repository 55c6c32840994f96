// Our loop around each HTTP connection; see http_connection.h. httplib's
// process_request parses and routes one request from any httplib::Stream, so
// the stream here is where a request head's bytes and time are bounded: it
// counts what it hands httplib until httplib has parsed the headers (the
// setup_request callback), and answers 414, 431 or 408 itself when a head
// runs over.
#include "server/http_connection.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <openssl/err.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnserve {
namespace {

constexpr ssize_t kWouldBlock = -2;
// A connection the server ends in the middle of a request (a refused body, a
// head over its bounds) is read and discarded for at most this long and this
// many bytes after the answer, so that a client still sending sees the answer
// rather than a reset; then it is closed (reset if the client still sends).
constexpr absl::Duration kLingerTime = absl::Seconds(1);
constexpr size_t kLingerBytes = size_t{1} << 20;
// How often a wait looks whether the server is stopping.
constexpr absl::Duration kStopPoll = absl::Milliseconds(100);

// The socket's bytes, decrypted or not. Recv and Send answer kWouldBlock with
// `*wait` set to the poll event to wait for.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual ssize_t Recv(char* data, size_t size, short* wait) = 0;
  virtual ssize_t Send(const char* data, size_t size, short* wait) = 0;
  // Bytes received and not yet returned by Recv (TLS records).
  virtual bool Pending() const = 0;
};

class PlainTransport final : public Transport {
 public:
  explicit PlainTransport(int fd) : fd_(fd) {}

  ssize_t Recv(char* data, size_t size, short* wait) override {
    return Result(::recv(fd_, data, size, MSG_DONTWAIT), POLLIN, wait);
  }
  ssize_t Send(const char* data, size_t size, short* wait) override {
    return Result(::send(fd_, data, size, MSG_DONTWAIT | MSG_NOSIGNAL), POLLOUT, wait);
  }
  bool Pending() const override { return false; }

 private:
  static ssize_t Result(ssize_t n, short event, short* wait) {
    if (n >= 0) return n;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      *wait = event;
      return kWouldBlock;
    }
    return -1;
  }

  const int fd_;
};

class TlsTransport final : public Transport {
 public:
  explicit TlsTransport(SSL* ssl) : ssl_(ssl) {}

  // 0 once the handshake is done; kWouldBlock or -1 as Recv.
  ssize_t Accept(short* wait) {
    ERR_clear_error();
    const int r = SSL_accept(ssl_);
    return r == 1 ? 0 : Result(r, wait);
  }
  ssize_t Recv(char* data, size_t size, short* wait) override {
    ERR_clear_error();
    return Result(SSL_read(ssl_, data, static_cast<int>(std::min<size_t>(size, 1 << 30))), wait);
  }
  ssize_t Send(const char* data, size_t size, short* wait) override {
    if (size == 0) return 0;
    ERR_clear_error();
    return Result(SSL_write(ssl_, data, static_cast<int>(std::min<size_t>(size, 1 << 30))), wait);
  }
  bool Pending() const override { return SSL_has_pending(ssl_) == 1; }

  // Sends close_notify, unless the connection failed (OpenSSL forbids it then).
  void Shutdown() {
    if (fatal_) return;
    ERR_clear_error();
    SSL_shutdown(ssl_);
    ERR_clear_error();
  }

 private:
  ssize_t Result(int r, short* wait) {
    if (r > 0) return r;
    switch (SSL_get_error(ssl_, r)) {
      case SSL_ERROR_WANT_READ: *wait = POLLIN; return kWouldBlock;
      case SSL_ERROR_WANT_WRITE: *wait = POLLOUT; return kWouldBlock;
      case SSL_ERROR_ZERO_RETURN: return 0;
      default:
        fatal_ = true;
        ERR_clear_error();
        return -1;
    }
  }

  SSL* const ssl_;
  bool fatal_ = false;
};

// What the connection loop takes from the server's settings.
struct Settings {
  const std::atomic<socket_t>* listening;  // INVALID_SOCKET once stop() is called
  size_t keep_alive_max_count;
  absl::Duration keep_alive_timeout;
  absl::Duration read_timeout;
  absl::Duration write_timeout;
  HttpConnectionLimits limits;
};

class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(int fd, Transport* transport, const Settings& settings)
      : fd_(fd), transport_(transport), settings_(settings) {}

  bool stopping() const { return settings_.listening->load() == INVALID_SOCKET; }

  // True when a request's first bytes (or the end of the stream) arrive
  // within the keep-alive timeout.
  bool WaitForRequest() {
    return pos_ < len_ || transport_->Pending() ||
           Wait(POLLIN, absl::Now() + settings_.keep_alive_timeout, /*stop_aborts=*/true);
  }

  void BeginRequest() {
    in_head_ = true;
    chunked_ = false;
    body_length_ = 0;
    body_read_ = 0;
    head_bytes_ = 0;
    line_ended_ = false;
    body_line_bytes_ = 0;
    head_deadline_ = absl::Now() + settings_.limits.head_timeout;
  }
  // httplib has parsed the request line and headers.
  void EndHead(const httplib::Request& req) {
    in_head_ = false;
    body_read_ = 0;
    chunked_ = absl::EqualsIgnoreCase(req.get_header_value("Transfer-Encoding"), "chunked");
    body_length_ = req.get_header_value<uint64_t>("Content-Length");
  }
  // The request's body was not (or may not have been) read to its end, so
  // what follows on the connection is not a request: a handler answered
  // before reading it, or the read failed. Chunked bodies count as unread.
  bool body_unread() const { return !in_head_ && (chunked_ || body_read_ < body_length_); }

  void ReleaseWhenAnswered(std::function<void()> release) {
    releases_.push_back(std::move(release));
  }
  void RunReleases() {
    std::vector<std::function<void()>> releases;
    releases.swap(releases_);
    for (const auto& release : releases) release();
  }

  // `refused`: the response refused the request, whose body may be unread.
  void CloseAfterResponse(bool refused) {
    close_after_response_ = true;
    linger_ = linger_ || refused;
  }
  // After a request: the connection is to end. A request answered while its
  // head was still being read (httplib refused the head: 400, 414) leaves
  // the stream at an unknown point too.
  bool closing() const { return close_after_response_ || ends_mid_request(); }
  // The connection ends with what the client sent perhaps unread.
  bool ends_mid_request() const { return linger_ || refused_ || in_head_ || body_unread(); }

  // The TLS handshake, within the head timeout from now.
  bool Handshake(TlsTransport* tls) {
    const absl::Time deadline = absl::Now() + settings_.limits.head_timeout;
    for (;;) {
      short wait = 0;
      const ssize_t r = tls->Accept(&wait);
      if (r == 0) return true;
      if (r != kWouldBlock || !Wait(wait, deadline, /*stop_aborts=*/true)) return false;
    }
  }

  // Reads and drops what the client still sends, within kLingerTime and
  // kLingerBytes, so that it can read the answer before the connection closes.
  void Linger() {
    ::shutdown(fd_, SHUT_WR);
    const absl::Time deadline = absl::Now() + kLingerTime;
    size_t dropped = 0;
    char sink[16 * 1024];
    while (dropped < kLingerBytes && Wait(POLLIN, deadline, /*stop_aborts=*/true)) {
      const ssize_t n = ::recv(fd_, sink, sizeof(sink), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return;
      if (n > 0) dropped += static_cast<size_t>(n);
    }
  }

  bool is_readable() const override {
    return pos_ < len_ || transport_->Pending() ||
           Wait(POLLIN, absl::Now() + settings_.read_timeout, /*stop_aborts=*/false);
  }
  bool is_writable() const override {
    return !refused_ && Wait(POLLOUT, absl::Now() + settings_.write_timeout, false);
  }

  ssize_t read(char* data, size_t size) override {
    if (refused_) return -1;
    if (size == 0) return 0;
    const size_t max_head = settings_.limits.max_head_bytes;
    size_t allowed = size;
    if (in_head_) {
      if (head_bytes_ >= max_head) {
        return line_ended_ ? Refuse(431, "Request Header Fields Too Large",
                                    absl::StrCat("request head: over ", max_head, " bytes"))
                           : Refuse(414, "URI Too Long",
                                    absl::StrCat("request line: over ", max_head, " bytes"));
      }
      allowed = std::min(size, max_head - head_bytes_);
    } else if (size == 1 && body_line_bytes_ >= max_head) {
      // httplib reads lines a byte at a time; in a body those are a chunked
      // body's size lines.
      return Refuse(400, "Bad Request",
                    absl::StrCat("request body: a chunk size line over ", max_head, " bytes"));
    }
    if (pos_ == len_) {
      const ssize_t filled = Fill();
      if (filled <= 0) return filled;
    }
    const size_t n = std::min(allowed, len_ - pos_);
    std::memcpy(data, buffer_ + pos_, n);
    pos_ += n;
    if (in_head_) {
      head_bytes_ += n;
      if (!line_ended_ && std::memchr(data, '\n', n) != nullptr) line_ended_ = true;
    } else {
      body_read_ += n;
      if (size == 1) body_line_bytes_ = *data == '\n' ? 0 : body_line_bytes_ + 1;
    }
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* data, size_t size) override {
    if (refused_) return -1;
    return Send(data, size);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    Address(::getpeername, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    Address(::getsockname, ip, port);
  }
  socket_t socket() const override { return fd_; }

 private:
  // True once `fd_` is ready for `events` (or has failed: the next call says
  // how); false at `deadline`, or when the server stops if `stop_aborts`.
  bool Wait(short events, absl::Time deadline, bool stop_aborts) const {
    for (;;) {
      if (stop_aborts && stopping()) return false;
      absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      if (stop_aborts) left = std::min(left, kStopPoll);
      pollfd p{fd_, events, 0};
      const int r = ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
      if (r > 0) return true;
      if (r < 0 && errno != EINTR) return false;
    }
  }

  // Refills the buffer: bytes read, 0 at the end of the stream, -1 on error or
  // timeout (a head past its deadline is answered 408 first).
  ssize_t Fill() {
    absl::Time deadline = absl::Now() + settings_.read_timeout;
    if (in_head_) deadline = std::min(deadline, head_deadline_);
    for (;;) {
      short wait = 0;
      const ssize_t n = transport_->Recv(buffer_, sizeof(buffer_), &wait);
      if (n >= 0) {
        pos_ = 0;
        len_ = static_cast<size_t>(n);
        return n;
      }
      if (n != kWouldBlock) return -1;
      if (!Wait(wait, deadline, /*stop_aborts=*/in_head_)) {
        if (in_head_ && absl::Now() >= head_deadline_) {
          return Refuse(408, "Request Timeout",
                        absl::StrCat("request head: not complete within ",
                                     absl::FormatDuration(settings_.limits.head_timeout)));
        }
        return -1;
      }
    }
  }

  // Answers `status` with a v2 error body and Connection: close, and fails
  // every later read and write so that httplib gives the connection up.
  ssize_t Refuse(int status, const char* reason, const std::string& message) {
    const std::string body = absl::StrCat("{\"error\":\"", message, "\"}");
    const std::string response = absl::StrCat(
        "HTTP/1.1 ", status, " ", reason,
        "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: ", body.size(),
        "\r\n\r\n", body);
    for (size_t sent = 0; sent < response.size();) {
      const ssize_t n = Send(response.data() + sent, response.size() - sent);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    refused_ = true;
    return -1;
  }

  ssize_t Send(const char* data, size_t size) {
    const absl::Time deadline = absl::Now() + settings_.write_timeout;
    for (;;) {
      short wait = 0;
      const ssize_t n = transport_->Send(data, size, &wait);
      if (n != kWouldBlock) return n;
      if (!Wait(wait, deadline, /*stop_aborts=*/false)) return -1;
    }
  }

  void Address(int (*get)(int, sockaddr*, socklen_t*), std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (get(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return;
    char host[NI_MAXHOST];
    char service[NI_MAXSERV];
    if (getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), service,
                    sizeof(service), NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      port = std::atoi(service);
    }
  }

  const int fd_;
  Transport* const transport_;
  const Settings settings_;
  char buffer_[16 * 1024];
  size_t pos_ = 0;
  size_t len_ = 0;
  bool in_head_ = false;
  size_t head_bytes_ = 0;
  bool line_ended_ = false;  // the head holds a whole request line
  size_t body_line_bytes_ = 0;
  bool chunked_ = false;
  uint64_t body_length_ = 0;  // Content-Length
  uint64_t body_read_ = 0;
  absl::Time head_deadline_ = absl::InfiniteFuture();
  bool refused_ = false;
  bool close_after_response_ = false;
  bool linger_ = false;
  std::vector<std::function<void()>> releases_;  // of the request being served
};

// The connection this thread serves, for the logger (httplib tells its
// logger each response, not the stream it went to).
thread_local ConnectionStream* current_connection = nullptr;

// No request body unless the owner says how large (see the header). Holds of
// a request are released when its response is ready (httplib calls
// the post-routing handler for every response, just before writing it), and
// a response that says `Connection: close` ends its connection whatever the
// request asked (httplib would otherwise read on, a refused body included).
void InstallHooks(httplib::Server& server) {
  server.set_payload_max_length(0);
  server.set_post_routing_handler([](const httplib::Request&, httplib::Response&) {
    if (current_connection != nullptr) current_connection->RunReleases();
  });
  server.set_logger([](const httplib::Request&, const httplib::Response& res) {
    if (current_connection != nullptr && res.get_header_value("Connection") == "close") {
      current_connection->CloseAfterResponse(/*refused=*/res.status >= 400);
    }
  });
}

using ProcessRequest =
    std::function<bool(httplib::Stream&, bool close_connection, bool& connection_closed)>;

// httplib's keep-alive loop, on our stream.
bool ServeRequests(ConnectionStream& stream, const Settings& settings,
                   const ProcessRequest& process) {
  current_connection = &stream;
  bool ok = false;
  for (size_t left = settings.keep_alive_max_count; left > 0 && !stream.stopping(); --left) {
    if (!stream.WaitForRequest()) break;
    stream.BeginRequest();
    struct Released {  // whatever way the request ends
      ConnectionStream* stream;
      ~Released() { stream->RunReleases(); }
    } released{&stream};
    bool closed = false;
    ok = process(stream, left == 1, closed);
    if (!ok || closed || stream.closing()) break;
  }
  current_connection = nullptr;
  return ok;
}

}  // namespace

bool ReleaseWhenAnswered(std::function<void()> release) {
  if (current_connection == nullptr) {
    release();
    return false;
  }
  current_connection->ReleaseWhenAnswered(std::move(release));
  return true;
}

namespace {

void SetNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void CloseSocket(int fd) {
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
}

absl::Duration DurationOf(time_t sec, time_t usec) {
  return absl::Seconds(sec) + absl::Microseconds(usec);
}

}  // namespace

HttpServer::HttpServer(const HttpConnectionLimits& limits) : limits_(limits) {
  InstallHooks(*this);
}

bool HttpServer::process_and_close_socket(socket_t sock) {
  SetNonBlocking(sock);
  const Settings settings{&svr_sock_,
                          keep_alive_max_count_,
                          absl::Seconds(keep_alive_timeout_sec_),
                          DurationOf(read_timeout_sec_, read_timeout_usec_),
                          DurationOf(write_timeout_sec_, write_timeout_usec_),
                          limits_};
  PlainTransport transport(sock);
  ConnectionStream stream(sock, &transport, settings);
  const bool ok =
      ServeRequests(stream, settings, [&](httplib::Stream& s, bool close, bool& closed) {
        return process_request(s, close, closed,
                               [&](httplib::Request& req) { stream.EndHead(req); });
      });
  if (stream.ends_mid_request()) stream.Linger();
  CloseSocket(sock);
  return ok;
}

HttpsServer::HttpsServer(const std::function<bool(SSL_CTX& ctx)>& setup_ssl_ctx,
                         const HttpConnectionLimits& limits)
    : httplib::SSLServer(setup_ssl_ctx), limits_(limits) {
  InstallHooks(*this);
}

bool HttpsServer::process_and_close_socket(socket_t sock) {
  SetNonBlocking(sock);
  const Settings settings{&svr_sock_,
                          keep_alive_max_count_,
                          absl::Seconds(keep_alive_timeout_sec_),
                          DurationOf(read_timeout_sec_, read_timeout_usec_),
                          DurationOf(write_timeout_sec_, write_timeout_usec_),
                          limits_};
  bool ok = false;
  SSL* ssl = SSL_new(ssl_context());
  if (ssl != nullptr && SSL_set_fd(ssl, sock) == 1) {
    TlsTransport transport(ssl);
    ConnectionStream stream(sock, &transport, settings);
    if (stream.Handshake(&transport)) {
      ok = ServeRequests(stream, settings, [&](httplib::Stream& s, bool close, bool& closed) {
        return process_request(s, close, closed, [&](httplib::Request& req) {
          req.ssl = ssl;
          stream.EndHead(req);
        });
      });
      transport.Shutdown();
      if (stream.ends_mid_request()) stream.Linger();
    }
  }
  if (ssl != nullptr) SSL_free(ssl);
  ERR_clear_error();
  CloseSocket(sock);
  return ok;
}

}  // namespace attnserve
