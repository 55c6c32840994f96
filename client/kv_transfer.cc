// MoveCache and PushChunks; see kv_transfer.h.
#include "client/kv_transfer.h"

#include <grpcpp/client_context.h>

#include <algorithm>
#include <deque>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/cache_id_header.h"
#include "common/grpc_status.h"

namespace attnserve {
namespace {

int64_t PayloadBytes(const v1::KvChunk& c) {
  return static_cast<int64_t>(c.k().size() + c.v().size() + c.k_scale().size() +
                              c.v_scale().size());
}

std::string RandomTransferId() {
  std::random_device rd;
  std::mt19937_64 rng((uint64_t{rd()} << 32) ^ rd() ^ uint64_t(absl::ToUnixNanos(absl::Now())));
  return absl::StrCat("move-", absl::Hex(rng(), absl::kZeroPad16));
}

// A break worth a resume: the stream, not the request, failed.
bool Resumable(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:  // the chunk was not kept; a resume sends it again
    case absl::StatusCode::kDeadlineExceeded: return true;
    default: return false;
  }
}

void Prepare(grpc::ClientContext* context, const std::multimap<std::string, std::string>& metadata,
             const std::string& cache_id, absl::Time deadline) {
  for (const auto& [key, value] : metadata) context->AddMetadata(key, value);
  context->AddMetadata(kCacheIdHeader, cache_id);
  if (deadline != absl::InfiniteFuture()) context->set_deadline(absl::ToChronoTime(deadline));
}

// Chunks read ahead of the import, bounded in payload bytes (one chunk
// always fits). Closed by the reader (end or error) or by the writer (stop).
class ChunkQueue {
 public:
  explicit ChunkQueue(int64_t max_bytes) : max_bytes_(max_bytes) {}

  // False when the writer stopped the transfer.
  bool Push(v1::KvChunk chunk) {
    const int64_t bytes = PayloadBytes(chunk);
    absl::MutexLock lock(&mu_);
    auto room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopped_ || queue_.empty() || held_ + bytes <= max_bytes_;
    };
    mu_.Await(absl::Condition(&room));
    if (stopped_) return false;
    held_ += bytes;
    queue_.push_back(std::move(chunk));
    return true;
  }
  void Close(absl::Status status) {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    status_ = std::move(status);
  }
  void Stop() {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
  }
  // A chunk (true), or the end (false with *status the reader's).
  bool Pop(v1::KvChunk* chunk, absl::Status* status) {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || closed_; };
    mu_.Await(absl::Condition(&ready));
    if (queue_.empty()) {
      *status = status_;
      return false;
    }
    *chunk = std::move(queue_.front());
    queue_.pop_front();
    held_ -= PayloadBytes(*chunk);
    return true;
  }

 private:
  const int64_t max_bytes_;
  absl::Mutex mu_;
  std::deque<v1::KvChunk> queue_ ABSL_GUARDED_BY(mu_);
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

using Key = std::tuple<uint64_t, int32_t, int32_t>;

// The export side of a move over a data plane (DataPlaneSender): for
// MoveCache, an export with header_only and one whose chunks the source
// server sends to the offer itself.
using DataPlaneExport = DataPlaneSender;

// One attempt: the import stream from its first message to its end.
struct Attempt {
  absl::Status status;  // OK: every sequence live
  bool wrote_any = false;
};

class Pusher {
 public:
  Pusher(const std::shared_ptr<grpc::Channel>& dest, std::string cache_id, const OpenChunks& open,
         const MoveOptions& options, const DataPlaneExport* data_plane = nullptr)
      : data_plane_(data_plane),
        stub_(v1::KvTransfer::NewStub(dest)),
        cache_id_(std::move(cache_id)),
        open_(open),
        options_(options),
        deadline_(options.timeout == absl::InfiniteDuration() ? absl::InfiniteFuture()
                                                              : absl::Now() + options.timeout) {
    result_.transfer_id = options.transfer_id.empty() ? RandomTransferId() : options.transfer_id;
  }

  absl::StatusOr<MoveResult> Run() {
    const absl::Time start = absl::Now();
    result_.data_plane = "grpc";
    while (true) {
      const absl::Status status = data_plane_ != nullptr ? OnceDataPlane() : Once();
      if (status.ok()) break;
      if (!Resumable(status) || result_.resumes >= options_.max_resumes) {
        return absl::Status(status.code(),
                            absl::StrCat("transfer '", result_.transfer_id, "' after ",
                                         result_.resumes, " resume(s): ", status.message()));
      }
      ++result_.resumes;
      // A cut stream may still hold the receiver's session for a moment.
      absl::SleepFor(
          std::min(absl::Milliseconds(20) * (1 << std::min(result_.resumes, 6)), absl::Seconds(1)));
    }
    result_.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    return result_;
  }

 private:
  // One attempt over the data plane: the import asks for it, the export
  // sends the chunks there; this thread only waits for both. A receiver
  // without one sends this and every later attempt down the gRPC path.
  absl::Status OnceDataPlane() {
    if (!header_.has_value()) {
      absl::StatusOr<v1::KvTransferHeader> header = data_plane_->header(result_.transfer_id);
      if (!header.ok()) return header.status();
      header_ = *std::move(header);
    }
    grpc::ClientContext context;
    Prepare(&context, options_.dest_metadata, cache_id_, deadline_);
    auto stream = stub_->ImportSequences(&context);
    v1::ImportSequencesRequest opening;
    opening.set_cache_id(cache_id_);
    if (options_.create.has_value()) *opening.mutable_create() = *options_.create;
    *opening.mutable_header() = *header_;
    opening.set_data_plane(options_.data_plane);
    v1::ImportSequencesResponse answer;
    if (!stream->Write(opening) || !stream->Read(&answer)) return ToAbslStatus(stream->Finish());
    result_.dest_stats = answer.stats();
    if (!answer.has_data_plane()) {
      // No data plane there: end this stream (the receiver lets the session
      // go before it answers) and carry on in the gRPC streams.
      result_.data_plane_fallback = answer.data_plane_refused().empty()
                                        ? "the receiver answered no data plane"
                                        : answer.data_plane_refused();
      data_plane_ = nullptr;
      stream->WritesDone();
      v1::ImportSequencesResponse rest;
      while (stream->Read(&rest)) {
      }
      stream->Finish().ok();  // ABORTED (nothing sent yet) is expected
      if (options_.data_plane_required) return Required();
      return Once();
    }
    result_.data_plane = "ucx";
    const v1::ImportResumePoint at = answer.resume();
    const bool fresh = at.committed_sequence_ids_size() == 0 && !at.has_sequence_id();
    const int64_t kept_before = answer.bytes_received();
    absl::Mutex answers_mu;
    v1::ImportSequencesResponse last = answer;
    std::thread answers([&] {
      v1::ImportSequencesResponse r;
      while (stream->Read(&r)) {
        absl::MutexLock lock(&answers_mu);
        last = r;
      }
    });
    const absl::StatusOr<int64_t> sent =
        data_plane_->run(fresh ? nullptr : &at, result_.transfer_id, answer.data_plane());
    // A half-close: the receiver stops its data plane and answers what it kept.
    stream->WritesDone();
    answers.join();
    const absl::Status finished = ToAbslStatus(stream->Finish());
    {
      absl::MutexLock lock(&answers_mu);
      result_.dest_stats = last.stats();
      result_.sequences = last.resume().committed_sequence_ids_size();
      result_.bytes += std::max<int64_t>(0, last.bytes_received() - kept_before);
    }
    if (absl::IsUnimplemented(sent.status())) {
      // The source sends nothing over UCX: the rest goes in the gRPC streams
      // (the receiver kept nothing from this attempt; Once resumes there).
      result_.data_plane = "grpc";
      result_.data_plane_fallback = std::string(sent.status().message());
      data_plane_ = nullptr;
      if (options_.data_plane_required) return Required();
      return Once();
    }
    if (!sent.ok()) return sent.status();
    return finished;
  }

  // data_plane_required and no data plane: nothing was sent.
  absl::Status Required() const {
    return absl::FailedPreconditionError(
        absl::StrCat("data_plane: \"", options_.data_plane,
                     "\" required, not offered: ", result_.data_plane_fallback));
  }

  absl::Status Once() {
    std::unique_ptr<KvChunkReader> reader;
    std::optional<v1::KvChunk> first;
    if (!header_.has_value()) {
      // The header comes with the export's first chunk.
      auto opened = open_(nullptr, result_.transfer_id);
      if (!opened.ok()) return opened.status();
      reader = *std::move(opened);
      v1::KvChunk chunk;
      auto more = reader->Read(&chunk);
      if (!more.ok()) return more.status();
      if (!*more || !chunk.has_header()) {
        return absl::InternalError("the export's first chunk carries no header");
      }
      header_ = chunk.header();
      chunk.clear_header();
      first = std::move(chunk);
    }
    grpc::ClientContext context;
    Prepare(&context, options_.dest_metadata, cache_id_, deadline_);
    auto stream = stub_->ImportSequences(&context);
    v1::ImportSequencesRequest opening;
    opening.set_cache_id(cache_id_);
    if (options_.create.has_value()) *opening.mutable_create() = *options_.create;
    *opening.mutable_header() = *header_;
    v1::ImportSequencesResponse answer;
    if (!stream->Write(opening) || !stream->Read(&answer)) {
      if (reader != nullptr) reader->Cancel();
      return ToAbslStatus(stream->Finish());
    }
    result_.dest_stats = answer.stats();
    const v1::ImportResumePoint& at = answer.resume();
    const bool fresh = at.committed_sequence_ids_size() == 0 && !at.has_sequence_id();
    if (reader == nullptr || !fresh) {
      // A resume (or a receiver further on than this sender knew): the
      // export starts where the receiver stands.
      if (reader != nullptr) reader->Cancel();
      first.reset();
      auto opened = open_(fresh ? nullptr : &at, result_.transfer_id);
      if (!opened.ok()) {
        context.TryCancel();
        stream->Finish();
        return opened.status();
      }
      reader = *std::move(opened);
    }

    // Answers: read on their own thread, so the receiver never waits on us.
    absl::Mutex answers_mu;
    v1::ImportSequencesResponse last = answer;
    std::thread answers([&] {
      v1::ImportSequencesResponse r;
      while (stream->Read(&r)) {
        absl::MutexLock lock(&answers_mu);
        last = r;
      }
    });
    // Chunks: read ahead on their own thread into the bounded queue.
    ChunkQueue queue(std::max<int64_t>(options_.max_buffered_bytes, 1));
    std::thread producer([&] {
      if (first.has_value() && !queue.Push(*std::move(first))) return queue.Close({});
      while (true) {
        v1::KvChunk chunk;
        absl::StatusOr<bool> more = reader->Read(&chunk);
        if (!more.ok()) return queue.Close(more.status());
        if (!*more) return queue.Close(absl::OkStatus());
        chunk.clear_header();  // the opening message carried it
        if (!queue.Push(std::move(chunk))) return queue.Close({});
      }
    });

    absl::Status broken;  // why this attempt stopped early
    bool write_failed = false;
    v1::KvChunk chunk;
    absl::Status source;
    while (queue.Pop(&chunk, &source)) {
      if (options_.fault_for_testing) {
        broken = options_.fault_for_testing(offered_++, chunk);
        if (!broken.ok()) break;
      }
      v1::ImportSequencesRequest message;
      *message.mutable_chunk() = std::move(chunk);
      if (!stream->Write(message)) {
        write_failed = true;
        broken = absl::UnavailableError("the import stream broke");
        break;
      }
      const v1::KvChunk& sent = message.chunk();
      const int64_t bytes = PayloadBytes(sent);
      const Key key{sent.sequence_id(), sent.layer(), sent.token_begin()};
      if (!sent_.insert(key).second) result_.bytes_resent += bytes;
      result_.bytes += bytes;
    }
    if (broken.ok() && !source.ok()) broken = source;
    // Stop the reader side, then end the import: a half-close lets the
    // receiver keep every chunk written (a cut connection would lose the
    // ones in flight, which a resume sends again).
    queue.Stop();
    reader->Cancel();
    producer.join();
    // The fault seam's CANCELLED cuts the connection instead.
    if (absl::IsCancelled(broken)) context.TryCancel();
    stream->WritesDone();
    answers.join();
    const absl::Status finished = ToAbslStatus(stream->Finish());
    {
      absl::MutexLock lock(&answers_mu);
      result_.dest_stats = last.stats();
      result_.sequences = last.resume().committed_sequence_ids_size();
    }
    // A write fails when the receiver ended the stream: its status says why.
    if (write_failed && !finished.ok()) return finished;
    if (!broken.ok()) return broken;
    return finished;
  }

  const DataPlaneExport* data_plane_;
  const std::unique_ptr<v1::KvTransfer::Stub> stub_;
  const std::string cache_id_;
  const OpenChunks& open_;
  const MoveOptions& options_;
  const absl::Time deadline_;
  std::optional<v1::KvTransferHeader> header_;
  std::set<Key> sent_;   // chunks written (a resent one counts in bytes_resent)
  int64_t offered_ = 0;  // chunks taken from the queue, across attempts (the fault seam's index)
  MoveResult result_;
};

// An ExportSequences stream as a chunk reader.
class ExportReader final : public KvChunkReader {
 public:
  ExportReader(v1::KvTransfer::Stub* stub, const v1::ExportSequencesRequest& request,
               const MoveOptions& options, absl::Time deadline) {
    Prepare(&context_, options.source_metadata, request.cache_id(), deadline);
    reader_ = stub->ExportSequences(&context_, request);
  }
  ~ExportReader() override {
    if (finished_) return;
    // A stream is finished before it goes, even one given up on.
    context_.TryCancel();
    v1::KvChunk rest;
    while (reader_->Read(&rest)) {
    }
    reader_->Finish();
  }
  absl::StatusOr<bool> Read(v1::KvChunk* chunk) override {
    if (finished_) return false;
    if (reader_->Read(chunk)) return true;
    finished_ = true;
    const absl::Status status = ToAbslStatus(reader_->Finish());
    if (!status.ok())
      return absl::Status(status.code(), absl::StrCat("export: ", status.message()));
    return false;
  }
  void Cancel() override { context_.TryCancel(); }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::KvChunk>> reader_;
  bool finished_ = false;
};

}  // namespace

absl::StatusOr<MoveResult> PushChunks(const std::shared_ptr<grpc::Channel>& dest,
                                      const std::string& dest_cache_id, const OpenChunks& open,
                                      const MoveOptions& options) {
  return Pusher(dest, dest_cache_id, open, options).Run();
}

absl::StatusOr<MoveResult> PushChunks(const std::shared_ptr<grpc::Channel>& dest,
                                      const std::string& dest_cache_id, const OpenChunks& open,
                                      const MoveOptions& options, const DataPlaneSender& sender) {
  if (options.data_plane == "grpc") return PushChunks(dest, dest_cache_id, open, options);
  if (options.data_plane != "ucx") {
    return absl::InvalidArgumentError(
        absl::StrCat("data_plane: expected \"grpc\" or \"ucx\", got '", options.data_plane, "'"));
  }
  return Pusher(dest, dest_cache_id, open, options, &sender).Run();
}

namespace {

v1::ExportSequencesRequest BaseExport(const std::string& cache_id, const MoveOptions& options,
                                      const v1::ImportResumePoint* resume,
                                      const std::string& transfer_id) {
  v1::ExportSequencesRequest request;
  request.set_cache_id(cache_id);
  for (uint64_t id : options.sequence_ids) request.add_sequence_ids(id);
  request.set_token_begin(options.token_begin);
  if (options.token_end.has_value()) request.set_token_end(*options.token_end);
  if (resume != nullptr) *request.mutable_resume() = *resume;
  request.set_max_chunk_bytes(options.max_chunk_bytes);
  request.set_transfer_id(transfer_id);
  return request;
}

// An export with header_only: the transfer's header.
absl::StatusOr<v1::KvTransferHeader> ExportHeader(v1::KvTransfer::Stub* stub,
                                                  v1::ExportSequencesRequest request,
                                                  const MoveOptions& options, absl::Time deadline) {
  request.set_header_only(true);
  grpc::ClientContext context;
  Prepare(&context, options.source_metadata, request.cache_id(), deadline);
  auto reader = stub->ExportSequences(&context, request);
  v1::KvChunk chunk;
  std::optional<v1::KvTransferHeader> header;
  while (reader->Read(&chunk)) {
    if (chunk.has_header() && !header.has_value()) header = chunk.header();
  }
  const absl::Status status = ToAbslStatus(reader->Finish());
  if (!status.ok()) return absl::Status(status.code(), absl::StrCat("export: ", status.message()));
  if (!header.has_value()) return absl::InternalError("export: the header-only export sent none");
  return *header;
}

// Lanes: the sequences in contiguous shares, each moved by a MoveCache of
// its own at the same time.
absl::StatusOr<MoveResult> MoveLanes(const std::shared_ptr<grpc::Channel>& source,
                                     const std::shared_ptr<grpc::Channel>& dest,
                                     const std::string& cache_id, const MoveOptions& options) {
  const absl::Time start = absl::Now();
  auto stub = v1::KvTransfer::NewStub(source);
  const absl::Time deadline = options.timeout == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + options.timeout;
  const std::string base = options.transfer_id.empty() ? RandomTransferId() : options.transfer_id;
  absl::StatusOr<v1::KvTransferHeader> header =
      ExportHeader(stub.get(), BaseExport(cache_id, options, nullptr, base), options, deadline);
  if (!header.ok()) return header.status();
  std::vector<uint64_t> ids;
  for (const v1::SequenceLengths& s : header->sequences()) ids.push_back(s.sequence_id());
  const int lanes = std::max(1, std::min<int>(options.lanes, static_cast<int>(ids.size())));
  std::vector<absl::StatusOr<MoveResult>> results(size_t(lanes), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int l = 0; l < lanes; ++l) {
    MoveOptions lane = options;
    lane.lanes = 1;
    lane.transfer_id = absl::StrCat(base, "-l", l);
    const size_t from = ids.size() * size_t(l) / size_t(lanes);
    const size_t to = ids.size() * size_t(l + 1) / size_t(lanes);
    lane.sequence_ids.assign(ids.begin() + long(from), ids.begin() + long(to));
    threads.emplace_back(
        [&, l, lane] { results[size_t(l)] = MoveCache(source, dest, cache_id, lane); });
  }
  for (std::thread& t : threads) t.join();
  MoveResult out;
  out.transfer_id = base;
  out.lanes = lanes;
  out.data_plane = "";
  for (absl::StatusOr<MoveResult>& r : results) {
    if (!r.ok()) return r.status();
    out.bytes += r->bytes;
    out.bytes_resent += r->bytes_resent;
    out.sequences += r->sequences;
    out.resumes += r->resumes;
    if (out.data_plane.empty() || r->data_plane == "grpc") out.data_plane = r->data_plane;
    if (out.data_plane_fallback.empty()) out.data_plane_fallback = r->data_plane_fallback;
    if (r->dest_stats.sequences() >= out.dest_stats.sequences()) out.dest_stats = r->dest_stats;
  }
  out.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return out;
}

}  // namespace

absl::StatusOr<MoveResult> MoveCache(const std::shared_ptr<grpc::Channel>& source,
                                     const std::shared_ptr<grpc::Channel>& dest,
                                     const std::string& cache_id, const MoveOptions& options) {
  if (options.data_plane != "grpc" && options.data_plane != "ucx") {
    return absl::InvalidArgumentError(
        absl::StrCat("data_plane: expected \"grpc\" or \"ucx\", got '", options.data_plane, "'"));
  }
  if (options.lanes > 1) return MoveLanes(source, dest, cache_id, options);
  auto stub = v1::KvTransfer::NewStub(source);
  const absl::Time deadline = options.timeout == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + options.timeout;
  OpenChunks open =
      [&](const v1::ImportResumePoint* resume,
          const std::string& transfer_id) -> absl::StatusOr<std::unique_ptr<KvChunkReader>> {
    return std::unique_ptr<KvChunkReader>(new ExportReader(
        stub.get(), BaseExport(cache_id, options, resume, transfer_id), options, deadline));
  };
  const std::string dest_cache = options.dest_cache_id.empty() ? cache_id : options.dest_cache_id;
  if (options.data_plane == "grpc") return PushChunks(dest, dest_cache, open, options);
  DataPlaneExport plane;
  plane.header = [&](const std::string& transfer_id) {
    return ExportHeader(stub.get(), BaseExport(cache_id, options, nullptr, transfer_id), options,
                        deadline);
  };
  plane.run = [&](const v1::ImportResumePoint* resume, const std::string& transfer_id,
                  const v1::KvDataPlane& offer) -> absl::StatusOr<int64_t> {
    v1::ExportSequencesRequest request = BaseExport(cache_id, options, resume, transfer_id);
    *request.mutable_data_plane() = offer;
    grpc::ClientContext context;
    Prepare(&context, options.source_metadata, cache_id, deadline);
    // The seam's cut may come after this attempt: it then finds no context.
    struct Cut {
      absl::Mutex mu;
      grpc::ClientContext* context ABSL_GUARDED_BY(mu) = nullptr;
    };
    auto cut = std::make_shared<Cut>();
    {
      absl::MutexLock lock(&cut->mu);
      cut->context = &context;
    }
    if (options.data_plane_started_for_testing) {
      options.data_plane_started_for_testing([cut] {
        absl::MutexLock lock(&cut->mu);
        if (cut->context != nullptr) cut->context->TryCancel();
      });
    }
    auto reader = stub->ExportSequences(&context, request);
    v1::KvChunk chunk;
    int64_t bytes = 0;
    while (reader->Read(&chunk)) bytes += chunk.data_plane_bytes();
    const absl::Status status = ToAbslStatus(reader->Finish());
    {
      absl::MutexLock lock(&cut->mu);
      cut->context = nullptr;
    }
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("export over UCX: ", status.message()));
    }
    return bytes;
  };
  return Pusher(dest, dest_cache, open, options, &plane).Run();
}

}  // namespace attnserve
