// How `attnctl load` shows a step: the table on stdout, one CSV row (--csv)
// and one JSON object (--jsonl) per step, all from one list of columns so the
// three cannot disagree.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "client/cli/load_flags.h"
#include "client/cli/load_recorder.h"
#include "client/cli/load_workload.h"

namespace attnserve {
namespace cli {

// `x` with `digits` digits after the point.
std::string Fixed(double x, int digits);

// "concurrency=4" or "rate=100": a step's name in the table and progress.
std::string StepLabel(const StepResult& r);

// The table's two header lines, and one step's row (plus its errors by code,
// requests by device and first error when there are any).
void PrintHeader();
void PrintRow(const StepResult& r);

// Append the step to `path`: one CSV row (header first when the file is new
// or empty) or one JSON object on its own line. UNAVAILABLE naming the file
// when it cannot be written.
absl::Status AppendCsv(const std::string& path, const StepResult& r, const Workload& w,
                       const LoadConfig& config);
absl::Status AppendJson(const std::string& path, const StepResult& r, const Workload& w,
                        const LoadConfig& config);

}  // namespace cli
}  // namespace attnserve
