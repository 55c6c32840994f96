// Decoding and validating KvCache requests (kv.proto) into the pool's structs
// (server/kv/kv_pool.h), and the pool's answers back into responses. Errors
// name the wire field, the expected value and the actual one.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/kv.pb.h"
#include "server/kv/kv_pool.h"
#include "server/request_validation.h"

namespace attnserve {

KvCreateCache DecodeCreateCache(const v1::CreateCacheRequest& request);
std::vector<KvSequenceSpec> DecodeSequences(const v1::CreateSequencesRequest& request);

// Checks `request` against the cache's geometry and the server's limits and
// returns the call (input pointers into `request`, which must outlive it).
absl::StatusOr<std::shared_ptr<KvAppendAttend>> DecodeAppendAttend(
    const v1::AppendAttendRequest& request, const KvCache& cache, const RequestLimits& limits);

// o [Tq, Hq, D], lse [Hq, Tq] (with return_lse) and lengths, moved out of `call`.
void FillAppendAttendResponse(KvAppendAttend* call, v1::AppendAttendResponse* response);

void FillCacheStats(const KvCacheStats& stats, v1::CacheStats* out);

}  // namespace attnserve
