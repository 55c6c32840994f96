// The server's UCX listener (docs/ucx.md): accepts UCX connections on a
// port, reads frames (frame.h) off each connection's stream and hands whole
// steps to a StepHandler, then sends the replies back.
//
// Threading rule: one progress thread per listener owns its UCX worker, the
// listener, every endpoint and every operation on them; nothing else calls
// UCX. A step's completion (on an executor thread) only posts its reply to
// the listener's mailbox and wakes that thread through an eventfd.
//
// A frame that breaks the framing (bad magic, type, sizes over the limits,
// a header that does not parse) is answered with an error reply naming the
// field and closes that connection only. A step refused by the core is
// answered with its status and the connection goes on.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/stream_flow_control.h"
#include "server/ucx/frame.h"

namespace attnserve {
namespace ucx {

// Who a connection acts for, fixed by its hello.
class Session {
 public:
  virtual ~Session() = default;
  virtual const std::string& tenant() const = 0;
  // OK while the hello's token still names the tenant (checked per step).
  virtual absl::Status StillValid() const = 0;
};

// A step as received: its prefix, header bytes and payloads (each its own
// buffer, received straight from the wire), and the budget charge it holds
// until its reply has been sent.
struct StepFrame {
  FramePrefix prefix;
  std::string header;
  std::vector<std::unique_ptr<uint8_t[]>> payloads;  // kMaxPayloads buffers
  std::shared_ptr<std::atomic<bool>> cancelled;      // set when the connection closes
  ByteBudget* budget = nullptr;
  int64_t charged = 0;
  ~StepFrame() {
    if (budget != nullptr) budget->Release(charged);
  }
  absl::string_view payload(int i) const {
    return absl::string_view(reinterpret_cast<const char*>(payloads[i].get()),
                             prefix.payload_bytes[i]);
  }
};

// A reply: its prefix and header in one buffer, then up to two payloads
// (on the stream, or as tagged messages of the step's sequence number).
struct Reply {
  std::string head;
  std::string payloads[2];
  std::optional<uint32_t> tagged;  // the step's sequence number (kFlagTagged)
};

// What the listener asks of the service behind it (server/ucx/kv_steps.h).
class StepHandler {
 public:
  virtual ~StepHandler() = default;
  // The session of a hello's authorization value, or the refusal
  // (UNAUTHENTICATED). Runs on the listener thread; must not block.
  virtual absl::StatusOr<std::shared_ptr<const Session>> Hello(absl::string_view authorization) = 0;
  // Runs the step; `done` runs exactly once, on any thread, with the reply.
  // Must not block.
  virtual void Step(std::shared_ptr<const Session> session, std::shared_ptr<StepFrame> frame,
                    std::function<void(Reply)> done) = 0;
  // The reply frame of `type` (kHelloReply or kStepReply) carrying `status`
  // (OK: an accepted hello).
  virtual Reply StatusReply(FrameType type, const absl::Status& status,
                            absl::string_view request_id) = 0;
};

struct ListenerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port (port() tells which)
  FrameLimits limits;
  // Steps of one connection in flight at once; it is not read further
  // until one is answered.
  int max_in_flight_per_connection = 64;
  int max_connections = 1024;
  // Server-wide budget every received frame is charged to from the moment
  // its prefix arrives until its reply has been sent; may be null.
  ByteBudget* budget = nullptr;
};

class Listener {
 public:
  // Binds and starts the progress thread. `handler` must outlive Stop.
  static absl::StatusOr<std::unique_ptr<Listener>> Start(const ListenerOptions& options,
                                                         StepHandler* handler);
  ~Listener();  // Stop(0)

  int port() const { return port_; }
  // Stops accepting, waits up to `grace` for the steps in flight to be
  // answered, then closes every connection and joins the thread. Safe twice.
  void Stop(absl::Duration grace);

  // Counters for tests and logs.
  int64_t connections_accepted() const { return accepted_.load(std::memory_order_relaxed); }
  int64_t connections_open() const { return open_.load(std::memory_order_relaxed); }
  int64_t frames_refused() const { return refused_.load(std::memory_order_relaxed); }
  int64_t steps() const { return steps_.load(std::memory_order_relaxed); }

  class Impl;

 private:
  Listener() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  std::atomic<int64_t> accepted_{0}, open_{0}, refused_{0}, steps_{0};
};

}  // namespace ucx
}  // namespace attnserve
