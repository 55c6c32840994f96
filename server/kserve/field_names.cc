// KServe v2's field names; see field_names.h.
#include "server/kserve/field_names.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

std::string Parameter(absl::string_view name) { return absl::StrCat("parameters['", name, "']"); }

// An attention_kv request carries one step, its fields as parameters.
std::string StepParameter(int, absl::string_view field) {
  return field.empty() ? std::string("parameters") : Parameter(field);
}

}  // namespace

const FieldNames& V2FieldNames() {
  static const FieldNames names = [] {
    FieldNames n;
    n.q = "inputs['q']";
    n.k = "inputs['k']";
    n.v = "inputs['v']";
    n.dtype = "datatype";
    n.cu_seqlens_q = "inputs['cu_seqlens_q']";
    n.cu_seqlens_k = "inputs['cu_seqlens_k']";
    n.request_id = "id";
    n.layer = "parameters['layer']";
    n.steps = "the request";
    n.alibi_slopes = "inputs['alibi_slopes']";
    n.sinks = "inputs['sinks']";
    n.bias = "inputs['bias']";
    n.mask = "inputs['mask']";
    n.block_q = "parameters['block_q']";
    n.block_k = "parameters['block_k']";
    n.block_num_batch = "parameters['block_num_batch']";
    n.block_num_heads = "parameters['block_num_heads']";
    n.block_row_ptr = "inputs['block_row_ptr']";
    n.block_col_idx = "inputs['block_col_idx']";
    n.option = Parameter;
    n.step = StepParameter;
    return n;
  }();
  return names;
}

}  // namespace attnserve
