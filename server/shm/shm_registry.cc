// System shared memory (POSIX shm_open + mmap) and the per-tenant registry of
// regions; see shm_registry.h.
#include "server/shm/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/mapping_fault_guard.h"
#include "common/status_macros.h"
#include "server/shm/cuda_shm_region.h"

namespace attnserve {
namespace {

// The mapping of one registered system region, guarded against the client
// shrinking the object under it (mapping_fault_guard.h); unmapped on
// destruction. The descriptor stays open so every use can check the object's
// size without a fault.
class SystemShmRegion final : public ShmRegion {
 public:
  SystemShmRegion(std::string name, std::string key, int fd, void* mapping, uint64_t mapped_size,
                  uint64_t offset, uint64_t byte_size, std::unique_ptr<GuardedMapping> guard,
                  bool pinned)
      : name_(std::move(name)),
        key_(std::move(key)),
        fd_(fd),
        mapping_(mapping),
        mapped_size_(mapped_size),
        offset_(offset),
        byte_size_(byte_size),
        guard_(std::move(guard)),
        pinned_(pinned) {}
  ~SystemShmRegion() override {
    if (pinned_) UnpinHostMemory(mapping_);
    guard_.reset();  // before the range can be reused by another mapping
    munmap(mapping_, mapped_size_);
    close(fd_);
  }

  uint64_t byte_size() const override { return byte_size_; }
  char* mapped() const override { return base(); }
  absl::Status Read(uint64_t offset, uint64_t size, void* dst) const override {
    std::memcpy(dst, base() + offset, size);
    return CheckIntact();
  }
  absl::Status Write(uint64_t offset, const void* src, uint64_t size) override {
    std::memcpy(base() + offset, src, size);
    return CheckIntact();
  }
  absl::Status CheckIntact() const override {
    if (guard_->broken()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared memory region '", name_, "': shared memory key '", key_,
          "' shrank below the region while the server used it; unregister the region and "
          "register it again"));
    }
    struct stat st {};
    if (fstat(fd_, &st) != 0) {
      return absl::InternalError(
          absl::StrCat("shared memory region '", name_, "': fstat: ", std::strerror(errno)));
    }
    if (static_cast<uint64_t>(st.st_size) < mapped_size_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared memory region '", name_, "': shared memory key '", key_, "' is now ",
          static_cast<uint64_t>(st.st_size), " bytes, fewer than the offset + byte_size (",
          mapped_size_, ") it was registered with"));
    }
    return absl::OkStatus();
  }

 private:
  char* base() const { return static_cast<char*>(mapping_) + offset_; }

  const std::string name_;
  const std::string key_;
  const int fd_;
  void* const mapping_;
  const uint64_t mapped_size_;
  const uint64_t offset_;
  const uint64_t byte_size_;
  std::unique_ptr<GuardedMapping> guard_;
  const bool pinned_;  // PinHostMemory'd: unpinned before the unmap
};

std::string Octal(unsigned mode) {
  std::string digits;
  for (int shift = 9; shift >= 0; shift -= 3)
    digits.push_back(static_cast<char>('0' + ((mode >> shift) & 7)));
  return digits;
}

// Out of descriptors or address space: the server's resources, not a bad request.
absl::StatusCode CodeOfErrno(int err) {
  return err == ENOMEM || err == EMFILE || err == ENFILE ? absl::StatusCode::kResourceExhausted
                                                         : absl::StatusCode::kInvalidArgument;
}

// `strict` (authentication on): the object must be one the tenant's own
// process made for the server, not something else the server can open.
absl::StatusOr<std::unique_ptr<ShmRegion>> MapSystemRegion(const std::string& name,
                                                           const std::string& key, uint64_t offset,
                                                           uint64_t byte_size, bool strict,
                                                           bool pin) {
  if (byte_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': byte_size: expected > 0, got 0"));
  }
  if (offset > UINT64_MAX - byte_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': offset + byte_size overflows"));
  }
  // glibc's shm_open adds O_NOFOLLOW: a symbolic link is never followed.
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    return absl::Status(CodeOfErrno(err), absl::StrCat("shared memory region '", name,
                                                       "': cannot open shared memory key '", key,
                                                       "': ", std::strerror(err)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory region '", name, "': shared memory key '", key, "' is not a regular file"));
  }
  if (strict &&
      (st.st_uid != geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0 || st.st_nlink != 1)) {
    close(fd);
    return absl::PermissionDeniedError(
        absl::StrCat("shared memory region '", name, "': shared memory key '", key,
                     "' must be owned by the server's user (uid ", geteuid(),
                     "), not writable by group or others, with one link; it has uid ", st.st_uid,
                     ", mode ", Octal(st.st_mode & 07777), ", ", st.st_nlink, " links"));
  }
  const uint64_t end = offset + byte_size;
  if (static_cast<uint64_t>(st.st_size) < end) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': offset ", offset, " + byte_size ",
                     byte_size, " exceeds the ", static_cast<uint64_t>(st.st_size),
                     " bytes of shared memory key '", key, "'"));
  }
  // The whole prefix is mapped, since mmap's own offset must be page-aligned.
  void* mapping = mmap(nullptr, end, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapping == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::Status(CodeOfErrno(err), absl::StrCat("shared memory region '", name,
                                                       "': cannot map shared memory key '", key,
                                                       "': ", std::strerror(err)));
  }
  absl::StatusOr<std::unique_ptr<GuardedMapping>> guard = GuardedMapping::Guard(mapping, end);
  if (!guard.ok()) {
    munmap(mapping, end);
    close(fd);
    return absl::Status(guard.status().code(), absl::StrCat("shared memory region '", name,
                                                            "': ", guard.status().message()));
  }
  // Pinned after the guard: a shrink while pinned faults on the host, not
  // for the copy engines, which keep reading the pages they locked.
  const bool pinned = pin && PinHostMemory(mapping, end);
  return std::make_unique<SystemShmRegion>(name, key, fd, mapping, end, offset, byte_size,
                                           *std::move(guard), pinned);
}

// INVALID_ARGUMENT naming `field` when `value` is empty or too long to keep.
absl::Status CheckNameField(const char* field, const std::string& value, const char* what) {
  if (value.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", what, ", got none"));
  }
  if (value.size() > kMaxShmNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected at most ", kMaxShmNameBytes, " bytes, got ", value.size()));
  }
  return absl::OkStatus();
}

absl::Status OutOfMemory(const std::string& name) {
  return absl::ResourceExhaustedError(
      absl::StrCat("shared memory region '", name, "': out of memory registering it"));
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

std::string ShmKeyPrefix(const std::string& tenant) {
  return absl::StrCat("/attnserve.", tenant, ".");
}

absl::Status ShmRegistry::CheckRoom(const std::string& tenant, const std::string& name) const {
  if (regions_.count(Key{tenant, name}) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("shared memory region '", name, "' is already registered"));
  }
  const int64_t total = static_cast<int64_t>(regions_.size());
  if (limits_.max_regions > 0 && total >= limits_.max_regions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory region '", name, "': the server already holds ", total,
                     " regions, its limit (--max_shm_regions); unregister one first"));
  }
  auto it = held_.find(tenant);
  const int64_t held = it == held_.end() ? 0 : it->second;
  if (limits_.max_regions_per_tenant > 0 && held >= limits_.max_regions_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared memory region '", name, "': tenant '", tenant, "' already holds ", held,
        " regions, its limit (--max_shm_regions_per_tenant); unregister one first"));
  }
  if (tenants_ != nullptr) RETURN_IF_ERROR(tenants_->CheckShmRegions(tenant, held));
  return absl::OkStatus();
}

absl::Status ShmRegistry::Add(const std::string& tenant, ShmKind kind, ShmRegionInfo info,
                              std::unique_ptr<ShmRegion> region) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckRoom(tenant, info.name));
  Key key{tenant, info.name};
  regions_.emplace(std::move(key), Entry{kind, std::move(info), std::move(region)});
  ++held_[tenant];
  return absl::OkStatus();
}

absl::Status ShmRegistry::RegisterSystem(const std::string& tenant, const std::string& name,
                                         const std::string& key, uint64_t offset,
                                         uint64_t byte_size) {
  if (absl::Status s = CheckAllowed(); !s.ok()) return s;
  RETURN_IF_ERROR(CheckNameField("name", name, "a region name"));
  RETURN_IF_ERROR(CheckNameField("key", key, "a shared memory key"));
  const bool strict = tenants_ != nullptr;
  if (strict) {
    // The server opens the key with its own rights: a tenant names only
    // objects under its own prefix, never another tenant's.
    const std::string prefix = ShmKeyPrefix(tenant);
    const bool plain_tenant =
        !tenant.empty() && tenant.find_first_not_of(
                               "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                               "0123456789._-") == std::string::npos;
    if (!plain_tenant || key.size() <= prefix.size() ||
        key.compare(0, prefix.size(), prefix) != 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("shared memory region '", name, "': key '", key, "': tenant '", tenant,
                       "' may register only keys that start with '", prefix, "'"));
    }
  }
  try {
    {
      absl::MutexLock lock(&mu_);
      RETURN_IF_ERROR(CheckRoom(tenant, name));
    }
    absl::StatusOr<std::unique_ptr<ShmRegion>> region =
        MapSystemRegion(name, key, offset, byte_size, strict, pin_host_memory_);
    if (!region.ok()) return region.status();
    ShmRegionInfo info;
    info.name = name;
    info.key = key;
    info.offset = offset;
    info.byte_size = byte_size;
    return Add(tenant, ShmKind::kSystem, std::move(info), *std::move(region));
  } catch (const std::bad_alloc&) {
    return OutOfMemory(name);
  }
}

absl::Status ShmRegistry::RegisterCuda(const std::string& tenant, const std::string& name,
                                       const std::string& raw_handle, int64_t device_id,
                                       uint64_t byte_size) {
  if (absl::Status s = CheckAllowed(); !s.ok()) return s;
  RETURN_IF_ERROR(CheckNameField("name", name, "a region name"));
  if (tenants_ != nullptr) {
    // Whoever holds a handle's bytes can open the memory; nothing in them
    // says which tenant's it is, so no tenant may name one.
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA shared memory region '", name,
        "': CUDA shared memory is off while authentication is on (a CUDA IPC handle names no "
        "owner the server could check); use system shared memory"));
  }
  try {
    {
      absl::MutexLock lock(&mu_);
      RETURN_IF_ERROR(CheckRoom(tenant, name));
    }
    absl::StatusOr<std::unique_ptr<ShmRegion>> region =
        OpenCudaShmRegion(name, raw_handle, device_id, byte_size);
    if (!region.ok()) return region.status();
    ShmRegionInfo info;
    info.name = name;
    info.device_id = device_id;
    info.byte_size = byte_size;
    return Add(tenant, ShmKind::kCuda, std::move(info), *std::move(region));
  } catch (const std::bad_alloc&) {
    return OutOfMemory(name);
  }
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
      if (--held_[tenant] == 0) held_.erase(tenant);
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
  std::shared_ptr<ShmRegion> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(Key{tenant, name});
    if (it == regions_.end()) return UnknownRegion(name);
    region = it->second.region;
  }
  const uint64_t region_size = region->byte_size();
  if (offset > region_size || size > region_size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", name, "': offset ", offset, " + byte_size ", size,
                     " exceeds the region's ", region_size, " bytes"));
  }
  // A shrunk object fails here, before any byte of it is touched.
  RETURN_IF_ERROR(region->CheckIntact());
  return region;
}

}  // namespace attnserve
