// AttentionClient: channel construction, per-call contexts and the typed Forward (and Echo) built
// on the raw one.
#include "client/attention_client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/async_unary.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {

absl::Status StatusFromRpcCode(int code, const std::string& message) {
  if (code == 0) return absl::OkStatus();
  // A code outside google.rpc.Code (a misbehaving peer) must not become an
  // absl::StatusCode that no switch handles.
  const absl::StatusCode absl_code =
      code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
  return absl::Status(absl_code, message);
}

ForwardTiming ServerTimingFromProto(const v1::ServerTiming& t) {
  // A server without batching leaves batch_size 0: it ran alone.
  return {t.queue_us(),          t.host_to_device_us(), t.compute_us(),
          t.device_to_host_us(), t.total_us(),          std::max(1, t.batch_size())};
}

namespace {

void SetTensor(const HostTensor& from, v1::Tensor* to) { from.CopyToProto(to); }
void SetTensor(HostTensor&& from, v1::Tensor* to) { std::move(from).MoveToProto(to); }

// Shared by both MakeForwardRequest overloads; `Inputs` is const& or &&.
template <typename Inputs>
v1::ForwardRequest BuildRequest(Inputs&& inputs) {
  v1::ForwardRequest request;
  request.set_request_id(inputs.request_id);
  SetTensor(std::forward<Inputs>(inputs).q, request.mutable_q());
  SetTensor(std::forward<Inputs>(inputs).k, request.mutable_k());
  SetTensor(std::forward<Inputs>(inputs).v, request.mutable_v());
  request.mutable_cu_seqlens_q()->Assign(inputs.cu_seqlens_q.begin(), inputs.cu_seqlens_q.end());
  request.mutable_cu_seqlens_k()->Assign(inputs.cu_seqlens_k.begin(), inputs.cu_seqlens_k.end());
  AttentionOptionsToProto(inputs.options, request.mutable_options());
  ScoreModsToProto(inputs.mods, request.mutable_options());
  return request;
}

// What the contract says O and LSE must look like for `request`; a response
// that disagrees is a server bug, reported as INTERNAL rather than read past.
absl::Status CheckResultShapes(const v1::ForwardRequest& request, const ForwardResult& result) {
  const auto& q_shape = request.q().shape();
  std::vector<int64_t> want_o(q_shape.begin(), q_shape.end());
  // O has V's head dim (MLA shapes: not Q's).
  if (!want_o.empty() && request.v().shape_size() == static_cast<int>(want_o.size())) {
    want_o.back() = request.v().shape(request.v().shape_size() - 1);
  }
  const DType want_dtype = OutputDType(*DTypeFromProto(request.q().dtype()));
  if (result.o.shape() != want_o || result.o.dtype() != want_dtype) {
    return absl::InternalError(absl::StrCat("server returned o ", result.o.DebugString(),
                                            ", expected ", std::string(DTypeName(want_dtype)),
                                            ShapeString(want_o)));
  }
  if (!request.options().return_lse()) return absl::OkStatus();
  if (!result.lse) return absl::InternalError("return_lse was set but the response has no lse");
  std::vector<int64_t> want_lse;
  if (request.cu_seqlens_q_size() > 0 && want_o.size() == 3) {
    want_lse = {want_o[1], want_o[0]};  // [Hq, Tq]
  } else if (want_o.size() == 4) {
    want_lse = {want_o[0], want_o[2], want_o[1]};  // [B, Hq, Sq]
  } else {
    return absl::OkStatus();
  }
  if (result.lse->shape() != want_lse || result.lse->dtype() != DType::kFP32) {
    return absl::InternalError(absl::StrCat("server returned lse ", result.lse->DebugString(),
                                            ", expected FP32", ShapeString(want_lse)));
  }
  return absl::OkStatus();
}

}  // namespace

void AttentionOptionsToProto(const ForwardOptions& from, v1::AttentionOptions* to) {
  if (from.softmax_scale) to->set_softmax_scale(*from.softmax_scale);
  to->set_causal(from.causal);
  if (from.window_left) to->set_window_left(*from.window_left);
  if (from.window_right) to->set_window_right(*from.window_right);
  to->set_softcap(from.softcap);
  to->set_return_lse(from.return_lse);
  if (from.q_descale) to->set_q_descale(*from.q_descale);
  if (from.k_descale) to->set_k_descale(*from.k_descale);
  if (from.v_descale) to->set_v_descale(*from.v_descale);
}

v1::ForwardRequest MakeForwardRequest(const AttentionInputs& inputs) {
  return BuildRequest(inputs);
}
v1::ForwardRequest MakeForwardRequest(AttentionInputs&& inputs) {
  return BuildRequest(std::move(inputs));
}

absl::Status OutputsFromProto(v1::Tensor* o, v1::Tensor* lse, HostTensor* out_o,
                              std::optional<HostTensor>* out_lse) {
  absl::StatusOr<HostTensor> decoded = HostTensor::FromProto(std::move(*o));
  if (!decoded.ok()) {
    return absl::InternalError(absl::StrCat("response o: ", decoded.status().message()));
  }
  *out_o = *std::move(decoded);
  if (lse == nullptr) return absl::OkStatus();
  decoded = HostTensor::FromProto(std::move(*lse));
  if (!decoded.ok()) {
    return absl::InternalError(absl::StrCat("response lse: ", decoded.status().message()));
  }
  *out_lse = *std::move(decoded);
  return absl::OkStatus();
}

absl::StatusOr<ShmOutputSpans> PlaceForwardInArena(ShmArena& arena, v1::ForwardRequest* request) {
  arena.Reset();
  for (v1::Tensor* t : {request->mutable_q(), request->mutable_k(), request->mutable_v()}) {
    RETURN_IF_ERROR(arena.MoveIn(t));
  }
  const auto& v_shape = request->v().shape();
  return AllocateOutputSpans(arena, request->q(), request->options().return_lse(),
                             request->mutable_output_shm(),
                             v_shape.empty() ? 0 : v_shape[v_shape.size() - 1]);
}

absl::Status TakeForwardOutputs(const ShmArena& arena, const ShmOutputSpans& spans,
                                v1::ForwardResponse* response) {
  if (spans.has_o) RETURN_IF_ERROR(arena.TakeOut(spans.o, "o", response->mutable_o()));
  if (spans.has_lse) RETURN_IF_ERROR(arena.TakeOut(spans.lse, "lse", response->mutable_lse()));
  return absl::OkStatus();
}

absl::StatusOr<ForwardResult> ForwardResultFromProto(v1::ForwardResponse&& response) {
  ForwardResult result;
  result.request_id = response.request_id();
  const absl::Status outputs =
      OutputsFromProto(response.mutable_o(), response.has_lse() ? response.mutable_lse() : nullptr,
                       &result.o, &result.lse);
  if (!outputs.ok()) return outputs;
  result.timing = ServerTimingFromProto(response.timing());
  result.backend = response.backend();
  return result;
}

const char* HealthStatusName(HealthStatus status) {
  switch (status) {
    case HealthStatus::kServing: return "SERVING";
    case HealthStatus::kNotServing: return "NOT_SERVING";
    case HealthStatus::kServiceUnknown: return "SERVICE_UNKNOWN";
    case HealthStatus::kUnknown: break;
  }
  return "UNKNOWN";
}

absl::StatusOr<std::unique_ptr<AttentionClient>> AttentionClient::Create(
    const std::string& target, const ClientOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("target is empty: expected host:port");
  if (options.num_channels < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_channels must be >= 1, got ", options.num_channels));
  }
  // gRPC accepts any name and fails every call later with an opaque service
  // config error, so an unknown policy is caught here instead.
  const std::string& lb = options.load_balancing_policy;
  if (!lb.empty() && lb != "pick_first" && lb != "round_robin") {
    return absl::InvalidArgumentError(
        absl::StrCat("load_balancing_policy must be pick_first or round_robin, got '", lb, "'"));
  }
  std::unique_ptr<AttentionClient> client(new AttentionClient(target, options));
  for (int i = 0; i < options.num_channels; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
    args.SetMaxSendMessageSize(options.max_send_message_bytes);
    if (!lb.empty()) args.SetLoadBalancingPolicyName(lb);
    if (options.num_channels > 1) {
      // Channels with equal arguments share subchannels (and so connections)
      // through gRPC's global pool; a local pool gives each its own.
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    }
    Channel c;
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        MakeSecureChannel(target, options.security, args);
    if (!channel.ok()) return channel.status();
    c.channel = *std::move(channel);
    c.attention = v1::Attention::NewStub(c.channel);
    c.health = grpc::health::v1::Health::NewStub(c.channel);
    client->channels_.push_back(std::move(c));
  }
  return client;
}

AttentionClient::AttentionClient(std::string target, ClientOptions options)
    : target_(std::move(target)), options_(std::move(options)) {}

void AttentionClient::Prepare(const CallOptions& call, grpc::ClientContext* context) const {
  const absl::Duration timeout = call.timeout.value_or(options_.default_timeout);
  if (timeout != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  context->set_wait_for_ready(call.wait_for_ready.value_or(options_.wait_for_ready));
}

AttentionClient::Channel& AttentionClient::Next() {
  if (channels_.size() == 1) return channels_[0];
  return channels_[next_.fetch_add(1, std::memory_order_relaxed) % channels_.size()];
}

absl::Status AttentionClient::Connect(absl::Duration timeout) {
  const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
  for (Channel& c : channels_) {
    while (true) {
      const grpc_connectivity_state state = c.channel->GetState(/*try_to_connect=*/true);
      if (state == GRPC_CHANNEL_READY) break;
      if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) {
        return absl::UnavailableError(absl::StrCat("cannot connect to ", target_));
      }
      if (!c.channel->WaitForStateChange(state, deadline)) {
        return absl::DeadlineExceededError(
            absl::StrCat("no connection to ", target_, " within ", absl::FormatDuration(timeout)));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ForwardResponse> AttentionClient::CallUnary(Unary rpc,
                                                               const v1::ForwardRequest& request,
                                                               const CallOptions& call) {
  grpc::ClientContext context;
  Prepare(call, &context);
  v1::ForwardResponse response;
  v1::Attention::Stub& stub = *Next().attention;
  const grpc::Status status = rpc == Unary::kEcho ? stub.Echo(&context, request, &response)
                                                  : stub.Forward(&context, request, &response);
  if (!status.ok()) return ToAbslStatus(status);
  return response;
}

absl::StatusOr<ForwardResult> AttentionClient::CallUnaryTyped(Unary rpc,
                                                              const AttentionInputs& inputs,
                                                              const CallOptions& call) {
  const v1::ForwardRequest request = MakeForwardRequest(inputs);
  absl::StatusOr<v1::ForwardResponse> response = CallUnary(rpc, request, call);
  if (!response.ok()) return response.status();
  absl::StatusOr<ForwardResult> result = ForwardResultFromProto(*std::move(response));
  if (!result.ok()) return result.status();
  RETURN_IF_ERROR(CheckResultShapes(request, *result));
  return result;
}

void AttentionClient::CallUnaryAsync(
    Unary rpc, const v1::ForwardRequest& request, const CallOptions& call,
    std::function<void(absl::StatusOr<v1::ForwardResponse>)> done) {
  auto* async = Next().attention->async();
  StartAsyncUnary<v1::ForwardRequest, v1::ForwardResponse>(
      request, [&](grpc::ClientContext* context) { Prepare(call, context); },
      [&](grpc::ClientContext* context, const v1::ForwardRequest* req, v1::ForwardResponse* resp,
          std::function<void(grpc::Status)> reaction) {
        if (rpc == Unary::kEcho) {
          async->Echo(context, req, resp, std::move(reaction));
        } else {
          async->Forward(context, req, resp, std::move(reaction));
        }
      },
      std::move(done));
}

absl::StatusOr<v1::ForwardResponse> AttentionClient::Forward(const v1::ForwardRequest& request,
                                                             const CallOptions& call) {
  return CallUnary(Unary::kForward, request, call);
}

absl::StatusOr<ForwardResult> AttentionClient::Forward(const AttentionInputs& inputs,
                                                       const CallOptions& call) {
  return CallUnaryTyped(Unary::kForward, inputs, call);
}

absl::StatusOr<v1::ForwardResponse> AttentionClient::Forward(v1::ForwardRequest request,
                                                             ShmArena& arena,
                                                             const CallOptions& call) {
  absl::StatusOr<ShmOutputSpans> spans = PlaceForwardInArena(arena, &request);
  if (!spans.ok()) return spans.status();
  absl::StatusOr<v1::ForwardResponse> response = CallUnary(Unary::kForward, request, call);
  if (!response.ok()) return response.status();
  RETURN_IF_ERROR(TakeForwardOutputs(arena, *spans, &*response));
  return response;
}

absl::StatusOr<ForwardResult> AttentionClient::Forward(const AttentionInputs& inputs,
                                                       ShmArena& arena, const CallOptions& call) {
  v1::ForwardRequest request = MakeForwardRequest(inputs);
  // The shapes stay for the check; the bytes move into the arena.
  v1::ForwardRequest shapes;
  *shapes.mutable_q()->mutable_shape() = request.q().shape();
  *shapes.mutable_v()->mutable_shape() = request.v().shape();  // O has V's head dim
  shapes.mutable_q()->set_dtype(request.q().dtype());
  shapes.mutable_options()->set_return_lse(request.options().return_lse());
  shapes.mutable_cu_seqlens_q()->CopyFrom(request.cu_seqlens_q());
  absl::StatusOr<v1::ForwardResponse> response = Forward(std::move(request), arena, call);
  if (!response.ok()) return response.status();
  absl::StatusOr<ForwardResult> result = ForwardResultFromProto(*std::move(response));
  if (!result.ok()) return result.status();
  RETURN_IF_ERROR(CheckResultShapes(shapes, *result));
  return result;
}

void AttentionClient::ForwardAsync(const v1::ForwardRequest& request, const CallOptions& call,
                                   std::function<void(absl::StatusOr<v1::ForwardResponse>)> done) {
  CallUnaryAsync(Unary::kForward, request, call, std::move(done));
}

absl::StatusOr<v1::ForwardResponse> AttentionClient::Echo(const v1::ForwardRequest& request,
                                                          const CallOptions& call) {
  return CallUnary(Unary::kEcho, request, call);
}

absl::StatusOr<ForwardResult> AttentionClient::Echo(const AttentionInputs& inputs,
                                                    const CallOptions& call) {
  return CallUnaryTyped(Unary::kEcho, inputs, call);
}

void AttentionClient::EchoAsync(const v1::ForwardRequest& request, const CallOptions& call,
                                std::function<void(absl::StatusOr<v1::ForwardResponse>)> done) {
  CallUnaryAsync(Unary::kEcho, request, call, std::move(done));
}

absl::StatusOr<v1::GetServerInfoResponse> AttentionClient::GetServerInfo(const CallOptions& call) {
  grpc::ClientContext context;
  Prepare(call, &context);
  v1::GetServerInfoResponse response;
  const grpc::Status status =
      Next().attention->GetServerInfo(&context, v1::GetServerInfoRequest(), &response);
  if (!status.ok()) return ToAbslStatus(status);
  return response;
}

absl::StatusOr<HealthStatus> AttentionClient::HealthCheck(const std::string& service,
                                                          const CallOptions& call) {
  grpc::ClientContext context;
  Prepare(call, &context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = Next().health->Check(&context, request, &response);
  if (!status.ok()) return ToAbslStatus(status);
  using Proto = grpc::health::v1::HealthCheckResponse;
  switch (response.status()) {
    case Proto::SERVING: return HealthStatus::kServing;
    case Proto::NOT_SERVING: return HealthStatus::kNotServing;
    case Proto::SERVICE_UNKNOWN: return HealthStatus::kServiceUnknown;
    default: break;
  }
  return HealthStatus::kUnknown;
}

}  // namespace attnserve
