// libFuzzer target: the KServe v2 HTTP infer body (server/kserve/v2_json.h),
// JSON and the binary tensor extension, to a ModelInferRequest, and the
// response encoding of what it parsed.
//
// Beyond "no crash, no hang, no sanitizer report" it checks:
//   - a refusal is INVALID_ARGUMENT with a message that starts by naming the
//     field (the header, the body, id, parameters, inputs or outputs);
//   - a body nested deeper than kMaxJsonDepth is refused, and one buried
//     under up to a quarter of a million brackets is refused without
//     recursing over them (a recursion that deep overflows the stack here);
//   - an accepted body, read again with nlohmann's own parser, nests no
//     deeper than kMaxJsonDepth, and each input's data no deeper than its
//     shape's rank (at least 1); each input has the body's name, datatype,
//     shape and parameters (less binary_data_size); an input with JSON data
//     has exactly (its numbers) x (its datatype's width) bytes, holding those
//     numbers converted to the datatype, an input with binary_data_size its
//     slice of the body, in order, the slices ending at the body's end, and
//     an input with neither names a shared memory region and has no bytes;
//   - the request's tensors and requested outputs sent back as outputs
//     encode to a body whose JSON part parses, with one entry per output,
//     binary_data_size equal to the output's bytes and the blobs summing to
//     what follows the JSON part, and JSON data holding one number per
//     element for FP16, BF16 and FP32.
// Input: one control byte, then the body. Bit 0: the request has the
// Inference-Header-Content-Length header, its value the bytes up to the first
// newline (the body follows it). Bit 1: the body is prefixed by
// kMaxJsonDepth + 1 + 4096 * (control >> 2) opening brackets. Seeds:
// corpus/http_json_fuzzer/ (written by hand: a control byte, then the body).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "inference/grpc_service.pb.h"
#include "server/kserve/v2_json.h"
#include "tests/fuzz/fuzz_check.h"

namespace attnserve {
namespace {

using Json = nlohmann::json;
constexpr char kTarget[] = "http_json_fuzzer";

[[noreturn]] void Fail(const std::string& what) { FuzzFail(kTarget, what); }

// The bytes of one element of `datatype` in JSON data; 0 for a datatype JSON
// data is not read for.
size_t JsonWidth(const std::string& datatype) {
  if (datatype == "FP32" || datatype == "INT32") return 4;
  if (datatype == "FP16" || datatype == "BF16") return 2;
  if (datatype == "BOOL") return 1;  // one byte per element, nonzero = true
  return 0;
}

// The numbers (and bools) of `data` in row-major order, and how deep its
// arrays nest (a scalar: 0). Iterative: this is the oracle, not the code.
void Leaves(const Json& data, std::vector<double>* out, size_t* depth) {
  struct Item {
    const Json* value;
    size_t depth;
  };
  std::vector<Item> stack{{&data, 0}};
  *depth = 0;
  while (!stack.empty()) {
    const Item item = stack.back();
    stack.pop_back();
    if (item.value->is_array()) {
      *depth = std::max(*depth, item.depth + 1);
      for (auto it = item.value->rbegin(); it != item.value->rend(); ++it) {
        stack.push_back({&*it, item.depth + 1});
      }
    } else if (item.value->is_boolean()) {
      out->push_back(item.value->get<bool>() ? 1.0 : 0.0);
    } else if (item.value->is_number()) {
      out->push_back(item.value->get<double>());
    }
  }
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void CheckRefusal(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument) {
    Fail(absl::StrCat("a refusal that is not INVALID_ARGUMENT: ", status.ToString()));
  }
  const absl::string_view message = status.message();
  static constexpr const char* kFields[] = {
      kInferHeaderContentLength, "request body", "id:", "parameters", "inputs", "outputs"};
  for (const char* field : kFields) {
    if (absl::StartsWith(message, field)) return;
  }
  Fail(absl::StrCat("a refusal that names no field: \"", message, "\""));
}

// The accepted request against the body read again by nlohmann's parser.
// Whether each input has a raw_input_contents entry.
std::vector<bool> CheckAccepted(absl::string_view body, size_t header_length,
                                const inference::ModelInferRequest& request) {
  int max_depth = -1;
  const Json j = Json::parse(
      body.begin(), body.begin() + header_length,
      [&](int depth, Json::parse_event_t event, Json&) {
        if (event == Json::parse_event_t::object_start ||
            event == Json::parse_event_t::array_start) {
          max_depth = std::max(max_depth, depth);
        }
        return true;
      },
      false);
  if (j.is_discarded() || !j.is_object()) Fail("accepted a body that is not a JSON object");
  if (max_depth + 1 > kMaxJsonDepth) {
    Fail(absl::StrCat("accepted a body nested ", max_depth + 1, " levels deep"));
  }
  const Json& inputs = j.at("inputs");
  if (request.inputs_size() != static_cast<int>(inputs.size())) {
    Fail(absl::StrCat(inputs.size(), " inputs in the body, ", request.inputs_size(), " parsed"));
  }
  size_t offset = header_length;
  int slot = 0;
  std::vector<bool> has_bytes(static_cast<size_t>(request.inputs_size()), true);
  for (int i = 0; i < request.inputs_size(); ++i) {
    const Json& in = inputs[static_cast<size_t>(i)];
    const inference::ModelInferRequest::InferInputTensor& t = request.inputs(i);
    const std::string where = absl::StrCat("inputs[", i, "]");
    if (t.name() != in.at("name").get<std::string>() ||
        t.datatype() != in.at("datatype").get<std::string>()) {
      Fail(where + ": name or datatype differs from the body's");
    }
    const Json& shape = in.at("shape");
    if (t.shape_size() != static_cast<int>(shape.size())) Fail(where + ": rank differs");
    for (int d = 0; d < t.shape_size(); ++d) {
      if (t.shape(d) != shape[static_cast<size_t>(d)].get<int64_t>()) {
        Fail(where + ": shape differs");
      }
    }
    const Json params = in.value("parameters", Json::object());
    const bool binary = params.is_object() && params.contains("binary_data_size");
    const size_t param_count = params.is_object() ? params.size() : 0;
    if (static_cast<size_t>(t.parameters_size()) != param_count - (binary ? 1 : 0) ||
        t.parameters().count("binary_data_size") > 0) {
      Fail(where + ": parameters differ from the body's");
    }
    if (binary) {
      const uint64_t size = params["binary_data_size"].get<uint64_t>();
      if (slot >= request.raw_input_contents_size() ||
          request.raw_input_contents(slot) != body.substr(offset, size)) {
        Fail(where + ": bytes are not its slice of the body");
      }
      offset += size;
      ++slot;
    } else if (in.contains("data")) {
      std::vector<double> values;
      size_t depth = 0;
      Leaves(in["data"], &values, &depth);
      if (depth > std::max<size_t>(static_cast<size_t>(t.shape_size()), 1)) {
        Fail(absl::StrCat(where, ": data nested ", depth, " deep accepted for rank ",
                          t.shape_size()));
      }
      const size_t width = JsonWidth(t.datatype());
      if (width == 0) Fail(where + ": JSON data accepted for datatype " + t.datatype());
      if (slot >= request.raw_input_contents_size()) Fail(where + ": no bytes for its data");
      const std::string& raw = request.raw_input_contents(slot);
      if (raw.size() != values.size() * width) {
        Fail(absl::StrCat(where, ": ", raw.size(), " bytes for ", values.size(), " ", t.datatype(),
                          " numbers"));
      }
      for (size_t e = 0; e < values.size(); ++e) {
        const float f = static_cast<float>(values[e]);
        bool same = false;
        if (t.datatype() == "FP32") {
          float got;
          std::memcpy(&got, &raw[e * 4], 4);
          same = SameBits(got, f);
        } else if (t.datatype() == "INT32") {
          int32_t got;
          std::memcpy(&got, &raw[e * 4], 4);
          same = static_cast<double>(got) == values[e];
        } else if (t.datatype() == "BOOL") {
          same = raw[e] == (values[e] != 0.0 ? 1 : 0);
        } else {
          uint16_t got;
          std::memcpy(&got, &raw[e * 2], 2);
          same = got == (t.datatype() == "FP16" ? FloatToFp16(f) : FloatToBf16(f));
        }
        if (!same) Fail(absl::StrCat(where, ".data[", e, "]: packed as another value"));
      }
      ++slot;
    } else if (t.parameters().count("shared_memory_region") == 0) {
      Fail(where + ": accepted with no data, no binary data and no shared memory region");
    } else {
      has_bytes[static_cast<size_t>(i)] = false;
    }
  }
  if (slot != request.raw_input_contents_size()) {
    Fail(absl::StrCat(request.raw_input_contents_size(), " raw_input_contents entries for ", slot,
                      " inputs with data"));
  }
  if (offset != body.size()) Fail("accepted binary data no input claims");
  return has_bytes;
}

// The request's tensors (and its requested outputs, as FP32 vectors) sent
// back as a response in `form`.
void CheckResponse(const inference::ModelInferRequest& request, const std::vector<bool>& has_bytes,
                   const OutputForm& form) {
  inference::ModelInferResponse r;
  r.set_model_name("attention");
  r.set_id(request.id());
  *r.mutable_parameters() = request.parameters();
  int slot = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& in = request.inputs(i);
    auto* o = r.add_outputs();
    o->set_name(in.name());
    o->set_datatype(in.datatype());
    *o->mutable_shape() = in.shape();
    r.add_raw_output_contents(has_bytes[static_cast<size_t>(i)] ? request.raw_input_contents(slot++)
                                                                : std::string());
  }
  for (int i = 0; i < request.outputs_size(); ++i) {
    auto* o = r.add_outputs();
    o->set_name(request.outputs(i).name());
    o->set_datatype("FP32");
    o->add_shape(i % 5);
    r.add_raw_output_contents(std::string(static_cast<size_t>(i % 5) * 4, '\x3f'));
  }
  EncodedInferResponse encoded;
  try {
    encoded = EncodeInferResponse(r, form);
  } catch (const std::exception& e) {
    Fail(absl::StrCat("encoding the response threw: ", e.what()));
  }
  const size_t header_length = encoded.header_length.value_or(encoded.body.size());
  if (header_length > encoded.body.size()) Fail("response header length past its body");
  const Json j =
      Json::parse(encoded.body.begin(), encoded.body.begin() + header_length, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("outputs")) {
    Fail("the response's JSON part does not parse");
  }
  const Json& outputs = j["outputs"];
  if (outputs.size() != static_cast<size_t>(r.outputs_size())) Fail("response outputs differ");
  size_t blobs = 0;
  for (int i = 0; i < r.outputs_size(); ++i) {
    const Json& o = outputs[static_cast<size_t>(i)];
    const std::string& raw = r.raw_output_contents(i);
    const std::string& datatype = r.outputs(i).datatype();
    if (o.contains("parameters")) {
      if (o["parameters"].at("binary_data_size").get<uint64_t>() != raw.size()) {
        Fail(absl::StrCat("outputs[", i, "]: binary_data_size is not its byte size"));
      }
      blobs += raw.size();
    } else if (o.contains("data")) {
      const size_t width = datatype == "FP32"                           ? 4
                           : (datatype == "FP16" || datatype == "BF16") ? 2
                                                                        : 0;
      const size_t expected = width == 0 ? 0 : raw.size() / width;
      if (o["data"].size() != expected) {
        Fail(absl::StrCat("outputs[", i, "]: ", o["data"].size(), " numbers for ", raw.size(),
                          " bytes of ", datatype));
      }
    }
  }
  if (blobs != encoded.body.size() - header_length ||
      (blobs == 0) != !encoded.header_length.has_value()) {
    Fail(absl::StrCat("response blobs: ", blobs, " bytes claimed, ",
                      encoded.body.size() - header_length, " sent"));
  }
}

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  if (size == 0) return 0;
  const uint8_t control = data[0];
  absl::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::optional<absl::string_view> header;
  if (control & 1) {
    const size_t newline = rest.find('\n');
    header = rest.substr(0, newline);
    rest = newline == absl::string_view::npos ? absl::string_view() : rest.substr(newline + 1);
  }
  std::string body;
  const bool deep = (control & 2) != 0;
  if (deep) body.assign(kMaxJsonDepth + 1 + 4096 * static_cast<size_t>(control >> 2), '[');
  body.append(rest.data(), rest.size());

  inference::ModelInferRequest request;
  OutputForm form;
  const absl::Status status = ParseInferBody(body, header, &request, &form);
  // HTTP_JSON_FUZZER_VERBOSE=1: say what each input gave (to read a seed or a finding).
  static const bool verbose = std::getenv("HTTP_JSON_FUZZER_VERBOSE") != nullptr;
  if (verbose) {
    std::fprintf(stderr, "http_json_fuzzer: %s, %d inputs, %d raw\n", status.ToString().c_str(),
                 request.inputs_size(), request.raw_input_contents_size());
  }
  if (!status.ok()) {
    CheckRefusal(status);
    return 0;
  }
  if (deep) Fail("accepted a body under more than kMaxJsonDepth brackets");
  size_t header_length = body.size();
  if (header.has_value() && !absl::SimpleAtoi(*header, &header_length)) {
    Fail("accepted an Inference-Header-Content-Length that is not a number");
  }
  const std::vector<bool> has_bytes = CheckAccepted(body, header_length, request);
  CheckResponse(request, has_bytes, form);
  return 0;
}
