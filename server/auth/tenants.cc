// Tenant quotas, usage and counters; see tenants.h.
#include "server/auth/tenants.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

InFlightCharge& InFlightCharge::operator=(InFlightCharge&& other) noexcept {
  if (this != &other) {
    Release();
    directory_ = std::exchange(other.directory_, nullptr);
    tenant_ = std::move(other.tenant_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void InFlightCharge::Release() {
  if (directory_ != nullptr) directory_->ReleaseInFlight(tenant_, bytes_);
  directory_ = nullptr;
  bytes_ = 0;
}

void TenantDirectory::SetQuotas(const std::map<std::string, TenantQuotas>& quotas) {
  absl::MutexLock lock(&mu_);
  for (auto& [name, usage] : tenants_) usage.quotas = TenantQuotas();
  for (const auto& [name, q] : quotas) tenants_[name].quotas = q;
  configured_ = std::max<int64_t>(1, static_cast<int64_t>(quotas.size()));
}

int64_t TenantDirectory::ConfiguredTenants() const {
  absl::MutexLock lock(&mu_);
  return configured_;
}

namespace {

// The withdrawn tenant is nobody: nothing may be charged to it.
absl::Status RefuseWithdrawn() {
  return absl::UnauthenticatedError(
      "the call's bearer token names no tenant (withdrawn, or more than one authorization "
      "header): send exactly one current token");
}

}  // namespace

TenantQuotas TenantDirectory::QuotasOf(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? TenantQuotas() : it->second.quotas;
}

absl::Status TenantDirectory::Refuse(Usage& usage, const std::string& tenant, const char* quota,
                                     int64_t limit, int64_t held, int64_t asked) {
  ++usage.refused[quota];
  return absl::ResourceExhaustedError(absl::StrCat("tenant '", tenant, "' quota ", quota, ": ",
                                                   held, " held + ", asked, " asked > limit ",
                                                   limit));
}

absl::StatusOr<InFlightCharge> TenantDirectory::ChargeInFlight(const std::string& tenant,
                                                               int64_t bytes) {
  if (tenant == kWithdrawnTenant) return RefuseWithdrawn();
  absl::MutexLock lock(&mu_);
  Usage& usage = tenants_[tenant];
  const int64_t limit = usage.quotas.bytes_in_flight;
  if (limit > 0 && usage.bytes_in_flight + bytes > limit) {
    return Refuse(usage, tenant, "bytes_in_flight", limit, usage.bytes_in_flight, bytes);
  }
  usage.bytes_in_flight += bytes;
  InFlightCharge charge;
  charge.directory_ = this;
  charge.tenant_ = tenant;
  charge.bytes_ = bytes;
  return charge;
}

void TenantDirectory::ReleaseInFlight(const std::string& tenant, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  tenants_[tenant].bytes_in_flight -= bytes;
}

absl::Status TenantDirectory::CheckKvPages(const std::string& tenant, int64_t held, int64_t more) {
  if (tenant == kWithdrawnTenant) return RefuseWithdrawn();
  absl::MutexLock lock(&mu_);
  Usage& usage = tenants_[tenant];
  const int64_t limit = usage.quotas.kv_pages;
  if (limit > 0 && held + more > limit) return Refuse(usage, tenant, "kv_pages", limit, held, more);
  return absl::OkStatus();
}

absl::Status TenantDirectory::CheckKv(const std::string& tenant, int64_t held_pages,
                                      int64_t more_pages, int64_t held_bytes, int64_t more_bytes,
                                      int64_t device_budget) {
  if (tenant == kWithdrawnTenant) return RefuseWithdrawn();
  absl::MutexLock lock(&mu_);
  Usage& usage = tenants_[tenant];
  const int64_t limit = usage.quotas.kv_pages;
  if (limit > 0) {
    if (held_pages + more_pages > limit) {
      return Refuse(usage, tenant, "kv_pages", limit, held_pages, more_pages);
    }
    return absl::OkStatus();
  }
  const int64_t share = device_budget / configured_;
  if (held_bytes + more_bytes > share) {
    return Refuse(usage, tenant, "kv_share", share, held_bytes, more_bytes);
  }
  return absl::OkStatus();
}

absl::Status TenantDirectory::CheckShmRegions(const std::string& tenant, int64_t held) {
  if (tenant == kWithdrawnTenant) return RefuseWithdrawn();
  absl::MutexLock lock(&mu_);
  Usage& usage = tenants_[tenant];
  const int64_t limit = usage.quotas.shm_regions;
  if (limit > 0 && held + 1 > limit) return Refuse(usage, tenant, "shm_regions", limit, held, 1);
  return absl::OkStatus();
}

void TenantDirectory::RecordCall(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  ++tenants_[tenant].calls;
}

void TenantDirectory::RecordUnauthenticated() {
  absl::MutexLock lock(&mu_);
  ++unauthenticated_;
}

std::string TenantDirectory::RenderPrometheus() const {
  absl::MutexLock lock(&mu_);
  // Tenant names come from the operator's tokens file, checked to be
  // [A-Za-z0-9._-] there (or are server/tenant.h's kWithdrawnTenant), so
  // they need no escaping in a label.
  std::string calls =
      "# HELP attnserve_tenant_calls_total Authenticated calls per tenant.\n"
      "# TYPE attnserve_tenant_calls_total counter\n";
  std::string refused =
      "# HELP attnserve_tenant_quota_refusals_total Calls refused with RESOURCE_EXHAUSTED by a "
      "tenant quota.\n# TYPE attnserve_tenant_quota_refusals_total counter\n";
  std::string bytes =
      "# HELP attnserve_tenant_bytes_in_flight Request bytes a tenant has admitted and not yet "
      "answered.\n# TYPE attnserve_tenant_bytes_in_flight gauge\n";
  std::string limits =
      "# HELP attnserve_tenant_quota A tenant's quota (0: no limit).\n"
      "# TYPE attnserve_tenant_quota gauge\n";
  for (const auto& [name, u] : tenants_) {
    absl::StrAppend(&calls, "attnserve_tenant_calls_total{tenant=\"", name, "\"} ", u.calls, "\n");
    for (const char* quota : {"bytes_in_flight", "kv_pages", "kv_share", "shm_regions"}) {
      auto it = u.refused.find(quota);
      absl::StrAppend(&refused, "attnserve_tenant_quota_refusals_total{tenant=\"", name,
                      "\",quota=\"", quota, "\"} ", it == u.refused.end() ? 0 : it->second, "\n");
    }
    absl::StrAppend(&bytes, "attnserve_tenant_bytes_in_flight{tenant=\"", name, "\"} ",
                    u.bytes_in_flight, "\n");
    absl::StrAppend(&limits, "attnserve_tenant_quota{tenant=\"", name,
                    "\",quota=\"bytes_in_flight\"} ", u.quotas.bytes_in_flight, "\n",
                    "attnserve_tenant_quota{tenant=\"", name, "\",quota=\"kv_pages\"} ",
                    u.quotas.kv_pages, "\n", "attnserve_tenant_quota{tenant=\"", name,
                    "\",quota=\"shm_regions\"} ", u.quotas.shm_regions, "\n");
  }
  return absl::StrCat(calls, refused, bytes, limits,
                      "# HELP attnserve_unauthenticated_calls_total Calls refused with "
                      "UNAUTHENTICATED (missing or unknown bearer token).\n"
                      "# TYPE attnserve_unauthenticated_calls_total counter\n"
                      "attnserve_unauthenticated_calls_total ",
                      unauthenticated_, "\n");
}

}  // namespace attnserve
