// Writes the fuzzers' seed corpora (tests/fuzz/corpus/<target>/): small valid
// and invalid ForwardRequests covering every layout and option, and .npy files
// of every dtype the reader takes. The committed files came from this program;
// rerun it after a wire change: make_seeds <corpus dir>.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "common/dtype.h"
#include "client/npy.h"

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
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  using namespace attnserve;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR (holding forward_request_fuzzer/ and npy_fuzzer/)\n");
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
  r.mutable_options()->set_softcap(3e38f);  // issue 15: refused now
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
  return 0;
}
