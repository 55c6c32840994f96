// Bulk K/V page transfer over UCX (docs/kv-transfer.md, "Over UCX"): the
// data plane of a KvTransfer whose chunks do not ride the gRPC stream. The
// importing server starts a BulkReceiver for its import session (its own UCX
// worker and listener on an ephemeral port; one sender, the first connection
// whose hello carries the ticket); the
// exporting server's SendChunks connects there with the ticket the import
// answered and sends every chunk as a small header on the UCX stream and its
// k, v (and FP8 scales) as tagged messages, which UCX moves by rendezvous
// (one transfer between the two buffers where the transport allows). Many
// chunks are in flight at once; on each side a thread of its own reads the
// pages (D2H) or writes them (H2D) while the UCX thread moves the next ones;
// in a CUDA build the slots' k and v buffers are page-locked
// (cudaHostRegister), so those copies go by DMA without the driver's own
// staging through a bounce buffer.
// The receiver applies chunks in order and acknowledges each with its status;
// the first refusal stops the sender with that status (same codes and
// messages as the gRPC import). A broken connection, or a tagged message
// outside the window, closes the connection at once (SECURITY.md lists the
// rules). Protocol-free of gRPC: the service drives it.
//
// Wire (little-endian): every message on the stream is a 64-byte BulkFrame,
// then `message_bytes` of text (a hello's ticket, a refusal's message).
// Types: 1 hello (sender first), 2 hello reply, 3 chunk (its payloads follow
// as tagged messages ChunkTag(index, i)), 4 ack (the chunk's status).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/kv/kv_transfer.h"

namespace attnserve {
namespace ucx {

// Whether this server was built with UCX (the data plane can be offered).
bool BulkBuilt();

// Tests: the `nth` next StartThread (1: the next) fails as if the system had
// no thread to give; 0: none.
inline std::atomic<int> fail_thread_start_for_test{0};

// A thread of the data plane (a receiver's, a sender's, an export's): a
// system without one to give answers RESOURCE_EXHAUSTED naming `what`
// instead of throwing std::system_error out of a handler.
inline absl::StatusOr<std::thread> StartThread(const char* what, std::function<void()> body) {
  try {
    const int nth = fail_thread_start_for_test.load();
    if (nth > 0 && fail_thread_start_for_test.fetch_sub(1) == 1) {
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
    }
    return std::thread(std::move(body));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start ", what, "'s thread: ", e.what()));
  }
}

// Where a receiver takes chunks (KvDataPlane on the wire).
struct BulkOffer {
  std::string host;
  int port = 0;
  std::string ticket;
};

// Page-locks a staging buffer for the GPU copies (DMA): the handle undoes
// it when destroyed, which must happen before the buffer is freed or moves.
// Null where it cannot (the copies then stage as usual). A seam: the build's
// own (DefaultPinHost) is CUDA's host registration, and tests observe it.
using PinHost = std::function<std::shared_ptr<void>(void* data, size_t bytes)>;
// cudaHostRegister/cudaHostUnregister in a CUDA build; unset without CUDA
// (nothing is page-locked).
PinHost DefaultPinHost();

struct BulkOptions {
  // Chunks in flight (sent and not yet acknowledged): the sender's window
  // and the receiver's staging slots.
  int window = 8;
  // A chunk's payload above this is refused before it is received.
  int64_t max_chunk_bytes = int64_t{64} << 20;
  // The receiver's budget: called with a chunk's payload bytes when its frame
  // arrives, before they are received; the token it returns is held while
  // the slot keeps the chunk's buffers (until the slot takes another chunk, or
  // the connection ends). An error is sent back as that
  // chunk's refusal and ends the transfer. Unset: not charged.
  using Charge = std::function<absl::StatusOr<std::shared_ptr<void>>(int64_t bytes)>;
  Charge charge;
  // The sender's chunks' payload at most: its slots' k and v buffers are each
  // reserved for a whole chunk up front (either may carry all of it) and
  // never move, so their page-locking is never undone by a free; a part over
  // it fails the send. 0: buffers grow as chunks come, and nothing is
  // page-locked on the sending side.
  int64_t chunk_bytes = 0;
  // Connect, hello and one ack: a peer silent this long is gone.
  absl::Duration timeout = absl::Seconds(60);
  // Page-locks the slots' k and v buffers (both sides); unset: nothing is.
  PinHost pin_host = DefaultPinHost();
};

// The receiving side of one import stream. `apply` keeps one chunk (the
// import session's Accept), called in order on the receiver's apply thread;
// its error is sent back to the sender and nothing after it is applied.
class BulkReceiver {
 public:
  using Apply = std::function<absl::Status(const KvTransferChunk& chunk)>;
  static absl::StatusOr<std::unique_ptr<BulkReceiver>> Start(const std::string& host, Apply apply,
                                                             const BulkOptions& options = {});
  ~BulkReceiver();  // Stop()
  BulkReceiver(const BulkReceiver&) = delete;
  BulkReceiver& operator=(const BulkReceiver&) = delete;

  const BulkOffer& offer() const;
  // Stops taking chunks: the one being applied finishes, the ones received
  // and not applied are dropped (a resume sends them again), the connection
  // closes. Safe twice.
  void Stop();
  // Chunks and payload bytes applied so far.
  int64_t chunks() const;
  int64_t bytes() const;
  // Bytes of the staging buffers its slots hold between chunks (applied or
  // waiting): each slot's are charged with the chunk they last took.
  int64_t buffered_bytes() const;
  // Tagged messages taken out of UCX's queue as outside the import's window.
  int64_t discarded() const;

  class Impl;

 private:
  explicit BulkReceiver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct BulkSendResult {
  int64_t chunks = 0;  // acknowledged by the receiver
  int64_t bytes = 0;   // their payload bytes
};

// Fills `chunk` (its buffers reused) with the next chunk; false at the end.
using NextChunk = std::function<absl::StatusOr<bool>(KvTransferChunk* chunk)>;

// Connects to `offer` and sends every chunk `next` gives, `options.window`
// in flight, `next` running on a thread of its own ahead of the sends.
// Returns once the receiver has acknowledged every chunk, or the first
// error: the receiver's refusal (its code and message), UNAVAILABLE for a
// broken connection, CANCELLED once `*cancelled` is set. `result` (may be
// null) counts what was acknowledged either way.
absl::Status SendChunks(const BulkOffer& offer, const NextChunk& next, const BulkOptions& options,
                        const std::atomic<bool>* cancelled, BulkSendResult* result);

}  // namespace ucx
}  // namespace attnserve
