// One KvCall from receipt to completion; see kv_runner.h.
#include "server/core/kv_runner.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "server/auth/tenants.h"
#include "server/core/call_log.h"
#include "server/core/validate_attend_pages.h"
#include "server/core/validate_mods.h"
#include "server/in_flight.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// The pool's form of a call that passed ValidateKvCall on `cache`.
std::shared_ptr<KvAppendAttend> PoolCallOf(const KvCall& call, const KvCache& cache,
                                           const FieldNames& names) {
  const KvGeometry& g = cache.geometry();
  auto c = std::make_shared<KvAppendAttend>();
  c->cache_id = call.cache_id;
  c->layer = call.layer;
  for (const KvStepRequest& s : call.steps) {
    c->steps.push_back({s.sequence_id, call.check_lengths ? s.expected_length : kAnyLength,
                        s.num_new_tokens, s.num_queries, s.attend_pages});
  }
  c->dtype = g.dtype;
  c->num_heads_kv = g.num_heads_kv;
  // An absent q (no queries) has no heads to read: any multiple of Hkv
  // serves, the per-head lists' length when sent (the backend checks them).
  c->num_heads_q = static_cast<int32_t>(KvCallHeadsQ(call, g.num_heads_kv));
  c->head_dim = g.head_dim;
  c->head_dim_v = g.head_dim_v;
  c->options = ToAttnOptions(call.options);
  c->inputs.q = call.q.bytes.data();
  c->inputs.k = call.k.bytes.data();
  c->inputs.v = call.v.bytes.data();
  if (!call.k_scale.absent) {  // FP8 rows with scales (ValidateKvCall checked them)
    c->k_scale = reinterpret_cast<const float*>(call.k_scale.bytes.data());
    c->v_scale = reinterpret_cast<const float*>(call.v_scale.bytes.data());
  }
  // Device-resident rows (CUDA regions): the backend reads them where they lie.
  c->inputs.devices.q = call.q.device;
  c->inputs.devices.k = call.k.device;
  c->inputs.devices.v = call.v.device;
  // The score modifiers (ValidateKvCall refused a block mask).
  if (call.mods.alibi_slopes.has_value())
    c->inputs.mods.alibi_slopes = call.mods.alibi_slopes->data();
  if (call.mods.sinks.has_value()) c->inputs.mods.sinks = call.mods.sinks->data();
  SetKvElementMasks(call, &c->inputs.mods);
  c->return_lse = call.options.return_lse;
  c->names = &names;
  c->received = call.meta.received;
  c->deadline = call.meta.deadline;
  c->cancelled = call.meta.cancelled;
  return c;
}

// The outputs' shapes: o [Tq, Hq, Dv], lse [Hq, Tq].
OutputLayout KvLayoutOf(const KvAppendAttend& c) {
  int64_t total_q = 0;
  for (const KvStep& s : c.steps) total_q += s.num_queries;
  OutputLayout layout;
  layout.o_dtype = c.dtype;
  const int32_t dv = c.head_dim_v > 0 ? c.head_dim_v : c.head_dim;
  layout.o_shape = {total_q, c.num_heads_q, dv};
  layout.o_bytes = total_q * c.num_heads_q * dv * DTypeSize(c.dtype);
  if (c.return_lse) {
    layout.lse_shape = {c.num_heads_q, total_q};
    layout.lse_bytes = total_q * c.num_heads_q * int64_t{sizeof(float)};
  }
  return layout;
}

// Whether every step appends at least as many tokens as it has queries, so
// each query row (causal ones too) has its own token to attend and no
// kernel can leave it unwritten.
bool EveryQueryHasKeys(const KvAppendAttend& c) {
  for (const KvStep& s : c.steps) {
    if (s.num_new < s.num_queries) return false;
  }
  return true;
}

}  // namespace

KvRunner::KvRunner(KvPool* pool, std::string backend_name, const RequestLimits& limits,
                   ServerMetrics* metrics)
    : pool_(pool), backend_name_(std::move(backend_name)), limits_(limits), metrics_(metrics) {}

absl::Status KvRunner::Draining() const {
  if (draining_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("server is draining: not accepting new requests");
  }
  return absl::OkStatus();
}

void KvRunner::Start(const KvCall* call, const FieldNames& names, Done done,
                     std::function<absl::Status()> inputs_intact, KvOutputPlace o_place) {
  // Nothing may escape to the front-end's reactor: a throw completes the call
  // here (once), and a late completion is dropped.
  const Once<const absl::Status&, const WorkTimings&, KvResult*> once(std::move(done));
  std::function<void(const absl::Status&, const WorkTimings&, KvResult*)> finish =
      [this, call, done = once.Callback()](const absl::Status& status, const WorkTimings& timings,
                                           KvResult* result) {
        if (metrics_ != nullptr) metrics_->RecordRequest(status, timings);
        const spdlog::level::level_enum level = CallLogLevel(status);
        if (spdlog::should_log(level)) {
          spdlog::log(level, "kv append_attend id=\"{}\" status={}{}{}",
                      call->meta.id.substr(0, 64), absl::StatusCodeToString(status.code()),
                      status.ok() ? "" : " error=",
                      status.ok() ? std::string() : std::string(status.message()));
        }
        done(status, timings, result);
      };
  try {
    StartOrThrow(call, names, &finish, std::move(inputs_intact), o_place);
  } catch (...) {
    if (!once.ran()) {
      WorkTimings timings;
      timings.total_us = absl::ToInt64Microseconds(absl::Now() - call->meta.received);
      finish(StatusOfException(std::current_exception(), "append_attend"), timings, nullptr);
    }
  }
}

void KvRunner::StartOrThrow(const KvCall* call, const FieldNames& names, Finish* finish_in,
                            std::function<absl::Status()> inputs_intact, KvOutputPlace o_place) {
  Finish& finish = *finish_in;
  auto refuse = [&](const absl::Status& status) {
    WorkTimings timings;
    timings.total_us = absl::ToInt64Microseconds(absl::Now() - call->meta.received);
    finish(status, timings, nullptr);
  };
  absl::Status status = Draining();
  if (status.ok()) {
    status = HoldInFlight(pool_->tenants(), call->meta.tenant, call->request_bytes, &finish);
  }
  if (!status.ok()) return refuse(status);
  absl::StatusOr<std::shared_ptr<KvCache>> cache = pool_->Find(call->meta.tenant, call->cache_id);
  if (!cache.ok()) return refuse(cache.status());
  status = ValidateKvCall(*call, (*cache)->geometry(), limits_, names);
  if (status.ok()) {
    status = ValidateAttendPages(*call, (*cache)->page_size(), (*cache)->capacity_pages(), names);
  }
  if (!status.ok()) return refuse(status);

  std::shared_ptr<KvAppendAttend> c = PoolCallOf(*call, **cache, names);
  c->inputs_intact = std::move(inputs_intact);
  c->o_out = o_place.o;
  c->o_out_bytes = o_place.o_bytes;
  std::shared_ptr<char> o_shared;
  if (o_place.o == nullptr && o_place.shared && EveryQueryHasKeys(*c)) {
    // Not zeroed: the kernel writes all of it (the pool's string would be
    // zero-filled first, a memset of the whole o per step).
    const int64_t o_bytes = KvLayoutOf(*c).o_bytes;
    if (o_bytes > 0) {
      // Held from here through the queue wait until the answer is sent, so it
      // is charged like the request (the pool's own bind comes too late).
      status = HoldInFlight(pool_->tenants(), call->meta.tenant, o_bytes, &finish);
      if (!status.ok()) return refuse(status);
      // The backend's host tensor memory: on CUDA page-locked, so the
      // device-to-host copy writes o where the answer is sent from.
      o_shared = pool_->AllocateHostTensor(o_bytes);
      if (o_shared == nullptr) {
        return refuse(absl::ResourceExhaustedError(
            absl::StrCat("o: cannot allocate ", o_bytes, " bytes of host memory for it")));
      }
      c->o_out = o_shared.get();
      c->o_out_bytes = o_bytes;
    }
  }
  status = pool_->AppendAttend(
      *cache, c, [c, finish, o_shared](const absl::Status& s, const WorkTimings& timings) {
        KvResult result;
        if (s.ok()) {
          result.layout = KvLayoutOf(*c);
          result.o_shared = o_shared;
          result.o = std::move(c->o);
          result.lse = std::move(c->lse);
          result.lengths = std::move(c->lengths);
        }
        // total_us runs to here, not to the executor's completion, so that the
        // client can tell the server's whole share from the wire's.
        WorkTimings answered = timings;
        answered.total_us = absl::ToInt64Microseconds(absl::Now() - c->received);
        finish(s, answered, s.ok() ? &result : nullptr);
      });
  if (!status.ok()) finish(status, WorkTimings{}, nullptr);
}

}  // namespace attnserve
