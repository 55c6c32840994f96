// An FP8 K/V cache launch built from a varlen TestCase (FP16/BF16), shared by
// the CPU and CUDA paged tests: sequence b's context is its k/v rows; the last
// new_rows of them arrive as new rows (16-bit values the append quantises, or
// codes with their scales), the rest are quantised into shuffled pages over
// several slabs beforehand. Check() compares the launch's O and LSE with the
// float64 reference over the dequantised cache (tolerance.h's FP8 cache rule),
// O with the original 16-bit reference within the stated quantisation bound,
// and the pages' codes and scales with the contract's quantisation of every row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/kv_quantize.h"
#include "backend/paged_kv.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "common/dtype.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace testing_util {

class Fp8PagedCase {
 public:
  // `given_scales`: the new rows come as codes plus k/v_new_scale.
  Fp8PagedCase(const HostBuffers& buf, int page_size, int new_rows, bool given_scales, bool cow,
               uint32_t seed)
      : buf_(buf) {
    const AttnParams& a = buf.params();
    hkv_ = a.num_heads_kv;
    d_ = a.head_dim;
    const int64_t rows = a.total_k;
    // The contract's quantisation of every context row: what the pages must
    // hold after the launch, and the dequantised cache the reference reads.
    codes_k_.resize(size_t(rows * hkv_ * d_));
    codes_v_.resize(codes_k_.size());
    scales_k_.resize(size_t(rows * hkv_));
    scales_v_.resize(scales_k_.size());
    for (int64_t r = 0; r < rows * hkv_; ++r) {
      scales_k_[size_t(r)] = QuantiseFp8Row(a.k, a.dtype, r * d_, d_, &codes_k_[size_t(r * d_)]);
      scales_v_[size_t(r)] = QuantiseFp8Row(a.v, a.dtype, r * d_, d_, &codes_v_[size_t(r * d_)]);
    }
    std::mt19937 rng(seed);
    int page_shift = 0;
    while ((1 << page_shift) < page_size) ++page_shift;
    const int batch = a.batch;
    int stride = 1;
    int64_t pages_needed = 0;
    for (int b = 0; b < batch; ++b) {
      const int len = SeqLenK(a, b);
      stride = std::max(stride, (len + page_size - 1) / page_size);
      pages_needed += (len + page_size - 1) / page_size + 1;
    }
    int slab_shift = 0;
    while ((int64_t{kMaxKvSlabs} << slab_shift) < pages_needed + 8) ++slab_shift;
    const int64_t per_slab = int64_t{1} << slab_shift;
    const int num_slabs = static_cast<int>((pages_needed + 8 + per_slab - 1) / per_slab);
    KvPages& kv = params_.pages;
    kv = KvPages{};
    kv.num_slabs = num_slabs;
    kv.slab_shift = slab_shift;
    kv.page_size = page_size;
    kv.page_shift = page_shift;
    kv.fp8_e4m3 = true;
    const int64_t slab_bytes = per_slab * KvPageBytes(page_size, hkv_, d_, a.dtype, true);
    for (int s = 0; s < num_slabs; ++s) {
      // Poison: NaN codes and NaN scales.
      k_slabs_.emplace_back(size_t(slab_bytes), uint8_t{0xFF});
      v_slabs_.emplace_back(size_t(slab_bytes), uint8_t{0xFF});
      kv.k_slabs[s] = k_slabs_.back().data();
      kv.v_slabs[s] = v_slabs_.back().data();
    }
    std::vector<int32_t> free_pages(size_t(int64_t{num_slabs} * per_slab));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
    table_.assign(size_t(batch) * stride, -1);
    seqlens_.resize(size_t(batch));
    cu_new_.push_back(0);
    cu_q_.assign(a.cu_seqlens_q, a.cu_seqlens_q + batch + 1);
    const int64_t row_bytes = int64_t{hkv_} * d_ * DTypeSize(a.dtype);
    for (int b = 0; b < batch; ++b) {
      const int len = SeqLenK(a, b);
      const int added = std::min(new_rows, len);
      const int prefix = len - added;
      seqlens_[size_t(b)] = len;
      const int pages = (len + page_size - 1) / page_size;
      for (int i = 0; i < pages; ++i) {
        table_[size_t(b) * stride + i] = free_pages.back();
        free_pages.pop_back();
      }
      const int64_t k0 = SeqStartK(a, b);
      for (int r = 0; r < prefix; ++r)
        WriteRow(k0 + r, table_[size_t(b) * stride + r / page_size], r);
      if (cow && prefix % page_size != 0) {
        const int i = prefix / page_size;
        const int32_t shared = free_pages.back();
        free_pages.pop_back();
        for (int r = i * page_size; r < prefix; ++r) WriteRow(k0 + r, shared, r);
        copy_src_.push_back(shared);
        copy_dst_.push_back(table_[size_t(b) * stride + i]);
      }
      for (int r = prefix; r < len; ++r) {
        const int64_t row = k0 + r;
        if (given_scales) {
          const size_t c = size_t(row * hkv_ * d_);
          k_new_.insert(k_new_.end(), &codes_k_[c], &codes_k_[c] + hkv_ * d_);
          v_new_.insert(v_new_.end(), &codes_v_[c], &codes_v_[c] + hkv_ * d_);
          k_scale_new_.insert(k_scale_new_.end(), &scales_k_[size_t(row * hkv_)],
                              &scales_k_[size_t(row * hkv_)] + hkv_);
          v_scale_new_.insert(v_scale_new_.end(), &scales_v_[size_t(row * hkv_)],
                              &scales_v_[size_t(row * hkv_)] + hkv_);
        } else {
          const char* k = static_cast<const char*>(a.k) + row * row_bytes;
          const char* v = static_cast<const char*>(a.v) + row * row_bytes;
          k_new_.insert(k_new_.end(), k, k + row_bytes);
          v_new_.insert(v_new_.end(), v, v + row_bytes);
        }
      }
      cu_new_.push_back(cu_new_.back() + added);
    }
    // Never empty: data() of an empty vector may be null.
    k_new_.push_back(0);
    v_new_.push_back(0);
    k_scale_new_.push_back(1.0f);
    v_scale_new_.push_back(1.0f);
    o_.assign(size_t(buf.o_bytes()), 0xFF);
    lse_.assign(size_t(std::max<int64_t>(buf.lse_elements(), 1)), std::nanf(""));

    params_.attn = a;
    params_.attn.k = k_new_.data();
    params_.attn.v = v_new_.data();
    params_.attn.o = o_.data();
    params_.attn.lse = a.lse != nullptr ? lse_.data() : nullptr;
    params_.attn.cu_seqlens_q = cu_q_.data();
    params_.attn.cu_seqlens_k = cu_new_.data();
    params_.attn.total_k = cu_new_.back();
    params_.attn.seqlen_k = batch > 0 ? *std::max_element(seqlens_.begin(), seqlens_.end()) : 0;
    params_.block_table = table_.data();
    params_.block_table_stride = stride;
    params_.seqlens_k = seqlens_.data();
    params_.copy_src = copy_src_.data();
    params_.copy_dst = copy_dst_.data();
    params_.num_page_copies = static_cast<int32_t>(copy_src_.size());
    params_.k_new_scale = given_scales ? k_scale_new_.data() : nullptr;
    params_.v_new_scale = given_scales ? v_scale_new_.data() : nullptr;
  }

  const PagedAttnParams& params() const { return params_; }
  PagedAttnParams& mutable_params() { return params_; }
  std::vector<std::vector<uint8_t>>& k_slabs() { return k_slabs_; }
  std::vector<std::vector<uint8_t>>& v_slabs() { return v_slabs_; }
  // Bytes of the new rows as the launch reads them (codes or 16-bit values).
  int64_t new_bytes() const { return static_cast<int64_t>(k_new_.size()); }
  int64_t new_scale_count() const { return static_cast<int64_t>(k_scale_new_.size()); }

  // Empty when the pages (host copies: k_slabs(), v_slabs()) hold every
  // context row's codes and scales as the contract quantises them.
  std::string CheckPages() const {
    const AttnParams& a = buf_.params();
    const KvPages& kv = params_.pages;
    for (int b = 0; b < a.batch; ++b) {
      for (int r = 0; r < seqlens_[size_t(b)]; ++r) {
        const int32_t page = table_[size_t(b) * params_.block_table_stride + r / kv.page_size];
        const int t = r % kv.page_size;
        const int64_t row = SeqStartK(a, b) + r;
        for (int kvw = 0; kvw < 2; ++kvw) {
          const uint8_t* slab = (kvw ? v_slabs_ : k_slabs_)[size_t(PageSlab(kv, page))].data();
          const std::vector<uint8_t>& codes = kvw ? codes_v_ : codes_k_;
          const std::vector<float>& scales = kvw ? scales_v_ : scales_k_;
          for (int h = 0; h < hkv_; ++h) {
            float scale;
            std::memcpy(&scale, slab + PageScaleOffset(kv, page, t, hkv_, d_, h), 4);
            const uint8_t* c = slab + PageRowOffset(kv, page, t, hkv_, d_, h);
            const size_t at = size_t((row * hkv_ + h) * d_);
            if (scale != scales[size_t(row * hkv_ + h)] ||
                std::memcmp(c, &codes[at], size_t(d_)) != 0) {
              std::ostringstream os;
              os << (kvw ? "V" : "K") << " of sequence " << b << " token " << r << " head " << h
                 << ": page scale " << scale << " expected " << scales[size_t(row * hkv_ + h)]
                 << (std::memcmp(c, &codes[at], size_t(d_)) != 0 ? ", codes differ" : "");
              return os.str();
            }
          }
        }
      }
    }
    return "";
  }

  // Empty when O (OutputDType layout of the case) and LSE pass: the dtype's
  // rule against the float64 reference over the dequantised cache, and the
  // quantisation bound (tolerance::Fp8CacheBound) against the 16-bit one.
  std::string CheckOutput(const void* o, const float* lse) const {
    AttnParams cache = buf_.params();
    cache.k = codes_k_.data();
    cache.v = codes_v_.data();
    const KvRowScales scales{scales_k_.data(), scales_v_.data()};
    const ReferenceOutput ref = ReferenceAttention(cache, scales);
    const ReferenceOutput lowp = ReferenceAttentionLowPrecision(cache, scales);
    const ReferenceOutput& orig = buf_.Reference();
    const AttnParams& a = buf_.params();
    double lowp_err = 0.0, lse_lowp_err = 0.0;
    for (size_t i = 0; i < ref.o.size(); ++i)
      lowp_err = std::max(lowp_err, std::fabs(lowp.o[i] - ref.o[i]));
    for (size_t i = 0; i < ref.lse.size(); ++i) {
      if (std::isfinite(ref.lse[i]))
        lse_lowp_err = std::max(lse_lowp_err, std::fabs(lowp.lse[i] - ref.lse[i]));
    }
    const double tol = 2 * lowp_err + tolerance::OutputFloor(a.dtype);
    const double lse_tol = 2 * lse_lowp_err + tolerance::kLowpLseFloor;
    std::ostringstream err;
    for (int b = 0; b < a.batch; ++b) {
      const int sq = SeqLenQ(a, b);
      const int sk = SeqLenK(a, b);
      for (int h = 0; h < a.num_heads_q; ++h) {
        const int hk = KVHead(a, h);
        // The quantisation bound's inputs over the sequence's keys.
        double max_k = 0.0, max_v = 0.0;
        for (int j = 0; j < sk; ++j) {
          for (int c = 0; c < d_; ++c) {
            const int64_t at = KVOffset(a, SeqStartK(a, b) + j, hk) + c;
            max_k = std::max(max_k, std::fabs(double(LoadAsFloat(a.k, a.dtype, at))));
            max_v = std::max(max_v, std::fabs(double(LoadAsFloat(a.v, a.dtype, at))));
          }
        }
        for (int i = 0; i < sq; ++i) {
          const int64_t qo = QOffset(a, SeqStartQ(a, b) + i, h);
          double q_l1 = 0.0;
          for (int c = 0; c < d_; ++c) q_l1 += std::fabs(double(LoadAsFloat(a.q, a.dtype, qo + c)));
          const double delta = a.softmax_scale * tolerance::kFp8CodeRtol * q_l1 * max_k;
          const double bound = tolerance::Fp8CacheBound(delta, max_v) + tol;
          for (int c = 0; c < d_; ++c) {
            const double out = LoadAsFloat(o, a.dtype, qo + c);
            const double e = std::fabs(out - ref.o[size_t(qo + c)]);
            if (!(e <= tol)) {
              err << "O[b " << b << ", i " << i << ", h " << h << ", c " << c << "] = " << out
                  << ", dequantised-cache reference " << ref.o[size_t(qo + c)] << ", error " << e
                  << " > tolerance " << tol;
              return err.str();
            }
            const double eq = std::fabs(out - orig.o[size_t(qo + c)]);
            if (!(eq <= bound)) {
              err << "O[b " << b << ", i " << i << ", h " << h << ", c " << c << "] = " << out
                  << ", 16-bit reference " << orig.o[size_t(qo + c)] << ", error " << eq
                  << " > quantisation bound " << bound;
              return err.str();
            }
          }
          if (lse == nullptr) continue;
          const size_t li = size_t(LseOffset(a, b, h, i));
          const double want = ref.lse[li];
          const bool ok = std::isinf(want) ? lse[li] == want : std::fabs(lse[li] - want) <= lse_tol;
          if (!ok) {
            err << "LSE[b " << b << ", i " << i << ", h " << h << "] = " << lse[li]
                << ", reference " << want << ", tolerance " << lse_tol;
            return err.str();
          }
        }
      }
    }
    return "";
  }
  const void* o() const { return o_.data(); }
  const float* lse() const { return params_.attn.lse; }

 private:
  // Context row `row` (all kv heads) into token `pos` of `page`: codes and scales.
  void WriteRow(int64_t row, int32_t page, int pos) {
    const KvPages& kv = params_.pages;
    const int t = pos & (kv.page_size - 1);
    for (int kvw = 0; kvw < 2; ++kvw) {
      uint8_t* slab = (kvw ? v_slabs_ : k_slabs_)[size_t(PageSlab(kv, page))].data();
      const std::vector<uint8_t>& codes = kvw ? codes_v_ : codes_k_;
      const std::vector<float>& scales = kvw ? scales_v_ : scales_k_;
      for (int h = 0; h < hkv_; ++h) {
        std::memcpy(slab + PageRowOffset(kv, page, t, hkv_, d_, h),
                    &codes[size_t((row * hkv_ + h) * d_)], size_t(d_));
        std::memcpy(slab + PageScaleOffset(kv, page, t, hkv_, d_, h),
                    &scales[size_t(row * hkv_ + h)], 4);
      }
    }
  }

  const HostBuffers& buf_;
  int hkv_ = 0, d_ = 0;
  std::vector<uint8_t> codes_k_, codes_v_;
  std::vector<float> scales_k_, scales_v_;
  std::vector<std::vector<uint8_t>> k_slabs_, v_slabs_;
  std::vector<int32_t> table_, seqlens_, cu_new_, cu_q_, copy_src_, copy_dst_;
  std::vector<uint8_t> k_new_, v_new_, o_;
  std::vector<float> k_scale_new_, v_scale_new_, lse_;
  PagedAttnParams params_{};
};

// A case of the FP8 paged tests (CPU and CUDA): the call, its page size, how
// many of each sequence's rows arrive with the launch and how (given codes and
// scales, or 16-bit rows to quantise), and whether a partial page is copied
// on write first.
struct Fp8Case {
  TestCase tc;
  int page_size;
  int new_rows;
  bool given_scales;
  bool cow;
};

inline void PrintTo(const Fp8Case& c, std::ostream* os) {
  *os << c.tc.Name() << " page " << c.page_size << " new " << c.new_rows
      << (c.given_scales ? " given-scales" : " quantised") << (c.cow ? " cow" : "");
}

// The cases every backend runs: decode (GQA 4:1, one new token a sequence)
// with quantised and given rows, chunked prefill, windows and softcap at
// D 256, ALiBi and sinks, and a launch that appends nothing.
inline std::vector<Fp8Case> Fp8CaseGrid() {
  std::vector<Fp8Case> grid;
  TestCase decode;
  decode.dtype = DType::kBF16;
  decode.num_heads_q = 8;
  decode.num_heads_kv = 2;
  decode.head_dim = 128;
  decode.seqlens_q = {1, 1, 1, 1};
  decode.seqlens_k = {1, 97, 300, 17};
  decode.causal = true;
  grid.push_back({decode, 16, 1, false, true});
  grid.push_back({decode, 64, 1, true, true});
  TestCase prefill;  // chunked prefill over cache + new rows, FP16
  prefill.dtype = DType::kFP16;
  prefill.num_heads_q = 4;
  prefill.num_heads_kv = 1;
  prefill.seqlens_q = {33, 0, 64};
  prefill.seqlens_k = {150, 20, 64};
  prefill.causal = true;
  grid.push_back({prefill, 32, 33, false, true});
  grid.push_back({prefill, 128, 40, true, false});
  TestCase window = prefill;  // windows and softcap, BF16, D 256
  window.dtype = DType::kBF16;
  window.head_dim = 256;
  window.causal = false;
  window.window_left = 40;
  window.window_right = 3;
  window.softcap = 20.0f;
  grid.push_back({window, 256, 10, false, false});
  TestCase mods = decode;  // ALiBi and sinks over the cached keys
  mods.mods.alibi = true;
  mods.mods.sinks = true;
  grid.push_back({mods, 32, 1, false, true});
  TestCase attend_only = decode;  // nothing appended
  attend_only.return_lse = false;
  grid.push_back({attend_only, 16, 0, false, false});
  return grid;
}

}  // namespace testing_util
}  // namespace attnserve
