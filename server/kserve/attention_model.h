// The KServe v2 model `attention` (and `attention_dense`, see below): one
// ModelInferRequest becomes one core AttentionCall and runs through the
// AttentionRunner, so it gets the same checks (named in v2 words), limits,
// executor, batcher, backends and metrics as the native Forward. Inputs q, k, v (FP16, BF16 or
// FP32) and optionally cu_seqlens_q, cu_seqlens_k (INT32, varlen), alibi_slopes, sinks (FP32
// [Hq]), bias (FP32/FP16/BF16), mask (BOOL), block_row_ptr, block_col_idx (INT32); request
// parameters causal, window_left, window_right, softcap, softmax_scale, return_lse, and
// block_q, block_k, block_num_batch, block_num_heads with a block mask; outputs o and, when
// return_lse is set or lse is requested, lse. docs/kserve.md, docs/design.md §2.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/params.h"
#include "server/core/attention_runner.h"
#include "server/kserve/model.h"
#include "server/kserve/v2_tensors.h"
#include "server/metrics.h"
#include "server/shm/shm_registry.h"

namespace attnserve {

struct AttentionModelInfo {
  // "attention" takes the optional inputs (varlen cu_seqlens_q/k, and the
  // score modifiers' and masks' tensors and parameters); "attention_dense"
  // (varlen_inputs false) is the same model without any of them,
  // because perf_analyzer 2.50 refuses shared memory for a model with optional
  // inputs.
  std::string name = "attention";
  bool varlen_inputs = true;
  std::string backend;              // "cpu" or "cuda"
  DType advertised = DType::kFP16;  // the datatype metadata and config list for q, k, v and o
  bool batching = false;
  int64_t batch_max_delay_us = 0;
};

class AttentionModel final : public KserveModel {
 public:
  // Everything passed must outlive the model.
  AttentionModel(AttentionRunner* runner, const ShmRegistry* shm, const ServerMetrics* metrics,
                 AttentionModelInfo info);

  const std::string& name() const override { return name_; }
  bool ready() const override { return true; }
  void FillMetadata(inference::ModelMetadataResponse* out) const override;
  void FillConfig(inference::ModelConfig* out) const override;
  void FillStatistics(inference::ModelStatistics* out) const override;
  void Infer(InferCall call) override;

 private:
  struct Call;
  // Turns the v2 request into call->attention and plans the outputs.
  absl::Status Prepare(Call* call) const;
  // The optional inputs of the score modifiers and masks into
  // call->attention.mods (index_of: IndexInputs' answer).
  absl::Status TakeMods(const InputSource& source, const std::vector<int>& index_of,
                        Call* call) const;
  // A block mask's inputs and parameters (block_given: per kBlockParameters)
  // are all given or none; sets mods.block_mask.present.
  absl::Status CheckBlockMaskComplete(const std::vector<int>& index_of, const bool* block_given,
                                      Call* call) const;
  // Moves the call's outputs into the v2 response (or shared memory).
  absl::Status Deliver(Call* call, const WorkTimings& timings) const;

  AttentionRunner* const runner_;
  const ShmRegistry* const shm_;
  const ServerMetrics* const metrics_;
  const AttentionModelInfo info_;
  const std::string& name_ = info_.name;
};

}  // namespace attnserve
