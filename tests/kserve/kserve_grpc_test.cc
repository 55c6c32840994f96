// The KServe v2 gRPC service over the wire on a real in-process AttnServer
// (CPU backend): ModelInfer gives the native Forward's exact bytes and its
// error codes and messages, each in its protocol's words (both run through the same
// AttentionRunner), and a shared-memory region unregistered while a request uses it is not unmapped
// under that request.
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/kserve/kserve_test_server.h"
#include "tests/kserve/shm_test_util.h"

namespace attnserve {
namespace {

// The tests here use the shared fixture under this file's name.
using KserveGrpcTest = KserveServerTest;

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

// The same bad input gives the same refusal on both protocols, each naming
// the field in its own words (the native API's `k.shape`, v2's
// `inputs['k'].shape`), with the same actual value.
TEST_F(KserveGrpcTest, SameErrorsAsForwardInEachProtocolsWords) {
  struct Breakage {
    std::function<void(v1::ForwardRequest*)> apply;
    std::string native_field;
    std::string v2_field;
  };
  const std::vector<Breakage> breakages = {
      {[](v1::ForwardRequest* r) { r->mutable_k()->set_shape(3, 16); }, "k.data",
       "inputs['k'].data"},
      {[](v1::ForwardRequest* r) { r->mutable_options()->set_window_left(-2); },
       "options.window_left", "parameters['window_left']"},
      {[](v1::ForwardRequest* r) { r->mutable_options()->set_softcap(-1.0f); }, "options.softcap",
       "parameters['softcap']"},
      {[](v1::ForwardRequest* r) { r->mutable_options()->set_softmax_scale(0.0f); },
       "options.softmax_scale", "parameters['softmax_scale']"},
      {[](v1::ForwardRequest* r) { r->mutable_q()->mutable_data()->resize(10); }, "q.data",
       "inputs['q'].data"},
      {[](v1::ForwardRequest* r) { r->mutable_v()->add_shape(1); }, "v.shape", "inputs['v'].shape"},
      {[](v1::ForwardRequest* r) { r->mutable_q()->set_shape(3, 7); }, "q.data",
       "inputs['q'].data"},
      {[](v1::ForwardRequest* r) {
         *r = Varlen();
         r->set_cu_seqlens_q(2, 6);
       },
       "cu_seqlens_q[2]", "inputs['cu_seqlens_q'][2]"},
  };
  // What follows the last "got ": the actual value, the same in both.
  auto actual = [](const std::string& message) { return message.substr(message.rfind("got ")); };
  for (size_t i = 0; i < breakages.size(); ++i) {
    SCOPED_TRACE(i);
    v1::ForwardRequest request = Dense(DType::kFP32, 1, 8, 8, 2, 2, 32);
    breakages[i].apply(&request);
    v1::ForwardResponse native;
    const grpc::Status want = Forward(request, &native);
    ASSERT_FALSE(want.ok());
    ModelInferResponse v2;
    const grpc::Status got = Infer(ToV2(request), &v2);
    EXPECT_EQ(got.error_code(), want.error_code());
    EXPECT_EQ(want.error_message().rfind(breakages[i].native_field + ":", 0), 0u)
        << want.error_message();
    EXPECT_EQ(got.error_message().rfind(breakages[i].v2_field + ":", 0), 0u) << got.error_message();
    EXPECT_EQ(actual(got.error_message()), actual(want.error_message()));
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
  ASSERT_TRUE(RegisterSystem("all", object.key(), 4 * q.size()).ok());
  ModelInferRequest v2 = ToV2(request);
  v2.clear_raw_input_contents();
  for (int i = 0; i < 3; ++i) {
    PlaceInRegion(v2.mutable_inputs(i)->mutable_parameters(), "all", i * q.size(), q.size());
  }
  auto* o = v2.add_outputs();
  o->set_name("o");
  PlaceInRegion(o->mutable_parameters(), "all", 3 * q.size(), q.size());

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
