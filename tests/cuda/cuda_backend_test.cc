// CudaBackend against the float64 reference with docs/design.md §4's tolerance
// policy: the shared StandardGrid (every feature of the contract, all dtypes)
// and Fp8Grid (FP8 inputs with descales), plus GPU-specific cases: every
// instantiated head dim and the sizes served by the next one up, tile-boundary
// sizes, split-KV decode with GQA packing (dense, varlen, windows), long causal
// prefill, split-KV with its fused combine (planned splits, and split counts
// alternating on one workspace: the ticket counters' reset), the Hopper
// family's cases (Sm90Grid; on an sm90 GPU the planner gives them to it, with
// ATTNSERVE_CUDA_PORTABLE=1 the portable kernel runs every case), and buffer
// reuse. Inputs are fresh random numbers per case, outputs NaN-poisoned before
// every run.
// Without a GPU each test calls GTEST_SKIP with the reason.
#include "backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/generated/kernel_set.h"
#include "gtest/gtest.h"
#include "tests/common/attn_test_util.h"
#include "tests/cuda/shared_cuda_backend.h"

namespace attnserve {
namespace {

using testing_util::CheckOutput;
using testing_util::HostBuffers;
using testing_util::TestCase;
constexpr auto SharedBackend = testing_util::SharedCudaBackend;

// What CanImplement is documented to refuse (cuda_backend.h): a head dim
// with no compiled kernel at or above it (ATTNSERVE_CUDA_KERNELS=dev), or a
// kernel whose tile needs more shared memory than the device allows (head
// dims 192/256 on sm86/sm89). Written from the compiled set and the tile
// table, not from the planner, so a planner regression cannot excuse itself.
bool DocumentedRefusal(const AttnParams& p) {
  if (p.dtype == DType::kFP32) return false;
  int kernel_head_dim = 0;
  for (int d : cuda::kCompiledHeadDims) {
    if (d >= p.head_dim && (kernel_head_dim == 0 || d < kernel_head_dim)) kernel_head_dim = d;
  }
  if (kernel_head_dim == 0) return true;
  int optin = 0;
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
  // The portable tile: a Hopper tile is planned only on sm90, where every one
  // fits (227 KB).
  return cuda::SmemBytes(cuda::TileFor(TileKind::kPrefill, kernel_head_dim)) > optin;
}

class CudaTest : public ::testing::TestWithParam<TestCase> {
 protected:
  void SetUp() override {
    std::string why;
    backend_ = SharedBackend(&why);
    if (backend_ == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  void RunAndCheck(const TestCase& tc) {
    HostBuffers buf(tc);
    const absl::StatusOr<Plan> plan = backend_->CanImplement(buf.params());
    // Only the refusals CanImplement documents are skips; any other
    // UNIMPLEMENTED is a regression and fails here.
    if (plan.status().code() == absl::StatusCode::kUnimplemented &&
        DocumentedRefusal(buf.params())) {
      GTEST_SKIP() << plan.status().message();
    }
    ASSERT_TRUE(plan.ok()) << plan.status();
    // Twice on the same buffers (re-poisoned): reused device memory must not
    // leak results from one call into the next.
    for (int run = 0; run < 2; ++run) {
      buf.Poison();
      BackendTimings t;
      const absl::Status st = backend_->Forward(*plan, buf.params(), &t);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(CheckOutput(buf)) << tc.Name() << " run " << run;
    }
  }
  AttentionBackend* backend_ = nullptr;
};

std::string CaseName(const ::testing::TestParamInfo<TestCase>& info) {
  return info.param.Name() + "_" + std::to_string(info.index);
}

TEST_P(CudaTest, MatchesReference) { RunAndCheck(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Standard, CudaTest, ::testing::ValuesIn(testing_util::StandardGrid()),
                         CaseName);
// FP8_E4M3 with descales: dequantised on the device to BF16, then the BF16
// kernel; O (BF16) against the float64 reference on the dequantised inputs.
INSTANTIATE_TEST_SUITE_P(Fp8, CudaTest, ::testing::ValuesIn(testing_util::Fp8Grid()), CaseName);

TestCase Make(DType t, int b, int sq, int sk, int hq, int hkv, int d, bool causal) {
  TestCase tc;
  tc.dtype = t;
  tc.batch = b;
  tc.seqlen_q = sq;
  tc.seqlen_k = sk;
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  tc.head_dim = d;
  tc.causal = causal;
  return tc;
}

// A varlen case: one entry per sequence in seqlens_q / seqlens_k.
TestCase Varlen(DType t, std::vector<int> seqlens_q, std::vector<int> seqlens_k, int hq, int hkv,
                int d, bool causal) {
  TestCase tc;
  tc.dtype = t;
  tc.seqlens_q = std::move(seqlens_q);
  tc.seqlens_k = std::move(seqlens_k);
  tc.num_heads_q = hq;
  tc.num_heads_kv = hkv;
  tc.head_dim = d;
  tc.causal = causal;
  return tc;
}

// Every instantiated head dim and ones served zero-padded by the next size.
std::vector<TestCase> HeadDimGrid() {
  std::vector<TestCase> g;
  for (DType t : {DType::kFP16, DType::kBF16}) {
    for (int d : {8, 16, 40, 64, 72, 96, 104, 128, 136, 192, 200, 248, 256}) {
      g.push_back(Make(t, 2, 97, 130, 4, 2, d, false));
      g.push_back(Make(t, 1, 130, 97, 2, 2, d, true));
    }
  }
  return g;
}
INSTANTIATE_TEST_SUITE_P(HeadDims, CudaTest, ::testing::ValuesIn(HeadDimGrid()), CaseName);

// Tile edges (64, 128), long causal prefill, split-KV decode.
std::vector<TestCase> ShapeGrid() {
  std::vector<TestCase> g;
  for (DType t : {DType::kFP16, DType::kBF16}) {
    for (int s : {63, 64, 65, 127, 128, 129, 255, 257})
      g.push_back(Make(t, 1, s, s, 2, 1, 128, s % 2 == 1));
    g.push_back(Make(t, 1, 2048, 2048, 2, 2, 128, true));
    g.push_back(Make(t, 1, 1500, 1500, 2, 1, 64, false));
    g.push_back(Make(t, 1, 700, 900, 2, 2, 256, true));
    // Decode: Sq 1..16 packs the GQA group into M; B small -> split-KV.
    g.push_back(Make(t, 1, 1, 8192, 32, 8, 128, false));
    g.push_back(Make(t, 3, 1, 4097, 32, 8, 128, true));
    g.push_back(Make(t, 2, 4, 3000, 16, 2, 128, true));  // speculative decode, causal
    g.push_back(Make(t, 1, 16, 5000, 8, 8, 64, false));  // Sq 16, no GQA: split only
    g.push_back(Make(t, 1, 1, 6000, 4, 1, 256, false));  // MQA decode, D 256
    {
      TestCase tc = Make(t, 2, 1, 6000, 16, 4, 128, false);
      tc.window_left = 700;  // most splits see no key at all
      g.push_back(tc);
    }
    {
      TestCase tc = Make(t, 1, 1, 3000, 8, 2, 128, false);
      tc.softcap = 5.0f;
      g.push_back(tc);
    }
    // Varlen decode with empty sequences and split-KV; varlen prefill, causal,
    // sequences across tile edges.
    g.push_back(Varlen(t, {1, 1, 0, 1, 1}, {3000, 0, 5000, 17, 6000}, 8, 2, 128, false));
    g.push_back(Varlen(t, {129, 0, 300, 1, 64}, {129, 10, 200, 500, 64}, 4, 1, 96, true));
  }
  // FP32 at decode and prefill sizes (the SIMT path).
  g.push_back(Make(DType::kFP32, 1, 1, 4097, 8, 2, 128, false));
  g.push_back(Make(DType::kFP32, 1, 300, 300, 2, 1, 256, true));
  return g;
}
INSTANTIATE_TEST_SUITE_P(Shapes, CudaTest, ::testing::ValuesIn(ShapeGrid()), CaseName);

// Split-KV launches: each case must plan more than one split (asserted, so a
// planner change cannot quietly drop the coverage); LSE returned and checked.
// Decode tiles combine in the forward kernel, prefill tiles in the combine
// kernel. Contexts 1k..32k at B = 1 and B = 16
// with GQA 4:1 packed into the decode tile; one query head per KV head (a
// row of fewer output chunks than threads: the combine splits the splits);
// GQA 8:1 (8 packed rows); and chunked prefill (Sq 128), whose prefill tile
// also splits.
class CudaSplitTest : public CudaTest {};

TEST_P(CudaSplitTest, SplitsAndMatchesReference) {
  HostBuffers buf(GetParam());
  const absl::StatusOr<Plan> plan = backend_->CanImplement(buf.params());
  if (plan.status().code() == absl::StatusCode::kUnimplemented && DocumentedRefusal(buf.params())) {
    GTEST_SKIP() << plan.status().message();
  }
  ASSERT_TRUE(plan.ok()) << plan.status();
  if (plan->kernel_family == KernelFamily::kSm90 && plan->num_splits == 1) {
    // On sm90 the Hopper prefill family takes the dense chunked-prefill cases
    // and never splits, and the Hopper decode kernel splits only to one CTA
    // per SM (the B = 16 cases fill the SMs unsplit): checked here as they
    // run; the split itself is covered by the same binary's portable run
    // (ATTNSERVE_CUDA_PORTABLE=1, gpu-check.sh) and, on the Hopper decode
    // kernel, by the B = 1 cases and CudaSplitWorkspace.
    RunAndCheck(GetParam());
    return;
  }
  ASSERT_GT(plan->num_splits, 1) << GetParam().Name();
  RunAndCheck(GetParam());
}

std::vector<TestCase> SplitGrid() {
  std::vector<TestCase> g;
  for (int sk : {1000, 4096, 16384, 32768})
    g.push_back(Make(DType::kBF16, 1, 1, sk, 32, 8, 128, false));
  g.push_back(Make(DType::kFP16, 1, 1, 8192, 32, 8, 128, false));
  for (int sk : {1024, 2500}) g.push_back(Make(DType::kBF16, 16, 1, sk, 32, 8, 128, false));
  g.push_back(Make(DType::kFP16, 16, 1, 2048, 32, 8, 128, true));
  g.push_back(Make(DType::kBF16, 1, 1, 5000, 8, 8, 128, false));    // no GQA: 1 row per tile
  g.push_back(Make(DType::kBF16, 2, 1, 7000, 64, 8, 128, false));   // GQA 8:1
  g.push_back(Make(DType::kBF16, 1, 128, 4096, 8, 2, 128, false));  // chunked prefill
  g.push_back(Make(DType::kFP16, 1, 128, 3000, 8, 2, 128, true));
  g.push_back(Make(DType::kBF16, 1, 128, 16384, 1, 1, 64, false));  // 128 splits, rows in passes
  return g;
}
INSTANTIATE_TEST_SUITE_P(Split, CudaSplitTest, ::testing::ValuesIn(SplitGrid()), CaseName);

// A device copy of a HostBuffers case (q, k, v in; o, lse out) and its
// params with device pointers.
class DeviceCase {
 public:
  explicit DeviceCase(HostBuffers* buf) : buf_(buf) {
    dev_ = buf->params();
    dev_.q = Upload(buf->q(), buf->q_bytes());
    dev_.k = Upload(buf->k(), buf->kv_bytes());
    dev_.v = Upload(buf->v(), buf->kv_bytes());
    dev_.o = Upload(nullptr, buf->o_bytes());
    dev_.lse = static_cast<float*>(Upload(nullptr, buf->lse_elements() * 4));
  }
  ~DeviceCase() {
    for (void* p : ptrs_) cudaFree(p);
  }
  bool ok() const { return ok_; }
  const AttnParams& params() const { return dev_; }
  // o and lse back into the host buffers (poisoned first on the device).
  void Poison() {
    ok_ &= cudaMemset(dev_.o, 0xff, static_cast<size_t>(buf_->o_bytes())) == cudaSuccess;
    ok_ &= cudaMemset(dev_.lse, 0xff, static_cast<size_t>(buf_->lse_elements() * 4)) == cudaSuccess;
  }
  void Download() {
    ok_ &= cudaMemcpy(buf_->o(), dev_.o, static_cast<size_t>(buf_->o_bytes()),
                      cudaMemcpyDeviceToHost) == cudaSuccess;
    ok_ &= cudaMemcpy(buf_->lse(), dev_.lse, static_cast<size_t>(buf_->lse_elements() * 4),
                      cudaMemcpyDeviceToHost) == cudaSuccess;
  }

 private:
  void* Upload(const void* src, int64_t bytes) {
    void* p = nullptr;
    ok_ &= cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 16))) == cudaSuccess;
    if (p != nullptr) ptrs_.push_back(p);
    if (src != nullptr && p != nullptr)
      ok_ &= cudaMemcpy(p, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice) == cudaSuccess;
    return p;
  }
  HostBuffers* buf_;
  AttnParams dev_;
  std::vector<void*> ptrs_;
  bool ok_ = true;
};

// The ticket counters' reset: launches of two shapes with different split
// counts (and so different tile groups, and splits with no keys at all)
// alternate on ONE workspace whose counters were zeroed once. Each must
// match the reference, and every counter must be zero after each launch.
TEST(CudaSplitWorkspace, BackToBackSplitCountsOnOneWorkspace) {
  std::string why;
  if (SharedBackend(&why) == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  HostBuffers a(Make(DType::kBF16, 1, 1, 3000, 32, 8, 128, false));   // 47 key tiles, 8 groups
  HostBuffers b(Make(DType::kBF16, 16, 1, 1500, 16, 4, 128, false));  // 24 key tiles, 64 groups
  DeviceCase da(&a), db(&b);
  ASSERT_TRUE(da.ok() && db.ok());
  int num_sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  constexpr int kMaxSplits = 40;
  const int64_t ws_bytes = std::max(cuda::SplitWorkspaceBytes(da.params(), kMaxSplits),
                                    cuda::SplitWorkspaceBytes(db.params(), kMaxSplits));
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, static_cast<size_t>(ws_bytes)), cudaSuccess);
  ASSERT_EQ(cudaMemset(ws, 0x5a, static_cast<size_t>(ws_bytes)), cudaSuccess);  // garbage partials
  ASSERT_EQ(cuda::ClearSplitCounters(ws, nullptr), cudaSuccess);
  struct Step {
    HostBuffers* buf;
    DeviceCase* dev;
    int splits;  // 40 over 47 tiles: 16 splits without keys; 40 over 24: 16 too
  };
  const Step steps[] = {{&a, &da, 7}, {&b, &db, 3},  {&a, &da, 40}, {&b, &db, 40},
                        {&a, &da, 2}, {&b, &db, 13}, {&a, &da, 7}};
  // The portable decode tile, then (on sm90) the Hopper decode kernel, on
  // the same workspace.
  const bool sm90 = cuda::DeviceRunsSm90Kernels(0);
  for (int round = 0; round < (sm90 ? 2 : 1); ++round)
    for (const Step& st : steps) {
      Plan plan = cuda::PlanForward(st.dev->params(), num_sms, /*allow_sm90=*/round == 1);
      ASSERT_EQ(plan.tile_kind, TileKind::kDecode);
      ASSERT_EQ(plan.kernel_family, round == 1 ? KernelFamily::kSm90 : KernelFamily::kPortable);
      plan.num_splits = st.splits;
      plan.workspace_bytes = cuda::SplitWorkspaceBytes(st.dev->params(), st.splits);
      st.dev->Poison();
      ASSERT_EQ(cuda::LaunchForward(st.dev->params(), plan, ws, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      st.dev->Download();
      ASSERT_TRUE(st.dev->ok());
      EXPECT_TRUE(CheckOutput(*st.buf)) << st.buf->test_case().Name() << " splits " << st.splits;
      std::vector<int32_t> counters(cuda::kMaxSplitGroups, -1);
      ASSERT_EQ(cudaMemcpy(counters.data(), ws, cuda::kSplitCounterBytes, cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(std::count(counters.begin(), counters.end(), 0), cuda::kMaxSplitGroups)
          << "a ticket counter was left non-zero after " << st.splits << " splits";
    }
  cudaFree(ws);
}

// The Hopper family's coverage (kSm90TileTable; on sm90 the planner picks it
// for all of these, on other GPUs and with ATTNSERVE_CUDA_PORTABLE=1 the
// portable kernel runs them): its head dims and ones the next kernel up
// serves (8..64, 72..128, 136..192, 200..256), lengths off the 128-row and
// 64/112/128-key tiles, long sequences (32k keys; 32k queries), causal
// bottom-right with Sq > Sk (fully masked rows: O = 0, LSE = -inf), sliding
// windows, softcap, GQA and MQA, varlen prefill (empty sequences, sequences
// ending inside a key tile).
std::vector<TestCase> Sm90Grid() {
  std::vector<TestCase> g;
  for (DType t : {DType::kFP16, DType::kBF16}) {
    for (int d : {16, 40, 64, 72, 120, 128, 136, 192, 200, 256}) {
      g.push_back(Make(t, 2, 333, 333, 4, 2, d, false));
      g.push_back(Make(t, 1, 257, 700, 2, 1, d, true));
    }
    for (int s : {1, 17, 64, 127, 129, 191, 385})
      g.push_back(
          Make(t, 2, s + 63, s, 2, 2, 128, s % 2 == 1));  // Sq > Sk: masked rows when causal
    g.push_back(Make(t, 1, 256, 32768, 2, 1, 128, false));
    g.push_back(Make(t, 1, 1024, 32768, 1, 1, 64, true));
    g.push_back(Make(t, 1, 32768, 300, 2, 2, 256, false));
    g.push_back(Make(t, 1, 4096, 4096, 2, 1, 192, true));
    // Long key ranges at D <= 64 run the wider key tile (kSm90LongKeyTileTable):
    // lengths off its 192 keys, D < 64, causal bottom-right, varlen by its
    // longest sequence (a key tile past the short ones' ends).
    g.push_back(Make(t, 2, 333, 4133, 4, 2, 64, false));
    g.push_back(Make(t, 1, 500, 4500, 2, 1, 40, true));
    g.push_back(Varlen(t, {300, 0, 129}, {4400, 7, 200}, 4, 2, 64, true));
    // Varlen prefill: empty sequences, no keys, lengths off every tile.
    for (int d : {64, 128, 192, 256}) {
      g.push_back(Varlen(t, {129, 0, 300, 1, 64, 700, 200}, {129, 10, 200, 500, 70, 700, 0}, 4, 2,
                         d, d % 128 == 0));
    }
    {
      TestCase tc = Varlen(t, {1000, 77, 513}, {1100, 300, 513}, 8, 1, 128, false);  // MQA
      tc.window_left = 100;
      tc.window_right = 30;
      tc.softcap = 15.0f;
      g.push_back(tc);
    }
    {
      TestCase tc = Make(t, 2, 1000, 1200, 8, 1, 128, false);  // MQA, window both sides
      tc.window_left = 150;
      tc.window_right = 40;
      g.push_back(tc);
    }
    {
      TestCase tc = Make(t, 1, 700, 700, 4, 2, 64, true);  // causal + window + softcap
      tc.window_left = 200;
      tc.softcap = 30.0f;
      g.push_back(tc);
    }
    {
      TestCase tc = Make(t, 2, 300, 5000, 4, 4, 256, false);
      tc.softcap = 10.0f;
      tc.return_lse = false;
      g.push_back(tc);
    }
    // The Hopper decode kernel (kSm90DecodeTileTable: head dims 64, 96 and 128
    // exactly): GQA packed into the 16-row tile, split-KV with the fused
    // combine, partial last tiles, speculative steps, a window with softcap.
    for (int d : {64, 96, 128}) {
      g.push_back(Make(t, 3, 1, 4999, 32, 8, d, false));
      g.push_back(Make(t, 2, 3, 777, 8, 2, d, true));
      TestCase tc = Make(t, 5, 1, 2100, 16, 16, d, false);
      tc.window_left = 500;
      tc.softcap = 20.0f;
      g.push_back(tc);
    }
  }
  {
    // FP8 Q K^T on the wider key tile (the Fp8/ grid's keys are short).
    TestCase tc = Make(DType::kFP8E4M3, 1, 300, 4200, 4, 2, 64, true);
    tc.q_descale = 0.5f;
    tc.k_descale = 1.5f;
    tc.v_descale = 0.25f;
    g.push_back(tc);
  }
  return g;
}
INSTANTIATE_TEST_SUITE_P(Sm90, CudaTest, ::testing::ValuesIn(Sm90Grid()), CaseName);

// Varlen: a key tile reaching past a sequence's end reads the next
// sequence's K/V rows. NaN planted in rows that their own sequence never
// loads (a causal window of 20 keeps its queries at keys >= 280, in key tiles
// starting at 224 or later for every tile width: 32, 64, 112, 128) must not
// reach the sequence before them: its scores there are masked, but P = 0
// times NaN is NaN unless the kernel keeps those values out (the Hopper
// kernels zero such V rows in smem; the portable kernel never loads them).
// Prefill and decode (GQA packed), each head dim of the Hopper prefill
// kernels. (NaN inside a sequence's own loaded tiles is not covered: no
// kernel here promises that, nor does FlashAttention.)
TEST(CudaBackendVarlen, RowsPastASequenceStayOut) {
  std::string why;
  AttentionBackend* backend = SharedBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  for (int d : {64, 128, 192, 256}) {
    for (int sq : {1, 100}) {
      TestCase tc = Varlen(DType::kBF16, {sq == 1 ? 1 : 70, sq}, {70, 400}, 4, 2, d, true);
      tc.window_left = 20;
      HostBuffers buf(tc);
      // Sequence 1's keys 0..127 (rows 70..197).
      const int64_t row_bytes = int64_t{tc.num_heads_kv} * d * 2;
      for (void* x : {buf.k(), buf.v()}) {
        std::memset(static_cast<char*>(x) + 70 * row_bytes, 0xff,
                    static_cast<size_t>(128 * row_bytes));
      }
      const absl::StatusOr<Plan> plan = backend->CanImplement(buf.params());
      if (plan.status().code() == absl::StatusCode::kUnimplemented &&
          DocumentedRefusal(buf.params())) {
        continue;  // D 192/256 on sm86/sm89
      }
      ASSERT_TRUE(plan.ok()) << plan.status();
      BackendTimings t;
      const absl::Status st = backend->Forward(*plan, buf.params(), &t);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(CheckOutput(buf))
          << tc.Name() << " on the "
          << (plan->kernel_family == KernelFamily::kSm90 ? "Hopper" : "portable") << " kernel";
    }
  }
}

// On an sm90 GPU (without ATTNSERVE_CUDA_PORTABLE=1) the Hopper family must
// really be what runs the grids above: dense and varlen prefill plan onto it,
// and what it does not cover stays portable.
TEST(CudaBackendSm90, PlannerPicksTheHopperFamilyOnSm90) {
  std::string why;
  AttentionBackend* backend = SharedBackend(&why);
  if (backend == nullptr) GTEST_SKIP() << "no usable CUDA device: " << why;
  if (!cuda::DeviceRunsSm90Kernels(0)) {
    GTEST_SKIP()
        << "not an sm90 device, a build without ATTNSERVE_CUDA_SM90, or ATTNSERVE_CUDA_PORTABLE=1";
  }
  TestCase dense = Make(DType::kBF16, 2, 1024, 1024, 8, 2, 128, true);
  HostBuffers a(dense);
  absl::StatusOr<Plan> plan = backend->CanImplement(a.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kernel_family, KernelFamily::kSm90);
  // FP8 prefill runs Q K^T on the codes (QGMMA): the Fp8/ grid's prefill
  // cases take that path here.
  HostBuffers e(Make(DType::kFP8E4M3, 2, 1024, 1024, 8, 2, 128, true));
  plan = backend->CanImplement(e.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kernel_family, KernelFamily::kSm90);
  EXPECT_TRUE(plan->fp8_qk);
  // Decode at a head dim of the Hopper decode kernel takes it ...
  HostBuffers c(Make(DType::kBF16, 2, 1, 4096, 32, 8, 128, false));
  plan = backend->CanImplement(c.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kernel_family, KernelFamily::kSm90);
  EXPECT_EQ(plan->tile_kind, TileKind::kDecode);
  // ... and one it does not have exactly (72 runs the portable 96 tile) stays portable.
  HostBuffers d(Make(DType::kBF16, 2, 1, 4096, 32, 8, 72, false));
  plan = backend->CanImplement(d.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kernel_family, KernelFamily::kPortable);
  // Varlen prefill and head dim 192 take the Hopper prefill kernel.
  HostBuffers vb(Varlen(DType::kBF16, {300, 0, 129}, {300, 5, 200}, 4, 2, 128, false));
  plan = backend->CanImplement(vb.params());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kernel_family, KernelFamily::kSm90);
  EXPECT_EQ(plan->tile_kind, TileKind::kPrefill);
  if (cuda::CompiledSm90LongKeyHeadDim(64)) {
    HostBuffers l(Make(DType::kBF16, 2, 333, 4133, 4, 2, 64, false));
    plan = backend->CanImplement(l.params());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->kernel_family, KernelFamily::kSm90);
    EXPECT_EQ(plan->tile_kind, TileKind::kLongKeys);
  }
  if (cuda::CompiledSm90HeadDim(192)) {
    HostBuffers h(Make(DType::kFP16, 1, 512, 512, 4, 4, 160, false));
    plan = backend->CanImplement(h.params());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->kernel_family, KernelFamily::kSm90);
    EXPECT_EQ(plan->kernel_head_dim, 192);
  }
}

TEST(CudaBackendInfo, DescribesDevice) {
  auto b = MakeCudaBackend(0);
  if (!b.ok()) GTEST_SKIP() << "no usable CUDA device: " << b.status().message();
  const BackendDescription& d = (*b)->Describe();
  EXPECT_EQ(d.name, "cuda");
  ASSERT_EQ(d.devices.size(), 1u);
  EXPECT_FALSE(d.devices[0].name.empty());
  EXPECT_GE(d.devices[0].compute_capability_major, 8);
  EXPECT_GT(d.devices[0].total_memory_bytes, 0);
}

TEST(CudaBackendInfo, MissingDeviceIsUnavailable) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  auto b = MakeCudaBackend(count + 3);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attnserve
