// The Hopper prefill kernel's score modifiers (D 64, 128, 256), launched directly
// (RunAttnFwdSm90 on the default schedule, device params staged here, so
// the planner's routing plays no part): block-sparse masks (CSR, random per
// head and local + global stripes shared by the heads, densities 0..1,
// several block sizes, causal or not, dense and varlen, empty rows), ALiBi
// slopes and attention sinks, against a float64 reference written here
// (scale, softcap, + ALiBi, then the band and the block mask remove keys,
// sinks join the denominator) over the same rounded inputs. Outputs are
// NaN-poisoned before each run. SM90_BS_TIMING=1 adds a timing table (dense
// vs block mask at kept fractions s), SM90_BS_CSV=path writes it as CSV.
// Without an sm90 GPU every test is skipped.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/generated/kernel_set.h"
#include "backend/cuda/hopper/attn_fwd_sm90.h"
#include "backend/cuda/mods_prefix.h"
#include "backend/params.h"
#include "common/dtype.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

bool HaveSm90() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return major == 9 && minor == 0;
}

struct Case {
  std::string name;
  int d = 128;
  DType dtype = DType::kBF16;
  bool causal = false;
  int window_left = kNoWindow;
  std::vector<int> seq_q, seq_k;  // one entry: dense batch of `batch`
  int batch = 2;
  int hq = 4, hkv = 2;
  // Block mask: density < 0 = none.
  double density = -1;
  std::string pattern = "random";  // random (per head) | stripes (shared) | rows (some rows empty)
  int block_q = 128, block_k = 128;
  bool alibi = false, sinks = false;
  float softcap = 0.f;
};

// Device buffer freed at scope end.
struct Dev {
  void* ptr = nullptr;
  Dev() = default;
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  template <typename V>
  cudaError_t Up(const std::vector<V>& v) {
    if (v.empty()) return cudaSuccess;
    cudaError_t e = cudaMalloc(&ptr, v.size() * sizeof(V));
    if (e != cudaSuccess) return e;
    return cudaMemcpy(ptr, v.data(), v.size() * sizeof(V), cudaMemcpyHostToDevice);
  }
  template <typename V>
  V* As() const {
    return static_cast<V*>(ptr);
  }
};

// The host side of a problem: params over host arrays (pointers filled in
// by Stage for the device), rounded inputs as floats, the CSR.
struct Problem {
  AttnParams p{};
  std::vector<int32_t> cu_q, cu_k;
  std::vector<float> q, k, v;  // rounded values
  std::vector<uint16_t> q16, k16, v16;
  std::vector<int32_t> row_ptr, col_idx;
  std::vector<float> slopes, sinks;
};

// inputs = false: the CSR (and small arrays) only.
Problem Build(const Case& c, uint32_t seed, bool inputs = true) {
  Problem pr;
  AttnParams& p = pr.p;
  p.dtype = c.dtype;
  p.num_heads_q = c.hq;
  p.num_heads_kv = c.hkv;
  p.head_dim = c.d;
  const bool varlen = c.seq_q.size() > 1;
  if (varlen) {
    p.batch = static_cast<int>(c.seq_q.size());
    pr.cu_q.push_back(0);
    pr.cu_k.push_back(0);
    for (int b = 0; b < p.batch; ++b) {
      pr.cu_q.push_back(pr.cu_q.back() + c.seq_q[b]);
      pr.cu_k.push_back(pr.cu_k.back() + c.seq_k[b]);
      p.seqlen_q = std::max(p.seqlen_q, c.seq_q[b]);
      p.seqlen_k = std::max(p.seqlen_k, c.seq_k[b]);
    }
    p.total_q = pr.cu_q.back();
    p.total_k = pr.cu_k.back();
    p.cu_seqlens_q = pr.cu_q.data();
    p.cu_seqlens_k = pr.cu_k.data();
  } else {
    p.batch = c.batch;
    p.seqlen_q = c.seq_q[0];
    p.seqlen_k = c.seq_k[0];
    p.total_q = int64_t{p.batch} * p.seqlen_q;
    p.total_k = int64_t{p.batch} * p.seqlen_k;
  }
  p.softmax_scale = 1.f / std::sqrt(static_cast<float>(c.d));
  p.softmax_scale_log2 = p.softmax_scale * kLog2e;
  p.softcap = c.softcap;
  p.is_causal = c.causal;
  p.window_left = c.window_left;
  p.window_right = c.causal ? 0 : kNoWindow;
  std::mt19937 rng(seed);
  // Scores of a few units: softmax neither flat nor one-hot, so a wrong
  // key set moves O by far more than rounding.
  std::normal_distribution<float> qk(0.f, 1.5f);
  std::uniform_real_distribution<float> vd(-1.f, 1.f);
  auto fill = [&](std::vector<float>& f, std::vector<uint16_t>& h, int64_t n, bool is_v) {
    f.resize(n);
    h.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const float x = is_v ? vd(rng) : qk(rng);
      h[i] = c.dtype == DType::kBF16 ? FloatToBf16(x) : FloatToFp16(x);
      f[i] = c.dtype == DType::kBF16 ? Bf16ToFloat(h[i]) : Fp16ToFloat(h[i]);
    }
  };
  if (inputs) {
    fill(pr.q, pr.q16, p.total_q * c.hq * c.d, false);
    fill(pr.k, pr.k16, p.total_k * c.hkv * c.d, false);
    fill(pr.v, pr.v16, p.total_k * c.hkv * c.d, true);
  }
  if (c.alibi) {
    for (int h = 0; h < c.hq; ++h) pr.slopes.push_back(std::pow(2.f, -8.f * (h + 1) / c.hq));
  }
  if (c.sinks) {
    std::uniform_real_distribution<float> sd(-2.f, 3.f);
    for (int h = 0; h < c.hq; ++h) pr.sinks.push_back(sd(rng));
  }
  if (c.density >= 0) {
    p.block_q = c.block_q;
    p.block_k = c.block_k;
    p.block_per_head = c.pattern != "stripes";
    p.block_per_batch = varlen || c.pattern != "stripes";
    const int64_t rows = BlockMaskRows(p);  // needs cu_seqlens (host) for varlen
    const int heads = p.block_per_head ? c.hq : 1;
    const int64_t rows_per_head = rows / heads;
    std::uniform_real_distribution<double> u(0.0, 1.0);
    pr.row_ptr.push_back(0);
    for (int64_t r = 0; r < rows; ++r) {
      // Which sequence (for its key blocks) and query block this row is.
      const int64_t rr = r % rows_per_head;
      int b = 0;
      int64_t qb = rr;
      if (p.block_per_batch) {
        while (qb >= BlockRowsOf(p, b)) qb -= BlockRowsOf(p, b++);
      }
      const int kb = (SeqLenK(p, b) + c.block_k - 1) / c.block_k;
      for (int col = 0; col < kb; ++col) {
        bool keep;
        if (c.pattern == "stripes") {
          // Local band around the (scaled) diagonal plus the first key block.
          const int diag = static_cast<int>(qb * int64_t{kb} / std::max(1, BlockRowsOf(p, b)));
          const int w = std::max(0, static_cast<int>(std::lround(c.density * kb / 2)));
          keep = c.density > 0 && (col == 0 || std::abs(col - diag) <= w);
          if (c.density >= 1) keep = true;
        } else if (c.pattern == "rows") {
          keep = (r % 3 != 1) && u(rng) < c.density;  // every third row empty
        } else {
          keep = u(rng) < c.density;
        }
        if (keep) pr.col_idx.push_back(col);
      }
      pr.row_ptr.push_back(static_cast<int32_t>(pr.col_idx.size()));
    }
  }
  return pr;
}

// float64 reference over the rounded inputs: o [total_q, Hq, D], lse [Hq-major as LseOffset].
void Reference(const Problem& pr, const Case& c, std::vector<double>* o, std::vector<double>* lse) {
  const AttnParams& p = pr.p;
  const int D = c.d;
  o->assign(p.total_q * c.hq * D, 0.0);
  lse->assign(p.total_q * c.hq, 0.0);
  std::vector<double> s, acc(D);
  for (int b = 0; b < p.batch; ++b) {
    const int sq = SeqLenQ(p, b), sk = SeqLenK(p, b);
    const int64_t q0 = SeqStartQ(p, b), k0 = SeqStartK(p, b);
    const int64_t rows_before = HasBlockMask(p) ? BlockRowsBefore(p, b) : 0;
    for (int h = 0; h < c.hq; ++h) {
      const int kvh = KVHead(p, h);
      for (int i = 0; i < sq; ++i) {
        std::vector<char> kept(sk, 1);
        if (HasBlockMask(p)) {
          std::fill(kept.begin(), kept.end(), 0);
          const int64_t r = BlockRow(p, rows_before, b, h, i / p.block_q);
          for (int e = pr.row_ptr[r]; e < pr.row_ptr[r + 1]; ++e) {
            const int col = pr.col_idx[e];
            for (int j = col * p.block_k; j < std::min(sk, (col + 1) * p.block_k); ++j) kept[j] = 1;
          }
        }
        int lo, hi;
        VisibleKeys(p, i, sq, sk, &lo, &hi);
        s.clear();
        std::vector<int> js;
        double mx = -INFINITY;
        for (int j = std::max(lo, 0); j <= std::min(hi, sk - 1); ++j) {
          if (!kept[j]) continue;
          const float* qr = &pr.q[((q0 + i) * c.hq + h) * D];
          const float* kr = &pr.k[((k0 + j) * c.hkv + kvh) * D];
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += double{qr[d]} * kr[d];
          double x = dot * p.softmax_scale;
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          if (c.alibi) x += AlibiBias(pr.slopes[h], i, j, sq, sk);
          s.push_back(x);
          js.push_back(j);
          mx = std::max(mx, x);
        }
        const double sink = c.sinks ? double{pr.sinks[h]} : -INFINITY;
        const double top = std::max(mx, sink);
        double* out = &(*o)[((q0 + i) * c.hq + h) * D];
        const int64_t li = LseOffset(p, b, h, i);
        if (top == -INFINITY) {
          (*lse)[li] = -INFINITY;
          continue;
        }
        double sum = c.sinks ? std::exp(sink - top) : 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (size_t t = 0; t < s.size(); ++t) {
          const double w = std::exp(s[t] - top);
          sum += w;
          const float* vr = &pr.v[((k0 + js[t]) * c.hkv + kvh) * D];
          for (int d = 0; d < D; ++d) acc[d] += w * vr[d];
        }
        for (int d = 0; d < D; ++d) out[d] = acc[d] / sum;
        (*lse)[li] = top + std::log(sum);
      }
    }
  }
}

// Device copies of a problem and the launch struct RunAttnFwdSm90 reads.
struct Staged {
  Dev q, k, v, o, lse, cu_q, cu_k, row_ptr, col_idx, slopes, sinks, counters;
  cuda::FwdLaunch l{};
};

void Stage(const Problem& pr, const Case& c, Staged* st) {
  AttnParams p = pr.p;
  CUDA_OK(st->q.Up(pr.q16));
  CUDA_OK(st->k.Up(pr.k16));
  CUDA_OK(st->v.Up(pr.v16));
  CUDA_OK(cudaMalloc(&st->o.ptr, std::max<int64_t>(1, p.total_q * c.hq * c.d) * 2));
  CUDA_OK(cudaMalloc(&st->lse.ptr, std::max<int64_t>(1, p.total_q * c.hq) * 4));
  CUDA_OK(cudaMemset(st->o.ptr, 0xff, std::max<int64_t>(1, p.total_q * c.hq * c.d) * 2));  // NaN
  CUDA_OK(cudaMemset(st->lse.ptr, 0xff, std::max<int64_t>(1, p.total_q * c.hq) * 4));
  CUDA_OK(st->cu_q.Up(pr.cu_q));
  CUDA_OK(st->cu_k.Up(pr.cu_k));
  CUDA_OK(st->slopes.Up(pr.slopes));
  CUDA_OK(st->sinks.Up(pr.sinks));
  // The schedule's counters, then (varlen block mask) the per-sequence
  // offsets LaunchForward would stage (mods_prefix.h), summed here on the host.
  // A block mask: the item order after them (the kernel's pre-pass writes it).
  const int64_t ws_bytes = std::max(cuda::kSplitCounterBytes + cuda::ModsPrefixBytes(p),
                                    cuda::ItemOrderOffset(p) + cuda::ItemOrderBytes(p));
  CUDA_OK(cudaMalloc(&st->counters.ptr, ws_bytes));
  CUDA_OK(cudaMemset(st->counters.ptr, 0, cuda::kSplitCounterBytes));
  if (cuda::NeedsModsPrefix(p)) {
    std::vector<int64_t> prefix(2 * (int64_t{p.batch} + 1), 0);
    for (int b = 0; b < p.batch; ++b) {
      prefix[b + 1] = prefix[b] + int64_t{SeqLenQ(p, b)} * SeqLenK(p, b);
      prefix[p.batch + 2 + b] = prefix[p.batch + 1 + b] + BlockRowsOf(p, b);
    }
    CUDA_OK(cudaMemcpy(static_cast<char*>(st->counters.ptr) + cuda::kModsPrefixOffset,
                       prefix.data(), prefix.size() * 8, cudaMemcpyHostToDevice));
  }
  p.q = st->q.ptr;
  p.k = st->k.ptr;
  p.v = st->v.ptr;
  p.o = st->o.ptr;
  p.lse = st->lse.As<float>();
  p.cu_seqlens_q = pr.cu_q.empty() ? nullptr : st->cu_q.As<int32_t>();
  p.cu_seqlens_k = pr.cu_k.empty() ? nullptr : st->cu_k.As<int32_t>();
  p.alibi_slopes = pr.slopes.empty() ? nullptr : st->slopes.As<float>();
  p.sinks = pr.sinks.empty() ? nullptr : st->sinks.As<float>();
  if (HasBlockMask(p)) {
    CUDA_OK(st->row_ptr.Up(pr.row_ptr));
    // An empty column list still needs a valid pointer.
    std::vector<int32_t> cols = pr.col_idx;
    if (cols.empty()) cols.push_back(0);
    CUDA_OK(st->col_idx.Up(cols));
    p.block_row_ptr = st->row_ptr.As<int32_t>();
    p.block_col_idx = st->col_idx.As<int32_t>();
  }
  cuda::FwdLaunch& l = st->l;
  l.p = p;
  l.num_splits = 1;
  l.pack_gqa = 1;
  l.num_m_blocks = (p.seqlen_q + 127) / 128;
  l.scale_log2 = p.softmax_scale * kLog2e;
  l.softcap_in = p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f;
  l.softcap_out = p.softcap * kLog2e;
  l.item_counters = st->counters.As<int>();
  l.tile_kind = TileKind::kPrefill;
}

// Head dims this build did not compile (ATTNSERVE_CUDA_KERNELS=dev) are
// never referenced, so the test links with either kernel set; their cases skip.
template <int D, typename T>
cudaError_t RunTyped(const cuda::FwdLaunch& l, cudaStream_t s) {
  if constexpr (cuda::CompiledSm90HeadDim(D)) {
    if (IsBanded(l.p)) {
      return cuda::RunAttnFwdSm90<D, T, true, cuda::kDefaultSm90Schedule, false, false>(l, s);
    }
    return cuda::RunAttnFwdSm90<D, T, false, cuda::kDefaultSm90Schedule, false, false>(l, s);
  } else {
    return cudaErrorNotYetImplemented;
  }
}

template <int D>
cudaError_t RunD(const cuda::FwdLaunch& l, cudaStream_t s) {
  return l.p.dtype == DType::kBF16 ? RunTyped<D, __nv_bfloat16>(l, s) : RunTyped<D, __half>(l, s);
}

cudaError_t RunSm90(const cuda::FwdLaunch& l, cudaStream_t s = nullptr) {
  switch (l.p.head_dim) {
    case 64: return RunD<64>(l, s);
    case 256: return RunD<256>(l, s);
    default: return RunD<128>(l, s);
  }
}

bool Compiled(int d) { return cuda::CompiledSm90HeadDim(d); }

class Sm90ModsTest : public ::testing::TestWithParam<Case> {};

// The block-masked launch's item order (the workspace after the staged
// offsets; an entry per item: the item and its walk of the block mask):
// every item exactly once; without a band, each item's walk as WalkBlockRow
// would find it (its kept blocks' key tiles below the sequence's last, the
// run's top entry, the tiles of the top block past that), and each query
// head's items in the head's own segment by their kept blocks, most first
// (items past their sequence's rows count 0).
void CheckItemOrder(const Problem& pr, const Case& c, const Staged& st) {
  const AttnParams& p = pr.p;
  const int nmb = st.l.num_m_blocks;
  const int64_t items = int64_t{nmb} * p.batch * p.num_heads_q;
  ASSERT_GE(cuda::ItemOrderBytes(p), items * 16);
  std::vector<int32_t> order(items * 4);
  CUDA_OK(cudaMemcpy(order.data(),
                     static_cast<const char*>(st.counters.ptr) + cuda::ItemOrderOffset(p),
                     items * 16, cudaMemcpyDeviceToHost));
  std::vector<int> seen(items, 0);
  for (int64_t j = 0; j < items; ++j) {
    const int32_t i = order[4 * j];
    ASSERT_TRUE(i >= 0 && i < items) << "item " << i << " of " << items;
    ++seen[i];
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), items) << "an item drawn twice or never";
  if (IsBanded(p)) return;  // walks inside the band: the kernel's results check them
  const int64_t per_head = int64_t{nmb} * p.batch;
  const int block_n = cuda::Sm90TileFor(c.d).block_n, tpb = p.block_k / block_n;
  // Item i's CSR row, or -1 past its sequence's rows.
  auto row_of = [&](int64_t i) -> int64_t {
    const int h = static_cast<int>(i / per_head);
    const int b = static_cast<int>(i % per_head / nmb), m = static_cast<int>(i % nmb);
    if (m * 128 >= SeqLenQ(p, b)) return -1;
    return BlockRow(p, BlockRowsBefore(p, b), b, h, m * 128 / p.block_q);
  };
  auto kept = [&](int64_t i) {
    const int64_t row = row_of(i);
    return row < 0 ? 0 : pr.row_ptr[row + 1] - pr.row_ptr[row];
  };
  int64_t bad_walks = 0;
  for (int64_t j = 0; j < items; ++j) {
    const int32_t* e = &order[4 * j];
    const int64_t row = row_of(e[0]);
    if (row < 0) continue;  // not drawn into work
    const int b = static_cast<int>(e[0] % per_head / nmb);
    const int n_end = (SeqLenK(p, b) + block_n - 1) / block_n;
    const int e0 = pr.row_ptr[row], e1 = pr.row_ptr[row + 1];
    int tiles = 0;
    for (int x = e0; x < e1; ++x) {
      tiles += std::max(0, std::min(n_end, (pr.col_idx[x] + 1) * tpb) - pr.col_idx[x] * tpb);
    }
    const int excess = e1 > e0 ? std::max(0, (pr.col_idx[e1 - 1] + 1) * tpb - n_end) : 0;
    if (e[1] != tiles || (e1 > e0 && (e[2] != e1 - 1 || e[3] != excess))) ++bad_walks;
  }
  EXPECT_EQ(bad_walks, 0) << c.name << ": walks other than WalkBlockRow's";
  int64_t out_of_order = 0, other_head = 0;
  for (int64_t j = 0; j < items; ++j) {
    if (j % per_head != 0 && kept(order[4 * j]) > kept(order[4 * (j - 1)])) ++out_of_order;
    if (order[4 * j] / per_head != j / per_head) ++other_head;
  }
  EXPECT_EQ(out_of_order, 0) << c.name << ": items not longest first";
  EXPECT_EQ(other_head, 0) << c.name << ": an item outside its head's segment";
}

TEST_P(Sm90ModsTest, MatchesFloat64Reference) {
  if (!HaveSm90()) GTEST_SKIP() << "no sm90 GPU";
  const Case& c = GetParam();
  if (!Compiled(c.d)) GTEST_SKIP() << "head dim " << c.d << " not in this build's kernel set";
  const Problem pr = Build(c, 1234u + static_cast<uint32_t>(std::hash<std::string>()(c.name)));
  Staged st;
  Stage(pr, c, &st);
  if (HasFatalFailure()) return;
  // Twice: the second launch also checks the dynamic scheduler's counters
  // came back to zero.
  for (int rep = 0; rep < 2; ++rep) {
    CUDA_OK(RunSm90(st.l));
    CUDA_OK(cudaDeviceSynchronize());
  }
  const AttnParams& p = pr.p;
  if (HasBlockMask(p)) CheckItemOrder(pr, c, st);
  std::vector<uint16_t> o16(p.total_q * c.hq * c.d);
  std::vector<float> lse(p.total_q * c.hq);
  CUDA_OK(cudaMemcpy(o16.data(), st.o.ptr, o16.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(lse.data(), st.lse.ptr, lse.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<double> ro, rl;
  Reference(pr, c, &ro, &rl);
  double num = 0, den = 0, max_err = 0, lse_err = 0;
  int64_t bad = 0;
  for (size_t i = 0; i < o16.size(); ++i) {
    const double x = c.dtype == DType::kBF16 ? Bf16ToFloat(o16[i]) : Fp16ToFloat(o16[i]);
    if (!std::isfinite(x)) ++bad;
    num += (x - ro[i]) * (x - ro[i]);
    den += ro[i] * ro[i];
    max_err = std::max(max_err, std::abs(x - ro[i]));
  }
  int64_t lse_bad = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(rl[i]) || std::isinf(lse[i])) {
      if (!(std::isinf(rl[i]) && std::isinf(lse[i]) && rl[i] < 0 && lse[i] < 0)) ++lse_bad;
    } else {
      lse_err = std::max(lse_err, std::abs(lse[i] - rl[i]));
    }
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const bool bf16 = c.dtype == DType::kBF16;
  EXPECT_EQ(bad, 0) << "non-finite O elements";
  EXPECT_EQ(lse_bad, 0) << "LSE -inf where the reference has keys or a sink, or the reverse";
  EXPECT_LE(rel, bf16 ? 1e-2 : 2e-3) << "relative L2 error of O";
  EXPECT_LE(max_err, bf16 ? 2.5e-2 : 4e-3) << "max abs error of O";
  EXPECT_LE(lse_err, 2e-3) << "max abs error of LSE";
  int64_t kept = static_cast<int64_t>(pr.col_idx.size());
  RecordProperty("kept_blocks", std::to_string(kept));
}

std::vector<Case> Cases() {
  std::vector<Case> v;
  auto name = [](const Case& c, const std::string& extra) {
    return std::string(c.dtype == DType::kBF16 ? "bf16" : "fp16") + "_d" + std::to_string(c.d) +
           (c.causal ? "_causal" : "") + "_" + extra;
  };
  for (int d : {64, 128})
    for (DType t : {DType::kBF16, DType::kFP16})
      for (bool causal : {false, true}) {
        // One sequence of `sq` queries and `sk` keys at this grid point.
        auto one = [&](int sq, int sk) {
          Case c;
          c.d = d;
          c.dtype = t;
          c.causal = causal;
          c.seq_q = {sq};
          c.seq_k = {sk};
          return c;
        };
        for (double dens : {0.0, 0.05, 0.25, 0.5, 1.0}) {
          Case c = one(700, 700);
          c.density = dens;
          c.name = name(c, "random" + std::to_string(static_cast<int>(dens * 100)));
          v.push_back(c);
        }
        Case s = one(640, 1000);
        s.density = 0.25;
        s.pattern = "stripes";
        s.name = name(s, "stripes25_q640_k1000");
        v.push_back(s);
        // ALiBi + sinks without a block mask, then with one.
        Case a = one(333, 333);
        a.alibi = a.sinks = true;
        a.name = name(a, "alibi_sinks");
        v.push_back(a);
        a.density = 0.5;
        a.name = name(a, "alibi_sinks_random50");
        v.push_back(a);
      }
  // Block sizes above the grain; rows with no kept block (with and without sinks).
  {
    Case c;
    c.seq_q = {900};
    c.seq_k = {1100};
    c.density = 0.5;
    c.block_q = 256;
    c.block_k = 384;
    c.name = "bf16_d128_random50_bq256_bk384";
    v.push_back(c);
    c.causal = true;
    c.block_q = 384;
    c.block_k = 256;
    c.name = "bf16_d128_causal_random50_bq384_bk256";
    v.push_back(c);
    c.causal = false;
    c.block_q = c.block_k = 128;
    c.pattern = "rows";
    c.density = 0.6;
    c.name = "bf16_d128_empty_rows";
    v.push_back(c);
    c.sinks = true;
    c.name = "bf16_d128_empty_rows_sinks";
    v.push_back(c);
    c.d = 64;
    c.dtype = DType::kFP16;
    c.density = 0.0;
    c.name = "fp16_d64_density0_sinks";
    v.push_back(c);
  }
  // Varlen (an empty sequence, one shorter than a tile, one past a tile's end).
  for (bool causal : {false, true})
    for (int d : {64, 128}) {
      Case c;
      c.d = d;
      c.causal = causal;
      c.seq_q = {300, 0, 129, 513, 60};
      c.seq_k = {300, 7, 700, 513, 900};
      c.density = 0.5;
      c.name = std::string("bf16_d") + std::to_string(d) + (causal ? "_causal" : "") +
               "_varlen_random50";
      v.push_back(c);
      c.alibi = c.sinks = true;
      c.density = 0.25;
      c.dtype = DType::kFP16;
      c.name = std::string("fp16_d") + std::to_string(d) + (causal ? "_causal" : "") +
               "_varlen_alibi_sinks_random25";
      v.push_back(c);
    }
  // Sq > Sk causal: the first rows see no key (O = 0; LSE = -inf or the sink).
  for (bool sinks : {false, true}) {
    Case c;
    c.causal = true;
    c.seq_q = {900};
    c.seq_k = {300};
    c.sinks = sinks;
    c.alibi = true;
    c.density = 0.5;
    c.name = std::string("bf16_d128_causal_q900_k300_alibi") + (sinks ? "_sinks" : "");
    v.push_back(c);
  }
  // D 256: 64-key tiles, two per 128-key block (the walk steps inside a block).
  for (bool causal : {false, true}) {
    Case c;
    c.d = 256;
    c.causal = causal;
    c.seq_q = {500};
    c.seq_k = {700};
    c.density = 0.5;
    c.alibi = c.sinks = causal;
    c.name = std::string("bf16_d256") + (causal ? "_causal_alibi_sinks" : "") + "_random50";
    v.push_back(c);
  }
  // Sliding window + softcap + ALiBi with a block mask.
  {
    Case c;
    c.d = 64;
    c.seq_q = {1000};
    c.seq_k = {1000};
    c.window_left = 300;
    c.causal = true;
    c.softcap = 20.f;
    c.alibi = true;
    c.density = 0.5;
    c.pattern = "stripes";
    c.name = "bf16_d64_window300_softcap_alibi_stripes50";
    v.push_back(c);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Sm90, Sm90ModsTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

// What the kernel refuses: an additive bias or element mask (not in this
// kernel), and key blocks its key tiles would straddle (checked with
// Sm90BlockMaskFits: 112- and 192-key tiles).
TEST(Sm90ModsRefusals, BiasAndStraddlingBlocks) {
  EXPECT_TRUE(cuda::Sm90BlockMaskFits(128, 128, 128));
  EXPECT_TRUE(cuda::Sm90BlockMaskFits(64, 256, 384));
  EXPECT_FALSE(cuda::Sm90BlockMaskFits(112, 128, 128));
  EXPECT_FALSE(cuda::Sm90BlockMaskFits(192, 128, 256));
  EXPECT_TRUE(cuda::Sm90BlockMaskFits(192, 128, 384));
  if (!HaveSm90()) GTEST_SKIP() << "no sm90 GPU";
  Case c;
  c.seq_q = {200};
  c.seq_k = {200};
  const Problem pr = Build(c, 7);
  Staged st;
  Stage(pr, c, &st);
  if (HasFatalFailure()) return;
  cuda::FwdLaunch l = st.l;
  // A bias of another dtype than FP32/FP16/BF16 (never read: refused first).
  float bias = 0.f;
  l.p.bias = &bias;
  l.p.bias_dtype = DType::kFP8E4M3;
  EXPECT_EQ(RunSm90(l), cudaErrorNotSupported);
  cudaGetLastError();
}

// The timing table: dense (the plain kernel) vs block masks of kept fraction
// s (random per head; local + global stripes shared by the heads), B 1, H 16,
// non-causal BF16. Only with SM90_BS_TIMING=1.
double TimeMs(const cuda::FwdLaunch& l, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) RunSm90(l);
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    RunSm90(l);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    ts.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

TEST(Sm90ModsTiming, DenseVsBlockSparse) {
  const char* on = std::getenv("SM90_BS_TIMING");
  if (on == nullptr || std::string(on) != "1") GTEST_SKIP() << "SM90_BS_TIMING=1 times";
  if (!HaveSm90()) GTEST_SKIP() << "no sm90 GPU";
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::string csv = "gpu,d,n,pattern,s_target,s_kept,ms,dense_ms,ratio_to_s_dense\n";
  std::printf("GPU: %s\n%4s %6s %8s %6s %7s %9s %9s %8s\n", prop.name, "D", "N", "pattern", "s",
              "kept", "ms", "dense_ms", "t/(s*td)");
  for (int d : {64, 128})
    for (int n : {8192, 16384}) {
      if (!Compiled(d)) continue;
      Case c;
      c.d = d;
      c.batch = 1;
      c.hq = c.hkv = 16;
      c.seq_q = {n};
      c.seq_k = {n};
      Problem pr = Build(c, 99);
      Staged dense;
      Stage(pr, c, &dense);
      if (HasFatalFailure()) return;
      const double dense_ms = TimeMs(dense.l, 10);
      auto row = [&](const std::string& pat, double s, double kept, double ms) {
        const double ratio = kept > 0 ? ms / (kept * dense_ms) : 0;
        std::printf("%4d %6d %8s %6.2f %7.4f %9.3f %9.3f %8.3f\n", d, n, pat.c_str(), s, kept, ms,
                    dense_ms, ratio);
        char buf[1400];
        std::snprintf(buf, sizeof buf, "%s,%d,%d,%s,%.2f,%.4f,%.4f,%.4f,%.4f\n", prop.name, d, n,
                      pat.c_str(), s, kept, ms, dense_ms, ratio);
        csv += buf;
      };
      row("dense", 1.0, 1.0, dense_ms);
      for (const std::string pat : {"random", "stripes"})
        for (double s : {1.0, 0.5, 0.25, 0.1, 0.05}) {
          if (pat == "stripes" && s == 1.0) continue;
          Case m = c;
          m.density = s;
          m.pattern = pat;
          // Reuse the dense inputs; only the CSR is new.
          Problem mp = Build(m, 99, /*inputs=*/false);
          const int64_t blocks = BlockMaskRows(mp.p) * ((n + 127) / 128);
          const double kept = static_cast<double>(mp.col_idx.size()) / blocks;
          Dev rp, ci;
          CUDA_OK(rp.Up(mp.row_ptr));
          std::vector<int32_t> cols = mp.col_idx;
          if (cols.empty()) cols.push_back(0);
          CUDA_OK(ci.Up(cols));
          cuda::FwdLaunch l = dense.l;
          l.p.block_q = l.p.block_k = 128;
          l.p.block_per_head = mp.p.block_per_head;
          l.p.block_per_batch = mp.p.block_per_batch;
          l.p.block_row_ptr = rp.As<int32_t>();
          l.p.block_col_idx = ci.As<int32_t>();
          CUDA_OK(RunSm90(l));
          CUDA_OK(cudaDeviceSynchronize());
          row(pat, s, kept, TimeMs(l, 10));
        }
    }
  if (const char* path = std::getenv("SM90_BS_CSV")) {
    if (FILE* f = std::fopen(path, "w")) {
      std::fputs(csv.c_str(), f);
      std::fclose(f);
    }
  }
}

}  // namespace
}  // namespace attnserve
