// attnserve: the attention service binary. Parses flags, starts AttnServer and
// drains it on SIGINT/SIGTERM (exit 0 once in-flight requests have finished).
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "common/malloc_tuning.h"
#include "server/kv/startup_cache.h"
#include "server/native/kv_transfer_service.h"
#include "server/server.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on (0.0.0.0: all IPv4; [::]: all)");
ABSL_FLAG(int, port, 50051, "Port to listen on; 0 picks a free one (logged at startup)");
ABSL_FLAG(std::string, backend, "auto",
          "Compute backend: auto (CUDA if a GPU is usable, else CPU), cpu or cuda");
ABSL_FLAG(int, threads, 0, "Worker threads of the CPU backend; 0 = one per hardware thread");
ABSL_FLAG(std::string, devices, "all",
          "GPUs the CUDA backend serves on: \"all\" visible ones, or CUDA indices such as 0,1. "
          "One executor per GPU; each request goes to the least-loaded");
ABSL_FLAG(int, cpu_devices, 1,
          "The CPU backend as this many devices, numbered from 0, sharing --threads: each "
          "has its own executor and K/V pool (what CI runs where a server has several GPUs)");
ABSL_FLAG(int64_t, max_request_bytes, int64_t{1} << 30,
          "Largest ForwardRequest accepted, in bytes (also the gRPC receive limit)");
ABSL_FLAG(int64_t, max_buffered_bytes, 0,
          "Every byte the server buffers for callers, over all of them: a quarter for gRPC's own "
          "receive buffers (a gRPC ResourceQuota), half for what streams hold and HTTP bodies "
          "with their parsed JSON tensors, a quarter for UCX frames, UCX K/V imports and exports "
          "and --handoff_peer pushes; over it streams stop being read, HTTP requests are refused "
          "(429, or 413 by Content-Length) and UCX transfers RESOURCE_EXHAUSTED. 0 = half the "
          "machine's memory");
ABSL_FLAG(int64_t, max_tokens, int64_t{1} << 22,
          "Largest B*Sq + B*Sk (dense) or Tq + Tk (varlen) accepted");
ABSL_FLAG(bool, batching, true,
          "Dynamic ragged batching: pack queued requests with the same dtype, heads, head dim and "
          "options into one varlen launch (--nobatching or --batching=false: one launch each)");
ABSL_FLAG(int64_t, batch_max_delay_us, 500,
          "Longest a batch that already has company waits for more requests, in microseconds");
ABSL_FLAG(int64_t, batch_max_tokens, 65536,
          "Most Tq + Tk rows in one packed launch; a larger request runs alone");
ABSL_FLAG(bool, batch_invariant, false,
          "Every call batch-invariant (AttentionOptions.batch_invariant): a request's output "
          "bytes do not depend on what else is batched with it, at some cost in speed");
ABSL_FLAG(int, metrics_port, 8002,
          "Port of the Prometheus /metrics HTTP endpoint (Triton's metric names); 0 = off");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0", "Address the /metrics endpoint listens on");
ABSL_FLAG(int, http_port, 8000,
          "Port of the KServe v2 / Triton HTTP/REST endpoints (/v2/...; Triton's default 8000), "
          "on --host; 0 = off. The v2 gRPC service is always on --port");
ABSL_FLAG(int64_t, max_shm_regions, 1024,
          "KServe shared-memory regions registered at once over all tenants (each system region "
          "holds one mapping and one open descriptor); 0 = no limit");
ABSL_FLAG(int64_t, max_shm_regions_per_tenant, 256,
          "KServe shared-memory regions one tenant may hold at once (a lower shm_regions quota "
          "applies too); 0 = no limit");
ABSL_FLAG(bool, allow_client_shm, false,
          "Let KServe v2 clients register shared-memory regions (system: a POSIX shm key; CUDA: "
          "an IPC handle) for tensors. Off by default because a client then makes this server "
          "map and write memory it names by key, which only makes sense for trusted clients on "
          "the same host");
ABSL_FLAG(int, max_queue_size, 256,
          "Requests admitted but not yet started, per device; beyond it RESOURCE_EXHAUSTED "
          "(a tenant below its share of the queue is still admitted)");
ABSL_FLAG(absl::Duration, launch_timeout, absl::Minutes(5),
          "A device call (a launch) running longer than this marks the device as not answering: "
          "its queued requests fail with UNAVAILABLE, new ones go to the other devices, health "
          "is NOT_SERVING when no device answers, and the device serves again as soon as the "
          "call returns; 'inf' = never");
ABSL_FLAG(int64_t, inline_max_cost, int64_t{1} << 22,
          "A request whose device is idle (nothing queued or running) and whose estimated "
          "work is at most this (cost units: bytes moved, or FLOPs / 64 when larger; a K/V "
          "step's context counted) runs on the thread that received it instead of waking the "
          "device's executor threads; 0 = always hand it to them");
ABSL_FLAG(int, stream_max_pending_requests, 64,
          "Stream flow control (ForwardStream, ModelStreamInfer, AppendAttendStream): requests "
          "one stream may hold (read and not yet answered, or answered and not yet sent to the "
          "client); at this many the server stops reading the stream until responses have gone "
          "out");
ABSL_FLAG(int64_t, max_streams_per_tenant, 64,
          "Streams (ForwardStream, ModelStreamInfer, AppendAttendStream) one tenant may have "
          "open at once; one more is refused with RESOURCE_EXHAUSTED before any of its messages "
          "is read. What a tenant's streams hold together pauses them at its bytes_in_flight "
          "quota; 0 = no cap");
ABSL_FLAG(int64_t, stream_max_pending_bytes, int64_t{256} << 20,
          "Stream flow control: bytes one stream may hold (its unanswered requests and "
          "unsent responses, serialized); at this many the server stops reading the stream. "
          "One stream holds at most this plus one request and its response");
ABSL_FLAG(int64_t, kv_cache_bytes, int64_t{1} << 30,
          "K/V caches (KvCache service): bytes of K/V pages each device may hold over all its "
          "caches; a cache's capacity is a maximum drawn from this on demand");
ABSL_FLAG(int, kv_page_size, 64,
          "K/V caches: tokens per page when CreateCache leaves page_size 0 (a power of two in "
          "[16, 256])");
ABSL_FLAG(absl::Duration, kv_idle_timeout, absl::Minutes(10),
          "K/V caches: sequences and caches unused this long are removed (counted as expired; "
          "clients then see NOT_FOUND and re-prefill); 0 = never");
ABSL_FLAG(absl::Duration, kv_import_idle_timeout, absl::Seconds(60),
          "K/V transfer (KvTransfer.ImportSequences): a cut import's committed sequences stay "
          "live and the rows of the sequence it was receiving wait this long for a resume with "
          "the same transfer_id before their pages go back; 0 = until the server stops");
ABSL_FLAG(std::string, kv_startup_cache, "",
          "K/V caches to create at start-up, for clients that cannot call KvCache.CreateCache "
          "(perf_analyzer, tritonclient driving attention_kv). ';'-separated "
          "ID:layers=L,hkv=H,d=D,dtype=FP16|BF16|FP32,capacity_tokens=N (or capacity_bytes=N)"
          "[,page_size=P][,device=I][,reserve=1][,tenant=T]; e.g. "
          "kv0:layers=1,hkv=16,d=128,dtype=BF16,page_size=64,capacity_tokens=65536. Such a cache "
          "never expires as a whole (its idle sequences do); a bad spec stops start-up");
ABSL_FLAG(std::string, tls_cert, "",
          "TLS: PEM certificate chain (leaf first) served on every port: gRPC, KServe v2 HTTP "
          "and /metrics. Empty: plain text. Re-read when the file changes "
          "(--tls_reload_interval), so a rotated certificate needs no restart");
ABSL_FLAG(std::string, tls_key, "", "TLS: PEM private key of --tls_cert (re-read with it)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "Mutual TLS: PEM CA bundle; every client must present a certificate it signed "
          "(needs --tls_cert). Re-read when the file changes");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Seconds(10),
          "How often the TLS files are checked for a new version (gRPC checks in whole seconds)");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "Bearer tokens: a file of lines '<token> <tenant> [bytes_in_flight=N] [kv_pages=N] "
          "[shm_regions=N]'. Every call then needs 'authorization: Bearer <token>' (gRPC "
          "metadata or HTTP header) or is refused UNAUTHENTICATED (HTTP 401); health, reflection "
          "and KServe ServerLive/ServerReady stay open. The token's tenant scopes K/V caches and "
          "shared-memory regions and is held to its quotas. Re-read when the file changes");
ABSL_FLAG(absl::Duration, auth_reload_interval, absl::Seconds(10),
          "How often --auth_tokens_file is checked for changes");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(30),
          "On SIGINT/SIGTERM, how long in-flight requests get to finish (e.g. 30s, 500ms)");
ABSL_FLAG(std::string, handoff_peer, "",
          "host:port of a peer replica (rolling upgrades, deploy/README.md): on SIGTERM the K/V "
          "caches move there (ImportSequences, as each cache's tenant with the first token the "
          "shared --auth_tokens_file lists for it) and later calls on them are answered "
          "UNAVAILABLE with the trailing metadata x-attnserve-moved-to; a call on a cache this "
          "server lacks first asks the peer to give it back (as the caller). Empty: off");
ABSL_FLAG(std::string, handoff_peer_ca, "",
          "With --tls_cert: PEM roots the peer's certificate must chain to (empty: the "
          "system's); with --tls_client_ca this server's --tls_cert/--tls_key are presented");
ABSL_FLAG(absl::Duration, handoff_linger, absl::Milliseconds(500),
          "After every cache has moved to --handoff_peer, how long the server still answers "
          "moved-to before it stops listening (within --shutdown_grace)");
ABSL_FLAG(std::string, handoff_transport, "auto",
          "What carries the pages of a cache moved to --handoff_peer: auto (UCX when this server "
          "runs with --ucx_port, the operator's opt-in to connect out over UCX, and the peer's "
          "import offers it, i.e. the peer runs with --ucx_port too; else the gRPC stream), ucx "
          "(a peer without UCX fails the move) or grpc");
ABSL_FLAG(int, ucx_port, 0,
          "AppendAttend steps over UCX on this port (docs/ucx.md; UCX_TLS picks the transports: "
          "tcp, sm for same-host shared memory, rc/ud verbs); 0: off. gRPC stays the control "
          "plane; GetServerInfo's kv.ucx_port advertises it");
ABSL_FLAG(std::string, ucx_host, "127.0.0.1",
          "Address the UCX listener binds (UCX carries tensors unencrypted: with --tls_cert "
          "only a loopback address is accepted)");
ABSL_FLAG(int, ucx_max_exports, attnserve::kDefaultUcxMaxExports,
          "UCX exports (ExportSequences with data_plane) running at once on this server; one "
          "more is refused with RESOURCE_EXHAUSTED before anything is reserved; 0: no limit");
ABSL_FLAG(int, ucx_max_exports_per_tenant, attnserve::kDefaultUcxMaxExportsPerTenant,
          "UCX exports running at once per tenant (as --ucx_max_exports); 0: no limit");
ABSL_FLAG(std::string, log_level, "info",
          "Log level: trace, debug, info, warn, error, critical or off");

namespace {

// --help lists this binary's flags (declared here), not every library's.
bool IsOurFlagFile(absl::string_view file) { return absl::StrContains(file, "server/main.cc"); }

bool ParseLogLevel(const std::string& name, spdlog::level::level_enum* level) {
  static const std::vector<std::pair<std::string, spdlog::level::level_enum>> kLevels = {
      {"trace", spdlog::level::trace}, {"debug", spdlog::level::debug},
      {"info", spdlog::level::info},   {"warn", spdlog::level::warn},
      {"error", spdlog::level::err},   {"critical", spdlog::level::critical},
      {"off", spdlog::level::off}};
  for (const auto& [n, l] : kLevels) {
    if (n == name) {
      *level = l;
      return true;
    }
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread starts (the two headers say why each).
  attnserve::TuneMallocForTensors();
  attnserve::UseBoundedMallocArenas();
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = IsOurFlagFile;
  usage.contains_helpshort_flags = IsOurFlagFile;
  usage.version_string = [] {
    return std::string("attnserve ") + attnserve::AttnServeVersion() + "\n";
  };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "fused multi-head attention over gRPC (attnserve.v1.Attention, "
      "grpc.health.v1, reflection).\nUsage: attnserve [--port=50051] [--backend=auto|cpu|cuda] "
      "...");
  absl::ParseCommandLine(argc, argv);

  spdlog::level::level_enum level;
  if (!ParseLogLevel(absl::GetFlag(FLAGS_log_level), &level)) {
    std::fprintf(stderr,
                 "--log_level: expected trace, debug, info, warn, error, critical or off; "
                 "got \"%s\"\n",
                 absl::GetFlag(FLAGS_log_level).c_str());
    return 2;
  }
  spdlog::set_level(level);

  // Block the shutdown signals before any thread starts, so every thread
  // inherits the mask and only sigwait below receives them: the drain then
  // runs on an ordinary thread, not inside a signal handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  attnserve::ServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.backend.kind = absl::GetFlag(FLAGS_backend);
  options.backend.cpu_threads = absl::GetFlag(FLAGS_threads);
  options.backend.devices = absl::GetFlag(FLAGS_devices);
  options.backend.cpu_devices = absl::GetFlag(FLAGS_cpu_devices);
  options.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  options.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  options.max_buffered_bytes = absl::GetFlag(FLAGS_max_buffered_bytes);
  options.max_queue_size = absl::GetFlag(FLAGS_max_queue_size);
  options.launch_timeout = absl::GetFlag(FLAGS_launch_timeout);
  options.inline_max_cost = absl::GetFlag(FLAGS_inline_max_cost);
  options.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  options.kv_page_size = absl::GetFlag(FLAGS_kv_page_size);
  options.kv_idle_timeout = absl::GetFlag(FLAGS_kv_idle_timeout);
  options.kv_import_idle_timeout = absl::GetFlag(FLAGS_kv_import_idle_timeout);
  absl::StatusOr<std::vector<attnserve::KvStartupCache>> startup_caches =
      attnserve::ParseStartupCaches(absl::GetFlag(FLAGS_kv_startup_cache));
  if (!startup_caches.ok()) {
    std::fprintf(stderr, "%s\n", std::string(startup_caches.status().message()).c_str());
    return 2;
  }
  options.kv_startup_cache = absl::GetFlag(FLAGS_kv_startup_cache);  // parsed again at Start
  options.batching = absl::GetFlag(FLAGS_batching);
  options.batch_max_delay = absl::Microseconds(absl::GetFlag(FLAGS_batch_max_delay_us));
  options.batch_max_tokens = absl::GetFlag(FLAGS_batch_max_tokens);
  options.batch_invariant = absl::GetFlag(FLAGS_batch_invariant);
  options.metrics_enabled = absl::GetFlag(FLAGS_metrics_port) != 0;
  options.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.stream.max_pending_requests = absl::GetFlag(FLAGS_stream_max_pending_requests);
  options.stream.max_pending_bytes = absl::GetFlag(FLAGS_stream_max_pending_bytes);
  options.stream.max_streams_per_tenant = absl::GetFlag(FLAGS_max_streams_per_tenant);
  options.kserve.http_enabled = absl::GetFlag(FLAGS_http_port) != 0;
  options.kserve.http_host = absl::GetFlag(FLAGS_host);
  options.kserve.http_port = absl::GetFlag(FLAGS_http_port);
  options.kserve.allow_client_shm = absl::GetFlag(FLAGS_allow_client_shm);
  options.kserve.shm_limits.max_regions = absl::GetFlag(FLAGS_max_shm_regions);
  options.kserve.shm_limits.max_regions_per_tenant =
      absl::GetFlag(FLAGS_max_shm_regions_per_tenant);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.tls.reload_interval = absl::GetFlag(FLAGS_tls_reload_interval);
  options.auth.tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  options.auth.reload_interval = absl::GetFlag(FLAGS_auth_reload_interval);
  options.ucx_port = absl::GetFlag(FLAGS_ucx_port);
  options.ucx_host = absl::GetFlag(FLAGS_ucx_host);
  if (absl::GetFlag(FLAGS_ucx_max_exports) < 0 ||
      absl::GetFlag(FLAGS_ucx_max_exports_per_tenant) < 0) {
    std::fprintf(stderr, "ucx_max_exports, ucx_max_exports_per_tenant: expected >= 0\n");
    return 2;
  }
  attnserve::SetUcxExportLimits(absl::GetFlag(FLAGS_ucx_max_exports),
                                absl::GetFlag(FLAGS_ucx_max_exports_per_tenant));
  options.handoff.peer = absl::GetFlag(FLAGS_handoff_peer);
  options.handoff.peer_ca_file = absl::GetFlag(FLAGS_handoff_peer_ca);
  options.handoff.linger = absl::GetFlag(FLAGS_handoff_linger);
  options.handoff.transport = absl::GetFlag(FLAGS_handoff_transport);
  // A server connects out over UCX only when the operator opted in.
  if (options.handoff.transport == "auto" && options.ucx_port == 0) {
    options.handoff.transport = "grpc";
  }

  // Gives back the free pages malloc's heap keeps (malloc_tuning.h says
  // why); outlives the server.
  attnserve::HeapTrimmer heap_trimmer;
  auto server = attnserve::AttnServer::Create(options);
  if (!server.ok()) {
    spdlog::critical("cannot create server: {}", server.status().ToString());
    return 1;
  }
  absl::Status started = (*server)->Start();
  if (!started.ok()) {
    spdlog::critical("cannot start server: {}", started.ToString());
    return 1;
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("received {}; shutting down", signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  (*server)->Shutdown(absl::GetFlag(FLAGS_shutdown_grace));
  (*server)->Wait();
  return 0;
}
