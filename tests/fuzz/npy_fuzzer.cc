// libFuzzer target: the .npy reader attnctl uses for --q/--k/--v inputs
// (client/npy.h). Any bytes must give a tensor or an INVALID_ARGUMENT with a
// message, never a crash, over-read or sanitizer report; and a tensor it
// accepts must encode and read back with the same shape and element count.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "client/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  const std::string contents(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<HostTensor> tensor = ParseNpy(contents, "fuzz.npy");
  if (!tensor.ok()) {
    if (tensor.status().message().empty()) {
      std::fprintf(stderr, "npy_fuzzer: refusal without a message\n");
      std::abort();
    }
    return 0;
  }
  absl::StatusOr<HostTensor> again = ParseNpy(EncodeNpy(*tensor), "again.npy");
  if (!again.ok() || again->shape() != tensor->shape()) {
    std::fprintf(stderr, "npy_fuzzer: an accepted tensor does not round-trip: %s\n",
                 again.ok() ? "shape differs" : std::string(again.status().message()).c_str());
    std::abort();
  }
  return 0;
}
