// A K/V snapshot on disk (`attnctl export-kv --out`, `import-kv --in`): the
// KvChunk messages of one export (kv_transfer.proto), in the order the
// export sent them, each preceded by its length as a base-128 varint
// (protobuf's delimited form, so any protobuf library reads it: Python's
// attnserve.transfer writes and reads the same files). The first chunk
// carries the transfer's header; every chunk keeps its CRC-32C.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/kv_transfer.pb.h"

namespace attnserve {
namespace cli {

// CRC-32C of k, v, k_scale, v_scale as one byte string (KvChunk.crc32c).
uint32_t ChunkCrc32c(const v1::KvChunk& chunk);

// Writes to "<path>.partial" and renames it to `path` at Commit, so a
// failed export leaves no file that looks whole.
class KvChunkFileWriter {
 public:
  // INVALID_ARGUMENT naming --out when the file cannot be created.
  static absl::StatusOr<std::unique_ptr<KvChunkFileWriter>> Create(const std::string& path);
  ~KvChunkFileWriter();  // removes the partial file unless committed

  absl::Status Write(const v1::KvChunk& chunk);
  absl::Status Commit();
  int64_t bytes_written() const { return offset_; }

 private:
  KvChunkFileWriter(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  std::string path_;
  std::FILE* file_;
  int64_t offset_ = 0;
  bool committed_ = false;
  std::string buffer_;
};

class KvChunkFileReader {
 public:
  // INVALID_ARGUMENT naming --in when the file cannot be opened.
  static absl::StatusOr<std::unique_ptr<KvChunkFileReader>> Open(const std::string& path);
  ~KvChunkFileReader();

  // The next chunk into *chunk: true, or false at the end of the file.
  // INVALID_ARGUMENT naming the file, the chunk's index and byte offset for a
  // truncated length or message, a length past kMaxChunkMessageBytes, or
  // bytes that do not parse as a KvChunk.
  absl::StatusOr<bool> Next(v1::KvChunk* chunk);

  int64_t index() const { return index_; }    // chunks read so far
  int64_t offset() const { return offset_; }  // bytes read so far

 private:
  KvChunkFileReader(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  absl::Status Error(int64_t at, const std::string& what) const;

  std::string path_;
  std::FILE* file_;
  int64_t index_ = 0;
  int64_t offset_ = 0;
  std::string buffer_;
};

// A chunk's message is at most this long (an export's chunks are at most
// 2 GiB of payload by the proto's int32 max_chunk_bytes).
inline constexpr uint64_t kMaxChunkMessageBytes = uint64_t{1} << 31;

// What a whole file holds, after checking it: every message parses, the
// first (and only the first) carries a header, each chunk's CRC-32C matches
// its bytes, and each chunk's sequence is one of the header's.
struct KvChunkFileSummary {
  v1::KvTransferHeader header;
  int64_t chunks = 0;
  int64_t payload_bytes = 0;
  int64_t sequences_ended = 0;  // chunks with sequence_end
};
// INVALID_ARGUMENT naming the file, the chunk (index, byte offset, sequence,
// layer, tokens) and what is wrong.
absl::StatusOr<KvChunkFileSummary> CheckChunkFile(const std::string& path);

}  // namespace cli
}  // namespace attnserve
