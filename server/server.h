// AttnServer: the attnserve gRPC server as an object (Create/Start/Shutdown),
// used by main.cc and by tests that start a real server on 127.0.0.1:0.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "server/auth/authenticator.h"
#include "server/kserve/frontend.h"
#include "server/kv/handoff.h"
#include "server/security/tls_files.h"
#include "server/stream_flow_control.h"

namespace attnserve {

struct ServerOptions {
  std::string host = "0.0.0.0";
  int port = 50051;  // 0: pick a free port; AttnServer::port() tells which
  BackendOptions backend;
  // Largest ForwardRequest accepted, in bytes (also the gRPC receive limit).
  int64_t max_request_bytes = int64_t{1} << 30;
  // Every byte the server buffers for callers, server-wide: gRPC's receive
  // buffers (its ResourceQuota), what all streams hold together and HTTP
  // bodies with their parsed tensors, and what UCX transfers and pushes hold,
  // split by SplitBufferedBytes (server/buffered_shares.h).
  // 0: DefaultMaxBufferedBytes().
  int64_t max_buffered_bytes = 0;
  // Largest B*Sq + B*Sk (dense) or Tq + Tk (varlen) accepted.
  int64_t max_tokens = int64_t{1} << 22;
  // Requests admitted but not yet started; beyond it RESOURCE_EXHAUSTED.
  int max_queue_size = 256;
  // A backend call running longer than this marks its device as not
  // answering (ExecutorOptions::launch_timeout); infinite: never.
  absl::Duration launch_timeout = absl::Minutes(5);
  // Small calls that find their device idle run on the receiving thread
  // (ExecutorOptions::inline_max_cost). Off here so in-process servers (tests
  // that hold a backend) keep every call on the executor; main.cc turns it on.
  int64_t inline_max_cost = 0;
  // Prometheus /metrics over HTTP (metrics.h) on metrics_host:metrics_port;
  // port 0 picks a free one (AttnServer::metrics_port() tells which). Off by
  // default here so in-process servers (tests) bind nothing extra; main.cc
  // turns it on (--metrics_port, default 8002).
  // Dynamic ragged batching (ExecutorOptions): on by default.
  bool batching = true;
  absl::Duration batch_max_delay = absl::Microseconds(500);
  int64_t batch_max_tokens = 65536;
  // Every call batch-invariant (ExecutorOptions::batch_invariant).
  bool batch_invariant = false;
  // K/V caches (kv.proto, docs/kv-cache.md): each device's K/V byte budget,
  // shared by its caches; the page size when CreateCache leaves it 0; idle
  // sequences and caches expire after kv_idle_timeout (zero: never).
  int64_t kv_cache_bytes = int64_t{1} << 30;
  int kv_page_size = 64;
  absl::Duration kv_idle_timeout = absl::Minutes(10);
  // A cut K/V import's staged rows wait this long for a resume with the same
  // transfer_id (docs/kv-transfer.md); zero: until the server stops.
  absl::Duration kv_import_idle_timeout = absl::Seconds(60);
  // Caches created before the server listens: --kv_startup_cache's text,
  // parsed by ParseStartupCaches (server/kv/startup_cache.h). Kept as text so
  // this header does not pull the K/V pool's types into every client of the
  // server (the client library has its own KvClientGeometry and KvClientStep). A bad
  // spec, or a cache the pool refuses, fails Start with its message.
  std::string kv_startup_cache;
  bool metrics_enabled = false;
  // What one stream (ForwardStream, ModelStreamInfer, AppendAttendStream) may
  // hold before the server stops reading it
  // (stream_flow_control.h; --stream_max_pending_requests/_bytes).
  StreamLimits stream;
  std::string metrics_host = "0.0.0.0";
  int metrics_port = 8002;
  // The KServe v2 / Triton front-end (server/kserve/frontend.h): its gRPC
  // service is always on the native port; shared memory and HTTP/REST are
  // opt-in.
  KserveOptions kserve;
  // Transport security (server/security/): TLS on every port (gRPC, KServe
  // HTTP, /metrics) when tls.cert_file is set, mutual with a client CA.
  TlsFiles tls;
  // Bearer tokens and tenants (server/auth/): off when tokens_file is empty.
  AuthOptions auth;
  // --handoff_peer (server/kv/handoff.h): on Shutdown the K/V caches move to
  // the peer before the server stops, and a cache missing here is fetched
  // from it. Off when handoff.peer is empty.
  HandoffOptions handoff;
  // AppendAttend steps over UCX (server/ucx/, docs/ucx.md) on ucx_host:ucx_port:
  // 0 off; -1 any free port (AttnServer::ucx_port() tells which). Needs a
  // build with UCX (cmake/ucx.cmake); without it a port other than 0 fails Start.
  int ucx_port = 0;
  std::string ucx_host = "127.0.0.1";
};

// This build's version (--version, the start-up log, GetServerInfo).
const char* AttnServeVersion();

// Half the machine's physical memory (what --max_buffered_bytes defaults to),
// at least 1 GiB.
int64_t DefaultMaxBufferedBytes();

class AttnServer {
 public:
  // Builds the backend named by options.backend.
  static absl::StatusOr<std::unique_ptr<AttnServer>> Create(const ServerOptions& options);
  // Runs on the given backend (tests inject one).
  static absl::StatusOr<std::unique_ptr<AttnServer>> Create(
      const ServerOptions& options, std::unique_ptr<AttentionBackend> backend);
  // Runs on several backends of one kind (one per GPU), each with its own
  // executor; requests go to the least-loaded (ExecutorPool).
  static absl::StatusOr<std::unique_ptr<AttnServer>> Create(
      const ServerOptions& options, std::vector<std::unique_ptr<AttentionBackend>> backends);

  virtual ~AttnServer() = default;

  // Binds and starts serving; health turns SERVING once this returns OK.
  virtual absl::Status Start() = 0;
  // The bound port (after Start).
  virtual int port() const = 0;
  // Health NOT_SERVING, new requests UNAVAILABLE, in-flight ones finished
  // (up to `grace`), then the gRPC server stops. Safe to call twice.
  virtual void Shutdown(absl::Duration grace) = 0;
  // Blocks until Shutdown has completed.
  virtual void Wait() = 0;
  // Requests admitted but not yet started (monitoring, and tests that need a
  // request to be known queued before they go on).
  virtual int queued_requests() const = 0;
  // The bound metrics port after Start, or 0 when metrics are off.
  virtual int metrics_port() const = 0;
  // The bound KServe v2 HTTP port after Start, or 0 when it is off.
  virtual int http_port() const { return 0; }
  // The bound UCX port after Start, or 0 when UCX is off.
  virtual int ucx_port() const { return 0; }
};

}  // namespace attnserve
