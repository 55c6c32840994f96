// `attnctl forward`: one Forward call with random inputs of a given shape (or
// Q/K/V from .npy files), printing client latency, the server's timing
// breakdown and backend, optionally writing O/LSE to .npy and checking the
// result against the float64 reference (--verify).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/cli/attention_flags.h"
#include "client/cli/command.h"
#include "client/cli/common.h"
#include "client/cli/score_mod_flags.h"
#include "client/inputs.h"
#include "client/npy.h"
#include "client/verify.h"

// Inputs and outputs as files.
ABSL_FLAG(std::string, q, "",
          "Read Q from this .npy file ([B,Sq,Hq,D], or [Tq,Hq,D] with --varlen_q).");
ABSL_FLAG(std::string, k, "", "Read K from this .npy file ([B,Sk,Hkv,D] or [Tk,Hkv,D]).");
ABSL_FLAG(std::string, v, "", "Read V from this .npy file (shape of K).");
ABSL_FLAG(std::string, out, "",
          "Write O to this .npy file ('<f2' for FP16, '<f4' for FP32 and BF16). export-kv: the "
          "chunk file to write.");
ABSL_FLAG(std::string, out_lse, "", "Write LSE (FP32) to this .npy file; implies --return_lse.");

ABSL_FLAG(
    bool, verify, false,
    "Compute the float64 reference locally and check O (and LSE) with docs/design.md's tolerance; "
    "exit 1 on FAIL.");
ABSL_FLAG(std::string, request_id, "", "request_id to send (echoed by the server and in its log).");

// Score modifiers and masks (docs/masks.md); --verify applies them to the reference too.
ABSL_FLAG(bool, alibi, false,
          "ALiBi with the paper's slopes for Hq heads (2^(-8i/Hq); the paper's interleaving for "
          "Hq not a power of two): score -= slope[h] * |i + Sk - Sq - j|.");
ABSL_FLAG(std::string, sinks, "",
          "Attention sinks: one logit per query head joining the softmax denominator: a value "
          "for every head (e.g. 0.5), Hq comma-separated values, or an FP32 .npy file of [Hq].");
ABSL_FLAG(std::string, bias, "",
          "Additive bias from this .npy file ('<f4', '<f2', '<f8' narrowed to FP32, '<u2' BF16 "
          "bits): dense [B or 1, Hq or 1, Sq, Sk], varlen [Hq or 1, sum of sq_b*sk_b].");
ABSL_FLAG(std::string, mask, "",
          "Boolean mask from this .npy file ('|b1' or '|u1'; nonzero = attend), the shapes of "
          "--bias.");
ABSL_FLAG(std::optional<double>, block_density, std::nullopt,
          "Block-sparse mask: keep this fraction S in [0, 1] of the key blocks of every query "
          "block, per sequence and head, drawn from --seed (0 masks every key; 1 keeps all).");
ABSL_FLAG(std::string, block_size, "128",
          "With --block_density: Q or Q,K, the query and key block sizes (multiples of 128).");
ABSL_FLAG(std::string, block_pattern, "random",
          "With --block_density: random (round(S*n) of a row's n key blocks, uniformly) or "
          "stripes (local + global: the first quarter of them as global columns, the rest a band "
          "ending at the row's diagonal block).");

namespace attnserve {
namespace cli {
namespace {

constexpr char kCmd[] = "forward";

absl::Status UsageStatus(std::string message) { return absl::InvalidArgumentError(message); }

absl::StatusOr<AttentionInputs> FileInputsFromFlags(std::optional<DType> dtype) {
  for (const char* flag : kShapeFlags) {
    if (FlagWasSet(flag)) {
      return UsageStatus(absl::StrCat("--", flag,
                                      " applies to random inputs; with --q/--k/--v the shapes "
                                      "come from the files"));
    }
  }
  AttentionInputs in;
  const struct {
    const char* flag;
    std::string path;
    HostTensor* into;
  } files[] = {{"q", absl::GetFlag(FLAGS_q), &in.q},
               {"k", absl::GetFlag(FLAGS_k), &in.k},
               {"v", absl::GetFlag(FLAGS_v), &in.v}};
  for (const auto& f : files) {
    if (f.path.empty()) return UsageStatus("--q, --k and --v must be given together");
  }
  for (const auto& f : files) {
    absl::StatusOr<HostTensor> t = ReadNpy(f.path);
    if (!t.ok()) {
      return absl::Status(t.status().code(),
                          absl::StrCat("--", f.flag, ": ", t.status().message()));
    }
    *f.into = *std::move(t);
  }
  // Without --dtype the files decide; K and V follow Q.
  const DType want = dtype.value_or(in.q.dtype());
  in.q = in.q.ConvertTo(want);
  in.k = in.k.ConvertTo(want);
  in.v = in.v.ConvertTo(want);

  absl::StatusOr<std::optional<VarlenLengths>> lengths = VarlenLengthsFromFlags();
  if (!lengths.ok()) return lengths.status();
  if (!lengths->has_value()) {
    if (in.q.rank() == 3) {
      return UsageStatus(absl::StrCat("--q ", absl::GetFlag(FLAGS_q), " is ", in.q.DebugString(),
                                      ": packed [T, H, D] inputs need --varlen_q (and --varlen_k) "
                                      "with the sequence lengths"));
    }
    return in;
  }
  in.cu_seqlens_q = CuSeqlensFromLengths((*lengths)->q);
  in.cu_seqlens_k = CuSeqlensFromLengths((*lengths)->k);
  if (in.q.rank() != 3 || in.k.rank() != 3) {
    return UsageStatus(absl::StrCat("--varlen_q needs packed [T, H, D] files, got q ",
                                    in.q.DebugString(), " and k ", in.k.DebugString()));
  }
  if (in.cu_seqlens_q.back() != in.q.dim(0)) {
    return UsageStatus(absl::StrCat("--varlen_q lengths sum to ", in.cu_seqlens_q.back(),
                                    " but --q has ", in.q.dim(0), " rows"));
  }
  if (in.cu_seqlens_k.back() != in.k.dim(0)) {
    return UsageStatus(absl::StrCat("--varlen_k lengths sum to ", in.cu_seqlens_k.back(),
                                    " but --k has ", in.k.dim(0), " rows"));
  }
  return in;
}

ScoreModFlags ModFlags() {
  ScoreModFlags f;
  f.alibi = absl::GetFlag(FLAGS_alibi);
  f.sinks = absl::GetFlag(FLAGS_sinks);
  f.bias = absl::GetFlag(FLAGS_bias);
  f.mask = absl::GetFlag(FLAGS_mask);
  f.block_density = absl::GetFlag(FLAGS_block_density);
  f.block_size = absl::GetFlag(FLAGS_block_size);
  f.block_pattern = absl::GetFlag(FLAGS_block_pattern);
  f.block_size_set = FlagWasSet("block_size");
  f.block_pattern_set = FlagWasSet("block_pattern");
  return f;
}

std::string Ms(int64_t us) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(3) << us / 1000.0;
  return os.str();
}

std::string Sci(double x) {
  std::ostringstream os;
  os << std::scientific << std::setprecision(3) << x;
  return os.str();
}

}  // namespace

int RunForward(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError(kCmd, "forward takes no arguments, got '" + args[0] + "'");
  std::optional<DType> dtype;
  if (FlagWasSet("dtype") || absl::GetFlag(FLAGS_q).empty()) {
    absl::StatusOr<DType> d = ParseDType(absl::GetFlag(FLAGS_dtype));
    if (!d.ok()) return UsageError(kCmd, absl::StrCat("--dtype: ", d.status().message()));
    dtype = *d;
  }
  const bool from_files = !absl::GetFlag(FLAGS_q).empty() || !absl::GetFlag(FLAGS_k).empty() ||
                          !absl::GetFlag(FLAGS_v).empty();
  uint64_t seed = 0;
  absl::StatusOr<AttentionInputs> inputs;
  if (from_files) {
    inputs = FileInputsFromFlags(dtype);
  } else {
    seed = absl::GetFlag(FLAGS_seed).value_or(std::random_device()());
    inputs = RandomInputsFromFlags(*dtype, seed);
  }
  // Flags and input files are the user's to fix: both are usage errors.
  if (!inputs.ok()) return UsageError(kCmd, inputs.status().message());
  absl::Status st = OptionsFromFlags(&inputs->options);
  if (!st.ok()) return UsageError(kCmd, st.message());
  // --out_lse needs the LSE back.
  if (!absl::GetFlag(FLAGS_out_lse).empty()) inputs->options.return_lse = true;
  inputs->request_id = absl::GetFlag(FLAGS_request_id);
  absl::StatusOr<InputsSummary> summary = SummarizeInputs(*inputs);
  if (!summary.ok()) return UsageError(kCmd, summary.status().message());
  absl::StatusOr<ScoreMods> mods = ScoreModsFromFlags(ModFlags(), *inputs, *summary, seed);
  if (!mods.ok()) return UsageError(kCmd, mods.status().message());
  inputs->mods = *std::move(mods);

  absl::StatusOr<ProtocolChoice> protocol = ProtocolFromFlags();
  if (!protocol.ok()) return UsageError(kCmd, protocol.status().message());
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = MakeClientFromFlags();
  if (!client.ok()) return UsageError(kCmd, client.status().message());

  std::cout << "request:  " << summary->ToString() << ", " << OptionsString(inputs->options);
  if (!from_files) std::cout << ", seed " << seed;
  std::cout << "\n";
  if (!inputs->mods.empty()) std::cout << "mods:     " << ScoreModsString(inputs->mods) << "\n";
  // The v2 path sends the same native request, converted (v2_client.h).
  v1::ForwardRequest request;
  std::unique_ptr<V2Client> v2;
  if (protocol->v2) {
    std::cout << "protocol: " << protocol->ToString() << "\n";
    request = MakeForwardRequest(*inputs);
    absl::StatusOr<std::unique_ptr<V2Client>> made = V2Client::Create(
        client->get(), protocol->shm, 1, V2SlotBytes(request), protocol->shm_prefix);
    if (!made.ok()) return PrintError("--protocol=v2", made.status());
    v2 = *std::move(made);
  }
  // Native shared memory: q, k, v and O in one registered arena (shm_arena.h).
  std::unique_ptr<ShmArena> arena;
  if (!protocol->v2 && protocol->shm != ShmMode::kNone) {
    std::cout << "protocol: " << protocol->ToString() << "\n";
    request = MakeForwardRequest(*inputs);
    const uint64_t bytes =
        request.q().data().size() + request.k().data().size() + request.v().data().size() +
        ShmOBytes(request.q(), request.v().shape_size() > 0
                                   ? request.v().shape(request.v().shape_size() - 1)
                                   : 0) +
        ShmLseBytes(request.q()) + 4 * kShmAlignment;
    absl::StatusOr<std::unique_ptr<ShmArena>> made = MakeArena(**client, *protocol, bytes);
    if (!made.ok()) return PrintError("--shm", made.status());
    arena = *std::move(made);
  }

  // Client latency covers the RPC and decoding, not building the inputs or
  // opening the connection. A failed connect is left for Forward to report
  // (it may also wait, with --wait_for_ready), so errors come out one way.
  if (!absl::GetFlag(FLAGS_wait_for_ready)) {
    (*client)->Connect(std::min(absl::GetFlag(FLAGS_timeout), absl::Seconds(10))).IgnoreError();
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<ForwardResult> result;
  if (v2 != nullptr) {
    absl::StatusOr<v1::ForwardResponse> response = v2->Forward(request);
    result = response.ok() ? ForwardResultFromProto(*std::move(response)) : response.status();
  } else if (arena != nullptr) {
    result = (*client)->Forward(*inputs, *arena);
  } else {
    result = (*client)->Forward(*inputs);
  }
  const int64_t client_us = absl::ToInt64Microseconds(absl::Now() - start);
  if (!result.ok()) {
    return PrintError(v2 != nullptr ? "ModelInfer failed" : "Forward failed", result.status());
  }

  const ForwardTiming& t = result->timing;
  std::cout << "backend:  " << result->backend << "\n"
            << "latency:  client " << Ms(client_us) << " ms; server total " << Ms(t.total_us)
            << " ms (queue " << Ms(t.queue_us) << ", host_to_device " << Ms(t.host_to_device_us)
            << ", compute " << Ms(t.compute_us) << ", device_to_host " << Ms(t.device_to_host_us)
            << " ms; batch of " << t.batch_size << ")\n";

  if (const std::string path = absl::GetFlag(FLAGS_out); !path.empty()) {
    st = WriteNpy(path, result->o);
    if (!st.ok()) return PrintError("--out", st);
    std::cout << "wrote:    o " << result->o.DebugString() << " to " << path << "\n";
  }
  if (const std::string path = absl::GetFlag(FLAGS_out_lse); !path.empty()) {
    st = WriteNpy(path, *result->lse);
    if (!st.ok()) return PrintError("--out_lse", st);
    std::cout << "wrote:    lse " << result->lse->DebugString() << " to " << path << "\n";
  }

  if (!absl::GetFlag(FLAGS_verify)) return kExitOk;
  const absl::Time ref_start = absl::Now();
  absl::StatusOr<VerifyReport> report = VerifyForward(*inputs, *result);
  if (!report.ok()) return PrintError("verify", report.status());
  std::cout << "verify:   o max abs err " << Sci(report->max_abs_err) << ", max rel err "
            << Sci(report->max_rel_err) << " (of each row's max|ref|)";
  if (summary->dtype != DType::kFP32) {
    std::cout << ", tolerance " << Sci(report->tolerance) << " = " << report->tolerance_rule
              << " (max|ref_lowp - ref| " << Sci(report->lowp_err) << ")";
  } else {
    std::cout << ", tolerance " << report->tolerance_rule;
  }
  std::cout << "\n";
  if (report->lse_checked) {
    std::cout << "verify:   lse max abs err " << Sci(report->lse_max_abs_err) << ", tolerance "
              << report->lse_tolerance_rule << "\n";
  }
  std::cout << "verify:   reference took " << Ms(absl::ToInt64Microseconds(absl::Now() - ref_start))
            << " ms\n";
  if (!report->passed) {
    std::cout << "FAIL: " << report->failure << "\n";
    return kExitFailure;
  }
  std::cout << "PASS\n";
  return kExitOk;
}

}  // namespace cli
}  // namespace attnserve
