// KserveFrontend: builds the models and both transports; see frontend.h.
#include "server/kserve/frontend.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/kv_runner.h"
#include "server/kserve/attention_kv_model.h"
#include "server/kserve/attention_model.h"
#include "server/kserve/grpc_service.h"
#include "server/kserve/http_service.h"

namespace attnserve {

KserveFrontend::KserveFrontend(AttentionRunner* runner, KvRunner* kv_runner, ServerMetrics* metrics,
                               const KserveServerInfo& info, const KserveOptions& options,
                               const StreamLimits& stream_limits, std::function<bool()> ready)
    : options_(options),
      max_request_bytes_(info.max_request_bytes),
      context_(options.allow_client_shm) {
  context_.shm.set_limits(options.shm_limits);
  context_.ready = std::move(ready);
  context_.stream_limits = stream_limits;
  context_.buffered.set_limit(options.max_buffered_bytes);
  context_.stream_gauge = metrics != nullptr ? &metrics->streams() : nullptr;
  AttentionModelInfo model_info;
  model_info.backend = info.backend;
  model_info.advertised = info.advertised_dtype;
  model_info.batching = info.batching;
  model_info.batch_max_delay_us = absl::ToInt64Microseconds(info.batch_max_delay);
  context_.models.Add(std::make_unique<AttentionModel>(runner, &context_.shm, metrics, model_info));
  model_info.name = "attention_dense";
  model_info.varlen_inputs = false;
  context_.models.Add(
      std::make_unique<AttentionModel>(runner, &context_.shm, metrics, std::move(model_info)));
  context_.models.Add(std::make_unique<AttentionKvModel>(
      kv_runner, &context_.shm, metrics,
      AttentionKvModelInfo{info.backend, info.advertised_dtype, info.kv_idle_timeout}));
  grpc_ = std::make_unique<KserveGrpcService>(&context_);
}

KserveFrontend::~KserveFrontend() { StopHttp(); }

std::string KserveFrontend::RenderBufferedMetrics() const {
  std::string out;
  AppendFamily(&out, "attnserve_http_buffered_bytes", "gauge",
               "Bytes of HTTP bodies and their parsed JSON tensors the server holds now",
               {{"", absl::StrCat(context_.buffered.used())}});
  AppendFamily(&out, "attnserve_http_buffered_bytes_limit", "gauge",
               "What they may hold at once (half of --max_buffered_bytes; 0: unbounded)",
               {{"", absl::StrCat(context_.buffered.limit())}});
  return out;
}

grpc::Service* KserveFrontend::grpc_service() { return grpc_.get(); }

absl::Status KserveFrontend::StartHttp() {
  if (!options_.http_enabled) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<KserveHttpServer>> http = KserveHttpServer::Start(
      options_.http_host, options_.http_port, max_request_bytes_, &context_, options_.tls);
  if (!http.ok()) return http.status();
  http_ = *std::move(http);
  http_port_.store(http_->port(), std::memory_order_release);
  return absl::OkStatus();
}

void KserveFrontend::StopHttp() {
  if (http_ != nullptr) http_->Stop();
}

}  // namespace attnserve
