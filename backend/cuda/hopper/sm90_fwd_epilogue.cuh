// The Hopper forward kernel's epilogue: an item's O normalised once and
// written with its LSE straight from the consumer's wgmma fragments, or, for
// an item that sees no key, O = 0 and LSE = -inf (the portable kernel's
// NormalizeRows and StoreEmptyRows, attn_fwd_kernel.cuh).
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
    detail::StoreEmptyRows<T, kBlockM, kConsumerThreads>(F, qr, t.b, 0, t.m0, t.sq, ctid);
  }

  // The thread's rows row0 and row0 + 8 of item t: o (normalised in place),
  // row_max and row_sum as the mainloop left them.
  __device__ __forceinline__ static void Store(const FwdLaunch& F, const detail::QueryRows& qr,
                                               const Sm90Tile& t, int row0, int quad,
                                               float (&o)[1][kDTiles][4], const float (&row_max)[2],
                                               const float (&row_sum)[2], float score_log2) {
    const AttnParams& p = F.p;
    float lse[2];
    detail::NormalizeRows<1, kDTiles>(o, row_max, row_sum, score_log2, lse);
    T* o_ptr = static_cast<T*>(p.o);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = row0 + half * 8;
      if (m >= t.sq) continue;
      T* dst = o_ptr + QOffset(p, qr.q_start + m, t.head);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dt * 8 + quad * 2;
        if (col < p.head_dim) {
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
