// The per-sequence offsets of a varlen call's pair-layout modifiers, staged
// once per launch in the launch's workspace: PairOffset's pairs_before (bias,
// element mask) and BlockRow's rows_before (block mask) of every sequence.
// Without them each CTA (or work item) walked the sequences before its own,
// O(B) each and O(B^2) per call. Plain C++ (the planner sizes the workspace
// in every build) and nvcc-safe (the kernels read it).
//
// Layout, right after the workspace's counter block (a split plan's
// partials follow them, MakeFwdLaunch), so a kernel finds them at a fixed
// offset:
//   int64 pairs_before[B + 1]   pairs of sequences 0..b-1 ([B]: all)
//   int64 rows_before[B + 1]    query blocks of sequences 0..b-1 (0 without
//                               a block mask)
#pragma once

#include <cstdint>

#include "backend/cuda/attn_fwd_plan.h"
#include "backend/params.h"

namespace attnserve {
namespace cuda {

// Whether a launch of p reads the staged offsets.
ATTN_HOST_DEVICE bool NeedsModsPrefix(const AttnParams& p) {
  return IsVarlen(p) && (p.bias != nullptr || p.mask != nullptr || HasBlockMask(p));
}

ATTN_HOST_DEVICE int64_t ModsPrefixBytes(const AttnParams& p) {
  return NeedsModsPrefix(p) ? 2 * 8 * (int64_t{p.batch} + 1) : 0;
}

// Their byte offset in the workspace: after the counter block.
constexpr int64_t kModsPrefixOffset = kSplitCounterBytes;

// BlockRow (params.h) with the staged offsets: rows_before = rows_before[b],
// rows_total = rows_before[B] (params.h's walks the sequences for both).
ATTN_HOST_DEVICE int64_t StagedBlockRow(const AttnParams& p, int64_t rows_before,
                                        int64_t rows_total, int b, int h, int r) {
  if (!IsVarlen(p)) return BlockRow(p, 0, b, h, r);
  const int64_t hh = p.block_per_head ? h : 0;
  return hh * rows_total + rows_before + r;
}

}  // namespace cuda
}  // namespace attnserve
