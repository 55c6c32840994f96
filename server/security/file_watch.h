// Watches a few files (certificates, keys, the tokens file) and calls back when
// any of them changes, so they can be replaced without a restart. It polls
// stat(2) on a thread of its own: a Kubernetes secret volume swaps a symlink,
// which inotify on the files themselves would miss, and a poll every few
// seconds costs nothing.
#pragma once

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

class FileWatcher {
 public:
  // Checks `paths` every `interval` and runs `on_change` (on the watcher's
  // thread) after any of them changed: modification time, size, inode, or
  // appearing or vanishing. Empty paths are skipped.
  FileWatcher(std::vector<std::string> paths, absl::Duration interval,
              std::function<void()> on_change);
  // Stops the thread (an on_change in progress finishes first).
  ~FileWatcher();
  FileWatcher(const FileWatcher&) = delete;
  FileWatcher& operator=(const FileWatcher&) = delete;

 private:
  std::string Signature() const;
  void Loop();

  const std::vector<std::string> paths_;
  const absl::Duration interval_;
  const std::function<void()> on_change_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace attnserve
