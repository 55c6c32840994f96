// Random score modifiers and masks for tests (see the header).
#include "tests/common/score_mods_util.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <sstream>

#include "common/dtype.h"

namespace attnserve {
namespace testing_util {
namespace {

std::string Frac(float x) {
  std::ostringstream os;
  os << x;
  std::string s = os.str();
  for (char& c : s) {
    if (c == '.') c = 'p';
    if (c == '-') c = 'm';
  }
  return s;
}

std::string DTypeTag(DType t) {
  switch (t) {
    case DType::kFP16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kFP32: return "fp32";
    case DType::kFP8E4M3: return "fp8";
  }
  return "dt";
}

// "B1", "1H", "BH" or "11": the broadcast shape's leading extents.
std::string Bcast(bool per_batch, bool per_head) {
  return std::string(per_batch ? "B" : "1") + (per_head ? "H" : "1");
}

// Calls f(b, h, i, offset of (i, 0), sk_b) for every row of a bias or mask
// with these flags; b and h are 0 where the tensor is broadcast over them.
template <class F>
void ForEachPairRow(const AttnParams& p, bool per_batch, bool per_head, F f) {
  const int batches = per_batch ? p.batch : (p.batch > 0 ? 1 : 0);
  const int heads = per_head ? p.num_heads_q : 1;
  for (int b = 0; b < batches; ++b) {
    const int64_t before = PairsBefore(p, b);
    const int sq = SeqLenQ(p, b);
    const int sk = SeqLenK(p, b);
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < sq; ++i)
        f(b, h, i, PairOffset(p, per_batch, per_head, before, b, h, i, 0), sk);
    }
  }
}

}  // namespace

std::string ModsSpec::Tag() const {
  std::string s;
  if (alibi) s += "_alibi";
  if (sinks) s += "_sinks";
  if (bias) {
    s += "_bias" + DTypeTag(bias_dtype) + "_" + Bcast(bias_per_batch, bias_per_head);
    if (bias_neg_inf > 0.0f) s += "_ninf" + Frac(bias_neg_inf);
  }
  if (mask_density >= 0.0f) {
    s += "_mask" + Frac(mask_density) + "_" + Bcast(mask_per_batch, mask_per_head);
    if (mask_empty_rows > 0.0f) s += "_er" + Frac(mask_empty_rows);
  }
  if (block_q > 0) {
    s += "_bm" + std::to_string(block_q) + "x" + std::to_string(block_k) + "s" +
         Frac(block_density) + "_" + Bcast(block_per_batch, block_per_head);
    if (block_empty_rows > 0.0f) s += "_er" + Frac(block_empty_rows);
  }
  return s;
}

ModsSpec Bias(DType dtype, bool per_batch, bool per_head, float neg_inf) {
  ModsSpec m;
  m.bias = true;
  m.bias_dtype = dtype;
  m.bias_per_batch = per_batch;
  m.bias_per_head = per_head;
  m.bias_neg_inf = neg_inf;
  return m;
}

ModsSpec Mask(float density, bool per_batch, bool per_head, float empty_rows) {
  ModsSpec m;
  m.mask_density = density;
  m.mask_per_batch = per_batch;
  m.mask_per_head = per_head;
  m.mask_empty_rows = empty_rows;
  return m;
}

ModsSpec Blocks(int bq, int bk, float density, bool per_batch, bool per_head, float empty_rows) {
  ModsSpec m;
  m.block_q = bq;
  m.block_k = bk;
  m.block_density = density;
  m.block_per_batch = per_batch;
  m.block_per_head = per_head;
  m.block_empty_rows = empty_rows;
  return m;
}

int32_t KeyBlocksOf(const AttnParams& p, int b) {
  return (SeqLenK(p, b) + p.block_k - 1) / p.block_k;
}

HostMods::HostMods(const ModsSpec& spec, const AttnParams& shape, uint32_t seed) : spec_(spec) {
  if (IsVarlen(shape)) {
    spec_.bias_per_batch = spec_.mask_per_batch = spec_.block_per_batch = true;
  }
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const int hq = shape.num_heads_q;
  if (spec_.alibi) {
    alibi_.resize(static_cast<size_t>(hq));
    for (float& x : alibi_) x = unit(rng) * spec_.alibi_max_slope;
  }
  if (spec_.sinks) {
    sinks_.resize(static_cast<size_t>(hq));
    for (float& x : sinks_) x = (2.0f * unit(rng) - 1.0f) * spec_.sink_range;
  }
  if (spec_.bias) {
    const int64_t n = PairElements(shape, spec_.bias_per_batch, spec_.bias_per_head);
    bias_.assign(static_cast<size_t>(n * DTypeSize(spec_.bias_dtype)), 0);
    std::normal_distribution<float> normal(0.0f, spec_.bias_std);
    for (int64_t i = 0; i < n; ++i) {
      const float x =
          unit(rng) < spec_.bias_neg_inf ? -std::numeric_limits<float>::infinity() : normal(rng);
      StoreFromFloat(bias_.data(), spec_.bias_dtype, i, x);
    }
  }
  if (spec_.mask_density >= 0.0f) {
    const int64_t n = PairElements(shape, spec_.mask_per_batch, spec_.mask_per_head);
    mask_.resize(static_cast<size_t>(n));
    for (uint8_t& x : mask_) x = unit(rng) < spec_.mask_density ? 1 : 0;
    if (spec_.mask_empty_rows > 0.0f) {
      ForEachPairRow(shape, spec_.mask_per_batch, spec_.mask_per_head,
                     [&](int, int, int, int64_t off, int sk) {
                       if (unit(rng) < spec_.mask_empty_rows) {
                         std::fill(mask_.begin() + off, mask_.begin() + off + sk, 0);
                       }
                     });
    }
  }
  if (spec_.block_q > 0) {
    AttnParams p = shape;
    ApplyTo(&p);  // block sizes and flags, for the row helpers
    const int64_t rows = BlockMaskRows(p);
    std::vector<std::vector<int32_t>> cols(static_cast<size_t>(rows));
    const int batches = p.block_per_batch ? p.batch : (p.batch > 0 ? 1 : 0);
    const int heads = p.block_per_head ? hq : 1;
    int64_t pairs = 0;
    int64_t kept = 0;
    for (int b = 0; b < batches; ++b) {
      const int64_t before = BlockRowsBefore(p, b);
      const int kb = KeyBlocksOf(p, b);
      for (int h = 0; h < heads; ++h) {
        for (int r = 0; r < BlockRowsOf(p, b); ++r) {
          std::vector<int32_t>& row = cols[static_cast<size_t>(BlockRow(p, before, b, h, r))];
          const bool empty = unit(rng) < spec_.block_empty_rows;
          for (int c = 0; c < kb; ++c) {
            if (!empty && unit(rng) < spec_.block_density) row.push_back(c);
          }
          pairs += kb;
          kept += static_cast<int64_t>(row.size());
        }
      }
    }
    row_ptr_.assign(1, 0);
    for (const std::vector<int32_t>& row : cols) {
      col_idx_.insert(col_idx_.end(), row.begin(), row.end());
      row_ptr_.push_back(static_cast<int32_t>(col_idx_.size()));
    }
    kept_fraction_ = pairs > 0 ? static_cast<double>(kept) / pairs : 1.0;
  }
}

int64_t HostMods::bias_elements() const {
  return static_cast<int64_t>(bias_.size()) / DTypeSize(spec_.bias_dtype);
}

AttnMods HostMods::mods() const {
  // A tensor with no elements (an empty call) is left null: nothing to read.
  AttnMods m;
  m.alibi_slopes = alibi_.empty() ? nullptr : alibi_.data();
  m.sinks = sinks_.empty() ? nullptr : sinks_.data();
  if (!bias_.empty()) {
    m.bias = bias_.data();
    m.bias_dtype = spec_.bias_dtype;
    m.bias_per_batch = spec_.bias_per_batch;
    m.bias_per_head = spec_.bias_per_head;
  }
  if (!mask_.empty()) {
    m.mask = mask_.data();
    m.mask_per_batch = spec_.mask_per_batch;
    m.mask_per_head = spec_.mask_per_head;
  }
  if (spec_.block_q > 0) {
    m.block_q = spec_.block_q;
    m.block_k = spec_.block_k;
    m.block_row_ptr = row_ptr_.empty() ? nullptr : row_ptr_.data();
    m.block_col_idx = col_idx_.empty() ? nullptr : col_idx_.data();  // null: no kept block
    m.block_per_batch = spec_.block_per_batch;
    m.block_per_head = spec_.block_per_head;
  }
  return m;
}

void HostMods::ApplyTo(AttnParams* p) const {
  const AttnMods m = mods();
  p->alibi_slopes = m.alibi_slopes;
  p->sinks = m.sinks;
  p->bias = m.bias;
  p->bias_dtype = m.bias_dtype;
  p->bias_per_batch = m.bias_per_batch;
  p->bias_per_head = m.bias_per_head;
  p->mask = m.mask;
  p->mask_per_batch = m.mask_per_batch;
  p->mask_per_head = m.mask_per_head;
  p->block_q = m.block_q;
  p->block_k = m.block_k;
  p->block_row_ptr = m.block_row_ptr;
  p->block_col_idx = m.block_col_idx;
  p->block_per_batch = m.block_per_batch;
  p->block_per_head = m.block_per_head;
}

}  // namespace testing_util
}  // namespace attnserve
