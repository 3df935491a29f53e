// A read-only view of one weight matrix or vector, in its stored type. Weights usually
// live in a memory-mapped file; the view never owns them.
#ifndef KVLENS_KERNELS_WEIGHT_H_
#define KVLENS_KERNELS_WEIGHT_H_

#include <cstdint>
#include <string>

#include "kernels/dtype.h"

namespace kvlens::kernels {

// A matrix `[rows, cols]` stored row-major, each row `cols` elements of `dtype` packed
// contiguously (a row of a block type is cols / DTypeBlockSize whole blocks). Linear layers use the
// convention
// `[out_features, in_features]` (llama2.c, GGUF and PyTorch's nn.Linear): y = x · Wᵀ.
// A vector is a matrix with rows == 1.
struct WeightView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;

  bool empty() const { return data == nullptr; }
  int64_t row_bytes() const { return DTypeRowBytes(dtype, cols); }
  const uint8_t* row(int64_t r) const {
    return static_cast<const uint8_t*>(data) + r * row_bytes();
  }
  // Rows [first, first + count) as a view of their own (rows are contiguous).
  WeightView Rows(int64_t first, int64_t count) const {
    return WeightView{row(first), dtype, count, cols};
  }
};

// Decodes row `r` of `w` into `out[0 … w.cols)`. T is float or double.
template <typename T>
void DequantizeRow(const WeightView& w, int64_t r, T* out);

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_WEIGHT_H_
