// Moving a K/V cache between servers (kv_transfer.proto, docs/kv-transfer.md):
// MoveCache pipes one server's ExportSequences into another's
// ImportSequences through a bounded buffer, and when either stream breaks it
// re-opens the import with the same transfer_id, reads where the receiver
// stands and resumes the export from there, so finished pages are never
// sent again.
//
//   auto source = grpc::CreateChannel("10.0.0.1:50051", creds);
//   auto dest = grpc::CreateChannel("10.0.0.2:50051", creds);
//   MoveOptions options;
//   options.create.set_capacity_tokens(1 << 20);  // the receiver creates the cache
//   absl::StatusOr<MoveResult> moved = MoveCache(source, dest, "kv0", options);
//
// PushChunks is the import half alone, for a sender whose chunks come from
// elsewhere (a server draining to its peer reads them in-process; a prefill
// engine builds them from its own K/V): `open` starts (or, after a cut,
// restarts) the chunk stream at a resume point.
#pragma once

#include <grpcpp/channel.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/v1/kv_transfer.grpc.pb.h"

namespace attnserve {

struct MoveOptions {
  // The receiver's cache id; empty: the source's.
  std::string dest_cache_id;
  // Set (has_* fields filled): the receiver creates the cache when its
  // tenant lacks it (CreateCacheRequest's capacity, device, reserve).
  std::optional<v1::CreateCacheRequest> create;
  // What to export (ExportSequencesRequest's fields; cache_id, resume and
  // transfer_id are MoveCache's).
  std::vector<uint64_t> sequence_ids;
  int32_t token_begin = 0;
  std::optional<int32_t> token_end;
  int32_t max_chunk_bytes = 0;
  // Empty: a random one. Names the transfer on the receiver across resumes.
  std::string transfer_id;
  // Chunks read from the export and not yet written to the import: the
  // buffer's bound in payload bytes (at least one chunk is always held).
  int64_t max_buffered_bytes = int64_t{16} << 20;
  // Broken streams survived before giving up (each resumes where the
  // receiver stands).
  int max_resumes = 8;
  // Per-call metadata both streams carry (authorization, for instance);
  // the affinity header x-attnserve-cache-id is added per side.
  std::multimap<std::string, std::string> source_metadata;
  std::multimap<std::string, std::string> dest_metadata;
  // Whole move; infinite: none.
  absl::Duration timeout = absl::InfiniteDuration();
  // What carries the chunks (MoveCache only): "grpc" (in the two streams,
  // through this client), or "ucx": the receiver offers a UCX address in its
  // first answer and the source sends the chunks there itself, server to
  // server, the streams carrying only the control messages. A receiver that
  // offers no UCX (no --ucx_port, built without it) gets the chunks in the
  // gRPC streams: MoveResult.data_plane is then "grpc" and
  // data_plane_fallback says why.
  std::string data_plane = "grpc";
  // With data_plane "ucx": a receiver (or a source) without UCX fails the
  // move with FAILED_PRECONDITION, saying why, instead of falling back to
  // the gRPC streams.
  bool data_plane_required = false;
  // Transfers run at once (MoveCache only), each a contiguous share of the
  // sequences with streams (and UCX connection) of its own and transfer id
  // `transfer_id-lN`: the page copies of each side run on that many threads.
  int lanes = 1;
  // Test seam (data_plane "ucx"): called as each attempt's export starts,
  // with a function that cuts that export (cancels its stream) from any
  // thread; the move then resumes where the receiver stands.
  std::function<void(std::function<void()> cut)> data_plane_started_for_testing;
  // Test seam: called with a running count of the chunks about to be
  // written (from 0, across resumes; a chunk refused here and sent again
  // after the resume counts twice); an error breaks the import stream there:
  // CANCELLED cuts it (chunks in flight are lost and sent again), any other
  // code half-closes it (the receiver keeps every chunk written).
  std::function<absl::Status(int64_t index, const v1::KvChunk& chunk)> fault_for_testing;
};

struct MoveResult {
  std::string transfer_id;
  // Payload bytes written to the import (resent ones included); over UCX,
  // what the receiver kept (the chunks in flight at a cut, sent again, are
  // not seen here: bytes_resent stays 0).
  int64_t bytes = 0;
  int64_t bytes_resent = 0;  // of those, chunks sent again after a cut
  int64_t sequences = 0;     // sequences live on the receiver from this transfer
  int32_t resumes = 0;       // broken streams resumed
  double seconds = 0;
  v1::CacheStats dest_stats;        // the receiver's cache after the last chunk
  std::string data_plane = "grpc";  // what carried the chunks ("ucx" or "grpc")
  std::string data_plane_fallback;  // why not UCX, when it was asked for
  int lanes = 1;
};

// A chunk stream PushChunks reads: Read fills `chunk` and returns true, or
// false at the end; an error breaks the transfer at that point (PushChunks
// then resumes: it re-opens with the receiver's resume point).
class KvChunkReader {
 public:
  virtual ~KvChunkReader() = default;
  virtual absl::StatusOr<bool> Read(v1::KvChunk* chunk) = 0;
  // Makes a Read blocked in another thread return soon (an error or false);
  // PushChunks calls it when the import breaks. Thread-safe.
  virtual void Cancel() {}
};
// Opens the chunk stream at `resume` (null: from the start) with
// `transfer_id`; the first chunk carries the header.
using OpenChunks = std::function<absl::StatusOr<std::unique_ptr<KvChunkReader>>(
    const v1::ImportResumePoint* resume, const std::string& transfer_id)>;

absl::StatusOr<MoveResult> PushChunks(const std::shared_ptr<grpc::Channel>& dest,
                                      const std::string& dest_cache_id, const OpenChunks& open,
                                      const MoveOptions& options);

// A sender that puts the chunks on the data plane itself (a server handing
// its caches to a peer): `header` gives the transfer's header; `run` sends
// the chunks from `resume` (null: the start) to the receiver's offer and
// returns the payload bytes the receiver kept (UNIMPLEMENTED: this sender
// has no UCX, and the chunks go in the gRPC stream, from `open`).
struct DataPlaneSender {
  std::function<absl::StatusOr<v1::KvTransferHeader>(const std::string& transfer_id)> header;
  std::function<absl::StatusOr<int64_t>(const v1::ImportResumePoint* resume,
                                        const std::string& transfer_id,
                                        const v1::KvDataPlane& offer)>
      run;
};
// PushChunks whose chunks go over the data plane options.data_plane names
// ("ucx") when the receiver offers it, else (unless data_plane_required)
// in the import stream; MoveResult.data_plane says which.
absl::StatusOr<MoveResult> PushChunks(const std::shared_ptr<grpc::Channel>& dest,
                                      const std::string& dest_cache_id, const OpenChunks& open,
                                      const MoveOptions& options, const DataPlaneSender& sender);

absl::StatusOr<MoveResult> MoveCache(const std::shared_ptr<grpc::Channel>& source,
                                     const std::shared_ptr<grpc::Channel>& dest,
                                     const std::string& cache_id, const MoveOptions& options);

}  // namespace attnserve
