// The one seam between authentication and the K/V caches (DESIGN §6): the
// tenant a call acts for. Caches are scoped to it; another tenant's cache
// answers NOT_FOUND. Until authentication exists everyone is "default"; an
// authenticated build derives it from the call's credentials here, and
// nothing else changes.
#pragma once

#include <string>

#include "grpcpp/server_context.h"

namespace attnserve {

inline std::string TenantOf(const grpc::CallbackServerContext& /*context*/) { return "default"; }

}  // namespace attnserve
