// A client's shared-memory region as both front-ends use it: bytes
// another process put in memory the server mapped (POSIX shm) or opened (a
// CUDA IPC handle), read for inputs and written for outputs (in place when
// the region is mapped here, through Read and Write otherwise). A region is
// unmapped when its last reference goes, so unregistering one that a running
// request still holds frees nothing under it (ShmRegistry hands out
// shared_ptrs). The client keeps its own handle on the memory and may shrink
// it under us: CheckIntact says whether the region is still all there, and a
// call fails (naming the region) instead of the server dying.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace attnserve {

class ShmRegion {
 public:
  virtual ~ShmRegion() = default;
  // Bytes usable from the region's start (after the registered offset).
  virtual uint64_t byte_size() const = 0;
  // The region's bytes (from its start) as this process addresses them, for
  // requests that read inputs and write outputs in place: a system region's
  // mapping. Null where only Read and Write reach them (a CUDA region).
  virtual char* mapped() const { return nullptr; }
  // A CUDA region's bytes (from its start) as a device address valid in this
  // process, on device(): backends read and write them there, no host copy.
  // Null for a region in host memory.
  virtual char* device_ptr() const { return nullptr; }
  // The CUDA device of device_ptr(); -1 (kHostMemory) for host memory.
  virtual int device() const { return -1; }
  // Copy [offset, offset + size) out of / into the region. The caller has
  // checked the bounds (ShmRegistry::Acquire).
  virtual absl::Status Read(uint64_t offset, uint64_t size, void* dst) const = 0;
  virtual absl::Status Write(uint64_t offset, const void* src, uint64_t size) = 0;
  // FAILED_PRECONDITION naming the region when its memory is no longer all
  // the client's: the object behind it is now smaller than registered, or an
  // access already found it shrunk. Checked when a call acquires the region
  // and again before the call's outputs count (a shrink during the call).
  virtual absl::Status CheckIntact() const { return absl::OkStatus(); }
};

}  // namespace attnserve
