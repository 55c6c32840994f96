// The shared-memory regions clients registered (Triton's system_shared_memory
// and cuda_shared_memory extensions), per tenant (server/tenant.h): register,
// unregister, list, and Acquire, the bounds check every use goes through.
// A tenant never sees another's regions: a name registered by someone else is
// answered exactly like a name nobody registered. Off unless the server runs
// with --allow_client_shm (then every call here is FAILED_PRECONDITION).
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
#include "server/kserve/shm_region.h"

namespace attnserve {

enum class ShmKind { kSystem, kCuda };

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
  explicit ShmRegistry(bool allowed) : allowed_(allowed) {}

  bool allowed() const { return allowed_; }
  // Per-tenant quotas (shm_regions); null (the default) when authentication
  // is off. Set before serving.
  void set_tenants(TenantDirectory* tenants) { tenants_ = tenants; }

  // Maps [offset, offset + byte_size) of the POSIX shared-memory object `key`.
  // ALREADY_EXISTS when the tenant already has a region called `name`.
  absl::Status RegisterSystem(const std::string& tenant, const std::string& name,
                              const std::string& key, uint64_t offset, uint64_t byte_size);
  // Opens a CUDA IPC handle (cuda_shm_region.h); UNIMPLEMENTED without CUDA.
  absl::Status RegisterCuda(const std::string& tenant, const std::string& name,
                            const std::string& raw_handle, int64_t device_id, uint64_t byte_size);
  // Forgets `name` (every region of `kind` when empty); an unknown name is not
  // an error, as in Triton. A request that holds the region keeps it mapped.
  absl::Status Unregister(const std::string& tenant, ShmKind kind, const std::string& name);
  // The tenant's regions of `kind` (only `name` when set: NOT_FOUND if unknown).
  absl::StatusOr<std::vector<ShmRegionInfo>> List(const std::string& tenant, ShmKind kind,
                                                  const std::string& name) const;

  // The tenant's region `name` (of either kind) if [offset, offset + size)
  // lies inside it; INVALID_ARGUMENT naming the region otherwise. The caller
  // keeps the returned reference for as long as it reads or writes.
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
  absl::Status Add(const std::string& tenant, ShmKind kind, ShmRegionInfo info,
                   std::unique_ptr<ShmRegion> region);

  const bool allowed_;
  TenantDirectory* tenants_ = nullptr;
  mutable absl::Mutex mu_;
  std::map<Key, Entry> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
