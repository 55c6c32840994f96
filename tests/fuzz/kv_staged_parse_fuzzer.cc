// libFuzzer target: the unary AppendAttend's staged parse
// (ParseAppendAttendStaged, server/native/kv_messages.h), which walks the
// raw request across gRPC's slices and copies q's, k's and v's data into
// host tensor memory instead of letting protobuf parse them, against
// protobuf's own parse of the same bytes (ParseAppendAttend, what the server
// ran before the staging; the staged parse promises "same result, same
// errors").
//
// Beyond "no crash, no hang, no sanitizer report" it checks:
//   - the request buffer is emptied either way;
//   - with memory for every tensor: the staged parse succeeds exactly when
//     protobuf's does, and then its message with the staged bytes put back
//     equals protobuf's message byte for byte once serialized; a staged tensor's message
//     data is empty, its size is its block's, and it was allocated for
//     exactly that many bytes; a tensor that also names a shared-memory span
//     keeps its data in the message (nothing staged for it);
//   - with an allocation refused (null): RESOURCE_EXHAUSTED whose message
//     starts with that tensor's "q.data", "k.data" or "v.data", nothing
//     left staged, and only for a request protobuf parses.
// Input: one control byte, then up to 7 two-byte cut points, then the
// message. Control bits 0-2: how many cut points (the message is cut into
// slices there, as gRPC may receive it); bits 3-4: which allocation returns
// null (0: none, else the 1st, 2nd or 3rd). Seeds: corpus/kv_staged_parse_fuzzer/
// (tests/fuzz/make_kv_staged_seeds.py: wire bytes written by hand).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnserve/v1/kv.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/native/kv_messages.h"
#include "server/native/kv_service.h"
#include "tests/fuzz/fuzz_check.h"

namespace attnserve {
namespace {

constexpr char kTarget[] = "kv_staged_parse_fuzzer";

void Check(bool ok, const std::string& what) {
  if (!ok) FuzzFail(kTarget, what);
}

// `wire` cut at `cuts` (sorted, within it; repeats give empty slices, which
// gRPC does not send, so they are dropped).
grpc::ByteBuffer Sliced(const std::string& wire, std::vector<size_t> cuts) {
  std::sort(cuts.begin(), cuts.end());
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t cut : cuts) {
    if (cut > at) slices.emplace_back(wire.data() + at, cut - at);
    at = std::max(at, cut);
  }
  if (wire.size() > at) slices.emplace_back(wire.data() + at, wire.size() - at);
  if (slices.empty()) return grpc::ByteBuffer();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void RunOne(const uint8_t* data, size_t size) {
  if (size < 1) return;
  const uint8_t control = data[0];
  const size_t num_cuts = control & 7;
  const int refuse_at = (control >> 3) & 3;  // 0: never
  size_t at = 1;
  std::vector<size_t> raw_cuts;
  for (size_t i = 0; i < num_cuts && at + 2 <= size; ++i, at += 2) {
    raw_cuts.push_back(size_t{data[at]} | size_t{data[at + 1]} << 8);
  }
  const std::string wire(reinterpret_cast<const char*>(data) + at, size - at);
  std::vector<size_t> cuts;
  for (size_t c : raw_cuts) cuts.push_back(c % (wire.size() + 1));

  // Protobuf's parse of the bytes, one slice (how the slicing falls does not
  // change protobuf's answer).
  grpc::ByteBuffer whole = Sliced(wire, {});
  v1::AppendAttendRequest expected;
  const grpc::Status expected_status = ParseAppendAttend(&whole, &expected);

  grpc::ByteBuffer buffer = Sliced(wire, cuts);
  std::vector<int64_t> asked;
  const HostTensorAllocator allocate = [&](int64_t bytes) -> std::shared_ptr<char> {
    asked.push_back(bytes);
    if (static_cast<int>(asked.size()) == refuse_at) return nullptr;
    return std::shared_ptr<char>(new char[static_cast<size_t>(std::max<int64_t>(bytes, 1))],
                                 std::default_delete<char[]>());
  };
  v1::AppendAttendRequest request;
  KvStagedInputs staged;
  const grpc::Status status = ParseAppendAttendStaged(&buffer, allocate, &request, &staged);
  Check(buffer.Length() == 0, "the request's buffer was not emptied");

  const bool refused = refuse_at > 0 && static_cast<int>(asked.size()) >= refuse_at;
  if (refused) {
    Check(expected_status.ok(), absl::StrCat("an allocation was asked for a request protobuf ",
                                             "refuses: ", expected_status.error_message()));
    Check(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("a refused allocation gave code ", status.error_code(), ": ",
                       status.error_message()));
    Check(absl::StartsWith(status.error_message(), "q.data") ||
              absl::StartsWith(status.error_message(), "k.data") ||
              absl::StartsWith(status.error_message(), "v.data"),
          "a refused allocation's message names no tensor: " + status.error_message());
    Check(!staged.q && !staged.k && !staged.v && staged.q_bytes == 0 && staged.k_bytes == 0 &&
              staged.v_bytes == 0,
          "a refused allocation left tensors staged");
    return;
  }
  Check(status.ok() == expected_status.ok(),
        absl::StrCat("staged parse ", status.ok() ? "accepted" : "refused", " what protobuf ",
                     expected_status.ok() ? "accepts" : "refuses", ": '", status.error_message(),
                     "' / '", expected_status.error_message(), "'"));
  if (!status.ok()) return;

  const v1::Tensor* tensors[3] = {&request.q(), &request.k(), &request.v()};
  const std::shared_ptr<char>* blocks[3] = {&staged.q, &staged.k, &staged.v};
  const int64_t sizes[3] = {staged.q_bytes, staged.k_bytes, staged.v_bytes};
  const std::string expected_data[3] = {expected.q().data(), expected.k().data(),
                                        expected.v().data()};
  constexpr const char* kNames[3] = {"q", "k", "v"};
  v1::AppendAttendRequest rejoined = request;
  // mutable_* only for a staged tensor: it would make an absent one present.
  auto rejoined_tensor = [&rejoined](int t) {
    return t == 0 ? rejoined.mutable_q() : t == 1 ? rejoined.mutable_k() : rejoined.mutable_v();
  };
  size_t allocation = 0;
  for (int t = 0; t < 3; ++t) {
    const std::string name = kNames[t];
    if (*blocks[t] == nullptr) {
      Check(sizes[t] == 0, name + ": a size without a block");
      continue;
    }
    Check(tensors[t]->data().empty(), name + ": staged and also in the message");
    Check(!tensors[t]->has_shm(), name + ": staged although it names a shared-memory span");
    Check(sizes[t] > 0, name + ": an empty block staged");
    Check(allocation < asked.size() && asked[allocation] == sizes[t],
          name + ": allocated for a size other than its data's");
    ++allocation;
    rejoined_tensor(t)->set_data(std::string(blocks[t]->get(), static_cast<size_t>(sizes[t])));
    Check(rejoined_tensor(t)->data() == expected_data[t], name + ": staged bytes differ");
  }
  Check(allocation == asked.size(), "an allocation that staged nothing");
  // Byte for byte: the same fields (unknown ones included, in their order)
  // and the same float bits (a NaN option compares unequal to itself).
  if (expected.SerializeAsString() != rejoined.SerializeAsString()) {
    std::string difference;
    google::protobuf::util::MessageDifferencer differ;
    differ.ReportDifferencesToString(&difference);
    differ.Compare(expected, rejoined);
    FuzzFail(kTarget, "the staged message differs from protobuf's: " + difference);
  }
}

}  // namespace
}  // namespace attnserve

// Protobuf logs a line for each string field that is not UTF-8 (a refusal
// the check compares, not a finding): silenced.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::RunOne(data, size);
  return 0;
}
