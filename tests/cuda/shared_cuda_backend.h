// One CudaBackend for a whole GPU test binary (device buffers reused across
// cases, as in the server), or null with the reason when there is no usable
// GPU, so each test can GTEST_SKIP with it.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/backend_factory.h"

namespace attnserve {
namespace testing_util {

inline AttentionBackend* SharedCudaBackend(std::string* why) {
  static std::string reason;
  static std::unique_ptr<AttentionBackend> backend = [] {
    auto b = MakeCudaBackend(0);
    if (!b.ok()) {
      reason = std::string(b.status().message());
      return std::unique_ptr<AttentionBackend>();
    }
    return std::move(*b);
  }();
  *why = reason;
  return backend.get();
}

}  // namespace testing_util
}  // namespace attnserve
