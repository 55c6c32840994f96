// What every front-end boundary (gRPC reactors, HTTP handlers, the core's
// runners) shares: a count of work still owed a response, so a drain can wait
// until every admitted request has been answered (not merely computed) before
// the servers stop; and the turning of an escaped exception into a status, so
// a throwing library call answers its caller instead of wedging the drain.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

class InFlightCounter {
 public:
  // Released when destroyed: every path out of a handler, a throw included,
  // gives its count back.
  class Hold {
   public:
    Hold() = default;
    explicit Hold(InFlightCounter* counter) : counter_(counter) {
      if (counter_ != nullptr) counter_->Add();
    }
    Hold(Hold&& other) noexcept : counter_(std::exchange(other.counter_, nullptr)) {}
    Hold& operator=(Hold&& other) noexcept {
      if (this != &other) {
        Release();
        counter_ = std::exchange(other.counter_, nullptr);
      }
      return *this;
    }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() { Release(); }
    void Release() {
      if (counter_ != nullptr) std::exchange(counter_, nullptr)->Done();
    }

   private:
    InFlightCounter* counter_ = nullptr;
  };

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
  int64_t count() {
    absl::MutexLock lock(&mu_);
    return count_;
  }

 private:
  absl::Mutex mu_;
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// The status of an exception caught at a front-end boundary: allocation
// failures are RESOURCE_EXHAUSTED (the caller asked for too much), anything
// else INTERNAL with what() so the log and the caller see the cause.
inline absl::Status StatusOfException(std::exception_ptr e, absl::string_view where) {
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(where, ": out of memory for this request"));
  } catch (const std::length_error& x) {
    return absl::ResourceExhaustedError(absl::StrCat(where, ": too large (", x.what(), ")"));
  } catch (const std::exception& x) {
    return absl::InternalError(absl::StrCat(where, ": ", x.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(where, ": unknown exception"));
  }
}

// Wraps a completion callback so it runs at most once: when a call throws
// after it may already have handed its callback on, the boundary completes
// it with the exception's status and a late completion is dropped.
template <typename... Args>
class Once {
 public:
  explicit Once(std::function<void(Args...)> fn) : state_(std::make_shared<State>(std::move(fn))) {}
  // The callback to hand on; runs `fn` unless this Once already ran.
  std::function<void(Args...)> Callback() const {
    return [state = state_](Args... args) { state->Run(std::forward<Args>(args)...); };
  }
  // Runs `fn` unless it already ran; true if it ran now.
  template <typename... A>
  bool operator()(A&&... args) const {
    return state_->Run(std::forward<A>(args)...);
  }
  bool ran() const { return state_->ran.load(std::memory_order_acquire); }

 private:
  struct State {
    explicit State(std::function<void(Args...)> f) : fn(std::move(f)) {}
    template <typename... A>
    bool Run(A&&... args) {
      if (ran.exchange(true, std::memory_order_acq_rel)) return false;
      fn(std::forward<A>(args)...);
      return true;
    }
    std::function<void(Args...)> fn;
    std::atomic<bool> ran{false};
  };
  std::shared_ptr<State> state_;
};

}  // namespace attnserve
