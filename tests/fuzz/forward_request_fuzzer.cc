// libFuzzer target: bytes -> ForwardRequest (protobuf decode) -> the server's
// own native decoding and AttentionRunner (validation, params, admission to a real executor on the
// CPU backend, output binding, the response and its log line), as a Forward
// call runs it. Byte-level: libprotobuf-mutator is not packaged for Debian 12.
//
// Beyond "no crash, no sanitizer report", it checks what the contract
// promises for every request the server accepts:
//   - an OK answer has O shaped like Q with Q's byte size, and LSE when asked;
//   - with finite inputs small enough that |q.k| <= 1.1e12 (the bound that
//     backend/score_range.h derives the option ranges from), O and LSE hold no
//     NaN and O no Inf (no all-NaN answer with status OK);
//   - a refusal has a message naming a field ("expected ... got").
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "backend/backend_factory.h"
#include "common/dtype.h"
#include "server/core/attention_runner.h"
#include "server/executor_pool.h"
#include "server/native/field_names.h"
#include "server/native/forward_call.h"
#include "spdlog/spdlog.h"
#include "tests/fuzz/fuzz_check.h"

namespace attnserve {
namespace {

// Small limits keep every accepted request cheap to compute.
constexpr RequestLimits kLimits{int64_t{1} << 20, 512};

struct Harness {
  Harness()
      : backend(MakeCpuBackend(1)),
        executors({backend.get()}, ExecutorOptions{/*max_queue_size=*/4}),
        runner(&executors, "cpu", kLimits) {
    spdlog::set_level(spdlog::level::off);
  }
  std::unique_ptr<AttentionBackend> backend;
  ExecutorPool executors;
  AttentionRunner runner;
};

[[noreturn]] void Fail(const std::string& what) { FuzzFail("forward_request_fuzzer", what); }

// max |value| of a tensor; FP8 values are code x descale (unset: 1).
double MaxAbs(const v1::Tensor& t, bool has_descale, float descale, bool* finite) {
  const DType dtype = static_cast<DType>(t.dtype());
  const int64_t n = static_cast<int64_t>(t.data().size()) / DTypeSize(dtype);
  const double scale = has_descale ? descale : 1.0;
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = LoadAsFloat(t.data().data(), dtype, i) * scale;
    if (!std::isfinite(x)) *finite = false;
    m = std::fmax(m, std::fabs(x));
  }
  return m;
}

void CheckAnswer(const v1::ForwardRequest& request, const v1::ForwardResponse& response) {
  const v1::Tensor& q = request.q();
  // O is shaped like Q, in Q's dtype except BF16 for FP8 inputs.
  const DType o_dtype = OutputDType(static_cast<DType>(q.dtype()));
  const size_t o_bytes = q.data().size() /
                         static_cast<size_t>(DTypeSize(static_cast<DType>(q.dtype()))) *
                         static_cast<size_t>(DTypeSize(o_dtype));
  if (response.o().data().size() != o_bytes ||
      response.o().dtype() != static_cast<v1::DType>(o_dtype)) {
    Fail("OK answer whose O is not shaped like Q (in OutputDType)");
  }
  if (request.options().return_lse() != response.has_lse()) Fail("LSE presence differs");
  bool finite = true;
  const double head_dim = static_cast<double>(q.shape(q.shape_size() - 1));
  const v1::AttentionOptions& o = request.options();
  const double bound = MaxAbs(q, o.has_q_descale(), o.q_descale(), &finite) *
                       MaxAbs(request.k(), o.has_k_descale(), o.k_descale(), &finite) * head_dim;
  MaxAbs(request.v(), o.has_v_descale(), o.v_descale(), &finite);
  if (!finite || bound > 1.1e12) return;  // the data's own range: not promised
  const int64_t n = static_cast<int64_t>(response.o().data().size()) / DTypeSize(o_dtype);
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(LoadAsFloat(response.o().data().data(), o_dtype, i))) {
      Fail("non-finite O for finite inputs inside the documented range");
    }
  }
  const int64_t lse_n = static_cast<int64_t>(response.lse().data().size()) / 4;
  for (int64_t i = 0; i < lse_n; ++i) {
    if (std::isnan(LoadAsFloat(response.lse().data().data(), DType::kFP32, i))) {
      Fail("NaN LSE for finite inputs inside the documented range");
    }
  }
}

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  static Harness* harness = new Harness();  // lives for the process, as the server's does
  v1::ForwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  v1::ForwardResponse response;
  absl::Status result;
  absl::Notification done;
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  CallMeta meta;
  meta.tenant = "fuzz";
  meta.cancelled = cancelled;
  const AttentionCall call = ForwardCallOf(request, &response, std::move(meta));
  harness->runner.Start(&call, NativeFieldNames(),
                        [&](const absl::Status& status, const WorkTimings& timings) {
                          FinishForwardResponse(request, status, timings, "cpu", &response);
                          result = status;
                          done.Notify();
                        });
  done.WaitForNotification();
  if (result.ok()) {
    CheckAnswer(request, response);
  } else if (result.message().empty()) {
    Fail("refusal without a message");
  }
  return 0;
}
