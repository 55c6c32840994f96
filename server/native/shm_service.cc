// SharedMemory's calls over the registry; see shm_service.h.
#include "server/native/shm_service.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "server/tenant.h"

namespace attnserve {
namespace {

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

void FillStatus(ShmKind kind, const ShmRegionInfo& info, v1::RegionStatus* out) {
  out->set_name(info.name);
  out->set_byte_size(info.byte_size);
  if (kind == ShmKind::kSystem) {
    out->mutable_system()->set_key(info.key);
    out->mutable_system()->set_offset(info.offset);
  } else {
    // The handle is the caller's secret: never sent back.
    out->mutable_cuda()->set_device_id(info.device_id);
  }
}

}  // namespace

grpc::ServerUnaryReactor* ShmService::Register(grpc::CallbackServerContext* context,
                                               const v1::RegisterRegionRequest* request,
                                               v1::RegisterRegionResponse*) {
  const std::string tenant = TenantOf(auth_, context);
  absl::Status status;
  switch (request->memory_case()) {
    case v1::RegisterRegionRequest::kSystem:
      status = registry_->RegisterSystem(tenant, request->name(), request->system().key(),
                                         request->system().offset(), request->byte_size());
      break;
    case v1::RegisterRegionRequest::kCuda:
      status = registry_->RegisterCuda(tenant, request->name(), request->cuda().raw_handle(),
                                       request->cuda().device_id(), request->byte_size());
      break;
    default:
      // Off is off, whatever the request holds.
      status = registry_->allowed()
                   ? absl::InvalidArgumentError(
                         "memory: expected system (a POSIX shared-memory key) or cuda (a CUDA IPC "
                         "handle), got neither")
                   : absl::FailedPreconditionError(
                         "shared memory is off: the server must be started with "
                         "--allow_client_shm");
  }
  return Answer(context, status);
}

grpc::ServerUnaryReactor* ShmService::Unregister(grpc::CallbackServerContext* context,
                                                 const v1::UnregisterRegionRequest* request,
                                                 v1::UnregisterRegionResponse*) {
  // Names are unique over both kinds: a name is one region of either.
  const std::string tenant = TenantOf(auth_, context);
  absl::Status status = registry_->Unregister(tenant, ShmKind::kSystem, request->name());
  if (status.ok()) status = registry_->Unregister(tenant, ShmKind::kCuda, request->name());
  return Answer(context, status);
}

grpc::ServerUnaryReactor* ShmService::Status(grpc::CallbackServerContext* context,
                                             const v1::RegionStatusRequest* request,
                                             v1::RegionStatusResponse* response) {
  const std::string tenant = TenantOf(auth_, context);
  bool found = false;
  for (ShmKind kind : {ShmKind::kSystem, ShmKind::kCuda}) {
    absl::StatusOr<std::vector<ShmRegionInfo>> regions =
        registry_->List(tenant, kind, request->name());
    if (regions.status().code() == absl::StatusCode::kNotFound) continue;
    if (!regions.ok()) {
      response->Clear();
      return Answer(context, regions.status());
    }
    for (const ShmRegionInfo& info : *regions) FillStatus(kind, info, response->add_regions());
    found = true;
  }
  if (!request->name().empty() && !found) {
    return Answer(context,
                  absl::NotFoundError(absl::StrCat("name: unable to find shared memory region: '",
                                                   request->name(), "'")));
  }
  return Answer(context, absl::OkStatus());
}

}  // namespace attnserve
