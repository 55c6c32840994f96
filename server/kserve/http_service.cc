// KServe v2 HTTP/REST; see http_service.h. Requests become the gRPC side's
// messages (inference::ModelInferRequest and friends) and answers are turned
// back into Triton's JSON. JSON is parsed without exceptions and every field
// is type-checked before use.
#include "server/kserve/http_service.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/cache_id_header.h"
#include "common/dtype.h"
#include "server/in_flight.h"
#include "server/tenant.h"

#ifdef ATTNSERVE_HAVE_HTTPLIB
#include <nlohmann/json.hpp>

#include "server/http_listener.h"
#include "server/security/http_tls.h"
#endif

namespace attnserve {

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange: return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kAborted: return 409;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kCancelled: return 499;
    case absl::StatusCode::kUnimplemented: return 501;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

#ifdef ATTNSERVE_HAVE_HTTPLIB
namespace {

using Json = nlohmann::json;

// What a JSON body may take once parsed, per byte of body: nlohmann's
// document (a 16-byte value per number plus array overhead), the flattened
// doubles and the packed tensor. JSON bodies are capped at
// max_request_bytes / kJsonBodyDivisor so that this stays below the limit
// binary bodies have.
constexpr int64_t kJsonExpansion = 24;
constexpr int64_t kJsonBodyDivisor = 16;
// As the gRPC receive limit: a body just over max_request_bytes still reaches
// validation, which names the limit.
constexpr int64_t kBodySlackBytes = 64 * 1024;
constexpr char kHeaderLength[] = "Inference-Header-Content-Length";

void Reply(httplib::Response& res, const absl::Status& status, const Json& body = Json::object()) {
  res.status = HttpStatusFor(status.code());
  if (status.ok()) {
    res.set_content(body.dump(), "application/json");
  } else {
    res.set_content(Json{{"error", std::string(status.message())}}.dump(), "application/json");
  }
}

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

absl::StatusOr<std::string> StringField(const std::string& where, const Json& object,
                                        const char* name) {
  auto it = object.find(name);
  if (it == object.end() || !it->is_string()) {
    return Invalid(absl::StrCat(where, ".", name, ": expected a string"));
  }
  return it->get<std::string>();
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
        if (values[i] != static_cast<double>(static_cast<int32_t>(values[i]))) {
          return Invalid(absl::StrCat(where, ".data[", i, "]: expected an INT32, got ", values[i]));
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
  return Invalid(absl::StrCat(where,
                              ".datatype: JSON data is read for FP16, BF16, FP32 and "
                              "INT32, got \"",
                              datatype, "\""));
}

// The deepest nesting of arrays and objects a request body may have: an
// inference request is an object of inputs holding data nested as deep as
// its rank. Checked before parsing, so nothing (the parser, the flattening,
// the document's destructor) recurses over a hostile depth.
constexpr int kMaxJsonDepth = 64;

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

// Which requested outputs want binary data, and which go to shared memory.
struct OutputForm {
  bool default_binary = false;
  std::set<std::string> binary;
  std::set<std::string> json;
  std::set<std::string> shm;
};

// The JSON header plus binary blobs of an infer call -> ModelInferRequest.
absl::Status ParseInferRequest(const httplib::Request& req, inference::ModelInferRequest* out,
                               OutputForm* form) {
  size_t header_length = req.body.size();
  if (req.has_header(kHeaderLength)) {
    const std::string value = req.get_header_value(kHeaderLength);
    if (!absl::SimpleAtoi(value, &header_length) || header_length > req.body.size()) {
      return Invalid(
          absl::StrCat(kHeaderLength, ": expected 0..", req.body.size(), ", got \"", value, "\""));
    }
  }
  absl::Status depth = CheckJsonDepth(absl::string_view(req.body.data(), header_length));
  if (!depth.ok()) return depth;
  const Json j = Json::parse(req.body.begin(), req.body.begin() + header_length, nullptr, false);
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
          static_cast<uint64_t>(size) > req.body.size() - binary_offset) {
        return Invalid(absl::StrCat(where, ".parameters['binary_data_size']: expected 0..",
                                    req.body.size() - binary_offset,
                                    " (the binary data left in the body)"));
      }
      out->add_raw_input_contents(req.body.substr(binary_offset, static_cast<size_t>(size)));
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
  if (binary_offset != req.body.size()) {
    return Invalid(absl::StrCat("request body: ", req.body.size() - binary_offset,
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

// The response header and, for binary outputs, the blobs to append.
void WriteInferResponse(inference::ModelInferResponse& r, const OutputForm& form,
                        httplib::Response& res) {
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
    std::string* raw =
        i < r.raw_output_contents_size() ? r.mutable_raw_output_contents(i) : nullptr;
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
  if (blobs.empty()) {
    res.set_content(header, "application/json");
    return;
  }
  res.set_header(kHeaderLength, std::to_string(header.size()));
  header.append(blobs);
  res.set_content(header, "application/octet-stream");
}

Json MetadataJson(const inference::ModelMetadataResponse& m) {
  auto tensors = [](const auto& list) {
    Json out = Json::array();
    for (const auto& t : list) {
      Json shape = Json::array();
      for (int64_t d : t.shape()) shape.push_back(d);
      out.push_back({{"name", t.name()}, {"datatype", t.datatype()}, {"shape", shape}});
    }
    return out;
  };
  Json versions = Json::array();
  for (const auto& v : m.versions()) versions.push_back(v);
  return {{"name", m.name()},
          {"versions", versions},
          {"platform", m.platform()},
          {"inputs", tensors(m.inputs())},
          {"outputs", tensors(m.outputs())}};
}

// Triton's config JSON: proto field names, enum names, numbers as numbers.
Json ConfigJson(const inference::ModelConfig& c) {
  auto tensors = [](const auto& list) {
    Json out = Json::array();
    for (const auto& t : list) {
      Json dims = Json::array();
      for (int64_t d : t.dims()) dims.push_back(d);
      out.push_back({{"name", t.name()},
                     {"data_type", inference::DataType_Name(t.data_type())},
                     {"dims", dims}});
    }
    return out;
  };
  Json j = {{"name", c.name()},
            {"platform", c.platform()},
            {"backend", c.backend()},
            {"max_batch_size", c.max_batch_size()},
            {"input", tensors(c.input())},
            {"output", tensors(c.output())}};
  for (int i = 0; i < c.input_size(); ++i) j["input"][i]["optional"] = c.input(i).optional();
  if (c.has_dynamic_batching()) {
    j["dynamic_batching"] = {
        {"max_queue_delay_microseconds", c.dynamic_batching().max_queue_delay_microseconds()}};
  }
  Json params = Json::object();
  for (const auto& [k, v] : c.parameters()) params[k] = {{"string_value", v.string_value()}};
  j["parameters"] = params;
  return j;
}

Json StatisticsJson(const inference::ModelStatisticsResponse& r) {
  auto duration = [](const inference::StatisticDuration& d) {
    return Json{{"count", d.count()}, {"ns", d.ns()}};
  };
  Json models = Json::array();
  for (const auto& m : r.model_stats()) {
    const auto& s = m.inference_stats();
    models.push_back({{"name", m.name()},
                      {"version", m.version()},
                      {"last_inference", m.last_inference()},
                      {"inference_count", m.inference_count()},
                      {"execution_count", m.execution_count()},
                      {"inference_stats",
                       {{"success", duration(s.success())},
                        {"fail", duration(s.fail())},
                        {"queue", duration(s.queue())},
                        {"compute_input", duration(s.compute_input())},
                        {"compute_infer", duration(s.compute_infer())},
                        {"compute_output", duration(s.compute_output())},
                        {"cache_hit", duration(s.cache_hit())},
                        {"cache_miss", duration(s.cache_miss())}}},
                      {"batch_stats", Json::array()}});
  }
  return {{"model_stats", models}};
}

// A JSON request body (may be empty: then {}).
absl::StatusOr<Json> BodyObject(const httplib::Request& req) {
  if (req.body.empty()) return Json::object();
  absl::Status depth = CheckJsonDepth(req.body);
  if (!depth.ok()) return depth;
  Json j = Json::parse(req.body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Invalid("request body: expected a JSON object");
  return j;
}

absl::StatusOr<uint64_t> UintField(const Json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return uint64_t{0};
  if (!it->is_number_unsigned()) {
    return Invalid(absl::StrCat(name, ": expected a non-negative integer"));
  }
  return it->get<uint64_t>();
}

class KserveHttpServerImpl final : public KserveHttpServer {
 public:
  KserveHttpServerImpl(KserveContext* context, int64_t max_request_bytes, HttpServerWithTls http)
      : context_(context),
        max_json_body_bytes_(std::max<int64_t>(max_request_bytes / kJsonBodyDivisor, 1)),
        max_body_bytes_(max_request_bytes + kBodySlackBytes),
        holder_(std::move(http)),
        http_(*holder_.server) {
    // Small requests and responses must not wait for Nagle's algorithm.
    http_.set_tcp_nodelay(true);
    http_.set_payload_max_length(static_cast<size_t>(max_body_bytes_));
    // A handler that throws answers a v2 error naming it; httplib's default
    // would answer 500 with the exception's text in a header.
    http_.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr e) {
          Reply(res, StatusOfException(e, "request"));
        });
    Authenticate();
    Routes();
  }
  ~KserveHttpServerImpl() override { Stop(); }

  absl::Status Bind(const std::string& host, int port) {
    return listener_.Start("KServe v2 HTTP", host, port);
  }

  int port() const override { return listener_.port(); }

  void Stop() override { listener_.Stop(); }

 private:
  // The model named in the path (`matches` 1 and 2: name and optional version).
  absl::StatusOr<KserveModel*> ModelOf(const httplib::Request& req) {
    return context_->models.Find(req.matches[1],
                                 req.matches.size() > 2 ? req.matches[2].str() : "");
  }

  // A POST whose body is not read. tritonclient sends these with an empty body
  // and no Content-Length, which httplib's ordinary handlers would wait on
  // until the read timeout; a content-reader handler that never reads does not.
  void PostWithoutBody(const std::string& pattern, httplib::Server::Handler handler) {
    http_.Post(pattern, [handler = std::move(handler)](
                            const httplib::Request& req, httplib::Response& res,
                            const httplib::ContentReader&) { handler(req, res); });
  }

  // Runs before the body is read: a Content-Length over what the body may be
  // (binary: --max_request_bytes; JSON inference: a sixteenth of it) or over
  // what the server may still buffer is refused without reading it, and the
  // connection closed since its body was left unread.
  bool RefuseLargeBody(const httplib::Request& req, httplib::Response& res) {
    if (!req.has_header("Content-Length")) return false;
    int64_t length = 0;
    if (!absl::SimpleAtoi(req.get_header_value("Content-Length"), &length) || length < 0) {
      return false;  // httplib answers a malformed length itself
    }
    absl::Status refused;
    const bool json = !req.has_header(kHeaderLength);
    if (length > max_body_bytes_) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("request body: ", length, " bytes; at most --max_request_bytes=",
                       max_body_bytes_ - kBodySlackBytes, " are accepted"));
    } else if (json && absl::EndsWith(req.path, "/infer") && length > max_json_body_bytes_) {
      refused = JsonTooLarge(length);
    } else if (const int64_t limit = context_->buffered.limit();
               limit > 0 && length > limit - context_->buffered.used()) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("request body: ", length,
                       " bytes; the server holds as many request bytes as it may "
                       "(--max_buffered_bytes=",
                       limit, "); retry later"));
    }
    if (refused.ok()) return false;
    Reply(res, refused);
    res.status = 413;
    res.set_header("Connection", "close");
    return true;
  }

  // With bearer tokens on, every call but the health probes needs one: a
  // missing or unknown token is answered 401 before any route runs.
  void Authenticate() {
    http_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (RefuseLargeBody(req, res)) return httplib::Server::HandlerResponse::Handled;
      if (context_->auth == nullptr || req.path == "/v2/health/live" ||
          req.path == "/v2/health/ready") {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      // Exactly one: with two, which one a check reads is a choice an
      // attacker could exploit. Refused (and counted) as a call without one.
      const bool several = req.get_header_value_count("Authorization") > 1;
      absl::StatusOr<std::string> tenant =
          context_->auth->Authenticate(several ? "" : req.get_header_value("Authorization"));
      if (several)
        tenant = absl::UnauthenticatedError("authorization: expected one header, got several");
      if (tenant.ok()) return httplib::Server::HandlerResponse::Unhandled;
      res.set_header("WWW-Authenticate", "Bearer");
      Reply(res, tenant.status());
      return httplib::Server::HandlerResponse::Handled;
    });
  }

  // The tenant of a call the pre-routing handler let through
  // (kWithdrawnTenant should the tokens file drop its token in between).
  std::string TenantOf(const httplib::Request& req) const {
    absl::StatusOr<std::string> tenant =
        TenantForCall(context_->auth, req.get_header_value("Authorization"), /*count=*/false);
    return tenant.ok() ? *tenant : std::string(kWithdrawnTenant);
  }

  void Routes() {
    const std::string model = R"(/v2/models/([^/]+)(?:/versions/([^/]+))?)";
    http_.Get("/v2/health/live",
              [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
    http_.Get("/v2/health/ready", [this](const httplib::Request&, httplib::Response& res) {
      res.status = context_->ready() ? 200 : 503;
    });
    http_.Get("/v2", [this](const httplib::Request&, httplib::Response& res) {
      inference::ServerMetadataResponse m;
      context_->FillServerMetadata(&m);
      Json extensions = Json::array();
      for (const auto& e : m.extensions()) extensions.push_back(e);
      Reply(res, absl::OkStatus(),
            {{"name", m.name()}, {"version", m.version()}, {"extensions", extensions}});
    });
    // Before the model routes, which would take "stats" for a model name.
    auto stats = [this](const httplib::Request& req, httplib::Response& res) {
      inference::ModelStatisticsResponse r;
      const std::string name = req.matches.size() > 1 ? req.matches[1].str() : "";
      const std::string version = req.matches.size() > 2 ? req.matches[2].str() : "";
      absl::Status s = context_->FillStatistics(name, version, &r);
      Reply(res, s, s.ok() ? StatisticsJson(r) : Json());
    };
    http_.Get("/v2/models/stats", stats);
    http_.Get(model + "/stats", stats);
    http_.Get(model, [this](const httplib::Request& req, httplib::Response& res) {
      absl::StatusOr<KserveModel*> m = ModelOf(req);
      if (!m.ok()) return Reply(res, m.status());
      inference::ModelMetadataResponse meta;
      (*m)->FillMetadata(&meta);
      Reply(res, absl::OkStatus(), MetadataJson(meta));
    });
    http_.Get(model + "/ready", [this](const httplib::Request& req, httplib::Response& res) {
      absl::StatusOr<KserveModel*> m = ModelOf(req);
      if (!m.ok()) return Reply(res, m.status());
      res.status = context_->ready() && (*m)->ready() ? 200 : 503;
    });
    http_.Get(model + "/config", [this](const httplib::Request& req, httplib::Response& res) {
      absl::StatusOr<KserveModel*> m = ModelOf(req);
      if (!m.ok()) return Reply(res, m.status());
      inference::ModelConfig config;
      (*m)->FillConfig(&config);
      Reply(res, absl::OkStatus(), ConfigJson(config));
    });
    PostWithoutBody(
        "/v2/repository/index", [this](const httplib::Request&, httplib::Response& res) {
          inference::RepositoryIndexResponse r;
          context_->FillRepositoryIndex(&r);
          Json models = Json::array();
          for (const auto& m : r.models()) {
            models.push_back({{"name", m.name()}, {"version", m.version()}, {"state", m.state()}});
          }
          Reply(res, absl::OkStatus(), models);
        });
    http_.Post(model + "/infer",
               [this](const httplib::Request& req, httplib::Response& res) { Infer(req, res); });
    SharedMemoryRoutes();
  }

  void Infer(const httplib::Request& req, httplib::Response& res) {
    // Held until this handler returns, however it returns.
    InFlightCounter::Hold in_flight(&context_->in_flight);
    absl::Status status;
    try {
      status = InferOrThrow(req, res);
    } catch (...) {
      status = StatusOfException(std::current_exception(), "infer");
    }
    if (!status.ok()) Reply(res, status);
  }

  // What the request holds while it runs: its body, and for JSON tensors the
  // parsed document and the packed tensors (kJsonExpansion times the body).
  int64_t BufferedBytesOf(const httplib::Request& req) const {
    const int64_t body = static_cast<int64_t>(req.body.size());
    return req.has_header(kHeaderLength) ? 2 * body : kJsonExpansion * body;
  }

  absl::Status InferOrThrow(const httplib::Request& req, httplib::Response& res) {
    if (!req.has_header(kHeaderLength) &&
        static_cast<int64_t>(req.body.size()) > max_json_body_bytes_) {
      return JsonTooLarge(static_cast<int64_t>(req.body.size()));
    }
    const int64_t charge = BufferedBytesOf(req);
    if (!context_->buffered.TryCharge(charge)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the server holds as many request bytes as it may (--max_buffered_bytes=",
                       context_->buffered.limit(), "); retry later"));
    }
    struct Uncharge {
      ByteBudget* budget;
      int64_t bytes;
      ~Uncharge() { budget->Release(bytes); }
    } uncharge{&context_->buffered, charge};

    absl::StatusOr<KserveModel*> model = ModelOf(req);
    if (!model.ok()) return model.status();
    // Shared with the completion, so that a model that throws after handing
    // the call on cannot write into freed memory when it completes later.
    struct State {
      inference::ModelInferRequest request;
      inference::ModelInferResponse response;
      absl::Status status;
      absl::Notification done;
    };
    auto state = std::make_shared<State>();
    OutputForm form;
    if (absl::Status parsed = ParseInferRequest(req, &state->request, &form); !parsed.ok()) {
      return parsed;
    }
    state->request.set_model_name((*model)->name());
    const Once<const absl::Status&> done([state](const absl::Status& s) {
      state->status = s;
      state->done.Notify();
    });
    InferCall call;
    call.request = &state->request;
    call.response = &state->response;
    call.tenant = TenantOf(req);
    call.cache_id_header = req.get_header_value(kCacheIdHeader);
    call.cancelled = std::make_shared<std::atomic<bool>>(false);
    call.done = done.Callback();
    const absl::Status held = HoldInFlight(context_->tenants, call.tenant,
                                           static_cast<int64_t>(req.body.size()), &call.done);
    if (!held.ok()) return held;
    try {
      (*model)->Infer(std::move(call));
    } catch (...) {
      done(StatusOfException(std::current_exception(), "infer"));
    }
    state->done.WaitForNotification();
    if (!state->status.ok()) return state->status;
    WriteInferResponse(state->response, form, res);
    return absl::OkStatus();
  }

  absl::Status JsonTooLarge(int64_t bytes) const {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request body: ", bytes, " bytes of JSON; JSON tensors are accepted up to ",
        max_json_body_bytes_,
        " bytes (--max_request_bytes / 16, since parsed JSON takes many times its size): send "
        "large tensors with the binary tensor extension (Inference-Header-Content-Length)"));
  }

  void SharedMemoryRoutes() {
    for (const ShmKind kind : {ShmKind::kSystem, ShmKind::kCuda}) {
      const std::string base =
          kind == ShmKind::kSystem ? "/v2/systemsharedmemory" : "/v2/cudasharedmemory";
      auto status = [this, kind](const httplib::Request& req, httplib::Response& res) {
        const std::string name = req.matches.size() > 1 ? req.matches[1].str() : "";
        absl::StatusOr<std::vector<ShmRegionInfo>> regions =
            context_->shm.List(TenantOf(req), kind, name);
        if (!regions.ok()) return Reply(res, regions.status());
        Json out = Json::array();
        for (const ShmRegionInfo& r : *regions) {
          if (kind == ShmKind::kSystem) {
            out.push_back({{"name", r.name},
                           {"key", r.key},
                           {"offset", r.offset},
                           {"byte_size", r.byte_size}});
          } else {
            out.push_back(
                {{"name", r.name}, {"device_id", r.device_id}, {"byte_size", r.byte_size}});
          }
        }
        Reply(res, absl::OkStatus(), out);
      };
      http_.Get(base + "/status", status);
      http_.Get(base + "/region/([^/]+)/status", status);
      auto unregister = [this, kind](const httplib::Request& req, httplib::Response& res) {
        const std::string name = req.matches.size() > 1 ? req.matches[1].str() : "";
        Reply(res, context_->shm.Unregister(TenantOf(req), kind, name));
      };
      PostWithoutBody(base + "/unregister", unregister);
      PostWithoutBody(base + "/region/([^/]+)/unregister", unregister);
      http_.Post(base + "/region/([^/]+)/register",
                 [this, kind](const httplib::Request& req, httplib::Response& res) {
                   Reply(res, Register(kind, req));
                 });
    }
  }

  absl::Status Register(ShmKind kind, const httplib::Request& req) {
    absl::StatusOr<Json> body = BodyObject(req);
    if (!body.ok()) return body.status();
    absl::StatusOr<uint64_t> byte_size = UintField(*body, "byte_size");
    if (!byte_size.ok()) return byte_size.status();
    const std::string name = req.matches[1];
    if (kind == ShmKind::kSystem) {
      absl::StatusOr<std::string> key = StringField("request body", *body, "key");
      if (!key.ok()) return key.status();
      absl::StatusOr<uint64_t> offset = UintField(*body, "offset");
      if (!offset.ok()) return offset.status();
      return context_->shm.RegisterSystem(TenantOf(req), name, *key, *offset, *byte_size);
    }
    // {"raw_handle": {"b64": "..."}, "device_id": N, "byte_size": N}
    auto handle = body->find("raw_handle");
    std::string raw;
    if (handle == body->end() || !handle->is_object() || !handle->contains("b64") ||
        !(*handle)["b64"].is_string() ||
        !absl::Base64Unescape((*handle)["b64"].get<std::string>(), &raw)) {
      return Invalid("raw_handle: expected {\"b64\": base64 of a cudaIpcMemHandle_t}");
    }
    absl::StatusOr<uint64_t> device = UintField(*body, "device_id");
    if (!device.ok()) return device.status();
    return context_->shm.RegisterCuda(TenantOf(req), name, raw, static_cast<int64_t>(*device),
                                      *byte_size);
  }

  KserveContext* const context_;
  const int64_t max_json_body_bytes_;
  const int64_t max_body_bytes_;
  HttpServerWithTls holder_;
  httplib::Server& http_;
  HttpListener listener_{&http_};
};

}  // namespace

absl::StatusOr<std::unique_ptr<KserveHttpServer>> KserveHttpServer::Start(const std::string& host,
                                                                          int port,
                                                                          int64_t max_request_bytes,
                                                                          KserveContext* context,
                                                                          const TlsFiles& tls) {
  absl::StatusOr<HttpServerWithTls> http = MakeHttpServer(tls);
  if (!http.ok()) return http.status();
  auto server =
      std::make_unique<KserveHttpServerImpl>(context, max_request_bytes, *std::move(http));
  absl::Status bound = server->Bind(host, port);
  if (!bound.ok()) return bound;
  return server;
}

#else  // !ATTNSERVE_HAVE_HTTPLIB

absl::StatusOr<std::unique_ptr<KserveHttpServer>> KserveHttpServer::Start(const std::string& host,
                                                                          int port, int64_t,
                                                                          KserveContext*,
                                                                          const TlsFiles&) {
  return absl::UnimplementedError(
      absl::StrCat("KServe v2 HTTP: this build has no HTTP library (a static build), so ", host,
                   ":", port, " is not served"));
}

#endif  // ATTNSERVE_HAVE_HTTPLIB

}  // namespace attnserve
