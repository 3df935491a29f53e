// Helpers shared by the kernel tests: weights in every stored dtype, random data, and
// typed copies between the double oracle and the fp32 path.
#ifndef KVLENS_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define KVLENS_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/weight.h"

namespace kvlens::kernels::testing {

// A weight matrix that owns its bytes. values() are the numbers the stored bytes mean
// (after f16/bf16 rounding or q8_0 quantisation), computed here without DequantizeRow.
class OwnedWeight {
 public:
  OwnedWeight() = default;
  OwnedWeight(const std::vector<double>& v, int64_t rows, int64_t cols, DType dtype)
      : dtype_(dtype), rows_(rows), cols_(cols) {
    bytes_.resize(static_cast<size_t>(DTypeRowBytes(dtype, cols) * rows));
    values_.resize(v.size());
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* row = bytes_.data() + r * DTypeRowBytes(dtype, cols);
      const double* src = v.data() + r * cols;
      double* meant = values_.data() + r * cols;
      switch (dtype) {
        case DType::kF32:
          for (int64_t i = 0; i < cols; ++i) {
            const float f = static_cast<float>(src[i]);
            std::memcpy(row + 4 * i, &f, 4);
            meant[i] = f;
          }
          break;
        case DType::kF16:
          for (int64_t i = 0; i < cols; ++i) {
            const uint16_t h = F32ToF16(static_cast<float>(src[i]));
            std::memcpy(row + 2 * i, &h, 2);
            meant[i] = F16ToF32(h);
          }
          break;
        case DType::kBF16:
          for (int64_t i = 0; i < cols; ++i) {
            const uint16_t b = F32ToBF16(static_cast<float>(src[i]));
            std::memcpy(row + 2 * i, &b, 2);
            meant[i] = BF16ToF32(b);
          }
          break;
        case DType::kQ8_0:
          for (int64_t b = 0; b < cols / kQ8_0BlockSize; ++b) {
            double amax = 0.0;
            for (int i = 0; i < kQ8_0BlockSize; ++i) {
              amax = std::max(amax, std::abs(src[b * kQ8_0BlockSize + i]));
            }
            const uint16_t d_bits = F32ToF16(static_cast<float>(amax / 127.0));
            const double d = F16ToF32(d_bits);
            uint8_t* block = row + b * kQ8_0BlockBytes;
            std::memcpy(block, &d_bits, 2);
            for (int i = 0; i < kQ8_0BlockSize; ++i) {
              const double x = src[b * kQ8_0BlockSize + i];
              const int q =
                  d == 0.0 ? 0 : std::clamp(static_cast<int>(std::lround(x / d)), -127, 127);
              const int8_t q8 = static_cast<int8_t>(q);
              std::memcpy(block + 2 + i, &q8, 1);
              meant[b * kQ8_0BlockSize + i] = d * q;
            }
          }
          break;
      }
    }
  }

  WeightView view() const { return WeightView{bytes_.data(), dtype_, rows_, cols_}; }
  const std::vector<double>& values() const { return values_; }

 private:
  std::vector<uint8_t> bytes_;
  std::vector<double> values_;
  DType dtype_ = DType::kF32;
  int64_t rows_ = 0, cols_ = 0;
};

inline std::vector<double> RandomVector(std::mt19937_64& rng, size_t n, double lo = -1.0,
                                        double hi = 1.0) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = u(rng);
  return v;
}

// Values a float can hold exactly, so both backends see identical inputs.
inline std::vector<double> RandomFloatExact(std::mt19937_64& rng, size_t n, double lo = -1.0,
                                            double hi = 1.0) {
  std::vector<double> v = RandomVector(rng, n, lo, hi);
  for (double& x : v) x = static_cast<float>(x);
  return v;
}

template <typename T>
std::vector<T> Cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <typename T>
std::vector<double> ToDouble(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

inline double MaxAbs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

}  // namespace kvlens::kernels::testing

#endif  // KVLENS_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
