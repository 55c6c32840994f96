// A paged test case's host slabs in K/V memory, for the GPU tests: each host
// slab (K, and V where the case has V pages) copied to memory from the
// backend's AllocateKvMemory; pages() is the case's KvPages pointing at those
// copies, and CopyBack refreshes the host slabs with what a launch wrote (its
// append and page copies), for the case's page checks.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "backend/backend.h"
#include "backend/paged_kv.h"

namespace attnserve {
namespace testing_util {

class DeviceSlabs {
 public:
  using Slabs = std::vector<std::vector<uint8_t>>;
  // `pages`: the case's pages (its host slabs' pointers are replaced);
  // `v_slabs` empty when the case has no V pages (pages.v_in_k).
  DeviceSlabs(AttentionBackend* backend, const KvPages& pages, Slabs* k_slabs, Slabs* v_slabs)
      : backend_(backend), host_{k_slabs, v_slabs}, pages_(pages) {
    for (int s = 0; s < kMaxKvSlabs; ++s) pages_.k_slabs[s] = pages_.v_slabs[s] = nullptr;
    for (int kv = 0; kv < 2; ++kv) {
      for (size_t s = 0; s < host_[kv]->size(); ++s) {
        std::vector<uint8_t>& host = (*host_[kv])[s];
        absl::StatusOr<void*> m = backend->AllocateKvMemory(int64_t(host.size()));
        status_.Update(m.status());
        if (!m.ok()) return;
        (kv ? pages_.v_slabs : pages_.k_slabs)[s] = *m;
        status_.Update(backend->CopyToKvMemory(*m, host.data(), int64_t(host.size())));
      }
    }
  }
  ~DeviceSlabs() {
    for (int s = 0; s < kMaxKvSlabs; ++s) {
      backend_->FreeKvMemory(pages_.k_slabs[s]);
      backend_->FreeKvMemory(pages_.v_slabs[s]);
    }
  }
  DeviceSlabs(const DeviceSlabs&) = delete;
  DeviceSlabs& operator=(const DeviceSlabs&) = delete;

  void CopyBack() {
    for (int kv = 0; kv < 2; ++kv) {
      for (size_t s = 0; s < host_[kv]->size(); ++s) {
        std::vector<uint8_t>& host = (*host_[kv])[s];
        status_.Update(backend_->CopyFromKvMemory(
            host.data(), (kv ? pages_.v_slabs : pages_.k_slabs)[s], int64_t(host.size())));
      }
    }
  }
  const absl::Status& status() const { return status_; }
  const KvPages& pages() const { return pages_; }

 private:
  AttentionBackend* backend_;
  Slabs* host_[2];
  KvPages pages_;
  absl::Status status_;
};

}  // namespace testing_util
}  // namespace attnserve
