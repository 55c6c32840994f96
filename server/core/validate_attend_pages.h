// The checks of a K/V step's attend_pages (kv.proto, docs/kv-cache.md) that
// need no sequence state: order, count, the options they cannot be combined
// with and, when the call states expected_length, the range. The cache checks
// the range again against the sequence's length when it reserves the call.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "server/core/call.h"
#include "server/core/field_names.h"

namespace attnserve {

// INVALID_ARGUMENT naming the step's attend_pages (and the sequence) when a
// step's list is out of order, negative, longer than the cache's
// `capacity_pages`, past the pages `expected_length` fills (with
// check_lengths), or comes with options whose positions would be wrong on the
// compacted keys: a sliding window, or causal with more queries than new
// tokens plus one.
absl::Status ValidateAttendPages(const KvCall& call, int32_t page_size, int64_t capacity_pages,
                                 const FieldNames& names);

}  // namespace attnserve
