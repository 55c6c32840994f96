// Score modifiers and masks over the wire, on a real AttnServer (CPU backend)
// on 127.0.0.1: ALiBi slopes, sinks, bias, element mask and block mask sent
// through the native Forward, KServe v2 ModelInfer over gRPC and the v2
// HTTP/JSON infer endpoint give the float64 reference's answer (and the same
// bytes on every protocol); every malformed input is INVALID_ARGUMENT (HTTP
// 400) naming the field in its protocol's words, Echo refuses it exactly like
// Forward, and the server keeps serving. With batching on, calls with the
// same slopes and sinks share a launch and calls with a bias run alone.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "backend/reference/reference_attention.h"
#include "common/dtype.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/server.h"
#include "spdlog/spdlog.h"
#include "tests/common/attn_test_util.h"
#include "tests/kserve/shm_test_util.h"
#include "tests/server/gated_cpu_backend.h"

#ifdef ATTNSERVE_TEST_HTTP
#include <httplib.h>

#include <nlohmann/json.hpp>
#endif

namespace attnserve {
namespace {

using testing_util::HostBuffers;
using testing_util::ModsSpec;
using testing_util::TestCase;

// ---- requests ----

std::string Bytes(const void* data, size_t size) {
  return std::string(static_cast<const char*>(data), size);
}

void SetTensor(v1::Tensor* t, DType dtype, std::vector<int64_t> shape, std::string bytes) {
  t->set_dtype(static_cast<v1::DType>(dtype));
  for (int64_t d : shape) t->add_shape(d);
  *t->mutable_data() = std::move(bytes);
}

// The native request for `buf`'s call: its inputs, options and mods.
v1::ForwardRequest RequestOf(const HostBuffers& buf) {
  const TestCase& tc = buf.test_case();
  const AttnParams& p = buf.params();
  v1::ForwardRequest r;
  r.set_request_id(tc.Name());
  const int64_t hq = p.num_heads_q, hkv = p.num_heads_kv, d = p.head_dim;
  if (tc.varlen()) {
    SetTensor(r.mutable_q(), tc.dtype, {p.total_q, hq, d}, Bytes(buf.q(), buf.q_bytes()));
    SetTensor(r.mutable_k(), tc.dtype, {p.total_k, hkv, d}, Bytes(buf.k(), buf.kv_bytes()));
    SetTensor(r.mutable_v(), tc.dtype, {p.total_k, hkv, d}, Bytes(buf.v(), buf.kv_bytes()));
    for (int b = 0; b <= p.batch; ++b) {
      r.add_cu_seqlens_q(buf.cu_seqlens_q()[b]);
      r.add_cu_seqlens_k(buf.cu_seqlens_k()[b]);
    }
  } else {
    SetTensor(r.mutable_q(), tc.dtype, {p.batch, p.seqlen_q, hq, d}, Bytes(buf.q(), buf.q_bytes()));
    SetTensor(r.mutable_k(), tc.dtype, {p.batch, p.seqlen_k, hkv, d},
              Bytes(buf.k(), buf.kv_bytes()));
    SetTensor(r.mutable_v(), tc.dtype, {p.batch, p.seqlen_k, hkv, d},
              Bytes(buf.v(), buf.kv_bytes()));
  }
  v1::AttentionOptions* o = r.mutable_options();
  o->set_causal(tc.causal);
  if (tc.window_left >= 0) o->set_window_left(tc.window_left);
  if (tc.window_right >= 0) o->set_window_right(tc.window_right);
  o->set_softcap(tc.softcap);
  if (tc.softmax_scale != 0.0f) o->set_softmax_scale(tc.softmax_scale);
  o->set_return_lse(tc.return_lse);
  const testing_util::HostMods* mods = buf.mods();
  if (mods == nullptr) return r;
  const ModsSpec& s = mods->spec();
  for (float x : mods->alibi_slopes()) o->add_alibi_slopes(x);
  for (float x : mods->sinks()) o->add_sinks(x);
  // The shape of a bias or mask with these broadcast flags (params.h).
  auto pair_shape = [&](bool per_batch, bool per_head) -> std::vector<int64_t> {
    const int64_t heads = per_head ? hq : 1;
    if (tc.varlen()) return {heads, p.total_pairs};
    return {per_batch ? p.batch : 1, heads, p.seqlen_q, p.seqlen_k};
  };
  if (s.bias) {
    SetTensor(o->mutable_bias(), s.bias_dtype, pair_shape(s.bias_per_batch, s.bias_per_head),
              Bytes(mods->bias().data(), mods->bias().size()));
  }
  if (s.mask_density >= 0.0f) {
    for (int64_t dim : pair_shape(s.mask_per_batch, s.mask_per_head)) {
      o->mutable_mask()->add_shape(dim);
    }
    o->mutable_mask()->set_data(Bytes(mods->mask().data(), mods->mask().size()));
  }
  if (s.block_q > 0) {
    v1::BlockMask* m = o->mutable_block_mask();
    m->set_block_q(s.block_q);
    m->set_block_k(s.block_k);
    m->set_num_batch(s.block_per_batch ? p.batch : 1);
    m->set_num_heads(s.block_per_head ? p.num_heads_q : 1);
    for (int32_t x : mods->block_row_ptr()) m->add_row_ptr(x);
    for (int32_t x : mods->block_col_idx()) m->add_col_idx(x);
  }
  return r;
}

// One v2 input: name, datatype, shape and little-endian bytes.
struct V2Input {
  std::string name;
  std::string datatype;
  std::vector<int64_t> shape;
  std::string bytes;
};

template <typename T>
std::string ListBytes(const google::protobuf::RepeatedField<T>& values) {
  return Bytes(values.data(), values.size() * sizeof(T));
}

std::string V2DType(int code) {
  const DType t = static_cast<DType>(code);
  return t == DType::kFP8E4M3 ? "FP8_E4M3" : std::string(DTypeName(t));
}

// The v2 inputs and parameters of the `attention` model for a native request
// (the mapping of docs/design.md §2).
std::vector<V2Input> V2InputsOf(const v1::ForwardRequest& r) {
  std::vector<V2Input> in;
  for (const auto& [name, t] :
       {std::pair<const char*, const v1::Tensor*>{"q", &r.q()}, {"k", &r.k()}, {"v", &r.v()}}) {
    in.push_back({name, V2DType(t->dtype()), {t->shape().begin(), t->shape().end()}, t->data()});
  }
  if (r.cu_seqlens_q_size() > 0) {
    in.push_back({"cu_seqlens_q", "INT32", {r.cu_seqlens_q_size()}, ListBytes(r.cu_seqlens_q())});
    in.push_back({"cu_seqlens_k", "INT32", {r.cu_seqlens_k_size()}, ListBytes(r.cu_seqlens_k())});
  }
  const v1::AttentionOptions& o = r.options();
  if (o.alibi_slopes_size() > 0) {
    in.push_back({"alibi_slopes", "FP32", {o.alibi_slopes_size()}, ListBytes(o.alibi_slopes())});
  }
  if (o.sinks_size() > 0) in.push_back({"sinks", "FP32", {o.sinks_size()}, ListBytes(o.sinks())});
  if (o.has_bias()) {
    in.push_back({"bias",
                  V2DType(o.bias().dtype()),
                  {o.bias().shape().begin(), o.bias().shape().end()},
                  o.bias().data()});
  }
  if (o.has_mask()) {
    in.push_back(
        {"mask", "BOOL", {o.mask().shape().begin(), o.mask().shape().end()}, o.mask().data()});
  }
  if (o.has_block_mask()) {
    const v1::BlockMask& m = o.block_mask();
    in.push_back({"block_row_ptr", "INT32", {m.row_ptr_size()}, ListBytes(m.row_ptr())});
    in.push_back({"block_col_idx", "INT32", {m.col_idx_size()}, ListBytes(m.col_idx())});
  }
  return in;
}

using V2Params = google::protobuf::Map<std::string, inference::InferParameter>;

V2Params V2ParamsOf(const v1::ForwardRequest& r) {
  V2Params p;
  const v1::AttentionOptions& o = r.options();
  if (o.causal()) p["causal"].set_bool_param(true);
  if (o.has_window_left()) p["window_left"].set_int64_param(o.window_left());
  if (o.has_window_right()) p["window_right"].set_int64_param(o.window_right());
  if (o.softcap() != 0.0f) p["softcap"].set_double_param(o.softcap());
  if (o.has_softmax_scale()) p["softmax_scale"].set_double_param(o.softmax_scale());
  if (o.return_lse()) p["return_lse"].set_bool_param(true);
  if (o.has_block_mask()) {
    const v1::BlockMask& m = o.block_mask();
    p["block_q"].set_int64_param(m.block_q());
    p["block_k"].set_int64_param(m.block_k());
    p["block_num_batch"].set_int64_param(m.num_batch());
    p["block_num_heads"].set_int64_param(m.num_heads());
  }
  return p;
}

inference::ModelInferRequest ToV2(const std::vector<V2Input>& inputs, const V2Params& params,
                                  const std::string& id) {
  inference::ModelInferRequest v2;
  v2.set_model_name("attention");
  v2.set_id(id);
  for (const V2Input& in : inputs) {
    auto* t = v2.add_inputs();
    t->set_name(in.name);
    t->set_datatype(in.datatype);
    for (int64_t d : in.shape) t->add_shape(d);
    v2.add_raw_input_contents(in.bytes);
  }
  *v2.mutable_parameters() = params;
  return v2;
}

// An answer from any protocol: status, O's bytes and LSE's bytes.
struct Answer {
  int code = 0;  // grpc::StatusCode, or the HTTP status for HTTP
  std::string message;
  std::string o, lse;
};

// ---- the server ----

class ScoreModsWireTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.max_request_bytes = 32 << 20;
    options.kserve.allow_client_shm = true;
#ifdef ATTNSERVE_TEST_HTTP
    options.kserve.http_enabled = true;
    options.kserve.http_host = "127.0.0.1";
    options.kserve.http_port = 0;
#endif
    auto backend = std::make_unique<GatedCpuBackend>();
    backend_ = backend.get();
    absl::StatusOr<std::unique_ptr<AttnServer>> server =
        AttnServer::Create(options, std::move(backend));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->Start().ok());
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                             grpc::InsecureChannelCredentials(), args);
    native_ = v1::Attention::NewStub(channel);
    v2_ = inference::GRPCInferenceService::NewStub(channel);
  }

  static void SetDeadline(grpc::ClientContext* context) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  }

  Answer Forward(const v1::ForwardRequest& request, v1::ForwardResponse* out = nullptr) {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ForwardResponse response;
    const grpc::Status s = native_->Forward(&context, request, &response);
    if (out != nullptr) *out = response;
    return {s.error_code(), s.error_message(), response.o().data(), response.lse().data()};
  }
  Answer Echo(const v1::ForwardRequest& request) {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ForwardResponse response;
    const grpc::Status s = native_->Echo(&context, request, &response);
    return {s.error_code(), s.error_message(), response.o().data(), response.lse().data()};
  }
  Answer InferGrpc(const inference::ModelInferRequest& request) {
    grpc::ClientContext context;
    SetDeadline(&context);
    inference::ModelInferResponse response;
    const grpc::Status s = v2_->ModelInfer(&context, request, &response);
    Answer a{s.error_code(), s.error_message(), {}, {}};
    for (int i = 0; i < response.outputs_size() && i < response.raw_output_contents_size(); ++i) {
      (response.outputs(i).name() == "o" ? a.o : a.lse) = response.raw_output_contents(i);
    }
    return a;
  }

#ifdef ATTNSERVE_TEST_HTTP
  // The v2 HTTP infer call: tensors as JSON "data" (binary false) or through
  // the binary tensor extension; O and LSE always come back binary.
  Answer InferHttp(const std::vector<V2Input>& inputs, const V2Params& params, bool want_lse,
                   bool binary) {
    nlohmann::json header = {{"id", "http"}, {"inputs", nlohmann::json::array()}};
    std::string blobs;
    for (const V2Input& in : inputs) {
      nlohmann::json t = {{"name", in.name}, {"datatype", in.datatype}, {"shape", in.shape}};
      if (binary) {
        t["parameters"] = {{"binary_data_size", in.bytes.size()}};
        blobs += in.bytes;
      } else {
        t["data"] = JsonData(in);
      }
      header["inputs"].push_back(t);
    }
    nlohmann::json p = nlohmann::json::object();
    for (const auto& [name, value] : params) {
      switch (value.parameter_choice_case()) {
        case inference::InferParameter::kBoolParam: p[name] = value.bool_param(); break;
        case inference::InferParameter::kInt64Param: p[name] = value.int64_param(); break;
        case inference::InferParameter::kDoubleParam: p[name] = value.double_param(); break;
        default: ADD_FAILURE() << name;
      }
    }
    if (!p.empty()) header["parameters"] = p;
    header["outputs"] = {{{"name", "o"}, {"parameters", {{"binary_data", true}}}}};
    if (want_lse) {
      header["outputs"].push_back({{"name", "lse"}, {"parameters", {{"binary_data", true}}}});
    }
    const std::string json = header.dump();
    httplib::Client client("127.0.0.1", server_->http_port());
    client.set_read_timeout(60, 0);
    httplib::Headers headers;
    if (binary) headers.emplace("Inference-Header-Content-Length", std::to_string(json.size()));
    httplib::Result res = client.Post("/v2/models/attention/infer", headers, json + blobs,
                                      binary ? "application/octet-stream" : "application/json");
    Answer a;
    if (!res) {
      a.code = -1;
      a.message = httplib::to_string(res.error());
      return a;
    }
    a.code = res->status;
    if (res->status != 200) {
      a.message = nlohmann::json::parse(res->body).value("error", res->body);
      return a;
    }
    const size_t length = std::stoul(res->get_header_value("Inference-Header-Content-Length"));
    const nlohmann::json body = nlohmann::json::parse(res->body.substr(0, length));
    size_t offset = length;
    for (const auto& out : body["outputs"]) {
      const size_t size = out["parameters"]["binary_data_size"].get<size_t>();
      (out["name"] == "o" ? a.o : a.lse) = res->body.substr(offset, size);
      offset += size;
    }
    return a;
  }

  static nlohmann::json JsonData(const V2Input& in) {
    nlohmann::json data = nlohmann::json::array();
    const char* b = in.bytes.data();
    if (in.datatype == "BOOL") {
      for (char c : in.bytes) data.push_back(c != 0);
    } else if (in.datatype == "INT32") {
      for (size_t i = 0; i + 4 <= in.bytes.size(); i += 4) {
        int32_t x;
        std::memcpy(&x, b + i, 4);
        data.push_back(x);
      }
    } else {
      const DType t = in.datatype == "FP32"   ? DType::kFP32
                      : in.datatype == "FP16" ? DType::kFP16
                                              : DType::kBF16;
      const size_t size = DTypeSize(t);
      for (size_t i = 0; i + size <= in.bytes.size(); i += size) {
        float x;
        if (t == DType::kFP32) {
          std::memcpy(&x, b + i, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, b + i, 2);
          x = t == DType::kFP16 ? Fp16ToFloat(h) : Bf16ToFloat(h);
        }
        data.push_back(x);
      }
    }
    return data;
  }
#endif

  // A small valid call that every protocol still answers.
  void ExpectStillServing() {
    TestCase tc;
    tc.seqlen_q = 3;
    tc.seqlen_k = 5;
    tc.num_heads_q = 2;
    tc.head_dim = 8;
    HostBuffers buf(tc);
    const v1::ForwardRequest r = RequestOf(buf);
    EXPECT_EQ(Forward(r).code, grpc::StatusCode::OK);
    EXPECT_EQ(InferGrpc(ToV2(V2InputsOf(r), V2ParamsOf(r), "ok")).code, grpc::StatusCode::OK);
  }

  GatedCpuBackend* backend_ = nullptr;  // owned by server_
  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::Attention::Stub> native_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> v2_;
};

// ---- results ----

// The largest difference between `buf`'s reference and the same call
// without its mods: how far a server that dropped them would be off.
double ModsEffect(const HostBuffers& buf) {
  AttnParams plain = buf.params();
  plain.alibi_slopes = plain.sinks = nullptr;
  plain.bias = nullptr;
  plain.mask = nullptr;
  plain.block_q = plain.block_k = 0;
  plain.block_row_ptr = plain.block_col_idx = nullptr;
  const ReferenceOutput without = ReferenceAttention(plain);
  const ReferenceOutput& with = buf.Reference();
  double effect = 0.0;
  for (size_t i = 0; i < with.o.size(); ++i) {
    effect = std::max(effect, std::abs(with.o[i] - without.o[i]));
  }
  return effect;
}

struct ModsCase {
  std::string name;
  TestCase tc;
  bool over_http_json = true;  // no -inf or NaN that JSON cannot spell
};

std::vector<ModsCase> Cases() {
  std::vector<ModsCase> cases;
  auto dense = [](DType dtype, int b, int sq, int sk, int hq, int hkv) {
    TestCase tc;
    tc.dtype = dtype;
    tc.batch = b;
    tc.seqlen_q = sq;
    tc.seqlen_k = sk;
    tc.num_heads_q = hq;
    tc.num_heads_kv = hkv;
    tc.head_dim = 32;
    tc.seed = static_cast<uint32_t>(sq * 131 + sk * 7 + hq);
    return tc;
  };
  {
    TestCase tc = dense(DType::kFP32, 2, 33, 47, 4, 2);
    tc.causal = true;
    tc.mods.alibi = true;
    cases.push_back({"alibi_gqa_causal", tc});
  }
  {
    TestCase tc = dense(DType::kBF16, 1, 8, 8, 4, 1);
    tc.mods.sinks = true;
    tc.mods.sink_range = 6.0f;
    cases.push_back({"sinks_bf16", tc});
  }
  {
    TestCase tc = dense(DType::kFP32, 2, 21, 30, 2, 2);
    tc.mods.bias = true;
    tc.mods.bias_dtype = DType::kFP16;
    tc.mods.bias_neg_inf = 0.2f;
    cases.push_back({"bias_fp16_per_batch_head_neg_inf", tc, /*over_http_json=*/false});
  }
  {
    TestCase tc = dense(DType::kFP16, 2, 19, 25, 2, 1);
    tc.mods.bias = true;
    tc.mods.bias_dtype = DType::kBF16;
    tc.mods.bias_per_batch = false;
    tc.mods.bias_per_head = false;
    tc.window_left = 6;
    cases.push_back({"bias_bf16_broadcast_window", tc});
  }
  {
    TestCase tc = dense(DType::kFP32, 2, 26, 26, 2, 2);
    tc.mods.mask_density = 0.5f;
    tc.mods.mask_empty_rows = 0.2f;
    tc.mods.mask_per_head = false;
    cases.push_back({"mask_per_batch_empty_rows", tc});
  }
  {
    TestCase tc = dense(DType::kFP32, 1, 300, 290, 2, 1);
    tc.head_dim = 16;
    tc.mods.block_q = 128;
    tc.mods.block_k = 128;
    tc.mods.block_density = 0.5f;
    tc.mods.block_empty_rows = 0.2f;
    tc.mods.block_per_batch = false;
    cases.push_back({"block_mask_shared_batch", tc});
  }
  {
    TestCase tc;
    tc.dtype = DType::kFP32;
    tc.seqlens_q = {130, 0, 20};
    tc.seqlens_k = {140, 9, 260};
    tc.num_heads_q = 2;
    tc.num_heads_kv = 1;
    tc.head_dim = 16;
    tc.causal = true;
    tc.seed = 7;
    tc.mods.alibi = true;
    tc.mods.sinks = true;
    tc.mods.bias = true;
    tc.mods.bias_per_head = false;
    tc.mods.mask_density = 0.7f;
    tc.mods.block_q = 128;
    tc.mods.block_k = 256;
    tc.mods.block_density = 0.6f;
    cases.push_back({"varlen_all_mods", tc});
  }
  return cases;
}

TEST_F(ScoreModsWireTest, EachModMatchesTheReferenceOnEveryProtocol) {
  for (const ModsCase& c : Cases()) {
    SCOPED_TRACE(c.name);
    HostBuffers buf(c.tc);
    // A server that ignored the mods would be off by far more than the tolerance.
    EXPECT_GT(ModsEffect(buf), 1e-2);
    const v1::ForwardRequest request = RequestOf(buf);
    const Answer native = Forward(request);
    ASSERT_EQ(native.code, grpc::StatusCode::OK) << native.message;
    const float* lse =
        c.tc.return_lse ? reinterpret_cast<const float*>(native.lse.data()) : nullptr;
    ASSERT_EQ(static_cast<int64_t>(native.o.size()), buf.o_bytes());
    EXPECT_TRUE(testing_util::CheckOutput(buf, native.o.data(), lse));

    const std::vector<V2Input> inputs = V2InputsOf(request);
    const V2Params params = V2ParamsOf(request);
    const Answer grpc_v2 = InferGrpc(ToV2(inputs, params, c.name));
    ASSERT_EQ(grpc_v2.code, grpc::StatusCode::OK) << grpc_v2.message;
    EXPECT_TRUE(grpc_v2.o == native.o);
    EXPECT_TRUE(grpc_v2.lse == native.lse);
#ifdef ATTNSERVE_TEST_HTTP
    for (bool binary : {false, true}) {
      if (!binary && !c.over_http_json) continue;
      SCOPED_TRACE(binary ? "http binary" : "http json");
      const Answer http = InferHttp(inputs, params, c.tc.return_lse, binary);
      ASSERT_EQ(http.code, 200) << http.message;
      EXPECT_TRUE(http.o == native.o);
      EXPECT_TRUE(http.lse == native.lse);
    }
#endif
  }
}

// Every mod input may lie in a system shared-memory region, as q, k and v may.
TEST_F(ScoreModsWireTest, ModInputsInSharedMemory) {
  TestCase tc = Cases().back().tc;  // varlen, every mod
  HostBuffers buf(tc);
  const v1::ForwardRequest request = RequestOf(buf);
  const Answer native = Forward(request);
  ASSERT_EQ(native.code, grpc::StatusCode::OK) << native.message;
  std::vector<V2Input> inputs = V2InputsOf(request);
  size_t total = 0;
  for (const V2Input& in : inputs) total += (in.bytes.size() + 63) / 64 * 64;
  TestShmObject object(total, "mods");
  ASSERT_TRUE(object.ok());
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    inference::SystemSharedMemoryRegisterRequest r;
    r.set_name("mods");
    r.set_key(object.key());
    r.set_byte_size(total);
    inference::SystemSharedMemoryRegisterResponse unused;
    ASSERT_TRUE(v2_->SystemSharedMemoryRegister(&context, r, &unused).ok());
  }
  inference::ModelInferRequest v2 = ToV2(inputs, V2ParamsOf(request), "shm");
  v2.clear_raw_input_contents();
  size_t offset = 0;
  for (int i = 0; i < v2.inputs_size(); ++i) {
    const std::string& bytes = inputs[static_cast<size_t>(i)].bytes;
    const std::string& name = inputs[static_cast<size_t>(i)].name;
    if (name == "q" || name == "k" || name == "v") {
      v2.add_raw_input_contents(bytes);
      continue;
    }
    std::memcpy(object.data() + offset, bytes.data(), bytes.size());
    auto& p = *v2.mutable_inputs(i)->mutable_parameters();
    p["shared_memory_region"].set_string_param("mods");
    p["shared_memory_offset"].set_int64_param(static_cast<int64_t>(offset));
    p["shared_memory_byte_size"].set_int64_param(static_cast<int64_t>(bytes.size()));
    offset += (bytes.size() + 63) / 64 * 64;
  }
  const Answer shm = InferGrpc(v2);
  ASSERT_EQ(shm.code, grpc::StatusCode::OK) << shm.message;
  EXPECT_TRUE(shm.o == native.o);
  EXPECT_TRUE(shm.lse == native.lse);
}

// ---- refusals ----

// A dense FP32 call with every mod: B = 2, Sq = 130, Sk = 260, Hq = 2, Hkv = 1.
TestCase BaseCase() {
  TestCase tc;
  tc.batch = 2;
  tc.seqlen_q = 130;
  tc.seqlen_k = 260;
  tc.num_heads_q = 2;
  tc.head_dim = 8;
  tc.seed = 3;
  tc.mods.alibi = true;
  tc.mods.sinks = true;
  tc.mods.bias = true;
  tc.mods.mask_density = 0.8f;
  tc.mods.block_q = 128;
  tc.mods.block_k = 128;
  tc.mods.block_density = 0.7f;
  return tc;
}

void SetFloat(std::string* bytes, size_t index, float value) {
  std::memcpy(&(*bytes)[index * 4], &value, 4);
}

struct Breakage {
  std::string what;
  std::function<void(v1::ForwardRequest*)> apply;
  std::string native_field;
  std::string v2_field;
};

std::vector<Breakage> Breakages() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto opt = [](v1::ForwardRequest* r) { return r->mutable_options(); };
  auto block = [](v1::ForwardRequest* r) { return r->mutable_options()->mutable_block_mask(); };
  return {
      {"three slopes for two heads", [=](auto* r) { opt(r)->add_alibi_slopes(0.5f); },
       "options.alibi_slopes", "inputs['alibi_slopes']"},
      {"a NaN slope", [=](auto* r) { opt(r)->set_alibi_slopes(1, nan); }, "options.alibi_slopes[1]",
       "inputs['alibi_slopes'][1]"},
      {"one sink for two heads", [=](auto* r) { opt(r)->mutable_sinks()->RemoveLast(); },
       "options.sinks", "inputs['sinks']"},
      {"an infinite sink", [=](auto* r) { opt(r)->set_sinks(0, inf); }, "options.sinks[0]",
       "inputs['sinks'][0]"},
      {"an FP8 bias", [=](auto* r) { opt(r)->mutable_bias()->set_dtype(v1::FP8_E4M3); },
       "options.bias.dtype", "inputs['bias'].datatype"},
      {"a bias over Sk + 1 keys", [=](auto* r) { opt(r)->mutable_bias()->set_shape(3, 261); },
       "options.bias.shape", "inputs['bias'].shape"},
      {"a rank-3 bias", [=](auto* r) { opt(r)->mutable_bias()->mutable_shape()->RemoveLast(); },
       "options.bias.shape", "inputs['bias'].shape"},
      {"a bias of 3 batches", [=](auto* r) { opt(r)->mutable_bias()->set_shape(0, 3); },
       "options.bias.shape", "inputs['bias'].shape"},
      {"a bias four bytes short",
       [=](auto* r) {
         opt(r)->mutable_bias()->mutable_data()->resize(opt(r)->bias().data().size() - 4);
       },
       "options.bias.data", "inputs['bias'].data"},
      {"a NaN in the bias",
       [=](auto* r) { SetFloat(opt(r)->mutable_bias()->mutable_data(), 77, nan); },
       "options.bias.data[77]", "inputs['bias'].data[77]"},
      {"+inf in the bias",
       [=](auto* r) { SetFloat(opt(r)->mutable_bias()->mutable_data(), 5, inf); },
       "options.bias.data[5]", "inputs['bias'].data[5]"},
      {"a mask over Sq - 1 queries", [=](auto* r) { opt(r)->mutable_mask()->set_shape(2, 129); },
       "options.mask.shape", "inputs['mask'].shape"},
      {"a mask one byte long",
       [=](auto* r) { opt(r)->mutable_mask()->mutable_data()->push_back(1); }, "options.mask.data",
       "inputs['mask'].data"},
      {"block_q 64", [=](auto* r) { block(r)->set_block_q(64); }, "options.block_mask.block_q",
       "parameters['block_q']"},
      {"block_k 0", [=](auto* r) { block(r)->set_block_k(0); }, "options.block_mask.block_k",
       "parameters['block_k']"},
      {"block_k 200", [=](auto* r) { block(r)->set_block_k(200); }, "options.block_mask.block_k",
       "parameters['block_k']"},
      {"num_batch 3 of 2", [=](auto* r) { block(r)->set_num_batch(3); },
       "options.block_mask.num_batch", "parameters['block_num_batch']"},
      {"num_heads 0", [=](auto* r) { block(r)->set_num_heads(0); }, "options.block_mask.num_heads",
       "parameters['block_num_heads']"},
      {"row_ptr one short", [=](auto* r) { block(r)->mutable_row_ptr()->RemoveLast(); },
       "options.block_mask.row_ptr", "inputs['block_row_ptr']"},
      {"row_ptr from 1", [=](auto* r) { block(r)->set_row_ptr(0, 1); },
       "options.block_mask.row_ptr[0]", "inputs['block_row_ptr'][0]"},
      {"row_ptr decreasing", [=](auto* r) { block(r)->set_row_ptr(2, block(r)->row_ptr(1) - 1); },
       "options.block_mask.row_ptr[2]", "inputs['block_row_ptr'][2]"},
      {"row_ptr ending short of col_idx", [=](auto* r) { block(r)->add_col_idx(0); },
       "options.block_mask.row_ptr[", "inputs['block_row_ptr']["},
      {"a key block out of range",
       [=](auto* r) { block(r)->set_col_idx(block(r)->col_idx_size() - 1, 3); },
       "options.block_mask.col_idx[", "inputs['block_col_idx']["},
      {"a negative key block", [=](auto* r) { block(r)->set_col_idx(0, -1); },
       "options.block_mask.col_idx[0]", "inputs['block_col_idx'][0]"},
      {"unsorted key blocks",
       [=](auto* r) {
         // The first row with two blocks lists them backwards.
         for (int row = 0; row + 1 < block(r)->row_ptr_size(); ++row) {
           const int e = block(r)->row_ptr(row);
           if (block(r)->row_ptr(row + 1) - e >= 2) {
             const int32_t a = block(r)->col_idx(e);
             block(r)->set_col_idx(e, block(r)->col_idx(e + 1));
             block(r)->set_col_idx(e + 1, a);
             return;
           }
         }
         ADD_FAILURE() << "no row with two key blocks";
       },
       "options.block_mask.col_idx[", "inputs['block_col_idx']["},
  };
}

TEST_F(ScoreModsWireTest, MalformedModsAreRefusedNamingTheFieldOnEveryProtocol) {
  HostBuffers buf(BaseCase());
  const v1::ForwardRequest valid = RequestOf(buf);
  {
    // The base call is valid everywhere, so each refusal below is its breakage's.
    ASSERT_EQ(Forward(valid).code, grpc::StatusCode::OK) << Forward(valid).message;
    const Answer v2 = InferGrpc(ToV2(V2InputsOf(valid), V2ParamsOf(valid), "valid"));
    ASSERT_EQ(v2.code, grpc::StatusCode::OK) << v2.message;
  }
  const int calls_before = backend_->calls();
  for (const Breakage& b : Breakages()) {
    SCOPED_TRACE(b.what);
    v1::ForwardRequest bad = valid;
    b.apply(&bad);
    const Answer forward = Forward(bad);
    EXPECT_EQ(forward.code, grpc::StatusCode::INVALID_ARGUMENT) << forward.message;
    EXPECT_NE(forward.message.find(b.native_field), std::string::npos) << forward.message;
    const Answer echo = Echo(bad);
    EXPECT_EQ(echo.code, grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(echo.message, forward.message);

    const std::vector<V2Input> inputs = V2InputsOf(bad);
    const V2Params params = V2ParamsOf(bad);
    const Answer v2 = InferGrpc(ToV2(inputs, params, "bad"));
    EXPECT_EQ(v2.code, grpc::StatusCode::INVALID_ARGUMENT) << v2.message;
    EXPECT_NE(v2.message.find(b.v2_field), std::string::npos) << v2.message;
#ifdef ATTNSERVE_TEST_HTTP
    const Answer http = InferHttp(inputs, params, true, /*binary=*/true);
    EXPECT_EQ(http.code, 400) << http.message;
    EXPECT_EQ(http.message, v2.message);
#endif
  }
  // Nothing malformed reached the backend, and the server still serves.
  EXPECT_EQ(backend_->calls(), calls_before);
  ExpectStillServing();
}

// Hostile block masks: a block size near INT32_MAX (its row count once
// overflowed: the server read past row_ptr and died) and a request with no
// query rows but 2^31 - 1 sequences and heads (the row walk once spun through
// B x Hq steps no byte paid for). Each is answered at once and the server
// keeps serving.
TEST_F(ScoreModsWireTest, HostileBlockMasksAreAnsweredAndTheServerServes) {
  auto tensor = [](v1::Tensor* t, std::vector<int64_t> shape) {
    t->set_dtype(v1::FP32);
    int64_t n = 1;
    for (int64_t d : shape) {
      t->add_shape(d);
      n *= d;
    }
    t->set_data(std::string(static_cast<size_t>(n) * 4, '\0'));
  };
  auto request = [&](int64_t batch, int64_t sq, int64_t hq, int64_t block_q, int64_t num_batch,
                     int64_t num_heads, std::vector<int32_t> row_ptr) {
    v1::ForwardRequest r;
    tensor(r.mutable_q(), {batch, sq, hq, 8});
    tensor(r.mutable_k(), {batch, sq, 1, 8});
    tensor(r.mutable_v(), {batch, sq, 1, 8});
    v1::BlockMask* m = r.mutable_options()->mutable_block_mask();
    m->set_block_q(static_cast<int32_t>(block_q));
    m->set_block_k(128);
    m->set_num_batch(static_cast<int32_t>(num_batch));
    m->set_num_heads(static_cast<int32_t>(num_heads));
    for (int32_t x : row_ptr) m->add_row_ptr(x);
    return r;
  };
  constexpr int64_t kHugeBlock = 2147483520;  // the largest multiple of 128 in int32
  // One row (1000 queries in one block): row_ptr needs 2 entries, not 1.
  Answer a = Forward(request(1, 1000, 1, kHugeBlock, 1, 1, {0}));
  EXPECT_EQ(a.code, grpc::StatusCode::INVALID_ARGUMENT) << a.message;
  EXPECT_NE(a.message.find("row_ptr"), std::string::npos) << a.message;
  a = Forward(request(1, 256, 1, kHugeBlock, 1, 1, {}));
  EXPECT_EQ(a.code, grpc::StatusCode::INVALID_ARGUMENT) << a.message;
  // The same block size with a correct CSR runs (one row keeping key block 0).
  v1::ForwardRequest ok = request(1, 1000, 1, kHugeBlock, 1, 1, {0, 1});
  ok.mutable_options()->mutable_block_mask()->add_col_idx(0);
  a = Forward(ok);
  EXPECT_EQ(a.code, grpc::StatusCode::OK) << a.message;
  // No query rows, 1000 sequences and 2^31 - 1 heads: no rows to walk.
  constexpr int64_t kMax = 2147483647;
  a = Forward(request(1000, 0, kMax, 128, 1000, kMax, {0}));
  EXPECT_NE(a.code, grpc::StatusCode::DEADLINE_EXCEEDED) << a.message;
  // 2^31 - 1 empty sequences: more than --max_tokens, refused before the
  // backend sizes anything by the batch.
  a = Forward(request(kMax, 0, 1, 128, 1, 1, {0}));
  EXPECT_EQ(a.code, grpc::StatusCode::RESOURCE_EXHAUSTED) << a.message;
  EXPECT_NE(a.message.find("q.shape[0]"), std::string::npos) << a.message;
  ExpectStillServing();
}

// What only v2 can get wrong: datatypes, missing block-mask pieces, and
// parameters of the wrong type.
TEST_F(ScoreModsWireTest, V2OnlyRefusals) {
  HostBuffers buf(BaseCase());
  const v1::ForwardRequest valid = RequestOf(buf);
  const std::vector<V2Input> inputs = V2InputsOf(valid);
  const V2Params params = V2ParamsOf(valid);
  struct Case {
    std::string what;
    std::function<void(std::vector<V2Input>*, V2Params*)> apply;
    std::string field;
  };
  auto input = [](std::vector<V2Input>* in, const std::string& name) -> V2Input& {
    for (V2Input& i : *in) {
      if (i.name == name) return i;
    }
    ADD_FAILURE() << name;
    return in->front();
  };
  auto drop = [](std::vector<V2Input>* in, const std::string& name) {
    for (size_t i = 0; i < in->size(); ++i) {
      if ((*in)[i].name == name) in->erase(in->begin() + static_cast<long>(i));
    }
  };
  const std::vector<Case> cases = {
      {"an INT8 mask", [&](auto* in, auto*) { input(in, "mask").datatype = "INT8"; },
       "inputs['mask'].datatype"},
      {"FP16 slopes",
       [&](auto* in, auto*) {
         V2Input& s = input(in, "alibi_slopes");
         s.datatype = "FP16";
         s.bytes.resize(s.bytes.size() / 2);
       },
       "inputs['alibi_slopes'].datatype"},
      {"2-D sinks",
       [&](auto* in, auto*) {
         input(in, "sinks").shape = {1, 2};
       },
       "inputs['sinks'].shape"},
      {"FP32 row pointers", [&](auto* in, auto*) { input(in, "block_row_ptr").datatype = "FP32"; },
       "inputs['block_row_ptr'].datatype"},
      {"an INT32 bias", [&](auto* in, auto*) { input(in, "bias").datatype = "INT32"; },
       "inputs['bias'].datatype"},
      {"no block_q", [&](auto*, auto* p) { p->erase("block_q"); }, "parameters['block_q']"},
      {"no column indices", [&](auto* in, auto*) { drop(in, "block_col_idx"); },
       "inputs['block_col_idx']"},
      {"block_q as a string", [&](auto*, auto* p) { (*p)["block_q"].set_string_param("big"); },
       "parameters['block_q']"},
      {"a block mask's parameters alone",
       [&](auto* in, auto*) {
         drop(in, "block_row_ptr");
         drop(in, "block_col_idx");
       },
       "inputs['block_row_ptr']"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<V2Input> in = inputs;
    V2Params p = params;
    c.apply(&in, &p);
    const Answer v2 = InferGrpc(ToV2(in, p, "bad"));
    EXPECT_EQ(v2.code, grpc::StatusCode::INVALID_ARGUMENT) << v2.message;
    EXPECT_NE(v2.message.find(c.field), std::string::npos) << v2.message;
  }
  ExpectStillServing();
}

// The mods' bytes count against --max_request_bytes like the tensors': a
// call whose q, k and v fit is refused once its bias takes it over the limit
// (by less than gRPC's own receive slack, so the server's check is the one
// that answers).
TEST_F(ScoreModsWireTest, ModBytesCountAgainstTheRequestLimit) {
  constexpr int64_t kLimit = 32 << 20;  // the fixture's max_request_bytes
  // q [1, 16, 1, 8], k and v [1, Sk, 1, 8], bias [1, 1, 16, Sk] FP32: 128 bytes per key.
  const int64_t sk = (kLimit + (16 << 10)) / 128;
  TestCase tc;
  tc.seqlen_q = 16;
  tc.seqlen_k = static_cast<int>(sk);
  tc.head_dim = 8;
  tc.return_lse = false;
  HostBuffers buf(tc);
  v1::ForwardRequest r = RequestOf(buf);
  ASSERT_LT(static_cast<int64_t>(r.ByteSizeLong()), kLimit);
  SetTensor(r.mutable_options()->mutable_bias(), DType::kFP32, {1, 1, 16, sk},
            std::string(static_cast<size_t>(16 * sk * 4), '\0'));
  const int64_t size = static_cast<int64_t>(r.ByteSizeLong());
  ASSERT_GT(size, kLimit);
  ASSERT_LT(size, kLimit + (60 << 10));
  const Answer native = Forward(r);
  EXPECT_EQ(native.code, grpc::StatusCode::RESOURCE_EXHAUSTED) << native.message;
  EXPECT_NE(native.message.find("max_request_bytes"), std::string::npos) << native.message;
  const Answer v2 = InferGrpc(ToV2(V2InputsOf(r), V2ParamsOf(r), "big"));
  EXPECT_EQ(v2.code, grpc::StatusCode::RESOURCE_EXHAUSTED) << v2.message;
  EXPECT_NE(v2.message.find("max_request_bytes"), std::string::npos) << v2.message;
  ExpectStillServing();
}

// With batching on: calls with the same slopes and sinks share one launch;
// a call with a bias (or mask, or block mask) runs alone; every answer is
// still the reference's.
TEST_F(ScoreModsWireTest, BatchingPacksEqualPerHeadModsAndRunsTensorModsAlone) {
  TestCase sinks_case;
  sinks_case.seqlen_q = 9;
  sinks_case.seqlen_k = 14;
  sinks_case.num_heads_q = 2;
  sinks_case.head_dim = 16;
  sinks_case.seed = 11;
  sinks_case.mods.sinks = true;
  sinks_case.mods.alibi = true;
  TestCase bias_case = sinks_case;
  bias_case.mods = ModsSpec();
  bias_case.mods.bias = true;
  bias_case.seed = 12;
  HostBuffers sinks_buf(sinks_case);
  HostBuffers bias_buf(bias_case);
  TestCase blocker;  // holds the gate while the others queue
  blocker.head_dim = 16;
  blocker.num_heads_q = 2;
  HostBuffers blocker_buf(blocker);
  const int warm_calls = backend_->calls();  // the start-up warm-up, if any

  struct Pending {
    grpc::ClientContext context;
    v1::ForwardResponse response;
    grpc::Status status;
    bool done = false;
  };
  absl::Mutex mu;
  std::vector<std::unique_ptr<Pending>> pending;
  std::vector<v1::ForwardRequest> requests = {RequestOf(blocker_buf), RequestOf(sinks_buf),
                                              RequestOf(sinks_buf), RequestOf(bias_buf),
                                              RequestOf(bias_buf)};
  backend_->Close();
  for (size_t i = 0; i < requests.size(); ++i) {
    pending.push_back(std::make_unique<Pending>());
    Pending* p = pending.back().get();
    SetDeadline(&p->context);
    native_->async()->Forward(&p->context, &requests[i], &p->response, [&mu, p](grpc::Status s) {
      absl::MutexLock lock(&mu);
      p->status = std::move(s);
      p->done = true;
    });
    if (i == 0) {
      // The blocker is in the backend before the rest arrive.
      while (backend_->calls() == warm_calls) absl::SleepFor(absl::Milliseconds(1));
    }
  }
  // The rest are queued behind the blocker: the server says so (not a fixed wait).
  const int behind = static_cast<int>(requests.size()) - 1;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (server_->queued_requests() < behind && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(server_->queued_requests(), behind);
  backend_->Open();
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](std::vector<std::unique_ptr<Pending>>* v) {
          for (const auto& p : *v) {
            if (!p->done) return false;
          }
          return true;
        },
        &pending));
  }
  for (size_t i = 0; i < pending.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(pending[i]->status.ok()) << pending[i]->status.error_message();
  }
  const HostBuffers* bufs[] = {&blocker_buf, &sinks_buf, &sinks_buf, &bias_buf, &bias_buf};
  for (size_t i = 1; i < pending.size(); ++i) {
    SCOPED_TRACE(i);
    const v1::ForwardResponse& r = pending[i]->response;
    EXPECT_TRUE(testing_util::CheckOutput(*bufs[i], r.o().data().data(),
                                          reinterpret_cast<const float*>(r.lse().data().data())));
  }
  EXPECT_EQ(pending[1]->response.timing().batch_size(), 2);
  EXPECT_EQ(pending[2]->response.timing().batch_size(), 2);
  EXPECT_EQ(pending[3]->response.timing().batch_size(), 1);
  EXPECT_EQ(pending[4]->response.timing().batch_size(), 1);
}

}  // namespace
}  // namespace attnserve
