// Serves ServerMetrics as Prometheus text on GET /metrics over plain HTTP
// (cpp-httplib), on its own port as Triton does (8002 by default), so the gRPC
// port stays HTTP/2-only. Runs its own small thread pool; the request path
// never touches it.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/metrics.h"
#include "server/security/tls_files.h"

namespace attnserve {

class MetricsHttpServer {
 public:
  // Binds host:port (0 picks a free port) and starts serving `metrics`, which
  // must outlive the server. UNAVAILABLE when the address cannot be bound.
  // HTTPS when `tls` is set (server/security/http_tls.h).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host, int port,
                                                                  const ServerMetrics* metrics,
                                                                  const TlsFiles& tls = {});
  // Stop(), then waits for the listener thread.
  virtual ~MetricsHttpServer() = default;

  // The bound port.
  virtual int port() const = 0;
  // Stops listening; idempotent.
  virtual void Stop() = 0;
};

}  // namespace attnserve
