// `attnctl kv <op>`: the K/V cache service from a shell. Create, inspect and
// drop a cache, and the sequence operations a person or a script needs
// (create, fork, truncate, free). Appending and attending is what programs
// and `attnctl load-kv` do; it has no subcommand here.
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cli/attention_flags.h"
#include "client/cli/command.h"
#include "client/cli/common.h"
#include "client/cli/kv_flags.h"
#include "client/kv_client.h"
#include "common/dtype.h"

ABSL_DECLARE_FLAG(std::optional<int>, heads_kv);
ABSL_DECLARE_FLAG(int, head_dim);
ABSL_DECLARE_FLAG(int, head_dim_v);
ABSL_DECLARE_FLAG(bool, json);

ABSL_FLAG(int, layers, 1,
          "kv create: the cache's layers L (each sequence has one K/V history per layer). "
          "load-kv: layers per generated token.");
ABSL_FLAG(int, page_size, 0,
          "Tokens per page of a new cache: a power of two in [16, 256]; 0 = the server's default "
          "(attnctl info shows it).");
ABSL_FLAG(bool, v_in_k, false,
          "kv create, load-kv: an MLA cache in the absorbed form: one K row per token and KV "
          "head whose first --head_dim_v elements (all of it when 0) are V; no V pages, and the "
          "steps send no v (e.g. --heads_kv=1 --head_dim=576 --head_dim_v=512 --v_in_k).");
ABSL_FLAG(std::optional<int>, device, std::nullopt,
          "Device index of a new cache (default: the server picks the device with the most free "
          "K/V budget).");
ABSL_FLAG(std::string, cache, "",
          "kv: the cache id. kv create: the id to create (empty: a random one, c-<16 hex digits>, "
          "printed); every other kv operation, move-kv, export-kv and import-kv: the cache to act "
          "on.");
ABSL_FLAG(int64_t, capacity_tokens, 0,
          "kv create: the cache's maximum size in tokens over all sequences and layers (rounded "
          "up to whole pages). Exactly one of --capacity_tokens and --capacity_bytes. move-kv, "
          "import-kv: the receiver creates the cache with it when it has none of that id.");
ABSL_FLAG(int64_t, capacity_bytes, 0, "kv create: the cache's maximum size in K and V bytes.");
ABSL_FLAG(bool, reserve, false,
          "kv create: take the whole capacity from the device's K/V budget now, so appends never "
          "fail for lack of pool memory.");
ABSL_FLAG(std::string, seq, "",
          "kv create-seq, free-seq, truncate, info: comma-separated sequence ids (e.g. 1,2,3; "
          "truncate takes one). move-kv, export-kv: the sequences to export (default: all).");
ABSL_FLAG(std::optional<uint64_t>, fork_from, std::nullopt,
          "kv create-seq: start the new sequences as a prefix of this sequence (shared pages).");
ABSL_FLAG(std::optional<int>, fork_length, std::nullopt,
          "kv create-seq with --fork_from: tokens of the prefix (default: the source's whole "
          "length).");
ABSL_FLAG(std::optional<int>, length, std::nullopt,
          "kv truncate: the new length (<= the current one).");
ABSL_FLAG(std::optional<int>, layer, std::nullopt,
          "kv truncate: only this layer (default: every layer).");

namespace attnserve {
namespace cli {
namespace {

constexpr char kCmd[] = "kv";

// One kv operation: its name and the kv.cc/borrowed flags it reads, so a
// flag given to an operation that ignores it is a usage error, not a no-op.
struct Op {
  const char* name;
  std::vector<const char*> flags;
  int (*run)(KvClient& kv);
};

absl::StatusOr<std::vector<uint64_t>> ParseIds(const std::string& text) {
  if (text.empty()) return absl::InvalidArgumentError("--seq is required (e.g. --seq=1,2)");
  return ParseSequenceIds(text);
}

std::string Cache() { return absl::GetFlag(FLAGS_cache); }

void PrintStats(const v1::CacheStats& s) {
  const v1::KvGeometry& g = s.geometry();
  std::cout << "cache:      " << s.cache_id() << " (device " << s.device() << ")\n"
            << "geometry:   " << g.num_layers() << " layers, Hkv " << g.num_heads_kv() << ", D "
            << g.head_dim()
            << (g.head_dim_v() > 0 ? absl::StrCat(", Dv ", g.head_dim_v()) : std::string())
            << (g.v_in_k() ? " (V in K)" : "") << ", " << v1::DType_Name(g.dtype()) << "; pages of "
            << s.page_size() << " tokens, " << s.page_bytes() << " bytes each\n"
            << "pages:      " << s.pages_used() << " used, " << s.pages_free() << " free of "
            << s.capacity_pages() << "\n"
            << "sequences:  " << s.sequences() << " live, " << s.expired_sequences() << " expired; "
            << s.tokens() << " tokens over sequences and layers\n";
}

int PrintStatsOrJson(const v1::CacheStats& stats) {
  if (absl::GetFlag(FLAGS_json)) return PrintJson(stats);
  PrintStats(stats);
  return kExitOk;
}

int RunCreate(KvClient& kv) {
  CacheSpec spec;
  const std::optional<int> heads_kv = absl::GetFlag(FLAGS_heads_kv);
  if (!heads_kv) return UsageError(kCmd, "kv create needs --heads_kv (the cache's KV heads)");
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return UsageError(kCmd, absl::StrCat("--dtype: ", dtype.status().message()));
  spec.geometry = {absl::GetFlag(FLAGS_layers), *heads_kv, absl::GetFlag(FLAGS_head_dim), *dtype};
  spec.geometry.head_dim_v = absl::GetFlag(FLAGS_head_dim_v);
  spec.geometry.v_in_k = absl::GetFlag(FLAGS_v_in_k);
  spec.page_size = absl::GetFlag(FLAGS_page_size);
  spec.capacity_tokens = absl::GetFlag(FLAGS_capacity_tokens);
  spec.capacity_bytes = absl::GetFlag(FLAGS_capacity_bytes);
  if ((spec.capacity_tokens > 0) == (spec.capacity_bytes > 0)) {
    return UsageError(kCmd, absl::StrCat("kv create needs exactly one of --capacity_tokens and "
                                         "--capacity_bytes > 0, got ",
                                         spec.capacity_tokens, " and ", spec.capacity_bytes));
  }
  spec.cache_id = Cache();
  spec.device = absl::GetFlag(FLAGS_device);
  spec.reserve = absl::GetFlag(FLAGS_reserve);
  // The server checks geometry and page size (and names the field); the
  // client does not repeat its limits.
  absl::StatusOr<v1::CacheStats> stats = kv.CreateCache(spec);
  if (!stats.ok()) return PrintError("CreateCache failed", stats.status());
  return PrintStatsOrJson(*stats);
}

int RunInfo(KvClient& kv) {
  std::vector<uint64_t> ids;
  if (!absl::GetFlag(FLAGS_seq).empty()) {
    absl::StatusOr<std::vector<uint64_t>> parsed = ParseIds(absl::GetFlag(FLAGS_seq));
    if (!parsed.ok()) return UsageError(kCmd, parsed.status().message());
    ids = *parsed;
  }
  absl::StatusOr<v1::GetCacheStatsResponse> r = kv.GetCacheStats(Cache(), ids);
  if (!r.ok()) return PrintError("GetCacheStats failed", r.status());
  if (absl::GetFlag(FLAGS_json)) return PrintJson(*r);
  PrintStats(r->stats());
  for (const v1::SequenceLengths& s : r->sequences()) {
    std::cout << "sequence " << s.sequence_id() << ": lengths per layer "
              << absl::StrJoin(s.lengths(), ",") << "\n";
  }
  return kExitOk;
}

int RunDrop(KvClient& kv) {
  const absl::Status st = kv.DropCache(Cache());
  if (!st.ok()) return PrintError("DropCache failed", st);
  std::cout << "dropped cache " << Cache() << "\n";
  return kExitOk;
}

int RunCreateSeq(KvClient& kv) {
  absl::StatusOr<std::vector<uint64_t>> ids = ParseIds(absl::GetFlag(FLAGS_seq));
  if (!ids.ok()) return UsageError(kCmd, ids.status().message());
  const std::optional<uint64_t> fork_from = absl::GetFlag(FLAGS_fork_from);
  const std::optional<int> fork_length = absl::GetFlag(FLAGS_fork_length);
  if (fork_length && !fork_from) {
    return UsageError(kCmd, "--fork_length needs --fork_from (the sequence to fork)");
  }
  std::vector<SequenceSpec> specs;
  for (uint64_t id : *ids) specs.push_back({id, fork_from, fork_length});
  absl::StatusOr<v1::CacheStats> stats = kv.CreateSequences(Cache(), specs);
  if (!stats.ok()) return PrintError("CreateSequences failed", stats.status());
  return PrintStatsOrJson(*stats);
}

int RunFreeSeq(KvClient& kv) {
  absl::StatusOr<std::vector<uint64_t>> ids = ParseIds(absl::GetFlag(FLAGS_seq));
  if (!ids.ok()) return UsageError(kCmd, ids.status().message());
  absl::StatusOr<v1::CacheStats> stats = kv.FreeSequences(Cache(), *ids);
  if (!stats.ok()) return PrintError("FreeSequences failed", stats.status());
  return PrintStatsOrJson(*stats);
}

int RunTruncate(KvClient& kv) {
  absl::StatusOr<std::vector<uint64_t>> ids = ParseIds(absl::GetFlag(FLAGS_seq));
  if (!ids.ok()) return UsageError(kCmd, ids.status().message());
  if (ids->size() != 1) {
    return UsageError(kCmd, absl::StrCat("kv truncate takes one --seq, got ", ids->size()));
  }
  const std::optional<int> length = absl::GetFlag(FLAGS_length);
  if (!length) return UsageError(kCmd, "kv truncate needs --length (the new length)");
  absl::StatusOr<v1::CacheStats> stats =
      kv.Truncate(Cache(), ids->front(), *length, absl::GetFlag(FLAGS_layer));
  if (!stats.ok()) return PrintError("Truncate failed", stats.status());
  return PrintStatsOrJson(*stats);
}

const Op kOps[] = {
    {"create",
     {"cache", "layers", "heads_kv", "head_dim", "head_dim_v", "v_in_k", "dtype", "page_size",
      "capacity_tokens", "capacity_bytes", "device", "reserve", "json"},
     RunCreate},
    {"info", {"cache", "seq", "json"}, RunInfo},
    {"drop", {"cache"}, RunDrop},
    {"create-seq", {"cache", "seq", "fork_from", "fork_length", "json"}, RunCreateSeq},
    {"free-seq", {"cache", "seq", "json"}, RunFreeSeq},
    {"truncate", {"cache", "seq", "length", "layer", "json"}, RunTruncate},
};

}  // namespace

int RunKv(const std::vector<std::string>& args) {
  std::vector<std::string> names;
  for (const Op& op : kOps) names.push_back(op.name);
  if (args.empty()) {
    return UsageError(kCmd, absl::StrCat("kv needs an operation: ", absl::StrJoin(names, ", ")));
  }
  // "stats" reads as naturally as "info" for a cache.
  const std::string name = args[0] == "stats" ? "info" : args[0];
  const Op* op = nullptr;
  for (const Op& o : kOps) {
    if (name == o.name) op = &o;
  }
  if (op == nullptr) {
    return UsageError(kCmd, absl::StrCat("unknown kv operation '", args[0],
                                         "' (operations: ", absl::StrJoin(names, ", "), ")"));
  }
  if (args.size() > 1) {
    return UsageError(kCmd,
                      absl::StrCat("kv ", name, " takes no more arguments, got '", args[1], "'"));
  }
  for (const std::string& set : FlagsSet()) {
    if (IsGlobalFlag(set)) continue;
    bool applies = false;
    for (const char* f : op->flags) applies |= set == f;
    if (!applies) {
      return UsageError(kCmd, absl::StrCat("flag --", set, " does not apply to 'kv ", name, "'"));
    }
  }
  if (name != "create" && Cache().empty()) {
    return UsageError(kCmd, absl::StrCat("kv ", name, " needs --cache (the cache id)"));
  }
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = MakeClientFromFlags();
  if (!client.ok()) return UsageError(kCmd, client.status().message());
  KvClient kv(**client);
  return op->run(kv);
}

}  // namespace cli
}  // namespace attnserve
