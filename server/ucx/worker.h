// A UCP context with one worker, and the stream operations the UCX step
// transport uses on it (docs/ucx.md). Threading rule: a Worker and every
// endpoint and operation on it belong to one thread, the one that calls
// Progress (the server's listener thread, or the client call's own thread);
// UCX is initialised single-threaded (UCS_THREAD_MODE_SINGLE) and nothing
// here locks. Other threads reach that thread only through its wake-up fd
// (the listener's mailbox).
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attnserve {
namespace ucx {

// UCX's status as absl's: UNAVAILABLE for a peer or transport that is gone,
// DEADLINE_EXCEEDED for a timeout, INTERNAL otherwise; `what` names the call.
absl::Status StatusOf(ucs_status_t status, const std::string& what);

// Completion of one operation: runs once, on the worker's thread, inside
// Progress. `length`: bytes received (receives only).
using OpDone = std::function<void(ucs_status_t status, size_t length)>;

class Worker {
 public:
  // Reads UCX's configuration from the environment (UCX_TLS and the rest).
  static absl::StatusOr<std::unique_ptr<Worker>> Create();
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  ucp_worker_h get() const { return worker_; }

  // One round of progress; true when something happened.
  bool Progress() { return ucp_worker_progress(worker_) != 0; }
  // Progress until `done()` holds or `deadline` passes (DEADLINE_EXCEEDED):
  // spins for `spin` after each event, then sleeps on the worker's event fd.
  absl::Status WaitFor(const std::function<bool()>& done, absl::Time deadline,
                       absl::Duration spin = absl::Microseconds(50));
  // Blocks until UCX has an event, `extra_fd` (>= 0) is readable or
  // `timeout` passes. Call only when Progress found nothing to do.
  void Sleep(int extra_fd, absl::Duration timeout);

 private:
  Worker() = default;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
};

// Starts sending `size` bytes at `data` on the stream of `ep`. UCS_OK: sent
// (the buffer is free again; `done` is not called); UCS_INPROGRESS: `done`
// runs once the buffer is free; an error: nothing started.
ucs_status_t StartSend(ucp_ep_h ep, const void* data, size_t size, OpDone done);
// Starts receiving exactly `size` bytes into `data` (UCX's WAITALL). UCS_OK:
// received (`done` is not called); UCS_INPROGRESS: `done` runs with the
// outcome; an error: nothing started.
ucs_status_t StartRecv(ucp_ep_h ep, void* data, size_t size, OpDone done);

// Starts sending `size` bytes at `data` to `ep` as a tagged message (UCX
// picks eager or rendezvous by size: a large buffer moves in one zero-copy
// transfer where the transport allows). Returns as StartSend.
ucs_status_t StartTagSend(ucp_ep_h ep, const void* data, size_t size, uint64_t tag, OpDone done);
// Posts a receive of exactly `size` bytes tagged `tag` (from any endpoint of
// the worker). UCS_INPROGRESS: `done` runs with the outcome
// (UCS_ERR_MESSAGE_TRUNCATED for a message of another size, shorter ones
// included) and `*request` is set, to cancel with ucp_request_cancel; an
// error: nothing started.
ucs_status_t StartTagRecv(ucp_worker_h worker, void* data, size_t size, uint64_t tag, OpDone done,
                          void** request);

// Blocking forms for one-call-at-a-time clients: progress `worker` until
// the operation completes or `deadline` passes.
absl::Status SendAll(Worker& worker, ucp_ep_h ep, const void* data, size_t size,
                     absl::Time deadline);
absl::Status RecvAll(Worker& worker, ucp_ep_h ep, void* data, size_t size, absl::Time deadline);

// Closes `ep` (force: in-flight operations fail) and progresses until UCX
// has released it, at most until `deadline`.
void CloseEndpoint(Worker& worker, ucp_ep_h ep, absl::Time deadline);

}  // namespace ucx
}  // namespace attnserve
