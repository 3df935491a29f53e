// KVLENS_ASSIGN_OR_RETURN(lhs, expr): evaluates an absl::StatusOr expression; on error
// returns its status from the enclosing function, else assigns the value to lhs.
#ifndef KVLENS_ENGINE_STATUS_MACROS_H_
#define KVLENS_ENGINE_STATUS_MACROS_H_

#include <utility>

#define KVLENS_ASSIGN_OR_RETURN(lhs, expr)          \
  do {                                              \
    auto _kvlens_r = (expr);                        \
    if (!_kvlens_r.ok()) return _kvlens_r.status(); \
    lhs = *std::move(_kvlens_r);                    \
  } while (0)

#endif  // KVLENS_ENGINE_STATUS_MACROS_H_
