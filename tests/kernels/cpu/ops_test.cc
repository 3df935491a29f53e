// Every non-attention op on both CPU backends against values worked out by hand or
// straight from the op's formula.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/kernels/cpu/attention_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels {
namespace {

using testing::OwnedWeight;

template <typename B>
class OpsTest : public ::testing::Test {
 protected:
  using T = decltype(testing::ScalarOf(static_cast<B*>(nullptr)));
  static constexpr double kRel = std::is_same_v<T, double> ? 1e-13 : 1e-6;

  std::unique_ptr<B> backend_ = [] {
    if constexpr (std::is_same_v<B, CpuBackend>) {
      return std::make_unique<CpuBackend>(3);
    } else {
      return std::make_unique<B>();
    }
  }();
};

using Backends = ::testing::Types<ReferenceBackend, CpuBackend>;
TYPED_TEST_SUITE(OpsTest, Backends);

// x = [[1,2,3],[−1,½,2]], W = [[1,0,−1],[2,1,0]], bias = [½,−1]
// y = [[1−3+½, 2+2−1], [−1−2+½, −2+½−1]] = [[−1.5, 3], [−2.5, −2.5]]; every value is exact
// in f16 and bf16 too.
TYPED_TEST(OpsTest, MatMulByHandInEveryFloatDtype) {
  using T = typename TestFixture::T;
  const std::vector<T> x = {1, 2, 3, -1, 0.5, 2};
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    const OwnedWeight w({1, 0, -1, 2, 1, 0}, 2, 3, dt);
    const OwnedWeight b({0.5, -1}, 1, 2, dt);
    std::vector<T> y(4);
    this->backend_->MatMul(x.data(), 2, w.view(), b.view(), y.data());
    EXPECT_EQ(y[0], -1.5) << DTypeName(dt);
    EXPECT_EQ(y[1], 3.0) << DTypeName(dt);
    EXPECT_EQ(y[2], -2.5) << DTypeName(dt);
    EXPECT_EQ(y[3], -2.5) << DTypeName(dt);
    this->backend_->MatMul(x.data(), 1, w.view(), WeightView{}, y.data());
    EXPECT_EQ(y[0], -2.0) << DTypeName(dt);
    EXPECT_EQ(y[1], 4.0) << DTypeName(dt);
  }
}

// q8_0 weights written byte by byte: row o has scale 2^−o and quants q(o,i); the expected
// product is summed here in integers (exact in float as well).
TYPED_TEST(OpsTest, MatMulQ8_0ByHand) {
  using T = typename TestFixture::T;
  constexpr int kIn = 64, kOut = 5, kN = 6;
  const uint16_t scale_bits[kOut] = {0x3c00, 0x3800, 0x3400, 0x3000, 0x2c00};  // 1, ½, ¼, ⅛, 1/16
  auto q = [](int o, int i) { return ((i * 37 + o * 11) % 255) - 127; };
  std::vector<uint8_t> bytes(kOut * 2 * kQ8_0BlockBytes);
  for (int o = 0; o < kOut; ++o) {
    for (int blk = 0; blk < 2; ++blk) {
      uint8_t* p = bytes.data() + (o * 2 + blk) * kQ8_0BlockBytes;
      std::memcpy(p, &scale_bits[o], 2);
      for (int i = 0; i < 32; ++i)
        p[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(q(o, blk * 32 + i)));
    }
  }
  const WeightView w{bytes.data(), DType::kQ8_0, kOut, kIn};
  std::vector<T> x(kN * kIn);
  for (int r = 0; r < kN; ++r) {
    for (int i = 0; i < kIn; ++i) x[r * kIn + i] = static_cast<T>((i + 3 * r) % 7 - 3);
  }
  const float bias_v[kOut] = {1, -2, 0.5, 0, 3};
  std::vector<T> y(kN * kOut);
  this->backend_->MatMul(x.data(), kN, w, WeightView{bias_v, DType::kF32, 1, kOut}, y.data());
  for (int r = 0; r < kN; ++r) {
    for (int o = 0; o < kOut; ++o) {
      int64_t dot = 0;
      for (int i = 0; i < kIn; ++i) dot += static_cast<int64_t>((i + 3 * r) % 7 - 3) * q(o, i);
      EXPECT_EQ(y[r * kOut + o], std::ldexp(static_cast<double>(dot), -o) + bias_v[o])
          << r << " " << o;
    }
  }
}

TYPED_TEST(OpsTest, EmbeddingCopiesRows) {
  using T = typename TestFixture::T;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    const OwnedWeight table({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, 4, 3, dt);
    const int32_t ids[3] = {2, 0, 2};
    std::vector<T> out(9);
    this->backend_->Embedding(table.view(), ids, 3, out.data());
    const double want[9] = {7, 8, 9, 1, 2, 3, 7, 8, 9};
    for (int e = 0; e < 9; ++e) EXPECT_EQ(out[e], want[e]) << DTypeName(dt);
  }
}

// x = [3, 4]: mean(x²) = 12.5; y = x / √(12.5 + eps) ⊙ g
TYPED_TEST(OpsTest, RmsNormByHand) {
  using T = typename TestFixture::T;
  const std::vector<T> x = {3, 4, -1, 0};
  const OwnedWeight g({1, 2}, 1, 2, DType::kF32);
  std::vector<T> y(4);
  this->backend_->RmsNorm(x.data(), 2, 2, g.view(), 0.0, y.data());
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.5), this->kRel);
  EXPECT_NEAR(y[1], 8 / std::sqrt(12.5), this->kRel);
  EXPECT_NEAR(y[2], -1 / std::sqrt(0.5), this->kRel);
  EXPECT_EQ(y[3], 0.0);
  this->backend_->RmsNorm(x.data(), 1, 2, g.view(), 0.25, y.data());
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.75), this->kRel);
  EXPECT_NEAR(y[1], 8 / std::sqrt(12.75), this->kRel);
}

// x = [1,2,3,4]: μ = 2.5, v = 1.25 (biased); y = (x − μ)/√v ⊙ g + b
TYPED_TEST(OpsTest, LayerNormByHand) {
  using T = typename TestFixture::T;
  const std::vector<T> x = {1, 2, 3, 4, 1001, 1002, 1003, 1004};
  const OwnedWeight g({1, 1, 2, 2}, 1, 4, DType::kF32);
  const OwnedWeight b({0, 0, 1, -1}, 1, 4, DType::kF32);
  std::vector<T> y(8);
  this->backend_->LayerNorm(x.data(), 2, 4, g.view(), b.view(), 0.0, y.data());
  const double s = std::sqrt(1.25);
  const double want[4] = {-1.5 / s, -0.5 / s, 2 * 0.5 / s + 1, 2 * 1.5 / s - 1};
  for (int r = 0; r < 2; ++r) {  // a large mean must not cancel the variance
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[r * 4 + i], want[i], 4 * this->kRel) << r << i;
  }
  this->backend_->LayerNorm(x.data(), 1, 4, g.view(), WeightView{}, 0.75, y.data());
  EXPECT_NEAR(y[0], -1.5 / std::sqrt(2.0), this->kRel);
  EXPECT_NEAR(y[3], 2 * 1.5 / std::sqrt(2.0), this->kRel);
}

// Dh = 4, theta = 100: pair 0 turns by pos·1, pair 1 by pos·100^(−2/4) = pos·0.1.
// Adjacent pairs rotate (0,1),(2,3); half split rotates (0,2),(1,3).
TYPED_TEST(OpsTest, RopeRotatesTheRightPairsByTheRightAngles) {
  using T = typename TestFixture::T;
  constexpr int kStride = 10;  // 2 heads × 4, then 2 padding values left alone
  const int32_t pos[2] = {1, 3};
  std::vector<T> base(2 * kStride);
  for (int e = 0; e < 2 * kStride; ++e) base[e] = static_cast<T>(0.5 + 0.25 * e);
  // Frequencies 100^(−2p/4): 1 and 0.1; with Llama 3.1's factors, divided by 2 and 4.
  const float factors[2] = {2.0f, 4.0f};
  for (const bool scaled : {false, true})
    for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalfSplit}) {
      std::vector<T> x = base;
      this->backend_->Rope(x.data(), 2, kStride, 2, 4, pos,
                           RopeSpec{100.0, style, scaled ? factors : nullptr});
      for (int r = 0; r < 2; ++r) {
        for (int h = 0; h < 2; ++h) {
          for (int p = 0; p < 2; ++p) {
            const double angle =
                pos[r] * (p == 0 ? 1.0 : 0.1) / (scaled ? (p == 0 ? 2.0 : 4.0) : 1.0);
            const int ia = style == RopeStyle::kAdjacentPairs ? 2 * p : p;
            const int ib = style == RopeStyle::kAdjacentPairs ? 2 * p + 1 : p + 2;
            const double a = base[r * kStride + h * 4 + ia], b = base[r * kStride + h * 4 + ib];
            EXPECT_NEAR(x[r * kStride + h * 4 + ia], std::cos(angle) * a - std::sin(angle) * b,
                        4 * this->kRel);
            EXPECT_NEAR(x[r * kStride + h * 4 + ib], std::sin(angle) * a + std::cos(angle) * b,
                        4 * this->kRel);
          }
        }
        EXPECT_EQ(x[r * kStride + 8], base[r * kStride + 8]);
        EXPECT_EQ(x[r * kStride + 9], base[r * kStride + 9]);
      }
    }
}

// RoPE makes ⟨R(m)q, R(n)k⟩ depend on m − n only.
TYPED_TEST(OpsTest, RopeDotProductDependsOnRelativePosition) {
  using T = typename TestFixture::T;
  std::mt19937_64 rng(3);
  const std::vector<T> q0 = testing::Cast<T>(testing::RandomVector(rng, 64));
  const std::vector<T> k0 = testing::Cast<T>(testing::RandomVector(rng, 64));
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalfSplit}) {
    auto rotated_dot = [&](int m, int n) {
      std::vector<T> q = q0, k = k0;
      this->backend_->Rope(q.data(), 1, 64, 1, 64, &m, RopeSpec{10000.0, style});
      this->backend_->Rope(k.data(), 1, 64, 1, 64, &n, RopeSpec{10000.0, style});
      double dot = 0;
      for (int d = 0; d < 64; ++d) dot += static_cast<double>(q[d]) * k[d];
      return dot;
    };
    const double d0 = rotated_dot(9, 4);
    EXPECT_NEAR(rotated_dot(5, 0), d0, 1e3 * this->kRel);
    EXPECT_NEAR(rotated_dot(1009, 1004), d0, 1e3 * this->kRel);
  }
}

// GELU(x) = x/2·(1 + tanh(√(2/π)(x + 0.044715x³))); GELU(1) = 0.8411919906…
TYPED_TEST(OpsTest, GeluMatchesTheTanhFormula) {
  using T = typename TestFixture::T;
  std::vector<T> x = {-5, -3, -1, -0.5, 0, 0.5, 1, 3, 5};
  const std::vector<T> x0 = x;
  this->backend_->Gelu(x.data(), static_cast<int64_t>(x.size()));
  const double c = std::sqrt(2.0 / std::numbers::pi);
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x0[i];
    EXPECT_NEAR(x[i], 0.5 * v * (1 + std::tanh(c * (v + 0.044715 * v * v * v))),
                this->kRel * (1 + std::abs(v)));
    // The approximation stays within 1e-3 of the exact x·Φ(x).
    EXPECT_NEAR(x[i], 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))), 1e-3);
  }
  EXPECT_NEAR(x[6], 0.8411919906082768, this->kRel);
  EXPECT_EQ(x[4], 0.0);
}

// out = gate·σ(gate)·up
TYPED_TEST(OpsTest, SwiGluByFormula) {
  using T = typename TestFixture::T;
  const std::vector<T> gate = {-2, 0, 1, 3, -30}, up = {1, 2, 3, -1, 4};
  std::vector<T> out(5);
  this->backend_->SwiGlu(gate.data(), up.data(), 5, out.data());
  for (int i = 0; i < 5; ++i) {
    const double g = gate[i];
    EXPECT_NEAR(out[i], g / (1 + std::exp(-g)) * up[i], this->kRel * 4) << i;
  }
  EXPECT_NEAR(out[2], 3 / (1 + std::exp(-1.0)), this->kRel * 4);
}

// out = GELU(gate)·up (tanh approximation, Gemma's gelu_pytorch_tanh), written into the
// gate; and x·factor.
TYPED_TEST(OpsTest, GeGluAndScaleByFormula) {
  using T = typename TestFixture::T;
  const std::vector<T> gate = {-2, 0, 1, 3, -30}, up = {1, 2, 3, -1, 4};
  std::vector<T> out = gate;
  this->backend_->GeGlu(out.data(), up.data(), 5, out.data());
  const double c = std::sqrt(2 / std::numbers::pi);
  for (int i = 0; i < 5; ++i) {
    const double g = gate[i];
    EXPECT_NEAR(out[i], 0.5 * g * (1 + std::tanh(c * (g + 0.044715 * g * g * g))) * up[i],
                this->kRel * 4)
        << i;
  }
  EXPECT_NEAR(out[2], 3 * 0.8411919906082768, this->kRel * 4);  // GELU(1), as above
  EXPECT_EQ(out[1], 0.0);
  std::vector<T> x = {1, -2, 0.5, 0};
  this->backend_->Scale(x.data(), 4, std::sqrt(2048.0));
  EXPECT_NEAR(x[0], 45.254833995939045, this->kRel * 45);
  EXPECT_NEAR(x[1], -90.50966799187809, this->kRel * 90);
  EXPECT_NEAR(x[2], 22.627416997969522, this->kRel * 22);
  EXPECT_EQ(x[3], 0.0);
}

// x ← cap·tanh(x/cap) (Gemma 2's logit soft-capping): tanh(1) = 0.7615941559557649, so
// 30 ↦ 22.847824678672946 at cap 30; ±1000 saturates at ±30; small values pass almost as
// they are (0.3 ↦ 30·tanh(0.01)).
TYPED_TEST(OpsTest, SoftCapByHand) {
  using T = typename TestFixture::T;
  std::vector<T> x = {30, -1000, 1000, 0.3, 0};
  this->backend_->SoftCap(x.data(), 5, 30.0);
  EXPECT_NEAR(x[0], 22.847824678672946, this->kRel * 23);
  EXPECT_NEAR(x[1], -30.0, this->kRel * 30);
  EXPECT_NEAR(x[2], 30.0, this->kRel * 30);
  EXPECT_NEAR(x[3], 0.2999900003999838, this->kRel);
  EXPECT_EQ(x[4], 0.0);
}

// Backend::DrawTokens' greedy pick by hand (temperature 0): the first of tied maxima; NaN
// never picked and adding nothing; −inf adding nothing; a row of −inf or NaN only gives
// token 0 and NaN.
TYPED_TEST(OpsTest, GreedyDrawByHand) {
  using T = typename TestFixture::T;
  const T inf = std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  const std::vector<T> logits = {1,    3,    3,    2,     // tie: the first 3
                                 nan,  -inf, 0.5,  -2,    // NaN and −inf skipped
                                 -inf, -inf, -inf, -inf,  // nothing to pick
                                 nan,  nan,  nan,  nan};
  std::vector<int32_t> token(4, -1);
  std::vector<float> logprob(4, 7.0f);
  const std::vector<kernels::TokenDraw> greedy(4);
  ASSERT_TRUE(this->backend_
                  ->DrawTokens(logits.data(), 4, 4, greedy.data(), token.data(), logprob.data(),
                               nullptr, nullptr)
                  .ok());
  EXPECT_EQ(token, (std::vector<int32_t>{1, 2, 0, 0}));
  EXPECT_NEAR(logprob[0], 3 - std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0)), 1e-6);
  EXPECT_NEAR(logprob[1], -std::log(1 + std::exp(-2.5)), 1e-6);
  EXPECT_TRUE(std::isnan(logprob[2]));
  EXPECT_TRUE(std::isnan(logprob[3]));
}

TYPED_TEST(OpsTest, AddAccumulates) {
  using T = typename TestFixture::T;
  std::vector<T> y = {1, 2, 3}, x = {0.5, -2, 10};
  this->backend_->Add(y.data(), x.data(), 3);
  EXPECT_EQ(y, (std::vector<T>{1.5, 0, 13}));
}

// Four rows of 2 and two source rows: row 0 gets source 1, row 1 nothing (−1), rows 2 and
// 3 source 0; an index past the sources, or below −1, is refused and changes nothing.
TYPED_TEST(OpsTest, AddRowsAddsEachRowsIndexedSource) {
  using T = typename TestFixture::T;
  std::vector<T> y = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<T> rows = {0.5, -1, 10, 20};
  const std::vector<int32_t> index = {1, -1, 0, 0};
  ASSERT_TRUE(this->backend_->AddRows(y.data(), 4, 2, rows.data(), 2, index.data()).ok());
  EXPECT_EQ(y, (std::vector<T>{11, 22, 3, 4, 5.5, 5, 7.5, 7}));

  for (const int32_t bad : {2, -2}) {
    const std::vector<int32_t> out_of_range = {0, bad};
    const absl::Status s =
        this->backend_->AddRows(y.data(), 2, 2, rows.data(), 2, out_of_range.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("index[1] = " + std::to_string(bad)), std::string::npos) << s;
    EXPECT_NE(s.message().find("num_rows = 2"), std::string::npos) << s;
  }
  EXPECT_EQ(y, (std::vector<T>{11, 22, 3, 4, 5.5, 5, 7.5, 7}));
}

// Two source rows of 3 (stride 4) land in cache rows 5 and 1 (stride 5); nothing else moves.
TYPED_TEST(OpsTest, StoreKvWritesOnlyTheNamedRows) {
  using T = typename TestFixture::T;
  const std::vector<T> k = {1, 2, 3, -9, 4, 5, 6, -9}, v = {7, 8, 9, -9, 10, 11, 12, -9};
  std::vector<T> kc(30, -1), vc(30, -1);
  const int64_t rows[2] = {5, 1};
  this->backend_->StoreKv(k.data(), v.data(), 2, 4, 3, rows, kc.data(), vc.data(), 5,
                          KvDtype::kActivation);
  for (int e = 0; e < 30; ++e) {
    const int row = e / 5, col = e % 5;
    double want_k = -1, want_v = -1;
    if (col < 3 && row == 5) want_k = 1 + col, want_v = 7 + col;
    if (col < 3 && row == 1) want_k = 4 + col, want_v = 10 + col;
    EXPECT_EQ(kc[e], want_k) << e;
    EXPECT_EQ(vc[e], want_v) << e;
  }
}

// A negative destination is a padding row (Transformer's padded decode steps): not stored.
TYPED_TEST(OpsTest, StoreKvSkipsPaddingRows) {
  using T = typename TestFixture::T;
  const std::vector<T> k = {1, 2, 3, 4}, v = {5, 6, 7, 8};
  std::vector<T> kc(6, -1), vc(6, -1);
  const int64_t rows[2] = {-1, 2};
  this->backend_->StoreKv(k.data(), v.data(), 2, 2, 2, rows, kc.data(), vc.data(), 2,
                          KvDtype::kActivation);
  EXPECT_EQ(kc, (std::vector<T>{-1, -1, -1, -1, 3, 4}));
  EXPECT_EQ(vc, (std::vector<T>{-1, -1, -1, -1, 7, 8}));
}

// A bf16 cache stores each value rounded to nearest, ties to even (bits by hand: 1 + 2^-8
// is halfway between 1 (0x3F80) and 1 + 2^-7 (0x3F81) and goes to the even 0x3F80;
// 1 + 3·2^-9 rounds up to 0x3F81; 1 + 2^-7 + 2^-8 is halfway and goes to the even 0x3F82
// (1 + 2^-6); −2.5 is exact, 0xC020). Padding rows store nothing.
TYPED_TEST(OpsTest, StoreKvRoundsIntoABf16Cache) {
  using T = typename TestFixture::T;
  const std::vector<T> k = {T(1 + 1.0 / 256), T(1 + 3.0 / 512), 9, 9};
  const std::vector<T> v = {T(1 + 1.0 / 128 + 1.0 / 256), T(-2.5), 9, 9};
  std::vector<uint16_t> kc(6, 0xFFFF), vc(6, 0xFFFF);
  const int64_t rows[2] = {1, -1};
  this->backend_->StoreKv(k.data(), v.data(), 2, 2, 2, rows, kc.data(), vc.data(), 3,
                          KvDtype::kBF16);
  EXPECT_EQ(kc, (std::vector<uint16_t>{0xFFFF, 0xFFFF, 0xFFFF, 0x3F80, 0x3F81, 0xFFFF}));
  EXPECT_EQ(vc, (std::vector<uint16_t>{0xFFFF, 0xFFFF, 0xFFFF, 0x3F82, 0xC020, 0xFFFF}));
}

}  // namespace
}  // namespace kvlens::kernels
