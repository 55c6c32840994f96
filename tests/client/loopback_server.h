// The in-process server the client tests talk to: an AttnServer on the CPU
// backend (2 threads) listening on 127.0.0.1:0, drained (up to 5 s) when the
// object goes away. One per test suite: start it in SetUpTestSuite.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/server.h"

namespace attnserve {

class LoopbackServer {
 public:
  // A started server, or why it could not start. `allow_client_shm`: KServe
  // v2 shared-memory registration (--allow_client_shm).
  static absl::StatusOr<std::unique_ptr<LoopbackServer>> Start(bool allow_client_shm = false) {
    ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.backend.kind = "cpu";
    options.backend.cpu_threads = 2;
    options.kserve.allow_client_shm = allow_client_shm;
    absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(options);
    if (!server.ok()) return server.status();
    std::unique_ptr<LoopbackServer> loopback(new LoopbackServer(*std::move(server)));
    const absl::Status started = loopback->server_->Start();
    if (!started.ok()) return started;
    return loopback;
  }

  ~LoopbackServer() { server_->Shutdown(absl::Seconds(5)); }

  LoopbackServer(const LoopbackServer&) = delete;
  LoopbackServer& operator=(const LoopbackServer&) = delete;

  int port() const { return server_->port(); }
  // "127.0.0.1:<port>", a gRPC target.
  std::string target() const { return absl::StrCat("127.0.0.1:", port()); }

 private:
  explicit LoopbackServer(std::unique_ptr<AttnServer> server) : server_(std::move(server)) {}

  std::unique_ptr<AttnServer> server_;
};

}  // namespace attnserve
