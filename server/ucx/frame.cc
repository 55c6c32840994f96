// The UCX transport's frame prefix; see frame.h.
#include "server/ucx/frame.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace ucx {
namespace {

// Byte offsets in the prefix (little-endian: both ends are x86-64 or arm64).
constexpr size_t kMagicAt = 0, kTypeAt = 4, kFlagsAt = 6, kHeaderAt = 8, kReservedAt = 12,
                 kPayloadsAt = 16;

template <typename T>
T Load(const uint8_t* data, size_t at) {
  T value;
  std::memcpy(&value, data + at, sizeof(T));
  return value;
}

template <typename T>
void Store(std::string* out, size_t at, T value) {
  std::memcpy(out->data() + at, &value, sizeof(T));
}

bool Accepts(Receiver receiver, uint16_t type) {
  if (receiver == Receiver::kServer) {
    return type == static_cast<uint16_t>(FrameType::kHello) ||
           type == static_cast<uint16_t>(FrameType::kStep);
  }
  return type == static_cast<uint16_t>(FrameType::kHelloReply) ||
         type == static_cast<uint16_t>(FrameType::kStepReply);
}

// How many payloads a frame type carries.
int PayloadsOf(FrameType type) {
  switch (type) {
    case FrameType::kStep: return 3;
    case FrameType::kStepReply: return 2;
    default: return 0;
  }
}

}  // namespace

std::string EncodePrefix(const FramePrefix& p) {
  std::string out(kPrefixBytes, '\0');
  Store<uint32_t>(&out, kMagicAt, kFrameMagic);
  Store<uint16_t>(&out, kTypeAt, static_cast<uint16_t>(p.type));
  Store<uint16_t>(&out, kFlagsAt, p.flags);
  Store<uint32_t>(&out, kHeaderAt, p.header_bytes);
  Store<uint32_t>(&out, kReservedAt, p.tag);
  for (int i = 0; i < kMaxPayloads; ++i) {
    Store<uint64_t>(&out, kPayloadsAt + 8 * i, p.payload_bytes[i]);
  }
  return out;
}

void MarkClosing(std::string* head) {
  if (head->size() < kPrefixBytes) return;
  Store<uint16_t>(head, kFlagsAt, kFlagClosing);
  Store<uint32_t>(head, kReservedAt, 0);
}

void MarkTagged(std::string* head, uint32_t tag) {
  if (head->size() < kPrefixBytes) return;
  Store<uint16_t>(
      head, kFlagsAt,
      Load<uint16_t>(reinterpret_cast<const uint8_t*>(head->data()), kFlagsAt) | kFlagTagged);
  Store<uint32_t>(head, kReservedAt, tag);
}

uint64_t PayloadTag(uint32_t base, uint32_t seq, bool reply, int index) {
  return (uint64_t{base} << 32) | (uint64_t{seq & 0xffffffu} << 8) | (reply ? 0x80u : 0u) |
         static_cast<uint64_t>(index & 0x7f);
}

const char* PayloadName(FrameType type, int index) {
  static const char* const kStepNames[kMaxPayloads] = {"q", "k", "v", "payload 3"};
  static const char* const kReplyNames[kMaxPayloads] = {"o", "lse", "payload 2", "payload 3"};
  if (index < 0 || index >= kMaxPayloads) return "payload";
  return type == FrameType::kStepReply ? kReplyNames[index] : kStepNames[index];
}

absl::StatusOr<FramePrefix> ParsePrefix(const uint8_t* data, size_t size, const FrameLimits& limits,
                                        Receiver receiver) {
  if (data == nullptr || size != kPrefixBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame prefix: expected ", kPrefixBytes, " bytes, got ", size));
  }
  const uint32_t magic = Load<uint32_t>(data, kMagicAt);
  if (magic != kFrameMagic) {
    return absl::InvalidArgumentError(absl::StrCat("magic: expected 0x", absl::Hex(kFrameMagic),
                                                   " (an attnserve UCX frame), got 0x",
                                                   absl::Hex(magic)));
  }
  const uint16_t type = Load<uint16_t>(data, kTypeAt);
  if (!Accepts(receiver, type)) {
    return absl::InvalidArgumentError(absl::StrCat("type: expected ",
                                                   receiver == Receiver::kServer
                                                       ? "1 (hello) or 3 (step)"
                                                       : "2 (hello reply) or 4 (step reply)",
                                                   ", got ", type));
  }
  const uint16_t flags = Load<uint16_t>(data, kFlagsAt);
  // A step may come tagged; a reply may close and come tagged.
  const uint16_t allowed =
      receiver == Receiver::kClient
          ? kFlagClosing | kFlagTagged
          : (type == static_cast<uint16_t>(FrameType::kStep) ? kFlagTagged : 0);
  if ((flags & ~allowed) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flags: expected ", receiver == Receiver::kClient ? "0 to 3" : "0 or 2 (tagged step)",
        ", got ", flags));
  }
  const uint32_t reserved = Load<uint32_t>(data, kReservedAt);
  if ((flags & kFlagTagged) == 0 && reserved != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("reserved: expected 0 (the flags carry no tag), got ", reserved));
  }
  FramePrefix p;
  p.type = static_cast<FrameType>(type);
  p.flags = flags;
  p.tag = reserved;
  p.header_bytes = Load<uint32_t>(data, kHeaderAt);
  const bool hello = p.type == FrameType::kHello || p.type == FrameType::kHelloReply;
  const uint32_t max_header = hello ? limits.max_hello_bytes : limits.max_header_bytes;
  if (p.header_bytes > max_header) {
    return absl::InvalidArgumentError(
        absl::StrCat("header_bytes: expected at most ", max_header, ", got ", p.header_bytes));
  }
  const int payloads = PayloadsOf(p.type);
  // Each size is checked against the limit before the sum, so the sum cannot wrap.
  uint64_t total = p.header_bytes;
  for (int i = 0; i < kMaxPayloads; ++i) {
    p.payload_bytes[i] = Load<uint64_t>(data, kPayloadsAt + 8 * i);
    if (i >= payloads && p.payload_bytes[i] != 0) {
      return absl::InvalidArgumentError(absl::StrCat("payload_bytes[", i, "] (",
                                                     PayloadName(p.type, i), "): expected 0, got ",
                                                     p.payload_bytes[i]));
    }
    if (p.payload_bytes[i] > limits.max_frame_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("payload_bytes[", i, "] (", PayloadName(p.type, i), "): expected at most ",
                       limits.max_frame_bytes, ", got ", p.payload_bytes[i]));
    }
    total += p.payload_bytes[i];
  }
  if (total > limits.max_frame_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame bytes (header and payloads): expected at most ", limits.max_frame_bytes,
                     ", got ", total));
  }
  return p;
}

}  // namespace ucx
}  // namespace attnserve
