// The launches of a call on a cache that spans devices; see span_launch.h.
#include "server/kv/span_launch.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "backend/make_params.h"
#include "common/dtype.h"
#include "common/lse_merge.h"
#include "server/kv/kv_pool.h"

namespace attnserve {
namespace {

// A launch's buffers are never empty, so their pointers are never null.
template <typename T>
void SizeAtLeastOne(std::vector<T>* v, size_t n) {
  v->assign(std::max<size_t>(n, 1), T{});
}

// out[d] += w * element (at + d) of `data`, a buffer of `dtype` values.
void AddScaledRow(const char* data, DType dtype, int64_t at, int64_t dim, float w, float* out) {
  switch (dtype) {
    case DType::kBF16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(data) + at;
      for (int64_t d = 0; d < dim; ++d) out[d] += w * Bf16ToFloat(p[d]);
      return;
    }
    case DType::kFP16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(data) + at;
      for (int64_t d = 0; d < dim; ++d) out[d] += w * Fp16ToFloat(p[d]);
      return;
    }
    case DType::kFP32: {
      const float* p = reinterpret_cast<const float*>(data) + at;
      for (int64_t d = 0; d < dim; ++d) out[d] += w * p[d];
      return;
    }
    default:
      for (int64_t d = 0; d < dim; ++d) out[d] += w * LoadAsFloat(data, dtype, at + d);
  }
}

// Elements [at, at + dim) of `data` (a buffer of `dtype` values) = row, rounded.
void StoreRow(const float* row, int64_t dim, DType dtype, int64_t at, char* data) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t* p = reinterpret_cast<uint16_t*>(data) + at;
      for (int64_t d = 0; d < dim; ++d) p[d] = FloatToBf16(row[d]);
      return;
    }
    case DType::kFP32: std::memcpy(data + at * 4, row, size_t(dim) * 4); return;
    default:
      for (int64_t d = 0; d < dim; ++d) StoreFromFloat(data, dtype, at + d, row[d]);
  }
}

}  // namespace

absl::Status CheckSpanningCall(const KvAppendAttend& c) {
  const FieldNames& names = *c.names;
  if (c.options.window_left.has_value() || c.options.window_right.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        names.option(c.options.window_left.has_value() ? "window_left" : "window_right"),
        ": expected unset on cache '", c.cache_id,
        "', which spans devices (a window is a key position in the whole sequence, which no "
        "one device's launch sees), got ",
        c.options.window_left.value_or(c.options.window_right.value_or(0))));
  }
  if (c.inputs.mods.alibi_slopes != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(names.alibi_slopes, ": expected unset on cache '", c.cache_id,
                     "', which spans devices (ALiBi's bias is a key's distance in the whole "
                     "sequence, which no one device's launch sees), got ",
                     c.num_heads_q, " slopes"));
  }
  if (c.inputs.mods.bias != nullptr || c.inputs.mods.mask != nullptr) {
    // Each launch sees one segment's keys; the rows span the whole history.
    return absl::UnimplementedError(
        absl::StrCat(c.inputs.mods.bias != nullptr ? names.bias : names.mask,
                     ": expected unset on cache '", c.cache_id,
                     "', which spans devices (its rows span each sequence's whole history, which "
                     "no one device's launch sees)"));
  }
  const TensorDevices& at = c.inputs.devices;
  if (at.q != kHostMemory || at.k != kHostMemory || at.v != kHostMemory) {
    return absl::UnimplementedError(absl::StrCat(
        "q, k, v: cache '", c.cache_id,
        "' spans devices and gathers each device's rows in host memory: send them in the "
        "message or a system shared-memory region, not a CUDA region"));
  }
  return absl::OkStatus();
}

absl::Status BuildSpanGroups(const KvAppendAttend& c, std::vector<KvSpanGroup>* groups) {
  const KvReservation& r = c.reservation;
  const FieldNames& names = *c.names;
  // Causal: each step's queries are its last rows; the earlier segments are
  // wholly visible to them only when they all lie in the last segment.
  if (c.options.causal) {
    std::vector<int32_t> parts_of(c.steps.size(), 0);
    for (const KvSpanPart& p : r.parts) ++parts_of[size_t(p.step)];
    for (const KvSpanPart& p : r.parts) {
      const KvStep& st = c.steps[size_t(p.step)];
      if (p.last && parts_of[size_t(p.step)] > 1 && st.num_queries > p.tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            names.step(p.step, "num_queries"), ": with causal on cache '", c.cache_id,
            "', which spans devices, expected at most ", p.tokens, " (the tokens of sequence ",
            st.sequence_id,
            "'s last segment, on one device: a query row's causal limit must fall there), got ",
            st.num_queries, "; nothing was appended"));
      }
    }
  }
  const int64_t q_row = int64_t{c.num_heads_q} * c.head_dim * DTypeSize(c.dtype);
  const bool given_codes = c.k_scale != nullptr;
  const int64_t kv_row =
      int64_t{c.num_heads_kv} * c.head_dim * (given_codes ? 1 : DTypeSize(c.dtype));
  const int64_t o_row = int64_t{c.num_heads_q} * c.head_dim * DTypeSize(c.dtype);
  groups->clear();
  const int n_shards = static_cast<int>(r.shard_pages.size());
  // The steps' last segments first: they also append, so their launches
  // start first (SubmitSpanning submits in this order).
  for (bool last : {true, false}) {
    for (int shard = 0; shard < n_shards; ++shard) {
      KvSpanGroup g;
      g.shard = shard;
      g.last = last;
      for (size_t i = 0; i < r.parts.size(); ++i) {
        if (r.parts[i].shard == shard && r.parts[i].last == last) {
          g.parts.push_back(static_cast<int32_t>(i));
        }
      }
      if (g.parts.empty()) continue;
      groups->push_back(std::move(g));
    }
  }
  for (KvSpanGroup& g : *groups) {
    const size_t n = g.parts.size();
    g.cu_q.assign(1, 0);
    g.cu_k.assign(1, 0);
    int32_t stride = 1;
    for (int32_t i : g.parts) {
      const KvSpanPart& p = r.parts[size_t(i)];
      g.q_offset.push_back(g.cu_q.back());
      g.cu_q.push_back(g.cu_q.back() + c.steps[size_t(p.step)].num_queries);
      g.cu_k.push_back(g.cu_k.back() + p.new_tokens);
      stride = std::max(stride, static_cast<int32_t>(p.pages.size()));
      g.seqlens.push_back(p.tokens);
      if (p.copy_src >= 0) {
        g.copy_src.push_back(p.copy_src);
        g.copy_dst.push_back(p.copy_dst);
      }
    }
    const int64_t total_q = g.cu_q.back(), total_k = g.cu_k.back();
    SizeAtLeastOne(&g.q, size_t(total_q * q_row));
    SizeAtLeastOne(&g.k, size_t(total_k * kv_row));
    SizeAtLeastOne(&g.v, size_t(total_k * kv_row));
    SizeAtLeastOne(&g.o, size_t(total_q * o_row));
    SizeAtLeastOne(&g.lse, size_t(total_q * c.num_heads_q));
    if (given_codes) {
      SizeAtLeastOne(&g.k_scale, size_t(total_k * c.num_heads_kv));
      SizeAtLeastOne(&g.v_scale, size_t(total_k * c.num_heads_kv));
    }
    g.block_table.assign(n * size_t(stride), 0);
    for (size_t e = 0; e < n; ++e) {
      const KvSpanPart& p = r.parts[size_t(g.parts[e])];
      std::copy(p.pages.begin(), p.pages.end(), g.block_table.begin() + e * size_t(stride));
      const int32_t step = p.step;
      const int32_t nq = c.steps[size_t(step)].num_queries;
      if (nq > 0) {
        std::memcpy(g.q.data() + g.cu_q[e] * q_row,
                    static_cast<const char*>(c.inputs.q) + c.cu_q[size_t(step)] * q_row,
                    size_t(nq * q_row));
      }
      if (p.new_tokens > 0) {
        const int64_t from = c.cu_k[size_t(step)], to = g.cu_k[e];
        std::memcpy(g.k.data() + to * kv_row, static_cast<const char*>(c.inputs.k) + from * kv_row,
                    size_t(p.new_tokens * kv_row));
        std::memcpy(g.v.data() + to * kv_row, static_cast<const char*>(c.inputs.v) + from * kv_row,
                    size_t(p.new_tokens * kv_row));
        if (given_codes) {
          const int64_t h = c.num_heads_kv;
          std::copy(c.k_scale + from * h, c.k_scale + (from + p.new_tokens) * h,
                    g.k_scale.begin() + to * h);
          std::copy(c.v_scale + from * h, c.v_scale + (from + p.new_tokens) * h,
                    g.v_scale.begin() + to * h);
        }
      }
    }
    AttnOptions options = c.options;
    AttnPointers io;
    io.q = g.q.data();
    io.k = g.k.data();
    io.v = g.v.data();
    io.o = g.o.data();
    io.lse = g.lse.data();
    if (!g.last) {
      options.causal = false;  // every key before the last segment is visible
    } else {
      io.mods.sinks = c.inputs.mods.sinks;  // the sinks join one partial only
    }
    PagedAttnParams& p = g.params;
    p.attn =
        MakeAttnParams(PagedShape(c.dtype, static_cast<int32_t>(n), c.num_heads_q, c.num_heads_kv,
                                  c.head_dim, g.cu_q.data(), g.cu_k.data(), g.seqlens.data()),
                       options, io);
    p.pages = r.shard_pages[size_t(g.shard)];
    p.block_table = g.block_table.data();
    p.block_table_stride = stride;
    p.seqlens_k = g.seqlens.data();
    p.copy_src = g.copy_src.data();
    p.copy_dst = g.copy_dst.data();
    p.num_page_copies = static_cast<int32_t>(g.copy_src.size());
    p.k_new_scale = given_codes ? g.k_scale.data() : nullptr;
    p.v_new_scale = given_codes ? g.v_scale.data() : nullptr;
  }
  return absl::OkStatus();
}

void MergeSpanGroups(KvAppendAttend& c, const std::vector<KvSpanGroup>& groups) {
  const KvReservation& r = c.reservation;
  // Each step's partials: (group, first row of the step's queries there).
  std::vector<std::vector<std::pair<const KvSpanGroup*, int32_t>>> of_step(c.steps.size());
  for (const KvSpanGroup& g : groups) {
    for (size_t e = 0; e < g.parts.size(); ++e) {
      of_step[size_t(r.parts[size_t(g.parts[e])].step)].push_back({&g, g.q_offset[e]});
    }
  }
  const int64_t hq = c.num_heads_q, dim = c.head_dim;
  const int64_t total_q = c.cu_q.back();
  char* o = c.o_out != nullptr ? c.o_out : c.o.data();
  float* lse = c.return_lse ? reinterpret_cast<float*>(c.lse.data()) : nullptr;
  std::vector<float> row(static_cast<size_t>(dim));
  std::vector<float> lses, weights;
  for (size_t i = 0; i < c.steps.size(); ++i) {
    const auto& partials = of_step[i];
    const int n = static_cast<int>(partials.size());
    lses.resize(size_t(n));
    weights.resize(size_t(n));
    for (int32_t q = 0; q < c.steps[i].num_queries; ++q) {
      const int64_t out_row = c.cu_q[i] + q;
      for (int64_t h = 0; h < hq; ++h) {
        for (int k = 0; k < n; ++k) {
          const KvSpanGroup& g = *partials[size_t(k)].first;
          lses[size_t(k)] = g.lse[size_t(h * g.cu_q.back() + partials[size_t(k)].second + q)];
        }
        // MergeLseRow's arithmetic, each partial's row read in one typed loop.
        const float merged = LseMergeWeights(n, lses.data(), weights.data());
        std::fill(row.begin(), row.end(), 0.0f);
        for (int k = 0; k < n; ++k) {
          if (weights[size_t(k)] == 0.0f) continue;  // its O holds nothing of this row
          const KvSpanGroup& g = *partials[size_t(k)].first;
          const int64_t at = ((partials[size_t(k)].second + q) * hq + h) * dim;
          AddScaledRow(g.o.data(), c.dtype, at, dim, weights[size_t(k)], row.data());
        }
        StoreRow(row.data(), dim, c.dtype, (out_row * hq + h) * dim, o);
        if (lse != nullptr) lse[h * total_q + out_row] = merged;
      }
    }
  }
}

}  // namespace attnserve
