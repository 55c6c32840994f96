// CpuBackend's paged K/V path (paged_kv.h, DESIGN §6): pages live in host
// memory; one launch copies pages (copy-on-write), appends the new K/V rows
// through the block tables and attends with the same tiled online-softmax
// kernel as Forward, reading K/V in place through the block table.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "backend/check_paged_params.h"
#include "backend/cpu/cpu_attention_kernel.h"
#include "backend/cpu/cpu_backend.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

// Bytes of one page's K (or V): page_size rows of [Hkv, D].
int64_t PageBytes(const PagedAttnParams& p) {
  return int64_t{p.pages.page_size} * p.attn.num_heads_kv * p.attn.head_dim *
         DTypeSize(p.attn.dtype);
}

char* PageAddress(void* const* slabs, const PagedAttnParams& p, int32_t page) {
  const int64_t elem = DTypeSize(p.attn.dtype);
  return static_cast<char*>(slabs[PageSlab(p.pages, page)]) +
         PageRowOffset(p.pages, page, 0, p.attn.num_heads_kv, p.attn.head_dim, 0) * elem;
}

// Steps 1 and 2 of paged_kv.h: page copies, then the new rows into their pages.
void CopyAndAppend(const PagedAttnParams& p) {
  const int64_t page_bytes = PageBytes(p);
  for (int i = 0; i < p.num_page_copies; ++i) {
    std::memcpy(PageAddress(p.pages.k_slabs, p, p.copy_dst[i]),
                PageAddress(p.pages.k_slabs, p, p.copy_src[i]), size_t(page_bytes));
    std::memcpy(PageAddress(p.pages.v_slabs, p, p.copy_dst[i]),
                PageAddress(p.pages.v_slabs, p, p.copy_src[i]), size_t(page_bytes));
  }
  const int64_t elem = DTypeSize(p.attn.dtype);
  const int64_t row_bytes = int64_t{p.attn.num_heads_kv} * p.attn.head_dim * elem;
  const char* k_new = static_cast<const char*>(p.attn.k);
  const char* v_new = static_cast<const char*>(p.attn.v);
  for (int b = 0; b < p.attn.batch; ++b) {
    const int32_t added = SeqLenK(p.attn, b);
    const int32_t first = p.seqlens_k[b] - added;
    const int32_t* table = p.block_table + int64_t{b} * p.block_table_stride;
    for (int32_t r = 0; r < added; ++r) {
      const int32_t pos = first + r;
      const int32_t page = table[pos >> p.pages.page_shift];
      const int64_t off = PageRowOffset(p.pages, page, pos & (p.pages.page_size - 1),
                                        p.attn.num_heads_kv, p.attn.head_dim, 0) *
                          elem;
      const int64_t src = (SeqStartK(p.attn, b) + r) * row_bytes;
      std::memcpy(static_cast<char*>(p.pages.k_slabs[PageSlab(p.pages, page)]) + off, k_new + src,
                  size_t(row_bytes));
      std::memcpy(static_cast<char*>(p.pages.v_slabs[PageSlab(p.pages, page)]) + off, v_new + src,
                  size_t(row_bytes));
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

absl::StatusOr<Plan> CpuBackend::CanImplementPaged(const PagedAttnParams& params) const {
  // Every valid launch runs here: the checks keep it inside the cache's pages.
  // The paged task applies the per-head score modifiers (ALiBi, sinks).
  PagedModSupport mods;
  mods.alibi_slopes = true;
  mods.sinks = true;
  RETURN_IF_ERROR(CheckPagedParams(params, mods));
  return Plan();
}

absl::Status CpuBackend::PagedForward(const Plan& /*plan*/, const PagedAttnParams& params,
                                      BackendTimings* timings) {
  std::lock_guard<std::mutex> lock(forward_mu_);
  const auto start = std::chrono::steady_clock::now();
  CopyAndAppend(params);
  RETURN_IF_ERROR(RunTasks(params.attn, [&params](int b, int h, int m_block, cpu::Scratch* s) {
    cpu::PagedAttentionTask(params, b, h, m_block, s);
  }));
  if (timings != nullptr) {
    timings->compute_us = std::chrono::duration_cast<std::chrono::microseconds>(
                              std::chrono::steady_clock::now() - start)
                              .count();
  }
  return absl::OkStatus();
}

}  // namespace attnserve
