// --kv_startup_cache: K/V caches the server creates at start-up, so a client
// that cannot call KvCache.CreateCache (perf_analyzer, tritonclient) can drive
// the attention_kv model on its own. This file only parses the flag; the pool
// (KvPool::CreateCache) checks the geometry and capacity like any other cache.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/kv/kv_pool.h"

namespace attnserve {

struct KvStartupCache {
  std::string tenant;  // "tenant=" key; empty = the default tenant
  KvCreateCache create;
};

// Syntax: caches separated by ';', each `ID:key=value,key=value,...` with
//   layers, hkv, d, dtype (FP16|BF16|FP32), cache_dtype (optional: FP8_E4M3
//   for FP8 pages, with dtype FP16 or BF16), dv (optional: V's head dim of an
//   MLA cache), v_in_k (0|1, optional: V is the first dv elements of each K
//   row, the absorbed MLA form), capacity_tokens or capacity_bytes
//   (required), page_size, device, devices (all, or indices joined by '+'
//   such as 0+1: the cache spans them), reserve (0|1), tenant (optional).
// Example: kv0:layers=2,hkv=8,d=128,dtype=BF16,page_size=64,capacity_tokens=65536
// MLA: mla0:layers=1,hkv=1,d=576,dv=512,v_in_k=1,dtype=BF16,capacity_tokens=65536
// INVALID_ARGUMENT naming the cache and key (expected vs actual) otherwise.
absl::StatusOr<std::vector<KvStartupCache>> ParseStartupCaches(absl::string_view flag);

}  // namespace attnserve
