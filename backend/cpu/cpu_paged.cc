// CpuBackend's paged K/V path (paged_kv.h, DESIGN §6): pages live in host
// memory; one launch copies pages (copy-on-write), appends the new K/V rows
// through the block tables and attends with the same tiled online-softmax
// kernel as Forward, reading K/V in place through the block table. FP8 caches:
// the append quantises 16-bit rows (or copies given codes and scales) and the
// kernel reads codes times their row's scale. A bias or element mask has, per
// sequence, rows over its whole history (CheckPagedParams).
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backend/check_paged_params.h"
#include "backend/cpu/cpu_attention_kernel.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/kv_quantize.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

// Bytes of one element in the pages: a code of an FP8 cache, else attn.dtype.
int64_t ElemBytes(const PagedAttnParams& p) {
  return p.pages.fp8_e4m3 ? 1 : DTypeSize(p.attn.dtype);
}

// `d` below is the row width of the slabs at hand: D for K's, Dv for V's.

// Bytes of one page's K (or V) codes or elements: page_size rows of [Hkv, d].
int64_t PageBytes(const PagedAttnParams& p, int d) {
  return int64_t{p.pages.page_size} * p.attn.num_heads_kv * d * ElemBytes(p);
}

char* PageAddress(void* const* slabs, const PagedAttnParams& p, int d, int32_t page) {
  return static_cast<char*>(slabs[PageSlab(p.pages, page)]) +
         PageRowOffset(p.pages, page, 0, p.attn.num_heads_kv, d, 0) * ElemBytes(p);
}

// FP8 caches: the address of the scale of (token t of page, kv head h).
float* ScaleAddress(void* const* slabs, const PagedAttnParams& p, int d, int32_t page, int t,
                    int h) {
  return reinterpret_cast<float*>(static_cast<char*>(slabs[PageSlab(p.pages, page)]) +
                                  PageScaleOffset(p.pages, page, t, p.attn.num_heads_kv, d, h));
}

// One new row (all kv heads) of K or V into its page: a copy, or for an FP8
// cache codes and scales (given, or quantised from attn.dtype here).
void AppendRow(const PagedAttnParams& p, void* const* slabs, int d, const void* src,
               const float* scales, int64_t r, int32_t page, int t) {
  const int hkv = p.attn.num_heads_kv;
  char* dst = static_cast<char*>(slabs[PageSlab(p.pages, page)]) +
              PageRowOffset(p.pages, page, t, hkv, d, 0) * ElemBytes(p);
  if (!p.pages.fp8_e4m3) {
    const int64_t row_bytes = int64_t{hkv} * d * ElemBytes(p);
    std::memcpy(dst, static_cast<const char*>(src) + r * row_bytes, size_t(row_bytes));
    return;
  }
  uint8_t* codes = reinterpret_cast<uint8_t*>(dst);
  for (int h = 0; h < hkv; ++h) {
    float scale;
    if (scales != nullptr) {
      std::memcpy(codes + int64_t{h} * d,
                  static_cast<const uint8_t*>(src) + (r * hkv + h) * int64_t{d}, size_t(d));
      scale = scales[r * hkv + h];
    } else {
      scale =
          QuantiseFp8Row(src, p.attn.dtype, (r * hkv + h) * int64_t{d}, d, codes + int64_t{h} * d);
    }
    *ScaleAddress(slabs, p, d, page, t, h) = scale;
  }
}

// Steps 1 and 2 of paged_kv.h: page copies, then the new rows into their pages.
void CopyAndAppend(const PagedAttnParams& p) {
  const int64_t scale_bytes = int64_t{p.pages.page_size} * p.attn.num_heads_kv * 4;
  const int dk = p.attn.head_dim;
  const int dv = HeadDimV(p.attn);
  // V in K's pages (v_in_k): K's slabs alone hold the rows.
  const int kinds = p.pages.v_in_k ? 1 : 2;
  void* const* slabs_of[2] = {p.pages.k_slabs, p.pages.v_slabs};
  const int dim_of[2] = {dk, dv};
  for (int i = 0; i < p.num_page_copies; ++i) {
    for (int x = 0; x < kinds; ++x) {
      void* const* slabs = slabs_of[x];
      const int d = dim_of[x];
      std::memcpy(PageAddress(slabs, p, d, p.copy_dst[i]), PageAddress(slabs, p, d, p.copy_src[i]),
                  size_t(PageBytes(p, d)));
      if (p.pages.fp8_e4m3) {  // a page's scales are contiguous (all heads)
        std::memcpy(ScaleAddress(slabs, p, d, p.copy_dst[i], 0, 0),
                    ScaleAddress(slabs, p, d, p.copy_src[i], 0, 0), size_t(scale_bytes));
      }
    }
  }
  for (int b = 0; b < p.attn.batch; ++b) {
    const int32_t added = SeqLenK(p.attn, b);
    const int32_t first = p.seqlens_k[b] - added;
    const int32_t* table = p.block_table + int64_t{b} * p.block_table_stride;
    for (int32_t r = 0; r < added; ++r) {
      const int32_t pos = first + r;
      const int32_t page = table[pos >> p.pages.page_shift];
      const int t = pos & (p.pages.page_size - 1);
      const int64_t row = SeqStartK(p.attn, b) + r;
      AppendRow(p, p.pages.k_slabs, dk, p.attn.k, p.k_new_scale, row, page, t);
      if (!p.pages.v_in_k) AppendRow(p, p.pages.v_slabs, dv, p.attn.v, p.v_new_scale, row, page, t);
    }
  }
}

}  // namespace

absl::StatusOr<void*> CpuBackend::AllocateKvMemory(int64_t bytes) {
  // 64-byte alignment: whole cache lines per page, AVX loads never split one.
  const size_t size = (static_cast<size_t>(bytes) + 63) / 64 * 64;
  void* memory = bytes > 0 ? std::aligned_alloc(64, size) : nullptr;
  if (memory == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu backend: cannot allocate ", bytes,
                                                     " bytes of host memory for K/V pages"));
  }
  return memory;
}

void CpuBackend::FreeKvMemory(void* memory) { std::free(memory); }

std::shared_ptr<char> CpuBackend::AllocateHostTensor(int64_t bytes) {
  std::shared_ptr<char> memory = AttentionBackend::AllocateHostTensor(bytes);
  if (memory == nullptr) return nullptr;
  std::shared_ptr<HostTensorCounters> counts = host_tensors_;
  counts->allocations.fetch_add(1, std::memory_order_relaxed);
  counts->bytes.fetch_add(bytes, std::memory_order_relaxed);
  counts->live_bytes.fetch_add(bytes, std::memory_order_relaxed);
  // The deleter holds the memory and counts its release.
  auto release = [memory, counts, bytes](char*) mutable {
    memory.reset();
    counts->live_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  };
  return std::shared_ptr<char>(memory.get(), std::move(release));
}

CpuBackend::HostTensorCounts CpuBackend::host_tensor_counts() const {
  HostTensorCounts c;
  c.allocations = host_tensors_->allocations.load(std::memory_order_relaxed);
  c.bytes = host_tensors_->bytes.load(std::memory_order_relaxed);
  c.live_bytes = host_tensors_->live_bytes.load(std::memory_order_relaxed);
  return c;
}

absl::StatusOr<Plan> CpuBackend::CanImplementPaged(const PagedAttnParams& params) const {
  // Every valid launch runs here: the checks keep it inside the cache's pages.
  // The paged task applies the per-head score modifiers (ALiBi, sinks).
  PagedModSupport mods;
  mods.alibi_slopes = true;
  mods.sinks = true;
  mods.mla = true;            // Dv != D and V in K's pages (cpu_attention_kernel.cc)
  mods.element_masks = true;  // bias and mask rows over each sequence's history
  RETURN_IF_ERROR(CheckPagedParams(params, mods));
  RETURN_IF_ERROR(CheckHostTensors(params.attn, "cpu"));
  return Plan();
}

absl::Status CpuBackend::PagedForward(const Plan& /*plan*/, const PagedAttnParams& params,
                                      BackendTimings* timings) {
  std::lock_guard<std::mutex> lock(forward_mu_);
  const auto start = std::chrono::steady_clock::now();
  cpu::SeqPrefix prefix;
  if (!prefix.Build(params)) {
    return absl::ResourceExhaustedError("cpu backend: cannot allocate the per-sequence offsets");
  }
  CopyAndAppend(params);
  RETURN_IF_ERROR(
      RunTasks(params.attn, [&params, &prefix](int b, int h, int m_block, cpu::Scratch* s) {
        cpu::PagedAttentionTask(params, prefix, b, h, m_block, s);
      }));
  if (timings != nullptr) {
    timings->compute_us = std::chrono::duration_cast<std::chrono::microseconds>(
                              std::chrono::steady_clock::now() - start)
                              .count();
  }
  return absl::OkStatus();
}

}  // namespace attnserve
