// The `attention` model: v2 request -> AttentionCall -> AttentionRunner ->
// v2 response; see attention_model.h. Tensor bytes are moved, not copied, out
// of the request wherever the protocol lets them, and q, k, v, o and lse in a
// system shared-memory region are read and written where they lie;
// docs/kserve.md lists the copies that remain.
#include "server/kserve/attention_model.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "server/kserve/field_names.h"
#include "server/kserve/model_reports.h"
#include "server/kserve/v2_options.h"
#include "server/kserve/v2_outputs.h"
#include "server/kserve/v2_tensors.h"

namespace attnserve {
namespace {

constexpr const char* kInputNames[] = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"};
constexpr size_t kNumDenseInputs = 3;

// An INT32 cu_seqlens input -> its offsets.
absl::Status FillSeqlens(const inference::ModelInferRequest::InferInputTensor& input,
                         const std::string& bytes, std::vector<int32_t>* out) {
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
  out->resize(static_cast<size_t>(count));
  if (count > 0) std::memcpy(out->data(), bytes.data(), bytes.size());
  return absl::OkStatus();
}

}  // namespace

// One request in flight: what Prepare built and Deliver reads.
struct AttentionModel::Call {
  InferCall call;
  AttentionCall attention;
  // q, k and v bytes taken out of the request, or read in place from a
  // region (each holds its region mapped until the call is done).
  std::string storage[3];
  InPlaceBytes inputs[3];
  std::vector<int32_t> cu_seqlens[2];
  std::vector<V2Output> outputs;
  ProducedTensor o, lse;
};

AttentionModel::AttentionModel(AttentionRunner* runner, const ShmRegistry* shm,
                               const ServerMetrics* metrics, AttentionModelInfo info)
    : runner_(runner), shm_(shm), metrics_(metrics), info_(std::move(info)) {}

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
  AttentionCall& call = c->attention;
  call.meta = MetaOf(c->call);
  // Counted before any bytes move out, plus what is read from regions below.
  call.request_bytes = static_cast<int64_t>(request.ByteSizeLong());
  if (absl::Status raw = CheckRawInputCount(request); !raw.ok()) return raw;

  const absl::Span<const char* const> names =
      absl::MakeConstSpan(kInputNames)
          .subspan(0, info_.varlen_inputs ? std::size(kInputNames) : kNumDenseInputs);
  absl::StatusOr<std::vector<int>> index_of = IndexInputs(request, name_, names);
  if (!index_of.ok()) return index_of.status();
  TensorView* tensors[] = {&call.q, &call.k, &call.v};
  for (int which = 0; which < 3; ++which) {
    if ((*index_of)[which] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs: model '", name_, "' needs q, k and v; '", names[which], "' is missing"));
    }
    absl::StatusOr<TensorView> taken =
        TakeFloatTensor(source, (*index_of)[which], &c->storage[which], &c->inputs[which]);
    if (!taken.ok()) return taken.status();
    *tensors[which] = *taken;
    call.request_bytes += static_cast<int64_t>(c->inputs[which].size);
  }
  for (size_t which = 3; which < names.size(); ++which) {
    const int index = (*index_of)[which];
    if (index < 0) continue;
    absl::StatusOr<std::string> bytes = TakeInputBytes(source, index);
    if (!bytes.ok()) return bytes.status();
    absl::Status filled = FillSeqlens(request.inputs(index), *bytes, &c->cu_seqlens[which - 3]);
    if (!filled.ok()) return filled;
  }
  call.cu_seqlens_q = c->cu_seqlens[0];
  call.cu_seqlens_k = c->cu_seqlens[1];

  // Sorted, so the first bad parameter named is the same on every call.
  std::vector<std::string> parameter_names;
  for (const auto& [name, value] : request.parameters()) parameter_names.push_back(name);
  std::sort(parameter_names.begin(), parameter_names.end());
  for (const std::string& name : parameter_names) {
    absl::StatusOr<bool> applied =
        ApplyAttentionOption(name, request.parameters().at(name), &call.options);
    if (!applied.ok()) return applied.status();
    if (*applied || IsProtocolParameter(name)) continue;
    return absl::InvalidArgumentError(absl::StrCat("parameters['", name, "']: expected one of ",
                                                   kAttentionOptionNames, ", got '", name, "'"));
  }

  RETURN_IF_ERROR(PlanOutputs(source, name_, &call.options.return_lse, &c->outputs));
  call.sink = V2Sink(&c->outputs, &c->o, &c->lse);
  return absl::OkStatus();
}

absl::Status AttentionModel::Deliver(Call* c, const WorkTimings& timings) const {
  inference::ModelInferResponse& response = *c->call.response;
  RETURN_IF_ERROR(CheckInPlaceIntact(c->inputs));
  RETURN_IF_ERROR(DeliverOutputs(&c->outputs, &c->o, &c->lse, &response));
  response.set_model_name(name_);
  response.set_model_version(kModelVersion);
  response.set_id(c->call.request->id());
  SetTimingParameters(timings, runner_->backend_name(), &response);
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
  runner_->Start(&c->attention, V2FieldNames(),
                 [this, c](const absl::Status& status, const WorkTimings& timings) {
                   absl::Status delivered = status.ok() ? Deliver(c.get(), timings) : status;
                   if (!delivered.ok()) c->call.response->Clear();
                   c->call.done(delivered);
                 });
}

}  // namespace attnserve
