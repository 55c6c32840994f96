// Progress: the once-a-second status line of `attnctl load`.
#include "client/cli/load_progress.h"

#include <unistd.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cli/load_report.h"

namespace attnserve {
namespace cli {

Progress::Progress(const std::string& label, const Recorder& rec, absl::Time start,
                   absl::Time window_start, absl::Time stop)
    : thread_([=, &rec] { Loop(label, rec, start, window_start, stop); }) {}

Progress::~Progress() {
  done_.Notify();
  thread_.join();
}

void Progress::Loop(const std::string& label, const Recorder& rec, absl::Time start,
                    absl::Time window_start, absl::Time stop) {
  const bool tty = isatty(2);
  int64_t last = 0;
  while (!done_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
    const absl::Time now = absl::Now();
    const int64_t completed = rec.completed();
    const std::string phase = absl::StrCat(now < window_start ? "warmup " : "measure ",
                                           Fixed(absl::ToDoubleSeconds(now - start), 0), "/",
                                           Fixed(absl::ToDoubleSeconds(stop - start), 0), "s");
    std::cerr << (tty ? "\r" : "") << "[" << label << " " << phase << "] " << completed << " done, "
              << completed - last << " req/s, " << rec.failed() << " errors" << (tty ? "   " : "\n")
              << std::flush;
    last = completed;
  }
  if (tty) std::cerr << "\r" << std::string(72, ' ') << "\r" << std::flush;
}

}  // namespace cli
}  // namespace attnserve
