// Where the flags of move-kv, export-kv and import-kv live (attnctl's
// command table lists them under each command's help).
#pragma once

namespace attnserve {
namespace cli {

inline constexpr char kKvTransferFlagsFile[] = "client/cli/kv_transfer_cmd.cc";

}  // namespace cli
}  // namespace attnserve
