// The score modifiers' and masks' checks; see validate_mods.h.
#include "server/core/validate_mods.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/shape_string.h"
#include "common/status_macros.h"
#include "server/core/validate.h"

namespace attnserve {
namespace {

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// Hq finite values (ALiBi slopes, sink logits).
absl::Status CheckPerHead(const char* name, absl::Span<const float> values, int64_t num_heads_q) {
  if (static_cast<int64_t>(values.size()) != num_heads_q) {
    return Invalid(absl::StrCat(name, ": expected Hq = ", num_heads_q,
                                " values (one per query head), got ", values.size()));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return Invalid(absl::StrCat(name, "[", i, "]: expected finite, got ", values[i]));
    }
  }
  return absl::OkStatus();
}

// The shape of a bias or mask: dense [B or 1, Hq or 1, Sq, Sk], varlen
// [Hq or 1, P]; sets the broadcast flags it implies.
absl::Status CheckPairShape(const char* name, absl::Span<const int64_t> shape, const AttnParams& p,
                            bool* per_batch, bool* per_head) {
  if (IsVarlen(p)) {
    if (shape.size() != 2 || (shape[0] != p.num_heads_q && shape[0] != 1) ||
        shape[1] != p.total_pairs) {
      return Invalid(absl::StrCat(
          name, ".shape: expected [Hq or 1, P] = [", p.num_heads_q, " or 1, ", p.total_pairs,
          "] (varlen: P = sum of sq_b * sk_b over the sequences), got ", ShapeString(shape)));
    }
    *per_batch = true;
    *per_head = shape[0] == p.num_heads_q;
    return absl::OkStatus();
  }
  if (shape.size() != 4 || (shape[0] != p.batch && shape[0] != 1) ||
      (shape[1] != p.num_heads_q && shape[1] != 1) || shape[2] != p.seqlen_q ||
      shape[3] != p.seqlen_k) {
    return Invalid(absl::StrCat(name, ".shape: expected [B or 1, Hq or 1, Sq, Sk] = [", p.batch,
                                " or 1, ", p.num_heads_q, " or 1, ", p.seqlen_q, ", ", p.seqlen_k,
                                "], got ", ShapeString(shape)));
  }
  *per_batch = shape[0] == p.batch;
  *per_head = shape[1] == p.num_heads_q;
  return absl::OkStatus();
}

// Elements of a shape whose dims CheckPairShape compared with the call's
// (each at most 2^31, and B·Sq, Sk, Hq bounded alike: no overflow).
int64_t PairTensorElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// No NaN and no +inf among the bias's elements (-inf removes the key).
absl::Status CheckBiasValues(const char* name, const TensorView& t) {
  const DType dtype = static_cast<DType>(t.dtype);
  const char* data = t.bytes.data();
  const int64_t size = DTypeSize(dtype);
  const int64_t n = static_cast<int64_t>(t.bytes.size()) / size;
  for (int64_t i = 0; i < n; ++i) {
    // NaN (all-ones exponent, nonzero mantissa) or +inf, from the bits.
    bool bad;
    float value;
    if (dtype == DType::kFP32) {
      uint32_t bits;
      std::memcpy(&bits, data + i * 4, 4);
      bad = (bits & 0x7fffffffu) >= 0x7f800000u && bits != 0xff800000u;
      std::memcpy(&value, &bits, 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, data + i * 2, 2);
      const uint16_t inf = dtype == DType::kFP16 ? 0x7c00 : 0x7f80;
      bad = (bits & 0x7fff) >= inf && bits != (inf | 0x8000);
      value = dtype == DType::kFP16 ? Fp16ToFloat(bits) : Bf16ToFloat(bits);
    }
    if (bad) {
      return Invalid(absl::StrCat(name, ".data[", i,
                                  "]: expected a finite value or -inf (-inf removes the key), got ",
                                  value));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBias(const TensorView& t, const AttnParams& p, const FieldNames& n,
                       AttnMods* out) {
  const char* name = n.bias;
  const DType dtype = static_cast<DType>(t.dtype);
  if (dtype != DType::kFP32 && dtype != DType::kFP16 && dtype != DType::kBF16) {
    return Invalid(absl::StrCat(name, ".", n.dtype, ": expected FP32, FP16 or BF16, got ",
                                n.dtype_name(t.dtype)));
  }
  RETURN_IF_ERROR(CheckPairShape(name, t.shape, p, &out->bias_per_batch, &out->bias_per_head));
  RETURN_IF_ERROR(ValidateTensor(name, t, n));
  RETURN_IF_ERROR(CheckBiasValues(name, t));
  out->bias = t.bytes.data();
  out->bias_dtype = dtype;
  return absl::OkStatus();
}

absl::Status CheckMask(const TensorView& t, const AttnParams& p, const FieldNames& n,
                       AttnMods* out) {
  const char* name = n.mask;
  RETURN_IF_ERROR(CheckPairShape(name, t.shape, p, &out->mask_per_batch, &out->mask_per_head));
  const int64_t elements = PairTensorElements(t.shape);
  if (static_cast<int64_t>(t.bytes.size()) != elements) {
    return Invalid(absl::StrCat(name, ".data: expected ", elements, " bytes (",
                                ShapeString(t.shape), ", one byte per element), got ",
                                t.bytes.size(), " bytes"));
  }
  out->mask = reinterpret_cast<const uint8_t*>(t.bytes.data());
  return absl::OkStatus();
}

absl::Status CheckBlockSize(const char* name, int64_t size) {
  if (size <= 0 || size % kBlockMaskGrain != 0 || size > std::numeric_limits<int32_t>::max()) {
    return Invalid(absl::StrCat(name, ": expected a positive multiple of ", kBlockMaskGrain,
                                " (the kernels' query tile, and whole key tiles), got ", size));
  }
  return absl::OkStatus();
}

// Row pointers: rows + 1 entries from 0, non-decreasing, ending at the
// column count.
absl::Status CheckRowPtr(const BlockMaskView& m, int64_t rows, const FieldNames& n) {
  const auto& ptr = m.row_ptr;
  if (static_cast<int64_t>(ptr.size()) != rows + 1) {
    return Invalid(absl::StrCat(n.block_row_ptr, ": expected ", rows + 1,
                                " entries (rows + 1; rows = batches x heads x query blocks = ",
                                rows, "), got ", ptr.size()));
  }
  if (ptr[0] != 0) return Invalid(absl::StrCat(n.block_row_ptr, "[0]: expected 0, got ", ptr[0]));
  for (size_t r = 1; r < ptr.size(); ++r) {
    if (ptr[r] < ptr[r - 1]) {
      return Invalid(absl::StrCat(n.block_row_ptr, "[", r, "]: expected >= ", n.block_row_ptr, "[",
                                  r - 1, "] = ", ptr[r - 1], " (never decreasing), got ", ptr[r]));
    }
  }
  if (ptr.back() != static_cast<int64_t>(m.col_idx.size())) {
    return Invalid(absl::StrCat(n.block_row_ptr, "[", ptr.size() - 1, "]: expected ",
                                m.col_idx.size(), " (the length of ", n.block_col_idx, "), got ",
                                ptr.back()));
  }
  return absl::OkStatus();
}

// Row `row` (sequence b, head h, query block r) keeps strictly increasing key
// blocks below ceil(sk_b / block_k).
absl::Status CheckRowColumns(const BlockMaskView& m, int64_t row, int b, int h, int r,
                             int64_t key_blocks, const FieldNames& n) {
  for (int64_t e = m.row_ptr[row]; e < m.row_ptr[row + 1]; ++e) {
    const int32_t c = m.col_idx[e];
    if (c < 0 || c >= key_blocks) {
      return Invalid(absl::StrCat(n.block_col_idx, "[", e, "]: expected a key block in [0, ",
                                  key_blocks, ") (row ", row, ": sequence ", b, ", head ", h,
                                  ", query block ", r, "; ceil(sk / block_k) = ", key_blocks,
                                  "), got ", c));
    }
    if (e > m.row_ptr[row] && c <= m.col_idx[e - 1]) {
      return Invalid(absl::StrCat(n.block_col_idx, "[", e, "]: expected > ", n.block_col_idx, "[",
                                  e - 1, "] = ", m.col_idx[e - 1],
                                  " (key blocks strictly increase within a row; row ", row,
                                  "), got ", c));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBlockMask(const BlockMaskView& m, const AttnParams& p, const FieldNames& n,
                            AttnMods* out) {
  RETURN_IF_ERROR(CheckBlockSize(n.block_q, m.block_q));
  RETURN_IF_ERROR(CheckBlockSize(n.block_k, m.block_k));
  const bool varlen = IsVarlen(p);
  if (varlen ? m.num_batch != p.batch : (m.num_batch != p.batch && m.num_batch != 1)) {
    return Invalid(
        absl::StrCat(n.block_num_batch, ": expected ",
                     varlen ? absl::StrCat("B = ", p.batch, " (varlen: rows per sequence always)")
                            : absl::StrCat("1 or B = ", p.batch),
                     ", got ", m.num_batch));
  }
  if (m.num_heads != p.num_heads_q && m.num_heads != 1) {
    return Invalid(absl::StrCat(n.block_num_heads, ": expected 1 or Hq = ", p.num_heads_q, ", got ",
                                m.num_heads));
  }
  AttnParams q = p;
  q.block_q = static_cast<int32_t>(m.block_q);
  q.block_k = static_cast<int32_t>(m.block_k);
  q.block_per_batch = varlen || m.num_batch == p.batch;
  q.block_per_head = m.num_heads == p.num_heads_q;
  RETURN_IF_ERROR(CheckRowPtr(m, BlockMaskRows(q), n));

  // Rows in their layout order (params.h BlockRow), one pass.
  const int heads = q.block_per_head ? p.num_heads_q : 1;
  const int batches = q.block_per_batch ? p.batch : 1;
  int64_t row = 0;
  auto check_sequence = [&](int b, int h) -> absl::Status {
    const int64_t key_blocks = (int64_t{SeqLenK(q, b)} + q.block_k - 1) / q.block_k;
    for (int r = 0; r < BlockRowsOf(q, b); ++r, ++row) {
      RETURN_IF_ERROR(CheckRowColumns(m, row, b, h, r, key_blocks, n));
    }
    return absl::OkStatus();
  };
  // Only sequences with query blocks own rows: walking the others would cost
  // B x Hq steps that no byte of the request paid for.
  if (varlen) {
    std::vector<int> owners;
    for (int b = 0; b < batches; ++b) {
      if (BlockRowsOf(q, b) > 0) owners.push_back(b);
    }
    for (int h = 0; h < heads && !owners.empty(); ++h) {
      for (int b : owners) RETURN_IF_ERROR(check_sequence(b, h));
    }
  } else if (BlockRowsOf(q, 0) > 0) {
    for (int b = 0; b < batches; ++b) {
      for (int h = 0; h < heads; ++h) RETURN_IF_ERROR(check_sequence(b, h));
    }
  }
  out->block_q = q.block_q;
  out->block_k = q.block_k;
  out->block_row_ptr = m.row_ptr.data();
  out->block_col_idx = m.col_idx.data();
  out->block_per_batch = q.block_per_batch;
  out->block_per_head = q.block_per_head;
  return absl::OkStatus();
}

// A K/V step's bias or mask: [Hq or 1, P], P = the sum over the steps of
// num_queries x (expected_length + num_new_tokens): each sequence's query rows
// over its whole history after the append.
absl::Status CheckKvPairShape(const char* name, absl::Span<const int64_t> shape, int64_t heads,
                              int64_t pairs, bool* per_head) {
  if (shape.size() != 2 || (shape[0] != heads && shape[0] != 1) || shape[1] != pairs) {
    return Invalid(absl::StrCat(name, ".shape: expected [Hq or 1, P] = [", heads, " or 1, ", pairs,
                                "] (P = sum over the steps of num_queries * (expected_length + "
                                "num_new_tokens): each sequence's queries over its whole "
                                "history), got ",
                                ShapeString(shape)));
  }
  *per_head = shape[0] != 1;
  return absl::OkStatus();
}

// The bias and element mask of a K/V call (shapes, dtype, bytes, values);
// `heads` is KvCallHeadsQ.
absl::Status CheckKvElementMasks(const KvCall& c, int64_t heads, const FieldNames& n) {
  const ScoreModsView& mods = c.mods;
  const char* name = !mods.bias.absent ? n.bias : n.mask;
  if (!c.check_lengths) {
    return Invalid(absl::StrCat(
        name,
        ": needs each step's expected_length (its rows span the sequence's length after "
        "the append), which this call does not give"));
  }
  for (size_t i = 0; i < c.steps.size(); ++i) {
    if (c.steps[i].attend_pages.empty()) continue;
    // The compacted keys are not the history the rows are laid out over.
    return Invalid(absl::StrCat(name,
                                ": not supported together with attend_pages (its rows span the "
                                "whole history, which the left-out pages would shift); ",
                                n.step(static_cast<int>(i), "attend_pages"), " is set"));
  }
  int64_t pairs = 0;
  for (const KvStepRequest& s : c.steps) {
    pairs += int64_t{s.num_queries} * (int64_t{s.expected_length} + s.num_new_tokens);
  }
  bool per_head = false;
  if (!mods.bias.absent) {
    const TensorView& t = mods.bias;
    const DType dtype = static_cast<DType>(t.dtype);
    if (dtype != DType::kFP32 && dtype != DType::kFP16 && dtype != DType::kBF16) {
      return Invalid(absl::StrCat(n.bias, ".", n.dtype, ": expected FP32, FP16 or BF16, got ",
                                  n.dtype_name(t.dtype)));
    }
    RETURN_IF_ERROR(CheckKvPairShape(n.bias, t.shape, heads, pairs, &per_head));
    RETURN_IF_ERROR(ValidateTensor(n.bias, t, n));
    RETURN_IF_ERROR(CheckBiasValues(n.bias, t));
  }
  if (!mods.mask.absent) {
    const TensorView& t = mods.mask;
    RETURN_IF_ERROR(CheckKvPairShape(n.mask, t.shape, heads, pairs, &per_head));
    const int64_t elements = PairTensorElements(t.shape);
    if (static_cast<int64_t>(t.bytes.size()) != elements) {
      return Invalid(absl::StrCat(n.mask, ".data: expected ", elements, " bytes (",
                                  ShapeString(t.shape), ", one byte per element), got ",
                                  t.bytes.size(), " bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttnMods> ValidateScoreMods(const ScoreModsView& mods, const AttnParams& p,
                                           const FieldNames& n) {
  AttnMods out;
  if (mods.alibi_slopes.has_value()) {
    RETURN_IF_ERROR(CheckPerHead(n.alibi_slopes, *mods.alibi_slopes, p.num_heads_q));
    out.alibi_slopes = mods.alibi_slopes->data();
  }
  if (mods.sinks.has_value()) {
    RETURN_IF_ERROR(CheckPerHead(n.sinks, *mods.sinks, p.num_heads_q));
    out.sinks = mods.sinks->data();
  }
  if (!mods.bias.absent) RETURN_IF_ERROR(CheckBias(mods.bias, p, n, &out));
  if (!mods.mask.absent) RETURN_IF_ERROR(CheckMask(mods.mask, p, n, &out));
  if (mods.block_mask.present) RETURN_IF_ERROR(CheckBlockMask(mods.block_mask, p, n, &out));
  return out;
}

int64_t KvCallHeadsQ(const KvCall& c, int64_t num_heads_kv) {
  if (c.q.shape.size() == 3) return c.q.shape[1];
  if (c.mods.alibi_slopes.has_value()) return static_cast<int64_t>(c.mods.alibi_slopes->size());
  if (c.mods.sinks.has_value()) return static_cast<int64_t>(c.mods.sinks->size());
  return num_heads_kv;
}

absl::Status ValidateKvScoreMods(const KvCall& c, int64_t num_heads_kv, const FieldNames& n) {
  const ScoreModsView& mods = c.mods;
  if (mods.block_mask.present) {
    // Laid out over a call's own key blocks: attend_pages is the K/V path's
    // sparsity. The whole block mask, not its block_q ("options.block_mask").
    std::string name(n.block_q);
    const size_t dot = name.rfind('.');
    if (dot != std::string::npos && name.compare(dot, std::string::npos, ".block_q") == 0) {
      name.resize(dot);
    }
    return Invalid(absl::StrCat(
        name, ": not supported on K/V calls; use attend_pages for page-level sparsity"));
  }
  const int64_t heads = KvCallHeadsQ(c, num_heads_kv);
  if (c.q.shape.size() != 3 && (heads <= 0 || heads % num_heads_kv != 0)) {
    // No q to take Hq from: the lists say it, and it must be one a q could have.
    const char* name = mods.alibi_slopes.has_value() ? n.alibi_slopes : n.sinks;
    return Invalid(absl::StrCat(name, ": expected Hq values, Hq a positive multiple of Hkv = ",
                                num_heads_kv, " (the call has no q to take Hq from), got ", heads));
  }
  if (mods.alibi_slopes.has_value()) {
    RETURN_IF_ERROR(CheckPerHead(n.alibi_slopes, *mods.alibi_slopes, heads));
    for (size_t i = 0; i < c.steps.size(); ++i) {
      if (c.steps[i].attend_pages.empty()) continue;
      // The compacted keys' positions are not the sequence's: ALiBi's
      // distances would be wrong (sinks count no positions and may stay).
      return Invalid(
          absl::StrCat(n.alibi_slopes,
                       ": not supported together with attend_pages (ALiBi's distances count "
                       "positions in the whole sequence, which the left-out pages would shift); ",
                       n.step(static_cast<int>(i), "attend_pages"), " is set"));
    }
  }
  if (mods.sinks.has_value()) RETURN_IF_ERROR(CheckPerHead(n.sinks, *mods.sinks, heads));
  if (!mods.bias.absent || !mods.mask.absent) RETURN_IF_ERROR(CheckKvElementMasks(c, heads, n));
  return absl::OkStatus();
}

void SetKvElementMasks(const KvCall& c, AttnMods* mods) {
  // Varlen rows: per sequence always; per head unless the first dim is 1.
  if (!c.mods.bias.absent) {
    mods->bias = c.mods.bias.bytes.data();
    mods->bias_dtype = static_cast<DType>(c.mods.bias.dtype);
    mods->bias_per_batch = true;
    mods->bias_per_head = c.mods.bias.shape[0] != 1;
  }
  if (!c.mods.mask.absent) {
    mods->mask = reinterpret_cast<const uint8_t*>(c.mods.mask.bytes.data());
    mods->mask_per_batch = true;
    mods->mask_per_head = c.mods.mask.shape[0] != 1;
  }
}

}  // namespace attnserve
