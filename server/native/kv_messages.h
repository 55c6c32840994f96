// attnserve.v1 KvCache messages as the core's and the pool's types and back
// (kv.proto): cache creation, sequences, the append-and-attend call (views
// into the request, nothing copied) and its response, cache statistics.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "attnserve/v1/kv.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "server/core/call.h"
#include "server/core/kv_runner.h"
#include "server/kv/kv_pool.h"

namespace attnserve {

KvCreateCache DecodeCreateCache(const v1::CreateCacheRequest& request);
std::vector<KvSequenceSpec> DecodeSequences(const v1::CreateSequencesRequest& request);

// q's, k's and v's bytes of a unary AppendAttend, parsed out of gRPC's
// slices into host memory the backend's launches read where it lies
// (AttentionBackend::AllocateHostTensor); null where the message holds them.
struct KvStagedInputs {
  std::shared_ptr<char> q, k, v;
  int64_t q_bytes = 0, k_bytes = 0, v_bytes = 0;
};
using HostTensorAllocator = std::function<std::shared_ptr<char>(int64_t bytes)>;

// Parses the raw request `bytes` (emptied, as ParseAppendAttend does) into
// `request` as protobuf would, except that q.data, k.data and v.data stay
// empty and their bytes are copied once, from the received slices, into
// memory from `allocate`, held in `staged`. A tensor that also names a
// shared-memory span keeps its data in the message (the span's check refuses
// both). A form this walk does not take (a group, a malformed field) is
// parsed by protobuf into the message as before: same result, same errors.
// RESOURCE_EXHAUSTED naming the field when `allocate` has no memory left.
grpc::Status ParseAppendAttendStaged(grpc::ByteBuffer* bytes, const HostTensorAllocator& allocate,
                                     v1::AppendAttendRequest* request, KvStagedInputs* staged);

// The call for `request` (which must outlive it) with `meta`'s tenant,
// deadline and cancellation; q, k and v from `staged` where it holds them
// (which must outlive the call too).
KvCall KvCallOf(const v1::AppendAttendRequest& request, CallMeta meta,
                const KvStagedInputs* staged = nullptr);

// o [Tq, Hq, D], lse [Hq, Tq] (with return_lse) and lengths, moved out of `result`.
void FillAppendAttendResponse(KvResult* result, v1::AppendAttendResponse* response);

void FillCacheStats(const KvCacheStats& stats, v1::CacheStats* out);

}  // namespace attnserve
