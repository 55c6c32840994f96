// A pipelined bidirectional-streaming reactor for gRPC's callback API, shared
// by the native ForwardStream, KServe v2's ModelStreamInfer and the K/V
// service's AppendAttendStream: it keeps
// reading while earlier requests run, writes responses as they complete (so
// possibly out of order), one write in flight and the rest queued. A failed
// request becomes an in-band error response (the protocol's `fail` hook) and
// the stream goes on, unless the protocol's `ends` hook says the status ends
// the stream: that request is then not answered, no request read after it
// starts, and once the requests already started are answered the RPC
// finishes with that status (a K/V cache that moved elsewhere). The RPC finishes once the client
// has half-closed (or the call is gone) and every started request has completed and been written
// (or can no longer be).
//
// Flow control (stream_flow_control.h), the same for every stream: the next
// read starts only while the stream's ledger is under its limits; otherwise
// reading pauses and resumes when a written response frees room. A paused
// stream learns of a cancelled call from OnCancel (no read is outstanding to
// fail), and treats it as the end of its requests. An answered request's
// input is released at once: only its response waits for the client.
//
// Lifetime: gRPC calls OnDone only after Finish, and Finish is called only
// when no request is pending, so no completion callback can outlive the
// reactor. Decisions are made under mu_; StartWrite and Finish are called
// after releasing it, and nothing touches `this` after Finish.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/server_callback.h"
#include "server/in_flight.h"
#include "server/stream_flow_control.h"

namespace attnserve {

template <typename Request, typename Response>
class PipelinedStreamReactor final : public grpc::ServerBidiReactor<Request, Response> {
 public:
  struct Call {
    Request request;
    Response response;
    int64_t held_bytes = 0;  // what the ledger counts for it now
  };
  using Done = std::function<void(const absl::Status&)>;
  // Starts `call`; must call its Done exactly once (on any thread, possibly
  // before returning), after which call->response is written.
  using Start = std::function<void(Call* call, Done done)>;
  // Turns `call`'s response into the in-band report of a failed request.
  using Fail = std::function<void(Call* call, const absl::Status& status)>;
  // True when a failed request's `status` ends the stream; `first` for the
  // first such status (the hook may add trailing metadata then).
  using Ends = std::function<bool(const absl::Status& status, bool first)>;

  // `in_flight` counts every request until its response is written or dropped;
  // `cancelled` is set when the RPC is cancelled (the requests see it);
  // `limits` bound what the stream holds, `gauge` (may be null; must outlive
  // the reactor) sums it over the server's streams.
  PipelinedStreamReactor(InFlightCounter* in_flight, std::shared_ptr<std::atomic<bool>> cancelled,
                         Start start, Fail fail, const StreamLimits& limits, StreamGauge* gauge,
                         Ends ends = nullptr)
      : in_flight_(in_flight),
        cancelled_(std::move(cancelled)),
        start_(std::move(start)),
        fail_(std::move(fail)),
        ends_(std::move(ends)),
        ledger_(limits, gauge) {
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
    bool ended = false;
    bool finish_now = false;
    {
      absl::MutexLock lock(&mu_);
      if (ending_) {
        // Read as the stream ended: not started, never answered.
        incoming_.Clear();
        reads_done_ = ended = true;
        finish_now = ShouldFinishLocked();
      }
    }
    if (ended) {
      if (finish_now) FinishStream();
      return;
    }
    auto owned = std::make_unique<Call>();
    owned->request.Swap(&incoming_);
    owned->held_bytes = static_cast<int64_t>(owned->request.ByteSizeLong());
    Call* call = owned.get();
    in_flight_->Add();
    bool read_next;
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
      ledger_.AddRequest(call->held_bytes);
      calls_.push_back(std::move(owned));
      read_next = !ledger_.Full();
      if (!read_next) ledger_.SetPaused(true);
      starting_ = true;
    }
    // Start this request, then read the next while it runs (pipelining is the
    // point), unless the stream already holds all it may. Requests start in
    // arrival order: the K/V stream's calls on one sequence and layer apply in
    // the order they were sent. So no read starts while start_ runs (the next
    // OnReadDone could run on another thread at once and start a later
    // request first): a resume that comes meanwhile (a response written, or
    // this request answered at once) is deferred to here. start_ only decodes
    // and queues the request, so the read waits little.
    // A throwing start_ answers its request with the exception's status (once:
    // it may have handed `done` on already) and the stream goes on.
    const Once<const absl::Status&> done(
        [this, call](const absl::Status& status) { OnRequestDone(call, status); });
    try {
      start_(call, done.Callback());
    } catch (...) {
      done(StatusOfException(std::current_exception(), "stream request"));
    }
    bool read;
    bool finish;
    {
      absl::MutexLock lock(&mu_);
      starting_ = false;
      read = (read_next || resume_after_start_) && !reads_done_ && !ending_;
      resume_after_start_ = false;
      finish = !read && ShouldFinishLocked();
    }
    if (read) {
      this->StartRead(&incoming_);
    } else if (finish) {
      FinishStream();
    }
  }

  void OnWriteDone(bool ok) override {
    Response* next;
    bool finish;
    bool resume;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      in_flight_->Done();
      RemoveLocked(ready_.front());
      ready_.pop_front();
      // A failed write means the stream is gone; what is left cannot be sent.
      if (!ok) write_failed_ = true;
      next = NextWriteLocked();
      resume = ResumeReadingLocked();
      finish = next == nullptr && ShouldFinishLocked();
    }
    Proceed(resume, next, finish);
  }

  void OnCancel() override {
    cancelled_->store(true, std::memory_order_release);
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      // No read is outstanding to report the end: this is it.
      if (ledger_.paused() && !reads_done_) {
        ledger_.SetPaused(false);
        reads_done_ = true;
        finish = ShouldFinishLocked();
      }
    }
    if (finish) FinishStream();
  }
  void OnDone() override { delete this; }

 private:
  // A request whose status ends the stream: dropped unanswered (see the top).
  bool EndsStream(Call* call, const absl::Status& status) {
    if (ends_ == nullptr) return false;
    Response* next;
    bool finish;
    {
      absl::MutexLock lock(&mu_);
      if (!ends_(status, !ending_)) return false;
      if (!ending_) {
        ending_ = true;
        end_status_ = status;
      }
      --pending_;
      in_flight_->Done();
      RemoveLocked(call);
      next = NextWriteLocked();
      finish = next == nullptr && ShouldFinishLocked();
    }
    Proceed(false, next, finish);
    return true;
  }

  void OnRequestDone(Call* call, const absl::Status& status) {
    if (!status.ok() && EndsStream(call, status)) return;
    if (!status.ok()) fail_(call, status);
    // `done` (and `fail`) were the last uses of the request: free it now (Swap
    // with an empty message releases the buffers; Clear would keep them).
    Request().Swap(&call->request);
    const int64_t response_bytes = static_cast<int64_t>(call->response.ByteSizeLong());
    Response* next;
    bool finish;
    bool resume;
    {
      absl::MutexLock lock(&mu_);
      --pending_;
      ledger_.Resize(response_bytes - call->held_bytes);
      call->held_bytes = response_bytes;
      ready_.push_back(call);
      next = NextWriteLocked();
      resume = ResumeReadingLocked();
      finish = next == nullptr && ShouldFinishLocked();
    }
    Proceed(resume, next, finish);
  }

  // Acts on what a reaction decided under mu_, after releasing it: the
  // resumed read, the next write, or the end of the stream.
  void Proceed(bool resume, Response* next, bool finish) {
    if (resume) this->StartRead(&incoming_);
    if (next != nullptr) {
      this->StartWrite(next);
    } else if (finish) {
      FinishStream();
    }
  }

  // True (and reading marked resumed) when reading was paused and the ledger
  // has room again; the caller then starts the read after unlocking.
  // While a request is starting, the read waits for it (OnReadDone starts it).
  bool ResumeReadingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!ledger_.paused() || reads_done_ || ending_ || ledger_.Full()) return false;
    ledger_.SetPaused(false);
    if (starting_) {
      resume_after_start_ = true;
      return false;
    }
    return true;
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

  // Never while a request is starting: OnReadDone still uses `this` after start_.
  bool ShouldFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // An ending stream finishes with a read still outstanding (it then fails).
    if (finished_ || starting_ || (!reads_done_ && !ending_) || pending_ > 0 || writing_ ||
        !ready_.empty()) {
      return false;
    }
    finished_ = true;
    return true;
  }

  void RemoveLocked(Call* call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = calls_.begin(); it != calls_.end(); ++it) {
      if (it->get() == call) {
        ledger_.RemoveRequest(call->held_bytes);
        calls_.erase(it);
        return;
      }
    }
  }

  void FinishStream() {
    absl::Status ended;
    {
      absl::MutexLock lock(&mu_);
      ended = end_status_;
    }
    if (!ended.ok() && !cancelled_->load(std::memory_order_acquire)) {
      this->Finish(
          grpc::Status(static_cast<grpc::StatusCode>(ended.code()), std::string(ended.message())));
      return;
    }
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
  const Ends ends_;
  Request incoming_;  // the buffer of the one read in flight

  absl::Mutex mu_;
  std::deque<std::unique_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);  // owns every live call
  std::deque<Call*> ready_ ABSL_GUARDED_BY(mu_);  // completed, not yet written; front is in flight
  int pending_ ABSL_GUARDED_BY(mu_) = 0;          // started, not completed
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool starting_ ABSL_GUARDED_BY(mu_) = false;            // OnReadDone is in start_
  bool resume_after_start_ ABSL_GUARDED_BY(mu_) = false;  // a resume came meanwhile
  bool ending_ ABSL_GUARDED_BY(mu_) = false;              // a request's status ends the stream
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  StreamLedger ledger_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
