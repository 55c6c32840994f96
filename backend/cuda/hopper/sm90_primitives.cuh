// Hopper (sm_90a) building blocks of the forward kernels in this folder, each
// a thin wrapper over one PTX instruction (PTX ISA 8.x): mbarriers, TMA tile
// loads (cp.async.bulk.tensor) and bulk row copies (cp.async.bulk), wgmma
// shared-memory descriptors, fences, setmaxnreg and named barriers. The wgmma m64nNk16 instructions
// themselves are in generated/sm90_wgmma.h (their operand lists are long and regular). Written here
// instead of taken from CUTLASS/CuTe: the whole Hopper path compiles in seconds per instantiation
// on CI's 2 cores, every instruction the kernel issues is visible in this file, and nothing else is
// pulled in. Only compiled for sm_90a (the callers guard on __CUDA_ARCH_FEAT_SM90_ALL).
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing here links libcuda)

#include <cstdint>

namespace attnserve {
namespace cuda {
namespace sm90 {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier: a 64-bit shared-memory barrier that completes a phase once
// `count` threads arrived and the transaction bytes announced with
// ArriveExpectTx have landed (TMA completes them).
__device__ __forceinline__ void MbarInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count));
}
// Makes the initialised barriers visible to the async proxy (TMA) and the
// other threads; a __syncthreads must follow.
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddr(bar)) : "memory");
}
// Spins until the phase with parity `parity` completed.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_LOOP:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_LOOP;\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA: one box of a 4-d tensor map into shared memory, completing
// `bytes` (the whole box, zero-filled where out of bounds) on `bar`.
__device__ __forceinline__ void TmaLoad4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                          int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// The same under an L2 cache policy (L2Policy): evict-first for data read
// once that should not push out what will be read again.
__device__ __forceinline__ void TmaLoad4dPolicy(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                int c0, int c1, int c2, int c3, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "l"(policy)
      : "memory");
}
// Evict-first, or (false) evict-unchanged: what a plain load does.
__device__ __forceinline__ uint64_t L2Policy(bool evict_first) {
  uint64_t first, unchanged;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(first));
  asm volatile("createpolicy.fractional.L2::evict_unchanged.b64 %0, 1.0;\n" : "=l"(unchanged));
  return evict_first ? first : unchanged;
}
// ---- Bulk copy (TMA without a tensor map): `bytes` (a multiple of 16, both
// addresses 16-byte aligned) from global to shared memory, completing them on
// `bar`. One row of a K/V tile each in the decode kernel, whose rows are
// scattered (heads interleaved, or pages).
__device__ __forceinline__ void BulkLoad(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later
// async-proxy (TMA) accesses of the same bytes (a buffer the threads wrote
// that TMA refills next).
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- wgmma shared-memory descriptors, 128-byte swizzle only (what TMA
// writes with CU_TENSOR_MAP_SWIZZLE_128B: a tile of rows x 64 16-bit
// elements, 128 bytes a row, 16-byte chunk c of row r stored at c ^ (r % 8);
// tiles 1024-byte aligned). Bits: [0,14) start address >> 4, [16,30) leading
// byte offset >> 4, [32,46) stride byte offset >> 4, [62,64) layout (1 = 128B
// swizzle).
//  - K-major operand (Q as A, K as B of S = Q K^T: rows x 64 along K): SBO =
//    1024 (one 8-row group of 128-byte rows to the next); LBO unused. A k16
//    step is +32 bytes inside the 128-byte row.
//  - MN-major operand (V as B of O = P V, keys x 64 d-columns per block):
//    SBO = 1024 (8 keys to the next 8), LBO = the distance between 64-column
//    blocks (keys of the tile x 128 bytes). A k16 step is +16 rows = 2048 bytes.
__device__ __forceinline__ uint64_t SmemDesc(const void* smem, uint32_t lbo_bytes,
                                             uint32_t sbo_bytes) {
  uint64_t d = (SmemAddr(smem) & 0x3FFFFu) >> 4;
  d |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16;
  d |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32;
  d |= uint64_t{1} << 62;
  return d;
}
// A K-major operand in 64-byte swizzled rows (layout 2: what TMA writes with
// CU_TENSOR_MAP_SWIZZLE_64B; 512-byte aligned blocks of 8 rows): SBO = 512,
// LBO unused. A k32 step of FP8 is +32 bytes inside the row.
__device__ __forceinline__ uint64_t SmemDescSw64(const void* smem) {
  uint64_t d = (SmemAddr(smem) & 0x3FFFFu) >> 4;
  d |= uint64_t{1} << 16;
  d |= static_cast<uint64_t>(512 >> 4) << 32;
  d |= uint64_t{2} << 62;
  return d;
}

// ---- wgmma ordering. Fence: prior register writes (accumulators, A
// fragments) are visible to the next wgmma. Commit: the wgmmas issued since
// the last commit form a group. Wait<N>: at most N groups still in flight.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads or writes of accumulator registers
// across an asynchronous wgmma (the registers are written behind its back).
template <int kN>
__device__ __forceinline__ void FenceRegs(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kN>
__device__ __forceinline__ void FenceRegs(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// d += A B with A [64 x 32] E4M3 in registers (the P V's A fragment) and B
// [32 x 8] K-major E4M3 in shared memory: the FP8 P V's row sums, B a tile
// of ones (Sm90FwdSmem::ones). d: rows r, r + 8 of the thread, 2 columns each.
__device__ __forceinline__ void WgmmaE4m3N8RS(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "%8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// ---- Register reallocation between warpgroups (the kernel must have a
// register cap at entry: __launch_bounds__(threads, 1)).
template <int kRegs>
__device__ __forceinline__ void SetMaxRegsDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void SetMaxRegsInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- Named barriers (ids 1..15; 0 is __syncthreads). Sync waits until
// `threads` threads arrived or synced; Arrive counts without waiting.
__device__ __forceinline__ void NamedBarSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace sm90
}  // namespace cuda
}  // namespace attnserve
