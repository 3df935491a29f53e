#include "engine/model/weights.h"

#include "gtest/gtest.h"

namespace kvlens {
namespace {

using kernels::DType;

// Views are never read here: a non-null address marks them present.
WeightView View(DType dtype, int64_t rows, int64_t cols) {
  static const char kSomewhere = 0;
  return WeightView{&kSomewhere, dtype, rows, cols};
}

TEST(LinearWeightDTypesTest, OneTypeIsItsName) {
  Weights w;
  w.layers.resize(2);
  for (LayerWeights& l : w.layers) {
    l.wq = l.wk = l.wv = l.wo = View(DType::kF16, 64, 64);
    l.w_in = l.w_up = View(DType::kF16, 172, 64);
    l.w_out = View(DType::kF16, 64, 172);
    l.attn_norm = View(DType::kF32, 1, 64);  // not a linear weight
  }
  w.output = View(DType::kF16, 512, 64);
  EXPECT_EQ(LinearWeightDTypes(w), "f16");
}

// A Q4_K_M-like mix: q4_K holds most parameters, q6_K the output and half the down
// projections; the norms (f32) are not linear weights. Per layer q4_K: 4·256² + 2·256·768
// (+ 256·768 for layer 1's down projection); q6_K: 256·768 (layer 0's down) + 1000·256.
TEST(LinearWeightDTypesTest, MixedTypesMostParametersFirst) {
  Weights w;
  w.layers.resize(2);
  for (int i = 0; i < 2; ++i) {
    LayerWeights& l = w.layers[i];
    l.wq = l.wk = l.wv = l.wo = View(DType::kQ4_K, 256, 256);
    l.w_in = l.w_up = View(DType::kQ4_K, 768, 256);
    l.w_out = View(i == 0 ? DType::kQ6_K : DType::kQ4_K, 256, 768);
    l.attn_norm = l.ffn_norm = View(DType::kF32, 1, 256);
  }
  w.final_norm = View(DType::kF32, 1, 256);
  w.output = View(DType::kQ6_K, 1000, 256);
  EXPECT_EQ(LinearWeightDTypes(w), "q4_K+q6_K");
  // A larger output flips the order: 6000·256 + 256·768 = 1,732,608 q6_K elements against
  // q4_K's 2·(4·256² + 2·256·768) + 256·768 = 1,507,328.
  w.output = View(DType::kQ6_K, 6000, 256);
  EXPECT_EQ(LinearWeightDTypes(w), "q6_K+q4_K");
  EXPECT_EQ(LinearWeightDTypes(Weights{}), "");
}

}  // namespace
}  // namespace kvlens
