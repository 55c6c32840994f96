// Shared test support for every attention backend (CPU tests here, CUDA tests
// on the GPU machine): a TestCase describes one call, HostBuffers owns fresh
// random inputs, poisoned outputs and a filled AttnParams for it, and
// CheckOutput applies docs/design.md §4's tolerance policy against the float64
// reference. No gRPC, protobuf or backend dependency: only params.h, dtype.h,
// the reference and GoogleTest.
//
// Typical use (a device backend copies its results into buf.o()/buf.lse(), or
// passes its own host copies to CheckOutput):
//
//   TestCase tc;
//   tc.dtype = DType::kBF16;
//   tc.seqlen_q = tc.seqlen_k = 97;
//   tc.causal = true;
//   HostBuffers buf(tc);                 // inputs random, outputs NaN-poisoned
//   ASSERT_TRUE(backend->Forward(buf.params(), &t).ok());
//   EXPECT_TRUE(CheckOutput(buf));       // or CheckOutput(buf, my_o, my_lse)
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "backend/params.h"
#include "backend/reference/reference_attention.h"
#include "gtest/gtest.h"
#include "tests/common/score_mods_util.h"

namespace attnserve {
namespace testing_util {

// One attention call. Dense unless seqlens_q/seqlens_k are set (varlen: one
// entry per sequence, batch = their size, zero lengths allowed).
struct TestCase {
  DType dtype = DType::kFP32;
  int batch = 1;
  int seqlen_q = 1;
  int seqlen_k = 1;
  int num_heads_q = 1;
  int num_heads_kv = 1;
  int head_dim = 64;
  int head_dim_v = 0;  // V's and O's head dim (MLA); 0: head_dim
  bool causal = false;
  int window_left = kNoWindow;
  int window_right = kNoWindow;
  float softcap = 0.0f;
  float softmax_scale = 0.0f;  // 0: the contract's default 1/sqrt(D)
  std::vector<int> seqlens_q;  // varlen when non-empty (with seqlens_k)
  std::vector<int> seqlens_k;
  bool return_lse = true;
  // FP8_E4M3 only (1 otherwise): the inputs are random codes, their values
  // code x descale.
  float q_descale = 1.0f;
  float k_descale = 1.0f;
  float v_descale = 1.0f;
  uint32_t seed = 0;  // 0: derived from Name(), so every case gets its own inputs
  // Score modifiers and masks (score_mods_util.h): random arrays drawn by
  // HostBuffers; all off by default.
  ModsSpec mods;

  bool varlen() const { return !seqlens_q.empty(); }
  // A readable, gtest-safe name ([A-Za-z0-9_] only) spelling every field that
  // differs from the defaults, e.g. "bf16_b2_q97_k97_h4x1_d64_causal_lse".
  std::string Name() const;
};

// gtest prints a parameter with this instead of its raw bytes (ctest's test
// list and failure messages then read "bf16_b2_q97_...").
inline void PrintTo(const TestCase& tc, std::ostream* os) { *os << tc.Name(); }

// The absolute floor of O's bound for dtype `t`: tolerance::OutputFloor
// (backend/reference/tolerance.h, which says why each value).
double OutputFloor(DType t);

// Buffers for one TestCase: q/k/v filled with fresh random values (normal,
// rounded to the dtype, never zero; FP8: codes of such values, scaled by the
// case's descales), o (OutputDType: BF16 for FP8) and lse poisoned with an
// all-ones bit pattern (NaN in FP16, BF16 and FP32) so unwritten elements are
// caught.
// Not copyable or movable: params() points into it.
class HostBuffers {
 public:
  explicit HostBuffers(const TestCase& tc);
  HostBuffers(const HostBuffers&) = delete;
  HostBuffers& operator=(const HostBuffers&) = delete;

  const TestCase& test_case() const { return tc_; }
  // Host pointers to every buffer; lse is null unless tc.return_lse. The
  // softmax scale, causal-as-window normalisation and totals are filled the
  // way the server's FillParams does.
  const AttnParams& params() const { return params_; }

  void* o() { return o_.data(); }
  const void* o() const { return o_.data(); }
  float* lse() { return tc_.return_lse ? lse_.data() : nullptr; }
  const float* lse() const { return tc_.return_lse ? lse_.data() : nullptr; }
  const void* q() const { return q_.data(); }
  const void* k() const { return k_.data(); }
  const void* v() const { return v_.data(); }
  // Inputs a test may plant values in (before the first Reference() call:
  // the reference reads them then).
  void* k() { return k_.data(); }
  void* v() { return v_.data(); }
  const int32_t* cu_seqlens_q() const { return tc_.varlen() ? cu_q_.data() : nullptr; }
  const int32_t* cu_seqlens_k() const { return tc_.varlen() ? cu_k_.data() : nullptr; }
  // The case's mod arrays (params() points at them), or null when it has none.
  const HostMods* mods() const { return mods_.get(); }

  int64_t q_bytes() const { return static_cast<int64_t>(q_.size()); }
  int64_t kv_bytes() const { return static_cast<int64_t>(k_.size()); }  // K (and V when Dv == D)
  int64_t v_bytes() const { return static_cast<int64_t>(v_.size()); }
  int64_t o_bytes() const { return static_cast<int64_t>(o_.size()); }
  int64_t o_elements() const;    // total_q * Hq * Dv
  int64_t lse_elements() const;  // Hq * total_q (0 without return_lse)

  // Re-poisons o and lse (before each run of a backend on the same inputs).
  void Poison();

  // The float64 reference and its low-precision twin, computed on first use.
  const ReferenceOutput& Reference() const;
  const ReferenceOutput& ReferenceLowPrecision() const;

 private:
  TestCase tc_;
  std::vector<uint8_t> q_, k_, v_, o_;
  std::vector<float> lse_;
  std::vector<int32_t> cu_q_, cu_k_;
  std::unique_ptr<HostMods> mods_;
  AttnParams params_;
  mutable std::unique_ptr<ReferenceOutput> ref_;
  mutable std::unique_ptr<ReferenceOutput> ref_lowp_;
};

// Compares an output (o in OutputDType of the case's dtype, layout of params.o; lse FP32,
// may be null only when the case has return_lse off) with the reference.
// Empty string when it passes; otherwise what failed, with the worst element's
// coordinates, its value, the reference and the tolerance.
std::string CheckOutputError(const HostBuffers& buf, const void* o, const float* lse);

// gtest-friendly forms: EXPECT_TRUE(CheckOutput(buf, o, lse)).
::testing::AssertionResult CheckOutput(const HostBuffers& buf, const void* o, const float* lse);
// Checks buf's own o()/lse().
::testing::AssertionResult CheckOutput(const HostBuffers& buf);

// The grid every backend runs (docs/design.md §4): sizes 1, 17, 97, 1025; Sq != Sk
// both ways; GQA 4:1 and MQA; causal; windows (left, right, both, with
// causal); softcap; custom scale; varlen with zero-length sequences; B = 0;
// Sk = 0; fully masked rows; all dtypes; head dims 8..256. Sized so the CPU
// backend runs it in well under a minute on two cores.
std::vector<TestCase> StandardGrid();

// FP8_E4M3 inputs with descales (O is BF16, checked with the BF16 rule on the
// dequantised inputs, tolerance.h): a subset of StandardGrid's shapes (dense,
// GQA/MQA, causal with fully masked rows, windows, softcap, head dims 64, 128,
// 256, varlen with zero-length sequences, empty calls) with descales of 1,
// powers of two and non-powers of two. Kept apart from StandardGrid so the
// other dtypes' grid stays the size CI budgets for.
std::vector<TestCase> Fp8Grid();

}  // namespace testing_util
}  // namespace attnserve
