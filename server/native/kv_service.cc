// Reactors of the K/V front-end; see kv_service.h.
#include "server/native/kv_service.h"

#include <atomic>
#include <exception>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/tensor_wire_slices.h"
#include "server/call_deadline.h"
#include "server/in_flight.h"
#include "server/native/field_names.h"
#include "server/native/forward_call.h"
#include "server/native/kv_messages.h"
#include "server/native/kv_moved.h"
#include "server/native/shm_calls.h"
#include "server/stream_reactor.h"
#include "server/tenant.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// A call answered on the spot.
grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// Unary AppendAttend: the pool's completion finishes the RPC. It holds the
// call's messages: the method is raw (kv_service.h), so gRPC holds bytes.
class AppendAttendReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit AppendAttendReactor(InFlightCounter* in_flight)
      : in_flight_(in_flight), cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    in_flight_->Add();
  }
  std::shared_ptr<const std::atomic<bool>> cancelled() const { return cancelled_; }
  void OnCancel() override { cancelled_->store(true, std::memory_order_release); }
  void OnDone() override {
    in_flight_->Done();
    delete this;
  }

  v1::AppendAttendRequest request;
  KvStagedInputs staged;  // q, k and v's bytes, parsed out of the request
  v1::AppendAttendResponse response;
  std::shared_ptr<const char> o;  // o's bytes when not in response.o (KvOutputPlace::shared)

 private:
  InFlightCounter* const in_flight_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
};

// `response` with o's and lse's bytes as slices it hands over, not copies;
// o's from `o` (OutputLayout's o_bytes) when the runner wrote it there.
grpc::ByteBuffer EncodeAppendAttend(v1::AppendAttendResponse* response,
                                    std::shared_ptr<const char> o) {
  using R = v1::AppendAttendResponse;
  static_assert(v1::Tensor::kDataFieldNumber == 3, "TensorWireSlices writes Tensor.data as 3");
  TensorWireSlices tensors;
  if (o != nullptr && response->has_o()) {
    int64_t bytes = DTypeSize(static_cast<DType>(response->o().dtype()));
    for (int64_t d : response->o().shape()) bytes *= d;
    tensors.ShareData(R::kOFieldNumber, std::move(o), static_cast<size_t>(bytes));
  }
  if (response->has_o()) tensors.TakeData(R::kOFieldNumber, response->mutable_o()->mutable_data());
  if (response->has_lse()) {
    tensors.TakeData(R::kLseFieldNumber, response->mutable_lse()->mutable_data());
  }
  return tensors.Encode(*response);
}

}  // namespace

KvService::KvService(KvRunner* runner, ServerMetrics* metrics, const StreamLimits& stream_limits)
    : runner_(runner), pool_(runner->pool()), stream_limits_(stream_limits), metrics_(metrics) {}

namespace {

// GetCacheStats' ids, deduplicated and bounded so that a small request
// cannot ask for a large answer.
absl::StatusOr<std::vector<uint64_t>> StatsIds(const v1::GetCacheStatsRequest& request,
                                               int32_t num_layers) {
  if (request.sequence_ids_size() > kMaxKvIdsPerCall) {
    return absl::InvalidArgumentError(absl::StrCat("sequence_ids: expected at most ",
                                                   kMaxKvIdsPerCall, " per call, got ",
                                                   request.sequence_ids_size()));
  }
  // Each id is answered once, however often it is asked for.
  std::vector<uint64_t> ids;
  std::set<uint64_t> seen;
  for (uint64_t id : request.sequence_ids()) {
    if (seen.insert(id).second) ids.push_back(id);
  }
  const int64_t lengths = static_cast<int64_t>(ids.size()) * num_layers;
  if (lengths > kMaxKvStatsLengths) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence_ids: ", ids.size(), " sequences of ", num_layers, " layers are ",
                     lengths, " lengths, more than one answer carries (", kMaxKvStatsLengths,
                     "): ask for at most ", kMaxKvStatsLengths / num_layers, " per call"));
  }
  return ids;
}

}  // namespace

grpc::ServerUnaryReactor* KvService::CreateCache(grpc::CallbackServerContext* context,
                                                 const v1::CreateCacheRequest* request,
                                                 v1::CreateCacheResponse* response) {
  return Gated(context, request->cache_id(), /*create=*/true, [=] {
    absl::Status status = runner_->Draining();
    if (status.ok()) {
      absl::StatusOr<std::shared_ptr<KvCache>> cache =
          pool_->CreateCache(TenantOf(auth_, context), DecodeCreateCache(*request));
      status = cache.status();
      if (cache.ok()) {
        FillCacheStats((*cache)->Stats(), response->mutable_stats());
        spdlog::info("kv cache created id={} device={} page_size={} capacity_pages={}",
                     (*cache)->id(), (*cache)->device(), (*cache)->page_size(),
                     response->stats().capacity_pages());
      }
    }
    return status;
  });
}

grpc::ServerUnaryReactor* KvService::DropCache(grpc::CallbackServerContext* context,
                                               const v1::DropCacheRequest* request,
                                               v1::DropCacheResponse*) {
  if (gate_ != nullptr && AsksToGive(context)) {
    // The peer asks for the cache (kv_moved.h): it moves there, then goes.
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    gate_->Give(TenantOf(auth_, context), request->cache_id(), AuthorizationOf(context),
                [reactor](const absl::Status& status) { reactor->Finish(ToGrpcStatus(status)); });
    return reactor;
  }
  return Gated(context, request->cache_id(), /*create=*/false, [=] {
    absl::Status status = runner_->Draining();
    if (status.ok()) status = pool_->DropCache(TenantOf(auth_, context), request->cache_id());
    return status;
  });
}

grpc::ServerUnaryReactor* KvService::CreateSequences(grpc::CallbackServerContext* context,
                                                     const v1::CreateSequencesRequest* request,
                                                     v1::CreateSequencesResponse* response) {
  return Gated(context, request->cache_id(), /*create=*/false, [=] {
    absl::Status status = runner_->Draining();
    // Refused before anything is decoded (KvCache checks the same bound).
    if (status.ok() && request->sequences_size() > kMaxKvIdsPerCall) {
      status =
          absl::InvalidArgumentError(absl::StrCat("sequences: expected at most ", kMaxKvIdsPerCall,
                                                  " per call, got ", request->sequences_size()));
    }
    if (status.ok()) {
      absl::StatusOr<std::shared_ptr<KvCache>> cache =
          pool_->Find(TenantOf(auth_, context), request->cache_id());
      status = cache.ok() ? (*cache)->CreateSequences(DecodeSequences(*request)) : cache.status();
      if (status.ok()) FillCacheStats((*cache)->Stats(), response->mutable_stats());
    }
    return status;
  });
}

grpc::ServerUnaryReactor* KvService::Truncate(grpc::CallbackServerContext* context,
                                              const v1::TruncateRequest* request,
                                              v1::TruncateResponse* response) {
  return Gated(context, request->cache_id(), /*create=*/false, [=] {
    absl::Status status = runner_->Draining();
    if (status.ok()) {
      absl::StatusOr<std::shared_ptr<KvCache>> cache =
          pool_->Find(TenantOf(auth_, context), request->cache_id());
      status = cache.ok() ? (*cache)->Truncate(request->sequence_id(),
                                               request->has_layer()
                                                   ? std::optional<int32_t>(request->layer())
                                                   : std::nullopt,
                                               request->length())
                          : cache.status();
      if (status.ok()) FillCacheStats((*cache)->Stats(), response->mutable_stats());
    }
    return status;
  });
}

grpc::ServerUnaryReactor* KvService::FreeSequences(grpc::CallbackServerContext* context,
                                                   const v1::FreeSequencesRequest* request,
                                                   v1::FreeSequencesResponse* response) {
  return Gated(context, request->cache_id(), /*create=*/false, [=] {
    absl::Status status = runner_->Draining();
    if (status.ok()) {
      absl::StatusOr<std::shared_ptr<KvCache>> cache =
          pool_->Find(TenantOf(auth_, context), request->cache_id());
      status = cache.ok() ? (*cache)->Free(std::vector<uint64_t>(request->sequence_ids().begin(),
                                                                 request->sequence_ids().end()))
                          : cache.status();
      if (status.ok()) FillCacheStats((*cache)->Stats(), response->mutable_stats());
    }
    return status;
  });
}

grpc::ServerUnaryReactor* KvService::GetCacheStats(grpc::CallbackServerContext* context,
                                                   const v1::GetCacheStatsRequest* request,
                                                   v1::GetCacheStatsResponse* response) {
  // Read-only: answered from what is here (never fetched from a peer).
  return Gated(
      context, request->cache_id(), /*create=*/false,
      [=] {
        // Statistics stay readable during a drain: they change nothing.
        absl::StatusOr<std::shared_ptr<KvCache>> cache =
            pool_->Find(TenantOf(auth_, context), request->cache_id());
        if (!cache.ok()) return cache.status();
        absl::StatusOr<std::vector<uint64_t>> ids =
            StatsIds(*request, (*cache)->geometry().num_layers);
        if (!ids.ok()) return ids.status();
        absl::Status status;
        FillCacheStats((*cache)->Stats(), response->mutable_stats());
        for (uint64_t id : *ids) {
          absl::StatusOr<std::vector<int32_t>> lengths = (*cache)->Lengths(id);
          if (!lengths.ok()) {
            status = lengths.status();
            response->Clear();
            break;
          }
          v1::SequenceLengths* out = response->add_sequences();
          out->set_sequence_id(id);
          for (int32_t len : *lengths) out->add_lengths(len);
        }
        return status;
      },
      /*read_only=*/true);
}

void KvService::StartAppendAttend(CallMeta meta, const v1::AppendAttendRequest* request,
                                  v1::AppendAttendResponse* response,
                                  std::function<void(const absl::Status&)> done,
                                  std::shared_ptr<const char>* o_shared,
                                  const KvStagedInputs* staged) {
  // The call and its regions live until its completion has run (the
  // completion holds them).
  auto call = std::make_shared<KvCall>(KvCallOf(*request, std::move(meta), staged));
  auto regions = std::make_shared<ShmCall>(shm_, call->meta.tenant);
  // At most kMaxRequestIdBytes back, as Forward does (an over-long id is refused).
  response->set_request_id(request->request_id().substr(0, kMaxRequestIdBytes));
  response->set_backend(runner_->backend_name());
  // Spans are read (and output spans checked) before the call starts: the
  // append cannot be undone, so a region that fails must fail it first.
  absl::Status decoded = KvShmInputs(*request, regions.get(), call.get());
  // StatusOr may not hold an OK status: only a failure is copied over.
  absl::StatusOr<KvShmOutputs> outputs = decoded.ok() ? KvShmOutputSpans(*request, regions.get())
                                                      : absl::StatusOr<KvShmOutputs>(decoded);
  if (!outputs.ok()) return done(outputs.status());
  // Inputs read in place from a region: it must still be whole when the
  // append commits (a region shrunk during the call fails it, appending nothing).
  std::function<absl::Status()> inputs_intact;
  if (regions->any()) inputs_intact = [regions] { return regions->CheckIntact(); };
  // A mapped o span is written by the launch itself (no copy after the call).
  KvOutputPlace o_place = KvShmOutputPlace(*outputs);
  o_place.shared = o_shared != nullptr;
  runner_->Start(
      call.get(), NativeFieldNames(),
      [call, regions, outputs = *std::move(outputs), o_place, response, o_shared,
       done = std::move(done)](const absl::Status& status, const WorkTimings& timings,
                               KvResult* result) {
        absl::Status delivered = status;
        if (delivered.ok()) {
          FillAppendAttendResponse(result, response);
          if (o_shared != nullptr) *o_shared = std::move(result->o_shared);
          // After the append: a region failing here fails the
          // answer, not the append (docs/shared-memory.md).
          delivered = DeliverKvShm(outputs, o_place.o != nullptr, response);
          if (!delivered.ok()) {
            response->clear_o();
            response->clear_lse();
          }
        }
        FillServerTiming(timings, response->mutable_timing());
        done(delivered);
      },
      std::move(inputs_intact), o_place);
}

grpc::ServerUnaryReactor* KvService::AppendAttend(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request_bytes,
                                                  grpc::ByteBuffer* response_bytes) {
  auto* reactor = new AppendAttendReactor(&in_flight_);
  // gRPC owns the request's buffer until the call is done but never reads it
  // again: parsing empties it, so the raw bytes go now, not at OnDone. q, k
  // and v land once, in memory the backend's copies read where it lies.
  KvPool* pool = pool_;
  auto* raw = const_cast<grpc::ByteBuffer*>(request_bytes);
  grpc::Status parsed;
  // The reactor is made and counted in flight: a throw (the backend's host
  // memory) must finish it here, not escape to gRPC, which would answer
  // UNIMPLEMENTED with no message and never run OnDone.
  try {
    parsed = pool->host_tensors()
                 ? ParseAppendAttendStaged(
                       raw, [pool](int64_t bytes) { return pool->AllocateHostTensor(bytes); },
                       &reactor->request, &reactor->staged)
                 : ParseAppendAttend(raw, &reactor->request);
  } catch (...) {
    reactor->staged = KvStagedInputs();
    parsed = ToGrpcStatus(StatusOfException(std::current_exception(), "AppendAttend"));
  }
  if (!parsed.ok()) {
    reactor->Finish(parsed);
    return reactor;
  }
  const v1::AppendAttendRequest* request = &reactor->request;
  v1::AppendAttendResponse* response = &reactor->response;
  // Finish may run before this returns (a refused call); the callback API
  // holds it until the reactor is bound to the call.
  auto start = [this, context, reactor, request, response,
                response_bytes](KvHandoffGate::Pass pass) {
    StartAppendAttend(
        CallMetaOf(TenantOf(auth_, context), DeadlineOf(context), reactor->cancelled()), request,
        response,
        [reactor, response, response_bytes,
         pass = std::move(pass)](const absl::Status& status) mutable {
          // A failed call's body is not sent (the status is), so only an OK
          // one is encoded.
          if (status.ok()) *response_bytes = EncodeAppendAttend(response, std::move(reactor->o));
          reactor->Finish(ToGrpcStatus(status));
          pass.reset();
        },
        &reactor->o, &reactor->staged);
  };
  if (gate_ == nullptr) {
    start(nullptr);
    return reactor;
  }
  gate_->Enter({TenantOf(auth_, context), request->cache_id(), AuthorizationOf(context)},
               [context, reactor, start](const absl::Status& refused, KvHandoffGate::Pass pass) {
                 if (refused.ok()) return start(std::move(pass));
                 AddMovedToTrailer(context, refused);
                 reactor->Finish(ToGrpcStatus(refused));
               });
  return reactor;
}

grpc::ServerBidiReactor<v1::AppendAttendRequest, v1::AppendAttendResponse>*
KvService::AppendAttendStream(grpc::CallbackServerContext* context) {
  using Reactor = PipelinedStreamReactor<v1::AppendAttendRequest, v1::AppendAttendResponse>;
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  auto start = [this, cancelled, who = StreamTenantOf(auth_, context),
                deadline = DeadlineOf(context),
                authorization = AuthorizationOf(context)](Reactor::Call* call, Reactor::Done done) {
    // A token withdrawn while the stream is open stops its next request.
    if (absl::Status valid = who->StillValid(); !valid.ok()) {
      call->response.set_request_id(call->request.request_id().substr(0, kMaxRequestIdBytes));
      return done(valid);
    }
    auto go = [this, who, deadline, cancelled, call, done](const absl::Status& refused,
                                                           KvHandoffGate::Pass pass) {
      if (!refused.ok()) {
        call->response.set_request_id(call->request.request_id().substr(0, kMaxRequestIdBytes));
        return done(refused);
      }
      StartAppendAttend(CallMetaOf(who->tenant(), deadline, cancelled), &call->request,
                        &call->response,
                        [done, pass = std::move(pass)](const absl::Status& s) mutable {
                          done(s);
                          pass.reset();
                        });
    };
    if (gate_ == nullptr) return go(absl::OkStatus(), nullptr);
    gate_->Enter({who->tenant(), call->request.cache_id(), authorization, /*create=*/false,
                  /*read_only=*/false, /*stream=*/true},
                 std::move(go));
  };
  // A failed call is answered in-band and the stream goes on.
  auto fail = [](Reactor::Call* call, const absl::Status& status) {
    call->response.set_error_code(ToRpcCode(status));
    call->response.set_error_message(std::string(status.message()));
  };
  // A moved cache ends the stream with the moved-to trailer; its client
  // reopens the stream there and sends the unanswered requests again.
  auto ends = [context](const absl::Status& status, bool first) {
    if (!MovedToOf(status).has_value()) return false;
    if (first) AddMovedToTrailer(context, status);
    return true;
  };
  return new Reactor(&in_flight_, std::move(cancelled), std::move(start), std::move(fail),
                     stream_limits_, metrics_ != nullptr ? &metrics_->streams() : nullptr,
                     std::move(ends));
}

grpc::ServerUnaryReactor* KvService::Gated(grpc::CallbackServerContext* context,
                                           const std::string& cache_id, bool create,
                                           std::function<absl::Status()> body, bool read_only) {
  if (gate_ == nullptr) return Answer(context, body());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  KvHandoffGate::Call call{TenantOf(auth_, context), cache_id, AuthorizationOf(context), create,
                           read_only};
  gate_->Enter(std::move(call), [context, reactor, body = std::move(body)](
                                    const absl::Status& refused, KvHandoffGate::Pass pass) {
    const absl::Status status = refused.ok() ? body() : refused;
    pass.reset();
    AddMovedToTrailer(context, status);
    reactor->Finish(ToGrpcStatus(status));
  });
  return reactor;
}

std::string KvService::RenderMetrics(const KvPoolStats& s) {
  std::string out;
  std::vector<std::pair<std::string, std::string>> used, free, util, bytes, limit;
  for (const KvPoolStats::Device& d : s.devices) {
    const std::string label = absl::StrCat("device=\"", d.index, "\"");
    used.emplace_back(label, absl::StrCat(d.pages_used));
    free.emplace_back(label, absl::StrCat(d.pages_capacity - d.pages_used));
    util.emplace_back(label,
                      absl::StrCat(d.bytes_limit > 0 ? double(d.bytes_used) / d.bytes_limit : 0.0));
    bytes.emplace_back(label, absl::StrCat(d.bytes_used));
    limit.emplace_back(label, absl::StrCat(d.bytes_limit));
  }
  // Triton's response-cache gauge is nv_cache_util; this is its K/V twin.
  AppendFamily(&out, "nv_kv_cache_util", "gauge",
               "K/V pool utilization [0.0 - 1.0]: bytes allocated / --kv_cache_bytes", util);
  AppendFamily(&out, "attnserve_kv_pages_used", "gauge",
               "K/V pages held by sequences (a shared page counts once)", used);
  AppendFamily(&out, "attnserve_kv_pages_free", "gauge",
               "K/V pages the caches may still take (capacity minus used)", free);
  AppendFamily(&out, "attnserve_kv_bytes_allocated", "gauge",
               "K/V slab bytes allocated on the device", bytes);
  AppendFamily(&out, "attnserve_kv_bytes_limit", "gauge", "K/V byte budget (--kv_cache_bytes)",
               limit);
  AppendFamily(&out, "attnserve_kv_caches", "gauge", "Live K/V caches",
               {{"", absl::StrCat(s.caches)}});
  AppendFamily(&out, "attnserve_kv_sequences", "gauge", "Live K/V sequences",
               {{"", absl::StrCat(s.sequences)}});
  AppendFamily(&out, "attnserve_kv_expired_sequences_total", "counter",
               "Sequences removed after --kv_idle_timeout",
               {{"", absl::StrCat(s.expired_sequences)}});
  AppendFamily(&out, "attnserve_kv_expired_caches_total", "counter",
               "Caches removed after --kv_idle_timeout", {{"", absl::StrCat(s.expired_caches)}});
  return out;
}

}  // namespace attnserve
