// What the KServe v2 tests over the wire share: a real in-process AttnServer
// (CPU backend behind a gate, batching off, client shared memory allowed)
// with native and v2 stubs, and the requests they send (deterministic
// tensors, and the v2 request a Triton client sends for a native one).
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "common/dtype.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/server.h"
#include "tests/server/gated_cpu_backend.h"

namespace attnserve {

using inference::GRPCInferenceService;
using inference::ModelInferRequest;
using inference::ModelInferResponse;

class KserveServerTest : public ::testing::Test {
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
  // SystemSharedMemoryRegister of `byte_size` bytes of the object `key` as `name`.
  grpc::Status RegisterSystem(const std::string& name, const std::string& key, uint64_t byte_size) {
    grpc::ClientContext context;
    inference::SystemSharedMemoryRegisterRequest request;
    request.set_name(name);
    request.set_key(key);
    request.set_byte_size(byte_size);
    inference::SystemSharedMemoryRegisterResponse unused;
    return v2_->SystemSharedMemoryRegister(&context, request, &unused);
  }

  GatedCpuBackend* backend_ = nullptr;
  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::Attention::Stub> native_;
  std::unique_ptr<GRPCInferenceService::Stub> v2_;
};

// The parameters that put a tensor at [offset, offset + size) of `region`.
inline void PlaceInRegion(google::protobuf::Map<std::string, inference::InferParameter>* p,
                          const std::string& region, int64_t offset, int64_t size) {
  (*p)["shared_memory_region"].set_string_param(region);
  (*p)["shared_memory_offset"].set_int64_param(offset);
  (*p)["shared_memory_byte_size"].set_int64_param(size);
}

// Deterministic values in `dtype`'s bytes.
inline std::string Values(DType dtype, int64_t count, int seed) {
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

inline void SetTensor(v1::Tensor* t, DType dtype, std::vector<int64_t> shape, int seed) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  t->set_dtype(static_cast<v1::DType>(dtype));
  for (int64_t d : shape) t->add_shape(d);
  *t->mutable_data() = Values(dtype, count, seed);
}

inline v1::ForwardRequest Dense(DType dtype, int b, int sq, int sk, int hq, int hkv, int d) {
  v1::ForwardRequest r;
  r.set_request_id("dense");
  SetTensor(r.mutable_q(), dtype, {b, sq, hq, d}, 1);
  SetTensor(r.mutable_k(), dtype, {b, sk, hkv, d}, 2);
  SetTensor(r.mutable_v(), dtype, {b, sk, hkv, d}, 3);
  return r;
}

inline v1::ForwardRequest Varlen() {
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
inline ModelInferRequest ToV2(const v1::ForwardRequest& r) {
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
  for (const auto& [name, cu] :
       {std::pair<const char*, const google::protobuf::RepeatedField<int32_t>*>{"cu_seqlens_q",
                                                                                &r.cu_seqlens_q()},
        {"cu_seqlens_k", &r.cu_seqlens_k()}}) {
    if (cu->empty()) continue;
    auto* in = v2.add_inputs();
    in->set_name(name);
    in->set_datatype("INT32");
    in->add_shape(cu->size());
    v2.add_raw_input_contents(
        std::string(reinterpret_cast<const char*>(cu->data()), cu->size() * 4));
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

}  // namespace attnserve
