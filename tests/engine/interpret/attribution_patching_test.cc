// AttributionPatchSweep (attribution patching) against what each cell must be, without the
// backward pass it uses:
//   - a cell minus the clean score is the derivative of the exact patch toward the source:
//     central differences of edited forwards with clean + ε·(source − clean) patched in
//     (ResidualPatch, HeadPatch or RowOverride as PatchSweep's cells), at every site, two
//     rows, one head; with all_positions the sum of the rows' derivatives;
//   - a cell past the objective's row is the clean score (no gradient flows back there);
//   - the layout and the refusals are PatchSweep's.
// And against the PyTorch float64 oracle's autograd estimates (tests/oracle/kvlens_oracle/
// patching.py), every cell of every layer, on stories260K, the default GPT-2 and a random
// Gemma 2, both backends.
#include "engine/interpret/attribution_patching.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "engine/interpret/interventions.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/interpret/sweep_oracle.h"
#include "tests/engine/random_tokens.h"
#include "tests/engine/stories_model_test.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

class AttributionPatchingTest : public testing::StoriesModelTest {
 protected:
  kernels::ReferenceBackend be_;
};

// clean + e·(source − clean), entry by entry.
std::vector<double> Toward(const std::vector<double>& clean, const std::vector<double>& source,
                           double e) {
  std::vector<double> v(clean.size());
  for (size_t d = 0; d < v.size(); ++d) v[d] = clean[d] + e * (source[d] - clean[d]);
  return v;
}

TEST_F(AttributionPatchingTest, CellsAreTheDerivativesOfTheExactPatches) {
  if (NoModel()) return;
  const ModelConfig& c = model_->config;
  const int n = 9, row = 6, layer = 2;
  const SequenceInput<double> input{testing::RandomTokens(n, 14, c.vocab_size)},
      source{testing::RandomTokens(n, 15, c.vocab_size)};
  const Objective o = Objective::LogitDiff(row, source.tokens[row + 1], input.tokens[row + 1]);
  auto clean = RunForward(*model_, be_, input), src = RunForward(*model_, be_, source);
  ASSERT_TRUE(clean.ok() && src.ok());
  const double clean_j = EvaluateObjective(o, c, *clean);
  for (const char* name : {"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k",
                           "v", "z", "pattern"}) {
    SCOPED_TRACE(name);
    const PatchTarget target = *PatchTargetByName(name);
    const int head = target.Heads(c) - 1;
    auto atp = AttributionPatchSweep(*model_, be_, input, source, target, {layer}, 0, n, o);
    auto every = AttributionPatchSweep(*model_, be_, input, source, target, {layer}, 0, n, o,
                                       /*all_positions=*/true);
    ASSERT_TRUE(atp.ok() && every.ok()) << atp.status() << every.status();
    ASSERT_EQ(atp->metric.size(), static_cast<size_t>(target.Heads(c) * n));
    EXPECT_EQ(atp->clean, clean_j);
    // The edit that puts clean + e·(source − clean) at `i`, the exact cell's patch scaled.
    auto edits = [&](int i, double e) {
      Edits ed;
      if (target.kind == PatchTarget::Kind::kHeadPattern) {
        const int64_t at = (int64_t{head} * n + i) * n;
        const auto& cp = clean->layers[layer].probs;
        const auto& sp = src->layers[layer].probs;
        ed.row_overrides.push_back({layer,
                                    head,
                                    i,
                                    Toward({cp.begin() + at, cp.begin() + at + n},
                                           {sp.begin() + at, sp.begin() + at + n}, e),
                                    {}});
      } else if (target.kind == PatchTarget::Kind::kHeadVector) {
        HeadPatch p = *HeadPatchFrom(*clean, c, layer, head, i, i, target.tensor);
        p.value =
            Toward(p.value, HeadPatchFrom(*src, c, layer, head, i, i, target.tensor)->value, e);
        ed.head_patches.push_back(p);
      } else {
        const int l = layer + (target.next_layer ? 1 : 0);
        ResidualPatch p = *PatchFrom(*clean, c, l, i, i, target.site);
        p.value = Toward(p.value, PatchFrom(*src, c, l, i, i, target.site)->value, e);
        ed.patches.push_back(p);
      }
      return ed;
    };
    const double eps = 1e-5;
    double total = 0;
    for (int i = 0; i < n; ++i) {
      auto plus = RunForward(*model_, be_, input, edits(i, eps));
      auto minus = RunForward(*model_, be_, input, edits(i, -eps));
      ASSERT_TRUE(plus.ok() && minus.ok()) << plus.status() << minus.status();
      const double derivative =
          (EvaluateObjective(o, c, *plus) - EvaluateObjective(o, c, *minus)) / (2 * eps);
      total += derivative;
      const double cell = atp->metric[int64_t{head} * n + i];
      if (i > row) {
        EXPECT_EQ(cell, clean_j) << i;  // causal: no gradient reaches a later row
      }
      EXPECT_NEAR(cell - clean_j, derivative, 1e-6 * std::max(1.0, std::abs(derivative))) << i;
    }
    EXPECT_NEAR(every->metric[head] - clean_j, total, 1e-6 * std::max(1.0, std::abs(total)));
    EXPECT_NE(every->metric[head], clean_j);
  }
  // PatchSweep's refusals, by the same check.
  auto bad =
      AttributionPatchSweep(*model_, be_, input, source, PatchTarget{}, {c.num_layers}, 0, n, o);
  EXPECT_NE(bad.status().message().find("layer 5 is outside [0, 5)"), std::string::npos)
      << bad.status();
}

TEST(AttributionPatchingOracle, Stories260KEverySite) {
  sweep_oracle::ExpectStoriesSweeps({"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out",
                                     "q", "k", "v", "z", "pattern"},
                                    {.attribution = true});
  sweep_oracle::ExpectStoriesSweeps({"v", "pattern"}, {.all_positions = true, .attribution = true});
}

TEST(AttributionPatchingOracle, QkFixOnStories260KGpt2AndGemma2) {
  // (GQA on stories260K; Gemma 2's capped scores, windows on alternate layers)
  sweep_oracle::ExpectStoriesSweeps({"q", "k"}, {.attribution = true, .qk_fix = true});
  sweep_oracle::ExpectStoriesSweeps({"k"},
                                    {.all_positions = true, .attribution = true, .qk_fix = true});
  sweep_oracle::ExpectDefaultGpt2Sweeps({"q", "k"}, {.attribution = true, .qk_fix = true});
  sweep_oracle::ExpectGemma2Sweeps({"q", "k"}, {.attribution = true, .qk_fix = true});
}

TEST(AttributionPatchingOracle, DefaultGpt2) {
  sweep_oracle::ExpectDefaultGpt2Sweeps({"attn_out", "z", "pattern"}, {.attribution = true});
}

TEST(AttributionPatchingOracle, Gemma2) {
  sweep_oracle::ExpectGemma2Sweeps({"attn_out", "mlp_out", "resid_mid", "k", "pattern"},
                                   {.attribution = true});
}

}  // namespace
}  // namespace kvlens::interpret
