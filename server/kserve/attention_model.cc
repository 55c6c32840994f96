// The `attention` model: v2 request -> ForwardRequest -> ForwardHandler ->
// v2 response; see attention_model.h. Tensor bytes are moved, not copied,
// between the two messages wherever the protocol lets them, and q, k, v, o
// and lse in a system shared-memory region are read and written where they
// lie (LentMemory); docs/kserve.md lists the copies that remain.
#include "server/kserve/attention_model.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "server/kserve/model_reports.h"
#include "server/kserve/v2_options.h"
#include "server/kserve/v2_outputs.h"
#include "server/kserve/v2_tensors.h"

namespace attnserve {
namespace {

constexpr const char* kInputNames[] = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"};
constexpr size_t kNumDenseInputs = 3;

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
  std::vector<V2Output> outputs;
  // q, k and v when read in place from a region (each holds its region
  // mapped until the call is done).
  InPlaceBytes inputs[3];
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
  const inference::DataType type = ConfigType(info_.advertised);
  AddConfigInput("q", type, 4, false, out);
  AddConfigInput("k", type, 4, false, out);
  AddConfigInput("v", type, 4, false, out);
  if (info_.varlen_inputs) {
    AddConfigInput("cu_seqlens_q", inference::TYPE_INT32, 1, true, out);
    AddConfigInput("cu_seqlens_k", inference::TYPE_INT32, 1, true, out);
  }
  AddConfigOutput("o", type, 4, out);
  AddConfigOutput("lse", inference::TYPE_FP32, 3, out);
  if (info_.batching) {
    out->mutable_dynamic_batching()->set_max_queue_delay_microseconds(
        static_cast<uint64_t>(info_.batch_max_delay_us));
  }
  (*out->mutable_parameters())["attnserve_backend"].set_string_value(info_.backend);
}

void AttentionModel::FillStatistics(inference::ModelStatistics* out) const {
  FillModelStatistics(name_, *metrics_, out);
}

absl::Status AttentionModel::Prepare(Call* c) const {
  inference::ModelInferRequest& request = *c->call.request;
  const InputSource source{&request, shm_, c->call.tenant};
  v1::ForwardRequest& forward = c->forward;
  forward.set_request_id(request.id());
  if (absl::Status raw = CheckRawInputCount(request); !raw.ok()) return raw;

  const absl::Span<const char* const> names =
      absl::MakeConstSpan(kInputNames)
          .subspan(0, info_.varlen_inputs ? std::size(kInputNames) : kNumDenseInputs);
  absl::StatusOr<std::vector<int>> index_of = IndexInputs(request, name_, names);
  if (!index_of.ok()) return index_of.status();
  v1::Tensor* tensors[] = {forward.mutable_q(), forward.mutable_k(), forward.mutable_v()};
  for (int which = 0; which < 3; ++which) {
    if ((*index_of)[which] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs: model '", name_, "' needs q, k and v; '", names[which], "' is missing"));
    }
    absl::Status taken =
        TakeFloatTensor(source, (*index_of)[which], tensors[which], &c->inputs[which]);
    if (!taken.ok()) return taken;
  }
  google::protobuf::RepeatedField<int32_t>* seqlens[] = {forward.mutable_cu_seqlens_q(),
                                                         forward.mutable_cu_seqlens_k()};
  for (size_t which = 3; which < names.size(); ++which) {
    const int index = (*index_of)[which];
    if (index < 0) continue;
    absl::StatusOr<std::string> bytes = TakeInputBytes(source, index);
    if (!bytes.ok()) return bytes.status();
    absl::Status filled = FillSeqlens(request.inputs(index), *bytes, seqlens[which - 3]);
    if (!filled.ok()) return filled;
  }

  // Sorted, so the first bad parameter named is the same on every call.
  std::vector<std::string> parameter_names;
  for (const auto& [name, value] : request.parameters()) parameter_names.push_back(name);
  std::sort(parameter_names.begin(), parameter_names.end());
  for (const std::string& name : parameter_names) {
    absl::StatusOr<bool> applied =
        ApplyAttentionOption(name, request.parameters().at(name), forward.mutable_options());
    if (!applied.ok()) return applied.status();
    if (*applied || IsProtocolParameter(name)) continue;
    return absl::InvalidArgumentError(absl::StrCat("parameters['", name, "']: expected one of ",
                                                   kAttentionOptionNames, ", got '", name, "'"));
  }

  bool return_lse = forward.options().return_lse();
  absl::Status planned = PlanOutputs(source, name_, &return_lse, &c->outputs);
  forward.mutable_options()->set_return_lse(return_lse);
  return planned;
}

absl::Status AttentionModel::Deliver(Call* c) const {
  v1::ForwardResponse& result = c->result;
  inference::ModelInferResponse& response = *c->call.response;
  absl::Status delivered =
      DeliverOutputs(&c->outputs, result.mutable_o(), result.mutable_lse(), &response);
  if (!delivered.ok()) return delivered;
  response.set_model_name(name_);
  response.set_model_version(kModelVersion);
  response.set_id(c->call.request->id());
  SetTimingParameters(result.timing(), result.backend(), &response);
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
  LentMemory lent;
  lent.inputs.q = c->inputs[0].view();
  lent.inputs.k = c->inputs[1].view();
  lent.inputs.v = c->inputs[2].view();
  // The handler keeps this until `done`, which holds `c`.
  lent.place_outputs = [outputs = &c->outputs](int64_t o_bytes, int64_t lse_bytes, void** o,
                                               float** lse) {
    return PlaceOutputs(outputs, o_bytes, lse_bytes, o, lse);
  };
  handler_->Start(
      &c->forward, &c->result, c->call.tenant, c->call.deadline, c->call.cancelled,
      [this, c](const absl::Status& status) {
        absl::Status delivered = status.ok() ? Deliver(c.get()) : status;
        if (!delivered.ok()) c->call.response->Clear();
        c->call.done(delivered);
      },
      std::move(lent));
}

}  // namespace attnserve
