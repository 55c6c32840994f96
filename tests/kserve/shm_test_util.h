// A POSIX shared-memory object made for a test (what a client would create
// before registering it), removed when the test is done.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace attnserve {

class TestShmObject {
 public:
  // Key "/attnserve_<tag>_<pid>"; with `prefix`, "<prefix><tag>_<pid>" (a
  // tenant's own key, ShmKeyPrefix). `mode` is set exactly, whatever the umask.
  explicit TestShmObject(size_t size, const std::string& tag = "t",
                         const std::string& prefix = "/attnserve_", mode_t mode = 0600)
      : key_(absl::StrCat(prefix, tag, "_", getpid())), size_(size) {
    shm_unlink(key_.c_str());
    const int fd = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0 && fchmod(fd, mode) == 0 && ftruncate(fd, static_cast<off_t>(size)) == 0) {
      void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) data_ = static_cast<char*>(p);
    }
    if (fd >= 0) close(fd);
  }
  ~TestShmObject() {
    if (data_ != nullptr) munmap(data_, size_);
    shm_unlink(key_.c_str());
  }
  bool ok() const { return data_ != nullptr; }
  // Shrinks (or grows) the object as a client could at any time. The
  // object's own mapping here faults past the new end: read it no more.
  bool Truncate(size_t size) {
    const int fd = shm_open(key_.c_str(), O_RDWR, 0);
    if (fd < 0) return false;
    const bool ok = ftruncate(fd, static_cast<off_t>(size)) == 0;
    close(fd);
    return ok;
  }
  const std::string& key() const { return key_; }
  char* data() { return data_; }

 private:
  const std::string key_;
  const size_t size_;
  char* data_ = nullptr;
};

}  // namespace attnserve
