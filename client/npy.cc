// .npy parsing and encoding (format described in npy.h). The header is a
// Python dict literal; rather than a general Python parser, a small
// recursive-descent reader accepts exactly the three keys NumPy writes.
#include "client/npy.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
// NumPy pads the preamble so the data starts on a 64-byte boundary.
constexpr size_t kAlign = 64;

// Reads the header dict "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }".
class HeaderReader {
 public:
  HeaderReader(absl::string_view text, const std::string& name) : text_(text), name_(name) {}

  absl::Status Read(std::string* descr, bool* fortran_order, std::vector<int64_t>* shape) {
    bool have_descr = false, have_order = false, have_shape = false;
    if (!Consume('{')) return Error("expected '{' at the start of the header");
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      std::string key;
      if (!ReadString(&key)) return Error("expected a quoted key");
      if (!Consume(':')) return Error(absl::StrCat("expected ':' after '", key, "'"));
      if (key == "descr") {
        if (!ReadString(descr)) return Error("'descr' must be a string such as '<f4'");
        have_descr = true;
      } else if (key == "fortran_order") {
        SkipSpace();
        if (ConsumeWord("True")) {
          *fortran_order = true;
        } else if (ConsumeWord("False")) {
          *fortran_order = false;
        } else {
          return Error("'fortran_order' must be True or False");
        }
        have_order = true;
      } else if (key == "shape") {
        RETURN_IF_ERROR(ReadShape(shape));
        have_shape = true;
      } else {
        return Error(absl::StrCat("unexpected key '", key, "'"));
      }
      SkipSpace();
      if (Consume('}')) break;
      if (!Consume(',')) return Error("expected ',' or '}' between entries");
    }
    if (!have_descr || !have_order || !have_shape) {
      return Error("the header must have 'descr', 'fortran_order' and 'shape'");
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": malformed .npy header (", what, "): ", text_));
  }
  void SkipSpace() {
    while (pos_ < text_.size() && absl::ascii_isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
  }
  bool Consume(char c) {
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool ConsumeWord(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  bool ReadString(std::string* out) {
    SkipSpace();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) return false;
    const char quote = text_[pos_++];
    const size_t end = text_.find(quote, pos_);
    if (end == absl::string_view::npos) return false;
    *out = std::string(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return true;
  }
  absl::Status ReadShape(std::vector<int64_t>* shape) {
    shape->clear();
    if (!Consume('(')) return Error("'shape' must be a tuple such as (2, 3)");
    while (true) {
      if (Consume(')')) return absl::OkStatus();
      SkipSpace();
      size_t end = pos_;
      while (end < text_.size() && absl::ascii_isdigit(static_cast<unsigned char>(text_[end]))) {
        ++end;
      }
      int64_t d = 0;
      if (end == pos_ || !absl::SimpleAtoi(text_.substr(pos_, end - pos_), &d)) {
        return Error("'shape' entries must be non-negative integers");
      }
      shape->push_back(d);
      pos_ = end;
      if (pos_ < text_.size() && text_[pos_] == 'L') ++pos_;  // Python 2 long literal
      if (Consume(')')) return absl::OkStatus();
      if (!Consume(',')) return Error("expected ',' or ')' in 'shape'");
    }
  }

  absl::string_view text_;
  const std::string& name_;
  size_t pos_ = 0;
};

uint32_t ReadLE(const std::string& s, size_t at, int bytes) {
  uint32_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

// The header of a .npy file: its element type without the byte-order
// character, its shape and element count, and where the data starts.
struct RawNpy {
  std::string descr;
  std::string type;
  std::vector<int64_t> shape;
  int64_t num_elements = 0;
  size_t data_at = 0;
};

absl::StatusOr<RawNpy> ParseHeader(const std::string& contents, const std::string& name) {
  if (contents.size() < kMagicLen + 2 || contents.compare(0, kMagicLen, kMagic) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": not a .npy file (no \\x93NUMPY magic at the start)"));
  }
  const int major = static_cast<unsigned char>(contents[kMagicLen]);
  const int minor = static_cast<unsigned char>(contents[kMagicLen + 1]);
  int len_bytes = 0;
  if (major == 1 && minor == 0) {
    len_bytes = 2;
  } else if ((major == 2 || major == 3) && minor == 0) {
    len_bytes = 4;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(name, ": unsupported .npy version ", major, ".",
                                                   minor, " (supported: 1.0, 2.0, 3.0)"));
  }
  const size_t header_at = kMagicLen + 2 + len_bytes;
  if (contents.size() < header_at) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": truncated .npy preamble"));
  }
  const size_t header_len = ReadLE(contents, kMagicLen + 2, len_bytes);
  if (contents.size() - header_at < header_len) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": .npy header says ", header_len,
                                                   " bytes but the file ends before that"));
  }
  const absl::string_view header(contents.data() + header_at, header_len);

  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
  RETURN_IF_ERROR(HeaderReader(header, name).Read(&descr, &fortran_order, &shape));
  if (fortran_order) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": Fortran-order arrays are not supported; save with np.ascontiguousarray(x)"));
  }
  if (descr.size() >= 2 && descr[0] == '>') {
    return absl::InvalidArgumentError(absl::StrCat(name, ": big-endian element type '", descr,
                                                   "' is not supported; use x.astype('<f4')"));
  }
  // '=' is native order, which is little-endian on every supported host.
  // '|' is "byte order not applicable" (one-byte types).
  const std::string type =
      (descr.size() >= 2 && (descr[0] == '<' || descr[0] == '=' || descr[0] == '|'))
          ? descr.substr(1)
          : descr;
  absl::StatusOr<int64_t> n = NumElementsOf(shape);
  if (!n.ok()) return absl::InvalidArgumentError(absl::StrCat(name, ": ", n.status().message()));
  return RawNpy{descr, type, std::move(shape), *n, header_at + header_len};
}

absl::Status CheckDataSize(const std::string& contents, const std::string& name, const RawNpy& raw,
                           int64_t elem) {
  const size_t data_len = contents.size() - raw.data_at;
  if (raw.num_elements > static_cast<int64_t>(data_len) / elem ||
      static_cast<int64_t>(data_len) != raw.num_elements * elem) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": shape ", ShapeString(raw.shape), " of '", raw.descr, "' needs ",
                     raw.num_elements, " * ", elem, " bytes of data, the file has ", data_len));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HostTensor> ParseNpy(const std::string& contents, const std::string& name) {
  absl::StatusOr<RawNpy> raw = ParseHeader(contents, name);
  if (!raw.ok()) return raw.status();
  const std::string& type = raw->type;
  const std::string& descr = raw->descr;
  std::vector<int64_t> shape = raw->shape;
  const int64_t n = raw->num_elements;
  const size_t data_at = raw->data_at;
  int64_t elem = 0;
  if (type == "u1" || type == "V1") {
    elem = 1;  // FP8 E4M3 codes (npy.h)
  } else if (type == "f2" || type == "u2") {
    elem = 2;
  } else if (type == "f4") {
    elem = 4;
  } else if (type == "f8") {
    elem = 8;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": element type '", descr,
                     "' is not supported (expected '<f2', '<f4', '<f8', '<u2' for BF16 bits, or "
                     "'|u1' for FP8 E4M3 codes)"));
  }
  RETURN_IF_ERROR(CheckDataSize(contents, name, *raw, elem));
  std::string data = contents.substr(data_at);
  if (type == "f8") {
    std::vector<float> values(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, data.data() + i * 8, 8);
      values[i] = static_cast<float>(d);
    }
    return HostTensor::FromFloats(DType::kFP32, std::move(shape), values);
  }
  const DType dtype = type == "f2"   ? DType::kFP16
                      : type == "u2" ? DType::kBF16
                      : elem == 1    ? DType::kFP8E4M3
                                     : DType::kFP32;
  return HostTensor::FromBytes(dtype, std::move(shape), std::move(data));
}

absl::StatusOr<NpyMask> ParseNpyMask(const std::string& contents, const std::string& name) {
  absl::StatusOr<RawNpy> raw = ParseHeader(contents, name);
  if (!raw.ok()) return raw.status();
  if (raw->type != "b1" && raw->type != "u1") {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": a mask's element type must be '|b1' (bool) or '|u1' (uint8), got '",
                     raw->descr, "'; save it with mask.astype(bool)"));
  }
  RETURN_IF_ERROR(CheckDataSize(contents, name, *raw, 1));
  NpyMask mask;
  mask.shape = raw->shape;
  mask.data.assign(contents.begin() + static_cast<std::ptrdiff_t>(raw->data_at), contents.end());
  return mask;
}

std::string EncodeNpy(const HostTensor& tensor) {
  // BF16 goes out as float32 (exact), see npy.h.
  std::optional<HostTensor> widened;
  if (tensor.dtype() == DType::kBF16) widened = tensor.ConvertTo(DType::kFP32);
  const HostTensor& out = widened ? *widened : tensor;
  std::string shape;
  if (out.rank() == 1) {
    shape = absl::StrCat("(", out.dim(0), ",)");
  } else {
    shape = absl::StrCat("(", absl::StrJoin(out.shape(), ", "), ")");
  }
  const char* descr = out.dtype() == DType::kFP16      ? "<f2"
                      : out.dtype() == DType::kFP8E4M3 ? "|u1"
                                                       : "<f4";
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': ", shape, ", }");
  // Version 1.0 has a 2-byte header length; longer headers need 2.0.
  size_t preamble = kMagicLen + 2 + 2;
  if (header.size() + 1 + kAlign > 0xffff) preamble = kMagicLen + 2 + 4;
  const size_t total = preamble + header.size() + 1;
  header.append((kAlign - total % kAlign) % kAlign, ' ');
  header.push_back('\n');

  std::string file(kMagic, kMagicLen);
  const bool v2 = preamble == kMagicLen + 2 + 4;
  file.push_back(static_cast<char>(v2 ? 2 : 1));
  file.push_back(0);
  const size_t len = header.size();
  for (int i = 0; i < (v2 ? 4 : 2); ++i) file.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  file += header;
  file += out.bytes();
  return file;
}

namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    return absl::Status(absl::ErrnoToStatusCode(err),
                        absl::StrCat("cannot open ", path, ": ", std::strerror(err)));
  }
  std::string contents((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return contents;
}

}  // namespace

absl::StatusOr<HostTensor> ReadNpy(const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFile(path);
  if (!contents.ok()) return contents.status();
  return ParseNpy(*contents, path);
}

absl::StatusOr<NpyMask> ReadNpyMask(const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFile(path);
  if (!contents.ok()) return contents.status();
  return ParseNpyMask(*contents, path);
}

absl::Status WriteNpy(const std::string& path, const HostTensor& tensor) {
  const std::string file = EncodeNpy(tensor);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    const int err = errno;
    return absl::Status(absl::ErrnoToStatusCode(err),
                        absl::StrCat("cannot write ", path, ": ", std::strerror(err)));
  }
  out.write(file.data(), static_cast<std::streamsize>(file.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

}  // namespace attnserve
