// The UCX data plane's page-locking of its staging buffers (BulkOptions::
// pin_host), observed without a GPU: a recording PinHost stands in for
// cudaHostRegister, and this binary's operator new/delete check every heap
// block against what is page-locked. Registered memory must never be freed
// (a new allocation at its address would be taken as still page-locked and
// a device copy could read the old pages: review finding R1-F1), and each
// buffer a slot takes for a chunk of another size is page-locked anew.
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/ucx/kv_bulk.h"

namespace {

// What is page-locked now: fixed slots, so operator new/delete can look
// without allocating.
constexpr int kMaxPinned = 256;
std::atomic<void*> pinned_at[kMaxPinned];
std::atomic<int64_t> freed_while_pinned{0};
std::atomic<int64_t> allocated_at_pinned{0};

bool IsPinned(void* p) {
  if (p == nullptr) return false;
  for (auto& slot : pinned_at) {
    if (slot.load(std::memory_order_acquire) == p) return true;
  }
  return false;
}

void CheckFree(void* p) {
  if (IsPinned(p)) freed_while_pinned.fetch_add(1);
}

}  // namespace

// Every heap block of this process passes here (std::string's storage included).
void* operator new(size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  if (IsPinned(p)) allocated_at_pinned.fetch_add(1);
  return p;
}
void* operator new[](size_t n) { return operator new(n); }
void operator delete(void* p) noexcept {
  CheckFree(p);
  std::free(p);
}
void operator delete[](void* p) noexcept { operator delete(p); }
void operator delete(void* p, size_t) noexcept { operator delete(p); }
void operator delete[](void* p, size_t) noexcept { operator delete(p); }

namespace attnserve {
namespace ucx {
namespace {

// A PinHost that records what it page-locks (as cudaHostRegister would).
struct Recorder {
  std::atomic<int> pins{0};
  PinHost Host() {
    return [this](void* data, size_t) -> std::shared_ptr<void> {
      for (auto& slot : pinned_at) {
        void* empty = nullptr;
        if (slot.compare_exchange_strong(empty, data)) {
          pins.fetch_add(1);
          return std::shared_ptr<void>(data, [&slot](void*) { slot.store(nullptr); });
        }
      }
      return nullptr;  // full: not page-locked (as a failed registration)
    };
  }
};

KvTransferChunk ChunkOf(int index, size_t bytes) {
  KvTransferChunk c;
  c.sequence_id = 7;
  c.layer = 0;
  c.token_begin = index;
  c.num_tokens = 1;
  c.k.assign(bytes, static_cast<char>('a' + index % 26));
  c.v.assign(bytes, static_cast<char>('A' + index % 26));
  return c;
}

class KvBulkPinTest : public ::testing::Test {
 protected:
  void SetUp() override {
    freed_while_pinned = 0;
    allocated_at_pinned = 0;
  }
  void TearDown() override {
    for (auto& slot : pinned_at) EXPECT_EQ(slot.load(), nullptr) << "left page-locked";
  }
};

// One slot takes chunks of alternating sizes: each chunk refits its k and v
// buffers (the old ones are freed), so each is unpinned before the free and
// each new buffer is page-locked after its copy.
TEST_F(KvBulkPinTest, TheReceiverUnpinsEveryBufferItFreesAndPinsTheNewOne) {
  constexpr int kChunks = 24;
  std::vector<KvTransferChunk> chunks;
  for (int i = 0; i < kChunks; ++i) chunks.push_back(ChunkOf(i, i % 2 == 0 ? 256 << 10 : 4 << 10));
  Recorder receiver_pins;
  BulkOptions receiving;
  receiving.window = 1;
  receiving.pin_host = receiver_pins.Host();
  std::mutex mu;
  int applied = 0;
  int64_t pinned_when_applied = 0;  // chunks whose k was page-locked as applied (must be none)
  absl::StatusOr<std::unique_ptr<BulkReceiver>> receiver = BulkReceiver::Start(
      "127.0.0.1",
      [&](const KvTransferChunk& c) {
        std::lock_guard<std::mutex> lock(mu);
        // A refitted buffer is fresh: page-locked only after this copy.
        if (IsPinned(const_cast<char*>(c.k.data()))) ++pinned_when_applied;
        EXPECT_EQ(c.k, chunks[size_t(applied)].k);
        ++applied;
        return absl::OkStatus();
      },
      receiving);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  BulkOptions sending;
  sending.window = 1;
  sending.pin_host = nullptr;  // the receiver's pins only
  std::atomic<size_t> at{0};
  const absl::Status sent = SendChunks((*receiver)->offer(),
                                       [&](KvTransferChunk* c) -> absl::StatusOr<bool> {
                                         const size_t i = at.fetch_add(1);
                                         if (i >= chunks.size()) return false;
                                         *c = chunks[i];
                                         return true;
                                       },
                                       sending, nullptr, nullptr);
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(applied, kChunks);
  (*receiver)->Stop();
  EXPECT_EQ(freed_while_pinned.load(), 0) << "a page-locked buffer was freed";
  EXPECT_EQ(allocated_at_pinned.load(), 0) << "memory still page-locked was allocated again";
  EXPECT_EQ(pinned_when_applied, 0) << "a new buffer was taken as page-locked";
  // k and v of every chunk: each chunk came in buffers of its own size.
  EXPECT_EQ(receiver_pins.pins.load(), 2 * kChunks);
  receiver->reset();
}

// The sender's slots: page-locked after their first fill, and unpinned
// before they are freed when the sender ends.
TEST_F(KvBulkPinTest, TheSenderUnpinsItsBuffersBeforeFreeingThem) {
  constexpr int kChunks = 16;
  std::vector<KvTransferChunk> chunks;
  for (int i = 0; i < kChunks; ++i) chunks.push_back(ChunkOf(i, 64 << 10));
  BulkOptions receiving;
  receiving.pin_host = nullptr;
  std::atomic<int> applied{0};
  absl::StatusOr<std::unique_ptr<BulkReceiver>> receiver = BulkReceiver::Start(
      "127.0.0.1",
      [&](const KvTransferChunk&) {
        applied.fetch_add(1);
        return absl::OkStatus();
      },
      receiving);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  Recorder sender_pins;
  BulkOptions sending;
  sending.window = 2;
  sending.chunk_bytes = 2 * (64 << 10);  // k and v fit their reserved buffers
  sending.pin_host = sender_pins.Host();
  std::atomic<size_t> at{0};
  const absl::Status sent =
      SendChunks((*receiver)->offer(),
                 [&](KvTransferChunk* c) -> absl::StatusOr<bool> {
                   const size_t i = at.fetch_add(1);
                   if (i >= chunks.size()) return false;
                   c->k.assign(chunks[i].k);  // in place, as the exporter fills them
                   c->v.assign(chunks[i].v);
                   c->sequence_id = chunks[i].sequence_id;
                   c->token_begin = chunks[i].token_begin;
                   c->num_tokens = 1;
                   return true;
                 },
                 sending, nullptr, nullptr);
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(applied.load(), kChunks);
  EXPECT_EQ(freed_while_pinned.load(), 0);
  // Two slots, k and v each, page-locked once: the buffers never moved.
  EXPECT_EQ(sender_pins.pins.load(), 4);
  receiver->reset();
}

// A slot whose first chunk is short and a later one's k (or v) is most of
// the chunk: an MLA cache's K carries the whole chunk (v empty), a head_dim
// above head_dim_v makes k three quarters of it. Each part's buffer is
// reserved for a whole chunk, so the exporter's in-place fill never moves a
// page-locked buffer (with half a chunk reserved and the capacity pinned
// after the first fill, every growing chunk freed a pinned buffer); a part
// is page-locked again only when it is longer than before, not per chunk.
TEST_F(KvBulkPinTest, TheSenderNeverFreesAPinnedBufferWhenAPartGrows) {
  constexpr size_t kChunk = 256 << 10;
  // (k, v) per chunk: short first chunks for both slots, then the large ones.
  const std::vector<std::pair<size_t, size_t>> sizes = {{4 << 10, 4 << 10},
                                                        {4 << 10, 4 << 10},
                                                        {kChunk, 0},
                                                        {kChunk / 2, kChunk / 2},
                                                        {kChunk * 3 / 4, kChunk / 4},
                                                        {4 << 10, 4 << 10},
                                                        {kChunk, 0},
                                                        {0, kChunk},
                                                        {kChunk * 3 / 4, kChunk / 4},
                                                        {kChunk, 0},
                                                        {kChunk / 2, kChunk / 2},
                                                        {kChunk, 0}};
  std::vector<KvTransferChunk> chunks;
  for (size_t i = 0; i < sizes.size(); ++i) {
    KvTransferChunk c = ChunkOf(int(i), 0);
    c.k.assign(sizes[i].first, static_cast<char>('a' + i));
    c.v.assign(sizes[i].second, static_cast<char>('A' + i));
    chunks.push_back(std::move(c));
  }
  BulkOptions receiving;
  receiving.pin_host = nullptr;
  std::mutex mu;
  size_t applied = 0;
  absl::StatusOr<std::unique_ptr<BulkReceiver>> receiver = BulkReceiver::Start(
      "127.0.0.1",
      [&](const KvTransferChunk& c) {
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_EQ(c.k, chunks[applied].k) << applied;
        EXPECT_EQ(c.v, chunks[applied].v) << applied;
        ++applied;
        return absl::OkStatus();
      },
      receiving);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  Recorder sender_pins;
  BulkOptions sending;
  sending.window = 2;
  sending.chunk_bytes = kChunk;
  sending.pin_host = sender_pins.Host();
  std::atomic<size_t> at{0};
  const absl::Status sent =
      SendChunks((*receiver)->offer(),
                 [&](KvTransferChunk* c) -> absl::StatusOr<bool> {
                   const size_t i = at.fetch_add(1);
                   if (i >= chunks.size()) return false;
                   c->k.assign(chunks[i].k);  // in place, as the exporter's resize and copy
                   c->v.assign(chunks[i].v);
                   c->sequence_id = chunks[i].sequence_id;
                   c->token_begin = chunks[i].token_begin;
                   c->num_tokens = 1;
                   return true;
                 },
                 sending, nullptr, nullptr);
  ASSERT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(applied, chunks.size());
  EXPECT_EQ(freed_while_pinned.load(), 0) << "a page-locked buffer was freed";
  EXPECT_EQ(allocated_at_pinned.load(), 0) << "memory still page-locked was allocated again";
  // Per slot and part at most: a short first chunk, half, three quarters and
  // a whole chunk (4 lengths); per chunk it would be 2 x 12.
  EXPECT_GT(sender_pins.pins.load(), 0);
  EXPECT_LE(sender_pins.pins.load(), 2 * 2 * 4);
  receiver->reset();
}

}  // namespace
}  // namespace ucx
}  // namespace attnserve
