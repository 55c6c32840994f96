// Global attnctl flags and the helpers every command uses (see common.h).
#include "client/cli/common.h"

#include <google/protobuf/util/json_util.h>

#include <cstdlib>
#include <iostream>
#include <set>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "client/cli/command.h"

namespace {

// Containers and scripts set the target once in the environment.
std::string DefaultTarget() {
  const char* env = std::getenv("ATTNCTL_TARGET");
  return env != nullptr && *env != '\0' ? env : "localhost:50051";
}

}  // namespace

ABSL_FLAG(std::string, target, DefaultTarget(),
          "Server address: host:port, dns:///host:port (every address the name resolves to, "
          "with --lb_policy=round_robin), ipv4:a:port,b:port or unix:///path. Default: "
          "$ATTNCTL_TARGET, else localhost:50051.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(120),
          "Deadline of each RPC, e.g. 500ms, 30s, 2m; 'inf' for none.");
ABSL_FLAG(std::string, lb_policy, "",
          "gRPC load-balancing policy: pick_first (gRPC's default) or round_robin (spread calls "
          "over every resolved address).");
ABSL_FLAG(bool, tls, false,
          "Connect with TLS, verifying the server against the system's roots (or --tls_ca).");
ABSL_FLAG(std::string, tls_ca, "",
          "Connect with TLS, verifying the server's certificate against this PEM CA file.");
ABSL_FLAG(std::string, tls_cert, "",
          "Mutual TLS: this client's PEM certificate chain (with --tls_key).");
ABSL_FLAG(std::string, tls_key, "", "Mutual TLS: the PEM private key of --tls_cert.");
ABSL_FLAG(std::string, token, "",
          "Bearer token sent as 'authorization: Bearer <token>' on every call. Default: "
          "$ATTNSERVE_TOKEN (preferred: a flag shows in the process list).");
ABSL_FLAG(bool, wait_for_ready, false,
          "Wait (up to --timeout) for the server to come up instead of failing at once with "
          "UNAVAILABLE.");

namespace attnserve {
namespace cli {
namespace {

std::set<std::string>& SetFlags() {
  static auto* flags = new std::set<std::string>;
  return *flags;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionClient>> MakeClientFromFlags(int num_channels) {
  return MakeClientForTarget(absl::GetFlag(FLAGS_target), num_channels);
}

absl::StatusOr<std::unique_ptr<AttentionClient>> MakeClientForTarget(const std::string& target,
                                                                     int num_channels) {
  ClientOptions options;
  options.num_channels = num_channels;
  options.default_timeout = absl::GetFlag(FLAGS_timeout);
  options.load_balancing_policy = absl::GetFlag(FLAGS_lb_policy);
  options.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  options.security.tls = absl::GetFlag(FLAGS_tls);
  options.security.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.security.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.security.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.security.token = absl::GetFlag(FLAGS_token);
  if (options.security.token.empty()) {
    const char* env = std::getenv("ATTNSERVE_TOKEN");
    if (env != nullptr) options.security.token = env;
  }
  absl::StatusOr<std::unique_ptr<AttentionClient>> client =
      AttentionClient::Create(target, options);
  if (!client.ok() && client.status().code() == absl::StatusCode::kInvalidArgument) {
    // The possible causes are flags; say which.
    return absl::InvalidArgumentError(
        absl::StrCat("--target/--lb_policy/--tls_*: ", client.status().message()));
  }
  return client;
}

int PrintError(absl::string_view what, const absl::Status& status) {
  std::cerr << "attnctl: " << what << ": " << absl::StatusCodeToString(status.code()) << ": "
            << status.message() << "\n";
  return kExitFailure;
}

int PrintJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    return PrintError("encoding JSON", absl::InternalError(std::string(status.message())));
  }
  std::cout << json;
  return kExitOk;
}

int UsageError(absl::string_view command, absl::string_view message) {
  std::cerr << "attnctl: " << message << "\n"
            << "Run 'attnctl help" << (command.empty() ? "" : " ") << command << "' for usage.\n";
  return kExitUsage;
}

void MarkFlagSet(absl::string_view name) { SetFlags().insert(std::string(name)); }
bool FlagWasSet(absl::string_view name) { return SetFlags().count(std::string(name)) > 0; }
std::vector<std::string> FlagsSet() { return {SetFlags().begin(), SetFlags().end()}; }

bool IsGlobalFlag(absl::string_view name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr && absl::EndsWith(flag->Filename(), kGlobalFlagsFile);
}

absl::StatusOr<std::vector<int>> ParseLengthList(absl::string_view flag, absl::string_view text) {
  std::vector<int> out;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    int v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", item,
                       "' is not a non-negative integer (expected a comma-separated "
                       "list of sequence lengths such as 3,0,17)"));
    }
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<std::vector<uint64_t>> ParseSequenceIds(absl::string_view text) {
  std::vector<uint64_t> ids;
  if (text.empty()) return ids;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    uint64_t id = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(item), &id)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--seq: '", item, "' is not a sequence id (a non-negative integer, e.g. --seq=1,2)"));
    }
    ids.push_back(id);
  }
  return ids;
}

}  // namespace cli
}  // namespace attnserve
