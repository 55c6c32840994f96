// FileWatcher; see file_watch.h.
#include "server/security/file_watch.h"

#include <sys/stat.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

FileWatcher::FileWatcher(std::vector<std::string> paths, absl::Duration interval,
                         std::function<void()> on_change)
    : paths_(std::move(paths)), interval_(interval), on_change_(std::move(on_change)) {
  thread_ = std::thread([this] { Loop(); });
}

FileWatcher::~FileWatcher() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

std::string FileWatcher::Signature() const {
  std::string signature;
  for (const std::string& path : paths_) {
    if (path.empty()) continue;
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      absl::StrAppend(&signature, "missing;");
      continue;
    }
    absl::StrAppend(&signature, st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".",
                    st.st_mtim.tv_nsec, ":", st.st_ctim.tv_sec, ".", st.st_ctim.tv_nsec, ";");
  }
  return signature;
}

void FileWatcher::Loop() {
  std::string last = Signature();
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), interval_)) {
    mu_.Unlock();
    std::string now = Signature();
    if (now != last) {
      last = std::move(now);
      on_change_();
    }
    mu_.Lock();
  }
}

}  // namespace attnserve
