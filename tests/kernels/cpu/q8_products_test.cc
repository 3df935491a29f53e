// CpuBackend's int8-activation mode (kernels/cpu/q8_products.h, q8k_products.h) for every
// block type. The reference rounds the activations by the mode's rules, written here from
// their definitions (ggml's quantize_row_q8_0 for the 32-element types, llama.cpp's q8_K
// granularity for the 256-element ones), and multiplies them in double with the weights'
// exact values (DequantizeRow<double>, which ggml_quants_test checks against ggml).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/dtype.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels {
namespace {

using testing::OwnedWeight;

constexpr DType kBlockTypes[] = {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1,   DType::kQ5_0,
                                 DType::kQ5_1, DType::kQ2_K, DType::kQ3_K,   DType::kQ4_K,
                                 DType::kQ5_K, DType::kQ6_K, DType::kIQ4_NL, DType::kIQ4_XS};

// x rounded as the mode rounds it for weights of type t, written here from the definitions.
// For the 32-element types ggml's quantize_row_q8_0: per block of 32, d = max|x| / 127 in
// float, q = roundf(x · (1/d)) (halves away from zero). For the 256-element types (k-quants,
// iq4_xs; q8k_products.h) llama.cpp's q8_K granularity: per 256, d = max|x| / 127,
// q = x · (1/d) rounded half to even. The values d · q, and each element's d.
struct Rounded {
  std::vector<double> value, scale;
};
Rounded RoundQ8(const std::vector<float>& x, DType t) {
  const size_t block = DTypeBlockSize(t) == 256 ? 256 : 32;
  Rounded r{std::vector<double>(x.size()), std::vector<double>(x.size())};
  for (size_t b = 0; b < x.size(); b += block) {
    float amax = 0.0f;
    for (size_t i = b; i < b + block; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float id = d == 0.0f ? 0.0f : 1.0f / d;
    for (size_t i = b; i < b + block; ++i) {
      const float v = x[i] * id;
      // std::round: away from zero; std::nearbyint: the default mode, to even.
      r.value[i] = static_cast<double>(d) * (block == 32 ? std::round(v) : std::nearbyint(v));
      r.scale[i] = d;
    }
  }
  return r;
}

// Per 32-element type, widths of one block, of a partial unit (9 blocks), of two whole
// units of 256, and of two units and 3 blocks; the k-quants, one and three super-blocks.
std::vector<int> WidthsOf(DType t) {
  if (DTypeBlockSize(t) == 256) return {256, 768};
  return {32, 288, 512, 608};
}

TEST(Q8ProductsTest, MatchTheRoundedActivationsTimesTheExactWeights) {
  std::mt19937_64 rng(31);
  for (int threads : {1, 3}) {
    CpuBackend cpu(threads);
    cpu.SetInt8Activations(true);
    for (DType dt : kBlockTypes) {
      for (int in : WidthsOf(dt)) {
        const int out = 37;
        const OwnedWeight w(testing::RandomVector(rng, static_cast<size_t>(in) * out), out, in, dt);
        const OwnedWeight bias(testing::RandomVector(rng, out), 1, out, DType::kF32);
        // From 16 rows on the 256-element types take q8k_products.h's tile.
        for (int n : {1, 3, 4, 6, 16, 37}) {
          // Rows of different magnitudes, so blocks get different scales.
          std::vector<float> x(static_cast<size_t>(n) * in);
          std::uniform_real_distribution<float> u(-1.0f, 1.0f);
          for (size_t i = 0; i < x.size(); ++i) x[i] = u(rng) * (i / 32 % 3 == 0 ? 50.0f : 1.0f);
          const Rounded xr = RoundQ8(x, dt);
          std::vector<float> y(static_cast<size_t>(n) * out, std::nanf(""));
          cpu.MatMul(x.data(), n, w.view(), bias.view(), y.data());
          const std::vector<double>& wv = w.values();
          for (int r = 0; r < n; ++r) {
            for (int o = 0; o < out; ++o) {
              double want = bias.values()[o], mag = std::abs(want);
              for (int i = 0; i < in; ++i) {
                want += wv[o * in + i] * xr.value[r * in + i];
                mag += std::abs(wv[o * in + i] * xr.value[r * in + i]);
              }
              ASSERT_NEAR(y[r * out + o], want, 2e-6 * mag + 1e-30)
                  << DTypeName(dt) << " in=" << in << " n=" << n << " r=" << r << " o=" << o
                  << " threads=" << threads;
            }
          }
        }
      }
    }
  }
}

// Against the exact product: each activation moves by at most half its block's d, so
// |y − y_exact| ≤ Σ_i |w_i| · d_i / 2 (plus float rounding).
TEST(Q8ProductsTest, StayWithinHalfAStepOfTheExactProduct) {
  std::mt19937_64 rng(32);
  CpuBackend cpu(2);
  cpu.SetInt8Activations(true);
  ReferenceBackend ref;
  for (DType dt : kBlockTypes) {
    const int in = DTypeBlockSize(dt) == 256 ? 512 : 288, out = 19, n = 3;
    const OwnedWeight w(testing::RandomVector(rng, static_cast<size_t>(in) * out), out, in, dt);
    const std::vector<double> x = testing::RandomFloatExact(rng, static_cast<size_t>(n) * in);
    const std::vector<float> xf = testing::Cast<float>(x);
    const Rounded xr = RoundQ8(xf, dt);
    std::vector<double> exact(static_cast<size_t>(n) * out);
    ref.MatMul(x.data(), n, w.view(), WeightView{}, exact.data());
    std::vector<float> y(exact.size(), std::nanf(""));
    cpu.MatMul(xf.data(), n, w.view(), WeightView{}, y.data());
    double worst = 0.0;  // how much of the bound the largest error uses
    for (int r = 0; r < n; ++r) {
      for (int o = 0; o < out; ++o) {
        double bound = 0.0, mag = 0.0;
        for (int i = 0; i < in; ++i) {
          const double wi = std::abs(w.values()[o * in + i]);
          bound += wi * xr.scale[r * in + i] / 2;
          mag += wi * std::abs(x[r * in + i]);
        }
        const double err = std::abs(y[r * out + o] - exact[r * out + o]);
        ASSERT_LE(err, bound + 2e-6 * mag) << DTypeName(dt) << " r=" << r << " o=" << o;
        worst = std::max(worst, err / bound);
      }
    }
    // Not exact either: the mode is on (random activations never land on the grid).
    EXPECT_GT(worst, 1e-3) << DTypeName(dt);
  }
}

// By hand: a q8_0 weight row of d = 1 with q = 1 at element 0 reads x_0. With max|x| = 127
// the activations' d is 1, so x_0 = ±2.5 rounds away from zero to ±3 (round-half-even would
// give ±2); the exact product is ±2.5.
TEST(Q8ProductsTest, RoundsHalvesAwayFromZeroAsGgml) {
  std::vector<uint8_t> row(kQ8_0BlockBytes, 0);
  const uint16_t one = F32ToF16(1.0f);
  std::memcpy(row.data(), &one, 2);
  row[2] = 1;
  const WeightView w{row.data(), DType::kQ8_0, 1, 32};
  CpuBackend cpu(1);
  for (const float x0 : {2.5f, -2.5f}) {
    std::vector<float> x(32, 0.0f);
    x[0] = x0;
    x[1] = 127.0f;
    float y = 0.0f;
    cpu.SetInt8Activations(false);
    cpu.MatMul(x.data(), 1, w, WeightView{}, &y);
    EXPECT_EQ(y, x0);
    cpu.SetInt8Activations(true);
    cpu.MatMul(x.data(), 1, w, WeightView{}, &y);
    EXPECT_EQ(y, x0 > 0 ? 3.0f : -3.0f);
  }
}

// Batching never changes results, in this mode too; and a NaN stays in its own row.
TEST(Q8ProductsTest, GiveARowTheSameBitsInAnyBatchAndKeepNaNsInTheirRow) {
  std::mt19937_64 rng(33);
  for (int threads : {1, 3}) {
    CpuBackend cpu(threads);
    cpu.SetInt8Activations(true);
    // 40 rows: the 256-element types' tile (three groups of 16 rows, the last part-filled)
    // against the rows alone along k.
    for (DType dt : kBlockTypes)
      for (int n : {9, 40}) {
        const int in = DTypeBlockSize(dt) == 256 ? 768 : 608, out = 50;
        const OwnedWeight w(testing::RandomVector(rng, static_cast<size_t>(in) * out), out, in, dt);
        std::vector<float> x =
            testing::Cast<float>(testing::RandomFloatExact(rng, static_cast<size_t>(n) * in));
        x[static_cast<size_t>(4) * in + 300] = std::nanf("");
        std::vector<float> batch(static_cast<size_t>(n) * out, 0.0f);
        cpu.MatMul(x.data(), n, w.view(), WeightView{}, batch.data());
        for (int r = 0; r < n; ++r) {
          std::vector<float> alone(out, 0.0f);
          cpu.MatMul(x.data() + static_cast<size_t>(r) * in, 1, w.view(), WeightView{},
                     alone.data());
          for (int o = 0; o < out; ++o) {
            if (r == 4) {
              ASSERT_TRUE(std::isnan(batch[r * out + o])) << DTypeName(dt) << " o=" << o;
              continue;
            }
            ASSERT_EQ(std::bit_cast<uint32_t>(batch[r * out + o]),
                      std::bit_cast<uint32_t>(alone[o]))
                << DTypeName(dt) << " n=" << n << " r=" << r << " o=" << o
                << " threads=" << threads;
          }
        }
      }
  }
}

// By hand: a q6_K weight row of d = 1 with every scale 1, q = 33 (weight 1) at element 0
// and q = 32 (weight 0) elsewhere reads x_0. With max|x| = 127 the activations' d is 1, so
// x_0 = ±2.5 rounds half to even to ±2, as llama.cpp's q8_K does (q8_0's rule would give
// ±3); ±3.5 to ±4.
TEST(Q8ProductsTest, RoundsTheKQuantsActivationsHalfToEvenAsLlamaCppQ8K) {
  std::vector<uint8_t> row(210, 0);
  std::fill(row.begin() + 128, row.begin() + 192, 0xAA);  // qh: high bits 2, so q = 32
  std::fill(row.begin() + 192, row.begin() + 208, 1);     // scales
  row[0] = 1;                                             // element 0: q = 33
  const uint16_t one = F32ToF16(1.0f);
  std::memcpy(row.data() + 208, &one, 2);
  const WeightView w{row.data(), DType::kQ6_K, 1, 256};
  CpuBackend cpu(1);
  for (const float x0 : {2.5f, -2.5f, 3.5f}) {
    std::vector<float> x(256, 0.0f);
    x[0] = x0;
    x[1] = 127.0f;
    float y = 0.0f;
    cpu.SetInt8Activations(false);
    cpu.MatMul(x.data(), 1, w, WeightView{}, &y);
    EXPECT_EQ(y, x0);
    cpu.SetInt8Activations(true);
    cpu.MatMul(x.data(), 1, w, WeightView{}, &y);
    EXPECT_EQ(y, x0 == 3.5f ? 4.0f : x0 > 0 ? 2.0f : -2.0f);
  }
}

// Float weights ignore the mode: the same bits as with it off.
TEST(Q8ProductsTest, LeaveFloatWeightsExact) {
  std::mt19937_64 rng(34);
  CpuBackend cpu(2);
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    const int in = 96, out = 21, n = 5;
    const OwnedWeight w(testing::RandomVector(rng, static_cast<size_t>(in) * out), out, in, dt);
    const std::vector<float> x =
        testing::Cast<float>(testing::RandomFloatExact(rng, static_cast<size_t>(n) * in));
    std::vector<float> off(static_cast<size_t>(n) * out), on(off.size());
    cpu.SetInt8Activations(false);
    cpu.MatMul(x.data(), n, w.view(), WeightView{}, off.data());
    cpu.SetInt8Activations(true);
    cpu.MatMul(x.data(), n, w.view(), WeightView{}, on.data());
    for (size_t i = 0; i < off.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(off[i]), std::bit_cast<uint32_t>(on[i])) << DTypeName(dt);
    }
  }
}

}  // namespace
}  // namespace kvlens::kernels
