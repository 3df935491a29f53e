#include "kernels/weight.h"

#include <cstring>

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
    case DType::kQ8_0: {
      // Block b: f16 scale d, then 32 int8 quants q; element = d · q.
      for (int64_t b = 0; b < n / kQ8_0BlockSize; ++b) {
        const uint8_t* block = src + b * kQ8_0BlockBytes;
        uint16_t d_bits;
        std::memcpy(&d_bits, block, 2);
        const T d = static_cast<T>(F16ToF32(d_bits));
        const auto* q = reinterpret_cast<const int8_t*>(block + 2);
        for (int i = 0; i < kQ8_0BlockSize; ++i) {
          out[b * kQ8_0BlockSize + i] = d * static_cast<T>(q[i]);
        }
      }
      return;
    }
  }
}

template void DequantizeRow<float>(const WeightView&, int64_t, float*);
template void DequantizeRow<double>(const WeightView&, int64_t, double*);

}  // namespace kvlens::kernels
