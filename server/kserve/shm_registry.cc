// System shared memory (POSIX shm_open + mmap) and the per-tenant registry of
// regions; see shm_registry.h.
#include "server/kserve/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/kserve/cuda_shm_region.h"

namespace attnserve {
namespace {

// The mapping of one registered system region; unmapped on destruction.
class SystemShmRegion final : public ShmRegion {
 public:
  SystemShmRegion(void* mapping, uint64_t mapped_size, uint64_t offset, uint64_t byte_size)
      : mapping_(mapping), mapped_size_(mapped_size), offset_(offset), byte_size_(byte_size) {}
  ~SystemShmRegion() override { munmap(mapping_, mapped_size_); }

  uint64_t byte_size() const override { return byte_size_; }
  char* mapped() const override { return base(); }
  absl::Status Read(uint64_t offset, uint64_t size, void* dst) const override {
    std::memcpy(dst, base() + offset, size);
    return absl::OkStatus();
  }
  absl::Status Write(uint64_t offset, const void* src, uint64_t size) override {
    std::memcpy(base() + offset, src, size);
    return absl::OkStatus();
  }

 private:
  char* base() const { return static_cast<char*>(mapping_) + offset_; }

  void* const mapping_;
  const uint64_t mapped_size_;
  const uint64_t offset_;
  const uint64_t byte_size_;
};

absl::StatusOr<std::unique_ptr<ShmRegion>> MapSystemRegion(const std::string& name,
                                                           const std::string& key, uint64_t offset,
                                                           uint64_t byte_size) {
  if (byte_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': byte_size: expected > 0, got 0"));
  }
  if (offset > UINT64_MAX - byte_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': offset + byte_size overflows"));
  }
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory region '", name,
                                                   "': cannot open shared memory key '", key,
                                                   "': ", std::strerror(errno)));
  }
  struct stat st {};
  const uint64_t end = offset + byte_size;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < end) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': offset ", offset, " + byte_size ",
                     byte_size, " exceeds the ", static_cast<uint64_t>(st.st_size),
                     " bytes of shared memory key '", key, "'"));
  }
  // The whole prefix is mapped, since mmap's own offset must be page-aligned.
  void* mapping = mmap(nullptr, end, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  close(fd);  // the mapping keeps the object alive
  if (mapping == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory region '", name,
                                                   "': cannot map shared memory key '", key,
                                                   "': ", std::strerror(map_errno)));
  }
  return std::make_unique<SystemShmRegion>(mapping, end, offset, byte_size);
}

absl::Status UnknownRegion(const std::string& name) {
  return absl::InvalidArgumentError(
      absl::StrCat("unable to find shared memory region: '", name, "'"));
}

}  // namespace

absl::Status ShmRegistry::CheckAllowed() const {
  if (allowed_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "shared memory is off: the server must be started with --allow_client_shm");
}

absl::Status ShmRegistry::Add(const std::string& tenant, ShmKind kind, ShmRegionInfo info,
                              std::unique_ptr<ShmRegion> region) {
  absl::MutexLock lock(&mu_);
  Key key{tenant, info.name};
  if (regions_.count(key) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("shared memory region '", info.name, "' is already registered"));
  }
  if (tenants_ != nullptr) {
    int64_t held = 0;
    for (const auto& [k, entry] : regions_) held += k.first == tenant ? 1 : 0;
    RETURN_IF_ERROR(tenants_->CheckShmRegions(tenant, held));
  }
  regions_.emplace(std::move(key), Entry{kind, std::move(info), std::move(region)});
  return absl::OkStatus();
}

absl::Status ShmRegistry::RegisterSystem(const std::string& tenant, const std::string& name,
                                         const std::string& key, uint64_t offset,
                                         uint64_t byte_size) {
  if (absl::Status s = CheckAllowed(); !s.ok()) return s;
  if (name.empty()) return absl::InvalidArgumentError("name: expected a region name, got none");
  {
    absl::MutexLock lock(&mu_);
    if (regions_.count(Key{tenant, name}) > 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("shared memory region '", name, "' is already registered"));
    }
  }
  absl::StatusOr<std::unique_ptr<ShmRegion>> region = MapSystemRegion(name, key, offset, byte_size);
  if (!region.ok()) return region.status();
  ShmRegionInfo info;
  info.name = name;
  info.key = key;
  info.offset = offset;
  info.byte_size = byte_size;
  return Add(tenant, ShmKind::kSystem, std::move(info), *std::move(region));
}

absl::Status ShmRegistry::RegisterCuda(const std::string& tenant, const std::string& name,
                                       const std::string& raw_handle, int64_t device_id,
                                       uint64_t byte_size) {
  if (absl::Status s = CheckAllowed(); !s.ok()) return s;
  if (name.empty()) return absl::InvalidArgumentError("name: expected a region name, got none");
  absl::StatusOr<std::unique_ptr<ShmRegion>> region =
      OpenCudaShmRegion(name, raw_handle, device_id, byte_size);
  if (!region.ok()) return region.status();
  ShmRegionInfo info;
  info.name = name;
  info.device_id = device_id;
  info.byte_size = byte_size;
  return Add(tenant, ShmKind::kCuda, std::move(info), *std::move(region));
}

absl::Status ShmRegistry::Unregister(const std::string& tenant, ShmKind kind,
                                     const std::string& name) {
  if (absl::Status s = CheckAllowed(); !s.ok()) return s;
  // Mappings are released after the lock: an unmap can be slow.
  std::vector<std::shared_ptr<ShmRegion>> released;
  absl::MutexLock lock(&mu_);
  for (auto it = regions_.begin(); it != regions_.end();) {
    const bool match = it->first.first == tenant && it->second.kind == kind &&
                       (name.empty() || it->first.second == name);
    if (match) {
      released.push_back(std::move(it->second.region));
      it = regions_.erase(it);
    } else {
      ++it;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ShmRegionInfo>> ShmRegistry::List(const std::string& tenant,
                                                             ShmKind kind,
                                                             const std::string& name) const {
  if (absl::Status s = CheckAllowed(); !s.ok()) return s;
  std::vector<ShmRegionInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, entry] : regions_) {
    if (key.first == tenant && entry.kind == kind && (name.empty() || key.second == name)) {
      out.push_back(entry.info);
    }
  }
  if (!name.empty() && out.empty()) {
    return absl::NotFoundError(absl::StrCat("unable to find shared memory region: '", name, "'"));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<ShmRegion>> ShmRegistry::Acquire(const std::string& tenant,
                                                                const std::string& name,
                                                                uint64_t offset,
                                                                uint64_t size) const {
  if (absl::Status s = CheckAllowed(); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(Key{tenant, name});
  if (it == regions_.end()) return UnknownRegion(name);
  const uint64_t region_size = it->second.region->byte_size();
  if (offset > region_size || size > region_size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': offset ", offset, " + byte_size ", size,
                     " exceeds the region's ", region_size, " bytes"));
  }
  return it->second.region;
}

}  // namespace attnserve
