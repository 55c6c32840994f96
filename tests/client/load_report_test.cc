// Unit tests of attnctl load's Recorder (window, percentiles, server timing
// means, errors by code) and of its CSV and JSON Lines rows, without a server.
#include "client/cli/load_report.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cli/load_recorder.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace attnserve {
namespace cli {
namespace {

using ::testing::HasSubstr;

// A success that took `ms` milliseconds, ending at `done`.
Completion Success(absl::Time done, double ms, const v1::ServerTiming* timing) {
  Completion c;
  c.done = done;
  c.sent = done - absl::Milliseconds(ms);
  c.timing = timing;
  return c;
}

Completion Failure(absl::Time done, const std::string& code) {
  Completion c;
  c.done = done;
  c.sent = done;
  c.code = code;
  c.failure = absl::StrCat(code, ": why");
  return c;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

TEST(RecorderTest, CountsOnlyTheWindowAndTakesNearestRankPercentiles) {
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(2);
  Recorder rec(start, end, /*tokens_per_request=*/10, /*flops_per_request=*/1e12);
  v1::ServerTiming timing;
  timing.set_queue_us(1000);
  timing.set_compute_us(3000);
  timing.set_batch_size(2);
  timing.set_device(1);
  // 1..100 ms inside the window; one before and one after it.
  for (int ms = 1; ms <= 100; ++ms) rec.Record(Success(start + absl::Seconds(1), ms, &timing));
  rec.Record(Success(start - absl::Milliseconds(1), 500, &timing));
  rec.Record(Success(end + absl::Milliseconds(1), 500, &timing));
  rec.Record(Failure(start + absl::Seconds(1), "CHECK_FAILED"));
  rec.Record(Failure(start + absl::Seconds(1), "UNAVAILABLE"));
  rec.Record(Failure(start + absl::Seconds(1), "UNAVAILABLE"));
  EXPECT_EQ(rec.completed(), 105);
  EXPECT_EQ(rec.failed(), 3);

  StepResult r;
  rec.Summarize(&r);
  EXPECT_DOUBLE_EQ(r.seconds, 2.0);
  EXPECT_EQ(r.requests, 103);
  EXPECT_EQ(r.errors, 3);
  EXPECT_EQ(r.errors_by_code.at("UNAVAILABLE"), 2);
  EXPECT_EQ(r.errors_by_code.at("CHECK_FAILED"), 1);
  EXPECT_EQ(r.first_error, "CHECK_FAILED: why");
  EXPECT_DOUBLE_EQ(r.req_per_s, 50.0);
  EXPECT_DOUBLE_EQ(r.tokens_per_s, 500.0);
  EXPECT_DOUBLE_EQ(r.tflops, 50.0);
  EXPECT_NEAR(r.p50_ms, 50.0, 1e-9);
  EXPECT_NEAR(r.p90_ms, 90.0, 1e-9);
  EXPECT_NEAR(r.p99_ms, 99.0, 1e-9);
  EXPECT_NEAR(r.max_ms, 100.0, 1e-9);
  EXPECT_NEAR(r.mean_ms, 50.5, 1e-9);
  EXPECT_DOUBLE_EQ(r.queue_ms, 1.0);
  EXPECT_DOUBLE_EQ(r.compute_ms, 3.0);
  EXPECT_DOUBLE_EQ(r.mean_batch_size, 2.0);
  EXPECT_EQ(r.requests_by_device.at(1), 100);
}

TEST(RecorderTest, DroppedArrivalsAreClientBacklogErrors) {
  const absl::Time start = absl::Now() - absl::Seconds(1);
  Recorder rec(start, start + absl::Seconds(10), 1, 1.0);
  rec.RecordDropped();
  StepResult r;
  rec.Summarize(&r);
  EXPECT_EQ(r.errors_by_code.at("CLIENT_BACKLOG"), 1);
  EXPECT_EQ(r.req_per_s, 0.0);
  EXPECT_EQ(r.p50_ms, 0.0);  // no successes: no latencies
}

class LoadReportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = absl::StrCat(::testing::TempDir(), "/load_report_", getpid());
    std::remove((base_ + ".csv").c_str());
    std::remove((base_ + ".jsonl").c_str());
    w_.summary.batch = 2;
    w_.summary.seqlen_q = w_.summary.seqlen_k = 64;
    w_.summary.heads_q = w_.summary.heads_kv = 4;
    w_.summary.head_dim = 32;
    w_.summary.dtype = DType::kBF16;
    w_.options = "causal";
    config_.label = "say \"hi\"\x01";
    config_.channels = 3;
    config_.check = true;
    r_.mode = "open";
    r_.rate = 12.5;
    r_.seconds = 2;
    r_.requests = 1766;
    r_.req_per_s = 883;
    r_.p50_ms = 1.0 / 3.0;
    r_.errors = 2;
    r_.errors_by_code = {{"CANCELLED", 2}};
    r_.requests_by_device = {{0, 500}, {1, 383}};
  }
  void TearDown() override {
    std::remove((base_ + ".csv").c_str());
    std::remove((base_ + ".jsonl").c_str());
  }

  std::string base_;
  Workload w_;
  LoadConfig config_;
  StepResult r_;
};

TEST_F(LoadReportTest, CsvWritesTheHeaderOnceAndQuotesText) {
  const std::string path = base_ + ".csv";
  ASSERT_TRUE(AppendCsv(path, r_, w_, config_).ok());
  ASSERT_TRUE(AppendCsv(path, r_, w_, config_).ok());
  const std::vector<std::string> rows = Lines(ReadFile(path));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].substr(0, 44), "label,mode,concurrency,rate,channels,stream,");
  EXPECT_EQ(rows[1], rows[2]);
  EXPECT_THAT(rows[1],
              HasSubstr("\"say 'hi'\x01\",\"open\",0,12.5,3,false,\"dense\",\"BF16\",2,64,"));
  EXPECT_THAT(rows[1], HasSubstr(",1766,2,\"CANCELLED:2\",883,"));
  EXPECT_THAT(rows[1], HasSubstr(",0.333333,"));  // six significant digits
  EXPECT_THAT(rows[1], HasSubstr(",\"0:500;1:383\",true"));
  // The protocol columns come last (--protocol, --shm).
  EXPECT_THAT(rows[0], testing::EndsWith(",check,protocol,shm"));
  EXPECT_THAT(rows[1], testing::EndsWith(",true,\"native\",\"none\""));
}

TEST_F(LoadReportTest, JsonLinesHoldTheCsvNumbersAndEscapeText) {
  const std::string path = base_ + ".jsonl";
  ASSERT_TRUE(AppendJson(path, r_, w_, config_).ok());
  const std::vector<std::string> lines = Lines(ReadFile(path));
  ASSERT_EQ(lines.size(), 1u);
  // Whole numbers stay integers, fractions keep the CSV's digits.
  EXPECT_THAT(lines[0], HasSubstr("\"rate\":12.5,"));
  EXPECT_THAT(lines[0], HasSubstr("\"req_per_s\":883,"));
  EXPECT_THAT(lines[0], HasSubstr("\"p50_ms\":0.333333,"));
  EXPECT_THAT(lines[0], HasSubstr("\"stream\":false,"));
  EXPECT_THAT(lines[0], HasSubstr("\"label\":\"say \\\"hi\\\"\\u0001\","));
  const nlohmann::json j = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(j["label"], "say \"hi\"\x01");
  EXPECT_EQ(j["channels"], 3);
  EXPECT_EQ(j["check"], true);
  EXPECT_EQ(j["errors_by_code"]["CANCELLED"], 2);
  EXPECT_EQ(j["requests_by_device"], "0:500;1:383");
  // errors_by_code comes last, as an object.
  EXPECT_EQ(lines[0].rfind("\"errors_by_code\":{\"CANCELLED\":2}}"),
            lines[0].size() - std::string("\"errors_by_code\":{\"CANCELLED\":2}}").size());
}

TEST_F(LoadReportTest, UnwritablePathIsUnavailableNamingIt) {
  const absl::Status st = AppendCsv("/nonexistent-dir/x.csv", r_, w_, config_);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(st.message()), HasSubstr("/nonexistent-dir/x.csv"));
}

}  // namespace
}  // namespace cli
}  // namespace attnserve
