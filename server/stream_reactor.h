// A pipelined bidirectional-streaming reactor for gRPC's callback API, shared
// by the native ForwardStream and KServe v2's ModelStreamInfer: it keeps
// reading while earlier requests run, writes responses as they complete (so
// possibly out of order), one write in flight and the rest queued. A failed
// request becomes an in-band error response (the protocol's `fail` hook) and
// the stream goes on. The RPC finishes once the client has half-closed (or the
// call is gone) and every started request has completed and been written (or
// can no longer be).
//
// Lifetime: gRPC calls OnDone only after Finish, and Finish is called only
// when no request is pending, so no completion callback can outlive the
// reactor. Decisions are made under mu_; StartWrite and Finish are called
// after releasing it, and nothing touches `this` after Finish.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/server_callback.h"
#include "server/in_flight.h"

namespace attnserve {

template <typename Request, typename Response>
class PipelinedStreamReactor final : public grpc::ServerBidiReactor<Request, Response> {
 public:
  struct Call {
    Request request;
    Response response;
  };
  using Done = std::function<void(const absl::Status&)>;
  // Starts `call`; must call its Done exactly once (on any thread, possibly
  // before returning), after which call->response is written.
  using Start = std::function<void(Call* call, Done done)>;
  // Turns `call`'s response into the in-band report of a failed request.
  using Fail = std::function<void(Call* call, const absl::Status& status)>;

  // `in_flight` counts every request until its response is written or dropped;
  // `cancelled` is set when the RPC is cancelled (the requests see it).
  PipelinedStreamReactor(InFlightCounter* in_flight, std::shared_ptr<std::atomic<bool>> cancelled,
                         Start start, Fail fail)
      : in_flight_(in_flight),
        cancelled_(std::move(cancelled)),
        start_(std::move(start)),
        fail_(std::move(fail)) {
    this->StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // Half-close, cancellation or a broken stream: no more requests.
      bool finish;
      {
        absl::MutexLock lock(&mu_);
        reads_done_ = true;
        finish = ShouldFinishLocked();
      }
      if (finish) FinishStream();
      return;
    }
    auto owned = std::make_unique<Call>();
    owned->request.Swap(&incoming_);
    Call* call = owned.get();
    in_flight_->Add();
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
      calls_.push_back(std::move(owned));
    }
    // Read the next request while this one runs: pipelining is the point.
    this->StartRead(&incoming_);
    start_(call, [this, call](const absl::Status& status) { OnRequestDone(call, status); });
  }

  void OnWriteDone(bool ok) override {
    Response* next;
    bool finish;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      in_flight_->Done();
      RemoveLocked(ready_.front());
      ready_.pop_front();
      // A failed write means the stream is gone; what is left cannot be sent.
      if (!ok) write_failed_ = true;
      next = NextWriteLocked();
      finish = next == nullptr && ShouldFinishLocked();
    }
    if (next != nullptr) {
      this->StartWrite(next);
    } else if (finish) {
      FinishStream();
    }
  }

  void OnCancel() override { cancelled_->store(true, std::memory_order_release); }
  void OnDone() override { delete this; }

 private:
  void OnRequestDone(Call* call, const absl::Status& status) {
    if (!status.ok()) fail_(call, status);
    Response* next;
    bool finish;
    {
      absl::MutexLock lock(&mu_);
      --pending_;
      ready_.push_back(call);
      next = NextWriteLocked();
      finish = next == nullptr && ShouldFinishLocked();
    }
    if (next != nullptr) {
      this->StartWrite(next);
    } else if (finish) {
      FinishStream();
    }
  }

  // The response to write now, marking a write in flight, or null.
  Response* NextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (write_failed_) {
      for (Call* c : ready_) {
        in_flight_->Done();
        RemoveLocked(c);
      }
      ready_.clear();
    }
    if (writing_ || ready_.empty()) return nullptr;
    writing_ = true;
    return &ready_.front()->response;
  }

  bool ShouldFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || !reads_done_ || pending_ > 0 || writing_ || !ready_.empty()) return false;
    finished_ = true;
    return true;
  }

  void RemoveLocked(Call* call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = calls_.begin(); it != calls_.end(); ++it) {
      if (it->get() == call) {
        calls_.erase(it);
        return;
      }
    }
  }

  void FinishStream() {
    // Per-request errors travel in responses; the stream itself succeeded
    // unless the client went away.
    this->Finish(cancelled_->load(std::memory_order_acquire)
                     ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled")
                     : grpc::Status::OK);
  }

  InFlightCounter* const in_flight_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  const Start start_;
  const Fail fail_;
  Request incoming_;  // the buffer of the one read in flight

  absl::Mutex mu_;
  std::deque<std::unique_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);  // owns every live call
  std::deque<Call*> ready_ ABSL_GUARDED_BY(mu_);  // completed, not yet written; front is in flight
  int pending_ ABSL_GUARDED_BY(mu_) = 0;          // started, not completed
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attnserve
