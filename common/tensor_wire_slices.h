// A message with large Tensor fields on the gRPC wire without copying the
// tensors' bytes into the serialized message: the message is encoded without
// their `data`, then each Tensor field occurs once more holding only `data`,
// whose bytes travel as a slice that owns the moved-out string. Protobuf
// merges repeated occurrences of an embedded message field, so every parser
// reads exactly the message it would have read from the one-piece encoding.
// Used where a K/V step's tensors are sent (the client's request, the
// server's response): the serialising memcpy of q/k/v or o is gone; the
// kernel still copies into the socket as it does for any message.
#pragma once

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/message_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace attnserve {

class TensorWireSlices {
 public:
  // Moves the bytes of `data` (a Tensor's data field, emptied here) out of
  // the message; `field` is that Tensor's field number in the outer message.
  // Call for every tensor before Encode; an empty one is skipped.
  void TakeData(uint32_t field, std::string* data) {
    if (data->empty()) return;
    auto* owned = new std::string(std::move(*data));
    data->clear();
    tails_.push_back({field, owned->data(), owned->size(), owned, &FreeString});
  }
  // The same for data held elsewhere: `bytes` (n of them) stay alive as long
  // as gRPC needs them.
  void ShareData(uint32_t field, std::shared_ptr<const char> bytes, size_t n) {
    if (n == 0) return;
    const char* data = bytes.get();
    tails_.push_back(
        {field, data, n, new std::shared_ptr<const char>(std::move(bytes)), &FreeShared});
  }

  // `message` (its data fields taken) followed by the taken tensors' data.
  grpc::ByteBuffer Encode(const google::protobuf::MessageLite& message) {
    using google::protobuf::io::CodedOutputStream;
    using WireFormatLite = google::protobuf::internal::WireFormatLite;
    constexpr uint32_t kTensorDataField = 3;  // Tensor.data
    std::vector<grpc::Slice> slices;
    slices.emplace_back(message.SerializeAsString());
    for (Tail& t : tails_) {
      const uint32_t n = static_cast<uint32_t>(t.size);
      const uint32_t inner = 1 + CodedOutputStream::VarintSize32(n) + n;
      uint8_t head[32];
      uint8_t* p = head;
      p = CodedOutputStream::WriteTagToArray(
          WireFormatLite::MakeTag(t.field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED), p);
      p = CodedOutputStream::WriteVarint32ToArray(inner, p);
      p = CodedOutputStream::WriteTagToArray(
          WireFormatLite::MakeTag(kTensorDataField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED), p);
      p = CodedOutputStream::WriteVarint32ToArray(n, p);
      slices.emplace_back(head, static_cast<size_t>(p - head));
      // The slice owns the bytes from here (freed when gRPC is done with them).
      slices.emplace_back(const_cast<char*>(t.data), t.size, t.free, t.owner);
      t.owner = nullptr;
    }
    tails_.clear();
    return grpc::ByteBuffer(slices.data(), slices.size());
  }

  TensorWireSlices() = default;
  TensorWireSlices(const TensorWireSlices&) = delete;
  TensorWireSlices& operator=(const TensorWireSlices&) = delete;
  ~TensorWireSlices() {
    for (Tail& t : tails_) t.free(t.owner);
  }

 private:
  struct Tail {
    uint32_t field;
    const char* data;
    size_t size;
    void* owner;
    void (*free)(void* owner);
  };
  static void FreeString(void* owner) { delete static_cast<std::string*>(owner); }
  static void FreeShared(void* owner) { delete static_cast<std::shared_ptr<const char>*>(owner); }

  std::vector<Tail> tails_;
};

}  // namespace attnserve
