// K/V chunk files (kv_chunk_file.h).
#include "client/cli/kv_chunk_file.h"

#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"

namespace attnserve {
namespace cli {

uint32_t ChunkCrc32c(const v1::KvChunk& chunk) {
  uint32_t crc = 0;
  for (const std::string* part : {&chunk.k(), &chunk.v(), &chunk.k_scale(), &chunk.v_scale()}) {
    crc = Crc32cExtend(crc, part->data(), part->size());
  }
  return crc;
}

absl::StatusOr<std::unique_ptr<KvChunkFileWriter>> KvChunkFileWriter::Create(
    const std::string& path) {
  const std::string partial = path + ".partial";
  std::FILE* file = std::fopen(partial.c_str(), "wb");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--out: cannot create ", partial, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<KvChunkFileWriter>(new KvChunkFileWriter(path, file));
}

KvChunkFileWriter::~KvChunkFileWriter() {
  if (file_ != nullptr) std::fclose(file_);
  if (!committed_) std::remove((path_ + ".partial").c_str());
}

absl::Status KvChunkFileWriter::Write(const v1::KvChunk& chunk) {
  buffer_.clear();
  uint64_t n = chunk.ByteSizeLong();
  do {  // the length, 7 bits a byte, low bits first
    buffer_.push_back(static_cast<char>((n & 0x7f) | (n > 0x7f ? 0x80 : 0)));
    n >>= 7;
  } while (n != 0);
  if (!chunk.AppendToString(&buffer_)) {
    return absl::InternalError("encoding a KvChunk for the file failed");
  }
  if (std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size()) {
    return absl::InternalError(
        absl::StrCat("writing ", path_, ".partial failed: ", std::strerror(errno)));
  }
  offset_ += static_cast<int64_t>(buffer_.size());
  return absl::OkStatus();
}

absl::Status KvChunkFileWriter::Commit() {
  const int flushed = std::fflush(file_);
  const int closed = std::fclose(file_);
  file_ = nullptr;
  if (flushed != 0 || closed != 0) {
    return absl::InternalError(
        absl::StrCat("writing ", path_, ".partial failed: ", std::strerror(errno)));
  }
  if (std::rename((path_ + ".partial").c_str(), path_.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("renaming ", path_, ".partial to ", path_, " failed: ", std::strerror(errno)));
  }
  committed_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvChunkFileReader>> KvChunkFileReader::Open(
    const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--in: cannot open ", path, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<KvChunkFileReader>(new KvChunkFileReader(path, file));
}

KvChunkFileReader::~KvChunkFileReader() { std::fclose(file_); }

absl::Status KvChunkFileReader::Error(int64_t at, const std::string& what) const {
  return absl::InvalidArgumentError(absl::StrCat(
      path_, ": not a K/V chunk file (export-kv's): chunk ", index_, " at byte ", at, ": ", what));
}

absl::StatusOr<bool> KvChunkFileReader::Next(v1::KvChunk* chunk) {
  const int64_t start = offset_;
  uint64_t length = 0;
  for (int shift = 0;; shift += 7) {
    const int c = std::fgetc(file_);
    if (c == EOF) {
      if (shift == 0) return false;  // a clean end between chunks
      return Error(start, "the file ends inside a length");
    }
    ++offset_;
    if (shift > 56) return Error(start, "a length longer than 9 bytes");
    length |= static_cast<uint64_t>(c & 0x7f) << shift;
    if ((c & 0x80) == 0) break;
  }
  if (length > kMaxChunkMessageBytes) {
    return Error(start, absl::StrCat("a length of ", length, " bytes (at most ",
                                     kMaxChunkMessageBytes, ")"));
  }
  buffer_.resize(length);
  const size_t got = std::fread(buffer_.data(), 1, length, file_);
  offset_ += static_cast<int64_t>(got);
  if (got != length) {
    return Error(start, absl::StrCat("the file ends ", length - got, " bytes inside a ", length,
                                     "-byte chunk"));
  }
  if (!chunk->ParseFromString(buffer_)) return Error(start, "the bytes do not parse as a KvChunk");
  ++index_;
  return true;
}

absl::StatusOr<KvChunkFileSummary> CheckChunkFile(const std::string& path) {
  absl::StatusOr<std::unique_ptr<KvChunkFileReader>> reader = KvChunkFileReader::Open(path);
  if (!reader.ok()) return reader.status();
  KvChunkFileSummary summary;
  std::set<uint64_t> sequences;
  v1::KvChunk chunk;
  for (;;) {
    const int64_t at = (*reader)->offset();
    absl::StatusOr<bool> more = (*reader)->Next(&chunk);
    if (!more.ok()) return more.status();
    if (!*more) break;
    const int64_t index = (*reader)->index() - 1;
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": chunk ", index, " at byte ", at, " (sequence ", chunk.sequence_id(),
                       ", layer ", chunk.layer(), ", tokens ", chunk.token_begin(), "..",
                       int64_t{chunk.token_begin()} + chunk.num_tokens(), "): ", what));
    };
    if (index == 0) {
      if (!chunk.has_header()) {
        return bad(
            "the first chunk has no header (not a file export-kv wrote, or its start is "
            "missing)");
      }
      summary.header = chunk.header();
      for (const v1::SequenceLengths& s : summary.header.sequences()) {
        sequences.insert(s.sequence_id());
      }
    } else if (chunk.has_header()) {
      return bad("a header after the first chunk (two exports in one file?)");
    }
    if (sequences.count(chunk.sequence_id()) == 0) {
      return bad("a sequence the header does not list");
    }
    const uint32_t crc = ChunkCrc32c(chunk);
    if (crc != chunk.crc32c()) {
      return bad(absl::StrCat("crc32c mismatch: the chunk says ", chunk.crc32c(),
                              ", its bytes give ", crc, " (the file is damaged)"));
    }
    summary.payload_bytes += static_cast<int64_t>(chunk.k().size() + chunk.v().size() +
                                                  chunk.k_scale().size() + chunk.v_scale().size());
    summary.sequences_ended += chunk.sequence_end() ? 1 : 0;
    ++summary.chunks;
  }
  if (summary.chunks == 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": empty (no chunk, no header)"));
  }
  if (summary.sequences_ended != summary.header.sequences_size() ||
      summary.payload_bytes != summary.header.total_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": incomplete: ", summary.sequences_ended, " of ", summary.header.sequences_size(),
        " sequences end in it, ", summary.payload_bytes, " of ", summary.header.total_bytes(),
        " payload bytes (an export cut short?)"));
  }
  return summary;
}

}  // namespace cli
}  // namespace attnserve
