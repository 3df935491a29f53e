#include "kernels/weight.h"

#include <cstring>

#include "kernels/ggml_quants.h"

namespace kvlens::kernels {

template <typename T>
void DequantizeRow(const WeightView& w, int64_t r, T* out) {
  const uint8_t* src = w.row(r);
  const int64_t n = w.cols;
  switch (w.dtype) {
    case DType::kF32: {
      for (int64_t i = 0; i < n; ++i) {
        float f;
        std::memcpy(&f, src + 4 * i, 4);
        out[i] = static_cast<T>(f);
      }
      return;
    }
    case DType::kF16: {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = static_cast<T>(F16ToF32(h));
      }
      return;
    }
    case DType::kBF16: {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        out[i] = static_cast<T>(BF16ToF32(b));
      }
      return;
    }
    default:  // ggml's block types
      DecodeBlocks(w.dtype, src, n / DTypeBlockSize(w.dtype), out);
      return;
  }
}

template void DequantizeRow<float>(const WeightView&, int64_t, float*);
template void DequantizeRow<double>(const WeightView&, int64_t, double*);

}  // namespace kvlens::kernels
