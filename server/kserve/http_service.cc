// KServe v2 HTTP/REST; see http_service.h. Requests become the gRPC side's
// messages (inference::ModelInferRequest and friends) and answers are turned
// back into Triton's JSON. JSON is parsed without exceptions and every field
// is type-checked before use.
#include "server/kserve/http_service.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/cache_id_header.h"
#include "server/in_flight.h"
#include "server/kserve/v2_json.h"
#include "server/tenant.h"

#ifdef ATTNSERVE_HAVE_HTTPLIB
#include <nlohmann/json.hpp>

#include "server/http_connection.h"
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
constexpr const char* kHeaderLength = kInferHeaderContentLength;

void Reply(httplib::Response& res, const absl::Status& status, const Json& body = Json::object()) {
  res.status = HttpStatusFor(status.code());
  if (status.ok()) {
    res.set_content(body.dump(), "application/json");
  } else {
    res.set_content(Json{{"error", std::string(status.message())}}.dump(), "application/json");
  }
}

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

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
  // connection closed since its body was left unread. A body let through is
  // charged to the budget until its response is ready, so bodies read at
  // once cannot each count on the same free bytes.
  bool RefuseLargeBody(const httplib::Request& req, httplib::Response& res) {
    if (req.has_header("Transfer-Encoding")) {
      // Its size is known only once read: it could not be charged first.
      Reply(res, Invalid("Transfer-Encoding: request bodies are accepted with a Content-Length "
                         "only"));
      res.status = 411;
      res.set_header("Connection", "close");
      return true;
    }
    if (!req.has_header("Content-Length")) return false;
    int64_t length = 0;
    absl::Status refused;
    if (!absl::SimpleAtoi(req.get_header_value("Content-Length"), &length) || length < 0) {
      // httplib would read what strtoull makes of it.
      Reply(res, Invalid("Content-Length: expected a non-negative integer"));
      res.set_header("Connection", "close");
      return true;
    }
    const bool json = !req.has_header(kHeaderLength);
    if (length > max_body_bytes_) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("request body: ", length, " bytes; at most --max_request_bytes=",
                       max_body_bytes_ - kBodySlackBytes, " are accepted"));
    } else if (json && absl::EndsWith(req.path, "/infer") && length > max_json_body_bytes_) {
      refused = JsonTooLarge(length);
    } else if (!context_->buffered.TryCharge(length)) {
      refused = absl::ResourceExhaustedError(
          absl::StrCat("request body: ", length,
                       " bytes; the server holds as many request bytes as it may "
                       "(--max_buffered_bytes=",
                       context_->buffered.limit(), "); retry later"));
    } else {
      ReleaseWhenAnswered([budget = &context_->buffered, length] { budget->Release(length); });
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

  // What the request holds while it runs beyond its body, which
  // RefuseLargeBody charged by its Content-Length: a copy, or for JSON
  // tensors the parsed document and the packed tensors (kJsonExpansion times
  // the body in all).
  int64_t BufferedBytesOf(const httplib::Request& req) const {
    const int64_t body = static_cast<int64_t>(req.body.size());
    return (req.has_header(kHeaderLength) ? 2 * body : kJsonExpansion * body) - body;
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
    const std::string header_length = req.get_header_value(kHeaderLength);
    absl::Status parsed = ParseInferBody(req.body,
                                         req.has_header(kHeaderLength)
                                             ? std::optional<absl::string_view>(header_length)
                                             : std::nullopt,
                                         &state->request, &form);
    if (!parsed.ok()) return parsed;
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
    const EncodedInferResponse encoded = EncodeInferResponse(state->response, form);
    if (encoded.header_length.has_value()) {
      res.set_header(kHeaderLength, std::to_string(*encoded.header_length));
      res.set_content(encoded.body, "application/octet-stream");
    } else {
      res.set_content(encoded.body, "application/json");
    }
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
