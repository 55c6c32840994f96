// The KServe v2 model `attention_kv`: the K/V cache's append-and-attend call
// (kv.proto's AppendAttend, docs/kv-cache.md) on the protocol's sequence
// semantics, so tritonclient and perf_analyzer's sequence mode drive a decode
// loop whose K/V stay on the server. One request = one sequence at one layer:
//   - the cache: request parameter `cache_id`, else the x-attnserve-cache-id
//     header (as the native API carries it); a cache made with the native API.
//   - `layer` (required when the cache has more than one layer);
//   - `sequence_id` (non-zero; the native API's id space in that cache);
//     `sequence_start` creates it (empty, or forked with `fork_from` /
//     `fork_length`) before the call; `sequence_end` frees it after a call
//     that succeeded, or after the last call still in flight on it;
//   - optional `expected_length` (the native retry guard); without it the
//     call appends at whatever length the calls before it left;
//   - optional `attend_pages`: the history pages to attend, a string of
//     comma-separated page indices ("0,3,7"), as the native attend_pages;
//   - inputs q [Tq, Hq, D], k and v [Tk, Hkv, D] (the new tokens; zero rows
//     allowed), optional FP32 alibi_slopes and sinks [Hq] (as `attention`'s;
//     ALiBi not with attend_pages; accepted but not listed in the metadata
//     or config, which perf_analyzer's shared memory needs), outputs o [Tq, Hq, D] and lse [Hq,
//     Tq], attention options as for `attention`; `attention`'s bias, mask and block mask are
//     refused (attend_pages is the K/V sparsity).
// Each request becomes one core KvCall and runs through the KvRunner: the
// same checks (named in v2 words), limits, pool, ordering and metrics as the
// native AppendAttend. docs/kserve.md has the mapping.
#pragma once

#include <memory>
#include <string>

#include "backend/params.h"
#include "server/core/kv_runner.h"
#include "server/kserve/model.h"
#include "server/kv/kv_pool.h"
#include "server/metrics.h"
#include "server/shm/shm_registry.h"

namespace attnserve {

inline constexpr char kAttentionKvModelName[] = "attention_kv";

struct AttentionKvModelInfo {
  std::string backend;              // "cpu" or "cuda"
  DType advertised = DType::kFP16;  // the datatype metadata and config list
  absl::Duration idle_timeout;      // the pool's --kv_idle_timeout (config)
};

class AttentionKvModel final : public KserveModel {
 public:
  // Everything passed must outlive the model.
  AttentionKvModel(KvRunner* runner, const ShmRegistry* shm, const ServerMetrics* metrics,
                   AttentionKvModelInfo info);

  const std::string& name() const override { return name_; }
  bool ready() const override { return true; }
  void FillMetadata(inference::ModelMetadataResponse* out) const override;
  void FillConfig(inference::ModelConfig* out) const override;
  void FillStatistics(inference::ModelStatistics* out) const override;
  void Infer(InferCall call) override;

 private:
  struct Call;
  // The v2 request -> call->append, the sequence controls and the outputs.
  absl::Status Prepare(Call* call) const;
  // After the call: frees the sequence on sequence_end (or undoes a
  // sequence_start when the call failed) and delivers the outputs.
  absl::Status Complete(Call* call, const absl::Status& status, const WorkTimings& timings,
                        KvResult* result) const;

  KvRunner* const runner_;
  KvPool* const pool_;
  const ShmRegistry* const shm_;
  const ServerMetrics* const metrics_;
  const AttentionKvModelInfo info_;
  const std::string name_ = kAttentionKvModelName;
};

}  // namespace attnserve
