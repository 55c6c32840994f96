// The log level of a finished call: client errors are routine for a server,
// only its own failures are errors.
#pragma once

#include "absl/status/status.h"
#include "spdlog/spdlog.h"

namespace attnserve {

inline spdlog::level::level_enum CallLogLevel(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss: return spdlog::level::err;
    default: return spdlog::level::info;
  }
}

}  // namespace attnserve
