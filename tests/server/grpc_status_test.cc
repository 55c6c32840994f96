// The absl <-> gRPC status mapping: every code keeps its number and message.
#include "common/grpc_status.h"

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(StatusMappingTest, OkIsOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_EQ(ToRpcCode(absl::OkStatus()), 0);
  EXPECT_TRUE(ToAbslStatus(grpc::Status::OK).ok());
}

TEST(StatusMappingTest, EveryCodeKeepsNumberAndMessage) {
  for (int code = 1; code <= 16; ++code) {
    const absl::Status in(static_cast<absl::StatusCode>(code), "q.dtype: expected FP16, got FP32");
    const grpc::Status out = ToGrpcStatus(in);
    EXPECT_EQ(static_cast<int>(out.error_code()), code);
    EXPECT_EQ(out.error_message(), "q.dtype: expected FP16, got FP32");
    EXPECT_EQ(ToRpcCode(in), code);
    EXPECT_EQ(ToAbslStatus(out), in) << "code " << code;
  }
}

TEST(StatusMappingTest, NamedCodesMatchGrpc) {
  EXPECT_EQ(ToGrpcStatus(absl::InvalidArgumentError("x")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("x")).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(ToGrpcStatus(absl::CancelledError("x")).error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(ToGrpcStatus(absl::UnavailableError("x")).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ToGrpcStatus(absl::UnimplementedError("x")).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(ToGrpcStatus(absl::InternalError("x")).error_code(), grpc::StatusCode::INTERNAL);
}

TEST(StatusMappingTest, OutOfRangeCodeBecomesUnknown) {
  const absl::Status odd(static_cast<absl::StatusCode>(42), "odd");
  EXPECT_EQ(ToGrpcStatus(odd).error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(ToRpcCode(odd), 2);
  EXPECT_EQ(ToAbslStatus(grpc::Status(static_cast<grpc::StatusCode>(99), "odd")).code(),
            absl::StatusCode::kUnknown);
}

}  // namespace
}  // namespace attnserve
