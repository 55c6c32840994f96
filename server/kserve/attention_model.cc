// The `attention` model: v2 request -> AttentionCall -> AttentionRunner ->
// v2 response; see attention_model.h. Tensor bytes are moved, not copied, out
// of the request wherever the protocol lets them, and q, k, v, o and lse in a
// shared-memory region are read and written where they lie (a CUDA region's
// on its device, by the backend); docs/kserve.md lists the copies that remain.
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

// q, k, v; then the optional inputs of `attention` (not of `attention_dense`):
// varlen offsets and the score modifiers' and masks' tensors.
enum Input : size_t {
  kQ,
  kK,
  kV,
  kCuSeqlensQ,
  kCuSeqlensK,
  kAlibiSlopes,
  kSinks,
  kBias,
  kMask,
  kBlockRowPtr,
  kBlockColIdx,
};
constexpr const char* kInputNames[] = {
    "q",     "k",    "v",    "cu_seqlens_q",  "cu_seqlens_k", "alibi_slopes",
    "sinks", "bias", "mask", "block_row_ptr", "block_col_idx"};
constexpr size_t kNumDenseInputs = 3;

// The block mask's request parameters, in BlockMaskView's order.
constexpr const char* kBlockParameters[] = {"block_q", "block_k", "block_num_batch",
                                            "block_num_heads"};

// A 1-D input of `datatype` (4-byte elements) -> its values; `shape` says
// what its one dimension counts, for the error.
template <typename T>
absl::Status FillList(const inference::ModelInferRequest::InferInputTensor& input,
                      const char* datatype, const char* shape, const std::string& bytes,
                      std::vector<T>* out) {
  static_assert(sizeof(T) == 4, "4-byte elements");
  const std::string where = absl::StrCat("inputs['", input.name(), "']");
  if (input.datatype() != datatype) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".datatype: expected ", datatype, ", got \"", input.datatype(), "\""));
  }
  // Bounded first, so count * 4 below cannot overflow.
  if (input.shape_size() != 1 || input.shape(0) < 0 ||
      input.shape(0) > static_cast<int64_t>(bytes.size())) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".shape: expected ", shape, ", got [",
                                                   absl::StrJoin(input.shape(), ","), "]"));
  }
  const int64_t count = input.shape(0);
  if (static_cast<int64_t>(bytes.size()) != count * 4) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected ", count * 4,
                                                   " bytes (shape [", count, "] of ", datatype,
                                                   "), got ", bytes.size()));
  }
  out->resize(static_cast<size_t>(count));
  if (count > 0) std::memcpy(out->data(), bytes.data(), bytes.size());
  return absl::OkStatus();
}

// Whether the input's bytes come from a shared-memory region (not counted in
// the request message's size).
bool InSharedMemory(const inference::ModelInferRequest::InferInputTensor& input) {
  return input.parameters().count("shared_memory_region") > 0;
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
  // The score modifiers and masks, as call.attention.mods views them.
  std::vector<float> alibi_slopes, sinks;
  std::string bias_storage, mask_storage;
  InPlaceBytes bias_in_place, mask_in_place;
  std::vector<int32_t> block_row_ptr, block_col_idx;
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
    // bias may be FP16 or BF16 too, and bias and mask are [Hq or 1, P] for
    // varlen calls (docs/design.md §2); metadata lists one type and rank.
    AddTensorMetadata("alibi_slopes", "FP32", 1, out->mutable_inputs());
    AddTensorMetadata("sinks", "FP32", 1, out->mutable_inputs());
    AddTensorMetadata("bias", "FP32", 4, out->mutable_inputs());
    AddTensorMetadata("mask", "BOOL", 4, out->mutable_inputs());
    AddTensorMetadata("block_row_ptr", "INT32", 1, out->mutable_inputs());
    AddTensorMetadata("block_col_idx", "INT32", 1, out->mutable_inputs());
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
    AddConfigInput("alibi_slopes", inference::TYPE_FP32, 1, true, out);
    AddConfigInput("sinks", inference::TYPE_FP32, 1, true, out);
    AddConfigInput("bias", inference::TYPE_FP32, 4, true, out);
    AddConfigInput("mask", inference::TYPE_BOOL, 4, true, out);
    AddConfigInput("block_row_ptr", inference::TYPE_INT32, 1, true, out);
    AddConfigInput("block_col_idx", inference::TYPE_INT32, 1, true, out);
    (*out->mutable_parameters())["attnserve_block_mask_parameters"].set_string_value(
        "block_q, block_k, block_num_batch, block_num_heads (int64 request parameters, with "
        "inputs block_row_ptr and block_col_idx)");
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
    // A CUDA region's q, k and v stay on the device: the backend reads them there.
    absl::StatusOr<TensorView> taken =
        TakeFloatTensor(source, (*index_of)[which], &c->storage[which], &c->inputs[which],
                        InPlaceKinds::kMappedOrDevice);
    if (!taken.ok()) return taken.status();
    *tensors[which] = *taken;
    // Bytes from a region, read in place or copied (a CUDA region), were
    // not in the message.
    if (InSharedMemory(request.inputs((*index_of)[which]))) {
      call.request_bytes += static_cast<int64_t>(c->inputs[which].size + c->storage[which].size());
    }
  }
  for (size_t which = kCuSeqlensQ; which <= kCuSeqlensK && which < names.size(); ++which) {
    const int index = (*index_of)[which];
    if (index < 0) continue;
    absl::StatusOr<std::string> bytes = TakeInputBytes(source, index);
    if (!bytes.ok()) return bytes.status();
    absl::Status filled = FillList(request.inputs(index), "INT32", "[B+1]", *bytes,
                                   &c->cu_seqlens[which - kCuSeqlensQ]);
    if (!filled.ok()) return filled;
  }
  call.cu_seqlens_q = c->cu_seqlens[0];
  call.cu_seqlens_k = c->cu_seqlens[1];
  if (info_.varlen_inputs) RETURN_IF_ERROR(TakeMods(source, *index_of, c));

  // Sorted, so the first bad parameter named is the same on every call.
  std::vector<std::string> parameter_names;
  for (const auto& [name, value] : request.parameters()) parameter_names.push_back(name);
  std::sort(parameter_names.begin(), parameter_names.end());
  int64_t* const block_values[] = {&call.mods.block_mask.block_q, &call.mods.block_mask.block_k,
                                   &call.mods.block_mask.num_batch,
                                   &call.mods.block_mask.num_heads};
  bool block_given[std::size(kBlockParameters)] = {};
  for (const std::string& name : parameter_names) {
    const inference::InferParameter& value = request.parameters().at(name);
    if (info_.varlen_inputs) {
      const auto* block = std::find(std::begin(kBlockParameters), std::end(kBlockParameters), name);
      if (block != std::end(kBlockParameters)) {
        const size_t i = static_cast<size_t>(block - std::begin(kBlockParameters));
        ASSIGN_OR_RETURN(*block_values[i],
                         IntParameter(absl::StrCat("parameters['", name, "']"), value));
        block_given[i] = true;
        continue;
      }
    }
    absl::StatusOr<bool> applied = ApplyAttentionOption(name, value, &call.options);
    if (!applied.ok()) return applied.status();
    if (*applied || IsProtocolParameter(name)) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "parameters['", name, "']: expected one of ", kAttentionOptionNames,
        info_.varlen_inputs ? ", block_q, block_k, block_num_batch, block_num_heads" : "",
        ", got '", name, "'"));
  }
  if (info_.varlen_inputs) RETURN_IF_ERROR(CheckBlockMaskComplete(*index_of, block_given, c));

  RETURN_IF_ERROR(PlanOutputs(source, name_, &call.options.return_lse, &c->outputs));
  call.sink = V2Sink(&c->outputs, &c->o, &c->lse, &call.output_devices);
  return absl::OkStatus();
}

absl::Status AttentionModel::TakeMods(const InputSource& source, const std::vector<int>& index_of,
                                      Call* c) const {
  inference::ModelInferRequest& request = *source.request;
  ScoreModsView& mods = c->attention.mods;
  auto count_shared = [&](int index, uint64_t bytes) {
    if (InSharedMemory(request.inputs(index))) {
      c->attention.request_bytes += static_cast<int64_t>(bytes);
    }
  };
  // The per-head lists and the CSR arrays: small, copied out (aligned).
  struct List {
    Input input;
    const char* datatype;
    const char* shape;
  };
  for (const List& list :
       {List{kAlibiSlopes, "FP32", "[Hq]"}, List{kSinks, "FP32", "[Hq]"},
        List{kBlockRowPtr, "INT32", "[rows + 1]"}, List{kBlockColIdx, "INT32", "[kept blocks]"}}) {
    const int index = index_of[list.input];
    if (index < 0) continue;
    ASSIGN_OR_RETURN(const std::string bytes, TakeInputBytes(source, index));
    count_shared(index, bytes.size());
    const auto& input = request.inputs(index);
    switch (list.input) {
      case kAlibiSlopes:
        RETURN_IF_ERROR(FillList(input, list.datatype, list.shape, bytes, &c->alibi_slopes));
        mods.alibi_slopes = absl::MakeConstSpan(c->alibi_slopes);
        break;
      case kSinks:
        RETURN_IF_ERROR(FillList(input, list.datatype, list.shape, bytes, &c->sinks));
        mods.sinks = absl::MakeConstSpan(c->sinks);
        break;
      case kBlockRowPtr:
        RETURN_IF_ERROR(FillList(input, list.datatype, list.shape, bytes, &c->block_row_ptr));
        mods.block_mask.row_ptr = c->block_row_ptr;
        break;
      default:
        RETURN_IF_ERROR(FillList(input, list.datatype, list.shape, bytes, &c->block_col_idx));
        mods.block_mask.col_idx = c->block_col_idx;
        break;
    }
  }
  // bias and mask may be large: taken or read in place, like q, k and v.
  if (const int index = index_of[kBias]; index >= 0) {
    ASSIGN_OR_RETURN(mods.bias,
                     TakeFloatTensor(source, index, &c->bias_storage, &c->bias_in_place));
    count_shared(index, c->bias_storage.size() + c->bias_in_place.size);
  }
  if (const int index = index_of[kMask]; index >= 0) {
    const auto& input = request.inputs(index);
    if (input.datatype() != "BOOL") {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs['mask'].datatype: expected BOOL, got \"", input.datatype(), "\""));
    }
    ASSIGN_OR_RETURN(c->mask_storage, TakeInputBytes(source, index, &c->mask_in_place));
    count_shared(index, c->mask_storage.size() + c->mask_in_place.size);
    mods.mask.shape =
        absl::MakeConstSpan(input.shape().data(), static_cast<size_t>(input.shape_size()));
    mods.mask.bytes = c->mask_in_place.data != nullptr ? c->mask_in_place.view()
                                                       : absl::string_view(c->mask_storage);
    mods.mask.absent = false;
  }
  return absl::OkStatus();
}

absl::Status AttentionModel::CheckBlockMaskComplete(const std::vector<int>& index_of,
                                                    const bool* block_given, Call* c) const {
  BlockMaskView& mask = c->attention.mods.block_mask;
  const bool inputs[] = {index_of[kBlockRowPtr] >= 0, index_of[kBlockColIdx] >= 0};
  bool any = inputs[0] || inputs[1];
  for (size_t i = 0; i < std::size(kBlockParameters); ++i) any = any || block_given[i];
  if (!any) return absl::OkStatus();
  // A block mask is all six pieces; the first one missing is named.
  for (size_t i = 0; i < std::size(kBlockParameters); ++i) {
    if (!block_given[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameters['", kBlockParameters[i],
                       "']: expected with a block mask (block_row_ptr, block_col_idx, block_q, "
                       "block_k, block_num_batch, block_num_heads), got none"));
    }
  }
  for (size_t i = 0; i < 2; ++i) {
    if (!inputs[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs['", kInputNames[kBlockRowPtr + i],
                       "']: expected with a block mask (block_row_ptr, block_col_idx, block_q, "
                       "block_k, block_num_batch, block_num_heads), got none"));
    }
  }
  mask.present = true;
  return absl::OkStatus();
}

absl::Status AttentionModel::Deliver(Call* c, const WorkTimings& timings) const {
  inference::ModelInferResponse& response = *c->call.response;
  RETURN_IF_ERROR(CheckInPlaceIntact(c->inputs));
  RETURN_IF_ERROR(CheckInPlaceIntact({c->bias_in_place, c->mask_in_place}));
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
