// The native API's shared-memory registration: attnserve.v1.SharedMemory
// (shm.proto) on the server's gRPC port. The regions are the ones KServe v2's
// system_shared_memory and cuda_shared_memory calls register (one
// ShmRegistry, one namespace per tenant, one set of limits); Forward and
// AppendAttend name spans of them (shm_tensors.h). Answers on the gRPC
// thread: a registration maps or opens memory, nothing waits on the executor.
#pragma once

#include "attnserve/v1/shm.grpc.pb.h"
#include "server/auth/authenticator.h"
#include "server/shm/shm_registry.h"

namespace attnserve {

class ShmService final : public v1::SharedMemory::CallbackService {
 public:
  // `registry` must outlive the service.
  explicit ShmService(ShmRegistry* registry) : registry_(registry) {}

  // Who the calls are (server/tenant.h); null (the default) when
  // authentication is off. Set before serving.
  void set_auth(const Authenticator* auth) { auth_ = auth; }

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const v1::RegisterRegionRequest* request,
                                     v1::RegisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* Unregister(grpc::CallbackServerContext* context,
                                       const v1::UnregisterRegionRequest* request,
                                       v1::UnregisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* context,
                                   const v1::RegionStatusRequest* request,
                                   v1::RegionStatusResponse* response) override;

 private:
  ShmRegistry* const registry_;
  const Authenticator* auth_ = nullptr;
};

}  // namespace attnserve
