// The one conversion between absl::Status (used end to end inside attnserve)
// and grpc::Status, both ways: the server turns its statuses into what a client
// sees (a grpc::Status for unary RPCs, or the google.rpc code carried in
// ForwardResponse.error_code on ForwardStream); the client turns what it
// receives back. Its own CMake target (attn_grpc_status), so the backend never
// depends on gRPC.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace attnserve {

// Same code and message. absl and gRPC both number their codes as google.rpc.Code,
// so the code is kept; a code outside that range becomes UNKNOWN rather than an
// invalid grpc::StatusCode. An OK status maps to grpc::Status::OK.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The google.rpc.Code value of `status` (0 for OK), for ForwardResponse.error_code.
int32_t ToRpcCode(const absl::Status& status);

// The inverse direction, for code that receives a grpc::Status (the client).
// The message is kept verbatim, so server-side field names reach the caller.
absl::Status ToAbslStatus(const grpc::Status& status);

}  // namespace attnserve
