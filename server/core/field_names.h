// How a front-end's protocol names the fields of a call, so that one set of
// checks (server/core/validate.h) speaks every caller's own words: the
// native API says `q.shape` and `options.causal`, KServe v2 says
// `inputs['q'].shape` and `parameters['causal']`.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace attnserve {

// The contract's own names (docs/design.md, which the native API follows)
// are the defaults.
std::string ContractDTypeName(int code);
std::string ContractOptionName(absl::string_view name);
std::string ContractStepField(int index, absl::string_view field);

struct FieldNames {
  // The tensors (followed by "." + dtype, "shape" or "data").
  const char* q = "q";
  const char* k = "k";
  const char* v = "v";
  // The field that holds a tensor's element type.
  const char* dtype = "dtype";
  const char* cu_seqlens_q = "cu_seqlens_q";
  const char* cu_seqlens_k = "cu_seqlens_k";
  const char* request_id = "request_id";
  const char* layer = "layer";
  const char* steps = "sequences";
  // The score modifiers and masks (bias and mask are tensors as above).
  const char* alibi_slopes = "options.alibi_slopes";
  const char* sinks = "options.sinks";
  const char* bias = "options.bias";
  const char* mask = "options.mask";
  const char* block_q = "options.block_mask.block_q";
  const char* block_k = "options.block_mask.block_k";
  const char* block_num_batch = "options.block_mask.num_batch";
  const char* block_num_heads = "options.block_mask.num_heads";
  const char* block_row_ptr = "options.block_mask.row_ptr";
  const char* block_col_idx = "options.block_mask.col_idx";
  // The name of a raw dtype code ("FP16", or the protocol's word for an
  // unknown one).
  std::string (*dtype_name)(int code) = ContractDTypeName;
  // An attention option: "options.causal" or "parameters['causal']".
  std::string (*option)(absl::string_view name) = ContractOptionName;
  // A field of step `index` of a K/V call ("sequences[2].expected_length";
  // an empty field names the step) or, where a call carries one step,
  // "parameters['expected_length']".
  std::string (*step)(int index, absl::string_view field) = ContractStepField;
};

// The defaults, for callers that speak the contract's words.
const FieldNames& ContractFieldNames();

}  // namespace attnserve
