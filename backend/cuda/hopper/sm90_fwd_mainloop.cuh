// The Hopper forward kernel's mainloop: the TMA loads of Q and of the K/V
// ring (Sm90FwdLoads, issued by Sm90FwdProducer, or by consumer thread 0
// under kTmaSync), and the consumer warpgroups' loop over an item's key tiles
// (Sm90FwdMainloop: S = Q K^T by wgmma from shared memory, softcap, mask and
// online softmax, O += P V by wgmma with P from registers), ordered by the
// Sm90Schedule flags of Sm90FwdConfig. The mask rules and softcap are the
// portable kernel's (attn_fwd_kernel.cuh, detail::).
#pragma once

#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "backend/cuda/attn_fwd.h"
#include "backend/cuda/attn_fwd_kernel.cuh"
#include "backend/cuda/fp8_vt_layout.h"
#include "backend/cuda/generated/sm90_wgmma.h"
#include "backend/cuda/hopper/attn_fwd_sm90.h"
#include "backend/cuda/hopper/sm90_exp2_poly.h"
#include "backend/cuda/hopper/sm90_fwd_config.cuh"
#include "backend/cuda/hopper/sm90_fwd_tile_scheduler.cuh"
#include "backend/cuda/hopper/sm90_primitives.cuh"
#include "backend/cuda/mods_prefix.cuh"

namespace attnserve {
namespace cuda {
namespace sm90 {

// One online-softmax step over this thread's two rows of an S tile (in place:
// S becomes P = exp2(S * score_log2 - max)); corr[half] is the factor the
// row's O and sum must be scaled by for the new max (applied to the sum here,
// to O by the caller, which may do it later: the P V of the previous tile can
// still be in flight). row_max in raw-score units; row_sum thread-partial.
// kPExp: P comes out scaled by 2^kPExp (the FP8 P V's, Sm90FwdConfig);
// kPoly: every fourth n8 tile's exp2 by Exp2Poly.
template <int kPExp = 0, bool kPoly = false, int kNTiles>
__device__ __forceinline__ void SoftmaxStep(float (&s)[1][kNTiles][4], float (&row_max)[2],
                                            float (&row_sum)[2], float (&corr)[2],
                                            float score_log2) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = row_max[half];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
      mx = fmaxf(mx, fmaxf(s[0][nt][half * 2], s[0][nt][half * 2 + 1]));
    mx = detail::QuadMax(mx);
    // A row that has seen only masked keys keeps max -inf; subtracting 0
    // instead keeps exp2(-inf - -inf) from turning into NaN.
    const float mx_log2 = mx == -INFINITY ? 0.f : mx * score_log2;
    corr[half] = detail::Exp2(row_max[half] * score_log2 - mx_log2);
    row_max[half] = mx;
    const float arg0 = kPExp == 0 ? -mx_log2 : static_cast<float>(kPExp) - mx_log2;
    float sum = row_sum[half] * corr[half];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = fmaf(s[0][nt][half * 2 + e], score_log2, arg0);
        const float pv = kPoly && nt % 4 == 3 ? Exp2Poly(x) : detail::Exp2(x);
        s[0][nt][half * 2 + e] = pv;
        sum += pv;
      }
    row_sum[half] = sum;
  }
}

// SoftmaxStep with a per-thread additive offset off[half] (S units) that
// belongs to every score of the thread's row `half` in this tile but is not
// in S (ALiBi's constant part, Sm90FwdMainloop::AddAlibiLinear): it joins
// the row max and each exponent's argument instead of every element.
template <int kNTiles>
__device__ __forceinline__ void SoftmaxStep(float (&s)[1][kNTiles][4], float (&row_max)[2],
                                            float (&row_sum)[2], float (&corr)[2], float score_log2,
                                            const float (&off)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mt = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
      mt = fmaxf(mt, fmaxf(s[0][nt][half * 2], s[0][nt][half * 2 + 1]));
    const float mx = fmaxf(row_max[half], detail::QuadMax(mt + off[half]));
    const float mx_log2 = mx == -INFINITY ? 0.f : mx * score_log2;
    corr[half] = detail::Exp2(row_max[half] * score_log2 - mx_log2);
    row_max[half] = mx;
    const float arg0 = fmaf(off[half], score_log2, -mx_log2);
    float sum = row_sum[half] * corr[half];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = detail::Exp2(fmaf(s[0][nt][half * 2 + e], score_log2, arg0));
        s[0][nt][half * 2 + e] = pv;
        sum += pv;
      }
    row_sum[half] = sum;
  }
}

template <int kDTiles>
__device__ __forceinline__ void RescaleO(float (&o)[1][kDTiles][4], const float (&corr)[2]) {
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) {
    o[0][dt][0] *= corr[0];
    o[0][dt][1] *= corr[0];
    o[0][dt][2] *= corr[1];
    o[0][dt][3] *= corr[1];
  }
}

// P (fp32 S fragments) -> wgmma A fragments, one per k16 step of keys: the
// S accumulators of n8 tiles 2kk and 2kk+1 are exactly that A fragment.
template <typename T, int kNTiles>
__device__ __forceinline__ void ConvertP(const float (&s)[1][kNTiles][4],
                                         uint32_t (&pa)[kNTiles / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < kNTiles / 2; ++kk) {
    pa[kk][0] = detail::PackPair<T>(s[0][2 * kk][0], s[0][2 * kk][1]);
    pa[kk][1] = detail::PackPair<T>(s[0][2 * kk][2], s[0][2 * kk][3]);
    pa[kk][2] = detail::PackPair<T>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
    pa[kk][3] = detail::PackPair<T>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
  }
}

// P (fp32 S fragments, scaled: Sm90FwdConfig::kPExp) -> FP8 wgmma A
// fragments, one per k32 step of keys: n8 tiles 4kk .. 4kk + 3, each row's
// values in register order (tiles 4kk, 4kk + 1 into registers 0 / 1, tiles
// 4kk + 2, 4kk + 3 into 2 / 3), rounded to nearest E4M3. That order is not
// the keys' (fp8_vt_layout.h): V^T's columns are permuted to match it.
template <int kNTiles>
__device__ __forceinline__ void ConvertPE4m3(const float (&s)[1][kNTiles][4],
                                             uint32_t (&pa)[kNTiles / 4][4]) {
  auto pack = [](float a, float b, float c, float d) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
  };
#pragma unroll
  for (int kk = 0; kk < kNTiles / 4; ++kk) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // r: the thread's row (fragment values 2r, 2r + 1)
      pa[kk][r] = pack(s[0][4 * kk][2 * r], s[0][4 * kk][2 * r + 1], s[0][4 * kk + 1][2 * r],
                       s[0][4 * kk + 1][2 * r + 1]);
      pa[kk][2 + r] = pack(s[0][4 * kk + 2][2 * r], s[0][4 * kk + 2][2 * r + 1],
                           s[0][4 * kk + 3][2 * r], s[0][4 * kk + 3][2 * r + 1]);
    }
  }
}

template <int kA, int kB, int kC>
__device__ __forceinline__ float (&Flat(float (&x)[kA][kB][kC]))[kA * kB * kC] {
  return reinterpret_cast<float(&)[kA * kB * kC]>(x);
}

// The TMA loads (one thread): boxes of 128-byte rows. g: the tile's index in
// the CTA's whole sequence of K/V tiles (ring slot and phase); n: the key
// tile (KeyTileAt of its index in the item).
template <class Cfg>
struct Sm90FwdLoads {
  using Smem = Sm90FwdSmem<Cfg>;

  __device__ __forceinline__ static void LoadQ(const Sm90FwdLaunch& L, const Smem& sm,
                                               const Sm90Tile& t, int slot) {
    MbarArriveExpectTx(&sm.q_full()[slot], Cfg::kQBytes);
#pragma unroll
    for (int db = 0; db < Cfg::kQKBlocks; ++db) {
      TmaLoad4d(sm.sQ() + slot * Cfg::kQBytes + db * kBlockM * 128, &L.q, &sm.q_full()[slot],
                db * Cfg::kQKCols, t.head, t.q_row0 + t.m0, t.map_b);
    }
  }

  // K and V of a tile are released separately (K once S = Q K^T is done, V
  // after P V), so the next K can load while this tile's P V still reads V.
  __device__ __forceinline__ static void LoadKV(const Sm90FwdLaunch& L, const Smem& sm,
                                                const Sm90Tile& t, int g, int n) {
    constexpr int kStages = Cfg::kStages;
    constexpr int kBlockN = Cfg::kBlockN;
    const int stage = g % kStages;
    const int key0 = t.k_row0 + n * kBlockN;
    // The stage's previous tiles (g - kStages) must be consumed first.
    const uint32_t parity = ((g / kStages) - 1) & 1;
    if (g >= kStages) MbarWait(&sm.k_empty()[stage], parity);
    MbarArriveExpectTx(&sm.k_full()[stage], Cfg::kKBytes);
#pragma unroll
    for (int db = 0; db < Cfg::kQKBlocks; ++db) {
      TmaLoad4d(sm.sK() + stage * Cfg::kKBytes + db * kBlockN * 128, &L.k, &sm.k_full()[stage],
                db * Cfg::kQKCols, t.kv_head, key0, t.map_b);
    }
    if (g >= kStages) MbarWait(&sm.v_empty()[stage], parity);
    MbarArriveExpectTx(&sm.v_full()[stage], Cfg::kVBytes);
    if constexpr (Cfg::kFp8Pv) {
      // V^T: boxes of kVtChunk key columns x kHeadDimV rows, from the
      // sequence's first column (fp8_vt_layout.h's VtSeqStart).
      const AttnParams& p = L.fwd.p;
      const int col0 = static_cast<int>(IsVarlen(p) ? VtAlignUp(t.k_row0 + int64_t{t.b} * kFp8VtGap)
                                                    : t.b * VtDensePeriod(p)) +
                       n * kBlockN;
      unsigned char* dst = reinterpret_cast<unsigned char*>(sm.sV()) + stage * Cfg::kVBytes;
#pragma unroll
      for (int c = 0; c < kBlockN / Cfg::kVtChunk; ++c) {
        TmaLoad4d(dst + c * Cfg::kHeadDimV * Cfg::kVtChunk, &L.v, &sm.v_full()[stage],
                  col0 + c * Cfg::kVtChunk, 0, t.kv_head, 0);
      }
    } else {
#pragma unroll
      for (int db = 0; db < Cfg::kDBlocks; ++db) {
        TmaLoad4d(sm.sV() + (stage * Cfg::kDBlocks + db) * kBlockN * 64, &L.v, &sm.v_full()[stage],
                  db * 64, t.kv_head, key0, t.map_b);
      }
    }
  }
};

// The producer warpgroup's one thread (warp-specialised schedules): each
// item's Q into its slot, then all its K/V tiles through the ring.
template <class Cfg>
class Sm90FwdProducer {
 public:
  using Smem = Sm90FwdSmem<Cfg>;
  using Loads = Sm90FwdLoads<Cfg>;

  __device__ __forceinline__ Sm90FwdProducer(const Sm90FwdLaunch& L, const Smem& sm)
      : L_(L), sm_(sm) {}

  __device__ __forceinline__ void PrefetchMaps() const {
    PrefetchTensorMap(&L_.q);
    PrefetchTensorMap(&L_.k);
    PrefetchTensorMap(&L_.v);
  }

  // Item t (with key tiles to scan). The slot's previous item (kQSlots items
  // back) must have run its last Q K^T before its Q is overwritten.
  __device__ __forceinline__ void LoadItem(const Sm90Tile& t) {
    const int slot = items_done_ % Cfg::kQSlots;
    if (items_done_ >= Cfg::kQSlots) {
      MbarWait(&sm_.q_empty()[slot], (items_done_ / Cfg::kQSlots - 1) & 1);
    }
    Loads::LoadQ(L_, sm_, t, slot);
    // The next tile's index (a CSR read under a block mask) is read before
    // this tile's loads wait for their ring slot.
    int n = KeyTileAt<Cfg::kBlockN, Cfg::kMods>(L_.fwd.p, t, 0);
    for (int it = 0; it < t.num_tiles; ++it) {
      const int n_next =
          it + 1 < t.num_tiles ? KeyTileAt<Cfg::kBlockN, Cfg::kMods>(L_.fwd.p, t, it + 1) : 0;
      Loads::LoadKV(L_, sm_, t, g_ + it, n);
      n = n_next;
    }
    g_ += t.num_tiles;
    ++items_done_;
  }

 private:
  const Sm90FwdLaunch& L_;
  const Smem sm_;
  int g_ = 0;           // K/V tiles loaded so far
  int items_done_ = 0;  // items loaded so far
};

// A consumer thread's registers across an item: the running O, the softmax
// state of its two rows (the epilogue's input), and the S / P fragments of
// the tile in flight. The kernel owns them; Sm90FwdMainloop works on them.
template <class Cfg>
struct Sm90FwdAccum {
  float o[1][Cfg::kDTiles][4];
  float row_max[2], row_sum[2];
  float corr[2] = {1.f, 1.f};
  float s[1][Cfg::kNTiles][4];
  uint32_t pa[Cfg::kPSteps][4];
  // kFp8Pv: each row's sum of the E4M3-rounded P that O sums, by the tensor
  // core (P times a ones tile, Sm90FwdSmem::ones: every column is the row's
  // sum; 0, 1 of row r, 2, 3 of row r + 8), rescaled with O. O is normalised
  // by it, so O stays a convex combination of V rows; the unrounded row_sum
  // gives the LSE.
  float psum[4];
};

// The two consumer warpgroups: warpgroup wg owns rows m0 + 64 wg .. + 63 of
// each item. Mma(t) leaves the item's unnormalised O and softmax state in the
// kernel's Sm90FwdAccum (o, row_max, row_sum) for the epilogue. (The
// accumulators stay the kernel's, not members: as members ptxas spilled.)
template <class Cfg>
class Sm90FwdMainloop {
 public:
  using T = typename Cfg::T;
  using Smem = Sm90FwdSmem<Cfg>;
  using Loads = Sm90FwdLoads<Cfg>;
  using Mask = detail::MaskPolicy<Cfg::kIsBanded>;
  static constexpr int kBlockN = Cfg::kBlockN;
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kNTiles = Cfg::kNTiles;
  static constexpr int kDTiles = Cfg::kDTiles;
  static constexpr int kDBlocks = Cfg::kDBlocks;
  // kMods loads each tile's bias / mask pairs during the tile before's GEMMs.
  static_assert(!Cfg::kMods || Cfg::kOverlap, "kMods needs the overlapped schedule");

  const int ctid;  // thread index among the consumers
  const int wg;
  const int warp;
  const int lane;
  const int quad;
  const bool use_softcap;
  const float score_log2;

  __device__ __forceinline__ Sm90FwdMainloop(const Sm90FwdLaunch& L, const Smem& sm, int ctid_,
                                             Sm90FwdAccum<Cfg>& acc)
      : ctid(ctid_),
        wg(ctid_ / 128),
        warp((ctid_ / 32) % 4),
        lane(ctid_ % 32),
        quad(ctid_ % 32 % 4),
        use_softcap(L.fwd.p.softcap > 0.f),
        score_log2(L.fwd.p.softcap > 0.f ? 1.f : L.fwd.scale_log2),
        L_(L),
        sm_(sm),
        q_wg_(sm.sQ()),
        acc_(acc) {}

  // The thread's first row of item t (its second: + 8).
  __device__ __forceinline__ int Row0(const Sm90Tile& t) const {
    return t.m0 + wg * 64 + warp * 16 + lane / 4;
  }

  // Ping-pong turns: warpgroup wg issues its GEMMs between NamedBarSync on
  // its barrier (1 + wg) and NamedBarArrive on the other's; warpgroup 1
  // grants the first turn (BeginTurns), and warpgroup 0 takes a last, empty
  // one (EndTurns), so every arrival is matched. Both warpgroups take the
  // same turns (same items).
  __device__ __forceinline__ void BeginTurns() const {
    if (Cfg::kPingPong && wg == 1) NamedBarArrive(1, kConsumerThreads);
  }
  __device__ __forceinline__ void EndTurns() const {
    if (Cfg::kPingPong && wg == 0) NamedBarSync(1, kConsumerThreads);
  }

  // The scan of item t's key tiles, right to left. Without a producer
  // warpgroup, thread 0 first loads Q and the first kStages tiles, then
  // refills the stage tile it - 1 used once both warpgroups released it
  // (LoadKV waits for that). Non-persistent there: one item.
  __device__ __forceinline__ void Mma(const Sm90Tile& t, int row0) {
    const int num_tiles = t.num_tiles;  // tile it is key tile TileAt(t, it)
    if constexpr (!Cfg::kWS) {
      if (ctid == 0) {
        Loads::LoadQ(L_, sm_, t, 0);
        for (int it = 0; it < kStages && it < num_tiles; ++it) {
          Loads::LoadKV(L_, sm_, t, it, TileAt(t, it));
        }
      }
    }
    if constexpr (Cfg::kMods) BeginItemMods(t);
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_.o[0][dt][e] = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_.psum[e] = 0.f;
    acc_.row_max[0] = acc_.row_max[1] = -INFINITY;
    acc_.row_sum[0] = acc_.row_sum[1] = 0.f;
    const int q_slot = items_done_ % Cfg::kQSlots;
    q_wg_ = sm_.sQ() + q_slot * Cfg::kQBytes + wg * 64 * 128;
    MbarWait(&sm_.q_full()[q_slot], (items_done_ / Cfg::kQSlots) & 1);
    const int g = g_;
    if constexpr (!Cfg::kOverlap) {
      for (int it = 0; it < num_tiles; ++it) {
        const int stage = (g + it) % kStages;
        const uint32_t parity = ((g + it) / kStages) & 1;
        Refill(t, it, num_tiles);
        MbarWait(&sm_.k_full()[stage], parity);
        TurnBegin();
        GemmQK(stage);
        TurnEnd();
        WgmmaWait<0>();
        FenceRegs(Flat(acc_.s));
        ReleaseK(stage, it, num_tiles, q_slot);
        const int n = TileAt(t, it);
        Softmax(t, row0, n);
        RescaleAcc();
        ConvertPa();
        MbarWait(&sm_.v_full()[stage], parity);
        ClearVTail(t, stage, n);
        GemmPV(stage);
        WgmmaWait<0>();
        FenceAcc();
        Release(&sm_.v_empty()[stage]);
      }
    } else {
      // Tile 0: S and P only (O is still zero). kMods: its bias / mask
      // pairs are loaded before its Q K^T, each later tile's right after
      // the softmax of the tile before it (one tile's GEMMs hide them).
      TileWalk w{0, 0, 0, 1};
      if constexpr (Cfg::kMods) {
        WalkBegin(t, &w);
        PrefetchMods(t, w.n);
      }
      const int first = g % kStages;
      MbarWait(&sm_.k_full()[first], (g / kStages) & 1);
      TurnBegin();
      GemmQK(first);
      TurnEnd();
      WgmmaWait<0>();
      FenceRegs(Flat(acc_.s));
      ReleaseK(first, 0, num_tiles, q_slot);
      int n_prev = Cfg::kMods ? w.n : TileAt(t, 0);
      Softmax(t, row0, n_prev);
      if constexpr (Cfg::kMods) {
        // The next tile index (a CSR read) and its pairs are read before the
        // waits and GEMMs they would otherwise stall after.
        if (num_tiles > 1) {
          WalkNext(&w);
          PrefetchMods(t, w.n);
        }
      }
      ConvertPa();
      for (int it = 1; it < num_tiles; ++it) {
        const int stage = (g + it) % kStages;
        const int prev = (g + it - 1) % kStages;
        const int n_it = Cfg::kMods ? w.n : 0;
        MbarWait(&sm_.k_full()[stage], ((g + it) / kStages) & 1);
        MbarWait(&sm_.v_full()[prev], ((g + it - 1) / kStages) & 1);
        ClearVTail(t, prev, Cfg::kMods ? n_prev : TileAt(t, it - 1));
        TurnBegin();
        GemmQK(stage);  // S of tile it ...
        RescaleAcc();
        GemmPV(prev);  // ... while O += P V of tile it - 1
        TurnEnd();
        WgmmaWait<1>();  // S landed; P V may still run during the softmax
        FenceRegs(Flat(acc_.s));
        ReleaseK(stage, it, num_tiles, q_slot);
        Softmax(t, row0, Cfg::kMods ? n_it : TileAt(t, it));
        if constexpr (Cfg::kMods) {
          if (it + 1 < num_tiles) {
            WalkNext(&w);
            PrefetchMods(t, w.n);
          }
        }
        WgmmaWait<0>();
        FenceAcc();
        Release(&sm_.v_empty()[prev]);
        ConvertPa();
        if constexpr (Cfg::kMods) n_prev = n_it;
      }
      const int last = (g + num_tiles - 1) % kStages;
      MbarWait(&sm_.v_full()[last], ((g + num_tiles - 1) / kStages) & 1);
      ClearVTail(t, last, Cfg::kMods ? n_prev : TileAt(t, num_tiles - 1));
      TurnBegin();
      RescaleAcc();
      GemmPV(last);
      TurnEnd();
      WgmmaWait<0>();
      FenceAcc();
      Release(&sm_.v_empty()[last]);
    }
    g_ += num_tiles;
    ++items_done_;
  }

 private:
  // S = Q K^T for the stage's K tile: kQKSteps k-steps, each a K-major
  // descriptor pair advanced 32 bytes inside the 128-byte rows, 128-byte
  // boxes apart.
  __device__ __forceinline__ void GemmQK(int stage) {
    FenceRegs(Flat(acc_.s));
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < Cfg::kQKSteps; ++kk) {
      const int db = kk / 4, kin = (kk % 4) * 32;
      const uint64_t a = SmemDesc(q_wg_ + db * kBlockM * 128 + kin, 16, 1024);
      const uint64_t bd =
          SmemDesc(sm_.sK() + stage * Cfg::kKBytes + db * kBlockN * 128 + kin, 16, 1024);
      if constexpr (Cfg::kFp8Qk) {
        WgmmaE4m3<kBlockN>::SS(Flat(acc_.s), a, bd, kk > 0 ? 1 : 0);
      } else {
        Wgmma<kBlockN, T>::SS(Flat(acc_.s), a, bd, kk > 0 ? 1 : 0);
      }
    }
    WgmmaCommit();
    FenceRegs(Flat(acc_.s));
  }

  __device__ __forceinline__ void ConvertPa() {
    if constexpr (Cfg::kFp8Pv) {
      ConvertPE4m3(acc_.s, acc_.pa);
    } else {
      ConvertP<T>(acc_.s, acc_.pa);
    }
  }

  // O += P V: V is the MN-major B operand (keys x 64 d-columns per block,
  // blocks kBlockN x 128 bytes apart = LBO); a k16 step is 16 keys = 2048 B.
  // kFp8Pv: V^T is the K-major B operand (kHeadDimV rows of kVtChunk key
  // bytes per box, swizzled as K's rows are); a k32 step is +32 bytes of a row.
  __device__ __forceinline__ void GemmPV(int stage) {
    FenceAcc();
#pragma unroll
    for (int kk = 0; kk < Cfg::kPSteps; ++kk) FenceRegs(acc_.pa[kk]);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < Cfg::kPSteps; ++kk) {
      if constexpr (Cfg::kFp8Pv) {
        constexpr int kChunk = Cfg::kVtChunk;
        const unsigned char* box =
            reinterpret_cast<const unsigned char*>(sm_.sV()) + stage * Cfg::kVBytes +
            (kk * 32 / kChunk) * Cfg::kHeadDimV * kChunk + (kk * 32) % kChunk;
        const uint64_t bd = kChunk == 128 ? SmemDesc(box, 16, 1024) : SmemDescSw64(box);
        WgmmaE4m3<Cfg::kHeadDimV>::RS(Flat(acc_.o), acc_.pa[kk], bd);
        WgmmaE4m3N8RS(acc_.psum, acc_.pa[kk], SmemDesc(sm_.ones(), 16, 1024));
      } else {
        const uint64_t bd = SmemDesc(sm_.sV() + stage * kDBlocks * kBlockN * 64 + kk * 16 * 64,
                                     kBlockN * 128, 1024);
        Wgmma<Cfg::kHeadDimV, T>::RS(Flat(acc_.o), acc_.pa[kk], bd);
      }
    }
    WgmmaCommit();
    FenceAcc();
  }

  // O's accumulators (and kFp8Pv's row sums, written by the same wgmma
  // group) fenced against the asynchronous P V.
  __device__ __forceinline__ void FenceAcc() {
    FenceRegs(Flat(acc_.o));
    if constexpr (Cfg::kFp8Pv) FenceRegs(acc_.psum);
  }
  // O (and kFp8Pv's row sums) times the softmax step's corr.
  __device__ __forceinline__ void RescaleAcc() {
    RescaleO(acc_.o, acc_.corr);
    if constexpr (Cfg::kFp8Pv) {
      acc_.psum[0] *= acc_.corr[0];
      acc_.psum[1] *= acc_.corr[0];
      acc_.psum[2] *= acc_.corr[1];
      acc_.psum[3] *= acc_.corr[1];
    }
  }

  __device__ __forceinline__ void Release(uint64_t* bar) const {
    if (lane == 0) MbarArrive(bar);
  }
  // K tile it is consumed once its S landed; after the item's last Q K^T so
  // is its Q slot, which the producer refills with a later item's Q while
  // this one's last P V and epilogue run.
  __device__ __forceinline__ void ReleaseK(int stage, int it, int num_tiles, int q_slot) const {
    Release(&sm_.k_empty()[stage]);
    if (it == num_tiles - 1) Release(&sm_.q_empty()[q_slot]);
  }

  __device__ __forceinline__ void TurnBegin() const {
    if constexpr (Cfg::kPingPong) NamedBarSync(1 + wg, kConsumerThreads);
  }
  __device__ __forceinline__ void TurnEnd() const {
    if constexpr (Cfg::kPingPong) NamedBarArrive(1 + (wg ^ 1), kConsumerThreads);
  }

  // kTmaSync: thread 0 refills the stage that tile it - 1 used.
  __device__ __forceinline__ void Refill(const Sm90Tile& t, int it, int num_tiles) const {
    if constexpr (!Cfg::kWS) {
      const int next = it - 1 + kStages;
      if (ctid == 0 && it >= 1 && next < num_tiles)
        Loads::LoadKV(L_, sm_, t, next, TileAt(t, next));
    }
  }

  __device__ __forceinline__ int TileAt(const Sm90Tile& t, int it) const {
    return KeyTileAt<kBlockN, Cfg::kMods>(L_.fwd.p, t, it);
  }

  // KeyTileAt step by step (kMods consumers: no division per tile): n the
  // current tile, left the tiles of its key block still below it (no block
  // mask: unbounded), e its CSR entry. WalkNext only while tiles remain.
  struct TileWalk {
    int n, left, e, tpb;
  };
  __device__ __forceinline__ void WalkBegin(const Sm90Tile& t, TileWalk* w) const {
    const AttnParams& p = L_.fwd.p;
    if (t.e_top < 0) {
      *w = TileWalk{t.n_end - 1, 0x7fffffff, -1, 1};
      return;
    }
    w->tpb = p.block_k / kBlockN;
    w->e = t.e_top;
    w->n = (__ldg(p.block_col_idx + t.e_top) + 1) * w->tpb - 1 - t.top_excess;
    w->left = w->tpb - 1 - t.top_excess;
  }
  __device__ __forceinline__ void WalkNext(TileWalk* w) const {
    if (w->left > 0) {
      --w->n;
      --w->left;
    } else {
      --w->e;
      w->n = (__ldg(L_.fwd.p.block_col_idx + w->e) + 1) * w->tpb - 1;
      w->left = w->tpb - 1;
    }
  }

  // kMods, once per item: ALiBi's factor for the scores' units (raw Q.K, or
  // log2 units after softcap: score_log2 turns either into log2 units).
  // Once per item: ALiBi's factor for the scores' units (raw Q.K, or log2
  // units after softcap: score_log2 turns either into log2 units), and the
  // pairs of the sequences before this one (varlen bias / mask layout).
  __device__ __forceinline__ void BeginItemMods(const Sm90Tile& t) {
    const AttnParams& p = L_.fwd.p;
    const float* slopes = p.alibi_slopes;
    alibi_coef_ = slopes != nullptr ? -__ldg(slopes + t.head) * kLog2e / score_log2 : 0.f;
    if constexpr (Cfg::kElemMods) {
      pairs_before_ = (p.bias != nullptr || p.mask != nullptr) && IsVarlen(p)
                          ? __ldg(ModsPrefixOf(L_.fwd) + t.b)
                          : 0;
    }
  }

  // A 16-bit bias (the params are in constant memory: no registers held).
  __device__ __forceinline__ bool Bias16() const {
    const AttnParams& p = L_.fwd.p;
    return p.bias != nullptr && p.bias_dtype != DType::kFP32;
  }

  // Element 0 of the thread's row `half` of the bias (elt 4 or 2 bytes) or
  // the mask (1), recomputed per tile rather than held in registers; null
  // past the sequence (rows never stored).
  __device__ __forceinline__ const unsigned char* RowPtr(const Sm90Tile& t, int half, bool mask,
                                                         int elt) const {
    const AttnParams& p = L_.fwd.p;
    const int i = Row0(t) + half * 8;
    if (i >= t.sq) return nullptr;
    const int64_t off =
        mask ? PairOffset(p, p.mask_per_batch, p.mask_per_head, pairs_before_, t.b, t.head, i, 0)
             : PairOffset(p, p.bias_per_batch, p.bias_per_head, pairs_before_, t.b, t.head, i, 0);
    return static_cast<const unsigned char*>(mask ? static_cast<const void*>(p.mask) : p.bias) +
           off * elt;
  }

  // One pair (keys j, j + 1) of kElt-byte elements of a row as a word (low
  // element first), keys past sk not read (0: masked anyway). row null: a
  // row past the sequence (mask pairs read as kept).
  template <int kElt>
  __device__ __forceinline__ static uint32_t LoadPair(const unsigned char* row, int j, int sk) {
    using E = typename std::conditional<kElt == 2, uint16_t, uint8_t>::type;
    if (row == nullptr) return kElt == 1 ? 0x0101u : 0u;
    const unsigned char* a = row + j * kElt;
    const uint32_t lo = j < sk ? uint32_t{__ldg(reinterpret_cast<const E*>(a))} : 0u;
    const uint32_t hi = j + 1 < sk ? uint32_t{__ldg(reinterpret_cast<const E*>(a + kElt))} : 0u;
    return lo | (hi << (8 * kElt));
  }

  // Whether a row's pairs go through the prefetch buffer: each pair then
  // lies in one aligned word (a 16-bit bias row 4-byte aligned, a mask row
  // 2-byte aligned); other rows are read when the tile is scored.
  template <int kElt>
  __device__ __forceinline__ static bool Prefetchable(const unsigned char* row) {
    return Cfg::kPreBytes > 0 && row != nullptr &&
           reinterpret_cast<uintptr_t>(row) % (2 * kElt) == 0;
  }

  // Word k (half * kNTiles + nt) of this thread's prefetch buffer:
  // [k][consumer thread], so a warp's reads hit 32 banks.
  __device__ __forceinline__ uint32_t* PreWord(int k) const {
    return reinterpret_cast<uint32_t*>(sm_.pre()) + k * kConsumerThreads + ctid;
  }

  // Cfg::kBiasRows (a 16-bit bias alone over dense rows of 16-byte
  // multiples, RunAttnFwdSm90 checks): the buffer holds whole bias rows
  // (PrefetchBiasRows), each warp's 16 rows of a key tile, kBlockN 16-bit
  // values each, 16-byte chunk c of row r at chunk c ^ (r % 8), so the
  // fragment reads (8 rows x 4 words) hit 32 banks.
  static constexpr bool kBiasRowsPath = Cfg::kBiasRows && Cfg::kBiasRowsFit;
  static constexpr int kBiasRowBytes = kBlockN * 2;
  __device__ __forceinline__ unsigned char* BiasRows() const {
    return sm_.pre() + (ctid / 32) * 16 * kBiasRowBytes;
  }

  // Key tile n's bias for this warp's 16 rows, by the warp: 16-byte
  // cp.async (L2 only), a row's 16 lanes reading it contiguously; keys past
  // sk and rows past sq zero-filled. The warp first meets so no lane still
  // reads the tile before (AddBias16); AddBias16 waits and meets again.
  __device__ __forceinline__ void PrefetchBiasRows(const Sm90Tile& t, int n) {
    if constexpr (kBiasRowsPath) {
      constexpr int kRowsPerStep = 32 / kNTiles;  // rows a warp-wide step copies
      const AttnParams& p = L_.fwd.p;
      __syncwarp();
      // Lane: chunk ch (keys 8 ch .. 8 ch + 7) of rows r0, r0 + kRowsPerStep, ...
      const int ch = lane % kNTiles, r0 = lane / kNTiles;
      const int i = t.m0 + wg * 64 + warp * 16 + r0;  // its first row
      const int key = n * kBlockN + ch * 8;
      const int valid = min(max(t.sk - key, 0), 8) * 2;  // bytes of the chunk inside Sk
      const int64_t step = int64_t{kRowsPerStep} * p.seqlen_k * 2;
      const unsigned char* bias = static_cast<const unsigned char*>(p.bias);
      const unsigned char* src =
          bias + PairOffset(p, p.bias_per_batch, p.bias_per_head, 0, t.b, t.head, i, key) * 2;
      const uint32_t dst = SmemAddr(BiasRows()) + r0 * kBiasRowBytes;
      // Not unrolled: the consumers' registers are full here (S, O in flight).
#pragma unroll 1
      for (int k = 0; k < 16 / kRowsPerStep; ++k) {
        const int r = r0 + k * kRowsPerStep;
        const int bytes = i + k * kRowsPerStep < t.sq ? valid : 0;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                         dst + k * kRowsPerStep * kBiasRowBytes + ((ch ^ (r & 7)) * 16)),
                     "l"(bytes > 0 ? src + k * step : bias), "r"(bytes)
                     : "memory");
      }
      detail::CpAsyncCommit();
    }
  }

  // Key tile n's pairs of the thread's fragment into its prefetch buffer,
  // a tile ahead of their use: a 16-bit bias's, else the element mask's.
  // Aligned rows by
  // cp.async (no registers held while they load; each thread reads back
  // only its own words, after cp.async.wait_group): a mask pair as the
  // aligned word around it, shifted on use, the bytes copied stopping at the
  // row's sk (zero-filled). Other rows, and a 16-bit bias beside a mask
  // (the mask folded in as -inf bias), are read here and stored.
  __device__ __forceinline__ void PrefetchMods(const Sm90Tile& t, int n) {
    if constexpr (Cfg::kPreBytes > 0) {
      if constexpr (kBiasRowsPath) {
        PrefetchBiasRows(t, n);
        return;
      }
      const AttnParams& p = L_.fwd.p;
      const bool bias16 = Bias16();
      if (!bias16 && p.mask == nullptr) return;
      const int elt = bias16 ? 2 : 1;
      const int key0 = n * kBlockN + quad * 2;
      const uint32_t neg_inf = p.bias_dtype == DType::kBF16 ? 0xff80u : 0xfc00u;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const unsigned char* row = RowPtr(t, half, !bias16, elt);
        if (bias16 ? Prefetchable<2>(row) && p.mask == nullptr : Prefetchable<1>(row)) {
          const uintptr_t end =
              reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(t.sk) * elt;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            const uintptr_t a = reinterpret_cast<uintptr_t>(row) + (key0 + nt * 8) * elt;
            const uintptr_t w = a & ~uintptr_t{3};
            const int bytes = w >= end ? 0 : end - w >= 4 ? 4 : static_cast<int>(end - w);
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                             SmemAddr(PreWord(half * kNTiles + nt))),
                         "l"(bytes > 0 ? w : reinterpret_cast<uintptr_t>(row)), "r"(bytes)
                         : "memory");
          }
        } else if (bias16) {
          const unsigned char* mrow = p.mask != nullptr ? RowPtr(t, half, true, 1) : nullptr;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            uint32_t w = LoadPair<2>(row, key0 + nt * 8, t.sk);
            if (p.mask != nullptr) {
              const uint32_t m = LoadPair<1>(mrow, key0 + nt * 8, t.sk);
              if ((m & 0xffu) == 0) w = (w & 0xffff0000u) | neg_inf;
              if ((m & 0xff00u) == 0) w = (w & 0xffffu) | (neg_inf << 16);
            }
            *PreWord(half * kNTiles + nt) = w;
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            *PreWord(half * kNTiles + nt) = LoadPair<1>(row, key0 + nt * 8, t.sk);
          }
        }
      }
      detail::CpAsyncCommit();
    }
  }

  // Pair nt of the thread's row `row` (fragment row half) of key tile key0:
  // from its prefetch buffer (PrefetchMods; the copies landed), or read now
  // where the kernel has no buffer. Applied pair by pair, so no tile of
  // pairs is live beside S, O and P.
  template <int kElt>
  __device__ __forceinline__ uint32_t PairAt(const unsigned char* row, int half, int nt, int key0,
                                             int sk) const {
    if constexpr (Cfg::kPreBytes > 0) {
      // A mask pair's offset in its aligned word: the row's and the
      // thread's first column's (quad * 2; tiles and nt steps keep it).
      const int shift = kElt == 1 && Prefetchable<1>(row)
                            ? ((reinterpret_cast<uintptr_t>(row) + quad * 2) & 2) * 8
                            : 0;
      return *PreWord(half * kNTiles + nt) >> shift;
    } else {
      return LoadPair<kElt>(row, key0 + nt * 8 + quad * 2, sk);
    }
  }

  // x[0..1] += coef * one 16-bit pair of bias values (BF16 or FP16 in `u`).
  template <bool kBf16>
  __device__ __forceinline__ static void AddBiasPair(uint32_t u, float coef, float* x) {
    float2 b;
    if constexpr (kBf16) {
      b = make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
    } else {
      __half2 h;
      memcpy(&h, &u, 4);
      b = __half22float2(h);
    }
    x[0] = fmaf(b.x, coef, x[0]);
    x[1] = fmaf(b.y, coef, x[1]);
  }

  // S += bias (natural-log units, times kLog2e / score_log2 into S's
  // units) from 16-bit pairs.
  template <bool kBf16>
  __device__ __forceinline__ void AddBias16(const Sm90Tile& t, int key0) {
    detail::CpAsyncWaitAll();
    const float coef = kLog2e / score_log2;
    if constexpr (kBiasRowsPath) {
      __syncwarp();             // the other lanes' copies landed too
      const int sw = lane / 4;  // r % 8 of both the thread's rows
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const unsigned char* row = BiasRows() + (sw + half * 8) * kBiasRowBytes + quad * 4;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          AddBiasPair<kBf16>(*reinterpret_cast<const uint32_t*>(row + ((nt ^ sw) * 16)), coef,
                             &acc_.s[0][nt][half * 2]);
        }
      }
      return;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const unsigned char* row = RowPtr(t, half, false, 2);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        AddBiasPair<kBf16>(PairAt<2>(row, half, nt, key0, t.sk), coef, &acc_.s[0][nt][half * 2]);
      }
    }
  }

  // Keys whose element-mask byte is 0 become -inf (beside a 16-bit bias
  // in a prefetch buffer, the mask is folded into it).
  __device__ __forceinline__ void MaskElements(const Sm90Tile& t, int key0) {
    if (kBiasRowsPath || L_.fwd.p.mask == nullptr) return;  // kBiasRows: no mask
    const bool folded = Cfg::kPreBytes > 0 && Bias16();
    if (folded) return;
    detail::CpAsyncWaitAll();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const unsigned char* row = RowPtr(t, half, true, 1);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const uint32_t m = PairAt<1>(row, half, nt, key0, t.sk);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (((m >> (8 * e)) & 0xffu) == 0) acc_.s[0][nt][half * 2 + e] = -INFINITY;
        }
      }
    }
  }

  // The bias (after ALiBi) and, after the band, the element mask of key
  // tile key0.
  __device__ __forceinline__ void AddBias(const Sm90Tile& t, int key0) {
    const AttnParams& p = L_.fwd.p;
    if (p.bias == nullptr) return;
    // FP16 or BF16 only: an FP32 bias is refused at launch (the portable
    // kernel takes it); reading it here spilled every kMods kernel.
    if (p.bias_dtype == DType::kBF16) {
      AddBias16<true>(t, key0);
    } else {
      AddBias16<false>(t, key0);
    }
  }

  // S += ALiBi's -slope |diag - j| (alibi_coef_ per distance, in S's units)
  // for the thread's rows row0, row0 + 8 and key tile key0: per element one
  // add and one FMA with |x| folded in.
  __device__ __forceinline__ void AddAlibi(const Sm90Tile& t, int row0, int key0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float d0 = static_cast<float>(row0 + half * 8 + (t.sk - t.sq) - key0 -
                                          quad * 2);  // diag - j at nt = e = 0
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = acc_.s[0][nt][half * 2 + e];
          x = fmaf(alibi_coef_, fabsf(d0 - static_cast<float>(nt * 8 + e)), x);
        }
    }
  }

  // ALiBi as AddAlibi, where all of the thread's keys of the tile lie on one
  // side of its row's diagonal (every tile but those the diagonal crosses):
  // |diag - j| is then linear in the key's column c in the tile, so S gets
  // one FMA by a constant c per element and the row's constant part goes to
  // off[half] (SoftmaxStep's offset).
  __device__ __forceinline__ void AddAlibiLinear(const Sm90Tile& t, int row0, int key0,
                                                 float (&off)[2]) {
    constexpr int kLastCol = (kNTiles - 1) * 8 + 1;  // the thread's last column past quad * 2
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int d0 = row0 + half * 8 + (t.sk - t.sq) - key0 - quad * 2;  // diag - j at c = 0
      const float fd0 = static_cast<float>(d0);
      if (d0 >= kLastCol || d0 <= 0) {
        // Left of the diagonal |d| = d0 - c, right of it c - d0.
        const float k = d0 > 0 ? -alibi_coef_ : alibi_coef_;
        off[half] = -k * fd0;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = acc_.s[0][nt][half * 2 + e];
            x = fmaf(k, static_cast<float>(nt * 8 + e), x);
          }
      } else {
        off[half] = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = acc_.s[0][nt][half * 2 + e];
            x = fmaf(alibi_coef_, fabsf(fd0 - static_cast<float>(nt * 8 + e)), x);
          }
      }
    }
  }

  // Softcap, ALiBi, bias, band, element mask and the online-softmax step of
  // key tile n, S -> P.
  __device__ __forceinline__ void Softmax(const Sm90Tile& t, int row0, int n) {
    const AttnParams& p = L_.fwd.p;
    if (use_softcap) detail::SoftcapScores(acc_.s, L_.fwd.softcap_in, L_.fwd.softcap_out);
    const int key0 = n * kBlockN;
    float off[2] = {0.f, 0.f};
    if constexpr (Cfg::kElemMods) {
      if (alibi_coef_ != 0.f) AddAlibi(t, row0, key0);
      AddBias(t, key0);
    } else if constexpr (Cfg::kMods) {
      if (alibi_coef_ != 0.f) AddAlibiLinear(t, row0, key0, off);
    }
    if (Mask::TileNeedsMask(key0, kBlockN, t.sk, t.lo_last, t.hi_first)) {
      detail::MaskScores(acc_.s, p, key0, row0, t.sq, 1, t.sq, t.sk, quad);
    }
    if constexpr (Cfg::kElemMods) MaskElements(t, key0);
    if constexpr (Cfg::kMods && !Cfg::kElemMods) {
      SoftmaxStep(acc_.s, acc_.row_max, acc_.row_sum, acc_.corr, score_log2, off);
    } else {
      SoftmaxStep<Cfg::kPExp, Cfg::kPolyExp2>(acc_.s, acc_.row_max, acc_.row_sum, acc_.corr,
                                              score_log2);
    }
  }

  // Varlen: the V tile of key tile n reaching past the sequence holds the
  // next sequence's rows (a dense map zero-fills there). P is 0 for them but
  // 0 x Inf or NaN is not, so before P V reads the tile the consumers zero
  // those rows (whole 128-byte rows: the swizzle moves chunks only within a
  // row), fence the stores into wgmma's (async) proxy and meet at named
  // barrier 3. Only the sequence's last key tile, once per item; the test is
  // uniform over the consumers, so all or none reach the barrier.
  // (kFp8Pv: V^T's columns past a sequence are zeros already.)
  __device__ __forceinline__ void ClearVTail(const Sm90Tile& t, int stage, int n) const {
    if constexpr (Cfg::kFp8Pv) return;
    const int valid = t.sk - n * kBlockN;  // rows < valid are the sequence's
    if (!IsVarlen(L_.fwd.p) || valid >= kBlockN) return;
    uint4* tile = reinterpret_cast<uint4*>(sm_.sV() + stage * kDBlocks * kBlockN * 64);
    for (int c = ctid; c < kDBlocks * kBlockN * 8; c += kConsumerThreads) {
      if ((c / 8) % kBlockN >= valid) tile[c] = make_uint4(0, 0, 0, 0);
    }
    FenceProxyAsyncShared();
    NamedBarSync(3, kConsumerThreads);
  }

  const Sm90FwdLaunch& L_;
  const Smem sm_;
  const unsigned char* q_wg_;  // this warpgroup's 64 rows of the item's Q slot
  Sm90FwdAccum<Cfg>& acc_;
  // kMods (BeginItemMods): ALiBi's factor; PairsBefore of the item's
  // sequence (varlen bias / mask; dense: 0).
  float alibi_coef_ = 0.f;
  int64_t pairs_before_ = 0;
  int g_ = 0;           // K/V tiles consumed so far (ring slot and phase)
  int items_done_ = 0;  // items consumed so far (Q slot and phase)
};

}  // namespace sm90
}  // namespace cuda
}  // namespace attnserve
