// The /metrics HTTP endpoint; see metrics_http.h. cpp-httplib is included here
// only; builds without it (static ones, see server/CMakeLists.txt) get a Start
// that says so.
#include "server/metrics_http.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

#ifdef ATTNSERVE_HAVE_HTTPLIB
#include "server/http_listener.h"
#include "server/security/http_tls.h"
#endif

namespace attnserve {

#ifdef ATTNSERVE_HAVE_HTTPLIB
namespace {

class MetricsHttpServerImpl final : public MetricsHttpServer {
 public:
  MetricsHttpServerImpl(HttpServerWithTls http, const ServerMetrics* metrics)
      : http_(std::move(http)), listener_(http_.server.get()) {
    // A throwing handler answers 500 (httplib would otherwise name the
    // exception in a response header).
    http_.server->set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
          res.status = 500;
          res.set_content("internal error\n", "text/plain");
        });
    http_.server->Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics->RenderPrometheus(), "text/plain; version=0.0.4; charset=utf-8");
    });
  }

  ~MetricsHttpServerImpl() override { Stop(); }

  absl::Status Bind(const std::string& host, int port) {
    return listener_.Start("metrics", host, port);
  }

  int port() const override { return listener_.port(); }

  void Stop() override { listener_.Stop(); }

 private:
  HttpServerWithTls http_;
  HttpListener listener_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, const ServerMetrics* metrics, const TlsFiles& tls) {
  ASSIGN_OR_RETURN(HttpServerWithTls http, MakeHttpServer(tls));
  auto server = std::make_unique<MetricsHttpServerImpl>(std::move(http), metrics);
  RETURN_IF_ERROR(server->Bind(host, port));
  return server;
}

#else  // !ATTNSERVE_HAVE_HTTPLIB

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const std::string& host,
                                                                            int port,
                                                                            const ServerMetrics*,
                                                                            const TlsFiles&) {
  return absl::UnimplementedError(
      absl::StrCat("metrics: this build has no HTTP library (a static build), so ", host, ":", port,
                   "/metrics is not served"));
}

#endif  // ATTNSERVE_HAVE_HTTPLIB

}  // namespace attnserve
