// `attnctl load-kv`: the decode-loop load test of the K/V cache service (the
// loop itself is load_kv_loop.cc). Reads the flags, runs the loop once per
// --concurrency value, prints generated tokens/s, per-step p50/p99 and the
// server's breakdown, appends CSV rows in the columns of the K/V benchmarks
// (scenario, impl, sequences, context, layers, page_size, tokens_per_s, tbps,
// p50_ms, p99_ms, ...), and shows a progress line on stderr once a second.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/cli/attention_flags.h"
#include "client/cli/command.h"
#include "client/cli/common.h"
#include "client/cli/kv_flags.h"
#include "client/cli/load_kv_loop.h"
#include "client/cli/load_report.h"
#include "client/ucx_transport.h"
#include "common/dtype.h"

// Shape flags of attention_flags.cc and the load flags of load_flags.cc that
// load-kv takes with the same meaning (attnctl.cc lists them as borrowed).
ABSL_DECLARE_FLAG(int, heads_q);
ABSL_DECLARE_FLAG(std::optional<int>, heads_kv);
ABSL_DECLARE_FLAG(int, head_dim);
ABSL_DECLARE_FLAG(int, head_dim_v);
ABSL_DECLARE_FLAG(std::string, concurrency);
ABSL_DECLARE_FLAG(int, channels);
ABSL_DECLARE_FLAG(bool, stream);
ABSL_DECLARE_FLAG(bool, check);
ABSL_DECLARE_FLAG(std::string, csv);
ABSL_DECLARE_FLAG(std::string, label);

ABSL_FLAG(int, sequences, 4, "Sequences generating at once (the decode batch).");
ABSL_FLAG(int, prompt, 64,
          "Prompt tokens of each sequence, prefilled before the first generated token (the "
          "`context` column).");
ABSL_FLAG(int, tokens, 8, "Tokens generated per sequence.");
ABSL_FLAG(int, warmup_tokens, 0,
          "The first generated tokens run but are not measured (connection and allocator "
          "warm-up); must be < --tokens.");
ABSL_FLAG(int, prefill_chunk, 1024,
          "Most prompt tokens of one sequence in one prefill call (keeps requests under the "
          "server's size limits).");
ABSL_FLAG(bool, prefill_attend, true,
          "Prefill calls attend as well as append (a real prefill). false: prompts are "
          "appended without queries, moving only K/V (fills many layers of long contexts "
          "quickly; the decode steps and --check are unchanged).");
ABSL_FLAG(double, attend_fraction, 1.0,
          "Below 1: every decode step names, per sequence, a random fraction of its history "
          "pages (attend_pages, at least one; the pages of the new token always count), so the "
          "server reads only those: page-level sparse decode. tbps counts the pages read.");
ABSL_FLAG(std::string, cache_dtype, "",
          "What the cache's pages hold: empty (--dtype) or fp8 (E4M3 with a scale per token "
          "and KV head; --dtype fp16 or bf16; the server quantises each step's K/V).");
ABSL_FLAG(std::string, transport, "grpc",
          "What carries each step's q/k/v and O: grpc (the messages), ucx (a UCX connection per "
          "group to the port GetServerInfo's kv.ucx_port offers: shared memory, TCP or RDMA as "
          "UCX_TLS allows; docs/ucx.md) or auto (ucx when offered). ucx and auto fall back to "
          "grpc when the server or this build has no UCX, and the summary line says so.");
ABSL_FLAG(std::string, moved_to, "follow",
          "A cache that moved to another replica (UNAVAILABLE with x-attnserve-moved-to, a "
          "drained replica with --handoff_peer): follow (retry the call at the named address), "
          "retry (at --target again: a proxy that sends it on once the drained replica is "
          "gone; plain UNAVAILABLE is retried too) or off (an error).");
ABSL_FLAG(bool, keep_cache, false,
          "Leave the cache and its sequences on the server when the run ends (its id is "
          "printed) instead of freeing and dropping them: a full cache to time move-kv or "
          "export-kv on.");
ABSL_FLAG(bool, stateless, false,
          "No cache: every step sends each sequence's whole context with Forward (impl "
          "attnserve_stateless), the baseline the K/V service is compared with.");

namespace attnserve {
namespace cli {
namespace {

constexpr char kCmd[] = "load-kv";

// Prints progress to stderr once a second until destroyed.
class ProgressLine {
 public:
  ProgressLine(std::string label, const DecodeLoopProgress& p, int64_t sequences, int64_t total)
      : thread_([=, &p] { Loop(label, p, sequences, total); }) {}
  ~ProgressLine() {
    done_.Notify();
    thread_.join();
  }

 private:
  void Loop(const std::string& label, const DecodeLoopProgress& p, int64_t sequences,
            int64_t total) {
    const bool tty = isatty(2);
    const absl::Time start = absl::Now();
    int64_t last = 0;
    while (!done_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
      const int64_t tokens = p.tokens.load(std::memory_order_relaxed);
      std::string phase =
          p.decoding ? absl::StrCat("decode ", tokens, "/", total, " tokens, ", tokens - last,
                                    " tok/s, ", p.steps.load(), " steps")
                     : absl::StrCat("prefill ", p.prefilled.load(), "/", sequences, " sequences");
      std::cerr << (tty ? "\r" : "") << "[" << label << " "
                << Fixed(absl::ToDoubleSeconds(absl::Now() - start), 0) << "s] " << phase << ", "
                << p.errors.load() << " errors" << (tty ? "   " : "\n") << std::flush;
      last = tokens;
    }
    if (tty) std::cerr << "\r" << std::string(80, ' ') << "\r" << std::flush;
  }

  absl::Notification done_;
  std::thread thread_;
};

struct Column {
  std::string name, value;
};

std::vector<Column> Columns(const DecodeLoopConfig& c, const DecodeLoopResult& r) {
  auto num = [](double x) { return absl::StrCat(x); };
  std::vector<std::string> codes;
  for (const auto& [code, n] : r.errors_by_code) codes.push_back(absl::StrCat(code, "=", n));
  // The free-text cells cannot hold a comma or a quote.
  std::string label = absl::GetFlag(FLAGS_label);
  for (char& ch : label) {
    if (ch == ',' || ch == '"') ch = ';';
  }
  return {{"scenario", "loop"},
          {"impl", r.impl},
          {"sequences", absl::StrCat(c.sequences)},
          {"context", absl::StrCat(c.prompt)},
          {"layers", absl::StrCat(c.layers)},
          {"page_size", absl::StrCat(r.page_size)},
          {"tokens_per_s", num(r.tokens_per_s)},
          {"tbps", num(r.tbps)},
          {"p50_ms", num(r.p50_ms)},
          {"p99_ms", num(r.p99_ms)},
          {"label", label},
          {"tokens", absl::StrCat(c.tokens)},
          {"concurrency", absl::StrCat(c.groups)},
          {"channels", absl::StrCat(absl::GetFlag(FLAGS_channels))},
          {"stream", c.stream ? "true" : "false"},
          {"heads_q", absl::StrCat(c.heads_q)},
          {"heads_kv", absl::StrCat(c.heads_kv)},
          {"head_dim", absl::StrCat(c.head_dim)},
          {"dtype", std::string(DTypeName(c.dtype))},
          {"cache_dtype", c.fp8_cache ? "FP8_E4M3" : std::string(DTypeName(c.dtype))},
          {"steps", absl::StrCat(r.steps)},
          {"max_ms", num(r.max_ms)},
          {"queue_ms", num(r.queue_ms)},
          {"host_to_device_ms", num(r.h2d_ms)},
          {"compute_ms", num(r.compute_ms)},
          {"device_to_host_ms", num(r.d2h_ms)},
          {"server_total_ms", num(r.server_total_ms)},
          {"outside_server_p50_ms", num(r.outside_p50_ms)},
          {"client_ms", num(r.client_ms)},
          {"mean_batch_size", num(r.mean_batch_size)},
          {"prefill_s", num(r.prefill_s)},
          {"errors", absl::StrCat(r.errors)},
          {"errors_by_code", absl::StrJoin(codes, ";")},
          {"check", c.check ? "true" : "false"},
          // Last, so the columns before it keep their places in older files.
          {"transport", r.transport}};
}

absl::Status AppendCsv(const std::string& path, const std::vector<Column>& columns) {
  bool is_new = true;
  {
    std::ifstream in(path);
    is_new = !in.good() || in.peek() == std::ifstream::traits_type::eof();
  }
  std::ofstream out(path, std::ios::app);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  std::vector<std::string> names, values;
  for (const Column& col : columns) {
    names.push_back(col.name);
    values.push_back(col.value);
  }
  if (is_new) out << absl::StrJoin(names, ",") << "\n";
  out << absl::StrJoin(values, ",") << "\n";
  return out ? absl::OkStatus() : absl::UnavailableError(absl::StrCat("cannot write ", path));
}

void PrintResult(const DecodeLoopConfig& c, const DecodeLoopResult& r) {
  std::cout << "concurrency " << c.groups << " (" << r.transport
            << "): " << Fixed(r.tokens_per_s, 1) << " generated tokens/s (" << r.generated
            << " tokens in " << Fixed(r.decode_s, 3) << " s), K/V read " << Fixed(r.tbps * 1e3, 3)
            << " GB/s\n"
            << "  per step (" << r.steps << " layer-steps): p50 " << Fixed(r.p50_ms, 3)
            << " ms, p99 " << Fixed(r.p99_ms, 3) << " ms, max " << Fixed(r.max_ms, 3) << " ms\n"
            << "  server means: queue " << Fixed(r.queue_ms, 3) << " ms, h2d " << Fixed(r.h2d_ms, 3)
            << " ms, compute " << Fixed(r.compute_ms, 3) << " ms, d2h " << Fixed(r.d2h_ms, 3)
            << " ms, batch " << Fixed(r.mean_batch_size, 2) << "; total "
            << Fixed(r.server_total_ms, 3) << " ms (received to response built)\n"
            << "  outside the server: p50 " << Fixed(r.outside_p50_ms, 3)
            << " ms (wire, gRPC, this client; of it building and reading messages: mean "
            << Fixed(r.client_ms, 3) << " ms)\n"
            << "  prefill " << Fixed(r.prefill_s, 3) << " s";
  if (!r.cache_id.empty()) {
    std::cout << "; cache " << r.cache_id << ", page size " << r.page_size;
    if (c.keep_cache) {
      std::cout << ", kept on the server";
    } else {
      std::cout << ", pages used after free " << r.pages_used_after_free;
    }
  }
  std::cout << "\n";
  if (c.check) std::cout << "  check: " << r.checked << " outputs held to the reference\n";
  if (!c.stateless) {
    std::cout << "  moved caches: " << r.moved_retries << " retries after moved-to, "
              << r.reprefills << " re-prefills (steps that found their cache gone)\n";
  }
  if (r.errors > 0) {
    std::vector<std::string> codes;
    for (const auto& [code, n] : r.errors_by_code) codes.push_back(absl::StrCat(code, "=", n));
    std::cout << "  errors: " << absl::StrJoin(codes, ", ") << "\n"
              << "  first error: " << r.first_error << "\n";
  }
  std::cout << std::flush;
}

}  // namespace

int RunLoadKv(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError(kCmd, "load-kv takes no arguments, got '" + args[0] + "'");
  DecodeLoopConfig c;
  c.sequences = absl::GetFlag(FLAGS_sequences);
  c.prompt = absl::GetFlag(FLAGS_prompt);
  c.tokens = absl::GetFlag(FLAGS_tokens);
  c.warmup_tokens = absl::GetFlag(FLAGS_warmup_tokens);
  c.layers = absl::GetFlag(FLAGS_layers);
  c.heads_q = absl::GetFlag(FLAGS_heads_q);
  c.heads_kv = absl::GetFlag(FLAGS_heads_kv).value_or(c.heads_q);
  c.head_dim = absl::GetFlag(FLAGS_head_dim);
  c.head_dim_v = absl::GetFlag(FLAGS_head_dim_v);
  c.v_in_k = absl::GetFlag(FLAGS_v_in_k);
  c.page_size = absl::GetFlag(FLAGS_page_size);
  c.device = absl::GetFlag(FLAGS_device);
  c.stream = absl::GetFlag(FLAGS_stream);
  c.check = absl::GetFlag(FLAGS_check);
  c.stateless = absl::GetFlag(FLAGS_stateless);
  c.keep_cache = absl::GetFlag(FLAGS_keep_cache);
  c.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  c.prefill_attend = absl::GetFlag(FLAGS_prefill_attend);
  c.attend_fraction = absl::GetFlag(FLAGS_attend_fraction);
  c.seed = absl::GetFlag(FLAGS_seed).value_or(std::random_device()());
  const std::string moved_to = absl::GetFlag(FLAGS_moved_to);
  if (moved_to == "follow") {
    c.moved.policy = KvMovedOptions::Policy::kFollow;
  } else if (moved_to == "retry") {
    c.moved.policy = KvMovedOptions::Policy::kRetry;
  } else if (moved_to == "off") {
    c.moved.policy = KvMovedOptions::Policy::kOff;
  } else {
    return UsageError(kCmd, "--moved_to: expected follow, retry or off, got '" + moved_to + "'");
  }
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return UsageError(kCmd, absl::StrCat("--dtype: ", dtype.status().message()));
  c.dtype = *dtype;
  const std::string cache_dtype = absl::AsciiStrToLower(absl::GetFlag(FLAGS_cache_dtype));
  if (!cache_dtype.empty() && cache_dtype != "fp8" && cache_dtype != "fp8_e4m3") {
    return UsageError(
        kCmd, absl::StrCat("--cache_dtype: expected empty or fp8, got '", cache_dtype, "'"));
  }
  c.fp8_cache = !cache_dtype.empty();
  if (c.fp8_cache && (c.dtype == DType::kFP32 || c.check || c.stateless)) {
    // --check compares with the reference over the 16-bit K/V sent; an FP8
    // cache is held to the one over its dequantised rows (docs/kv-cache.md).
    return UsageError(kCmd,
                      "--cache_dtype=fp8: expected --dtype fp16 or bf16, without --check and "
                      "--stateless");
  }
  absl::StatusOr<ProtocolChoice> shm = ProtocolFromFlags();
  if (!shm.ok()) return UsageError(kCmd, shm.status().message());
  c.shm = shm->shm;
  c.shm_prefix = shm->shm_prefix;
  const std::string levels_text = absl::GetFlag(FLAGS_concurrency);
  absl::StatusOr<std::vector<int>> levels =
      ParseLengthList("concurrency", levels_text.empty() ? "1" : levels_text);
  if (!levels.ok()) return UsageError(kCmd, levels.status().message());
  if (c.stateless && c.keep_cache) {
    return UsageError(kCmd, "--keep_cache keeps a cache; --stateless has none");
  }
  if (c.stateless && (FlagWasSet("page_size") || FlagWasSet("device"))) {
    return UsageError(kCmd, "--page_size and --device describe a cache; --stateless has none");
  }
  if (absl::GetFlag(FLAGS_channels) < 1) {
    return UsageError(kCmd,
                      absl::StrCat("--channels must be >= 1, got ", absl::GetFlag(FLAGS_channels)));
  }
  for (int level : *levels) {
    c.groups = level;
    const absl::Status valid = ValidateDecodeLoopConfig(c);
    if (!valid.ok()) return UsageError(kCmd, valid.message());
  }

  absl::StatusOr<StepTransport> transport = ParseStepTransport(absl::GetFlag(FLAGS_transport));
  if (!transport.ok()) return UsageError(kCmd, transport.status().message());
  if (*transport != StepTransport::kGrpc && (c.stream || c.stateless || c.shm != ShmMode::kNone)) {
    return UsageError(kCmd,
                      "--transport=ucx|auto carries unary K/V steps: not with --stream, "
                      "--stateless or --shm");
  }

  absl::StatusOr<std::unique_ptr<AttentionClient>> client =
      MakeClientFromFlags(absl::GetFlag(FLAGS_channels));
  if (!client.ok()) return UsageError(kCmd, client.status().message());
  if (!absl::GetFlag(FLAGS_wait_for_ready)) {
    (*client)->Connect(std::min(absl::GetFlag(FLAGS_timeout), absl::Seconds(10))).IgnoreError();
  }
  // UCX when asked for and offered; otherwise gRPC bytes, and the summary says why.
  std::string fallback;
  if (*transport != StepTransport::kGrpc) {
    const UcxOffer offer = AskUcxOffer(**client);
    if (offer.port > 0) {
      c.ucx_host = offer.host;
      c.ucx_port = offer.port;
      c.ucx_authorization = AuthorizationOf(**client);
    } else {
      fallback = offer.why_not;
    }
  }
  const std::string transport_name =
      c.ucx_port > 0     ? absl::StrCat("UCX ", c.ucx_host, ":", c.ucx_port,
                                    getenv("UCX_TLS") != nullptr
                                            ? absl::StrCat(" (UCX_TLS=", getenv("UCX_TLS"), ")")
                                            : std::string())
          : fallback.empty() ? ShmTransportName(c.shm)
                         : absl::StrCat("grpc (fallback from UCX: ", fallback, ")");

  std::cout << "load-kv:  "
            << (c.stateless ? "stateless Forward (whole context each step)"
                : c.stream  ? "AppendAttendStream"
                            : "unary AppendAttend")
            << " over " << transport_name << ", " << c.sequences << " sequences x " << c.prompt
            << " prompt + " << c.tokens << " generated tokens (" << c.warmup_tokens << " warm-up), "
            << c.layers << " layers, Hq " << c.heads_q << ", Hkv " << c.heads_kv << ", D "
            << c.head_dim
            << (c.head_dim_v > 0 ? absl::StrCat(", Dv ", c.head_dim_v) : std::string())
            << (c.v_in_k ? " (V in K)" : "") << ", " << DTypeName(c.dtype) << ", "
            << (*client)->num_channels() << " channel(s), seed " << c.seed << ", check "
            << (c.check ? "on" : "off")
            << (c.attend_fraction < 1.0 ? absl::StrCat(", attend fraction ", c.attend_fraction)
                                        : std::string())
            << "\n";

  bool failed = false;
  for (int level : *levels) {
    c.groups = level;
    DecodeLoopProgress progress;
    absl::StatusOr<DecodeLoopResult> r;
    {
      ProgressLine line(
          absl::StrCat("load-kv ", c.ucx_port > 0 ? "ucx" : ShmTransportName(c.shm), " c=", level),
          progress, c.sequences, int64_t{c.sequences} * c.tokens);
      r = RunDecodeLoop(**client, c, &progress);
    }
    if (!r.ok()) return PrintError("load-kv", r.status());
    PrintResult(c, *r);
    failed |= r->errors > 0;
    if (const std::string path = absl::GetFlag(FLAGS_csv); !path.empty()) {
      const absl::Status st = AppendCsv(path, Columns(c, *r));
      if (!st.ok()) return PrintError("--csv", st);
    }
  }
  if (failed) {
    std::cout << "FAIL: errors in the decode loop (see above)\n";
    return kExitFailure;
  }
  if (c.check) std::cout << "PASS: every output matched the float64 reference\n";
  return kExitOk;
}

}  // namespace cli
}  // namespace attnserve
