// Counts RPC work the native front-end still owes a response for, so a drain
// can wait until every admitted request has been answered (not merely
// computed) before the gRPC server is stopped.
#pragma once

#include <cstdint>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

class InFlightCounter {
 public:
  void Add() {
    absl::MutexLock lock(&mu_);
    ++count_;
  }
  void Done() {
    absl::MutexLock lock(&mu_);
    --count_;
  }
  // True once the count is zero; false if `timeout` passes first.
  bool WaitForZero(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto zero = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return count_ == 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&zero), timeout);
  }

 private:
  absl::Mutex mu_;
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve
