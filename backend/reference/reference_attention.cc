// Float64 materialised attention and its low-precision twin (see the header).
// Deliberately the textbook algorithm: full score matrix, then softmax, then
// P·V, so it shares no code path with the fused kernels it checks. The band
// comes only from params.h's VisibleKeys, the contract's one statement of it;
// the mods follow params.h's order (scale, softcap, ALiBi, bias, masks, sinks)
// read element by element through its layout helpers.
#include "backend/reference/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/dtype.h"

namespace attnserve {
namespace {

// Which arithmetic the materialised algorithm runs in.
enum class Precision {
  kExact,  // double everywhere
  kLow,    // float accumulation, intermediates rounded to p.dtype
};

// Rounds x to the intermediate precision of the run.
inline double Round(Precision prec, DType t, double x) {
  return prec == Precision::kExact ? x : RoundTo(t, static_cast<float>(x));
}

// Input element i of `data` (q, k or v of p) as a value: FP8 codes times the
// tensor's descale, in float64; rounded to BF16 in the low-precision run,
// where FP8 inputs are computed as BF16.
inline double Input(Precision prec, const AttnParams& p, const void* data, float descale,
                    int64_t i) {
  const double x = static_cast<double>(LoadAsFloat(data, p.dtype, i)) * descale;
  if (prec == Precision::kExact || p.dtype != DType::kFP8E4M3) return x;
  return RoundTo(DType::kBF16, static_cast<float>(x));
}

// Element c of row `row`, kv head hk, of an FP8 cache's K or V (KvRowScales):
// code x scale, exact in float64; rounded to p.dtype in the low-precision run.
// `offset` is KVOffset (K) or VOffset (V) of (row, hk).
inline double CacheInput(Precision prec, const AttnParams& p, const void* codes,
                         const float* scales, int64_t offset, int64_t row, int hk, int c) {
  const double x =
      static_cast<double>(Fp8E4M3ToFloat(static_cast<const uint8_t*>(codes)[offset + c])) *
      static_cast<double>(scales[row * p.num_heads_kv + hk]);
  return prec == Precision::kExact ? x : RoundTo(p.dtype, static_cast<float>(x));
}

// True when key block `kb` is among the kept columns of CSR row `row`.
bool BlockKept(const AttnParams& p, int64_t row, int kb) {
  const int32_t* first = p.block_col_idx + p.block_row_ptr[row];
  const int32_t* last = p.block_col_idx + p.block_row_ptr[row + 1];
  return std::binary_search(first, last, kb);
}

ReferenceOutput Run(const AttnParams& p, Precision prec, const KvRowScales* cache) {
  // The dtype intermediates are rounded to: O's (BF16 for FP8 inputs).
  const DType t = OutputDType(p.dtype);
  const int hq = p.num_heads_q;
  const int d = p.head_dim;
  const int dv = HeadDimV(p);  // V's and O's (MLA: != d)
  const int64_t total_q = p.total_q;
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  ReferenceOutput out;
  out.o.assign(static_cast<size_t>(total_q * hq * dv), 0.0);
  out.lse.assign(static_cast<size_t>(total_q * hq), kNegInf);
  const double scale = p.softmax_scale;
  const double cap = p.softcap;

  std::vector<double> scores;  // [sq, sk]: materialised on purpose
  std::vector<char> kept;      // [sk] of the current row: survives band and masks
  std::vector<double> qrow(d);
  std::vector<double> krows;  // [sk, d], widened once per (b, h)
  std::vector<double> vrows;  // [sk, dv]
  for (int b = 0; b < p.batch; ++b) {
    const int sq = SeqLenQ(p, b);
    const int sk = SeqLenK(p, b);
    const int64_t q0 = SeqStartQ(p, b);
    const int64_t k0 = SeqStartK(p, b);
    const int64_t pairs_before = PairsBefore(p, b);
    const int64_t block_rows_before = HasBlockMask(p) ? BlockRowsBefore(p, b) : 0;
    for (int h = 0; h < hq; ++h) {
      const int hk = KVHead(p, h);
      krows.assign(static_cast<size_t>(sk) * d, 0.0);
      vrows.assign(static_cast<size_t>(sk) * dv, 0.0);
      for (int j = 0; j < sk; ++j) {
        const int64_t off = KVOffset(p, k0 + j, hk);
        const int64_t voff = VOffset(p, k0 + j, hk);
        for (int c = 0; c < d; ++c) {
          const size_t at = static_cast<size_t>(j) * d + c;
          krows[at] = cache != nullptr ? CacheInput(prec, p, p.k, cache->k, off, k0 + j, hk, c)
                                       : Input(prec, p, p.k, p.k_descale, off + c);
        }
        for (int c = 0; c < dv; ++c) {
          const size_t at = static_cast<size_t>(j) * dv + c;
          vrows[at] = cache != nullptr ? CacheInput(prec, p, p.v, cache->v, voff, k0 + j, hk, c)
                                       : Input(prec, p, p.v, p.v_descale, voff + c);
        }
      }
      scores.assign(static_cast<size_t>(sq) * sk, 0.0);
      // A sink is one more logit in every row's softmax with no value row.
      const bool has_sink = p.sinks != nullptr;
      const double sink = has_sink ? Round(prec, t, p.sinks[h]) : kNegInf;
      for (int i = 0; i < sq; ++i) {
        const int64_t qoff = QOffset(p, q0 + i, h);
        for (int c = 0; c < d; ++c) qrow[c] = Input(prec, p, p.q, p.q_descale, qoff + c);
        double* srow = scores.data() + static_cast<size_t>(i) * sk;
        // Which keys the row keeps: the band, then the element and block masks.
        int lo, hi;
        VisibleKeys(p, i, sq, sk, &lo, &hi);
        kept.assign(static_cast<size_t>(sk), 0);
        const int64_t block_row =
            HasBlockMask(p) ? BlockRow(p, block_rows_before, b, h, i / p.block_q) : 0;
        for (int j = lo; j <= hi; ++j) {
          bool keep = true;
          if (p.mask != nullptr) {
            keep = p.mask[PairOffset(p, p.mask_per_batch, p.mask_per_head, pairs_before, b, h, i,
                                     j)] != 0;
          }
          if (keep && HasBlockMask(p)) keep = BlockKept(p, block_row, j / p.block_k);
          kept[static_cast<size_t>(j)] = keep;
        }
        // Scores in the contract's order: scale, softcap, + ALiBi, + bias.
        // A -inf bias removes its key as the mask does.
        double m = sink;
        bool any = false;
        for (int j = lo; j <= hi; ++j) {
          if (!kept[static_cast<size_t>(j)]) continue;
          const double* kr = krows.data() + static_cast<size_t>(j) * d;
          double s;
          if (prec == Precision::kExact) {
            s = 0.0;
            for (int c = 0; c < d; ++c) s += qrow[c] * kr[c];
          } else {
            float sf = 0.0f;
            for (int c = 0; c < d; ++c) {
              sf += static_cast<float>(qrow[c]) * static_cast<float>(kr[c]);
            }
            s = sf;
          }
          s = Round(prec, t, s * scale);
          if (cap > 0.0) s = Round(prec, t, cap * std::tanh(s / cap));
          if (p.alibi_slopes != nullptr) {
            const double dist = std::fabs(static_cast<double>(i) + (sk - sq) - j);
            s = Round(prec, t, s - static_cast<double>(p.alibi_slopes[h]) * dist);
          }
          if (p.bias != nullptr) {
            const double bias = LoadAsFloat(
                p.bias, p.bias_dtype,
                PairOffset(p, p.bias_per_batch, p.bias_per_head, pairs_before, b, h, i, j));
            if (std::isinf(bias) && bias < 0) {
              kept[static_cast<size_t>(j)] = 0;
              continue;
            }
            s = Round(prec, t, s + bias);
          }
          srow[j] = s;
          m = std::max(m, s);
          any = true;
        }
        // Sees no key: O = 0 and LSE = -inf, or the sink alone (O still 0).
        if (!any) {
          if (has_sink) {
            out.lse[static_cast<size_t>(LseOffset(p, b, h, i))] =
                prec == Precision::kExact ? sink : static_cast<float>(sink);
          }
          continue;
        }
        double sum = 0.0;
        for (int j = lo; j <= hi; ++j) {
          if (!kept[static_cast<size_t>(j)]) continue;
          srow[j] = prec == Precision::kExact ? std::exp(srow[j] - m)
                                              : std::exp(static_cast<float>(srow[j] - m));
          sum += srow[j];
        }
        if (has_sink) {
          sum += prec == Precision::kExact ? std::exp(sink - m)
                                           : std::exp(static_cast<float>(sink - m));
        }
        if (prec == Precision::kLow) sum = static_cast<float>(sum);
        double* orow = out.o.data() + OOffset(p, q0 + i, h);
        for (int j = lo; j <= hi; ++j) {
          if (!kept[static_cast<size_t>(j)]) continue;
          const double pj = Round(prec, t, srow[j] / sum);
          const double* vr = vrows.data() + static_cast<size_t>(j) * dv;
          for (int c = 0; c < dv; ++c) orow[c] += pj * vr[c];
          if (prec == Precision::kLow) {
            for (int c = 0; c < dv; ++c) orow[c] = static_cast<float>(orow[c]);
          }
        }
        for (int c = 0; c < dv; ++c) orow[c] = Round(prec, t, orow[c]);
        const double lse = std::log(sum) + m;
        out.lse[static_cast<size_t>(LseOffset(p, b, h, i))] =
            prec == Precision::kExact ? lse : static_cast<float>(lse);
      }
    }
  }
  return out;
}

}  // namespace

ReferenceOutput ReferenceAttention(const AttnParams& p) {
  return Run(p, Precision::kExact, nullptr);
}

ReferenceOutput ReferenceAttention(const AttnParams& p, const KvRowScales& kv) {
  return Run(p, Precision::kExact, &kv);
}

ReferenceOutput ReferenceAttentionLowPrecision(const AttnParams& p, const KvRowScales& kv) {
  return Run(p, Precision::kLow, &kv);
}

ReferenceOutput ReferenceAttentionLowPrecision(const AttnParams& p) {
  if (p.dtype != DType::kFP32) return Run(p, Precision::kLow, nullptr);
  // FP32 inputs: the low-precision result is the exact one rounded to float,
  // as the header promises (a float re-run would only add accumulation noise).
  ReferenceOutput out = Run(p, Precision::kExact, nullptr);
  for (double& x : out.o) x = static_cast<float>(x);
  for (double& x : out.lse) x = static_cast<float>(x);
  return out;
}

}  // namespace attnserve
