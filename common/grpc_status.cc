// absl::Status <-> grpc::Status; see grpc_status.h.
#include "common/grpc_status.h"

#include <string>

namespace attnserve {
namespace {

// google.rpc.Code runs from OK (0) to UNAUTHENTICATED (16). A code outside it
// (a misbehaving peer) must not become a code that no switch handles.
constexpr int32_t kMaxRpcCode = 16;

int32_t CheckedCode(int32_t code) {
  return (code >= 0 && code <= kMaxRpcCode) ? code
                                            : static_cast<int32_t>(absl::StatusCode::kUnknown);
}

}  // namespace

int32_t ToRpcCode(const absl::Status& status) {
  return CheckedCode(static_cast<int32_t>(status.code()));
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(ToRpcCode(status)),
                      std::string(status.message()));
}

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(
      static_cast<absl::StatusCode>(CheckedCode(static_cast<int32_t>(status.error_code()))),
      status.error_message());
}

}  // namespace attnserve
