// The fused CPU attention kernel: one task computes the output rows of one
// (sequence, query head, block of kBlockM query rows), scanning K/V in blocks
// of kBlockN keys with an online softmax (FlashAttention-2 loop order). The
// Sq×Sk score matrix never exists; a task touches only its Scratch.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>

#include "backend/paged_kv.h"
#include "backend/params.h"

namespace attnserve {
namespace cpu {

// Tile sizes. 64×64: a task's working set for D = 64 (Q, Kᵀ and V tiles, the
// 64×64 score tile, the fp32 O accumulator: 5 × 16 KiB) stays in a 512 KiB
// L2 with room for the K/V stream, and a 64-wide score row is 8 AVX2
// registers, so the row max/exp/sum loops run at full vector width. Smaller
// query blocks give more tasks (better balance for short sequences) but reload
// K/V once per block: with 64, each K/V element loaded and converted is used
// 64 times, which keeps conversion under ~2% of the FLOPs.
inline constexpr int kBlockM = 64;
inline constexpr int kBlockN = 64;
// Register tile of the two small GEMMs: 4 query rows × 16 columns = 8 ymm
// accumulators (plus 2 operand loads and a broadcast, within AVX2's 16
// registers), enough independent FMA chains to cover FMA latency on two ports.
inline constexpr int kRowTile = 4;

// Eight floats, one AVX2 register. GCC/Clang vector extensions rather than
// intrinsics: plain arithmetic syntax, and the compiler still picks the
// instructions (FMA from a*b+c under -ffp-contract=fast). The micro-kernels
// use them because the auto-vectoriser would not keep a 4×16 accumulator
// tile in registers (it falls back to scalar FMAs).
typedef float Vec8 __attribute__((vector_size(32)));
typedef int32_t Vec8i __attribute__((vector_size(32)));
inline constexpr int kLanes = 8;

inline Vec8 Load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }
// Listing the lanes (not Vec8{} + x, which costs a scalar add: 0 + x is not x
// for x = -0) so this is a single vbroadcastss.
inline Vec8 Splat8(float x) { return Vec8{x, x, x, x, x, x, x, x}; }

// 2^x for x <= 0 (and -inf), eight at a time: x = n + f with n = round(x) and
// f in [-0.5, 0.5]; 2^f from its degree-7 Taylor polynomial (truncation error
// (0.5·ln2)^8/8! ≈ 5e-9, below float rounding) and 2^n built in the exponent
// bits. Anything below 2^-125 relative to the running max is flushed to 0,
// which is also how masked (-inf) scores become exactly 0. Shared with
// bench/cpu's naive attention so both pay the same for exp.
inline Vec8 Exp2NonPositive8(Vec8 x) {
  const Vec8 xc = x < -126.0f ? Splat8(-126.0f) : x;
  // Truncating xc - 0.5 (in [-126.5, -0.5]) toward zero rounds xc to nearest.
  const Vec8i n = __builtin_convertvector(xc - 0.5f, Vec8i);
  const Vec8 f = xc - __builtin_convertvector(n, Vec8);
  Vec8 poly = Splat8(1.5252733804059837e-05f);
  poly = poly * f + 1.5403530393381606e-04f;
  poly = poly * f + 1.3333558146428443e-03f;
  poly = poly * f + 9.6181291076284772e-03f;
  poly = poly * f + 5.5504108664821580e-02f;
  poly = poly * f + 2.4022650695910071e-01f;
  poly = poly * f + 6.9314718055994531e-01f;
  poly = poly * f + 1.0f;
  const Vec8 two_n = reinterpret_cast<Vec8>((n + 127) << 23);
  return x < -125.0f ? Splat8(0.0f) : poly * two_n;
}
inline float Exp2NonPositive(float x) { return Exp2NonPositive8(Splat8(x))[0]; }

// Per-thread working memory, sized for one pair of head dims (D of Q and K,
// Dv of V and O; head_dim_v 0 means Dv = D): O(kBlockM·D + kBlockN·max(D, Dv)
// + kBlockM·Dv + kBlockM·kBlockN) floats, independent of the sequence lengths.
class Scratch {
 public:
  // Null on allocation failure (the caller reports RESOURCE_EXHAUSTED).
  static std::unique_ptr<Scratch> Create(int head_dim, int head_dim_v = 0);
  // Bytes this scratch holds (the benchmark's memory accounting cross-check).
  static int64_t BytesFor(int head_dim, int head_dim_v = 0);

  float* q() { return buf_.get(); }               // [kBlockM, D], pre-scaled
  float* kt() { return q() + kBlockM * d_; }      // [D, kBlockN], K tile transposed
  float* v() { return kt() + d_ * kBlockN; }      // [kBlockN, max(D, Dv)]: K rows, then V's
  float* s() { return v() + kBlockN * wide_; }    // [kBlockM, kBlockN], scores then P
  float* o() { return s() + kBlockM * kBlockN; }  // [kBlockM, Dv], unnormalised
  float* m() { return o() + kBlockM * dv_; }      // [kBlockM] running max (log2 units)
  float* l() { return m() + kBlockM; }            // [kBlockM] running sum
  int head_dim() const { return d_; }
  int head_dim_v() const { return dv_; }

 private:
  Scratch(std::unique_ptr<float[]> buf, int d, int dv)
      : buf_(std::move(buf)), d_(d), dv_(dv), wide_(d > dv ? d : dv) {}
  std::unique_ptr<float[]> buf_;
  int d_;
  int dv_;
  int wide_;
};

// Per-sequence offsets of a varlen call's pair-layout modifiers (bias,
// element mask: PairOffset's pairs_before; block mask: BlockRow's
// rows_before and the query blocks of all sequences), summed once per call:
// a task looking them up is O(1), where walking the sequences before its own
// made a call of B sequences cost O(B^2). Dense calls and calls without those
// modifiers need none (Build leaves the arrays empty).
class SeqPrefix {
 public:
  // Fills the arrays for p (B + 1 entries each where needed); false when they
  // cannot be allocated.
  bool Build(const AttnParams& p);
  // A paged launch: sequence b's pairs span its whole history, seqlens_k[b].
  bool Build(const PagedAttnParams& p);
  int64_t PairsBefore(int b) const { return pairs_before_ ? pairs_before_[b] : 0; }
  int64_t BlockRowsBefore(int b) const { return rows_before_ ? rows_before_[b] : 0; }
  int64_t BlockRowsTotal() const { return rows_total_; }

 private:
  bool Build(const AttnParams& p, const int32_t* seqlens_k);
  std::unique_ptr<int64_t[]> pairs_before_;
  std::unique_ptr<int64_t[]> rows_before_;
  int64_t rows_total_ = 0;
};

// Sequences visited by SeqPrefix::Build since the process started: a test
// hook (score_mods_cpu_test bounds a call's walk by its B), the only walk over
// the sequences a modifier call makes.
int64_t SeqPrefixSteps();

// Computes rows [m_block * kBlockM, min(+kBlockM, Sq)) of sequence b, query
// head h: writes o (in OutputDType(p.dtype)) and, when p.lse is set, lse; FP8
// rows are dequantised (code x descale) as they load. Applies p's score
// modifiers and masks (params.h); a block mask's dropped key blocks are never
// loaded. `p` must have passed CheckParams; `prefix` is SeqPrefix::Build(p)'s.
void AttentionTask(const AttnParams& p, const SeqPrefix& prefix, int b, int h, int m_block,
                   Scratch* scratch);

// The same for sequence b of a paged launch (paged_kv.h): its keys are the
// p.seqlens_k[b] tokens its block table names (new rows already appended),
// read in place from the pages, with p.attn's q, o, lse, options and score
// modifiers (ALiBi over positions in the whole sequence, sinks, a bias and
// element mask whose sequence-b rows span its seqlens_k[b] keys); a block
// mask is refused by CheckPagedParams. V rows have HeadDimV(p.attn)
// elements, read from the V pages or, with pages.v_in_k, as the first Dv
// elements of the K rows. `prefix` is SeqPrefix::Build(p)'s.
void PagedAttentionTask(const PagedAttnParams& p, const SeqPrefix& prefix, int b, int h,
                        int m_block, Scratch* scratch);

}  // namespace cpu
}  // namespace attnserve
