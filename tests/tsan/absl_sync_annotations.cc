// TSan builds only (ATTNSERVE_SANITIZE=thread, cmake/sanitizers.cmake): makes
// the locking of Debian's Abseil visible to ThreadSanitizer.
//
// Why: libabsl_synchronization from Debian is not built with -fsanitize=thread,
// so absl::Mutex's acquire/release (atomics and futex calls inside the library)
// are invisible and every access our code guards with it is reported as a race
// (checked: a counter under absl::MutexLock in 4 threads gives reports). Abseil
// built with TSan annotates its own Mutex with the __tsan_mutex_* interface;
// this file does the same from the outside. The link wraps each listed symbol
// (-Wl,--wrap=SYMBOL: our objects' calls to SYMBOL reach __wrap_SYMBOL, which
// calls the library's as __real_SYMBOL) and the wrapper tells TSan what the
// call did. Only calls from the project's own objects are wrapped; gRPC's use
// of Abseil inside its own library is not (and needs no annotation: TSan does
// not see those accesses either, the library is not instrumented).
//
// The annotation order is Abseil's own: the release is announced before the
// library really unlocks and the acquire after it really locks, and TSan
// ignores memory accesses between pre_ and post_ (a Condition that the library
// evaluates on another thread while it holds the lock is not a report).
// Waits (Await, CondVar::Wait, LockWhen) release and re-acquire around the
// library call. absl::Notification: Notify releases on the object and every
// WaitForNotification* that returns true acquires it. Not covered (inline in
// the headers, nothing to wrap): Notification::HasBeenNotified() as a
// synchronisation point.
//
// The wrapped symbols are the ones named in cmake/sanitizers.cmake
// (attnserve_tsan_wrapped_absl); each has one function here with the member
// function's signature written as a free function (`this` first, Itanium ABI).
#include <sanitizer/tsan_interface.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

void Acquired(absl::Mutex* mu, unsigned flags) {
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
}

// Announces the release of a held lock around `unlock` (which really unlocks).
template <typename F>
auto Released(absl::Mutex* mu, unsigned flags, F unlock) {
  __tsan_mutex_pre_unlock(mu, flags);
  auto result = unlock();
  __tsan_mutex_post_unlock(mu, flags);
  return result;
}

// A wait on a held lock: the library releases it, waits, and takes it again.
template <typename F>
auto Waited(absl::Mutex* mu, F wait) {
  auto result = Released(mu, 0, wait);
  Acquired(mu, 0);
  return result;
}

template <typename F>
auto Locked(absl::Mutex* mu, unsigned flags, F lock) {
  __tsan_mutex_pre_lock(mu, flags);
  auto result = lock();
  __tsan_mutex_post_lock(mu, flags, 0);
  return result;
}

}  // namespace

extern "C" {

// Mutex::Lock / Unlock / ReaderLock / ReaderUnlock / TryLock / ReaderTryLock.
void __real__ZN4absl7debian35Mutex4LockEv(absl::Mutex*);
void __wrap__ZN4absl7debian35Mutex4LockEv(absl::Mutex* mu) {
  Locked(mu, 0, [&] {
    __real__ZN4absl7debian35Mutex4LockEv(mu);
    return 0;
  });
}
void __real__ZN4absl7debian35Mutex6UnlockEv(absl::Mutex*);
void __wrap__ZN4absl7debian35Mutex6UnlockEv(absl::Mutex* mu) {
  Released(mu, 0, [&] {
    __real__ZN4absl7debian35Mutex6UnlockEv(mu);
    return 0;
  });
}
void __real__ZN4absl7debian35Mutex10ReaderLockEv(absl::Mutex*);
void __wrap__ZN4absl7debian35Mutex10ReaderLockEv(absl::Mutex* mu) {
  Locked(mu, __tsan_mutex_read_lock, [&] {
    __real__ZN4absl7debian35Mutex10ReaderLockEv(mu);
    return 0;
  });
}
void __real__ZN4absl7debian35Mutex12ReaderUnlockEv(absl::Mutex*);
void __wrap__ZN4absl7debian35Mutex12ReaderUnlockEv(absl::Mutex* mu) {
  Released(mu, __tsan_mutex_read_lock, [&] {
    __real__ZN4absl7debian35Mutex12ReaderUnlockEv(mu);
    return 0;
  });
}
bool __real__ZN4absl7debian35Mutex7TryLockEv(absl::Mutex*);
bool __wrap__ZN4absl7debian35Mutex7TryLockEv(absl::Mutex* mu) {
  __tsan_mutex_pre_lock(mu, __tsan_mutex_try_lock);
  const bool locked = __real__ZN4absl7debian35Mutex7TryLockEv(mu);
  __tsan_mutex_post_lock(mu, __tsan_mutex_try_lock | (locked ? 0 : __tsan_mutex_try_lock_failed),
                         0);
  return locked;
}

// Mutex::LockWhen*: lock once the condition holds.
void __real__ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE(absl::Mutex*, const absl::Condition&);
void __wrap__ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE(absl::Mutex* mu,
                                                              const absl::Condition& c) {
  Locked(mu, 0, [&] {
    __real__ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE(mu, c);
    return 0;
  });
}
bool __real__ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    absl::Mutex*, const absl::Condition&, absl::Duration);
bool __wrap__ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    absl::Mutex* mu, const absl::Condition& c, absl::Duration d) {
  return Locked(mu, 0, [&] {
    return __real__ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(mu, c,
                                                                                              d);
  });
}

// Mutex::Await*: the lock is held before and after; released while waiting.
void __real__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(absl::Mutex*, const absl::Condition&);
void __wrap__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(absl::Mutex* mu,
                                                           const absl::Condition& c) {
  Waited(mu, [&] {
    __real__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(mu, c);
    return 0;
  });
}
bool __real__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    absl::Mutex*, const absl::Condition&, absl::Duration);
bool __wrap__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    absl::Mutex* mu, const absl::Condition& c, absl::Duration d) {
  return Waited(mu, [&] {
    return __real__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(mu, c,
                                                                                           d);
  });
}
bool __real__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(
    absl::Mutex*, const absl::Condition&, absl::Time);
bool __wrap__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(
    absl::Mutex* mu, const absl::Condition& c, absl::Time t) {
  return Waited(mu, [&] {
    return __real__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(mu, c, t);
  });
}

// CondVar::Wait*: same as Await on `mu`.
void __real__ZN4absl7debian37CondVar4WaitEPNS0_5MutexE(absl::CondVar*, absl::Mutex*);
void __wrap__ZN4absl7debian37CondVar4WaitEPNS0_5MutexE(absl::CondVar* cv, absl::Mutex* mu) {
  Waited(mu, [&] {
    __real__ZN4absl7debian37CondVar4WaitEPNS0_5MutexE(cv, mu);
    return 0;
  });
}
bool __real__ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE(absl::CondVar*,
                                                                                 absl::Mutex*,
                                                                                 absl::Duration);
bool __wrap__ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE(absl::CondVar* cv,
                                                                                 absl::Mutex* mu,
                                                                                 absl::Duration d) {
  return Waited(mu, [&] {
    return __real__ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE(cv, mu, d);
  });
}

// Mutex::~Mutex: forget the lock's state (a later mutex at this address is new).
void __real__ZN4absl7debian35MutexD1Ev(absl::Mutex*);
void __wrap__ZN4absl7debian35MutexD1Ev(absl::Mutex* mu) {
  __tsan_mutex_destroy(mu, 0);
  __real__ZN4absl7debian35MutexD1Ev(mu);
}

// absl::Notification: Notify happens before every wait that sees it.
void __real__ZN4absl7debian312Notification6NotifyEv(absl::Notification*);
void __wrap__ZN4absl7debian312Notification6NotifyEv(absl::Notification* n) {
  __tsan_release(n);
  __real__ZN4absl7debian312Notification6NotifyEv(n);
}
void __real__ZNK4absl7debian312Notification19WaitForNotificationEv(const absl::Notification*);
void __wrap__ZNK4absl7debian312Notification19WaitForNotificationEv(const absl::Notification* n) {
  __real__ZNK4absl7debian312Notification19WaitForNotificationEv(n);
  __tsan_acquire(const_cast<absl::Notification*>(n));
}
bool __real__ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE(
    const absl::Notification*, absl::Duration);
bool __wrap__ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE(
    const absl::Notification* n, absl::Duration d) {
  const bool notified =
      __real__ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE(n, d);
  if (notified) __tsan_acquire(const_cast<absl::Notification*>(n));
  return notified;
}

}  // extern "C"
