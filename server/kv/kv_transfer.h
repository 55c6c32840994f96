// Moving K/V sequences between servers (docs/kv-transfer.md), protocol-free:
// the chunks of kv_transfer.proto as plain structs, an exporter that reads a
// cache's sequences out of their pages in whole-source-page chunks, and
// import sessions that check each chunk, stage its rows in pages of the
// receiving cache and make a sequence live at its last chunk (all or nothing
// per sequence). The gRPC front-end (server/native/kv_transfer_service.h)
// and a draining server's push to its peer both drive these.
//
// Order of a transfer: its header's sequences in order; each sequence's
// layers ascending, each layer's rows [token_begin, final length) ascending,
// at least one chunk per layer (a layer with no rows sends one empty chunk);
// the chunk that completes the last layer carries sequence_end.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/kv/kv_cache.h"
#include "server/kv/kv_pool.h"

namespace attnserve {

// Chunk payload bound when an export asks for 0 (ExportSequencesRequest.max_chunk_bytes).
inline constexpr int64_t kDefaultKvChunkBytes = int64_t{4} << 20;

// The largest chunk payload an export of a cache with geometry `g` and
// `page_size` makes when asked for `max_chunk_bytes` (0: the default): whole
// pages of one layer, at least one.
int64_t KvMaxChunkBytes(const KvGeometry& g, int32_t page_size, int64_t max_chunk_bytes);

struct KvTransferSequence {
  uint64_t sequence_id = 0;
  std::vector<int32_t> lengths;  // per layer, after the import
};

// KvTransferHeader on the wire.
struct KvTransferHeader {
  std::string transfer_id;
  std::string source_cache_id;
  KvGeometry geometry;  // cache_dtype resolved
  int32_t source_page_size = 0;
  std::vector<KvTransferSequence> sequences;
  int32_t token_begin = 0;
  int64_t total_bytes = 0;
};

// KvChunk on the wire: rows [token_begin, token_begin + num_tokens) of one
// sequence at one layer, K and V in the page dtype (and FP8 scales).
struct KvTransferChunk {
  uint64_t sequence_id = 0;
  int32_t layer = 0;
  int32_t token_begin = 0;
  int32_t num_tokens = 0;
  std::string k, v, k_scale, v_scale;
  uint32_t crc32c = 0;
  bool sequence_end = false;

  int64_t payload_bytes() const {
    return static_cast<int64_t>(k.size() + v.size() + k_scale.size() + v_scale.size());
  }
};

// CRC-32C of k, v, k_scale, v_scale as one byte string (KvChunk.crc32c).
uint32_t KvChunkCrc32c(const KvTransferChunk& chunk);

// ImportResumePoint on the wire.
struct KvResumePoint {
  std::vector<uint64_t> committed_sequence_ids;
  std::optional<uint64_t> sequence_id;
  int32_t layer = 0;
  int32_t token = 0;
};

struct KvExportOptions {
  std::vector<uint64_t> sequence_ids;  // empty: every live one, ascending
  int32_t token_begin = 0;
  std::optional<int32_t> token_end;
  std::optional<KvResumePoint> resume;
  int64_t max_chunk_bytes = 0;  // 0: kDefaultKvChunkBytes
  std::string transfer_id;      // empty: one is made
  // Read the next chunk out of the pages on a thread of the exporter's own
  // while the caller sends this one (one chunk ahead): the page copies
  // (D2H on a GPU) and the checksum leave the caller's thread (a gRPC
  // thread) and overlap the send.
  bool read_ahead = false;
};

// Reads a cache's sequences out of their pages, one chunk at a time. Start
// pins every page it will read (a reference each, so a concurrent append
// copies a shared partial page instead of writing it, and a free or truncate
// leaves the rows in place) and fixes the header; the pins go with the
// exporter. Not thread-safe.
class KvExporter {
 public:
  // NOT_FOUND naming an unknown sequence, INVALID_ARGUMENT naming the field
  // (sequence_ids, token_begin, token_end, max_chunk_bytes, resume), before
  // anything is read.
  static absl::StatusOr<std::unique_ptr<KvExporter>> Start(std::shared_ptr<KvCache> cache,
                                                           const KvExportOptions& options);
  ~KvExporter();
  KvExporter(const KvExporter&) = delete;
  KvExporter& operator=(const KvExporter&) = delete;

  // The transfer's header (the whole list of sequences, resumed or not).
  const KvTransferHeader& header() const { return header_; }
  // Payload bytes still to send from the start position (resume skipped),
  // as Start found them.
  int64_t remaining_bytes() const { return start_bytes_; }
  // The most payload bytes one chunk carries (whole pages of one layer: above
  // max_chunk_bytes where that is less than a page), so any one of its parts.
  int64_t max_chunk_payload() const { return max_chunk_payload_; }
  // Fills *chunk (its buffers reused, or swapped with the read-ahead's) with
  // the next chunk; false when done.
  absl::StatusOr<bool> Next(KvTransferChunk* chunk);

 private:
  absl::StatusOr<bool> Read(KvTransferChunk* chunk);
  void ReadAhead();

  // The read-ahead thread's one chunk ahead, handed over under ahead_mu_.
  absl::Mutex ahead_mu_;
  bool ahead_want_ ABSL_GUARDED_BY(ahead_mu_) = false;  // read the next one
  bool ahead_stop_ ABSL_GUARDED_BY(ahead_mu_) = false;
  std::optional<absl::StatusOr<bool>> ahead_result_ ABSL_GUARDED_BY(ahead_mu_);
  KvTransferChunk ahead_chunk_;  // the read-ahead thread's while ahead_want_
  std::thread ahead_;

  struct Pinned {
    uint64_t sequence_id = 0;
    std::vector<std::vector<int32_t>> pages;  // per layer, pinned
    std::vector<int32_t> ends;                // per layer: last row exported + 1
  };
  KvExporter() = default;
  int32_t RowsPerChunk() const;

  std::shared_ptr<KvCache> cache_;
  KvTransferHeader header_;
  std::vector<Pinned> pinned_;  // the sequences still to send, in order
  int64_t rows_per_chunk_ = 0;
  int64_t max_chunk_payload_ = 0;
  int64_t remaining_bytes_ = 0;
  int64_t start_bytes_ = 0;
  size_t seq_ = 0;
  int32_t layer_ = 0;
  int32_t token_ = 0;
};

// The in-process export a draining server (or a test) uses: every chunk of
// `options`' sequences of the tenant's cache, the first with `header` set,
// into `sink` in order; the sink's error stops it and comes back.
using KvChunkSink =
    std::function<absl::Status(const KvTransferHeader* header, KvTransferChunk&& chunk)>;
absl::Status ExportCache(KvPool& pool, const std::string& tenant, const std::string& cache_id,
                         const KvExportOptions& options, const KvChunkSink& sink);

struct KvImportOptions {
  // Without a resume for this long, a cut import's staged rows go
  // (--kv_import_idle_timeout); committed sequences stay live.
  absl::Duration idle_timeout = absl::Seconds(60);
};

// The receiving cache, when the import creates it: CreateCacheRequest's
// capacity, device and reserve (geometry and page size are the header's,
// the id the import's).
struct KvImportCreate {
  int64_t capacity_tokens = 0;
  int64_t capacity_bytes = 0;
  std::optional<int32_t> device;
  bool reserve = false;
};

struct KvImportProgress {
  KvResumePoint resume;
  int64_t bytes_received = 0;
  bool sequence_committed = false;  // the last Accept made a sequence live
};

struct KvImportStats {
  int64_t sessions = 0;            // open (attached or waiting for a resume)
  int64_t staged_pages = 0;        // pages held by sequences not yet live
  int64_t expired_sessions = 0;    // since start: idle timeout without a resume
  int64_t sequences_imported = 0;  // since start: made live
  int64_t bytes_imported = 0;      // since start: payload bytes kept
  int64_t checksum_failures = 0;   // since start: chunks refused with DATA_LOSS
};

class KvImportSessions;

// One transfer on the receiving side, keyed by (tenant, transfer_id).
// KvImportSessions::Attach hands it to one stream at a time (with the
// header); Accept checks and keeps one chunk.
class KvImportSession {
 public:
  // Checks and keeps one chunk. An error changes no live state: DATA_LOSS
  // (chunk.crc32c), INVALID_ARGUMENT (order or sizes against the header,
  // naming chunk.*), ALREADY_EXISTS, FAILED_PRECONDITION, NOT_FOUND,
  // RESOURCE_EXHAUSTED (the current sequence's staged rows are returned and
  // it starts again from its first row).
  absl::StatusOr<KvImportProgress> Accept(const KvTransferChunk& chunk);
  // OK when `header` is this transfer's (a resumed stream sends it again).
  absl::Status SameHeader(const KvTransferHeader& header);
  // Where the transfer stands (what a resumed export starts from).
  KvImportProgress Progress();
  // True when every sequence of the header is live.
  bool Done();
  // The stream is over (cut, failed or done): a finished session ends now,
  // another waits for a resume until the idle timeout. A session that
  // created its cache and kept no row ends now too, and the cache goes with
  // it (a failed import leaves no cache behind; a resume creates it again
  // from `create`); one that kept rows but made no sequence live takes the
  // cache with it when it expires.
  void Detach();

  const std::string& transfer_id() const { return transfer_id_; }
  const std::shared_ptr<KvCache>& cache() const { return cache_; }

  KvImportSession(KvImportSessions* owner, std::string tenant, KvTransferHeader header,
                  std::shared_ptr<KvCache> cache, bool created_cache = false);
  ~KvImportSession();  // returns staged pages

 private:
  friend class KvImportSessions;
  struct Staged {
    std::vector<std::vector<int32_t>> pages;  // per layer: receiver pages from `base`
    int32_t base = 0;                         // first row the first page holds
    bool charged = false;                     // bookkeeping charged to the cache
    int64_t bytes = 0;                        // payload kept (bytes_received_ counts it)
  };
  absl::Status Check(const KvTransferChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Stage(const KvTransferChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Install() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns the current sequence's staged pages and charge; it starts again.
  void DropStaged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t StagedPages() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  KvResumePoint ResumeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  KvImportSessions* const owner_;
  const std::string tenant_;
  const std::string transfer_id_;
  const std::shared_ptr<KvCache> cache_;
  const bool created_cache_;  // Attach created the cache from `create`

  absl::Mutex mu_;
  KvTransferHeader header_ ABSL_GUARDED_BY(mu_);
  bool attached_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_active_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> committed_ ABSL_GUARDED_BY(mu_);
  size_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;  // index into header_->sequences
  int32_t layer_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t token_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ ABSL_GUARDED_BY(mu_) = false;  // the current sequence has rows staged
  Staged staged_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_received_ ABSL_GUARDED_BY(mu_) = 0;
};

// The import sessions of a server, and their idle expiry.
class KvImportSessions {
 public:
  KvImportSessions(KvPool* pool, const KvImportOptions& options);
  ~KvImportSessions();  // stops the expiry thread

  // The session for (tenant, transfer_id), attached to the caller's stream:
  // a new one on `cache_id` (created from `create` and the header when the
  // tenant lacks it; NOT_FOUND without `create`), or the cut one to resume
  // (its cache_id must match). ABORTED while another stream holds it;
  // INVALID_ARGUMENT naming header.transfer_id or cache_id.
  absl::StatusOr<std::shared_ptr<KvImportSession>> Attach(
      const std::string& tenant, const std::string& cache_id,
      const std::optional<KvImportCreate>& create, const KvTransferHeader& header);

  // Ends sessions idle past the timeout (the expiry thread calls it; tests may).
  void ExpireIdle(absl::Time now);
  KvImportStats Stats();

 private:
  friend class KvImportSession;
  void Forget(const KvImportSession* session);
  // Drops `cache` if the pool still holds it for `tenant`, it has no live
  // sequence and no other import uses it (an import created it and failed
  // before any sequence went live).
  void DropEmptyCreated(const std::string& tenant, const std::shared_ptr<KvCache>& cache)
      ABSL_LOCKS_EXCLUDED(mu_);

  KvPool* const pool_;
  const KvImportOptions options_;
  absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<KvImportSession>> sessions_
      ABSL_GUARDED_BY(mu_);
  // Counters sessions add to under their own lock (atomics: no lock order).
  std::atomic<int64_t> expired_{0};
  std::atomic<int64_t> sequences_imported_{0};
  std::atomic<int64_t> bytes_imported_{0};
  std::atomic<int64_t> checksum_failures_{0};
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread expiry_;
};

}  // namespace attnserve
