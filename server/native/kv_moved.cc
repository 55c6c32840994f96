// KvPeer: push, fetch and drain over gRPC; see kv_moved.h.
#include "server/native/kv_moved.h"

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/kv.grpc.pb.h"
#include "attnserve/v1/kv_transfer.grpc.pb.h"
#include "client/kv_transfer.h"
#include "common/cache_id_header.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/auth/tenants.h"
#include "server/metrics.h"
#include "server/native/kv_messages.h"
#include "server/native/kv_transfer_service.h"
#include "server/tenant.h"
#include "server/ucx/kv_bulk.h"
#include "spdlog/spdlog.h"

namespace attnserve {

PushWindow::~PushWindow() {
  if (budget != nullptr) budget->Release(held);
}

absl::StatusOr<std::unique_ptr<PushWindow>> ChargePushWindow(
    const std::string& tenant, const std::string& cache_id, const KvGeometry& geometry,
    int32_t page_size, int64_t pages_used, ByteBudget* budget, TenantDirectory* tenants,
    absl::Time deadline) {
  int64_t allowance = kPushWindowChunks * kDefaultKvChunkBytes;
  if (budget != nullptr && budget->limit() > 0) allowance = std::min(allowance, budget->limit());
  const int64_t quota = tenants != nullptr ? tenants->QuotasOf(tenant).bytes_in_flight : 0;
  if (quota > 0) allowance = std::min(allowance, quota);
  auto w = std::make_unique<PushWindow>();
  w->chunk_target = std::max<int64_t>(1, allowance / kPushWindowChunks);
  // No chunk is larger than the pages the cache uses.
  const int64_t page = KvMaxChunkBytes(geometry, page_size, 1);
  w->chunk_max = std::min(KvMaxChunkBytes(geometry, page_size, w->chunk_target),
                          std::max<int64_t>(1, pages_used) * page);
  w->held = kPushWindowChunks * w->chunk_max;
  bool charged_tenant = false;
  for (int64_t pause_ms = 1;; pause_ms = std::min<int64_t>(pause_ms * 2, 50)) {
    absl::Status refused;
    if (tenants != nullptr && !charged_tenant) {
      absl::StatusOr<InFlightCharge> charge = tenants->ChargeInFlight(tenant, w->held);
      if (charge.ok()) {
        w->tenant = *std::move(charge);
        charged_tenant = true;
      } else {
        refused = charge.status();
      }
    }
    if (refused.ok() && budget != nullptr) {
      if (budget->TryCharge(w->held)) {
        w->budget = budget;
        return w;
      }
      refused = absl::ResourceExhaustedError(
          absl::StrCat("max_buffered_bytes: a push's window of ", w->held, " bytes does not fit (",
                       budget->used(), " of ", budget->limit(), " held)"));
    }
    if (refused.ok()) return w;
    // A window larger than the limit itself never fits: refused at once.
    const bool never = (quota > 0 && w->held > quota) ||
                       (budget != nullptr && budget->limit() > 0 && w->held > budget->limit());
    if (never || absl::Now() + absl::Milliseconds(pause_ms) > deadline) {
      return absl::Status(refused.code(),
                          absl::StrCat("cache ", cache_id, " not pushed: ", refused.message()));
    }
    absl::SleepFor(absl::Milliseconds(pause_ms));
  }
}

namespace {

// Caches moved at once by a drain: enough to overlap one cache's tail with
// the next one's start, few enough that the first caches move first.
constexpr int kDrainWorkers = 4;

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A local export as the chunk stream PushChunks reads (the first chunk with
// the header).
class ExporterReader final : public KvChunkReader {
 public:
  explicit ExporterReader(std::unique_ptr<KvExporter> exporter) : exporter_(std::move(exporter)) {}
  absl::StatusOr<bool> Read(v1::KvChunk* out) override {
    KvTransferChunk chunk;
    ASSIGN_OR_RETURN(const bool more, exporter_->Next(&chunk));
    if (!more) return false;
    out->Clear();
    EncodeChunk(std::move(chunk), out);
    if (first_) EncodeTransferHeader(exporter_->header(), out->mutable_header());
    first_ = false;
    return true;
  }

 private:
  std::unique_ptr<KvExporter> exporter_;
  bool first_ = true;
};

// The push over UCX: this server sends a local export's chunks to the
// receiver the peer's import offers (server/ucx/kv_bulk.h), as
// ExportSequences does for a move between two other servers, in chunks of
// `window`'s size.
DataPlaneSender UcxSender(const std::shared_ptr<KvCache>& cache, const PushWindow& window) {
  DataPlaneSender sender;
  sender.header = [cache](const std::string& transfer_id) -> absl::StatusOr<v1::KvTransferHeader> {
    KvExportOptions options;
    options.transfer_id = transfer_id;
    ASSIGN_OR_RETURN(std::unique_ptr<KvExporter> exporter, KvExporter::Start(cache, options));
    v1::KvTransferHeader header;
    EncodeTransferHeader(exporter->header(), &header);
    return header;
  };
  const int64_t chunk_target = window.chunk_target, chunk_max = window.chunk_max;
  sender.run = [cache, chunk_target, chunk_max](
                   const v1::ImportResumePoint* resume, const std::string& transfer_id,
                   const v1::KvDataPlane& offer) -> absl::StatusOr<int64_t> {
    if (!ucx::BulkBuilt()) {
      return absl::UnimplementedError("this attnserve was built without UCX");
    }
    if (offer.transport() != "ucx") {
      return absl::InvalidArgumentError(absl::StrCat(
          "data_plane.transport: expected \"ucx\", got '", offer.transport().substr(0, 32), "'"));
    }
    KvExportOptions export_options;
    if (resume != nullptr) export_options.resume = DecodeResumePoint(*resume);
    export_options.transfer_id = transfer_id;
    export_options.max_chunk_bytes = chunk_target;
    ASSIGN_OR_RETURN(std::unique_ptr<KvExporter> exporter,
                     KvExporter::Start(cache, export_options));
    ucx::BulkOptions options;
    options.window = kPushWindowChunks;
    // The window's slots are sized up front (what the push charged): a chunk
    // is at most the window's chunk, what a receiver takes and what is left.
    options.chunk_bytes = std::max<int64_t>(
        1, std::min({chunk_max, options.max_chunk_bytes, exporter->remaining_bytes()}));
    const std::atomic<bool> cancelled{false};
    ucx::BulkSendResult sent;
    RETURN_IF_ERROR(ucx::SendChunks(
        ucx::BulkOffer{offer.host(), offer.port(), offer.ticket()},
        [&exporter](KvTransferChunk* chunk) { return exporter->Next(chunk); }, options, &cancelled,
        &sent));
    return sent.bytes;
  };
  return sender;
}

void PrepareContext(grpc::ClientContext* context, const std::string& cache_id,
                    const std::string& authorization, absl::Time deadline) {
  context->AddMetadata(kCacheIdHeader, cache_id);
  if (!authorization.empty()) context->AddMetadata("authorization", authorization);
  if (deadline != absl::InfiniteFuture()) context->set_deadline(absl::ToChronoTime(deadline));
}

// handoff_transport ucx: the peer's server info must name a UCX port before
// anything is sent (its import would create the cache before refusing UCX).
absl::Status PeerListensForUcx(const std::shared_ptr<grpc::Channel>& channel,
                               const std::string& peer, const std::string& authorization,
                               absl::Time deadline) {
  std::unique_ptr<v1::Attention::Stub> attention = v1::Attention::NewStub(channel);
  grpc::ClientContext context;
  if (!authorization.empty()) context.AddMetadata("authorization", authorization);
  context.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(10))));
  v1::GetServerInfoResponse info;
  RETURN_IF_ERROR(
      ToAbslStatus(attention->GetServerInfo(&context, v1::GetServerInfoRequest(), &info)));
  if (info.kv().ucx_port() > 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("handoff_transport: ucx, but the peer ", peer,
                   " offers no UCX (its server info's kv.ucx_port is 0: no --ucx_port)"));
}

}  // namespace

std::string RenderHandoffMetrics(const KvHandoffGate& gate) {
  const KvHandoffGate::Counters c = gate.counters();
  std::string out;
  auto one = [&out](const char* name, const char* help, int64_t value) {
    AppendFamily(&out, name, "counter", help, {{"", absl::StrCat(value)}});
  };
  one("attnserve_handoff_refused_moved_total",
      "K/V calls answered UNAVAILABLE moved-to (x-attnserve-moved-to)", c.refused_moved);
  one("attnserve_handoff_pushed_caches_total", "Caches moved to --handoff_peer (drain and give)",
      c.pushed);
  one("attnserve_handoff_pushed_bytes_total", "Payload bytes of the caches moved to the peer",
      c.bytes_pushed);
  one("attnserve_handoff_fetches_total", "Fetches from the peer started by a call that missed",
      c.fetches);
  one("attnserve_handoff_fetched_caches_total", "Fetches that brought the cache here", c.fetched);
  one("attnserve_handoff_failures_total",
      "Pushes that failed, and fetches that failed other than NOT_FOUND", c.failures);
  return out;
}

void AddMovedToTrailer(grpc::ServerContextBase* context, const absl::Status& status) {
  std::optional<std::string> address = MovedToOf(status);
  if (address.has_value()) context->AddTrailingMetadata(kMovedToHeader, *address);
}

bool AsksToGive(const grpc::CallbackServerContext* context) {
  const auto range = context->client_metadata().equal_range(kHandoffGiveHeader);
  for (auto it = range.first; it != range.second; ++it) {
    if (absl::string_view(it->second.data(), it->second.size()) == "give") return true;
  }
  return false;
}

std::string AuthorizationOf(const grpc::CallbackServerContext* context) {
  const std::optional<absl::string_view> header = SoleAuthorization(context);
  return header.has_value() ? std::string(*header) : std::string();
}

absl::StatusOr<std::unique_ptr<KvPeer>> KvPeer::Create(const HandoffOptions& options,
                                                       const TlsFiles& tls, std::string tokens_file,
                                                       KvPool* pool, ByteBudget* budget,
                                                       TenantDirectory* tenants) {
  if (options.transport != "auto" && options.transport != "ucx" && options.transport != "grpc") {
    return absl::InvalidArgumentError(absl::StrCat(
        "handoff_transport: expected auto, ucx or grpc, got '", options.transport, "'"));
  }
  if (options.transport == "ucx" && !ucx::BulkBuilt()) {
    return absl::InvalidArgumentError(
        "handoff_transport: ucx, but this attnserve was built without UCX");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (tls.enabled()) {
    grpc::SslCredentialsOptions ssl;
    if (!options.peer_ca_file.empty()) {
      ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem(options.peer_ca_file, "handoff_peer_ca"));
    }
    if (tls.mutual()) {
      ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPem(tls.cert_file, "tls_cert"));
      ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem(tls.key_file, "tls_key"));
    }
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  // Chunks are up to 4 MiB of payload plus framing.
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(options.peer, credentials, args);
  return std::unique_ptr<KvPeer>(
      new KvPeer(options, std::move(channel), std::move(tokens_file), pool, budget, tenants));
}

KvPeer::KvPeer(const HandoffOptions& options, std::shared_ptr<grpc::Channel> channel,
               std::string tokens_file, KvPool* pool, ByteBudget* budget, TenantDirectory* tenants)
    : options_(options),
      channel_(std::move(channel)),
      tokens_file_(std::move(tokens_file)),
      pool_(pool),
      budget_(budget),
      tenants_(tenants) {}

absl::Status KvPeer::Fetch(const KvHandoffGate::Call& call) {
  const std::string& id = call.cache_id;
  std::unique_ptr<v1::KvCache::Stub> kv = v1::KvCache::NewStub(channel_);
  grpc::ClientContext context;
  PrepareContext(&context, id, call.authorization, absl::Now() + options_.fetch_timeout);
  context.AddMetadata(kHandoffGiveHeader, "give");
  v1::DropCacheRequest request;
  request.set_cache_id(id);
  v1::DropCacheResponse response;
  const absl::Status given = ToAbslStatus(kv->DropCache(&context, request, &response));
  if (given.ok() && pool_->Find(call.tenant, id).ok()) return absl::OkStatus();
  if (given.ok() || absl::IsNotFound(given) || absl::IsUnavailable(given) ||
      absl::IsUnimplemented(given)) {
    // The peer does not hold it, or cannot be reached: as without a peer.
    return absl::NotFoundError(absl::StrCat("cache '", id, "' not found (nor on the peer ",
                                            options_.peer, ": ",
                                            absl::StatusCodeToString(given.code()), ")"));
  }
  spdlog::warn("handoff: the peer {} kept cache {}: {}", options_.peer, id, given.ToString());
  return MovedStatus(id, options_.peer);
}

absl::StatusOr<int64_t> KvPeer::Push(const std::shared_ptr<KvCache>& cache, absl::Time deadline,
                                     const std::string& authorization) {
  std::string as = authorization;
  if (as.empty()) {
    ASSIGN_OR_RETURN(const std::string token, TokenOfTenant(tokens_file_, cache->tenant()));
    if (!token.empty()) as = "Bearer " + token;
  }
  MoveOptions options;
  v1::CreateCacheRequest create;
  create.set_capacity_tokens(cache->capacity_pages() * cache->page_size());
  options.create = create;
  if (!as.empty()) options.dest_metadata.emplace("authorization", as);
  options.timeout = std::max(deadline - absl::Now(), absl::ZeroDuration());
  if (cache->Stats().sequences == 0) {
    // No chunk would carry the geometry: create the empty cache on the peer.
    std::unique_ptr<v1::KvCache::Stub> kv = v1::KvCache::NewStub(channel_);
    grpc::ClientContext context;
    PrepareContext(&context, cache->id(), as, deadline);
    v1::CacheStats stats;
    FillCacheStats(cache->Stats(), &stats);
    *create.mutable_geometry() = stats.geometry();
    create.set_page_size(cache->page_size());
    create.set_cache_id(cache->id());
    v1::CreateCacheResponse response;
    const absl::Status made = ToAbslStatus(kv->CreateCache(&context, create, &response));
    if (!made.ok() && !absl::IsAlreadyExists(made)) return made;
    return int64_t{0};
  }
  // What the push holds while it runs (either transport), charged first.
  const KvCacheStats stats = cache->Stats();
  ASSIGN_OR_RETURN(const std::unique_ptr<PushWindow> window,
                   ChargePushWindow(cache->tenant(), cache->id(), stats.geometry, stats.page_size,
                                    stats.pages_used, budget_, tenants_, deadline));
  // The queue's share of the window: the rest is the chunks being read,
  // encoded and written.
  options.max_buffered_bytes = (kPushWindowChunks - 4) * window->chunk_max;
  const int64_t chunk_target = window->chunk_target;
  OpenChunks open =
      [cache, chunk_target](
          const v1::ImportResumePoint* resume,
          const std::string& transfer_id) -> absl::StatusOr<std::unique_ptr<KvChunkReader>> {
    KvExportOptions export_options;
    if (resume != nullptr) export_options.resume = DecodeResumePoint(*resume);
    export_options.transfer_id = transfer_id;
    export_options.max_chunk_bytes = chunk_target;
    ASSIGN_OR_RETURN(std::unique_ptr<KvExporter> exporter,
                     KvExporter::Start(cache, export_options));
    return std::unique_ptr<KvChunkReader>(new ExporterReader(std::move(exporter)));
  };
  // auto asks for UCX when this build has it; the peer's import answers
  // whether it takes the chunks there (it runs with --ucx_port), else they
  // come in the stream.
  const bool ucx =
      options_.transport == "ucx" || (options_.transport == "auto" && ucx::BulkBuilt());
  absl::StatusOr<MoveResult> pushed;
  if (ucx) {
    if (options_.transport == "ucx")
      RETURN_IF_ERROR(PeerListensForUcx(channel_, options_.peer, as, deadline));
    options.data_plane = "ucx";
    options.data_plane_required = options_.transport == "ucx";
    pushed = PushChunks(channel_, cache->id(), open, options, UcxSender(cache, *window));
  } else {
    pushed = PushChunks(channel_, cache->id(), open, options);
  }
  if (!pushed.ok()) return pushed.status();
  const MoveResult& moved = *pushed;
  spdlog::info(
      "handoff: cache {} (tenant {}) moved to {} over {}: {} sequences, {} bytes in {:.3f} s "
      "({:.3f} GB/s){}{}",
      cache->id(), cache->tenant(), options_.peer, moved.data_plane, moved.sequences, moved.bytes,
      moved.seconds, moved.seconds > 0 ? double(moved.bytes) / moved.seconds / 1e9 : 0.0,
      moved.data_plane_fallback.empty() ? "" : "; not over UCX: ", moved.data_plane_fallback);
  return moved.bytes;
}

void KvPeer::Drain(KvHandoffGate* gate, absl::Time deadline) {
  const absl::Time begin = absl::Now();
  const std::vector<std::shared_ptr<KvCache>> caches = gate->BeginDrain();
  spdlog::info("handoff: moving {} caches to {}", caches.size(), options_.peer);
  std::atomic<size_t> next{0};
  std::atomic<int> moved{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < caches.size();) {
      const std::shared_ptr<KvCache>& cache = caches[i];
      absl::StatusOr<int64_t> pushed = gate->WaitIdle(cache->tenant(), cache->id(), deadline)
                                           ? Push(cache, deadline)
                                           : absl::DeadlineExceededError("calls still in flight");
      const absl::Status status = pushed.status();
      if (status.ok()) {
        // Its pages go now; the calls that wait hear where it went.
        pool_->DropCache(cache->tenant(), cache->id()).IgnoreError();
        gate->Moved(cache->tenant(), cache->id(), *pushed);
        moved.fetch_add(1);
      } else {
        spdlog::warn("handoff: cache {} (tenant {}) not moved to {}: {}", cache->id(),
                     cache->tenant(), options_.peer, status.ToString());
        gate->Release(cache->tenant(), cache->id());
      }
    }
  };
  std::vector<std::thread> workers;
  const int n = std::min<int>(kDrainWorkers, static_cast<int>(caches.size()));
  for (int i = 0; i < n; ++i) workers.emplace_back(work);
  for (std::thread& t : workers) t.join();
  spdlog::info("handoff: moved {} of {} caches to {} in {}", moved.load(), caches.size(),
               options_.peer, absl::FormatDuration(absl::Now() - begin));
  // Clients whose next call comes now still learn where their cache went.
  if (moved.load() == 0) return;
  absl::SleepFor(std::min(options_.linger, std::max(deadline - absl::Now(), absl::ZeroDuration())));
}

}  // namespace attnserve
