// `attnctl move-kv`, `export-kv` and `import-kv`: K/V sequences between
// servers (kv_transfer.proto, docs/kv-transfer.md) from a shell. move-kv
// pipes one server's export into another's import (PushChunks of
// client/kv_transfer.h, resuming a cut stream where the receiver stands);
// export-kv writes an export to a chunk file (a snapshot, kv_chunk_file.h)
// and import-kv sends such a file to a server.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/v1/kv_transfer.grpc.pb.h"
#include "client/cli/command.h"
#include "client/cli/common.h"
#include "client/cli/kv_chunk_file.h"
#include "client/cli/kv_flags.h"
#include "client/kv_client.h"
#include "client/kv_transfer.h"
#include "common/cache_id_header.h"
#include "common/grpc_status.h"

ABSL_DECLARE_FLAG(std::string, cache);
ABSL_DECLARE_FLAG(std::string, seq);
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(int64_t, capacity_tokens);
ABSL_DECLARE_FLAG(int64_t, capacity_bytes);
ABSL_DECLARE_FLAG(bool, reserve);

ABSL_FLAG(std::string, from, "", "move-kv: the server the cache leaves (host:port, any target).");
ABSL_FLAG(std::string, to, "", "move-kv: the server the cache goes to.");
ABSL_FLAG(std::string, to_cache, "",
          "move-kv: the receiving cache's id (default: --cache, the same id).");
ABSL_FLAG(std::string, in, "", "import-kv: the chunk file to send (one export-kv wrote).");
ABSL_FLAG(int, token_begin, 0,
          "move-kv, export-kv: the first token of each sequence to export (> 0: a range the "
          "receiver appends to sequences already holding token_begin tokens).");
ABSL_FLAG(std::optional<int>, token_end, std::nullopt,
          "move-kv, export-kv: one past the last token to export (default: each layer's whole "
          "length).");
ABSL_FLAG(int, max_chunk_bytes, 0,
          "move-kv, export-kv: most K/V payload bytes per chunk, rounded down to whole source "
          "pages; 0 = the server's default (4 MiB).");
ABSL_FLAG(std::string, transfer_id, "",
          "move-kv, import-kv: the transfer's id on the receiver (default: a random one); running "
          "the same command again with the id of a cut transfer resumes it there.");

ABSL_FLAG(std::string, data_plane, "grpc",
          "move-kv: what carries the pages: grpc (both streams, through attnctl) or ucx (the "
          "source sends them to the receiver over UCX itself, gRPC carrying the control "
          "messages; a receiver without UCX gets them over gRPC and the output says why).");
ABSL_FLAG(int, lanes, 1,
          "move-kv: transfers at once, each a contiguous share of the sequences with streams (and "
          "a UCX connection) of its own: the page copies on each server run on that many "
          "threads.");

namespace attnserve {
namespace cli {
namespace {

// Transient breaks worth resuming; anything else is the answer.
bool Resumable(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown: return true;
    default: return false;
  }
}

constexpr int kMaxResumes = 8;

std::string Gb(int64_t bytes) { return absl::StrFormat("%.3f GB", bytes / 1e9); }

// "bytes, GB/s, sequences" on stderr once a second while a transfer runs
// longer than a second: one rewritten line on a terminal, a line a second
// otherwise.
class TransferProgress {
 public:
  explicit TransferProgress(std::string what) : what_(std::move(what)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~TransferProgress() {
    done_.Notify();
    thread_.join();
  }
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> total{0};
  std::atomic<int64_t> sequences{0};
  std::atomic<int64_t> resumes{0};

 private:
  void Loop() {
    const absl::Time start = absl::Now();
    const bool tty = isatty(2) != 0;
    bool printed = false;
    while (!done_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
      const double s = absl::ToDoubleSeconds(absl::Now() - start);
      const int64_t b = bytes.load(), t = total.load();
      std::string line =
          absl::StrFormat("[%s] %s%s, %.2f GB/s, %d sequences%s", what_, Gb(b),
                          t > 0 ? absl::StrFormat(" of %s (%.0f%%)", Gb(t), 100.0 * b / t) : "",
                          b / 1e9 / s, sequences.load(),
                          resumes.load() > 0 ? absl::StrCat(", ", resumes.load(), " resumed") : "");
      std::cerr << (tty ? "\r" : "") << line << (tty ? "" : "\n") << std::flush;
      printed = true;
    }
    if (printed && tty) std::cerr << "\n";
  }

  const std::string what_;
  absl::Notification done_;
  std::thread thread_;
};

int64_t PayloadBytes(const v1::KvChunk& c) {
  return static_cast<int64_t>(c.k().size() + c.v().size() + c.k_scale().size() +
                              c.v_scale().size());
}

// The export request the flags describe (cache_id and sequences; resume and
// transfer_id are set per attempt).
struct ExportFlags {
  std::string cache_id;
  std::vector<uint64_t> sequence_ids;
  int32_t token_begin = 0;
  std::optional<int32_t> token_end;
  int32_t max_chunk_bytes = 0;
};

v1::ExportSequencesRequest ExportRequest(const ExportFlags& f, const v1::ImportResumePoint* resume,
                                         const std::string& transfer_id) {
  v1::ExportSequencesRequest request;
  request.set_cache_id(f.cache_id);
  for (uint64_t id : f.sequence_ids) request.add_sequence_ids(id);
  request.set_token_begin(f.token_begin);
  if (f.token_end) request.set_token_end(*f.token_end);
  request.set_max_chunk_bytes(f.max_chunk_bytes);
  request.set_transfer_id(transfer_id);
  if (resume != nullptr) *request.mutable_resume() = *resume;
  return request;
}

// A deadline for a whole stream only when --timeout was given (a transfer of
// gigabytes outlives the per-call default).
void StreamContext(grpc::ClientContext* context, const std::string& cache_id) {
  context->AddMetadata(std::string(kCacheIdHeader), cache_id);
  if (FlagWasSet("timeout") && absl::GetFlag(FLAGS_timeout) != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
  }
}

// One ExportSequences stream as the chunk source PushChunks reads, counting
// what passes for the progress line.
class ExportStreamReader : public KvChunkReader {
 public:
  ExportStreamReader(const std::shared_ptr<grpc::Channel>& channel,
                     const v1::ExportSequencesRequest& request, TransferProgress* progress)
      : stub_(v1::KvTransfer::NewStub(channel)), progress_(progress) {
    StreamContext(&context_, request.cache_id());
    reader_ = stub_->ExportSequences(&context_, request);
  }
  ~ExportStreamReader() override {
    if (!finished_) {
      context_.TryCancel();
      reader_->Finish().ok();  // cancelled: the status says so, and nobody asks
    }
  }

  void Cancel() override { context_.TryCancel(); }

  absl::StatusOr<bool> Read(v1::KvChunk* chunk) override {
    if (reader_->Read(chunk)) {
      if (chunk->has_header() && progress_->total.load() == 0) {
        progress_->total = chunk->header().total_bytes();
      }
      progress_->bytes += PayloadBytes(*chunk);
      if (chunk->sequence_end()) ++progress_->sequences;
      return true;
    }
    finished_ = true;
    const absl::Status status = ToAbslStatus(reader_->Finish());
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("ExportSequences (the source): ", status.message()));
    }
    return false;
  }

 private:
  std::unique_ptr<v1::KvTransfer::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader_;
  TransferProgress* progress_;
  bool finished_ = false;
};

// The chunks of a file from a resume point on: the sequences the receiver
// committed are skipped, and so are the current one's rows it holds (a chunk
// holding some of them is cut to the rest, its CRC computed again). The
// header goes with the first chunk sent, carrying this transfer's id.
class FileChunkReader : public KvChunkReader {
 public:
  FileChunkReader(std::unique_ptr<KvChunkFileReader> file, const v1::ImportResumePoint* resume,
                  std::string transfer_id, TransferProgress* progress)
      : file_(std::move(file)), transfer_id_(std::move(transfer_id)), progress_(progress) {
    if (resume != nullptr) {
      resume_ = *resume;
      committed_.insert(resume->committed_sequence_ids().begin(),
                        resume->committed_sequence_ids().end());
    }
  }

  absl::StatusOr<bool> Read(v1::KvChunk* chunk) override {
    for (;;) {
      absl::StatusOr<bool> more = file_->Next(chunk);
      if (!more.ok() || !*more) return more;
      if (chunk->has_header()) {
        header_ = chunk->header();
        header_.set_transfer_id(transfer_id_);
        chunk->clear_header();
      }
      if (!Wanted(chunk)) continue;
      if (!header_sent_) {
        *chunk->mutable_header() = header_;
        header_sent_ = true;
      }
      progress_->bytes += PayloadBytes(*chunk);
      if (chunk->sequence_end()) ++progress_->sequences;
      return true;
    }
  }

 private:
  // Whether the receiver still needs (part of) `chunk`; cuts the rows it holds.
  bool Wanted(v1::KvChunk* chunk) {
    if (committed_.count(chunk->sequence_id()) > 0) return false;
    if (!resume_.has_sequence_id() || resume_.sequence_id() != chunk->sequence_id()) return true;
    if (chunk->layer() != resume_.layer()) return chunk->layer() > resume_.layer();
    const int32_t end = chunk->token_begin() + chunk->num_tokens();
    if (end <= resume_.token() && chunk->num_tokens() > 0) return false;
    const int32_t skip = resume_.token() - chunk->token_begin();
    if (skip <= 0) return true;
    // Rows are [num_tokens, Hkv, D] elements (scales [num_tokens, Hkv]): cut
    // the same share of each part.
    for (std::string* part : {chunk->mutable_k(), chunk->mutable_v(), chunk->mutable_k_scale(),
                              chunk->mutable_v_scale()}) {
      const size_t row = part->size() / chunk->num_tokens();
      part->erase(0, row * skip);
    }
    chunk->set_token_begin(resume_.token());
    chunk->set_num_tokens(end - resume_.token());
    chunk->set_crc32c(ChunkCrc32c(*chunk));
    return true;
  }

  std::unique_ptr<KvChunkFileReader> file_;
  const std::string transfer_id_;
  TransferProgress* progress_;
  v1::ImportResumePoint resume_;
  std::set<uint64_t> committed_;
  v1::KvTransferHeader header_;
  bool header_sent_ = false;
};

absl::StatusOr<std::vector<uint64_t>> SequenceIds() {
  return ParseSequenceIds(absl::GetFlag(FLAGS_seq));
}

// The flags a command takes, besides the global ones; others are usage errors.
int CheckFlags(const char* command, const std::vector<const char*>& takes) {
  for (const std::string& set : FlagsSet()) {
    if (IsGlobalFlag(set)) continue;
    bool applies = false;
    for (const char* f : takes) applies |= set == f;
    if (!applies) {
      return UsageError(command,
                        absl::StrCat("flag --", set, " does not apply to '", command, "'"));
    }
  }
  return kExitOk;
}

absl::StatusOr<ExportFlags> ReadExportFlags(const char* command) {
  ExportFlags f;
  f.cache_id = absl::GetFlag(FLAGS_cache);
  if (f.cache_id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(command, " needs --cache (the cache id)"));
  }
  absl::StatusOr<std::vector<uint64_t>> ids = SequenceIds();
  if (!ids.ok()) return ids.status();
  f.sequence_ids = *ids;
  f.token_begin = absl::GetFlag(FLAGS_token_begin);
  f.token_end = absl::GetFlag(FLAGS_token_end);
  f.max_chunk_bytes = absl::GetFlag(FLAGS_max_chunk_bytes);
  if (f.token_begin < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--token_begin: expected >= 0, got ", f.token_begin));
  }
  if (f.token_end && *f.token_end < f.token_begin) {
    return absl::InvalidArgumentError(absl::StrCat("--token_end: expected >= --token_begin (",
                                                   f.token_begin, "), got ", *f.token_end));
  }
  if (f.max_chunk_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_chunk_bytes: expected >= 0, got ", f.max_chunk_bytes));
  }
  return f;
}

// The receiver creates the cache when the capacity flags are given.
absl::StatusOr<std::optional<v1::CreateCacheRequest>> CreateFlags() {
  const int64_t tokens = absl::GetFlag(FLAGS_capacity_tokens);
  const int64_t bytes = absl::GetFlag(FLAGS_capacity_bytes);
  const std::optional<int> device = absl::GetFlag(FLAGS_device);
  const bool reserve = absl::GetFlag(FLAGS_reserve);
  if (tokens == 0 && bytes == 0) {
    if (device || reserve) {
      return absl::InvalidArgumentError(
          "--device/--reserve describe a cache the receiver creates: give --capacity_tokens or "
          "--capacity_bytes too");
    }
    return std::nullopt;
  }
  if ((tokens > 0) == (bytes > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "exactly one of --capacity_tokens and --capacity_bytes > 0, got ", tokens, " and ", bytes));
  }
  v1::CreateCacheRequest create;
  create.set_capacity_tokens(tokens);
  create.set_capacity_bytes(bytes);
  if (device) create.set_device(*device);
  create.set_reserve(reserve);
  return create;
}

MoveOptions BaseMoveOptions(const std::optional<v1::CreateCacheRequest>& create) {
  MoveOptions options;
  options.create = create;
  options.transfer_id = absl::GetFlag(FLAGS_transfer_id);
  options.max_resumes = kMaxResumes;
  if (FlagWasSet("timeout")) options.timeout = absl::GetFlag(FLAGS_timeout);
  return options;
}

void PrintMoved(const std::string& what, const MoveResult& r) {
  std::cout << what << ": " << r.sequences << " sequences, " << Gb(r.bytes) << " in "
            << absl::StrFormat("%.3f s (%.2f GB/s)", r.seconds,
                               r.seconds > 0 ? r.bytes / 1e9 / r.seconds : 0.0)
            << "\n"
            << "transfer:   " << r.transfer_id << "; " << r.resumes << " resumed, "
            << Gb(r.bytes_resent) << " sent again\n";
  std::cout << "data plane: " << r.data_plane
            << (r.data_plane_fallback.empty()
                    ? std::string()
                    : absl::StrCat(" (fallback from UCX: ", r.data_plane_fallback, ")"))
            << (r.lanes > 1 ? absl::StrCat(", ", r.lanes, " lanes") : std::string()) << "\n";
  const v1::CacheStats& s = r.dest_stats;
  std::cout << "receiver:   cache " << s.cache_id() << " (device " << s.device()
            << "): " << s.sequences() << " sequences, " << s.tokens() << " tokens, "
            << s.pages_used() << " pages used, " << s.pages_free() << " free\n";
}

int RunMove() {
  absl::StatusOr<ExportFlags> f = ReadExportFlags("move-kv");
  if (!f.ok()) return UsageError("move-kv", f.status().message());
  const std::string from = absl::GetFlag(FLAGS_from), to = absl::GetFlag(FLAGS_to);
  if (from.empty() || to.empty()) {
    return UsageError("move-kv", "move-kv needs --from and --to (the two servers' addresses)");
  }
  absl::StatusOr<std::optional<v1::CreateCacheRequest>> create = CreateFlags();
  if (!create.ok()) return UsageError("move-kv", create.status().message());
  absl::StatusOr<std::unique_ptr<AttentionClient>> source = MakeClientForTarget(from);
  if (!source.ok())
    return UsageError("move-kv", absl::StrCat("--from: ", source.status().message()));
  absl::StatusOr<std::unique_ptr<AttentionClient>> dest = MakeClientForTarget(to);
  if (!dest.ok()) return UsageError("move-kv", absl::StrCat("--to: ", dest.status().message()));
  const std::string dest_cache =
      absl::GetFlag(FLAGS_to_cache).empty() ? f->cache_id : absl::GetFlag(FLAGS_to_cache);

  MoveOptions options = BaseMoveOptions(*create);
  options.dest_cache_id = dest_cache;
  const std::shared_ptr<grpc::Channel> source_channel = (*source)->channel(0);
  absl::StatusOr<MoveResult> moved;
  const std::string data_plane = absl::GetFlag(FLAGS_data_plane);
  const int lanes = absl::GetFlag(FLAGS_lanes);
  if (data_plane != "grpc" && data_plane != "ucx") {
    return UsageError("move-kv",
                      absl::StrCat("--data_plane: expected grpc or ucx, got '", data_plane, "'"));
  }
  if (lanes < 1) {
    return UsageError("move-kv", absl::StrCat("--lanes: expected >= 1, got ", lanes));
  }
  if (data_plane != "grpc" || lanes > 1) {
    // The servers move the pages (or several transfers run): MoveCache.
    options.data_plane = data_plane;
    options.lanes = lanes;
    options.sequence_ids = f->sequence_ids;
    options.token_begin = f->token_begin;
    options.token_end = f->token_end;
    options.max_chunk_bytes = f->max_chunk_bytes;
    moved = MoveCache(source_channel, (*dest)->channel(0), f->cache_id, options);
  } else {
    TransferProgress progress("move-kv");
    const ExportFlags& flags = *f;
    OpenChunks open =
        [&](const v1::ImportResumePoint* resume,
            const std::string& transfer_id) -> absl::StatusOr<std::unique_ptr<KvChunkReader>> {
      if (resume != nullptr) ++progress.resumes;
      return std::make_unique<ExportStreamReader>(
          source_channel, ExportRequest(flags, resume, transfer_id), &progress);
    };
    moved = PushChunks((*dest)->channel(0), dest_cache, open, options);
  }
  if (!moved.ok()) return PrintError("move-kv failed", moved.status());
  PrintMoved(absl::StrCat("moved cache ", f->cache_id, " from ", from, " to ", to,
                          dest_cache == f->cache_id ? "" : absl::StrCat(" as ", dest_cache)),
             *moved);
  return kExitOk;
}

// Where the receiver of what `file` holds so far would stand: the sequences
// ended in it, and the row after the last chunk of the current one.
v1::ImportResumePoint ResumeAfter(const v1::KvTransferHeader& header,
                                  const std::vector<uint64_t>& ended, const v1::KvChunk* last) {
  v1::ImportResumePoint point;
  for (uint64_t id : ended) point.add_committed_sequence_ids(id);
  if (last == nullptr || last->sequence_end()) return point;
  point.set_sequence_id(last->sequence_id());
  int32_t layer = last->layer();
  int32_t token = last->token_begin() + last->num_tokens();
  for (const v1::SequenceLengths& s : header.sequences()) {
    // A layer written to its end: the next row is the next layer's first.
    if (s.sequence_id() == last->sequence_id() && layer < s.lengths_size() &&
        token >= s.lengths(layer) && layer + 1 < s.lengths_size()) {
      ++layer;
      token = header.token_begin();
    }
  }
  point.set_layer(layer);
  point.set_token(token);
  return point;
}

int RunExport() {
  absl::StatusOr<ExportFlags> f = ReadExportFlags("export-kv");
  if (!f.ok()) return UsageError("export-kv", f.status().message());
  const std::string path = absl::GetFlag(FLAGS_out);
  if (path.empty()) return UsageError("export-kv", "export-kv needs --out (the file to write)");
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = MakeClientFromFlags();
  if (!client.ok()) return UsageError("export-kv", client.status().message());
  absl::StatusOr<std::unique_ptr<KvChunkFileWriter>> writer = KvChunkFileWriter::Create(path);
  if (!writer.ok()) return UsageError("export-kv", writer.status().message());

  const absl::Time start = absl::Now();
  std::unique_ptr<v1::KvTransfer::Stub> stub = v1::KvTransfer::NewStub((*client)->channel(0));
  v1::KvTransferHeader header;
  bool have_header = false;
  std::vector<uint64_t> ended;
  v1::KvChunk chunk, last;
  bool have_last = false;
  int resumes = 0;
  int64_t chunks = 0;
  TransferProgress progress("export-kv");
  for (;;) {
    std::optional<v1::ImportResumePoint> resume;
    if (have_header) resume = ResumeAfter(header, ended, have_last ? &last : nullptr);
    grpc::ClientContext context;
    StreamContext(&context, f->cache_id);
    std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader = stub->ExportSequences(
        &context, ExportRequest(*f, resume ? &*resume : nullptr, header.transfer_id()));
    while (reader->Read(&chunk)) {
      if (chunk.has_header()) {
        if (have_header) {
          chunk.clear_header();  // a resumed stream sends it again; the file has it
        } else {
          header = chunk.header();
          have_header = true;
          progress.total = header.total_bytes();
        }
      }
      const absl::Status written = (*writer)->Write(chunk);
      if (!written.ok()) {
        context.TryCancel();
        reader->Finish().ok();  // cancelled: the write's error is the answer
        return PrintError("export-kv failed", written);
      }
      ++chunks;
      progress.bytes += PayloadBytes(chunk);
      if (chunk.sequence_end()) {
        ended.push_back(chunk.sequence_id());
        ++progress.sequences;
      }
      last.Swap(&chunk);
      have_last = true;
    }
    const absl::Status status = ToAbslStatus(reader->Finish());
    if (status.ok()) break;
    // A cut before the header came resumes from the start; after it, from
    // the last chunk in the file.
    if (!Resumable(status) || resumes == kMaxResumes) {
      return PrintError(absl::StrCat("ExportSequences failed after ", chunks, " chunks"), status);
    }
    ++resumes;
    ++progress.resumes;
  }
  if (!have_header) {
    // An export of no sequence sends no chunk, so there is no header to write.
    return PrintError("export-kv failed",
                      absl::FailedPreconditionError(absl::StrCat(
                          "the export sent no chunk: cache ", f->cache_id,
                          " has no live sequences (or none of --seq); nothing written")));
  }
  const absl::Status committed = (*writer)->Commit();
  if (!committed.ok()) return PrintError("export-kv failed", committed);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::cout << "exported cache " << f->cache_id << " to " << path << ": " << ended.size()
            << " sequences, " << chunks << " chunks, " << Gb(progress.bytes.load()) << " of K/V in "
            << absl::StrFormat("%.3f s (%.2f GB/s)", seconds, progress.bytes.load() / 1e9 / seconds)
            << (resumes > 0 ? absl::StrCat(", ", resumes, " resumed") : "") << "\n";
  return kExitOk;
}

int RunImport() {
  const std::string path = absl::GetFlag(FLAGS_in);
  if (path.empty()) return UsageError("import-kv", "import-kv needs --in (the chunk file)");
  const std::string cache_id = absl::GetFlag(FLAGS_cache);
  if (cache_id.empty()) return UsageError("import-kv", "import-kv needs --cache (the cache id)");
  absl::StatusOr<std::optional<v1::CreateCacheRequest>> create = CreateFlags();
  if (!create.ok()) return UsageError("import-kv", create.status().message());
  // Checked whole before anything is sent: a damaged file changes nothing.
  absl::StatusOr<KvChunkFileSummary> summary = CheckChunkFile(path);
  if (!summary.ok()) return UsageError("import-kv", summary.status().message());
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = MakeClientFromFlags();
  if (!client.ok()) return UsageError("import-kv", client.status().message());

  MoveOptions options = BaseMoveOptions(*create);
  options.dest_cache_id = cache_id;
  absl::StatusOr<MoveResult> moved;
  {
    TransferProgress progress("import-kv");
    progress.total = summary->payload_bytes;
    OpenChunks open =
        [&](const v1::ImportResumePoint* resume,
            const std::string& transfer_id) -> absl::StatusOr<std::unique_ptr<KvChunkReader>> {
      absl::StatusOr<std::unique_ptr<KvChunkFileReader>> file = KvChunkFileReader::Open(path);
      if (!file.ok()) return file.status();
      if (resume != nullptr) ++progress.resumes;
      return std::make_unique<FileChunkReader>(*std::move(file), resume, transfer_id, &progress);
    };
    moved = PushChunks((*client)->channel(0), cache_id, open, options);
  }
  if (!moved.ok()) return PrintError("import-kv failed", moved.status());
  PrintMoved(absl::StrCat("imported ", path, " into cache ", cache_id), *moved);
  return kExitOk;
}

}  // namespace

int RunMoveKv(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return UsageError("move-kv", absl::StrCat("move-kv takes no arguments, got '", args[0], "'"));
  }
  const int bad =
      CheckFlags("move-kv", {"from", "to", "cache", "to_cache", "seq", "token_begin", "token_end",
                             "max_chunk_bytes", "transfer_id", "capacity_tokens", "capacity_bytes",
                             "device", "reserve", "data_plane", "lanes"});
  return bad != kExitOk ? bad : RunMove();
}

int RunExportKv(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return UsageError("export-kv",
                      absl::StrCat("export-kv takes no arguments, got '", args[0], "'"));
  }
  const int bad = CheckFlags(
      "export-kv", {"cache", "out", "seq", "token_begin", "token_end", "max_chunk_bytes"});
  return bad != kExitOk ? bad : RunExport();
}

int RunImportKv(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return UsageError("import-kv",
                      absl::StrCat("import-kv takes no arguments, got '", args[0], "'"));
  }
  const int bad = CheckFlags("import-kv", {"in", "cache", "transfer_id", "capacity_tokens",
                                           "capacity_bytes", "device", "reserve"});
  return bad != kExitOk ? bad : RunImport();
}

}  // namespace cli
}  // namespace attnserve
