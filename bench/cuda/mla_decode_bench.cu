// mla_decode_bench: the absorbed-MLA paged decode kernel (backend/cuda/
// paged_mla.h) at DeepSeek's decode shape: one 576-wide K/V head (V its first
// 512 dims), Hq query heads, one new token per sequence, BF16 pages of 64
// tokens in shuffled order. For each (batch, context, Hq) it checks nine
// heads of two sequences against a float64 reference on the host, then times the kernel
// (and the split combine) with CUDA events: median of --iters launches.
// Prints us, GB/s (the cache bytes read once plus Q and O), % of HBM peak
// (from the GPU's name: H200 4.8 TB/s, H100 SXM 3.35 TB/s) and TFLOP/s
// (2 x Hq x keys x (576 + 512) a sequence). Small caches rotate over several
// copies so the timed reads come from HBM, not L2.
// Ablation rows (--ablate=0: none): loads_only, the kernel's stage ring with
// no math (the pipeline's own ceiling); loads+S and +softmax, the first one
// and two of each stage's three phases (what each costs); rows64, the 64-row
// tile on a call whose rows fit a smaller one (what the padding rows cost);
// overlap, each stage's S beside the previous stage's P V (checked too).
// Usage: mla_decode_bench [--iters=50] [--sk=8192] [--splits=N] [--ablate=0]
//        [--csv=FILE]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/paged_mla.h"

#define CK(x)                                                                                 \
  do {                                                                                        \
    const cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace {

using namespace attnserve;

constexpr int kD = 576, kDv = 512, kPage = 64;

float Bf(uint16_t x) {
  uint32_t u = uint32_t{x} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t ToBf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct Row {
  int batch, sk, hq;
};

double PeakGBs(const std::string& name) {
  if (name.find("H200") != std::string::npos) return 4800.0;
  if (name.find("H100") != std::string::npos) return 3350.0;
  return 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 50, sk_arg = 8192, force_splits = 0;
  bool ablate = true;
  std::string csv;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--iters=", 0) == 0) iters = std::atoi(a.c_str() + 8);
    if (a.rfind("--sk=", 0) == 0) sk_arg = std::atoi(a.c_str() + 5);
    if (a.rfind("--splits=", 0) == 0) force_splits = std::atoi(a.c_str() + 9);
    if (a.rfind("--csv=", 0) == 0) csv = a.substr(6);
    if (a == "--ablate=0") ablate = false;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double peak = PeakGBs(prop.name);
  std::printf("# %s, %d SMs, L2 %d MB, HBM peak %s\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, peak > 0 ? std::to_string(peak).c_str() : "unknown");
  FILE* out = csv.empty() ? nullptr : std::fopen(csv.c_str(), "w");
  if (out) std::fprintf(out, "batch,sk,hq,splits,us,gbs,pct_hbm,tflops,max_err\n");
  std::printf("%6s %6s %4s %6s %9s %8s %6s %8s %9s\n", "batch", "sk", "hq", "splits", "us", "GB/s",
              "%HBM", "TFLOP/s", "rel_err");

  const std::vector<Row> rows = {{64, sk_arg, 16},  {64, sk_arg, 32}, {64, sk_arg, 64},
                                 {64, sk_arg, 128}, {1, sk_arg, 16},  {1, sk_arg, 64},
                                 {1, sk_arg, 128}};
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  for (const Row& r : rows) {
    const int pages_per_seq = (r.sk + kPage - 1) / kPage;
    // Copies of the whole cache so one step's bytes exceed L2 twice over.
    const int64_t cache_bytes = int64_t{r.batch} * pages_per_seq * kPage * kD * 2;
    const int copies =
        static_cast<int>(std::max<int64_t>(1, (2 * int64_t{prop.l2CacheSize}) / cache_bytes + 1));
    const int64_t total_pages = int64_t{copies} * r.batch * pages_per_seq;
    // Slabs: <= 32 of a power of two of pages.
    int slab_shift = 0;
    while ((total_pages + (int64_t{1} << slab_shift) - 1) >> slab_shift > kMaxKvSlabs) ++slab_shift;
    const int64_t per_slab = int64_t{1} << slab_shift;
    const int num_slabs = static_cast<int>((total_pages + per_slab - 1) / per_slab);
    KvPages pages{};
    pages.num_slabs = num_slabs;
    pages.slab_shift = slab_shift;
    pages.page_size = kPage;
    pages.page_shift = 6;
    pages.v_in_k = true;
    const int64_t page_elems = int64_t{kPage} * kD;
    std::vector<std::vector<uint16_t>> host_slabs(num_slabs);
    for (int s = 0; s < num_slabs; ++s) {
      host_slabs[s].resize(size_t(per_slab * page_elems));
      for (auto& x : host_slabs[s]) x = ToBf(uni(rng));
      void* d = nullptr;
      CK(cudaMalloc(&d, host_slabs[s].size() * 2));
      CK(cudaMemcpy(d, host_slabs[s].data(), host_slabs[s].size() * 2, cudaMemcpyHostToDevice));
      pages.k_slabs[s] = d;
    }
    std::vector<int32_t> perm(static_cast<size_t>(total_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int32_t> seqlens(r.batch, r.sk), cu_q(r.batch + 1), cu_k(r.batch + 1, 0);
    for (int b = 0; b <= r.batch; ++b) cu_q[b] = b;
    const int64_t q_elems = int64_t{r.batch} * r.hq * kD;
    std::vector<uint16_t> q(static_cast<size_t>(q_elems));
    for (auto& x : q) x = ToBf(uni(rng));
    int32_t *d_table, *d_seqlens, *d_cuq, *d_cuk;
    void *d_q, *d_o;
    float* d_lse;
    CK(cudaMalloc(&d_table, perm.size() * 4));
    CK(cudaMemcpy(d_table, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_seqlens, seqlens.size() * 4));
    CK(cudaMemcpy(d_seqlens, seqlens.data(), seqlens.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_cuq, cu_q.size() * 4));
    CK(cudaMemcpy(d_cuq, cu_q.data(), cu_q.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_cuk, cu_k.size() * 4));
    CK(cudaMemcpy(d_cuk, cu_k.data(), cu_k.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_q, q.size() * 2));
    CK(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    const int64_t o_elems = int64_t{r.batch} * r.hq * kDv;
    CK(cudaMalloc(&d_o, o_elems * 2));
    CK(cudaMalloc(&d_lse, int64_t{r.batch} * r.hq * 4));

    PagedAttnParams dev{};
    AttnParams& p = dev.attn;
    p.dtype = DType::kBF16;
    p.q = d_q;
    p.o = d_o;
    p.lse = d_lse;
    p.batch = r.batch;
    p.num_heads_q = r.hq;
    p.num_heads_kv = 1;
    p.head_dim = kD;
    p.head_dim_v = kDv;
    p.seqlen_q = 1;
    p.seqlen_k = r.sk;
    p.total_q = r.batch;
    p.total_k = 0;
    p.cu_seqlens_q = d_cuq;
    p.cu_seqlens_k = d_cuk;
    p.softmax_scale = 1.0f / std::sqrt(192.0f);
    p.softmax_scale_log2 = p.softmax_scale * 1.4426950408889634f;
    p.softcap = 0.0f;
    p.is_causal = false;
    p.window_left = kNoWindow;
    p.window_right = kNoWindow;
    dev.pages = pages;
    dev.block_table_stride = pages_per_seq;
    dev.seqlens_k = d_seqlens;
    Plan plan = cuda::PlanPagedMla(p, prop.multiProcessorCount);
    if (force_splits > 0) {
      plan.num_splits = force_splits;
      plan.workspace_bytes = cuda::SplitWorkspaceBytes(p, force_splits);
    }
    void* ws = nullptr;
    if (plan.workspace_bytes > 0) CK(cudaMalloc(&ws, plan.workspace_bytes));
    auto table_of = [&](int copy) { return d_table + int64_t{copy} * r.batch * pages_per_seq; };

    // variant: 0 the production launch; else 10 x rows a CTA + phases run
    // (LaunchPagedMlaAblation: 0 loads alone, 1 + S, 2 + softmax, 3 all; 4:
    // all, on the overlapped loop).
    auto launch = [&](int variant) {
      if (variant == 0) return cuda::LaunchPagedMla(dev, plan, ws, nullptr);
      const int phases = variant % 10;
      return cuda::LaunchPagedMlaAblation(dev, plan, ws, variant / 10, phases == 4 ? 3 : phases,
                                          phases == 4, nullptr);
    };
    // Check copy 0 after one launch of `variant`: sequences 0 and batch - 1
    // (nine heads each) against float64; O is poisoned first.
    auto check = [&](int variant) {
      dev.block_table = table_of(0);
      CK(cudaMemset(d_o, 0xFF, o_elems * 2));
      CK(launch(variant));
      CK(cudaDeviceSynchronize());
      std::vector<uint16_t> o(static_cast<size_t>(o_elems));
      CK(cudaMemcpy(o.data(), d_o, o.size() * 2, cudaMemcpyDeviceToHost));
      double err2 = 0.0, ref2 = 0.0;
      for (int b : {0, r.batch - 1}) {
        std::vector<const uint16_t*> krow(r.sk);
        for (int j = 0; j < r.sk; ++j) {
          const int32_t page = perm[size_t(b) * pages_per_seq + j / kPage];
          krow[j] = host_slabs[page >> slab_shift].data() +
                    (int64_t{page & (per_slab - 1)} * kPage + j % kPage) * kD;
        }
        std::vector<double> s(r.sk), acc(kDv);
        for (int h = 0; h < r.hq; ++h) {
          if (h >= 8 && h != r.hq - 1) continue;  // a few heads: the check is O(sk x D) each
          const uint16_t* qr = q.data() + (int64_t{b} * r.hq + h) * kD;
          double mx = -1e300;
          for (int j = 0; j < r.sk; ++j) {
            double dot = 0.0;
            for (int d = 0; d < kD; ++d) dot += double(Bf(qr[d])) * Bf(krow[j][d]);
            s[j] = dot * p.softmax_scale;
            mx = std::max(mx, s[j]);
          }
          double sum = 0.0;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int j = 0; j < r.sk; ++j) {
            const double w = std::exp(s[j] - mx);
            sum += w;
            for (int d = 0; d < kDv; ++d) acc[d] += w * Bf(krow[j][d]);
          }
          for (int d = 0; d < kDv; ++d) {
            const double ref = acc[d] / sum;
            const double got = Bf(o[(int64_t{b} * r.hq + h) * kDv + d]);
            err2 += (got - ref) * (got - ref);
            ref2 += ref * ref;
          }
        }
      }
      return std::sqrt(err2 / std::max(ref2, 1e-300));
    };

    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const int own_tile = cuda::MlaRowsPerCta(std::min(r.hq, 64));
    std::vector<std::pair<std::string, int>> variants = {{"plan", 0}};
    if (ablate) {
      variants.push_back({"loads_only", own_tile * 10});
      variants.push_back({"loads+S", own_tile * 10 + 1});
      variants.push_back({"+softmax", own_tile * 10 + 2});
      variants.push_back({"overlap", own_tile * 10 + 4});
      if (own_tile != 64) variants.push_back({"rows64", 643});
    }
    for (const auto& [label, variant] : variants) {
      for (int w = 0; w < 5; ++w) {
        dev.block_table = table_of(w % copies);
        CK(launch(variant));
      }
      std::vector<float> ms;
      for (int it = 0; it < iters; ++it) {
        dev.block_table = table_of(it % copies);
        CK(cudaEventRecord(e0));
        CK(launch(variant));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float t = 0.0f;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double us = 1000.0 * ms[ms.size() / 2];
      const double bytes =
          double(r.batch) * r.sk * kD * 2 + double(r.batch) * r.hq * (kD + kDv) * 2;
      const double gbs = bytes / us / 1e3;
      const double flops = 2.0 * r.batch * r.hq * double(r.sk) * (kD + kDv);
      const double tflops = flops / us / 1e6;
      const double pct = peak > 0 ? 100.0 * gbs / peak : 0.0;
      const bool checked = variant == 0 || variant % 10 >= 3;  // every full-math variant
      const double rel = checked ? check(variant) : 0.0;
      char err_text[32] = "-";
      if (checked) std::snprintf(err_text, sizeof(err_text), "%.2e", rel);
      std::printf("%-11s %6d %6d %4d %6d %9.1f %8.0f %6.1f %8.1f %9s%s\n", label.c_str(), r.batch,
                  r.sk, r.hq, plan.num_splits, us, gbs, pct, tflops, err_text,
                  checked && !(rel < 1e-2) ? "  CHECK FAILED" : "");
      if (out) {
        std::fprintf(out, "%s,%d,%d,%d,%d,%.2f,%.1f,%.2f,%.2f,%.3e\n", label.c_str(), r.batch, r.sk,
                     r.hq, plan.num_splits, us, gbs, pct, tflops, checked ? rel : 0.0);
      }
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    if (ws) CK(cudaFree(ws));
    for (int s = 0; s < num_slabs; ++s) CK(cudaFree(pages.k_slabs[s]));
    for (void* ptr :
         {static_cast<void*>(d_table), static_cast<void*>(d_seqlens), static_cast<void*>(d_cuq),
          static_cast<void*>(d_cuk), d_q, d_o, static_cast<void*>(d_lse)}) {
      CK(cudaFree(ptr));
    }
  }
  if (out) std::fclose(out);
  return 0;
}
