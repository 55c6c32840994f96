// Float64 materialised attention: the ground truth for tests and benchmarks.
// It builds the full Sq×Sk score matrix per (batch, head) on purpose; it is
// never linked into the server.
#pragma once

#include <vector>

#include "backend/params.h"

namespace attnserve {

struct ReferenceOutput {
  std::vector<double> o;  // [total_q, Hq, Dv], the layout of params.o
  // The layout of params.lse (always filled); for rows that see no key -inf,
  // or sink[h] when the call has sinks.
  std::vector<double> lse;
};

// Exact attention in float64 over the inputs in `p` (host pointers, read as
// p.dtype and widened; FP8 codes dequantised exactly: decode(code) * descale
// in float64). Applies the score modifiers and masks of params.h (ALiBi,
// bias, element and block masks, sinks; their arrays in host memory too).
// p.o and p.lse are ignored.
ReferenceOutput ReferenceAttention(const AttnParams& p);

// The same function evaluated the way a framework does it in p.dtype: scores
// and probabilities rounded to p.dtype, output rounded to p.dtype, float
// accumulation. Its distance from ReferenceAttention sets the FP16/BF16
// tolerance (docs/design.md §4). For FP32 it equals ReferenceAttention rounded to float.
// For FP8_E4M3 it is the BF16 computation on the dequantised inputs rounded to
// BF16 (what the CUDA path runs: dequantise to BF16, then the BF16 kernel).
ReferenceOutput ReferenceAttentionLowPrecision(const AttnParams& p);

// K and V read from an FP8 K/V cache (paged_kv.h), laid out as contiguous
// rows: p.k and p.v hold E4M3 codes [total_k, Hkv, D or Dv] (not p.dtype, which is
// Q's and O's: FP16 or BF16) and k/v their scales [total_k, Hkv]; an element
// is code x its row's scale. The float64 run takes that product exactly (the
// reference over the dequantised cache); the low-precision run rounds it to
// p.dtype (a framework that dequantises to the dtype, then attends in it).
struct KvRowScales {
  const float* k = nullptr;
  const float* v = nullptr;
};
ReferenceOutput ReferenceAttention(const AttnParams& p, const KvRowScales& kv);
ReferenceOutput ReferenceAttentionLowPrecision(const AttnParams& p, const KvRowScales& kv);

}  // namespace attnserve
