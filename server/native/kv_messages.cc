// KvCache messages to core and pool types and back; see kv_messages.h.
#include "server/native/kv_messages.h"

#include <utility>

#include "server/native/forward_call.h"

namespace attnserve {

KvCreateCache DecodeCreateCache(const v1::CreateCacheRequest& r) {
  KvCreateCache c;
  c.geometry.num_layers = r.geometry().num_layers();
  c.geometry.num_heads_kv = r.geometry().num_heads_kv();
  c.geometry.head_dim = r.geometry().head_dim();
  c.geometry.dtype = static_cast<DType>(r.geometry().dtype());
  c.geometry.cache_dtype = static_cast<DType>(r.geometry().cache_dtype());
  c.geometry.head_dim_v = r.geometry().head_dim_v();
  c.geometry.v_in_k = r.geometry().v_in_k();
  c.page_size = r.page_size();
  c.capacity_tokens = r.capacity_tokens();
  c.capacity_bytes = r.capacity_bytes();
  c.cache_id = r.cache_id();
  if (r.has_device()) c.device = r.device();
  c.devices.assign(r.devices().begin(), r.devices().end());
  c.reserve = r.reserve();
  return c;
}

std::vector<KvSequenceSpec> DecodeSequences(const v1::CreateSequencesRequest& r) {
  std::vector<KvSequenceSpec> specs;
  for (const v1::SequenceSpec& s : r.sequences()) {
    KvSequenceSpec spec;
    spec.sequence_id = s.sequence_id();
    if (s.has_fork_from()) spec.fork_from = s.fork_from();
    if (s.has_fork_length()) spec.fork_length = s.fork_length();
    specs.push_back(spec);
  }
  return specs;
}

KvCall KvCallOf(const v1::AppendAttendRequest& r, CallMeta meta) {
  KvCall call;
  call.meta = std::move(meta);
  call.meta.id = r.request_id();
  call.cache_id = r.cache_id();
  call.layer = r.layer();
  for (const v1::SequenceStep& s : r.sequences()) {
    call.steps.push_back(
        {s.sequence_id(), s.expected_length(), s.num_new_tokens(), s.num_queries(),
         absl::MakeConstSpan(s.attend_pages().data(), static_cast<size_t>(s.attend_pages_size()))});
  }
  call.q = ViewOf(r.q());
  call.k = ViewOf(r.k());
  call.v = ViewOf(r.v());
  // Present when sent at all, so an empty scale tensor is still refused.
  if (r.has_k_scale()) {
    call.k_scale = ViewOf(r.k_scale());
    call.k_scale.absent = false;
  }
  if (r.has_v_scale()) {
    call.v_scale = ViewOf(r.v_scale());
    call.v_scale.absent = false;
  }
  call.options = OptionsOf(r.options());
  // Every option field reaches the checks: those K/V calls refuse are named.
  call.mods = ModsOf(r.options());
  call.request_bytes = static_cast<int64_t>(r.ByteSizeLong());
  return call;
}

void FillAppendAttendResponse(KvResult* result, v1::AppendAttendResponse* response) {
  const OutputLayout& layout = result->layout;
  v1::Tensor* o = response->mutable_o();
  o->set_dtype(static_cast<v1::DType>(layout.o_dtype));
  for (int64_t d : layout.o_shape) o->add_shape(d);
  o->set_data(std::move(result->o));
  if (!layout.lse_shape.empty()) {
    v1::Tensor* lse = response->mutable_lse();
    lse->set_dtype(v1::FP32);
    for (int64_t d : layout.lse_shape) lse->add_shape(d);
    lse->set_data(std::move(result->lse));
  }
  for (int32_t len : result->lengths) response->add_lengths(len);
}

void FillCacheStats(const KvCacheStats& s, v1::CacheStats* out) {
  out->set_cache_id(s.cache_id);
  out->mutable_geometry()->set_num_layers(s.geometry.num_layers);
  out->mutable_geometry()->set_num_heads_kv(s.geometry.num_heads_kv);
  out->mutable_geometry()->set_head_dim(s.geometry.head_dim);
  out->mutable_geometry()->set_dtype(static_cast<v1::DType>(s.geometry.dtype));
  out->mutable_geometry()->set_cache_dtype(static_cast<v1::DType>(s.geometry.cache_dtype));
  out->mutable_geometry()->set_head_dim_v(s.geometry.head_dim_v);
  out->mutable_geometry()->set_v_in_k(s.geometry.v_in_k);
  out->set_page_size(s.page_size);
  out->set_device(s.device);
  out->set_capacity_pages(s.capacity_pages);
  out->set_pages_used(s.pages_used);
  out->set_pages_free(s.capacity_pages - s.pages_used);
  out->set_page_bytes(s.page_bytes);
  out->set_sequences(s.sequences);
  out->set_expired_sequences(s.expired_sequences);
  out->set_tokens(s.tokens);
}

}  // namespace attnserve
