// Binds a cpp-httplib server and runs its accept loop on a thread of its own,
// for the HTTP endpoints that live on ports beside gRPC (/metrics, the KServe
// v2 REST side). Include only where ATTNSERVE_HAVE_HTTPLIB is defined.
//
// cpp-httplib gives each connection a worker thread for as long as it is open
// (waiting for its first request, between keep-alive requests, and while a
// slow client trickles its headers), so a fixed pool of a few threads is held
// by a few idle or slow connections and the probes behind them wait. The
// listener therefore runs a pool that grows on demand up to a large cap, gives
// each connection short read, write and keep-alive timeouts, listens with a
// real backlog, and binds without SO_REUSEPORT so a second server on the same
// port fails instead of splitting the traffic. What one connection may make
// the server hold is bounded by the server classes (server/http_connection.h).
#pragma once

#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace attnserve {

struct HttpListenerOptions {
  // Most connections served at once (one thread each); further connections
  // wait in the queue.
  size_t max_threads = 512;
  // A connection that sends nothing (or nothing more of a request) for this
  // long is closed; a kept-alive connection waits this long for its next
  // request.
  int read_timeout_s = 5;
  int write_timeout_s = 10;
  int keep_alive_timeout_s = 5;
  int listen_backlog = 1024;
};

// An httplib task queue that starts a thread only when no idle one can take
// the connection, up to `max_threads`; threads idle for a while exit again.
class GrowingThreadPool final : public httplib::TaskQueue {
 public:
  explicit GrowingThreadPool(size_t max_threads) : max_threads_(max_threads) {}
  ~GrowingThreadPool() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    std::unique_lock<std::mutex> lock(mu_);
    jobs_.push_back(std::move(fn));
    if (idle_ < jobs_.size() && threads_ < max_threads_) {
      ++threads_;
      std::thread([this] { Work(); }).detach();
    }
    cv_.notify_one();
  }

  void shutdown() override {
    std::unique_lock<std::mutex> lock(mu_);
    shutdown_ = true;
    cv_.notify_all();
    // Workers finish the queued connections (each bounded by the timeouts).
    exited_.wait(lock, [this] { return threads_ == 0; });
  }

 private:
  static constexpr auto kIdleExit = std::chrono::seconds(30);

  void Work() {
    // A write to a connection the client has closed fails with EPIPE instead
    // of killing the process (OpenSSL writes without MSG_NOSIGNAL).
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ++idle_;
      const bool woke =
          cv_.wait_for(lock, kIdleExit, [this] { return shutdown_ || !jobs_.empty(); });
      --idle_;
      if (jobs_.empty() && (shutdown_ || !woke)) break;
      if (jobs_.empty()) continue;
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
    --threads_;
    exited_.notify_all();
  }

  const size_t max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable exited_;
  std::deque<std::function<void()>> jobs_;
  size_t threads_ = 0;
  size_t idle_ = 0;
  bool shutdown_ = false;
};

class HttpListener {
 public:
  // `server` must outlive the listener. Sets the server's task queue,
  // timeouts and socket options.
  explicit HttpListener(httplib::Server* server, const HttpListenerOptions& options = {})
      : server_(server), options_(options) {
    const size_t max_threads = options_.max_threads;
    server_->new_task_queue = [max_threads] { return new GrowingThreadPool(max_threads); };
    server_->set_read_timeout(options_.read_timeout_s, 0);
    server_->set_write_timeout(options_.write_timeout_s, 0);
    server_->set_keep_alive_timeout(options_.keep_alive_timeout_s);
    server_->set_socket_options([this](socket_t sock) {
      // SO_REUSEADDR only (restarts while old connections linger in
      // TIME_WAIT); httplib's default also sets SO_REUSEPORT.
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
      socket_.store(sock, std::memory_order_release);
    });
  }
  ~HttpListener() { Stop(); }

  // Binds host:port (0 picks a free port) and starts listening. UNAVAILABLE,
  // naming `what`, when the address cannot be bound.
  absl::Status Start(const std::string& what, const std::string& host, int port) {
    if (port == 0) {
      port_ = server_->bind_to_any_port(host);
    } else if (server_->bind_to_port(host, port)) {
      port_ = port;
    }
    if (port_ <= 0) {
      return absl::UnavailableError(absl::StrCat(what, ": could not listen on ", host, ":", port,
                                                 " (address in use or not available?)"));
    }
    // httplib listens with a backlog of 5; listening again on the bound
    // socket only raises it, so bursts of connections are not refused.
    if (const socket_t sock = socket_.load(std::memory_order_acquire); sock != INVALID_SOCKET) {
      ::listen(sock, options_.listen_backlog);
    }
    thread_ = std::thread([this] {
      server_->listen_after_bind();
      finished_.Notify();
    });
    return absl::OkStatus();
  }

  int port() const { return port_; }

  // Stops listening and waits for the accept loop; idempotent. httplib's
  // stop() does nothing until the loop has started, so a Stop right after
  // Start (a server shut down at once, on a loaded machine) would leave the
  // loop to start afterwards and block in accept() for ever: ask again until
  // the loop has ended.
  void Stop() {
    if (!thread_.joinable()) return;
    do {
      server_->stop();
    } while (!finished_.WaitForNotificationWithTimeout(absl::Milliseconds(10)));
    thread_.join();
  }

 private:
  httplib::Server* const server_;
  const HttpListenerOptions options_;
  int port_ = 0;
  std::atomic<socket_t> socket_{INVALID_SOCKET};
  std::thread thread_;
  absl::Notification finished_;  // the accept loop has returned
};

}  // namespace attnserve
