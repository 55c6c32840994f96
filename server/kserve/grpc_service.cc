// Reactors of inference.GRPCInferenceService; see grpc_service.h.
#include "server/kserve/grpc_service.h"

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "server/kserve/tenant.h"
#include "server/status_mapping.h"

namespace attnserve {
namespace {

using inference::ModelInferRequest;
using inference::ModelStreamInferResponse;

absl::Time DeadlineOf(const grpc::CallbackServerContext* ctx) {
  const auto deadline = ctx->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

std::string TenantOf(const grpc::CallbackServerContext* ctx) {
  const auto& metadata = ctx->client_metadata();
  auto it = metadata.find("authorization");
  return TenantForCall(it == metadata.end() ? absl::string_view()
                                            : absl::string_view(it->second.data(),
                                                                it->second.size()));
}

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// Unary ModelInfer: the model's completion finishes the RPC.
class InferReactor final : public grpc::ServerUnaryReactor {
 public:
  InferReactor(KserveContext* context, grpc::CallbackServerContext* ctx,
               const ModelInferRequest* request, inference::ModelInferResponse* response)
      : in_flight_(&context->in_flight), cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    in_flight_->Add();
    absl::StatusOr<KserveModel*> model =
        context->models.Find(request->model_name(), request->model_version());
    if (!model.ok()) {
      Finish(ToGrpcStatus(model.status()));
      return;
    }
    InferCall call;
    // The callback API hands the request as const, but the call owns it until
    // Finish and never reads it again: the model moves tensor bytes out of it
    // instead of copying them.
    call.request = const_cast<ModelInferRequest*>(request);
    call.response = response;
    call.tenant = TenantOf(ctx);
    call.deadline = DeadlineOf(ctx);
    call.cancelled = cancelled_;
    call.done = [this](const absl::Status& status) { Finish(ToGrpcStatus(status)); };
    (*model)->Infer(std::move(call));
  }

  void OnCancel() override { cancelled_->store(true, std::memory_order_release); }
  void OnDone() override {
    in_flight_->Done();
    delete this;
  }

 private:
  InFlightCounter* const in_flight_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
};

// ModelStreamInfer: reads on while earlier requests run and writes responses
// as they complete (possibly out of order; the id says which is which), one
// write in flight. A failed request is a response with error_message set, and
// the stream goes on. The RPC finishes once the client has half-closed and
// every request has been answered (or the stream is gone). Same lifetime rule
// as the native ForwardStream: Finish only when nothing is pending in a
// model, so no completion outlives the reactor.
class StreamReactor final
    : public grpc::ServerBidiReactor<ModelInferRequest, ModelStreamInferResponse> {
 public:
  StreamReactor(KserveContext* context, grpc::CallbackServerContext* ctx)
      : context_(context),
        tenant_(TenantOf(ctx)),
        deadline_(DeadlineOf(ctx)),
        cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      bool finish;
      {
        absl::MutexLock lock(&mu_);
        reads_done_ = true;
        finish = ShouldFinishLocked();
      }
      if (finish) FinishStream();
      return;
    }
    auto owned = std::make_unique<Call>();
    owned->request.Swap(&incoming_);
    Call* call = owned.get();
    context_->in_flight.Add();  // until its response is written or dropped
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
      calls_.push_back(std::move(owned));
    }
    StartRead(&incoming_);
    absl::StatusOr<KserveModel*> model =
        context_->models.Find(call->request.model_name(), call->request.model_version());
    if (!model.ok()) return OnRequestDone(call, model.status());
    InferCall infer;
    infer.request = &call->request;
    infer.response = call->response.mutable_infer_response();
    infer.tenant = tenant_;
    infer.deadline = deadline_;
    infer.cancelled = cancelled_;
    infer.done = [this, call](const absl::Status& status) { OnRequestDone(call, status); };
    (*model)->Infer(std::move(infer));
  }

  void OnWriteDone(bool ok) override {
    ModelStreamInferResponse* next;
    bool finish;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      context_->in_flight.Done();
      RemoveLocked(ready_.front());
      ready_.pop_front();
      if (!ok) write_failed_ = true;
      next = NextWriteLocked();
      finish = next == nullptr && ShouldFinishLocked();
    }
    if (next != nullptr) {
      StartWrite(next);
    } else if (finish) {
      FinishStream();
    }
  }

  void OnCancel() override { cancelled_->store(true, std::memory_order_release); }
  void OnDone() override { delete this; }

 private:
  struct Call {
    ModelInferRequest request;
    ModelStreamInferResponse response;
  };

  void OnRequestDone(Call* call, const absl::Status& status) {
    if (!status.ok()) {
      call->response.set_error_message(std::string(status.message()));
      // The id still tells the client which request failed.
      inference::ModelInferResponse* r = call->response.mutable_infer_response();
      r->set_model_name(call->request.model_name());
      r->set_id(call->request.id());
    }
    ModelStreamInferResponse* next;
    bool finish;
    {
      absl::MutexLock lock(&mu_);
      --pending_;
      ready_.push_back(call);
      next = NextWriteLocked();
      finish = next == nullptr && ShouldFinishLocked();
    }
    if (next != nullptr) {
      StartWrite(next);
    } else if (finish) {
      FinishStream();
    }
  }

  ModelStreamInferResponse* NextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (write_failed_) {
      for (Call* c : ready_) {
        context_->in_flight.Done();
        RemoveLocked(c);
      }
      ready_.clear();
    }
    if (writing_ || ready_.empty()) return nullptr;
    writing_ = true;
    return &ready_.front()->response;
  }

  bool ShouldFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || !reads_done_ || pending_ > 0 || writing_ || !ready_.empty()) return false;
    finished_ = true;
    return true;
  }

  void RemoveLocked(Call* call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = calls_.begin(); it != calls_.end(); ++it) {
      if (it->get() == call) {
        calls_.erase(it);
        return;
      }
    }
  }

  void FinishStream() {
    Finish(cancelled_->load(std::memory_order_acquire)
               ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled")
               : grpc::Status::OK);
  }

  KserveContext* const context_;
  const std::string tenant_;
  const absl::Time deadline_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  ModelInferRequest incoming_;

  absl::Mutex mu_;
  std::deque<std::unique_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);
  std::deque<Call*> ready_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

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

grpc::ServerUnaryReactor* KserveGrpcService::ModelConfig(grpc::CallbackServerContext* ctx,
                                                         const inference::ModelConfigRequest* request,
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
  return new StreamReactor(context_, ctx);
}

grpc::ServerUnaryReactor* KserveGrpcService::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryStatusRequest* request,
    inference::SystemSharedMemoryStatusResponse* response) {
  absl::StatusOr<std::vector<ShmRegionInfo>> regions =
      context_->shm.List(TenantOf(ctx), ShmKind::kSystem, request->name());
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
  return Answer(ctx, context_->shm.RegisterSystem(TenantOf(ctx), request->name(), request->key(),
                                                  request->offset(), request->byte_size()));
}

grpc::ServerUnaryReactor* KserveGrpcService::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryUnregisterRequest* request,
    inference::SystemSharedMemoryUnregisterResponse*) {
  return Answer(ctx, context_->shm.Unregister(TenantOf(ctx), ShmKind::kSystem, request->name()));
}

grpc::ServerUnaryReactor* KserveGrpcService::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryStatusRequest* request,
    inference::CudaSharedMemoryStatusResponse* response) {
  absl::StatusOr<std::vector<ShmRegionInfo>> regions =
      context_->shm.List(TenantOf(ctx), ShmKind::kCuda, request->name());
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
  return Answer(ctx, context_->shm.RegisterCuda(TenantOf(ctx), request->name(),
                                                request->raw_handle(), request->device_id(),
                                                request->byte_size()));
}

grpc::ServerUnaryReactor* KserveGrpcService::CudaSharedMemoryUnregister(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryUnregisterRequest* request,
    inference::CudaSharedMemoryUnregisterResponse*) {
  return Answer(ctx, context_->shm.Unregister(TenantOf(ctx), ShmKind::kCuda, request->name()));
}

}  // namespace attnserve
