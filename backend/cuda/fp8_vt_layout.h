// The layout of V^T that the Hopper prefill kernel's FP8 P V reads
// (Plan::fp8_pv): E4M3 codes, one row per (KV head, head-dim column) and one
// column per key position, so that the keys of a row are contiguous (FP8
// wgmma takes B only K-major). Written by fp8_dequant.cu's transpose pass,
// read by the kernel through a TMA map (attn_fwd_sm90.cuh). nvcc-safe, plain
// C++ on the host (the tests model it).
//
// Columns: sequence b's keys start at column VtSeqStart(p, b), a multiple
// of kFp8VtAlign (a TMA box's first column must be 16-byte aligned: an
// unaligned one is an illegal instruction), at least kFp8VtGap - 63 zero
// columns after the sequence before (dense: b x (Sk + kFp8VtGap) rounded
// up; varlen: SeqStartK(p, b) + b x kFp8VtGap rounded up, no prefix sum
// needed), so a key tile reaching past a sequence's end reads zeros (P is 0
// there, and 0 x a finite code is 0) and never the next sequence's codes.
//
// Keys are permuted inside each aligned group of 32 (a k32 step of FP8
// wgmma, counted from the sequence's first key): column 32 g + c holds key
// 32 g + Fp8VtKeyAt(c). Why: the S accumulator of Q K^T (fp32, m64nNk32's
// D fragment) gives a thread, in row r of its two, the keys 8 j + 2 q +
// {0, 1} for n8 tiles j = 0..3 of the step (q = lane % 4); FP8 wgmma's A
// fragment in registers wants, in the same row, k = 4 q + {0..3} (register
// 0 or 1) and k = 16 + 4 q + {0..3} (register 2 or 3). Packing the thread's
// S values in register order (tiles 0, 1 into the first word, 2, 3 into the
// second) therefore puts key 16 h + 8 (i / 2) + 2 q + i % 2 at k = 16 h + 4 q
// + i, and V^T's column k must hold that key: no shuffle in the kernel.
#pragma once

#include <cstdint>

#include "backend/params.h"

namespace attnserve {
namespace cuda {

// Zero columns after each sequence: kFp8VtGap - (kFp8VtAlign - 1) = 193 at
// least, the widest key tile (192) of a kernel that reads V^T less one, so a
// last partial tile stays inside them.
constexpr int kFp8VtGap = 256;
constexpr int kFp8VtAlign = 64;
// The permutation's group: one k32 step of FP8 wgmma.
constexpr int kFp8VtGroup = 32;

// The key (counted from its group's first) that column c (0..31) of a group holds.
ATTN_HOST_DEVICE constexpr int Fp8VtKeyAt(int c) {
  return 16 * (c / 16) + 8 * ((c % 4) / 2) + 2 * ((c % 16) / 4) + c % 2;
}

ATTN_HOST_DEVICE int64_t VtAlignUp(int64_t x) {
  return (x + kFp8VtAlign - 1) / kFp8VtAlign * kFp8VtAlign;
}

// Dense calls: the columns from one sequence's start to the next's.
ATTN_HOST_DEVICE int64_t VtDensePeriod(const AttnParams& p) {
  return VtAlignUp(int64_t{p.seqlen_k} + kFp8VtGap);
}

// Sequence b's first column (b = batch: the end of the last one's gap).
ATTN_HOST_DEVICE int64_t VtSeqStart(const AttnParams& p, int b) {
  return IsVarlen(p) ? VtAlignUp(SeqStartK(p, b) + int64_t{b} * kFp8VtGap)
                     : int64_t{b} * VtDensePeriod(p);
}

// Columns of a V^T row: every sequence and its gap, rounded up to 64 (the
// transpose pass's column block; a multiple of 16 bytes, which a TMA row
// stride must be).
ATTN_HOST_DEVICE int64_t VtWidth(const AttnParams& p) {
  const int64_t w = IsVarlen(p) ? VtAlignUp(p.total_k + int64_t{p.batch} * kFp8VtGap)
                                : int64_t{p.batch} * VtDensePeriod(p);
  return (w + 63) / 64 * 64;
}

// Bytes of V^T: num_heads_kv x head_dim rows of VtWidth codes.
ATTN_HOST_DEVICE int64_t VtBytes(const AttnParams& p) {
  return int64_t{p.num_heads_kv} * p.head_dim * VtWidth(p);
}

}  // namespace cuda
}  // namespace attnserve
