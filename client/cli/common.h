// What every attnctl command shares: the global flags (--target, --timeout,
// --lb_policy, --wait_for_ready), building a client from them, the record of
// which flags the user set, and how errors are printed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "google/protobuf/message.h"

ABSL_DECLARE_FLAG(std::string, target);
ABSL_DECLARE_FLAG(absl::Duration, timeout);
ABSL_DECLARE_FLAG(std::string, lb_policy);
ABSL_DECLARE_FLAG(bool, wait_for_ready);

namespace attnserve {
namespace cli {

// A client for --target with the channel settings of the global flags and
// `num_channels` channels.
absl::StatusOr<std::unique_ptr<AttentionClient>> MakeClientFromFlags(int num_channels = 1);
// The same for another address (move-kv's --from and --to): every global flag
// but --target applies.
absl::StatusOr<std::unique_ptr<AttentionClient>> MakeClientForTarget(const std::string& target,
                                                                     int num_channels = 1);

// Prints "attnctl: <what>: <CODE_NAME>: <message>" to stderr, keeping the
// server's message verbatim, and returns kExitFailure.
int PrintError(absl::string_view what, const absl::Status& status);
// Prints `message` as JSON (proto field names, every field, indented) to
// stdout and returns kExitOk, or prints the encoding error and returns
// kExitFailure. For --json output meant for scripts.
int PrintJson(const google::protobuf::Message& message);

// Prints "attnctl: <message>" and a pointer to the help to stderr and returns
// kExitUsage.
int UsageError(absl::string_view command, absl::string_view message);

// The command-line parser records every flag it sets, so commands can tell
// "left at the default" from "given explicitly" (for conflicts between flags).
void MarkFlagSet(absl::string_view name);
bool FlagWasSet(absl::string_view name);
std::vector<std::string> FlagsSet();
// Whether `name` is one of the global flags above (every command takes them).
bool IsGlobalFlag(absl::string_view name);
inline constexpr char kGlobalFlagsFile[] = "client/cli/common.cc";

// "3,0,17" -> {3, 0, 17}. INVALID_ARGUMENT naming `flag` for an empty item,
// a non-integer or a negative value.
absl::StatusOr<std::vector<int>> ParseLengthList(absl::string_view flag, absl::string_view text);

// --seq's comma-separated sequence ids; empty text gives no ids. An item that
// is not a non-negative integer is INVALID_ARGUMENT naming --seq.
absl::StatusOr<std::vector<uint64_t>> ParseSequenceIds(absl::string_view text);

}  // namespace cli
}  // namespace attnserve
