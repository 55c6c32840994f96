// The live progress line of an `attnctl load` step on stderr.
#pragma once

#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/cli/load_recorder.h"

namespace attnserve {
namespace cli {

// Prints "[label phase] N done, R req/s, E errors" to stderr once a second
// (in the measure phase "N measured": counts since the window opened)
// from construction to destruction: on a terminal it rewrites one line,
// otherwise it writes one line per second (logs stay readable).
class Progress {
 public:
  Progress(const std::string& label, const Recorder& rec, absl::Time start, absl::Time window_start,
           absl::Time stop);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

 private:
  void Loop(const std::string& label, const Recorder& rec, absl::Time start,
            absl::Time window_start, absl::Time stop);

  absl::Notification done_;
  std::thread thread_;
};

}  // namespace cli
}  // namespace attnserve
