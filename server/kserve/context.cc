// KserveContext's answers that both transports give alike; see context.h.
#include "server/kserve/context.h"

#include "server/shm/cuda_shm_region.h"

namespace attnserve {

void KserveContext::FillServerMetadata(inference::ServerMetadataResponse* out) const {
  out->set_name("attnserve");
  out->set_version(ATTNSERVE_VERSION);
  // Triton's extension names, for what attnserve implements of each.
  for (const char* e : {"binary_tensor_data", "parameters", "statistics"}) out->add_extensions(e);
  if (shm.allowed()) {
    out->add_extensions("system_shared_memory");
    // With tokens, CUDA regions are refused: an IPC handle names no owner.
    if (CudaShmAvailable() && auth == nullptr) out->add_extensions("cuda_shared_memory");
  }
}

absl::Status KserveContext::FillStatistics(const std::string& name, const std::string& version,
                                           inference::ModelStatisticsResponse* out) const {
  if (name.empty()) {
    for (KserveModel* m : models.models()) m->FillStatistics(out->add_model_stats());
    return absl::OkStatus();
  }
  absl::StatusOr<KserveModel*> model = models.Find(name, version);
  if (!model.ok()) return model.status();
  (*model)->FillStatistics(out->add_model_stats());
  return absl::OkStatus();
}

void KserveContext::FillRepositoryIndex(inference::RepositoryIndexResponse* out) const {
  for (KserveModel* m : models.models()) {
    auto* entry = out->add_models();
    entry->set_name(m->name());
    entry->set_version(kModelVersion);
    entry->set_state(m->ready() ? "READY" : "UNAVAILABLE");
  }
}

}  // namespace attnserve
