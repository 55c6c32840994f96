// The flags that describe one attention call, shared by `attnctl forward` and
// `attnctl load` so both read shapes, dtypes and options the same way: the
// random-input shape (--batch, --seqlen_q, ..., --varlen_q, --seed), --dtype
// and the AttentionOptions flags (--causal, --window_left, ...).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/attention_client.h"
#include "client/shm_arena.h"
#include "client/v2_client.h"

ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::optional<uint64_t>, seed);
ABSL_DECLARE_FLAG(std::string, varlen_q);
ABSL_DECLARE_FLAG(std::string, varlen_k);

namespace attnserve {
namespace cli {

// Where these flags are defined: commands list this file as their shared
// flags file (command.h), so help shows them and other commands reject them.
inline constexpr char kAttentionFlagsFile[] = "client/cli/attention_flags.cc";

// The flags that only make sense for random inputs.
inline constexpr const char* kShapeFlags[] = {"batch",    "seqlen_q", "seqlen_k",   "heads_q",
                                              "heads_kv", "head_dim", "head_dim_v", "seed"};

// Random inputs of the shape the flags give, with `seed`. INVALID_ARGUMENT
// naming the flag for a bad size or list (a usage error for the caller).
absl::StatusOr<AttentionInputs> RandomInputsFromFlags(DType dtype, uint64_t seed);

// Per-sequence lengths of varlen inputs: --varlen_q, and --varlen_k (the same
// as --varlen_q when unset).
struct VarlenLengths {
  std::vector<int> q;
  std::vector<int> k;
};

// The lengths --varlen_q/--varlen_k give; nullopt when --varlen_q is unset.
// A usage error for --varlen_k without --varlen_q, a bad list, or lists of
// different lengths.
absl::StatusOr<std::optional<VarlenLengths>> VarlenLengthsFromFlags();

// The option flags into `o` (return_lse from --return_lse only).
// INVALID_ARGUMENT naming the flag for a bad value.
absl::Status OptionsFromFlags(ForwardOptions* o);

// --protocol, --shm and --shm_prefix: which protocol carries the attention
// calls, and whether their tensors go through shared memory.
struct ProtocolChoice {
  bool v2 = false;  // KServe v2 ModelInfer instead of Forward
  ShmMode shm = ShmMode::kNone;
  std::string shm_prefix;  // native system arenas' key prefix
  // "native (attnserve.v1.Attention)", "native (attnserve.v1.Attention, shm
  // system)" or "v2 (KServe ModelInfer, model attention, shm system)".
  std::string ToString() const;
};
// INVALID_ARGUMENT naming the flag for a bad value, or --shm_prefix where it
// does not apply.
absl::StatusOr<ProtocolChoice> ProtocolFromFlags();

// How a native call's tensors travel, as load reports name it: "grpc",
// "shm-system" or "shm-cuda".
std::string ShmTransportName(ShmMode shm);

// A registered arena of `byte_size` bytes for the native calls of
// `protocol` (its shm must not be none), named attnctl-<pid>-<n>.
absl::StatusOr<std::unique_ptr<ShmArena>> MakeArena(AttentionClient& client,
                                                    const ProtocolChoice& protocol,
                                                    uint64_t byte_size);

// "causal window_left=4 return_lse", or "no mask".
std::string OptionsString(const ForwardOptions& o);

}  // namespace cli
}  // namespace attnserve
