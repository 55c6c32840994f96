// Attention-option request parameters; see v2_options.h.
#include "server/kserve/v2_options.h"

#include <climits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/kserve/v2_tensors.h"

namespace attnserve {

bool IsProtocolParameter(const std::string& name) {
  return name == "priority" || name == "timeout" || name == "binary_data_output" ||
         absl::StartsWith(name, "triton_");
}

absl::StatusOr<bool> ApplyAttentionOption(const std::string& name,
                                          const inference::InferParameter& p,
                                          StatedOptions* options) {
  const std::string where = absl::StrCat("parameters['", name, "']");
  if (name == "causal" || name == "return_lse") {
    absl::StatusOr<bool> b = BoolParameter(where, p);
    if (!b.ok()) return b.status();
    (name == "causal" ? options->causal : options->return_lse) = *b;
    return true;
  }
  if (name == "batch_invariant") {
    absl::StatusOr<bool> b = BoolParameter(where, p);
    if (!b.ok()) return b.status();
    options->batch_invariant = *b;
    return true;
  }
  if (name == "window_left" || name == "window_right") {
    absl::StatusOr<int64_t> w = IntParameter(where, p);
    if (!w.ok()) return w.status();
    // Negative values reach validation, which names the option.
    if (*w < INT_MIN || *w > INT_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected 0..", INT_MAX, ", got ", *w));
    }
    (name == "window_left" ? options->window_left : options->window_right) =
        static_cast<int32_t>(*w);
    return true;
  }
  if (name == "softcap" || name == "softmax_scale") {
    absl::StatusOr<double> d = DoubleParameter(where, p);
    if (!d.ok()) return d.status();
    if (name == "softcap") {
      options->softcap = static_cast<float>(*d);
    } else {
      options->softmax_scale = static_cast<float>(*d);
    }
    return true;
  }
  return false;
}

}  // namespace attnserve
