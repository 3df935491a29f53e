// PatchSweep (TransformerLens's activation-patching sweeps) against what each cell must be
// by construction, without the sweep's own building blocks:
//   - resid_pre of layer 0 at row p is the token embedding there, so that cell is the run
//     of the input with token p swapped for the source's (every tiny model family: GPT-2's
//     positions, Gemma's √D scale);
//   - resid_post of the last layer at the objective's row is the stream the final norm
//     reads, so that cell scores exactly the source's run; at any other row, the clean one;
//   - a cell past the objective's row (every site, every head) is the clean score, since
//     attention is causal;
//   - the grid is laid out [layer][head][row].
#include "engine/interpret/patch_sweep.h"

#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/interpret/tiny_model.h"
#include "tests/engine/stories_model_test.h"

namespace kvlens::interpret {
namespace {

std::vector<int32_t> Tokens(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t = {1};
  while (static_cast<int>(t.size()) < n) t.push_back(static_cast<int32_t>(3 + rng() % (vocab - 3)));
  return t;
}

class PatchSweepTest : public testing::StoriesModelTest {
 protected:
  kernels::ReferenceBackend be_;
};

TEST_F(PatchSweepTest, CellsAreTheRunsTheyMustBe) {
  if (NoModel()) return;
  const ModelConfig& c = model_->config;
  const int n = 10, row = 6, V = c.vocab_size;
  const SequenceInput<double> input{Tokens(n, 4, V)}, source{Tokens(n, 5, V)};
  // logit difference at row 6 between the next tokens of the two prompts
  const Objective o = Objective::LogitDiff(row, source.tokens[row + 1], input.tokens[row + 1]);
  for (const char* name : {"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z"}) {
    SCOPED_TRACE(name);
    const PatchTarget target = *PatchTargetByName(name);
    const std::vector<int> layers = {c.num_layers - 1, 0, 2};
    auto r = PatchSweep(*model_, be_, input, source, target, layers, 0, n, o);
    ASSERT_TRUE(r.ok()) << r.status();
    const int heads = target.heads ? c.num_heads : 1;
    ASSERT_EQ(r->heads, heads);
    ASSERT_EQ(r->metric.size(), layers.size() * heads * n);
    auto cell = [&](size_t li, int h, int i) { return r->metric[(li * heads + h) * n + i]; };
    auto clean = RunForward(*model_, be_, input), src = RunForward(*model_, be_, source);
    ASSERT_TRUE(clean.ok() && src.ok());
    const double clean_j = clean->logits[row * V + o.token_a] - clean->logits[row * V + o.token_b];
    const double src_j = src->logits[row * V + o.token_a] - src->logits[row * V + o.token_b];
    EXPECT_EQ(r->clean, clean_j);
    EXPECT_EQ(r->source, src_j);
    EXPECT_NE(r->clean, r->source);
    bool moved = false;
    for (size_t li = 0; li < layers.size(); ++li) {
      for (int h = 0; h < heads; ++h) {
        for (int i = row + 1; i < n; ++i) EXPECT_EQ(cell(li, h, i), clean_j) << li << " " << i;
        for (int i = 0; i <= row; ++i) moved |= cell(li, h, i) != clean_j;
      }
    }
    EXPECT_TRUE(moved);
    if (std::string_view(name) == "resid_post") {  // layers[0] is the last layer
      for (int i = 0; i < n; ++i) EXPECT_EQ(cell(0, 0, i), i == row ? src_j : clean_j) << i;
    }
    if (std::string_view(name) == "resid_pre") {  // layers[1] is layer 0: a token swap
      for (int i = 0; i <= row; ++i) {
        SequenceInput<double> swapped = input;
        swapped.tokens[i] = source.tokens[i];
        auto t = RunForward(*model_, be_, swapped);
        ASSERT_TRUE(t.ok());
        EXPECT_EQ(cell(1, 0, i), t->logits[row * V + o.token_a] - t->logits[row * V + o.token_b])
            << i;
      }
    }
  }
}

// Layer 0's resid_pre is the embedding (token, GPT-2's position, Gemma's √D): on every tiny
// family, each cell is the input with that token swapped; log-prob objective, fp32 backend.
TEST(PatchSweep, FirstStreamCellsAreTokenSwapsInEveryFamily) {
  for (int family = 0; family < testing::kTinyFamilies; ++family) {
    SCOPED_TRACE(family);
    auto m = testing::MakeTinyModel(testing::TinyFamilySpec(family));
    const ModelConfig& c = m->config;
    kernels::CpuBackend be(1);
    const int n = 7;
    const SequenceInput<float> input{Tokens(n, 11, c.vocab_size)},
        source{Tokens(n, 12, c.vocab_size)};
    const Objective o = Objective::LogProb({{n - 1, 5}, {3, 2}});
    auto r = PatchSweep(*m, be, input, source, PatchTarget{}, {0}, 1, n, o);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->metric.size(), size_t(n - 1));
    for (int i = 1; i < n; ++i) {
      SequenceInput<float> swapped = input;
      swapped.tokens[i] = source.tokens[i];
      auto t = RunForward(*m, be, swapped);
      ASSERT_TRUE(t.ok());
      EXPECT_EQ(r->metric[i - 1], EvaluateObjective(o, c, *t)) << i;
    }
  }
}

TEST_F(PatchSweepTest, BadSweepsNameTheProblem) {
  if (NoModel()) return;
  const ModelConfig& c = model_->config;
  const SequenceInput<double> input{Tokens(8, 4, c.vocab_size)}, source{Tokens(8, 5, c.vocab_size)},
      short_source{Tokens(7, 5, c.vocab_size)};
  const Objective o = Objective::LogitDiff(7, 5, 6);
  auto refused = [&](const absl::StatusOr<PatchSweepResult>& r, const std::string& want) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status();
  };
  refused(PatchSweep(*model_, be_, input, short_source, PatchTarget{}, {0}, 0, 8, o),
          "the source has 7 tokens and the input 8");
  refused(PatchSweep(*model_, be_, input, source, PatchTarget{}, {c.num_layers}, 0, 8, o),
          "layer 5 is outside [0, 5)");
  refused(PatchSweep(*model_, be_, input, source, PatchTarget{}, {0}, 3, 9, o),
          "rows [3, 9) are not a range");
  refused(PatchSweep(*model_, be_, input, source, PatchTarget{}, {0}, 0, 8,
                     Objective::AttnOutProbe(0, 0, std::vector<double>(8 * c.head_dim, 1.0))),
          "must read the logits");
  EXPECT_FALSE(PatchTargetByName("hook_resid_pre").has_value());
  EXPECT_FALSE(PatchTargetByName("blocks.0.hook_resid_pre").has_value());
}

}  // namespace
}  // namespace kvlens::interpret
