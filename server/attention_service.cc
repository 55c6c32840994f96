// Reactors for Forward, ForwardStream, Echo and GetServerInfo; see attention_service.h.
#include "server/attention_service.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/request_validation.h"
#include "server/status_mapping.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

absl::Time DeadlineOf(const grpc::CallbackServerContext* context) {
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

// Unary Forward: the handler's completion finishes the RPC with the mapped status.
class ForwardReactor final : public grpc::ServerUnaryReactor {
 public:
  ForwardReactor(ForwardHandler* handler, InFlightCounter* in_flight,
                 const grpc::CallbackServerContext* context, const v1::ForwardRequest* request,
                 v1::ForwardResponse* response)
      : in_flight_(in_flight), cancelled_(std::make_shared<std::atomic<bool>>(false)) {
    in_flight_->Add();
    // Finish may run before this constructor returns (a refused request);
    // the callback API holds it until the reactor is bound to the call.
    handler->Start(request, response, DeadlineOf(context), cancelled_,
                   [this](const absl::Status& status) { Finish(ToGrpcStatus(status)); });
  }

  void OnCancel() override { cancelled_->store(true, std::memory_order_release); }
  void OnDone() override {
    in_flight_->Done();
    delete this;
  }

 private:
  InFlightCounter* const in_flight_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
};

// Echo's answer to a request: Forward's checks (so the same INVALID_ARGUMENT
// and RESOURCE_EXHAUSTED), then o = q and, with return_lse, a zero LSE of the
// shape Forward returns (dense [B, Hq, Sq], varlen [Hq, Tq]).
absl::Status FillEcho(const v1::ForwardRequest& request, const RequestLimits& limits,
                      v1::ForwardResponse* response) {
  absl::StatusOr<AttnParams> params = ValidateAndFillParams(request, limits);
  if (!params.ok()) return params.status();
  *response->mutable_o() = request.q();
  if (request.options().return_lse()) ShapeLseTensor(request, *params, response->mutable_lse());
  return absl::OkStatus();
}

// Unary Echo: answered on the gRPC thread that delivered the request, since
// there is nothing to wait for (validation and one copy of q). Not counted in
// the nv_inference_* metrics, which describe attention work (ServerMetrics is
// fed by the ForwardHandler and the executor only); it does count as in flight,
// so a drain waits for its response to be sent.
class EchoReactor final : public grpc::ServerUnaryReactor {
 public:
  EchoReactor(const RequestLimits& limits, const std::string& backend_name,
              InFlightCounter* in_flight, const v1::ForwardRequest* request,
              v1::ForwardResponse* response)
      : in_flight_(in_flight) {
    in_flight_->Add();
    const absl::Time received = absl::Now();
    const absl::Status status = FillEcho(*request, limits, response);
    // At most kMaxRequestIdBytes back, as Forward does (forward_handler.cc).
    response->set_request_id(request->request_id().substr(0, kMaxRequestIdBytes));
    response->set_backend(backend_name);  // FillEcho sets o and lse only on success
    const int64_t total_us = absl::ToInt64Microseconds(absl::Now() - received);
    response->mutable_timing()->set_total_us(total_us);
    // Echo measures the transport ceiling: no log strings are built unless
    // debug logging is on.
    if (spdlog::should_log(spdlog::level::debug)) {
      spdlog::debug("echo id=\"{}\" q=[{}] status={} total_us={}",
                    request->request_id().substr(0, kMaxLoggedIdChars),
                    absl::StrJoin(request->q().shape(), ","),
                    absl::StatusCodeToString(status.code()), total_us);
    }
    Finish(ToGrpcStatus(status));
  }

  void OnDone() override {
    in_flight_->Done();
    delete this;
  }

 private:
  InFlightCounter* const in_flight_;
};

// ForwardStream: keeps reading while earlier requests run, writes responses as
// they complete (so possibly out of order), one write in flight and the rest
// queued. A failed request becomes a response with error_code/error_message.
// The RPC finishes once the client has half-closed (or the call is gone) and
// every admitted request has completed and been written (or can no longer be).
//
// Flow control (stream_flow_control.h): the next read starts only while the
// stream's ledger is under its limits; otherwise reading pauses and resumes
// when a written response frees room. A paused stream learns of a cancelled
// call from OnCancel (no read is outstanding to fail), and treats it as the
// end of its requests. An answered request's input is released at once: only
// its response waits for the client.
//
// Lifetime: gRPC calls OnDone only after Finish, and Finish is called only
// when no request is pending in the executor, so no completion callback can
// outlive the reactor. Decisions are made under mu_; StartWrite and Finish are
// called after releasing it, and nothing touches `this` after Finish.
class ForwardStreamReactor final
    : public grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse> {
 public:
  ForwardStreamReactor(ForwardHandler* handler, InFlightCounter* in_flight,
                       const grpc::CallbackServerContext* context, const StreamLimits& limits,
                       StreamGauge* gauge)
      : handler_(handler),
        in_flight_(in_flight),
        deadline_(DeadlineOf(context)),
        cancelled_(std::make_shared<std::atomic<bool>>(false)),
        ledger_(limits, gauge) {
    StartRead(&incoming_);
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
    auto call = std::make_unique<Call>();
    call->request.Swap(&incoming_);
    call->held_bytes = static_cast<int64_t>(call->request.ByteSizeLong());
    Call* raw = call.get();
    in_flight_->Add();  // until its response is written or dropped
    bool read_next;
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
      ledger_.AddRequest(raw->held_bytes);
      calls_.push_back(std::move(call));
      read_next = !ledger_.Full();
      if (!read_next) ledger_.SetPaused(true);
    }
    // Read the next request while this one runs (pipelining is the point),
    // unless the stream already holds all it may.
    if (read_next) StartRead(&incoming_);
    handler_->Start(&raw->request, &raw->response, deadline_, cancelled_,
                    [this, raw](const absl::Status& status) { OnRequestDone(raw, status); });
  }

  void OnWriteDone(bool ok) override {
    v1::ForwardResponse* next = nullptr;
    bool finish;
    bool resume;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      in_flight_->Done();
      RemoveCallLocked(ready_.front());
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
  struct Call {
    v1::ForwardRequest request;
    v1::ForwardResponse response;
    int64_t held_bytes = 0;  // what the ledger counts for it now
  };

  // The handler's completion, on the executor's thread or inside OnReadDone.
  void OnRequestDone(Call* call, const absl::Status& status) {
    if (!status.ok()) {
      call->response.set_error_code(ToRpcCode(status));
      call->response.set_error_message(std::string(status.message()));
    }
    // `done` is the handler's last use of the request: free its tensors now
    // (Swap with an empty message releases the buffers; Clear would keep them).
    v1::ForwardRequest().Swap(&call->request);
    const int64_t response_bytes = static_cast<int64_t>(call->response.ByteSizeLong());
    v1::ForwardResponse* next = nullptr;
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
  void Proceed(bool resume, v1::ForwardResponse* next, bool finish) {
    if (resume) StartRead(&incoming_);
    if (next != nullptr) {
      StartWrite(next);
    } else if (finish) {
      FinishStream();
    }
  }

  // True (and reading marked resumed) when reading was paused and the ledger
  // has room again; the caller then starts the read after unlocking.
  bool ResumeReadingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!ledger_.paused() || reads_done_ || ledger_.Full()) return false;
    ledger_.SetPaused(false);
    return true;
  }

  // The response to write now, marking a write in flight, or null.
  v1::ForwardResponse* NextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
        ledger_.RemoveRequest(call->held_bytes);
        calls_.erase(it);
        return;
      }
    }
  }

  void FinishStream() {
    // Per-request errors travel in responses; the stream itself succeeded
    // unless the client went away.
    Finish(cancelled_->load(std::memory_order_acquire)
               ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled")
               : grpc::Status::OK);
  }

  ForwardHandler* const handler_;
  InFlightCounter* const in_flight_;
  const absl::Time deadline_;
  const std::shared_ptr<std::atomic<bool>> cancelled_;
  v1::ForwardRequest incoming_;  // the buffer of the one read in flight

  absl::Mutex mu_;
  std::deque<std::unique_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);  // owns every live call
  std::deque<Call*> ready_ ABSL_GUARDED_BY(mu_);  // completed, not yet written; front is in flight
  int pending_ ABSL_GUARDED_BY(mu_) = 0;          // handed to the handler, not completed
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  StreamLedger ledger_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

const std::vector<std::string>& ServerFeatures() {
  static const auto* features = new std::vector<std::string>{
      "causal",     "sliding_window", "softcap", "gqa",    "mqa",       "varlen",
      "return_lse", "forward_stream", "echo",    "health", "reflection"};
  return *features;
}

AttentionService::AttentionService(ForwardHandler* handler, BackendDescription backend,
                                   const ServiceInfo& info)
    : handler_(handler), backend_(std::move(backend)), info_(info) {}

grpc::ServerUnaryReactor* AttentionService::Forward(grpc::CallbackServerContext* context,
                                                    const v1::ForwardRequest* request,
                                                    v1::ForwardResponse* response) {
  return new ForwardReactor(handler_, &in_flight_, context, request, response);
}

grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>* AttentionService::ForwardStream(
    grpc::CallbackServerContext* context) {
  return new ForwardStreamReactor(handler_, &in_flight_, context, info_.stream_limits,
                                  info_.stream_gauge);
}

grpc::ServerUnaryReactor* AttentionService::Echo(grpc::CallbackServerContext*,
                                                 const v1::ForwardRequest* request,
                                                 v1::ForwardResponse* response) {
  return new EchoReactor(handler_->limits(), backend_.name, &in_flight_, request,
                         response);
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetServerInfoRequest*,
                                                          v1::GetServerInfoResponse* response) {
  const BackendDescription& d = backend_;
  response->set_version(ATTNSERVE_VERSION);
  response->set_backend(d.name);
  for (const DeviceDescription& device : d.devices) {
    v1::DeviceInfo* out = response->add_devices();
    out->set_index(device.index);
    out->set_name(device.name);
    out->set_compute_capability_major(device.compute_capability_major);
    out->set_compute_capability_minor(device.compute_capability_minor);
    out->set_total_memory_bytes(device.total_memory_bytes);
  }
  for (DType t : d.dtypes) response->add_dtypes(static_cast<v1::DType>(t));
  response->set_min_head_dim(d.min_head_dim);
  response->set_max_head_dim(d.max_head_dim);
  response->set_head_dim_multiple(d.head_dim_multiple);
  v1::ServerLimits* limits = response->mutable_limits();
  limits->set_max_request_bytes(info_.max_request_bytes);
  limits->set_max_tokens(info_.max_tokens);
  limits->set_max_queue_size(info_.max_queue_size);
  limits->set_max_stream_pending_requests(info_.stream_limits.max_pending_requests);
  limits->set_max_stream_pending_bytes(info_.stream_limits.max_pending_bytes);
  for (const std::string& f : ServerFeatures()) response->add_features(f);
  response->set_cpu_threads(d.cpu_threads);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace attnserve
