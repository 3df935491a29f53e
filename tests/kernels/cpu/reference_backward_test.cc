// kernels/cpu/reference_backward.h's MatMulBackwardInput against its definition written
// plainly: dx[r, i] += Σ_o dy[r, o] · W[o, i], summed in double over o in order and
// skipping zero gradients (the same sums, so bitwise), for f32, bf16 and q8_0 weights on
// shapes that leave partial column panels and row groups, into a dx that already holds
// values, in float and in double.
#include "kernels/cpu/reference_backward.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels {
namespace {

template <typename T>
std::vector<T> Definition(const std::vector<T>& dy, int n, const WeightView& w, std::vector<T> dx) {
  const int64_t in = w.cols, out = w.rows;
  std::vector<double> wd(static_cast<size_t>(out * in));
  for (int64_t o = 0; o < out; ++o) DequantizeRow(w, o, wd.data() + o * in);
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < in; ++i) {
      double acc = 0.0;
      for (int64_t o = 0; o < out; ++o) {
        const double g = dy[r * out + o];
        if (g == 0.0) continue;
        acc += g * wd[o * in + i];
      }
      dx[r * in + i] += static_cast<T>(acc);
    }
  }
  return dx;
}

template <typename T>
void CheckShapes() {
  std::mt19937_64 rng(5);
  struct Shape {
    int n;
    int64_t out, in;
    DType dtype;
  };
  for (const Shape& s : {Shape{11, 37, 150, DType::kF32}, Shape{8, 5, 64, DType::kBF16},
                         Shape{3, 19, 96, DType::kQ8_0}, Shape{1, 300, 7, DType::kF32},
                         Shape{2, 6, 512, DType::kQ3_K}}) {
    SCOPED_TRACE(::testing::Message() << "n " << s.n << ", " << s.out << " x " << s.in);
    const testing::OwnedWeight w(testing::RandomFloatExact(rng, size_t(s.out * s.in), -1, 1), s.out,
                                 s.in, s.dtype);
    const std::vector<double> dyd = testing::RandomFloatExact(rng, size_t(s.n * s.out), -1, 1);
    std::vector<T> dy(dyd.begin(), dyd.end());
    for (size_t e = 0; e < dy.size(); e += 5) dy[e] = T(0);  // skipped terms
    const std::vector<double> dxd = testing::RandomFloatExact(rng, size_t(s.n * s.in), -1, 1);
    std::vector<T> dx(dxd.begin(), dxd.end());
    const std::vector<T> want = Definition(dy, s.n, w.view(), dx);
    MatMulBackwardInput(dy.data(), s.n, w.view(), dx.data());
    EXPECT_EQ(dx, want);
  }
}

TEST(ReferenceBackwardTest, MatMulBackwardInputIsItsDefinitionBitwise) {
  CheckShapes<float>();
  CheckShapes<double>();
}

}  // namespace
}  // namespace kvlens::kernels
