// Helpers shared by the kernel tests: weights in every stored dtype, random data, and
// typed copies between the double oracle and the fp32 path.
#ifndef KVLENS_TESTS_KERNELS_KERNEL_TEST_UTIL_H_
#define KVLENS_TESTS_KERNELS_KERNEL_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/ggml_quants.h"
#include "kernels/weight.h"

namespace kvlens::kernels::testing {

// Scales (d, and dmin or m) that make a random block of ggml's type t span about ±amax.
inline std::pair<double, double> RandomBlockScales(DType t, double amax) {
  switch (t) {
    case DType::kQ4_0:
      return {amax / 8, 0};
    case DType::kQ4_1:
      return {amax / 8, -amax};  // x = q · d + m, q in [0, 15]
    case DType::kQ5_0:
      return {amax / 16, 0};
    case DType::kQ5_1:
      return {amax / 16, -amax};
    case DType::kQ2_K:
      return {amax / 45, amax / 15};  // x = d·sc·q − dmin·m, sc, m ≤ 15, q ≤ 3
    case DType::kQ3_K:
      return {amax / 128, 0};  // x = d·(sc − 32)·q, q in [−4, 3]
    case DType::kQ4_K:
      return {amax / 945, amax / 63};  // sc, m ≤ 63, q ≤ 15
    case DType::kQ5_K:
      return {amax / 1953, amax / 63};
    case DType::kQ6_K:
      return {amax / 4096, 0};  // int8 scales, q in [−32, 31]
    case DType::kIQ4_NL:
      return {amax / 127, 0};  // table values in [−127, 113]
    case DType::kIQ4_XS:
      return {amax / 4064, 0};  // sc in [−32, 31]
    default:
      return {amax / 127, 0};
  }
}

// Random blocks of ggml's type t (`blocks` of them from rng), scaled as RandomBlockScales.
inline void FillRandomBlocks(DType t, double amax, int64_t blocks, std::mt19937_64& rng,
                             uint8_t* out) {
  const auto [d, dmin] = RandomBlockScales(t, amax);
  const DTypeBlock shape = DTypeBlockOf(t);
  const BlockHalves at = BlockHalvesOf(t);
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* block = out + b * shape.bytes;
    for (int i = 0; i < shape.bytes; ++i) block[i] = static_cast<uint8_t>(rng());
    const uint16_t dh = F32ToF16(static_cast<float>(d)), mh = F32ToF16(static_cast<float>(dmin));
    std::memcpy(block + at.d_at, &dh, 2);
    if (at.min_at >= 0) std::memcpy(block + at.min_at, &mh, 2);
  }
}

// Helpers' dtype lists: every stored dtype, and the widths they allow.
inline constexpr DType kAllDTypes[] = {DType::kF32,  DType::kF16,    DType::kBF16,  DType::kQ8_0,
                                       DType::kQ4_0, DType::kQ4_1,   DType::kQ5_0,  DType::kQ5_1,
                                       DType::kQ2_K, DType::kQ3_K,   DType::kQ4_K,  DType::kQ5_K,
                                       DType::kQ6_K, DType::kIQ4_NL, DType::kIQ4_XS};
// `cols` rounded down to whole blocks of t (at least one block).
inline int64_t BlockCols(DType t, int64_t cols) {
  const int64_t b = DTypeBlockSize(t);
  return std::max(b, cols / b * b);
}

// A weight matrix that owns its bytes. values() are the numbers the stored bytes mean
// (after f16/bf16 rounding or q8_0 quantisation), computed here without DequantizeRow.
// ggml's other block types hold random blocks instead, with scales that make each row span
// about its values' ±max (a product needs valid blocks, not these values); their values()
// come from DequantizeRow<double>, which ggml_quants_test checks against ggml itself.
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
        default: {
          double amax = 1e-3;
          for (int64_t i = 0; i < cols; ++i) amax = std::max(amax, std::abs(src[i]));
          std::mt19937_64 rng(static_cast<uint64_t>(r) * 7919 + static_cast<uint64_t>(cols));
          FillRandomBlocks(dtype, amax, cols / DTypeBlockSize(dtype), rng, row);
          DequantizeRow(WeightView{row, dtype, 1, cols}, 0, meant);
          break;
        }
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
