// The flags of `attnctl load` and the one LoadConfig they are checked into,
// so the workload, the loops and the report read settled values instead of
// flags (and a new mode adds its flags here without touching the others).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/cli/attention_flags.h"
#include "common/dtype.h"

namespace attnserve {
namespace cli {

// Where the load flags are defined (command.h's flags_file).
inline constexpr char kLoadFlagsFile[] = "client/cli/load_flags.cc";

// Everything a load run needs from the command line, validated.
struct LoadConfig {
  // Exactly one of the two is non-empty: closed-loop caller counts or
  // open-loop rates in req/s, one step each.
  std::vector<int> concurrency;
  std::vector<double> rates;
  absl::Duration warmup;
  absl::Duration duration;
  int channels = 1;
  int inputs = 4;
  int max_outstanding = 1024;
  DType dtype = DType::kFP16;
  uint64_t seed = 0;
  bool check = false;
  bool stream = false;
  bool echo = false;  // --rpc=echo
  // --protocol and --shm (shared with forward): v2 sends ModelInfer of the
  // model `attention` instead of Forward.
  ProtocolChoice protocol;
  std::string csv;
  std::string jsonl;
  std::string label;
  // The global call flags the loops need (--timeout, --wait_for_ready).
  absl::Duration timeout;
  bool wait_for_ready = false;
};

// The flags as a LoadConfig; INVALID_ARGUMENT naming the flag (a usage error)
// for a bad value or a combination that excludes itself.
absl::StatusOr<LoadConfig> LoadConfigFromFlags();

}  // namespace cli
}  // namespace attnserve
