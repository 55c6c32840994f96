// The absorbed-MLA paged path (paged_mla.h): the decode kernel (its K-only
// append is paged_attn.cu's, its splits' combine paged_decode_splits.cuh's).
//
// Decode over a 576-wide latent cache streams K once: a CTA takes one
// sequence's packed rows (token x query head, 16 kMT of them) and one split
// of its keys, and every row shares each 32-key stage. Per stage:
//  1. S = Q K^T: warp w takes m-group w % kGroups (kSM m16 tiles) x all 32
//     keys over the head-dim steps kk = w / kGroups (mod kDSplit), so Q and
//     K fragments are each reused several times; the kDSplit partial sums go
//     to shared memory (fp32).
//  2. softmax: each thread one row and 2-8 consecutive keys (a row's lanes
//     adjacent in one warp): the partial sums added, masked, the running
//     max and the rescale factor per row; P is written (FP16/BF16) over the
//     row's own partial sums.
//  3. O += P V: warp w owns O columns [64 w, 64 w + 64) of every row, V read
//     from the stage's first 512 dims with ldmatrix.trans.
// Shared rows of 1152 bytes are swizzled at 16 bytes (chunk c of row r at
// c ^ (r & 7)) so ldmatrix's eight rows fall in distinct banks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/paged_attn.h"
#include "backend/cuda/paged_decode_splits.cuh"
#include "backend/cuda/paged_mla.h"
#include "common/dtype.h"

namespace attnserve {
namespace cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kD = kMlaHeadDim;
constexpr int kDv = kMlaHeadDimV;
constexpr int kTile = kMlaKeyTile;
constexpr int kRowBytes = kD * 2;           // 1152: 72 chunks of 16 bytes
constexpr int kKSteps = kD / 16;            // 36 m16n8k16 steps over the head dim
constexpr int kColsPerWarp = kDv / kWarps;  // 64 O columns

static_assert(kThreads / 8 == kTile, "a stage's load: 8 threads a key row");

// kOverlap (the bench's variant): P gets a buffer of its own so that a
// stage's S runs beside the previous stage's P V (two barriers a stage, one
// stage fewer in flight).
template <int kMT, bool kOverlap = false>
struct Cfg {
  static constexpr int kRows = 16 * kMT;
  static constexpr int kSM = kMT < 2 ? kMT : 2;  // m16 tiles of one S unit
  static constexpr int kGroups = kMT / kSM;
  static constexpr int kDSplit = kWarps / kGroups;
  static constexpr int kStages = MlaStages(kRows);
  static constexpr int kQBytes = kRows * kRowBytes;
  static constexpr int kStageBytes = kTile * kRowBytes;
  static constexpr int kSBytes = kDSplit * kRows * kTile * 4;
  static constexpr int kPBytes = kOverlap ? kRows * kTile * 4 : 0;
  static constexpr int kRingOff = kQBytes;
  static constexpr int kSOff = kRingOff + kStages * kStageBytes;
  static constexpr int kPOff = kOverlap ? kSOff + kSBytes : kSOff;  // P rows of 128 bytes
  static constexpr int kStatOff = kSOff + kSBytes + kPBytes;        // alpha, m, l, lo, hi, slope
  static constexpr int kSmem = kStatOff + 6 * kRows * 4;
  static_assert(kOverlap || kSmem == MlaSmemBytes(kRows), "plan's smem");
  static_assert(kSmem <= 227 * 1024, "shared memory");
};

__device__ __forceinline__ uint32_t Swz(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void CpAsync16(uint32_t smem, const void* gmem, bool real) {
  const int bytes = real ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
}

__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldsm4T(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1);
template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <typename T>
__device__ __forceinline__ uint32_t Pack2(float lo, float hi) {
  const T v[2] = {FromFloat<T>(lo), FromFloat<T>(hi)};
  uint32_t out;
  memcpy(&out, v, 4);
  return out;
}

// CTA (split blockIdx.x, row block blockIdx.y, sequence blockIdx.z): packed
// rows R = blockIdx.y x kRows + r, query token R / Hq, head R % Hq.
// kPhases < 3 (the bench's ablation): only the stage ring and the first
// kPhases phases of each stage run (0: loads alone; 1: + S; 2: + softmax).
template <typename T, int kMT, int kPhases = 3, bool kOverlap = false>
__global__ void __launch_bounds__(kThreads, 1)
    PagedMlaDecodeKernel(const __grid_constant__ PagedDecodeLaunch L) {
  static_assert(!kOverlap || kPhases == 3, "the overlapped loop runs every phase");
  using C = Cfg<kMT, kOverlap>;
  constexpr int kRows = C::kRows;
  constexpr int kStages = C::kStages;
  // The softmax's threads: kLanesPerRow consecutive lanes per row, each
  // kKeysPerLane consecutive keys of the stage (every thread one row).
  constexpr int kKeysPerLane = kRows / kWarps;
  constexpr int kLanesPerRow = kTile / kKeysPerLane;
  static_assert(kKeysPerLane == 2 || kKeysPerLane == 4 || kKeysPerLane == 8, "softmax lanes");
  const AttnParams& p = L.p;
  const PagedKv& kv = L.kv;
  const int split = blockIdx.x;
  const int b = blockIdx.z;
  const int sq = SeqLenQ(p, b);
  const int hq = p.num_heads_q;
  const int n_rows = sq * hq;
  const int r0 = blockIdx.y * kRows;
  if (r0 >= n_rows) return;
  const int rows_here = min(kRows, n_rows - r0);
  const int sk = kv.seqlens_k[b];
  const int64_t q_start = SeqStartQ(p, b);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  // Keys some row of the block sees (both bounds grow with the token index).
  int lo_all, hi_all, unused;
  VisibleKeys(p, r0 / hq, sq, sk, &lo_all, &unused);
  VisibleKeys(p, (r0 + rows_here - 1) / hq, sq, sk, &unused, &hi_all);
  const int t_lo = lo_all / kTile;
  const int n_tiles = hi_all >= lo_all ? hi_all / kTile - t_lo + 1 : 0;
  const int per = MlaTilesPerSplit(n_tiles, L.num_splits, L.invariant);
  const int t_begin = t_lo + split * per;
  const int t_end = t_lo + min(n_tiles, (split + 1) * per);
  if (t_begin >= t_end && L.part_o != nullptr) {
    // An empty split: nothing for the combine to weigh.
    for (int idx = tid; idx < rows_here * kDv; idx += kThreads) {
      const int R = r0 + idx / kDv;
      const int64_t at = DecodePartialAt(p, split, q_start + R / hq, R % hq);
      L.part_o[at * kDv + idx % kDv] = 0.0f;
      if (idx % kDv == 0) L.part_lse[at] = -INFINITY;
    }
    return;
  }

  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t q_addr = s_base;
  const uint32_t ring_addr = s_base + C::kRingOff;
  float* s_part = reinterpret_cast<float*>(smem + C::kSOff);
  uint8_t* p_smem = smem + C::kPOff;
  const uint32_t p_addr = s_base + C::kPOff;
  float* s_alpha = reinterpret_cast<float*>(smem + C::kStatOff);
  float* s_m = s_alpha + kRows;
  float* s_l = s_m + kRows;
  int* s_lo = reinterpret_cast<int*>(s_l + kRows);
  int* s_hi = s_lo + kRows;
  float* s_slope = reinterpret_cast<float*>(s_hi + kRows);

  // Q rows (zero past the block's rows), then the per-row key bounds.
  for (int idx = tid; idx < kRows * (kD / 8); idx += kThreads) {
    const int r = idx / (kD / 8);
    const int c = idx % (kD / 8);
    const int R = r0 + r;
    const bool real = r < rows_here;
    const T* src =
        static_cast<const T*>(p.q) + (real ? QOffset(p, q_start + R / hq, R % hq) + c * 8 : 0);
    CpAsync16(q_addr + Swz(r, c), src, real);
  }
  CpAsyncCommit();
  for (int r = tid; r < kRows; r += kThreads) {
    const int R = r0 + r;
    int lo = 0, hi = -1;  // padding rows see no key
    if (r < rows_here) VisibleKeys(p, R / hq, sq, sk, &lo, &hi);
    s_lo[r] = lo;
    s_hi[r] = hi;
    s_slope[r] = p.alibi_slopes != nullptr && r < rows_here ? p.alibi_slopes[R % hq] : 0.0f;
  }

  // A stage's load: thread t copies chunks t % 8 + 8 k of key row t / 8;
  // keys past the sequence are zero-filled (their pages may not exist).
  const int32_t* table = kv.block_table + int64_t{b} * kv.block_table_stride;
  auto issue = [&](int t, int stage) {
    const int row = tid / 8;
    const int sub = tid % 8;
    const int key = t * kTile + row;
    const bool real = key < sk;
    const char* src = static_cast<const char*>(p.q);
    if (real) {
      const int32_t page = __ldg(table + (key >> kv.pages.page_shift));
      src = static_cast<const char*>(kv.pages.k_slabs[PageSlab(kv.pages, page)]) +
            PageRowOffset(kv.pages, page, key & (kv.pages.page_size - 1), 1, kD, 0) * 2;
    }
    const uint32_t dst = ring_addr + stage * C::kStageBytes;
#pragma unroll
    for (int k = 0; k < kD / 64; ++k) {
      const int c = sub + 8 * k;
      CpAsync16(dst + Swz(row, c), src + c * 16, real);
    }
  };
  constexpr int kAhead = kOverlap ? kStages - 2 : kStages - 1;  // stages in flight
#pragma unroll
  for (int u = 0; u < kAhead; ++u) {
    if (t_begin + u < t_end) issue(t_begin + u, u);
    CpAsyncCommit();
  }

  const bool mods = p.softcap > 0.0f || p.alibi_slopes != nullptr;
  const float scale = mods ? p.softmax_scale : p.softmax_scale_log2;
  const int sm_row = tid / kLanesPerRow;
  const int sm_key = (tid % kLanesPerRow) * kKeysPerLane;
  float m_run = -INFINITY;  // the row's running max (log2 units), the same in its lanes
  float l_run = 0.0f;       // this lane's share of the row's sum
  float acc[kMT][kColsPerWarp / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int n = 0; n < kColsPerWarp / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][n][e] = 0.0f;

  const int grp = warp % C::kGroups;
  const int ds = warp / C::kGroups;
  const int g = lane / 4;
  const int qd = lane % 4;

  // 1. Partial S over this warp's head-dim steps.
  auto s_phase = [&](uint32_t stage) {
    float s[C::kSM][4][4];
#pragma unroll
    for (int mi = 0; mi < C::kSM; ++mi)
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][n][e] = 0.0f;
#pragma unroll 2
    for (int kk = ds; kk < kKSteps; kk += C::kDSplit) {
      uint32_t a[C::kSM][4];
#pragma unroll
      for (int mi = 0; mi < C::kSM; ++mi) {
        const int row = (grp * C::kSM + mi) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        Ldsm4(a[mi], q_addr + Swz(row, 2 * kk + (lane >> 4)));
      }
      uint32_t bk[2][4];
#pragma unroll
      for (int nh = 0; nh < 2; ++nh) {
        const int key = nh * 16 + (lane & 7) + (lane >> 4) * 8;
        Ldsm4(bk[nh], stage + Swz(key, 2 * kk + ((lane >> 3) & 1)));
      }
#pragma unroll
      for (int mi = 0; mi < C::kSM; ++mi)
#pragma unroll
        for (int n = 0; n < 4; ++n)
          Mma<T>(s[mi][n], a[mi], bk[n / 2][2 * (n % 2)], bk[n / 2][2 * (n % 2) + 1]);
    }
#pragma unroll
    for (int mi = 0; mi < C::kSM; ++mi) {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int row = (grp * C::kSM + mi) * 16 + g + 8 * h2;
          const int col = n * 8 + 2 * qd;
          float* dst =
              s_part + (ds * kRows + row) * kTile + (((col >> 2) ^ (row & 7)) << 2) + (col & 3);
          *reinterpret_cast<float2*>(dst) = make_float2(s[mi][n][2 * h2], s[mi][n][2 * h2 + 1]);
        }
      }
    }
  };
  // 2. Softmax: row sm_row, keys sm_key.. of the stage; P over the row's
  // own partial sums (the lanes reading them are the lanes writing P).
  auto softmax_phase = [&](int t) {
    const int r = sm_row;
    float v[kKeysPerLane];
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) v[j] = 0.0f;
#pragma unroll
    for (int d = 0; d < C::kDSplit; ++d) {
      const float* row = s_part + (d * kRows + r) * kTile;
      if constexpr (kKeysPerLane == 2) {
        const float2 x =
            *reinterpret_cast<const float2*>(row + (((sm_key >> 2) ^ (r & 7)) << 2) + (sm_key & 3));
        v[0] += x.x;
        v[1] += x.y;
      } else {
#pragma unroll
        for (int c = 0; c < kKeysPerLane / 4; ++c) {
          const float4 x =
              *reinterpret_cast<const float4*>(row + ((((sm_key >> 2) + c) ^ (r & 7)) << 2));
          v[4 * c] += x.x;
          v[4 * c + 1] += x.y;
          v[4 * c + 2] += x.z;
          v[4 * c + 3] += x.w;
        }
      }
    }
    const int lo = s_lo[r], hi = s_hi[r];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) {
      const int key = t * kTile + sm_key + j;
      float x = v[j] * scale;
      if (mods) {
        if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
        if (p.alibi_slopes != nullptr) x += AlibiBias(s_slope[r], (r0 + r) / hq, key, sq, sk);
        x *= kLog2e;
      }
      if (key < lo || key > hi) x = -INFINITY;
      v[j] = x;
      mx = fmaxf(mx, x);
    }
#pragma unroll
    for (int o = kLanesPerRow / 2; o > 0; o /= 2)
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_new = fmaxf(m_run, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = exp2f(m_run - m_use);
    m_run = m_new;
    float sum = 0.0f;
    alignas(16) T pt[kKeysPerLane];
#pragma unroll
    for (int j = 0; j < kKeysPerLane; ++j) {
      const float pv = exp2f(v[j] - m_use);
      sum += pv;
      pt[j] = FromFloat<T>(pv);
    }
    l_run = l_run * alpha + sum;
    if (sm_key == 0) s_alpha[r] = alpha;
    __syncwarp();  // the row's partial sums are read before P overwrites them
    // P row r: 4 chunks of 8 keys at the start of its own partial row.
    uint8_t* dst = p_smem + r * (kTile * 4) + (((sm_key >> 3) ^ (r & 7)) << 4) + (sm_key & 7) * 2;
    if constexpr (kKeysPerLane == 2) {
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(pt);
    } else if constexpr (kKeysPerLane == 4) {
      *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(pt);
    } else {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(pt);
    }
  };
  // 3. O = alpha O + P V over this warp's 64 columns.
  auto pv_phase = [&](uint32_t stage) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const float a_lo = s_alpha[mt * 16 + g];
      const float a_hi = s_alpha[mt * 16 + g + 8];
#pragma unroll
      for (int n = 0; n < kColsPerWarp / 8; ++n) {
        acc[mt][n][0] *= a_lo;
        acc[mt][n][1] *= a_lo;
        acc[mt][n][2] *= a_hi;
        acc[mt][n][3] *= a_hi;
      }
    }
#pragma unroll
    for (int k2 = 0; k2 < kTile / 16; ++k2) {
      uint32_t bv[kColsPerWarp / 16][4];
#pragma unroll
      for (int np = 0; np < kColsPerWarp / 16; ++np) {
        const int key = k2 * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        const int chunk = warp * (kColsPerWarp / 8) + 2 * np + (lane >> 4);
        Ldsm4T(bv[np], stage + Swz(key, chunk));
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t pa[4];
        const int row = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int chunk = 2 * k2 + (lane >> 4);
        Ldsm4(pa, p_addr + row * (kTile * 4) + ((chunk ^ (row & 7)) << 4));
#pragma unroll
        for (int n = 0; n < kColsPerWarp / 8; ++n)
          Mma<T>(acc[mt][n], pa, bv[n / 2][2 * (n % 2)], bv[n / 2][2 * (n % 2) + 1]);
      }
    }
  };
  auto stage_at = [&](int k) { return ring_addr + (k % kStages) * C::kStageBytes; };

  if constexpr (!kOverlap) {
    for (int t = t_begin, k = 0; t < t_end; ++t, ++k) {
      CpAsyncWait<kStages - 2>();
      __syncthreads();  // stage k landed; every warp left stage k - 1
      if (t + kStages - 1 < t_end) issue(t + kStages - 1, (k + kStages - 1) % kStages);
      CpAsyncCommit();
      if constexpr (kPhases == 0) continue;
      s_phase(stage_at(k));
      __syncthreads();
      if constexpr (kPhases == 1) continue;
      softmax_phase(t);
      __syncthreads();
      if constexpr (kPhases == 2) continue;
      pv_phase(stage_at(k));
    }
  } else {
    // Stage k's S beside stage k - 1's P V, then stage k's softmax; stage k
    // is refilled once stage k + 1's S and stage k's P V are done.
    for (int t = t_begin, k = 0; t < t_end; ++t, ++k) {
      CpAsyncWait<kStages - 3>();
      __syncthreads();  // stage k landed; P and alpha of stage k - 1 written
      if (t + kStages - 2 < t_end) issue(t + kStages - 2, (k + kStages - 2) % kStages);
      CpAsyncCommit();
      s_phase(stage_at(k));
      if (k > 0) pv_phase(stage_at(k - 1));
      __syncthreads();
      softmax_phase(t);
    }
    if (t_end > t_begin) {
      __syncthreads();
      pv_phase(stage_at(t_end - t_begin - 1));
    }
  }
  CpAsyncWait<0>();

  // Row statistics: the lanes' shares of l summed; m is the same in them.
#pragma unroll
  for (int o = kLanesPerRow / 2; o > 0; o /= 2) l_run += __shfl_xor_sync(0xffffffffu, l_run, o);
  if (sm_key == 0) {
    s_m[sm_row] = m_run;
    s_l[sm_row] = l_run;
  }
  __syncthreads();

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int r = mt * 16 + g + 8 * h2;
      if (r >= rows_here) continue;
      const int R = r0 + r;
      const int head = R % hq;
      const int64_t row = q_start + R / hq;
      const float mm = s_m[r];
      float total = s_l[r];
      if (L.part_o != nullptr) {
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        const int64_t at = DecodePartialAt(p, split, row, head);
        float* dst = L.part_o + at * kDv + warp * kColsPerWarp + 2 * qd;
#pragma unroll
        for (int n = 0; n < kColsPerWarp / 8; ++n) {
          __stcg(reinterpret_cast<float2*>(dst + 8 * n),
                 make_float2(acc[mt][n][2 * h2] * inv, acc[mt][n][2 * h2 + 1] * inv));
        }
        if (warp == 0 && qd == 0) L.part_lse[at] = total > 0.0f ? mm + log2f(total) : -INFINITY;
        continue;
      }
      float f = 1.0f;
      float lse2 = mm;
      if (p.sinks != nullptr) {
        const float sink = p.sinks[head] * kLog2e;
        const float mn = fmaxf(mm, sink);
        f = mm == -INFINITY ? 0.0f : exp2f(mm - mn);
        total = total * f + exp2f(sink - mn);
        lse2 = mn;
      }
      const float scale_o = total > 0.0f ? f / total : 0.0f;
      T* dst = static_cast<T*>(p.o) + OOffset(p, row, head) + warp * kColsPerWarp + 2 * qd;
#pragma unroll
      for (int n = 0; n < kColsPerWarp / 8; ++n) {
        *reinterpret_cast<uint32_t*>(dst + 8 * n) =
            Pack2<T>(acc[mt][n][2 * h2] * scale_o, acc[mt][n][2 * h2 + 1] * scale_o);
      }
      if (warp == 0 && qd == 0 && p.lse != nullptr) {
        p.lse[LseOffset(p, b, head, R / hq)] =
            total > 0.0f ? (lse2 + log2f(total)) / kLog2e : -INFINITY;
      }
    }
  }
}

template <typename T, int kMT, int kPhases, bool kOverlap>
cudaError_t RunDecode(const PagedDecodeLaunch& l, dim3 grid, cudaStream_t stream) {
  constexpr int kSmem = Cfg<kMT, kOverlap>::kSmem;
  const cudaError_t err = cudaFuncSetAttribute(PagedMlaDecodeKernel<T, kMT, kPhases, kOverlap>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  PagedMlaDecodeKernel<T, kMT, kPhases, kOverlap><<<grid, kThreads, kSmem, stream>>>(l);
  return cudaGetLastError();
}

template <typename T, int kPhases = 3, bool kOverlap = false>
cudaError_t RunMla(const PagedDecodeLaunch& l, int rows_per_cta, dim3 grid, cudaStream_t stream) {
  cudaError_t err;
  if (rows_per_cta == 16)
    err = RunDecode<T, 1, kPhases, kOverlap>(l, grid, stream);
  else if (rows_per_cta == 32)
    err = RunDecode<T, 2, kPhases, kOverlap>(l, grid, stream);
  else
    err = RunDecode<T, 4, kPhases, kOverlap>(l, grid, stream);
  if (err != cudaSuccess || l.part_o == nullptr) return err;
  return LaunchDecodeCombine<T, kDv>(l, stream);
}

}  // namespace

cudaError_t LaunchMlaKvAppend(const PagedAttnParams& dev, cudaStream_t stream) {
  return LaunchKvAppend(dev, stream);
}

namespace {

// rows_per_cta 0: the plan's (MlaRowsPerCta); phases < 3 or overlap: BF16
// alone.
cudaError_t LaunchMla(const PagedAttnParams& dev, const Plan& plan, void* workspace,
                      int rows_per_cta, int phases, bool overlap, cudaStream_t stream) {
  const AttnParams& p = dev.attn;
  if (p.total_q == 0 || p.batch == 0) return cudaSuccess;
  const int64_t rows = int64_t{p.seqlen_q} * p.num_heads_q;
  const int per_cta = rows_per_cta > 0
                          ? rows_per_cta
                          : MlaRowsPerCta(static_cast<int>(std::min<int64_t>(rows, 64)));
  const int64_t row_blocks = (rows + per_cta - 1) / per_cta;
  if (row_blocks > 65535 || p.batch > 65535 || plan.num_splits < 1 ||
      plan.num_splits > kMaxSplits || p.total_q > int64_t{INT32_MAX} || p.num_heads_q > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  const bool split = plan.num_splits > 1 || p.batch_invariant;
  if (split &&
      (workspace == nullptr || plan.workspace_bytes < SplitWorkspaceBytes(p, plan.num_splits))) {
    return cudaErrorInvalidValue;
  }
  const PagedDecodeLaunch l =
      MakeDecodeLaunch(dev, plan.num_splits, split ? workspace : nullptr, kDv);
  const dim3 grid(static_cast<unsigned>(plan.num_splits), static_cast<unsigned>(row_blocks),
                  static_cast<unsigned>(p.batch));
  if (overlap) {
    if (p.dtype != DType::kBF16 || phases != 3) return cudaErrorInvalidValue;
    return RunMla<__nv_bfloat16, 3, true>(l, per_cta, grid, stream);
  }
  if (phases < 3) {
    if (p.dtype != DType::kBF16) return cudaErrorInvalidValue;
    if (phases == 0) return RunMla<__nv_bfloat16, 0>(l, per_cta, grid, stream);
    if (phases == 1) return RunMla<__nv_bfloat16, 1>(l, per_cta, grid, stream);
    return RunMla<__nv_bfloat16, 2>(l, per_cta, grid, stream);
  }
  if (p.dtype == DType::kBF16) return RunMla<__nv_bfloat16>(l, per_cta, grid, stream);
  if (p.dtype == DType::kFP16) return RunMla<__half>(l, per_cta, grid, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchPagedMla(const PagedAttnParams& dev, const Plan& plan, void* workspace,
                           cudaStream_t stream) {
  return LaunchMla(dev, plan, workspace, 0, 3, false, stream);
}

cudaError_t LaunchPagedMlaAblation(const PagedAttnParams& dev, const Plan& plan, void* workspace,
                                   int rows_per_cta, int phases, bool overlap,
                                   cudaStream_t stream) {
  if (rows_per_cta != 16 && rows_per_cta != 32 && rows_per_cta != 64) return cudaErrorInvalidValue;
  if (phases < 0 || phases > 3) return cudaErrorInvalidValue;
  return LaunchMla(dev, plan, workspace, rows_per_cta, phases, overlap, stream);
}

}  // namespace cuda
}  // namespace attnserve
