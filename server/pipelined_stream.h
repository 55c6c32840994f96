// A bidirectional-stream reactor that pipelines independent requests: it
// keeps reading while earlier requests run, writes responses as they complete
// (possibly out of order; one write in flight, the rest queued), and turns a
// failed request into a response with error_code/error_message while the
// stream goes on. The RPC finishes once the client has half-closed (or the
// call is gone) and every started request has completed and been written (or
// can no longer be). The K/V service's AppendAttendStream uses it; it is the
// shape of ForwardStream's reactor (attention_service.cc) made generic.
//
// Lifetime: gRPC calls OnDone only after Finish, and Finish is called only
// when no request is still running, so no completion outlives the reactor.
// Decisions are made under mu_; StartWrite and Finish run after releasing it.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/server_callback.h"
#include "server/in_flight.h"
#include "server/status_mapping.h"

namespace attnserve {

template <class Request, class Response>
class PipelinedStreamReactor final : public grpc::ServerBidiReactor<Request, Response> {
 public:
  using Done = std::function<void(const absl::Status& status)>;
  // Starts one request; calls `done` exactly once (possibly before returning).
  // `cancelled` turns true when the client cancels the stream.
  using Start = std::function<void(const Request* request, Response* response,
                                   const std::shared_ptr<const std::atomic<bool>>& cancelled,
                                   Done done)>;

  PipelinedStreamReactor(Start start, InFlightCounter* in_flight)
      : start_(std::move(start)),
        in_flight_(in_flight),
        cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    this->StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-close, cancellation or a broken stream: no more requests
      bool finish;
      {
        absl::MutexLock lock(&mu_);
        reads_done_ = true;
        finish = ShouldFinishLocked();
      }
      if (finish) FinishStream();
      return;
    }
    auto call = std::make_unique<Call>();
    call->request.Swap(&incoming_);
    Call* raw = call.get();
    in_flight_->Add();  // until its response is written or dropped
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
      calls_.push_back(std::move(call));
    }
    this->StartRead(&incoming_);  // read the next while this one runs
    start_(&raw->request, &raw->response, cancelled_,
           [this, raw](const absl::Status& status) { OnRequestDone(raw, status); });
  }

  void OnWriteDone(bool ok) override {
    Response* next = nullptr;
    bool finish;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      in_flight_->Done();
      RemoveCallLocked(ready_.front());
      ready_.pop_front();
      if (!ok) write_failed_ = true;  // the stream is gone
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
  struct Call {
    Request request;
    Response response;
  };

  void OnRequestDone(Call* call, const absl::Status& status) {
    if (!status.ok()) {
      call->response.set_error_code(ToRpcCode(status));
      call->response.set_error_message(std::string(status.message()));
    }
    Response* next = nullptr;
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

  Response* NextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (write_failed_) {
      for (Call* c : ready_) {
        in_flight_->Done();
        RemoveCallLocked(c);
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

  void RemoveCallLocked(Call* call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = calls_.begin(); it != calls_.end(); ++it) {
      if (it->get() == call) {
        calls_.erase(it);
        return;
      }
    }
  }

  void FinishStream() {
    this->Finish(cancelled_->load(std::memory_order_acquire)
                     ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled")
                     : grpc::Status::OK);
  }

  const Start start_;
  InFlightCounter* const in_flight_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  Request incoming_;  // the buffer of the one read in flight

  absl::Mutex mu_;
  std::deque<std::unique_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);
  std::deque<Call*> ready_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attnserve
