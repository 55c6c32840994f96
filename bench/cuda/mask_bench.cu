// mask_bench: what the score modifiers and masks cost in the CUDA backend,
// each case against the same shape without them, in one process:
//   sparse: block-sparse masks (blocks of 128 x 128) at kept fractions s,
//           random (per head) or local + global stripes (shared by the heads);
//           the target is time <= 1.15 x s x dense time (+ launch cost).
//   bias:   an additive BF16 bias shared by the heads [1, 1, N, N] or per
//           head [1, H, N, N] (bound by reading it: its TB/s is reported).
//   mods:   ALiBi slopes, sinks, both (target: <= 5% over the plain kernel).
// Every case is first validated against the float64 reference on a small
// shape with the same kinds of modifiers. --mask_dir=DIR writes each block
// mask (row_ptr / col_idx as raw int32) and an index for bench/gpu's peers.
// Timing: CUDA events, L2 flushed before every run, 3 warm-ups, median of 15.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attn_fwd.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "bench/cuda/bench_util.cuh"
#include "common/dtype.h"

namespace attnserve {
namespace {

constexpr int kBlock = 128;

struct Case {
  std::string grid, pattern, mods;  // pattern: dense|random|stripes; mods: none|alibi|...
  int d, b, h, n;
  double s;  // target kept fraction (sparse)
};

// A block mask in CSR form, host side.
struct Csr {
  std::vector<int32_t> row_ptr, col_idx;
  bool per_head = false;
  double kept = 1.0;  // kept fraction of all blocks
};

Csr MakeCsr(const std::string& pattern, int h, int n, double s, uint32_t seed) {
  Csr m;
  const int rows = (n + kBlock - 1) / kBlock, cols = rows;
  m.per_head = pattern == "random";
  const int heads = m.per_head ? h : 1;
  std::mt19937 rng(seed);
  m.row_ptr.push_back(0);
  // Stripes: a local band of w blocks each side of the diagonal plus g
  // global key blocks at the start, sized to keep about s of the blocks.
  const int g = std::max(1, static_cast<int>(std::lround(s * cols / 4)));
  const int w = std::max(1, static_cast<int>(std::lround((s * cols - g + 1) / 2)));
  std::vector<int32_t> all(cols);
  for (int hh = 0; hh < heads; ++hh) {
    for (int r = 0; r < rows; ++r) {
      std::vector<int32_t> row;
      if (pattern == "random") {
        const int k = std::max(1, static_cast<int>(std::lround(s * cols)));
        for (int c = 0; c < cols; ++c) all[c] = c;
        for (int i = 0; i < k; ++i) std::swap(all[i], all[i + rng() % (cols - i)]);
        row.assign(all.begin(), all.begin() + k);
      } else {
        for (int c = 0; c < cols; ++c)
          if (c < g || std::abs(r - c) < w) row.push_back(c);
      }
      std::sort(row.begin(), row.end());
      m.col_idx.insert(m.col_idx.end(), row.begin(), row.end());
      m.row_ptr.push_back(static_cast<int32_t>(m.col_idx.size()));
    }
  }
  m.kept = static_cast<double>(m.col_idx.size()) / (double(heads) * rows * cols);
  return m;
}

// The ALiBi paper's slopes for h heads (a power of two: 2^(-8i/h)).
std::vector<float> AlibiSlopes(int h) {
  std::vector<float> out(h);
  for (int i = 0; i < h; ++i) out[i] = std::pow(2.0f, -8.0f * (i + 1) / h);
  return out;
}

// The device and host memory of one case's modifiers.
struct Mods {
  Csr csr;
  std::vector<float> slopes, sinks;
  AttnMods dev;  // device pointers
  int64_t bias_bytes = 0;
};

bool Upload(Arena* a, const void* src, int64_t bytes, const void** dst) {
  void* p = a->Alloc(bytes);
  if (p == nullptr) return false;
  CK(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
  *dst = p;
  return true;
}

// Builds c's modifiers on the device (bias filled there: at N = 8k per head
// it is gigabytes); small = validation shape (host bias too, into *host_bias).
bool MakeMods(const Case& c, Arena* a, Mods* m, std::vector<uint16_t>* host_bias) {
  if (c.pattern != "dense") {
    m->csr = MakeCsr(c.pattern, c.h, c.n, c.s, 7);
    m->dev.block_q = m->dev.block_k = kBlock;
    m->dev.block_per_head = m->csr.per_head;
    const void* rp;
    const void* ci;
    if (!Upload(a, m->csr.row_ptr.data(), m->csr.row_ptr.size() * 4, &rp) ||
        !Upload(a, m->csr.col_idx.data(), std::max<size_t>(1, m->csr.col_idx.size()) * 4, &ci)) {
      return false;
    }
    m->dev.block_row_ptr = static_cast<const int32_t*>(rp);
    m->dev.block_col_idx = static_cast<const int32_t*>(ci);
  }
  if (c.mods.find("alibi") != std::string::npos) {
    m->slopes = AlibiSlopes(c.h);
    const void* p;
    if (!Upload(a, m->slopes.data(), c.h * 4, &p)) return false;
    m->dev.alibi_slopes = static_cast<const float*>(p);
  }
  if (c.mods.find("sinks") != std::string::npos) {
    m->sinks.resize(c.h);
    for (int i = 0; i < c.h; ++i) m->sinks[i] = 0.5f * (i % 5) - 1.0f;
    const void* p;
    if (!Upload(a, m->sinks.data(), c.h * 4, &p)) return false;
    m->dev.sinks = static_cast<const float*>(p);
  }
  if (c.mods.rfind("bias", 0) == 0) {
    const bool per_head = c.mods == "bias_head";
    const int64_t elems = (per_head ? int64_t{c.h} : 1) * c.n * c.n;
    m->bias_bytes = elems * 2;
    void* p = a->Alloc(m->bias_bytes);
    if (p == nullptr) return false;
    if (host_bias != nullptr) {
      host_bias->resize(elems);
      std::mt19937 rng(11);
      std::uniform_real_distribution<float> u(-2.f, 2.f);
      for (auto& e : *host_bias) e = FloatToBf16(u(rng));
      CK(cudaMemcpy(p, host_bias->data(), m->bias_bytes, cudaMemcpyHostToDevice));
    } else {
      FillRandom<__nv_bfloat16><<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), elems, 5);
    }
    m->dev.bias = p;
    m->dev.bias_dtype = DType::kBF16;
    m->dev.bias_per_head = per_head;
  }
  return true;
}

// Host pointers of the same modifiers (the reference reads host memory).
AttnMods HostMods(const Mods& m, const std::vector<uint16_t>& host_bias) {
  AttnMods h = m.dev;
  if (m.dev.block_q > 0) {
    h.block_row_ptr = m.csr.row_ptr.data();
    h.block_col_idx = m.csr.col_idx.data();
  }
  if (m.dev.alibi_slopes) h.alibi_slopes = m.slopes.data();
  if (m.dev.sinks) h.sinks = m.sinks.data();
  if (m.dev.bias) h.bias = host_bias.data();
  return h;
}

struct Launch {
  AttnParams p{};
  Plan plan;
  void* ws = nullptr;
};

// --sm90_mods: which Hopper kernels a modifier call takes. split (the
// plan's): the register modifiers' kernel or the bias / mask one, unbanded
// without a band; banded: the same kernels, always the banded
// instantiation.
std::string g_sm90_mods = "split";

bool Prepare(const Case& c, bool allow_sm90, const AttnPointers& ptrs, Arena* a, Launch* l) {
  int num_sms = 0;
  CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  l->p =
      MakeAttnParams(DenseShape(DType::kBF16, c.b, c.n, c.n, c.h, c.h, c.d), AttnOptions(), ptrs);
  l->plan = cuda::PlanForward(l->p, num_sms, allow_sm90 && cuda::DeviceRunsSm90Kernels(0));
  if (l->plan.kernel_head_dim == 0) return false;
  if (g_sm90_mods != "split" && HasScoreMods(l->p)) l->plan.banded = true;
  if (l->plan.workspace_bytes > 0) {
    l->ws = a->Alloc(l->plan.workspace_bytes);
    if (l->ws == nullptr) return false;
    CK(cuda::ClearSplitCounters(l->ws, nullptr));
  }
  return true;
}

// Relative L2 error of c's modifiers on a small shape (N = 640: five blocks,
// the last one partial) against the float64 reference; < 2e-2 passes.
bool Validate(Case c, bool allow_sm90, double* err) {
  c.b = 1;
  c.h = 2;
  c.n = 600;
  const int64_t nq = int64_t{c.n} * c.h * c.d;
  std::vector<uint16_t> hq(nq), hk(nq), hv(nq), ho(nq), hbias;
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto* x : {&hq, &hk, &hv})
    for (auto& e : *x) e = FloatToBf16(nd(rng));
  Arena a;
  Mods m;
  if (!MakeMods(c, &a, &m, &hbias)) return false;
  AttnPointers dev;
  const void* dq;
  const void* dk;
  const void* dv;
  if (!Upload(&a, hq.data(), nq * 2, &dq) || !Upload(&a, hk.data(), nq * 2, &dk) ||
      !Upload(&a, hv.data(), nq * 2, &dv)) {
    return false;
  }
  void* dout = a.Alloc(nq * 2);
  if (dout == nullptr) return false;
  dev = {dq, dk, dv, dout, nullptr, TensorDevices{}, m.dev};
  Launch l;
  if (!Prepare(c, allow_sm90, dev, &a, &l)) return false;
  CK(cuda::LaunchForward(l.p, l.plan, l.ws, nullptr));
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(ho.data(), dout, nq * 2, cudaMemcpyDeviceToHost));
  AttnPointers host{hq.data(), hk.data(),       hv.data(),         nullptr,
                    nullptr,   TensorDevices{}, HostMods(m, hbias)};
  const AttnParams hp =
      MakeAttnParams(DenseShape(DType::kBF16, 1, c.n, c.n, c.h, c.h, c.d), AttnOptions(), host);
  const ReferenceOutput ref = ReferenceAttention(hp);
  double num = 0, den = 0;
  for (int64_t i = 0; i < nq; ++i) {
    const double x = LoadAsFloat(ho.data(), DType::kBF16, i);
    if (!std::isfinite(x)) {
      *err = INFINITY;
      return false;
    }
    num += (x - ref.o[i]) * (x - ref.o[i]);
    den += ref.o[i] * ref.o[i];
  }
  *err = std::sqrt(num / std::max(den, 1e-30));
  return *err < 2e-2;
}

// Median milliseconds of c (with or without its modifiers), or < 0 on failure.
double Time(const Case& c, bool with_mods, bool allow_sm90, void* flush, Mods* mods_out,
            std::string* kernel) {
  const int64_t nq = int64_t{c.b} * c.n * c.h * c.d;
  Arena a;
  void* q = a.Alloc(nq * 2);
  void* k = a.Alloc(nq * 2);
  void* v = a.Alloc(nq * 2);
  void* o = a.Alloc(nq * 2);
  if (!q || !k || !v || !o) return -1;
  FillRandom<__nv_bfloat16><<<1024, 256>>>(static_cast<__nv_bfloat16*>(q), nq, 1);
  FillRandom<__nv_bfloat16><<<1024, 256>>>(static_cast<__nv_bfloat16*>(k), nq, 2);
  FillRandom<__nv_bfloat16><<<1024, 256>>>(static_cast<__nv_bfloat16*>(v), nq, 3);
  Mods m;
  if (with_mods && !MakeMods(c, &a, &m, nullptr)) return -1;
  Launch l;
  if (!Prepare(c, allow_sm90, {q, k, v, o, nullptr, TensorDevices{}, m.dev}, &a, &l)) return -1;
  *kernel = l.plan.kernel_family == KernelFamily::kSm90 ? "sm90" : "portable";
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int it = 0; it < 3 + 15; ++it) {
    cudaMemsetAsync(flush, it & 0xff, 256 << 20);
    cudaEventRecord(e0);
    if (cuda::LaunchForward(l.p, l.plan, l.ws, nullptr) != cudaSuccess) return -1;
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (it >= 3) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (cudaGetLastError() != cudaSuccess) return -1;
  std::sort(ms.begin(), ms.end());
  if (mods_out != nullptr) *mods_out = m;
  return ms[ms.size() / 2];
}

void WriteMask(const std::string& dir, const Case& c, const Csr& m, FILE* index) {
  char name[256];
  std::snprintf(name, sizeof(name), "%s_d%d_n%d_s%.2f", c.pattern.c_str(), c.d, c.n, c.s);
  for (const char* part : {"row_ptr", "col_idx"}) {
    const std::string path = dir + "/" + name + "." + part + ".bin";
    FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) return;
    const auto& v = std::string(part) == "row_ptr" ? m.row_ptr : m.col_idx;
    std::fwrite(v.data(), 4, v.size(), f);
    std::fclose(f);
  }
  std::fprintf(index, "%s,%s,%d,%d,%d,%d,%.2f,%.4f,%d\n", name, c.pattern.c_str(), c.d, c.b, c.h,
               c.n, c.s, m.kept, m.per_head ? 1 : 0);
  std::fflush(index);
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  using namespace attnserve;
  std::string grid = "all", out, mask_dir, impls = "ours", dims = "64,128", ns = "8192,16384,32768";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&](const char* f) {
      return a.rfind(f, 0) == 0 ? a.substr(std::strlen(f)) : std::string();
    };
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: mask_bench [--grid=sparse|bias|mods|all] [--impls=ours,portable] [--csv=FILE]\n"
          "                  [--mask_dir=DIR] [--dims=64,128 (sparse grid head dims)]\n"
          "                  [--ns=8192,16384 (sparse grid N)] [--sm90_mods=split|banded]\n"
          "Times block-sparse masks, biases, ALiBi and sinks against the same shapes without\n"
          "them (BF16, CUDA events, L2 flushed, median of 15), each validated first against\n"
          "the float64 reference; CSV rows, one per case.\n");
      return 0;
    }
    if (!val("--grid=").empty()) grid = val("--grid=");
    if (!val("--csv=").empty()) out = val("--csv=");
    if (!val("--mask_dir=").empty()) mask_dir = val("--mask_dir=");
    if (!val("--impls=").empty()) impls = val("--impls=");
    if (!val("--dims=").empty()) dims = val("--dims=");
    if (!val("--ns=").empty()) ns = val("--ns=");
    if (!val("--sm90_mods=").empty()) g_sm90_mods = val("--sm90_mods=");
  }
  if (g_sm90_mods != "split" && g_sm90_mods != "banded") {
    std::fprintf(stderr, "--sm90_mods: split or banded, not %s\n", g_sm90_mods.c_str());
    return 1;
  }
  // Read once, at the first Hopper launch: set before any.
  std::vector<Case> cases;
  const bool all = grid == "all";
  if (all || grid == "sparse") {
    for (int d : {64, 128}) {
      if (dims.find(std::to_string(d)) == std::string::npos) continue;
      for (int n : {8192, 16384, 32768}) {
        if (ns.find(std::to_string(n)) == std::string::npos) continue;
        for (const char* pat : {"random", "stripes"})
          for (double s : {1.0, 0.5, 0.25, 0.1, 0.05})
            cases.push_back({"sparse", pat, "none", d, 1, 2048 / d, n, s});
      }
    }
  }
  if (all || grid == "bias") {
    for (int n : {1024, 2048, 4096, 8192})
      for (const char* m : {"bias_shared", "bias_head"})
        cases.push_back({"bias", "dense", m, 128, std::max(1, 16384 / n), 16, n, 1.0});
  }
  if (all || grid == "mods") {
    for (int n : {1024, 8192})
      for (const char* m : {"alibi", "sinks", "alibi+sinks"})
        cases.push_back({"mods", "dense", m, 128, 16384 / n, 16, n, 1.0});
  }
  FILE* csv = out.empty() ? stdout : std::fopen(out.c_str(), "w");
  FILE* index = nullptr;
  if (!mask_dir.empty()) {
    index = std::fopen((mask_dir + "/index.csv").c_str(), "w");
    if (index) std::fprintf(index, "name,pattern,d,b,h,n,s,kept,per_head\n");
  }
  if (csv == nullptr) return 1;
  std::fprintf(csv,
               "grid,pattern,mods,dtype,d,b,h,n,s,kept,impl,kernel,ms,plain_ms,ratio,"
               "bound_ratio,bias_tbps,valid_err\n");
  void* flush = nullptr;
  if (cudaMalloc(&flush, 256 << 20) != cudaSuccess) return 1;
  int failed = 0, done = 0;
  const size_t runs = (impls.find("ours") != std::string::npos ? 1 : 0) +
                      (impls.find("portable") != std::string::npos ? 1 : 0);
  for (const Case& c : cases) {
    for (const char* impl : {"ours", "portable"}) {
      if (impls.find(impl) == std::string::npos) continue;
      const bool sm90 = std::string(impl) == "ours";
      double err = 0;
      if (!Validate(c, sm90, &err)) {
        std::fprintf(stderr, "FAIL validate %s %s %s d=%d err=%g\n", c.grid.c_str(),
                     c.pattern.c_str(), c.mods.c_str(), c.d, err);
        ++failed;
        continue;
      }
      Mods m;
      std::string kernel, plain_kernel;
      const double plain = Time(c, false, sm90, flush, nullptr, &plain_kernel);
      const double t = Time(c, true, sm90, flush, &m, &kernel);
      if (plain < 0 || t < 0) {
        std::fprintf(stderr, "FAIL time %s d=%d n=%d\n", c.grid.c_str(), c.d, c.n);
        ++failed;
        continue;
      }
      const double kept = c.pattern == "dense" ? 1.0 : m.csr.kept;
      // sparse: t / (kept x plain), the issue's bound is 1.15; others t / plain.
      const double bound = c.grid == "sparse" ? t / (kept * plain) : t / plain;
      const double tbps = m.bias_bytes > 0 ? m.bias_bytes / (t * 1e-3) * 1e-12 : 0.0;
      std::fprintf(csv, "%s,%s,%s,bf16,%d,%d,%d,%d,%.2f,%.4f,%s,%s,%.4f,%.4f,%.3f,%.3f,%.3f,%.2e\n",
                   c.grid.c_str(), c.pattern.c_str(), c.mods.c_str(), c.d, c.b, c.h, c.n, c.s, kept,
                   impl, kernel.c_str(), t, plain, t / plain, bound, tbps, err);
      std::fflush(csv);
      if (index != nullptr && sm90 && c.pattern != "dense") WriteMask(mask_dir, c, m.csr, index);
      std::fprintf(stderr, "mask_bench: %d/%zu runs\r", ++done, cases.size() * runs);
    }
  }
  std::fprintf(stderr, "\nmask_bench: %d failed\n", failed);
  cudaFree(flush);
  if (index) std::fclose(index);
  if (csv != stdout) std::fclose(csv);
  return failed == 0 ? 0 : 2;
}
