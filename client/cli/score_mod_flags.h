// `attnctl forward`'s score-modifier and mask flags (--alibi, --sinks, --bias,
// --mask, --block_density, --block_size, --block_pattern; defined in
// forward.cc) turned into the call's ScoreMods, each bad value an error that
// names its flag.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "client/attention_client.h"
#include "client/inputs.h"

namespace attnserve {
namespace cli {

struct ScoreModFlags {
  bool alibi = false;
  std::string sinks;  // "" | a value | Hq comma-separated values | an FP32 .npy [Hq]
  std::string bias;   // .npy path
  std::string mask;   // .npy path
  std::optional<double> block_density;
  std::string block_size = "128";  // "Q" or "Q,K"
  std::string block_pattern = "random";
  bool block_size_set = false;
  bool block_pattern_set = false;
};

// The mods for `inputs` (summarised as `s`): the random block mask is drawn
// from `seed`. INVALID_ARGUMENT naming the flag for a bad value, an unreadable
// file or a shape that does not fit the call.
absl::StatusOr<ScoreMods> ScoreModsFromFlags(const ScoreModFlags& flags,
                                             const AttentionInputs& inputs, const InputsSummary& s,
                                             uint64_t seed);

}  // namespace cli
}  // namespace attnserve
