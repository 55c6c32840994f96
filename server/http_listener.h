// Binds a cpp-httplib server and runs its accept loop on a thread of its own,
// for the HTTP endpoints that live on ports beside gRPC (/metrics, the KServe
// v2 REST side). Include only where ATTNSERVE_HAVE_HTTPLIB is defined.
#pragma once

#include <httplib.h>

#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace attnserve {

class HttpListener {
 public:
  // `server` must outlive the listener.
  explicit HttpListener(httplib::Server* server) : server_(server) {}
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
  int port_ = 0;
  std::thread thread_;
  absl::Notification finished_;  // the accept loop has returned
};

}  // namespace attnserve
