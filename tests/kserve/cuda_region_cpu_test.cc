// CUDA shared memory where the server cannot use it, on any machine: the CPU
// backend refuses tensors in device memory (UNIMPLEMENTED naming the tensor,
// before anything runs), such calls never share a packed launch, and a KServe
// server without a usable GPU refuses CudaSharedMemoryRegister while it goes
// on serving, a request naming that region refused as an unknown one. (With a
// GPU, tests/cuda/cuda_shm_test sends a real CUDA region to a CPU server.)
#include <string>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "gtest/gtest.h"
#include "server/shm/cuda_shm_region.h"
#include "tests/common/attn_test_util.h"
#include "tests/kserve/kserve_test_server.h"

namespace attnserve {
namespace {

using testing_util::HostBuffers;
using testing_util::TestCase;

TestCase Small() {
  TestCase tc;
  tc.dtype = DType::kFP32;
  tc.batch = 1;
  tc.seqlen_q = tc.seqlen_k = 17;
  tc.num_heads_q = 2;
  tc.num_heads_kv = 2;
  tc.head_dim = 16;
  return tc;
}

TEST(DeviceTensorsOnCpuTest, CpuBackendRefusesEachNamingIt) {
  CpuBackend backend(1);
  HostBuffers buf(Small());
  ASSERT_TRUE(backend.CanImplement(buf.params()).ok());
  for (const char* name : {"q", "k", "v", "o", "lse"}) {
    AttnParams p = buf.params();
    TensorDevices& d = p.devices;
    int32_t* field = std::string(name) == "q"   ? &d.q
                     : std::string(name) == "k" ? &d.k
                     : std::string(name) == "v" ? &d.v
                     : std::string(name) == "o" ? &d.o
                                                : &d.lse;
    *field = 1;
    const absl::StatusOr<Plan> plan = backend.CanImplement(p);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kUnimplemented) << name;
    EXPECT_NE(plan.status().message().find(absl::StrCat(name, " is memory of CUDA device 1")),
              std::string::npos)
        << plan.status();
  }
}

TEST(DeviceTensorsOnCpuTest, NeverShareALaunch) {
  HostBuffers a(Small()), b(Small());
  AttnParams device_o = a.params();
  device_o.devices.o = 0;
  EXPECT_TRUE(CanShareLaunch(a.params(), b.params()));
  EXPECT_FALSE(CanShareLaunch(device_o, b.params()));
  EXPECT_FALSE(CanShareLaunch(b.params(), device_o));
}

using CudaRegionCpuServerTest = KserveServerTest;

TEST_F(CudaRegionCpuServerTest, RegisterIsRefusedAndTheServerServesOn) {
  if (CudaShmAvailable()) {
    GTEST_SKIP() << "a GPU is present: tests/cuda/cuda_shm_test sends a real region instead";
  }
  inference::CudaSharedMemoryRegisterRequest request;
  request.set_name("gpu");
  request.set_raw_handle(std::string(64, '\x01'));
  request.set_device_id(0);
  request.set_byte_size(1 << 20);
  inference::CudaSharedMemoryRegisterResponse unused;
  grpc::ClientContext context;
  const grpc::Status registered = v2_->CudaSharedMemoryRegister(&context, request, &unused);
  // A CPU-only build: UNIMPLEMENTED; a CUDA build without a GPU: FAILED_PRECONDITION.
  EXPECT_TRUE(registered.error_code() == grpc::StatusCode::UNIMPLEMENTED ||
              registered.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
      << registered.error_code() << " " << registered.error_message();

  // A call naming the region: refused like any unknown region, naming it.
  inference::ModelInferRequest infer = ToV2(Dense(DType::kFP32, 1, 17, 17, 2, 2, 16));
  auto* q = infer.mutable_inputs(0);
  (*q->mutable_parameters())["shared_memory_region"].set_string_param("gpu");
  (*q->mutable_parameters())["shared_memory_byte_size"].set_int64_param(17 * 2 * 16 * 4);
  infer.mutable_raw_input_contents()->erase(infer.mutable_raw_input_contents()->begin());
  inference::ModelInferResponse response;
  const grpc::Status refused = Infer(infer, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_NE(refused.error_message().find("'gpu'"), std::string::npos) << refused.error_message();

  // The same call with its bytes in the message runs.
  response.Clear();
  const grpc::Status ok = Infer(ToV2(Dense(DType::kFP32, 1, 17, 17, 2, 2, 16)), &response);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
}

}  // namespace
}  // namespace attnserve
