// KServe v2 tensor bytes and parameters; see v2_tensors.h.
#include "server/kserve/v2_tensors.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve {
namespace {

absl::Status WrongType(const std::string& where, const char* expected,
                       const inference::InferParameter& p) {
  const char* got = "nothing";
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam: got = "bool"; break;
    case inference::InferParameter::kInt64Param: got = "int64"; break;
    case inference::InferParameter::kStringParam: got = "string"; break;
    case inference::InferParameter::kDoubleParam: got = "double"; break;
    case inference::InferParameter::kUint64Param: got = "uint64"; break;
    case inference::InferParameter::PARAMETER_CHOICE_NOT_SET: break;
  }
  return absl::InvalidArgumentError(absl::StrCat(where, ": expected ", expected, ", got ", got));
}

template <typename T>
std::string PackLittleEndian(const google::protobuf::RepeatedField<T>& values) {
  std::string bytes(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// An input whose bytes come from raw_input_contents.
bool UsesRaw(const inference::ModelInferRequest::InferInputTensor& input) {
  return !input.has_contents() && input.parameters().count("shared_memory_region") == 0;
}

}  // namespace

absl::StatusOr<DType> ParseFloatDatatype(const std::string& where, const std::string& datatype) {
  if (datatype == "FP16") return DType::kFP16;
  if (datatype == "BF16") return DType::kBF16;
  if (datatype == "FP32") return DType::kFP32;
  // The v2 protocol has no FP8 datatype; FP8 inputs go through attnserve.v1.
  return absl::InvalidArgumentError(absl::StrCat(
      where, ": expected FP16, BF16 or FP32, got \"", datatype,
      "\" (FP8_E4M3 is not a KServe v2 datatype: send FP8 inputs to attnserve.v1.Attention)"));
}

absl::StatusOr<int64_t> IntParameter(const std::string& where, const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param: return p.int64_param();
    case inference::InferParameter::kUint64Param:
      if (p.uint64_param() > static_cast<uint64_t>(INT64_MAX)) break;
      return static_cast<int64_t>(p.uint64_param());
    case inference::InferParameter::kStringParam: {
      int64_t v;
      if (absl::SimpleAtoi(p.string_param(), &v)) return v;
      break;
    }
    default: break;
  }
  return WrongType(where, "an integer", p);
}

absl::StatusOr<uint64_t> Uint64Parameter(const std::string& where,
                                         const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kUint64Param: return p.uint64_param();
    case inference::InferParameter::kInt64Param:
      if (p.int64_param() < 0) break;
      return static_cast<uint64_t>(p.int64_param());
    case inference::InferParameter::kStringParam: {
      uint64_t v;
      if (absl::SimpleAtoi(p.string_param(), &v)) return v;
      break;
    }
    default: break;
  }
  return WrongType(where, "an unsigned integer", p);
}

absl::StatusOr<std::string> StringParameter(const std::string& where,
                                            const inference::InferParameter& p) {
  if (p.parameter_choice_case() == inference::InferParameter::kStringParam) {
    return p.string_param();
  }
  return WrongType(where, "a string", p);
}

absl::StatusOr<double> DoubleParameter(const std::string& where,
                                       const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kDoubleParam: return p.double_param();
    case inference::InferParameter::kInt64Param: return static_cast<double>(p.int64_param());
    case inference::InferParameter::kUint64Param: return static_cast<double>(p.uint64_param());
    case inference::InferParameter::kStringParam: {
      double v;
      if (absl::SimpleAtod(p.string_param(), &v)) return v;
      break;
    }
    default: break;
  }
  return WrongType(where, "a number", p);
}

absl::StatusOr<bool> BoolParameter(const std::string& where, const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam: return p.bool_param();
    case inference::InferParameter::kStringParam: {
      bool v;
      if (absl::SimpleAtob(p.string_param(), &v)) return v;
      break;
    }
    default: break;
  }
  return WrongType(where, "a bool", p);
}

absl::StatusOr<std::optional<ShmRef>> ShmRefOf(const std::string& where,
                                               const V2Parameters& params) {
  auto region = params.find("shared_memory_region");
  if (region == params.end()) {
    if (params.count("shared_memory_byte_size") > 0 || params.count("shared_memory_offset") > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where,
                       ": shared_memory_byte_size or shared_memory_offset without "
                       "shared_memory_region"));
    }
    return std::nullopt;
  }
  if (region->second.parameter_choice_case() != inference::InferParameter::kStringParam) {
    return WrongType(absl::StrCat(where, ".shared_memory_region"), "a string", region->second);
  }
  ShmRef ref;
  ref.region = region->second.string_param();
  auto size = params.find("shared_memory_byte_size");
  if (size == params.end()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": shared_memory_region '", ref.region,
                                                   "' needs shared_memory_byte_size"));
  }
  absl::StatusOr<int64_t> bytes =
      IntParameter(absl::StrCat(where, ".shared_memory_byte_size"), size->second);
  if (!bytes.ok()) return bytes.status();
  int64_t offset = 0;
  if (auto it = params.find("shared_memory_offset"); it != params.end()) {
    absl::StatusOr<int64_t> o =
        IntParameter(absl::StrCat(where, ".shared_memory_offset"), it->second);
    if (!o.ok()) return o.status();
    offset = *o;
  }
  if (*bytes < 0 || offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": shared_memory_offset and shared_memory_byte_size: expected >= 0, got ", offset,
        " and ", *bytes));
  }
  ref.offset = static_cast<uint64_t>(offset);
  ref.byte_size = static_cast<uint64_t>(*bytes);
  return ref;
}

absl::Status CheckRawInputCount(const inference::ModelInferRequest& request) {
  int expected = 0;
  for (const auto& input : request.inputs()) expected += UsesRaw(input) ? 1 : 0;
  if (request.raw_input_contents_size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw_input_contents: expected ", expected,
                     " entries (one per input not given in contents or shared memory), got ",
                     request.raw_input_contents_size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> IndexInputs(const inference::ModelInferRequest& request,
                                             const std::string& model,
                                             absl::Span<const char* const> names) {
  std::vector<int> index_of(names.size(), -1);
  for (int i = 0; i < request.inputs_size(); ++i) {
    const std::string& name = request.inputs(i).name();
    size_t which = 0;
    while (which < names.size() && name != names[which]) ++which;
    if (which == names.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs['", name, "']: model '", model,
                       "' has no such input (inputs: ", absl::StrJoin(names, ", "), ")"));
    }
    if (index_of[which] != -1) {
      return absl::InvalidArgumentError(absl::StrCat("inputs['", name, "']: given twice"));
    }
    index_of[which] = i;
  }
  return index_of;
}

absl::StatusOr<TensorView> TakeFloatTensor(const InputSource& source, int index,
                                           std::string* storage, InPlaceBytes* in_place,
                                           InPlaceKinds kinds) {
  const auto& input = source.request->inputs(index);
  absl::StatusOr<DType> dtype =
      ParseFloatDatatype(absl::StrCat("inputs['", input.name(), "'].datatype"), input.datatype());
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<std::string> bytes = TakeInputBytes(source, index, in_place, kinds);
  if (!bytes.ok()) return bytes.status();
  *storage = *std::move(bytes);
  TensorView view;
  view.dtype = static_cast<int>(*dtype);
  view.shape = absl::MakeConstSpan(input.shape().data(), static_cast<size_t>(input.shape_size()));
  const bool placed = in_place != nullptr && in_place->data != nullptr;
  view.bytes = placed ? in_place->view() : absl::string_view(*storage);
  view.device = placed ? in_place->device : kHostMemory;
  return view;
}

InPlaceBytes InPlace(std::shared_ptr<ShmRegion> region, const ShmRef& ref, InPlaceKinds kinds) {
  InPlaceBytes bytes;
  if (char* const device_base = region->device_ptr(); device_base != nullptr) {
    if (kinds == InPlaceKinds::kMapped) return bytes;
    // The CUDA backend copies a misaligned span within the device itself.
    bytes.data = device_base + ref.offset;
    bytes.size = ref.byte_size;
    bytes.device = region->device();
    bytes.region = std::move(region);
    return bytes;
  }
  char* const base = region->mapped();
  if (kinds == InPlaceKinds::kDevice) return bytes;
  if (base == nullptr || reinterpret_cast<uintptr_t>(base + ref.offset) % kInPlaceAlignment != 0) {
    return bytes;
  }
  bytes.data = base + ref.offset;
  bytes.size = ref.byte_size;
  bytes.region = std::move(region);
  return bytes;
}

absl::Status CheckInPlaceIntact(absl::Span<const InPlaceBytes> inputs) {
  for (const InPlaceBytes& input : inputs) {
    if (input.data == nullptr || input.region == nullptr) continue;
    absl::Status intact = input.region->CheckIntact();
    if (!intact.ok()) return intact;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> TakeInputBytes(const InputSource& source, int index,
                                           InPlaceBytes* in_place, InPlaceKinds kinds) {
  inference::ModelInferRequest& request = *source.request;
  const inference::ModelInferRequest::InferInputTensor& input = request.inputs(index);
  const std::string where = absl::StrCat("inputs['", input.name(), "']");
  absl::StatusOr<std::optional<ShmRef>> shm = ShmRefOf(where, input.parameters());
  if (!shm.ok()) return shm.status();
  if (shm->has_value()) {
    if (input.has_contents()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected its data in contents or shared memory, got both"));
    }
    const ShmRef& ref = **shm;
    absl::StatusOr<std::shared_ptr<ShmRegion>> region =
        source.shm->Acquire(source.tenant, ref.region, ref.offset, ref.byte_size);
    if (!region.ok()) return region.status();
    if (in_place != nullptr) {
      *in_place = InPlace(*region, ref, kinds);
      if (in_place->data != nullptr) return std::string();
    }
    std::string bytes(ref.byte_size, '\0');
    absl::Status read = (*region)->Read(ref.offset, ref.byte_size, bytes.data());
    if (!read.ok()) return read;
    return bytes;
  }
  if (input.has_contents()) {
    if (input.datatype() == "FP32") return PackLittleEndian(input.contents().fp32_contents());
    if (input.datatype() == "INT32") return PackLittleEndian(input.contents().int_contents());
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": typed contents are read for FP32 and INT32 only; send ",
                     input.datatype(), " in raw_input_contents"));
  }
  int slot = 0;
  for (int i = 0; i < index; ++i) slot += UsesRaw(request.inputs(i)) ? 1 : 0;
  if (slot >= request.raw_input_contents_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": no data (no raw_input_contents entry, contents or shared memory)"));
  }
  return std::move(*request.mutable_raw_input_contents(slot));
}

}  // namespace attnserve
