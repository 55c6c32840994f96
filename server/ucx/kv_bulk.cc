// Bulk K/V chunks over UCX; see kv_bulk.h.
#include "server/ucx/kv_bulk.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/ucx/worker.h"
#include "spdlog/spdlog.h"

#if ATTNSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace attnserve {
namespace ucx {
namespace {

constexpr uint32_t kBulkMagic = 0x31564b41;  // "AKV1" little-endian
enum BulkType : uint16_t { kHello = 1, kHelloReply = 2, kChunk = 3, kAck = 4 };
constexpr uint16_t kSequenceEnd = 1;
constexpr uint32_t kMaxText = 4096;
// A connection to a receiver says its hello within this, or it is closed.
constexpr absl::Duration kHelloDeadline = absl::Seconds(5);
// Connections that have not said their hello yet, at most: one more closes
// the oldest (a real sender says its hello as soon as it connects).
constexpr size_t kMaxPendingHellos = 8;

// One message's fixed part (the host's byte order: little-endian machines).
struct BulkFrame {
  uint32_t magic = kBulkMagic;
  uint16_t type = 0;
  uint16_t flags = 0;
  uint64_t index = 0;  // the chunk's number on its connection (chunk, ack)
  uint64_t sequence_id = 0;
  int32_t layer = 0;
  int32_t token_begin = 0;
  int32_t num_tokens = 0;
  uint32_t crc32c = 0;
  uint32_t sizes[4] = {0, 0, 0, 0};  // k, v, k_scale, v_scale
  int32_t code = 0;                  // replies: absl::StatusCode
  uint32_t message_bytes = 0;        // text after the frame
};
static_assert(sizeof(BulkFrame) == 64, "BulkFrame is 64 bytes on the wire");

// The tag of payload `i` of chunk `index`.
uint64_t ChunkTag(uint64_t index, int i) {
  return (uint64_t{0xb0} << 56) | ((index & ((uint64_t{1} << 52) - 1)) << 2) | uint64_t(i);
}

std::string* Part(KvTransferChunk* c, int i) {
  switch (i) {
    case 0: return &c->k;
    case 1: return &c->v;
    case 2: return &c->k_scale;
    default: return &c->v_scale;
  }
}

absl::Status StatusOfReply(const BulkFrame& f, const std::string& text) {
  // absl's codes are 0..16: another is no status the server can answer with.
  if (f.code < 0 || f.code > 16) {
    return absl::InternalError(
        absl::StrCat("UCX data plane: a reply's code: expected 0..16, got ", f.code));
  }
  return absl::Status(static_cast<absl::StatusCode>(f.code), text);
}

// An eventfd another thread writes to wake the UCX thread's sleep.
class WakeFd {
 public:
  WakeFd() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~WakeFd() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }
  void Wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(fd_, &one, sizeof(one));
  }
  void Drain() {
    uint64_t count;
    [[maybe_unused]] ssize_t n = read(fd_, &count, sizeof(count));
  }

 private:
  const int fd_;
};

// A staging buffer (a std::string's storage) page-locked for the GPU copies
// while it is this size or smaller; registered again if it moves. Called on
// the thread that copies, after a copy: the backend has made the cache's
// device current there (a thread with none would start another device's
// context). A no-op without a PinHost (and where pinning fails: the copies
// then stage as usual).
class PinnedBuffer {
 public:
  explicit PinnedBuffer(const PinHost* pin) : pin_(pin) {}
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { Release(); }
  // Before the tracked storage is freed or handed on: registered memory must
  // not be freed, and a new allocation at the same address is not registered.
  void Release() {
    handle_.reset();
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void Track(std::string* s) {
    if (pin_ == nullptr || !*pin_ || s->capacity() == 0) return;
    if (s->data() == ptr_ && s->capacity() <= bytes_) return;
    Release();
    handle_ = (*pin_)(s->data(), s->capacity());
    if (handle_ == nullptr) return;
    ptr_ = s->data();
    bytes_ = s->capacity();
  }
  // The sender's: its buffers are reserved for the largest part up front and
  // never move, so only the bytes in use are page-locked, again only when a
  // part is longer than any before it (the buffer is not freed meanwhile).
  void TrackInUse(const std::string& s) {
    if (pin_ == nullptr || !*pin_ || s.empty()) return;
    if (s.data() == ptr_ && s.size() <= bytes_) return;
    Release();
    handle_ = (*pin_)(const_cast<char*>(s.data()), s.size());
    if (handle_ == nullptr) return;
    ptr_ = const_cast<char*>(s.data());
    bytes_ = s.size();
  }

 private:
  const PinHost* const pin_;
  std::shared_ptr<void> handle_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

absl::StatusOr<sockaddr_storage> Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("UCX data plane: cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  sockaddr_storage out{};
  std::memcpy(&out, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  return out;
}

socklen_t LengthOf(const sockaddr_storage& a) {
  return a.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
}

std::string RandomTicket() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) out += absl::StrCat(absl::Hex(rd(), absl::kZeroPad8));
  return out;
}

}  // namespace

bool BulkBuilt() { return true; }

PinHost DefaultPinHost() {
#if ATTNSERVE_HAVE_CUDA
  return [](void* data, size_t bytes) -> std::shared_ptr<void> {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    if (cudaHostRegister(data, bytes, cudaHostRegisterPortable) != cudaSuccess) {
      cudaGetLastError();  // not sticky: the copies run from pageable memory
      return nullptr;
    }
    // Undone on the device it was registered on; the thread's own is put back.
    return std::shared_ptr<void>(data, [device](void* p) {
      int current = -1;
      if (cudaGetDevice(&current) != cudaSuccess) current = -1;
      if (current != device) cudaSetDevice(device);
      cudaHostUnregister(p);
      if (current >= 0 && current != device) cudaSetDevice(current);
      cudaGetLastError();
    });
  };
#else
  return nullptr;
#endif
}

// --- Receiver ---

class BulkReceiver::Impl {
 public:
  Impl(Apply apply, const BulkOptions& options) : apply_(std::move(apply)), options_(options) {}

  ~Impl() {
    Stop();
    // Destroyed by the progress thread; here only when it never started.
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    listener_ = nullptr;
    worker_.reset();
  }

  absl::Status Init(const std::string& host) {
    if (wake_.fd() < 0) return absl::InternalError("eventfd for the UCX data plane failed");
    absl::StatusOr<std::unique_ptr<Worker>> worker = Worker::Create();
    if (!worker.ok()) return worker.status();
    worker_ = *std::move(worker);
    absl::StatusOr<sockaddr_storage> address = Resolve(host, 0, true);
    if (!address.ok()) return address.status();
    ucp_listener_params_t params{};
    params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*address);
    params.sockaddr.addrlen = LengthOf(*address);
    params.conn_handler.cb = [](ucp_conn_request_h request, void* arg) {
      static_cast<Impl*>(arg)->OnConnectionRequest(request);
    };
    params.conn_handler.arg = this;
    ucs_status_t s = ucp_listener_create(worker_->get(), &params, &listener_);
    if (s != UCS_OK) return StatusOf(s, absl::StrCat("UCX data plane: listen on ", host));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(listener_, &attr);
    if (s != UCS_OK) {
      ucp_listener_destroy(listener_);
      listener_ = nullptr;
      return StatusOf(s, "ucp_listener_query");
    }
    offer_.host = host;
    offer_.port = attr.sockaddr.ss_family == AF_INET
                      ? ntohs(reinterpret_cast<const sockaddr_in&>(attr.sockaddr).sin_port)
                      : ntohs(reinterpret_cast<const sockaddr_in6&>(attr.sockaddr).sin6_port);
    offer_.ticket = RandomTicket();
    for (int i = 0; i < std::max(options_.window, 1); ++i) {
      free_.push_back(std::make_unique<Slot>(&options_.pin_host));
    }
    // A thread that does not start fails the receiver (its caller answers
    // with the status); one started is stopped again by Stop.
    absl::StatusOr<std::thread> progress = StartThread("the receiver", [this] { Run(); });
    if (!progress.ok()) return progress.status();
    progress_ = *std::move(progress);
    absl::StatusOr<std::thread> applier =
        StartThread("the receiver's apply", [this] { ApplyLoop(); });
    if (!applier.ok()) return applier.status();
    applier_ = *std::move(applier);
    return absl::OkStatus();
  }

  const BulkOffer& offer() const { return offer_; }
  int64_t chunks() const { return chunks_.load(std::memory_order_relaxed); }
  int64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }
  int64_t buffered_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t total = 0;
    auto add = [&](Slot& slot) {
      for (int i = 0; i < 4; ++i) total += int64_t(Part(&slot.chunk, i)->capacity());
    };
    for (auto& slot : free_) add(*slot);
    for (auto& [index, slot] : ready_) add(*slot);
    return total;
  }
  int64_t discarded() const { return discarded_.load(std::memory_order_relaxed); }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    if (applier_.joinable()) applier_.join();
    wake_.Wake();
    if (progress_.joinable()) progress_.join();
  }

 private:
  // A chunk being received or waiting to be applied.
  struct Slot {
    explicit Slot(const PinHost* pin) : pinned{PinnedBuffer(pin), PinnedBuffer(pin)} {}
    KvTransferChunk chunk;
    PinnedBuffer pinned[2];        // k, v: the H2D copies' sources
    std::shared_ptr<void> charge;  // BulkOptions::charge's token, until applied
    uint64_t index = 0;
    int tags_left = 0;
    std::vector<std::shared_ptr<void*>> requests;
  };
  struct Ack {
    uint64_t index = 0;
    absl::Status status;
  };

  // A connection before its hello. Several are heard at once (up to
  // kMaxPendingHellos), so one that says nothing (or a wrong ticket) does
  // not keep the sender out; the first with the ticket becomes the import's
  // connection and the others are closed.
  struct Pending {
    ucp_ep_h ep = nullptr;
    BulkFrame in;
    std::string text;
    absl::Time deadline;                          // its hello by then, or closed
    absl::Time drop_at = absl::InfiniteFuture();  // refused: closed by then
    bool gone = false;                            // the peer went (or an error)
    bool closing = false;                         // no longer heard
    int outstanding = 0;
  };

  void OnConnectionRequest(ucp_conn_request_h request) {
    // One sender per import stream (a resumed export comes with a new
    // stream): the ticket is used up only by a hello that carries it.
    if (hello_done_ || stop_seen_) {
      ucp_listener_reject(listener_, request);
      return;
    }
    // Closes happen on the progress loop's next turn (not inside UCX's callbacks).
    size_t live = 0;
    for (const std::shared_ptr<Pending>& q : pending_) live += q->drop_at == absl::InfiniteFuture();
    for (const std::shared_ptr<Pending>& q : pending_) {
      if (live < kMaxPendingHellos) break;
      if (q->drop_at != absl::InfiniteFuture()) continue;
      q->drop_at = absl::Now();
      --live;
    }
    auto p = std::make_shared<Pending>();
    p->deadline = absl::Now() + kHelloDeadline;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.conn_request = request;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = [](void* arg, ucp_ep_h ep, ucs_status_t) {
      static_cast<Impl*>(arg)->OnEndpointError(ep);
    };
    params.err_handler.arg = this;
    if (ucp_ep_create(worker_->get(), &params, &p->ep) != UCS_OK) return;
    pending_.push_back(p);
    ++p->outstanding;
    const ucs_status_t s =
        StartRecv(p->ep, &p->in, sizeof(p->in), [this, p](ucs_status_t st, size_t) {
          --p->outstanding;
          if (st != UCS_OK) return void(p->gone = true);
          OnPendingFrame(p);
        });
    if (s == UCS_INPROGRESS) return;
    --p->outstanding;
    if (s != UCS_OK) return void(p->gone = true);
    OnPendingFrame(p);
  }

  void OnEndpointError(ucp_ep_h ep) {
    if (ep == ep_) {
      peer_gone_ = true;
      return;
    }
    for (const std::shared_ptr<Pending>& p : pending_) {
      if (p->ep == ep) p->gone = true;
    }
  }

  void OnPendingFrame(const std::shared_ptr<Pending>& p) {
    if (p->closing) return;
    if (p->in.magic != kBulkMagic || p->in.type != kHello || p->in.message_bytes > kMaxText) {
      p->drop_at = absl::Now();  // not a sender of this protocol
      return;
    }
    p->text.assign(p->in.message_bytes, '\0');
    if (p->text.empty()) return OnHello(p);
    ++p->outstanding;
    const ucs_status_t s =
        StartRecv(p->ep, p->text.data(), p->text.size(), [this, p](ucs_status_t st, size_t) {
          --p->outstanding;
          if (st != UCS_OK) return void(p->gone = true);
          OnHello(p);
        });
    if (s == UCS_INPROGRESS) return;
    --p->outstanding;
    if (s != UCS_OK) return void(p->gone = true);
    OnHello(p);
  }

  void OnHello(const std::shared_ptr<Pending>& p) {
    if (p->closing) return;
    BulkFrame reply;
    reply.type = kHelloReply;
    if (p->text != offer_.ticket || hello_done_) {
      const std::string text =
          "ticket: not this import's (the UCX data plane takes the ticket its import answered)";
      reply.code = static_cast<int32_t>(absl::StatusCode::kUnauthenticated);
      reply.message_bytes = static_cast<uint32_t>(text.size());
      auto held = std::make_shared<std::string>(sizeof(reply) + text.size(), '\0');
      std::memcpy(held->data(), &reply, sizeof(reply));
      std::memcpy(held->data() + sizeof(reply), text.data(), text.size());
      ++p->outstanding;
      const ucs_status_t s = StartSend(p->ep, held->data(), held->size(),
                                       [p, held](ucs_status_t, size_t) { --p->outstanding; });
      if (s != UCS_INPROGRESS) --p->outstanding;
      // Closed once the sender has read the reply and gone, or a second on.
      p->drop_at = absl::Now() + absl::Seconds(1);
      return;
    }
    // The import's sender: the other connections are closed.
    ep_ = p->ep;
    p->ep = nullptr;
    pending_.erase(std::find(pending_.begin(), pending_.end(), p));
    for (const std::shared_ptr<Pending>& q : pending_) q->drop_at = absl::Now();
    hello_done_ = true;
    last_heard_ = absl::Now();
    SendFrame(reply, "");
    ReadFrame();
  }

  // Closes a connection that never said a good hello (UCX stops queuing
  // what it sends); the listener hears the next.
  void ClosePending(std::shared_ptr<Pending> p) {
    p->closing = true;  // its operations' completions (in the progress below) do nothing
    auto it = std::find(pending_.begin(), pending_.end(), p);
    if (it != pending_.end()) pending_.erase(it);
    if (p->ep != nullptr) CloseEndpoint(*worker_, p->ep, absl::Now() + absl::Seconds(1));
    p->ep = nullptr;
    const absl::Time until = absl::Now() + absl::Seconds(1);
    while (p->outstanding > 0 && absl::Now() < until) worker_->Progress();
  }

  bool Receiving() const { return !receiving_.empty() || waiting_slot_; }

  void CheckPending() {
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < pending_.size();) {
      const std::shared_ptr<Pending> p = pending_[i];
      if ((p->gone && p->outstanding == 0) || now >= p->drop_at || now >= p->deadline) {
        ClosePending(p);
      } else {
        ++i;
      }
    }
  }

  void ReadFrame() {
    if (ep_ == nullptr || broken_ || stop_seen_) return;
    reading_ = true;
    ++outstanding_;
    const ucs_status_t s = StartRecv(ep_, &in_, sizeof(in_), [this](ucs_status_t st, size_t) {
      --outstanding_;
      reading_ = false;
      if (st != UCS_OK) return Break("receive failed");
      OnFrame();
    });
    if (s == UCS_INPROGRESS) return;
    --outstanding_;
    reading_ = false;
    if (s != UCS_OK) return Break("receive failed");
    OnFrame();
  }

  void OnFrame() {
    if (in_.magic != kBulkMagic || in_.message_bytes > kMaxText) {
      return Break("a frame with a bad magic or text size");
    }
    if (in_.type != kChunk) return Break("a frame out of order");
    last_heard_ = absl::Now();
    // Chunks are numbered 0, 1, 2, ... on their connection: a repeated or
    // skipped number would alias a slot being received (and its tags).
    if (in_.index != next_index_) {
      Refuse(in_.index, absl::InvalidArgumentError(
                            absl::StrCat("chunk.index: expected ", next_index_, ", got ", in_.index,
                                         " (the UCX data plane numbers chunks in order from 0)")));
      return Break("a chunk out of order");
    }
    ++next_index_;
    return OnChunkFrame();
  }

  // A chunk's frame is in: its payloads are received into a free slot (the
  // stream is read on at once: many chunks in flight), or the stream waits
  // for a slot.
  void OnChunkFrame() {
    uint64_t total = 0;
    for (uint32_t s : in_.sizes) total += s;
    if (int64_t(total) > options_.max_chunk_bytes || in_.num_tokens < 0) {
      Refuse(in_.index, absl::InvalidArgumentError(absl::StrCat(
                            "chunk: ", total, " payload bytes; the UCX data plane takes at most ",
                            options_.max_chunk_bytes, " per chunk (max_chunk_bytes)")));
      return Break("a chunk over the data plane's size limit");
    }
    std::shared_ptr<void> charge;
    if (options_.charge && !waiting_slot_) {
      absl::StatusOr<std::shared_ptr<void>> charged = options_.charge(int64_t(total));
      if (!charged.ok()) {
        Refuse(in_.index, charged.status());
        return Break("a chunk over its budget (the tenant's or the server's)");
      }
      charge = *std::move(charged);
    } else if (options_.charge) {
      charge = std::move(waiting_charge_);
    }
    std::unique_ptr<Slot> slot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        slot = std::move(free_.front());
        free_.pop_front();
      }
    }
    if (slot == nullptr) {
      waiting_slot_ = true;  // DeliverAcks resumes once the applier frees one
      waiting_charge_ = std::move(charge);
      return;
    }
    waiting_slot_ = false;
    slot->charge = std::move(charge);  // the previous chunk's goes
    // Buffers above this chunk's charge are given back before it is received
    // (k's and v's page-locking undone first).
    for (int i = 0; i < 4; ++i) {
      std::string* part = Part(&slot->chunk, i);
      if (i < 2 && Refits(*part, in_.sizes[i])) slot->pinned[i].Release();
      FitTo(part, in_.sizes[i]);
    }
    KvTransferChunk& c = slot->chunk;
    c.sequence_id = in_.sequence_id;
    c.layer = in_.layer;
    c.token_begin = in_.token_begin;
    c.num_tokens = in_.num_tokens;
    c.crc32c = in_.crc32c;
    c.sequence_end = (in_.flags & kSequenceEnd) != 0;
    slot->index = in_.index;
    slot->tags_left = 1;  // released below, once every receive is posted
    slot->requests.clear();
    Slot* raw = slot.get();
    if (!receiving_.try_emplace(raw->index, std::move(slot)).second) {
      slot->charge.reset();
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(std::move(slot));
      return Break("a chunk index already being received");
    }
    for (int i = 0; i < 4; ++i) {
      std::string* part = Part(&raw->chunk, i);
      part->resize(in_.sizes[i]);
      if (part->empty()) continue;
      auto request = std::make_shared<void*>(nullptr);
      ++raw->tags_left;
      ++outstanding_;
      const ucs_status_t s = StartTagRecv(
          worker_->get(), part->data(), part->size(), ChunkTag(raw->index, i),
          [this, raw, request](ucs_status_t st, size_t) {
            *request = nullptr;
            --outstanding_;
            last_heard_ = absl::Now();
            if (st != UCS_OK) return Break("a tagged receive failed");
            Arrived(raw);
          },
          request.get());
      if (s != UCS_INPROGRESS) {
        --outstanding_;
        --raw->tags_left;
        return Break("a tagged receive failed");
      }
      raw->requests.push_back(std::move(request));
    }
    Arrived(raw);
    ReadFrame();
  }

  // `s` at `n` bytes in an allocation of about that size (the charge is the
  // payload's): a larger one from an earlier chunk is given back first.
  static bool Refits(const std::string& s, size_t n) {
    constexpr size_t kSlack = 64;
    return s.capacity() > n + kSlack || s.capacity() < n;
  }
  static void FitTo(std::string* s, size_t n) {
    if (Refits(*s, n)) {
      std::string().swap(*s);
      s->reserve(n);  // exactly (growing in place may double it)
    }
    s->resize(n);
  }

  void Arrived(Slot* slot) {
    if (--slot->tags_left > 0 || broken_) return;
    auto it = receiving_.find(slot->index);
    if (it == receiving_.end()) return;
    std::unique_ptr<Slot> done = std::move(it->second);
    receiving_.erase(it);
    done->requests.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint64_t index = done->index;
      if (!ready_.try_emplace(index, std::move(done)).second) {
        // Unreachable with indexes checked in order; the slot stays in the pool.
        done->charge.reset();
        free_.push_back(std::move(done));
        broken_ = true;
        return;
      }
    }
    cv_.notify_all();
  }

  // The apply thread: chunks in index order, each acknowledged.
  void ApplyLoop() {
    uint64_t next = 0;
    bool failed = false;
    for (;;) {
      std::unique_ptr<Slot> slot;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || (!failed && ready_.count(next) > 0); });
        if (stopping_) return;
        auto it = ready_.find(next);
        slot = std::move(it->second);
        ready_.erase(it);
      }
      Ack ack;
      ack.index = next;
      ack.status = apply_(slot->chunk);
      // The slot keeps its buffers for the next chunk, and with them their
      // charge (replaced by that chunk's, or given back when the connection ends).
      // Page-locked after its first copy, for the chunks this slot takes next.
      for (int p = 0; p < 2; ++p) slot->pinned[p].Track(Part(&slot->chunk, p));
      if (ack.status.ok()) {
        chunks_.fetch_add(1, std::memory_order_relaxed);
        bytes_.fetch_add(slot->chunk.payload_bytes(), std::memory_order_relaxed);
      } else {
        failed = true;  // nothing after a refusal is applied
      }
      ++next;
      {
        std::lock_guard<std::mutex> lock(mu_);
        acks_.push_back(std::move(ack));
        if (!closed_) free_.push_back(std::move(slot));  // else it goes with its charge
      }
      wake_.Wake();
    }
  }

  void DeliverAcks() {
    std::deque<Ack> acks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      acks.swap(acks_);
    }
    for (const Ack& a : acks) {
      ++acks_sent_;
      BulkFrame f;
      f.type = kAck;
      f.index = a.index;
      f.code = static_cast<int32_t>(a.status.code());
      const std::string text(a.status.message().substr(0, kMaxText));
      f.message_bytes = static_cast<uint32_t>(text.size());
      SendFrame(f, text);
    }
    if (waiting_slot_ && !broken_) OnChunkFrame();
  }

  // Refuses chunk `index` before it is received: the sender stops on it.
  void Refuse(uint64_t index, const absl::Status& status) {
    BulkFrame f;
    f.type = kAck;
    f.index = index;
    f.code = static_cast<int32_t>(status.code());
    const std::string text(status.message().substr(0, kMaxText));
    f.message_bytes = static_cast<uint32_t>(text.size());
    SendFrame(f, text);
  }

  void SendFrame(const BulkFrame& f, const std::string& text) {
    if (ep_ == nullptr || broken_) return;
    auto held = std::make_shared<std::string>(sizeof(f) + text.size(), '\0');
    std::memcpy(held->data(), &f, sizeof(f));
    std::memcpy(held->data() + sizeof(f), text.data(), text.size());
    ++outstanding_;
    const ucs_status_t s =
        StartSend(ep_, held->data(), held->size(), [this, held](ucs_status_t st, size_t) {
          --outstanding_;
          if (st != UCS_OK) Break("send failed");
        });
    if (s == UCS_INPROGRESS) return;
    --outstanding_;
    if (s != UCS_OK) Break("send failed");
  }

  // The connection is done for: what was received and not applied is dropped.
  void Break(const char* why) {
    if (broken_) return;
    broken_ = true;
    // A refusal just sent gets a moment to reach the sender (which then
    // goes); a peer already gone is closed at once.
    close_at_ = absl::Now() + absl::Seconds(1);
    spdlog::debug("kv import over UCX: connection ended ({})", why);
  }

  void CloseConnection() {
    for (auto& [index, slot] : receiving_) {
      for (const std::shared_ptr<void*>& r : slot->requests) {
        if (*r != nullptr) ucp_request_cancel(worker_->get(), *r);
      }
    }
    if (ep_ != nullptr) {
      CloseEndpoint(*worker_, ep_, absl::Now() + absl::Seconds(1));
      ep_ = nullptr;
    }
    const absl::Time until = absl::Now() + absl::Seconds(2);
    while (outstanding_ > 0 && absl::Now() < until) worker_->Progress();
  }

  // The ticket holder's connection broke (the peer went, a transport error,
  // a refusal sent): it is closed at once, not left for UCX to queue what
  // the peer still sends, and what was received and not applied is dropped
  // with its charge and buffers. The import takes no second connection: a
  // resume comes with a new import stream and a new ticket.
  void CloseBroken() {
    spdlog::info("kv import over UCX: the sender's connection closed after {} chunk(s) applied",
                 chunks_.load(std::memory_order_relaxed));
    CloseConnection();
    DropChunks();
  }

  void DropChunks() {
    receiving_.clear();
    waiting_charge_.reset();
    waiting_slot_ = false;
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    ready_.clear();
    free_.clear();
  }

  // Only a chunk payload whose frame is still to be read may wait in UCX's
  // queue of tagged messages nobody has asked for: one of the window's
  // chunks (from the next frame's index to the first unacknowledged plus
  // the window), at most max_chunk_bytes, from the ticket holder. Any other
  // is taken out of the queue and closes its connection; one that waits
  // longer than the timeout for its frame does too. So the queue holds at
  // most the window's chunks.
  void CheckUnexpected() {
    for (int n = 0; n < 64; ++n) {
      ucp_tag_recv_info_t info{};
      if (ucp_tag_probe_nb(worker_->get(), 0, 0, 0, &info) == nullptr) return;
      const uint64_t tag = info.sender_tag;
      const uint64_t index = (tag >> 2) & ((uint64_t{1} << 52) - 1);
      const uint64_t low = next_index_ - (waiting_slot_ ? 1 : 0);
      const bool inside = hello_done_ && !broken_ && (tag >> 56) == 0xb0 && index >= low &&
                          index < acks_sent_ + uint64_t(std::max(options_.window, 1)) &&
                          int64_t(info.length) <= options_.max_chunk_bytes;
      if (inside) {
        const absl::Time now = absl::Now();
        if (tag != head_tag_ || !head_seen_) {
          head_tag_ = tag;
          head_seen_ = true;
          head_since_ = now;
        } else if (now - head_since_ > options_.timeout) {
          Break("a chunk payload whose frame never came");
        }
        return;
      }
      Discard(tag);
      if (!hello_done_) {
        // A real sender sends none before its hello; whose it was cannot be
        // told, so every connection still before its hello is closed.
        while (!pending_.empty()) ClosePending(pending_.front());
        continue;
      }
      if (ep_ == nullptr) continue;  // from the connection already closed
      Break("a tagged message outside the import's window");
    }
  }

  // Takes the first message tagged `tag` out of the queue and receives it
  // truncated into a scratch buffer (UCX then drops its payload).
  void Discard(uint64_t tag) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h m = ucp_tag_probe_nb(worker_->get(), tag, ~uint64_t{0}, 1, &info);
    if (m == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_DATATYPE;
    param.cb.recv = [](void*, ucs_status_t, const ucp_tag_recv_info_t*, void*) {};
    param.datatype = ucp_dt_make_contig(1);
    ucs_status_ptr_t r =
        ucp_tag_msg_recv_nbx(worker_->get(), scratch_, sizeof(scratch_), m, &param);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);  // released by UCX once done
    ++discarded_;
  }

  void Run() {
    absl::Time active = absl::Now();
    for (;;) {
      bool busy = worker_->Progress();
      bool stop;
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop = stopping_;
        busy |= !acks_.empty();
      }
      if (stop) {
        stop_seen_ = true;
        break;
      }
      wake_.Drain();
      DeliverAcks();
      if (peer_gone_ && !broken_) Break("the sender is gone");
      CheckPending();
      if (ep_ != nullptr && !broken_ && Receiving() &&
          absl::Now() - last_heard_ > options_.timeout) {
        Break("a chunk half-received and nothing heard for the timeout");
      }
      if (ep_ != nullptr && hello_done_ && broken_ && (peer_gone_ || absl::Now() >= close_at_)) {
        CloseBroken();
      }
      CheckUnexpected();
      if (busy) {
        active = absl::Now();
        continue;
      }
      if (absl::Now() - active < absl::Microseconds(100)) continue;
      worker_->Sleep(wake_.fd(), absl::Milliseconds(100));
      active = absl::Now();
    }
    broken_ = true;
    while (!pending_.empty()) ClosePending(pending_.front());
    CloseConnection();
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    listener_ = nullptr;
    // Chunks received and not applied are dropped, and their charges go.
    DropChunks();
  }

  const Apply apply_;
  const BulkOptions options_;
  std::unique_ptr<Worker> worker_;
  ucp_listener_h listener_ = nullptr;
  BulkOffer offer_;
  WakeFd wake_;
  std::thread progress_, applier_;
  std::atomic<int64_t> chunks_{0}, bytes_{0};

  // The progress thread's.
  ucp_ep_h ep_ = nullptr;
  std::vector<std::shared_ptr<Pending>> pending_;  // before their hello, oldest first
  absl::Time last_heard_;                          // the sender's last frame or payload
  bool hello_done_ = false;
  uint64_t next_index_ = 0;  // the next chunk frame's index
  bool reading_ = false;
  bool waiting_slot_ = false;
  bool broken_ = false;
  bool stop_seen_ = false;
  std::atomic<bool> peer_gone_{false};
  int outstanding_ = 0;
  BulkFrame in_;
  std::shared_ptr<void> waiting_charge_;  // the charge of the frame waiting for a slot
  absl::Time close_at_;                   // a broken connection after its hello: closed by then
  uint64_t acks_sent_ = 0;
  uint64_t head_tag_ = 0;  // the queue's first unasked-for message, waiting for its frame
  bool head_seen_ = false;
  absl::Time head_since_;
  std::atomic<int64_t> discarded_{0};
  char scratch_[64];
  std::map<uint64_t, std::unique_ptr<Slot>> receiving_;

  // Shared with the apply thread.
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool closed_ = false;  // the connection is over: slots are not kept
  std::deque<std::unique_ptr<Slot>> free_;
  std::map<uint64_t, std::unique_ptr<Slot>> ready_;
  std::deque<Ack> acks_;
};

BulkReceiver::BulkReceiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BulkReceiver::~BulkReceiver() { Stop(); }

absl::StatusOr<std::unique_ptr<BulkReceiver>> BulkReceiver::Start(const std::string& host,
                                                                  Apply apply,
                                                                  const BulkOptions& options) {
  auto impl = std::make_unique<Impl>(std::move(apply), options);
  absl::Status init = impl->Init(host);
  if (!init.ok()) return init;
  return std::unique_ptr<BulkReceiver>(new BulkReceiver(std::move(impl)));
}

const BulkOffer& BulkReceiver::offer() const { return impl_->offer(); }
void BulkReceiver::Stop() {
  if (impl_ != nullptr) impl_->Stop();
}
int64_t BulkReceiver::chunks() const { return impl_->chunks(); }
int64_t BulkReceiver::bytes() const { return impl_->bytes(); }
int64_t BulkReceiver::buffered_bytes() const { return impl_->buffered_bytes(); }
int64_t BulkReceiver::discarded() const { return impl_->discarded(); }

// --- Sender ---

namespace {

class Sender {
 public:
  Sender(const BulkOptions& options, const std::atomic<bool>* cancelled)
      : options_(options), cancelled_(cancelled) {}

  ~Sender() {
    StopProducer();
    if (worker_ != nullptr) {
      if (ep_ != nullptr) CloseEndpoint(*worker_, ep_, absl::Now() + absl::Seconds(1));
      const absl::Time until = absl::Now() + absl::Seconds(2);
      while (outstanding_ > 0 && absl::Now() < until) worker_->Progress();
    }
  }

  absl::Status Run(const BulkOffer& offer, const NextChunk& next, BulkSendResult* result) {
    result_ = result;
    if (wake_.fd() < 0) return absl::InternalError("eventfd for the UCX data plane failed");
    absl::StatusOr<std::unique_ptr<Worker>> worker = Worker::Create();
    if (!worker.ok()) return worker.status();
    worker_ = *std::move(worker);
    where_ = absl::StrCat(offer.host, ":", offer.port);
    absl::StatusOr<sockaddr_storage> address = Resolve(offer.host, offer.port, false);
    if (!address.ok()) return address.status();
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*address);
    params.sockaddr.addrlen = LengthOf(*address);
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) {
      static_cast<Sender*>(arg)->peer_gone_ = true;
    };
    params.err_handler.arg = this;
    const ucs_status_t s = ucp_ep_create(worker_->get(), &params, &ep_);
    if (s != UCS_OK) {
      ep_ = nullptr;
      return StatusOf(s, absl::StrCat("UCX data plane: connect to ", where_));
    }
    RETURN_IF_ERROR(Hello(offer.ticket));
    for (int i = 0; i < std::max(options_.window, 1); ++i) {
      auto slot = std::make_unique<Slot>(&options_.pin_host);
      if (options_.chunk_bytes > 0) {
        // Either of K and V may take the whole chunk (an MLA cache's K, a
        // head_dim above head_dim_v), and a slot's first chunk may be short:
        // sized for a whole chunk each now, they never move while page-locked.
        // Untouched, the reserve is address space, not memory.
        for (int p = 0; p < 2; ++p) Part(&slot->chunk, p)->reserve(size_t(options_.chunk_bytes));
      }
      free_.push_back(std::move(slot));
    }
    absl::StatusOr<std::thread> producer =
        StartThread("the sender's producer", [this, &next] { Produce(next); });
    if (!producer.ok()) return producer.status();
    producer_ = *std::move(producer);
    ReadAck();
    return Loop();
  }

 private:
  struct Slot {
    explicit Slot(const PinHost* pin) : pinned{PinnedBuffer(pin), PinnedBuffer(pin)} {}
    KvTransferChunk chunk;
    PinnedBuffer pinned[2];  // k, v: the D2H copies' destinations
    BulkFrame frame;
    int sends_left = 0;
    bool acked = false;
  };

  absl::Status Hello(const std::string& ticket) {
    const absl::Time deadline = absl::Now() + options_.timeout;
    BulkFrame hello;
    hello.type = kHello;
    hello.message_bytes = static_cast<uint32_t>(ticket.size());
    hello_bytes_.assign(sizeof(hello) + ticket.size(), '\0');
    std::memcpy(hello_bytes_.data(), &hello, sizeof(hello));
    std::memcpy(hello_bytes_.data() + sizeof(hello), ticket.data(), ticket.size());
    RETURN_IF_ERROR(Wrap(Await("UCX stream send", deadline, [&](OpDone done) {
      return StartSend(ep_, hello_bytes_.data(), hello_bytes_.size(), std::move(done));
    })));
    BulkFrame& reply = ack_;
    RETURN_IF_ERROR(Wrap(Await("UCX stream receive", deadline, [&](OpDone done) {
      return StartRecv(ep_, &reply, sizeof(reply), std::move(done));
    })));
    if (reply.magic != kBulkMagic || reply.type != kHelloReply || reply.message_bytes > kMaxText) {
      return absl::InternalError(absl::StrCat("UCX data plane at ", where_, ": a bad hello reply"));
    }
    ack_text_.assign(reply.message_bytes, '\0');
    if (!ack_text_.empty()) {
      RETURN_IF_ERROR(Wrap(Await("UCX stream receive", deadline, [&](OpDone done) {
        return StartRecv(ep_, ack_text_.data(), ack_text_.size(), std::move(done));
      })));
    }
    return StatusOfReply(reply, ack_text_);
  }

  // One stream operation on the hello, waited for until `deadline` or until
  // the export is cancelled (its buffer is a member: it outlives a wait given up).
  absl::Status Await(const char* what, absl::Time deadline,
                     const std::function<ucs_status_t(OpDone)>& start) {
    auto state = std::make_shared<std::pair<bool, ucs_status_t>>(false, UCS_OK);
    const ucs_status_t started = start([state](ucs_status_t st, size_t) {
      state->first = true;
      state->second = st;
    });
    if (started == UCS_OK) return absl::OkStatus();
    if (started != UCS_INPROGRESS) return StatusOf(started, what);
    const absl::Status waited = worker_->WaitFor(
        [&] {
          return state->first ||
                 (cancelled_ != nullptr && cancelled_->load(std::memory_order_acquire));
        },
        deadline);
    if (!waited.ok())
      return absl::Status(waited.code(), absl::StrCat(what, ": ", waited.message()));
    if (!state->first) return absl::CancelledError("the export was cancelled");
    return state->second == UCS_OK ? absl::OkStatus() : StatusOf(state->second, what);
  }

  absl::Status Wrap(const absl::Status& s) const {
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat("UCX data plane at ", where_, ": ", s.message()));
  }

  // The producer thread: reads chunks (the pages' copies) ahead of the sends.
  void Produce(const NextChunk& next) {
    for (;;) {
      std::unique_ptr<Slot> slot;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !free_.empty(); });
        if (stop_) return;
        slot = std::move(free_.front());
        free_.pop_front();
      }
      absl::StatusOr<bool> more = next(&slot->chunk);
      if (more.ok() && *more && options_.chunk_bytes > 0) {
        for (int p = 0; p < 2; ++p) {
          const std::string& part = *Part(&slot->chunk, p);
          if (int64_t(part.size()) > options_.chunk_bytes) {
            more = absl::InternalError(absl::StrCat(
                "UCX data plane: a chunk's ", p == 0 ? "k" : "v", " of ", part.size(),
                " bytes is over the sender's chunk_bytes (", options_.chunk_bytes, ")"));
            break;
          }
          // Page-locked after its copy, in the buffer reserved for it.
          slot->pinned[p].TrackInUse(part);
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!more.ok() || !*more) {
          produced_all_ = true;
          produce_status_ = more.status();
        } else {
          produced_.push_back(std::move(slot));
        }
      }
      wake_.Wake();
      if (!more.ok() || !*more) return;
    }
  }

  void StopProducer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (producer_.joinable()) producer_.join();
  }

  void SendChunk(std::unique_ptr<Slot> slot) {
    Slot* s = slot.get();
    const KvTransferChunk& c = s->chunk;
    BulkFrame& f = s->frame;
    f = BulkFrame();
    f.type = kChunk;
    f.flags = c.sequence_end ? kSequenceEnd : 0;
    f.index = next_index_++;
    f.sequence_id = c.sequence_id;
    f.layer = c.layer;
    f.token_begin = c.token_begin;
    f.num_tokens = c.num_tokens;
    f.crc32c = c.crc32c;
    for (int i = 0; i < 4; ++i) {
      f.sizes[i] = static_cast<uint32_t>(Part(const_cast<KvTransferChunk*>(&c), i)->size());
    }
    s->sends_left = 0;
    s->acked = false;
    in_flight_.emplace(f.index, std::move(slot));
    auto done = [this, s](ucs_status_t st, size_t) {
      --outstanding_;
      --s->sends_left;
      if (st != UCS_OK) failure_ = st;
      MaybeFree(s->frame.index);
    };
    auto start = [&](ucs_status_t started) {
      if (started == UCS_INPROGRESS) {
        ++outstanding_;
        ++s->sends_left;
      } else if (started != UCS_OK) {
        failure_ = started;
      }
    };
    start(StartSend(ep_, &f, sizeof(f), done));
    for (int i = 0; i < 4; ++i) {
      const std::string* part = Part(&s->chunk, i);
      if (part->empty()) continue;
      start(StartTagSend(ep_, part->data(), part->size(), ChunkTag(f.index, i), done));
    }
  }

  // A chunk's slot goes back to the producer once it is sent and acknowledged.
  void MaybeFree(uint64_t index) {
    auto it = in_flight_.find(index);
    if (it == in_flight_.end() || it->second->sends_left > 0 || !it->second->acked) return;
    std::unique_ptr<Slot> slot = std::move(it->second);
    in_flight_.erase(it);
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(std::move(slot));
    }
    cv_.notify_all();
  }

  // Acks are read one after another for as long as the connection lives.
  void ReadAck() {
    ++outstanding_;
    const ucs_status_t s = StartRecv(ep_, &ack_, sizeof(ack_), [this](ucs_status_t st, size_t) {
      --outstanding_;
      if (st != UCS_OK) {
        failure_ = st;
        return;
      }
      OnAckFrame();
    });
    if (s == UCS_INPROGRESS) return;
    --outstanding_;
    if (s != UCS_OK) {
      failure_ = s;
      return;
    }
    OnAckFrame();
  }

  void OnAckFrame() {
    if (ack_.magic != kBulkMagic || ack_.type != kAck || ack_.message_bytes > kMaxText) {
      error_ = absl::InternalError(absl::StrCat("UCX data plane at ", where_, ": a bad ack"));
      return;
    }
    ack_text_.assign(ack_.message_bytes, '\0');
    if (ack_text_.empty()) return OnAck();
    ++outstanding_;
    const ucs_status_t s =
        StartRecv(ep_, ack_text_.data(), ack_text_.size(), [this](ucs_status_t st, size_t) {
          --outstanding_;
          if (st != UCS_OK) {
            failure_ = st;
            return;
          }
          OnAck();
        });
    if (s == UCS_INPROGRESS) return;
    --outstanding_;
    if (s != UCS_OK) {
      failure_ = s;
      return;
    }
    OnAck();
  }

  void OnAck() {
    last_ack_ = absl::Now();
    if (ack_.code != 0) {
      error_ = StatusOfReply(ack_, ack_text_);
      return;
    }
    auto it = in_flight_.find(ack_.index);
    if (it == in_flight_.end()) {
      error_ = absl::InternalError(absl::StrCat("UCX data plane at ", where_, ": an ack of chunk ",
                                                ack_.index, ", which is not in flight"));
      return;
    }
    it->second->acked = true;
    if (result_ != nullptr) {
      ++result_->chunks;
      result_->bytes += it->second->chunk.payload_bytes();
    }
    MaybeFree(ack_.index);
    ReadAck();
  }

  absl::Status Loop() {
    absl::Time active = absl::Now();
    last_ack_ = active;
    for (;;) {
      bool busy = worker_->Progress();
      if (!error_.ok()) return error_;
      if (failure_ != UCS_OK || peer_gone_) {
        return absl::UnavailableError(absl::StrCat(
            "UCX data plane at ", where_, ": the connection broke (",
            ucs_status_string(failure_ != UCS_OK ? failure_ : UCS_ERR_CONNECTION_RESET), ")"));
      }
      if (cancelled_ != nullptr && cancelled_->load(std::memory_order_acquire)) {
        return absl::CancelledError("the export was cancelled");
      }
      std::deque<std::unique_ptr<Slot>> produced;
      bool all = false;
      absl::Status produce_status;
      {
        std::lock_guard<std::mutex> lock(mu_);
        produced.swap(produced_);
        all = produced_all_;
        produce_status = produce_status_;
      }
      wake_.Drain();
      for (auto& slot : produced) SendChunk(std::move(slot));
      busy |= !produced.empty();
      if (all && produced.empty() && in_flight_.empty()) return produce_status;
      if (all && !produce_status.ok()) return produce_status;
      const absl::Time now = absl::Now();
      if (!in_flight_.empty() && now - last_ack_ > options_.timeout) {
        return absl::DeadlineExceededError(absl::StrCat("UCX data plane at ", where_,
                                                        ": no acknowledgement in ",
                                                        absl::FormatDuration(options_.timeout)));
      }
      if (busy) {
        active = now;
        continue;
      }
      if (now - active < absl::Microseconds(100)) continue;
      worker_->Sleep(wake_.fd(), absl::Milliseconds(20));
      active = absl::Now();
    }
  }

  const BulkOptions options_;
  const std::atomic<bool>* const cancelled_;
  BulkSendResult* result_ = nullptr;
  std::unique_ptr<Worker> worker_;
  ucp_ep_h ep_ = nullptr;
  std::string where_;
  WakeFd wake_;
  std::thread producer_;

  // The UCX thread's.
  std::atomic<bool> peer_gone_{false};
  ucs_status_t failure_ = UCS_OK;
  absl::Status error_;
  int outstanding_ = 0;
  uint64_t next_index_ = 0;
  std::map<uint64_t, std::unique_ptr<Slot>> in_flight_;
  BulkFrame ack_;
  std::string ack_text_;
  std::string hello_bytes_;
  absl::Time last_ack_;

  // Shared with the producer.
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool produced_all_ = false;
  absl::Status produce_status_;
  std::deque<std::unique_ptr<Slot>> free_;
  std::deque<std::unique_ptr<Slot>> produced_;
};

}  // namespace

absl::Status SendChunks(const BulkOffer& offer, const NextChunk& next, const BulkOptions& options,
                        const std::atomic<bool>* cancelled, BulkSendResult* result) {
  Sender sender(options, cancelled);
  return sender.Run(offer, next, result);
}

}  // namespace ucx
}  // namespace attnserve
