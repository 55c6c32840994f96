// Random score modifiers and masks for attention tests (params.h's ALiBi
// slopes, sinks, additive bias, boolean element mask and CSR block mask),
// shared by the CPU tests and the CUDA tests. A ModsSpec says which mods a
// case carries and how dense they are; HostMods draws random host arrays for
// one call's shape and points an AttnParams at them. TestCase::mods
// (attn_test_util.h) carries a spec, so HostBuffers builds the arrays itself
// and its reference sees them:
//
//   TestCase tc;
//   tc.seqlen_q = tc.seqlen_k = 300;
//   tc.mods.sinks = true;
//   tc.mods.mask_density = 0.5f;            // each (i, j) kept with p = 0.5
//   tc.mods.block_q = tc.mods.block_k = 128;
//   tc.mods.block_density = 0.25f;          // each (query block, key block) kept with p = 0.25
//   HostBuffers buf(tc);                    // buf.params() carries host pointers to all of it
//   const HostMods* mods = buf.mods();      // the arrays, to copy to a device
//
// A device test copies mods->bias() etc. to the device and sets the matching
// AttnParams pointers (ApplyTo shows which field takes which array).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/make_params.h"
#include "backend/params.h"

namespace attnserve {
namespace testing_util {

// Which mods a call carries; every one is off by default. The *_per_batch /
// *_per_head flags pick the broadcast shape ([B or 1, Hq or 1, ...]); varlen
// calls always get per_batch (the contract's only varlen layout).
struct ModsSpec {
  // ALiBi: slopes uniform in [0, alibi_max_slope] per query head.
  bool alibi = false;
  float alibi_max_slope = 0.25f;
  // Sinks: logits uniform in [-sink_range, sink_range] per query head.
  bool sinks = false;
  float sink_range = 3.0f;
  // Bias: normal(0, bias_std) rounded to bias_dtype; a bias_neg_inf fraction
  // of elements is -inf (removes the key like the mask).
  bool bias = false;
  DType bias_dtype = DType::kFP32;
  bool bias_per_batch = true;
  bool bias_per_head = true;
  float bias_std = 1.0f;
  float bias_neg_inf = 0.0f;
  // Element mask: each byte nonzero (attend) with probability mask_density;
  // < 0 means no mask. A mask_empty_rows fraction of rows is all zero
  // (fully masked query rows).
  float mask_density = -1.0f;
  float mask_empty_rows = 0.0f;
  bool mask_per_batch = true;
  bool mask_per_head = true;
  // Block mask: block_q = 0 means none. Each (query block, key block) pair is
  // kept with probability block_density; a block_empty_rows fraction of CSR
  // rows keeps no block.
  int32_t block_q = 0;
  int32_t block_k = 0;
  float block_density = 1.0f;
  float block_empty_rows = 0.0f;
  bool block_per_batch = true;
  bool block_per_head = true;

  bool any() const { return alibi || sinks || bias || mask_density >= 0.0f || block_q > 0; }
  // A gtest-safe tag ([A-Za-z0-9_]) spelling what is on, e.g.
  // "_alibi_sinks_biasbf16_BH_mask0p5_1H_bm128x128s0p25_B1"; empty when none.
  std::string Tag() const;
};

// Specs of one mod each, with its broadcast shape: a bias of `dtype` (a
// `neg_inf` fraction of -inf), an element mask kept with p = `density` (an
// `empty_rows` fraction of rows all zero), a block mask of bq x bk blocks kept
// with p = `density` (an `empty_rows` fraction of CSR rows empty).
ModsSpec Bias(DType dtype, bool per_batch, bool per_head, float neg_inf = 0.f);
ModsSpec Mask(float density, bool per_batch, bool per_head, float empty_rows = 0.f);
ModsSpec Blocks(int bq, int bk, float density, bool per_batch, bool per_head,
                float empty_rows = 0.f);

// The random arrays of one spec for one call's shape (sizes, varlen offsets
// and total_pairs of `shape`, which must come from MakeAttnParams; its mod
// fields are ignored). Host memory, owned here; not copyable (params point in).
class HostMods {
 public:
  HostMods(const ModsSpec& spec, const AttnParams& shape, uint32_t seed);
  HostMods(const HostMods&) = delete;
  HostMods& operator=(const HostMods&) = delete;

  // The spec as applied (per_batch forced on for varlen).
  const ModsSpec& spec() const { return spec_; }
  // Sets p's mod fields: pointers to these host arrays, bias_dtype, block
  // sizes and broadcast flags. Fields of mods that are off stay null/0.
  void ApplyTo(AttnParams* p) const;
  // The same as an AttnMods (MakeAttnParams' input).
  AttnMods mods() const;

  // The arrays (empty when that mod is off), in the layouts of params.h.
  const std::vector<float>& alibi_slopes() const { return alibi_; }  // [Hq]
  const std::vector<float>& sinks() const { return sinks_; }         // [Hq]
  const std::vector<uint8_t>& bias() const { return bias_; }         // bytes of bias_dtype
  int64_t bias_elements() const;
  const std::vector<uint8_t>& mask() const { return mask_; }              // one byte per element
  const std::vector<int32_t>& block_row_ptr() const { return row_ptr_; }  // BlockMaskRows + 1
  const std::vector<int32_t>& block_col_idx() const { return col_idx_; }  // nnz
  // Kept blocks over all (row, key block) pairs of the CSR (1 without a block mask).
  double kept_block_fraction() const { return kept_fraction_; }

 private:
  ModsSpec spec_;
  std::vector<float> alibi_, sinks_;
  std::vector<uint8_t> bias_, mask_;
  std::vector<int32_t> row_ptr_, col_idx_;
  double kept_fraction_ = 1.0;
};

// The key blocks (ceil(sk_b / block_k)) a CSR row of sequence b may name.
int32_t KeyBlocksOf(const AttnParams& p, int b);

}  // namespace testing_util
}  // namespace attnserve
