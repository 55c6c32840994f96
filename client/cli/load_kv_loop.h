// The decode loop of `attnctl load-kv`: what a serving stack's generation loop
// asks of the K/V service, measured. One run creates a cache, prefills every
// sequence (append with Q, causal), then for each generated token and each
// layer sends one append-and-attend step per group of sequences (Sq = 1 and
// one new K/V token per sequence), frees the sequences and drops the cache.
// Groups run at once (as serving stacks pipeline micro-batches), each on its
// own thread, over unary calls or streams shared round-robin by the groups.
//
// With check, the loop keeps each sequence's K/V per layer on the client and
// holds every output to the float64 reference over the whole context. The
// stateless variant sends that whole context with Forward at every step
// instead (no cache): the baseline the K/V service is measured against.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/kv_client.h"
#include "client/shm_arena.h"

namespace attnserve {
namespace cli {

struct DecodeLoopConfig {
  int sequences = 4;
  int prompt = 64;        // tokens of each sequence before the first generated one
  int tokens = 8;         // generated tokens per sequence
  int warmup_tokens = 0;  // the first ones are run but not measured
  int layers = 1;
  int heads_q = 8;
  int heads_kv = 8;
  int head_dim = 64;
  // MLA caches: V's head dim (0: head_dim), and v_in_k (V is the first
  // head_dim_v elements of each K row: the steps send no v).
  int head_dim_v = 0;
  bool v_in_k = false;
  DType dtype = DType::kFP16;
  // An FP8 cache (geometry.cache_dtype FP8_E4M3): the server quantises the
  // steps' 16-bit K/V into E4M3 pages.
  bool fp8_cache = false;
  int page_size = 0;  // 0: the server's default
  std::optional<int> device;
  int groups = 1;            // groups of sequences in flight at once
  bool stream = false;       // AppendAttendStream instead of unary AppendAttend
  bool check = false;        // verify every output against the float64 reference
  bool stateless = false;    // Forward with the whole context, no cache
  bool keep_cache = false;   // leave the cache and its sequences on the server at the end
  int prefill_chunk = 1024;  // most prompt tokens of one sequence in one prefill call
  // False: prompts are appended without queries (num_queries = 0), so a
  // prefill moves only K/V: how a benchmark fills 32 layers x 64 x 8k without
  // sending Q and receiving O three times the cache's size over loopback.
  bool prefill_attend = true;
  // Below 1: each decode step names, per sequence, a random attend_fraction of
  // its history pages (attend_pages, at least one), as sparse-decode methods
  // that pick the top pages per step do; 1 attends everything.
  double attend_fraction = 1.0;
  uint64_t seed = 0;
  // Shared memory (client/shm_arena.h): each group registers one arena before
  // the cache is created and sends every step's q, k and v and receives its O
  // through it (the stateless loop's Forward too); unregistered and removed
  // when the run ends.
  ShmMode shm = ShmMode::kNone;
  std::string shm_prefix = kDefaultShmKeyPrefix;
  // UCX steps (client/ucx_transport.h, docs/ucx.md): port > 0 gives each group
  // its own UCX connection to ucx_host:ucx_port for its AppendAttend calls
  // (prefill and decode); cache set-up and clean-up stay on gRPC.
  std::string ucx_host;
  int ucx_port = 0;
  std::string ucx_authorization;  // "Bearer <token>" or empty
  // What the K/V calls do when a cache moved to another replica (--moved_to).
  KvMovedOptions moved;
};

// What one run measured.
struct DecodeLoopResult {
  std::string impl;       // "attnserve_kv" or "attnserve_stateless"
  std::string transport;  // "grpc", "shm-system", "shm-cuda" or "ucx"
  std::string cache_id;
  int page_size = 0;  // as the server chose it (0 for stateless)
  double prefill_s = 0.0;
  double decode_s = 0.0;      // wall time of the measured tokens
  int64_t generated = 0;      // measured generated tokens over all sequences
  int64_t steps = 0;          // measured layer-steps (one call each)
  double tokens_per_s = 0.0;  // generated / decode_s
  double tbps = 0.0;          // K+V bytes attended (the named pages only) per second / 1e12
  double p50_ms = 0.0, p99_ms = 0.0, max_ms = 0.0;  // per layer-step, client side
  // Means over the measured steps of the server's timing, in ms.
  double queue_ms = 0.0, h2d_ms = 0.0, compute_ms = 0.0, d2h_ms = 0.0;
  // Mean of the server's total (request received until the response is
  // built), the p50 of client latency minus that total (wire, gRPC and this
  // client), and the mean time this client spent building requests and
  // reading responses (unary; the stream's reading is not split out).
  double server_total_ms = 0.0, outside_p50_ms = 0.0, client_ms = 0.0;
  double mean_batch_size = 0.0;
  int64_t checked = 0;  // outputs held to the reference
  int64_t errors = 0;
  std::map<std::string, int64_t> errors_by_code;  // CHECK_FAILED for a mismatch
  std::string first_error;
  // The cache after the sequences were freed, before the drop: pages_used
  // should be 0 (-1 when not read).
  int64_t pages_used_after_free = -1;
  // Calls retried after a moved-to answer (a draining replica handed the
  // cache over), and steps that found the cache or a sequence gone
  // (NOT_FOUND: a serving stack would re-prefill those sequences).
  int64_t moved_retries = 0;
  int64_t reprefills = 0;
};

// Live counters for the progress line.
struct DecodeLoopProgress {
  std::atomic<int64_t> prefilled{0};  // sequences whose prompt is in
  std::atomic<int64_t> tokens{0};     // generated tokens (all sequences)
  std::atomic<int64_t> steps{0};      // layer-steps completed
  std::atomic<int64_t> errors{0};
  std::atomic<bool> decoding{false};
};

// INVALID_ARGUMENT naming the flag for a value out of range (a usage error).
absl::Status ValidateDecodeLoopConfig(const DecodeLoopConfig& config);

// Runs the whole loop. A failed step stops its group (the later steps would
// only repeat the error) and is counted; the status is an error only when the
// run could not start (cache creation, or cleanup) and says which call failed.
absl::StatusOr<DecodeLoopResult> RunDecodeLoop(AttentionClient& client,
                                               const DecodeLoopConfig& config,
                                               DecodeLoopProgress* progress);

}  // namespace cli
}  // namespace attnserve
