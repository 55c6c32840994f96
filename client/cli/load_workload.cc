// Builds `attnctl load`'s requests and references, and turns a Forward/Echo
// response into the Recorder's RPC-independent Completion (checking it).
#include "client/cli/load_workload.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/cli/attention_flags.h"

namespace attnserve {
namespace cli {
namespace {

constexpr char kCheckFailed[] = "CHECK_FAILED";

// "" when the response matches its reference, else why not. Leaves only the
// timing in `response` (the tensors are moved out to be decoded).
std::string CheckResponse(const Workload& w, int input, v1::ForwardResponse* response) {
  v1::ForwardResponse decoded;
  *decoded.mutable_timing() = response->timing();
  absl::StatusOr<ForwardResult> result = ForwardResultFromProto(std::move(*response));
  *response = std::move(decoded);
  if (!result.ok()) return std::string(result.status().message());
  absl::StatusOr<VerifyReport> report = w.verifiers[input].Check(*result);
  if (!report.ok()) return std::string(report.status().message());
  return report->passed ? "" : report->failure;
}

}  // namespace

double FlopsOf(const AttentionInputs& in, const InputsSummary& s) {
  const double per_pair = 4.0 * s.heads_q * s.head_dim;
  auto seq = [&](int64_t sq, int64_t sk) {
    return per_pair * sq * sk * (in.options.causal && sq == sk ? 0.5 : 1.0);
  };
  if (!s.varlen) return s.batch * seq(s.seqlen_q, s.seqlen_k);
  double flops = 0.0;
  for (size_t b = 0; b + 1 < in.cu_seqlens_q.size(); ++b) {
    flops += seq(in.cu_seqlens_q[b + 1] - in.cu_seqlens_q[b],
                 in.cu_seqlens_k[b + 1] - in.cu_seqlens_k[b]);
  }
  return flops;
}

absl::StatusOr<Workload> BuildWorkload(const LoadConfig& config) {
  Workload w;
  w.echo = config.echo;
  for (int i = 0; i < config.inputs; ++i) {
    absl::StatusOr<AttentionInputs> in = RandomInputsFromFlags(config.dtype, config.seed + i);
    if (!in.ok()) return in.status();
    absl::Status st = OptionsFromFlags(&in->options);
    if (!st.ok()) return st;
    if (i == 0) {
      absl::StatusOr<InputsSummary> s = SummarizeInputs(*in);
      if (!s.ok()) return s.status();
      w.summary = *s;
      w.options = OptionsString(in->options);
      w.tokens_per_request = s->total_q;
      w.flops_per_request = config.echo ? 0.0 : FlopsOf(*in, *s);
    }
    if (config.check) {
      absl::StatusOr<ForwardVerifier> v = ForwardVerifier::Create(*in);
      if (!v.ok()) return v.status();
      w.verifiers.push_back(*std::move(v));
    }
    w.requests.push_back(MakeForwardRequest(*std::move(in)));
    if (config.protocol.v2 && config.protocol.shm == V2Shm::kNone) {
      w.v2_requests.push_back(ToModelInferRequest(w.requests.back()));
    }
  }
  return w;
}

Completion ForwardCompletion(const Workload& w, int input, absl::Time sent, absl::Status status,
                             v1::ForwardResponse* response) {
  Completion c;
  c.sent = sent;
  c.done = absl::Now();  // before the check, which is not the server's time
  if (status.ok() && response->error_code() != 0) {
    status = absl::Status(static_cast<absl::StatusCode>(response->error_code()),
                          response->error_message());
  }
  if (!status.ok()) {
    c.code = absl::StatusCodeToString(status.code());
    c.failure = absl::StrCat(c.code, ": ", status.message());
    return c;
  }
  if (!w.verifiers.empty()) {
    const std::string mismatch = CheckResponse(w, input, response);
    if (!mismatch.empty()) {
      c.code = kCheckFailed;
      c.failure = absl::StrCat(kCheckFailed, ": ", mismatch);
      return c;
    }
  }
  c.timing = &response->timing();
  return c;
}

}  // namespace cli
}  // namespace attnserve
