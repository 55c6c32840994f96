// KvClient and AppendAttendStream: request building, the cache-id header, the
// typed append-and-attend call with its shape checks, and the stream's
// request_id matching (see kv_client.h).
#include "client/kv_client.h"

#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/status.h>
#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <random>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/async_unary.h"
#include "common/dtype.h"
#include "common/shape_string.h"
#include "common/tensor_wire_slices.h"

namespace attnserve {
namespace {

// Shared by both MakeAppendAttendRequest overloads; `Inputs` is const& or &&.
template <typename Inputs>
v1::AppendAttendRequest BuildRequest(Inputs&& in) {
  v1::AppendAttendRequest request;
  request.set_request_id(in.request_id);
  request.set_cache_id(in.cache_id);
  request.set_layer(in.layer);
  for (const KvClientStep& s : in.sequences) {
    v1::SequenceStep* step = request.add_sequences();
    step->set_sequence_id(s.sequence_id);
    step->set_expected_length(s.expected_length);
    step->set_num_new_tokens(s.num_new_tokens);
    step->set_num_queries(s.num_queries);
    step->mutable_attend_pages()->Add(s.attend_pages.begin(), s.attend_pages.end());
  }
  // A default HostTensor (FP32 [0]) stands for "no rows" and stays unset on
  // the wire, so an append-only or attend-only call needs no placeholder of
  // the right dtype and heads.
  // (mutable_* would create the field, so it is only called for a tensor.)
  auto set = [](auto&& from, auto mutable_field) {
    if (from.rank() == 1 && from.num_elements() == 0) return;
    if constexpr (std::is_rvalue_reference_v<Inputs&&>) {
      std::move(from).MoveToProto(mutable_field());
    } else {
      from.CopyToProto(mutable_field());
    }
  };
  set(std::forward<Inputs>(in).q, [&] { return request.mutable_q(); });
  set(std::forward<Inputs>(in).k, [&] { return request.mutable_k(); });
  set(std::forward<Inputs>(in).v, [&] { return request.mutable_v(); });
  AttentionOptionsToProto(in.options, request.mutable_options());
  return request;
}

// O must be [sum num_queries, Hq, Dv] in q's dtype and LSE FP32 [Hq, sum
// num_queries]; anything else is a server bug, INTERNAL rather than read past.
absl::Status CheckShapes(const v1::AppendAttendRequest& request, const AppendAttendResult& r) {
  const auto& q_shape = request.q().shape();
  if (q_shape.empty()) {
    // No queries were sent (append only): O must hold no rows.
    if (r.o.num_elements() != 0) {
      return absl::InternalError(
          absl::StrCat("server returned o ", r.o.DebugString(), " for a call without queries"));
    }
  }
  std::vector<int64_t> want_o(q_shape.begin(), q_shape.end());
  // O rows have V's head dim: v's last dim when v is sent; without v (an
  // attend-only call, or an MLA cache whose V is part of K) any width up to q's.
  const auto& v_shape = request.v().shape();
  if (!want_o.empty() && !v_shape.empty()) {
    want_o.back() = v_shape[v_shape.size() - 1];
  } else if (!want_o.empty() && r.o.shape().size() == want_o.size() && r.o.shape().back() > 0 &&
             r.o.shape().back() <= want_o.back()) {
    want_o.back() = r.o.shape().back();
  }
  absl::StatusOr<DType> want_dtype = DTypeFromProto(request.q().dtype());
  if (!q_shape.empty() && want_dtype.ok() &&
      (r.o.shape() != want_o || r.o.dtype() != *want_dtype)) {
    return absl::InternalError(absl::StrCat("server returned o ", r.o.DebugString(), ", expected ",
                                            std::string(DTypeName(*want_dtype)),
                                            ShapeString(want_o)));
  }
  if (r.lengths.size() != static_cast<size_t>(request.sequences_size())) {
    return absl::InternalError(absl::StrCat("server returned ", r.lengths.size(), " lengths for ",
                                            request.sequences_size(), " sequences"));
  }
  if (!request.options().return_lse()) return absl::OkStatus();
  if (!r.lse) return absl::InternalError("return_lse was set but the response has no lse");
  if (want_o.size() == 3) {
    const std::vector<int64_t> want_lse = {want_o[1], want_o[0]};
    if (r.lse->shape() != want_lse || r.lse->dtype() != DType::kFP32) {
      return absl::InternalError(absl::StrCat("server returned lse ", r.lse->DebugString(),
                                              ", expected FP32", ShapeString(want_lse)));
    }
  }
  return absl::OkStatus();
}

// `request`'s encoding with q, k and v's bytes moved into slices (their
// shapes stay in `request`).
grpc::ByteBuffer EncodeRequest(v1::AppendAttendRequest* request) {
  // Only the tensors present: mutable_* would create an absent one (an
  // append-only call has no q).
  TensorWireSlices tensors;
  using R = v1::AppendAttendRequest;
  static_assert(v1::Tensor::kDataFieldNumber == 3, "TensorWireSlices writes Tensor.data as 3");
  if (request->has_q()) tensors.TakeData(R::kQFieldNumber, request->mutable_q()->mutable_data());
  if (request->has_k()) tensors.TakeData(R::kKFieldNumber, request->mutable_k()->mutable_data());
  if (request->has_v()) tensors.TakeData(R::kVFieldNumber, request->mutable_v()->mutable_data());
  return tensors.Encode(*request);
}

// What AppendAttendResultFromProto reads of a request, without the bytes.
v1::AppendAttendRequest ShapesOf(const v1::AppendAttendRequest& r) {
  v1::AppendAttendRequest out;
  out.mutable_q()->set_dtype(r.q().dtype());
  *out.mutable_q()->mutable_shape() = r.q().shape();
  *out.mutable_sequences() = r.sequences();
  *out.mutable_options() = r.options();
  return out;
}

}  // namespace

v1::KvGeometry KvGeometryToProto(const KvClientGeometry& g) {
  v1::KvGeometry out;
  out.set_num_layers(g.num_layers);
  out.set_num_heads_kv(g.num_heads_kv);
  out.set_head_dim(g.head_dim);
  out.set_dtype(DTypeToProto(g.dtype));
  if (g.cache_dtype != DType{0}) out.set_cache_dtype(DTypeToProto(g.cache_dtype));
  out.set_head_dim_v(g.head_dim_v);
  out.set_v_in_k(g.v_in_k);
  return out;
}

v1::CreateCacheRequest MakeCreateCacheRequest(const CacheSpec& spec) {
  v1::CreateCacheRequest request;
  *request.mutable_geometry() = KvGeometryToProto(spec.geometry);
  request.set_page_size(spec.page_size);
  request.set_capacity_tokens(spec.capacity_tokens);
  request.set_capacity_bytes(spec.capacity_bytes);
  request.set_cache_id(spec.cache_id);
  if (spec.device) request.set_device(*spec.device);
  for (int d : spec.devices) request.add_devices(d);
  request.set_reserve(spec.reserve);
  return request;
}

v1::AppendAttendRequest MakeAppendAttendRequest(const AppendAttendInputs& inputs) {
  return BuildRequest(inputs);
}
v1::AppendAttendRequest MakeAppendAttendRequest(AppendAttendInputs&& inputs) {
  return BuildRequest(std::move(inputs));
}

absl::StatusOr<AppendAttendResult> AppendAttendResultFromProto(
    const v1::AppendAttendRequest& request, v1::AppendAttendResponse&& response) {
  const absl::Status error = StatusFromRpcCode(response.error_code(), response.error_message());
  if (!error.ok()) return error;
  AppendAttendResult result;
  result.request_id = response.request_id();
  const absl::Status outputs =
      OutputsFromProto(response.mutable_o(), response.has_lse() ? response.mutable_lse() : nullptr,
                       &result.o, &result.lse);
  if (!outputs.ok()) return outputs;
  result.lengths.assign(response.lengths().begin(), response.lengths().end());
  result.timing = ServerTimingFromProto(response.timing());
  result.backend = response.backend();
  const absl::Status shapes = CheckShapes(request, result);
  if (!shapes.ok()) return shapes;
  return result;
}

absl::StatusOr<ShmOutputSpans> PlaceAppendAttendInArena(ShmArena& arena,
                                                        v1::AppendAttendRequest* request) {
  arena.Reset();
  // Only the tensors present: mutable_* would create an absent one (an
  // append-only call has no q).
  absl::Status moved;
  if (request->has_q()) moved.Update(arena.MoveIn(request->mutable_q()));
  if (request->has_k()) moved.Update(arena.MoveIn(request->mutable_k()));
  if (request->has_v()) moved.Update(arena.MoveIn(request->mutable_v()));
  if (!moved.ok()) return moved;
  if (!request->has_q()) return ShmOutputSpans{};  // append only: no outputs
  return AllocateOutputSpans(arena, request->q(), request->options().return_lse(),
                             request->mutable_output_shm());
}

absl::Status TakeAppendAttendOutputs(const ShmArena& arena, const ShmOutputSpans& spans,
                                     v1::AppendAttendResponse* response) {
  if (response->error_code() != 0) return absl::OkStatus();
  if (spans.has_o) {
    const absl::Status o = arena.TakeOut(spans.o, "o", response->mutable_o());
    if (!o.ok()) return o;
  }
  if (spans.has_lse) return arena.TakeOut(spans.lse, "lse", response->mutable_lse());
  return absl::OkStatus();
}

// --- KvClient ---

KvClient::KvClient(AttentionClient& client, KvMovedOptions moved) : client_(client), moved_(moved) {
  for (int i = 0; i < client.num_channels(); ++i) {
    channels_.push_back(client.channel(i));
    stubs_.push_back(v1::KvCache::NewStub(channels_.back()));
  }
}

void KvClient::Prepare(const CallOptions& call, const std::string& cache_id,
                       grpc::ClientContext* context) const {
  client_.Prepare(call, context);
  if (!cache_id.empty()) context->AddMetadata(kCacheIdHeader, cache_id);
}

KvClient::Route KvClient::Next() {
  const size_t i =
      stubs_.size() == 1 ? 0 : next_.fetch_add(1, std::memory_order_relaxed) % stubs_.size();
  return {stubs_[i].get(), channels_[i].get()};
}

KvClient::Route KvClient::RouteFor(const std::string& cache_id) {
  {
    absl::MutexLock lock(&routes_mu_);
    auto route = routes_.find(cache_id);
    if (route != routes_.end()) {
      return {moved_stubs_.at(route->second).get(),
              moved_clients_.at(route->second)->channel(0).get()};
    }
  }
  return Next();
}

absl::StatusOr<KvClient::Route> KvClient::RouteTo(const std::string& cache_id,
                                                  const std::string& address) {
  absl::MutexLock lock(&routes_mu_);
  if (moved_stubs_.count(address) == 0) {
    // Same credentials and settings as the client's own target.
    absl::StatusOr<std::unique_ptr<AttentionClient>> made =
        AttentionClient::Create(address, client_.options());
    if (!made.ok()) return made.status();
    moved_stubs_[address] = v1::KvCache::NewStub((*made)->channel(0));
    moved_clients_[address] = *std::move(made);
  }
  routes_[cache_id] = address;
  return Route{moved_stubs_.at(address).get(), moved_clients_.at(address)->channel(0).get()};
}

grpc::Status KvClient::Invoke(
    const CallOptions& call, const std::string& cache_id,
    const std::function<grpc::Status(const Route&, grpc::ClientContext*)>& rpc) {
  const absl::Time give_up = absl::Now() + moved_.budget;
  absl::Duration backoff = absl::Milliseconds(5);
  while (true) {
    grpc::ClientContext context;
    Prepare(call, cache_id, &context);
    const grpc::Status status = rpc(RouteFor(cache_id), &context);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE ||
        moved_.policy == KvMovedOptions::Policy::kOff || absl::Now() >= give_up) {
      return status;
    }
    const auto& trailers = context.GetServerTrailingMetadata();
    const auto moved_to = trailers.find(kMovedToHeader);
    if (moved_.policy == KvMovedOptions::Policy::kFollow) {
      if (moved_to == trailers.end()) return status;
      const std::string address(moved_to->second.data(), moved_to->second.size());
      if (!RouteTo(cache_id, address).ok()) return status;
    } else {
      // Through a proxy: the drained replica answers until it exits, then
      // the proxy sends the call to the replica that holds the cache.
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Milliseconds(100));
    }
    moved_retries_.fetch_add(1, std::memory_order_relaxed);
  }
}

absl::StatusOr<v1::CacheStats> KvClient::CreateCache(const CacheSpec& spec,
                                                     const CallOptions& call) {
  v1::CreateCacheRequest request = MakeCreateCacheRequest(spec);
  if (request.cache_id().empty()) {
    // An id the server chose would be unknown to the proxy when it routes
    // CreateCache, which could then land on a replica other than the one the
    // id hashes to; an id chosen here routes every call, the first included.
    std::random_device entropy;
    request.set_cache_id(absl::StrCat("c-", absl::Hex(entropy(), absl::kZeroPad8),
                                      absl::Hex(entropy(), absl::kZeroPad8)));
  }
  return CreateCache(request, call);
}

absl::StatusOr<v1::CacheStats> KvClient::CreateCache(const v1::CreateCacheRequest& request,
                                                     const CallOptions& call) {
  // Without an id (the server chooses one) the call carries no header.
  v1::CreateCacheResponse response;
  const grpc::Status status =
      Invoke(call, request.cache_id(), [&](const Route& route, grpc::ClientContext* context) {
        return route.stub->CreateCache(context, request, &response);
      });
  if (!status.ok()) return ToAbslStatus(status);
  return std::move(*response.mutable_stats());
}

absl::Status KvClient::DropCache(const std::string& cache_id, const CallOptions& call) {
  v1::DropCacheRequest request;
  request.set_cache_id(cache_id);
  v1::DropCacheResponse response;
  return ToAbslStatus(Invoke(call, cache_id, [&](const Route& route, grpc::ClientContext* context) {
    return route.stub->DropCache(context, request, &response);
  }));
}

absl::StatusOr<v1::CacheStats> KvClient::CreateSequences(const std::string& cache_id,
                                                         const std::vector<SequenceSpec>& sequences,
                                                         const CallOptions& call) {
  v1::CreateSequencesRequest request;
  request.set_cache_id(cache_id);
  for (const SequenceSpec& s : sequences) {
    v1::SequenceSpec* spec = request.add_sequences();
    spec->set_sequence_id(s.sequence_id);
    if (s.fork_from) spec->set_fork_from(*s.fork_from);
    if (s.fork_length) spec->set_fork_length(*s.fork_length);
  }
  v1::CreateSequencesResponse response;
  const grpc::Status status =
      Invoke(call, cache_id, [&](const Route& route, grpc::ClientContext* context) {
        return route.stub->CreateSequences(context, request, &response);
      });
  if (!status.ok()) return ToAbslStatus(status);
  return std::move(*response.mutable_stats());
}

absl::StatusOr<v1::CacheStats> KvClient::Truncate(const std::string& cache_id, uint64_t sequence_id,
                                                  int32_t length, std::optional<int32_t> layer,
                                                  const CallOptions& call) {
  v1::TruncateRequest request;
  request.set_cache_id(cache_id);
  request.set_sequence_id(sequence_id);
  if (layer) request.set_layer(*layer);
  request.set_length(length);
  v1::TruncateResponse response;
  const grpc::Status status =
      Invoke(call, cache_id, [&](const Route& route, grpc::ClientContext* context) {
        return route.stub->Truncate(context, request, &response);
      });
  if (!status.ok()) return ToAbslStatus(status);
  return std::move(*response.mutable_stats());
}

absl::StatusOr<v1::CacheStats> KvClient::FreeSequences(const std::string& cache_id,
                                                       const std::vector<uint64_t>& sequence_ids,
                                                       const CallOptions& call) {
  v1::FreeSequencesRequest request;
  request.set_cache_id(cache_id);
  request.mutable_sequence_ids()->Assign(sequence_ids.begin(), sequence_ids.end());
  v1::FreeSequencesResponse response;
  const grpc::Status status =
      Invoke(call, cache_id, [&](const Route& route, grpc::ClientContext* context) {
        return route.stub->FreeSequences(context, request, &response);
      });
  if (!status.ok()) return ToAbslStatus(status);
  return std::move(*response.mutable_stats());
}

absl::StatusOr<v1::GetCacheStatsResponse> KvClient::GetCacheStats(
    const std::string& cache_id, const std::vector<uint64_t>& sequence_ids,
    const CallOptions& call) {
  v1::GetCacheStatsRequest request;
  request.set_cache_id(cache_id);
  request.mutable_sequence_ids()->Assign(sequence_ids.begin(), sequence_ids.end());
  v1::GetCacheStatsResponse response;
  const grpc::Status status =
      Invoke(call, cache_id, [&](const Route& route, grpc::ClientContext* context) {
        return route.stub->GetCacheStats(context, request, &response);
      });
  if (!status.ok()) return ToAbslStatus(status);
  return response;
}

absl::StatusOr<v1::AppendAttendResponse> KvClient::AppendAttend(
    const v1::AppendAttendRequest& request, const CallOptions& call) {
  v1::AppendAttendResponse response;
  const grpc::Status status =
      Invoke(call, request.cache_id(), [&](const Route& route, grpc::ClientContext* context) {
        response.Clear();
        return route.stub->AppendAttend(context, request, &response);
      });
  if (!status.ok()) return ToAbslStatus(status);
  return response;
}

absl::StatusOr<v1::AppendAttendResponse> KvClient::AppendAttend(v1::AppendAttendRequest* request,
                                                                const CallOptions& call) {
  // The generated stub would serialize the request into one buffer (a copy
  // of every tensor byte); this call sends its own encoding instead, through
  // the same blocking path the stub takes.
  static const grpc::internal::RpcMethod kMethod("/attnserve.v1.KvCache/AppendAttend",
                                                 grpc::internal::RpcMethod::NORMAL_RPC);
  const grpc::ByteBuffer wire = EncodeRequest(request);
  v1::AppendAttendResponse response;
  const grpc::Status status =
      Invoke(call, request->cache_id(), [&](const Route& route, grpc::ClientContext* context) {
        response.Clear();
        return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, v1::AppendAttendResponse,
                                                 grpc::ByteBuffer, grpc::protobuf::MessageLite>(
            route.channel, kMethod, context, wire, &response);
      });
  if (!status.ok()) return ToAbslStatus(status);
  return response;
}

absl::StatusOr<AppendAttendResult> KvClient::AppendAttend(const AppendAttendInputs& inputs,
                                                          const CallOptions& call) {
  v1::AppendAttendRequest request = MakeAppendAttendRequest(inputs);
  // The tensors' bytes go onto the wire; their shapes stay for the check.
  absl::StatusOr<v1::AppendAttendResponse> response = AppendAttend(&request, call);
  if (!response.ok()) return response.status();
  return AppendAttendResultFromProto(request, *std::move(response));
}

absl::StatusOr<v1::AppendAttendResponse> KvClient::AppendAttend(v1::AppendAttendRequest request,
                                                                ShmArena& arena,
                                                                const CallOptions& call) {
  absl::StatusOr<ShmOutputSpans> spans = PlaceAppendAttendInArena(arena, &request);
  if (!spans.ok()) return spans.status();
  absl::StatusOr<v1::AppendAttendResponse> response = AppendAttend(request, call);
  if (!response.ok()) return response.status();
  const absl::Status taken = TakeAppendAttendOutputs(arena, *spans, &*response);
  if (!taken.ok()) return taken;
  return response;
}

absl::StatusOr<AppendAttendResult> KvClient::AppendAttend(const AppendAttendInputs& inputs,
                                                          ShmArena& arena,
                                                          const CallOptions& call) {
  v1::AppendAttendRequest request = MakeAppendAttendRequest(inputs);
  const v1::AppendAttendRequest shapes = ShapesOf(request);
  absl::StatusOr<v1::AppendAttendResponse> response = AppendAttend(std::move(request), arena, call);
  if (!response.ok()) return response.status();
  return AppendAttendResultFromProto(shapes, *std::move(response));
}

void KvClient::AppendAttendAsync(
    const v1::AppendAttendRequest& request, const CallOptions& call,
    std::function<void(absl::StatusOr<v1::AppendAttendResponse>)> done) {
  StartAsyncUnary<v1::AppendAttendRequest, v1::AppendAttendResponse>(
      request, [&](grpc::ClientContext* context) { Prepare(call, request.cache_id(), context); },
      [&](grpc::ClientContext* context, const v1::AppendAttendRequest* req,
          v1::AppendAttendResponse* resp, std::function<void(grpc::Status)> reaction) {
        Next().stub->async()->AppendAttend(context, req, resp, std::move(reaction));
      },
      std::move(done));
}

absl::StatusOr<std::unique_ptr<AppendAttendStream>> KvClient::OpenStream(
    const std::string& cache_id, int channel, const CallOptions& call) {
  if (cache_id.empty()) return absl::InvalidArgumentError("cache_id is empty");
  if (channel < 0) {
    return absl::InvalidArgumentError(absl::StrCat("channel must be >= 0, got ", channel));
  }
  grpc::ChannelInterface* target = channels_[channel % channels_.size()].get();
  {
    absl::MutexLock lock(&routes_mu_);
    auto route = routes_.find(cache_id);
    if (route != routes_.end()) target = moved_clients_.at(route->second)->channel(0).get();
  }
  AppendAttendStream::Reopen reopen;
  if (moved_.policy == KvMovedOptions::Policy::kFollow) {
    reopen = [this,
              cache_id](const std::string& address) -> absl::StatusOr<grpc::ChannelInterface*> {
      moved_retries_.fetch_add(1, std::memory_order_relaxed);
      absl::StatusOr<Route> route = RouteTo(cache_id, address);
      if (!route.ok()) return route.status();
      return route->channel;
    };
  } else if (moved_.policy == KvMovedOptions::Policy::kRetry) {
    // Through a proxy: the same target, once the drained replica has gone.
    reopen = [this, target, backoff = absl::Milliseconds(5)](
                 const std::string&) mutable -> absl::StatusOr<grpc::ChannelInterface*> {
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Milliseconds(100));
      moved_retries_.fetch_add(1, std::memory_order_relaxed);
      return target;
    };
  }
  std::unique_ptr<AppendAttendStream> stream(new AppendAttendStream(
      cache_id, target, call, client_.options(), std::move(reopen), moved_.budget));
  return stream;
}

// --- AppendAttendStream ---

AppendAttendStream::AppendAttendStream(std::string cache_id, grpc::ChannelInterface* channel,
                                       const CallOptions& call, const ClientOptions& options,
                                       Reopen reopen, absl::Duration budget)
    : cache_id_(std::move(cache_id)),
      call_(call),
      options_(options),
      reopen_(std::move(reopen)),
      budget_(budget) {
  {
    absl::MutexLock lock(&write_mu_);
    Open(channel);
  }
  reader_ = std::thread([this] { ReadLoop(); });
}

void AppendAttendStream::Open(grpc::ChannelInterface* channel) {
  // The generated stub's stream would serialize each request (a copy of its
  // tensors); this one writes their encoding.
  static const grpc::internal::RpcMethod kMethod("/attnserve.v1.KvCache/AppendAttendStream",
                                                 grpc::internal::RpcMethod::BIDI_STREAMING);
  auto context = std::make_unique<grpc::ClientContext>();
  if (call_.timeout && *call_.timeout != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + *call_.timeout));
  }
  context->set_wait_for_ready(call_.wait_for_ready.value_or(options_.wait_for_ready));
  context->AddMetadata(kCacheIdHeader, cache_id_);
  rpcs_.emplace_back(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, v1::AppendAttendResponse>::Create(
          channel, kMethod, context.get()));
  contexts_.push_back(std::move(context));
  stream_ = rpcs_.back().get();
}

AppendAttendStream::~AppendAttendStream() { Finish().IgnoreError(); }

int64_t AppendAttendStream::in_flight() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(pending_.size());
}

int64_t AppendAttendStream::reopened() const {
  absl::MutexLock lock(&mu_);
  return reopened_;
}

absl::Status AppendAttendStream::Send(v1::AppendAttendRequest request, Done done) {
  if (request.cache_id() != cache_id_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request cache_id '", request.cache_id(), "' is not the stream's cache '", cache_id_, "'"));
  }
  // Registered and written under one lock, so a reopened stream sends the
  // unanswered requests in the order they were written.
  absl::MutexLock write_lock(&write_mu_);
  write_mu_.Await(absl::Condition(this, &AppendAttendStream::NotResending));
  std::shared_ptr<const grpc::ByteBuffer> wire;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::FailedPreconditionError("the stream is closed");
    if (request.request_id().empty()) {
      // A prefix no caller-chosen id is likely to use.
      request.set_request_id(absl::StrCat("s", next_id_++));
    }
    if (pending_.count(request.request_id()) > 0) {
      return absl::InvalidArgumentError(absl::StrCat("request_id '", request.request_id(),
                                                     "' is already in flight on this stream"));
    }
    wire = std::make_shared<const grpc::ByteBuffer>(EncodeRequest(&request));
    pending_.emplace(request.request_id(),
                     Pending{next_order_++, std::move(done), reopen_ != nullptr ? wire : nullptr});
  }
  if (!stream_->Write(*wire) && reopen_ == nullptr) {
    // The stream broke: the reader fails everything pending with the stream's
    // status, this request included (unless it already did). A stream that
    // follows moves learns from the reader whether it goes on.
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<AppendAttendResult> AppendAttendStream::Call(const AppendAttendInputs& inputs) {
  return Call(MakeAppendAttendRequest(inputs));
}

absl::StatusOr<AppendAttendResult> AppendAttendStream::Call(v1::AppendAttendRequest request) {
  // The request's bytes move into the stream; its shapes stay for the check.
  const v1::AppendAttendRequest shapes = ShapesOf(request);
  absl::Notification done;
  absl::StatusOr<v1::AppendAttendResponse> response;
  const absl::Status sent =
      Send(std::move(request), [&](absl::StatusOr<v1::AppendAttendResponse> r) {
        response = std::move(r);
        done.Notify();
      });
  if (!sent.ok()) return sent;
  done.WaitForNotification();
  if (!response.ok()) return response.status();
  return AppendAttendResultFromProto(shapes, *std::move(response));
}

absl::StatusOr<AppendAttendResult> AppendAttendStream::Call(const AppendAttendInputs& inputs,
                                                            ShmArena& arena) {
  return Call(MakeAppendAttendRequest(inputs), arena);
}

absl::StatusOr<AppendAttendResult> AppendAttendStream::Call(v1::AppendAttendRequest request,
                                                            ShmArena& arena) {
  absl::StatusOr<ShmOutputSpans> spans = PlaceAppendAttendInArena(arena, &request);
  if (!spans.ok()) return spans.status();
  const v1::AppendAttendRequest shapes = ShapesOf(request);
  absl::Notification done;
  absl::StatusOr<v1::AppendAttendResponse> response;
  const absl::Status sent =
      Send(std::move(request), [&](absl::StatusOr<v1::AppendAttendResponse> r) {
        response = std::move(r);
        done.Notify();
      });
  if (!sent.ok()) return sent;
  done.WaitForNotification();
  if (!response.ok()) return response.status();
  const absl::Status taken = TakeAppendAttendOutputs(arena, *spans, &*response);
  if (!taken.ok()) return taken;
  return AppendAttendResultFromProto(shapes, *std::move(response));
}

void AppendAttendStream::ReadLoop() {
  absl::Time give_up = absl::InfiniteFuture();  // of the moves followed in a row
  Rpc* stream;
  {
    absl::MutexLock lock(&write_mu_);
    stream = stream_;
  }
  absl::Status status;
  while (true) {
    v1::AppendAttendResponse response;
    while (stream->Read(&response)) {
      give_up = absl::InfiniteFuture();
      Done done;
      {
        absl::MutexLock lock(&mu_);
        auto it = pending_.find(response.request_id());
        if (it == pending_.end()) continue;  // not ours: nothing waits for it
        done = std::move(it->second.done);
        pending_.erase(it);
      }
      done(std::move(response));
      response.Clear();
    }
    grpc::ClientContext* context;
    {
      absl::MutexLock lock(&write_mu_);
      context = contexts_.back().get();
    }
    status = ToAbslStatus(stream->Finish());
    // The server ended the stream because the cache moved: what it did not
    // answer, it did not apply.
    const auto& trailers = context->GetServerTrailingMetadata();
    const auto moved_to = trailers.find(kMovedToHeader);
    if (reopen_ == nullptr || !absl::IsUnavailable(status) || moved_to == trailers.end()) break;
    if (give_up == absl::InfiniteFuture()) give_up = absl::Now() + budget_;
    if (absl::Now() >= give_up ||
        !FollowMove(std::string(moved_to->second.data(), moved_to->second.size()))) {
      break;
    }
    absl::MutexLock lock(&write_mu_);
    stream = stream_;
  }
  if (resender_.joinable()) resender_.join();
  // The server closed the stream (or it broke): whatever is still pending
  // will never be answered.
  std::map<std::string, Pending> orphans;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    orphans.swap(pending_);
  }
  const absl::Status orphan_status =
      status.ok() ? absl::UnavailableError("the stream ended before this request was answered")
                  : status;
  for (auto& [id, p] : orphans) p.done(orphan_status);
  final_status_ = status;
}

bool AppendAttendStream::FollowMove(const std::string& address) {
  if (resender_.joinable()) resender_.join();
  absl::StatusOr<grpc::ChannelInterface*> channel = reopen_(address);
  if (!channel.ok()) return false;
  std::vector<std::shared_ptr<const grpc::ByteBuffer>> again;
  {
    absl::MutexLock write_lock(&write_mu_);
    Open(*channel);
    std::vector<const Pending*> order;
    {
      absl::MutexLock lock(&mu_);
      ++reopened_;
      for (const auto& [id, p] : pending_) order.push_back(&p);
      std::sort(order.begin(), order.end(),
                [](const Pending* a, const Pending* b) { return a->order < b->order; });
      for (const Pending* p : order) again.push_back(p->request);
    }
    resending_ = true;
  }
  // Written on a thread of their own while this one reads the answers (a
  // long backlog must not wait on a server that waits for its reads).
  resender_ = std::thread([this, again = std::move(again)] {
    absl::MutexLock write_lock(&write_mu_);
    for (const auto& request : again) {
      if (!stream_->Write(*request)) break;  // the reader learns why
    }
    if (writes_done_) stream_->WritesDone();
    resending_ = false;
  });
  return true;
}

absl::Status AppendAttendStream::Finish() {
  if (finished_) return final_status_;
  finished_ = true;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  {
    absl::MutexLock lock(&write_mu_);
    write_mu_.Await(absl::Condition(this, &AppendAttendStream::NotResending));
    stream_->WritesDone();
    writes_done_ = true;
  }
  reader_.join();
  return final_status_;
}

}  // namespace attnserve
