// Native calls over shared memory; see shm_calls.h.
#include "server/native/shm_calls.h"

#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/native/forward_call.h"

namespace attnserve {
namespace {

absl::Status LseWithoutReturnLse(const v1::OutputRegions& out, bool return_lse) {
  if (!out.has_lse() || return_lse) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "output_shm.lse: expected only with options.return_lse (there is no lse to write)");
}

// The bytes `ref`'s span must hold for output `field`: o like q (its dtype
// and shape), lse FP32 [Hq, Tq]. Nothing when q's dtype or shape is not
// one the cache takes: the call is refused for that later, before it runs.
std::optional<int64_t> KvOutputBytes(const v1::Tensor& q, bool lse) {
  if (q.shape_size() != 3 || q.dtype() < static_cast<int>(DType::kFP16) ||
      q.dtype() > static_cast<int>(DType::kFP32)) {
    return std::nullopt;
  }
  int64_t n = lse ? 4 : DTypeSize(static_cast<DType>(q.dtype()));
  for (int i = 0; i < (lse ? 2 : 3); ++i) {
    const int64_t d = q.shape(i);
    if (d < 0 || (d > 0 && n > (int64_t{1} << 62) / d)) return std::nullopt;
    n *= d;
  }
  return n;
}

absl::Status WriteOutput(const ShmOutput& out, absl::string_view field, v1::Tensor* tensor) {
  const std::string& bytes = tensor->data();
  RETURN_IF_ERROR(CheckOutputSize(field, *out.ref, static_cast<int64_t>(bytes.size())));
  absl::Status written = out.span.region->Write(out.offset, bytes.data(), bytes.size());
  if (!written.ok()) {
    return absl::Status(written.code(), absl::StrCat(field, ": ", written.message()));
  }
  const std::vector<int64_t> shape(tensor->shape().begin(), tensor->shape().end());
  ShapeSharedTensor(tensor->dtype(), shape, *out.ref, tensor);
  return absl::OkStatus();
}

}  // namespace

absl::Status ForwardShmInputs(const v1::ForwardRequest& request, ShmRead how, ShmCall* shm,
                              AttentionCall* call) {
  RETURN_IF_ERROR(shm->Input("q", request.q(), how, &call->q, &call->request_bytes));
  RETURN_IF_ERROR(shm->Input("k", request.k(), how, &call->k, &call->request_bytes));
  RETURN_IF_ERROR(shm->Input("v", request.v(), how, &call->v, &call->request_bytes));
  if (request.options().has_bias()) {
    RETURN_IF_ERROR(shm->Input("options.bias", request.options().bias(), ShmRead::kHostInPlace,
                               &call->mods.bias, &call->request_bytes));
  }
  return absl::OkStatus();
}

absl::Status BindForwardShmOutputs(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                                   ShmCall* shm, AttentionCall* call) {
  if (!request.has_output_shm()) return absl::OkStatus();
  const v1::OutputRegions& out = request.output_shm();
  RETURN_IF_ERROR(LseWithoutReturnLse(out, request.options().return_lse()));
  std::optional<ShmOutput> o, lse;
  if (out.has_o()) {
    ASSIGN_OR_RETURN(o, shm->Output("output_shm.o", out.o()));
  }
  if (out.has_lse()) {
    ASSIGN_OR_RETURN(lse, shm->Output("output_shm.lse", out.lse()));
  }
  call->sink = [o, lse, response, call, in_response = std::move(call->sink)](
                   const OutputLayout& layout, void** o_ptr, float** lse_ptr) -> absl::Status {
    if (o.has_value()) {
      RETURN_IF_ERROR(CheckOutputSize("output_shm.o", *o->ref, layout.o_bytes));
    }
    const bool has_lse = !layout.lse_shape.empty();
    if (lse.has_value() && has_lse) {
      RETURN_IF_ERROR(CheckOutputSize("output_shm.lse", *lse->ref, layout.lse_bytes));
    }
    if (!o.has_value()) {
      // o goes into the response as without shared memory (lse too, unless
      // it has a span).
      OutputLayout only_o = layout;
      if (lse.has_value()) {
        only_o.lse_shape.clear();
        only_o.lse_bytes = 0;
      }
      RETURN_IF_ERROR(in_response(only_o, o_ptr, lse_ptr));
    } else {
      *o_ptr = o->span.data;
      call->output_devices.o = o->span.device;
      ShapeSharedTensor(static_cast<int>(layout.o_dtype), layout.o_shape, *o->ref,
                        response->mutable_o());
      if (has_lse && !lse.has_value()) {
        try {
          ShapeFloatTensor(layout.lse_shape, layout.lse_bytes, response->mutable_lse());
        } catch (const std::bad_alloc&) {
          response->clear_o();
          response->clear_lse();
          return absl::ResourceExhaustedError(absl::StrCat(
              "lse: cannot allocate ", layout.lse_bytes, " bytes of host memory for it"));
        }
        *lse_ptr = reinterpret_cast<float*>(response->mutable_lse()->mutable_data()->data());
      }
    }
    if (lse.has_value() && has_lse) {
      *lse_ptr = reinterpret_cast<float*>(lse->span.data);
      call->output_devices.lse = lse->span.device;
      ShapeSharedTensor(static_cast<int>(DType::kFP32), layout.lse_shape, *lse->ref,
                        response->mutable_lse());
    }
    return absl::OkStatus();
  };
  return absl::OkStatus();
}

absl::Status KvShmInputs(const v1::AppendAttendRequest& request, ShmCall* shm, KvCall* call) {
  // Read where they lie: a region shrunk during the call fails it before the
  // append commits (ShmCall::CheckIntact, asked by the pool).
  RETURN_IF_ERROR(shm->Input("q", request.q(), ShmRead::kInPlace, &call->q, &call->request_bytes));
  RETURN_IF_ERROR(shm->Input("k", request.k(), ShmRead::kInPlace, &call->k, &call->request_bytes));
  RETURN_IF_ERROR(shm->Input("v", request.v(), ShmRead::kInPlace, &call->v, &call->request_bytes));
  if (request.has_k_scale()) {
    RETURN_IF_ERROR(shm->Input("k_scale", request.k_scale(), ShmRead::kCopy, &call->k_scale,
                               &call->request_bytes));
  }
  if (request.has_v_scale()) {
    RETURN_IF_ERROR(shm->Input("v_scale", request.v_scale(), ShmRead::kCopy, &call->v_scale,
                               &call->request_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvShmOutputs> KvShmOutputSpans(const v1::AppendAttendRequest& request,
                                              ShmCall* shm) {
  KvShmOutputs spans;
  if (!request.has_output_shm()) return spans;
  const v1::OutputRegions& out = request.output_shm();
  RETURN_IF_ERROR(LseWithoutReturnLse(out, request.options().return_lse()));
  if (out.has_o()) {
    if (std::optional<int64_t> bytes = KvOutputBytes(request.q(), false); bytes.has_value()) {
      RETURN_IF_ERROR(CheckOutputSize("output_shm.o", out.o(), *bytes));
    }
    ASSIGN_OR_RETURN(spans.o, shm->Output("output_shm.o", out.o()));
  }
  if (out.has_lse()) {
    if (std::optional<int64_t> bytes = KvOutputBytes(request.q(), true); bytes.has_value()) {
      RETURN_IF_ERROR(CheckOutputSize("output_shm.lse", out.lse(), *bytes));
    }
    ASSIGN_OR_RETURN(spans.lse, shm->Output("output_shm.lse", out.lse()));
  }
  return spans;
}

KvOutputPlace KvShmOutputPlace(const KvShmOutputs& outputs) {
  KvOutputPlace place;
  if (outputs.o.has_value() && !outputs.o->span.on_device()) {
    place.o = outputs.o->span.data;
    place.o_bytes = static_cast<int64_t>(outputs.o->span.size);
  }
  return place;
}

absl::Status DeliverKvShm(const KvShmOutputs& outputs, bool o_in_place,
                          v1::AppendAttendResponse* response) {
  if (outputs.o.has_value() && o_in_place) {
    const ShmOutput& out = *outputs.o;
    if (absl::Status intact = out.span.region->CheckIntact(); !intact.ok()) {
      return absl::Status(intact.code(), absl::StrCat("output_shm.o: ", intact.message()));
    }
    v1::Tensor* o = response->mutable_o();
    const std::vector<int64_t> shape(o->shape().begin(), o->shape().end());
    ShapeSharedTensor(o->dtype(), shape, *out.ref, o);
  } else if (outputs.o.has_value()) {
    RETURN_IF_ERROR(WriteOutput(*outputs.o, "output_shm.o", response->mutable_o()));
  }
  if (outputs.lse.has_value() && response->has_lse()) {
    RETURN_IF_ERROR(WriteOutput(*outputs.lse, "output_shm.lse", response->mutable_lse()));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
