// The log level of a finished call: successes are debug (a line per call at
// the default level fills disks under load), client errors are routine for a
// server (info), only its own failures are errors.
#pragma once

#include "absl/status/status.h"
#include "spdlog/spdlog.h"

namespace attnserve {

inline spdlog::level::level_enum CallLogLevel(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss: return spdlog::level::err;
    case absl::StatusCode::kOk: return spdlog::level::debug;
    default: return spdlog::level::info;
  }
}

}  // namespace attnserve
