// VerifyForward: rebuilds AttnParams from the client's inputs, runs both
// references and applies the tolerance policy described in verify.h.
#include "client/verify.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "backend/make_params.h"
#include "backend/reference/reference_attention.h"
#include "backend/reference/tolerance.h"
#include "client/inputs.h"
#include "client/score_mods.h"
#include "common/dtype.h"

namespace attnserve {
namespace {

// The constants the tests use too (backend/reference/tolerance.h).
using tolerance::kFp32Atol;
using tolerance::kFp32LseAtol;
using tolerance::kFp32Rtol;
using tolerance::kLowpLseFloor;
using tolerance::OutputFloor;

AttnParams MakeParams(const AttentionInputs& in, const InputsSummary& s) {
  AttnShape shape;
  shape.dtype = s.dtype;
  shape.batch = static_cast<int32_t>(s.batch);
  shape.num_heads_q = static_cast<int32_t>(s.heads_q);
  shape.num_heads_kv = static_cast<int32_t>(s.heads_kv);
  shape.head_dim = static_cast<int32_t>(s.head_dim);
  shape.head_dim_v = static_cast<int32_t>(s.head_dim_v);
  shape.seqlen_q = static_cast<int32_t>(s.seqlen_q);
  shape.seqlen_k = static_cast<int32_t>(s.seqlen_k);
  if (s.varlen) {
    shape.cu_seqlens_q = in.cu_seqlens_q.data();
    shape.cu_seqlens_k = in.cu_seqlens_k.data();
  }
  AttnPointers pointers;
  pointers.q = in.q.data();
  pointers.k = in.k.data();
  pointers.v = in.v.data();
  pointers.mods = AttnModsOf(in.mods, s);
  // The same function as the server's FillParams: --verify cannot agree with
  // a server whose defaults or mask normalisation drifted.
  return MakeAttnParams(shape, in.options, pointers);
}

// Index into ReferenceOutput::lse of the row that o element `idx` belongs to.
int64_t LseIndexOfO(const AttnParams& p, int64_t idx) {
  const int64_t row = idx / (int64_t{p.num_heads_q} * HeadDimV(p));
  const int h = static_cast<int>((idx / HeadDimV(p)) % p.num_heads_q);
  if (IsVarlen(p)) return int64_t{h} * p.total_q + row;
  const int b = static_cast<int>(row / p.seqlen_q);
  return LseOffset(p, b, h, static_cast<int>(row % p.seqlen_q));
}

// fp8_p_term: tolerance::Fp8PTerm of the call (0 unless FP8), computed while
// its V was still in memory.
void CheckO(const AttnParams& p, const ReferenceOutput& ref, const ReferenceOutput* lowp,
            double fp8_p_term, const std::vector<float>& out, VerifyReport* r) {
  // The scale of each output vector (one query row of one head).
  const int64_t d = HeadDimV(p);
  std::vector<double> vec_scale(out.size() / std::max<int64_t>(d, 1), 0.0);
  for (size_t i = 0; i < out.size(); ++i) {
    vec_scale[i / d] = std::max(vec_scale[i / d], std::fabs(ref.o[i]));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i]) && r->failure.empty()) {
      r->failure =
          absl::StrCat("o[flat ", i, "] = ", out[i], " is not finite (reference ", ref.o[i], ")");
    }
    if (out[i] != 0.0f && std::isinf(ref.lse[LseIndexOfO(p, i)]) && r->failure.empty()) {
      r->failure =
          absl::StrCat("o[flat ", i, "] = ", out[i], ", expected exactly 0 (the row sees no key)");
    }
    const double err = std::fabs(out[i] - ref.o[i]);
    r->max_abs_err = std::max(r->max_abs_err, err);
    r->max_abs_ref = std::max(r->max_abs_ref, std::fabs(ref.o[i]));
    if (vec_scale[i / d] > 0) r->max_rel_err = std::max(r->max_rel_err, err / vec_scale[i / d]);
    if (lowp != nullptr) r->lowp_err = std::max(r->lowp_err, std::fabs(lowp->o[i] - ref.o[i]));
  }
  if (lowp != nullptr) {
    // FP8: the floor carries the E4M3 rounding of P.
    const double floor = OutputFloor(p.dtype) + fp8_p_term;
    r->tolerance = 2.0 * r->lowp_err + floor;
    r->tolerance_rule = absl::StrCat("2 * max|ref_lowp - ref| + ", floor);
    if (r->failure.empty() && r->max_abs_err > r->tolerance) {
      r->failure = absl::StrCat("max|o - ref| = ", r->max_abs_err, " > tolerance ", r->tolerance);
    }
    return;
  }
  r->tolerance = kFp32Rtol;
  r->tolerance_rule =
      absl::StrCat("|err| <= ", kFp32Rtol, " * max|ref of the vector| + ", kFp32Atol);
  for (size_t i = 0; i < out.size() && r->failure.empty(); ++i) {
    const double err = std::fabs(out[i] - ref.o[i]);
    const double allowed = kFp32Rtol * vec_scale[i / d] + kFp32Atol;
    if (err > allowed) {
      r->failure = absl::StrCat("o[flat ", i, "] = ", out[i], ", reference ", ref.o[i], ", |err| ",
                                err, " > ", allowed);
    }
  }
}

void CheckLse(const ReferenceOutput& ref, const ReferenceOutput* lowp,
              const std::vector<float>& lse, VerifyReport* r) {
  r->lse_checked = true;
  double lowp_err = 0.0;
  for (size_t i = 0; i < lse.size(); ++i) {
    const double want = ref.lse[i];
    if (std::isinf(want)) {
      if (!(std::isinf(lse[i]) && lse[i] < 0) && r->failure.empty()) {
        r->failure =
            absl::StrCat("lse[flat ", i, "] = ", lse[i], ", expected -inf (the row sees no key)");
      }
      continue;
    }
    if (!std::isfinite(lse[i])) {
      if (r->failure.empty()) {
        r->failure = absl::StrCat("lse[flat ", i, "] = ", lse[i], ", expected ", want);
      }
      continue;
    }
    r->lse_max_abs_err = std::max(r->lse_max_abs_err, std::fabs(lse[i] - want));
    if (lowp != nullptr) lowp_err = std::max(lowp_err, std::fabs(lowp->lse[i] - want));
  }
  if (lowp != nullptr) {
    r->lse_tolerance = 2.0 * lowp_err + kLowpLseFloor;
    r->lse_tolerance_rule =
        absl::StrCat(r->lse_tolerance, " = 2 * max|lse_lowp - ref| + ", kLowpLseFloor);
    if (r->failure.empty() && r->lse_max_abs_err > r->lse_tolerance) {
      r->failure =
          absl::StrCat("max|lse - ref| = ", r->lse_max_abs_err, " > tolerance ", r->lse_tolerance);
    }
    return;
  }
  r->lse_tolerance = kFp32Rtol;
  r->lse_tolerance_rule = absl::StrCat("|err| <= ", kFp32Rtol, " * |ref| + ", kFp32LseAtol);
  for (size_t i = 0; i < lse.size() && r->failure.empty(); ++i) {
    if (std::isinf(ref.lse[i])) continue;
    const double err = std::fabs(lse[i] - ref.lse[i]);
    const double allowed = kFp32Rtol * std::fabs(ref.lse[i]) + kFp32LseAtol;
    if (err > allowed) {
      r->failure = absl::StrCat("lse[flat ", i, "] = ", lse[i], ", reference ", ref.lse[i],
                                ", |err| ", err, " > ", allowed);
    }
  }
}

}  // namespace

struct ForwardVerifier::State {
  // Sizes, options and cu_seqlens (own copies): the tensor pointers are
  // cleared once the references exist, because the inputs need not outlive
  // the verifier.
  AttnParams params;
  std::vector<int32_t> cu_seqlens_q, cu_seqlens_k;
  std::vector<int64_t> o_shape;
  DType dtype;  // O's (BF16 for FP8 inputs)
  ReferenceOutput ref;
  std::optional<ReferenceOutput> lowp;  // FP16/BF16/FP8 only
  double fp8_p_term = 0.0;              // tolerance::Fp8PTerm, taken while V is at hand
};

absl::StatusOr<ForwardVerifier> ForwardVerifier::Create(const AttentionInputs& inputs) {
  absl::StatusOr<InputsSummary> s = SummarizeInputs(inputs);
  if (!s.ok()) return s.status();
  // The reference reads the mods through the shapes they claim.
  const absl::Status mods =
      CheckScoreMods(inputs.mods, *s, inputs.cu_seqlens_q, inputs.cu_seqlens_k);
  if (!mods.ok()) return mods;
  auto state = std::make_shared<State>();
  state->params = MakeParams(inputs, *s);
  state->o_shape = inputs.q.shape();
  if (!state->o_shape.empty()) state->o_shape.back() = s->head_dim_v;  // O has V's head dim
  state->dtype = OutputDType(inputs.q.dtype());
  state->ref = ReferenceAttention(state->params);
  if (state->params.dtype != DType::kFP32) {
    state->lowp = ReferenceAttentionLowPrecision(state->params);
  }
  state->fp8_p_term = tolerance::Fp8PTerm(state->params);
  state->params.q = state->params.k = state->params.v = nullptr;
  // Like q/k/v, the mods' arrays belong to the inputs; Check reads no mods.
  state->params.alibi_slopes = state->params.sinks = nullptr;
  state->params.bias = nullptr;
  state->params.mask = nullptr;
  state->params.block_row_ptr = state->params.block_col_idx = nullptr;
  if (s->varlen) {
    state->cu_seqlens_q = inputs.cu_seqlens_q;
    state->cu_seqlens_k = inputs.cu_seqlens_k;
    state->params.cu_seqlens_q = state->cu_seqlens_q.data();
    state->params.cu_seqlens_k = state->cu_seqlens_k.data();
  }
  return ForwardVerifier(std::move(state));
}

absl::StatusOr<VerifyReport> ForwardVerifier::Check(const ForwardResult& result) const {
  const State& st = *state_;
  if (result.o.shape() != st.o_shape || result.o.dtype() != st.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("o is ", result.o.DebugString(), ", expected ",
                                                   std::string(DTypeName(st.dtype)),
                                                   ShapeString(st.o_shape)));
  }
  const ReferenceOutput* lowp = st.lowp ? &*st.lowp : nullptr;
  VerifyReport r;
  CheckO(st.params, st.ref, lowp, st.fp8_p_term, result.o.ToFloats(), &r);
  if (result.lse) {
    if (result.lse->num_elements() != static_cast<int64_t>(st.ref.lse.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lse is ", result.lse->DebugString(), ", expected ", st.ref.lse.size(), " elements"));
    }
    CheckLse(st.ref, lowp, result.lse->ToFloats(), &r);
  }
  r.passed = r.failure.empty();
  return r;
}

absl::StatusOr<VerifyReport> VerifyForward(const AttentionInputs& inputs,
                                           const ForwardResult& result) {
  absl::StatusOr<ForwardVerifier> verifier = ForwardVerifier::Create(inputs);
  if (!verifier.ok()) return verifier.status();
  return verifier->Check(result);
}

}  // namespace attnserve
