// A K/V step's attend_pages before any state is touched; see
// validate_attend_pages.h.
#include "server/core/validate_attend_pages.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

absl::Status CheckStep(const KvCall& call, int index, int32_t page_size, int64_t capacity_pages,
                       const FieldNames& n) {
  const KvStepRequest& s = call.steps[size_t(index)];
  const absl::Span<const int32_t> pages = s.attend_pages;
  const std::string field = n.step(index, "attend_pages");
  const std::string seq = absl::StrCat(" (sequence ", s.sequence_id, ")");
  // Windows are bands of positions; on the compacted keys they would count
  // the pages left out.
  const char* window = call.options.window_left.has_value()    ? "window_left"
                       : call.options.window_right.has_value() ? "window_right"
                                                               : nullptr;
  if (window != nullptr) {
    return Invalid(absl::StrCat(field, seq, ": expected none with ", n.option(window),
                                " set (a window counts positions, and attend_pages leaves pages "
                                "out), got ",
                                pages.size(), " pages"));
  }
  // The kept keys keep their order and the new ones are last, so bottom-right
  // causal over them removes the last num_queries - 1 keys, all new ones (and
  // thus the same keys as over the whole sequence) iff num_queries <= num_new_tokens + 1.
  if (call.options.causal && int64_t{s.num_queries} > int64_t{s.num_new_tokens} + 1) {
    return Invalid(absl::StrCat(
        field, seq, ": with ", n.option("causal"), " expected ", n.step(index, "num_queries"),
        " <= ", n.step(index, "num_new_tokens"), " + 1 = ", int64_t{s.num_new_tokens} + 1,
        " (queries past the new tokens "
        "would see pages left out), got ",
        s.num_queries));
  }
  if (static_cast<int64_t>(pages.size()) > capacity_pages) {
    return Invalid(absl::StrCat(field, seq, ": expected at most ", capacity_pages,
                                " pages (the cache's capacity), got ", pages.size()));
  }
  for (size_t j = 0; j < pages.size(); ++j) {
    if (pages[j] < 0 || (j > 0 && pages[j] <= pages[j - 1])) {
      return Invalid(absl::StrCat(
          field, seq, ": expected strictly increasing page indices >= 0, got ", field, "[", j,
          "] = ", pages[j], j > 0 ? absl::StrCat(" after ", pages[j - 1]) : std::string()));
    }
  }
  if (!call.check_lengths) return absl::OkStatus();
  if (s.expected_length == 0) {
    return Invalid(absl::StrCat(field, seq, ": expected none for an empty history (",
                                n.step(index, "expected_length"), " is 0), got ", pages.size(),
                                " pages"));
  }
  const int64_t history_pages = (int64_t{s.expected_length} + page_size - 1) / page_size;
  if (pages.back() >= history_pages) {
    return Invalid(absl::StrCat(field, seq, ": expected page indices below ", history_pages,
                                " (the pages of ", s.expected_length, " tokens in pages of ",
                                page_size, "), got ", field, "[", pages.size() - 1,
                                "] = ", pages.back()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateAttendPages(const KvCall& call, int32_t page_size, int64_t capacity_pages,
                                 const FieldNames& names) {
  for (size_t i = 0; i < call.steps.size(); ++i) {
    if (call.steps[i].attend_pages.empty()) continue;
    absl::Status status = CheckStep(call, static_cast<int>(i), page_size, capacity_pages, names);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

}  // namespace attnserve
