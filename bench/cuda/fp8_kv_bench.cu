// fp8_kv_bench: one paged decode step over a BF16 cache and over an FP8 cache
// of the same K/V, in one process (scripts/device/fp8-kv-bench.sh). Both
// caches are filled by the GPU append (the FP8 one quantising on the device,
// as serving does); the BF16 step is the production paged decode (the planner
// picks the Hopper decode kernel where it runs), the FP8 step the FP8 cache's
// kernel. Each is timed with CUDA events around every launch (median of
// --iters after --warmup). Checked: for --check_seqs sequences, the FP8
// output against the float64 reference over the dequantised cache (the host
// quantises the same rows; tolerance.h's FP8 cache rule) and the BF16 output
// against its own reference (BF16 rule). Prints a table; --csv writes it.
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
#include <vector>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_plan.h"
#include "backend/cuda/paged_attn.h"
#include "backend/cuda/paged_attn_fp8.h"
#include "backend/kv_quantize.h"
#include "backend/make_params.h"
#include "backend/paged_kv.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "common/dtype.h"

namespace attnserve {
namespace {

#define CK(x)                                                                                  \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

struct Flags {
  int b = 64, sk = 8192, hq = 32, hkv = 8, d = 128, page = 64, iters = 50, warmup = 5;
  int check_seqs = 2;
  int simt = 1;       // time the SIMT kernel too
  int invariant = 0;  // and the batch-invariant plan
  std::string csv;
};

void* DeviceCopy(const void* host, size_t bytes) {
  void* d = nullptr;
  CK(cudaMalloc(&d, std::max<size_t>(bytes, 256)));
  // No host bytes: an output buffer, zeroed.
  if (bytes > 0 && host == nullptr) CK(cudaMemset(d, 0, bytes));
  if (bytes > 0 && host != nullptr) CK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
  return d;
}

// A cache of B sequences of sk tokens in shuffled pages over >= 4 slabs.
PagedAttnParams MakeCache(const Flags& f, const AttnParams& base, bool fp8,
                          std::vector<void*>* owned) {
  PagedAttnParams pp{};
  pp.attn = base;
  KvPages& kv = pp.pages;
  kv.page_size = f.page;
  while ((1 << kv.page_shift) < f.page) ++kv.page_shift;
  kv.fp8_e4m3 = fp8;
  const int per_seq = (f.sk + f.page - 1) / f.page;
  const int64_t pages = int64_t{f.b} * per_seq;
  while ((int64_t{1} << kv.slab_shift) * 4 < pages) ++kv.slab_shift;
  kv.num_slabs = static_cast<int>((pages + (1 << kv.slab_shift) - 1) >> kv.slab_shift);
  const int64_t slab_bytes =
      (int64_t{1} << kv.slab_shift) * KvPageBytes(f.page, f.hkv, f.d, DType::kBF16, fp8);
  for (int i = 0; i < kv.num_slabs; ++i) {
    CK(cudaMalloc(&kv.k_slabs[i], size_t(slab_bytes)));
    CK(cudaMalloc(&kv.v_slabs[i], size_t(slab_bytes)));
    owned->push_back(kv.k_slabs[i]);
    owned->push_back(kv.v_slabs[i]);
  }
  pp.block_table_stride = per_seq;  // the caller sets the table
  return pp;
}

double Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Median microseconds of `launch` over f.iters runs after f.warmup.
template <typename F>
double TimeUs(const Flags& f, F launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < f.warmup; ++i) CK(launch());
  std::vector<float> ms;
  for (int i = 0; i < f.iters; ++i) {
    CK(cudaEventRecord(a));
    CK(launch());
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return Median(ms) * 1000.0;
}

struct Check {
  double max_err = 0, tol = 0;
  bool ok = true;
};

// O of sequences [0, n) and the last one (BF16, [B, Hq, D] rows) against
// the float64 reference: over the dequantised cache (fp8) or the BF16 K/V.
Check CheckRows(const Flags& f, const std::vector<uint16_t>& q, const std::vector<uint16_t>& k,
                const std::vector<uint16_t>& v, const std::vector<uint16_t>& o, bool fp8) {
  Check c;
  std::vector<int> seqs;
  for (int s = 0; s < std::min(f.check_seqs, f.b); ++s) seqs.push_back(s);
  if (f.b - 1 >= f.check_seqs) seqs.push_back(f.b - 1);
  const int64_t rows = int64_t{f.sk} * f.hkv;
  for (int s : seqs) {
    const uint16_t* ks = k.data() + int64_t{s} * rows * f.d;
    const uint16_t* vs = v.data() + int64_t{s} * rows * f.d;
    std::vector<uint8_t> ck(static_cast<size_t>(rows * f.d)), cv(ck.size());
    std::vector<float> sk(static_cast<size_t>(rows)), sv(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows && fp8; ++r) {
      sk[size_t(r)] = QuantiseFp8Row(ks, DType::kBF16, r * f.d, f.d, &ck[size_t(r * f.d)]);
      sv[size_t(r)] = QuantiseFp8Row(vs, DType::kBF16, r * f.d, f.d, &cv[size_t(r * f.d)]);
    }
    AttnPointers ptr;
    ptr.q = q.data() + int64_t{s} * f.hq * f.d;
    ptr.k = fp8 ? static_cast<const void*>(ck.data()) : ks;
    ptr.v = fp8 ? static_cast<const void*>(cv.data()) : vs;
    AttnOptions options;
    options.causal = true;
    const AttnParams p =
        MakeAttnParams(DenseShape(DType::kBF16, 1, 1, f.sk, f.hq, f.hkv, f.d), options, ptr);
    const KvRowScales scales{sk.data(), sv.data()};
    const ReferenceOutput ref = fp8 ? ReferenceAttention(p, scales) : ReferenceAttention(p);
    const ReferenceOutput lowp =
        fp8 ? ReferenceAttentionLowPrecision(p, scales) : ReferenceAttentionLowPrecision(p);
    double lowp_err = 0, err = 0;
    for (size_t i = 0; i < ref.o.size(); ++i) {
      lowp_err = std::max(lowp_err, std::fabs(lowp.o[i] - ref.o[i]));
      const double got = Bf16ToFloat(o[size_t(int64_t{s} * f.hq * f.d) + i]);
      err = std::max(err, std::fabs(got - ref.o[i]));
      if (!std::isfinite(got)) err = INFINITY;
    }
    const double tol = 2 * lowp_err + tolerance::kBf16OutputFloor;
    c.max_err = std::max(c.max_err, err);
    c.tol = std::max(c.tol, tol);
    c.ok = c.ok && err <= tol;
  }
  return c;
}

int Main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&](const char* name, int* out) {
      const std::string key = std::string("--") + name + "=";
      if (a.rfind(key, 0) != 0) return false;
      *out = std::atoi(a.c_str() + key.size());
      return true;
    };
    if (val("b", &f.b) || val("sk", &f.sk) || val("hq", &f.hq) || val("hkv", &f.hkv) ||
        val("d", &f.d) || val("page", &f.page) || val("iters", &f.iters) ||
        val("warmup", &f.warmup) || val("check_seqs", &f.check_seqs) || val("simt", &f.simt) ||
        val("invariant", &f.invariant))
      continue;
    if (a.rfind("--csv=", 0) == 0) {
      f.csv = a.substr(6);
      continue;
    }
    std::fprintf(
        stderr,
        "usage: fp8_kv_bench [--b=64] [--sk=8192] [--hq=32] [--hkv=8] [--d=128] "
        "[--page=64] [--iters=50] [--warmup=5] [--check_seqs=2] [--simt=1] [--invariant=0] "
        "[--csv=FILE]\n");
    return 2;
  }
  int num_sms = 0;
  CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));

  // Inputs: BF16, standard normal (K scaled by 2 so scores spread).
  std::mt19937 rng(2026);
  std::normal_distribution<float> dist;
  auto random_bf16 = [&](int64_t n, float scale) {
    std::vector<uint16_t> x(static_cast<size_t>(n));
    for (uint16_t& e : x) e = FloatToBf16(dist(rng) * scale);
    return x;
  };
  const int64_t kv_rows = int64_t{f.b} * f.sk;
  const std::vector<uint16_t> q = random_bf16(int64_t{f.b} * f.hq * f.d, 1.0f);
  const std::vector<uint16_t> k = random_bf16(kv_rows * f.hkv * f.d, 2.0f);
  const std::vector<uint16_t> v = random_bf16(kv_rows * f.hkv * f.d, 1.0f);
  std::vector<int32_t> cu_q(size_t(f.b) + 1), cu_k(size_t(f.b) + 1), lens(size_t(f.b), f.sk);
  for (int b = 0; b <= f.b; ++b) {
    cu_q[size_t(b)] = b;
    cu_k[size_t(b)] = b * f.sk;
  }
  std::vector<void*> owned;
  void* q_dev = DeviceCopy(q.data(), q.size() * 2);
  void* k_dev = DeviceCopy(k.data(), k.size() * 2);
  void* v_dev = DeviceCopy(v.data(), v.size() * 2);
  void* o_dev = DeviceCopy(nullptr, q.size() * 2);
  int32_t* cu_q_dev = static_cast<int32_t*>(DeviceCopy(cu_q.data(), cu_q.size() * 4));
  int32_t* cu_k_dev = static_cast<int32_t*>(DeviceCopy(cu_k.data(), cu_k.size() * 4));
  int32_t* lens_dev = static_cast<int32_t*>(DeviceCopy(lens.data(), lens.size() * 4));
  owned.insert(owned.end(), {q_dev, k_dev, v_dev, o_dev, cu_q_dev, cu_k_dev, lens_dev});
  const int per_seq = (f.sk + f.page - 1) / f.page;
  std::vector<int32_t> ids;

  AttnShape shape = DenseShape(DType::kBF16, f.b, 1, f.sk, f.hq, f.hkv, f.d);
  shape.cu_seqlens_q = cu_q.data();
  shape.cu_seqlens_k = cu_k.data();
  AttnOptions options;
  options.causal = true;
  AttnParams base = MakeAttnParams(shape, options, {q_dev, k_dev, v_dev, o_dev, nullptr});
  base.cu_seqlens_q = cu_q_dev;
  base.cu_seqlens_k = cu_k_dev;

  struct Row {
    std::string impl;
    double us = 0;
    double gb = 0;
    Check check;
  };
  std::vector<Row> out;
  size_t plan_row = 0;  // the FP8 production plan's row
  for (const bool fp8 : {false, true}) {
    std::vector<void*> slabs;
    PagedAttnParams pp = MakeCache(f, base, fp8, &slabs);
    ids.resize(size_t(int64_t{pp.pages.num_slabs} << pp.pages.slab_shift));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
    ids.resize(size_t(int64_t{f.b} * per_seq));
    int32_t* table = static_cast<int32_t*>(DeviceCopy(ids.data(), ids.size() * 4));
    pp.block_table = table;
    pp.seqlens_k = lens_dev;
    // Fill: append every row (the FP8 append quantises them on the device).
    CK(fp8 ? cuda::LaunchKvAppendFp8(pp, nullptr) : cuda::LaunchKvAppend(pp, nullptr));
    CK(cudaDeviceSynchronize());
    // The decode step: no new rows, one query per sequence.
    std::vector<int32_t> zeros(size_t(f.b) + 1, 0);
    int32_t* cu_new = static_cast<int32_t*>(DeviceCopy(zeros.data(), zeros.size() * 4));
    pp.attn.cu_seqlens_k = cu_new;
    pp.attn.total_k = 0;
    void* ws = nullptr;
    const int64_t elems = kv_rows * f.hkv * f.d;
    const double bytes = fp8 ? 2.0 * (elems + kv_rows * f.hkv * 4) : 2.0 * elems * 2;
    // Times `launch`, then checks the O it leaves (zeroed first).
    auto measure = [&](const std::string& impl, auto launch) {
      Row row;
      row.impl = impl;
      CK(cudaMemset(o_dev, 0, q.size() * 2));
      row.us = TimeUs(f, launch);
      row.gb = bytes / (row.us * 1e3);
      std::vector<uint16_t> o(q.size());
      CK(cudaMemcpy(o.data(), o_dev, o.size() * 2, cudaMemcpyDeviceToHost));
      row.check = CheckRows(f, q, k, v, o, fp8);
      return row;
    };
    if (fp8) {
      // The ablation first (each row adds one technique), the production plan last.
      const Plan plan = cuda::PlanPagedFp8(pp.attn, num_sms);
      if (plan.workspace_bytes > 0) CK(cudaMalloc(&ws, size_t(plan.workspace_bytes)));
      const bool ablate = f.d == 128 && f.hq / f.hkv <= 8;
      if (f.simt) {
        out.push_back(
            measure("fp8_simt", [&] { return cuda::LaunchPagedForwardFp8(pp, nullptr); }));
      }
      if (ablate) {
        for (int variant = 0; variant <= 3; ++variant) {
          const std::string name = variant < 3 ? "fp8_mma_1split_ahead" + std::to_string(variant)
                                               : std::string("fp8_mma_1split_ring4");
          out.push_back(measure(name, [&] {
            return cuda::LaunchPagedFp8DecodeAblation(pp, 1, variant, nullptr, nullptr);
          }));
        }
        const Plan split = cuda::PlanPagedFp8(pp.attn, num_sms);
        if (split.num_splits > 1) {
          // The plan's splits with loads one step ahead.
          out.push_back(
              measure("fp8_mma_" + std::to_string(split.num_splits) + "split_ahead1", [&] {
                return cuda::LaunchPagedFp8DecodeAblation(pp, split.num_splits, 1, ws, nullptr);
              }));
        }
      }
      out.push_back(measure("fp8_mma_plan_" + std::to_string(plan.num_splits) + "split",
                            [&] { return cuda::LaunchPagedForwardFp8(pp, plan, ws, nullptr); }));
      plan_row = out.size() - 1;
      if (f.invariant) {
        AttnParams inv_attn = pp.attn;
        inv_attn.batch_invariant = true;
        const Plan inv = cuda::PlanPagedFp8(inv_attn, num_sms);
        void* inv_ws = nullptr;
        CK(cudaMalloc(&inv_ws, size_t(std::max<int64_t>(inv.workspace_bytes, 256))));
        PagedAttnParams inv_pp = pp;
        inv_pp.attn = inv_attn;
        out.push_back(measure("fp8_mma_invariant_" + std::to_string(inv.num_splits) + "split", [&] {
          return cuda::LaunchPagedForwardFp8(inv_pp, inv, inv_ws, nullptr);
        }));
        cudaFree(inv_ws);
      }
    } else {
      const Plan plan =
          cuda::PlanForward(pp.attn, num_sms, cuda::DeviceRunsSm90Kernels(0), cuda::KvRows::kPages);
      if (plan.workspace_bytes > 0) {
        CK(cudaMalloc(&ws, size_t(plan.workspace_bytes)));
        CK(cuda::ClearSplitCounters(ws, nullptr));
      }
      out.push_back(measure(
          plan.kernel_family == KernelFamily::kPortable ? "bf16_cache_portable" : "bf16_cache_sm90",
          [&] { return cuda::LaunchPagedForward(pp, plan, ws, nullptr); }));
    }
    for (void* p : slabs) cudaFree(p);
    cudaFree(table);
    cudaFree(cu_new);
    if (ws != nullptr) cudaFree(ws);
  }
  for (void* p : owned) cudaFree(p);

  const double ratio = out[plan_row].us / out[0].us;
  std::printf("# %s, %d SMs; B %d x Sk %d, Hq %d / Hkv %d, D %d, pages of %d, BF16 q/o\n",
              prop.name, num_sms, f.b, f.sk, f.hq, f.hkv, f.d, f.page);
  std::printf("%-30s %10s %10s %9s %12s %10s %6s\n", "impl", "time_us", "GB/s", "vs_bf16",
              "max_err", "tol", "check");
  bool ok = true;
  for (const Row& r : out) {
    std::printf("%-30s %10.1f %10.0f %9.3f %12.3e %10.3e %6s\n", r.impl.c_str(), r.us, r.gb,
                r.us / out[0].us, r.check.max_err, r.check.tol, r.check.ok ? "ok" : "FAIL");
    ok = ok && r.check.ok;
  }
  std::printf("fp8 / bf16 kernel time: %.3f (target <= 0.55)\n", ratio);
  if (!f.csv.empty()) {
    FILE* csv = std::fopen(f.csv.c_str(), "w");
    if (csv != nullptr) {
      std::fprintf(csv, "# %s\ngpu,b,sk,hq,hkv,d,page,impl,time_us,gbps,max_err,tol,check,ratio\n",
                   prop.name);
      for (const Row& r : out) {
        std::fprintf(csv, "%s,%d,%d,%d,%d,%d,%d,%s,%.2f,%.1f,%.4e,%.4e,%s,%.4f\n", prop.name, f.b,
                     f.sk, f.hq, f.hkv, f.d, f.page, r.impl.c_str(), r.us, r.gb, r.check.max_err,
                     r.check.tol, r.check.ok ? "ok" : "FAIL", r.us / out[0].us);
      }
      std::fclose(csv);
    }
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) { return attnserve::Main(argc, argv); }
