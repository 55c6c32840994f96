// The KServe v2 gRPC service over the wire on a real in-process AttnServer
// (CPU backend): ModelInfer gives the native Forward's exact bytes and its
// exact error codes and messages (it runs through the same ForwardHandler),
// and a shared-memory region unregistered while a request uses it is not
// unmapped under that request.
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "common/dtype.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/server.h"
#include "tests/kserve/shm_test_util.h"
#include "tests/server/gated_cpu_backend.h"

namespace attnserve {
namespace {

using inference::GRPCInferenceService;
using inference::ModelInferRequest;
using inference::ModelInferResponse;

class KserveGrpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.batching = false;  // one backend Forward per request, for the gate
    options.kserve.allow_client_shm = true;
    auto backend = std::make_unique<GatedCpuBackend>();
    backend_ = backend.get();
    absl::StatusOr<std::unique_ptr<AttnServer>> server =
        AttnServer::Create(options, std::move(backend));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                       grpc::InsecureChannelCredentials());
    native_ = v1::Attention::NewStub(channel);
    v2_ = GRPCInferenceService::NewStub(channel);
  }

  grpc::Status Forward(const v1::ForwardRequest& request, v1::ForwardResponse* response) {
    grpc::ClientContext context;
    return native_->Forward(&context, request, response);
  }
  grpc::Status Infer(const ModelInferRequest& request, ModelInferResponse* response) {
    grpc::ClientContext context;
    return v2_->ModelInfer(&context, request, response);
  }

  GatedCpuBackend* backend_ = nullptr;
  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::Attention::Stub> native_;
  std::unique_ptr<GRPCInferenceService::Stub> v2_;
};

// Deterministic values in `dtype`'s bytes.
std::string Values(DType dtype, int64_t count, int seed) {
  std::string bytes(count * DTypeSize(dtype), '\0');
  for (int64_t i = 0; i < count; ++i) {
    const float f = static_cast<float>((i * 37 + seed * 11) % 29) / 14.0f - 1.0f;
    if (dtype == DType::kFP32) {
      std::memcpy(&bytes[i * 4], &f, 4);
    } else {
      const uint16_t h = dtype == DType::kFP16 ? FloatToFp16(f) : FloatToBf16(f);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  return bytes;
}

void SetTensor(v1::Tensor* t, DType dtype, std::vector<int64_t> shape, int seed) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  t->set_dtype(static_cast<v1::DType>(dtype));
  for (int64_t d : shape) t->add_shape(d);
  *t->mutable_data() = Values(dtype, count, seed);
}

v1::ForwardRequest Dense(DType dtype, int b, int sq, int sk, int hq, int hkv, int d) {
  v1::ForwardRequest r;
  r.set_request_id("dense");
  SetTensor(r.mutable_q(), dtype, {b, sq, hq, d}, 1);
  SetTensor(r.mutable_k(), dtype, {b, sk, hkv, d}, 2);
  SetTensor(r.mutable_v(), dtype, {b, sk, hkv, d}, 3);
  return r;
}

v1::ForwardRequest Varlen() {
  v1::ForwardRequest r;
  r.set_request_id("varlen");
  SetTensor(r.mutable_q(), DType::kFP32, {7, 2, 16}, 1);
  SetTensor(r.mutable_k(), DType::kFP32, {10, 2, 16}, 2);
  SetTensor(r.mutable_v(), DType::kFP32, {10, 2, 16}, 3);
  for (int x : {0, 3, 7}) r.add_cu_seqlens_q(x);
  for (int x : {0, 6, 10}) r.add_cu_seqlens_k(x);
  return r;
}

// The v2 request a Triton client sends for the same call.
ModelInferRequest ToV2(const v1::ForwardRequest& r) {
  ModelInferRequest v2;
  v2.set_model_name("attention");
  v2.set_id(r.request_id());
  for (const auto& [name, t] :
       {std::pair<const char*, const v1::Tensor*>{"q", &r.q()}, {"k", &r.k()}, {"v", &r.v()}}) {
    auto* in = v2.add_inputs();
    in->set_name(name);
    in->set_datatype(std::string(DTypeName(static_cast<DType>(t->dtype()))));
    *in->mutable_shape() = t->shape();
    *v2.add_raw_input_contents() = t->data();
  }
  for (const auto& [name, cu] : {std::pair<const char*, const google::protobuf::RepeatedField<int32_t>*>{
                                     "cu_seqlens_q", &r.cu_seqlens_q()},
                                 {"cu_seqlens_k", &r.cu_seqlens_k()}}) {
    if (cu->empty()) continue;
    auto* in = v2.add_inputs();
    in->set_name(name);
    in->set_datatype("INT32");
    in->add_shape(cu->size());
    v2.add_raw_input_contents(std::string(reinterpret_cast<const char*>(cu->data()), cu->size() * 4));
  }
  const v1::AttentionOptions& o = r.options();
  auto& params = *v2.mutable_parameters();
  if (o.causal()) params["causal"].set_bool_param(true);
  if (o.has_window_left()) params["window_left"].set_int64_param(o.window_left());
  if (o.has_window_right()) params["window_right"].set_int64_param(o.window_right());
  if (o.softcap() != 0.0f) params["softcap"].set_double_param(o.softcap());
  if (o.has_softmax_scale()) params["softmax_scale"].set_double_param(o.softmax_scale());
  if (o.return_lse()) params["return_lse"].set_bool_param(true);
  return v2;
}

TEST_F(KserveGrpcTest, SameBytesAsForward) {
  std::vector<v1::ForwardRequest> cases;
  cases.push_back(Dense(DType::kFP32, 2, 9, 13, 4, 2, 32));
  cases.back().mutable_options()->set_causal(true);
  cases.back().mutable_options()->set_return_lse(true);
  cases.push_back(Dense(DType::kFP16, 1, 17, 17, 2, 2, 64));
  cases.back().mutable_options()->set_window_left(4);
  cases.back().mutable_options()->set_window_right(1);
  cases.push_back(Dense(DType::kBF16, 1, 5, 11, 4, 1, 16));
  cases.back().mutable_options()->set_softcap(3.0f);
  cases.back().mutable_options()->set_softmax_scale(0.2f);
  cases.back().mutable_options()->set_return_lse(true);
  cases.push_back(Varlen());
  cases.back().mutable_options()->set_causal(true);
  cases.back().mutable_options()->set_return_lse(true);
  for (const v1::ForwardRequest& request : cases) {
    SCOPED_TRACE(request.ShortDebugString().substr(0, 200));
    v1::ForwardResponse native;
    ASSERT_TRUE(Forward(request, &native).ok());
    ModelInferResponse v2;
    grpc::Status status = Infer(ToV2(request), &v2);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const bool lse = request.options().return_lse();
    ASSERT_EQ(v2.outputs_size(), lse ? 2 : 1);
    ASSERT_EQ(v2.raw_output_contents_size(), v2.outputs_size());
    EXPECT_EQ(v2.outputs(0).name(), "o");
    EXPECT_EQ(v2.outputs(0).datatype(), DTypeName(static_cast<DType>(request.q().dtype())));
    EXPECT_EQ(std::vector<int64_t>(v2.outputs(0).shape().begin(), v2.outputs(0).shape().end()),
              std::vector<int64_t>(native.o().shape().begin(), native.o().shape().end()));
    EXPECT_TRUE(v2.raw_output_contents(0) == native.o().data());
    if (lse) {
      EXPECT_EQ(v2.outputs(1).name(), "lse");
      EXPECT_EQ(v2.outputs(1).datatype(), "FP32");
      EXPECT_TRUE(v2.raw_output_contents(1) == native.lse().data());
    }
    EXPECT_EQ(v2.id(), request.request_id());
    EXPECT_EQ(v2.model_version(), "1");
  }
}

TEST_F(KserveGrpcTest, SameErrorsAsForward) {
  std::vector<std::function<void(v1::ForwardRequest*)>> breakages = {
      [](v1::ForwardRequest* r) { r->mutable_k()->set_shape(3, 16); },
      [](v1::ForwardRequest* r) { r->mutable_options()->set_window_left(-2); },
      [](v1::ForwardRequest* r) { r->mutable_options()->set_softcap(-1.0f); },
      [](v1::ForwardRequest* r) { r->mutable_options()->set_softmax_scale(0.0f); },
      [](v1::ForwardRequest* r) { r->mutable_q()->mutable_data()->resize(10); },
      [](v1::ForwardRequest* r) { r->mutable_v()->add_shape(1); },
      [](v1::ForwardRequest* r) { r->mutable_q()->set_shape(3, 7); },
      [](v1::ForwardRequest* r) {
        *r = Varlen();
        r->set_cu_seqlens_q(2, 6);
      },
  };
  for (size_t i = 0; i < breakages.size(); ++i) {
    SCOPED_TRACE(i);
    v1::ForwardRequest request = Dense(DType::kFP32, 1, 8, 8, 2, 2, 32);
    breakages[i](&request);
    v1::ForwardResponse native;
    const grpc::Status want = Forward(request, &native);
    ASSERT_FALSE(want.ok());
    ModelInferResponse v2;
    const grpc::Status got = Infer(ToV2(request), &v2);
    EXPECT_EQ(got.error_code(), want.error_code());
    EXPECT_EQ(got.error_message(), want.error_message());
  }
}

// v2 has no FP8 datatype: the front-end refuses it, naming the input and
// pointing at attnserve.v1, and nothing reaches the executor.
TEST_F(KserveGrpcTest, Fp8IsRefusedWithAClearError) {
  v1::ForwardRequest request = Dense(DType::kFP32, 1, 8, 8, 2, 2, 32);
  ModelInferRequest v2 = ToV2(request);
  v2.mutable_inputs(0)->set_datatype("FP8_E4M3");
  ModelInferResponse response;
  const grpc::Status got = Infer(v2, &response);
  EXPECT_EQ(got.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(got.error_message().find("inputs['q'].datatype: expected FP16, BF16 or FP32, got "
                                     "\"FP8_E4M3\""),
            std::string::npos)
      << got.error_message();
  EXPECT_NE(got.error_message().find("attnserve.v1.Attention"), std::string::npos)
      << got.error_message();
}

TEST_F(KserveGrpcTest, RegionUnregisteredMidRequestIsNotUnmapped) {
  const v1::ForwardRequest request = Dense(DType::kFP32, 1, 16, 16, 2, 2, 32);
  v1::ForwardResponse native;
  ASSERT_TRUE(Forward(request, &native).ok());
  const std::string& q = request.q().data();
  TestShmObject object(4 * q.size(), "midrequest");
  ASSERT_TRUE(object.ok());
  // q, k, v then o, back to back.
  std::memcpy(object.data(), q.data(), q.size());
  std::memcpy(object.data() + q.size(), request.k().data().data(), q.size());
  std::memcpy(object.data() + 2 * q.size(), request.v().data().data(), q.size());
  {
    grpc::ClientContext context;
    inference::SystemSharedMemoryRegisterRequest reg;
    reg.set_name("all");
    reg.set_key(object.key());
    reg.set_byte_size(4 * q.size());
    inference::SystemSharedMemoryRegisterResponse unused;
    ASSERT_TRUE(v2_->SystemSharedMemoryRegister(&context, reg, &unused).ok());
  }
  ModelInferRequest v2 = ToV2(request);
  v2.clear_raw_input_contents();
  auto place = [](google::protobuf::Map<std::string, inference::InferParameter>* p, int64_t offset,
                  int64_t size) {
    (*p)["shared_memory_region"].set_string_param("all");
    (*p)["shared_memory_offset"].set_int64_param(offset);
    (*p)["shared_memory_byte_size"].set_int64_param(size);
  };
  for (int i = 0; i < 3; ++i) place(v2.mutable_inputs(i)->mutable_parameters(), i * q.size(), q.size());
  auto* o = v2.add_outputs();
  o->set_name("o");
  place(o->mutable_parameters(), 3 * q.size(), q.size());

  const int calls = backend_->calls();
  backend_->Close();
  grpc::Status infer_status;
  ModelInferResponse response;
  std::thread caller([&] { infer_status = Infer(v2, &response); });
  backend_->AwaitCalls(calls + 1);  // the request is inside the backend
  {
    grpc::ClientContext context;
    inference::SystemSharedMemoryUnregisterRequest unreg;
    unreg.set_name("all");
    inference::SystemSharedMemoryUnregisterResponse unused;
    ASSERT_TRUE(v2_->SystemSharedMemoryUnregister(&context, unreg, &unused).ok());
  }
  {
    grpc::ClientContext context;
    inference::SystemSharedMemoryStatusRequest status_request;
    inference::SystemSharedMemoryStatusResponse status;
    ASSERT_TRUE(v2_->SystemSharedMemoryStatus(&context, status_request, &status).ok());
    EXPECT_TRUE(status.regions().empty());
  }
  backend_->Open();
  caller.join();
  ASSERT_TRUE(infer_status.ok()) << infer_status.error_message();
  EXPECT_EQ(std::string(object.data() + 3 * q.size(), q.size()), native.o().data());
  // The region is gone for the next request.
  ModelInferResponse again;
  const grpc::Status gone = Infer(v2, &again);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(gone.error_message().find("'all'"), std::string::npos) << gone.error_message();
}

TEST_F(KserveGrpcTest, StreamAnswersEveryRequestAndReportsErrorsInBand) {
  grpc::ClientContext context;
  auto stream = v2_->ModelStreamInfer(&context);
  v1::ForwardRequest good = Dense(DType::kFP32, 1, 4, 4, 1, 1, 16);
  ModelInferRequest ok_request = ToV2(good);
  ok_request.set_id("ok");
  ModelInferRequest bad_request = ok_request;
  bad_request.set_id("bad");
  bad_request.mutable_inputs()->RemoveLast();
  bad_request.mutable_raw_input_contents()->RemoveLast();
  ASSERT_TRUE(stream->Write(ok_request));
  ASSERT_TRUE(stream->Write(bad_request));
  ASSERT_TRUE(stream->WritesDone());
  std::map<std::string, inference::ModelStreamInferResponse> seen;
  inference::ModelStreamInferResponse r;
  while (stream->Read(&r)) seen[r.infer_response().id()] = r;
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen["ok"].error_message().empty());
  EXPECT_EQ(seen["ok"].infer_response().raw_output_contents_size(), 1);
  EXPECT_NE(seen["bad"].error_message().find("'v' is missing"), std::string::npos)
      << seen["bad"].error_message();
}

}  // namespace
}  // namespace attnserve
