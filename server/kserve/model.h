// A model the KServe v2 front-end serves, and the registry that names them.
// Each model answers its own metadata, config, statistics and inference; the
// gRPC and HTTP front-ends only find the model and carry the messages, so a
// new model (attention_kv) is one more class added to the registry.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "inference/grpc_service.pb.h"
#include "server/core/call.h"

namespace attnserve {

// The one version every attnserve model has.
inline constexpr char kModelVersion[] = "1";

// One inference call: the request (whose tensor bytes the model may move
// out), where the answer goes, and the call's context. `request` and
// `response` stay valid until `done` has run; `done` runs exactly once, on any
// thread, possibly before Infer returns.
struct InferCall {
  inference::ModelInferRequest* request = nullptr;
  inference::ModelInferResponse* response = nullptr;
  std::string tenant;  // tenant.h
  // The call's x-attnserve-cache-id header (gRPC metadata or HTTP header),
  // empty without one: attention_kv's cache when no cache_id parameter names it.
  std::string cache_id_header;
  absl::Time deadline = absl::InfiniteFuture();
  std::shared_ptr<const std::atomic<bool>> cancelled;
  std::function<void(const absl::Status&)> done;
};

// The core call's metadata for `call`: its id, tenant, deadline and cancellation.
inline CallMeta MetaOf(const InferCall& call) {
  CallMeta meta = CallMetaOf(call.tenant, call.deadline, call.cancelled);
  meta.id = call.request->id();
  return meta;
}

class KserveModel {
 public:
  virtual ~KserveModel() = default;
  virtual const std::string& name() const = 0;
  virtual bool ready() const = 0;
  virtual void FillMetadata(inference::ModelMetadataResponse* out) const = 0;
  virtual void FillConfig(inference::ModelConfig* out) const = 0;
  virtual void FillStatistics(inference::ModelStatistics* out) const = 0;
  virtual void Infer(InferCall call) = 0;
};

class ModelRegistry {
 public:
  void Add(std::unique_ptr<KserveModel> model);
  // The model called `name` at `version` ("" or kModelVersion); NOT_FOUND
  // naming both otherwise.
  absl::StatusOr<KserveModel*> Find(const std::string& name, const std::string& version) const;
  // Every model, by name.
  std::vector<KserveModel*> models() const;

 private:
  std::map<std::string, std::unique_ptr<KserveModel>> models_;
};

}  // namespace attnserve
