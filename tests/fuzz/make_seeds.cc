// Writes the fuzzers' seed corpora (tests/fuzz/corpus/<target>/): small valid
// and invalid ForwardRequests covering every layout and option, .npy files of
// every dtype the reader takes, KServe v2 requests (raw, typed and
// shared-memory tensors, varlen, parameters) and K/V operation programs. The
// committed files came from this program; rerun it after a wire change:
// make_seeds <corpus dir>.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "client/npy.h"
#include "common/dtype.h"
#include "inference/grpc_service.pb.h"

namespace attnserve {
namespace {

void Fill(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape) {
  t->set_dtype(dtype);
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  const DType dt = static_cast<DType>(dtype);
  std::string bytes(static_cast<size_t>(n * DTypeSize(dt)), '\0');
  for (int64_t i = 0; i < n; ++i) StoreFromFloat(bytes.data(), dt, i, 0.25f * ((i * 7) % 9 - 4));
  t->set_data(bytes);
}

v1::ForwardRequest Dense(v1::DType dtype, int b, int sq, int sk, int hq, int hkv, int d) {
  v1::ForwardRequest r;
  r.set_request_id("seed");
  Fill(r.mutable_q(), dtype, {b, sq, hq, d});
  Fill(r.mutable_k(), dtype, {b, sk, hkv, d});
  Fill(r.mutable_v(), dtype, {b, sk, hkv, d});
  return r;
}

void Write(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

// ---- KServe v2 (kserve_infer_fuzzer) ----

using V2Input = inference::ModelInferRequest::InferInputTensor;

V2Input* AddInput(inference::ModelInferRequest* r, const char* name, const char* datatype,
                  std::vector<int64_t> shape) {
  V2Input* in = r->add_inputs();
  in->set_name(name);
  in->set_datatype(datatype);
  for (int64_t d : shape) in->add_shape(d);
  return in;
}

// Raw little-endian bytes of n values of `dtype`.
std::string RawValues(DType dtype, int64_t n) {
  std::string bytes(static_cast<size_t>(n * DTypeSize(dtype)), '\0');
  for (int64_t i = 0; i < n; ++i) StoreFromFloat(bytes.data(), dtype, i, 0.25f * ((i * 5) % 7 - 3));
  return bytes;
}

void SetShm(google::protobuf::Map<std::string, inference::InferParameter>* p, const char* region,
            int64_t offset, int64_t size) {
  (*p)["shared_memory_region"].set_string_param(region);
  (*p)["shared_memory_offset"].set_int64_param(offset);
  (*p)["shared_memory_byte_size"].set_int64_param(size);
}

// The fuzzer reads its registry program from the input's end: one zero byte
// there is "no registry operations", and the rest is the request.
std::string V2Seed(const inference::ModelInferRequest& r) { return r.SerializeAsString() + '\0'; }

std::vector<std::pair<std::string, std::string>> KserveSeeds() {
  std::vector<std::pair<std::string, std::string>> seeds;
  {  // raw FP16, dense, causal
    inference::ModelInferRequest r;
    r.set_model_name("attention");
    r.set_id("raw");
    AddInput(&r, "q", "FP16", {1, 3, 2, 8});
    AddInput(&r, "k", "FP16", {1, 5, 1, 8});
    AddInput(&r, "v", "FP16", {1, 5, 1, 8});
    r.add_raw_input_contents(RawValues(DType::kFP16, 48));
    r.add_raw_input_contents(RawValues(DType::kFP16, 40));
    r.add_raw_input_contents(RawValues(DType::kFP16, 40));
    (*r.mutable_parameters())["causal"].set_bool_param(true);
    seeds.emplace_back("raw_fp16_causal", V2Seed(r));
  }
  {  // typed FP32 contents, both outputs asked for
    inference::ModelInferRequest r;
    for (const char* name : {"q", "k", "v"}) {
      V2Input* in = AddInput(&r, name, "FP32", {1, 2, 1, 8});
      for (int i = 0; i < 16; ++i) in->mutable_contents()->add_fp32_contents(0.5f * (i % 3 - 1));
    }
    (*r.mutable_parameters())["return_lse"].set_string_param("true");
    r.add_outputs()->set_name("o");
    r.add_outputs()->set_name("lse");
    seeds.emplace_back("typed_fp32_lse", V2Seed(r));
  }
  {  // inputs from the "in" region, o into the "out" region
    inference::ModelInferRequest r;
    SetShm(AddInput(&r, "q", "FP16", {1, 2, 1, 8})->mutable_parameters(), "in", 0, 32);
    SetShm(AddInput(&r, "k", "FP16", {1, 4, 1, 8})->mutable_parameters(), "in", 64, 64);
    SetShm(AddInput(&r, "v", "FP16", {1, 4, 1, 8})->mutable_parameters(), "in", 256, 64);
    SetShm(r.add_outputs()->mutable_parameters(), "out", 0, 2048);
    r.mutable_outputs(0)->set_name("o");
    seeds.emplace_back("shm_in_out", V2Seed(r));
  }
  {  // an output region too small for o: refused, nothing written
    inference::ModelInferRequest r;
    SetShm(AddInput(&r, "q", "FP16", {1, 8, 1, 8})->mutable_parameters(), "in", 0, 128);
    SetShm(AddInput(&r, "k", "FP16", {1, 8, 1, 8})->mutable_parameters(), "in", 128, 128);
    SetShm(AddInput(&r, "v", "FP16", {1, 8, 1, 8})->mutable_parameters(), "in", 256, 128);
    SetShm(r.add_outputs()->mutable_parameters(), "out", 2000, 48);
    r.mutable_outputs(0)->set_name("o");
    seeds.emplace_back("shm_out_too_small", V2Seed(r));
  }
  {  // varlen with INT32 typed cu_seqlens, window and softcap as strings
    inference::ModelInferRequest r;
    AddInput(&r, "q", "BF16", {5, 2, 8});
    AddInput(&r, "k", "BF16", {4, 1, 8});
    AddInput(&r, "v", "BF16", {4, 1, 8});
    r.add_raw_input_contents(RawValues(DType::kBF16, 80));
    r.add_raw_input_contents(RawValues(DType::kBF16, 32));
    r.add_raw_input_contents(RawValues(DType::kBF16, 32));
    for (const char* name : {"cu_seqlens_q", "cu_seqlens_k"}) {
      V2Input* in = AddInput(&r, name, "INT32", {3});
      for (int x : {0, 2, name[10] == 'q' ? 5 : 4}) in->mutable_contents()->add_int_contents(x);
    }
    (*r.mutable_parameters())["window_left"].set_string_param("2");
    (*r.mutable_parameters())["softcap"].set_double_param(20.0);
    (*r.mutable_parameters())["softmax_scale"].set_int64_param(1);
    seeds.emplace_back("varlen_params", V2Seed(r));
  }
  {  // an unknown parameter and a protocol one
    inference::ModelInferRequest r;
    AddInput(&r, "q", "FP16", {1, 1, 1, 8});
    AddInput(&r, "k", "FP16", {1, 1, 1, 8});
    AddInput(&r, "v", "FP16", {1, 1, 1, 8});
    for (int i = 0; i < 3; ++i) r.add_raw_input_contents(RawValues(DType::kFP16, 8));
    (*r.mutable_parameters())["priority"].set_int64_param(1);
    (*r.mutable_parameters())["temperature"].set_double_param(0.7);
    seeds.emplace_back("unknown_parameter", V2Seed(r));
  }
  return seeds;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  using namespace attnserve;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR (holding one directory per fuzz target)\n");
    return 2;
  }
  const std::string fwd = std::string(argv[1]) + "/forward_request_fuzzer/";
  const std::string npy = std::string(argv[1]) + "/npy_fuzzer/";
  std::vector<std::pair<std::string, v1::ForwardRequest>> seeds;
  seeds.emplace_back("dense_fp16", Dense(v1::FP16, 1, 3, 5, 2, 1, 8));
  seeds.emplace_back("dense_bf16_gqa", Dense(v1::BF16, 2, 2, 3, 4, 2, 16));
  seeds.emplace_back("dense_fp32", Dense(v1::FP32, 1, 2, 2, 1, 1, 8));
  v1::ForwardRequest r = Dense(v1::FP16, 1, 4, 4, 1, 1, 8);
  r.mutable_options()->set_causal(true);
  r.mutable_options()->set_return_lse(true);
  seeds.emplace_back("causal_lse", r);
  r = Dense(v1::BF16, 1, 3, 6, 1, 1, 8);
  r.mutable_options()->set_window_left(1);
  r.mutable_options()->set_window_right(0);
  r.mutable_options()->set_softcap(30.0f);
  r.mutable_options()->set_softmax_scale(0.5f);
  seeds.emplace_back("window_softcap_scale", r);
  r = v1::ForwardRequest();
  r.set_request_id("varlen");
  Fill(r.mutable_q(), v1::FP16, {5, 2, 8});
  Fill(r.mutable_k(), v1::FP16, {4, 1, 8});
  Fill(r.mutable_v(), v1::FP16, {4, 1, 8});
  for (int x : {0, 2, 2, 5}) r.add_cu_seqlens_q(x);
  for (int x : {0, 1, 4, 4}) r.add_cu_seqlens_k(x);
  r.mutable_options()->set_return_lse(true);
  seeds.emplace_back("varlen_zero_len", r);
  r = Dense(v1::FP16, 1, 2, 2, 1, 1, 8);
  r.mutable_options()->set_softcap(3e38f);  // out of range: refused
  seeds.emplace_back("softcap_huge", r);
  r = Dense(v1::FP32, 1, 2, 2, 1, 1, 8);
  r.mutable_options()->set_softmax_scale(1e26f);  // the largest accepted
  seeds.emplace_back("scale_max", r);
  r = Dense(v1::FP16, 1, 2, 2, 1, 1, 12);  // bad head dim
  seeds.emplace_back("bad_head_dim", r);
  r = Dense(v1::FP16, 1, 2, 2, 1, 1, 8);
  r.mutable_q()->mutable_data()->resize(3);  // wrong byte length
  seeds.emplace_back("short_q", r);
  r = Dense(v1::FP8_E4M3, 1, 3, 5, 2, 1, 16);
  r.mutable_options()->set_q_descale(0.5f);
  r.mutable_options()->set_k_descale(2.0f);
  r.mutable_options()->set_v_descale(0.25f);
  r.mutable_options()->set_causal(true);
  r.mutable_options()->set_return_lse(true);
  seeds.emplace_back("dense_fp8_descale", r);
  r = Dense(v1::FP8_E4M3, 1, 2, 2, 1, 1, 8);
  r.mutable_options()->set_k_descale(0.0f);  // out of range: refused
  seeds.emplace_back("fp8_zero_descale", r);
  r = Dense(v1::BF16, 1, 2, 2, 1, 1, 8);
  r.mutable_options()->set_v_descale(2.0f);  // descale on BF16: refused
  seeds.emplace_back("bf16_descale", r);
  for (const auto& [name, request] : seeds) Write(fwd + name + ".pb", request.SerializeAsString());

  const std::vector<float> values = {1.0f, -2.5f, 0.125f, 65504.0f, -0.0f, 3.0f};
  for (DType t : {DType::kFP16, DType::kBF16, DType::kFP32, DType::kFP8E4M3}) {
    absl::StatusOr<HostTensor> tensor = HostTensor::FromFloats(t, {2, 3}, values);
    if (!tensor.ok()) return 1;
    Write(npy + std::string(DTypeName(t)) + "_2x3.npy", EncodeNpy(*tensor));
  }
  absl::StatusOr<HostTensor> scalar = HostTensor::FromFloats(DType::kFP32, {}, {7.0f});
  if (scalar.ok()) Write(npy + "fp32_scalar.npy", EncodeNpy(*scalar));
  absl::StatusOr<HostTensor> empty = HostTensor::FromFloats(DType::kFP16, {0, 4}, {});
  if (empty.ok()) Write(npy + "fp16_empty.npy", EncodeNpy(*empty));
  // Hand-written headers: NumPy's float64 default, and the u2 BF16 spelling.
  std::string header = "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');  // data 64-aligned
  header += '\n';
  std::string f8 = std::string("\x93NUMPY\x01\x00", 8);
  f8 += static_cast<char>(header.size() & 0xff);
  f8 += static_cast<char>(header.size() >> 8);
  f8 += header;
  const double two[2] = {1.5, -3.0};
  f8.append(reinterpret_cast<const char*>(two), sizeof(two));
  Write(npy + "f8_2.npy", f8);

  for (const auto& [name, bytes] : KserveSeeds()) {
    Write(std::string(argv[1]) + "/kserve_infer_fuzzer/" + name + ".bin", bytes);
  }
  // K/V programs: every byte string is a program (FuzzedDataProvider), so
  // seeds of a few lengths from a fixed generator start the search at
  // caches with several sequences, forks and appends.
  std::mt19937 rng(15);
  for (int len : {48, 96, 160, 256, 400, 640}) {
    std::string program(static_cast<size_t>(len), '\0');
    for (char& c : program) c = static_cast<char>(rng() & 0xff);
    Write(std::string(argv[1]) + "/kv_ops_fuzzer/program_" + std::to_string(len) + ".bin", program);
  }
  return 0;
}
