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

  // Lock-free: every request on every device passes here twice, so the count
  // is one atomic; the mutex is taken only while a drain waits for zero.
  void Add() { count_.fetch_add(1, std::memory_order_seq_cst); }
  void Done() {
    // seq_cst on both sides: either the waiter sees zero when it checks, or
    // this sees the waiter and wakes it under the mutex.
    if (count_.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
        waiters_.load(std::memory_order_seq_cst) > 0) {
      absl::MutexLock lock(&mu_);
      zero_.SignalAll();
    }
  }
  // True once the count is zero; false if `timeout` passes first.
  bool WaitForZero(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    absl::MutexLock lock(&mu_);
    waiters_.fetch_add(1, std::memory_order_seq_cst);
    bool zero;
    while (!(zero = count_.load(std::memory_order_seq_cst) == 0)) {
      if (zero_.WaitWithDeadline(&mu_, deadline)) {
        zero = count_.load(std::memory_order_seq_cst) == 0;
        break;
      }
    }
    waiters_.fetch_sub(1, std::memory_order_seq_cst);
    return zero;
  }
  int64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> count_{0};
  std::atomic<int> waiters_{0};
  absl::Mutex mu_;
  absl::CondVar zero_;
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
