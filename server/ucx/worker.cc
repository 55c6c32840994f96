// UCP context, worker and stream operations; see worker.h.
#include "server/ucx/worker.h"

#include <poll.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace ucx {
namespace {

void SendDone(void* request, ucs_status_t status, void* user_data) {
  std::unique_ptr<OpDone> done(static_cast<OpDone*>(user_data));
  ucp_request_free(request);
  (*done)(status, 0);
}

void RecvDone(void* request, ucs_status_t status, size_t length, void* user_data) {
  std::unique_ptr<OpDone> done(static_cast<OpDone*>(user_data));
  ucp_request_free(request);
  (*done)(status, length);
}

struct TagRecv {
  OpDone done;
  size_t expected = 0;
};

void TagRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                 void* user_data) {
  std::unique_ptr<TagRecv> recv(static_cast<TagRecv*>(user_data));
  ucp_request_free(request);
  const size_t length = info != nullptr ? info->length : 0;
  if (status == UCS_OK && length != recv->expected) status = UCS_ERR_MESSAGE_TRUNCATED;
  recv->done(status, length);
}

// The outcome of an nbx call: OK (completed now), INPROGRESS (the callback
// owns `done`), or the error.
ucs_status_t Started(ucs_status_ptr_t request, std::unique_ptr<OpDone>* done) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  done->release();  // the callback deletes it
  return UCS_INPROGRESS;
}

// Runs `start` and waits for its completion on `worker`.
absl::Status Blocking(Worker& worker, absl::Time deadline, const std::string& what,
                      const std::function<ucs_status_t(OpDone)>& start) {
  auto state = std::make_shared<std::pair<bool, ucs_status_t>>(false, UCS_OK);
  const ucs_status_t started = start([state](ucs_status_t status, size_t) {
    state->first = true;
    state->second = status;
  });
  if (started == UCS_OK) return absl::OkStatus();
  if (started != UCS_INPROGRESS) return StatusOf(started, what);
  absl::Status waited = worker.WaitFor([&] { return state->first; }, deadline);
  if (!waited.ok()) return absl::Status(waited.code(), absl::StrCat(what, ": ", waited.message()));
  return state->second == UCS_OK ? absl::OkStatus() : StatusOf(state->second, what);
}

}  // namespace

absl::Status StatusOf(ucs_status_t status, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_OK: return absl::OkStatus();
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT: return absl::DeadlineExceededError(message);
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NO_DEVICE: return absl::UnavailableError(message);
    default: return absl::InternalError(message);
  }
}

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create() {
  std::unique_ptr<Worker> w(new Worker());
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return StatusOf(s, "ucp_config_read");
  // Connections ask for peer-failure handling (a dead client must not leave its
  // connection behind), and UCX 1.13 leaves its shared-memory transports out
  // of such endpoints unless told they may take part: without this, UCX_TLS=sm
  // connections would run over TCP. An explicit UCX_MM_ERROR_HANDLING wins.
  if (getenv("UCX_MM_ERROR_HANDLING") == nullptr)
    ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  // Streams for the frames, tags for payloads that go by rendezvous; wake-up
  // so an idle thread sleeps instead of spinning.
  params.features = UCP_FEATURE_STREAM | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  s = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  if (s != UCS_OK) return StatusOf(s, "ucp_init");
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(w->context_, &wp, &w->worker_);
  if (s != UCS_OK) return StatusOf(s, "ucp_worker_create");
  if (ucp_worker_get_efd(w->worker_, &w->event_fd_) != UCS_OK) w->event_fd_ = -1;
  return w;
}

Worker::~Worker() {
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

void Worker::Sleep(int extra_fd, absl::Duration timeout) {
  // BUSY: events arrived since the last progress; go round again.
  if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) return;
  pollfd fds[2] = {{event_fd_, POLLIN, 0}, {extra_fd, POLLIN, 0}};
  const int ms = static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(timeout), 0, 1000));
  poll(fds, extra_fd >= 0 ? 2 : 1, ms);
}

absl::Status Worker::WaitFor(const std::function<bool()>& done, absl::Time deadline,
                             absl::Duration spin) {
  absl::Time active = absl::Now();
  while (!done()) {
    if (Progress()) {
      active = absl::Now();
      continue;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) return absl::DeadlineExceededError("no answer before the deadline");
    if (now - active < spin) continue;
    Sleep(-1, std::min(deadline - now, absl::Milliseconds(100)));
    active = absl::Now();
  }
  return absl::OkStatus();
}

ucs_status_t StartSend(ucp_ep_h ep, const void* data, size_t size, OpDone done) {
  auto owned = std::make_unique<OpDone>(std::move(done));
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = SendDone;
  param.user_data = owned.get();
  param.datatype = ucp_dt_make_contig(1);
  return Started(ucp_stream_send_nbx(ep, data, size, &param), &owned);
}

ucs_status_t StartRecv(ucp_ep_h ep, void* data, size_t size, OpDone done) {
  auto owned = std::make_unique<OpDone>(std::move(done));
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.recv_stream = RecvDone;
  param.user_data = owned.get();
  param.datatype = ucp_dt_make_contig(1);
  param.flags = UCP_STREAM_RECV_FLAG_WAITALL;
  size_t length = 0;
  return Started(ucp_stream_recv_nbx(ep, data, size, &length, &param), &owned);
}

ucs_status_t StartTagSend(ucp_ep_h ep, const void* data, size_t size, uint64_t tag, OpDone done) {
  auto owned = std::make_unique<OpDone>(std::move(done));
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = SendDone;
  param.user_data = owned.get();
  param.datatype = ucp_dt_make_contig(1);
  return Started(ucp_tag_send_nbx(ep, data, size, tag, &param), &owned);
}

ucs_status_t StartTagRecv(ucp_worker_h worker, void* data, size_t size, uint64_t tag, OpDone done,
                          void** request) {
  auto owned = std::make_unique<TagRecv>();
  owned->done = std::move(done);
  owned->expected = size;
  ucp_request_param_t param{};
  // Always through the callback, which is told the message's length (a
  // receive completed at once is not, and a short message must not pass).
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = TagRecvDone;
  param.user_data = owned.get();
  param.datatype = ucp_dt_make_contig(1);
  ucs_status_ptr_t r = ucp_tag_recv_nbx(worker, data, size, tag, ~uint64_t{0}, &param);
  *request = nullptr;
  // Not expected with NO_IMM_CMPL; its length unknown, it is not trusted.
  if (r == nullptr) return UCS_ERR_MESSAGE_TRUNCATED;
  if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
  owned.release();  // the callback deletes it
  *request = r;
  return UCS_INPROGRESS;
}

absl::Status SendAll(Worker& worker, ucp_ep_h ep, const void* data, size_t size,
                     absl::Time deadline) {
  if (size == 0) return absl::OkStatus();
  return Blocking(worker, deadline, "UCX stream send",
                  [&](OpDone done) { return StartSend(ep, data, size, std::move(done)); });
}

absl::Status RecvAll(Worker& worker, ucp_ep_h ep, void* data, size_t size, absl::Time deadline) {
  if (size == 0) return absl::OkStatus();
  return Blocking(worker, deadline, "UCX stream receive",
                  [&](OpDone done) { return StartRecv(ep, data, size, std::move(done)); });
}

void CloseEndpoint(Worker& worker, ucp_ep_h ep, absl::Time deadline) {
  if (ep == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  while (ucp_request_check_status(request) == UCS_INPROGRESS && absl::Now() < deadline) {
    worker.Progress();
  }
  ucp_request_free(request);
}

}  // namespace ucx
}  // namespace attnserve
