// The KServe v2 protocol's HTTP/REST side (Triton's endpoints and JSON), on a
// port of its own: health (/v2/health/live, /v2/health/ready, for Kubernetes
// probes), server and model metadata, model config, statistics, repository
// index, inference with JSON tensors and the binary-tensor extension, and the
// shared-memory endpoints. Every call is turned into the same messages the
// gRPC side uses and answered by the same models (context.h), so limits and
// errors match; errors are {"error": message} with an HTTP status for the
// code. Uses cpp-httplib; a build without it (a static one) answers
// UNIMPLEMENTED from Start.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/kserve/context.h"
#include "server/security/tls_files.h"

namespace attnserve {

class KserveHttpServer {
 public:
  // Binds host:port (0 picks a free one) and serves `context`, which must
  // outlive the server; HTTPS when `tls` is set. Bodies over `max_request_bytes` (plus the same
  // slack the gRPC limit has) are refused with 413. UNAVAILABLE when it cannot bind.
  static absl::StatusOr<std::unique_ptr<KserveHttpServer>> Start(const std::string& host, int port,
                                                                 int64_t max_request_bytes,
                                                                 KserveContext* context,
                                                                 const TlsFiles& tls = {});
  virtual ~KserveHttpServer() = default;
  virtual int port() const = 0;
  // Stops listening and waits for the listener; idempotent.
  virtual void Stop() = 0;
};

// The HTTP status a v2 error with `code` is answered with.
int HttpStatusFor(absl::StatusCode code);

}  // namespace attnserve
