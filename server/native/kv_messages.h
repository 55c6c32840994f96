// attnserve.v1 KvCache messages as the core's and the pool's types and back
// (kv.proto): cache creation, sequences, the append-and-attend call (views
// into the request, nothing copied) and its response, cache statistics.
#pragma once

#include <vector>

#include "attnserve/v1/kv.pb.h"
#include "server/core/call.h"
#include "server/core/kv_runner.h"
#include "server/kv/kv_pool.h"

namespace attnserve {

KvCreateCache DecodeCreateCache(const v1::CreateCacheRequest& request);
std::vector<KvSequenceSpec> DecodeSequences(const v1::CreateSequencesRequest& request);

// The call for `request` (which must outlive it) with `meta`'s tenant,
// deadline and cancellation.
KvCall KvCallOf(const v1::AppendAttendRequest& request, CallMeta meta);

// o [Tq, Hq, D], lse [Hq, Tq] (with return_lse) and lengths, moved out of `result`.
void FillAppendAttendResponse(KvResult* result, v1::AppendAttendResponse* response);

void FillCacheStats(const KvCacheStats& stats, v1::CacheStats* out);

}  // namespace attnserve
