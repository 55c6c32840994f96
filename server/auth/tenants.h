// Tenants: who a call acts for once authenticated (server/auth/authenticator.h),
// the quotas each may use, what each holds now, and per-tenant counters for
// /metrics. K/V caches (server/kv/kv_pool.h) and KServe shared-memory regions
// (server/shm/shm_registry.h) ask here before they grow a tenant's share;
// the gRPC and HTTP front-ends charge the bytes of each request in flight.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

// The tenant of a call whose credentials name no tenant at the time of the
// lookup (a token withdrawn by a reload, or more than one authorization
// header): a name no tokens file can hold, so it owns nothing, and every
// call that would give it state or charge it is refused (UNAUTHENTICATED).
// It stays printable because /metrics renders tenant names as labels.
inline constexpr char kWithdrawnTenant[] = "(token withdrawn)";

// What one tenant may hold at once; 0 = no limit of that kind.
struct TenantQuotas {
  int64_t bytes_in_flight = 0;  // serialized request bytes admitted and not yet answered
  int64_t kv_pages = 0;         // K/V pages over all its caches' capacities
  int64_t shm_regions = 0;      // KServe shared-memory regions registered
};

class TenantDirectory;

// Bytes of one request charged to its tenant; given back when destroyed.
class InFlightCharge {
 public:
  InFlightCharge() = default;
  InFlightCharge(InFlightCharge&& other) noexcept { *this = std::move(other); }
  InFlightCharge& operator=(InFlightCharge&& other) noexcept;
  InFlightCharge(const InFlightCharge&) = delete;
  InFlightCharge& operator=(const InFlightCharge&) = delete;
  ~InFlightCharge() { Release(); }
  void Release();

 private:
  friend class TenantDirectory;
  TenantDirectory* directory_ = nullptr;
  std::string tenant_;
  int64_t bytes_ = 0;
};

class TenantDirectory {
 public:
  // Replaces every tenant's quotas (a reloaded tokens file). Tenants that are
  // no longer listed keep their usage and counters until what they hold is
  // gone; new calls for them are refused by authentication anyway.
  void SetQuotas(const std::map<std::string, TenantQuotas>& quotas);
  TenantQuotas QuotasOf(const std::string& tenant) const;
  // Tenants named by the tokens file in force (at least 1).
  int64_t ConfiguredTenants() const;

  // Charges `bytes` to `tenant`, or RESOURCE_EXHAUSTED naming the quota
  // (bytes_in_flight) when they do not fit. A request larger than the quota on
  // its own is refused as well: it could never fit.
  absl::StatusOr<InFlightCharge> ChargeInFlight(const std::string& tenant, int64_t bytes);
  // RESOURCE_EXHAUSTED naming kv_pages when `held` pages plus `more` exceed
  // the tenant's quota (the caller counts what the tenant holds).
  absl::Status CheckKvPages(const std::string& tenant, int64_t held, int64_t more);
  // The K/V rule (SECURITY.md, "Quotas"): a tenant with a kv_pages quota is
  // held to it (`held_pages` + `more_pages`, all devices); one without may
  // reserve at most `device_budget` / (tenants in the tokens file) bytes of
  // a device (`held_bytes` + `more_bytes` there), so no tenant can lock the
  // others out of the pool. RESOURCE_EXHAUSTED naming kv_pages or kv_share.
  absl::Status CheckKv(const std::string& tenant, int64_t held_pages, int64_t more_pages,
                       int64_t held_bytes, int64_t more_bytes, int64_t device_budget);
  // The same for shared-memory regions (`held` registered now, one more asked).
  absl::Status CheckShmRegions(const std::string& tenant, int64_t held);

  // Counters: one authenticated call; one call refused for its credentials
  // (no tenant: counted server-wide).
  void RecordCall(const std::string& tenant);
  void RecordUnauthenticated();

  // attnserve_tenant_* families (Prometheus text): calls, quota refusals by
  // quota, bytes in flight now, and the quotas themselves.
  std::string RenderPrometheus() const;

 private:
  friend class InFlightCharge;
  struct Usage {
    TenantQuotas quotas;
    int64_t bytes_in_flight = 0;
    int64_t calls = 0;
    std::map<std::string, int64_t> refused;  // quota name -> refusals
  };
  void ReleaseInFlight(const std::string& tenant, int64_t bytes);
  // RESOURCE_EXHAUSTED naming the tenant and quota; counts the refusal.
  absl::Status Refuse(Usage& usage, const std::string& tenant, const char* quota, int64_t limit,
                      int64_t held, int64_t asked) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Usage> tenants_ ABSL_GUARDED_BY(mu_);
  int64_t configured_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t unauthenticated_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve

namespace attnserve {

// Charges a request's `bytes` to `tenant` for as long as its call runs: on
// OK, `*done` (any callable) is replaced by one that gives the bytes back
// after running the original. Over the quota: RESOURCE_EXHAUSTED naming it,
// nothing charged and `*done` untouched. A null directory (authentication
// off) charges nothing.
template <typename Done>
absl::Status HoldInFlight(TenantDirectory* tenants, const std::string& tenant, int64_t bytes,
                          Done* done) {
  if (tenants == nullptr) return absl::OkStatus();
  absl::StatusOr<InFlightCharge> charge = tenants->ChargeInFlight(tenant, bytes);
  if (!charge.ok()) return charge.status();
  auto held = std::make_shared<InFlightCharge>(*std::move(charge));
  *done = [held, inner = std::move(*done)](auto&&... args) mutable {
    inner(std::forward<decltype(args)>(args)...);
    held->Release();
  };
  return absl::OkStatus();
}

}  // namespace attnserve
