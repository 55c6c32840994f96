// The `attention` model: v2 request -> ForwardRequest -> ForwardHandler ->
// v2 response; see attention_model.h. Tensor bytes are moved, not copied,
// between the two messages wherever the protocol lets them (docs/kserve.md
// lists the copies that remain).
#include "server/kserve/attention_model.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "server/kserve/v2_tensors.h"

namespace attnserve {
namespace {

constexpr const char* kInputNames[] = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"};
constexpr int kNumDenseInputs = 3;
constexpr int kNumInputs = 5;
constexpr const char* kParameterNames =
    "causal, window_left, window_right, softcap, softmax_scale, return_lse";

// Parameters the protocol and Triton's clients define for themselves (Triton
// reserves the "triton_" prefix; perf_analyzer sends
// triton_enable_empty_final_response); they do not change the result.
bool IsProtocolParameter(const std::string& name) {
  return name == "priority" || name == "timeout" || name == "binary_data_output" ||
         absl::StartsWith(name, "triton_");
}

void AddTensorMetadata(const char* name, const char* datatype, int rank,
                       google::protobuf::RepeatedPtrField<
                           inference::ModelMetadataResponse::TensorMetadata>* out) {
  auto* t = out->Add();
  t->set_name(name);
  t->set_datatype(datatype);
  for (int i = 0; i < rank; ++i) t->add_shape(-1);
}

inference::DataType ConfigType(DType t) {
  switch (t) {
    case DType::kFP16: return inference::TYPE_FP16;
    case DType::kBF16: return inference::TYPE_BF16;
    case DType::kFP32: return inference::TYPE_FP32;
    case DType::kFP8E4M3: break;  // not a v2 datatype (v2_tensors.cc refuses it)
  }
  return inference::TYPE_INVALID;
}

uint64_t Ns(int64_t us) { return static_cast<uint64_t>(us) * 1000; }

// Request parameter -> AttentionOptions.
absl::Status ApplyParameter(const std::string& name, const inference::InferParameter& p,
                            v1::AttentionOptions* options) {
  const std::string where = absl::StrCat("parameters['", name, "']");
  if (name == "causal" || name == "return_lse") {
    absl::StatusOr<bool> b = BoolParameter(where, p);
    if (!b.ok()) return b.status();
    name == "causal" ? options->set_causal(*b) : options->set_return_lse(*b);
    return absl::OkStatus();
  }
  if (name == "window_left" || name == "window_right") {
    absl::StatusOr<int64_t> w = IntParameter(where, p);
    if (!w.ok()) return w.status();
    // Negative values reach validation, which names the option.
    if (*w < INT_MIN || *w > INT_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected 0..", INT_MAX, ", got ", *w));
    }
    name == "window_left" ? options->set_window_left(static_cast<int32_t>(*w))
                          : options->set_window_right(static_cast<int32_t>(*w));
    return absl::OkStatus();
  }
  if (name == "softcap" || name == "softmax_scale") {
    absl::StatusOr<double> d = DoubleParameter(where, p);
    if (!d.ok()) return d.status();
    name == "softcap" ? options->set_softcap(static_cast<float>(*d))
                      : options->set_softmax_scale(static_cast<float>(*d));
    return absl::OkStatus();
  }
  if (IsProtocolParameter(name)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": expected one of ", kParameterNames, ", got '", name, "'"));
}

// An INT32 cu_seqlens input -> the repeated int32 of the ForwardRequest.
absl::Status FillSeqlens(const inference::ModelInferRequest::InferInputTensor& input,
                         const std::string& bytes, google::protobuf::RepeatedField<int32_t>* out) {
  const std::string where = absl::StrCat("inputs['", input.name(), "']");
  if (input.datatype() != "INT32") {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".datatype: expected INT32, got \"", input.datatype(), "\""));
  }
  if (input.shape_size() != 1 || input.shape(0) < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".shape: expected [B+1], got [",
                                                   absl::StrJoin(input.shape(), ","), "]"));
  }
  const int64_t count = input.shape(0);
  if (static_cast<int64_t>(bytes.size()) != count * 4) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected ", count * 4,
                                                   " bytes (shape [", count, "] of INT32), got ",
                                                   bytes.size()));
  }
  out->Resize(static_cast<int>(count), 0);
  if (count > 0) std::memcpy(out->mutable_data(), bytes.data(), bytes.size());
  return absl::OkStatus();
}

}  // namespace

// One request in flight: what Prepare built and Deliver reads.
struct AttentionModel::Call {
  InferCall call;
  v1::ForwardRequest forward;
  v1::ForwardResponse result;
  struct Output {
    std::string name;  // "o" or "lse"
    std::optional<ShmRef> shm;
    // Held until the output is written, so an unregister cannot unmap it.
    std::shared_ptr<ShmRegion> region;
  };
  std::vector<Output> outputs;
};

AttentionModel::AttentionModel(ForwardHandler* handler, const ShmRegistry* shm,
                               const ServerMetrics* metrics, AttentionModelInfo info)
    : handler_(handler), shm_(shm), metrics_(metrics), info_(std::move(info)) {}

void AttentionModel::FillMetadata(inference::ModelMetadataResponse* out) const {
  const char* type = DTypeName(info_.advertised).data();
  out->set_name(name_);
  out->add_versions(kModelVersion);
  out->set_platform("attnserve");
  AddTensorMetadata("q", type, 4, out->mutable_inputs());
  AddTensorMetadata("k", type, 4, out->mutable_inputs());
  AddTensorMetadata("v", type, 4, out->mutable_inputs());
  if (info_.varlen_inputs) {
    AddTensorMetadata("cu_seqlens_q", "INT32", 1, out->mutable_inputs());
    AddTensorMetadata("cu_seqlens_k", "INT32", 1, out->mutable_inputs());
  }
  AddTensorMetadata("o", type, 4, out->mutable_outputs());
  AddTensorMetadata("lse", "FP32", 3, out->mutable_outputs());
}

void AttentionModel::FillConfig(inference::ModelConfig* out) const {
  out->set_name(name_);
  out->set_platform("attnserve");
  out->set_backend("attnserve");
  out->set_max_batch_size(0);  // the tensors carry their own batch dimension
  auto add_input = [&](const char* n, inference::DataType t, int rank, bool optional) {
    inference::ModelInput* in = out->add_input();
    in->set_name(n);
    in->set_data_type(t);
    for (int i = 0; i < rank; ++i) in->add_dims(-1);
    in->set_optional(optional);
  };
  const inference::DataType type = ConfigType(info_.advertised);
  add_input("q", type, 4, false);
  add_input("k", type, 4, false);
  add_input("v", type, 4, false);
  if (info_.varlen_inputs) {
    add_input("cu_seqlens_q", inference::TYPE_INT32, 1, true);
    add_input("cu_seqlens_k", inference::TYPE_INT32, 1, true);
  }
  auto add_output = [&](const char* n, inference::DataType t, int rank) {
    inference::ModelOutput* o = out->add_output();
    o->set_name(n);
    o->set_data_type(t);
    for (int i = 0; i < rank; ++i) o->add_dims(-1);
  };
  add_output("o", type, 4);
  add_output("lse", inference::TYPE_FP32, 3);
  if (info_.batching) {
    out->mutable_dynamic_batching()->set_max_queue_delay_microseconds(
        static_cast<uint64_t>(info_.batch_max_delay_us));
  }
  (*out->mutable_parameters())["attnserve_backend"].set_string_value(info_.backend);
}

void AttentionModel::FillStatistics(inference::ModelStatistics* out) const {
  const ServerMetrics::Counters c = metrics_->Snapshot();
  out->set_name(name_);
  out->set_version(kModelVersion);
  out->set_last_inference(static_cast<uint64_t>(c.last_request_ms));
  out->set_inference_count(static_cast<uint64_t>(c.success));
  out->set_execution_count(static_cast<uint64_t>(c.executions));
  inference::InferStatistics* s = out->mutable_inference_stats();
  const uint64_t ok = static_cast<uint64_t>(c.success);
  s->mutable_success()->set_count(ok);
  s->mutable_success()->set_ns(Ns(c.request_us));
  // Durations of failed requests are not kept (as in Triton's metrics).
  s->mutable_fail()->set_count(static_cast<uint64_t>(c.failure));
  s->mutable_queue()->set_count(ok);
  s->mutable_queue()->set_ns(Ns(c.queue_us));
  s->mutable_compute_input()->set_count(ok);
  s->mutable_compute_input()->set_ns(Ns(c.compute_input_us));
  s->mutable_compute_infer()->set_count(ok);
  s->mutable_compute_infer()->set_ns(Ns(c.compute_infer_us));
  s->mutable_compute_output()->set_count(ok);
  s->mutable_compute_output()->set_ns(Ns(c.compute_output_us));
}

absl::Status AttentionModel::Prepare(Call* c) const {
  inference::ModelInferRequest& request = *c->call.request;
  const InputSource source{&request, shm_, c->call.tenant};
  v1::ForwardRequest& forward = c->forward;
  forward.set_request_id(request.id());
  if (absl::Status raw = CheckRawInputCount(request); !raw.ok()) return raw;

  const int not_given = -1;
  const int num_inputs = info_.varlen_inputs ? kNumInputs : kNumDenseInputs;
  int index_of[kNumInputs] = {not_given, not_given, not_given, not_given, not_given};
  for (int i = 0; i < request.inputs_size(); ++i) {
    const std::string& name = request.inputs(i).name();
    int which = 0;
    while (which < num_inputs && name != kInputNames[which]) ++which;
    if (which == num_inputs) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs['", name, "']: model '", name_, "' has no such input (inputs: ",
          absl::StrJoin(kInputNames, kInputNames + num_inputs, ", "), ")"));
    }
    if (index_of[which] != not_given) {
      return absl::InvalidArgumentError(absl::StrCat("inputs['", name, "']: given twice"));
    }
    index_of[which] = i;
  }
  v1::Tensor* tensors[] = {forward.mutable_q(), forward.mutable_k(), forward.mutable_v()};
  for (int which = 0; which < 3; ++which) {
    if (index_of[which] == not_given) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs: model '", name_, "' needs q, k and v; '", kInputNames[which], "' is missing"));
    }
    const auto& input = request.inputs(index_of[which]);
    absl::StatusOr<DType> dtype =
        ParseFloatDatatype(absl::StrCat("inputs['", input.name(), "'].datatype"), input.datatype());
    if (!dtype.ok()) return dtype.status();
    absl::StatusOr<std::string> bytes = TakeInputBytes(source, index_of[which]);
    if (!bytes.ok()) return bytes.status();
    tensors[which]->set_dtype(static_cast<v1::DType>(*dtype));
    *tensors[which]->mutable_shape() = input.shape();
    *tensors[which]->mutable_data() = *std::move(bytes);
  }
  google::protobuf::RepeatedField<int32_t>* seqlens[] = {forward.mutable_cu_seqlens_q(),
                                                         forward.mutable_cu_seqlens_k()};
  for (int which = 3; which < kNumInputs; ++which) {
    if (index_of[which] == not_given) continue;
    absl::StatusOr<std::string> bytes = TakeInputBytes(source, index_of[which]);
    if (!bytes.ok()) return bytes.status();
    absl::Status filled = FillSeqlens(request.inputs(index_of[which]), *bytes, seqlens[which - 3]);
    if (!filled.ok()) return filled;
  }

  // Sorted, so the first bad parameter named is the same on every call.
  std::vector<std::string> names;
  for (const auto& [name, value] : request.parameters()) names.push_back(name);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    absl::Status applied =
        ApplyParameter(name, request.parameters().at(name), forward.mutable_options());
    if (!applied.ok()) return applied;
  }

  if (request.outputs_size() == 0) {
    c->outputs.push_back({"o", std::nullopt, nullptr});
    if (forward.options().return_lse()) c->outputs.push_back({"lse", std::nullopt, nullptr});
    return absl::OkStatus();
  }
  for (const auto& requested : request.outputs()) {
    const std::string where = absl::StrCat("outputs['", requested.name(), "']");
    if (requested.name() != "o" && requested.name() != "lse") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": model '", name_, "' has no such output (outputs: o, lse)"));
    }
    for (const Call::Output& seen : c->outputs) {
      if (seen.name == requested.name()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": requested twice"));
      }
    }
    if (requested.name() == "lse") forward.mutable_options()->set_return_lse(true);
    absl::StatusOr<std::optional<ShmRef>> shm = ShmRefOf(where, requested.parameters());
    if (!shm.ok()) return shm.status();
    Call::Output out{requested.name(), *shm, nullptr};
    if (out.shm.has_value()) {
      absl::StatusOr<std::shared_ptr<ShmRegion>> region =
          shm_->Acquire(c->call.tenant, out.shm->region, out.shm->offset, out.shm->byte_size);
      if (!region.ok()) return region.status();
      out.region = *std::move(region);
    }
    c->outputs.push_back(std::move(out));
  }
  return absl::OkStatus();
}

absl::Status AttentionModel::Deliver(Call* c) const {
  v1::ForwardResponse& result = c->result;
  auto tensor_of = [&](const std::string& name) -> v1::Tensor* {
    return name == "o" ? result.mutable_o() : result.mutable_lse();
  };
  // Every region must fit before any is written: a failed call changes nothing.
  for (const Call::Output& out : c->outputs) {
    const uint64_t bytes = tensor_of(out.name)->data().size();
    if (out.shm.has_value() && bytes > out.shm->byte_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "outputs['", out.name, "']: shared memory region '", out.shm->region,
          "' was given shared_memory_byte_size ", out.shm->byte_size, " for an output of ", bytes,
          " bytes"));
    }
  }
  inference::ModelInferResponse& response = *c->call.response;
  for (Call::Output& out : c->outputs) {
    v1::Tensor* tensor = tensor_of(out.name);
    auto* meta = response.add_outputs();
    meta->set_name(out.name);
    meta->set_datatype(DTypeName(static_cast<DType>(tensor->dtype())).data());
    *meta->mutable_shape() = tensor->shape();
    std::string* raw = response.add_raw_output_contents();
    if (out.region != nullptr) {
      // Empty, so raw_output_contents stays aligned with outputs.
      absl::Status written = out.region->Write(out.shm->offset, tensor->data().data(),
                                               tensor->data().size());
      if (!written.ok()) return written;
      out.region.reset();
    } else {
      raw->swap(*tensor->mutable_data());
    }
  }
  response.set_model_name(name_);
  response.set_model_version(kModelVersion);
  response.set_id(c->call.request->id());
  // The native API's ServerTiming, as response parameters.
  const v1::ServerTiming& t = result.timing();
  auto& params = *response.mutable_parameters();
  params["queue_us"].set_int64_param(t.queue_us());
  params["compute_us"].set_int64_param(t.compute_us());
  params["total_us"].set_int64_param(t.total_us());
  params["batch_size"].set_int64_param(t.batch_size());
  params["device"].set_int64_param(t.device());
  params["backend"].set_string_param(result.backend());
  return absl::OkStatus();
}

void AttentionModel::Infer(InferCall call) {
  auto c = std::make_shared<Call>();
  c->call = std::move(call);
  absl::Status prepared = Prepare(c.get());
  if (!prepared.ok()) {
    c->call.done(prepared);
    return;
  }
  handler_->Start(&c->forward, &c->result, c->call.deadline, c->call.cancelled,
                  [this, c](const absl::Status& status) {
                    absl::Status delivered = status.ok() ? Deliver(c.get()) : status;
                    if (!delivered.ok()) c->call.response->Clear();
                    c->call.done(delivered);
                  });
}

}  // namespace attnserve
