// KvCache requests to pool structs and back; see kv_request.h.
#include "server/kv_request.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backend/make_params.h"
#include "common/dtype.h"
#include "common/shape_string.h"
#include "common/status_macros.h"

namespace attnserve {
namespace {

// A tensor of rows [rows, heads, D] in the cache's dtype; `heads` 0 means any
// positive multiple of `heads_multiple` (q's Hq). An entirely unset tensor
// stands for zero rows.
absl::Status CheckRows(const char* name, const v1::Tensor& t, const KvGeometry& g, int64_t rows,
                       int64_t heads, int64_t heads_multiple) {
  if (rows == 0 && t.shape_size() == 0 && t.data().empty()) return absl::OkStatus();
  RETURN_IF_ERROR(ValidateTensorBytes(name, t));
  if (t.dtype() != static_cast<int>(g.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".dtype: expected the cache's dtype ", v1::DType_Name(static_cast<v1::DType>(g.dtype)),
        ", got ", v1::DType_Name(static_cast<v1::DType>(t.dtype()))));
  }
  const bool heads_ok = t.shape_size() == 3 &&
                        (heads > 0 ? t.shape(1) == heads
                                   : t.shape(1) > 0 && t.shape(1) % heads_multiple == 0);
  if (t.shape_size() != 3 || t.shape(0) != rows || !heads_ok || t.shape(2) != g.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".shape: expected [", rows, ", ",
        heads > 0 ? absl::StrCat(heads) : absl::StrCat("Hq (a multiple of ", heads_multiple, ")"),
        ", ", g.head_dim, "] (rows from sequences, the cache's geometry), got ", ShapeString(t.shape())));
  }
  return absl::OkStatus();
}

}  // namespace

KvCreateCache DecodeCreateCache(const v1::CreateCacheRequest& r) {
  KvCreateCache c;
  c.geometry.num_layers = r.geometry().num_layers();
  c.geometry.num_heads_kv = r.geometry().num_heads_kv();
  c.geometry.head_dim = r.geometry().head_dim();
  c.geometry.dtype = static_cast<DType>(r.geometry().dtype());
  c.page_size = r.page_size();
  c.capacity_tokens = r.capacity_tokens();
  c.capacity_bytes = r.capacity_bytes();
  c.cache_id = r.cache_id();
  if (r.has_device()) c.device = r.device();
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

absl::StatusOr<std::shared_ptr<KvAppendAttend>> DecodeAppendAttend(
    const v1::AppendAttendRequest& r, const KvCache& cache, const RequestLimits& limits) {
  const int64_t bytes = static_cast<int64_t>(r.ByteSizeLong());
  if (bytes > limits.max_request_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("request: expected at most ",
                                                     limits.max_request_bytes,
                                                     " bytes (--max_request_bytes), got ", bytes));
  }
  RETURN_IF_ERROR(ValidateRequestId(r.request_id()));
  const KvGeometry& g = cache.geometry();
  if (r.layer() < 0 || r.layer() >= g.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer: expected [0, ", g.num_layers,
                                                   ") (the cache's layers), got ", r.layer()));
  }
  if (r.sequences().empty()) {
    return absl::InvalidArgumentError("sequences: expected at least one, got none");
  }
  auto call = std::make_shared<KvAppendAttend>();
  call->cache_id = r.cache_id();
  call->layer = r.layer();
  int64_t total_q = 0, total_new = 0;
  std::set<uint64_t> ids;
  for (int i = 0; i < r.sequences_size(); ++i) {
    const v1::SequenceStep& s = r.sequences(i);
    if (!ids.insert(s.sequence_id()).second) {
      return absl::InvalidArgumentError(absl::StrCat("sequences[", i, "].sequence_id: ",
                                                     s.sequence_id(), " is listed twice"));
    }
    if (s.expected_length() < 0 || s.num_new_tokens() < 0 || s.num_queries() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequences[", i, "]: expected expected_length, num_new_tokens, num_queries >= 0, got ",
          s.expected_length(), ", ", s.num_new_tokens(), ", ", s.num_queries()));
    }
    call->steps.push_back({s.sequence_id(), s.expected_length(), s.num_new_tokens(), s.num_queries()});
    total_q += s.num_queries();
    total_new += s.num_new_tokens();
  }
  if (total_q + total_new > limits.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequences: expected at most ", limits.max_tokens,
        " query plus new rows (--max_tokens), got ", total_q + total_new));
  }
  RETURN_IF_ERROR(CheckRows("q", r.q(), g, total_q, 0, g.num_heads_kv));
  RETURN_IF_ERROR(CheckRows("k", r.k(), g, total_new, g.num_heads_kv, 1));
  RETURN_IF_ERROR(CheckRows("v", r.v(), g, total_new, g.num_heads_kv, 1));
  // The cache's dtype is never FP8 (kv_pool.cc), so descales are refused here.
  RETURN_IF_ERROR(ValidateOptions(r.options(), g.head_dim, static_cast<int>(g.dtype)));
  // The pool builds the params from these once it knows the sequences'
  // offsets and lengths.
  call->dtype = g.dtype;
  call->num_heads_kv = g.num_heads_kv;
  call->num_heads_q =
      r.q().shape_size() == 3 ? static_cast<int32_t>(r.q().shape(1)) : g.num_heads_kv;
  call->head_dim = g.head_dim;
  call->options = OptionsFromWire(r.options());
  call->inputs.q = r.q().data().data();
  call->inputs.k = r.k().data().data();
  call->inputs.v = r.v().data().data();
  call->return_lse = r.options().return_lse();
  return call;
}

void FillAppendAttendResponse(KvAppendAttend* call, v1::AppendAttendResponse* response) {
  int64_t total_q = 0;
  for (const KvStep& step : call->steps) total_q += step.num_queries;
  v1::Tensor* o = response->mutable_o();
  o->set_dtype(static_cast<v1::DType>(call->dtype));
  o->add_shape(total_q);
  o->add_shape(call->num_heads_q);
  o->add_shape(call->head_dim);
  o->set_data(std::move(call->o));
  if (call->return_lse) {
    v1::Tensor* lse = response->mutable_lse();
    lse->set_dtype(v1::FP32);
    lse->add_shape(call->num_heads_q);
    lse->add_shape(total_q);
    lse->set_data(std::move(call->lse));
  }
  for (int32_t len : call->lengths) response->add_lengths(len);
}

void FillCacheStats(const KvCacheStats& s, v1::CacheStats* out) {
  out->set_cache_id(s.cache_id);
  out->mutable_geometry()->set_num_layers(s.geometry.num_layers);
  out->mutable_geometry()->set_num_heads_kv(s.geometry.num_heads_kv);
  out->mutable_geometry()->set_head_dim(s.geometry.head_dim);
  out->mutable_geometry()->set_dtype(static_cast<v1::DType>(s.geometry.dtype));
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
