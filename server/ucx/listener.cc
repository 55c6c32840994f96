// The UCX listener's progress thread, connections and framing; see listener.h.
#include "server/ucx/listener.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/ucx/worker.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace ucx {
namespace {

// Replies posted by completions on any thread, for the listener thread. Owns
// the eventfd that wakes it; outlives the listener while completions hold it.
class Mailbox {
 public:
  Mailbox() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~Mailbox() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }
  void Post(uint64_t connection, Reply reply) {
    {
      absl::MutexLock lock(&mu_);
      items_.emplace_back(connection, std::move(reply));
    }
    Wake();
  }
  void Wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(fd_, &one, sizeof(one));
  }
  std::deque<std::pair<uint64_t, Reply>> Take() {
    uint64_t count;
    [[maybe_unused]] ssize_t n = read(fd_, &count, sizeof(count));
    absl::MutexLock lock(&mu_);
    return std::exchange(items_, {});
  }

 private:
  const int fd_;
  absl::Mutex mu_;
  std::deque<std::pair<uint64_t, Reply>> items_ ABSL_GUARDED_BY(mu_);
};

// The socket address of host:port, or INVALID_ARGUMENT naming --ucx_host.
absl::StatusOr<sockaddr_storage> AddressOf(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  const int rc =
      getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("ucx_host: cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  sockaddr_storage out{};
  std::memcpy(&out, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  return out;
}

int PortOf(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
}

}  // namespace

class Listener::Impl {
 public:
  Impl(Listener* owner, const ListenerOptions& options, StepHandler* handler)
      : owner_(owner),
        options_(options),
        handler_(handler),
        mailbox_(std::make_shared<Mailbox>()) {}

  ~Impl() {
    if (thread_.joinable()) thread_.join();
    worker_.reset();
  }

  absl::Status Init() {
    if (mailbox_->fd() < 0) return absl::InternalError("eventfd for the UCX listener failed");
    absl::StatusOr<std::unique_ptr<Worker>> worker = Worker::Create();
    if (!worker.ok()) return worker.status();
    worker_ = *std::move(worker);
    absl::StatusOr<sockaddr_storage> address = AddressOf(options_.host, options_.port);
    if (!address.ok()) return address.status();
    ucp_listener_params_t params{};
    params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*address);
    params.sockaddr.addrlen =
        address->ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    params.conn_handler.cb = [](ucp_conn_request_h request, void* arg) {
      static_cast<Impl*>(arg)->OnConnectionRequest(request);
    };
    params.conn_handler.arg = this;
    ucs_status_t s = ucp_listener_create(worker_->get(), &params, &listener_);
    if (s != UCS_OK) {
      return absl::UnavailableError(absl::StrCat("ucx_port: cannot listen on ", options_.host, ":",
                                                 options_.port, ": ", ucs_status_string(s)));
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(listener_, &attr);
    if (s != UCS_OK) return StatusOf(s, "ucp_listener_query");
    port_ = PortOf(attr.sockaddr);
    return absl::OkStatus();
  }

  int port() const { return port_; }

  void StartThread() {
    thread_ = std::thread([this] { Run(); });
  }

  void RequestStop(absl::Duration grace) {
    {
      absl::MutexLock lock(&stop_mu_);
      if (stop_requested_) return;
      stop_requested_ = true;
      stop_deadline_ = absl::Now() + grace;
    }
    mailbox_->Wake();
    if (thread_.joinable()) thread_.join();
  }

 private:
  enum class Reading { kPrefix, kHeader, kPayload, kTagged };

  struct Connection {
    Impl* owner = nullptr;
    uint64_t id = 0;
    ucp_ep_h ep = nullptr;
    Reading reading = Reading::kPrefix;
    uint8_t prefix[kPrefixBytes];
    std::shared_ptr<StepFrame> frame;
    int payload = 0;
    bool recv_pending = false;
    bool closing = false;       // nothing more is read or sent
    bool close_issued = false;  // ucp_ep_close_nbx has been called
    bool graceful_close = false;
    absl::Time close_at = absl::InfiniteFuture();  // a closing reply's grace ends
    bool close_after_send = false;  // a refused hello or a bad frame: answered, then closed
    int outstanding = 0;            // UCX operations not yet completed
    int in_flight = 0;              // steps handed to the handler and not yet answered
    uint32_t tag_base = 0;          // tags of this connection's tagged payloads
    int tags_left = 0;              // tagged payloads of the current frame not yet received
    // The tagged receives posted and not yet completed (null once done), to
    // cancel on close: they belong to the worker, not the endpoint.
    std::vector<std::shared_ptr<void*>> tag_requests;
    std::shared_ptr<const Session> session;
    std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
  };

  void OnConnectionRequest(ucp_conn_request_h request) {
    if (stopping_ || static_cast<int>(connections_.size()) >= options_.max_connections) {
      ucp_listener_reject(listener_, request);
      return;
    }
    auto c = std::make_unique<Connection>();
    c->id = next_id_++;
    c->owner = this;
    // Never 0 (no tag); random, so one connection cannot aim at another's
    // tags by counting.
    while (c->tag_base == 0) c->tag_base = static_cast<uint32_t>(random_());
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.conn_request = request;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) {
      // Inside UCX: only noted here; Run closes it.
      Connection* conn = static_cast<Connection*>(arg);
      conn->cancelled->store(true, std::memory_order_release);
      conn->owner->pending_errors_.push_back(conn->id);
    };
    params.err_handler.arg = c.get();
    const ucs_status_t s = ucp_ep_create(worker_->get(), &params, &c->ep);
    if (s != UCS_OK) {
      spdlog::warn("ucx: accepting a connection failed: {}", ucs_status_string(s));
      return;
    }
    owner_->accepted_.fetch_add(1, std::memory_order_relaxed);
    owner_->open_.fetch_add(1, std::memory_order_relaxed);
    Connection* raw = c.get();
    connections_.emplace(raw->id, std::move(c));
    Pump(raw);
  }

  // Reads the next piece of the current frame until a read is pending, the
  // connection has its fill of steps in flight, or it closes.
  void Pump(Connection* c) {
    while (!c->closing && !c->recv_pending && !c->close_after_send) {
      if (c->reading == Reading::kPrefix && c->in_flight >= options_.max_in_flight_per_connection) {
        return;
      }
      void* buffer = nullptr;
      size_t size = 0;
      switch (c->reading) {
        case Reading::kPrefix:
          buffer = c->prefix;
          size = kPrefixBytes;
          break;
        case Reading::kHeader:
          buffer = c->frame->header.data();
          size = c->frame->header.size();
          break;
        case Reading::kPayload:
          buffer = c->frame->payloads[c->payload].get();
          size = c->frame->prefix.payload_bytes[c->payload];
          break;
        case Reading::kTagged: return ReceiveTagged(c);
      }
      if (size == 0) {
        Advance(c);
        continue;
      }
      c->recv_pending = true;
      ++c->outstanding;
      const ucs_status_t s = StartRecv(c->ep, buffer, size, [this, c](ucs_status_t st, size_t) {
        --c->outstanding;
        c->recv_pending = false;
        if (st != UCS_OK) return Close(c, "receive failed");
        Advance(c);
        Pump(c);
      });
      if (s == UCS_INPROGRESS) return;
      --c->outstanding;
      c->recv_pending = false;
      if (s != UCS_OK) return Close(c, "receive failed");
      Advance(c);
    }
  }

  // The piece just read is complete: parse it and move on.
  void Advance(Connection* c) {
    switch (c->reading) {
      case Reading::kPrefix: return OnPrefix(c);
      case Reading::kHeader:
        c->reading =
            (c->frame->prefix.flags & kFlagTagged) != 0 ? Reading::kTagged : Reading::kPayload;
        c->payload = 0;
        return;
      case Reading::kTagged:
        c->reading = Reading::kPrefix;
        return OnFrame(c, std::exchange(c->frame, nullptr));
      case Reading::kPayload:
        if (++c->payload < kMaxPayloads) return;
        c->reading = Reading::kPrefix;
        return OnFrame(c, std::exchange(c->frame, nullptr));
    }
  }

  // Posts the receives of a tagged step's payloads (each straight into its
  // buffer, by rendezvous where UCX picks it); the stream is not read until
  // they are all in.
  void ReceiveTagged(Connection* c) {
    const FramePrefix& prefix = c->frame->prefix;
    c->recv_pending = true;
    c->tags_left = 1;  // released below, once every receive is posted
    for (int i = 0; i < kMaxPayloads && !c->closing; ++i) {
      if (prefix.payload_bytes[i] == 0) continue;
      auto slot = std::make_shared<void*>(nullptr);
      ++c->tags_left;
      ++c->outstanding;
      const ucs_status_t s = StartTagRecv(
          worker_->get(), c->frame->payloads[i].get(), prefix.payload_bytes[i],
          PayloadTag(c->tag_base, prefix.tag, /*reply=*/false, i),
          [this, c, slot](ucs_status_t st, size_t) {
            *slot = nullptr;
            --c->outstanding;
            if (st != UCS_OK) return Close(c, "tagged receive failed");
            TaggedArrived(c);
          },
          slot.get());
      if (s == UCS_INPROGRESS) {
        c->tag_requests.push_back(std::move(slot));
        continue;
      }
      --c->outstanding;
      --c->tags_left;
      if (s != UCS_OK) return Close(c, "tagged receive failed");
    }
    TaggedArrived(c);
  }

  void TaggedArrived(Connection* c) {
    if (--c->tags_left > 0 || c->closing) return;
    c->tag_requests.clear();
    c->recv_pending = false;
    Advance(c);
    Pump(c);
  }

  void OnPrefix(Connection* c) {
    absl::StatusOr<FramePrefix> prefix =
        ParsePrefix(c->prefix, kPrefixBytes, options_.limits, Receiver::kServer);
    if (!prefix.ok()) return BadFrame(c, prefix.status());
    const bool hello = prefix->type == FrameType::kHello;
    if (c->session == nullptr && !hello) {
      return BadFrame(c, absl::UnauthenticatedError(
                             "type: expected 1 (hello, with the bearer token) as a connection's "
                             "first frame, got 3 (step)"));
    }
    if (c->session != nullptr && hello) {
      return BadFrame(c,
                      absl::InvalidArgumentError(
                          "type: expected 3 (step) after the connection's hello, got 1 (hello)"));
    }
    auto frame = std::make_shared<StepFrame>();
    frame->prefix = *prefix;
    frame->cancelled = c->cancelled;
    const int64_t bytes = static_cast<int64_t>(prefix->header_bytes + prefix->payload_total());
    if (options_.budget != nullptr) {
      if (!options_.budget->TryCharge(bytes)) {
        return BadFrame(c, absl::ResourceExhaustedError(absl::StrCat(
                               "max_buffered_bytes: the server holds ", options_.budget->used(),
                               " of ", options_.budget->limit(), " buffered bytes; a frame of ",
                               bytes, " does not fit (retry later)")));
      }
      frame->budget = options_.budget;
      frame->charged = bytes;
    }
    frame->header.resize(prefix->header_bytes);
    frame->payloads.resize(kMaxPayloads);
    for (int i = 0; i < kMaxPayloads; ++i) {
      // Not value-initialised: every byte is received before it is read.
      frame->payloads[i].reset(new uint8_t[std::max<uint64_t>(prefix->payload_bytes[i], 1)]);
    }
    c->frame = std::move(frame);
    c->reading = Reading::kHeader;
  }

  void OnFrame(Connection* c, std::shared_ptr<StepFrame> frame) {
    if (frame->prefix.type == FrameType::kHello) {
      absl::StatusOr<std::shared_ptr<const Session>> session = handler_->Hello(frame->header);
      if (!session.ok()) return BadFrame(c, session.status());
      c->session = *std::move(session);
      Reply reply = handler_->StatusReply(FrameType::kHelloReply, absl::OkStatus(), "");
      MarkTagged(&reply.head, c->tag_base);  // steps may send their payloads tagged
      return Send(c, std::move(reply));
    }
    ++c->in_flight;
    ++in_flight_;
    owner_->steps_.fetch_add(1, std::memory_order_relaxed);
    std::optional<uint32_t> tagged;
    if ((frame->prefix.flags & kFlagTagged) != 0) tagged = frame->prefix.tag;
    handler_->Step(c->session, std::move(frame),
                   [mailbox = mailbox_, id = c->id, tagged](Reply reply) {
                     if (tagged.has_value()) {
                       MarkTagged(&reply.head, *tagged);
                       reply.tagged = tagged;
                     }
                     mailbox->Post(id, std::move(reply));
                   });
  }

  // Answers a frame that broke the framing or was refused at the door, then
  // closes the connection (its stream cannot be trusted to be in step).
  void BadFrame(Connection* c, const absl::Status& status) {
    owner_->refused_.fetch_add(1, std::memory_order_relaxed);
    spdlog::warn("ucx: connection {} closed: {}", c->id, std::string(status.message()));
    c->frame = nullptr;
    c->close_after_send = true;
    const FrameType type = c->session == nullptr ? FrameType::kHelloReply : FrameType::kStepReply;
    Reply reply = handler_->StatusReply(type, status, "");
    MarkClosing(&reply.head);
    // The peer closes on reading kFlagClosing; closing here at once could
    // overtake the reply (UCX reports the close on another socket than the
    // data's), so the server only closes after a grace period.
    c->close_at = absl::Now() + kCloseGrace;
    Send(c, std::move(reply));
  }

  // Sends a reply's pieces in order; the reply lives until UCX is done with it.
  void Send(Connection* c, Reply reply) {
    if (c->closing) return;
    auto held = std::make_shared<Reply>(std::move(reply));
    const std::string* pieces[] = {&held->head, &held->payloads[0], &held->payloads[1]};
    for (int i = 0; i < 3; ++i) {
      const std::string* piece = pieces[i];
      if (piece->empty()) continue;
      ++c->outstanding;
      auto done = [this, c, held](ucs_status_t st, size_t) {
        --c->outstanding;
        if (st != UCS_OK) Close(c, "send failed");
      };
      const ucs_status_t s =
          i > 0 && held->tagged.has_value()
              ? StartTagSend(c->ep, piece->data(), piece->size(),
                             PayloadTag(c->tag_base, *held->tagged, /*reply=*/true, i - 1), done)
              : StartSend(c->ep, piece->data(), piece->size(), done);
      if (s == UCS_INPROGRESS) continue;
      --c->outstanding;
      if (s != UCS_OK) return Close(c, "send failed");
    }
  }

  // Marks the connection closed: nothing more is read or sent on it, and Run
  // closes its endpoint outside UCX's callbacks.
  // `graceful`: UCX flushes what was sent before it disconnects (an error
  // reply must reach the peer); otherwise in-flight operations are dropped.
  void Close(Connection* c, const char* why, bool graceful = false) {
    if (c->closing) return;
    c->closing = true;
    c->graceful_close = graceful;
    c->cancelled->store(true, std::memory_order_release);
    spdlog::debug("ucx: connection {} {}", c->id, why);
    to_close_.push_back(c->id);
  }

  // Closes the endpoints of the connections marked since the last round,
  // without waiting; Reap frees each once UCX has released every operation.
  void CloseMarked() {
    for (uint64_t id : std::exchange(pending_errors_, {})) {
      auto it = connections_.find(id);
      if (it != connections_.end()) Close(it->second.get(), "peer gone");
    }
    for (uint64_t id : std::exchange(to_close_, {})) {
      auto it = connections_.find(id);
      if (it == connections_.end() || it->second->close_issued) continue;
      Connection* c = it->second.get();
      c->close_issued = true;
      // Tagged receives are the worker's: cancelled here, they complete
      // (UCS_ERR_CANCELED) while their buffers are still alive.
      for (const std::shared_ptr<void*>& slot : std::exchange(c->tag_requests, {})) {
        if (*slot != nullptr) ucp_request_cancel(worker_->get(), *slot);
      }
      ucp_request_param_t param{};
      param.op_attr_mask =
          UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.flags = c->graceful_close ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
      param.cb.send = [](void* request, ucs_status_t, void* user_data) {
        --static_cast<Connection*>(user_data)->outstanding;
        ucp_request_free(request);
      };
      param.user_data = c;
      ucs_status_ptr_t request = ucp_ep_close_nbx(c->ep, &param);
      if (request != nullptr && !UCS_PTR_IS_ERR(request)) ++c->outstanding;
    }
  }

  // Frees closed connections UCX is done with, and closes those whose
  // closing reply's grace has run out.
  void Reap() {
    const absl::Time now = absl::Now();
    for (auto& [id, c] : connections_) {
      if (!c->closing && c->close_at <= now) Close(c.get(), "closed after its answer", true);
    }
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (it->second->close_issued && it->second->outstanding == 0) {
        owner_->open_.fetch_sub(1, std::memory_order_relaxed);
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Sends the replies completions posted; true when there were any.
  bool DeliverReplies() {
    std::deque<std::pair<uint64_t, Reply>> replies = mailbox_->Take();
    for (auto& [id, reply] : replies) {
      --in_flight_;
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;  // closed meanwhile: nobody to tell
      Connection* c = it->second.get();
      --c->in_flight;
      Send(c, std::move(reply));
      Pump(c);  // reading may resume below the in-flight cap
    }
    return !replies.empty();
  }

  void Run() {
    absl::Time active = absl::Now();
    bool listening = true;
    absl::Time closing_since = absl::InfiniteFuture();
    for (;;) {
      bool busy = worker_->Progress();
      CloseMarked();
      busy |= DeliverReplies();
      Reap();
      bool stop;
      absl::Time deadline;
      {
        absl::MutexLock lock(&stop_mu_);
        stop = stop_requested_;
        deadline = stop_deadline_;
      }
      if (stop) {
        stopping_ = true;
        if (listening) {
          ucp_listener_destroy(listener_);
          listener_ = nullptr;
          listening = false;
        }
        const absl::Time now = absl::Now();
        if ((in_flight_ == 0 || now >= deadline) && closing_since == absl::InfiniteFuture()) {
          for (auto& [id, c] : connections_) Close(c.get(), "server stopping");
          CloseMarked();
          closing_since = now;
        }
        if (connections_.empty() || now - closing_since > absl::Seconds(2)) break;
      }
      if (busy) {
        active = absl::Now();
        continue;
      }
      if (absl::Now() - active < kSpin) continue;
      worker_->Sleep(mailbox_->fd(), stop ? absl::Milliseconds(10) : absl::Milliseconds(200));
      active = absl::Now();
    }
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    listener_ = nullptr;
    connections_.clear();
  }

  // After activity the thread polls this long before it sleeps on the event
  // fds: a step's reply and the next step arrive within it in a decode loop.
  static constexpr absl::Duration kSpin = absl::Microseconds(100);
  // How long a peer that got a closing reply has to close its end.
  static constexpr absl::Duration kCloseGrace = absl::Seconds(2);

  Listener* const owner_;
  const ListenerOptions options_;
  StepHandler* const handler_;
  const std::shared_ptr<Mailbox> mailbox_;
  std::unique_ptr<Worker> worker_;
  ucp_listener_h listener_ = nullptr;
  int port_ = 0;
  std::thread thread_;
  // Listener thread only.
  std::map<uint64_t, std::unique_ptr<Connection>> connections_;
  uint64_t next_id_ = 1;
  std::random_device random_;
  int64_t in_flight_ = 0;
  bool stopping_ = false;
  std::vector<uint64_t> pending_errors_;
  std::vector<uint64_t> to_close_;  // marked by Close, closed by CloseMarked  // peers that failed,
                                    // noted by UCX's error handler

  absl::Mutex stop_mu_;
  bool stop_requested_ ABSL_GUARDED_BY(stop_mu_) = false;
  absl::Time stop_deadline_ ABSL_GUARDED_BY(stop_mu_);
};

absl::StatusOr<std::unique_ptr<Listener>> Listener::Start(const ListenerOptions& options,
                                                          StepHandler* handler) {
  std::unique_ptr<Listener> listener(new Listener());
  listener->impl_ = std::make_unique<Impl>(listener.get(), options, handler);
  absl::Status init = listener->impl_->Init();
  if (!init.ok()) return init;
  listener->port_ = listener->impl_->port();
  listener->impl_->StartThread();
  return listener;
}

Listener::~Listener() { Stop(absl::ZeroDuration()); }

void Listener::Stop(absl::Duration grace) {
  if (impl_ != nullptr) impl_->RequestStop(grace);
}

}  // namespace ucx
}  // namespace attnserve
