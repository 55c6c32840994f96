// FP8 prefill with P V on FP8 wgmma (Plan::fp8_pv): V^T's layout and key
// permutation (backend/cuda/fp8_vt_layout.h) against a host model, the
// transpose pass against that model (every byte, gaps included), FP8 calls
// whose rows are dominated by a few keys (where pairing P with the wrong V
// rows shows) through the backend against the float64 reference with the FP8
// rule (tolerance.h), and the same call with V^T's keys left unpermuted,
// which must fail that check. Without a GPU the device tests GTEST_SKIP.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/fp8_dequant.h"
#include "backend/cuda/fp8_vt_layout.h"
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
  // head dim this build compiled for it.
  if (cuda::DeviceRunsSm90Kernels(0) && plan->kernel_family == KernelFamily::kSm90) {
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
