// FP8 prefill with P V on FP8 wgmma (Plan::fp8_pv): V^T's layout and key
// permutation (backend/cuda/fp8_vt_layout.h) against a host model, the
// transpose pass against that model (every byte, gaps included), FP8 calls
// whose rows are dominated by a few keys (where pairing P with the wrong V
// rows shows) through the backend against the float64 reference with the FP8
// rule (tolerance.h), and the same call with V^T's keys left unpermuted,
// which must fail that check; rows of a few top keys among many whose
// weights round to E4M3 zero, over V constant along the keys, where O must
// come out as V's row (the normalisation sums the weights O summed); and the
// polynomial exp2 over every kind of input (host). Without a GPU the device
// tests GTEST_SKIP.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/fp8_dequant.h"
#include "backend/cuda/fp8_vt_layout.h"
#include "backend/cuda/hopper/sm90_exp2_poly.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;

// The permutation against the two fragment layouts it joins (no GPU): in a
// k32 step, thread q (lane % 4) of a row holds S values e = 0..7 in register
// order (n8 tile e / 2, element e % 2), i.e. key 8 (e / 2) + 2 q + e % 2;
// ConvertPE4m3 packs them in that order into A bytes e, which FP8 wgmma
// reads as k = 16 (e / 4) + 4 q + e % 4. V^T's column k must hold that key.
TEST(Fp8PvLayout, KeyPermutationMatchesTheFragments) {
  std::vector<int> hits(cuda::kFp8VtGroup, 0);
  for (int q = 0; q < 4; ++q) {
    for (int e = 0; e < 8; ++e) {
      const int key = 8 * (e / 2) + 2 * q + e % 2;
      const int k = 16 * (e / 4) + 4 * q + e % 4;
      EXPECT_EQ(cuda::Fp8VtKeyAt(k), key) << "thread q " << q << ", value " << e;
      ++hits[k];
    }
  }
  std::vector<int> keys(cuda::kFp8VtGroup, 0);
  for (int c = 0; c < cuda::kFp8VtGroup; ++c) {
    EXPECT_EQ(hits[c], 1) << "column " << c;
    ++keys[cuda::Fp8VtKeyAt(c)];
  }
  for (int k = 0; k < cuda::kFp8VtGroup; ++k) EXPECT_EQ(keys[k], 1) << "key " << k;
}

// Exp2Poly (the FP8 P V softmax's polynomial exp2) is a finite positive
// number for every argument (NaN included), within 2^-11.5 of 2^x on [-126,
// 127], and 2^-126 / 2^127 past the ends; the version before the clamp's
// upper end gave NaN from x = 127.5 up (j overflowing the exponent field) and
// at +inf.
TEST(Fp8PvExp2Poly, FiniteAndAccurateEverywhere) {
  using cuda::sm90::Exp2Poly;
  const float lo = std::ldexp(1.0f, -126), hi = std::ldexp(1.0f, 127);
  auto check = [&](float x) {
    const float r = Exp2Poly(x);
    ASSERT_TRUE(std::isfinite(r) && r > 0.f) << "x = " << x << " gives " << r;
    // NaN: 2^-126 on the GPU (its min / max drop a NaN operand); the host's
    // fmaxf keeps a signalling one, and fminf then gives 127.
    if (std::isnan(x)) return;
    if (x < -126.f) {
      ASSERT_EQ(r, lo) << "x = " << x;
    } else if (x > 127.f) {
      ASSERT_EQ(r, hi) << "x = " << x;
    } else {
      const double rel = std::fabs(r / std::exp2(static_cast<double>(x)) - 1.0);
      ASSERT_LE(rel, std::ldexp(1.0, -11) * 0.71) << "x = " << x;  // 2^-11.5
    }
  };
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {-inf, inf, std::numeric_limits<float>::quiet_NaN(), 0.f, -0.f,
                  std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), 127.4f, 127.5f, 127.99f, 128.f, 129.f,
                  1e9f, -126.f, -126.5f, -127.f, -1e9f}) {
    check(x);
  }
  // Every half-integer boundary of the rounding to j, and its neighbours.
  for (int i = -300; i <= 300; ++i) {
    const float b = 0.5f * static_cast<float>(i);
    check(b);
    check(std::nextafter(b, -inf));
    check(std::nextafter(b, inf));
  }
  // A stride through all 2^32 bit patterns (every sign, exponent and NaN).
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 997) {
    const uint32_t bits = static_cast<uint32_t>(u);
    float x;
    std::memcpy(&x, &bits, sizeof(x));
    check(x);
  }
  // Densely over the range the kernel uses (arguments <= 8 + rounding).
  for (float x = -140.f; x <= 10.f; x += 1.f / 1024) check(x);
}

bool HaveGpu(std::string* why) { return testing_util::SharedCudaBackend(why) != nullptr; }

// Device memory freed on scope exit.
class DeviceMem {
 public:
  explicit DeviceMem(size_t bytes) {
    if (cudaMalloc(&p_, bytes > 0 ? bytes : 1) != cudaSuccess) p_ = nullptr;
  }
  ~DeviceMem() { cudaFree(p_); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

// A case's inputs copied to the device, and its outputs copied back.
class DeviceCall {
 public:
  explicit DeviceCall(const HostBuffers& buf)
      : q_(buf.q_bytes()),
        k_(buf.kv_bytes()),
        v_(buf.v_bytes()),
        o_(buf.o_bytes()),
        lse_(buf.lse_elements() * sizeof(float)),
        cu_q_((buf.params().batch + 1) * sizeof(int32_t)),
        cu_k_((buf.params().batch + 1) * sizeof(int32_t)) {
    dev = buf.params();
    Copy(q_.get(), buf.q(), buf.q_bytes());
    Copy(k_.get(), buf.k(), buf.kv_bytes());
    Copy(v_.get(), buf.v(), buf.v_bytes());
    dev.q = q_.get();
    dev.k = k_.get();
    dev.v = v_.get();
    dev.o = o_.get();
    dev.lse = buf.lse() != nullptr ? static_cast<float*>(lse_.get()) : nullptr;
    if (buf.cu_seqlens_q() != nullptr) {
      const size_t n = (dev.batch + 1) * sizeof(int32_t);
      Copy(cu_q_.get(), buf.cu_seqlens_q(), n);
      Copy(cu_k_.get(), buf.cu_seqlens_k(), n);
      dev.cu_seqlens_q = static_cast<int32_t*>(cu_q_.get());
      dev.cu_seqlens_k = static_cast<int32_t*>(cu_k_.get());
    }
  }
  // O and LSE into the host buffers (after the launch's stream is synchronised).
  bool Download(HostBuffers* buf) const {
    return cudaMemcpy(buf->o(), o_.get(), buf->o_bytes(), cudaMemcpyDeviceToHost) == cudaSuccess &&
           (buf->lse() == nullptr ||
            cudaMemcpy(buf->lse(), lse_.get(), buf->lse_elements() * sizeof(float),
                       cudaMemcpyDeviceToHost) == cudaSuccess);
  }
  AttnParams dev;

 private:
  void Copy(void* dst, const void* src, int64_t bytes) {
    if (bytes > 0) ok_ = ok_ && cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  DeviceMem q_, k_, v_, o_, lse_, cu_q_, cu_k_;
  bool ok_ = true;
};

// V^T of host params `p` (FP8 codes at p.v), built from fp8_vt_layout.h's
// statement the other way round from the pass: key j of sequence b goes to
// column VtSeqStart + its group's start + the column whose key it is.
std::vector<uint8_t> VtModel(const AttnParams& p) {
  const int64_t w = cuda::VtWidth(p);
  const int d = p.head_dim;
  std::vector<uint8_t> vt(static_cast<size_t>(cuda::VtBytes(p)), 0);
  int column_of[cuda::kFp8VtGroup];
  for (int c = 0; c < cuda::kFp8VtGroup; ++c) column_of[cuda::Fp8VtKeyAt(c)] = c;
  const uint8_t* v = static_cast<const uint8_t*>(p.v);
  for (int b = 0; b < p.batch; ++b) {
    for (int j = 0; j < SeqLenK(p, b); ++j) {
      const int64_t col = cuda::VtSeqStart(p, b) + j / cuda::kFp8VtGroup * cuda::kFp8VtGroup +
                          column_of[j % cuda::kFp8VtGroup];
      for (int hk = 0; hk < p.num_heads_kv; ++hk) {
        for (int c = 0; c < d; ++c) {
          vt[static_cast<size_t>((int64_t{hk} * d + c) * w + col)] =
              v[VOffset(p, SeqStartK(p, b) + j, hk) + c];
        }
      }
    }
  }
  return vt;
}

TestCase Fp8Case(int b, int sq, int sk, int hq, int hkv, int d, bool causal, float scale) {
  TestCase tc;
  tc.dtype = DType::kFP8E4M3;
  tc.batch = b;
  tc.seqlen_q = sq;
  tc.seqlen_k = sk;
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  tc.head_dim = d;
  tc.causal = causal;
  tc.softmax_scale = scale;
  tc.q_descale = 1.0f;
  tc.k_descale = 1.0f;
  tc.v_descale = 0.75f;
  return tc;
}

TestCase VarlenFp8Case(std::vector<int> sq, std::vector<int> sk, int hq, int hkv, int d,
                       bool causal, float scale) {
  TestCase tc = Fp8Case(1, 1, 1, hq, hkv, d, causal, scale);
  tc.seqlens_q = std::move(sq);
  tc.seqlens_k = std::move(sk);
  return tc;
}

// The pass's V^T, every byte (the scratch poisoned first), against VtModel:
// dense and varlen (an empty sequence, lengths off the 32-key groups),
// head dims 64, 128 and 256, GQA.
TEST(CudaFp8Pv, TransposeMatchesTheLayout) {
  std::string why;
  if (!HaveGpu(&why)) GTEST_SKIP() << "no usable CUDA device: " << why;
  for (const TestCase& tc :
       {VarlenFp8Case({70, 0, 300, 33}, {70, 0, 300, 33}, 4, 2, 128, true, 0),
        Fp8Case(2, 100, 100, 2, 1, 64, false, 0), Fp8Case(1, 1, 1, 2, 2, 256, false, 0),
        Fp8Case(3, 17, 129, 4, 2, 128, false, 0)}) {
    HostBuffers buf(tc);
    DeviceCall call(buf);
    const int64_t bytes = cuda::Fp8ScratchBytes(call.dev, true, true);
    ASSERT_GE(bytes, cuda::VtBytes(call.dev));
    DeviceMem scratch(bytes);
    ASSERT_NE(scratch.get(), nullptr);
    ASSERT_EQ(cudaMemset(scratch.get(), 0xff, bytes), cudaSuccess);  // E4M3 NaN codes
    AttnParams run;
    ASSERT_EQ(cuda::DequantiseFp8(call.dev, true, true, scratch.get(), nullptr, &run), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(run.v, scratch.get());
    EXPECT_EQ(run.v_descale, call.dev.v_descale);
    EXPECT_EQ(run.dtype, DType::kBF16);
    std::vector<uint8_t> got(static_cast<size_t>(cuda::VtBytes(call.dev)));
    ASSERT_EQ(cudaMemcpy(got.data(), scratch.get(), got.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    // Every sequence's first column is 16-byte aligned (TMA boxes start
    // there; an unaligned start is an illegal instruction).
    for (int b = 0; b <= call.dev.batch; ++b) {
      EXPECT_EQ(cuda::VtSeqStart(buf.params(), b) % 16, 0) << tc.Name() << " sequence " << b;
    }
    const std::vector<uint8_t> want = VtModel(buf.params());
    const int64_t w = cuda::VtWidth(call.dev);
    int64_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (got[i] != want[i] && bad++ < 5) {
        ADD_FAILURE() << tc.Name() << ": V^T row " << static_cast<int64_t>(i) / w << " column "
                      << static_cast<int64_t>(i) % w << " = " << int{got[i]} << ", expected "
                      << int{want[i]};
      }
    }
    EXPECT_EQ(bad, 0) << tc.Name();
  }
}

// Rows dominated by a few keys (q . k of N(0, 1) codes over D dims, times
// the scale below: standard deviations of 3 to 6), so O is close to a few V
// rows and a P weight paired with the wrong key's V moves it by a whole
// |v_a - v_b|, far past the FP8 rule. Dense and varlen, causal or not, GQA,
// key counts off the 32-key groups and the 128-key tiles.
std::vector<TestCase> SharpCases() {
  return {
      Fp8Case(2, 300, 300, 4, 2, 128, false, 0.5f),
      Fp8Case(1, 1000, 1000, 8, 2, 128, true, 0.3f),
      Fp8Case(2, 129, 513, 2, 2, 128, false, 0.5f),
      Fp8Case(1, 200, 333, 4, 1, 64, true, 0.7f),
      Fp8Case(1, 150, 257, 2, 1, 256, false, 0.35f),
      VarlenFp8Case({130, 7, 400}, {130, 7, 513}, 4, 2, 128, true, 0.5f),
      VarlenFp8Case({1, 64, 0, 100}, {33, 64, 5, 290}, 2, 2, 128, false, 0.5f),
  };
}

class CudaFp8PvSharp : public ::testing::TestWithParam<TestCase> {};

TEST_P(CudaFp8PvSharp, PassesTheFp8Rule) {
  std::string why;
  AttentionBackend* backend = testing_util::SharedCudaBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  HostBuffers buf(GetParam());
  const absl::StatusOr<Plan> plan = backend->CanImplement(buf.params());
  if (plan.status().code() == absl::StatusCode::kUnimplemented) {
    GTEST_SKIP() << plan.status().message();  // a head dim this build has no kernel for
  }
  ASSERT_TRUE(plan.ok()) << plan.status();
  // On an sm90 GPU the Hopper kernel's FP8 P V runs every case here whose
  // head dim this build compiled for it and the planner gives it to.
  if (cuda::DeviceRunsSm90Kernels(0) && plan->kernel_family == KernelFamily::kSm90 &&
      cuda::Fp8PvPlannedAt(GetParam().head_dim)) {
    EXPECT_TRUE(plan->fp8_pv) << GetParam().Name();
  }
  // Twice as planned, then with Plan::fp8_poly_exp2 flipped (both exp2 forms
  // of the FP8 P V's softmax), then with Plan::fp8_extra_stage flipped too.
  for (int run = 0; run < (plan->fp8_pv ? 4 : 2); ++run) {
    Plan use = *plan;
    if (run >= 2) use.fp8_poly_exp2 = !plan->fp8_poly_exp2;
    if (run == 3) use.fp8_extra_stage = !plan->fp8_extra_stage;
    buf.Poison();
    BackendTimings t;
    const absl::Status st = backend->Forward(use, buf.params(), &t);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(CheckOutput(buf)) << GetParam().Name() << " run " << run << " poly_exp2 "
                                  << use.fp8_poly_exp2 << " extra_stage " << use.fp8_extra_stage;
  }
}

INSTANTIATE_TEST_SUITE_P(Fp8Pv, CudaFp8PvSharp, ::testing::ValuesIn(SharpCases()),
                         [](const ::testing::TestParamInfo<TestCase>& info) {
                           return info.param.Name() + "_" + std::to_string(info.index);
                         });

// A row sum that O does not share shows: two top keys (the first and last,
// so whichever end the kernel scans first holds one) and Sk - 2 keys whose
// weight is 2^-18.05 of theirs, so that FP8 P (scaled by 2^8) rounds each to
// an E4M3 zero, over V rows equal along the keys. O must be V's row: the
// normalisation has to sum the weights O summed. Summing the unrounded ones
// (the kernel before) divides by 2 + 16382 x 2^-18.05 instead of 2, 2.9%
// low, which the FP8 rule's n 2^-17 term would admit at 16k keys; here
// |O - v| must stay within 2^-8 |v| (O's BF16 rounding, 2^-9). Every head
// dim the plan gives FP8 P V, both exp2 forms, the extra stage.
TEST(CudaFp8Pv, FlushedWeightsLeaveTheRowSum) {
  std::string why;
  AttentionBackend* backend = testing_util::SharedCudaBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  constexpr int kSk = 16384;
  // s_top - s_tiny = (2 - 1) x 1 x scale; times log2(e): 18.05.
  const float scale = static_cast<float>(18.05 / std::log2(std::exp(1.0)));
  for (int d : {64, 128, 256}) {
    TestCase tc = Fp8Case(1, 64, kSk, 1, 1, d, false, scale);
    HostBuffers buf(tc);
    const AttnParams& p = buf.params();
    // Q: code 1.0 in column 0 of every row, 0 elsewhere (E4M3 0x38 is 1.0,
    // 0x40 2.0, 0x00 0). Q's buffer has no mutable accessor: the test owns
    // the HostBuffers, whose params point at it.
    uint8_t* q = static_cast<uint8_t*>(const_cast<void*>(buf.q()));
    std::memset(q, 0, static_cast<size_t>(buf.q_bytes()));
    for (int64_t r = 0; r < p.total_q * p.num_heads_q; ++r) q[r * d] = 0x38;
    // K: column 0 is 2.0 for the top keys, 1.0 for the rest; 0 elsewhere.
    uint8_t* k = static_cast<uint8_t*>(buf.k());
    std::memset(k, 0, static_cast<size_t>(buf.kv_bytes()));
    for (int j = 0; j < kSk; ++j) k[int64_t{j} * d] = j == 0 || j == kSk - 1 ? 0x40 : 0x38;
    // V: row c of every key is code (c % 7 + 1) / 4 x (-1)^c (0.25 .. 1.75).
    uint8_t* v = static_cast<uint8_t*>(buf.v());
    const uint8_t codes[7] = {0x28, 0x30, 0x34, 0x38, 0x3a, 0x3c, 0x3e};
    for (int j = 0; j < kSk; ++j) {
      for (int c = 0; c < d; ++c) v[int64_t{j} * d + c] = codes[c % 7] | (c % 2 ? 0x80 : 0);
    }
    const absl::StatusOr<Plan> plan = backend->CanImplement(p);
    if (plan.status().code() == absl::StatusCode::kUnimplemented) continue;
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int run = 0; run < (plan->fp8_pv ? 3 : 1); ++run) {
      Plan use = *plan;
      if (run >= 1) use.fp8_poly_exp2 = !plan->fp8_poly_exp2;
      if (run == 2) use.fp8_extra_stage = !plan->fp8_extra_stage;
      buf.Poison();
      BackendTimings t;
      const absl::Status st = backend->Forward(use, p, &t);
      ASSERT_TRUE(st.ok()) << st;
      const std::string what = "d " + std::to_string(d) + " fp8_pv " + std::to_string(use.fp8_pv) +
                               " poly_exp2 " + std::to_string(use.fp8_poly_exp2) + " extra_stage " +
                               std::to_string(use.fp8_extra_stage);
      const uint16_t* o = static_cast<const uint16_t*>(buf.o());  // BF16
      double worst = 0.0;
      for (int64_t i = 0; i < buf.o_elements(); ++i) {
        const int c = static_cast<int>(i % d);
        const double want = (c % 2 ? -1.0 : 1.0) * (c % 7 + 1) / 4.0 * p.v_descale;
        const uint32_t bits = uint32_t{o[i]} << 16;
        float got;
        std::memcpy(&got, &bits, sizeof(got));
        worst = std::max(worst, std::fabs(got - want) / std::fabs(want));
      }
      EXPECT_LE(worst, 1.0 / 256) << what << ": O is off V's row by this fraction of it";
      EXPECT_TRUE(CheckOutput(buf)) << what;
    }
  }
}

// The check can fail: the same launch with V^T's keys left in key order
// inside each group (the pass's output, un-permuted on the host) pairs each
// P weight with another key's V row, and must fail the FP8 rule where the
// pass's own V^T passes it.
TEST(CudaFp8Pv, UnpermutedKeysFailTheCheck) {
  std::string why;
  AttentionBackend* backend = testing_util::SharedCudaBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  for (const TestCase& tc : {Fp8Case(1, 256, 512, 4, 4, 128, false, 0.5f),
                             VarlenFp8Case({128, 200}, {128, 300}, 2, 2, 128, true, 0.5f)}) {
    HostBuffers buf(tc);
    const absl::StatusOr<Plan> plan = backend->CanImplement(buf.params());
    ASSERT_TRUE(plan.ok()) << plan.status();
    if (!plan->fp8_pv) GTEST_SKIP() << "the plan has no FP8 P V (not an sm90 GPU or kernel)";
    DeviceCall call(buf);
    DeviceMem scratch(cuda::Fp8ScratchBytes(call.dev, true, true));
    DeviceMem ws(plan->workspace_bytes);
    ASSERT_NE(scratch.get(), nullptr);
    ASSERT_EQ(cudaMemset(ws.get(), 0, plan->workspace_bytes), cudaSuccess);  // counters at rest
    AttnParams run;
    ASSERT_EQ(cuda::DequantiseFp8(call.dev, true, true, scratch.get(), nullptr, &run), cudaSuccess);
    auto launch = [&]() {
      buf.Poison();
      EXPECT_EQ(cudaMemset(call.dev.o, 0xff, buf.o_bytes()), cudaSuccess);
      EXPECT_EQ(cuda::LaunchForward(run, *plan, ws.get(), nullptr), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(call.Download(&buf));
    };
    launch();
    EXPECT_TRUE(CheckOutput(buf)) << tc.Name() << " with the pass's V^T";
    // Column 32 g + c now holds key 32 g + c.
    std::vector<uint8_t> vt(static_cast<size_t>(cuda::VtBytes(call.dev)));
    ASSERT_EQ(cudaMemcpy(vt.data(), scratch.get(), vt.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<uint8_t> plain(vt.size());
    for (size_t i = 0; i < vt.size(); i += cuda::kFp8VtGroup) {
      for (int c = 0; c < cuda::kFp8VtGroup; ++c) {
        int from = 0;
        while (cuda::Fp8VtKeyAt(from) != c) ++from;
        plain[i + c] = vt[i + from];
      }
    }
    ASSERT_EQ(cudaMemcpy(scratch.get(), plain.data(), plain.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    launch();
    EXPECT_FALSE(CheckOutput(buf)) << tc.Name() << " passed with V^T's keys unpermuted";
  }
}

}  // namespace
}  // namespace attnserve
