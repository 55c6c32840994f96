// The fused CPU attention kernel: one task computes the output rows of one
// (sequence, query head, block of kBlockM query rows), scanning K/V in blocks
// of kBlockN keys with an online softmax (FlashAttention-2 loop order). The
// Sq×Sk score matrix never exists; a task touches only its Scratch.
#pragma once

#include <cstdint>
#include <memory>

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
// accumulators, enough independent FMA chains to cover FMA latency on two ports.
inline constexpr int kRowTile = 4;

// Per-thread working memory, sized for one head dim: O(kBlockM·D + kBlockN·D +
// kBlockM·kBlockN) floats, independent of the sequence lengths.
class Scratch {
 public:
  // Null on allocation failure (the caller reports RESOURCE_EXHAUSTED).
  static std::unique_ptr<Scratch> Create(int head_dim);
  // Bytes this scratch holds (the benchmark's memory accounting cross-check).
  static int64_t BytesFor(int head_dim);

  float* q() { return buf_.get(); }                 // [kBlockM, D], pre-scaled
  float* kt() { return q() + kBlockM * d_; }        // [D, kBlockN], K tile transposed
  float* v() { return kt() + d_ * kBlockN; }        // [kBlockN, D]
  float* s() { return v() + kBlockN * d_; }         // [kBlockM, kBlockN], scores then P
  float* o() { return s() + kBlockM * kBlockN; }    // [kBlockM, D], unnormalised
  float* m() { return o() + kBlockM * d_; }         // [kBlockM] running max (log2 units)
  float* l() { return m() + kBlockM; }              // [kBlockM] running sum
  int head_dim() const { return d_; }

 private:
  Scratch(std::unique_ptr<float[]> buf, int d) : buf_(std::move(buf)), d_(d) {}
  std::unique_ptr<float[]> buf_;
  int d_;
};

// Computes rows [m_block * kBlockM, min(+kBlockM, Sq)) of sequence b, query
// head h: writes o (in p.dtype) and, when p.lse is set, lse. `p` must have
// passed CheckParams.
void AttentionTask(const AttnParams& p, int b, int h, int m_block, Scratch* scratch);

}  // namespace cpu
}  // namespace attnserve
