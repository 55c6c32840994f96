// The one place that decides which tenant a KServe v2 call acts for. Shared-
// memory regions belong to the tenant that registered them; until attnserve
// authenticates callers every call is the tenant "default", and this function
// is where a verified identity will map to a tenant.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace attnserve {

inline constexpr char kDefaultTenant[] = "default";

// `authorization`: the call's authorization header or metadata, unverified and
// ignored for now.
inline std::string TenantForCall(absl::string_view /*authorization*/) { return kDefaultTenant; }

}  // namespace attnserve
