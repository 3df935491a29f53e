// Model::ValidateWeights on what a file may get wrong beyond the tensors' shapes: Llama 3.1's
// rope_freqs (one positive, finite f32 factor per pair of a head).
#include "engine/model/model.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

std::string StoriesGguf() { return testing::TestData("stories260K/stories260K.gguf"); }

TEST(ModelTest, RopeFreqsMustBeOnePositiveF32FactorPerPair) {
  KVLENS_REQUIRE_FILE(StoriesGguf());
  auto model = LoadModel({StoriesGguf(), ""});
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  ASSERT_EQ(m.config.head_dim, 8);  // 4 pairs
  EXPECT_TRUE(m.weights.rope_freqs.empty());
  std::vector<float> f = {1.0f, 1.5f, 4.0f, 8.0f};
  m.weights.rope_freqs = kernels::WeightView{f.data(), kernels::DType::kF32, 1, 4};
  EXPECT_TRUE(m.ValidateWeights().ok()) << m.ValidateWeights();
  struct Case {
    kernels::WeightView view;
    std::string message;
  };
  std::vector<float> bad = f;
  bad[2] = 0.0f;
  std::vector<float> nan = f;
  nan[1] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<uint16_t> halves(4, 0x3c00);  // 1.0 in f16
  const Case cases[] = {
      {kernels::WeightView{f.data(), kernels::DType::kF32, 1, 3}, "rope_freqs"},
      {kernels::WeightView{halves.data(), kernels::DType::kF16, 1, 4}, "(must be f32)"},
      {kernels::WeightView{bad.data(), kernels::DType::kF32, 1, 4}, "rope_freqs[2] = 0"},
      {kernels::WeightView{nan.data(), kernels::DType::kF32, 1, 4}, "rope_freqs[1] = nan"},
  };
  for (const Case& c : cases) {
    m.weights.rope_freqs = c.view;
    const absl::Status s = m.ValidateWeights();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_NE(std::string(s.message()).find(c.message), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace kvlens
