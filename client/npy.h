// Reading and writing NumPy .npy files as HostTensors, so attnctl can take
// inputs from and hand outputs to Python without a conversion script.
//
// Format (numpy.lib.format): magic "\x93NUMPY", version 1.0 (2-byte header
// length), 2.0 or 3.0 (4-byte length), then a Python dict literal with
// 'descr', 'fortran_order' and 'shape', then the raw elements.
//
// Element types read:
//   '<f2'           -> FP16
//   '<f4'           -> FP32
//   '<f8'           -> FP32 (narrowed; NumPy's default float type, so
//                      np.random.randn output works as is)
//   '<u2'           -> BF16 bit patterns (NumPy has no bfloat16; these are the
//                      upper 16 bits of each float32, as on the wire)
//   '|u1' ('<u1', '|V1')
//                   -> FP8 E4M3 codes (NumPy has no float8; a uint8 array of
//                      the codes, e.g. torch_fp8.view(torch.uint8).numpy() or
//                      an ml_dtypes float8_e4m3fn array .view(np.uint8)). The
//                      file holds codes only: the descale is a separate flag
//                      (attnctl --q_descale/--k_descale/--v_descale).
// Masks (ParseNpyMask/ReadNpyMask): '|b1' (bool) or '|u1', one byte per element.
// Written: FP16 as '<f2', FP32 as '<f4', FP8 as '|u1' codes, and BF16 as '<f4': widening BF16 to
// float32 is exact, and a float32 file is what a NumPy user can use directly.
// Reading that file back with dtype BF16 requested restores the same bits.
//
// Only C-order arrays are supported. Big-endian, Fortran-order, object and
// other element types are INVALID_ARGUMENT naming the file and what it holds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/host_tensor.h"

namespace attnserve {

// Parses the bytes of a .npy file; `name` only labels error messages.
absl::StatusOr<HostTensor> ParseNpy(const std::string& contents, const std::string& name);
// A boolean mask file: its shape and one byte per element (nonzero = true).
struct NpyMask {
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};
absl::StatusOr<NpyMask> ParseNpyMask(const std::string& contents, const std::string& name);
// Encodes a tensor as a .npy file (version 1.0, or 2.0 for a header over 64 KiB).
std::string EncodeNpy(const HostTensor& tensor);

// File versions of the above. Read errors are NOT_FOUND (missing file) or
// INVALID_ARGUMENT (not a supported .npy); a file that cannot be opened or
// written is the matching errno code. Every message names the path.
absl::StatusOr<HostTensor> ReadNpy(const std::string& path);
absl::StatusOr<NpyMask> ReadNpyMask(const std::string& path);
absl::Status WriteNpy(const std::string& path, const HostTensor& tensor);

}  // namespace attnserve
