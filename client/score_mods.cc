// Score modifiers and masks on the client side (see score_mods.h).
#include "client/score_mods.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/inputs.h"
#include "common/dtype.h"
#include "common/shape_string.h"

namespace attnserve {
namespace {

absl::Status Invalid(std::string message) { return absl::InvalidArgumentError(message); }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Per-sequence lengths of the call: dense calls repeat Sq/Sk B times.
struct SeqLens {
  std::vector<int64_t> q, k;
};
SeqLens SeqLensOf(const InputsSummary& s, const std::vector<int32_t>& cu_q,
                  const std::vector<int32_t>& cu_k) {
  SeqLens l;
  for (int64_t b = 0; b < s.batch; ++b) {
    l.q.push_back(s.varlen ? cu_q[b + 1] - cu_q[b] : s.seqlen_q);
    l.k.push_back(s.varlen ? cu_k[b + 1] - cu_k[b] : s.seqlen_k);
  }
  return l;
}

absl::Status CheckHeadValues(const char* field, const std::vector<float>& v, int64_t heads) {
  if (v.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(v.size()) != heads) {
    return Invalid(
        absl::StrCat(field, ": expected ", heads, " values (one per query head), got ", v.size()));
  }
  for (size_t h = 0; h < v.size(); ++h) {
    if (!std::isfinite(v[h])) {
      return Invalid(absl::StrCat(field, "[", h, "] must be finite, got ", v[h]));
    }
  }
  return absl::OkStatus();
}

// The shapes a bias or mask may have for the call: dense [B or 1, Hq or 1,
// Sq, Sk], varlen [Hq or 1, P].
absl::Status CheckPairShape(const char* field, const std::vector<int64_t>& shape,
                            const InputsSummary& s, int64_t total_pairs) {
  if (s.varlen) {
    if (shape.size() != 2 || (shape[0] != 1 && shape[0] != s.heads_q) || shape[1] != total_pairs) {
      return Invalid(absl::StrCat(field, ": varlen calls take [Hq or 1, P] = [", s.heads_q,
                                  " or 1, ", total_pairs, "] (P = sum of sq_b * sk_b), got ",
                                  ShapeString(shape)));
    }
    return absl::OkStatus();
  }
  if (shape.size() != 4 || (shape[0] != 1 && shape[0] != s.batch) ||
      (shape[1] != 1 && shape[1] != s.heads_q) || shape[2] != s.seqlen_q ||
      shape[3] != s.seqlen_k) {
    return Invalid(absl::StrCat(field, ": dense calls take [B or 1, Hq or 1, Sq, Sk] = [", s.batch,
                                " or 1, ", s.heads_q, " or 1, ", s.seqlen_q, ", ", s.seqlen_k,
                                "], got ", ShapeString(shape)));
  }
  return absl::OkStatus();
}

absl::Status CheckBlockMask(const BlockMaskData& m, const InputsSummary& s, const SeqLens& lens) {
  for (const auto& [name, size] : {std::pair{"block_q", m.block_q}, {"block_k", m.block_k}}) {
    if (size <= 0 || size % kBlockMaskGrain != 0) {
      return Invalid(absl::StrCat("block_mask.", name, ": expected a positive multiple of ",
                                  kBlockMaskGrain, ", got ", size));
    }
  }
  if (m.num_heads != 1 && m.num_heads != s.heads_q) {
    return Invalid(
        absl::StrCat("block_mask.num_heads: expected ", s.heads_q, " or 1, got ", m.num_heads));
  }
  if (s.varlen ? m.num_batch != s.batch : (m.num_batch != 1 && m.num_batch != s.batch)) {
    return Invalid(absl::StrCat("block_mask.num_batch: expected ", s.batch,
                                s.varlen ? " (varlen: one per sequence)" : " or 1", ", got ",
                                m.num_batch));
  }
  // The key blocks of each row, in CSR row order.
  std::vector<int64_t> row_kblocks;
  const int64_t seqs = s.varlen || m.num_batch != 1 ? s.batch : 1;
  auto add_rows = [&](int64_t b) {
    for (int64_t r = 0; r < CeilDiv(lens.q[b], m.block_q); ++r) {
      row_kblocks.push_back(CeilDiv(lens.k[b], m.block_k));
    }
  };
  if (s.varlen) {
    for (int32_t h = 0; h < m.num_heads; ++h) {
      for (int64_t b = 0; b < s.batch; ++b) add_rows(b);
    }
  } else {
    for (int64_t b = 0; b < seqs; ++b) {
      for (int32_t h = 0; h < m.num_heads; ++h) add_rows(b);
    }
  }
  const size_t rows = row_kblocks.size();
  if (m.row_ptr.size() != rows + 1) {
    return Invalid(absl::StrCat("block_mask.row_ptr: expected ", rows + 1,
                                " entries (rows + 1), got ", m.row_ptr.size()));
  }
  if (m.row_ptr[0] != 0) {
    return Invalid(absl::StrCat("block_mask.row_ptr[0] must be 0, got ", m.row_ptr[0]));
  }
  if (m.row_ptr.back() != static_cast<int64_t>(m.col_idx.size())) {
    return Invalid(absl::StrCat("block_mask.row_ptr[", rows, "] must equal the ", m.col_idx.size(),
                                " entries of col_idx, got ", m.row_ptr.back()));
  }
  for (size_t r = 0; r < rows; ++r) {
    if (m.row_ptr[r + 1] < m.row_ptr[r]) {
      return Invalid(absl::StrCat("block_mask.row_ptr must be non-decreasing, but row_ptr[", r + 1,
                                  "] = ", m.row_ptr[r + 1], " < row_ptr[", r,
                                  "] = ", m.row_ptr[r]));
    }
    for (int32_t i = m.row_ptr[r]; i < m.row_ptr[r + 1]; ++i) {
      const int32_t c = m.col_idx[i];
      if (c < 0 || c >= row_kblocks[r]) {
        return Invalid(absl::StrCat("block_mask.col_idx[", i, "] = ", c, " (row ", r,
                                    ") must be in [0, ", row_kblocks[r], ")"));
      }
      if (i > m.row_ptr[r] && c <= m.col_idx[i - 1]) {
        return Invalid(absl::StrCat(
            "block_mask.col_idx must increase strictly within a row, but "
            "col_idx[",
            i, "] = ", c, " <= col_idx[", i - 1, "] = ", m.col_idx[i - 1], " (row ", r, ")"));
      }
    }
  }
  return absl::OkStatus();
}

// The kept key blocks of one row with n key blocks; `diag` is the key block
// of the row's last query on the bottom-right aligned diagonal.
std::vector<int32_t> RowBlocks(BlockPattern pattern, double density, int64_t n, int64_t diag,
                               std::mt19937_64* rng) {
  const int64_t keep = std::llround(density * static_cast<double>(n));
  std::vector<int32_t> cols;
  if (pattern == BlockPattern::kRandom) {
    std::vector<int32_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    for (int64_t i = 0; i < keep; ++i) {
      std::uniform_int_distribution<int64_t> pick(i, n - 1);
      std::swap(all[i], all[pick(*rng)]);
    }
    cols.assign(all.begin(), all.begin() + keep);
  } else {
    std::set<int32_t> kept;
    for (int64_t c = 0; c < keep / 4; ++c) kept.insert(static_cast<int32_t>(c));
    const int64_t d = std::clamp<int64_t>(diag, 0, std::max<int64_t>(n - 1, 0));
    for (int64_t c = d; c >= 0 && static_cast<int64_t>(kept.size()) < keep; --c) {
      kept.insert(static_cast<int32_t>(c));
    }
    for (int64_t c = d + 1; c < n && static_cast<int64_t>(kept.size()) < keep; ++c) {
      kept.insert(static_cast<int32_t>(c));
    }
    cols.assign(kept.begin(), kept.end());
  }
  std::sort(cols.begin(), cols.end());
  return cols;
}

}  // namespace

void ScoreModsToProto(const ScoreMods& from, v1::AttentionOptions* to) {
  to->mutable_alibi_slopes()->Assign(from.alibi_slopes.begin(), from.alibi_slopes.end());
  to->mutable_sinks()->Assign(from.sinks.begin(), from.sinks.end());
  if (from.bias) from.bias->CopyToProto(to->mutable_bias());
  if (from.mask) {
    v1::ElementMask* m = to->mutable_mask();
    m->mutable_shape()->Assign(from.mask->shape.begin(), from.mask->shape.end());
    m->set_data(from.mask->data.data(), from.mask->data.size());
  }
  if (from.block_mask) {
    const BlockMaskData& b = *from.block_mask;
    v1::BlockMask* m = to->mutable_block_mask();
    m->set_block_q(b.block_q);
    m->set_block_k(b.block_k);
    m->set_num_batch(b.num_batch);
    m->set_num_heads(b.num_heads);
    m->mutable_row_ptr()->Assign(b.row_ptr.begin(), b.row_ptr.end());
    m->mutable_col_idx()->Assign(b.col_idx.begin(), b.col_idx.end());
  }
}

std::string ScoreModsString(const ScoreMods& mods) {
  std::vector<std::string> parts;
  if (!mods.alibi_slopes.empty()) parts.push_back("alibi");
  if (!mods.sinks.empty()) parts.push_back("sinks");
  if (mods.bias) parts.push_back(absl::StrCat("bias=", mods.bias->DebugString()));
  if (mods.mask) parts.push_back(absl::StrCat("mask=BOOL", ShapeString(mods.mask->shape)));
  if (mods.block_mask) {
    const BlockMaskData& b = *mods.block_mask;
    parts.push_back(absl::StrCat("block_mask=", b.block_q, "x", b.block_k, " rows ",
                                 b.row_ptr.empty() ? 0 : b.row_ptr.size() - 1, " kept ", b.kept()));
  }
  return absl::StrJoin(parts, " ");
}

absl::Status CheckScoreMods(const ScoreMods& mods, const InputsSummary& s,
                            const std::vector<int32_t>& cu_seqlens_q,
                            const std::vector<int32_t>& cu_seqlens_k) {
  if (absl::Status st = CheckHeadValues("alibi_slopes", mods.alibi_slopes, s.heads_q); !st.ok()) {
    return st;
  }
  if (absl::Status st = CheckHeadValues("sinks", mods.sinks, s.heads_q); !st.ok()) return st;
  const SeqLens lens = SeqLensOf(s, cu_seqlens_q, cu_seqlens_k);
  int64_t total_pairs = 0;
  for (int64_t b = 0; b < s.batch; ++b) total_pairs += lens.q[b] * lens.k[b];
  if (mods.bias) {
    const HostTensor& t = *mods.bias;
    if (t.dtype() != DType::kFP32 && t.dtype() != DType::kFP16 && t.dtype() != DType::kBF16) {
      return Invalid(
          absl::StrCat("bias: expected FP32, FP16 or BF16 elements, got ", t.DebugString()));
    }
    if (absl::Status st = CheckPairShape("bias", t.shape(), s, total_pairs); !st.ok()) return st;
    const std::vector<float> values = t.ToFloats();
    for (size_t i = 0; i < values.size(); ++i) {
      if (std::isnan(values[i]) || values[i] == INFINITY) {
        return Invalid(absl::StrCat("bias[flat ", i, "] = ", values[i],
                                    ": NaN and +inf are not allowed (-inf masks the key)"));
      }
    }
  }
  if (mods.mask) {
    if (absl::Status st = CheckPairShape("mask", mods.mask->shape, s, total_pairs); !st.ok()) {
      return st;
    }
    int64_t n = 1;
    for (int64_t d : mods.mask->shape) n *= d;
    if (static_cast<int64_t>(mods.mask->data.size()) != n) {
      return Invalid(absl::StrCat("mask.data: shape ", ShapeString(mods.mask->shape), " needs ", n,
                                  " bytes, got ", mods.mask->data.size()));
    }
  }
  if (mods.block_mask) return CheckBlockMask(*mods.block_mask, s, lens);
  return absl::OkStatus();
}

AttnMods AttnModsOf(const ScoreMods& mods, const InputsSummary& s) {
  AttnMods m;
  if (!mods.alibi_slopes.empty()) m.alibi_slopes = mods.alibi_slopes.data();
  if (!mods.sinks.empty()) m.sinks = mods.sinks.data();
  // Dense [B or 1, Hq or 1, ..]; varlen [Hq or 1, P] is always per sequence.
  auto per_batch = [&](const std::vector<int64_t>& shape) { return s.varlen || shape[0] != 1; };
  auto per_head = [&](const std::vector<int64_t>& shape) {
    return (s.varlen ? shape[0] : shape[1]) != 1;
  };
  if (mods.bias) {
    m.bias = mods.bias->data();
    m.bias_dtype = mods.bias->dtype();
    m.bias_per_batch = per_batch(mods.bias->shape());
    m.bias_per_head = per_head(mods.bias->shape());
  }
  if (mods.mask) {
    m.mask = mods.mask->data.data();
    m.mask_per_batch = per_batch(mods.mask->shape);
    m.mask_per_head = per_head(mods.mask->shape);
  }
  if (mods.block_mask) {
    const BlockMaskData& b = *mods.block_mask;
    m.block_q = b.block_q;
    m.block_k = b.block_k;
    m.block_row_ptr = b.row_ptr.data();
    m.block_col_idx = b.col_idx.data();
    m.block_per_batch = s.varlen || b.num_batch != 1;
    m.block_per_head = b.num_heads != 1;
  }
  return m;
}

std::vector<float> AlibiSlopes(int num_heads) {
  if (num_heads <= 0) return {};
  auto power_of_two = [](int n) {
    std::vector<float> s(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) s[i] = static_cast<float>(std::exp2(-8.0 * (i + 1) / n));
    return s;
  };
  int closest = 1;
  while (closest * 2 <= num_heads) closest *= 2;
  std::vector<float> slopes = power_of_two(closest);
  if (closest == num_heads) return slopes;
  const std::vector<float> extra = power_of_two(2 * closest);
  for (int i = 0; static_cast<int>(slopes.size()) < num_heads; i += 2) slopes.push_back(extra[i]);
  return slopes;
}

absl::StatusOr<BlockMaskData> MakeBlockMask(BlockPattern pattern, double density, int32_t block_q,
                                            int32_t block_k, const InputsSummary& s,
                                            const std::vector<int32_t>& cu_seqlens_q,
                                            const std::vector<int32_t>& cu_seqlens_k,
                                            std::mt19937_64* rng) {
  if (!(density >= 0.0 && density <= 1.0)) {
    return Invalid(absl::StrCat("block density must be in [0, 1], got ", density));
  }
  BlockMaskData m;
  m.block_q = block_q;
  m.block_k = block_k;
  m.num_batch = static_cast<int32_t>(s.batch);
  m.num_heads = static_cast<int32_t>(s.heads_q);
  for (const auto& [name, size] : {std::pair{"block_q", block_q}, {"block_k", block_k}}) {
    if (size <= 0 || size % kBlockMaskGrain != 0) {
      return Invalid(
          absl::StrCat(name, " must be a positive multiple of ", kBlockMaskGrain, ", got ", size));
    }
  }
  const SeqLens lens = SeqLensOf(s, cu_seqlens_q, cu_seqlens_k);
  m.row_ptr.push_back(0);
  auto add_rows = [&](int64_t b) {
    const int64_t sq = lens.q[b], sk = lens.k[b];
    const int64_t n = CeilDiv(sk, block_k);
    for (int64_t r = 0; r < CeilDiv(sq, block_q); ++r) {
      const int64_t last = std::min<int64_t>((r + 1) * block_q, sq) - 1;
      const int64_t diag = last + sk - sq;
      for (int32_t c : RowBlocks(pattern, density, n, diag < 0 ? 0 : diag / block_k, rng)) {
        m.col_idx.push_back(c);
      }
      m.row_ptr.push_back(static_cast<int32_t>(m.col_idx.size()));
    }
  };
  // Row order: dense [B, Hq, query blocks]; varlen [Hq, sequences' query blocks].
  if (s.varlen) {
    for (int64_t h = 0; h < s.heads_q; ++h) {
      for (int64_t b = 0; b < s.batch; ++b) add_rows(b);
    }
  } else {
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h = 0; h < s.heads_q; ++h) add_rows(b);
    }
  }
  return m;
}

}  // namespace attnserve
