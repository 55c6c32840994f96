// The server's own request types: what every front-end (server/native for
// attnserve.v1, server/kserve for KServe v2) decodes its wire format into,
// and what the core validates and runs. No protocol's messages appear here:
// tensors are byte views of memory the front-end keeps alive until the
// call's completion has run (a message, a shared-memory region, a buffer).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "backend/params.h"

namespace attnserve {

// Who asked, by when, and whether they still want the answer.
struct CallMeta {
  std::string id;  // echoed in the answer and logged (client-chosen)
  std::string tenant;
  absl::Time received = absl::Now();
  absl::Time deadline = absl::InfiniteFuture();
  // Set when the client cancels; may be null.
  std::shared_ptr<const std::atomic<bool>> cancelled;
};

// The metadata of a call received now.
inline CallMeta CallMetaOf(std::string tenant, absl::Time deadline,
                           std::shared_ptr<const std::atomic<bool>> cancelled) {
  CallMeta meta;
  meta.tenant = std::move(tenant);
  meta.deadline = deadline;
  meta.cancelled = std::move(cancelled);
  return meta;
}

// One tensor as the caller sent it. `dtype` is the wire's code (a DType value
// when known; anything else is refused naming the field), `shape` its dims
// as sent, `bytes` its data wherever it lies.
struct TensorView {
  int dtype = 0;
  absl::Span<const int64_t> shape;
  absl::string_view bytes;
  // Set when the sender left the tensor out entirely (a K/V step without
  // new tokens may).
  bool absent = false;
  // kHostMemory, or the CUDA device whose memory `bytes` points into (a
  // client's CUDA shared-memory region): the core then never reads the
  // bytes, it only hands the address to the backend. q, k and v only.
  int device = kHostMemory;
};

// The attention options as the caller stated them: unset stays unset, so
// the checks can tell "left out" from a value (docs/design.md §2).
struct StatedOptions {
  std::optional<float> softmax_scale;
  bool causal = false;
  std::optional<int32_t> window_left;
  std::optional<int32_t> window_right;
  float softcap = 0.0f;
  bool return_lse = false;
  std::optional<float> q_descale;
  std::optional<float> k_descale;
  std::optional<float> v_descale;
  bool batch_invariant = false;
};

// A block-sparse mask as sent (attnserve.v1.BlockMask): CSR rows over
// (sequence, head, query block), docs/design.md §2. Sizes are int64 so a
// protocol's wider integers reach the checks unclipped.
struct BlockMaskView {
  bool present = false;
  int64_t block_q = 0;
  int64_t block_k = 0;
  int64_t num_batch = 0;
  int64_t num_heads = 0;
  absl::Span<const int32_t> row_ptr;
  absl::Span<const int32_t> col_idx;
};

// The score modifiers and masks as sent, each off unless present
// (AttentionOptions fields 10..14). Views into memory the front-end keeps
// alive until the call's completion, like q, k and v.
struct ScoreModsView {
  std::optional<absl::Span<const float>> alibi_slopes;  // [Hq]
  std::optional<absl::Span<const float>> sinks;         // [Hq]
  TensorView bias{0, {}, {}, /*absent=*/true};
  // One byte per element; `dtype` is not read (the front-end checked its own).
  TensorView mask{0, {}, {}, /*absent=*/true};
  BlockMaskView block_mask;
};

// O's and LSE's sizes once a call is valid, for the front-end to place and
// later encode them.
struct OutputLayout {
  DType o_dtype = DType::kFP16;
  int64_t o_bytes = 0;
  std::vector<int64_t> o_shape;  // Q's shape
  int64_t lse_bytes = 0;
  // Set iff return_lse. FP32: dense [B, Hq, Sq], varlen or K/V [Hq, Tq].
  std::vector<int64_t> lse_shape;
};

// Where the backend writes a call's outputs. Runs on the executor just before
// compute (so large buffers are never allocated for calls that never run):
// sets *o and *lse (lse only when layout.lse_shape is set) to memory of at least
// those sizes that stays valid until the call's completion. An error fails
// the call before compute.
using OutputSink = std::function<absl::Status(const OutputLayout& layout, void** o, float** lse)>;

// Where a sink put o and lse: kHostMemory, or the CUDA device whose memory
// it pointed them into (a client's CUDA shared-memory region). A sink that
// binds device memory sets these (AttentionCall::output_devices).
struct OutputDevices {
  int o = kHostMemory;
  int lse = kHostMemory;
};

// One attention call (Forward, the KServe `attention` model).
struct AttentionCall {
  CallMeta meta;
  TensorView q, k, v;
  // Varlen offsets (B+1 each); empty for dense calls.
  absl::Span<const int32_t> cu_seqlens_q, cu_seqlens_k;
  StatedOptions options;
  ScoreModsView mods;
  // Bytes the call brought (its message, plus tensors read from shared
  // memory): what --max_request_bytes bounds.
  int64_t request_bytes = 0;
  OutputSink sink;
  // Set by `sink` when it binds an output to device memory; host otherwise.
  // A call with any tensor in device memory runs in a launch of its own.
  OutputDevices output_devices;
};

// One sequence's part of an append-and-attend call.
struct KvStepRequest {
  uint64_t sequence_id = 0;
  int32_t expected_length = 0;  // the sequence's length before the call (the retry guard)
  int32_t num_new_tokens = 0;
  int32_t num_queries = 0;
  // History pages to attend (kv.proto's attend_pages; empty: all), a view of
  // memory the front-end keeps alive like the tensors.
  absl::Span<const int32_t> attend_pages;
};

// One append-and-attend call on a server-side K/V cache (docs/kv-cache.md):
// new K/V rows appended to each sequence, then the new queries attended
// over the whole sequence at `layer`.
struct KvCall {
  CallMeta meta;
  std::string cache_id;
  int32_t layer = 0;
  std::vector<KvStepRequest> steps;
  TensorView q, k, v;  // packed rows: [Tq, Hq, D], [Tk, Hkv, D]
  // FP8 caches given FP8_E4M3 k and v: their scales, FP32 [Tk, Hkv].
  TensorView k_scale{0, {}, {}, /*absent=*/true};
  TensorView v_scale{0, {}, {}, /*absent=*/true};
  StatedOptions options;
  // ALiBi slopes, sinks, a bias and an element mask apply (validate_mods.h
  // says their K/V layout); a block mask is refused.
  ScoreModsView mods;
  int64_t request_bytes = 0;
  // False: the steps append at whatever length the calls before them left
  // (a protocol without the retry guard); expected_length is ignored.
  bool check_lengths = true;
};

}  // namespace attnserve
