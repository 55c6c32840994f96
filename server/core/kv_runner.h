// Runs one KvCall (append-and-attend on a server-side K/V cache) from any
// front-end: draining, the tenant's in-flight budget, the cache lookup, the
// structural check against the cache's geometry (errors in the caller's
// field names), then the pool (server/kv/kv_pool.h), which orders, reserves,
// launches and commits or rolls back. Front-ends decode and encode only.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/core/call.h"
#include "server/core/field_names.h"
#include "server/core/validate.h"
#include "server/executor.h"
#include "server/kv/kv_pool.h"
#include "server/metrics.h"

namespace attnserve {

// Host memory a call's o is written into where it lies (a mapped output
// span of `o_bytes`), instead of KvResult::o.
struct KvOutputPlace {
  char* o = nullptr;
  int64_t o_bytes = 0;
  // Without `o`: the caller may take o as KvResult::o_shared, a buffer the
  // runner allocates without zeroing it (the string KvResult::o is
  // zero-filled first), used when every step appends at least as many
  // tokens as it has queries (no query row without a key: the kernel writes
  // all of o); otherwise o comes in KvResult::o as before.
  bool shared = false;
};

// What a successful call produced, for the front-end to encode.
struct KvResult {
  OutputLayout layout;  // o [Tq, Hq, D] in the cache's dtype; lse [Hq, Tq] with return_lse
  std::string o;        // empty when written to a KvOutputPlace or into o_shared
  std::shared_ptr<const char> o_shared;  // layout.o_bytes of o (KvOutputPlace::shared)
  std::string lse;
  std::vector<int32_t> lengths;  // each sequence's length at the layer after the call
};

class KvRunner {
 public:
  // Called exactly once per call; `result` is set (and movable from) on OK.
  using Done =
      std::function<void(const absl::Status& status, const WorkTimings& timings, KvResult* result)>;

  // `pool` and `metrics` (may be null) must outlive the runner.
  KvRunner(KvPool* pool, std::string backend_name, const RequestLimits& limits,
           ServerMetrics* metrics);

  // Starts `call`, whose views stay valid until `done` has run (possibly
  // before Start returns). Never blocks. `names` must outlive the call.
  // `inputs_intact` (may be null): whether memory the views read in place is
  // still all the caller's (a shared-memory region its owner may shrink),
  // asked after the launch and before the append commits; an error fails the
  // call and appends nothing. `o_place`: where o goes instead of KvResult::o.
  void Start(const KvCall* call, const FieldNames& names, Done done,
             std::function<absl::Status()> inputs_intact = nullptr, KvOutputPlace o_place = {});

  // New calls are refused with UNAVAILABLE from now on; admitted ones finish.
  void StopAdmitting() { draining_.store(true, std::memory_order_release); }
  // UNAVAILABLE while draining, else OK.
  absl::Status Draining() const;

  KvPool* pool() const { return pool_; }
  const std::string& backend_name() const { return backend_name_; }
  const RequestLimits& limits() const { return limits_; }

 private:
  using Finish =
      std::function<void(const absl::Status& status, const WorkTimings& timings, KvResult* result)>;
  // Start without the exception boundary; `finish` records and answers.
  void StartOrThrow(const KvCall* call, const FieldNames& names, Finish* finish,
                    std::function<absl::Status()> inputs_intact, KvOutputPlace o_place);

  KvPool* const pool_;
  const std::string backend_name_;
  const RequestLimits limits_;
  ServerMetrics* const metrics_;
  std::atomic<bool> draining_{false};
};

}  // namespace attnserve
