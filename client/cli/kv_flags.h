// The K/V cache flags that both `attnctl kv` (which defines them, in kv.cc)
// and `attnctl load-kv` read: the cache's layers, page size, device and
// whether V lives inside K (an MLA cache in the absorbed form).
#pragma once

#include <optional>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(int, layers);
ABSL_DECLARE_FLAG(int, page_size);
ABSL_DECLARE_FLAG(std::optional<int>, device);
ABSL_DECLARE_FLAG(bool, v_in_k);

namespace attnserve {
namespace cli {

inline constexpr char kKvFlagsFile[] = "client/cli/kv.cc";

}  // namespace cli
}  // namespace attnserve
