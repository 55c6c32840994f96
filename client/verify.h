// Client-side verification of a Forward result against the float64 reference,
// with docs/design.md §4's tolerance policy. Used by `attnctl forward --verify` and
// by `attnctl load --check`, which computes each input's reference once
// (ForwardVerifier) and checks every response against it.
//
// The policy and its constants are backend/reference/tolerance.h's, shared
// with the tests' checker (tests/common/attn_test_util.cc): FP16/BF16 O within
// 2 * max|ref_lowp - ref| + a floor of about one ulp at 1.0; FP8 inputs are
// checked like BF16 (their O is BF16) against the references on the
// dequantised inputs (code * descale); FP32 O within a
// relative error per output vector; LSE checked separately; rows that see no
// key must give O exactly 0 and LSE exactly -inf. NaN or inf in O fails.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace attnserve {

struct VerifyReport {
  bool passed = false;
  // O against the float64 reference.
  double max_abs_err = 0.0;
  // max over elements of |out - ref| / max|ref of its vector|: relative to
  // each output vector's scale, so elements that are near-zero sums do not
  // turn rounding noise into huge ratios.
  double max_rel_err = 0.0;
  double max_abs_ref = 0.0;
  // max|ref_lowp - ref| (0 for FP32).
  double lowp_err = 0.0;
  // The bound max_abs_err is held to (low precision), or the relative bound
  // (FP32, checked per element with its absolute floor).
  double tolerance = 0.0;
  std::string tolerance_rule;  // how `tolerance` was formed, for printing
  // LSE, when the result carries it.
  bool lse_checked = false;
  double lse_max_abs_err = 0.0;
  double lse_tolerance = 0.0;
  std::string lse_tolerance_rule;
  // Empty when passed; otherwise the first reason, with coordinates.
  std::string failure;
};

// The references of one input, computed once, so many results can be checked
// against them at the cost of a comparison (the float64 reference is O(N^2)
// per row and would otherwise dominate a load test). Immutable after Create,
// so Check may run on many threads at once.
class ForwardVerifier {
 public:
  // INVALID_ARGUMENT if `inputs` are not a valid call.
  static absl::StatusOr<ForwardVerifier> Create(const AttentionInputs& inputs);

  // INVALID_ARGUMENT if `result` does not match the inputs in shape and
  // dtype; otherwise the comparison (which may have failed).
  absl::StatusOr<VerifyReport> Check(const ForwardResult& result) const;

 private:
  struct State;
  explicit ForwardVerifier(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// ForwardVerifier::Create(inputs) and Check(result) in one step.
absl::StatusOr<VerifyReport> VerifyForward(const AttentionInputs& inputs,
                                           const ForwardResult& result);

}  // namespace attnserve
