// A paged launch with a value head dim (paged_kv.h) built from a varlen
// TestCase, shared by the CPU and CUDA MLA paged tests: V pages of Dv != D,
// or the absorbed form's V inside K (pages.v_in_k: K pages alone). Each
// sequence's last new_rows K/V rows arrive with the launch (the append writes
// them), the rest are written beforehand into shuffled pages over several
// host slabs (the CUDA tests copy them to the device, device_slabs.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "backend/paged_kv.h"
#include "common/dtype.h"
#include "tests/common/attn_test_util.h"

namespace attnserve {
namespace testing_util {

class MlaPagedCase {
 public:
  // With `v_in_k`, buf's V is first made the first Dv elements of its K (what
  // the cache will read), and no V pages or V rows exist. `cow`: a sequence's
  // partial last page of old rows lies in a page outside its table (a shared
  // one), which the launch copies (copy-on-write) to the table's, left
  // poisoned, before the append.
  MlaPagedCase(HostBuffers& buf, int page_size, int new_rows, bool v_in_k, uint32_t seed,
               bool cow = false) {
    const AttnParams& a = buf.params();
    const int d = a.head_dim;
    const int dv = HeadDimV(a);
    const int64_t elem = DTypeSize(a.dtype);
    const int64_t k_row = int64_t{a.num_heads_kv} * d * elem;
    const int64_t v_row = int64_t{a.num_heads_kv} * dv * elem;
    if (v_in_k) {
      for (int64_t r = 0; r < a.total_k * a.num_heads_kv; ++r) {
        std::memcpy(static_cast<char*>(buf.v()) + r * dv * elem,
                    static_cast<const char*>(buf.k()) + r * d * elem, size_t(dv * elem));
      }
    }
    int page_shift = 0;
    while ((1 << page_shift) < page_size) ++page_shift;
    const int batch = a.batch;
    int stride = 1;
    int64_t pages_needed = 0;
    for (int b = 0; b < batch; ++b) {
      const int pages = (SeqLenK(a, b) + page_size - 1) / page_size;
      stride = std::max(stride, pages);
      pages_needed += pages;
    }
    // Slabs of 2^slab_shift pages (4 where they fit), so a sequence spans
    // several slabs, and one slab of spare pages.
    int slab_shift = 2;
    while ((pages_needed + (int64_t{1} << slab_shift) - 1) / (int64_t{1} << slab_shift) + 1 >
           kMaxKvSlabs) {
      ++slab_shift;
    }
    const int per_slab = 1 << slab_shift;
    const int num_slabs = static_cast<int>((pages_needed + per_slab - 1) / per_slab) + 1;
    KvPages& kv = params_.pages;
    kv = KvPages{};
    kv.num_slabs = num_slabs;
    kv.slab_shift = slab_shift;
    kv.page_size = page_size;
    kv.page_shift = page_shift;
    kv.v_in_k = v_in_k;
    for (int s = 0; s < num_slabs; ++s) {
      // Poisoned: NaN in every dtype, so a read of an unwritten row shows.
      k_slabs_.emplace_back(size_t(per_slab * page_size * k_row), uint8_t{0xFF});
      kv.k_slabs[s] = k_slabs_.back().data();
      if (!v_in_k) {
        v_slabs_.emplace_back(size_t(per_slab * page_size * v_row), uint8_t{0xFF});
        kv.v_slabs[s] = v_slabs_.back().data();
      }
    }
    std::mt19937 rng(seed);
    std::vector<int32_t> free_pages(size_t(num_slabs) * per_slab);
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
    table_.assign(size_t(batch) * stride, -1);
    cu_new_.push_back(0);
    const char* k = static_cast<const char*>(a.k);
    const char* v = static_cast<const char*>(a.v);
    for (int b = 0; b < batch; ++b) {
      const int len = SeqLenK(a, b);
      const int added = std::min(new_rows, len);
      seqlens_.push_back(len);
      for (int i = 0; i < (len + page_size - 1) / page_size; ++i) {
        table_[size_t(b) * stride + i] = free_pages.back();
        free_pages.pop_back();
      }
      const int64_t k0 = SeqStartK(a, b);
      const int old_rows = len - added;
      int32_t shared = -1;
      if (cow && old_rows % page_size != 0) {
        shared = free_pages.back();
        free_pages.pop_back();
        copy_src_.push_back(shared);
        copy_dst_.push_back(table_[size_t(b) * stride + old_rows / page_size]);
      }
      for (int r = 0; r < old_rows; ++r) {
        const int32_t page = shared >= 0 && r / page_size == old_rows / page_size
                                 ? shared
                                 : table_[size_t(b) * stride + r / page_size];
        const int t = r % page_size;
        const int64_t slab = PageSlab(kv, page);
        std::memcpy(k_slabs_[slab].data() + PageRowOffset(kv, page, t, a.num_heads_kv, d, 0) * elem,
                    k + (k0 + r) * k_row, size_t(k_row));
        if (!v_in_k) {
          std::memcpy(
              v_slabs_[slab].data() + PageRowOffset(kv, page, t, a.num_heads_kv, dv, 0) * elem,
              v + (k0 + r) * v_row, size_t(v_row));
        }
      }
      const int64_t first = k0 + old_rows;
      k_new_.insert(k_new_.end(), k + first * k_row, k + (first + added) * k_row);
      if (!v_in_k) v_new_.insert(v_new_.end(), v + first * v_row, v + (first + added) * v_row);
      cu_new_.push_back(cu_new_.back() + added);
    }
    o_.assign(size_t(buf.o_bytes()), 0xFF);
    lse_.assign(size_t(std::max<int64_t>(buf.lse_elements(), 1)), std::nanf(""));
    params_.attn = a;
    params_.attn.k = k_new_.data();
    params_.attn.v = v_in_k ? nullptr : v_new_.data();  // unused with v_in_k
    params_.attn.o = o_.data();
    params_.attn.lse = a.lse != nullptr ? lse_.data() : nullptr;
    params_.attn.cu_seqlens_k = cu_new_.data();
    params_.attn.total_k = cu_new_.back();
    params_.attn.seqlen_k = batch > 0 ? *std::max_element(seqlens_.begin(), seqlens_.end()) : 0;
    params_.block_table = table_.data();
    params_.block_table_stride = stride;
    params_.seqlens_k = seqlens_.data();
    params_.copy_src = copy_src_.data();
    params_.copy_dst = copy_dst_.data();
    params_.num_page_copies = static_cast<int32_t>(copy_src_.size());
    params_.k_new_scale = nullptr;
    params_.v_new_scale = nullptr;
  }
  MlaPagedCase(const MlaPagedCase&) = delete;
  MlaPagedCase& operator=(const MlaPagedCase&) = delete;

  const PagedAttnParams& params() const { return params_; }
  PagedAttnParams& mutable_params() { return params_; }
  const void* o() const { return o_.data(); }
  const float* lse() const { return params_.attn.lse; }
  // The host slabs params().pages points at (V's empty with v_in_k).
  std::vector<std::vector<uint8_t>>& k_slabs() { return k_slabs_; }
  std::vector<std::vector<uint8_t>>& v_slabs() { return v_slabs_; }
  // O and LSE poisoned again, for a second launch into them.
  void Poison() {
    std::fill(o_.begin(), o_.end(), uint8_t{0xFF});
    std::fill(lse_.begin(), lse_.end(), std::nanf(""));
  }

 private:
  PagedAttnParams params_{};
  std::vector<std::vector<uint8_t>> k_slabs_, v_slabs_;
  std::vector<int32_t> table_, seqlens_, cu_new_, copy_src_, copy_dst_;
  std::vector<uint8_t> k_new_, v_new_, o_;
  std::vector<float> lse_;
};

}  // namespace testing_util
}  // namespace attnserve
