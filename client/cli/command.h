// The subcommands of attnctl. Each lives in its own file under client/cli/ with
// its own flags; attnctl.cc lists them in one table, so a new command (such as
// `load`) is a new file plus one table entry.
#pragma once

#include <string>
#include <vector>

namespace attnserve {
namespace cli {

// Exit codes shared by every command.
constexpr int kExitOk = 0;
// The command ran and the answer is "no": NOT_SERVING, --verify FAIL, or an
// error status from the server or the transport.
constexpr int kExitFailure = 1;
// The command line or an input file is wrong; nothing was sent.
constexpr int kExitUsage = 2;

struct Command {
  const char* name;
  const char* summary;  // one line for the command list
  const char* usage;    // synopsis and description for `attnctl help <name>`
  // Flags defined in a source file whose path ends with this belong to the
  // command: `help` lists them, and other commands reject them.
  const char* flags_file;
  // A second file whose flags also belong to it (shared with other commands,
  // such as the attention-call flags of forward and load), or nullptr.
  const char* shared_flags_file;
  // Runs with the flags already parsed; `args` are the positional arguments
  // after the command name.
  int (*run)(const std::vector<std::string>& args);
  // Single flags of other files that this command also takes (e.g. kv takes
  // --heads_kv, --head_dim and --dtype of the attention flags, load-kv
  // load's --concurrency and --check), so one name keeps one meaning across
  // commands without the command taking every flag of that file.
  std::vector<const char*> borrowed_flags;
};

int RunHealth(const std::vector<std::string>& args);
int RunInfo(const std::vector<std::string>& args);
int RunForward(const std::vector<std::string>& args);
int RunLoad(const std::vector<std::string>& args);
int RunKv(const std::vector<std::string>& args);
int RunLoadKv(const std::vector<std::string>& args);
int RunMoveKv(const std::vector<std::string>& args);
int RunExportKv(const std::vector<std::string>& args);
int RunImportKv(const std::vector<std::string>& args);

}  // namespace cli
}  // namespace attnserve
