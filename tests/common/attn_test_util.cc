// Test cases, host buffers and the docs/design.md §4 checker (see the header).
#include "tests/common/attn_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

#include "backend/make_params.h"
#include "backend/reference/tolerance.h"
#include "common/dtype.h"

namespace attnserve {
namespace testing_util {
namespace {

// The constants and why each value: backend/reference/tolerance.h.
using tolerance::kFp32Atol;
using tolerance::kFp32LseAtol;
using tolerance::kFp32Rtol;
using tolerance::kLowpLseFloor;

uint32_t Fnv1a(const std::string& s) {
  uint32_t h = 2166136261u;
  for (unsigned char c : s) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

std::string FloatTag(float x) {
  std::ostringstream os;
  os << x;
  std::string s = os.str();
  std::replace(s.begin(), s.end(), '.', 'p');
  std::replace(s.begin(), s.end(), '-', 'm');
  std::replace(s.begin(), s.end(), '+', 'P');
  return s;
}

std::string JoinInts(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += "_";
    s += std::to_string(v[i]);
  }
  return s;
}

// Fills n elements of `dtype` with normal(0, 1) values rounded to the dtype,
// redrawing any value whose rounded magnitude is below 1e-3 so no input is
// (or rounds to) zero.
void FillRandom(std::vector<uint8_t>* buf, DType dtype, int64_t n, std::mt19937* rng) {
  buf->assign(static_cast<size_t>(n * DTypeSize(dtype)), 0);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    float x;
    do {
      x = RoundTo(dtype, dist(*rng));
    } while (std::fabs(x) < 1e-3f);
    StoreFromFloat(buf->data(), dtype, i, x);
  }
}

// Where flat element `row` (a row of q, 0 <= row < total_q) sits: sequence
// and position within it.
void LocateRow(const AttnParams& p, int64_t row, int* b, int64_t* i) {
  if (IsVarlen(p)) {
    int s = 0;
    while (s + 1 < p.batch && p.cu_seqlens_q[s + 1] <= row) ++s;
    *b = s;
    *i = row - p.cu_seqlens_q[s];
  } else {
    *b = static_cast<int>(row / std::max(1, p.seqlen_q));
    *i = row % std::max(1, p.seqlen_q);
  }
}

std::string OCoord(const AttnParams& p, int64_t idx) {
  const int dv = HeadDimV(p);
  const int64_t row = idx / (int64_t{p.num_heads_q} * dv);
  const int h = static_cast<int>((idx / dv) % p.num_heads_q);
  const int c = static_cast<int>(idx % dv);
  int b;
  int64_t i;
  LocateRow(p, row, &b, &i);
  std::ostringstream os;
  os << "o[b=" << b << ", i=" << i << ", h=" << h << ", d=" << c << "] (flat " << idx << ")";
  return os.str();
}

std::string LseCoord(const AttnParams& p, int64_t idx) {
  int b, h;
  int64_t i;
  if (IsVarlen(p)) {
    h = static_cast<int>(idx / std::max<int64_t>(1, p.total_q));
    LocateRow(p, idx % std::max<int64_t>(1, p.total_q), &b, &i);
  } else {
    const int64_t sq = std::max(1, p.seqlen_q);
    i = idx % sq;
    h = static_cast<int>((idx / sq) % p.num_heads_q);
    b = static_cast<int>(idx / (sq * p.num_heads_q));
  }
  std::ostringstream os;
  os << "lse[b=" << b << ", h=" << h << ", i=" << i << "] (flat " << idx << ")";
  return os.str();
}

std::string CheckO(const HostBuffers& buf, const void* o) {
  const AttnParams& p = buf.params();
  const int64_t n = buf.o_elements();
  if (n == 0) return "";
  const ReferenceOutput& ref = buf.Reference();
  const bool lowp = p.dtype != DType::kFP32;
  const DType o_dtype = OutputDType(p.dtype);  // BF16 for FP8 inputs
  // Low precision: docs/design.md §4, max|out - ref| <= 2 * max|ref_lowp - ref| + floor
  // (FP8: + tolerance::Fp8PBound, the E4M3 rounding of P).
  double lowp_err = 0.0;
  if (lowp) {
    const ReferenceOutput& rl = buf.ReferenceLowPrecision();
    for (int64_t i = 0; i < n; ++i) lowp_err = std::max(lowp_err, std::fabs(rl.o[i] - ref.o[i]));
  }
  const double o_floor = OutputFloor(p.dtype) + tolerance::Fp8PTerm(p);
  // FP32: each element's allowance scales with the largest |ref| of its vector.
  const int d = HeadDimV(p);
  std::vector<double> vec_scale(static_cast<size_t>(n / d), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    vec_scale[i / d] = std::max(vec_scale[i / d], std::fabs(ref.o[i]));
  }
  double worst_excess = -1.0;  // err / allowed, worst element
  int64_t worst = -1;
  double max_err = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float out = LoadAsFloat(o, o_dtype, i);
    if (!std::isfinite(out)) {
      std::ostringstream os;
      os << OCoord(p, i) << " = " << out
         << (std::isnan(out) ? ": NaN (poison left: element never written)" : ": not finite")
         << ", reference " << ref.o[i];
      return os.str();
    }
    const double err = std::fabs(out - ref.o[i]);
    max_err = std::max(max_err, err);
    const double allowed =
        lowp ? 2.0 * lowp_err + o_floor : kFp32Rtol * vec_scale[i / d] + kFp32Atol;
    if (err / allowed > worst_excess) {
      worst_excess = err / allowed;
      worst = i;
    }
  }
  if (worst_excess <= 1.0) return "";
  std::ostringstream os;
  os.precision(9);
  os << OCoord(p, worst) << " = " << LoadAsFloat(o, o_dtype, worst) << ", reference "
     << ref.o[worst] << ", |err| " << std::fabs(LoadAsFloat(o, o_dtype, worst) - ref.o[worst]);
  if (lowp) {
    os << " (max |err| " << max_err << ") > allowed 2 * " << lowp_err << " + " << o_floor << " = "
       << 2.0 * lowp_err + o_floor;
  } else {
    os << " > allowed " << kFp32Rtol << " * max|ref of the vector| (" << vec_scale[worst / d]
       << ") + " << kFp32Atol << " (x" << worst_excess << ")";
  }
  return os.str();
}

std::string CheckLse(const HostBuffers& buf, const float* lse) {
  const AttnParams& p = buf.params();
  const int64_t n = buf.lse_elements();
  if (n == 0) return "";
  if (lse == nullptr) return "lse: expected an LSE buffer (return_lse is set), got null";
  const ReferenceOutput& ref = buf.Reference();
  const bool lowp = p.dtype != DType::kFP32;
  double lowp_err = 0.0;
  if (lowp) {
    const ReferenceOutput& rl = buf.ReferenceLowPrecision();
    for (int64_t i = 0; i < n; ++i) {
      if (std::isfinite(ref.lse[i]))
        lowp_err = std::max(lowp_err, std::fabs(rl.lse[i] - ref.lse[i]));
    }
  }
  const double lowp_allowed = 2.0 * lowp_err + kLowpLseFloor;
  double worst_excess = -1.0;
  int64_t worst = -1;
  for (int64_t i = 0; i < n; ++i) {
    const float out = lse[i];
    const double r = ref.lse[i];
    std::ostringstream os;
    if (std::isnan(out)) {
      os << LseCoord(p, i) << " = NaN (poison left: element never written), reference " << r;
      return os.str();
    }
    if (std::isinf(r)) {  // a row that sees no key: exactly -inf
      if (!(std::isinf(out) && out < 0)) {
        os << LseCoord(p, i) << " = " << out << ", expected -inf (the row sees no key)";
        return os.str();
      }
      continue;
    }
    if (!std::isfinite(out)) {
      os << LseCoord(p, i) << " = " << out << ", expected finite reference " << r;
      return os.str();
    }
    const double err = std::fabs(out - r);
    const double allowed = lowp ? lowp_allowed : kFp32Rtol * std::fabs(r) + kFp32LseAtol;
    if (err / allowed > worst_excess) {
      worst_excess = err / allowed;
      worst = i;
    }
  }
  if (worst_excess <= 1.0) return "";
  std::ostringstream os;
  os.precision(9);
  const double r = ref.lse[worst];
  os << LseCoord(p, worst) << " = " << lse[worst] << ", reference " << r << ", |err| "
     << std::fabs(lse[worst] - r) << " > allowed "
     << (lowp ? lowp_allowed : kFp32Rtol * std::fabs(r) + kFp32LseAtol);
  return os.str();
}

// A dense case of these sizes, every other field at its default.
TestCase DenseCase(int b, int sq, int sk, int hq, int hkv, int d) {
  TestCase tc;
  tc.batch = b;
  tc.seqlen_q = sq;
  tc.seqlen_k = sk;
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  tc.head_dim = d;
  return tc;
}

}  // namespace

double OutputFloor(DType t) { return tolerance::OutputFloor(t); }

std::string TestCase::Name() const {
  std::string s;
  switch (dtype) {
    case DType::kFP16: s = "fp16"; break;
    case DType::kBF16: s = "bf16"; break;
    case DType::kFP32: s = "fp32"; break;
    case DType::kFP8E4M3: s = "fp8"; break;
  }
  if (varlen()) {
    s += "_varlen_q" + JoinInts(seqlens_q) + "_k" + JoinInts(seqlens_k);
  } else {
    s += "_b" + std::to_string(batch) + "_q" + std::to_string(seqlen_q) + "_k" +
         std::to_string(seqlen_k);
  }
  s += "_h" + std::to_string(num_heads_q) + "x" + std::to_string(num_heads_kv);
  s += "_d" + std::to_string(head_dim);
  if (head_dim_v != 0) s += "_dv" + std::to_string(head_dim_v);
  if (causal) s += "_causal";
  if (window_left != kNoWindow) s += "_wl" + std::to_string(window_left);
  if (window_right != kNoWindow) s += "_wr" + std::to_string(window_right);
  if (softcap != 0.0f) s += "_cap" + FloatTag(softcap);
  if (softmax_scale != 0.0f) s += "_scale" + FloatTag(softmax_scale);
  if (q_descale != 1.0f || k_descale != 1.0f || v_descale != 1.0f) {
    s += "_dq" + FloatTag(q_descale) + "_dk" + FloatTag(k_descale) + "_dv" + FloatTag(v_descale);
  }
  s += mods.Tag();
  s += return_lse ? "_lse" : "_nolse";
  if (seed != 0) s += "_seed" + std::to_string(seed);
  return s;
}

HostBuffers::HostBuffers(const TestCase& tc) : tc_(tc) {
  AttnShape shape;
  shape.dtype = tc.dtype;
  shape.num_heads_q = tc.num_heads_q;
  shape.num_heads_kv = tc.num_heads_kv;
  shape.head_dim = tc.head_dim;
  shape.head_dim_v = tc.head_dim_v;
  if (tc.varlen()) {
    shape.batch = static_cast<int32_t>(tc.seqlens_q.size());
    cu_q_.assign(1, 0);
    cu_k_.assign(1, 0);
    for (size_t b = 0; b < tc.seqlens_q.size(); ++b) {
      cu_q_.push_back(cu_q_.back() + tc.seqlens_q[b]);
      cu_k_.push_back(cu_k_.back() + (b < tc.seqlens_k.size() ? tc.seqlens_k[b] : 0));
    }
    shape.cu_seqlens_q = cu_q_.data();
    shape.cu_seqlens_k = cu_k_.data();
  } else {
    shape.batch = tc.batch;
    shape.seqlen_q = tc.seqlen_q;
    shape.seqlen_k = tc.seqlen_k;
  }
  AttnOptions options;
  if (tc.softmax_scale != 0.0f) options.softmax_scale = tc.softmax_scale;
  options.causal = tc.causal;
  if (tc.window_left != kNoWindow) options.window_left = tc.window_left;
  if (tc.window_right != kNoWindow) options.window_right = tc.window_right;
  options.softcap = tc.softcap;
  if (tc.dtype == DType::kFP8E4M3) {
    options.q_descale = tc.q_descale;
    options.k_descale = tc.k_descale;
    options.v_descale = tc.v_descale;
  }
  // Pointers are set below, once the buffers are filled.
  params_ = MakeAttnParams(shape, options, AttnPointers());
  AttnParams& p = params_;

  std::mt19937 rng(tc.seed != 0 ? tc.seed : Fnv1a(tc.Name()));
  FillRandom(&q_, tc.dtype, p.total_q * p.num_heads_q * p.head_dim, &rng);
  FillRandom(&k_, tc.dtype, p.total_k * p.num_heads_kv * p.head_dim, &rng);
  FillRandom(&v_, tc.dtype, p.total_k * p.num_heads_kv * HeadDimV(p), &rng);
  if (tc.mods.any()) {
    mods_ = std::make_unique<HostMods>(tc.mods, p, static_cast<uint32_t>(rng()));
    mods_->ApplyTo(&p);
  }
  o_.assign(static_cast<size_t>(p.total_q * p.num_heads_q * HeadDimV(p) *
                                DTypeSize(OutputDType(tc.dtype))),
            0);
  lse_.assign(static_cast<size_t>(p.total_q * p.num_heads_q), 0.0f);
  Poison();
  p.q = q_.data();
  p.k = k_.data();
  p.v = v_.data();
  p.o = o_.data();
  p.lse = lse();
}

int64_t HostBuffers::o_elements() const {
  return params_.total_q * params_.num_heads_q * HeadDimV(params_);
}

int64_t HostBuffers::lse_elements() const {
  return tc_.return_lse ? params_.total_q * params_.num_heads_q : 0;
}

void HostBuffers::Poison() {
  // All-ones is a NaN in FP16 (exp 0x1f, man != 0), BF16 and FP32 alike.
  if (!o_.empty()) std::memset(o_.data(), 0xff, o_.size());
  if (!lse_.empty())
    std::memset(static_cast<void*>(lse_.data()), 0xff, lse_.size() * sizeof(float));
}

const ReferenceOutput& HostBuffers::Reference() const {
  if (!ref_) ref_ = std::make_unique<ReferenceOutput>(ReferenceAttention(params_));
  return *ref_;
}

const ReferenceOutput& HostBuffers::ReferenceLowPrecision() const {
  if (!ref_lowp_) {
    ref_lowp_ = std::make_unique<ReferenceOutput>(ReferenceAttentionLowPrecision(params_));
  }
  return *ref_lowp_;
}

std::string CheckOutputError(const HostBuffers& buf, const void* o, const float* lse) {
  std::string err = CheckO(buf, o);
  if (!err.empty()) return buf.test_case().Name() + ": " + err;
  err = CheckLse(buf, lse);
  if (!err.empty()) return buf.test_case().Name() + ": " + err;
  return "";
}

::testing::AssertionResult CheckOutput(const HostBuffers& buf, const void* o, const float* lse) {
  const std::string err = CheckOutputError(buf, o, lse);
  if (err.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << err;
}

::testing::AssertionResult CheckOutput(const HostBuffers& buf) {
  return CheckOutput(buf, buf.o(), buf.lse());
}

std::vector<TestCase> StandardGrid() {
  std::vector<TestCase> shapes;
  auto add = [&shapes](int b, int sq, int sk, int hq, int hkv, int d) -> TestCase& {
    shapes.push_back(DenseCase(b, sq, sk, hq, hkv, d));
    return shapes.back();
  };
  // Awkward sizes: 1, 17, 97, 1025 (one past a power of two, so every tile
  // loop has a ragged last block).
  add(1, 1, 1, 1, 1, 64);
  add(2, 17, 17, 2, 2, 64);
  add(1, 97, 97, 4, 1, 64).causal = true;  // GQA 4:1
  add(1, 1025, 1025, 1, 1, 64);
  add(1, 1025, 1025, 2, 1, 64).causal = true;
  // Sq != Sk both ways; with causal, Sq > Sk leaves the first Sq - Sk rows
  // fully masked (O = 0, LSE = -inf).
  add(1, 17, 97, 2, 2, 64);
  add(1, 17, 97, 2, 2, 64).causal = true;
  add(2, 97, 17, 2, 1, 64);
  add(2, 97, 17, 2, 1, 64).causal = true;
  add(1, 33, 65, 8, 1, 64);                  // MQA
  add(2, 1, 1025, 8, 2, 128).causal = true;  // decode shape, GQA
  {
    TestCase& tc = add(1, 1025, 1025, 2, 1, 128);  // long sliding window: skipped tiles
    tc.causal = true;
    tc.window_left = 300;
  }
  // Windows: left only, right only, both, with causal.
  add(1, 97, 97, 2, 1, 64).window_left = 8;
  add(1, 97, 97, 2, 1, 64).window_right = 4;
  {
    TestCase& tc = add(1, 97, 130, 2, 2, 64);
    tc.window_left = 16;
    tc.window_right = 3;
  }
  {
    TestCase& tc = add(1, 130, 97, 2, 2, 64);
    tc.causal = true;
    tc.window_left = 10;
  }
  {
    TestCase& tc = add(1, 97, 97, 2, 2, 64);
    tc.window_left = 0;  // each row sees only its diagonal key
    tc.window_right = 0;
  }
  // Softcap (small, so tanh bends the scores), custom scale, both.
  add(1, 97, 97, 2, 1, 64).softcap = 2.0f;
  {
    TestCase& tc = add(1, 65, 80, 2, 2, 64);
    tc.causal = true;
    tc.softcap = 30.0f;
  }
  add(1, 65, 65, 2, 2, 64).softmax_scale = 0.5f;
  {
    TestCase& tc = add(1, 65, 65, 2, 2, 64);
    tc.softmax_scale = 0.03f;
    tc.softcap = 1.0f;
  }
  // Head dims.
  for (int d : {8, 72, 128, 256}) add(1, 33, 47, 2, 1, d);
  add(1, 33, 47, 2, 1, 256).causal = true;
  // Varlen with zero-length sequences (a zero-length q, a zero-length k with
  // queries: fully masked rows), causal and not.
  for (bool causal : {false, true}) {
    TestCase tc;
    tc.seqlens_q = {5, 0, 17, 64, 3};
    tc.seqlens_k = {9, 0, 3, 70, 0};
    tc.num_heads_q = 4;
    tc.num_heads_kv = 2;
    tc.causal = causal;
    shapes.push_back(tc);
  }
  {
    TestCase tc;  // a long sequence beside empty and short ones
    tc.seqlens_q = {1025, 0, 7};
    tc.seqlens_k = {1100, 5, 0};
    tc.num_heads_q = 4;
    tc.num_heads_kv = 1;
    tc.causal = true;
    shapes.push_back(tc);
  }
  {
    TestCase tc;
    tc.seqlens_q = {0, 0};
    tc.seqlens_k = {0, 4};
    tc.num_heads_q = 2;
    tc.num_heads_kv = 1;
    shapes.push_back(tc);
  }
  // Empty: B = 0; Sk = 0 (every row fully masked); Sq = 0.
  add(0, 17, 17, 2, 1, 64);
  add(2, 7, 0, 2, 1, 64);
  add(2, 0, 7, 2, 1, 64);
  // Without LSE.
  add(1, 97, 97, 2, 1, 64).return_lse = false;

  std::vector<TestCase> grid;
  for (DType t : {DType::kFP32, DType::kFP16, DType::kBF16}) {
    for (TestCase tc : shapes) {
      tc.dtype = t;
      grid.push_back(tc);
    }
  }
  return grid;
}

std::vector<TestCase> Fp8Grid() {
  std::vector<TestCase> grid;
  auto add = [&grid](int b, int sq, int sk, int hq, int hkv, int d, float dq, float dk,
                     float dv) -> TestCase& {
    TestCase tc = DenseCase(b, sq, sk, hq, hkv, d);
    tc.dtype = DType::kFP8E4M3;
    tc.q_descale = dq;
    tc.k_descale = dk;
    tc.v_descale = dv;
    grid.push_back(tc);
    return grid.back();
  };
  add(1, 1, 1, 1, 1, 64, 1.0f, 1.0f, 1.0f);
  add(2, 17, 17, 2, 2, 64, 0.5f, 2.0f, 0.25f);
  add(1, 97, 97, 4, 1, 64, 0.037f, 1.7f, 3.3f).causal = true;  // GQA 4:1
  add(1, 17, 97, 2, 2, 64, 1.0f, 0.1f, 10.0f).causal = true;
  add(2, 97, 17, 2, 1, 64, 0.75f, 0.75f, 0.02f).causal = true;  // fully masked rows
  add(1, 33, 65, 8, 1, 64, 0.3f, 0.3f, 1.0f);                   // MQA
  add(2, 1, 1025, 8, 2, 128, 0.05f, 0.2f, 0.6f).causal = true;  // decode shape
  add(1, 1025, 1025, 2, 1, 128, 0.09f, 0.11f, 1.3f).causal = true;
  add(1, 97, 97, 2, 1, 64, 1.0f, 1.0f, 1.0f).window_left = 8;
  {
    TestCase& tc = add(1, 97, 130, 2, 2, 64, 0.6f, 0.5f, 2.0f);
    tc.window_left = 16;
    tc.window_right = 3;
  }
  add(1, 97, 97, 2, 1, 64, 0.8f, 1.25f, 1.0f).softcap = 2.0f;
  add(1, 65, 65, 2, 2, 64, 1.0f, 1.0f, 0.5f).softmax_scale = 0.03f;
  add(1, 33, 47, 2, 1, 256, 0.125f, 0.0625f, 4.0f).causal = true;
  add(1, 97, 97, 2, 1, 64, 1.0f, 1.0f, 1.0f).return_lse = false;
  {
    TestCase tc;  // varlen with zero-length sequences
    tc.dtype = DType::kFP8E4M3;
    tc.seqlens_q = {5, 0, 17, 64, 3};
    tc.seqlens_k = {9, 0, 3, 70, 0};
    tc.num_heads_q = 4;
    tc.num_heads_kv = 2;
    tc.causal = true;
    tc.q_descale = 0.4f;
    tc.k_descale = 0.9f;
    tc.v_descale = 1.5f;
    grid.push_back(tc);
  }
  add(0, 17, 17, 2, 1, 64, 1.0f, 1.0f, 1.0f);  // B = 0
  add(2, 7, 0, 2, 1, 64, 2.0f, 2.0f, 2.0f);    // Sk = 0: every row masked
  return grid;
}

}  // namespace testing_util
}  // namespace attnserve
