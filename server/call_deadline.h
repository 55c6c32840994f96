// A gRPC call's deadline as an absl::Time (infinite when the client set none),
// for the front-ends that hand it to the executor.
#pragma once

#include <chrono>

#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace attnserve {

inline absl::Time DeadlineOf(const grpc::CallbackServerContext* context) {
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

}  // namespace attnserve
