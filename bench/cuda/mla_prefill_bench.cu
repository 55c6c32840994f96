// mla_prefill_bench: MLA-shape prefill (Q/K head dim 192, V/O 128 by
// default: DeepSeek-V3's) in the CUDA backend's forward path, at a fixed
// token count (B x N = --tokens) over --ns sequence lengths, --hqs head
// counts (K/V heads = query heads, as DeepSeek-V3's prefill has them),
// causal or not. TFLOP/s counts 2 x B x H x N x N x (Dqk + Dv), halved for
// causal. Each (heads, causal) pair is first validated against the float64
// reference on a small shape (relative L2 error < 2e-2), and the timed
// launch's output is checked finite. --same_dims=1 adds rows of the
// equal-dims kernel at D = Dqk on the same N (V of Dqk: what a caller padding
// V would run), where this build compiled it. Timing: CUDA events, L2
// flushed by a 256 MB memset before every run, 5 warm-ups, median of 25.
// On sm90 every shape also runs on the portable kernel (impl ours_portable;
// --portable=1: that kernel alone; --portable_rows=0: not). --tag names the
// plan's rows (an A/B pass under an environment knob).
// Rows: kind,dtype,dqk,dv,b,hq,hkv,sq,sk,causal,impl,kernel,ms,tflops (CSV).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

struct Args {
  std::vector<int> ns{1024, 2048, 4096, 8192, 16384};
  std::vector<int> hqs{128, 16};
  std::vector<int> causals{0, 1};
  int tokens = 16384;
  int dqk = 192, dv = 128;
  DType dtype = DType::kBF16;
  bool same_dims = false;
  bool portable = false;      // allow_sm90 off: the portable kernels only
  bool portable_rows = true;  // on sm90, the portable kernel's rows beside the plan's
  std::string tag = "ours";   // the impl name of the plan's rows
  std::string csv;
};

std::vector<int> ParseList(const char* s) {
  std::vector<int> out;
  for (const char* p = s; *p != '\0';) {
    out.push_back(std::atoi(p));
    const char* c = std::strchr(p, ',');
    if (c == nullptr) break;
    p = c + 1;
  }
  return out;
}

AttnShape Shape(const Args& a, int b, int n, int h, int dv) {
  AttnShape s = DenseShape(a.dtype, b, n, n, h, h, a.dqk);
  s.head_dim_v = dv == a.dqk ? 0 : dv;
  return s;
}

AttnOptions Options(bool causal) {
  AttnOptions o;
  o.causal = causal;
  return o;
}

struct Launch {
  AttnParams p{};
  Plan plan;
  void* ws = nullptr;
};

// portable: plan without the Hopper family.
bool Prepare(const AttnShape& shape, bool causal, bool portable, const AttnPointers& ptrs,
             Arena* arena, Launch* l) {
  int num_sms = 0;
  CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  l->p = MakeAttnParams(shape, Options(causal), ptrs);
  l->plan = cuda::PlanForward(l->p, num_sms, !portable && cuda::DeviceRunsSm90Kernels(0));
  if (l->plan.kernel_head_dim == 0) return false;
  if (l->plan.workspace_bytes > 0) {
    l->ws = arena->Alloc(l->plan.workspace_bytes);
    if (l->ws == nullptr) return false;
    CK(cuda::ClearSplitCounters(l->ws, nullptr));
  }
  return true;
}

bool Upload(Arena* a, const void* src, int64_t bytes, void** dst) {
  *dst = a->Alloc(bytes);
  if (*dst == nullptr) return false;
  CK(cudaMemcpy(*dst, src, bytes, cudaMemcpyHostToDevice));
  return true;
}

// Relative L2 error of O on a small shape (B 2, N 600, H 2: partial tiles,
// rows past the diagonal) against the float64 reference.
bool Validate(const Args& a, bool causal, bool portable, double* err) {
  const int b = 2, n = 600, h = 2;
  const int64_t nq = int64_t{b} * n * h * a.dqk, nv = int64_t{b} * n * h * a.dv;
  std::vector<uint16_t> hq(nq), hk(nq), hv(nv), ho(nv);
  std::mt19937 rng(1234 + causal);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto round = [&](float x) { return a.dtype == DType::kBF16 ? FloatToBf16(x) : FloatToFp16(x); };
  for (auto* x : {&hq, &hk, &hv})
    for (auto& e : *x) e = round(nd(rng));
  Arena arena;
  void *dq, *dk, *dv;
  if (!Upload(&arena, hq.data(), nq * 2, &dq) || !Upload(&arena, hk.data(), nq * 2, &dk) ||
      !Upload(&arena, hv.data(), nv * 2, &dv)) {
    return false;
  }
  void* dout = arena.Alloc(nv * 2);
  if (dout == nullptr) return false;
  const AttnShape shape = Shape(a, b, n, h, a.dv);
  Launch l;
  if (!Prepare(shape, causal, portable, {dq, dk, dv, dout, nullptr, TensorDevices{}, AttnMods{}},
               &arena, &l)) {
    return false;
  }
  CK(cuda::LaunchForward(l.p, l.plan, l.ws, nullptr));
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(ho.data(), dout, nv * 2, cudaMemcpyDeviceToHost));
  const AttnParams hp = MakeAttnParams(
      shape, Options(causal),
      {hq.data(), hk.data(), hv.data(), nullptr, nullptr, TensorDevices{}, AttnMods{}});
  const ReferenceOutput ref = ReferenceAttention(hp);
  double num = 0, den = 0;
  for (int64_t i = 0; i < nv; ++i) {
    const double x = LoadAsFloat(ho.data(), a.dtype, i);
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

template <typename T>
void Fill(void* x, int64_t n, uint32_t seed) {
  FillRandom<T><<<1024, 256>>>(static_cast<T*>(x), n, seed);
}

// Median milliseconds of B x N x H at V/O head dim dv, or < 0 when this
// build has no kernel for it or a launch failed.
double Time(const Args& a, int b, int n, int h, int dv, bool causal, bool portable, void* flush,
            std::string* kernel) {
  const int64_t nq = int64_t{b} * n * h * a.dqk, nv = int64_t{b} * n * h * dv;
  Arena arena;
  void* q = arena.Alloc(nq * 2);
  void* k = arena.Alloc(nq * 2);
  void* v = arena.Alloc(nv * 2);
  void* o = arena.Alloc(nv * 2);
  if (!q || !k || !v || !o) return -1;
  const bool bf16 = a.dtype == DType::kBF16;
  (bf16 ? Fill<__nv_bfloat16> : Fill<__half>)(q, nq, 1);
  (bf16 ? Fill<__nv_bfloat16> : Fill<__half>)(k, nq, 2);
  (bf16 ? Fill<__nv_bfloat16> : Fill<__half>)(v, nv, 3);
  Launch l;
  if (!Prepare(Shape(a, b, n, h, dv), causal, portable,
               {q, k, v, o, nullptr, TensorDevices{}, AttnMods{}}, &arena, &l)) {
    return -1;
  }
  *kernel = l.plan.kernel_family == KernelFamily::kSm90 ? "sm90" : "portable";
  if (l.plan.num_splits > 1) *kernel += "-split" + std::to_string(l.plan.num_splits);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int it = 0; it < 5 + 25; ++it) {
    cudaMemsetAsync(flush, it & 0xff, 256 << 20);
    cudaEventRecord(e0);
    if (cuda::LaunchForward(l.p, l.plan, l.ws, nullptr) != cudaSuccess) return -1;
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (it >= 5) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  if (cudaGetLastError() != cudaSuccess) return -1;
  // The last run's output: finite everywhere (a launch that wrote nothing
  // would leave the allocation's garbage or zeros, which the validation
  // above catches on its own shape).
  std::vector<uint16_t> out(std::min<int64_t>(nv, 1 << 20));
  if (cudaMemcpy(out.data(), o, out.size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess) return -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(LoadAsFloat(out.data(), a.dtype, static_cast<int64_t>(i)))) return -1;
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const char* s = argv[i];
    auto val = [&](const char* name) -> const char* {
      const size_t n = std::strlen(name);
      return std::strncmp(s, name, n) == 0 && s[n] == '=' ? s + n + 1 : nullptr;
    };
    if (const char* v = val("--ns")) {
      a.ns = ParseList(v);
    } else if (const char* v = val("--hqs")) {
      a.hqs = ParseList(v);
    } else if (const char* v = val("--causal")) {
      a.causals = ParseList(v);
    } else if (const char* v = val("--tokens")) {
      a.tokens = std::atoi(v);
    } else if (const char* v = val("--dqk")) {
      a.dqk = std::atoi(v);
    } else if (const char* v = val("--dv")) {
      a.dv = std::atoi(v);
    } else if (const char* v = val("--dtype")) {
      a.dtype = std::strcmp(v, "fp16") == 0 ? DType::kFP16 : DType::kBF16;
    } else if (const char* v = val("--same_dims")) {
      a.same_dims = std::atoi(v) != 0;
    } else if (const char* v = val("--portable")) {
      a.portable = std::atoi(v) != 0;
    } else if (const char* v = val("--portable_rows")) {
      a.portable_rows = std::atoi(v) != 0;
    } else if (const char* v = val("--tag")) {
      a.tag = v;
    } else if (const char* v = val("--csv")) {
      a.csv = v;
    } else {
      std::fprintf(stderr,
                   "usage: mla_prefill_bench [--ns=1024,...] [--hqs=128,16] [--causal=0,1] "
                   "[--tokens=16384] [--dqk=192] [--dv=128] [--dtype=bf16|fp16] "
                   "[--same_dims=0|1] [--portable=0|1] [--portable_rows=0|1] [--tag=ours] "
                   "[--csv=FILE]\n");
      return 2;
    }
  }
  const char* dn = a.dtype == DType::kBF16 ? "bf16" : "fp16";
  FILE* csv = a.csv.empty() ? nullptr : std::fopen(a.csv.c_str(), "w");
  if (csv != nullptr) {
    std::fprintf(csv, "kind,dtype,dqk,dv,b,hq,hkv,sq,sk,causal,impl,kernel,ms,tflops\n");
  }
  void* flush = nullptr;
  if (cudaMalloc(&flush, 256 << 20) != cudaSuccess) {
    std::fprintf(stderr, "cannot allocate the L2 flush buffer\n");
    return 1;
  }
  int failures = 0;
  // On sm90 the plan's kernel (Hopper where it covers the shape) and the
  // portable one beside it.
  const bool both = !a.portable && a.portable_rows && cuda::DeviceRunsSm90Kernels(0);
  for (int causal : a.causals) {
    for (bool portable : {a.portable, true}) {
      if (portable && !a.portable && !both) continue;
      double err = 0;
      const bool ok = Validate(a, causal != 0, portable, &err);
      std::printf("validate %s %d/%d causal=%d %s: rel L2 err %.2e %s\n", dn, a.dqk, a.dv, causal,
                  portable ? "portable" : "plan", err, ok ? "ok" : "FAILED");
      if (!ok) ++failures;
      if (a.portable) break;
    }
  }
  std::printf("%-6s %5s %4s %6s %6s %-16s %-18s %9s %8s\n", "dtype", "hq", "b", "n", "causal",
              "impl", "kernel", "ms", "TFLOP/s");
  for (int h : a.hqs) {
    for (int n : a.ns) {
      const int b = std::max(1, a.tokens / n);
      for (int causal : a.causals) {
        struct Impl {
          std::string name;
          int dv;
          bool portable;
        };
        std::vector<Impl> impls{{a.tag, a.dv, a.portable}};
        if (both) impls.push_back({"ours_portable", a.dv, true});
        if (a.same_dims) impls.push_back({"ours_same_dims", a.dqk, a.portable});
        for (const auto& [impl, dv, portable] : impls) {
          std::string kernel = "none";
          const double ms = Time(a, b, n, h, dv, causal != 0, portable, flush, &kernel);
          if (ms < 0) {
            std::printf("%-6s %5d %4d %6d %6d %-16s %-18s %9s\n", dn, h, b, n, causal, impl.c_str(),
                        kernel.c_str(), "skipped");
            if (impl == a.tag) ++failures;
            continue;
          }
          // The MLA shape's useful work, for every row (equal-dims rows too).
          const double flops =
              2.0 * b * h * static_cast<double>(n) * n * (a.dqk + a.dv) / (causal ? 2 : 1);
          const double tflops = flops / (ms * 1e-3) * 1e-12;
          std::printf("%-6s %5d %4d %6d %6d %-16s %-18s %9.4f %8.1f\n", dn, h, b, n, causal,
                      impl.c_str(), kernel.c_str(), ms, tflops);
          if (csv != nullptr) {
            std::fprintf(csv, "prefill,%s,%d,%d,%d,%d,%d,%d,%d,%d,%s,%s,%.4f,%.2f\n", dn, a.dqk, dv,
                         b, h, h, n, n, causal, impl.c_str(), kernel.c_str(), ms, tflops);
            std::fflush(csv);
          }
        }
      }
    }
  }
  cudaFree(flush);
  if (csv != nullptr) std::fclose(csv);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) { return attnserve::Main(argc, argv); }
