// The shared-memory regions clients registered (Triton's system_shared_memory
// and cuda_shared_memory extensions), per tenant (server/tenant.h): register,
// unregister, list, and Acquire, the bounds check every use goes through.
// A tenant never sees another's regions: a name registered by someone else is
// answered exactly like a name nobody registered. Off unless the server runs
// with --allow_client_shm (then every call here is FAILED_PRECONDITION).
//
// The server opens a key with its own rights, so with authentication on (a
// tenant directory set) a tenant may name only its own objects: system keys
// must start with ShmKeyPrefix(tenant), and the object must be a regular file
// with one link, owned by the server's user and not writable by group or
// others. CUDA IPC handles carry no owner to check, so they are refused then.
// Registrations are bounded (ShmLimits): each system region is one mapping
// and one open descriptor, both finite for the whole process.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/auth/tenants.h"
#include "server/shm/shm_region.h"

namespace attnserve {

enum class ShmKind { kSystem, kCuda };

// Region names and system keys longer than this are refused: the registry
// keeps them for as long as the region lives.
inline constexpr size_t kMaxShmNameBytes = 256;

// How many regions may be registered at once (0: no limit of that kind).
struct ShmLimits {
  // Over every tenant and both kinds: mappings and descriptors are the
  // process's, and vm.max_map_count (65530 by default) bounds the mappings.
  int64_t max_regions = 1024;
  // Per tenant (with authentication off, the one tenant "default"); a lower
  // tenant quota (shm_regions) applies as well.
  int64_t max_regions_per_tenant = 256;
};

// What a system key registered by `tenant` must start with when
// authentication is on: "/attnserve.<tenant>." (tenant names are
// [A-Za-z0-9._-], so this is one shm_open name component).
std::string ShmKeyPrefix(const std::string& tenant);

// What the status calls list for one region.
struct ShmRegionInfo {
  std::string name;
  std::string key;        // system: the shm_open name
  uint64_t offset = 0;    // system: where the region starts in the object
  int64_t device_id = 0;  // CUDA: the device the handle was opened on
  uint64_t byte_size = 0;
};

class ShmRegistry {
 public:
  explicit ShmRegistry(bool allowed, ShmLimits limits = {}) : allowed_(allowed), limits_(limits) {}

  bool allowed() const { return allowed_; }
  // Per-tenant quotas (shm_regions) and the per-tenant key rule; null (the
  // default) when authentication is off. Set before serving.
  void set_tenants(TenantDirectory* tenants) { tenants_ = tenants; }
  // Set before serving.
  void set_limits(const ShmLimits& limits) { limits_ = limits; }
  // Page-lock each system region for the CUDA devices when it is registered
  // (PinHostMemory): a CUDA backend then copies inputs to the device straight
  // from the region. Off by default (it would start a CUDA context for a
  // server that does not use one). Set before serving.
  void set_pin_host_memory(bool pin) { pin_host_memory_ = pin; }

  // Maps [offset, offset + byte_size) of the POSIX shared-memory object `key`.
  // ALREADY_EXISTS when the tenant already has a region called `name`;
  // INVALID_ARGUMENT naming the field for a name or key over
  // kMaxShmNameBytes; PERMISSION_DENIED for a key or object the tenant may
  // not use (see above); RESOURCE_EXHAUSTED naming the limit when full.
  absl::Status RegisterSystem(const std::string& tenant, const std::string& name,
                              const std::string& key, uint64_t offset, uint64_t byte_size);
  // Opens a CUDA IPC handle (cuda_shm_region.h); UNIMPLEMENTED without CUDA,
  // FAILED_PRECONDITION with authentication on.
  absl::Status RegisterCuda(const std::string& tenant, const std::string& name,
                            const std::string& raw_handle, int64_t device_id, uint64_t byte_size);
  // Forgets `name` (every region of `kind` when empty); an unknown name is not
  // an error, as in Triton. A request that holds the region keeps it mapped.
  absl::Status Unregister(const std::string& tenant, ShmKind kind, const std::string& name);
  // The tenant's regions of `kind` (only `name` when set: NOT_FOUND if unknown).
  absl::StatusOr<std::vector<ShmRegionInfo>> List(const std::string& tenant, ShmKind kind,
                                                  const std::string& name) const;

  // The tenant's region `name` (of either kind) if [offset, offset + size)
  // lies inside it; INVALID_ARGUMENT naming the region otherwise, and
  // FAILED_PRECONDITION when the region is no longer intact
  // (ShmRegion::CheckIntact). The caller keeps the returned reference for as
  // long as it reads or writes, and checks CheckIntact again before the
  // bytes it read or wrote count.
  absl::StatusOr<std::shared_ptr<ShmRegion>> Acquire(const std::string& tenant,
                                                     const std::string& name, uint64_t offset,
                                                     uint64_t size) const;

 private:
  struct Entry {
    ShmKind kind;
    ShmRegionInfo info;
    std::shared_ptr<ShmRegion> region;
  };
  using Key = std::pair<std::string, std::string>;  // tenant, region name

  absl::Status CheckAllowed() const;
  // ALREADY_EXISTS, or RESOURCE_EXHAUSTED naming the limit, for one more
  // region `name` of `tenant`.
  absl::Status CheckRoom(const std::string& tenant, const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Add(const std::string& tenant, ShmKind kind, ShmRegionInfo info,
                   std::unique_ptr<ShmRegion> region);

  const bool allowed_;
  ShmLimits limits_;
  bool pin_host_memory_ = false;
  TenantDirectory* tenants_ = nullptr;
  mutable absl::Mutex mu_;
  std::map<Key, Entry> regions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> held_ ABSL_GUARDED_BY(mu_);  // regions per tenant
};

}  // namespace attnserve
