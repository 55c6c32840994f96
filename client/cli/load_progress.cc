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
  // The counts when the window opened: warm-up's, which the step's results
  // leave out, so the measure phase shows only what it will report.
  int64_t warmup_done = 0, warmup_failed = 0;
  bool measuring = false;
  absl::Time tick = start + absl::Seconds(1);
  for (;;) {
    // Wake at the window's start as well, so the snapshot is taken there.
    const absl::Time wake = !measuring && window_start < tick ? window_start : tick;
    if (done_.WaitForNotificationWithDeadline(wake)) break;
    const absl::Time now = absl::Now();
    if (!measuring && now >= window_start) {
      measuring = true;
      warmup_done = rec.completed();
      warmup_failed = rec.failed();
    }
    if (now < tick) continue;
    tick += absl::Seconds(1);
    const int64_t completed = rec.completed();
    const std::string phase = absl::StrCat(measuring ? "measure " : "warmup ",
                                           Fixed(absl::ToDoubleSeconds(now - start), 0), "/",
                                           Fixed(absl::ToDoubleSeconds(stop - start), 0), "s");
    std::cerr << (tty ? "\r" : "") << "[" << label << " " << phase << "] "
              << completed - warmup_done << (measuring ? " measured, " : " done, ")
              << completed - last << " req/s, " << rec.failed() - warmup_failed << " errors"
              << (tty ? "   " : "\n") << std::flush;
    last = completed;
  }
  if (tty) std::cerr << "\r" << std::string(72, ' ') << "\r" << std::flush;
}

}  // namespace cli
}  // namespace attnserve
