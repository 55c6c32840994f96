// Forward messages to and from the core's call; see forward_call.h.
#include "server/native/forward_call.h"

#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/validate.h"

namespace attnserve {

TensorView ViewOf(const v1::Tensor& t) {
  TensorView view;
  view.dtype = t.dtype();
  view.shape = absl::MakeConstSpan(t.shape().data(), static_cast<size_t>(t.shape_size()));
  view.bytes = t.data();
  view.absent = t.shape_size() == 0 && t.data().empty();
  return view;
}

StatedOptions OptionsOf(const v1::AttentionOptions& o) {
  StatedOptions options;
  if (o.has_softmax_scale()) options.softmax_scale = o.softmax_scale();
  options.causal = o.causal();
  if (o.has_window_left()) options.window_left = o.window_left();
  if (o.has_window_right()) options.window_right = o.window_right();
  options.softcap = o.softcap();
  options.return_lse = o.return_lse();
  if (o.has_q_descale()) options.q_descale = o.q_descale();
  if (o.has_k_descale()) options.k_descale = o.k_descale();
  if (o.has_v_descale()) options.v_descale = o.v_descale();
  options.batch_invariant = o.batch_invariant();
  return options;
}

ScoreModsView ModsOf(const v1::AttentionOptions& o) {
  ScoreModsView mods;
  // An empty list is no list: Hq >= 1 values are needed to mean anything.
  if (o.alibi_slopes_size() > 0) {
    mods.alibi_slopes =
        absl::MakeConstSpan(o.alibi_slopes().data(), static_cast<size_t>(o.alibi_slopes_size()));
  }
  if (o.sinks_size() > 0) {
    mods.sinks = absl::MakeConstSpan(o.sinks().data(), static_cast<size_t>(o.sinks_size()));
  }
  if (o.has_bias()) {
    mods.bias = ViewOf(o.bias());
    mods.bias.absent = false;
  }
  if (o.has_mask()) {
    mods.mask.shape =
        absl::MakeConstSpan(o.mask().shape().data(), static_cast<size_t>(o.mask().shape_size()));
    mods.mask.bytes = o.mask().data();
    mods.mask.absent = false;
  }
  if (o.has_block_mask()) {
    const v1::BlockMask& b = o.block_mask();
    BlockMaskView& m = mods.block_mask;
    m.present = true;
    m.block_q = b.block_q();
    m.block_k = b.block_k();
    m.num_batch = b.num_batch();
    m.num_heads = b.num_heads();
    m.row_ptr = absl::MakeConstSpan(b.row_ptr().data(), static_cast<size_t>(b.row_ptr_size()));
    m.col_idx = absl::MakeConstSpan(b.col_idx().data(), static_cast<size_t>(b.col_idx_size()));
  }
  return mods;
}

void ShapeFloatTensor(const std::vector<int64_t>& shape, int64_t bytes, v1::Tensor* out) {
  out->set_dtype(v1::FP32);
  out->clear_shape();
  for (int64_t d : shape) out->add_shape(d);
  out->mutable_data()->resize(static_cast<size_t>(bytes));
}

AttentionCall ForwardCallOf(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                            CallMeta meta) {
  AttentionCall call;
  call.meta = std::move(meta);
  call.meta.id = request.request_id();
  call.q = ViewOf(request.q());
  call.k = ViewOf(request.k());
  call.v = ViewOf(request.v());
  call.cu_seqlens_q = absl::MakeConstSpan(request.cu_seqlens_q().data(),
                                          static_cast<size_t>(request.cu_seqlens_q_size()));
  call.cu_seqlens_k = absl::MakeConstSpan(request.cu_seqlens_k().data(),
                                          static_cast<size_t>(request.cu_seqlens_k_size()));
  call.options = OptionsOf(request.options());
  call.mods = ModsOf(request.options());
  call.request_bytes = static_cast<int64_t>(request.ByteSizeLong());
  // The backend writes into the response's own buffers, the bytes that go
  // on the wire. Runs on the executor, where a throw would take the server
  // down: an allocation failure is RESOURCE_EXHAUSTED and binds nothing.
  call.sink = [response](const OutputLayout& layout, void** o, float** lse) -> absl::Status {
    try {
      v1::Tensor* out = response->mutable_o();
      out->set_dtype(static_cast<v1::DType>(layout.o_dtype));
      out->clear_shape();
      for (int64_t d : layout.o_shape) out->add_shape(d);
      out->mutable_data()->resize(static_cast<size_t>(layout.o_bytes));
      *o = out->mutable_data()->data();
      if (!layout.lse_shape.empty()) {
        ShapeFloatTensor(layout.lse_shape, layout.lse_bytes, response->mutable_lse());
        *lse = reinterpret_cast<float*>(response->mutable_lse()->mutable_data()->data());
      }
    } catch (const std::bad_alloc&) {
      response->clear_o();
      response->clear_lse();
      return absl::ResourceExhaustedError(absl::StrCat("o: cannot allocate ", layout.o_bytes,
                                                       " bytes of host memory for the output",
                                                       layout.lse_shape.empty() ? "" : " and lse"));
    }
    return absl::OkStatus();
  };
  return call;
}

void FillServerTiming(const WorkTimings& timings, v1::ServerTiming* t) {
  t->set_queue_us(timings.queue_us);
  t->set_host_to_device_us(timings.host_to_device_us);
  t->set_compute_us(timings.compute_us);
  t->set_device_to_host_us(timings.device_to_host_us);
  t->set_total_us(timings.total_us);
  t->set_batch_size(timings.batch_size);
  t->set_device(timings.device);
}

void FinishForwardResponse(const v1::ForwardRequest& request, const absl::Status& status,
                           const WorkTimings& timings, const std::string& backend,
                           v1::ForwardResponse* response) {
  // An over-long id was refused; its answer carries only the allowed prefix,
  // so refusing it costs no more than serving a valid one.
  response->set_request_id(request.request_id().substr(0, kMaxRequestIdBytes));
  response->set_backend(backend);
  if (!status.ok()) {
    // Partial outputs are meaningless and may be large: never send them.
    response->clear_o();
    response->clear_lse();
  }
  FillServerTiming(timings, response->mutable_timing());
}

}  // namespace attnserve
