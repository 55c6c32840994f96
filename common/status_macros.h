// RETURN_IF_ERROR / ASSIGN_OR_RETURN: Abseil 20220623 (Debian 12) has neither.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTN_CONCAT_INNER_(a, b) a##b
#define ATTN_CONCAT_(a, b) ATTN_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function if it is not OK.
#define RETURN_IF_ERROR(expr)                    \
  do {                                           \
    ::absl::Status attn_status_ = (expr);        \
    if (!attn_status_.ok()) return attn_status_; \
  } while (false)

// `lhs = value of expr`, or returns its status from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(ATTN_CONCAT_(attn_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                           \
  if (!statusor.ok()) return statusor.status();     \
  lhs = std::move(statusor).value()
