// The native K/V transfer front-end: attnserve.v1.KvTransfer
// (kv_transfer.proto, docs/kv-transfer.md) on gRPC's callback API, on the
// same port as KvCache. Thin: the proto messages become the core's chunks
// (server/kv/kv_transfer.h) and back, tenancy as KvService (another tenant's
// cache is NOT_FOUND), statuses mapped in one place (common/grpc_status.h).
//
// ExportSequences reads the next chunk only when the previous one is written
// (one chunk in flight per stream), and the bytes it holds are charged to the
// tenant's bytes_in_flight like other streams, so a slow receiver holds one
// chunk, not the cache. ImportSequences answers each kept sequence (and the
// first message) with where the transfer stands.
//
// In-process use (a draining server pushing to its peer): ExportChunks and
// the proto conversions below drive the same core without a stream.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/kv_transfer.grpc.pb.h"
#include "server/auth/authenticator.h"
#include "server/auth/tenants.h"
#include "server/core/kv_runner.h"
#include "server/in_flight.h"
#include "server/kv/kv_pool.h"
#include "server/kv/kv_transfer.h"
#include "server/stream_flow_control.h"

namespace attnserve {

// Proto <-> core conversions (the chunk's bytes are copied; `out` reused).
KvExportOptions DecodeExportRequest(const v1::ExportSequencesRequest& request);
KvTransferHeader DecodeTransferHeader(const v1::KvTransferHeader& header);
void EncodeTransferHeader(const KvTransferHeader& header, v1::KvTransferHeader* out);
void DecodeChunk(const v1::KvChunk& chunk, KvTransferChunk* out);
void EncodeChunk(KvTransferChunk&& chunk, v1::KvChunk* out);
void EncodeResumePoint(const KvResumePoint& point, v1::ImportResumePoint* out);
KvResumePoint DecodeResumePoint(const v1::ImportResumePoint& point);

// Every chunk ExportSequences would send for `request` on the tenant's
// cache, in order (the first with its header), into `sink`; the sink's error
// stops it and comes back.
absl::Status ExportChunks(KvPool& pool, const std::string& tenant,
                          const v1::ExportSequencesRequest& request,
                          const std::function<absl::Status(v1::KvChunk&&)>& sink);

// UCX exports running at once: per server (--ucx_max_exports) and per
// tenant (--ucx_max_exports_per_tenant); 0: no limit. Process-wide, set
// once at start-up (tests may set them again).
inline constexpr int kDefaultUcxMaxExports = 16;
inline constexpr int kDefaultUcxMaxExportsPerTenant = 4;
void SetUcxExportLimits(int per_server, int per_tenant);

// The UCX exports a service runs, counted against those limits.
class UcxExportSlots {
 public:
  // One export's place; given back when destroyed (or replaced).
  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& o) noexcept : owner_(o.owner_), tenant_(std::move(o.tenant_)) {
      o.owner_ = nullptr;
    }
    Slot& operator=(Slot&& o) noexcept {
      if (this != &o) {
        Release();
        owner_ = o.owner_;
        tenant_ = std::move(o.tenant_);
        o.owner_ = nullptr;
      }
      return *this;
    }
    ~Slot() { Release(); }

   private:
    friend class UcxExportSlots;
    Slot(UcxExportSlots* owner, std::string tenant) : owner_(owner), tenant_(std::move(tenant)) {}
    void Release() {
      if (owner_ != nullptr) owner_->Give(tenant_);
      owner_ = nullptr;
    }
    UcxExportSlots* owner_ = nullptr;
    std::string tenant_;
  };

  // A place for one more export of `tenant`, or RESOURCE_EXHAUSTED naming
  // the flag whose limit it would pass.
  absl::StatusOr<Slot> Take(const std::string& tenant);
  int running();

 private:
  void Give(const std::string& tenant);
  absl::Mutex mu_;
  int total_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int> per_tenant_ ABSL_GUARDED_BY(mu_);
};

// Counters for /metrics (bytes and sequences exported; the import side's are
// KvImportSessions::Stats).
struct KvTransferCounters {
  std::atomic<int64_t> bytes_exported{0};
  std::atomic<int64_t> sequences_exported{0};
  std::atomic<int64_t> chunks_exported{0};
};

class KvTransferService final : public v1::KvTransfer::CallbackService {
 public:
  // `runner` (its pool, and whether the server drains: imports are refused
  // then, exports still run) and `sessions` must outlive the service.
  KvTransferService(KvRunner* runner, KvImportSessions* sessions);

  grpc::ServerWriteReactor<v1::KvChunk>* ExportSequences(
      grpc::CallbackServerContext* context, const v1::ExportSequencesRequest* request) override;
  grpc::ServerBidiReactor<v1::ImportSequencesRequest, v1::ImportSequencesResponse>* ImportSequences(
      grpc::CallbackServerContext* context) override;

  // Who the calls are; null (the default) when authentication is off.
  // Set before serving.
  void set_auth(const Authenticator* auth) { auth_ = auth; }
  // Charges the bytes a stream holds to its tenant (null: not charged).
  void set_tenants(TenantDirectory* tenants) { tenants_ = tenants; }
  // The server's budget for bytes outside gRPC and the streams
  // (--max_buffered_bytes' share, server/buffered_shares.h): a UCX export's
  // window and each chunk a UCX import receives are charged to it, with or
  // without tokens (null: not charged). Set before serving.
  void set_buffered(ByteBudget* budget) { buffered_ = budget; }
  // Imports that ask for it take their chunks over UCX on this host (the
  // UCX listener's, --ucx_host); empty (the default): never offered.
  void set_data_plane_host(const std::string& host) {
    absl::MutexLock lock(&data_plane_mu_);
    data_plane_host_ = host;
  }

  // Waits until every stream has finished. True when none is left.
  bool WaitForStreams(absl::Duration timeout) { return in_flight_.WaitForZero(timeout); }

  // The transfer families in Prometheus text (ServerMetrics::SetExtraSource).
  std::string RenderMetrics();

  const KvTransferCounters& counters() const { return counters_; }
  // UCX exports running now.
  int ucx_exports_running() { return ucx_exports_.running(); }

 private:
  KvRunner* const runner_;
  KvPool* const pool_;
  KvImportSessions* const sessions_;
  const Authenticator* auth_ = nullptr;
  TenantDirectory* tenants_ = nullptr;
  ByteBudget* buffered_ = nullptr;
  KvTransferCounters counters_;
  InFlightCounter in_flight_;
  UcxExportSlots ucx_exports_;
  absl::Mutex data_plane_mu_;
  std::string data_plane_host_ ABSL_GUARDED_BY(data_plane_mu_);
};

}  // namespace attnserve
