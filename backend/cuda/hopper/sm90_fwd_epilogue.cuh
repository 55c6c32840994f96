// The Hopper forward kernel's epilogue: an item's O normalised once and
// written with its LSE straight from the consumer's wgmma fragments, or, for
// an item that sees no key, O = 0 and LSE = -inf (the portable kernel's
// NormalizeRows and StoreEmptyRows, attn_fwd_kernel.cuh). Cfg::kSinks: attention
// sinks join each row's denominator (and its LSE; a row with no key gets
// LSE = sink).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_kernel.cuh"
#include "backend/cuda/hopper/sm90_fwd_config.cuh"
#include "backend/cuda/hopper/sm90_fwd_tile_scheduler.cuh"

namespace attnserve {
namespace cuda {
namespace sm90 {

template <class Cfg>
struct Sm90FwdEpilogue {
  using T = typename Cfg::T;
  static constexpr int kDTiles = Cfg::kDTiles;

  // Item t has no visible key: all consumer threads (ctid) share its rows.
  __device__ __forceinline__ static void StoreEmpty(const FwdLaunch& F, const detail::QueryRows& qr,
                                                    const Sm90Tile& t, int ctid) {
    if (Cfg::kSinks && F.p.sinks != nullptr) {
      StoreEmptySink(F, qr, t, ctid);
    } else {
      detail::StoreEmptyRows<T, kBlockM, kConsumerThreads, false, Cfg::kDistinctV>(
          F, qr, t.b, 0, t.m0, t.sq, ctid);
    }
  }

  // O = 0 and LSE = sink: one thread per row.
  __device__ __forceinline__ static void StoreEmptySink(const FwdLaunch& F,
                                                        const detail::QueryRows& qr,
                                                        const Sm90Tile& t, int ctid) {
    const AttnParams& p = F.p;
    const float sink = __ldg(p.sinks + t.head);
    for (int m = t.m0 + ctid; m < t.m0 + kBlockM && m < t.sq; m += kConsumerThreads) {
      T* o = static_cast<T*>(p.o) + detail::OutOffset<Cfg::kDistinctV>(p, qr.q_start + m, t.head);
      const int dv = detail::OutDim<Cfg::kDistinctV>(p);
      for (int d = 0; d < dv; d += 2) *reinterpret_cast<uint32_t*>(o + d) = 0u;
      if (p.lse != nullptr) p.lse[LseOffset(p, t.b, t.head, m)] = sink;
    }
  }

  // NormalizeRows with the sink's exp(sink) in each row's sum, in log2 units
  // against the larger of the row max and the sink.
  __device__ __forceinline__ static void NormalizeRowsSink(float (&o)[1][kDTiles][4],
                                                           const float (&row_max)[2],
                                                           const float (&row_sum)[2],
                                                           float score_log2, float sink,
                                                           float (&lse)[2]) {
    const float sink_log2 = sink * kLog2e;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float sum = detail::QuadSum(row_sum[half]);
      const float m_log2 = row_max[half] == -INFINITY ? -INFINITY : row_max[half] * score_log2;
      const float top = fmaxf(m_log2, sink_log2);
      const float keep = detail::Exp2(m_log2 - top);  // the keys' sum's factor
      const float total = sum * keep + detail::Exp2(sink_log2 - top);
      const float inv = total > 0.f ? keep / total : 0.f;
      lse[half] = total > 0.f ? (top + __log2f(total)) * detail::kLn2 : -INFINITY;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o[0][dt][half * 2] *= inv;
        o[0][dt][half * 2 + 1] *= inv;
      }
    }
  }

  // kFp8Pv: O over the row sum of the rounded P it summed (psum, whole per
  // thread: Sm90FwdAccum), times V's descale (O summed V's codes); the LSE
  // from the unrounded sum (row_sum, quad-partial), less P's 2^kPExp, which
  // the normalisation cancelled. (FP8 calls take no sinks.)
  __device__ __forceinline__ static void NormalizeRowsFp8Pv(
      float (&o)[1][kDTiles][4], const float (&row_max)[2], const float (&row_sum)[2],
      const float (&psum)[4], float score_log2, float v_descale, float (&lse)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float sum = detail::QuadSum(row_sum[half]);
      const float l = psum[half * 2];
      const float inv = l > 0.f ? v_descale / l : 0.f;
      lse[half] = sum > 0.f ? (row_max[half] * score_log2 + __log2f(sum)) * detail::kLn2 -
                                  static_cast<float>(Cfg::kPExp) * detail::kLn2
                            : -INFINITY;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o[0][dt][half * 2] *= inv;
        o[0][dt][half * 2 + 1] *= inv;
      }
    }
  }

  // The thread's rows row0 and row0 + 8 of item t: o (normalised in place),
  // row_max, row_sum and (kFp8Pv) psum as the mainloop left them.
  __device__ __forceinline__ static void Store(const FwdLaunch& F, const detail::QueryRows& qr,
                                               const Sm90Tile& t, int row0, int quad,
                                               float (&o)[1][kDTiles][4], const float (&row_max)[2],
                                               const float (&row_sum)[2], const float (&psum)[4],
                                               float score_log2) {
    const AttnParams& p = F.p;
    float lse[2];
    if constexpr (Cfg::kFp8Pv) {
      static_assert(!Cfg::kSinks, "FP8 P V without sinks");
      NormalizeRowsFp8Pv(o, row_max, row_sum, psum, score_log2, p.v_descale, lse);
    } else if (Cfg::kSinks && p.sinks != nullptr) {
      NormalizeRowsSink(o, row_max, row_sum, score_log2, __ldg(p.sinks + t.head), lse);
    } else {
      detail::NormalizeRows<1, kDTiles>(o, row_max, row_sum, score_log2, lse);
    }
    T* o_ptr = static_cast<T*>(p.o);
    const int dv = detail::OutDim<Cfg::kDistinctV>(p);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = row0 + half * 8;
      if (m >= t.sq) continue;
      T* dst = o_ptr + detail::OutOffset<Cfg::kDistinctV>(p, qr.q_start + m, t.head);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + quad * 2;
        if (col < dv) {
          *reinterpret_cast<uint32_t*>(dst + col) =
              detail::PackPair<T>(o[0][dt][half * 2], o[0][dt][half * 2 + 1]);
        }
      }
      if (p.lse != nullptr && quad == 0) p.lse[LseOffset(p, t.b, t.head, m)] = lse[half];
    }
  }
};

}  // namespace sm90
}  // namespace cuda
}  // namespace attnserve
