// attnctl: the command-line client of attnserve. This file holds the command
// table, the command-line parser and the help; each command lives in
// client/cli/<name>.cc with its own flags.
//
// The parser is ours rather than absl::ParseCommandLine so that flags may come
// before or after the command, flags of another command are rejected by name,
// every usage error exits with code 2 (absl's exits with 1, which scripts
// would read as "NOT_SERVING" or "FAIL"), and --help exits 0.
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "client/cli/attention_flags.h"
#include "client/cli/command.h"
#include "client/cli/common.h"
#include "client/cli/kv_flags.h"
#include "client/cli/kv_transfer_flags.h"
#include "client/cli/load_flags.h"
#include "common/malloc_tuning.h"

namespace attnserve {
namespace cli {
namespace {

const Command kCommands[] = {
    {"health",
     "Ask the gRPC health service whether the server is SERVING (exit 0 only then).",
     "attnctl [--target=host:port] health [--service=NAME]\n\n"
     "Prints SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN. Exit code 0 only for SERVING,\n"
     "1 otherwise (also when the server cannot be reached).",
     "client/cli/health.cc",
     nullptr,
     RunHealth,
     {}},
    {"info",
     "Print the server's version, backend, devices, dtypes, head dims, limits, features.",
     "attnctl [--target=host:port] info [--json]",
     "client/cli/info.cc",
     nullptr,
     RunInfo,
     {}},
    {"forward",
     "Run one attention call on random or .npy inputs; --verify checks it locally.",
     "attnctl [--target=host:port] forward [shape flags | --q=Q.npy --k=K.npy --v=V.npy]\n"
     "        [--dtype=fp16|bf16|fp32] [--causal] [--window_left=N] [--window_right=N]\n"
     "        [--softcap=X] [--softmax_scale=X] [--return_lse] [--out=O.npy] [--out_lse=L.npy]\n"
     "        [--verify] [--protocol=native|v2] [--shm=none|system|cuda [--shm_prefix=P]]\n"
     "        [--alibi] [--sinks=V|V,V,..|S.npy] [--bias=B.npy] [--mask=M.npy]\n"
     "        [--block_density=S [--block_size=Q[,K]] [--block_pattern=random|stripes]]\n\n"
     "Examples:\n"
     "  attnctl forward --batch=2 --seqlen_q=256 --heads_q=16 --heads_kv=4 --head_dim=128 \\\n"
     "      --dtype=bf16 --causal --verify\n"
     "  attnctl forward --varlen_q=3,0,17 --varlen_k=5,4,17 --dtype=fp16 --return_lse --verify\n"
     "  attnctl forward --q=q.npy --k=k.npy --v=v.npy --out=o.npy\n"
     "  attnctl forward --shm=system --seqlen_q=512 --verify\n"
     "  attnctl forward --protocol=v2 --shm=system --seqlen_q=512 --verify\n"
     "  attnctl forward --seqlen_q=1024 --block_density=0.25 --block_pattern=stripes --verify\n"
     "  attnctl forward --heads_q=12 --alibi --sinks=0.5 --causal --verify\n"
     "  attnctl forward --batch=2 --heads_q=8 --bias=bias.npy --mask=mask.npy --verify\n\n"
     "Score modifiers and masks (docs/masks.md): ALiBi, sinks, an additive bias and a boolean\n"
     "mask ([B or 1, Hq or 1, Sq, Sk] dense, [Hq or 1, sum sq_b*sk_b] varlen) and a random\n"
     "block-sparse mask; --verify applies the same ones to the reference.\n\n"
     "--protocol=v2 sends the same request as KServe v2 ModelInfer of the model 'attention'\n"
     "(docs/kserve.md). --shm=system passes q, k, v and O through a POSIX shared-memory region\n"
     "registered with the server (which needs --allow_client_shm) instead of the message, on\n"
     "either protocol; --shm=cuda through device memory of GPU 0 (a CUDA build of attnctl).\n"
     "The region is unregistered and removed before attnctl exits (docs/shared-memory.md).\n"
     "Prints the request, the backend, client latency and the server's timing breakdown.\n"
     "With --verify: the float64 reference is computed locally and O (and LSE) are held to\n"
     "docs/design.md's tolerance: FP16/BF16 max|o - ref| <= 2 * max|ref_lowp - ref| + floor\n"
     "(1e-3 FP16, 8e-3 BF16); FP32 |o - ref| <= 1e-5 * max|ref of its row| + 1e-6.\n"
     "Exit code 0 on success (and PASS), 1 on FAIL or a server error, 2 on bad flags or files.",
     "client/cli/forward.cc",
     kAttentionFlagsFile,
     RunForward,
     {}},
    {"load",
     "Load-test the server: closed-loop concurrency sweep or open-loop Poisson rate.",
     "attnctl [--target=host:port] load [--concurrency=1,4,16 | --rate=R[,R...]]\n"
     "        [--warmup=2s] [--duration=10s] [--channels=N] [--stream] [--inputs=4] [--check]\n"
     "        [--csv=FILE] [--jsonl=FILE] [--label=TEXT]\n"
     "        [--protocol=native|v2 [--shm=none|system|cuda]]\n"
     "        [shape, --dtype and option flags of forward]\n\n"
     "Examples:\n"
     "  attnctl load --concurrency=1,4,16 --batch=1 --seqlen_q=512 --heads_q=16 --head_dim=128 \\\n"
     "      --dtype=bf16 --duration=20s --csv=load.csv && scripts/plot-load.py load.csv\n"
     "  attnctl load --rate=50,100,200 --stream --channels=4 --check\n"
     "  attnctl load --concurrency=4 --protocol=v2 --shm=system --seqlen_q=4096 --csv=v2.csv\n\n"
     "--protocol=v2 sends unary KServe v2 ModelInfer calls of the model 'attention' instead of\n"
     "Forward (no --stream, no --rpc=echo), so the two protocols are measured by one tool;\n"
     "--shm=system gives each caller its own registered POSIX shared-memory region (closed loop\n"
     "only). The report and the CSV/JSON rows name the protocol and shm.\n"
     "Each step (one concurrency or rate) warms up, then measures. Closed loop: N callers, each\n"
     "sending its next request when the last returns. Open loop: Poisson arrivals at R req/s,\n"
     "latency counted from the scheduled arrival. Reported per step: req/s, query tokens/s,\n"
     "effective TFLOP/s (4*B*Hq*Sq*Sk*D per request, halved for causal Sq = Sk), client latency\n"
     "p50/p90/p95/p99/max, the server's mean queue/host_to_device/compute/device_to_host, and\n"
     "errors by status code (only requests completing inside the window count). A live progress\n"
     "line goes to stderr once a second. Exit code 0; 1 if no request succeeded, or with --check\n"
     "if any request failed or mismatched; 2 on bad flags.",
     kLoadFlagsFile,
     kAttentionFlagsFile,
     RunLoad,
     {}},
    {"kv",
     "K/V caches on the server: create, info, drop; sequences: create-seq, free-seq, truncate.",
     "attnctl [--target=host:port] kv <operation> [flags]\n\n"
     "Operations:\n"
     "  create      --heads_kv=H [--layers=L] [--head_dim=D] [--dtype=T] [--page_size=P]\n"
     "              (--capacity_tokens=N | --capacity_bytes=N) [--cache=ID] [--device=I] "
     "[--reserve]\n"
     "              [--head_dim_v=DV [--v_in_k]]   an MLA cache (docs/kv-cache.md)\n"
     "  info        --cache=ID [--seq=1,2]     (also: stats) statistics and sequence lengths\n"
     "  drop        --cache=ID                 frees every page of the cache\n"
     "  create-seq  --cache=ID --seq=1,2 [--fork_from=S [--fork_length=N]]\n"
     "  free-seq    --cache=ID --seq=1,2\n"
     "  truncate    --cache=ID --seq=S --length=N [--layer=L]\n"
     "create, info and the sequence operations print the cache's statistics (--json: as JSON).\n\n"
     "Example:\n"
     "  attnctl kv create --cache=demo --layers=2 --heads_kv=2 --head_dim=64 --dtype=fp16 \\\n"
     "      --page_size=16 --capacity_tokens=4096\n"
     "  attnctl kv create-seq --cache=demo --seq=1,2\n"
     "  attnctl kv info --cache=demo --seq=1,2\n"
     "  attnctl kv drop --cache=demo\n\n"
     "Every call carries the header x-attnserve-cache-id: ID, so an affinity proxy routes it to\n"
     "the replica that holds the cache. NOT_FOUND: the cache or sequence is not on this server\n"
     "(restart, expiry, another replica): create it again and re-prefill.\n"
     "Exit code 0 on success, 1 on a server error (its code and message are printed), 2 on bad\n"
     "flags.",
     kKvFlagsFile,
     nullptr,
     RunKv,
     {"heads_kv", "head_dim", "head_dim_v", "dtype", "json"}},
    {"load-kv",
     "Decode-loop load test of the K/V cache: prefill, then per-layer steps per token.",
     "attnctl [--target=host:port] load-kv [--sequences=N] [--prompt=N] [--tokens=N] [--layers=L]\n"
     "        [--heads_q=H] [--heads_kv=H] [--head_dim=D] [--dtype=T] [--page_size=P]\n"
     "        [--concurrency=G[,G...]] [--channels=N] [--stream] [--check] [--stateless]\n"
     "        [--warmup_tokens=N] [--prefill_chunk=N] [--prefill_attend=false] [--csv=FILE]\n"
     "        [--attend_fraction=F] [--label=TEXT] [--shm=none|system|cuda [--shm_prefix=P]]\n"
     "        [--transport=grpc|ucx|auto] [--moved_to=follow|retry|off]\n"
     "        [--head_dim_v=DV [--v_in_k]]\n\n"
     "Examples:\n"
     "  attnctl load-kv --sequences=4 --prompt=40 --tokens=4 --layers=2 --heads_q=4 \\\n"
     "      --heads_kv=2 --head_dim=32 --page_size=16 --check\n"
     "  attnctl load-kv --sequences=64 --prompt=8192 --tokens=32 --warmup_tokens=2 --layers=32 \\\n"
     "      --prefill_attend=false --heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 \\\n"
     "      --stream --channels=4 --concurrency=1,4 --csv=kv.csv\n"
     "  attnctl load-kv --stateless --sequences=16 --prompt=4096 ... --csv=kv.csv\n"
     "  attnctl load-kv --shm=system --stream --concurrency=4 --check ...\n"
     "  attnctl load-kv --heads_q=16 --heads_kv=1 --head_dim=576 --head_dim_v=512 --v_in_k \\\n"
     "      --dtype=bf16 --page_size=64 --check\n\n"
     "Creates a cache and --sequences sequences, prefills each with --prompt tokens (append\n"
     "with Q, causal, in --prefill_chunk pieces; K/V alone with --prefill_attend=false), then\n"
     "for each of --tokens generated tokens and each layer sends one append-and-attend step per\n"
     "group of sequences (Sq = 1, one new K/V token each). --concurrency=G splits the sequences\n"
     "into G groups in flight at once (one thread each; with --stream they share\n"
     "min(G, --channels) streams round-robin). Frees the sequences and drops the cache at the\n"
     "end. --stateless sends the whole context with\n"
     "Forward at every step instead. Reports generated tokens/s, K/V bytes attended per second,\n"
     "per-step (one call) p50/p99 and the server's queue/h2d/compute/d2h; --csv appends one row\n"
     "per --concurrency value (scenario=loop, impl=attnserve_kv|attnserve_stateless, ...).\n"
     "--check keeps every sequence's K/V per layer on the client and holds every output\n"
     "(prefill unless --prefill_attend=false, and decode) to the float64 reference over the\n"
     "whole context.\n"
     "--head_dim_v=DV makes an MLA cache whose V rows have DV elements (K and Q keep\n"
     "--head_dim); with --v_in_k V is the first DV elements of each K row (the absorbed form:\n"
     "no V pages, the steps send no v, and --check takes V from K the same way).\n"
     "--attend_fraction=F (0 < F < 1) names, at every decode step and for each sequence, a\n"
     "random F of its history pages (attend_pages): the server reads only those and the pages\n"
     "of the new token (page-level sparse decode); --check then uses exactly those tokens.\n"
     "--shm=system (or cuda) keeps tensor bytes off the socket: each group registers one\n"
     "shared-memory region with the server (which needs --allow_client_shm) before the cache is\n"
     "created, every prefill and decode step writes its q/k/v there and reads O back from it,\n"
     "and the region is unregistered and removed at the end (docs/shared-memory.md). The\n"
     "report, the progress line and the CSV's transport column say grpc, shm-system or\n"
     "shm-cuda.\n"
     "--transport=ucx (or auto) sends each unary step's q/k/v and receives O over a UCX\n"
     "connection per group (shared memory, TCP or RDMA as UCX_TLS allows) to the port the\n"
     "server offers (GetServerInfo kv.ucx_port, from --ucx_port); caches and sequences stay\n"
     "on gRPC. A server or build without UCX: gRPC bytes, and the first line says why\n"
     "(docs/ucx.md). The CSV's transport column says ucx.\n"
     "--moved_to: a cache that moved to another replica (a drained server with\n"
     "--handoff_peer answers UNAVAILABLE with x-attnserve-moved-to) is followed to the named\n"
     "address (follow), retried at --target (retry: behind the proxy, deploy/README.md) or is\n"
     "an error (off); the report counts the retries and the re-prefills (steps that found\n"
     "their cache gone). Unary steps only: a stream's requests fail in-band.\n"
     "Exit code 0 on success; 1 on any error or mismatch; 2 on bad flags.",
     "client/cli/load_kv.cc",
     nullptr,
     RunLoadKv,
     {"layers", "page_size", "device", "heads_q", "heads_kv", "head_dim", "head_dim_v", "v_in_k",
      "dtype", "seed", "concurrency", "channels", "stream", "check", "csv", "label", "shm",
      "shm_prefix"}},
    {"move-kv",
     "Move a K/V cache's sequences from one server to another (resumes a cut stream).",
     "attnctl move-kv --from=host:port --to=host:port --cache=ID [--to_cache=ID] [--seq=1,2]\n"
     "        [--token_begin=N] [--token_end=N] [--max_chunk_bytes=N] [--transfer_id=ID]\n"
     "        [--capacity_tokens=N | --capacity_bytes=N [--device=I] [--reserve]]\n\n"
     "Examples:\n"
     "  attnctl move-kv --from=10.0.0.1:50051 --to=10.0.0.2:50051 --cache=kv0 \\\n"
     "      --capacity_tokens=1048576\n"
     "  attnctl move-kv --from=a:50051 --to=b:50051 --cache=kv0 --seq=3,4 --token_end=512\n\n"
     "Pipes the source's ExportSequences into the receiver's ImportSequences\n"
     "(docs/kv-transfer.md): the sequences arrive live with the same ids and lengths, all or\n"
     "nothing per sequence; the source keeps its copy. With --capacity_tokens or\n"
     "--capacity_bytes the receiver creates the cache when it has none of that id (geometry and\n"
     "page size from the source). A broken stream is resumed where the receiver stands\n"
     "(finished sequences are not sent again), up to 8 times; after a failure, the same\n"
     "command with --transfer_id set to the id in the error continues it.\n"
     "--timeout bounds the whole move only when given. --token/--tls* apply to both servers.\n"
     "A progress line (bytes, GB/s, sequences) goes to stderr once a second.\n"
     "Exit code 0 on success, 1 on a server error (code and message printed), 2 on bad flags.",
     kKvTransferFlagsFile,
     nullptr,
     RunMoveKv,
     {"cache", "seq", "capacity_tokens", "capacity_bytes", "device", "reserve"}},
    {"export-kv",
     "Write a K/V cache's sequences to a file (a snapshot import-kv loads again).",
     "attnctl [--target=host:port] export-kv --cache=ID --out=FILE [--seq=1,2]\n"
     "        [--token_begin=N] [--token_end=N] [--max_chunk_bytes=N]\n\n"
     "Example:\n"
     "  attnctl export-kv --cache=kv0 --out=kv0.chunks\n\n"
     "FILE holds the export's KvChunk messages (kv_transfer.proto), each preceded by its length\n"
     "as a varint (protobuf's delimited form), the first with the header; every chunk keeps its\n"
     "CRC-32C. It is written as FILE.partial and renamed when whole. A cut stream is resumed\n"
     "after the last chunk written, up to 8 times. The cache stays on the server.\n"
     "Exit code 0 on success, 1 on a server error, 2 on bad flags or an unwritable file.",
     kKvTransferFlagsFile,
     nullptr,
     RunExportKv,
     {"cache", "seq", "out"}},
    {"import-kv",
     "Load a file export-kv wrote into a server's cache (live sequences, same ids).",
     "attnctl [--target=host:port] import-kv --in=FILE --cache=ID [--transfer_id=ID]\n"
     "        [--capacity_tokens=N | --capacity_bytes=N [--device=I] [--reserve]]\n\n"
     "Example:\n"
     "  attnctl import-kv --in=kv0.chunks --cache=kv0 --capacity_tokens=1048576\n\n"
     "Reads the whole file first and checks it (every chunk parses, one header first, each\n"
     "chunk's CRC-32C, every sequence complete): a damaged or cut file is refused, naming the\n"
     "chunk and byte offset, before anything is sent. Then sends it through ImportSequences,\n"
     "resuming a cut stream where the server stands. With --capacity_tokens or --capacity_bytes\n"
     "the server creates the cache when it has none of that id. Sequence ids the cache already\n"
     "holds are ALREADY_EXISTS.\n"
     "Exit code 0 on success, 1 on a server error, 2 on bad flags or a bad file.",
     kKvTransferFlagsFile,
     nullptr,
     RunImportKv,
     {"cache", "capacity_tokens", "capacity_bytes", "device", "reserve"}},
};

const Command* FindCommand(absl::string_view name) {
  for (const Command& c : kCommands) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

// The flags defined in the file `suffix`, sorted by name.
std::vector<absl::CommandLineFlag*> FlagsOf(absl::string_view suffix) {
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), suffix)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  return flags;
}

// `text` as lines of at most `width` columns, each indented by `indent`.
std::string Wrap(const std::string& text, size_t indent, size_t width) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && indent + line.size() + 1 + word.size() > width) {
      absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

void PrintFlag(const absl::CommandLineFlag& f) {
  std::cout << "  --" << f.Name();
  const std::string def = f.DefaultValue();
  if (!def.empty()) std::cout << " (default: " << def << ")";
  std::cout << "\n" << Wrap(f.Help(), 6, 88);
}

void PrintFlags(absl::string_view title, absl::string_view file) {
  std::cout << "\n" << title << ":\n";
  for (const absl::CommandLineFlag* f : FlagsOf(file)) PrintFlag(*f);
}

void PrintHelp(const Command* command) {
  if (command != nullptr) {
    std::cout << command->summary << "\n\nUsage: " << command->usage << "\n";
    PrintFlags(absl::StrCat(command->name, " flags"), command->flags_file);
    if (command->shared_flags_file != nullptr) {
      PrintFlags("Attention call flags (shared by forward and load)", command->shared_flags_file);
    }
    if (!command->borrowed_flags.empty()) {
      std::cout << "\nFlags shared with other commands:\n";
      for (const char* name : command->borrowed_flags) {
        PrintFlag(*absl::FindCommandLineFlag(name));
      }
    }
  } else {
    std::cout << "attnctl: command-line client of the attnserve attention service.\n\n"
                 "Usage: attnctl [global flags] <command> [command flags]\n\nCommands:\n";
    for (const Command& c : kCommands) {
      std::cout << "  " << c.name << std::string(10 - absl::string_view(c.name).size(), ' ')
                << c.summary << "\n";
    }
    std::cout << "  help      Show this help, or a command's flags: attnctl help <command>.\n"
                 "\nFlags take the forms --name=value, --name value, and for booleans --name or "
                 "--noname.\nExit codes: 0 success, 1 failure (server error, NOT_SERVING, "
                 "verify FAIL), 2 bad usage.\n";
  }
  PrintFlags("Global flags", kGlobalFlagsFile);
}

// Sets one flag from "--name[=value]" (value possibly in the next argument).
// Returns an error message, or "" on success.
std::string SetFlag(absl::string_view arg, const std::vector<std::string>& argv, size_t* i) {
  absl::string_view body = arg;
  if (!absl::ConsumePrefix(&body, "--")) absl::ConsumePrefix(&body, "-");
  const size_t eq = body.find('=');
  std::string name(body.substr(0, eq));
  // --block-density is --block_density: flag names are identifiers.
  std::replace(name.begin(), name.end(), '-', '_');
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  bool negated = false;
  if (flag == nullptr && absl::StartsWith(name, "no")) {
    absl::CommandLineFlag* positive = absl::FindCommandLineFlag(name.substr(2));
    if (positive != nullptr && positive->IsOfType<bool>() && eq == absl::string_view::npos) {
      flag = positive;
      negated = true;
      name = name.substr(2);
    }
  }
  if (flag == nullptr || !absl::StrContains(flag->Filename(), "client/cli/")) {
    return absl::StrCat("unknown flag --", name);
  }
  std::string value;
  if (eq != absl::string_view::npos) {
    value = std::string(body.substr(eq + 1));
  } else if (flag->IsOfType<bool>()) {
    value = negated ? "false" : "true";
  } else if (*i + 1 < argv.size() && !absl::StartsWith(argv[*i + 1], "--")) {
    value = argv[++*i];
  } else {
    return absl::StrCat("flag --", name, " needs a value");
  }
  std::string error;
  if (!flag->ParseFrom(value, &error)) {
    return absl::StrCat("--", name, ": invalid value '", value, "': ", error);
  }
  MarkFlagSet(name);
  return "";
}

int Main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  std::vector<std::string> positional;
  bool help = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      positional.insert(positional.end(), args.begin() + i + 1, args.end());
      break;
    }
    if (a == "--help" || a == "-h" || a == "-help" || a == "--helpfull") {
      help = true;
      continue;
    }
    if (a.size() > 1 && a[0] == '-') {
      const std::string error = SetFlag(a, args, &i);
      if (!error.empty()) {
        return UsageError(positional.empty() ? "" : positional[0], error);
      }
      continue;
    }
    positional.push_back(a);
  }

  if (positional.empty()) {
    PrintHelp(nullptr);
    return help ? kExitOk : kExitUsage;
  }
  std::string name = positional[0];
  if (name == "help") {
    help = true;
    name = positional.size() > 1 ? positional[1] : "";
  }
  const Command* command = name.empty() ? nullptr : FindCommand(name);
  if (!name.empty() && command == nullptr) {
    return UsageError("", absl::StrCat("unknown command '", name,
                                       "' (commands: health, info, forward, load, kv, load-kv, "
                                       "move-kv, export-kv, import-kv, help)"));
  }
  if (help) {
    PrintHelp(command);
    return kExitOk;
  }
  // A flag of another command is almost always a typo or a misplaced option.
  for (const std::string& set : FlagsSet()) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(set);
    const std::string file = flag->Filename();
    const bool shared =
        command->shared_flags_file != nullptr && absl::EndsWith(file, command->shared_flags_file);
    const bool borrowed =
        std::find_if(command->borrowed_flags.begin(), command->borrowed_flags.end(),
                     [&](const char* b) { return set == b; }) != command->borrowed_flags.end();
    if (!absl::EndsWith(file, kGlobalFlagsFile) && !absl::EndsWith(file, command->flags_file) &&
        !shared && !borrowed) {
      return UsageError(command->name,
                        absl::StrCat("flag --", set, " does not apply to '", command->name, "'"));
    }
  }
  return command->run(std::vector<std::string>(positional.begin() + 1, positional.end()));
}

}  // namespace
}  // namespace cli
}  // namespace attnserve

int main(int argc, char** argv) {
  // As the server does: a load test's messages are not faulted in anew every call.
  attnserve::TuneMallocForTensors();
  return attnserve::cli::Main(argc, argv);
}
