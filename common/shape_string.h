// ShapeString: a tensor shape as text, "[2, 128, 8, 64]", for error messages
// (server and client) and log lines; one spelling across the project.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attnserve {

// The server's log line passes "," so each field stays one whitespace-free
// token ("q=[2,128,8,64]").
inline std::string ShapeString(absl::Span<const int64_t> shape,
                               absl::string_view separator = ", ") {
  return absl::StrCat("[", absl::StrJoin(shape, separator), "]");
}

}  // namespace attnserve
