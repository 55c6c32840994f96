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
//   int32 item_order[items]     the Hopper prefill kernel's block-masked work
//                               items in the order its scheduler hands them
//                               out (ItemOrderBytes; dense calls too)
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

// The Hopper prefill kernel's work items (128 query rows of one head of one
// sequence) of p: an upper bound (pack_gqa 1) of its launch's count.
constexpr int kSm90ItemRows = 128;
ATTN_HOST_DEVICE int64_t Sm90ItemsOf(const AttnParams& p) {
  return (int64_t{p.seqlen_q} + kSm90ItemRows - 1) / kSm90ItemRows * p.batch * p.num_heads_q;
}

// A block-masked Hopper launch orders its items by kept key blocks, longest
// first (OrderItemsKernel): one int32 per item, after the staged offsets.
// Past kMaxOrderedItems (a varlen batch of very many short sequences) the
// items run in their natural order: the order's 4 bytes an item would cost
// more than its balance buys.
constexpr int64_t kMaxOrderedItems = int64_t{1} << 22;
ATTN_HOST_DEVICE int64_t ItemOrderBytes(const AttnParams& p) {
  if (!HasBlockMask(p)) return 0;
  const int64_t items = Sm90ItemsOf(p);
  return items <= kMaxOrderedItems ? 4 * items : 0;
}
ATTN_HOST_DEVICE int64_t ItemOrderOffset(const AttnParams& p) {
  return kModsPrefixOffset + ModsPrefixBytes(p);
}

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
