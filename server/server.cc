// AttnServer: wires backend, executor, front-end, health and reflection into a
// grpc::Server, and drains it on Shutdown; see server.h.
#include "server/server.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "backend/make_params.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/auth/call_admission.h"
#include "server/buffered_shares.h"
#include "server/core/attention_runner.h"
#include "server/core/kv_runner.h"
#include "server/executor.h"
#include "server/executor_pool.h"
#include "server/gpu_monitor.h"
#include "server/kv/handoff.h"
#include "server/kv/kv_pool.h"
#include "server/kv/kv_transfer.h"
#include "server/kv/startup_cache.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/native/attention_service.h"
#include "server/native/kv_moved.h"
#include "server/native/kv_service.h"
#include "server/native/kv_transfer_service.h"
#include "server/native/shm_service.h"
#include "server/security/grpc_credentials.h"
#include "server/tenant.h"
#include "server/ucx/kv_steps.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// Headroom above max_request_bytes for the gRPC receive limit, so a request
// just over the limit reaches validation and gets the message that names
// --max_request_bytes instead of gRPC's generic one.
constexpr int64_t kReceiveSlackBytes = 64 * 1024;

// After draining, how long gRPC gets to close connections and streams that
// have nothing left in flight.
constexpr absl::Duration kMinStopTime = absl::Milliseconds(200);

const char kServiceName[] = "attnserve.v1.Attention";

std::string ListenAddress(const std::string& host, int port) {
  // An IPv6 literal needs brackets before ":port".
  if (absl::StrContains(host, ':') && !absl::StartsWith(host, "[")) {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

// The budget in force: the option, or the machine's default.
int64_t BufferedBytesOf(const ServerOptions& o) {
  return o.max_buffered_bytes > 0 ? o.max_buffered_bytes : DefaultMaxBufferedBytes();
}

// The budget's shares (server/buffered_shares.h).
BufferedShares SharesOf(const ServerOptions& o) { return SplitBufferedBytes(BufferedBytesOf(o)); }

// The stream limits with the server-wide total: the streams' share.
StreamLimits StreamLimitsOf(const ServerOptions& o) {
  StreamLimits limits = o.stream;
  limits.max_total_bytes = SharesOf(o).streams;
  return limits;
}

absl::Status CheckOptions(const ServerOptions& o) {
  if (o.kserve.shm_limits.max_regions < 0 || o.kserve.shm_limits.max_regions_per_tenant < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_shm_regions, max_shm_regions_per_tenant: expected >= 0 (0: no limit), got ",
        o.kserve.shm_limits.max_regions, " and ", o.kserve.shm_limits.max_regions_per_tenant));
  }
  if (o.max_buffered_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_buffered_bytes: expected >= 0 (0: the default), got ", o.max_buffered_bytes));
  }
  if (o.port < 0 || o.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("port: expected 0..65535, got ", o.port));
  }
  if (o.max_request_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_request_bytes: expected > 0, got ", o.max_request_bytes));
  }
  if (o.max_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: expected > 0, got ", o.max_tokens));
  }
  if (o.metrics_enabled && (o.metrics_port < 0 || o.metrics_port > 65535)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_port: expected 0..65535, got ", o.metrics_port));
  }
  if (o.batching && (o.batch_max_tokens <= 0 || o.batch_max_delay < absl::ZeroDuration())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch_max_tokens: expected > 0 (got ", o.batch_max_tokens,
        ") and batch_max_delay >= 0 (got ", absl::FormatDuration(o.batch_max_delay), ")"));
  }
  if (o.kserve.http_enabled && (o.kserve.http_port < 0 || o.kserve.http_port > 65535)) {
    return absl::InvalidArgumentError(
        absl::StrCat("http_port: expected 0..65535, got ", o.kserve.http_port));
  }
  if (o.max_queue_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queue_size: expected > 0, got ", o.max_queue_size));
  }
  if (o.kv_cache_bytes <= 0 || o.kv_page_size < kMinPageSize || o.kv_page_size > kMaxPageSize ||
      (o.kv_page_size & (o.kv_page_size - 1)) != 0 || o.kv_idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_cache_bytes: expected > 0 (got ", o.kv_cache_bytes,
        "), kv_page_size: expected a power of two in [16, 256] (got ", o.kv_page_size,
        "), kv_idle_timeout: expected >= 0 (got ", absl::FormatDuration(o.kv_idle_timeout), ")"));
  }
  if (o.kv_import_idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("kv_import_idle_timeout: expected >= 0, got ",
                                                   absl::FormatDuration(o.kv_import_idle_timeout)));
  }
  RETURN_IF_ERROR(CheckTlsFiles(o.tls));
  return CheckStreamLimits(o.stream);
}

// Loopback addresses only this host can reach.
bool IsLoopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || absl::StartsWith(host, "127.");
}

// The KServe options with the server's TLS files (every port shares them).
KserveOptions KserveOptionsOf(const ServerOptions& o) {
  KserveOptions k = o.kserve;
  k.tls = o.tls;
  // HTTP bodies share the streams' share of the budget.
  k.max_buffered_bytes = SharesOf(o).streams;
  return k;
}

// Runs one tiny request through the executor, so health turns SERVING only
// once the backend has computed something (a CUDA context exists, kernels
// load). It uses the backend's first dtype and a head dim it lists; a backend
// that still cannot implement it (UNIMPLEMENTED) is not an error.
absl::Status WarmUp(Executor* executor, const BackendDescription& d) {
  const std::string where =
      d.devices.empty() ? std::string() : absl::StrCat(" on device ", d.devices.front().index);
  constexpr int kRows = 4;
  const DType dtype = d.dtypes.empty() ? DType::kFP32 : d.dtypes.front();
  const int dim =
      (d.min_head_dim <= 64 && 64 <= d.max_head_dim && 64 % std::max(d.head_dim_multiple, 1) == 0)
          ? 64
          : d.min_head_dim;
  // Zero bits are 0.0 in every dtype: uniform attention, a valid input.
  std::vector<uint8_t> inputs(3 * kRows * dim * DTypeSize(dtype), 0);
  std::vector<uint8_t> o(kRows * dim * DTypeSize(dtype));
  std::vector<float> lse(kRows);
  const AttnShape shape = DenseShape(dtype, 1, kRows, kRows, 1, 1, dim);
  AttnPointers pointers;
  pointers.q = inputs.data();
  pointers.k = inputs.data() + kRows * dim * DTypeSize(dtype);
  pointers.v = inputs.data() + 2 * kRows * dim * DTypeSize(dtype);
  pointers.o = o.data();
  pointers.lse = lse.data();
  const AttnParams p = MakeAttnParams(shape, AttnOptions(), pointers);

  absl::Notification done;
  absl::Status result;
  WorkItem item;
  item.params = p;
  item.internal = true;
  item.done = [&](const absl::Status& status, const WorkTimings&) {
    result = status;
    done.Notify();
  };
  RETURN_IF_ERROR(executor->Submit(std::move(item)));
  done.WaitForNotification();
  if (absl::IsUnimplemented(result)) {
    spdlog::warn("backend warm-up{} skipped: {}", where, std::string(result.message()));
    return absl::OkStatus();
  }
  if (!result.ok()) {
    return absl::Status(result.code(),
                        absl::StrCat("backend warm-up", where, " failed: ", result.message()));
  }
  return absl::OkStatus();
}

std::vector<AttentionBackend*> Pointers(const std::vector<std::unique_ptr<AttentionBackend>>& v) {
  std::vector<AttentionBackend*> out;
  for (const auto& b : v) out.push_back(b.get());
  return out;
}

// What GetServerInfo reports: the first backend's description with every
// backend's devices (all backends of one server are of one kind).
BackendDescription Combined(const std::vector<std::unique_ptr<AttentionBackend>>& backends) {
  BackendDescription d = backends.front()->Describe();
  d.devices.clear();
  for (const auto& b : backends) {
    for (const DeviceDescription& dev : b->Describe().devices) d.devices.push_back(dev);
  }
  return d;
}

// Each backend with its executor, for the K/V pool (a cache's calls go to its
// device's executor only).
std::vector<KvDevice> KvDevices(const std::vector<std::unique_ptr<AttentionBackend>>& backends,
                                ExecutorPool* executors) {
  std::vector<KvDevice> devices;
  for (size_t i = 0; i < backends.size(); ++i) {
    const BackendDescription& d = backends[i]->Describe();
    devices.push_back({backends[i].get(), &executors->executor(static_cast<int>(i)),
                       d.devices.empty() ? static_cast<int>(i) : d.devices.front().index});
  }
  return devices;
}

// What the native services report and bound, by name.
ServiceInfo NativeInfo(const ServerOptions& o, StreamGauge* streams, TenantDirectory* tenants,
                       const Authenticator* auth, const std::atomic<int>* ucx_port) {
  ServiceInfo info;
  info.max_request_bytes = o.max_request_bytes;
  info.max_tokens = o.max_tokens;
  info.max_queue_size = o.max_queue_size;
  info.stream_limits = StreamLimitsOf(o);
  info.stream_gauge = streams;
  info.kv_cache = true;
  info.kv_default_page_size = o.kv_page_size;
  info.kv_cache_bytes = o.kv_cache_bytes;
  info.kv_idle_timeout_ms = absl::ToInt64Milliseconds(o.kv_idle_timeout);
  info.tenants = tenants;
  info.auth = auth;
  info.ucx_port = ucx_port;
  return info;
}

// What the KServe v2 front-end reports of this server's set-up. Metadata lists
// q, k, v and o as FP16 when the backend runs it (tools such as perf_analyzer
// generate that type); requests may use any dtype the backend lists.
KserveServerInfo KserveInfo(const ServerOptions& o, const BackendDescription& d) {
  KserveServerInfo info;
  info.backend = d.name;
  const bool fp16 = std::find(d.dtypes.begin(), d.dtypes.end(), DType::kFP16) != d.dtypes.end();
  info.advertised_dtype = fp16 || d.dtypes.empty() ? DType::kFP16 : d.dtypes.front();
  info.batching = o.batching;
  info.batch_max_delay = o.batch_max_delay;
  info.max_request_bytes = o.max_request_bytes;
  info.kv_idle_timeout = o.kv_idle_timeout;
  return info;
}

class AttnServerImpl final : public AttnServer {
 public:
  AttnServerImpl(const ServerOptions& options,
                 std::vector<std::unique_ptr<AttentionBackend>> backends,
                 std::unique_ptr<TenantDirectory> tenants, std::unique_ptr<Authenticator> auth)
      : options_(options),
        backends_(std::move(backends)),
        description_(Combined(backends_)),
        tenants_(std::move(tenants)),
        auth_(std::move(auth)),
        executors_(Pointers(backends_), MakeExecutorOptions(options)),
        runner_(&executors_, description_.name,
                RequestLimits{options.max_request_bytes, options.max_tokens}, &metrics_),
        service_(&runner_, description_,
                 NativeInfo(options, &metrics_.streams(), tenants_.get(), auth_.get(), &ucx_port_)),
        kv_pool_(
            KvPoolOptions{options.kv_cache_bytes, options.kv_page_size, options.kv_idle_timeout},
            KvDevices(backends_, &executors_)),
        kv_runner_(&kv_pool_, description_.name,
                   RequestLimits{options.max_request_bytes, options.max_tokens}, &metrics_),
        kv_service_(&kv_runner_, &metrics_, StreamLimitsOf(options)),
        kv_import_sessions_(&kv_pool_, KvImportOptions{options.kv_import_idle_timeout}),
        kv_transfer_service_(&kv_runner_, &kv_import_sessions_),
        kserve_(&runner_, &kv_runner_, &metrics_, KserveInfo(options, description_),
                KserveOptionsOf(options), StreamLimitsOf(options), [this] {
                  absl::MutexLock lock(&mu_);
                  return state_ == State::kServing;
                }) {
    kv_pool_.set_tenants(tenants_.get());
    kv_service_.set_auth(auth_.get());
    kv_transfer_service_.set_auth(auth_.get());
    kv_transfer_service_.set_tenants(tenants_.get());
    kv_transfer_service_.set_buffered(&ucx_buffered_);
    kserve_.SetAuth(auth_.get(), tenants_.get());
    service_.set_shm(kserve_.shm_registry());
    kv_service_.set_shm(kserve_.shm_registry());
    // A CUDA backend's copies read a page-locked region where it lies.
    kserve_.shm_registry()->set_pin_host_memory(description_.name == "cuda");
    shm_service_.set_auth(auth_.get());
    StartHandoff();
  }

  ~AttnServerImpl() override {
    Shutdown(absl::ZeroDuration());
    Wait();
  }

  // Listen, warm every backend up, start the metrics sources and endpoint,
  // then turn health SERVING. Shutdown may run at any point meanwhile.
  absl::Status Start() override {
    RETURN_IF_ERROR(BeginStart());
    RETURN_IF_ERROR(handoff_error_);
    if (handoff_gate_ != nullptr) {
      spdlog::info("handoff peer {}: caches move there on shutdown, and missing ones come from it",
                   options_.handoff.peer);
    }
    RETURN_IF_ERROR(CreateStartupCaches());
    ASSIGN_OR_RETURN(grpc::Server * server, Listen());
    RETURN_IF_ERROR(WarmUpBackends());
    StartDeviceMetrics();
    // Every port must be this server's alone: one that cannot be bound (another
    // server has it) fails the start, as the gRPC port does.
    absl::Status http = StartMetricsEndpoint();
    if (http.ok()) http = kserve_.StartHttp();
    if (!http.ok()) {
      Shutdown(absl::ZeroDuration());
      return http;
    }
    if (absl::Status ucx = StartUcx(); !ucx.ok()) {
      Shutdown(absl::ZeroDuration());
      return ucx;
    }
    if (MarkServing(server)) LogListening();
    return absl::OkStatus();
  }

  int port() const override { return port_.load(std::memory_order_acquire); }

  void Shutdown(absl::Duration grace) override {
    grpc::Server* server;
    {
      absl::MutexLock lock(&mu_);
      if (state_ == State::kDraining || state_ == State::kStopped) return;
      const bool never_started = state_ == State::kNew;
      state_ = State::kDraining;
      server = server_.get();
      if (never_started) {
        executors_.Shutdown();
        state_ = State::kStopped;
        stopped_.Notify();
        return;
      }
    }
    const absl::Time begin = absl::Now();
    spdlog::info("draining: health NOT_SERVING, refusing new requests, grace {}",
                 absl::FormatDuration(grace));
    // Health first: load balancers that poll it stop routing new work here.
    {
      absl::MutexLock lock(&health_mu_);
      health_server_ = nullptr;  // device health changes no longer turn it back on
    }
    if (server != nullptr) server->GetHealthCheckService()->SetServingStatus(false);
    // Before the executors stop admitting: calls on a cache finish while it
    // waits to move, and the ones that waited are answered moved-to.
    if (handoff_peer_ != nullptr) handoff_peer_->Drain(handoff_gate_.get(), begin + grace);
    executors_.StopAdmitting();
    kv_runner_.StopAdmitting();
    // Every admitted request answered, within the grace period.
    const bool answered =
        service_.WaitForResponses(grace) &&
        kv_service_.WaitForResponses(std::max(begin + grace - absl::Now(), absl::ZeroDuration())) &&
        kserve_.WaitForResponses(std::max(begin + grace - absl::Now(), absl::ZeroDuration())) &&
        executors_.WaitIdle(std::max(begin + grace - absl::Now(), absl::ZeroDuration()));
    // UCX steps in flight are answered (within what is left of the grace) before
    // the executors stop; then its connections close.
    if (ucx_listener_ != nullptr) {
      ucx_listener_->Stop(std::max(begin + grace - absl::Now(), absl::ZeroDuration()));
    }
    if (!answered) spdlog::warn("grace period over with requests still queued, running or unsent");
    // Queued leftovers complete with UNAVAILABLE; a running one finishes.
    executors_.Shutdown();
    // What is left are idle connections and streams with nothing in flight:
    // gRPC gets a moment to flush, then cancels them rather than waiting for
    // clients that poll rarely to acknowledge the GOAWAY.
    if (server != nullptr) server->Shutdown(absl::ToChronoTime(absl::Now() + kMinStopTime));
    spdlog::info("stopped after {}", absl::FormatDuration(absl::Now() - begin));
    // Outside mu_: a v2 HTTP readiness probe being answered takes mu_, and
    // stopping waits for it.
    kserve_.StopHttp();
    absl::MutexLock lock(&mu_);
    // Metrics stay scrapeable through the drain, so its end is visible.
    if (metrics_http_ != nullptr) metrics_http_->Stop();
    state_ = State::kStopped;
    stopped_.Notify();
  }

  void Wait() override { stopped_.WaitForNotification(); }

  int queued_requests() const override { return executors_.queued(); }

  int metrics_port() const override { return metrics_http_port_.load(std::memory_order_acquire); }

  int http_port() const override { return kserve_.http_port(); }

  int ucx_port() const override { return ucx_port_.load(std::memory_order_acquire); }

 private:
  enum class State { kNew, kStarting, kServing, kDraining, kStopped };

  // --handoff_peer: the gate in front of every KvCache call, and the peer
  // it fetches from and drains to (with import sessions of its own).
  void StartHandoff() {
    if (options_.handoff.peer.empty()) return;
    absl::StatusOr<std::unique_ptr<KvPeer>> peer =
        KvPeer::Create(options_.handoff, options_.tls, options_.auth.tokens_file, &kv_pool_,
                       &ucx_buffered_, tenants_.get());
    if (!peer.ok()) {
      handoff_error_ = peer.status();
      return;
    }
    handoff_peer_ = *std::move(peer);
    handoff_gate_ = std::make_unique<KvHandoffGate>(
        &kv_pool_, options_.handoff.peer,
        [peer = handoff_peer_.get()](const KvHandoffGate::Call& call) { return peer->Fetch(call); },
        [peer = handoff_peer_.get(), grace = options_.handoff.fetch_timeout](
            const std::shared_ptr<KvCache>& cache, const std::string& authorization) {
          return peer->Push(cache, absl::Now() + grace, authorization);
        });
    kv_service_.set_handoff(handoff_gate_.get());
  }

  // --kv_startup_cache: before Listen, so no client sees the server without
  // them.
  absl::Status CreateStartupCaches() {
    ASSIGN_OR_RETURN(const std::vector<KvStartupCache> caches,
                     ParseStartupCaches(options_.kv_startup_cache));
    for (const KvStartupCache& c : caches) {
      const std::string tenant = c.tenant.empty() ? std::string(kDefaultTenant) : c.tenant;
      absl::StatusOr<std::shared_ptr<KvCache>> made = kv_pool_.CreateCache(tenant, c.create);
      if (!made.ok()) {
        return absl::Status(made.status().code(),
                            absl::StrCat("--kv_startup_cache: cache '", c.create.cache_id,
                                         "': ", made.status().message()));
      }
      spdlog::info("K/V cache '{}' (tenant {}) created at start-up: {} pages of {} tokens",
                   (*made)->id(), tenant, (*made)->capacity_pages(), (*made)->page_size());
    }
    return absl::OkStatus();
  }

  // kNew -> kStarting, or FAILED_PRECONDITION on a second Start.
  absl::Status BeginStart() {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kNew) return absl::FailedPreconditionError("Start: already called");
    state_ = State::kStarting;
    return absl::OkStatus();
  }

  // Builds the gRPC server and binds the port, health NOT_SERVING until
  // MarkServing. UNAVAILABLE when the address cannot be bound; CANCELLED when
  // Shutdown ran meanwhile (the server is stopped again).
  absl::StatusOr<grpc::Server*> Listen() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();

    grpc::ServerBuilder builder;
    const std::string address = ListenAddress(options_.host, options_.port);
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
        MakeGrpcServerCredentials(options_.tls, auth_.get());
    if (!credentials.ok()) {
      absl::MutexLock lock(&mu_);
      state_ = State::kStopped;
      stopped_.Notify();
      return credentials.status();
    }
    builder.AddListeningPort(address, *credentials, &selected_port_);
    // gRPC sets SO_REUSEPORT by default, so a second server on a busy port
    // would start and silently split the traffic; fail instead.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    // gRPC's own buffers (receive buffers, messages being read) draw on a
    // quota: gRPC's share of the server's buffered budget.
    grpc::ResourceQuota quota("attnserve");
    quota.Resize(static_cast<size_t>(SharesOf(options_).grpc));
    builder.SetResourceQuota(quota);
    // Streams are admitted per tenant from their metadata, before any of
    // their messages is read, and charge what they hold to the tenant.
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> admission;
    admission.push_back(std::make_unique<CallAdmission>(
        auth_.get(), tenants_.get(), &metrics_.streams(), options_.stream.max_streams_per_tenant));
    builder.experimental().SetInterceptorCreators(std::move(admission));
    builder.SetMaxReceiveMessageSize(static_cast<int>(
        std::min<int64_t>(options_.max_request_bytes + kReceiveSlackBytes, INT_MAX)));
    // Responses are as large as their requests' Q; the client sets its own limit.
    builder.SetMaxSendMessageSize(-1);
    builder.RegisterService(&service_);
    builder.RegisterService(&kv_service_);
    builder.RegisterService(&kv_transfer_service_);
    builder.RegisterService(&shm_service_);
    builder.RegisterService(kserve_.grpc_service());
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (server == nullptr || selected_port_ == 0) {
      absl::MutexLock lock(&mu_);
      state_ = State::kStopped;
      stopped_.Notify();
      return absl::UnavailableError(
          absl::StrCat("could not listen on ", address, " (address in use or not available?)"));
    }
    port_.store(selected_port_, std::memory_order_release);
    grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
    health->SetServingStatus("", false);
    health->SetServingStatus(kServiceName, false);
    grpc::Server* raw_server = server.get();
    bool stopped_meanwhile;
    {
      absl::MutexLock lock(&mu_);
      server_ = std::move(server);
      stopped_meanwhile = state_ != State::kStarting;
    }
    if (stopped_meanwhile) {
      // Shutdown ran before there was a gRPC server to stop; stop it now.
      raw_server->Shutdown(absl::ToChronoTime(absl::Now() + kMinStopTime));
      return absl::CancelledError("Start: Shutdown was called while starting");
    }
    return raw_server;
  }

  // One tiny request through each executor (WarmUp); on failure the server
  // shuts down and Start returns the error.
  absl::Status WarmUpBackends() {
    for (int i = 0; i < executors_.size(); ++i) {
      absl::Status warm = WarmUp(&executors_.executor(i), backends_[i]->Describe());
      if (!warm.ok()) {
        Shutdown(absl::ZeroDuration());
        return warm;
      }
    }
    return absl::OkStatus();
  }

  // The gauges' sources: the executors' queues, the K/V pool, and NVML for
  // GPU devices (serving goes on without them when NVML is missing).
  void StartDeviceMetrics() {
    metrics_.SetPendingSource([this] { return int64_t{executors_.queued()}; });
    metrics_.SetExtraSource([this] {
      std::string text = KvService::RenderMetrics(kv_pool_.Stats()) +
                         kv_transfer_service_.RenderMetrics() + executors_.RenderDeviceGauges() +
                         kserve_.RenderBufferedMetrics();
      AppendFamily(&text, "attnserve_grpc_buffered_bytes_limit", "gauge",
                   "gRPC's ResourceQuota: its share of --max_buffered_bytes",
                   {{"", absl::StrCat(SharesOf(options_).grpc)}});
      if (tenants_ != nullptr) text += tenants_->RenderPrometheus();
      if (handoff_gate_ != nullptr) text += RenderHandoffMetrics(*handoff_gate_);
      return text;
    });
    metrics_.SetDevices(description_.devices);
    if (description_.devices.empty()) return;
    absl::StatusOr<std::unique_ptr<NvmlMonitor>> monitor =
        NvmlMonitor::Create(description_.devices);
    if (monitor.ok()) {
      metrics_.SetDeviceUsageSource(
          [mon = std::shared_ptr<NvmlMonitor>(*std::move(monitor))] { return mon->Read(); });
    } else {
      spdlog::warn("no GPU memory-used or utilisation metrics: {}",
                   std::string(monitor.status().message()));
    }
  }

  // The UCX step listener (--ucx_port, docs/ucx.md). Its data plane is never
  // encrypted, so with TLS on it may only listen on a loopback address.
  absl::Status StartUcx() {
    if (options_.ucx_port == 0) return absl::OkStatus();
#if ATTNSERVE_HAVE_UCX
    if (options_.ucx_port < -1 || options_.ucx_port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("ucx_port: expected 0..65535 (0: off), got ", options_.ucx_port));
    }
    if (options_.tls.enabled() && !IsLoopback(options_.ucx_host)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ucx_host: UCX carries tensors unencrypted; with TLS on, expected a loopback address "
          "(127.0.0.1 or ::1), got '",
          options_.ucx_host, "' (docs/ucx.md)"));
    }
    ucx::ListenerOptions o;
    o.host = options_.ucx_host;
    o.port = std::max(options_.ucx_port, 0);
    o.limits.max_frame_bytes = static_cast<uint64_t>(options_.max_request_bytes);
    o.budget = &ucx_buffered_;
    ASSIGN_OR_RETURN(std::unique_ptr<ucx::Listener> listener, ucx::Listener::Start(o, &ucx_steps_));
    ucx_port_.store(listener->port(), std::memory_order_release);
    ucx_listener_ = std::move(listener);
    kv_transfer_service_.set_data_plane_host(options_.ucx_host);  // K/V imports over UCX
    spdlog::info("UCX steps on {}:{} (UCX_TLS={})", options_.ucx_host, ucx_port(),
                 getenv("UCX_TLS") != nullptr ? getenv("UCX_TLS") : "all");
    if (auth_ == nullptr && !IsLoopback(options_.ucx_host)) {
      spdlog::warn(
          "UCX listens on {} without authentication: anyone who can reach it can run "
          "steps on every cache of the default tenant (docs/ucx.md)",
          options_.ucx_host);
    }
    return absl::OkStatus();
#else
    return absl::FailedPreconditionError(
        "ucx_port: this attnserve was built without UCX (cmake -DATTNSERVE_UCX=ON with "
        "libucx-dev; docs/ucx.md)");
#endif
  }

  // The /metrics endpoint, when enabled; UNAVAILABLE when its port cannot be
  // bound.
  absl::Status StartMetricsEndpoint() {
    if (!options_.metrics_enabled) return absl::OkStatus();
    ASSIGN_OR_RETURN(std::unique_ptr<MetricsHttpServer> http,
                     MetricsHttpServer::Start(options_.metrics_host, options_.metrics_port,
                                              &metrics_, options_.tls));
    metrics_http_port_.store(http->port(), std::memory_order_release);
    absl::MutexLock lock(&mu_);
    metrics_http_ = std::move(http);
    return absl::OkStatus();
  }

  // kStarting -> kServing and health SERVING; false when Shutdown has begun
  // meanwhile (health then stays NOT_SERVING).
  bool MarkServing(grpc::Server* server) {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kStarting) return false;
    state_ = State::kServing;
    absl::MutexLock health_lock(&health_mu_);
    health_server_ = server;
    server->GetHealthCheckService()->SetServingStatus(executors_.healthy() > 0);
    return true;
  }

  ExecutorOptions MakeExecutorOptions(const ServerOptions& options) {
    ExecutorOptions e;
    e.max_queue_size = options.max_queue_size;
    e.metrics = &metrics_;
    e.batching = options.batching;
    e.batch_max_delay = options.batch_max_delay;
    e.batch_max_tokens = options.batch_max_tokens;
    e.batch_invariant = options.batch_invariant;
    e.launch_timeout = options.launch_timeout;
    e.inline_max_cost = options.inline_max_cost;
    e.on_health_change = [this] { OnDeviceHealthChange(); };
    return e;
  }

  // A device stopped or resumed answering (Executor::Healthy): health is
  // SERVING while any device answers (the pool sends work to those), and
  // NOT_SERVING when none does. Runs on an executor thread; health_mu_, not
  // mu_, since Shutdown holds mu_ while it stops the executors.
  void OnDeviceHealthChange() {
    absl::MutexLock lock(&health_mu_);
    const int healthy = executors_.healthy();
    if (healthy < executors_.size()) {
      spdlog::error("{} of {} devices answering", healthy, executors_.size());
    }
    if (health_server_ != nullptr) {
      health_server_->GetHealthCheckService()->SetServingStatus(healthy > 0);
    }
  }

  void LogListening() {
    const BackendDescription& d = description_;
    std::vector<std::string> devices;
    for (const DeviceDescription& dev : d.devices)
      devices.push_back(absl::StrCat(dev.index, ":", dev.name));
    spdlog::info("attnserve {} listening on {}:{} backend={} devices=[{}] cpu_threads={}",
                 ATTNSERVE_VERSION, options_.host, port(), d.name,
                 d.devices.empty() ? std::string("host CPU") : absl::StrJoin(devices, ", "),
                 d.cpu_threads);
    const char* scheme = options_.tls.enabled() ? "https" : "http";
    if (http_port() != 0) {
      spdlog::info("KServe v2 HTTP on {}://{}:{}/v2", scheme, options_.kserve.http_host,
                   http_port());
    }
    if (metrics_port() != 0) {
      spdlog::info("metrics on {}://{}:{}/metrics", scheme, options_.metrics_host, metrics_port());
    }
    const BufferedShares shares = SharesOf(options_);
    spdlog::info(
        "buffered bytes budget {} (--max_buffered_bytes): gRPC {}, streams and HTTP {}, UCX and "
        "pushes {}",
        BufferedBytesOf(options_), shares.grpc, shares.streams, shares.outside);
    LogSecurity();
  }

  // What protects the ports, and a warning when a port others can reach has
  // neither encryption nor authentication (SECURITY.md).
  void LogSecurity() {
    const TlsFiles& tls = options_.tls;
    spdlog::info("security: {}, {}",
                 tls.enabled() ? (tls.mutual() ? "mutual TLS" : "TLS") : "plain text",
                 auth_ != nullptr ? "bearer tokens from " + options_.auth.tokens_file
                                  : std::string("no authentication"));
    if (tls.enabled() || auth_ != nullptr) return;
    if (!IsLoopback(options_.host)) {
      spdlog::warn(
          "listening on {} (--host) in plain text without authentication: anyone who can reach "
          "this host can call every RPC and read every tensor in transit; set "
          "--tls_cert/--tls_key and --auth_tokens_file, or --host=127.0.0.1 (SECURITY.md)",
          options_.host);
    } else if (options_.metrics_enabled && !IsLoopback(options_.metrics_host)) {
      spdlog::warn(
          "/metrics listens on {} (--metrics_host) in plain text: anyone who can reach this host "
          "can read the server's counters; set --metrics_host=127.0.0.1 or TLS (SECURITY.md)",
          options_.metrics_host);
    }
  }

  const ServerOptions options_;
  const std::vector<std::unique_ptr<AttentionBackend>> backends_;
  const BackendDescription description_;
  // Both null when authentication is off; before the services that use them.
  const std::unique_ptr<TenantDirectory> tenants_;
  const std::unique_ptr<Authenticator> auth_;
  // Before the executors and handler, which record into it.
  ServerMetrics metrics_;
  ExecutorPool executors_;
  AttentionRunner runner_;
  AttentionService service_;
  KvPool kv_pool_;  // after the executors its calls run on
  KvRunner kv_runner_;
  KvService kv_service_;
  // Bytes held outside gRPC's and the streams' accounting: UCX steps' frames,
  // UCX K/V imports and exports, --handoff_peer pushes' send windows (before
  // all of them, which charge it).
  ByteBudget ucx_buffered_{SharesOf(options_).outside};
  // KvTransfer (docs/kv-transfer.md): imports waiting for a resume, and the service.
  KvImportSessions kv_import_sessions_;
  KvTransferService kv_transfer_service_;
  // --handoff_peer: the peer, and the gate (destroyed first: it waits for
  // fetches and gives that use the peer).
  std::unique_ptr<KvPeer> handoff_peer_;
  std::unique_ptr<KvHandoffGate> handoff_gate_;
  absl::Status handoff_error_;
  KserveFrontend kserve_;
  ShmService shm_service_{kserve_.shm_registry()};  // KServe's regions, for the native API
  // The UCX step transport: after the K/V runner its steps run on, so it stops first.
  ucx::KvSteps ucx_steps_{&kv_runner_, auth_.get()};
  std::unique_ptr<ucx::Listener> ucx_listener_;
  std::atomic<int> ucx_port_{0};

  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kNew;
  std::unique_ptr<grpc::Server> server_ ABSL_GUARDED_BY(mu_);
  // Set while serving: where device health changes go (OnDeviceHealthChange).
  absl::Mutex health_mu_;
  grpc::Server* health_server_ ABSL_GUARDED_BY(health_mu_) = nullptr;
  int selected_port_ = 0;  // written by BuildAndStart, in Start
  // Readable from any thread once bound (while Start still warms up).
  std::atomic<int> port_{0};
  absl::Notification stopped_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;  // set in Start, stopped in Shutdown
  std::atomic<int> metrics_http_port_{0};
};

// AttnServer::Create's common part, for options CheckOptions accepted.
absl::StatusOr<std::unique_ptr<AttnServer>> CreateChecked(
    const ServerOptions& options, std::vector<std::unique_ptr<AttentionBackend>> backends) {
  if (backends.empty()) return absl::InvalidArgumentError("backend: expected a backend, got none");
  for (const auto& b : backends) {
    if (b == nullptr) return absl::InvalidArgumentError("backend: expected a backend, got null");
  }
  std::unique_ptr<TenantDirectory> tenants;
  std::unique_ptr<Authenticator> auth;
  if (!options.auth.tokens_file.empty()) {
    tenants = std::make_unique<TenantDirectory>();
    ASSIGN_OR_RETURN(auth, Authenticator::Create(options.auth, tenants.get()));
  }
  return std::unique_ptr<AttnServer>(
      new AttnServerImpl(options, std::move(backends), std::move(tenants), std::move(auth)));
}

}  // namespace

const char* AttnServeVersion() { return ATTNSERVE_VERSION; }

int64_t DefaultMaxBufferedBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  const int64_t physical =
      pages > 0 && page_size > 0 ? int64_t{pages} * int64_t{page_size} : int64_t{8} << 30;
  return std::max<int64_t>(physical / 2, int64_t{1} << 30);
}

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Create(const ServerOptions& options) {
  // Options first: a bad flag should not wait for (or fail as) a GPU's start-up.
  RETURN_IF_ERROR(CheckOptions(options));
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<AttentionBackend>> backends,
                   MakeBackends(options.backend));
  return CreateChecked(options, std::move(backends));
}

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Create(
    const ServerOptions& options, std::unique_ptr<AttentionBackend> backend) {
  std::vector<std::unique_ptr<AttentionBackend>> backends;
  backends.push_back(std::move(backend));
  return Create(options, std::move(backends));
}

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Create(
    const ServerOptions& options, std::vector<std::unique_ptr<AttentionBackend>> backends) {
  RETURN_IF_ERROR(CheckOptions(options));
  return CreateChecked(options, std::move(backends));
}

}  // namespace attnserve
