// Reactors of inference.GRPCInferenceService; see grpc_service.h.
#include "server/kserve/grpc_service.h"

#include <memory>
#include <string>
#include <utility>

#include "common/cache_id_header.h"
#include "common/grpc_status.h"
#include "server/call_deadline.h"
#include "server/stream_reactor.h"
#include "server/tenant.h"

namespace attnserve {
namespace {

using inference::ModelInferRequest;
using inference::ModelStreamInferResponse;

// The call's x-attnserve-cache-id metadata (attention_kv), empty without it.
std::string CacheIdHeaderOf(const grpc::CallbackServerContext* ctx) {
  const auto& metadata = ctx->client_metadata();
  auto it = metadata.find(kCacheIdHeader);
  return it == metadata.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// Unary ModelInfer: the model's completion finishes the RPC. The in-flight
// count is held from construction to OnDone, and a throw while starting
// finishes the call with its status instead of escaping to gRPC.
class InferReactor final : public grpc::ServerUnaryReactor {
 public:
  InferReactor(KserveContext* context, grpc::CallbackServerContext* ctx,
               const ModelInferRequest* request, inference::ModelInferResponse* response)
      : in_flight_(&context->in_flight), cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    try {
      Start(context, ctx, request, response);
    } catch (...) {
      FinishOnce(StatusOfException(std::current_exception(), "ModelInfer"));
    }
  }

  void OnCancel() override { cancelled_->store(true, std::memory_order_release); }
  void OnDone() override { delete this; }

 private:
  void Start(KserveContext* context, grpc::CallbackServerContext* ctx,
             const ModelInferRequest* request, inference::ModelInferResponse* response) {
    absl::StatusOr<KserveModel*> model =
        context->models.Find(request->model_name(), request->model_version());
    if (!model.ok()) return FinishOnce(model.status());
    InferCall call;
    // The callback API hands the request as const, but the call owns it until
    // Finish and never reads it again: the model moves tensor bytes out of it
    // instead of copying them.
    call.request = const_cast<ModelInferRequest*>(request);
    call.response = response;
    call.tenant = TenantOf(context->auth, ctx);
    call.cache_id_header = CacheIdHeaderOf(ctx);
    call.deadline = DeadlineOf(ctx);
    call.cancelled = cancelled_;
    call.done = [this](const absl::Status& status) { FinishOnce(status); };
    const absl::Status held = HoldInFlight(
        context->tenants, call.tenant, static_cast<int64_t>(request->ByteSizeLong()), &call.done);
    if (!held.ok()) return call.done(held);
    (*model)->Infer(std::move(call));
  }

  void FinishOnce(const absl::Status& status) {
    if (!finished_.exchange(true, std::memory_order_acq_rel)) Finish(ToGrpcStatus(status));
  }

  InFlightCounter::Hold in_flight_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  std::atomic<bool> finished_{false};
};

using StreamReactor = PipelinedStreamReactor<ModelInferRequest, ModelStreamInferResponse>;

// ModelStreamInfer: each request goes to its model; a failed one is answered
// with error_message set (and its id), and the stream goes on.
StreamReactor* NewStreamReactor(KserveContext* context, grpc::CallbackServerContext* ctx) {
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  auto start = [context, cancelled, who = StreamTenantOf(context->auth, ctx),
                deadline = DeadlineOf(ctx), cache_id = CacheIdHeaderOf(ctx)](
                   StreamReactor::Call* call, StreamReactor::Done done) {
    // A token withdrawn since the stream opened stops it, request by request.
    if (absl::Status valid = who->StillValid(); !valid.ok()) return done(valid);
    absl::StatusOr<KserveModel*> model =
        context->models.Find(call->request.model_name(), call->request.model_version());
    if (!model.ok()) return done(model.status());
    InferCall infer;
    infer.request = &call->request;
    infer.response = call->response.mutable_infer_response();
    infer.tenant = who->tenant();
    infer.cache_id_header = cache_id;
    infer.deadline = deadline;
    infer.cancelled = cancelled;
    infer.done = std::move(done);
    const absl::Status held =
        HoldInFlight(context->tenants, infer.tenant,
                     static_cast<int64_t>(call->request.ByteSizeLong()), &infer.done);
    if (!held.ok()) return infer.done(held);
    (*model)->Infer(std::move(infer));
  };
  auto fail = [](StreamReactor::Call* call, const absl::Status& status) {
    call->response.set_error_message(std::string(status.message()));
    // The id still tells the client which request failed.
    inference::ModelInferResponse* r = call->response.mutable_infer_response();
    r->set_model_name(call->request.model_name());
    r->set_id(call->request.id());
  };
  return new StreamReactor(&context->in_flight, std::move(cancelled), std::move(start),
                           std::move(fail), context->stream_limits, context->stream_gauge);
}

}  // namespace

grpc::ServerUnaryReactor* KserveGrpcService::ServerLive(grpc::CallbackServerContext* ctx,
                                                        const inference::ServerLiveRequest*,
                                                        inference::ServerLiveResponse* response) {
  response->set_live(true);
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveGrpcService::ServerReady(grpc::CallbackServerContext* ctx,
                                                         const inference::ServerReadyRequest*,
                                                         inference::ServerReadyResponse* response) {
  response->set_ready(context_->ready());
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveGrpcService::ModelReady(grpc::CallbackServerContext* ctx,
                                                        const inference::ModelReadyRequest* request,
                                                        inference::ModelReadyResponse* response) {
  absl::StatusOr<KserveModel*> model = context_->models.Find(request->name(), request->version());
  if (!model.ok()) return Answer(ctx, model.status());
  response->set_ready(context_->ready() && (*model)->ready());
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveGrpcService::ServerMetadata(
    grpc::CallbackServerContext* ctx, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  context_->FillServerMetadata(response);
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveGrpcService::ModelMetadata(
    grpc::CallbackServerContext* ctx, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  absl::StatusOr<KserveModel*> model = context_->models.Find(request->name(), request->version());
  if (!model.ok()) return Answer(ctx, model.status());
  (*model)->FillMetadata(response);
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveGrpcService::ModelConfig(
    grpc::CallbackServerContext* ctx, const inference::ModelConfigRequest* request,
    inference::ModelConfigResponse* response) {
  absl::StatusOr<KserveModel*> model = context_->models.Find(request->name(), request->version());
  if (!model.ok()) return Answer(ctx, model.status());
  (*model)->FillConfig(response->mutable_config());
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveGrpcService::ModelStatistics(
    grpc::CallbackServerContext* ctx, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  return Answer(ctx, context_->FillStatistics(request->name(), request->version(), response));
}

grpc::ServerUnaryReactor* KserveGrpcService::RepositoryIndex(
    grpc::CallbackServerContext* ctx, const inference::RepositoryIndexRequest*,
    inference::RepositoryIndexResponse* response) {
  context_->FillRepositoryIndex(response);
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveGrpcService::ModelInfer(grpc::CallbackServerContext* ctx,
                                                        const inference::ModelInferRequest* request,
                                                        inference::ModelInferResponse* response) {
  return new InferReactor(context_, ctx, request, response);
}

grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse>*
KserveGrpcService::ModelStreamInfer(grpc::CallbackServerContext* ctx) {
  return NewStreamReactor(context_, ctx);
}

grpc::ServerUnaryReactor* KserveGrpcService::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryStatusRequest* request,
    inference::SystemSharedMemoryStatusResponse* response) {
  absl::StatusOr<std::vector<ShmRegionInfo>> regions =
      context_->shm.List(TenantOf(context_->auth, ctx), ShmKind::kSystem, request->name());
  if (!regions.ok()) return Answer(ctx, regions.status());
  for (const ShmRegionInfo& r : *regions) {
    auto& out = (*response->mutable_regions())[r.name];
    out.set_name(r.name);
    out.set_key(r.key);
    out.set_offset(r.offset);
    out.set_byte_size(r.byte_size);
  }
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveGrpcService::SystemSharedMemoryRegister(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryRegisterRequest* request,
    inference::SystemSharedMemoryRegisterResponse*) {
  return Answer(
      ctx, context_->shm.RegisterSystem(TenantOf(context_->auth, ctx), request->name(),
                                        request->key(), request->offset(), request->byte_size()));
}

grpc::ServerUnaryReactor* KserveGrpcService::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryUnregisterRequest* request,
    inference::SystemSharedMemoryUnregisterResponse*) {
  return Answer(ctx, context_->shm.Unregister(TenantOf(context_->auth, ctx), ShmKind::kSystem,
                                              request->name()));
}

grpc::ServerUnaryReactor* KserveGrpcService::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryStatusRequest* request,
    inference::CudaSharedMemoryStatusResponse* response) {
  absl::StatusOr<std::vector<ShmRegionInfo>> regions =
      context_->shm.List(TenantOf(context_->auth, ctx), ShmKind::kCuda, request->name());
  if (!regions.ok()) return Answer(ctx, regions.status());
  for (const ShmRegionInfo& r : *regions) {
    auto& out = (*response->mutable_regions())[r.name];
    out.set_name(r.name);
    out.set_device_id(static_cast<uint64_t>(r.device_id));
    out.set_byte_size(r.byte_size);
  }
  return Answer(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* KserveGrpcService::CudaSharedMemoryRegister(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryRegisterRequest* request,
    inference::CudaSharedMemoryRegisterResponse*) {
  return Answer(ctx, context_->shm.RegisterCuda(TenantOf(context_->auth, ctx), request->name(),
                                                request->raw_handle(), request->device_id(),
                                                request->byte_size()));
}

grpc::ServerUnaryReactor* KserveGrpcService::CudaSharedMemoryUnregister(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryUnregisterRequest* request,
    inference::CudaSharedMemoryUnregisterResponse*) {
  return Answer(ctx, context_->shm.Unregister(TenantOf(context_->auth, ctx), ShmKind::kCuda,
                                              request->name()));
}

}  // namespace attnserve
