// Reactors of the K/V transfer front-end; see kv_transfer_service.h.
#include "server/native/kv_transfer_service.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cache_id_header.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "server/metrics.h"
#include "server/native/kv_messages.h"
#include "server/tenant.h"
#include "server/ucx/kv_bulk.h"
#include "spdlog/spdlog.h"

namespace attnserve {

namespace {

// A chunk over UCX: what the export asked for (0: the default), at most what
// a receiver takes (ucx::BulkOptions).
int64_t UcxChunkBytes(int64_t requested) {
  const int64_t asked = requested > 0 ? requested : kDefaultKvChunkBytes;
  return std::min(asked, ucx::BulkOptions{}.max_chunk_bytes);
}

// Bytes charged to the server's buffered budget (outside gRPC and the
// streams) until destroyed or released.
class BufferedCharge {
 public:
  BufferedCharge() = default;
  BufferedCharge(BufferedCharge&& o) noexcept : budget_(o.budget_), bytes_(o.bytes_) {
    o.budget_ = nullptr;
  }
  BufferedCharge& operator=(BufferedCharge&& o) noexcept {
    if (this != &o) {
      Release();
      budget_ = o.budget_;
      bytes_ = o.bytes_;
      o.budget_ = nullptr;
    }
    return *this;
  }
  ~BufferedCharge() { Release(); }
  void Release() {
    if (budget_ != nullptr) budget_->Release(bytes_);
    budget_ = nullptr;
  }
  // `bytes` of `what` charged to `budget` (null: nothing), or
  // RESOURCE_EXHAUSTED naming --max_buffered_bytes when they do not fit now.
  static absl::StatusOr<BufferedCharge> Take(ByteBudget* budget, int64_t bytes, const char* what) {
    BufferedCharge c;
    if (budget == nullptr || bytes <= 0) return c;
    if (!budget->TryCharge(bytes)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("max_buffered_bytes: ", what, " of ", bytes,
                       " bytes does not fit the server's budget for "
                       "UCX and pushes (",
                       budget->used(), " of ", budget->limit(),
                       " bytes held; --max_buffered_bytes sets it); try again later or over gRPC"));
    }
    c.budget_ = budget;
    c.bytes_ = bytes;
    return c;
  }

 private:
  ByteBudget* budget_ = nullptr;
  int64_t bytes_ = 0;
};

std::atomic<int> ucx_max_exports{kDefaultUcxMaxExports};
std::atomic<int> ucx_max_exports_per_tenant{kDefaultUcxMaxExportsPerTenant};

}  // namespace

void SetUcxExportLimits(int per_server, int per_tenant) {
  ucx_max_exports.store(per_server);
  ucx_max_exports_per_tenant.store(per_tenant);
}

absl::StatusOr<UcxExportSlots::Slot> UcxExportSlots::Take(const std::string& tenant) {
  const int most = ucx_max_exports.load();
  const int most_per_tenant = ucx_max_exports_per_tenant.load();
  absl::MutexLock lock(&mu_);
  if (most > 0 && total_ >= most) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "data_plane: ", total_, " UCX exports are running, the most --ucx_max_exports allows (",
        most, "); export over gRPC or try again later"));
  }
  int& mine = per_tenant_[tenant];
  if (most_per_tenant > 0 && mine >= most_per_tenant) {
    return absl::ResourceExhaustedError(
        absl::StrCat("data_plane: ", mine,
                     " UCX exports of this tenant are running, the most "
                     "--ucx_max_exports_per_tenant allows (",
                     most_per_tenant, "); export over gRPC or try again later"));
  }
  ++mine;
  ++total_;
  return Slot(this, tenant);
}

void UcxExportSlots::Give(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  --total_;
  auto it = per_tenant_.find(tenant);
  if (it != per_tenant_.end() && --it->second <= 0) per_tenant_.erase(it);
}

int UcxExportSlots::running() {
  absl::MutexLock lock(&mu_);
  return total_;
}

KvExportOptions DecodeExportRequest(const v1::ExportSequencesRequest& r) {
  KvExportOptions o;
  o.sequence_ids.assign(r.sequence_ids().begin(), r.sequence_ids().end());
  o.token_begin = r.token_begin();
  if (r.has_token_end()) o.token_end = r.token_end();
  if (r.has_resume()) o.resume = DecodeResumePoint(r.resume());
  o.max_chunk_bytes = r.has_data_plane() ? UcxChunkBytes(r.max_chunk_bytes()) : r.max_chunk_bytes();
  o.transfer_id = r.transfer_id();
  // Chunks in this stream: read one ahead, off the gRPC thread (the data
  // plane's sender reads on a thread of its own already).
  o.read_ahead = !r.header_only() && !r.has_data_plane();
  return o;
}

KvTransferHeader DecodeTransferHeader(const v1::KvTransferHeader& h) {
  KvTransferHeader out;
  out.transfer_id = h.transfer_id();
  out.source_cache_id = h.source_cache_id();
  out.geometry.num_layers = h.geometry().num_layers();
  out.geometry.num_heads_kv = h.geometry().num_heads_kv();
  out.geometry.head_dim = h.geometry().head_dim();
  out.geometry.dtype = static_cast<DType>(h.geometry().dtype());
  out.geometry.cache_dtype = static_cast<DType>(h.geometry().cache_dtype());
  out.geometry.head_dim_v = h.geometry().head_dim_v();
  out.geometry.v_in_k = h.geometry().v_in_k();
  if (out.geometry.cache_dtype == DType{0}) out.geometry.cache_dtype = out.geometry.dtype;
  out.source_page_size = h.source_page_size();
  for (const v1::SequenceLengths& s : h.sequences()) {
    KvTransferSequence seq;
    seq.sequence_id = s.sequence_id();
    seq.lengths.assign(s.lengths().begin(), s.lengths().end());
    out.sequences.push_back(std::move(seq));
  }
  out.token_begin = h.token_begin();
  out.total_bytes = h.total_bytes();
  return out;
}

void EncodeTransferHeader(const KvTransferHeader& h, v1::KvTransferHeader* out) {
  out->set_transfer_id(h.transfer_id);
  out->set_source_cache_id(h.source_cache_id);
  v1::KvGeometry* g = out->mutable_geometry();
  g->set_num_layers(h.geometry.num_layers);
  g->set_num_heads_kv(h.geometry.num_heads_kv);
  g->set_head_dim(h.geometry.head_dim);
  g->set_dtype(static_cast<v1::DType>(h.geometry.dtype));
  g->set_cache_dtype(static_cast<v1::DType>(h.geometry.cache_dtype));
  g->set_head_dim_v(h.geometry.head_dim_v);
  g->set_v_in_k(h.geometry.v_in_k);
  out->set_source_page_size(h.source_page_size);
  for (const KvTransferSequence& s : h.sequences) {
    v1::SequenceLengths* seq = out->add_sequences();
    seq->set_sequence_id(s.sequence_id);
    for (int32_t len : s.lengths) seq->add_lengths(len);
  }
  out->set_token_begin(h.token_begin);
  out->set_total_bytes(h.total_bytes);
}

void DecodeChunk(const v1::KvChunk& c, KvTransferChunk* out) {
  out->sequence_id = c.sequence_id();
  out->layer = c.layer();
  out->token_begin = c.token_begin();
  out->num_tokens = c.num_tokens();
  out->k = c.k();
  out->v = c.v();
  out->k_scale = c.k_scale();
  out->v_scale = c.v_scale();
  out->crc32c = c.crc32c();
  out->sequence_end = c.sequence_end();
}

void EncodeChunk(KvTransferChunk&& c, v1::KvChunk* out) {
  out->clear_header();
  out->set_sequence_id(c.sequence_id);
  out->set_layer(c.layer);
  out->set_token_begin(c.token_begin);
  out->set_num_tokens(c.num_tokens);
  out->set_k(std::move(c.k));
  out->set_v(std::move(c.v));
  out->set_k_scale(std::move(c.k_scale));
  out->set_v_scale(std::move(c.v_scale));
  out->set_crc32c(c.crc32c);
  out->set_sequence_end(c.sequence_end);
}

void EncodeResumePoint(const KvResumePoint& p, v1::ImportResumePoint* out) {
  out->Clear();
  for (uint64_t id : p.committed_sequence_ids) out->add_committed_sequence_ids(id);
  if (p.sequence_id.has_value()) {
    out->set_sequence_id(*p.sequence_id);
    out->set_layer(p.layer);
    out->set_token(p.token);
  }
}

KvResumePoint DecodeResumePoint(const v1::ImportResumePoint& p) {
  KvResumePoint out;
  out.committed_sequence_ids.assign(p.committed_sequence_ids().begin(),
                                    p.committed_sequence_ids().end());
  if (p.has_sequence_id()) {
    out.sequence_id = p.sequence_id();
    out.layer = p.layer();
    out.token = p.token();
  }
  return out;
}

absl::Status ExportChunks(KvPool& pool, const std::string& tenant,
                          const v1::ExportSequencesRequest& request,
                          const std::function<absl::Status(v1::KvChunk&&)>& sink) {
  return ExportCache(pool, tenant, request.cache_id(), DecodeExportRequest(request),
                     [&](const KvTransferHeader* header, KvTransferChunk&& chunk) {
                       v1::KvChunk out;
                       EncodeChunk(std::move(chunk), &out);
                       if (header != nullptr) EncodeTransferHeader(*header, out.mutable_header());
                       return sink(std::move(out));
                     });
}

namespace {

// ExportSequences: one chunk read from the pages and written at a time, its
// bytes charged to the tenant until the write completes.
class ExportReactor final : public grpc::ServerWriteReactor<v1::KvChunk> {
 public:
  ExportReactor(KvPool* pool, TenantDirectory* tenants, ByteBudget* buffered,
                KvTransferCounters* counters, InFlightCounter* in_flight, UcxExportSlots* slots,
                std::string tenant, const v1::ExportSequencesRequest& request, bool ucx_enabled)
      : tenants_(tenants),
        buffered_(buffered),
        counters_(counters),
        slots_(slots),
        hold_(in_flight),
        tenant_(std::move(tenant)),
        ucx_enabled_(ucx_enabled) {
    absl::StatusOr<std::shared_ptr<KvCache>> cache = pool->Find(tenant_, request.cache_id());
    if (!cache.ok()) {
      Finish(ToGrpcStatus(cache.status()));
      return;
    }
    absl::StatusOr<std::unique_ptr<KvExporter>> exporter =
        KvExporter::Start(*cache, DecodeExportRequest(request));
    if (!exporter.ok()) {
      Finish(ToGrpcStatus(exporter.status()));
      return;
    }
    exporter_ = *std::move(exporter);
    if (request.header_only()) {
      // The header alone: a mover learns the sequences before the import.
      final_ = true;
      EncodeTransferHeader(exporter_->header(), message_.mutable_header());
      StartWrite(&message_);
      return;
    }
    if (request.has_data_plane()) {
      StartDataPlane(request);
      return;
    }
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    charge_.Release();
    if (final_) {
      Finish(ok ? grpc::Status::OK
                : grpc::Status(grpc::StatusCode::CANCELLED, "the export stream was cut"));
      return;
    }
    if (!ok) {
      // The client went away (or cancelled): nothing more is read.
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the export stream was cut"));
      return;
    }
    WriteNext();
  }

  void OnCancel() override { cancelled_.store(true, std::memory_order_release); }

  void OnDone() override {
    if (sender_.joinable()) {
      if (sender_.get_id() == std::this_thread::get_id()) {
        sender_.detach();  // its last act was Finish
      } else {
        sender_.join();
      }
    }
    delete this;
  }

 private:
  // The chunks go over UCX to the receiver the request names
  // (server/ucx/kv_bulk.h), read from the pages on the sender's own thread
  // ahead of the UCX transfers; this stream then carries one chunk: the
  // header and the bytes the receiver kept. The chunks the sender holds
  // (its window) are charged to the tenant until it is done.
  void StartDataPlane(const v1::ExportSequencesRequest& request) {
    const v1::KvDataPlane& plane = request.data_plane();
    if (!ucx::BulkBuilt() || !ucx_enabled_) {
      // The operator opts in with --ucx_port: a server without it sends nothing over UCX.
      Finish(ToGrpcStatus(absl::UnimplementedError(
          "data_plane: the source offers no UCX (started without --ucx_port, or built without "
          "UCX); export over gRPC")));
      return;
    }
    if (plane.transport() != "ucx") {
      Finish(ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "data_plane.transport: expected \"ucx\", got '", plane.transport().substr(0, 32), "'"))));
      return;
    }
    // Counted before anything is reserved: each export holds a UCX worker
    // and its window of buffers.
    absl::StatusOr<UcxExportSlots::Slot> slot = slots_->Take(tenant_);
    if (!slot.ok()) {
      Finish(ToGrpcStatus(slot.status()));
      return;
    }
    ucx::BulkOptions options;
    // The window's slots are reserved (and page-locked in CUDA builds) for
    // the largest chunk before anything is read: at most a chunk of the
    // export (whole pages) and what is left to send. The charge is all of
    // them, to the tenant and to the server's budget.
    const int64_t chunk = std::max<int64_t>(
        1, std::min(exporter_->max_chunk_payload(), exporter_->remaining_bytes()));
    const int64_t held = std::max(options.window, 1) * chunk;
    options.chunk_bytes = chunk;
    if (tenants_ != nullptr && held > 0) {
      absl::StatusOr<InFlightCharge> charge = tenants_->ChargeInFlight(tenant_, held);
      if (!charge.ok()) {
        Finish(ToGrpcStatus(charge.status()));
        return;
      }
      charge_ = *std::move(charge);
    }
    absl::StatusOr<BufferedCharge> buffered =
        BufferedCharge::Take(buffered_, held, "a UCX export's window");
    if (!buffered.ok()) {
      charge_.Release();
      Finish(ToGrpcStatus(buffered.status()));
      return;
    }
    buffered_charge_ = *std::move(buffered);
    slot_ = *std::move(slot);
    const ucx::BulkOffer offer{plane.host(), plane.port(), plane.ticket()};
    spdlog::info("kv export transfer={} over UCX to {}:{}", exporter_->header().transfer_id,
                 offer.host, offer.port);
    absl::StatusOr<std::thread> sender = ucx::StartThread("the UCX export", [this, offer, options] {
      ucx::BulkSendResult sent;
      const absl::Status status = ucx::SendChunks(
          offer,
          [this](KvTransferChunk* c) -> absl::StatusOr<bool> {
            absl::StatusOr<bool> more = exporter_->Next(c);
            if (more.ok() && *more) {
              counters_->bytes_exported.fetch_add(c->payload_bytes(), std::memory_order_relaxed);
              counters_->chunks_exported.fetch_add(1, std::memory_order_relaxed);
              if (c->sequence_end) {
                counters_->sequences_exported.fetch_add(1, std::memory_order_relaxed);
              }
            }
            return more;
          },
          options, &cancelled_, &sent);
      charge_.Release();
      buffered_charge_.Release();
      slot_ = UcxExportSlots::Slot();
      if (!status.ok()) {
        spdlog::info("kv export transfer={} over UCX stopped after {} bytes: {}",
                     exporter_->header().transfer_id, sent.bytes, status.ToString());
        Finish(ToGrpcStatus(status));
        return;
      }
      final_ = true;
      message_.Clear();
      EncodeTransferHeader(exporter_->header(), message_.mutable_header());
      message_.set_data_plane_bytes(sent.bytes);
      StartWrite(&message_);
    });
    if (!sender.ok()) {
      // Nothing sent: what was taken for it goes back.
      charge_.Release();
      buffered_charge_.Release();
      slot_ = UcxExportSlots::Slot();
      Finish(ToGrpcStatus(sender.status()));
      return;
    }
    sender_ = *std::move(sender);
  }

  void WriteNext() {
    absl::StatusOr<bool> more = exporter_->Next(&chunk_);
    if (!more.ok()) {
      Finish(ToGrpcStatus(more.status()));
      return;
    }
    if (!*more) {
      Finish(grpc::Status::OK);
      return;
    }
    const int64_t bytes = chunk_.payload_bytes();
    if (tenants_ != nullptr) {
      absl::StatusOr<InFlightCharge> charge = tenants_->ChargeInFlight(tenant_, bytes);
      if (!charge.ok()) {
        Finish(ToGrpcStatus(charge.status()));
        return;
      }
      charge_ = *std::move(charge);
    }
    const bool end = chunk_.sequence_end;
    EncodeChunk(std::move(chunk_), &message_);
    chunk_ = KvTransferChunk();
    if (first_) EncodeTransferHeader(exporter_->header(), message_.mutable_header());
    first_ = false;
    counters_->bytes_exported.fetch_add(bytes, std::memory_order_relaxed);
    counters_->chunks_exported.fetch_add(1, std::memory_order_relaxed);
    if (end) counters_->sequences_exported.fetch_add(1, std::memory_order_relaxed);
    StartWrite(&message_);
  }

  TenantDirectory* const tenants_;
  ByteBudget* const buffered_;
  KvTransferCounters* const counters_;
  UcxExportSlots* const slots_;
  InFlightCounter::Hold hold_;
  const std::string tenant_;
  const bool ucx_enabled_;
  std::unique_ptr<KvExporter> exporter_;
  KvTransferChunk chunk_;
  v1::KvChunk message_;
  InFlightCharge charge_;
  BufferedCharge buffered_charge_;  // a UCX export's window, server-wide
  UcxExportSlots::Slot slot_;       // the export's place among the UCX exports
  bool first_ = true;
  bool final_ = false;  // the last message (header only, or after the data plane)
  std::atomic<bool> cancelled_{false};
  std::thread sender_;
};

// ImportSequences: one message read and kept at a time; an answer after the
// first message and after each sequence made live, read on after it is sent.
class ImportReactor final
    : public grpc::ServerBidiReactor<v1::ImportSequencesRequest, v1::ImportSequencesResponse> {
 public:
  ImportReactor(KvRunner* runner, KvImportSessions* sessions, TenantDirectory* tenants,
                ByteBudget* buffered, InFlightCounter* in_flight,
                std::shared_ptr<const StreamTenant> who, std::string data_plane_host)
      : data_plane_host_(std::move(data_plane_host)),
        runner_(runner),
        sessions_(sessions),
        tenants_(tenants),
        buffered_(buffered),
        hold_(in_flight),
        who_(std::move(who)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return HalfClosed();
    const absl::Status status = Handle();
    if (!status.ok()) return Fail(status);
    if (answer_) {
      answer_ = false;
      StartWrite(&response_);
      return;
    }
    StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Fail(absl::CancelledError("the import stream was cut"));
    if (finishing_) return End(final_);
    StartRead(&request_);
  }

  void OnDone() override {
    if (receiver_ != nullptr) receiver_->Stop();
    if (session_ != nullptr) session_->Detach();
    delete this;
  }

 private:
  absl::Status Handle() {
    RETURN_IF_ERROR(who_->StillValid());
    InFlightCharge charge;
    if (tenants_ != nullptr) {
      // The chunk held while it is checked and copied into pages.
      ASSIGN_OR_RETURN(charge, tenants_->ChargeInFlight(
                                   who_->tenant(), static_cast<int64_t>(request_.ByteSizeLong())));
    }
    if (session_ == nullptr) return Open();
    if (!request_.has_chunk()) {
      return absl::InvalidArgumentError("chunk: expected a chunk after the first message");
    }
    if (request_.chunk().has_header()) {
      RETURN_IF_ERROR(session_->SameHeader(DecodeTransferHeader(request_.chunk().header())));
    }
    return Keep();
  }

  absl::Status Open() {
    RETURN_IF_ERROR(runner_->Draining());
    const bool in_chunk = request_.has_chunk() && request_.chunk().has_header();
    if (!request_.has_header() && !in_chunk) {
      return absl::InvalidArgumentError(
          "header: expected the transfer's header on the first message (header or "
          "chunk.header)");
    }
    const KvTransferHeader header =
        DecodeTransferHeader(request_.has_header() ? request_.header() : request_.chunk().header());
    if (request_.has_header() && in_chunk &&
        request_.header().SerializeAsString() != request_.chunk().header().SerializeAsString()) {
      return absl::InvalidArgumentError("chunk.header: expected the same header as header");
    }
    std::optional<KvImportCreate> create;
    if (request_.has_create()) {
      const v1::CreateCacheRequest& c = request_.create();
      create = KvImportCreate{c.capacity_tokens(), c.capacity_bytes(),
                              c.has_device() ? std::optional<int32_t>(c.device()) : std::nullopt,
                              c.reserve()};
    }
    ASSIGN_OR_RETURN(session_,
                     sessions_->Attach(who_->tenant(), request_.cache_id(), create, header));
    spdlog::info("kv import transfer={} cache={} sequences={} resumed_after={}", header.transfer_id,
                 request_.cache_id(), header.sequences.size(), session_->Progress().bytes_received);
    Answer(session_->Progress());
    if (!request_.data_plane().empty()) OfferDataPlane();
    // A first message with a chunk carries rows too (the header alone is
    // the `header` field).
    if (request_.has_chunk()) return Keep();
    return absl::OkStatus();
  }

  absl::Status Keep() {
    DecodeChunk(request_.chunk(), &chunk_);
    ASSIGN_OR_RETURN(const KvImportProgress progress, session_->Accept(chunk_));
    if (progress.sequence_committed) Answer(progress);
    return absl::OkStatus();
  }

  // The first message asked for the chunks over UCX: a receiver of this
  // import's own (server/ucx/kv_bulk.h) applies them to the session in order,
  // each charged to the tenant from its arrival until it is kept, and the first
  // answer names it; else the answer says why not and the chunks come in
  // this stream.
  void OfferDataPlane() {
    const std::string& want = request_.data_plane();
    std::string why;
    if (want != "ucx") {
      why = absl::StrCat("data_plane: expected \"ucx\", got '", want.substr(0, 32), "'");
    } else if (!ucx::BulkBuilt()) {
      why = "this attnserve was built without UCX";
    } else if (data_plane_host_.empty()) {
      why = "the receiver offers no UCX (started without --ucx_port)";
    } else {
      std::shared_ptr<KvImportSession> session = session_;
      TenantDirectory* tenants = tenants_;
      ByteBudget* buffered = buffered_;
      std::shared_ptr<const StreamTenant> who = who_;
      ucx::BulkOptions options;
      if (tenants != nullptr || buffered != nullptr) {
        // Each chunk from its frame's arrival while its slot holds it: to the
        // tenant and to the server's budget.
        struct Held {
          InFlightCharge tenant;
          BufferedCharge server;
        };
        options.charge = [tenants, buffered,
                          who](int64_t bytes) -> absl::StatusOr<std::shared_ptr<void>> {
          auto held = std::make_shared<Held>();
          if (tenants != nullptr) {
            ASSIGN_OR_RETURN(held->tenant, tenants->ChargeInFlight(who->tenant(), bytes));
          }
          ASSIGN_OR_RETURN(held->server,
                           BufferedCharge::Take(buffered, bytes, "a UCX import's chunk"));
          return std::shared_ptr<void>(std::move(held));
        };
      }
      absl::StatusOr<std::unique_ptr<ucx::BulkReceiver>> receiver = ucx::BulkReceiver::Start(
          data_plane_host_,
          [session, who](const KvTransferChunk& chunk) -> absl::Status {
            RETURN_IF_ERROR(who->StillValid());
            return session->Accept(chunk).status();
          },
          options);
      if (receiver.ok()) {
        receiver_ = *std::move(receiver);
        v1::KvDataPlane* plane = response_.mutable_data_plane();
        plane->set_transport("ucx");
        plane->set_host(receiver_->offer().host);
        plane->set_port(receiver_->offer().port);
        plane->set_ticket(receiver_->offer().ticket);
        spdlog::info("kv import transfer={} takes its chunks over UCX on {}:{}",
                     session_->transfer_id(), plane->host(), plane->port());
        return;
      }
      why = absl::StrCat("the UCX data plane did not start: ", receiver.status().message());
    }
    response_.set_data_plane_refused(why);
    spdlog::info("kv import transfer={} takes its chunks in the gRPC stream: {}",
                 session_->transfer_id(), why);
  }

  void Answer(const KvImportProgress& progress) {
    response_.Clear();
    response_.set_transfer_id(session_->transfer_id());
    EncodeResumePoint(progress.resume, response_.mutable_resume());
    response_.set_bytes_received(progress.bytes_received);
    FillCacheStats(session_->cache()->Stats(), response_.mutable_stats());
    answer_ = true;
  }

  void HalfClosed() {
    // Chunks received over UCX and not yet applied are dropped (a resume
    // sends them again); the answer below says what was kept.
    if (receiver_ != nullptr) receiver_->Stop();
    if (session_ == nullptr) {
      End(ToGrpcStatus(absl::InvalidArgumentError(
          "header: the stream ended before its first message (cache_id and the header)")));
      return;
    }
    const KvImportProgress progress = session_->Progress();
    if (session_->Done()) {
      final_ = grpc::Status::OK;
    } else {
      final_ = ToGrpcStatus(absl::AbortedError(absl::StrCat(
          "the sender ended transfer '", session_->transfer_id(), "' with ",
          progress.resume.committed_sequence_ids.size(),
          " sequence(s) live and others missing; resume with the same transfer_id to finish")));
    }
    Answer(progress);
    response_.set_done(true);
    finishing_ = true;
    StartWrite(&response_);
  }

  void Fail(const absl::Status& status) {
    if (!status.ok() && session_ != nullptr) {
      spdlog::info("kv import transfer={} stopped: {}", session_->transfer_id(), status.ToString());
    }
    End(ToGrpcStatus(status));
  }

  // The session is free for a resume before the sender can see the status.
  void End(const grpc::Status& status) {
    if (receiver_ != nullptr) receiver_->Stop();
    if (session_ != nullptr) {
      session_->Detach();
      session_.reset();
    }
    Finish(status);
  }

  const std::string data_plane_host_;
  KvRunner* const runner_;
  KvImportSessions* const sessions_;
  TenantDirectory* const tenants_;
  ByteBudget* const buffered_;
  InFlightCounter::Hold hold_;
  const std::shared_ptr<const StreamTenant> who_;
  std::shared_ptr<KvImportSession> session_;
  std::unique_ptr<ucx::BulkReceiver> receiver_;
  v1::ImportSequencesRequest request_;
  v1::ImportSequencesResponse response_;
  KvTransferChunk chunk_;
  bool answer_ = false;
  bool finishing_ = false;
  grpc::Status final_;
};

}  // namespace

KvTransferService::KvTransferService(KvRunner* runner, KvImportSessions* sessions)
    : runner_(runner), pool_(runner->pool()), sessions_(sessions) {}

grpc::ServerWriteReactor<v1::KvChunk>* KvTransferService::ExportSequences(
    grpc::CallbackServerContext* context, const v1::ExportSequencesRequest* request) {
  bool ucx_enabled;
  {
    absl::MutexLock lock(&data_plane_mu_);
    ucx_enabled = !data_plane_host_.empty();
  }
  return new ExportReactor(pool_, tenants_, buffered_, &counters_, &in_flight_, &ucx_exports_,
                           TenantOf(auth_, context), *request, ucx_enabled);
}

grpc::ServerBidiReactor<v1::ImportSequencesRequest, v1::ImportSequencesResponse>*
KvTransferService::ImportSequences(grpc::CallbackServerContext* context) {
  std::string host;
  {
    absl::MutexLock lock(&data_plane_mu_);
    host = data_plane_host_;
  }
  return new ImportReactor(runner_, sessions_, tenants_, buffered_, &in_flight_,
                           StreamTenantOf(auth_, context), std::move(host));
}

std::string KvTransferService::RenderMetrics() {
  const KvImportStats s = sessions_->Stats();
  std::string out;
  AppendFamily(&out, "attnserve_kv_transfer_bytes_total", "counter",
               "K/V payload bytes moved by KvTransfer (export: sent, import: kept)",
               {{"direction=\"export\"", absl::StrCat(counters_.bytes_exported.load())},
                {"direction=\"import\"", absl::StrCat(s.bytes_imported)}});
  AppendFamily(&out, "attnserve_kv_transfer_sequences_total", "counter",
               "K/V sequences moved by KvTransfer (export: last chunk sent, import: made live)",
               {{"direction=\"export\"", absl::StrCat(counters_.sequences_exported.load())},
                {"direction=\"import\"", absl::StrCat(s.sequences_imported)}});
  AppendFamily(&out, "attnserve_kv_transfer_checksum_failures_total", "counter",
               "Imported chunks refused for a CRC-32C mismatch (DATA_LOSS)",
               {{"", absl::StrCat(s.checksum_failures)}});
  AppendFamily(&out, "attnserve_kv_import_sessions", "gauge",
               "Imports open or waiting for a resume", {{"", absl::StrCat(s.sessions)}});
  AppendFamily(&out, "attnserve_kv_import_staged_pages", "gauge",
               "K/V pages holding rows of sequences not yet live (counted in their caches)",
               {{"", absl::StrCat(s.staged_pages)}});
  AppendFamily(&out, "attnserve_kv_import_expired_total", "counter",
               "Cut imports whose staged rows went after --kv_import_idle_timeout",
               {{"", absl::StrCat(s.expired_sessions)}});
  if (buffered_ != nullptr) {
    AppendFamily(&out, "attnserve_ucx_buffered_bytes", "gauge",
                 "Bytes held outside gRPC and the streams: UCX step frames, UCX K/V imports' "
                 "and exports' staging buffers, --handoff_peer pushes' send windows",
                 {{"", absl::StrCat(buffered_->used())}});
    AppendFamily(&out, "attnserve_ucx_buffered_bytes_limit", "gauge",
                 "Their share of --max_buffered_bytes", {{"", absl::StrCat(buffered_->limit())}});
  }
  return out;
}

}  // namespace attnserve
