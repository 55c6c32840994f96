// The `attention_kv` model: v2 request -> KvCall -> KvRunner -> v2 response;
// see attention_kv_model.h.
#include "server/kserve/attention_kv_model.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/cache_id_header.h"
#include "common/dtype.h"
#include "common/shape_string.h"
#include "common/status_macros.h"
#include "server/kserve/field_names.h"
#include "server/kserve/model_reports.h"
#include "server/kserve/v2_options.h"
#include "server/kserve/v2_outputs.h"
#include "server/kserve/v2_tensors.h"

namespace attnserve {
namespace {

// q, k, v; then the optional per-head score modifiers (FP32 [Hq] each).
constexpr const char* kInputs[] = {"q", "k", "v", "alibi_slopes", "sinks"};
constexpr size_t kNumTensorInputs = 3;
// The `attention` model's masks and bias: laid out over a call's own keys,
// they have no K/V form, and are refused by name.
constexpr const char* kRefusedInputs[] = {"bias", "mask", "block_row_ptr", "block_col_idx"};
constexpr const char* kRefusedParameters[] = {"block_q", "block_k", "block_num_batch",
                                              "block_num_heads"};
constexpr char kNoKvMasks[] =
    ": not supported on K/V calls; use attend_pages for page-level sparsity";
constexpr char kControlNames[] =
    "cache_id, layer, sequence_id, sequence_start, sequence_end, expected_length, fork_from, "
    "fork_length, attend_pages";

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// Rows of a [rows, H, D] input; INVALID_ARGUMENT naming it for another rank.
absl::StatusOr<int32_t> RowsOf(const char* name, const TensorView& t, const char* layout) {
  if (t.shape.size() != 3 || t.shape[0] < 0 || t.shape[0] > INT_MAX) {
    return Invalid(absl::StrCat("inputs['", name, "'].shape: expected ", layout,
                                " (the new tokens of one sequence), got ", ShapeString(t.shape)));
  }
  return static_cast<int32_t>(t.shape[0]);
}

// The attend_pages parameter: page indices as a comma-separated string
// ("0,3,7"; v2 parameters carry no lists), empty = every page. The order and
// range are the core's checks.
absl::StatusOr<std::vector<int32_t>> ParseAttendPages(const std::string& where,
                                                      const std::string& text) {
  std::vector<int32_t> pages;
  if (text.empty()) return pages;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    int32_t page = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(item), &page)) {
      return Invalid(absl::StrCat(where,
                                  ": expected comma-separated page indices (\"0,3,7\"), got '",
                                  text.substr(0, 64), "'"));
    }
    pages.push_back(page);
  }
  return pages;
}

// A [Hq] FP32 input -> its values.
absl::Status FillPerHead(const inference::ModelInferRequest::InferInputTensor& input,
                         const std::string& bytes, std::vector<float>* out) {
  const std::string where = absl::StrCat("inputs['", input.name(), "']");
  if (input.datatype() != "FP32") {
    return Invalid(absl::StrCat(where, ".datatype: expected FP32, got \"", input.datatype(), "\""));
  }
  // Bounded first, so count * 4 below cannot overflow.
  if (input.shape_size() != 1 || input.shape(0) < 0 ||
      input.shape(0) > static_cast<int64_t>(bytes.size())) {
    return Invalid(absl::StrCat(where, ".shape: expected [Hq], got [",
                                absl::StrJoin(input.shape(), ","), "]"));
  }
  const int64_t count = input.shape(0);
  if (static_cast<int64_t>(bytes.size()) != count * 4) {
    return Invalid(absl::StrCat(where, ": expected ", count * 4, " bytes (shape [", count,
                                "] of FP32), got ", bytes.size()));
  }
  out->resize(static_cast<size_t>(count));
  if (count > 0) std::memcpy(out->data(), bytes.data(), bytes.size());
  return absl::OkStatus();
}

}  // namespace

// One request in flight.
struct AttentionKvModel::Call {
  InferCall call;
  KvCall append;
  std::string storage[3];  // q, k and v bytes taken out of the request
  // q, k and v in a CUDA region: read by the backend on the device (each
  // holds its region open until the call is done).
  InPlaceBytes on_device[3];
  std::vector<V2Output> outputs;
  std::shared_ptr<KvCache> cache;
  uint64_t sequence_id = 0;
  bool start = false;
  bool end = false;
  bool check_lengths = false;
  std::optional<uint64_t> fork_from;
  std::optional<int32_t> fork_length;
  std::vector<int32_t> attend_pages;       // append.steps[0] views it
  std::vector<float> alibi_slopes, sinks;  // append.mods views them
  bool created = false;                    // this call's sequence_start created the sequence
};

AttentionKvModel::AttentionKvModel(KvRunner* runner, const ShmRegistry* shm,
                                   const ServerMetrics* metrics, AttentionKvModelInfo info)
    : runner_(runner),
      pool_(runner->pool()),
      shm_(shm),
      metrics_(metrics),
      info_(std::move(info)) {}

void AttentionKvModel::FillMetadata(inference::ModelMetadataResponse* out) const {
  const char* type = DTypeName(info_.advertised).data();
  out->set_name(name_);
  out->add_versions(kModelVersion);
  out->set_platform("attnserve");
  // q, k and v only: alibi_slopes and sinks are accepted but not listed,
  // since perf_analyzer refuses shared memory for a model with optional
  // inputs and its sequence mode drives this model with it.
  for (size_t i = 0; i < kNumTensorInputs; ++i) {
    AddTensorMetadata(kInputs[i], type, 3, out->mutable_inputs());
  }
  AddTensorMetadata("o", type, 3, out->mutable_outputs());
  AddTensorMetadata("lse", "FP32", 2, out->mutable_outputs());
}

void AttentionKvModel::FillConfig(inference::ModelConfig* out) const {
  out->set_name(name_);
  out->set_platform("attnserve");
  out->set_backend("attnserve");
  out->set_max_batch_size(0);  // one sequence per request; its rows are the first dimension
  const inference::DataType type = ConfigType(info_.advertised);
  // As the metadata: the optional per-head inputs are not listed.
  for (size_t i = 0; i < kNumTensorInputs; ++i) AddConfigInput(kInputs[i], type, 3, false, out);
  AddConfigOutput("o", type, 3, out);
  AddConfigOutput("lse", inference::TYPE_FP32, 2, out);
  // Stateful: tools that read the config (perf_analyzer) then send
  // sequence_id / sequence_start / sequence_end.
  out->mutable_sequence_batching()->set_max_sequence_idle_microseconds(
      static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Microseconds(info_.idle_timeout))));
  (*out->mutable_parameters())["attnserve_backend"].set_string_value(info_.backend);
}

void AttentionKvModel::FillStatistics(inference::ModelStatistics* out) const {
  FillModelStatistics(name_, *metrics_, out);
}

absl::Status AttentionKvModel::Prepare(Call* c) const {
  inference::ModelInferRequest& request = *c->call.request;
  const InputSource source{&request, shm_, c->call.tenant};
  KvCall& append = c->append;
  append.meta = MetaOf(c->call);
  append.request_bytes = static_cast<int64_t>(request.ByteSizeLong());
  if (absl::Status raw = CheckRawInputCount(request); !raw.ok()) return raw;

  // Sorted, so the first bad parameter named is the same on every call.
  std::vector<std::string> names;
  for (const auto& [name, value] : request.parameters()) names.push_back(name);
  std::sort(names.begin(), names.end());
  std::optional<std::string> cache_param;
  std::optional<int64_t> layer, expected_length, fork_length;
  for (const std::string& name : names) {
    const inference::InferParameter& p = request.parameters().at(name);
    const std::string where = absl::StrCat("parameters['", name, "']");
    absl::StatusOr<bool> option = ApplyAttentionOption(name, p, &append.options);
    if (!option.ok()) return option.status();
    if (*option || IsProtocolParameter(name)) continue;
    absl::Status status;
    if (std::find(std::begin(kRefusedParameters), std::end(kRefusedParameters), name) !=
        std::end(kRefusedParameters)) {
      status = Invalid(absl::StrCat(where, " (the block mask)", kNoKvMasks));
    } else if (name == "cache_id") {
      absl::StatusOr<std::string> v = StringParameter(where, p);
      status = v.status();
      if (v.ok()) cache_param = *v;
    } else if (name == "attend_pages") {
      absl::StatusOr<std::string> v = StringParameter(where, p);
      absl::StatusOr<std::vector<int32_t>> pages =
          v.ok() ? ParseAttendPages(where, *v) : absl::StatusOr<std::vector<int32_t>>(v.status());
      status = pages.status();
      if (pages.ok()) c->attend_pages = *std::move(pages);
    } else if (name == "sequence_id" || name == "fork_from") {
      absl::StatusOr<uint64_t> v = Uint64Parameter(where, p);
      status = v.status();
      if (v.ok() && name == "sequence_id") c->sequence_id = *v;
      if (v.ok() && name == "fork_from") c->fork_from = *v;
    } else if (name == "sequence_start" || name == "sequence_end") {
      absl::StatusOr<bool> v = BoolParameter(where, p);
      status = v.status();
      if (v.ok()) (name == "sequence_start" ? c->start : c->end) = *v;
    } else if (name == "layer" || name == "expected_length" || name == "fork_length") {
      absl::StatusOr<int64_t> v = IntParameter(where, p);
      status = v.status();
      if (v.ok() && (*v < 0 || *v > INT_MAX)) {
        status = Invalid(absl::StrCat(where, ": expected 0..", INT_MAX, ", got ", *v));
      }
      if (status.ok())
        (name == "layer" ? layer : name == "expected_length" ? expected_length : fork_length) = *v;
    } else {
      status = Invalid(absl::StrCat(where, ": expected one of ", kControlNames, ", ",
                                    kAttentionOptionNames, ", got '", name, "'"));
    }
    if (!status.ok()) return status;
  }

  // The cache: the parameter, else the header the native API carries.
  if (cache_param.has_value() && !c->call.cache_id_header.empty() &&
      *cache_param != c->call.cache_id_header) {
    return Invalid(absl::StrCat("parameters['cache_id']: '", *cache_param, "' differs from the ",
                                kCacheIdHeader, " header '", c->call.cache_id_header, "'"));
  }
  const std::string cache_id = cache_param.value_or(c->call.cache_id_header);
  if (cache_id.empty()) {
    return Invalid(absl::StrCat("parameters['cache_id']: model '", name_,
                                "' needs a K/V cache: the cache_id parameter or the ",
                                kCacheIdHeader, " header (a cache made with KvCache.CreateCache)"));
  }
  if (c->sequence_id == 0) {
    return Invalid(absl::StrCat("parameters['sequence_id']: model '", name_,
                                "' needs a non-zero sequence_id (the K/V sequence), got ",
                                request.parameters().count("sequence_id") > 0 ? "0" : "none"));
  }
  if ((c->fork_from.has_value() || fork_length.has_value()) && !c->start) {
    return Invalid(absl::StrCat("parameters['",
                                c->fork_from.has_value() ? "fork_from" : "fork_length",
                                "']: only with sequence_start (a fork creates the sequence)"));
  }
  if (fork_length.has_value() && !c->fork_from.has_value()) {
    return Invalid("parameters['fork_length']: only with fork_from");
  }
  if (fork_length.has_value()) c->fork_length = static_cast<int32_t>(*fork_length);

  absl::StatusOr<std::shared_ptr<KvCache>> cache = pool_->Find(c->call.tenant, cache_id);
  if (!cache.ok()) {
    return absl::Status(cache.status().code(),
                        absl::StrCat(cache_param.has_value() ? "parameters['cache_id']: "
                                                             : absl::StrCat(kCacheIdHeader, ": "),
                                     cache.status().message()));
  }
  c->cache = *std::move(cache);
  if (!layer.has_value() && c->cache->geometry().num_layers > 1) {
    return Invalid(absl::StrCat("parameters['layer']: cache '", cache_id, "' has ",
                                c->cache->geometry().num_layers, " layers; name one in [0, ",
                                c->cache->geometry().num_layers, ")"));
  }

  for (const auto& input : request.inputs()) {
    if (std::find(std::begin(kRefusedInputs), std::end(kRefusedInputs), input.name()) !=
        std::end(kRefusedInputs)) {
      return Invalid(absl::StrCat("inputs['", input.name(), "']", kNoKvMasks));
    }
  }
  absl::StatusOr<std::vector<int>> index_of = IndexInputs(request, name_, kInputs);
  if (!index_of.ok()) return index_of.status();
  std::vector<float>* lists[] = {&c->alibi_slopes, &c->sinks};
  std::optional<absl::Span<const float>>* views[] = {&append.mods.alibi_slopes, &append.mods.sinks};
  for (size_t i = 0; i < 2; ++i) {
    const int index = (*index_of)[kNumTensorInputs + i];
    if (index < 0) continue;
    ASSIGN_OR_RETURN(const std::string bytes, TakeInputBytes(source, index));
    // Bytes read from a region were not in the message.
    if (request.inputs(index).parameters().count("shared_memory_region") > 0) {
      append.request_bytes += static_cast<int64_t>(bytes.size());
    }
    RETURN_IF_ERROR(FillPerHead(request.inputs(index), bytes, lists[i]));
    *views[i] = absl::MakeConstSpan(*lists[i]);
  }
  TensorView* tensors[] = {&append.q, &append.k, &append.v};
  for (int which = 0; which < 3; ++which) {
    if ((*index_of)[which] < 0) {
      return Invalid(absl::StrCat("inputs: model '", name_,
                                  "' needs q, k and v (zero rows allowed); '", kInputs[which],
                                  "' is missing"));
    }
    // A system region's bytes are copied (the append cannot be undone, so a
    // shrink must fail the read before it); a CUDA region's stay on the device.
    absl::StatusOr<TensorView> taken =
        TakeFloatTensor(source, (*index_of)[which], &c->storage[which], &c->on_device[which],
                        InPlaceKinds::kDevice);
    if (!taken.ok()) return taken.status();
    *tensors[which] = *taken;
  }
  absl::StatusOr<int32_t> queries = RowsOf("q", append.q, "[Tq, Hq, D]");
  if (!queries.ok()) return queries.status();
  absl::StatusOr<int32_t> new_tokens = RowsOf("k", append.k, "[Tk, Hkv, D]");
  if (!new_tokens.ok()) return new_tokens.status();

  append.cache_id = cache_id;
  append.layer = static_cast<int32_t>(layer.value_or(0));
  append.steps.push_back({c->sequence_id, static_cast<int32_t>(expected_length.value_or(0)),
                          *new_tokens, *queries, c->attend_pages});
  append.check_lengths = expected_length.has_value();

  RETURN_IF_ERROR(PlanOutputs(source, name_, &append.options.return_lse, &c->outputs));
  // A region too small must fail before the append, which cannot be undone.
  // The cache checks the shapes later; these sizes need only q's.
  absl::StatusOr<DType> dtype = ParseFloatDatatype("q", request.inputs((*index_of)[0]).datatype());
  const absl::Span<const int64_t> q = append.q.shape;
  if (!dtype.ok() || q[1] < 0 || q[2] < 0) return absl::OkStatus();
  const uint64_t rows_heads = uint64_t(q[0]) * uint64_t(q[1]);
  for (const V2Output& out : c->outputs) {
    absl::Status fits = CheckOutputFits(
        out, out.name == "o" ? rows_heads * uint64_t(q[2]) * DTypeSize(*dtype) : rows_heads * 4);
    if (!fits.ok()) return fits;
  }
  return absl::OkStatus();
}

absl::Status AttentionKvModel::Complete(Call* c, const absl::Status& status,
                                        const WorkTimings& timings, KvResult* result) const {
  if (!status.ok()) {
    // A failed call changes nothing: not even the sequence its start created.
    if (c->created) c->cache->Free({c->sequence_id}).IgnoreError();
    return status;
  }
  inference::ModelInferResponse& response = *c->call.response;
  ProducedTensor o{result->layout.o_dtype, result->layout.o_shape, std::move(result->o)};
  ProducedTensor lse{DType::kFP32, result->layout.lse_shape, std::move(result->lse)};
  RETURN_IF_ERROR(DeliverOutputs(&c->outputs, &o, &lse, &response));
  const int32_t length = result->lengths.empty() ? 0 : result->lengths[0];
  if (c->end) {
    // sequence_end may race other calls on the sequence (perf_analyzer sends
    // a sequence's requests without waiting): the last of them frees it.
    absl::StatusOr<bool> freed = c->cache->FreeWhenIdle(c->sequence_id);
    if (!freed.ok()) {
      return absl::Status(
          freed.status().code(),
          absl::StrCat("parameters['sequence_end']: the append applied (sequence ", c->sequence_id,
                       " has ", length, " tokens at layer ", c->append.layer,
                       ") but the sequence was not freed: ", freed.status().message()));
    }
  }
  response.set_model_name(name_);
  response.set_model_version(kModelVersion);
  response.set_id(c->call.request->id());
  SetTimingParameters(timings, runner_->backend_name(), &response);
  auto& params = *response.mutable_parameters();
  params["sequence_id"].set_uint64_param(c->sequence_id);
  params["sequence_length"].set_int64_param(length);
  return absl::OkStatus();
}

void AttentionKvModel::Infer(InferCall call) {
  auto c = std::make_shared<Call>();
  c->call = std::move(call);
  absl::Status prepared = Prepare(c.get());
  if (prepared.ok()) prepared = runner_->Draining();
  if (prepared.ok() && c->start) {
    KvSequenceSpec spec;
    spec.sequence_id = c->sequence_id;
    spec.fork_from = c->fork_from;
    spec.fork_length = c->fork_length;
    prepared = c->cache->CreateSequences({spec}, V2FieldNames());
    if (prepared.ok()) {
      c->created = true;
    } else if (prepared.code() == absl::StatusCode::kAlreadyExists) {
      prepared = absl::AlreadyExistsError(absl::StrCat(
          "parameters['sequence_start']: sequence ", c->sequence_id, " already exists in cache '",
          c->cache->id(), "' (end it with sequence_end, or continue it without sequence_start)"));
    }
  }
  if (!prepared.ok()) {
    c->call.done(prepared);
    return;
  }
  runner_->Start(
      &c->append, V2FieldNames(),
      [this, c](const absl::Status& status, const WorkTimings& timings, KvResult* result) {
        absl::Status completed = Complete(c.get(), status, timings, result);
        if (!completed.ok()) c->call.response->Clear();
        c->call.done(completed);
      });
}

}  // namespace attnserve
