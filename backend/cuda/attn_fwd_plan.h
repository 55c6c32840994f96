// The CUDA forward path's planning, in plain C++ (no CUDA headers, so it
// builds and is unit-tested on any machine): the tile tables of the portable
// kernel, one lookup into them, and PlanForward, which turns params into the
// Plan the launch follows.
#pragma once

#include <cstdint>

#include "backend/params.h"
#include "backend/plan.h"

namespace attnserve {
namespace cuda {

// Tile table of the portable mma.sync kernel, one row per instantiated head
// dim. Every warp owns kBlockM / kNWarps query rows (16 per m16n8k16 tile) and
// the whole kBlockN-wide score tile for them; Q, K and V tiles live in shared
// memory with rows padded by 16 bytes (conflict-free ldmatrix without swizzle).
//  - 64:  128x64, 4 warps (32 rows each). O = 64 + S = 64 fp32 regs; a
//         128-wide N tile (S = 128 regs) spilled at the 255-register limit.
//  - 96:  128x64, 4 warps. O = 96 + S = 64 regs.
//  - 128: 128x64, 4 warps. O = 128 + S = 64 regs: the FA2 sm80 choice; two
//         m16 tiles per warp let every K/V fragment loaded from smem feed two
//         MMAs, which keeps shared-memory bandwidth under the tensor-core rate.
//         Smem 70 KB; two CTAs per SM (register-bound).
//  - 192: 128x64, 8 warps (16 rows each). O = 96 regs; 2 m-tiles would need
//         192 + 64 regs and spill. Smem 102 KB: 2 CTAs per SM on sm90/sm80.
//  - 256: 128x64, 8 warps (16 rows each). O = 128 regs. Smem 135 KB: fits
//         sm80's 164 KB and sm90's 227 KB. sm86/89 (99 KB per CTA) run only
//         the head dims whose tiles fit (CanImplement checks).
// Stages: 2 = K and V double-buffered (the next tile's K and V load while
// this one is computed: twice the bytes in flight, which decode needs, and one
// barrier per tile); 1 = single K and V buffers, V loading during Q.K^T and the
// next K during softmax and P.V (FA2's scheme) where smem is short.
//  - 64: 2 stages (52 KB): faster than 1 stage.
//  - 96, 128: 1 stage: 2 stages (104 KB at 128) are slower in prefill and
//    decode.
//  - 192, 256: 1 stage (102, 135 KB; 2 stages would be 153/203 KB: one CTA
//    per SM at best, and over sm80's 164 KB for 256).
struct TileConfig {
  int head_dim;
  int block_m;
  int block_n;
  int num_warps;
  int stages;
  int regs;  // registers per thread the split planner assumes (ptxas -v; 255 = at the cap)
};
// The row of a tile table for `head_dim`, or all zeros when it has none.
template <int N>
constexpr TileConfig TileRowFor(const TileConfig (&table)[N], int head_dim) {
  for (const TileConfig& t : table) {
    if (t.head_dim == head_dim) return t;
  }
  return TileConfig{0, 0, 0, 0, 0, 0};
}
constexpr TileConfig kTileTable[] = {
    {64, 128, 64, 4, 2, 255},  {96, 128, 64, 4, 1, 255},  {128, 128, 64, 4, 1, 255},
    {192, 128, 64, 8, 1, 255}, {256, 128, 64, 8, 1, 255},
};
// Decode tile (used when the whole M extent, seqlen_q x packed GQA heads, is
// at most 16 rows): one 16-row m tile; all 4 warps load and compute.
// The prefill tile wastes 7/8 of its Q tile and registers here: 255 registers
// x 128 threads allow 2 CTAs per SM, each with one 16 KB K or V tile in flight
// (1 stage), i.e. 8 dependent DRAM round trips per 4-tile split. This one:
// O = D/2 = 64 and S = 8 fp32 registers per thread (168 at the launch bound,
// no spill), K and V double buffered (the next tile's K and V both in flight
// during this tile, one round trip per tile), smem (16 + 4 x 64) x (D + 8) x 2
// = 74 KB at D=128: 3 CTAs per SM, 105 KB in flight per SM. Head dims 192/256
// (143+ KB) keep the prefill tile.
// The 4 warps split each tile's 64 keys (16 each, merged at the end): no
// slower than warp 0 computing alone, nor than a 16 x 32 x 4-stage cp.async
// ring (the kernel body supports kStages >= 3).
constexpr TileConfig kDecodeTileTable[] = {
    {64, 16, 64, 4, 2, 168},
    {96, 16, 64, 4, 2, 168},
    {128, 16, 64, 4, 2, 168},
};
// Banded (causal / sliding-window) instantiations that use a different tile.
//  - 128: 128x32, 2 stages (same 70 KB smem as 128x64 x 1 stage): S = 32
//         registers instead of 64 (spills 176 -> 16 B) and the next K and V in
//         flight during the whole tile: faster causal; noncausal keeps
//         128x64 (here Q fragments are re-read from smem twice as often).
// Not for 256 (either mask): 128x32, 2 stages, 8 warps, 135 KB is slower
// than 128x64 x 1 stage.
constexpr TileConfig kBandedTileTable[] = {
    {128, 128, 32, 4, 2, 255},
};
// Tile table of the Hopper kernel family (backend/cuda/hopper/, sm_90a),
// one row per head dim it covers. Every CTA has 128 query rows: two consumer
// warpgroups of 64 rows (the wgmma M) plus one producer warpgroup that only
// issues TMA (12 warps; setmaxnreg gives consumers 232 registers, the
// producer 40). Tiles live in smem unpadded, 128-byte swizzled in blocks of
// 64 columns (what TMA writes and wgmma reads), so smem is
// (q_slots x 128 + 2 x stages x block_n) x D x 2 bytes (Sm90SmemBytes).
//  - 64:  128x128, 3 stages, 2 Q slots (128 KB). S = 64 + O = 32 fp32
//         registers; a 64-wide K tile is little math per byte, so one more
//         tile in flight.
//  - 128: 128x128, 2 stages, 2 Q slots (192 KB). S 64 + O 64 + P 32
//         registers (the P fragments of tile j live while S of j+1 is
//         computed: 160 + row state and addresses, under 232).
//  - 192: 128x112, 2 stages, 1 Q slot (217 KB). 112 keys is the widest multiple of
//         16 whose two stages fit (128 keys: 241 KB); S 56 + O 96 + P 28 = 180
//         registers, about the 256 tile's 176.
//  - 256: 128x64, 2 stages, 1 Q slot (192 KB). O alone is 128 registers; a 128-key
//         tile would add S 64 + P 32 and spill at 232.
// Other head dims run the next kernel up, the boxes zero-filling the columns
// past D (D < 64 on 64, 96 on 128): a 96-column tile would need a
// 64-byte-swizzle block, not written.
constexpr TileConfig kSm90TileTable[] = {
    {64, 128, 128, 12, 3, 232},
    {128, 128, 128, 12, 2, 232},
    {192, 128, 112, 12, 2, 232},
    {256, 128, 64, 12, 2, 232},
};
// Dynamic smem of a Hopper tile: q_slots Q tiles, the K and V rings, 1 KB
// to align the tiles to 1024 bytes (the swizzle atom) and the mbarriers.
// qk_bytes: bytes of a Q/K element (2; 1 for the FP8 path's codes, whose
// rows round up to whole 128-byte boxes); v_bytes: of a V element (2; 1 for
// V^T's codes, Plan::fp8_pv).
// v_dim: V's head dim when it differs (MLA shapes; 0: t.head_dim).
constexpr int kSm90MaxSmemBytes = 227 * 1024;  // a CTA's opt-in limit on sm_90
constexpr int Sm90SmemBytesWith(const TileConfig& t, int qk_bytes, int q_slots, int v_dim = 0,
                                int v_bytes = 2) {
  const int qk_row = (t.head_dim * qk_bytes + 127) / 128 * 128;
  // FP8 V^T (v_bytes 1) adds the 1024-byte ones tile of its row sums.
  return (q_slots * t.block_m + t.stages * t.block_n) * qk_row +
         t.stages * t.block_n * (v_dim > 0 ? v_dim : t.head_dim) * v_bytes +
         (v_bytes == 1 ? 1024 : 0) + 1024 + 256;
}
// Q slots of a Hopper prefill tile: two where they fit (D 64 and 128; FP8
// Q/K up to 256), so a persistent CTA's producer loads the next item's Q,
// and behind it that item's first K/V tiles, while this item still runs
// (with one slot it waits for this item's last Q K^T); one where they do not
// (16-bit D 192 and 256).
constexpr int Sm90QSlots(const TileConfig& t, int qk_bytes = 2, int v_dim = 0, int v_bytes = 2) {
  return Sm90SmemBytesWith(t, qk_bytes, 2, v_dim, v_bytes) <= kSm90MaxSmemBytes ? 2 : 1;
}
constexpr int Sm90SmemBytes(const TileConfig& t, int qk_bytes = 2, int v_dim = 0, int v_bytes = 2) {
  return Sm90SmemBytesWith(t, qk_bytes, Sm90QSlots(t, qk_bytes, v_dim, v_bytes), v_dim, v_bytes);
}
// True when the FP8 path's P V can run on FP8 wgmma on a tile of block_n
// keys (Plan::fp8_pv): its k32 steps and V^T's TMA boxes (64 or 128 keys,
// one 64- or 128-byte swizzled row) tile it, which D 192's 112 keys do not.
constexpr bool Sm90Fp8PvFits(int block_n) { return block_n > 0 && block_n % 64 == 0; }
// The FP8 call head dims PlanForward gives FP8 P V where the tile fits:
// 64, 128 and 256.
bool Fp8PvPlannedAt(int head_dim);
constexpr TileConfig Sm90TileFor(int head_dim) { return TileRowFor(kSm90TileTable, head_dim); }

// The Hopper prefill kernel for MLA shapes (V's and O's head dim Dv
// differing from Q's and K's D), one row per (D, Dv) pair: Q K^T over D's
// 64-column boxes, P V and O over Dv's (16-bit only; Sm90FwdConfig's
// kHeadDimV).
//  - 192/128: 128x128, 2 stages, 1 Q slot (209 KB: Q 48 + K 96 + V 64;
//    two Q slots would be 257 KB). V at 128 columns leaves room for
//    128-key tiles, where the equal-dims 192 kernel takes 112; registers
//    are D 128's (S 64 + O 64 + P 32). A plan on it names kernel_head_dim
//    192, so PlanSmemBytes reports the equal-dims 192 tile's 217 KB: over
//    this one's, and within the limit it is checked against.
struct Sm90DvTile {
  int head_dim_v;
  TileConfig tile;
};
constexpr Sm90DvTile kSm90DvTileTable[] = {
    {128, {192, 128, 128, 12, 2, 232}},
};
// The tile of the (head_dim, head_dim_v) pair, or all zeros when the table has none.
template <int N>
constexpr TileConfig Sm90DvTileRowFor(const Sm90DvTile (&table)[N], int head_dim, int head_dim_v) {
  for (const Sm90DvTile& t : table) {
    if (t.tile.head_dim == head_dim && t.head_dim_v == head_dim_v) return t.tile;
  }
  return TileConfig{0, 0, 0, 0, 0, 0};
}
constexpr TileConfig Sm90DvTileFor(int head_dim, int head_dim_v) {
  return Sm90DvTileRowFor(kSm90DvTileTable, head_dim, head_dim_v);
}

// True when the Hopper prefill kernel on a tile of block_n keys takes a
// block mask of (block_q, block_k): its 128-row query tiles lie in one query
// block (block_q a multiple of 128, as the contract has it), and its key
// tiles in one key block (block_n divides block_k: tiles of 64 and 128 keys
// always; D 192's 112 and the long-key tile's 192 almost never, so a
// block-masked call takes kSm90TileTable's tile, and D 192 the portable
// kernel).
constexpr bool Sm90BlockMaskFits(int block_n, int block_q, int block_k) {
  return block_n > 0 && block_q > 0 && block_q % 128 == 0 && block_k > 0 && block_k % block_n == 0;
}

// The Hopper prefill kernel on a wider key tile, for calls whose key range
// (Sk, the longest sequence's for varlen) is at least kSm90LongKeysMinSk
// (TileKind::kLongKeys): fewer row-max and row-sum reductions, barrier
// waits and wgmma issues per key, where a short range would waste more of
// its last, partial tile (so a short range keeps kSm90TileTable's):
//  - 64: 128x192, 3 stages, 2 Q slots (176 KB; S 96 + O 32 + P 48
//        registers).
// D = 128 (128x160) gains causal only, loses at short N: not listed.
constexpr TileConfig kSm90LongKeyTileTable[] = {
    {64, 128, 192, 12, 3, 232},
};
constexpr int kSm90LongKeysMinSk = 4096;
constexpr TileConfig Sm90LongKeyTileFor(int head_dim) {
  return TileRowFor(kSm90LongKeyTileTable, head_dim);
}
// Decode tile of the Hopper family (hopper/attn_decode_sm90.cuh): the
// portable decode tile's math (16 rows, 4 warps splitting a 64-key tile) plus
// a producer warp (5 warps) whose TMA loads fill a ring of `stages` K/V
// tiles (64 keys x 64-column boxes, 128-byte swizzled; D = 96 takes two
// boxes, the second half zeros). Sized so two CTAs fit per SM (<= 113 KB of
// smem each; 168 registers x 160 threads allow 2), though splits aim at one
// (attn_fwd_plan.cc): about 100 KB of K/V requested per CTA at any time,
// against the portable tile's 2 x 34 KB.
//  - 64:  6 stages (6 x 16 KB + Q).
//  - 96:  3 stages (3 x 32 KB + Q).
//  - 128: 3 stages (3 x 32 KB + Q).
// The head dim must be the kernel's exactly (Q rows are copied whole, with
// no zero fill of padding columns); other decode calls stay portable.
constexpr TileConfig kSm90DecodeTileTable[] = {
    {64, 16, 64, 5, 6, 168},
    {96, 16, 64, 5, 3, 168},
    {128, 16, 64, 5, 3, 168},
};
constexpr TileConfig Sm90DecodeTileFor(int head_dim) {
  return TileRowFor(kSm90DecodeTileTable, head_dim);
}
// Its dynamic smem: Q in padded rows (1024-byte aligned block), the K and V
// rings in 64-column boxes, 1 KB to align everything to the swizzle atom.
constexpr int Sm90DecodeQBytes(const TileConfig& t) {
  return (t.block_m * (t.head_dim + 8) * 2 + 1023) / 1024 * 1024;
}
constexpr int Sm90DecodeSmemBytes(const TileConfig& t) {
  return Sm90DecodeQBytes(t) + 2 * t.stages * ((t.head_dim + 63) / 64) * t.block_n * 128 + 1024;
}
constexpr int kDecodeMaxRows = 16;
constexpr int SmemBytes(const TileConfig& t) {
  return (t.block_m + 2 * t.stages * t.block_n) * (t.head_dim + 8) * 2;
}

// The row of `kind`'s table for `head_dim`; head_dim 0 when that table has
// none (only kPrefill covers every head dim).
constexpr TileConfig TileFor(TileKind kind, int head_dim) {
  if (kind == TileKind::kDecode) return TileRowFor(kDecodeTileTable, head_dim);
  if (kind == TileKind::kBanded) return TileRowFor(kBandedTileTable, head_dim);
  return TileRowFor(kTileTable, head_dim);
}

// Split-KV workspace: a fixed block of ticket counters (one int32 per tile
// group = (m block, head, batch), the CTAs that share a query tile), then the
// fp32 partials. The counters are zero at rest: zeroed once when the
// workspace is allocated (ClearSplitCounters, attn_fwd.h), and every split
// launch leaves them zero (the last CTA of a group resets its counter). Fixed
// size and first, so calls of any split count and shape find them in the
// same place; the planner splits only launches with at most kMaxSplitGroups
// groups (more than about 10 waves never split: DecodeSplits). A Hopper
// prefill plan, which never splits, takes the counter block alone for its
// schedule's item counters (Sm90ScheduleWorkspaceBytes).
constexpr int64_t kMaxSplitGroups = 8192;
// Splits of one launch at most (the combine's smem holds one weight each).
constexpr int kMaxSplits = 128;
constexpr int64_t kSplitCounterBytes = kMaxSplitGroups * 4;
// Workspace bytes of a launch of `p` with `num_splits` > 1 splits (partial
// rows of O's head dim, HeadDimV).
inline int64_t SplitWorkspaceBytes(const AttnParams& p, int num_splits) {
  return kSplitCounterBytes +
         int64_t{num_splits} * p.num_heads_q * p.total_q * (int64_t{HeadDimV(p)} + 1) * 4;
}

// Batch-invariant decode (AttnParams::batch_invariant): a split's key range
// is a function of its own sequence, never of the batch. A CTA scanning
// `tiles` key tiles takes splits of max(ceil(tiles / S), T) tiles
// (InvariantTilesPerSplit): S = InvariantDecodeSplits(heads), about one CTA
// per SM of a large GPU for one long sequence; T = InvariantMinTiles(), so a
// short sequence takes few splits and a large batch of them is not cut into
// CTAs of a tile or two (each split costs a Q load, a pipeline ramp and a
// share of the combine). The launch's split count (InvariantDecodeGrid; the
// plan holds S) covers every sequence up to the longest; a shorter one leaves
// trailing splits empty, which the combine weighs 0.
constexpr int kInvariantDecodeCtas = 128;
constexpr int kInvariantMinTiles = 8;
// ATTNSERVE_CUDA_INVARIANT_MIN_TILES overrides T up to this (the bench's
// ablation; 1 is the rule before T: ceil(tiles / S) per split).
constexpr int kInvariantMinTilesMax = 1024;
// S for a launch whose m block has `heads` CTAs (KV heads when GQA packs
// into M, else query heads).
constexpr int InvariantDecodeSplits(int64_t heads) {
  const int64_t s = heads > 0 ? kInvariantDecodeCtas / heads : 1;
  return s < 1 ? 1 : (s > kMaxSplits ? kMaxSplits : static_cast<int>(s));
}
ATTN_HOST_DEVICE int InvariantTilesPerSplit(int tiles, int splits, int min_tiles) {
  const int per = (tiles + splits - 1) / splits;
  return per > min_tiles ? per : min_tiles;
}
// Splits of an invariant decode launch whose longest sequence spans
// max_tiles key tiles. A sequence of n tiles needs ceil(n / per(n)): that is
// ceil(n / T) up to S x T tiles (S splits of T) and at most S past it, so
// min(S, ceil(max_tiles / T)) covers every sequence up to the longest. At
// least 2 when S is: a sequence then always ends in the combine, whether it
// runs alone or with longer ones (the unsplit epilogue adds a sink, and
// rounds, its own way).
constexpr int InvariantDecodeGrid(int64_t max_tiles, int splits, int min_tiles) {
  if (splits <= 1 || max_tiles <= 0 || min_tiles <= 0) return 1;
  const int64_t need = (max_tiles + min_tiles - 1) / min_tiles;
  return need >= splits ? splits : (need < 2 ? 2 : static_cast<int>(need));
}
// T: kInvariantMinTiles, or ATTNSERVE_CUDA_INVARIANT_MIN_TILES (1 to
// kInvariantMinTilesMax) read once per process: the launch's split count
// (LaunchSplits, launch_splits.h) and the kernel's T come from this value.
int InvariantMinTiles();

// How the warpgroups of a CTA share the work (bench/NOTES-cuda.md's ablation
// has one row per schedule):
//  - kTmaSync: 2 consumer warpgroups (64 query rows each, wgmma for both
//    GEMMs); thread 0 also issues the TMA loads of the K/V ring.
//  - kWarpSpecialized: + a producer warpgroup that only issues TMA
//    (setmaxnreg: producer 40 registers, consumers 232).
//  - kPingPong: + named barriers order the two consumers' QK^T GEMMs so one
//    warpgroup's softmax runs while the other's GEMM does.
//  - kPingPongOverlap: + inside a warpgroup, the softmax of tile j runs while
//    the P V GEMM of tile j-1 is in flight (both GEMMs issued in one turn).
//  - kPersistent: + one CTA per SM walks the work items (m block, batch,
//    head; banded: most key tiles first within a head), its producer loading
//    the next item's Q and K/V during this one's last tiles and epilogue.
//    Static striding: CTA c takes items c, c + grid, ...
//  - kPersistentDynamic: the same, but each CTA's producer takes the next
//    item from a global counter when it needs one (so a CTA that drew long
//    items takes fewer), and hands it to its consumers through shared memory.
enum class Sm90Schedule : int {
  kTmaSync = 0,
  kWarpSpecialized = 1,
  kPingPong = 2,
  kPingPongOverlap = 3,
  kPersistent = 4,
  kPersistentDynamic = 5,
};

// The schedule the planner's launches use: items drawn from a counter, for
// every mask. Static striding leaves CTAs unevenly loaded when items differ
// in length (banded calls; varlen sequences); the counter balances them and
// costs unbanded calls nothing measurable. Only this schedule is in the
// production library; the others are built for attn_bench's ablation
// (bench/cuda/sm90_schedule_ablation.cu).
constexpr Sm90Schedule kDefaultSm90Schedule = Sm90Schedule::kPersistentDynamic;
// Workspace a schedule needs: kPersistentDynamic's two counters (the next
// item, the CTAs done: ints 0 and 1 of the counter block, zero at rest like
// the split tickets; the last CTA out resets them). A Hopper prefill plan
// never splits, so no ticket shares them.
constexpr int64_t Sm90ScheduleWorkspaceBytes(Sm90Schedule s) {
  return s == Sm90Schedule::kPersistentDynamic ? kSplitCounterBytes : 0;
}

// The tile of a plan (either family) and its dynamic shared memory.
TileConfig TileForPlan(const Plan& plan);
int PlanSmemBytes(const Plan& plan);

// Where a call's K/V rows come from: the request's tensors (LaunchForward)
// or a cache's pages through block tables (LaunchPagedForward). The Hopper
// prefill kernel reads tensors only; the Hopper decode kernel both.
enum class KvRows { kTensors, kPages };

// Chooses the kernel, the tile, the split count and GQA packing for
// FP16/BF16 params, and FP8 E4M3 params as their BF16 view (the kernel that
// runs) plus Plan::fp8_qk where the Hopper prefill kernel takes them (host
// memory is fine: only sizes are read); num_sms: the
// device's SM count. kernel_head_dim is 0 when this build compiled no kernel
// for params.head_dim. A call whose V/O head dim differs (HeadDimV, MLA
// shapes) runs on a (D, Dv) pair's kernel (kernel_head_dim its D): the
// Hopper family's (Sm90DvKernelFor) where it would take the call, else the
// portable kernel's (DvKernelFor), never on the decode tile, and over the
// request's tensors only (pages: kernel_head_dim 0). allow_sm90: the device is
// sm90 and the caller allows the Hopper family (CudaBackend: unless ATTNSERVE_CUDA_PORTABLE=1); the
// plan then takes it for what it covers (SupportsSm90). A pure host function (attn_fwd_plan.cc,
// compiled by the host compiler in every build), unit-tested without a GPU.
Plan PlanForward(const AttnParams& p, int num_sms, bool allow_sm90 = false,
                 KvRows kv = KvRows::kTensors);

}  // namespace cuda
}  // namespace attnserve
