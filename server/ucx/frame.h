// The framing of the UCX step transport (docs/ucx.md), shared by the server's
// listener and the client's transport. Every message on a UCX stream
// endpoint is a fixed 48-byte prefix, then `header_bytes` of a serialized
// protobuf, then the payloads back to back (payload_bytes[i] each, up to
// four). The prefix is read first so that every size is checked before a
// byte of the rest is allocated or received. No UCX and no protobuf here:
// the parser is plain code a fuzz test drives with random bytes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace attnserve {
namespace ucx {

inline constexpr uint32_t kFrameMagic = 0x31585541;  // "AUX1" little-endian
inline constexpr size_t kPrefixBytes = 48;
inline constexpr int kMaxPayloads = 4;

enum class FrameType : uint16_t {
  // Client first: header = the `authorization` value ("Bearer <token>", or
  // empty when the server has no tokens); no payloads.
  kHello = 1,
  // Server: header = AppendAttendResponse with error_code 0 (accepted) or the
  // refusal (the connection then closes); no payloads.
  kHelloReply = 2,
  // Client: header = AppendAttendRequest without tensor bytes; payloads q, k, v.
  kStep = 3,
  // Server: header = AppendAttendResponse without tensor bytes (error_code
  // and error_message on failure); payloads o, lse.
  kStepReply = 4,
};

// Reply flag: the server closes the connection once the peer has read this
// reply (a refused hello, a frame that broke the framing). The peer closes
// its end; the server closes it anyway after a grace period.
inline constexpr uint16_t kFlagClosing = 1;
// Tagged payloads: on a hello reply, the server takes a step's payloads as
// UCX tagged messages (rendezvous for large ones: one transfer, no copy
// through the stream's bounce buffers) and `tag` is the connection's tag
// base; on a step, its payloads follow as tagged messages (PayloadTag, `tag`
// the step's sequence number) instead of on the stream; on a step reply, O
// and LSE do, under the step's sequence number.
inline constexpr uint16_t kFlagTagged = 2;

// Indices of a step's payloads and of its reply's.
enum StepPayload { kQ = 0, kK = 1, kV = 2 };
enum ReplyPayload { kO = 0, kLse = 1 };

struct FramePrefix {
  FrameType type = FrameType::kHello;
  uint16_t flags = 0;  // kFlagClosing on replies, kFlagTagged; 0 otherwise
  uint32_t header_bytes = 0;
  uint32_t tag = 0;  // bytes 12-15: 0 unless kFlagTagged
  std::array<uint64_t, kMaxPayloads> payload_bytes{};

  uint64_t payload_total() const {
    uint64_t n = 0;
    for (uint64_t b : payload_bytes) n += b;
    return n;
  }
};

// What a receiver accepts; a frame beyond any of them is refused before its
// body is read.
struct FrameLimits {
  uint32_t max_header_bytes = 1 << 20;
  // Header plus payloads of one frame (the server: --max_request_bytes).
  uint64_t max_frame_bytes = uint64_t{1} << 30;
  uint32_t max_hello_bytes = 4096;
};

// Which frames a side may receive: the server only kHello and kStep, the
// client only the replies.
enum class Receiver { kServer, kClient };

// The UCX tag of payload `index` of step `seq` on the connection whose tag
// base is `base`; `reply`: the step reply's O or LSE.
uint64_t PayloadTag(uint32_t base, uint32_t seq, bool reply, int index);

// The 48 bytes of `prefix`.
std::string EncodePrefix(const FramePrefix& prefix);

// Parses and checks `size` bytes (must be kPrefixBytes). Errors are
// INVALID_ARGUMENT naming the field (magic, type, flags, reserved,
// header_bytes, payload_bytes[i], frame bytes), the expected and the actual
// value.
absl::StatusOr<FramePrefix> ParsePrefix(const uint8_t* data, size_t size, const FrameLimits& limits,
                                        Receiver receiver);

// Sets kFlagClosing in the prefix at the start of `head`.
void MarkClosing(std::string* head);
// Sets kFlagTagged and `tag` in the prefix at the start of `head`.
void MarkTagged(std::string* head, uint32_t tag);

// "q", "k", "v" for a step's payloads, "o", "lse" for a reply's.
const char* PayloadName(FrameType type, int index);

}  // namespace ucx
}  // namespace attnserve
