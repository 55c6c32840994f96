// The fused CPU attention kernel (see cpu_attention_kernel.h). Written as plain
// loops over contiguous, fixed-size tiles so that g++ -O3 -march=x86-64-v3
// turns them into AVX2/FMA code: the D loop of Q·Kᵀ is moved outward (K tile
// stored transposed) so no loop needs a floating-point reduction reordered,
// and row max/sum use 8 explicit partial lanes for the same reason.
#include "backend/cpu/cpu_attention_kernel.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "common/dtype.h"

namespace attnserve {
namespace cpu {
namespace {

constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// dst[0, n) = row at `offset` of `base` (n elements of dtype t) as float;
// FP8 codes are decoded and multiplied by `descale` (1 for other dtypes).
inline void LoadRow(const void* base, DType t, int64_t offset, int n, float* dst, float descale) {
  switch (t) {
    case DType::kFP8E4M3: {
      const uint8_t* src = static_cast<const uint8_t*>(base) + offset;
      for (int i = 0; i < n; ++i) dst[i] = Fp8E4M3ToFloat(src[i]) * descale;
      return;
    }
    case DType::kFP32:
      std::memcpy(dst, static_cast<const float*>(base) + offset, sizeof(float) * n);
      return;
    case DType::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int i = 0; i < n; ++i) {
        const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
        std::memcpy(dst + i, &u, sizeof(float));
      }
      return;
    }
    case DType::kFP16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
#if defined(__F16C__)
      // n is a multiple of 8 (head_dim is): one vcvtph2ps per 8 values.
      for (int i = 0; i < n; i += 8) {
        _mm256_storeu_ps(
            dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
      }
#else
      for (int i = 0; i < n; ++i) dst[i] = Fp16ToFloat(src[i]);
#endif
      return;
    }
  }
}

// Row at `offset` of `base` (dtype t) = src[0, n) rounded to nearest even.
inline void StoreRow(const float* src, int n, DType t, void* base, int64_t offset) {
  switch (t) {
    case DType::kFP8E4M3: return;  // never an output dtype (OutputDType)
    case DType::kFP32:
      std::memcpy(static_cast<float*>(base) + offset, src, sizeof(float) * n);
      return;
    case DType::kBF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int i = 0; i < n; ++i) dst[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kFP16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
#if defined(__F16C__)
      for (int i = 0; i < n; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
      }
#else
      for (int i = 0; i < n; ++i) dst[i] = FloatToFp16(src[i]);
#endif
      return;
    }
  }
}

// s[r][j] = Σ_c q[r][c] · kt[c][j] for rows [0, rows_pad) and all kBlockN
// columns, kRowTile × 16 outputs at a time held in registers.
void ScoreTile(const float* __restrict q, const float* __restrict kt, int d, int rows_pad,
               float* __restrict s) {
  for (int r = 0; r < rows_pad; r += kRowTile) {
    const float* q0 = q + r * d;
    for (int j0 = 0; j0 < kBlockN; j0 += 2 * kLanes) {
      Vec8 acc[kRowTile][2] = {};
      for (int c = 0; c < d; ++c) {
        const Vec8 k_lo = Load8(kt + c * kBlockN + j0);
        const Vec8 k_hi = Load8(kt + c * kBlockN + j0 + kLanes);
        for (int rr = 0; rr < kRowTile; ++rr) {
          const Vec8 qv = Splat8(q0[rr * d + c]);
          acc[rr][0] += qv * k_lo;
          acc[rr][1] += qv * k_hi;
        }
      }
      for (int rr = 0; rr < kRowTile; ++rr) {
        Store8(s + (r + rr) * kBlockN + j0, acc[rr][0]);
        Store8(s + (r + rr) * kBlockN + j0 + kLanes, acc[rr][1]);
      }
    }
  }
}

// o[r][c0, c0 + 8·kVecs) += Σ_{j < nc} p[r][j] · v[j][c0, c0 + 8·kVecs).
template <int kVecs>
inline void PvChunk(const float* __restrict p, const float* __restrict v, int d, int r, int c0,
                    int nc, float* __restrict o) {
  Vec8 acc[kRowTile][kVecs];
  for (int rr = 0; rr < kRowTile; ++rr) {
    for (int x = 0; x < kVecs; ++x) acc[rr][x] = Load8(o + (r + rr) * d + c0 + x * kLanes);
  }
  for (int j = 0; j < nc; ++j) {
    Vec8 vv[kVecs];
    for (int x = 0; x < kVecs; ++x) vv[x] = Load8(v + j * d + c0 + x * kLanes);
    for (int rr = 0; rr < kRowTile; ++rr) {
      const Vec8 pv = Splat8(p[(r + rr) * kBlockN + j]);
      for (int x = 0; x < kVecs; ++x) acc[rr][x] += pv * vv[x];
    }
  }
  for (int rr = 0; rr < kRowTile; ++rr) {
    for (int x = 0; x < kVecs; ++x) Store8(o + (r + rr) * d + c0 + x * kLanes, acc[rr][x]);
  }
}

// o += p · v over the first nc keys of the tile; d is a multiple of 8.
void PvTile(const float* p, const float* v, int d, int rows_pad, int nc, float* o) {
  for (int r = 0; r < rows_pad; r += kRowTile) {
    int c0 = 0;
    for (; c0 + 2 * kLanes <= d; c0 += 2 * kLanes) PvChunk<2>(p, v, d, r, c0, nc, o);
    if (c0 < d) PvChunk<1>(p, v, d, r, c0, nc, o);
  }
}

inline float RowMax(const float* s) {
  Vec8 m = Load8(s);
  for (int j = kLanes; j < kBlockN; j += kLanes) {
    const Vec8 x = Load8(s + j);
    m = x > m ? x : m;
  }
  float r = m[0];
  for (int l = 1; l < kLanes; ++l) r = std::max(r, m[l]);
  return r;
}

// s[j] = 2^(s[j] - m) in place; returns their sum.
inline float ExpRowAndSum(float* s, float m) {
  Vec8 sum = {};
  const Vec8 mv = Splat8(m);
  for (int j = 0; j < kBlockN; j += kLanes) {
    const Vec8 e = Exp2NonPositive8(Load8(s + j) - mv);
    Store8(s + j, e);
    sum += e;
  }
  float r = 0.0f;
  for (int l = 0; l < kLanes; ++l) r += sum[l];
  return r;
}

}  // namespace

int64_t Scratch::BytesFor(int head_dim, int head_dim_v) {
  const int64_t d = head_dim;
  const int64_t dv = head_dim_v > 0 ? head_dim_v : head_dim;
  const int64_t wide = std::max(d, dv);
  return sizeof(float) * (kBlockM * d + d * kBlockN + kBlockN * wide + kBlockM * kBlockN +
                          kBlockM * dv + 2 * kBlockM);
}

std::unique_ptr<Scratch> Scratch::Create(int head_dim, int head_dim_v) {
  const int dv = head_dim_v > 0 ? head_dim_v : head_dim;
  const int64_t n = BytesFor(head_dim, dv) / static_cast<int64_t>(sizeof(float));
  // Value-initialised: K tile columns past a short last block are read (and
  // then masked) before any write, and must not hold NaN garbage.
  std::unique_ptr<float[]> buf(new (std::nothrow) float[n]());
  if (!buf) return nullptr;
  return std::unique_ptr<Scratch>(new (std::nothrow) Scratch(std::move(buf), head_dim, dv));
}

namespace {
std::atomic<int64_t> seq_prefix_steps{0};
}  // namespace

int64_t SeqPrefixSteps() { return seq_prefix_steps.load(std::memory_order_relaxed); }

bool SeqPrefix::Build(const AttnParams& p) { return Build(p, nullptr); }

bool SeqPrefix::Build(const PagedAttnParams& p) { return Build(p.attn, p.seqlens_k); }

bool SeqPrefix::Build(const AttnParams& p, const int32_t* seqlens_k) {
  pairs_before_.reset();
  rows_before_.reset();
  rows_total_ = HasBlockMask(p) && !IsVarlen(p) ? BlockRowsOf(p, 0) : 0;
  if (!IsVarlen(p)) return true;
  const bool pairs = p.bias != nullptr || p.mask != nullptr;
  const bool rows = HasBlockMask(p);
  if (!pairs && !rows) return true;
  const int batch = p.batch;
  if (pairs) {
    pairs_before_.reset(new (std::nothrow) int64_t[batch + 1]);
    if (!pairs_before_) return false;
  }
  if (rows) {
    rows_before_.reset(new (std::nothrow) int64_t[batch + 1]);
    if (!rows_before_) return false;
  }
  int64_t n_pairs = 0, n_rows = 0;
  for (int s = 0; s < batch; ++s) {
    if (pairs) pairs_before_[s] = n_pairs;
    if (rows) rows_before_[s] = n_rows;
    n_pairs += int64_t{SeqLenQ(p, s)} * (seqlens_k != nullptr ? seqlens_k[s] : SeqLenK(p, s));
    if (rows) n_rows += BlockRowsOf(p, s);
  }
  if (pairs) pairs_before_[batch] = n_pairs;
  if (rows) rows_before_[batch] = n_rows;
  rows_total_ = n_rows;
  seq_prefix_steps.fetch_add(batch, std::memory_order_relaxed);
  return true;
}

// BlockRow (params.h) with the varlen sums from `prefix`: params.h's walks
// the sequences for both rows_before and the varlen total.
inline int64_t TaskBlockRow(const AttnParams& p, const SeqPrefix& prefix, int b, int h, int r) {
  const int64_t hh = p.block_per_head ? h : 0;
  if (IsVarlen(p)) return hh * prefix.BlockRowsTotal() + prefix.BlockRowsBefore(b) + r;
  return BlockRow(p, 0, b, h, r);
}

// The score modifiers and masks of one task (params.h), in the tile's log2
// units: every additive term is multiplied by log2(e) like the scores.
struct TaskMods {
  const AttnParams& p;
  int b, h, i0, sq, sk;  // sk: the task's keys (a paged sequence's whole length)
  int64_t pairs_before;  // PairsBefore(p, b), for bias and mask offsets
  float alibi_log2;      // slope × log2(e); 0 without ALiBi

  TaskMods(const AttnParams& params, const SeqPrefix& prefix, int b_, int h_, int i0_, int sq_,
           int sk_)
      : p(params), b(b_), h(h_), i0(i0_), sq(sq_), sk(sk_) {
    pairs_before = prefix.PairsBefore(b);
    alibi_log2 = p.alibi_slopes != nullptr ? p.alibi_slopes[h] * kLog2e : 0.0f;
  }

  // PairOffset with the task's own sk: a paged sequence's rows of a bias or
  // mask span its whole history, not the call's new rows (SeqLenK).
  int64_t Offset(bool per_batch, bool per_head, int i, int j0) const {
    if (!IsVarlen(p)) return PairOffset(p, per_batch, per_head, pairs_before, b, h, i, j0);
    return (per_head ? h : 0) * p.total_pairs + pairs_before + int64_t{i} * sk + j0;
  }

  // Columns [a, e) of row r's score tile (keys j0 + a ..): + ALiBi, + bias,
  // then masked keys (mask byte 0) to -inf; a -inf bias gives -inf itself.
  void Apply(int r, int j0, int a, int e, float* s_row) const {
    const int i = i0 + r;
    if (p.alibi_slopes != nullptr) {
      // |diag - key| with diag = i + sk - sq (bottom-right aligned).
      const float dist0 = static_cast<float>(i + (sk - sq) - j0);
      for (int j = a; j < e; ++j) s_row[j] -= alibi_log2 * std::fabs(dist0 - static_cast<float>(j));
    }
    if (p.bias != nullptr) {
      const int64_t off = Offset(p.bias_per_batch, p.bias_per_head, i, j0);
      switch (p.bias_dtype) {
        case DType::kFP32: {
          const float* src = static_cast<const float*>(p.bias) + off;
          for (int j = a; j < e; ++j) s_row[j] += src[j] * kLog2e;
          break;
        }
        case DType::kBF16: {
          const uint16_t* src = static_cast<const uint16_t*>(p.bias) + off;
          for (int j = a; j < e; ++j) s_row[j] += Bf16ToFloat(src[j]) * kLog2e;
          break;
        }
        case DType::kFP16: {
          const uint16_t* src = static_cast<const uint16_t*>(p.bias) + off;
          for (int j = a; j < e; ++j) s_row[j] += Fp16ToFloat(src[j]) * kLog2e;
          break;
        }
        case DType::kFP8E4M3: break;  // refused by CheckParams
      }
    }
    if (p.mask != nullptr) {
      const uint8_t* m = p.mask + Offset(p.mask_per_batch, p.mask_per_head, i, j0);
      for (int j = a; j < e; ++j) s_row[j] = m[j] != 0 ? s_row[j] : kNegInf;
    }
  }
};

// The tile loop of AttentionTask over any K/V row source: kv.LoadK(j, hk,
// dst) and kv.LoadV(j, hk, dst) load key j (0-based within the sequence,
// j < sk) of KV head hk as floats. The contiguous path reads the request's
// K/V; the paged path reads in place through a block table. kMods: the call
// has score modifiers or masks (params.h); a template flag so the plain path
// keeps its loop untouched.
template <bool kMods, class KvRows>
void AttentionTaskOver(const AttnParams& p, const SeqPrefix& prefix, int b, int h, int m_block,
                       int sk, const KvRows& kv, Scratch* scratch) {
  const int d = p.head_dim;
  const int dv = HeadDimV(p);  // V's and O's: differs from d for MLA
  const int sq = SeqLenQ(p, b);
  const int64_t q_start = SeqStartQ(p, b);
  const int hk = KVHead(p, h);
  const int i0 = m_block * kBlockM;
  const int rows = std::min(kBlockM, sq - i0);
  const int rows_pad = (rows + kRowTile - 1) / kRowTile * kRowTile;
  const bool capped = p.softcap > 0.0f;
  // Scores come out of the GEMM in the units the next step wants: log2 units
  // (scale·log2(e) folded into Q) without softcap; s/softcap with it, so tanh
  // applies directly and softcap·log2(e) rescales afterwards.
  const float q_scale = capped ? p.softmax_scale / p.softcap : p.softmax_scale_log2;
  const float cap_log2 = p.softcap * kLog2e;

  float* q = scratch->q();
  float* kt = scratch->kt();
  float* v = scratch->v();
  float* s = scratch->s();
  float* o = scratch->o();
  float* m = scratch->m();
  float* l = scratch->l();

  // Each row's visible keys, and their union: the only K/V blocks scanned.
  // Visible ranges move right by one per row, so the union is one interval.
  int lo[kBlockM], hi[kBlockM];
  int span_lo = INT_MAX, span_hi = -1;
  for (int r = 0; r < rows; ++r) {
    VisibleKeys(p, i0 + r, sq, sk, &lo[r], &hi[r]);
    if (lo[r] <= hi[r]) {
      span_lo = std::min(span_lo, lo[r]);
      span_hi = std::max(span_hi, hi[r]);
    }
  }
  // A sink starts every row's running max and sum (its own exp2(0) = 1), so
  // O and LSE include it exactly and a row that sees no key keeps O = 0.
  const bool sink = kMods && p.sinks != nullptr;
  std::fill(m, m + kBlockM, sink ? p.sinks[h] * kLog2e : kNegInf);
  std::fill(l, l + kBlockM, sink ? 1.0f : 0.0f);
  std::fill(o, o + rows_pad * dv, 0.0f);

  // Keys [k_lo, k_hi] in tiles of up to kBlockN.
  auto scan = [&](int k_lo, int k_hi, const TaskMods* mods) {
    for (int j0 = k_lo; j0 <= k_hi; j0 += kBlockN) {
      const int nc = std::min(kBlockN, k_hi + 1 - j0);
      // K rows land in the V tile first, then are transposed into kt.
      for (int j = 0; j < nc; ++j) kv.LoadK(j0 + j, hk, v + j * d);
      for (int j = 0; j < nc; ++j) {
        for (int c = 0; c < d; ++c) kt[c * kBlockN + j] = v[j * d + c];
      }
      for (int j = 0; j < nc; ++j) kv.LoadV(j0 + j, hk, v + j * dv);

      ScoreTile(q, kt, d, rows_pad, s);

      for (int r = 0; r < rows; ++r) {
        float* s_row = s + r * kBlockN;
        // Visible columns of this row in this tile: [a, e).
        const int a = std::max(lo[r] - j0, 0);
        const int e = std::min(hi[r] - j0 + 1, nc);
        if (a >= e) {
          std::fill(s_row, s_row + kBlockN, 0.0f);
          continue;
        }
        if (capped) {
          for (int j = a; j < e; ++j) s_row[j] = cap_log2 * std::tanh(s_row[j]);
        }
        if constexpr (kMods) mods->Apply(r, j0, a, e, s_row);
        // Mask after the cap, only where this row's range cuts the tile.
        std::fill(s_row, s_row + a, kNegInf);
        std::fill(s_row + e, s_row + kBlockN, kNegInf);
        const float m_new = std::max(m[r], RowMax(s_row));
        if constexpr (kMods) {
          // Every key so far masked: nothing to add (and -inf - -inf is NaN).
          if (m_new == kNegInf) {
            std::fill(s_row, s_row + kBlockN, 0.0f);
            continue;
          }
        }
        const float alpha = Exp2NonPositive(m[r] - m_new);  // 0 on the first visible tile
        const float sum = ExpRowAndSum(s_row, m_new);
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
        if (alpha != 1.0f) {
          float* o_row = o + r * dv;
          for (int c = 0; c < dv; ++c) o_row[c] *= alpha;
        }
      }
      std::fill(s + rows * kBlockN, s + rows_pad * kBlockN, 0.0f);

      PvTile(s, v, dv, rows_pad, nc, o);
    }
  };

  if (span_lo <= span_hi) {
    for (int r = 0; r < rows; ++r) {
      float* q_row = q + r * d;
      LoadRow(p.q, p.dtype, QOffset(p, q_start + i0 + r, h), d, q_row, p.q_descale);
      for (int c = 0; c < d; ++c) q_row[c] *= q_scale;
    }
    std::fill(q + rows * d, q + rows_pad * d, 0.0f);

    if constexpr (!kMods) {
      scan(span_lo, span_hi, nullptr);
    } else {
      const TaskMods mods(p, prefix, b, h, i0, sq, sk);
      if (!HasBlockMask(p)) {
        scan(span_lo, span_hi, &mods);
      } else {
        // The task's rows lie in one query block (kBlockM divides block_q):
        // only its kept key blocks are scanned, masked ones never loaded.
        const int64_t row = TaskBlockRow(p, prefix, b, h, i0 / p.block_q);
        const int32_t* first = p.block_col_idx + p.block_row_ptr[row];
        const int32_t* last = p.block_col_idx + p.block_row_ptr[row + 1];
        for (const int32_t* c = std::lower_bound(first, last, span_lo / p.block_k); c < last; ++c) {
          const int64_t block_lo = int64_t{*c} * p.block_k;
          if (block_lo > span_hi) break;
          scan(static_cast<int>(std::max<int64_t>(block_lo, span_lo)),
               static_cast<int>(std::min<int64_t>(block_lo + p.block_k - 1, span_hi)), &mods);
        }
      }
    }
  }

  // Normalise once; rows that saw no key keep O = 0 and get LSE = -inf (or,
  // with a sink, l = its share and LSE = the sink).
  for (int r = 0; r < rows; ++r) {
    float* o_row = o + r * dv;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int c = 0; c < dv; ++c) o_row[c] *= inv;
    StoreRow(o_row, dv, OutputDType(p.dtype), p.o, OOffset(p, q_start + i0 + r, h));
    if (p.lse != nullptr) {
      p.lse[LseOffset(p, b, h, i0 + r)] = l[r] > 0.0f ? (m[r] + std::log2(l[r])) * kLn2 : kNegInf;
    }
  }
}

namespace {

// K/V rows of sequence b, contiguous in the request (p.k, p.v).
struct ContiguousKvRows {
  const AttnParams& p;
  int64_t k_start;
  void LoadK(int j, int hk, float* dst) const {
    LoadRow(p.k, p.dtype, KVOffset(p, k_start + j, hk), p.head_dim, dst, p.k_descale);
  }
  void LoadV(int j, int hk, float* dst) const {
    LoadRow(p.v, p.dtype, VOffset(p, k_start + j, hk), HeadDimV(p), dst, p.v_descale);
  }
};

// K/V rows of sequence b of a paged launch, read in place through its block
// table (no contiguous copy of the context is ever made).
struct PagedKvRows {
  const PagedAttnParams& p;
  const int32_t* table;  // sequence b's row of the block table
  // The first n elements of key j's row of kv head hk in slabs whose rows
  // have `row_dim` elements.
  void Load(void* const* slabs, int row_dim, int n, int j, int hk, float* dst) const {
    const int32_t page = table[j >> p.pages.page_shift];
    const int t = j & (p.pages.page_size - 1);
    const int64_t offset = PageRowOffset(p.pages, page, t, p.attn.num_heads_kv, row_dim, hk);
    const void* slab = slabs[PageSlab(p.pages, page)];
    if (!p.pages.fp8_e4m3) {
      LoadRow(slab, p.attn.dtype, offset, n, dst, 1.0f);
      return;
    }
    // FP8 cache: codes times the row's scale (paged_kv.h's slab layout).
    float scale;
    std::memcpy(&scale,
                static_cast<const char*>(slab) +
                    PageScaleOffset(p.pages, page, t, p.attn.num_heads_kv, row_dim, hk),
                sizeof(scale));
    LoadRow(slab, DType::kFP8E4M3, offset, n, dst, scale);
  }
  void LoadK(int j, int hk, float* dst) const {
    Load(p.pages.k_slabs, p.attn.head_dim, p.attn.head_dim, j, hk, dst);
  }
  // V in K's pages (v_in_k): the first Dv elements of the K row.
  void LoadV(int j, int hk, float* dst) const {
    if (p.pages.v_in_k) {
      Load(p.pages.k_slabs, p.attn.head_dim, HeadDimV(p.attn), j, hk, dst);
    } else {
      Load(p.pages.v_slabs, HeadDimV(p.attn), HeadDimV(p.attn), j, hk, dst);
    }
  }
};

// The kernel for p's mods over any K/V row source: the plain loop unless
// the call has score modifiers or masks.
template <class KvRows>
void RunTask(const AttnParams& p, const SeqPrefix& prefix, int b, int h, int m_block, int sk,
             const KvRows& kv, Scratch* scratch) {
  if (HasScoreMods(p)) {
    AttentionTaskOver<true>(p, prefix, b, h, m_block, sk, kv, scratch);
  } else {
    AttentionTaskOver<false>(p, prefix, b, h, m_block, sk, kv, scratch);
  }
}

}  // namespace

void AttentionTask(const AttnParams& p, const SeqPrefix& prefix, int b, int h, int m_block,
                   Scratch* scratch) {
  RunTask(p, prefix, b, h, m_block, SeqLenK(p, b), ContiguousKvRows{p, SeqStartK(p, b)}, scratch);
}

void PagedAttentionTask(const PagedAttnParams& p, const SeqPrefix& prefix, int b, int h,
                        int m_block, Scratch* scratch) {
  // sk is the whole sequence, so ALiBi's bottom-right diagonal counts the
  // cached keys and a bias or mask row spans the sequence's history.
  RunTask(p.attn, prefix, b, h, m_block, p.seqlens_k[b],
          PagedKvRows{p, p.block_table + int64_t{b} * p.block_table_stride}, scratch);
}

}  // namespace cpu
}  // namespace attnserve
