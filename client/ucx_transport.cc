// The UCX step transport's client; see ucx_transport.h.
#include "client/ucx_transport.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/ucx/frame.h"

#if ATTNSERVE_HAVE_UCX
#include <netdb.h>
#include <sys/socket.h>

#include <cstdlib>
#include <cstring>
#include <optional>

#include "server/ucx/worker.h"
#endif

namespace attnserve {

absl::StatusOr<StepTransport> ParseStepTransport(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "grpc") return StepTransport::kGrpc;
  if (t == "ucx") return StepTransport::kUcx;
  if (t == "auto") return StepTransport::kAuto;
  return absl::InvalidArgumentError(
      absl::StrCat("--transport: expected grpc, ucx or auto, got '", text, "'"));
}

bool UcxBuilt() { return ATTNSERVE_HAVE_UCX != 0; }

std::string HostOfTarget(const std::string& target) {
  std::string t = target;
  if (absl::StartsWith(t, "unix:")) return "";
  for (const char* scheme : {"dns:///", "dns:", "ipv4:", "ipv6:"}) {
    if (absl::StartsWith(t, scheme)) {
      t = t.substr(std::strlen(scheme));
      break;
    }
  }
  t = t.substr(0, t.find(','));  // the first of several addresses
  if (absl::StartsWith(t, "[")) {
    const size_t close = t.find(']');
    return close == std::string::npos ? "" : t.substr(1, close - 1);
  }
  const size_t colon = t.rfind(':');
  return colon == std::string::npos ? t : t.substr(0, colon);
}

std::string AuthorizationOf(const AttentionClient& client) {
  const std::string& token = client.options().security.token;
  return token.empty() ? std::string() : absl::StrCat("Bearer ", token);
}

UcxOffer AskUcxOffer(AttentionClient& client) {
  UcxOffer offer;
  if (!UcxBuilt()) {
    offer.why_not = "this client was built without UCX";
    return offer;
  }
  absl::StatusOr<v1::GetServerInfoResponse> info = client.GetServerInfo();
  if (!info.ok()) {
    offer.why_not = absl::StrCat("GetServerInfo failed: ", info.status().message());
    return offer;
  }
  if (info->kv().ucx_port() <= 0) {
    offer.why_not = "the server offers no UCX (no --ucx_port)";
    return offer;
  }
  offer.host = HostOfTarget(client.target());
  if (offer.host.empty()) {
    offer.why_not = absl::StrCat("the target '", client.target(), "' names no host for UCX");
    return offer;
  }
  offer.port = info->kv().ucx_port();
  return offer;
}

absl::StatusOr<AppendAttendResult> UcxStepConnection::AppendAttend(const AppendAttendInputs& inputs,
                                                                   absl::Duration timeout) {
  v1::AppendAttendRequest request = MakeAppendAttendRequest(inputs);
  absl::StatusOr<v1::AppendAttendResponse> response = AppendAttend(&request, timeout);
  if (!response.ok()) return response.status();
  return AppendAttendResultFromProto(request, *std::move(response));
}

#if ATTNSERVE_HAVE_UCX

namespace {

// ATTNSERVE_UCX_TAGGED_BYTES: steps whose q, k and v come to at least this
// many bytes send them (and get O and LSE back) as tagged messages; unset,
// "off" or negative: never (on the CPU the rendezvous handshakes cost more
// than the stream's copies: bench/NOTES-serving.md).
int64_t TaggedBytes() {
  static const int64_t bytes = [] {
    const char* text = getenv("ATTNSERVE_UCX_TAGGED_BYTES");
    int64_t value = -1;
    if (text == nullptr || !absl::SimpleAtoi(text, &value)) return int64_t{-1};
    return value;
  }();
  return bytes;
}

}  // namespace

class UcxStepConnection::Impl {
 public:
  ~Impl() {
    if (worker_ != nullptr && ep_ != nullptr) {
      ucx::CloseEndpoint(*worker_, ep_, absl::Now() + absl::Seconds(1));
    }
    ep_ = nullptr;
  }

  absl::Status Connect(const std::string& host, int port, absl::Duration timeout) {
    absl::StatusOr<std::unique_ptr<ucx::Worker>> worker = ucx::Worker::Create();
    if (!worker.ok()) return worker.status();
    worker_ = *std::move(worker);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const std::string service = absl::StrCat(port);
    const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
    if (rc != 0 || found == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("UCX: cannot resolve '", host, "': ", gai_strerror(rc)));
    }
    sockaddr_storage address{};
    const socklen_t length = found->ai_addrlen;
    std::memcpy(&address, found->ai_addr, length);
    freeaddrinfo(found);
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
    params.sockaddr.addrlen = length;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
      auto* self = static_cast<Impl*>(arg);
      self->broken_ = true;
      self->broken_at_ = absl::Now();
      self->failure_ = status;
    };
    params.err_handler.arg = this;
    const ucs_status_t s = ucp_ep_create(worker_->get(), &params, &ep_);
    if (s != UCS_OK) {
      ep_ = nullptr;
      return ucx::StatusOf(s, absl::StrCat("UCX connect to ", host, ":", port));
    }
    where_ = absl::StrCat(host, ":", port);
    (void)timeout;
    return absl::OkStatus();
  }

  // Sends a frame (prefix + header, then the payloads: on the stream, or as
  // tagged messages of step `tagged`) and reads the reply.
  absl::StatusOr<v1::AppendAttendResponse> Exchange(const std::string& head,
                                                    const std::string* payloads[3],
                                                    ucx::FrameType expect, absl::Time deadline,
                                                    std::string* o, std::string* lse,
                                                    std::optional<uint32_t> tagged = std::nullopt) {
    if (broken_) return Broken();
    int sends_left = 0;
    bool send_failed = false;
    int index = -1;  // the payload being sent; -1: the head
    auto send = [&](const std::string& piece) {
      if (piece.empty()) return;
      auto done = [&](ucs_status_t st, size_t) {
        --sends_left;
        if (st != UCS_OK) send_failed = true;
      };
      const ucs_status_t s =
          index >= 0 && tagged.has_value()
              ? ucx::StartTagSend(ep_, piece.data(), piece.size(),
                                  ucx::PayloadTag(tag_base_, *tagged, /*reply=*/false, index), done)
              : ucx::StartSend(ep_, piece.data(), piece.size(), done);
      if (s == UCS_INPROGRESS) {
        ++sends_left;
      } else if (s != UCS_OK) {
        send_failed = true;
      }
    };
    send(head);
    for (int i = 0; i < 3 && payloads != nullptr; ++i) {
      index = i;
      if (payloads[i] != nullptr) send(*payloads[i]);
    }
    absl::StatusOr<v1::AppendAttendResponse> reply = ReadReply(expect, deadline, o, lse);
    // The payloads must not be touched before UCX is done with them.
    absl::Status sent = worker_->WaitFor([&] { return sends_left == 0; }, deadline);
    if (!sent.ok() || send_failed) broken_ = true;
    if (broken_) {
      // Closing completes what is still in flight now, while the buffers and
      // the counters above are alive.
      ucx::CloseEndpoint(*worker_, ep_, absl::Now() + absl::Seconds(1));
      ep_ = nullptr;
    }
    return reply;
  }

  absl::StatusOr<v1::AppendAttendResponse> ReadReply(ucx::FrameType expect, absl::Time deadline,
                                                     std::string* o, std::string* lse) {
    uint8_t prefix_bytes[ucx::kPrefixBytes];
    absl::Status got = Recv(prefix_bytes, sizeof(prefix_bytes), deadline);
    if (!got.ok()) return got;
    ucx::FrameLimits limits;
    limits.max_frame_bytes = uint64_t{1} << 40;  // the server bounds what it sends
    absl::StatusOr<ucx::FramePrefix> prefix =
        ucx::ParsePrefix(prefix_bytes, sizeof(prefix_bytes), limits, ucx::Receiver::kClient);
    if (!prefix.ok()) {
      broken_ = true;
      return absl::InternalError(
          absl::StrCat("UCX reply from ", where_, ": ", prefix.status().message()));
    }
    std::string header(prefix->header_bytes, '\0');
    got = Recv(header.data(), header.size(), deadline);
    std::string scratch_o, scratch_lse;
    std::string* outs[2] = {o != nullptr ? o : &scratch_o, lse != nullptr ? lse : &scratch_lse};
    const bool tagged = (prefix->flags & ucx::kFlagTagged) != 0;
    if (prefix->type == ucx::FrameType::kHelloReply) {
      // The server's tag base: steps may send their payloads tagged.
      if (tagged) tag_base_ = prefix->tag;
    } else if (tagged && got.ok()) {
      for (int i = 0; i < 2; ++i) outs[i]->resize(prefix->payload_bytes[i]);
      got = RecvTagged(outs, prefix->tag, deadline);
    } else {
      for (int i = 0; i < 2 && got.ok(); ++i) {
        outs[i]->resize(prefix->payload_bytes[i]);
        got = Recv(outs[i]->data(), outs[i]->size(), deadline);
      }
    }
    if (!got.ok()) return got;
    v1::AppendAttendResponse response;
    if (!response.ParseFromString(header)) {
      broken_ = true;
      return absl::InternalError(absl::StrCat("UCX reply from ", where_,
                                              ": header: not a serialized AppendAttendResponse"));
    }
    // The server closes after this reply (a refused hello, a frame that broke
    // the framing), or answered a hello where a step reply was due: done.
    if (prefix->type != expect || (prefix->flags & ucx::kFlagClosing) != 0) broken_ = true;
    return response;
  }

  bool broken() const { return broken_; }
  // The server's tag base from its hello reply; 0: it takes no tagged payloads.
  uint32_t tag_base() const { return tag_base_; }
  uint32_t NextSeq() {
    ++tagged_steps_;
    return next_seq_++;
  }
  int64_t tagged_bytes = TaggedBytes();
  int64_t tagged_steps() const { return tagged_steps_; }

 private:
  // Receives a step reply's O and LSE as tagged messages of step `seq`, each
  // straight into its buffer. On failure the receives still posted are
  // cancelled (they belong to the worker) before the buffers go.
  absl::Status RecvTagged(std::string* outs[2], uint32_t seq, absl::Time deadline) {
    int left = 0;
    ucs_status_t failed = UCS_OK;
    void* requests[2] = {nullptr, nullptr};
    for (int i = 0; i < 2; ++i) {
      if (outs[i]->empty()) continue;
      const ucs_status_t s = ucx::StartTagRecv(
          worker_->get(), outs[i]->data(), outs[i]->size(),
          ucx::PayloadTag(tag_base_, seq, /*reply=*/true, i),
          [&, i](ucs_status_t st, size_t) {
            --left;
            requests[i] = nullptr;
            if (st != UCS_OK) failed = st;
          },
          &requests[i]);
      if (s == UCS_INPROGRESS) {
        ++left;
      } else if (s != UCS_OK) {
        failed = s;
      }
    }
    const absl::Status waited = worker_->WaitFor(
        [&] { return left == 0 || (broken_ && absl::Now() - broken_at_ > kCloseGrace); }, deadline);
    if (left > 0) {
      for (void* r : requests) {
        if (r != nullptr) ucp_request_cancel(worker_->get(), r);
      }
      worker_->WaitFor([&] { return left == 0; }, absl::Now() + absl::Seconds(1)).IgnoreError();
      broken_ = true;
    }
    const std::string what = absl::StrCat("UCX tagged reply from ", where_);
    if (!waited.ok())
      return absl::Status(waited.code(), absl::StrCat(what, ": ", waited.message()));
    if (failure_ != UCS_OK && left > 0) return ucx::StatusOf(failure_, what);
    if (failed != UCS_OK) {
      broken_ = true;
      return ucx::StatusOf(failed, what);
    }
    return absl::OkStatus();
  }

  // Receives exactly `size` bytes. Stops waiting as soon as the peer is gone
  // (UCX's error handler ran): the endpoint is closed here, which completes
  // the receive while `data` is still alive.
  absl::Status Recv(void* data, size_t size, absl::Time deadline) {
    if (size == 0) return absl::OkStatus();
    if (ep_ == nullptr) return Broken();
    auto state = std::make_shared<std::pair<bool, ucs_status_t>>(false, UCS_OK);
    const ucs_status_t started = ucx::StartRecv(ep_, data, size, [state](ucs_status_t st, size_t) {
      state->first = true;
      state->second = st;
    });
    if (started == UCS_OK) return absl::OkStatus();
    absl::Status waited;
    if (started == UCS_INPROGRESS) {
      // Bytes the peer sent before it closed (an error reply, then the close)
      // may still be on their way when UCX reports the close: a moment's grace.
      waited = worker_->WaitFor(
          [&] { return state->first || (broken_ && absl::Now() - broken_at_ > kCloseGrace); },
          deadline);
      if (state->first && state->second == UCS_OK) return absl::OkStatus();
    }
    broken_ = true;
    ucx::CloseEndpoint(*worker_, ep_, absl::Now() + absl::Seconds(1));
    ep_ = nullptr;
    const std::string what = absl::StrCat("UCX connection to ", where_);
    if (failure_ != UCS_OK) return ucx::StatusOf(failure_, what);
    if (started != UCS_INPROGRESS) return ucx::StatusOf(started, what);
    if (!waited.ok())
      return absl::Status(waited.code(), absl::StrCat(what, ": ", waited.message()));
    return ucx::StatusOf(state->second, what);
  }

  absl::Status Broken() const {
    return absl::UnavailableError(absl::StrCat(
        "UCX connection to ", where_, " is broken",
        failure_ != UCS_OK ? absl::StrCat(": ", ucs_status_string(failure_)) : std::string()));
  }

  std::unique_ptr<ucx::Worker> worker_;
  ucp_ep_h ep_ = nullptr;
  static constexpr absl::Duration kCloseGrace = absl::Milliseconds(200);
  bool broken_ = false;
  absl::Time broken_at_;
  ucs_status_t failure_ = UCS_OK;
  std::string where_;
  uint32_t tag_base_ = 0;
  uint32_t next_seq_ = 0;
  int64_t tagged_steps_ = 0;
};

UcxStepConnection::UcxStepConnection(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxStepConnection::~UcxStepConnection() = default;

bool UcxStepConnection::broken() const { return impl_->broken(); }
void UcxStepConnection::set_tagged_bytes(int64_t bytes) { impl_->tagged_bytes = bytes; }
int64_t UcxStepConnection::tagged_steps() const { return impl_->tagged_steps(); }

absl::StatusOr<std::unique_ptr<UcxStepConnection>> UcxStepConnection::Connect(
    const std::string& host, int port, const std::string& authorization, absl::Duration timeout) {
  auto impl = std::make_unique<Impl>();
  absl::Status connected = impl->Connect(host, port, timeout);
  if (!connected.ok()) return connected;
  ucx::FramePrefix prefix;
  prefix.type = ucx::FrameType::kHello;
  prefix.header_bytes = static_cast<uint32_t>(authorization.size());
  const std::string head = ucx::EncodePrefix(prefix) + authorization;
  absl::StatusOr<v1::AppendAttendResponse> reply = impl->Exchange(
      head, nullptr, ucx::FrameType::kHelloReply, absl::Now() + timeout, nullptr, nullptr);
  if (!reply.ok()) return reply.status();
  const absl::Status hello = StatusFromRpcCode(reply->error_code(), reply->error_message());
  if (!hello.ok()) return hello;
  return std::unique_ptr<UcxStepConnection>(new UcxStepConnection(std::move(impl)));
}

absl::StatusOr<v1::AppendAttendResponse> UcxStepConnection::AppendAttend(
    v1::AppendAttendRequest* request, absl::Duration timeout) {
  // The tensors' bytes leave the message for the payloads and come back after.
  std::string q = std::move(*request->mutable_q()->mutable_data());
  std::string k = std::move(*request->mutable_k()->mutable_data());
  std::string v = std::move(*request->mutable_v()->mutable_data());
  request->mutable_q()->clear_data();
  request->mutable_k()->clear_data();
  request->mutable_v()->clear_data();
  const std::string header = request->SerializeAsString();
  ucx::FramePrefix prefix;
  prefix.type = ucx::FrameType::kStep;
  prefix.header_bytes = static_cast<uint32_t>(header.size());
  prefix.payload_bytes[ucx::kQ] = q.size();
  prefix.payload_bytes[ucx::kK] = k.size();
  prefix.payload_bytes[ucx::kV] = v.size();
  const std::string* payloads[3] = {&q, &k, &v};
  // Large steps send their payloads tagged (one rendezvous transfer each
  // where UCX picks it) when the server takes them.
  std::optional<uint32_t> tagged;
  const int64_t threshold = impl_->tagged_bytes;
  if (impl_->tag_base() != 0 && threshold >= 0 &&
      static_cast<int64_t>(prefix.payload_total()) >= threshold) {
    tagged = impl_->NextSeq() & 0xffffffu;
    prefix.flags = ucx::kFlagTagged;
    prefix.tag = *tagged;
  }
  std::string o, lse;
  absl::StatusOr<v1::AppendAttendResponse> reply =
      impl_->Exchange(ucx::EncodePrefix(prefix) + header, payloads, ucx::FrameType::kStepReply,
                      absl::Now() + timeout, &o, &lse, tagged);
  *request->mutable_q()->mutable_data() = std::move(q);
  *request->mutable_k()->mutable_data() = std::move(k);
  *request->mutable_v()->mutable_data() = std::move(v);
  if (!reply.ok()) return reply.status();
  const absl::Status refused = StatusFromRpcCode(reply->error_code(), reply->error_message());
  if (!refused.ok()) return refused;
  if (reply->has_o()) *reply->mutable_o()->mutable_data() = std::move(o);
  if (reply->has_lse()) *reply->mutable_lse()->mutable_data() = std::move(lse);
  return reply;
}

absl::StatusOr<v1::AppendAttendResponse> UcxStepConnection::SendRawAndRead(const std::string& bytes,
                                                                           absl::Duration timeout) {
  return impl_->Exchange(bytes, nullptr, ucx::FrameType::kStepReply, absl::Now() + timeout, nullptr,
                         nullptr);
}

#else  // !ATTNSERVE_HAVE_UCX

class UcxStepConnection::Impl {};

UcxStepConnection::UcxStepConnection(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxStepConnection::~UcxStepConnection() = default;

bool UcxStepConnection::broken() const { return true; }
void UcxStepConnection::set_tagged_bytes(int64_t) {}
int64_t UcxStepConnection::tagged_steps() const { return 0; }

absl::StatusOr<std::unique_ptr<UcxStepConnection>> UcxStepConnection::Connect(const std::string&,
                                                                              int,
                                                                              const std::string&,
                                                                              absl::Duration) {
  return absl::UnimplementedError("this client was built without UCX (docs/ucx.md)");
}

absl::StatusOr<v1::AppendAttendResponse> UcxStepConnection::AppendAttend(v1::AppendAttendRequest*,
                                                                         absl::Duration) {
  return absl::UnimplementedError("this client was built without UCX (docs/ucx.md)");
}

absl::StatusOr<v1::AppendAttendResponse> UcxStepConnection::SendRawAndRead(const std::string&,
                                                                           absl::Duration) {
  return absl::UnimplementedError("this client was built without UCX (docs/ucx.md)");
}

#endif  // ATTNSERVE_HAVE_UCX

}  // namespace attnserve
