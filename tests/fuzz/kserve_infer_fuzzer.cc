// libFuzzer target: the KServe v2 front-end's request conversion and its
// shared-memory bounds checks, through the real code: a few registry
// operations (ShmRegistry::RegisterSystem / Acquire / Unregister with the
// input's names, offsets and sizes), then a ModelInferRequest (protobuf bytes)
// run by the `attention` model (server/kserve/attention_model.h) over a real
// AttentionRunner, executor and CPU backend, its inputs and outputs in raw
// contents, typed contents or the registered regions.
//
// Beyond "no crash, no sanitizer report" it checks:
//   - a region registers exactly when [offset, offset + size) fits the
//     object, and Acquire succeeds exactly when the span fits the region;
//   - another tenant gets exactly the answer a never-registered name gets;
//   - `done` runs once; a refusal has a message and leaves no outputs; an OK
//     answer has one raw_output_contents entry per output, sized by its shape
//     (empty for an output written to shared memory);
//   - shared memory changes only inside the spans the request's outputs
//     named, clipped to their regions (a write past a region's end, or into
//     an input region, is a finding: ASan cannot see mmap'd memory).
// Input: a FuzzedDataProvider prefix (the registry program), then the
// request's protobuf bytes. Seeds: make_seeds.
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "backend/backend_factory.h"
#include "common/dtype.h"
#include "inference/grpc_service.pb.h"
#include "server/core/attention_runner.h"
#include "server/executor_pool.h"
#include "server/kserve/attention_model.h"
#include "server/kserve/v2_tensors.h"
#include "server/metrics.h"
#include "server/shm/shm_registry.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_check.h"

namespace attnserve {
namespace {

constexpr RequestLimits kLimits{int64_t{1} << 20, 512};
constexpr char kTenant[] = "fuzz";
constexpr char kIntruder[] = "intruder";

[[noreturn]] void Fail(const std::string& what) { FuzzFail("kserve_infer_fuzzer", what); }

void Expect(bool ok, const std::string& what) {
  if (!ok) Fail(what);
}

// A POSIX shared-memory object the harness also maps, to see every change.
struct ShmObject {
  ShmObject(const std::string& tag, size_t bytes)
      : key(absl::StrCat("/attnserve_fuzz_", tag, "_", getpid())), size(bytes) {
    shm_unlink(key.c_str());
    const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    Expect(fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) == 0, "cannot create " + key);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    Expect(p != MAP_FAILED, "cannot map " + key);
    data = static_cast<char*>(p);
  }
  ~ShmObject() {
    munmap(data, size);
    shm_unlink(key.c_str());
  }
  const std::string key;
  const size_t size;
  char* data = nullptr;
};

// A region of tenant kTenant, as the harness knows it.
struct Region {
  ShmObject* object;
  uint64_t offset, size;
};

struct Harness {
  Harness()
      : backend(MakeCpuBackend(1)),
        executors({backend.get()}, ExecutorOptions{/*max_queue_size=*/4}),
        runner(&executors, "cpu", kLimits, &metrics),
        shm(/*allowed=*/true),
        model(&runner, &shm, &metrics, AttentionModelInfo{}),
        fixed("fixed", 3 * 4096),
        scratch("scratch", 2 * 4096) {
    spdlog::set_level(spdlog::level::off);
    // "in" holds FP16 values the seeds' q/k/v point at; "out" is a small
    // output region. The bytes around them are never part of a region.
    for (size_t i = 0; i < 4096 / 2; ++i) {
      StoreFromFloat(fixed.data + 4096, DType::kFP16, int64_t(i), 0.125f * float(int(i % 15) - 7));
    }
    Expect(shm.RegisterSystem(kTenant, "in", fixed.key, 4096, 4096).ok(), "register in");
    Expect(shm.RegisterSystem(kTenant, "out", fixed.key, 8192, 2048).ok(), "register out");
    regions["in"] = {&fixed, 4096, 4096};
    regions["out"] = {&fixed, 8192, 2048};
  }
  std::unique_ptr<AttentionBackend> backend;
  ServerMetrics metrics;
  ExecutorPool executors;
  AttentionRunner runner;
  ShmRegistry shm;
  AttentionModel model;
  ShmObject fixed, scratch;
  std::map<std::string, Region> regions;
};

// Registers, acquires and unregisters regions named "r0".."r2" of the scratch
// object, checking each answer against the bounds.
void RegistryProgram(Harness* h, FuzzedDataProvider* in, std::vector<std::string>* added) {
  const int ops = in->ConsumeIntegralInRange(0, 4);
  for (int i = 0; i < ops; ++i) {
    const std::string name = absl::StrCat("r", in->ConsumeIntegralInRange(0, 2));
    const uint64_t offset = in->ConsumeBool() ? in->ConsumeIntegralInRange<uint64_t>(0, 9000)
                                              : in->ConsumeIntegral<uint64_t>();
    const uint64_t size = in->ConsumeBool() ? in->ConsumeIntegralInRange<uint64_t>(0, 9000)
                                            : in->ConsumeIntegral<uint64_t>();
    if (in->ConsumeBool()) {
      const bool known = h->regions.count(name) > 0;
      const bool fits = size > 0 && offset <= h->scratch.size && size <= h->scratch.size - offset;
      const absl::Status s = h->shm.RegisterSystem(kTenant, name, h->scratch.key, offset, size);
      Expect(s.ok() == (fits && !known),
             absl::StrCat("RegisterSystem(", name, ", ", offset, ", ", size, ") on ",
                          h->scratch.size, " bytes: ", s.ToString()));
      if (s.ok()) {
        h->regions[name] = {&h->scratch, offset, size};
        added->push_back(name);
      }
      continue;
    }
    auto it = h->regions.find(name);
    const absl::StatusOr<std::shared_ptr<ShmRegion>> got =
        h->shm.Acquire(kTenant, name, offset, size);
    const bool fits =
        it != h->regions.end() && offset <= it->second.size && size <= it->second.size - offset;
    Expect(got.ok() == fits, absl::StrCat("Acquire(", name, ", ", offset, ", ", size,
                                          "): ", got.status().ToString()));
    // Another tenant: exactly a never-registered name's answer.
    const absl::Status theirs = h->shm.Acquire(kIntruder, name, offset, size).status();
    const absl::Status unknown = h->shm.Acquire(kTenant, "never", offset, size).status();
    Expect(theirs.code() == unknown.code() &&
               theirs.message() == absl::StrReplaceAll(unknown.message(), {{"never", name}}),
           absl::StrCat("another tenant's region '", name, "' answers ", theirs.ToString()));
  }
}

// Bytes the answer may change: each shared-memory output's span, clipped to
// its region (as the harness knows the region), in object coordinates.
struct Span {
  const ShmObject* object;
  uint64_t begin, end;
};
std::vector<Span> WritableSpans(const Harness& h, const inference::ModelInferRequest& request) {
  std::vector<Span> spans;
  for (const auto& out : request.outputs()) {
    absl::StatusOr<std::optional<ShmRef>> ref = ShmRefOf("output", out.parameters());
    if (!ref.ok() || !ref->has_value()) continue;
    auto it = h.regions.find((*ref)->region);
    if (it == h.regions.end() || (*ref)->offset >= it->second.size) continue;
    const Region& r = it->second;
    const uint64_t room = r.size - (*ref)->offset;
    spans.push_back({r.object, r.offset + (*ref)->offset,
                     r.offset + (*ref)->offset + std::min((*ref)->byte_size, room)});
  }
  return spans;
}

void CheckOnlySpansChanged(const ShmObject& object, const std::string& before,
                           const std::vector<Span>& spans) {
  for (size_t i = 0; i < object.size; ++i) {
    if (object.data[i] == before[i]) continue;
    bool allowed = false;
    for (const Span& s : spans)
      allowed = allowed || (s.object == &object && i >= s.begin && i < s.end);
    Expect(allowed, absl::StrCat("shared memory ", object.key, " byte ", i,
                                 " changed outside every span the outputs named"));
  }
}

int64_t Elements(const google::protobuf::RepeatedField<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  static Harness* h = new Harness();  // lives for the process, as the server's does
  FuzzedDataProvider in(data, size);
  std::vector<std::string> added;
  RegistryProgram(h, &in, &added);

  inference::ModelInferRequest request;
  const std::string bytes = in.ConsumeRemainingBytesAsString();
  if (request.ParseFromString(bytes)) {
    const std::vector<Span> spans = WritableSpans(*h, request);
    const std::string fixed_before(h->fixed.data, h->fixed.size);
    const std::string scratch_before(h->scratch.data, h->scratch.size);
    inference::ModelInferResponse response;
    absl::Notification done;
    absl::Status result;
    InferCall call;
    call.request = &request;
    call.response = &response;
    call.tenant = kTenant;
    call.cancelled = std::make_shared<std::atomic<bool>>(false);
    call.done = [&](const absl::Status& s) {
      result = s;
      done.Notify();  // a second call aborts (absl::Notification)
    };
    h->model.Infer(std::move(call));
    done.WaitForNotification();
    if (result.ok()) {
      Expect(response.outputs_size() == response.raw_output_contents_size(),
             "outputs and raw_output_contents differ in count");
      for (int i = 0; i < response.outputs_size(); ++i) {
        const auto& o = response.outputs(i);
        const DType t = o.datatype() == "FP32"   ? DType::kFP32
                        : o.datatype() == "BF16" ? DType::kBF16
                                                 : DType::kFP16;
        const size_t want = size_t(Elements(o.shape()) * DTypeSize(t));
        const size_t got = response.raw_output_contents(i).size();
        Expect(got == want || got == 0,
               absl::StrCat("output '", o.name(), "': ", got, " bytes for its shape (", want, ")"));
      }
    } else {
      Expect(!result.message().empty(), "a refusal without a message");
      Expect(response.outputs_size() == 0 && response.raw_output_contents_size() == 0,
             "a refused call left outputs in the response");
    }
    CheckOnlySpansChanged(h->fixed, fixed_before, spans);
    CheckOnlySpansChanged(h->scratch, scratch_before, spans);
    // Restore what a legal output wrote, so each input starts from the same bytes.
    std::memcpy(h->fixed.data, fixed_before.data(), h->fixed.size);
    std::memcpy(h->scratch.data, scratch_before.data(), h->scratch.size);
  }
  for (const std::string& name : added) {
    Expect(h->shm.Unregister(kTenant, ShmKind::kSystem, name).ok(), "Unregister " + name);
    h->regions.erase(name);
  }
  return 0;
}
