// Argument checks and the visibility rule shared by every Attention implementation, so
// that all backends reject the same calls with the same messages.
#ifndef KVLENS_KERNELS_ATTENTION_CHECK_H_
#define KVLENS_KERNELS_ATTENTION_CHECK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace kvlens::kernels {

// Key j is visible to query row i (absolute position query_offset + i) when
//   (!causal || j <= query_offset + i) && (no doc ids || q_doc_ids[i] == k_doc_ids[j])
//   && (window == 0 || query_offset + i − j < window).
template <typename T>
inline bool KeyVisible(const AttentionArgs<T>& a, int i, int j) {
  if (a.causal && static_cast<int64_t>(j) > static_cast<int64_t>(a.query_offset) + i) {
    return false;
  }
  if (a.window > 0 && static_cast<int64_t>(a.query_offset) + i - j >= a.window) return false;
  return a.q_doc_ids == nullptr || a.q_doc_ids[i] == a.k_doc_ids[j];
}

// Keys j >= this bound are masked by causality for row i (the bound is at most num_keys).
template <typename T>
inline int CausalKeyEnd(const AttentionArgs<T>& a, int i) {
  if (!a.causal) return a.num_keys;
  const int64_t end = static_cast<int64_t>(a.query_offset) + i + 1;
  return end < a.num_keys ? static_cast<int>(end) : a.num_keys;
}

// Keys j < this bound are outside row i's sliding window (0 without one).
template <typename T>
inline int WindowKeyBegin(const AttentionArgs<T>& a, int i) {
  if (a.window <= 0) return 0;
  const int64_t begin = static_cast<int64_t>(a.query_offset) + i - a.window + 1;
  return begin > 0 ? static_cast<int>(begin) : 0;
}

// Shapes, strides, pointers and the block table: INVALID_ARGUMENT naming the field.
template <typename T>
absl::Status ValidateAttentionArgs(const AttentionArgs<T>& a);

// INVALID_ARGUMENT naming the first query row that sees no key, else OK.
template <typename T>
absl::Status CheckEveryRowSeesAKey(const AttentionArgs<T>& a);

// "attention query row 3 (position 7) has no visible key"
absl::Status NoVisibleKeyError(int row, int64_t position);

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_ATTENTION_CHECK_H_
