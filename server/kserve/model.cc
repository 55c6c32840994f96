// ModelRegistry; see model.h.
#include "server/kserve/model.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

void ModelRegistry::Add(std::unique_ptr<KserveModel> model) {
  const std::string name = model->name();
  models_[name] = std::move(model);
}

absl::StatusOr<KserveModel*> ModelRegistry::Find(const std::string& name,
                                                 const std::string& version) const {
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(
        absl::StrCat("request for unknown model: '", name, "' is not found"));
  }
  if (!version.empty() && version != kModelVersion) {
    return absl::NotFoundError(absl::StrCat("request for unknown model: '", name, "' version ",
                                            version, " is not found (versions: ", kModelVersion,
                                            ")"));
  }
  return it->second.get();
}

std::vector<KserveModel*> ModelRegistry::models() const {
  std::vector<KserveModel*> out;
  for (const auto& [name, model] : models_) out.push_back(model.get());
  return out;
}

}  // namespace attnserve
