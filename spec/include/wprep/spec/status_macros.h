// Early returns for absl::Status and absl::StatusOr<T>, so that a function reads as its
// happy path (Abseil's internal ASSIGN_OR_RETURN, as TensorFlow and Arrow spell it).
#ifndef WPREP_SPEC_STATUS_MACROS_H_
#define WPREP_SPEC_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns the status of `expr` (an absl::Status) from the enclosing function unless OK.
#define WPREP_RETURN_IF_ERROR(expr)                          \
  do {                                                       \
    ::absl::Status wprep_status_ = (expr);                   \
    if (!wprep_status_.ok()) return wprep_status_;           \
  } while (0)

#define WPREP_STATUS_MACROS_CONCAT_INNER_(x, y) x##y
#define WPREP_STATUS_MACROS_CONCAT_(x, y) WPREP_STATUS_MACROS_CONCAT_INNER_(x, y)

// Evaluates `rexpr` (an absl::StatusOr<T>); returns its status unless OK, else moves its
// value into `lhs`, which may declare a variable: WPREP_ASSIGN_OR_RETURN(Plan p, MakePlan(...)).
#define WPREP_ASSIGN_OR_RETURN(lhs, rexpr) \
  WPREP_ASSIGN_OR_RETURN_IMPL_(WPREP_STATUS_MACROS_CONCAT_(wprep_statusor_, __LINE__), lhs, rexpr)

// `lhs` may be a declaration and `statusor` is a name: neither can take parentheses.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define WPREP_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = *std::move(statusor)
// NOLINTEND(bugprone-macro-parentheses)

#endif  // WPREP_SPEC_STATUS_MACROS_H_
