// attn_bench: attention forward versions side by side, llm.c style. Every
// version is validated against the float64 reference on a small shape of the
// same head dim / dtype / mask before it is timed.
//   standard: materialises S = Q K^T and P = softmax(S) in device memory
//             (cuBLAS strided-batched GEMMs + a row softmax kernel), O = P V.
//   fa1:      the FlashAttention-1 loop order: K/V tiles outer, Q tiles inner,
//             O, m and l read from and written back to device memory every
//             step. Simple fp32 SIMT code: it shows the loop order's traffic,
//             not FA1's tensor-core speed. Run at N <= 1k only (slow).
//   ours:     the production fused kernel (backend/cuda), split-KV for decode;
//             on an sm90 GPU the planner's choice (the Hopper family where it
//             covers the shape; ATTNSERVE_CUDA_PORTABLE=1 turns it off).
//   portable: the portable mma.sync kernel on any GPU (the plan without sm90).
//   varlen:   ours on the shape's rows as a varlen call (B sequences of equal
//             lengths): the varlen path's cost against dense.
//   ours_bi, varlen_bi: ours and varlen planned batch-invariant
//             (AttnParams::batch_invariant): the option's cost.
//   sm90_tma, sm90_ws, sm90_pp, sm90_ppo, sm90_persist, sm90_dynamic (D=128
//             BF16 prefill only, either mask):
//             the Hopper kernel under each warpgroup schedule (Sm90Schedule),
//             the ablation of bench/NOTES-cuda.md.
//   fp8, fp8_qk, fp8_dequant (BF16 prefill shapes): the shape's inputs as
//             FP8 E4M3 codes, run as CudaBackend runs an FP8 call (its pass
//             over V included): fp8 the planner's choice (on sm90 both GEMMs
//             on the codes, Plan::fp8_pv), fp8_qk Q K^T alone on the codes
//             (V dequantised, P V in BF16), fp8_dequant every input
//             dequantised to BF16 first. fp8_poly, fp8_mufu: fp8 with
//             Plan::fp8_poly_exp2 set / clear; fp8_stage: fp8 with
//             Plan::fp8_extra_stage, fp8_poly_stage: fp8_poly with it. fp8_pass, fp8_qk_pass: the
//             pass over the inputs of fp8 / fp8_qk alone (V^T's codes / BF16 V), no kernel; their
//             TFLOP/s column is meaningless, ms is the pass's time.
//   paged16, paged64 (decode shapes): the same K/V scattered by the GPU append
//             kernel into a cache's pages of 16 / 64 tokens (page ids shuffled
//             over several slabs), read by the paged decode kernel through the
//             block tables; on sm90 the planner's choice (the Hopper decode
//             kernel at D = 64/96/128). paged16_portable: the portable one.
// Grids (--grid=): anchor (docs/design.md §5: D 64/128/256 x N 512..16k;
// --ds=64,256 and --ns=1024,8192 keep those of its head dims and lengths),
// quick (its N = 1k and 8k, and the decode grid), decode, all (anchor and
// decode), decodesweep (split-KV: B 1 and 16 x contexts 1k..32k), hdims (D
// 32/96/192 at the anchor shapes, N = 1k and 8k).
// --decode_splits=N overrides the decode split count (a sweep).
// --kv_csv=FILE also writes the decode rows of ours/paged in the K/V
// benchmark's format (bench/results/kv-*.csv: scenario,impl,sequences,
// context,layers,page_size,tokens_per_s,tbps,p50_ms,p99_ms), timed over 100
// runs instead of 25.
// Timing: CUDA events around each run, L2 flushed (a 256 MB memset) before
// every run, 5 warm-ups, median of 25 runs; random inputs. Prints CSV rows in
// docs/design.md §5's format: kind,dtype,d,b,hq,hkv,sq,sk,causal,impl,ms,tflops,
// tbps,peak_mem_bytes (peak = bytes this version allocated: inputs, outputs,
// its intermediates).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/fp8_dequant.h"
#include "backend/cuda/paged_attn.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "bench/cuda/bench_util.cuh"
#include "bench/cuda/sm90_schedule_ablation.h"
#include "common/dtype.h"

namespace attnserve {
namespace {

struct Shape {
  const char* kind;
  DType dtype;
  int d, b, hq, hkv, sq, sk;
  bool causal;
};

// The params' sizes and options for a shape (dense, default scale).
AttnShape BenchShape(const Shape& s) {
  return DenseShape(s.dtype, s.b, s.sq, s.sk, s.hq, s.hkv, s.d);
}
AttnOptions BenchOptions(const Shape& s) {
  AttnOptions options;
  options.causal = s.causal;
  return options;
}

// ---- standard attention: row softmax over a materialised S (in place -> P).
template <typename T>
__global__ void SoftmaxRows(T* s, int sq, int sk, float scale, bool causal) {
  const int64_t row = blockIdx.x;  // over B*H*Sq
  const int i = static_cast<int>(row % sq);
  T* r = s + row * sk;
  const int limit = causal ? min(sk - 1, i + (sk - sq)) : sk - 1;
  __shared__ float red[32];
  float mx = -INFINITY;
  for (int j = threadIdx.x; j <= limit; j += blockDim.x) mx = fmaxf(mx, float(r[j]) * scale);
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int w = 0; w < blockDim.x / 32; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  float sum = 0.f;
  for (int j = threadIdx.x; j <= limit; j += blockDim.x) sum += expf(float(r[j]) * scale - mx);
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = sum;
  __syncthreads();
  sum = 0.f;
  for (int w = 0; w < blockDim.x / 32; ++w) sum += red[w];
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int j = threadIdx.x; j < sk; j += blockDim.x) {
    r[j] = T(j <= limit ? expf(float(r[j]) * scale - mx) * inv : 0.f);
  }
}

// ---- FlashAttention-1 loop order (fp32 SIMT): one CTA per (b, h); for each
// K/V tile (outer), for each Q tile (inner): read O, m, l from global, update
// with this K/V tile, write them back. 64-key tiles, 4 query rows per warp step.
template <typename T>
__global__ void Fa1Kernel(const T* q, const T* k, const T* v, float* o, float* m, float* l, int sq,
                          int sk, int hq, int hkv, int d, float scale, bool causal) {
  extern __shared__ float sm[];
  constexpr int kBc = 64;
  float* sk_t = sm;            // [kBc][d]
  float* sv_t = sm + kBc * d;  // [kBc][d]
  const int bh = blockIdx.x;
  const int b = bh / hq, h = bh % hq, kvh = h / (hq / hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  for (int j0 = 0; j0 < sk; j0 += kBc) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < kBc * d; idx += blockDim.x) {
      const int jj = idx / d, c = idx % d;
      const int64_t g = ((int64_t{b} * sk + j0 + jj) * hkv + kvh) * d + c;
      sk_t[idx] = j0 + jj < sk ? float(k[g]) : 0.f;
      sv_t[idx] = j0 + jj < sk ? float(v[g]) : 0.f;
    }
    __syncthreads();
    for (int i = warp; i < sq; i += nw) {  // inner loop over query rows
      const int64_t qrow = (int64_t{b} * sq + i) * hq + h;
      const int limit = causal ? i + (sk - sq) : sk - 1;
      // scores of this row against the tile: lane owns keys lane, lane+32
      float s[2];
      for (int t = 0; t < 2; ++t) {
        const int jj = lane + 32 * t;
        float dot = 0.f;
        for (int c = 0; c < d; ++c) dot += float(q[qrow * d + c]) * sk_t[jj * d + c];
        s[t] = (j0 + jj < sk && j0 + jj <= limit) ? dot * scale : -INFINITY;
      }
      float mt = fmaxf(s[0], s[1]);
      for (int off = 16; off > 0; off /= 2) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
      const float m_old = m[qrow];
      const float m_new = fmaxf(m_old, mt);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      const float p0 = expf(s[0] - base), p1 = expf(s[1] - base);
      float lt = p0 + p1;
      for (int off = 16; off > 0; off /= 2) lt += __shfl_xor_sync(0xffffffffu, lt, off);
      const float corr = expf(m_old - base);
      for (int c = lane; c < d; c += 32) {
        float acc = o[qrow * d + c] * corr;
        for (int jj = 0; jj < kBc; ++jj) {
          const float pj = __shfl_sync(0xffffffffu, jj < 32 ? p0 : p1, jj % 32);
          acc += pj * sv_t[jj * d + c];
        }
        o[qrow * d + c] = acc;
      }
      if (lane == 0) {
        m[qrow] = m_new;
        l[qrow] = l[qrow] * corr + lt;
      }
    }
  }
}
template <typename T>
__global__ void Fa1Finish(const float* o, const float* l, T* out, int64_t rows, int d) {
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < rows * d;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const float ll = l[idx / d];
    out[idx] = T(ll > 0.f ? o[idx] / ll : 0.f);
  }
}
__global__ void Fa1Init(float* o, float* m, float* l, int64_t rows, int d) {
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < rows * d;
       idx += int64_t{gridDim.x} * blockDim.x) {
    o[idx] = 0.f;
    if (idx % d == 0) {
      m[idx / d] = -INFINITY;
      l[idx / d] = 0.f;
    }
  }
}

struct Impl {
  // Sets up for a shape (allocations), returns false if it cannot run (memory).
  virtual bool Setup(const Shape& s, const void* q, const void* k, const void* v, void* o) = 0;
  virtual bool Run() = 0;
  virtual int64_t ExtraBytes() const = 0;
  virtual ~Impl() = default;
};

// --decode_splits=N (0: the planner's choice) overrides the split count of
// decode shapes, for sweeping the split heuristic.
int g_decode_splits = 0;
FILE* g_kv_csv = nullptr;  // --kv_csv
// The plan's split workspace (counters zeroed, as the backend does at
// allocation); false when it cannot be allocated.
bool AllocWorkspace(Plan* plan, Arena* arena, void** ws) {
  if (plan->workspace_bytes == 0) return true;
  *ws = arena->Alloc(plan->workspace_bytes);
  return *ws != nullptr && cuda::ClearSplitCounters(*ws, nullptr) == cudaSuccess &&
         cudaDeviceSynchronize() == cudaSuccess;
}

struct Ours : Impl {
  // allow_sm90: as CudaBackend (the device's and the environment's say);
  // false: the portable kernel only. varlen: the same rows as a varlen call
  // (B sequences of equal lengths, cu_seqlens on the device), for what the
  // varlen path costs against dense.
  // batch_invariant: AttnParams::batch_invariant (ours_bi, varlen_bi).
  explicit Ours(bool allow_sm90, bool varlen = false, bool batch_invariant = false)
      : allow_sm90(allow_sm90), varlen(varlen), batch_invariant(batch_invariant) {}
  bool allow_sm90, varlen, batch_invariant;
  AttnParams p{};
  Plan plan;
  Arena arena;
  void* ws = nullptr;
  int num_sms = 0;
  std::vector<int32_t> cu;  // varlen: cu_seqlens_q, then cu_seqlens_k (B + 1 each)
  bool Setup(const Shape& s, const void* q, const void* k, const void* v, void* o) override {
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
    AttnShape shape = BenchShape(s);
    if (varlen) {
      cu.resize(2 * (s.b + 1));
      for (int i = 0; i <= s.b; ++i) {
        cu[i] = i * s.sq;
        cu[s.b + 1 + i] = i * s.sk;
      }
      shape.cu_seqlens_q = cu.data();
      shape.cu_seqlens_k = cu.data() + s.b + 1;
    }
    p = MakeAttnParams(shape, BenchOptions(s), {q, k, v, o, nullptr});
    p.batch_invariant = batch_invariant;
    if (varlen) {
      auto* dev = static_cast<int32_t*>(arena.Alloc(static_cast<int64_t>(cu.size()) * 4));
      if (dev == nullptr) return false;
      CK(cudaMemcpy(dev, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
      p.cu_seqlens_q = dev;
      p.cu_seqlens_k = dev + s.b + 1;
    }
    plan = cuda::PlanForward(p, num_sms, allow_sm90 && cuda::DeviceRunsSm90Kernels(0));
    if (plan.kernel_head_dim == 0) return false;
    if (g_decode_splits > 0 && std::string(s.kind) == "decode") {  // --decode_splits sweep
      plan.num_splits = g_decode_splits;
      plan.workspace_bytes =
          g_decode_splits > 1 ? cuda::SplitWorkspaceBytes(p, g_decode_splits) : 0;
    }
    return AllocWorkspace(&plan, &arena, &ws);
  }
  bool Run() override {
    CK(cuda::LaunchForward(p, plan, ws, nullptr));
    return true;
  }
  int64_t ExtraBytes() const override { return arena.bytes; }
};

template <typename T>
struct Standard : Impl {
  Shape s{};
  const T *q, *k, *v;
  T* o;
  T* sbuf = nullptr;
  Arena arena;
  cublasHandle_t handle = nullptr;
  bool Setup(const Shape& sh, const void* q_, const void* k_, const void* v_, void* o_) override {
    s = sh;
    q = static_cast<const T*>(q_);
    k = static_cast<const T*>(k_);
    v = static_cast<const T*>(v_);
    o = static_cast<T*>(o_);
    if (s.hq != s.hkv) return false;  // the simple baseline has no GQA
    sbuf = static_cast<T*>(arena.Alloc(int64_t{s.b} * s.hq * s.sq * s.sk * sizeof(T)));
    if (sbuf == nullptr) return false;
    return cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS;
  }
  ~Standard() override {
    if (handle) cublasDestroy(handle);
  }
  bool Run() override {
    const cudaDataType dt = s.dtype == DType::kFP16 ? CUDA_R_16F : CUDA_R_16BF;
    const float one = 1.f, zero = 0.f;
    const int ld = s.hq * s.d;
    for (int b = 0; b < s.b; ++b) {
      const T* qb = q + int64_t{b} * s.sq * ld;
      const T* kb = k + int64_t{b} * s.sk * ld;
      const T* vb = v + int64_t{b} * s.sk * ld;
      T* sb = sbuf + int64_t{b} * s.hq * s.sq * s.sk;
      // S^T (col-major Sk x Sq) = K Q^T, per head.
      if (cublasGemmStridedBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, s.sk, s.sq, s.d, &one, kb,
                                     dt, ld, s.d, qb, dt, ld, s.d, &zero, sb, dt, s.sk,
                                     int64_t{s.sq} * s.sk, s.hq, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
        return false;
    }
    SoftmaxRows<T><<<static_cast<unsigned>(int64_t{s.b} * s.hq * s.sq), 256>>>(
        sbuf, s.sq, s.sk, 1.f / std::sqrt(float(s.d)), s.causal);
    for (int b = 0; b < s.b; ++b) {
      const T* vb = v + int64_t{b} * s.sk * ld;
      T* ob = o + int64_t{b} * s.sq * ld;
      T* sb = sbuf + int64_t{b} * s.hq * s.sq * s.sk;
      // O^T (col-major D x Sq) = V^T P^T, per head.
      if (cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, s.d, s.sq, s.sk, &one, vb,
                                     dt, ld, s.d, sb, dt, s.sk, int64_t{s.sq} * s.sk, &zero, ob, dt,
                                     ld, s.d, s.hq, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
        return false;
    }
    CK(cudaGetLastError());
    return true;
  }
  int64_t ExtraBytes() const override { return arena.bytes; }
};

template <typename T>
struct Fa1 : Impl {
  Shape s{};
  const T *q, *k, *v;
  T* o;
  float *oa = nullptr, *m = nullptr, *l = nullptr;
  Arena arena;
  bool Setup(const Shape& sh, const void* q_, const void* k_, const void* v_, void* o_) override {
    s = sh;
    q = static_cast<const T*>(q_);
    k = static_cast<const T*>(k_);
    v = static_cast<const T*>(v_);
    o = static_cast<T*>(o_);
    const int64_t rows = int64_t{s.b} * s.sq * s.hq;
    oa = static_cast<float*>(arena.Alloc(rows * s.d * 4));
    m = static_cast<float*>(arena.Alloc(rows * 4));
    l = static_cast<float*>(arena.Alloc(rows * 4));
    if (!oa || !m || !l) return false;
    return cudaFuncSetAttribute(Fa1Kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                2 * 64 * 256 * 4) == cudaSuccess;
  }
  bool Run() override {
    const int64_t rows = int64_t{s.b} * s.sq * s.hq;
    Fa1Init<<<1024, 256>>>(oa, m, l, rows, s.d);
    Fa1Kernel<T><<<s.b * s.hq, 256, 2 * 64 * s.d * 4>>>(q, k, v, oa, m, l, s.sq, s.sk, s.hq, s.hkv,
                                                        s.d, 1.f / std::sqrt(float(s.d)), s.causal);
    Fa1Finish<T><<<1024, 256>>>(oa, l, o, rows, s.d);
    CK(cudaGetLastError());
    return true;
  }
  int64_t ExtraBytes() const override { return arena.bytes; }
};

// kvread (decode shapes only): the harness's floor for decode, a streaming
// read of exactly the K and V bytes (16-byte loads, 8 CTAs of 256 threads per
// SM, 4 loads in flight per thread) with no attention math, timed the same
// way (after the same 256 MB memset flush). Its TB/s is what any decode
// kernel could reach in this measurement.
__global__ void __launch_bounds__(256)
    KvReadKernel(const uint4* k, const uint4* v, int64_t n16, unsigned* out) {
  unsigned acc = 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (const uint4* src : {k, v}) {
    int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
      uint4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = __ldcs(src + i + u * stride);
#pragma unroll
      for (int u = 0; u < 4; ++u) acc ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
    }
    for (; i < n16; i += stride) {
      const uint4 x = __ldcs(src + i);
      acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
  }
  if (acc == 0x9e3779b9u) *out = acc;  // keeps the loads; practically never taken
}
struct KvRead : Impl {
  const uint4 *k = nullptr, *v = nullptr;
  unsigned* out = nullptr;
  int64_t n16 = 0;
  int blocks = 0;
  bool Setup(const Shape& s, const void*, const void* k_, const void* v_, void* o) override {
    if (std::string(s.kind) != "decode") return false;
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    k = static_cast<const uint4*>(k_);
    v = static_cast<const uint4*>(v_);
    out = static_cast<unsigned*>(o);
    n16 = int64_t{s.b} * s.sk * s.hkv * s.d * 2 / 16;
    blocks = sms * 8;
    return true;
  }
  bool Run() override {
    KvReadKernel<<<blocks, 256>>>(k, v, n16, out);
    CK(cudaGetLastError());
    return true;
  }
  int64_t ExtraBytes() const override { return 0; }
};

// The decode problem with K/V in pages: Setup appends the contiguous K/V into
// the pages on the GPU (LaunchKvAppend), Run is the paged decode launch.
struct Paged : Impl {
  // allow_sm90 as Ours: the Hopper decode kernel where the planner picks it.
  Paged(int ps, bool allow) : page_size(ps), allow_sm90(allow) {}
  int page_size;
  bool allow_sm90;
  PagedAttnParams pp{};
  Plan plan;
  Arena arena;
  void* ws = nullptr;
  bool Setup(const Shape& s, const void* q, const void* k, const void* v, void* o) override {
    if (std::string(s.kind) != "decode") return false;
    int num_sms = 0;
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
    std::vector<int32_t> cu_q(s.b + 1), cu_k(s.b + 1), lens(s.b, s.sk);
    for (int b = 0; b <= s.b; ++b) {
      cu_q[b] = b * s.sq;
      cu_k[b] = b * s.sk;
    }
    // Varlen: the append reads the new rows (all of them) by cu_seqlens_k.
    AttnShape shape = BenchShape(s);
    shape.cu_seqlens_q = cu_q.data();
    shape.cu_seqlens_k = cu_k.data();
    AttnParams& p = pp.attn;
    p = MakeAttnParams(shape, BenchOptions(s), {q, k, v, o, nullptr});
    KvPages& kv = pp.pages;
    kv.page_size = page_size;
    while ((1 << kv.page_shift) < page_size) ++kv.page_shift;
    const int per_seq = (s.sk + page_size - 1) / page_size;
    const int64_t pages = int64_t{s.b} * per_seq;
    while ((int64_t{1} << kv.slab_shift) * 4 < pages) ++kv.slab_shift;  // >= 4 slabs
    kv.num_slabs = static_cast<int>((pages + (1 << kv.slab_shift) - 1) >> kv.slab_shift);
    const int64_t slab_bytes = (int64_t{1} << kv.slab_shift) * page_size * s.hkv * s.d * 2;
    for (int i = 0; i < kv.num_slabs; ++i) {
      kv.k_slabs[i] = arena.Alloc(slab_bytes);
      kv.v_slabs[i] = arena.Alloc(slab_bytes);
      if (kv.k_slabs[i] == nullptr || kv.v_slabs[i] == nullptr) return false;
    }
    std::vector<int32_t> ids(static_cast<size_t>(int64_t{kv.num_slabs} << kv.slab_shift));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
    ids.resize(static_cast<size_t>(pages));
    pp.block_table_stride = per_seq;
    auto upload = [&](const std::vector<int32_t>& h) -> int32_t* {
      void* d = arena.Alloc(int64_t(h.size()) * 4);
      if (d == nullptr ||
          cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice) != cudaSuccess)
        return nullptr;
      return static_cast<int32_t*>(d);
    };
    p.cu_seqlens_q = upload(cu_q);
    p.cu_seqlens_k = upload(cu_k);
    pp.block_table = upload(ids);
    pp.seqlens_k = upload(lens);
    if (!p.cu_seqlens_q || !p.cu_seqlens_k || !pp.block_table || !pp.seqlens_k) return false;
    CK(cuda::LaunchKvAppend(pp, nullptr));
    CK(cudaDeviceSynchronize());
    plan = cuda::PlanForward(p, num_sms, allow_sm90 && cuda::DeviceRunsSm90Kernels(0),
                             cuda::KvRows::kPages);
    if (plan.kernel_head_dim == 0) return false;
    return AllocWorkspace(&plan, &arena, &ws);
  }
  bool Run() override {
    CK(cuda::LaunchPagedForward(pp, plan, ws, nullptr));
    return true;
  }
  int64_t ExtraBytes() const override { return arena.bytes; }
};

// BF16 -> FP8 E4M3 codes (descale 1), for the FP8 versions' inputs.
__global__ void QuantiseToE4m3(const __nv_bfloat16* src, int64_t n, __nv_fp8_e4m3* dst) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = __nv_fp8_e4m3(__bfloat162float(src[i]));
  }
}

// FP8 E4M3 inputs on the BF16 grid's prefill shapes: the shape's inputs
// quantised to codes once in Setup (descale 1; Validate rounds the
// reference's inputs to E4M3 the same way), then what CudaBackend runs for
// an FP8 call, dequantisation included. Level 2: the planner's choice (on
// sm90 both GEMMs on the codes where the tile takes it, Plan::fp8_pv); 1: Q
// K^T on the codes only (Plan::fp8_qk, V dequantised: the path before
// fp8_pv); 0: every input dequantised to BF16 first. O is BF16. pass_only:
// the pass over the inputs alone (the ablation's split of a level's time).
struct Fp8 : Impl {
  explicit Fp8(int l, bool pass = false, int poly = -1, int stage = -1)
      : level(l), pass_only(pass), poly_exp2(poly), extra_stage(stage) {}
  int level;
  bool pass_only;
  int poly_exp2;    // level 2: Plan::fp8_poly_exp2 set (1), clear (0) or as planned (-1)
  int extra_stage;  // level 2: Plan::fp8_extra_stage likewise
  AttnParams p{};
  Plan plan;
  Arena arena;
  void* ws = nullptr;
  void* scratch = nullptr;
  bool Setup(const Shape& s, const void* q, const void* k, const void* v, void* o) override {
    if (s.dtype != DType::kBF16 || std::string(s.kind) == "decode") return false;
    int num_sms = 0;
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
    p = MakeAttnParams(BenchShape(s), BenchOptions(s), {q, k, v, o, nullptr});
    const int64_t nq = p.total_q * p.num_heads_q * p.head_dim;
    const int64_t nk = p.total_k * p.num_heads_kv * p.head_dim;
    const void* src[3] = {q, k, v};
    void* codes[3] = {arena.Alloc(nq), arena.Alloc(nk), arena.Alloc(nk)};
    for (int i = 0; i < 3; ++i) {
      if (codes[i] == nullptr) return false;
      QuantiseToE4m3<<<1024, 256>>>(static_cast<const __nv_bfloat16*>(src[i]), i == 0 ? nq : nk,
                                    static_cast<__nv_fp8_e4m3*>(codes[i]));
    }
    CK(cudaDeviceSynchronize());
    p.dtype = DType::kFP8E4M3;
    p.q = codes[0];
    p.k = codes[1];
    p.v = codes[2];
    plan = cuda::PlanForward(p, num_sms, cuda::DeviceRunsSm90Kernels(0));
    if (level < 2) plan.fp8_pv = false;
    if (level == 2 && poly_exp2 >= 0) plan.fp8_poly_exp2 = poly_exp2 == 1;
    if (level == 2 && extra_stage >= 0) plan.fp8_extra_stage = extra_stage == 1;
    if (level < 1) plan.fp8_qk = false;
    if (plan.kernel_head_dim == 0) return false;
    scratch = arena.Alloc(cuda::Fp8ScratchBytes(p, plan.fp8_qk, plan.fp8_pv));
    return scratch != nullptr && AllocWorkspace(&plan, &arena, &ws);
  }
  bool Run() override {
    AttnParams run;
    CK(cuda::DequantiseFp8(p, plan.fp8_qk, plan.fp8_pv, scratch, nullptr, &run));
    if (!pass_only) CK(cuda::LaunchForward(run, plan, ws, nullptr));
    return true;
  }
  int64_t ExtraBytes() const override { return arena.bytes; }
};

// One Hopper schedule (attn_fwd_sm90.h) on D=128 BF16 unbanded prefill.
struct Sm90Variant : Impl {
  explicit Sm90Variant(cuda::Sm90Schedule s) : schedule(s) {}
  cuda::Sm90Schedule schedule;
  AttnParams p{};
  Plan plan;
  Arena arena;
  void* ws = nullptr;
  bool Setup(const Shape& s, const void* q, const void* k, const void* v, void* o) override {
#if !defined(ATTNSERVE_CUDA_SM90)
    return false;  // built without the Hopper family (attn_bench_sm90_ablation)
#endif
    if (std::string(s.kind) != "prefill" || s.d != 128 || s.dtype != DType::kBF16 ||
        !cuda::DeviceRunsSm90Kernels(0)) {
      return false;
    }
    int num_sms = 0;
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
    p = MakeAttnParams(BenchShape(s), BenchOptions(s), {q, k, v, o, nullptr});
    plan = cuda::PlanForward(p, num_sms, /*allow_sm90=*/true);
    if (plan.kernel_family != KernelFamily::kSm90) return false;
    Plan own = plan;  // this schedule's workspace, not the default one's
    own.workspace_bytes = cuda::Sm90ScheduleWorkspaceBytes(schedule);
    return AllocWorkspace(&own, &arena, &ws);
  }
  bool Run() override {
#if defined(ATTNSERVE_CUDA_SM90)
    CK(cuda::LaunchForwardSm90Schedule(p, plan, schedule, ws, nullptr));
#endif
    return true;
  }
  int64_t ExtraBytes() const override { return arena.bytes; }
};

template <typename T>
std::unique_ptr<Impl> MakeImpl(const std::string& name) {
  if (name == "ours") return std::make_unique<Ours>(true);
  if (name == "portable") return std::make_unique<Ours>(false);
  if (name == "varlen") return std::make_unique<Ours>(true, true);
  if (name == "ours_bi") return std::make_unique<Ours>(true, false, true);
  if (name == "varlen_bi") return std::make_unique<Ours>(true, true, true);
  if (name == "sm90_tma") return std::make_unique<Sm90Variant>(cuda::Sm90Schedule::kTmaSync);
  if (name == "sm90_ws") return std::make_unique<Sm90Variant>(cuda::Sm90Schedule::kWarpSpecialized);
  if (name == "sm90_pp") return std::make_unique<Sm90Variant>(cuda::Sm90Schedule::kPingPong);
  if (name == "sm90_ppo")
    return std::make_unique<Sm90Variant>(cuda::Sm90Schedule::kPingPongOverlap);
  if (name == "sm90_persist") return std::make_unique<Sm90Variant>(cuda::Sm90Schedule::kPersistent);
  if (name == "sm90_dynamic")
    return std::make_unique<Sm90Variant>(cuda::Sm90Schedule::kPersistentDynamic);
  if (name == "paged16") return std::make_unique<Paged>(16, true);
  if (name == "paged64") return std::make_unique<Paged>(64, true);
  if (name == "paged16_portable") return std::make_unique<Paged>(16, false);
  if (name == "kvread") return std::make_unique<KvRead>();
  if (name == "fp8") return std::make_unique<Fp8>(2);
  if (name == "fp8_qk") return std::make_unique<Fp8>(1);
  if (name == "fp8_poly") return std::make_unique<Fp8>(2, false, 1);
  if (name == "fp8_mufu") return std::make_unique<Fp8>(2, false, 0);
  if (name == "fp8_stage") return std::make_unique<Fp8>(2, false, -1, 1);
  if (name == "fp8_poly_stage") return std::make_unique<Fp8>(2, false, 1, 1);
  if (name == "fp8_pass") return std::make_unique<Fp8>(2, true);
  if (name == "fp8_qk_pass") return std::make_unique<Fp8>(1, true);
  if (name == "fp8_dequant") return std::make_unique<Fp8>(0);
  if (name == "standard") return std::make_unique<Standard<T>>();
  if (name == "fa1") return std::make_unique<Fa1<T>>();
  return nullptr;
}

// Validates `name` on a small shape like s against the float64 reference:
// relative L2 error under 2e-2 (BF16/FP16 operands land near 3e-3).
bool Validate(const std::string& name, const Shape& big, double* rel_err) {
  Shape s = big;
  if (std::string(s.kind) == "decode") {
    s.b = 1;
    s.sk = 1000;
  } else {
    s.b = 1;
    s.sq = s.sk = 200;
    s.hq = std::min(s.hq, 4);
    s.hkv = std::min(s.hkv, s.hq);
  }
  const int64_t nq = int64_t{s.b} * s.sq * s.hq * s.d, nk = int64_t{s.b} * s.sk * s.hkv * s.d;
  std::vector<uint16_t> hq(nq), hk(nk), hv(nk), ho(nq);
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto fill = [&](std::vector<uint16_t>& x) {
    for (auto& e : x) e = s.dtype == DType::kFP16 ? FloatToFp16(nd(rng)) : FloatToBf16(nd(rng));
  };
  fill(hq);
  fill(hk);
  fill(hv);
  if (name.rfind("fp8", 0) == 0) {
    // The FP8 versions quantise their inputs: the reference sees the same values.
    for (auto* x : {&hq, &hk, &hv})
      for (auto& e : *x) e = FloatToBf16(Fp8E4M3ToFloat(FloatToFp8E4M3(Bf16ToFloat(e))));
  }
  Arena a;
  void* dq = a.Alloc(nq * 2);
  void* dk = a.Alloc(nk * 2);
  void* dv = a.Alloc(nk * 2);
  void* dout = a.Alloc(nq * 2);
  CK(cudaMemcpy(dq, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, hv.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemset(dout, 0xff, nq * 2));
  auto impl = s.dtype == DType::kFP16 ? MakeImpl<__half>(name) : MakeImpl<__nv_bfloat16>(name);
  if (impl == nullptr) {
    std::fprintf(stderr, "attn_bench: unknown version %s\n", name.c_str());
    return false;
  }
  if (!impl->Setup(s, dq, dk, dv, dout) || !impl->Run()) return false;
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(ho.data(), dout, nq * 2, cudaMemcpyDeviceToHost));
  const AttnParams p = MakeAttnParams(BenchShape(s), BenchOptions(s),
                                      {hq.data(), hk.data(), hv.data(), nullptr, nullptr});
  const ReferenceOutput ref = ReferenceAttention(p);
  double num = 0, den = 0;
  for (int64_t i = 0; i < nq; ++i) {
    const double x = LoadAsFloat(ho.data(), s.dtype, i);
    if (!std::isfinite(x)) {
      *rel_err = INFINITY;
      return false;
    }
    num += (x - ref.o[i]) * (x - ref.o[i]);
    den += ref.o[i] * ref.o[i];
  }
  *rel_err = std::sqrt(num / std::max(den, 1e-30));
  // FP8 P V (Plan::fp8_pv) rounds each softmax weight to E4M3: 3 mantissa
  // bits, a relative error of up to 2^-4 (rms ~2^-4 / sqrt(3)) per weight,
  // which for rows spread over many keys leaves O itself a few percent off
  // (tolerance.h's FP8 rule bounds it); the other versions' operands are
  // BF16 or FP16 (near 3e-3).
  const bool fp8_p =
      name.rfind("fp8", 0) == 0 && name.rfind("fp8_qk", 0) != 0 && name != "fp8_dequant";
  return *rel_err < (fp8_p ? 6e-2 : 2e-2);
}

bool Bench(const std::string& name, const Shape& s, void* flush, FILE* csv) {
  double err = 0;
  // kvread and the FP8 passes alone write no O to validate.
  const bool no_output = name == "kvread" || name.find("_pass") != std::string::npos;
  if (!no_output && !Validate(name, s, &err)) {
    std::fprintf(stderr, "SKIP/FAIL validate %s d=%d causal=%d err=%g\n", name.c_str(), s.d,
                 s.causal, err);
    return false;
  }
  const int64_t nq = int64_t{s.b} * s.sq * s.hq * s.d, nk = int64_t{s.b} * s.sk * s.hkv * s.d;
  Arena io;
  void* q = io.Alloc(nq * 2);
  void* k = io.Alloc(nk * 2);
  void* v = io.Alloc(nk * 2);
  void* o = io.Alloc(nq * 2);
  if (!q || !k || !v || !o) return false;
  FillRandom<__half>
      <<<1024, 256>>>(static_cast<__half*>(q), nq, 1);  // bit patterns valid for both 16-bit types
  FillRandom<__half><<<1024, 256>>>(static_cast<__half*>(k), nk, 2);
  FillRandom<__half><<<1024, 256>>>(static_cast<__half*>(v), nk, 3);
  auto impl = s.dtype == DType::kFP16 ? MakeImpl<__half>(name) : MakeImpl<__nv_bfloat16>(name);
  if (!impl->Setup(s, q, k, v, o)) {
    std::fprintf(stderr, "SKIP %s: setup failed (memory?) sq=%d d=%d\n", name.c_str(), s.sq, s.d);
    return false;
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const bool decode = std::string(s.kind) == "decode";
  const int warm = 5, reps = name == "fa1" ? 20 : (g_kv_csv != nullptr && decode) ? 100 : 25;
  std::vector<float> ms;
  for (int it = 0; it < warm + reps; ++it) {
    CK(cudaMemsetAsync(flush, it & 0xff, 256 << 20));
    CK(cudaEventRecord(e0));
    if (!impl->Run()) return false;
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (it >= warm) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  double flops = 4.0 * s.b * s.hq * double(s.sq) * s.sk * s.d;
  if (s.causal && s.sq == s.sk) flops /= 2;
  const double bytes = decode ? 2.0 * nk * 2 : 2.0 * (2 * nq + 2 * nk);
  std::fprintf(csv, "%s,%s,%d,%d,%d,%d,%d,%d,%d,%s,%.4f,%.2f,%.3f,%lld\n", s.kind,
               s.dtype == DType::kFP16 ? "fp16" : "bf16", s.d, s.b, s.hq, s.hkv, s.sq, s.sk,
               s.causal ? 1 : 0, name.c_str(), med, flops / med * 1e-9, bytes / med * 1e-9,
               static_cast<long long>(io.bytes + impl->ExtraBytes()));
  std::fflush(csv);
  if (g_kv_csv != nullptr && decode && name != "kvread") {
    // ours -> ours_contiguous, paged16 -> ours_paged with pages of 16 (on
    // sm90 both the Hopper decode kernel); the portable kernel's variants
    // (portable, paged16_portable) -> ours_portable_*.
    const bool paged = name.rfind("paged", 0) == 0;
    const bool portable = name.find("portable") != std::string::npos;
    const std::string label =
        std::string(portable ? "ours_portable_" : "ours_") + (paged ? "paged" : "contiguous");
    const std::string page = paged ? name.substr(5, name.find('_') - 5) : "";
    const double p99 =
        ms[std::min(ms.size() - 1, static_cast<size_t>(std::ceil(0.99 * ms.size())) - 1)];
    std::fprintf(g_kv_csv, "kernel,%s,%d,%d,1,%s,%.0f,%.3f,%.4f,%.4f\n", label.c_str(), s.b, s.sk,
                 page.c_str(), s.b / (med * 1e-3), bytes / med * 1e-9, med, p99);
    std::fflush(g_kv_csv);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return true;
}

}  // namespace
}  // namespace attnserve

// The comma-separated names of `list`, in order.
std::vector<std::string> SplitList(const std::string& list) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t end = std::min(list.find(',', at), list.size());
    if (end > at) out.push_back(list.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

int main(int argc, char** argv) {
  using namespace attnserve;
  std::string grid = "anchor", impls = "ours,standard,fa1", out;
  std::string anchor_ds, anchor_ns;  // ",64,256,": the anchor grid's D / N kept (empty: all)
  auto kept = [](const std::string& list, int x) {
    return list.empty() || list.find("," + std::to_string(x) + ",") != std::string::npos;
  };
  std::string dtypes = "bf16,fp16";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* f) {
      return a.rfind(f, 0) == 0 ? a.substr(std::strlen(f)) : std::string();
    };
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: attn_bench [--grid=anchor|quick|decode|all|decodesweep|hdims]\n"
          "                  [--impls=ours,ours_bi,portable,varlen,varlen_bi,standard,fa1,fp8,\n"
          "                           "
          "fp8_qk,fp8_dequant,fp8_poly,fp8_mufu,fp8_stage,fp8_poly_stage,\n"
          "                           fp8_pass,fp8_qk_pass,\n"
          "                           paged16,\n"
          "                           paged64,paged16_portable,kvread,sm90_tma,sm90_ws,sm90_pp,\n"
          "                           sm90_ppo,sm90_persist,sm90_dynamic] (default "
          "ours,standard,fa1)\n"
          "                  [--dtypes=bf16,fp16] [--ds=64,..] [--ns=1024,..] [--csv=FILE]\n"
          "                  [--decode_splits=N] "
          "[--kv_csv=FILE]\n"
          "Times each version (validated against the float64 reference first) with CUDA\n"
          "events, L2 flushed, median of 25 runs; CSV rows (docs/design.md section 5).\n");
      return 0;
    }
    if (!val("--grid=").empty()) grid = val("--grid=");
    if (!val("--impls=").empty()) impls = val("--impls=");
    if (!val("--dtypes=").empty()) dtypes = val("--dtypes=");
    if (!val("--csv=").empty()) out = val("--csv=");
    if (!val("--ds=").empty()) anchor_ds = "," + val("--ds=") + ",";
    if (!val("--ns=").empty()) anchor_ns = "," + val("--ns=") + ",";
    if (!val("--decode_splits=").empty())
      g_decode_splits = std::atoi(val("--decode_splits=").c_str());
    if (!val("--kv_csv=").empty()) {
      g_kv_csv = std::fopen(val("--kv_csv=").c_str(), "w");
      if (g_kv_csv == nullptr) return 1;
    }
  }
  FILE* csv = out.empty() ? stdout : std::fopen(out.c_str(), "w");
  if (csv == nullptr) return 1;
  std::fprintf(csv, "kind,dtype,d,b,hq,hkv,sq,sk,causal,impl,ms,tflops,tbps,peak_mem_bytes\n");
  std::vector<Shape> shapes;
  for (const char* dn : {"bf16", "fp16"}) {
    if (dtypes.find(dn) == std::string::npos) continue;
    const DType t = std::string(dn) == "bf16" ? DType::kBF16 : DType::kFP16;
    if (grid == "anchor" || grid == "all" || grid == "quick") {
      for (int d : {64, 128, 256}) {
        for (int n : {512, 1024, 2048, 4096, 8192, 16384}) {
          if (grid == "quick" && n != 1024 && n != 8192) continue;
          if (!kept(anchor_ds, d) || !kept(anchor_ns, n)) continue;
          for (bool c : {false, true})
            shapes.push_back({"prefill", t, d, 16384 / n, 2048 / d, 2048 / d, n, n, c});
        }
      }
    }
    if (grid == "hdims") {
      // Head dims off the anchor grid (served by the next kernel up, or their
      // own: 192 on sm90), its shapes at N = 1k and 8k.
      for (int d : {32, 96, 192}) {
        for (int n : {1024, 8192}) {
          for (bool c : {false, true})
            shapes.push_back({"prefill", t, d, 16384 / n, 2048 / d, 2048 / d, n, n, c});
        }
      }
    }
    if (grid == "decodesweep") {
      // The split-KV sweep: B = 1 and 16 over contexts 1k..32k, and chunked
      // prefill (Sq = 128, GQA 4:1) whose prefill tile also splits.
      for (int b : {1, 16})
        for (int sk = 1024; sk <= 32768; sk *= 2)
          shapes.push_back({"decode", t, 128, b, 32, 8, 1, sk, false});
      for (int sk : {8192, 32768}) shapes.push_back({"prefill", t, 128, 1, 32, 8, 128, sk, false});
    }
    if (grid == "decode" || grid == "all" || grid == "quick") {
      for (auto [b, sk] :
           std::vector<std::pair<int, int>>{{1, 8192}, {16, 8192}, {64, 4096}, {8, 65536}}) {
        shapes.push_back({"decode", t, 128, b, 32, 8, 1, sk, false});
      }
    }
  }
  void* flush = nullptr;
  if (cudaMalloc(&flush, 256 << 20) != cudaSuccess) return 1;
  int failed = 0;
  for (const Shape& s : shapes) {
    // In --impls order: each shape's versions run back to back, and later ones
    // run on a warmer GPU, so an A/B can be repeated in reverse order.
    for (const std::string& impl : SplitList(impls)) {
      const char* name = impl.c_str();
      if ((std::string(name) == "kvread" || std::string(name).rfind("paged", 0) == 0) &&
          std::string(s.kind) != "decode") {
        continue;
      }
      if (std::string(name) == "fa1" && (s.sq > 1024 || std::string(s.kind) == "decode")) continue;
      if (std::string(name) == "standard" && s.hq != s.hkv) continue;
      if (!Bench(name, s, flush, csv)) ++failed;
    }
  }
  cudaFree(flush);
  if (csv != stdout) std::fclose(csv);
  if (g_kv_csv != nullptr) std::fclose(g_kv_csv);
  std::fprintf(stderr, "attn_bench: %d version/shape pairs skipped or failed\n", failed);
  return 0;
}
