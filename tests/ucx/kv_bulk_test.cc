// The UCX data plane of K/V transfers alone (server/ucx/kv_bulk.h), over
// loopback with UCX_TLS from the environment: chunks of every size (empty
// ones and FP8 scales included) arrive whole and in order with a window in
// flight; a hello with another ticket is refused before anything is applied;
// the receiver's refusal of one chunk stops the sender with that status and
// nothing after it is applied; a cancelled sender stops; hostile peers (a
// broken connection, tags outside the window, silent connections) are closed
// and give back what they held; a thread that does not start is an error.
#include "server/ucx/kv_bulk.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/ucx/worker.h"

namespace attnserve {
namespace ucx {
namespace {

KvTransferChunk RandomChunk(std::mt19937* rng, int index) {
  KvTransferChunk c;
  c.sequence_id = uint64_t(1000 + index / 4);
  c.layer = index % 4;
  c.token_begin = index * 3;
  c.num_tokens = index % 7;
  c.sequence_end = index % 4 == 3;
  const size_t rows = size_t(index % 7) * (index % 3 == 0 ? 4096 : 64);
  for (std::string* part : {&c.k, &c.v}) {
    part->resize(rows);
    for (char& b : *part) b = static_cast<char>((*rng)());
  }
  if (index % 5 == 0) {  // FP8-like scales on some
    c.k_scale.assign(size_t(index % 7) * 8, 'k');
    c.v_scale.assign(size_t(index % 7) * 8, 'v');
  }
  c.crc32c = static_cast<uint32_t>((*rng)());
  return c;
}

bool Same(const KvTransferChunk& a, const KvTransferChunk& b) {
  return a.sequence_id == b.sequence_id && a.layer == b.layer && a.token_begin == b.token_begin &&
         a.num_tokens == b.num_tokens && a.sequence_end == b.sequence_end && a.crc32c == b.crc32c &&
         a.k == b.k && a.v == b.v && a.k_scale == b.k_scale && a.v_scale == b.v_scale;
}

struct Received {
  std::mutex mu;
  std::vector<KvTransferChunk> chunks;
};

NextChunk From(const std::vector<KvTransferChunk>* chunks, std::atomic<size_t>* at) {
  return [chunks, at](KvTransferChunk* c) -> absl::StatusOr<bool> {
    const size_t i = at->fetch_add(1);
    if (i >= chunks->size()) return false;
    *c = (*chunks)[i];
    return true;
  };
}

TEST(KvBulkTest, ChunksArriveWholeAndInOrder) {
  std::mt19937 rng(7);
  std::vector<KvTransferChunk> sent;
  for (int i = 0; i < 60; ++i) sent.push_back(RandomChunk(&rng, i));
  Received got;
  BulkOptions options;
  options.window = 4;
  auto receiver = BulkReceiver::Start(
      "127.0.0.1",
      [&](const KvTransferChunk& c) {
        std::lock_guard<std::mutex> lock(got.mu);
        got.chunks.push_back(c);
        return absl::OkStatus();
      },
      options);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  std::atomic<size_t> at{0};
  BulkSendResult result;
  const absl::Status sent_status =
      SendChunks((*receiver)->offer(), From(&sent, &at), options, nullptr, &result);
  ASSERT_TRUE(sent_status.ok()) << sent_status;
  (*receiver)->Stop();
  EXPECT_EQ(result.chunks, 60);
  int64_t bytes = 0;
  for (const KvTransferChunk& c : sent) bytes += c.payload_bytes();
  EXPECT_EQ(result.bytes, bytes);
  EXPECT_EQ((*receiver)->bytes(), bytes);
  ASSERT_EQ(got.chunks.size(), sent.size());
  for (size_t i = 0; i < sent.size(); ++i) EXPECT_TRUE(Same(got.chunks[i], sent[i])) << i;
}

TEST(KvBulkTest, AnotherTicketIsRefusedBeforeAnythingIsApplied) {
  std::atomic<int> applied{0};
  auto receiver = BulkReceiver::Start("127.0.0.1", [&](const KvTransferChunk&) {
    ++applied;
    return absl::OkStatus();
  });
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  BulkOffer wrong = (*receiver)->offer();
  wrong.ticket[0] = wrong.ticket[0] == '0' ? '1' : '0';
  std::mt19937 rng(1);
  std::vector<KvTransferChunk> sent = {RandomChunk(&rng, 1)};
  std::atomic<size_t> at{0};
  const absl::Status status = SendChunks(wrong, From(&sent, &at), {}, nullptr, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "ticket")) << status;
  (*receiver)->Stop();
  EXPECT_EQ(applied.load(), 0);
}

TEST(KvBulkTest, ARefusedChunkStopsTheSenderWithItsStatus) {
  std::mt19937 rng(3);
  std::vector<KvTransferChunk> sent;
  for (int i = 0; i < 40; ++i) sent.push_back(RandomChunk(&rng, i));
  std::atomic<int> applied{0};
  auto receiver = BulkReceiver::Start("127.0.0.1", [&](const KvTransferChunk&) {
    if (applied.fetch_add(1) == 7) return absl::DataLossError("chunk.crc32c: expected 1, got 2");
    return absl::OkStatus();
  });
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  std::atomic<size_t> at{0};
  BulkSendResult result;
  const absl::Status status =
      SendChunks((*receiver)->offer(), From(&sent, &at), {}, nullptr, &result);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_EQ(status.message(), "chunk.crc32c: expected 1, got 2");
  (*receiver)->Stop();
  EXPECT_EQ(applied.load(), 8) << "chunks after the refused one were applied";
  EXPECT_EQ(result.chunks, 7);
  EXPECT_EQ((*receiver)->chunks(), 7);
}

// Every chunk is charged from its arrival until it is applied; a charge
// refused stops the sender with that status, and every charge is given back.
TEST(KvBulkTest, ChunksAreChargedUntilAppliedAndARefusedChargeStopsTheSender) {
  std::mt19937 rng(9);
  std::vector<KvTransferChunk> sent;
  for (int i = 0; i < 30; ++i) sent.push_back(RandomChunk(&rng, i));
  std::atomic<int64_t> held{0};
  std::atomic<int> charges{0};
  std::atomic<int64_t> held_while_applying{-1};
  BulkOptions options;
  options.charge = [&](int64_t bytes) -> absl::StatusOr<std::shared_ptr<void>> {
    if (charges.fetch_add(1) == 20) {
      return absl::ResourceExhaustedError("bytes_in_flight: the tenant holds too much");
    }
    held += bytes;
    return std::shared_ptr<void>(new int(0), [&held, bytes](void* p) {
      held -= bytes;
      delete static_cast<int*>(p);
    });
  };
  auto receiver = BulkReceiver::Start(
      "127.0.0.1",
      [&](const KvTransferChunk& c) {
        if (c.payload_bytes() > 0)
          held_while_applying = std::max<int64_t>(held_while_applying, held);
        return absl::OkStatus();
      },
      options);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  std::atomic<size_t> at{0};
  const absl::Status status =
      SendChunks((*receiver)->offer(), From(&sent, &at), options, nullptr, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "bytes_in_flight")) << status;
  (*receiver)->Stop();
  EXPECT_GT(held_while_applying.load(), 0) << "a chunk was applied without its charge";
  EXPECT_EQ(held.load(), 0) << "charges were not given back";
  EXPECT_LE((*receiver)->chunks(), 20);
}

TEST(KvBulkTest, ACancelledSenderStops) {
  auto receiver =
      BulkReceiver::Start("127.0.0.1", [](const KvTransferChunk&) { return absl::OkStatus(); });
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  std::atomic<bool> cancelled{false};
  std::atomic<int> produced{0};
  std::mt19937 rng(5);
  const KvTransferChunk chunk = RandomChunk(&rng, 2);
  // Endless chunks: the sender ends only because it is cancelled (after 20).
  NextChunk next = [&](KvTransferChunk* c) -> absl::StatusOr<bool> {
    if (produced.fetch_add(1) == 20) cancelled = true;
    *c = chunk;
    return true;
  };
  const absl::Status status = SendChunks((*receiver)->offer(), next, {}, &cancelled, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  (*receiver)->Stop();
}

// The data plane's frame as a hostile sender writes it (kv_bulk.cc's
// BulkFrame: 64 bytes, host byte order).
struct RawFrame {
  uint32_t magic = 0x31564b41;
  uint16_t type = 0;
  uint16_t flags = 0;
  uint64_t index = 0;
  uint64_t sequence_id = 0;
  int32_t layer = 0;
  int32_t token_begin = 0;
  int32_t num_tokens = 0;
  uint32_t crc32c = 0;
  uint32_t sizes[4] = {0, 0, 0, 0};
  int32_t code = 0;
  uint32_t message_bytes = 0;
};
static_assert(sizeof(RawFrame) == 64, "the wire frame is 64 bytes");

// kv_bulk.cc's ChunkTag: the tag of payload `i` of chunk `index`.
uint64_t RawChunkTag(uint64_t index, int i) {
  return (uint64_t{0xb0} << 56) | (index << 2) | uint64_t(i);
}

absl::Time TestDeadline() { return absl::Now() + absl::Seconds(10); }

// Waits (progressing nothing: the receiver has threads of its own) until
// `done` holds, at most 10 seconds.
bool WaitUntil(const std::function<bool()>& done) {
  const absl::Time until = TestDeadline();
  while (!done()) {
    if (absl::Now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// A sender that writes frames (and tagged messages) of its own choosing to a
// receiver's offer.
class RawSender {
 public:
  explicit RawSender(const BulkOffer& offer) {
    auto worker = Worker::Create();
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) return;
    worker_ = *std::move(worker);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(uint16_t(offer.port));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    params.sockaddr.addrlen = sizeof(addr);
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    EXPECT_EQ(ucp_ep_create(worker_->get(), &params, &ep_), UCS_OK);
  }
  ~RawSender() { Close(); }
  // Goes away (a force close: the receiver sees its peer gone).
  void Close() {
    if (ep_ != nullptr) CloseEndpoint(*worker_, ep_, absl::Now() + absl::Seconds(1));
    ep_ = nullptr;
  }
  absl::Status Send(const RawFrame& f, const std::string& text = "") {
    std::string bytes(sizeof(f) + text.size(), '\0');
    std::memcpy(bytes.data(), &f, sizeof(f));
    std::memcpy(bytes.data() + sizeof(f), text.data(), text.size());
    return SendAll(*worker_, ep_, bytes.data(), bytes.size(), TestDeadline());
  }
  // Sends `bytes` as a tagged message and waits until it has left.
  absl::Status SendTagged(uint64_t tag, const std::string& bytes) {
    auto done = std::make_shared<std::pair<bool, ucs_status_t>>(false, UCS_OK);
    const ucs_status_t s =
        StartTagSend(ep_, bytes.data(), bytes.size(), tag, [done](ucs_status_t st, size_t) {
          done->first = true;
          done->second = st;
        });
    if (s == UCS_OK) return absl::OkStatus();
    if (s != UCS_INPROGRESS) return StatusOf(s, "tagged send");
    absl::Status waited = worker_->WaitFor([&] { return done->first; }, TestDeadline());
    if (!waited.ok()) return waited;
    return done->second == UCS_OK ? absl::OkStatus() : StatusOf(done->second, "tagged send");
  }
  // The next reply's status (its code and text), or the receive's error.
  absl::Status Reply(RawFrame* f) {
    absl::Status s = RecvAll(*worker_, ep_, f, sizeof(*f), TestDeadline());
    if (!s.ok()) return s;
    std::string text(f->message_bytes, '\0');
    s = RecvAll(*worker_, ep_, text.data(), text.size(), TestDeadline());
    if (!s.ok()) return s;
    return absl::Status(static_cast<absl::StatusCode>(f->code), text);
  }
  absl::Status Hello(const std::string& ticket) {
    RawFrame hello;
    hello.type = 1;
    hello.message_bytes = uint32_t(ticket.size());
    absl::Status s = Send(hello, ticket);
    if (!s.ok()) return s;
    RawFrame reply;
    return Reply(&reply);
  }

 private:
  std::unique_ptr<Worker> worker_;
  ucp_ep_h ep_ = nullptr;
};

// A receiver of its own choosing on a thread of its own: accepts every
// connection and calls `on_connection` once with the first, progressing its
// worker until destroyed.
class RawListener {
 public:
  using OnConnection = std::function<void(Worker& worker, ucp_ep_h ep)>;
  explicit RawListener(OnConnection on_connection = nullptr)
      : thread_([this, on_connection] { Run(on_connection); }) {
    while (port_ == 0 && !failed_) std::this_thread::yield();
  }
  ~RawListener() {
    stop_ = true;
    thread_.join();
  }
  int port() const { return port_; }

 private:
  void Run(const OnConnection& on_connection) {
    auto worker = Worker::Create();
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) {
      failed_ = true;
      return;
    }
    struct Accepted {
      Worker* worker;
      std::vector<ucp_ep_h> eps;
    } accepted{worker->get(), {}};
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    ucp_listener_params_t params{};
    params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
    params.sockaddr.addrlen = sizeof(addr);
    params.conn_handler.cb = [](ucp_conn_request_h request, void* arg) {
      auto* a = static_cast<Accepted*>(arg);
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
      ep.conn_request = request;
      ucp_ep_h h = nullptr;
      if (ucp_ep_create(a->worker->get(), &ep, &h) == UCS_OK) a->eps.push_back(h);
    };
    params.conn_handler.arg = &accepted;
    ucp_listener_h listener = nullptr;
    if (ucp_listener_create(accepted.worker->get(), &params, &listener) != UCS_OK) {
      ADD_FAILURE() << "ucp_listener_create";
      failed_ = true;
      return;
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    EXPECT_EQ(ucp_listener_query(listener, &attr), UCS_OK);
    port_ = ntohs(reinterpret_cast<const sockaddr_in&>(attr.sockaddr).sin_port);
    bool called = false;
    while (!stop_) {
      accepted.worker->Progress();
      if (called || accepted.eps.empty() || on_connection == nullptr) continue;
      called = true;
      on_connection(*accepted.worker, accepted.eps[0]);
    }
    for (ucp_ep_h h : accepted.eps) {
      CloseEndpoint(*accepted.worker, h, absl::Now() + absl::Seconds(1));
    }
    ucp_listener_destroy(listener);
  }

  std::atomic<int> port_{0};
  std::atomic<bool> failed_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Two chunk frames with one index, before any payload: the second would
// alias the first's slot and tags. It is refused naming chunk.index.
TEST(KvBulkTest, AChunkIndexOutOfOrderIsRefused) {
  std::atomic<int> applied{0};
  auto receiver = BulkReceiver::Start("127.0.0.1", [&](const KvTransferChunk&) {
    ++applied;
    return absl::OkStatus();
  });
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  RawSender raw((*receiver)->offer());
  ASSERT_TRUE(raw.Hello((*receiver)->offer().ticket).ok());
  RawFrame chunk;
  chunk.type = 3;
  chunk.index = 0;
  chunk.num_tokens = 1;
  chunk.sizes[0] = 4096;
  ASSERT_TRUE(raw.Send(chunk).ok());
  ASSERT_TRUE(raw.Send(chunk).ok());
  RawFrame reply;
  const absl::Status status = raw.Reply(&reply);
  EXPECT_EQ(reply.type, 4);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "chunk.index: expected 1, got 0")) << status;
  (*receiver)->Stop();
  EXPECT_EQ(applied.load(), 0);
}

// A receiver that takes the connection and never answers the hello: a
// cancelled export stops at once instead of waiting out its timeout.
TEST(KvBulkTest, ACancelledSenderStopsInItsHello) {
  RawListener silent;
  BulkOptions options;
  options.timeout = absl::Seconds(20);
  std::atomic<bool> cancelled{true};
  const absl::Time start = absl::Now();
  const absl::Status status = SendChunks(
      BulkOffer{"127.0.0.1", silent.port(), "ticket"},
      [](KvTransferChunk*) -> absl::StatusOr<bool> { return false; }, options, &cancelled, nullptr);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_LT(took, absl::Seconds(10)) << "the hello waited out its timeout";
}

// A receiver whose hello reply carries a code absl has not: the sender
// stops with INTERNAL naming the reply's code.
TEST(KvBulkTest, AReplyWithAnUnknownCodeIsRefused) {
  RawListener odd([](Worker& worker, ucp_ep_h ep) {
    char hello[64 + 6];
    if (!RecvAll(worker, ep, hello, sizeof(hello), TestDeadline()).ok()) return;
    RawFrame reply;
    reply.type = 2;
    reply.code = 1234;
    SendAll(worker, ep, &reply, sizeof(reply), TestDeadline()).IgnoreError();
  });
  BulkOptions options;
  options.timeout = absl::Seconds(20);
  std::atomic<bool> cancelled{false};
  const absl::Status status = SendChunks(
      BulkOffer{"127.0.0.1", odd.port(), "ticket"},
      [](KvTransferChunk*) -> absl::StatusOr<bool> { return false; }, options, &cancelled, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "code: expected 0..16, got 1234")) << status;
}

// A connection with another ticket is refused and closed; it does not use up
// the import: the sender with the ticket connects after it.
TEST(KvBulkTest, AnotherTicketDoesNotUseUpTheImport) {
  std::mt19937 rng(11);
  std::vector<KvTransferChunk> sent;
  for (int i = 0; i < 5; ++i) sent.push_back(RandomChunk(&rng, i));
  std::atomic<int> applied{0};
  auto receiver = BulkReceiver::Start("127.0.0.1", [&](const KvTransferChunk&) {
    ++applied;
    return absl::OkStatus();
  });
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  BulkOffer wrong = (*receiver)->offer();
  wrong.ticket[0] = wrong.ticket[0] == '0' ? '1' : '0';
  std::atomic<size_t> at{0};
  const absl::Status refused = SendChunks(wrong, From(&sent, &at), {}, nullptr, nullptr);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnauthenticated) << refused;
  at = 0;
  absl::Status status;
  // The refused connection is closed on the receiver's next turn: a connect
  // before that is turned away (UNAVAILABLE) and tried again.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  do {
    status = SendChunks((*receiver)->offer(), From(&sent, &at), {}, nullptr, nullptr);
  } while (status.code() == absl::StatusCode::kUnavailable && absl::Now() < until);
  EXPECT_TRUE(status.ok()) << status;
  (*receiver)->Stop();
  EXPECT_EQ(applied.load(), 5);
}

// A budget as the service's: each charge is held until its token goes.
struct Budget {
  std::atomic<int64_t> held{0};
  BulkOptions::Charge charge() {
    return [this](int64_t bytes) -> absl::StatusOr<std::shared_ptr<void>> {
      held += bytes;
      return std::shared_ptr<void>(new int(0), [this, bytes](void* p) {
        held -= bytes;
        delete static_cast<int*>(p);
      });
    };
  }
};

// The ticket holder's connection breaks after a chunk's frame (its payload
// never comes): the receiver closes it at once and gives back what it held,
// without waiting for the import to stop.
TEST(KvBulkTest, ABrokenConnectionIsClosedAndItsChargesGoAtOnce) {
  Budget budget;
  BulkOptions options;
  options.charge = budget.charge();
  auto receiver = BulkReceiver::Start(
      "127.0.0.1", [](const KvTransferChunk&) { return absl::OkStatus(); }, options);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  auto raw = std::make_unique<RawSender>((*receiver)->offer());
  ASSERT_TRUE(raw->Hello((*receiver)->offer().ticket).ok());
  RawFrame chunk;
  chunk.type = 3;
  chunk.num_tokens = 1;
  chunk.sizes[0] = 4096;
  ASSERT_TRUE(raw->Send(chunk).ok());
  ASSERT_TRUE(WaitUntil([&] { return budget.held == 4096; })) << "the chunk was not charged";
  raw.reset();  // its worker and connections go
  EXPECT_TRUE(WaitUntil([&] { return budget.held == 0; }))
      << budget.held << " bytes still charged after the sender went";
  (*receiver)->Stop();
  EXPECT_EQ(budget.held.load(), 0);
}

// A tagged message no chunk frame announced (an index far past the window):
// the receiver takes it out of UCX's queue and closes the connection.
TEST(KvBulkTest, ATagOutsideTheWindowClosesTheConnection) {
  std::atomic<int> applied{0};
  auto receiver = BulkReceiver::Start("127.0.0.1", [&](const KvTransferChunk&) {
    ++applied;
    return absl::OkStatus();
  });
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  RawSender raw((*receiver)->offer());
  ASSERT_TRUE(raw.Hello((*receiver)->offer().ticket).ok());
  ASSERT_TRUE(raw.SendTagged(RawChunkTag(1000, 0), std::string(4096, 'x')).ok());
  // Closed: the reply's receive fails at once (not at its 10 s deadline).
  const absl::Time start = absl::Now();
  RawFrame reply;
  const absl::Status status = raw.Reply(&reply);
  EXPECT_FALSE(status.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "the connection stayed open: " << status;
  EXPECT_EQ((*receiver)->discarded(), 1);
  (*receiver)->Stop();
  EXPECT_EQ(applied.load(), 0);
}

// Before its hello a connection may send no tagged message at all.
TEST(KvBulkTest, ATagBeforeTheHelloDropsTheConnection) {
  auto receiver =
      BulkReceiver::Start("127.0.0.1", [](const KvTransferChunk&) { return absl::OkStatus(); });
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  RawSender raw((*receiver)->offer());
  ASSERT_TRUE(raw.SendTagged(RawChunkTag(0, 0), std::string(100, 'x')).ok());
  const absl::Time start = absl::Now();
  RawFrame reply;
  const absl::Status status = raw.Reply(&reply);
  EXPECT_FALSE(status.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "the connection stayed open: " << status;
  EXPECT_EQ((*receiver)->discarded(), 1);
  (*receiver)->Stop();
}

// The receiver's slots keep their buffers between chunks (for the next one):
// those bytes stay charged, and go with the receiver.
TEST(KvBulkTest, BuffersKeptBetweenChunksAreCharged) {
  std::mt19937 rng(13);
  std::vector<KvTransferChunk> sent;
  for (int i = 0; i < 40; ++i) sent.push_back(RandomChunk(&rng, i));
  Budget budget;
  BulkOptions options;
  options.charge = budget.charge();
  auto receiver = BulkReceiver::Start(
      "127.0.0.1", [](const KvTransferChunk&) { return absl::OkStatus(); }, options);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  // Looked at once every chunk is applied, while the sender is still
  // connected (its next chunk is being read): every slot is between chunks.
  int64_t buffered = -1, charged = -1;
  std::atomic<size_t> at{0};
  NextChunk chunks = From(&sent, &at);
  NextChunk next = [&](KvTransferChunk* c) -> absl::StatusOr<bool> {
    if (at.load() < sent.size()) return chunks(c);
    EXPECT_TRUE(WaitUntil([&] { return (*receiver)->chunks() == int64_t(sent.size()); }));
    buffered = (*receiver)->buffered_bytes();
    charged = budget.held.load();
    return false;
  };
  const absl::Status status = SendChunks((*receiver)->offer(), next, options, nullptr, nullptr);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_GT(buffered, 0);
  // Four parts a slot, each within a small allocation's rounding of its charge.
  EXPECT_LE(buffered, charged + int64_t{options.window} * 4 * 64)
      << "the receiver holds buffers nothing is charged for";
  // The sender gone, its connection closes: the buffers go with their charges.
  EXPECT_TRUE(WaitUntil([&] { return budget.held == 0; })) << budget.held;
  EXPECT_EQ((*receiver)->buffered_bytes(), 0);
  (*receiver)->Stop();
}

// A thread the system cannot give: the receiver or sender does not start
// and says so (RESOURCE_EXHAUSTED naming the thread), no std::terminate.
TEST(KvBulkTest, AThreadThatDoesNotStartIsAnError) {
  auto apply = [](const KvTransferChunk&) { return absl::OkStatus(); };
  for (int nth : {1, 2}) {  // the progress thread, then the apply thread
    fail_thread_start_for_test = nth;
    auto receiver = BulkReceiver::Start("127.0.0.1", apply);
    fail_thread_start_for_test = 0;
    ASSERT_FALSE(receiver.ok()) << nth;
    EXPECT_EQ(receiver.status().code(), absl::StatusCode::kResourceExhausted) << nth;
    EXPECT_TRUE(absl::StrContains(receiver.status().message(), "thread")) << receiver.status();
  }
  auto receiver = BulkReceiver::Start("127.0.0.1", apply);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  std::mt19937 rng(2);
  std::vector<KvTransferChunk> sent = {RandomChunk(&rng, 1)};
  std::atomic<size_t> at{0};
  fail_thread_start_for_test = 1;  // the sender's producer
  const absl::Status status =
      SendChunks((*receiver)->offer(), From(&sent, &at), {}, nullptr, nullptr);
  fail_thread_start_for_test = 0;
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "producer's thread")) << status;
  EXPECT_EQ(at.load(), 0u) << "chunks were read";
  (*receiver)->Stop();
}

// Connections that say nothing (or half a hello) do not keep the sender out:
// several are heard at once, one more closes the oldest, and the sender with
// the ticket gets in on its first try.
TEST(KvBulkTest, SilentConnectionsDoNotKeepTheSenderOut) {
  std::mt19937 rng(17);
  std::vector<KvTransferChunk> sent;
  for (int i = 0; i < 5; ++i) sent.push_back(RandomChunk(&rng, i));
  std::atomic<int> applied{0};
  auto receiver = BulkReceiver::Start("127.0.0.1", [&](const KvTransferChunk&) {
    ++applied;
    return absl::OkStatus();
  });
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  std::vector<std::unique_ptr<RawSender>> silent;
  for (int i = 0; i < 10; ++i) {
    silent.push_back(std::make_unique<RawSender>((*receiver)->offer()));
    RawFrame hello;  // a hello whose ticket never comes
    hello.type = 1;
    hello.message_bytes = 32;
    ASSERT_TRUE(silent.back()->Send(hello).ok());
  }
  std::atomic<size_t> at{0};
  const absl::Time start = absl::Now();
  const absl::Status status =
      SendChunks((*receiver)->offer(), From(&sent, &at), {}, nullptr, nullptr);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(4)) << "the sender waited for a silent one";
  (*receiver)->Stop();
  EXPECT_EQ(applied.load(), 5);
}

}  // namespace
}  // namespace ucx
}  // namespace attnserve
