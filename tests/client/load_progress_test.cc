// attnctl load's progress line (client/cli/load_progress.h): once the
// measurement window opens, "N measured" counts only completions since it
// opened (what the step will report), and its errors likewise; warm-up's
// counts show only as "N done" before. Issue 27 finding 15: the measure
// phase counted warm-up's completions as measured.
#include "client/cli/load_progress.h"

#include <iostream>
#include <mutex>
#include <streambuf>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cli/load_recorder.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace cli {
namespace {

// std::cerr's text, written by the progress thread and read by the test.
class LockedBuffer : public std::streambuf {
 public:
  std::string text() {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }

 protected:
  int overflow(int c) override {
    if (c == traits_type::eof()) return traits_type::not_eof(c);
    std::lock_guard<std::mutex> lock(mu_);
    text_.push_back(static_cast<char>(c));
    return c;
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    std::lock_guard<std::mutex> lock(mu_);
    text_.append(s, static_cast<size_t>(n));
    return n;
  }

 private:
  std::mutex mu_;
  std::string text_;
};

// The progress lines written so far (a terminal's "\r" rewrites as lines).
std::vector<std::string> Lines(LockedBuffer* buffer) {
  std::vector<std::string> lines;
  for (absl::string_view l : absl::StrSplit(buffer->text(), absl::ByAnyChar("\r\n"))) {
    if (absl::StartsWith(l, "[")) lines.emplace_back(l);
  }
  return lines;
}

// Waits (polling the text the progress thread writes, up to 20 s) until
// there are more than `n` lines; the last one, or "" on time-out.
std::string NextLineAfter(LockedBuffer* buffer, size_t n) {
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (absl::Now() < give_up) {
    const std::vector<std::string> lines = Lines(buffer);
    if (lines.size() > n) return lines.back();
    absl::SleepFor(absl::Milliseconds(20));  // poll interval
  }
  return "";
}

void Complete(Recorder* rec, int n, bool failed) {
  for (int i = 0; i < n; ++i) {
    Completion c;
    c.sent = c.done = absl::Now();
    if (failed) {
      c.code = "UNAVAILABLE";
      c.failure = "UNAVAILABLE: test";
    }
    rec->Record(c);
  }
}

TEST(LoadProgressTest, MeasurePhaseCountsOnlyTheWindow) {
  LockedBuffer buffer;
  std::streambuf* const saved = std::cerr.rdbuf(&buffer);
  const absl::Time start = absl::Now();
  // Ticks at 1 s (warm-up), 2 s and 3 s (measuring).
  const absl::Time window_start = start + absl::Milliseconds(1500);
  const absl::Time stop = start + absl::Seconds(60);
  Recorder rec(window_start, stop, 1, 0.0);
  {
    Progress progress("c=1", rec, start, window_start, stop);
    Complete(&rec, 50, false);  // warm-up
    Complete(&rec, 3, true);
    const std::string warmup = NextLineAfter(&buffer, 0);
    EXPECT_TRUE(absl::StrContains(warmup, "warmup")) << warmup;
    EXPECT_TRUE(absl::StrContains(warmup, "] 53 done,")) << warmup;
    EXPECT_TRUE(absl::StrContains(warmup, " 3 errors")) << warmup;
    // The first line of the window: nothing completed since it opened (the
    // line is written after the snapshot the window's start takes).
    std::string line = NextLineAfter(&buffer, 1);
    ASSERT_TRUE(absl::StrContains(line, "measure")) << line;
    EXPECT_TRUE(absl::StrContains(line, "] 0 measured,")) << line;
    EXPECT_TRUE(absl::StrContains(line, " 0 errors")) << line;
    Complete(&rec, 7, false);
    Complete(&rec, 2, true);
    line = NextLineAfter(&buffer, 2);
    EXPECT_TRUE(absl::StrContains(line, "] 9 measured,")) << line;
    EXPECT_TRUE(absl::StrContains(line, " 2 errors")) << line;
  }
  std::cerr.rdbuf(saved);
}

}  // namespace
}  // namespace cli
}  // namespace attnserve
