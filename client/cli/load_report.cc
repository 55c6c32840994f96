// The table, CSV rows and JSON Lines objects of `attnctl load`.
#include "client/cli/load_report.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <variant>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "nlohmann/json.hpp"

namespace attnserve {
namespace cli {
namespace {

// "INVALID_ARGUMENT:3;CHECK_FAILED:1".
std::string ErrorsString(const StepResult& r) {
  std::vector<std::string> parts;
  for (const auto& [code, n] : r.errors_by_code) parts.push_back(absl::StrCat(code, ":", n));
  return absl::StrJoin(parts, ";");
}

// "0:510;1:498": successful requests per device.
std::string DevicesString(const StepResult& r) {
  std::vector<std::string> parts;
  for (const auto& [device, n] : r.requests_by_device)
    parts.push_back(absl::StrCat(device, ":", n));
  return absl::StrJoin(parts, ";");
}

// One column of the CSV header and rows and of the JSON objects. Text is
// quoted in CSV and a JSON string; the rest are CSV cells as written and JSON
// numbers or booleans.
struct Column {
  std::string name;
  std::variant<std::string, int64_t, double, bool> value;
};

// The columns in order (the CSV's, and the JSON's but for errors_by_code,
// which JSON writes last as an object).
std::vector<Column> Columns(const StepResult& r, const Workload& w, const LoadConfig& config) {
  const InputsSummary& s = w.summary;
  using I = int64_t;
  return {{"label", config.label},
          {"mode", r.mode},
          {"concurrency", I{r.concurrency}},
          {"rate", r.rate},
          {"channels", I{config.channels}},
          {"stream", config.stream},
          {"layout", std::string(s.varlen ? "varlen" : "dense")},
          {"dtype", std::string(DTypeName(s.dtype))},
          {"batch", I{s.batch}},
          {"seqlen_q", I{s.seqlen_q}},
          {"seqlen_k", I{s.seqlen_k}},
          {"heads_q", I{s.heads_q}},
          {"heads_kv", I{s.heads_kv}},
          {"head_dim", I{s.head_dim}},
          {"options", w.options},
          {"seconds", r.seconds},
          {"requests", I{r.requests}},
          {"errors", I{r.errors}},
          {"errors_by_code", ErrorsString(r)},
          {"req_per_s", r.req_per_s},
          {"tokens_per_s", r.tokens_per_s},
          {"tflops", r.tflops},
          {"p50_ms", r.p50_ms},
          {"p90_ms", r.p90_ms},
          {"p95_ms", r.p95_ms},
          {"p99_ms", r.p99_ms},
          {"max_ms", r.max_ms},
          {"mean_ms", r.mean_ms},
          {"queue_ms", r.queue_ms},
          {"host_to_device_ms", r.h2d_ms},
          {"compute_ms", r.compute_ms},
          {"device_to_host_ms", r.d2h_ms},
          {"mean_batch_size", r.mean_batch_size},
          {"requests_by_device", DevicesString(r)},
          {"check", config.check},
          // Last, so the columns before them keep their places in older files.
          {"protocol", std::string(config.protocol.v2 ? "v2" : "native")},
          {"shm", std::string(V2ShmName(config.protocol.shm))}};
}

// A CSV cell. Text is quoted, and a '"' in free text (--label) becomes '\''.
// Numbers are absl::StrCat's (six significant digits).
std::string CsvCell(const Column& c) {
  if (const auto* text = std::get_if<std::string>(&c.value)) {
    std::string cell = *text;
    std::replace(cell.begin(), cell.end(), '"', '\'');
    return absl::StrCat("\"", cell, "\"");
  }
  if (const auto* b = std::get_if<bool>(&c.value)) return *b ? "true" : "false";
  if (const auto* i = std::get_if<int64_t>(&c.value)) return absl::StrCat(*i);
  return absl::StrCat(std::get<double>(c.value));
}

// A JSON value. Doubles carry the CSV's digits, so a step's two records hold
// the same numbers, and a whole one is written as an integer ("883", not
// "883.0"), as in the CSV.
nlohmann::ordered_json JsonValue(const Column& c) {
  if (const auto* text = std::get_if<std::string>(&c.value)) return *text;
  if (const auto* b = std::get_if<bool>(&c.value)) return *b;
  if (const auto* i = std::get_if<int64_t>(&c.value)) return *i;
  double x = 0;
  if (!absl::SimpleAtod(CsvCell(c), &x)) x = std::get<double>(c.value);
  if (std::trunc(x) == x && std::fabs(x) < 9.0e15) return static_cast<int64_t>(x);
  return x;
}

absl::Status CannotWrite(const std::string& path) {
  return absl::UnavailableError(absl::StrCat("cannot write ", path));
}

}  // namespace

std::string Fixed(double x, int digits) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << x;
  return os.str();
}

std::string StepLabel(const StepResult& r) {
  return r.mode == "closed" ? absl::StrCat("concurrency=", r.concurrency)
                            : absl::StrCat("rate=", r.rate);
}

void PrintHeader() {
  std::cout << std::left << std::setw(18) << "step" << std::right << std::setw(10) << "req/s"
            << std::setw(12) << "tokens/s" << std::setw(9) << "TFLOP/s" << std::setw(9) << "p50"
            << std::setw(9) << "p90" << std::setw(9) << "p95" << std::setw(9) << "p99"
            << std::setw(9) << "max" << std::setw(9) << "queue" << std::setw(9) << "h2d"
            << std::setw(9) << "compute" << std::setw(9) << "d2h" << std::setw(7) << "batch"
            << std::setw(8) << "errors"
            << "\n"
            << std::string(48, ' ') << "latency ms (client)" << std::string(17, ' ')
            << "server ms (mean)\n";
}

void PrintRow(const StepResult& r) {
  std::cout << std::left << std::setw(18) << StepLabel(r) << std::right << std::setw(10)
            << Fixed(r.req_per_s, 1) << std::setw(12) << Fixed(r.tokens_per_s, 0) << std::setw(9)
            << Fixed(r.tflops, 4) << std::setw(9) << Fixed(r.p50_ms, 2) << std::setw(9)
            << Fixed(r.p90_ms, 2) << std::setw(9) << Fixed(r.p95_ms, 2) << std::setw(9)
            << Fixed(r.p99_ms, 2) << std::setw(9) << Fixed(r.max_ms, 2) << std::setw(9)
            << Fixed(r.queue_ms, 2) << std::setw(9) << Fixed(r.h2d_ms, 2) << std::setw(9)
            << Fixed(r.compute_ms, 2) << std::setw(9) << Fixed(r.d2h_ms, 2) << std::setw(7)
            << Fixed(r.mean_batch_size, 1) << std::setw(8) << r.errors << "\n";
  if (r.errors > 0) std::cout << "  errors by code: " << ErrorsString(r) << "\n";
  if (r.requests_by_device.size() > 1) {
    std::cout << "  requests by device: " << DevicesString(r) << "\n";
  }
  if (!r.first_error.empty()) {
    std::cout << "  first error: " << r.first_error << "\n";
  }
  std::cout << std::flush;
}

absl::Status AppendCsv(const std::string& path, const StepResult& r, const Workload& w,
                       const LoadConfig& config) {
  bool is_new = true;
  {
    std::ifstream in(path);
    is_new = !in.good() || in.peek() == std::ifstream::traits_type::eof();
  }
  std::ofstream out(path, std::ios::app);
  if (!out) return CannotWrite(path);
  std::vector<std::string> names, cells;
  for (const Column& c : Columns(r, w, config)) {
    names.push_back(c.name);
    cells.push_back(CsvCell(c));
  }
  if (is_new) out << absl::StrJoin(names, ",") << "\n";
  out << absl::StrJoin(cells, ",") << "\n";
  return out ? absl::OkStatus() : CannotWrite(path);
}

absl::Status AppendJson(const std::string& path, const StepResult& r, const Workload& w,
                        const LoadConfig& config) {
  std::ofstream out(path, std::ios::app);
  if (!out) return CannotWrite(path);
  nlohmann::ordered_json object = nlohmann::ordered_json::object();
  for (const Column& c : Columns(r, w, config)) {
    if (c.name == "errors_by_code") continue;  // an object below instead
    object[c.name] = JsonValue(c);
  }
  nlohmann::ordered_json codes = nlohmann::ordered_json::object();
  for (const auto& [code, n] : r.errors_by_code) codes[code] = n;
  object["errors_by_code"] = std::move(codes);
  // Invalid UTF-8 in --label is replaced rather than thrown on.
  out << object.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
  return out ? absl::OkStatus() : CannotWrite(path);
}

}  // namespace cli
}  // namespace attnserve
