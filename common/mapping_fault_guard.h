// Makes a shared mapping that another process can shrink under us safe to
// touch. A client that truncates the shared-memory object behind a mapping
// turns every access past the new end into SIGBUS, which would kill the
// server. While a GuardedMapping lives, a SIGBUS whose address lies inside its
// range is absorbed: anonymous zero pages replace the mapping from the
// faulting page to its end, so the access completes, and the mapping is
// marked broken for its owner to fail the call afterwards. Any other SIGBUS
// goes to the handler installed before ours, or kills the process as it
// would have without us.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace attnserve {

class GuardedMapping {
 public:
  // How many mappings may be guarded at once (a fixed table, so the signal
  // handler never allocates or locks).
  static constexpr int kCapacity = 16384;

  // Guards [begin, begin + size) (rounded out to pages). Installs the SIGBUS
  // handler on first use. RESOURCE_EXHAUSTED when kCapacity mappings are
  // guarded already; INTERNAL if the handler cannot be installed.
  static absl::StatusOr<std::unique_ptr<GuardedMapping>> Guard(void* begin, size_t size);

  // Stops guarding; call before unmapping the range.
  ~GuardedMapping();
  GuardedMapping(const GuardedMapping&) = delete;
  GuardedMapping& operator=(const GuardedMapping&) = delete;

  // True once an access faulted and part of the mapping became zero pages.
  // Never cleared: those pages are no longer the peer's memory.
  bool broken() const;

 private:
  explicit GuardedMapping(int slot) : slot_(slot) {}
  const int slot_;
};

}  // namespace attnserve
