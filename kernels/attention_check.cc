#include "kernels/attention_check.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvlens::kernels {
namespace {

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("AttentionArgs.", field, " ", what));
}

}  // namespace

absl::Status NoVisibleKeyError(int row, int64_t position) {
  return absl::InvalidArgumentError(
      absl::StrCat("attention query row ", row, " (position ", position, ") has no visible key"));
}

template <typename T>
absl::Status ValidateAttentionArgs(const AttentionArgs<T>& a) {
  if (a.num_queries <= 0)
    return Bad("num_queries", absl::StrCat("must be positive, got ", a.num_queries));
  if (a.num_keys <= 0) return Bad("num_keys", absl::StrCat("must be positive, got ", a.num_keys));
  if (a.num_heads <= 0)
    return Bad("num_heads", absl::StrCat("must be positive, got ", a.num_heads));
  if (a.num_kv_heads <= 0) {
    return Bad("num_kv_heads", absl::StrCat("must be positive, got ", a.num_kv_heads));
  }
  if (a.num_heads % a.num_kv_heads != 0) {
    return Bad("num_kv_heads",
               absl::StrCat("(", a.num_kv_heads, ") must divide num_heads (", a.num_heads, ")"));
  }
  if (a.head_dim <= 0) return Bad("head_dim", absl::StrCat("must be positive, got ", a.head_dim));
  if (a.query_offset < 0) {
    return Bad("query_offset", absl::StrCat("must be non-negative, got ", a.query_offset));
  }
  // A zero scale is almost always a forgotten field (it would make every row uniform).
  if (!std::isfinite(a.scale) || a.scale == 0.0) {
    return Bad("scale", absl::StrCat("must be finite and non-zero (usually 1/sqrt(head_dim)), got ",
                                     a.scale));
  }
  if (!(a.softcap >= 0.0 && a.softcap < 1e30)) {
    return Bad("softcap",
               absl::StrCat("must be non-negative and finite (0: none), got ", a.softcap));
  }
  const int64_t q_width = static_cast<int64_t>(a.num_heads) * a.head_dim;
  const int64_t kv_width = static_cast<int64_t>(a.num_kv_heads) * a.head_dim;
  if (a.q == nullptr) return Bad("q", "is null");
  if (a.q_stride < q_width) {
    return Bad("q_stride", absl::StrCat("(", a.q_stride, ") is less than num_heads * head_dim (",
                                        q_width, ")"));
  }
  if (a.out == nullptr) return Bad("out", "is null");
  if (a.out_stride < q_width) {
    return Bad("out_stride", absl::StrCat("(", a.out_stride,
                                          ") is less than num_heads * head_dim (", q_width, ")"));
  }
  if (a.kv.k == nullptr) return Bad("kv.k", "is null");
  if (a.kv.v == nullptr) return Bad("kv.v", "is null");
  if (a.kv.dtype != KvDtype::kActivation && a.kv.dtype != KvDtype::kBF16) {
    return Bad("kv.dtype", absl::StrCat("(", static_cast<int>(a.kv.dtype),
                                        ") is not a KV cache type (auto or bf16)"));
  }
  if (a.kv.row_stride < kv_width) {
    return Bad("kv.row_stride",
               absl::StrCat("(", a.kv.row_stride, ") is less than num_kv_heads * head_dim (",
                            kv_width, ")"));
  }
  if (a.kv.block_table != nullptr && a.kv.block_size <= 0) {
    return Bad("kv.block_size",
               absl::StrCat("must be positive with a block table, got ", a.kv.block_size));
  }
  if (a.kv.block_table != nullptr) {
    const int num_blocks = (a.num_keys + a.kv.block_size - 1) / a.kv.block_size;
    for (int b = 0; b < num_blocks; ++b) {
      if (a.kv.block_table[b] < 0) {
        return Bad("kv.block_table",
                   absl::StrCat("entry ", b, " is negative (", a.kv.block_table[b], ")"));
      }
    }
  }
  if (a.window < 0) return Bad("window", absl::StrCat("must be non-negative, got ", a.window));
  if (a.window > 0 && !a.causal) return Bad("window", "needs causal attention");
  if ((a.q_doc_ids == nullptr) != (a.k_doc_ids == nullptr)) {
    return Bad("q_doc_ids", "and k_doc_ids must be both set or both null");
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status CheckEveryRowSeesAKey(const AttentionArgs<T>& a) {
  for (int i = 0; i < a.num_queries; ++i) {
    const int end = CausalKeyEnd(a, i);
    bool seen = false;
    for (int j = 0; j < end && !seen; ++j) seen = KeyVisible(a, i, j);
    if (!seen) return NoVisibleKeyError(i, static_cast<int64_t>(a.query_offset) + i);
  }
  return absl::OkStatus();
}

template absl::Status ValidateAttentionArgs<float>(const AttentionArgs<float>&);
template absl::Status ValidateAttentionArgs<double>(const AttentionArgs<double>&);
template absl::Status CheckEveryRowSeesAKey<float>(const AttentionArgs<float>&);
template absl::Status CheckEveryRowSeesAKey<double>(const AttentionArgs<double>&);

}  // namespace kvlens::kernels
