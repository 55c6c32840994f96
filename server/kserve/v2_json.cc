// See v2_json.h. Moved from http_service.cc as it was. JSON is parsed
// without exceptions and every field is type-checked before use.
#include "server/kserve/v2_json.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace attnserve {
namespace {

using Json = nlohmann::json;

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

// ---- JSON -> messages ----

absl::Status ToParameter(const std::string& where, const Json& v, inference::InferParameter* out) {
  if (v.is_boolean()) {
    out->set_bool_param(v.get<bool>());
  } else if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(INT64_MAX)) {
      out->set_int64_param(static_cast<int64_t>(u));
    } else {
      out->set_uint64_param(u);
    }
  } else if (v.is_number_integer()) {
    out->set_int64_param(v.get<int64_t>());
  } else if (v.is_number_float()) {
    out->set_double_param(v.get<double>());
  } else if (v.is_string()) {
    out->set_string_param(v.get<std::string>());
  } else {
    return Invalid(absl::StrCat(where, ": expected a bool, number or string, got ", v.type_name()));
  }
  return absl::OkStatus();
}

absl::Status ToParameters(const std::string& where, const Json& object,
                          google::protobuf::Map<std::string, inference::InferParameter>* out) {
  if (object.is_null()) return absl::OkStatus();
  if (!object.is_object()) {
    return Invalid(absl::StrCat(where, ": expected an object, got ", object.type_name()));
  }
  for (auto it = object.begin(); it != object.end(); ++it) {
    absl::Status s =
        ToParameter(absl::StrCat(where, "['", it.key(), "']"), it.value(), &(*out)[it.key()]);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Nested or flat JSON "data" -> its numbers in row-major order. Nesting is
// bounded by the tensor's rank (`depth_left`), so the recursion is too.
absl::Status Flatten(const std::string& where, const Json& data, size_t depth_left,
                     std::vector<double>* out) {
  if (data.is_array()) {
    if (depth_left == 0) {
      return Invalid(
          absl::StrCat(where, ".data: nested deeper than the tensor's rank (its shape)"));
    }
    for (const Json& e : data) {
      absl::Status s = Flatten(where, e, depth_left - 1, out);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (data.is_number()) {
    out->push_back(data.get<double>());
    return absl::OkStatus();
  }
  if (data.is_boolean()) {
    out->push_back(data.get<bool>() ? 1.0 : 0.0);
    return absl::OkStatus();
  }
  return Invalid(absl::StrCat(where, ".data: expected numbers, got ", data.type_name()));
}

// JSON numbers -> the little-endian bytes of `datatype`; `rank` is the
// length of the tensor's shape (a flat list is always accepted).
absl::StatusOr<std::string> PackJsonData(const std::string& where, const std::string& datatype,
                                         size_t rank, const Json& data) {
  std::vector<double> values;
  absl::Status flat = Flatten(where, data, std::max<size_t>(rank, 1), &values);
  if (!flat.ok()) return flat;
  std::string bytes;
  if (datatype == "FP32" || datatype == "INT32") {
    bytes.resize(values.size() * 4);
    for (size_t i = 0; i < values.size(); ++i) {
      if (datatype == "FP32") {
        const float f = static_cast<float>(values[i]);
        std::memcpy(&bytes[i * 4], &f, 4);
      } else {
        // The range first: converting a double outside int32's range is
        // undefined behaviour, not a value to compare.
        const double d = values[i];
        if (!(d >= static_cast<double>(INT32_MIN) && d <= static_cast<double>(INT32_MAX)) ||
            d != static_cast<double>(static_cast<int32_t>(d))) {
          return Invalid(absl::StrCat(where, ".data[", i, "]: expected an INT32, got ", d));
        }
        const int32_t v = static_cast<int32_t>(values[i]);
        std::memcpy(&bytes[i * 4], &v, 4);
      }
    }
    return bytes;
  }
  if (datatype == "FP16" || datatype == "BF16") {
    bytes.resize(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const float f = static_cast<float>(values[i]);
      const uint16_t h = datatype == "FP16" ? FloatToFp16(f) : FloatToBf16(f);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
    return bytes;
  }
  if (datatype == "BOOL") {
    // v2's BOOL is one byte per element (the attention model's mask).
    bytes.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) bytes[i] = values[i] != 0.0 ? 1 : 0;
    return bytes;
  }
  return Invalid(absl::StrCat(where,
                              ".datatype: JSON data is read for FP16, BF16, FP32, INT32 and "
                              "BOOL, got \"",
                              datatype, "\""));
}

// ---- messages -> JSON ----

Json DecodeForJson(const std::string& datatype, const std::string& raw) {
  Json data = Json::array();
  if (datatype == "FP32") {
    for (size_t i = 0; i + 4 <= raw.size(); i += 4) {
      float f;
      std::memcpy(&f, &raw[i], 4);
      data.push_back(f);
    }
  } else if (datatype == "FP16" || datatype == "BF16") {
    for (size_t i = 0; i + 2 <= raw.size(); i += 2) {
      uint16_t h;
      std::memcpy(&h, &raw[i], 2);
      data.push_back(datatype == "FP16" ? Fp16ToFloat(h) : Bf16ToFloat(h));
    }
  }
  return data;
}

Json ParameterJson(const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam: return p.bool_param();
    case inference::InferParameter::kInt64Param: return p.int64_param();
    case inference::InferParameter::kUint64Param: return p.uint64_param();
    case inference::InferParameter::kDoubleParam: return p.double_param();
    case inference::InferParameter::kStringParam: return p.string_param();
    default: return nullptr;
  }
}

}  // namespace

// OK unless `text`'s arrays and objects nest deeper than kMaxJsonDepth.
// Brackets inside strings do not count.
absl::Status CheckJsonDepth(absl::string_view text) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        return Invalid(
            absl::StrCat("request body: JSON nested deeper than ", kMaxJsonDepth, " levels"));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> StringField(const std::string& where, const Json& object,
                                        const char* name) {
  auto it = object.find(name);
  if (it == object.end() || !it->is_string()) {
    return Invalid(absl::StrCat(where, ".", name, ": expected a string"));
  }
  return it->get<std::string>();
}

absl::Status ParseInferBody(absl::string_view body, std::optional<absl::string_view> header_value,
                            inference::ModelInferRequest* out, OutputForm* form) {
  size_t header_length = body.size();
  if (header_value.has_value()) {
    const std::string value(*header_value);
    if (!absl::SimpleAtoi(value, &header_length) || header_length > body.size()) {
      return Invalid(absl::StrCat(kInferHeaderContentLength, ": expected 0..", body.size(),
                                  ", got \"", value, "\""));
    }
  }
  absl::Status depth = CheckJsonDepth(body.substr(0, header_length));
  if (!depth.ok()) return depth;
  const Json j = Json::parse(body.begin(), body.begin() + header_length, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return Invalid("request body: expected a JSON object (the v2 inference request)");
  }
  if (auto id = j.find("id"); id != j.end()) {
    if (!id->is_string()) return Invalid("id: expected a string");
    out->set_id(id->get<std::string>());
  }
  absl::Status s =
      ToParameters("parameters", j.value("parameters", Json()), out->mutable_parameters());
  if (!s.ok()) return s;
  if (auto p = out->parameters().find("binary_data_output"); p != out->parameters().end()) {
    form->default_binary = p->second.bool_param();
  }
  auto inputs = j.find("inputs");
  if (inputs == j.end() || !inputs->is_array()) return Invalid("inputs: expected an array");
  size_t binary_offset = header_length;
  for (size_t i = 0; i < inputs->size(); ++i) {
    const Json& in = (*inputs)[i];
    std::string where = absl::StrCat("inputs[", i, "]");
    if (!in.is_object()) return Invalid(absl::StrCat(where, ": expected an object"));
    auto* tensor = out->add_inputs();
    absl::StatusOr<std::string> name = StringField(where, in, "name");
    if (!name.ok()) return name.status();
    where = absl::StrCat("inputs['", *name, "']");
    absl::StatusOr<std::string> datatype = StringField(where, in, "datatype");
    if (!datatype.ok()) return datatype.status();
    tensor->set_name(*name);
    tensor->set_datatype(*datatype);
    auto shape = in.find("shape");
    if (shape == in.end() || !shape->is_array())
      return Invalid(absl::StrCat(where, ".shape: expected an array"));
    for (const Json& d : *shape) {
      if (!d.is_number_integer()) return Invalid(absl::StrCat(where, ".shape: expected integers"));
      tensor->add_shape(d.get<int64_t>());
    }
    s = ToParameters(where + ".parameters", in.value("parameters", Json()),
                     tensor->mutable_parameters());
    if (!s.ok()) return s;
    auto& params = *tensor->mutable_parameters();
    if (auto b = params.find("binary_data_size"); b != params.end()) {
      const int64_t size = b->second.int64_param();
      if (b->second.parameter_choice_case() != inference::InferParameter::kInt64Param || size < 0 ||
          static_cast<uint64_t>(size) > body.size() - binary_offset) {
        return Invalid(absl::StrCat(where, ".parameters['binary_data_size']: expected 0..",
                                    body.size() - binary_offset,
                                    " (the binary data left in the body)"));
      }
      out->add_raw_input_contents(
          std::string(body.substr(binary_offset, static_cast<size_t>(size))));
      binary_offset += static_cast<size_t>(size);
      params.erase("binary_data_size");
    } else if (auto data = in.find("data"); data != in.end()) {
      absl::StatusOr<std::string> bytes =
          PackJsonData(where, *datatype, static_cast<size_t>(tensor->shape_size()), *data);
      if (!bytes.ok()) return bytes.status();
      *out->add_raw_input_contents() = *std::move(bytes);
    } else if (params.count("shared_memory_region") == 0) {
      return Invalid(
          absl::StrCat(where, ": expected data, binary_data_size or a shared memory region"));
    }
  }
  if (binary_offset != body.size()) {
    return Invalid(absl::StrCat("request body: ", body.size() - binary_offset,
                                " bytes of binary data that no input's binary_data_size claims"));
  }
  auto outputs = j.find("outputs");
  if (outputs != j.end()) {
    if (!outputs->is_array()) return Invalid("outputs: expected an array");
    for (size_t i = 0; i < outputs->size(); ++i) {
      const Json& o = (*outputs)[i];
      const std::string where = absl::StrCat("outputs[", i, "]");
      if (!o.is_object()) return Invalid(absl::StrCat(where, ": expected an object"));
      absl::StatusOr<std::string> name = StringField(where, o, "name");
      if (!name.ok()) return name.status();
      auto* requested = out->add_outputs();
      requested->set_name(*name);
      s = ToParameters(where + ".parameters", o.value("parameters", Json()),
                       requested->mutable_parameters());
      if (!s.ok()) return s;
      auto& params = *requested->mutable_parameters();
      if (auto b = params.find("binary_data"); b != params.end()) {
        (b->second.bool_param() ? form->binary : form->json).insert(*name);
        params.erase("binary_data");
      }
      if (params.count("shared_memory_region") > 0) form->shm.insert(*name);
    }
  }
  return absl::OkStatus();
}

EncodedInferResponse EncodeInferResponse(const inference::ModelInferResponse& r,
                                         const OutputForm& form) {
  Json j = {{"model_name", r.model_name()}, {"model_version", r.model_version()}};
  if (!r.id().empty()) j["id"] = r.id();
  Json params = Json::object();
  for (const auto& [k, v] : r.parameters()) params[k] = ParameterJson(v);
  j["parameters"] = params;
  Json outputs = Json::array();
  std::string blobs;
  for (int i = 0; i < r.outputs_size(); ++i) {
    const auto& o = r.outputs(i);
    Json out = {{"name", o.name()}, {"datatype", o.datatype()}, {"shape", Json::array()}};
    for (int64_t d : o.shape()) out["shape"].push_back(d);
    const std::string* raw = i < r.raw_output_contents_size() ? &r.raw_output_contents(i) : nullptr;
    const bool binary =
        form.binary.count(o.name()) > 0 || (form.default_binary && form.json.count(o.name()) == 0);
    if (form.shm.count(o.name()) > 0 || raw == nullptr) {
      // Written to shared memory: nothing to send.
    } else if (binary) {
      out["parameters"] = {{"binary_data_size", raw->size()}};
      blobs.append(*raw);
    } else {
      out["data"] = DecodeForJson(o.datatype(), *raw);
    }
    outputs.push_back(std::move(out));
  }
  j["outputs"] = std::move(outputs);
  std::string header = j.dump();
  if (blobs.empty()) return {std::move(header), std::nullopt};
  const size_t header_length = header.size();
  header.append(blobs);
  return {std::move(header), header_length};
}

}  // namespace attnserve
