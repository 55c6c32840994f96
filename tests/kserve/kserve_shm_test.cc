// System shared memory through ModelInfer on a real in-process server: q, k
// and v are read, and o and lse written, at exactly the offsets a request
// names, with Forward's bytes and no other byte of the region touched -- in
// place at aligned offsets (the server computes on the region itself: what
// the client changes while the request waits in the backend is what it
// reads) and through a copy at misaligned ones. An output that does not fit
// its region fails the request before it runs, with the message it always
// had, writing nothing; bad input references name the input or the region.
// A client that shrinks its object, before a call or while the server
// computes on it, fails that call naming the region, and the server serves on.
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/kserve/kserve_test_server.h"
#include "tests/kserve/shm_test_util.h"

namespace attnserve {
namespace {

using KserveShmTest = KserveServerTest;

// Every byte of a test region no tensor owns.
constexpr char kUntouched = '\x5a';

// Where a request's tensors lie in one region: not in the request's order
// (v, q, k, lse, o), with gaps between, each at `shift` bytes past a multiple
// of 64 (0: in place; 2: misaligned for FP32 and LSE, so copied).
struct Layout {
  int64_t q = 0, k = 0, v = 0, o = 0, lse = 0, end = 0;
  int64_t q_bytes = 0, kv_bytes = 0, lse_bytes = 0;  // o is like q

  // The [offset, offset + bytes) spans of q, k, v, o and lse.
  std::vector<std::pair<int64_t, int64_t>> spans() const {
    return {{q, q_bytes}, {k, kv_bytes}, {v, kv_bytes}, {o, q_bytes}, {lse, lse_bytes}};
  }
};

// LSE bytes of a request: FP32, one per query row and head.
int64_t LseBytes(const v1::ForwardRequest& r) {
  int64_t rows_heads = 1;
  for (int i = 0; i + 1 < r.q().shape_size(); ++i) rows_heads *= r.q().shape(i);
  return rows_heads * 4;
}

Layout MakeLayout(const v1::ForwardRequest& r, int64_t shift) {
  Layout l;
  l.q_bytes = static_cast<int64_t>(r.q().data().size());
  l.kv_bytes = static_cast<int64_t>(r.k().data().size());
  l.lse_bytes = LseBytes(r);
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = (at + 63) / 64 * 64 + 64 + shift;
    at = here + bytes;
    return here;
  };
  l.v = take(l.kv_bytes);
  l.q = take(l.q_bytes);
  l.k = take(l.kv_bytes);
  l.lse = take(l.lse_bytes);
  l.o = take(l.q_bytes);
  l.end = at + 64;
  return l;
}

// A region laid out as `l`: every byte kUntouched, then r's q, k and v.
void Fill(const v1::ForwardRequest& r, const Layout& l, char* region) {
  std::memset(region, kUntouched, static_cast<size_t>(l.end));
  std::memcpy(region + l.q, r.q().data().data(), r.q().data().size());
  std::memcpy(region + l.k, r.k().data().data(), r.k().data().size());
  std::memcpy(region + l.v, r.v().data().data(), r.v().data().size());
}

// ModelInfer of `r` with q, k, v, o and lse in `region` as `l` places them
// (cu_seqlens, if any, stay in raw_input_contents).
ModelInferRequest InRegion(const v1::ForwardRequest& r, const std::string& region,
                           const Layout& l) {
  ModelInferRequest v2 = ToV2(r);
  // q, k, v are inputs 0-2 and their raw entries come first (ToV2).
  v2.mutable_raw_input_contents()->DeleteSubrange(0, 3);
  PlaceInRegion(v2.mutable_inputs(0)->mutable_parameters(), region, l.q, l.q_bytes);
  PlaceInRegion(v2.mutable_inputs(1)->mutable_parameters(), region, l.k, l.kv_bytes);
  PlaceInRegion(v2.mutable_inputs(2)->mutable_parameters(), region, l.v, l.kv_bytes);
  auto* o = v2.add_outputs();
  o->set_name("o");
  PlaceInRegion(o->mutable_parameters(), region, l.o, l.q_bytes);
  auto* lse = v2.add_outputs();
  lse->set_name("lse");
  PlaceInRegion(lse->mutable_parameters(), region, l.lse, l.lse_bytes);
  return v2;
}

std::string At(const char* region, int64_t offset, int64_t bytes) {
  return std::string(region + offset, static_cast<size_t>(bytes));
}

// The first byte of [0, l.end) outside `spans` that is not kUntouched; -1
// when there is none.
int64_t FirstTouchedOutside(const char* region, const Layout& l,
                            const std::vector<std::pair<int64_t, int64_t>>& spans) {
  for (int64_t i = 0; i < l.end; ++i) {
    bool owned = false;
    for (const auto& [at, bytes] : spans) owned = owned || (i >= at && i < at + bytes);
    if (!owned && region[i] != kUntouched) return i;
  }
  return -1;
}

TEST_F(KserveShmTest, InputsAndOutputsLieAtTheOffsetsTheRequestNames) {
  std::vector<v1::ForwardRequest> cases;
  cases.push_back(Dense(DType::kFP32, 2, 9, 13, 4, 2, 32));
  cases.back().mutable_options()->set_causal(true);
  cases.push_back(Dense(DType::kFP16, 1, 17, 17, 2, 2, 64));
  cases.push_back(Varlen());  // cu_seqlens in the message, q, k, v in the region
  int n = 0;
  for (const v1::ForwardRequest& base : cases) {
    v1::ForwardRequest request = base;
    request.mutable_options()->set_return_lse(true);
    v1::ForwardResponse native;
    ASSERT_TRUE(Forward(request, &native).ok());
    for (int64_t shift : {0, 2}) {
      SCOPED_TRACE(absl::StrCat(request.request_id(), " ", request.q().dtype(), " shift ", shift));
      const Layout l = MakeLayout(request, shift);
      TestShmObject object(static_cast<size_t>(l.end), absl::StrCat("offsets", n));
      ASSERT_TRUE(object.ok());
      Fill(request, l, object.data());
      const std::string name = absl::StrCat("r", n++);
      ASSERT_TRUE(RegisterSystem(name, object.key(), static_cast<uint64_t>(l.end)).ok());

      ModelInferResponse response;
      const grpc::Status status = Infer(InRegion(request, name, l), &response);
      ASSERT_TRUE(status.ok()) << status.error_message();
      ASSERT_EQ(response.outputs_size(), 2);
      ASSERT_EQ(response.raw_output_contents_size(), 2);
      EXPECT_EQ(response.outputs(0).name(), "o");
      EXPECT_EQ(response.outputs(0).datatype(), DTypeName(static_cast<DType>(request.q().dtype())));
      EXPECT_EQ(std::vector<int64_t>(response.outputs(0).shape().begin(),
                                     response.outputs(0).shape().end()),
                std::vector<int64_t>(native.o().shape().begin(), native.o().shape().end()));
      EXPECT_EQ(response.outputs(1).name(), "lse");
      EXPECT_EQ(response.outputs(1).datatype(), "FP32");
      EXPECT_EQ(std::vector<int64_t>(response.outputs(1).shape().begin(),
                                     response.outputs(1).shape().end()),
                std::vector<int64_t>(native.lse().shape().begin(), native.lse().shape().end()));
      // The bytes are in the region, not the message.
      EXPECT_TRUE(response.raw_output_contents(0).empty());
      EXPECT_TRUE(response.raw_output_contents(1).empty());

      EXPECT_TRUE(At(object.data(), l.o, l.q_bytes) == native.o().data());
      EXPECT_TRUE(At(object.data(), l.lse, l.lse_bytes) == native.lse().data());
      // The inputs are read, never written.
      EXPECT_TRUE(At(object.data(), l.q, l.q_bytes) == request.q().data());
      EXPECT_TRUE(At(object.data(), l.k, l.kv_bytes) == request.k().data());
      EXPECT_TRUE(At(object.data(), l.v, l.kv_bytes) == request.v().data());
      EXPECT_EQ(FirstTouchedOutside(object.data(), l, l.spans()), -1);
    }
  }
}

// At an aligned offset the server computes on the region's bytes themselves:
// q changed while the request waits in the backend is the q it uses. At a
// misaligned one it copied q before the request ran.
TEST_F(KserveShmTest, AlignedInputsAreReadWhereTheyLie) {
  v1::ForwardRequest first = Dense(DType::kFP32, 1, 16, 16, 2, 2, 32);
  v1::ForwardRequest second = first;
  *second.mutable_q()->mutable_data() = Values(DType::kFP32, 16 * 2 * 32, 7);
  v1::ForwardResponse native_first, native_second;
  ASSERT_TRUE(Forward(first, &native_first).ok());
  ASSERT_TRUE(Forward(second, &native_second).ok());
  ASSERT_NE(native_first.o().data(), native_second.o().data());
  for (int64_t shift : {0, 2}) {
    SCOPED_TRACE(absl::StrCat("shift ", shift));
    const Layout l = MakeLayout(first, shift);
    TestShmObject object(static_cast<size_t>(l.end), absl::StrCat("inplace", shift));
    ASSERT_TRUE(object.ok());
    Fill(first, l, object.data());
    const std::string name = absl::StrCat("inplace", shift);
    ASSERT_TRUE(RegisterSystem(name, object.key(), static_cast<uint64_t>(l.end)).ok());

    const int calls = backend_->calls();
    backend_->Close();
    grpc::Status status;
    ModelInferResponse response;
    std::thread caller([&] { status = Infer(InRegion(first, name, l), &response); });
    backend_->AwaitCalls(calls + 1);  // inside the backend, before compute
    std::memcpy(object.data() + l.q, second.q().data().data(), second.q().data().size());
    backend_->Open();
    caller.join();
    ASSERT_TRUE(status.ok()) << status.error_message();
    const std::string& want = shift == 0 ? native_second.o().data() : native_first.o().data();
    EXPECT_TRUE(At(object.data(), l.o, l.q_bytes) == want);
  }
}

TEST_F(KserveShmTest, AnOutputThatDoesNotFitFailsBeforeItRunsAndWritesNothing) {
  v1::ForwardRequest request = Dense(DType::kFP32, 1, 8, 8, 2, 2, 32);
  request.mutable_options()->set_return_lse(true);
  for (const char* output : {"o", "lse"}) {
    SCOPED_TRACE(output);
    const Layout l = MakeLayout(request, 0);
    TestShmObject object(static_cast<size_t>(l.end), absl::StrCat("small_", output));
    ASSERT_TRUE(object.ok());
    Fill(request, l, object.data());
    const std::string name = absl::StrCat("small_", output);
    ASSERT_TRUE(RegisterSystem(name, object.key(), static_cast<uint64_t>(l.end)).ok());
    ModelInferRequest v2 = InRegion(request, name, l);
    const int index = std::string(output) == "o" ? 0 : 1;
    const int64_t needed = index == 0 ? l.q_bytes : l.lse_bytes;
    (*v2.mutable_outputs(index)->mutable_parameters())["shared_memory_byte_size"].set_int64_param(
        needed - 4);

    const int calls = backend_->calls();
    ModelInferResponse response;
    const grpc::Status status = Infer(v2, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(status.error_message(),
              absl::StrCat("outputs['", output, "']: shared memory region '", name,
                           "' was given shared_memory_byte_size ", needed - 4, " for an output of ",
                           needed, " bytes"));
    EXPECT_EQ(backend_->calls(), calls);
    // Only the inputs are in the region: no output was written, in part or whole.
    EXPECT_EQ(FirstTouchedOutside(object.data(), l,
                                  {{l.q, l.q_bytes}, {l.k, l.kv_bytes}, {l.v, l.kv_bytes}}),
              -1);
  }
}

TEST_F(KserveShmTest, BadInputReferencesNameTheInputOrTheRegion) {
  const v1::ForwardRequest request = Dense(DType::kFP32, 1, 8, 8, 2, 2, 32);
  const Layout l = MakeLayout(request, 0);
  TestShmObject object(static_cast<size_t>(l.end), "badinputs");
  ASSERT_TRUE(object.ok());
  Fill(request, l, object.data());
  ASSERT_TRUE(RegisterSystem("bad", object.key(), static_cast<uint64_t>(l.end)).ok());
  const int calls = backend_->calls();

  // q's bytes 4 short of its shape: Forward's own message for such a q, the
  // field named in v2's words.
  v1::ForwardRequest short_q = request;
  short_q.mutable_q()->mutable_data()->resize(request.q().data().size() - 4);
  v1::ForwardResponse native;
  const grpc::Status want = Forward(short_q, &native);
  ASSERT_FALSE(want.ok());
  ModelInferRequest v2 = InRegion(request, "bad", l);
  PlaceInRegion(v2.mutable_inputs(0)->mutable_parameters(), "bad", l.q, l.q_bytes - 4);
  ModelInferResponse response;
  grpc::Status got = Infer(v2, &response);
  EXPECT_EQ(got.error_code(), want.error_code());
  EXPECT_EQ(want.error_message().rfind("q.data: ", 0), 0u) << want.error_message();
  EXPECT_EQ(got.error_message(),
            "inputs['" + want.error_message().substr(0, 1) + "']" + want.error_message().substr(1))
      << got.error_message();

  // k past the region's end.
  v2 = InRegion(request, "bad", l);
  const int64_t past = l.end - 8;
  PlaceInRegion(v2.mutable_inputs(1)->mutable_parameters(), "bad", past, l.kv_bytes);
  got = Infer(v2, &response);
  EXPECT_EQ(got.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(got.error_message(),
            absl::StrCat("shared memory region 'bad': offset ", past, " + byte_size ", l.kv_bytes,
                         " exceeds the region's ", l.end, " bytes"));
  EXPECT_EQ(backend_->calls(), calls);
  EXPECT_EQ(FirstTouchedOutside(object.data(), l,
                                {{l.q, l.q_bytes}, {l.k, l.kv_bytes}, {l.v, l.kv_bytes}}),
            -1);
}

// The object is shrunk before the call: refused before the backend runs,
// naming the region; the next call on an intact region is served.
TEST_F(KserveShmTest, AnObjectShrunkBeforeTheCallFailsItCleanly) {
  v1::ForwardRequest request = Dense(DType::kFP32, 1, 16, 16, 2, 2, 32);
  request.mutable_options()->set_return_lse(true);
  v1::ForwardResponse native;
  ASSERT_TRUE(Forward(request, &native).ok());
  const Layout l = MakeLayout(request, 0);
  TestShmObject object(static_cast<size_t>(l.end), "shrunk_before");
  ASSERT_TRUE(object.ok());
  Fill(request, l, object.data());
  ASSERT_TRUE(RegisterSystem("shrunk", object.key(), static_cast<uint64_t>(l.end)).ok());
  ASSERT_TRUE(object.Truncate(static_cast<size_t>(l.q)));

  const int calls = backend_->calls();
  ModelInferResponse response;
  const grpc::Status status = Infer(InRegion(request, "shrunk", l), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(status.error_message().find("shared memory region 'shrunk'"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(backend_->calls(), calls);

  TestShmObject intact(static_cast<size_t>(l.end), "intact_after");
  ASSERT_TRUE(intact.ok());
  Fill(request, l, intact.data());
  ASSERT_TRUE(RegisterSystem("intact", intact.key(), static_cast<uint64_t>(l.end)).ok());
  const grpc::Status served = Infer(InRegion(request, "intact", l), &response);
  ASSERT_TRUE(served.ok()) << served.error_message();
  EXPECT_TRUE(At(intact.data(), l.o, l.q_bytes) == native.o().data());
}

// The object is shrunk while the call waits in the backend, after every check
// at the door passed: compute reads q and writes o past the new end, where
// the server would have died of SIGBUS. The call fails naming the region, and
// the server answers the next call.
TEST_F(KserveShmTest, AnObjectShrunkDuringTheCallFailsItAndTheServerServesOn) {
  v1::ForwardRequest request = Dense(DType::kFP32, 1, 64, 64, 2, 2, 64);
  request.mutable_options()->set_return_lse(true);
  v1::ForwardResponse native;
  ASSERT_TRUE(Forward(request, &native).ok());
  for (int64_t shift : {0, 2}) {  // in place, and copied
    SCOPED_TRACE(absl::StrCat("shift ", shift));
    const Layout l = MakeLayout(request, shift);
    TestShmObject object(static_cast<size_t>(l.end), absl::StrCat("shrunk_during", shift));
    ASSERT_TRUE(object.ok());
    Fill(request, l, object.data());
    const std::string name = absl::StrCat("during", shift);
    ASSERT_TRUE(RegisterSystem(name, object.key(), static_cast<uint64_t>(l.end)).ok());

    const int calls = backend_->calls();
    backend_->Close();
    grpc::Status status;
    ModelInferResponse response;
    std::thread caller([&] { status = Infer(InRegion(request, name, l), &response); });
    backend_->AwaitCalls(calls + 1);  // inside the backend, before compute
    ASSERT_TRUE(object.Truncate(0));
    backend_->Open();
    caller.join();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(status.error_message().find(absl::StrCat("shared memory region '", name, "'")),
              std::string::npos)
        << status.error_message();
    EXPECT_EQ(response.outputs_size(), 0);

    v1::ForwardResponse after;
    const grpc::Status served = Forward(request, &after);
    ASSERT_TRUE(served.ok()) << served.error_message();
    EXPECT_TRUE(after.o().data() == native.o().data());
  }
}

}  // namespace
}  // namespace attnserve
