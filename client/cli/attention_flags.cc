// The attention-call flags shared by `attnctl forward` and `attnctl load`
// (see attention_flags.h).
#include "client/cli/attention_flags.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/common.h"
#include "client/inputs.h"

// Shape of random inputs.
ABSL_FLAG(int, batch, 1, "Dense random inputs: number of sequences B.");
ABSL_FLAG(int, seqlen_q, 128, "Dense random inputs: query length Sq.");
ABSL_FLAG(std::optional<int>, seqlen_k, std::nullopt,
          "Dense random inputs: key length Sk (default: --seqlen_q).");
ABSL_FLAG(int, heads_q, 8, "Random inputs: query heads Hq.");
ABSL_FLAG(
    std::optional<int>, heads_kv, std::nullopt,
    "Random inputs: key/value heads Hkv; Hq must be a multiple (GQA/MQA). Default: --heads_q.");
ABSL_FLAG(int, head_dim, 64,
          "Random inputs: head dimension D (the server accepts multiples of "
          "8 from 8 to 256, and up to 576 with --head_dim_v).");
ABSL_FLAG(int, head_dim_v, 0,
          "Random inputs: V's (and O's) head dimension Dv when it differs from --head_dim (MLA "
          "shapes, e.g. --head_dim=192 --head_dim_v=128); 0 = --head_dim.");
ABSL_FLAG(std::string, varlen_q, "",
          "Packed variable-length random inputs: comma-separated query lengths, one per sequence, "
          "zeros allowed (e.g. 3,0,17). Replaces --batch/--seqlen_q/--seqlen_k.");
ABSL_FLAG(
    std::string, varlen_k, "",
    "Varlen key lengths, as many as --varlen_q (default: equal to --varlen_q). With --q/--k/--v "
    "files, --varlen_q/--varlen_k give the sequence lengths of the packed rows.");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt,
          "Seed of the random inputs (default: a fresh one, printed so a run can be repeated).");
ABSL_FLAG(std::string, dtype, "fp16",
          "Element type: fp16, bf16, fp32 or fp8_e4m3 (FP8 E4M3 codes; O comes back as BF16). "
          "With --q/--k/--v files the default is the files' type and an explicit --dtype converts "
          "them (uint8 .npy files hold FP8 codes: pass --dtype=fp8_e4m3).");

// Attention options (docs/design.md §2).
ABSL_FLAG(bool, causal, false,
          "Causal mask, aligned bottom-right: query i sees key j <= i + Sk - Sq.");
ABSL_FLAG(std::optional<int>, window_left, std::nullopt,
          "Sliding window: keys at most this far left of the diagonal (default: unlimited).");
ABSL_FLAG(std::optional<int>, window_right, std::nullopt,
          "Sliding window: keys at most this far right of the diagonal (default: unlimited).");
ABSL_FLAG(float, softcap, 0.0f,
          "Score soft cap: scores become softcap * tanh(scores / softcap); 0 = off.");
ABSL_FLAG(std::optional<float>, softmax_scale, std::nullopt,
          "Multiplies Q*K^T before the softmax (default: 1/sqrt(D)).");
ABSL_FLAG(bool, return_lse, false, "Also return the log-sum-exp of each query row.");
ABSL_FLAG(std::optional<float>, q_descale, std::nullopt,
          "FP8 inputs: q's value is its code times this, in (0, 128] (default: 1).");
ABSL_FLAG(std::optional<float>, k_descale, std::nullopt,
          "FP8 inputs: k's value is its code times this, in (0, 128] (default: 1).");
ABSL_FLAG(std::optional<float>, v_descale, std::nullopt,
          "FP8 inputs: v's value is its code times this, in (0, 128] (default: 1).");

// Which protocol carries the call (docs/kserve.md).
ABSL_FLAG(std::string, protocol, "native",
          "native: attnserve.v1.Attention/Forward. v2: KServe v2 / Triton ModelInfer of the model "
          "'attention' (inference.GRPCInferenceService on the same port), so the two paths "
          "compare side by side.");
ABSL_FLAG(std::string, shm, "none",
          "Same-host shared memory instead of tensor bytes on the socket (the server must run "
          "with --allow_client_shm; docs/shared-memory.md): none, system (a POSIX shared-memory "
          "object under --shm_prefix, registered once, unregistered and removed at exit) or "
          "cuda (device memory of GPU 0 registered as a CUDA IPC handle; needs an attnctl built "
          "with CUDA). forward: q, k and v go into the region and O (and LSE) come back from it "
          "(native Tensor.shm and output_shm; with --protocol=v2, KServe v2 shared memory). "
          "load-kv: every prefill and decode step goes through one region per group, reused "
          "every step. load: only with --protocol=v2, one region per caller, each caller's "
          "input written once and outputs read back only with --check.");
ABSL_FLAG(std::string, shm_prefix, attnserve::kDefaultShmKeyPrefix,
          "With --shm=system: where the shared-memory objects' names start (shm_open name: this "
          "prefix, then attnctl-<pid>-<n>, or attnctl_<pid>_<n> with --protocol=v2). A server with "
          "--auth_tokens_file accepts only \"/attnserve.<tenant>.\" for the caller's tenant.");

namespace attnserve {
namespace cli {
namespace {

absl::Status UsageStatus(std::string message) { return absl::InvalidArgumentError(message); }

}  // namespace

absl::StatusOr<ProtocolChoice> ProtocolFromFlags() {
  ProtocolChoice choice;
  const std::string protocol = absl::GetFlag(FLAGS_protocol);
  if (protocol != "native" && protocol != "v2") {
    return UsageStatus(absl::StrCat("--protocol: expected native or v2, got '", protocol, "'"));
  }
  choice.v2 = protocol == "v2";
  absl::StatusOr<V2Shm> shm = ParseV2Shm(absl::GetFlag(FLAGS_shm));
  if (!shm.ok()) return shm.status();
  choice.shm = *shm;
  choice.shm_prefix = absl::GetFlag(FLAGS_shm_prefix);
  if (FlagWasSet("shm_prefix") && choice.shm != ShmMode::kSystem) {
    return UsageStatus("--shm_prefix names the objects of --shm=system; it does not apply here");
  }
  const std::string& prefix = choice.shm_prefix;
  if (prefix.size() < 2 || prefix[0] != '/' || prefix.find('/', 1) != std::string::npos) {
    return UsageStatus(absl::StrCat("--shm_prefix: expected \"/\" then a name without \"/\" ",
                                    "(e.g. ", attnserve::kDefaultShmKeyPrefix, "), got \"", prefix,
                                    "\""));
  }
  return choice;
}

std::string ShmTransportName(ShmMode shm) {
  switch (shm) {
    case ShmMode::kSystem: return "shm-system";
    case ShmMode::kCuda: return "shm-cuda";
    case ShmMode::kNone: break;
  }
  return "grpc";
}

absl::StatusOr<std::unique_ptr<ShmArena>> MakeArena(AttentionClient& client,
                                                    const ProtocolChoice& protocol,
                                                    uint64_t byte_size) {
  static std::atomic<int> counter{0};
  ShmArenaOptions options;
  options.mode = protocol.shm;
  options.byte_size = std::max<uint64_t>(byte_size, 1);
  options.name = absl::StrCat("attnctl-", getpid(), "-", counter.fetch_add(1));
  options.key_prefix = protocol.shm_prefix;
  // attnctl may be interrupted: its objects must not outlive it in /dev/shm.
  options.unlink_after_register = true;
  return ShmArena::Create(client, options);
}

std::string ProtocolChoice::ToString() const {
  if (!v2) {
    if (shm == ShmMode::kNone) return "native (attnserve.v1.Attention)";
    return absl::StrCat("native (attnserve.v1.Attention, shm ", ShmModeName(shm), ")");
  }
  return absl::StrCat("v2 (KServe ModelInfer, model ", kV2AttentionModel, ", shm ", V2ShmName(shm),
                      ")");
}

absl::StatusOr<AttentionInputs> RandomInputsFromFlags(DType dtype, uint64_t seed) {
  AttentionShape s;
  s.dtype = dtype;
  s.batch = absl::GetFlag(FLAGS_batch);
  s.seqlen_q = absl::GetFlag(FLAGS_seqlen_q);
  s.seqlen_k = absl::GetFlag(FLAGS_seqlen_k).value_or(s.seqlen_q);
  s.heads_q = absl::GetFlag(FLAGS_heads_q);
  s.heads_kv = absl::GetFlag(FLAGS_heads_kv).value_or(s.heads_q);
  s.head_dim = absl::GetFlag(FLAGS_head_dim);
  s.head_dim_v = absl::GetFlag(FLAGS_head_dim_v);
  const struct {
    const char* flag;
    int value;
    int min;
  } checks[] = {{"batch", s.batch, 0},          {"seqlen_q", s.seqlen_q, 0},
                {"seqlen_k", s.seqlen_k, 0},    {"heads_q", s.heads_q, 1},
                {"heads_kv", s.heads_kv, 1},    {"head_dim", s.head_dim, 1},
                {"head_dim_v", s.head_dim_v, 0}};
  for (const auto& c : checks) {
    if (c.value < c.min) {
      return UsageStatus(absl::StrCat("--", c.flag, " must be >= ", c.min, ", got ", c.value));
    }
  }
  if (s.heads_q % s.heads_kv != 0) {
    return UsageStatus(absl::StrCat("--heads_q (", s.heads_q,
                                    ") must be a multiple of --heads_kv (", s.heads_kv, ")"));
  }
  const std::string varlen_q = absl::GetFlag(FLAGS_varlen_q);
  const std::string varlen_k = absl::GetFlag(FLAGS_varlen_k);
  if (!varlen_k.empty() && varlen_q.empty()) {
    return UsageStatus("--varlen_k needs --varlen_q (the query lengths)");
  }
  if (!varlen_q.empty()) {
    for (const char* flag : {"batch", "seqlen_q", "seqlen_k"}) {
      if (FlagWasSet(flag)) {
        return UsageStatus(absl::StrCat("--", flag,
                                        " cannot be combined with --varlen_q (varlen inputs take "
                                        "one length per sequence from --varlen_q/--varlen_k)"));
      }
    }
    absl::StatusOr<std::optional<VarlenLengths>> lengths = VarlenLengthsFromFlags();
    if (!lengths.ok()) return lengths.status();
    s.seqlens_q = (*lengths)->q;
    s.seqlens_k = (*lengths)->k;
  }
  return MakeRandomInputs(s, seed);
}

absl::StatusOr<std::optional<VarlenLengths>> VarlenLengthsFromFlags() {
  const std::string varlen_q = absl::GetFlag(FLAGS_varlen_q);
  const std::string varlen_k = absl::GetFlag(FLAGS_varlen_k);
  if (!varlen_k.empty() && varlen_q.empty()) {
    return UsageStatus("--varlen_k needs --varlen_q (the query lengths)");
  }
  if (varlen_q.empty()) return std::optional<VarlenLengths>();
  absl::StatusOr<std::vector<int>> lq = ParseLengthList("varlen_q", varlen_q);
  if (!lq.ok()) return lq.status();
  absl::StatusOr<std::vector<int>> lk =
      ParseLengthList("varlen_k", varlen_k.empty() ? varlen_q : varlen_k);
  if (!lk.ok()) return lk.status();
  if (lq->size() != lk->size()) {
    return UsageStatus(absl::StrCat("--varlen_k lists ", lk->size(),
                                    " sequences but --varlen_q lists ", lq->size()));
  }
  return std::optional<VarlenLengths>(VarlenLengths{*std::move(lq), *std::move(lk)});
}

absl::Status OptionsFromFlags(ForwardOptions* o) {
  o->causal = absl::GetFlag(FLAGS_causal);
  o->window_left = absl::GetFlag(FLAGS_window_left);
  o->window_right = absl::GetFlag(FLAGS_window_right);
  for (const auto& [flag, w] :
       {std::pair{"window_left", o->window_left}, std::pair{"window_right", o->window_right}}) {
    if (w && *w < 0) {
      return UsageStatus(absl::StrCat("--", flag,
                                      " must be >= 0 (leave it unset for an "
                                      "unlimited window), got ",
                                      *w));
    }
  }
  o->softcap = absl::GetFlag(FLAGS_softcap);
  if (!(o->softcap >= 0.0f) || !std::isfinite(o->softcap)) {
    return UsageStatus(
        absl::StrCat("--softcap must be a finite value >= 0 (0 = off), got ", o->softcap));
  }
  o->softmax_scale = absl::GetFlag(FLAGS_softmax_scale);
  if (o->softmax_scale && !(std::isfinite(*o->softmax_scale) && *o->softmax_scale > 0.0f)) {
    return UsageStatus(
        absl::StrCat("--softmax_scale must be finite and > 0, got ", *o->softmax_scale));
  }
  o->return_lse = absl::GetFlag(FLAGS_return_lse);
  // Range and dtype are the server's to check (INVALID_ARGUMENT naming
  // options.q_descale etc.): the same rule for every client.
  o->q_descale = absl::GetFlag(FLAGS_q_descale);
  o->k_descale = absl::GetFlag(FLAGS_k_descale);
  o->v_descale = absl::GetFlag(FLAGS_v_descale);
  return absl::OkStatus();
}

std::string OptionsString(const ForwardOptions& o) {
  std::vector<std::string> parts;
  if (o.causal) parts.push_back("causal");
  if (o.window_left) parts.push_back(absl::StrCat("window_left=", *o.window_left));
  if (o.window_right) parts.push_back(absl::StrCat("window_right=", *o.window_right));
  if (o.softcap != 0.0f) parts.push_back(absl::StrCat("softcap=", o.softcap));
  if (o.softmax_scale) parts.push_back(absl::StrCat("softmax_scale=", *o.softmax_scale));
  if (o.return_lse) parts.push_back("return_lse");
  if (o.q_descale) parts.push_back(absl::StrCat("q_descale=", *o.q_descale));
  if (o.k_descale) parts.push_back(absl::StrCat("k_descale=", *o.k_descale));
  if (o.v_descale) parts.push_back(absl::StrCat("v_descale=", *o.v_descale));
  return parts.empty() ? "no mask" : absl::StrJoin(parts, " ");
}

}  // namespace cli
}  // namespace attnserve
