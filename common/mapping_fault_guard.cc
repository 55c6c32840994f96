// The SIGBUS guard of shared mappings; see mapping_fault_guard.h.
#include "common/mapping_fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/base/attributes.h"
#include "absl/base/const_init.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {
namespace {

// One guarded range. The handler reads slots without a lock, so each is a
// seqlock: the sequence is odd while a writer changes the range, and a reader
// that sees it change skips the slot. The slot of a mapping being accessed
// never changes, so a skipped slot is never the one that faulted.
struct Slot {
  std::atomic<uint64_t> seq{0};
  std::atomic<uintptr_t> begin{0};  // 0: free
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> broken{false};
};

Slot g_slots[GuardedMapping::kCapacity];
// Slots [0, g_used) may be live; the handler looks at no others.
std::atomic<int> g_used{0};
// Writers of slots and the installation; never taken in the handler.
ABSL_CONST_INIT absl::Mutex g_mu(absl::kConstInit);
bool g_taken[GuardedMapping::kCapacity] ABSL_GUARDED_BY(g_mu) = {};
bool g_installed ABSL_GUARDED_BY(g_mu) = false;
// Set once before the handler is installed, read only by the handler.
struct sigaction g_previous;
uintptr_t g_page_mask = 0;

void WriteSlot(Slot& slot, uintptr_t begin, uintptr_t end) {
  const uint64_t seq = slot.seq.load(std::memory_order_relaxed);
  slot.seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  slot.begin.store(begin, std::memory_order_relaxed);
  slot.end.store(end, std::memory_order_relaxed);
  slot.broken.store(false, std::memory_order_relaxed);
  slot.seq.store(seq + 2, std::memory_order_release);
}

// Replaces the faulting page of a guarded range and the rest of the range
// with zero pages; false if `addr` lies in no guarded range.
bool Absorb(uintptr_t addr) {
  const int used = g_used.load(std::memory_order_acquire);
  for (int i = 0; i < used; ++i) {
    Slot& slot = g_slots[i];
    const uint64_t seq = slot.seq.load(std::memory_order_acquire);
    if (seq % 2 != 0) continue;
    const uintptr_t begin = slot.begin.load(std::memory_order_relaxed);
    const uintptr_t end = slot.end.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (slot.seq.load(std::memory_order_relaxed) != seq) continue;
    if (begin == 0 || addr < begin || addr >= end) continue;
    // Every page from the faulting one on lies past the object's new end
    // too; one remap covers them all instead of one fault each.
    const uintptr_t page = addr & g_page_mask;
    void* zero = mmap(reinterpret_cast<void*>(page), end - page, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (zero == MAP_FAILED) return false;
    slot.broken.store(true, std::memory_order_release);
    return true;
  }
  return false;
}

// What would have happened without us: the previous handler, or the default
// action (ignoring a fault would re-run the access forever).
void ForwardToPrevious(int sig, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler == SIG_IGN && info != nullptr && info->si_code <= 0) {
    return;  // a SIGBUS sent by a process, which was ignored before
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
  raise(SIGBUS);  // blocked until we return, then fatal
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  // Only faults the kernel raised for an access (si_code > 0); a machine
  // check is a hardware error, not a peer's truncation.
  bool absorbed = false;
  if (info != nullptr && info->si_code > 0
#ifdef BUS_MCEERR_AR
      && info->si_code != BUS_MCEERR_AR && info->si_code != BUS_MCEERR_AO
#endif
  ) {
    absorbed = Absorb(reinterpret_cast<uintptr_t>(info->si_addr));
  }
  if (!absorbed) ForwardToPrevious(sig, info, context);
  errno = saved_errno;
}

absl::Status InstallLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_mu) {
  if (g_installed) return absl::OkStatus();
  const long page = sysconf(_SC_PAGESIZE);
  g_page_mask = ~static_cast<uintptr_t>(page > 0 ? page - 1 : 4095);
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  if (sigaction(SIGBUS, &action, &g_previous) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot install the SIGBUS handler: ", std::strerror(errno)));
  }
  g_installed = true;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GuardedMapping>> GuardedMapping::Guard(void* begin, size_t size) {
  absl::MutexLock lock(&g_mu);
  if (absl::Status installed = InstallLocked(); !installed.ok()) return installed;
  int slot = 0;
  while (slot < kCapacity && g_taken[slot]) ++slot;
  if (slot == kCapacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server guards at most ", kCapacity, " shared mappings at once"));
  }
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin);
  const uintptr_t end = (first + size + ~g_page_mask) & g_page_mask;
  WriteSlot(g_slots[slot], first & g_page_mask, end);
  g_taken[slot] = true;
  if (slot >= g_used.load(std::memory_order_relaxed)) {
    g_used.store(slot + 1, std::memory_order_release);
  }
  return std::unique_ptr<GuardedMapping>(new GuardedMapping(slot));
}

GuardedMapping::~GuardedMapping() {
  absl::MutexLock lock(&g_mu);
  WriteSlot(g_slots[slot_], 0, 0);
  g_taken[slot_] = false;
}

bool GuardedMapping::broken() const {
  return g_slots[slot_].broken.load(std::memory_order_acquire);
}

}  // namespace attnserve
