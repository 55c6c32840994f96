// FP8 E4M3 -> BF16 dequantisation of an FP8 call's inputs (see fp8_dequant.h).
// A memory-bound elementwise kernel: each thread turns 8 codes (one 8-byte
// load) into 8 BF16 values (one 16-byte store), grid-stride over the tensor.
// For Plan::fp8_pv, V's codes are transposed instead (TransposeVtE4M3).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "backend/cuda/fp8_dequant.h"
#include "backend/cuda/fp8_vt_layout.h"

namespace attnserve {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// Enough CTAs to fill any current GPU several times over; the grid-stride
// loop covers larger tensors.
constexpr int64_t kMaxBlocks = 4096;

int64_t Align256(int64_t x) { return (x + 255) / 256 * 256; }

__device__ __forceinline__ float DecodeE4M3(uint32_t code) {
  __nv_fp8_e4m3 x;
  x.__x = static_cast<__nv_fp8_storage_t>(code);
  return static_cast<float>(x);
}

// dst[i] = bf16(decode(src[i]) * descale) for i < 8 * n8.
__global__ void DequantE4M3ToBf16(const uint2* __restrict__ src, int64_t n8, float descale,
                                  uint4* __restrict__ dst) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n8; i += stride) {
    const uint2 codes = src[i];
    uint32_t out[4];
    for (int w = 0; w < 4; ++w) {
      const uint32_t word = w < 2 ? codes.x : codes.y;
      const int shift = (w % 2) * 16;
      const float lo = DecodeE4M3((word >> shift) & 0xffu) * descale;
      const float hi = DecodeE4M3((word >> (shift + 8)) & 0xffu) * descale;
      const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);  // .x = lo: little-endian order
      out[w] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    dst[i] = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

cudaError_t Dequant(const void* src, int64_t elements, float descale, void* dst,
                    cudaStream_t stream) {
  const int64_t n8 = elements / 8;  // head_dim is a multiple of 8, so elements is too
  if (n8 == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n8 + kThreads - 1) / kThreads, kMaxBlocks);
  DequantE4M3ToBf16<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint2*>(src), n8, descale, static_cast<uint4*>(dst));
  return cudaGetLastError();
}

// V^T (fp8_vt_layout.h) from V's codes: a CTA per 64 columns of one KV
// head's rows. Each column's key (or none: a gap, a permuted slot past the
// sequence's end, the padding) is found first; the keys' D codes are read as
// 8-byte rows into shared memory and written out as 64-byte runs of each
// V^T row, so both global sides are coalesced.
constexpr int kVtCols = 64;
constexpr int kVtMaxDim = 256;

// The V row (a key of the whole tensor) V^T's column c holds, or -1.
__device__ int64_t VtSourceRow(const AttnParams& p, int64_t c) {
  int b;
  if (IsVarlen(p)) {
    // The last sequence whose first column is at or before c.
    int lo = 0, hi = p.batch;  // VtSeqStart(p, batch): the padding's start
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (VtSeqStart(p, mid) <= c) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    b = lo;
  } else {
    b = static_cast<int>(c / VtDensePeriod(p));
  }
  if (b >= p.batch) return -1;
  const int64_t pos = c - VtSeqStart(p, b);
  const int sk = SeqLenK(p, b);
  const int64_t key =
      pos / kFp8VtGroup * kFp8VtGroup + Fp8VtKeyAt(static_cast<int>(pos % kFp8VtGroup));
  return key < sk ? SeqStartK(p, b) + key : -1;
}

__global__ void __launch_bounds__(256)
    TransposeVtE4M3(const AttnParams p, int64_t width, uint8_t* __restrict__ vt) {
  __shared__ int64_t src[kVtCols];
  // [column][d], rows padded by a word: an odd number of words a row keeps
  // the second phase's word reads at most two to a bank.
  __shared__ __align__(4) uint8_t tile[kVtCols][kVtMaxDim + 4];
  const int d = p.head_dim;
  const int hk = blockIdx.y;
  const int64_t c0 = int64_t{blockIdx.x} * kVtCols;
  const int tid = threadIdx.x;
  if (tid < kVtCols) src[tid] = VtSourceRow(p, c0 + tid);
  __syncthreads();
  const uint8_t* v = static_cast<const uint8_t*>(p.v);
  const int parts = d / 8;
  for (int i = tid; i < kVtCols * parts; i += blockDim.x) {
    const int c = i / parts, part = i % parts;
    const int64_t row = src[c];
    const uint2 x = row >= 0 ? *reinterpret_cast<const uint2*>(v + VOffset(p, row, hk) + part * 8)
                             : make_uint2(0, 0);
    *reinterpret_cast<uint32_t*>(&tile[c][part * 8]) = x.x;
    *reinterpret_cast<uint32_t*>(&tile[c][part * 8 + 4]) = x.y;
  }
  __syncthreads();
  // Each task: rows d0 .. d0 + 3 of 8 columns (a run), from 8 words (one
  // column's 4 rows each) by 4 x 4 byte transposes; the 8 tasks of a row
  // group are adjacent lanes, so each output row is written as 64 contiguous
  // bytes.
  for (int i = tid; i < (d / 4) * (kVtCols / 8); i += blockDim.x) {
    const int d0 = i / (kVtCols / 8) * 4, run = i % (kVtCols / 8);
    uint32_t w[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) w[e] = *reinterpret_cast<const uint32_t*>(&tile[run * 8 + e][d0]);
    uint32_t lo[4], hi[4];  // row r's bytes of columns 0-3 and 4-7
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t* x = w + 4 * h;
      // t0: byte 0 and 1 of columns 0, 1 interleaved; t1 their bytes 2, 3; t2, t3 columns 2, 3.
      const uint32_t t0 = __byte_perm(x[0], x[1], 0x5140), t1 = __byte_perm(x[0], x[1], 0x7362);
      const uint32_t t2 = __byte_perm(x[2], x[3], 0x5140), t3 = __byte_perm(x[2], x[3], 0x7362);
      uint32_t* out = h == 0 ? lo : hi;
      out[0] = __byte_perm(t0, t2, 0x5410);
      out[1] = __byte_perm(t0, t2, 0x7632);
      out[2] = __byte_perm(t1, t3, 0x5410);
      out[3] = __byte_perm(t1, t3, 0x7632);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      *reinterpret_cast<uint2*>(vt + (int64_t{hk} * d + d0 + r) * width + c0 + run * 8) =
          make_uint2(lo[r], hi[r]);
    }
  }
}

cudaError_t TransposeVt(const AttnParams& p, void* dst, cudaStream_t stream) {
  const int64_t width = VtWidth(p);
  if (p.head_dim > kVtMaxDim || p.head_dim % 8 != 0) return cudaErrorInvalidValue;
  if (p.num_heads_kv == 0 || width / kVtCols > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(width / kVtCols), static_cast<unsigned>(p.num_heads_kv));
  TransposeVtE4M3<<<grid, 256, 0, stream>>>(p, width, static_cast<uint8_t*>(dst));
  return cudaGetLastError();
}

}  // namespace

// The copies' layout: v first (the only one when fp8_qk), then q and k.
int64_t Fp8ScratchBytes(const AttnParams& p, bool fp8_qk, bool fp8_pv) {
  if (fp8_qk && fp8_pv) return Align256(VtBytes(p));
  const int64_t q = p.total_q * p.num_heads_q * p.head_dim * 2;
  const int64_t kv = p.total_k * p.num_heads_kv * p.head_dim * 2;
  return fp8_qk ? Align256(kv) : 2 * Align256(kv) + Align256(q);
}

cudaError_t DequantiseFp8(const AttnParams& dev, bool fp8_qk, bool fp8_pv, void* scratch,
                          cudaStream_t stream, AttnParams* bf16) {
  if (fp8_qk && fp8_pv) {
    // Q and K stay codes; V^T's codes keep V's descale (the epilogue's).
    *bf16 = dev;
    bf16->dtype = DType::kBF16;
    bf16->v = scratch;
    return dev.total_k == 0 ? cudaSuccess : TransposeVt(dev, scratch, stream);
  }
  const int64_t q_elems = dev.total_q * dev.num_heads_q * dev.head_dim;
  const int64_t kv_elems = dev.total_k * dev.num_heads_kv * dev.head_dim;
  char* v = static_cast<char*>(scratch);
  char* q = v + Align256(kv_elems * 2);
  char* k = q + Align256(q_elems * 2);
  cudaError_t err = Dequant(dev.v, kv_elems, dev.v_descale, v, stream);
  if (!fp8_qk) {
    if (err == cudaSuccess) err = Dequant(dev.q, q_elems, dev.q_descale, q, stream);
    if (err == cudaSuccess) err = Dequant(dev.k, kv_elems, dev.k_descale, k, stream);
  }
  *bf16 = dev;
  bf16->dtype = DType::kBF16;
  bf16->v = v;
  bf16->v_descale = 1.0f;
  if (!fp8_qk) {
    bf16->q = q;
    bf16->k = k;
    bf16->q_descale = bf16->k_descale = 1.0f;
  }
  return err;
}

}  // namespace cuda
}  // namespace attnserve
