// An append-and-attend call on a K/V cache that spans devices
// (docs/kv-cache.md, "Caches that span devices"). KvCache::ReserveSpanning
// splits each step into parts, one per segment of its sequence; here the
// parts become launches, one per (device, role) group: the steps' last
// segments (which take the new rows and any copy-on-write, with the call's
// causal rule and sinks) and the earlier segments (wholly visible to the
// queries: causal off, no sinks). Every launch gets the steps' queries and
// returns a partial O and LSE per (row, head); MergeSpanGroups merges them
// exactly on the host (common/lse_merge.h).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "backend/paged_kv.h"
#include "server/core/field_names.h"

namespace attnserve {

struct KvAppendAttend;

struct KvSpanGroup {
  int32_t shard = 0;
  bool last = false;
  std::vector<int32_t> parts;     // indices into the reservation's parts
  std::vector<int32_t> q_offset;  // per part: its first row in this launch
  // The launch's own host memory: the parts' query rows (each step's
  // repeated for each of its parts here), the new rows, outputs and tables.
  std::vector<int32_t> cu_q, cu_k, block_table, seqlens, copy_src, copy_dst;
  std::vector<char> q, k, v, o;
  std::vector<float> k_scale, v_scale, lse;
  PagedAttnParams params{};
};

// What a spanning cache refuses before anything is reserved: sliding windows
// and ALiBi (they depend on a key's position in the whole sequence, which a
// segment's launch does not see), a bias or element mask (rows over the whole
// history) and inputs in device memory (the launches' rows are gathered on
// the host). INVALID_ARGUMENT or UNIMPLEMENTED naming
// the field.
absl::Status CheckSpanningCall(const KvAppendAttend& c);

// After ReserveSpanning: with a causal call, each step's queries must lie in
// its last segment (INVALID_ARGUMENT naming the step's num_queries
// otherwise); then the groups with their params, outputs bound: every
// device's last-segment group first, then the earlier segments' groups.
absl::Status BuildSpanGroups(const KvAppendAttend& c, std::vector<KvSpanGroup>* groups);

// Merges the groups' partial outputs into the call's o (or o_out) and lse.
void MergeSpanGroups(KvAppendAttend& c, const std::vector<KvSpanGroup>& groups);

}  // namespace attnserve
