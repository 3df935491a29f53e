// PatchSweep (TransformerLens's activation-patching sweeps) against what each cell must be
// by construction, without the sweep's own building blocks:
//   - resid_pre of layer 0 at row p is the token embedding there, so that cell is the run
//     of the input with token p swapped for the source's (every tiny model family: GPT-2's
//     positions, Gemma's √D scale);
//   - resid_post of the last layer at the objective's row is the stream the final norm
//     reads, so that cell scores exactly the source's run; at any other row, the clean one;
//   - a cell past the objective's row (every site, every head) is the clean score, since
//     attention is causal; so is, in the last layer, a q, z or pattern cell at another row
//     (a query row's head reaches only that row's output);
//   - k and v have a cell per KV head (stories260K: 8 heads on 4);
//   - all_positions: every row of a stream site from the source is the source's run; rows
//     [2, n) of layer 0's resid_pre are those tokens swapped; every row of a last-layer q
//     or z scores as its row at the objective's row;
//   - the grid is laid out [layer][head][row].
// And against the PyTorch float64 oracle's own patching (tests/oracle/kvlens_oracle/
// patching.py), every cell of every layer, on stories260K, the default GPT-2 and a random
// Gemma 2, both backends (stories260K also with all_positions). The oracle patches q and k before
// RoPE, as TransformerLens hooks them; kvlens after it.
#include "engine/interpret/patch_sweep.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/interpret/sweep_oracle.h"
#include "tests/engine/interpret/tiny_model.h"
#include "tests/engine/random_tokens.h"
#include "tests/engine/stories_model_test.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

class PatchSweepTest : public testing::StoriesModelTest {
 protected:
  kernels::ReferenceBackend be_;
};

TEST_F(PatchSweepTest, CellsAreTheRunsTheyMustBe) {
  if (NoModel()) return;
  const ModelConfig& c = model_->config;
  const int n = 10, row = 6, V = c.vocab_size;
  const SequenceInput<double> input{testing::RandomTokens(n, 4, V)},
      source{testing::RandomTokens(n, 5, V)};
  // logit difference at row 6 between the next tokens of the two prompts
  const Objective o = Objective::LogitDiff(row, source.tokens[row + 1], input.tokens[row + 1]);
  ASSERT_LT(c.num_kv_heads, c.num_heads);  // grouped-query attention
  for (const char* name : {"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k",
                           "v", "z", "pattern"}) {
    SCOPED_TRACE(name);
    const std::string_view hook = name;
    const PatchTarget target = *PatchTargetByName(name);
    const std::vector<int> layers = {c.num_layers - 1, 0, 2};
    auto r = PatchSweep(*model_, be_, input, source, target, layers, 0, n, o);
    ASSERT_TRUE(r.ok()) << r.status();
    const int heads = hook == "k" || hook == "v"                        ? c.num_kv_heads
                      : hook == "q" || hook == "z" || hook == "pattern" ? c.num_heads
                                                                        : 1;
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
    if (hook == "q" || hook == "z" || hook == "pattern") {
      // in the last layer (layers[0]) a query row's head reaches only that row's logits
      for (int h = 0; h < heads; ++h) {
        for (int i = 0; i < n; ++i) {
          if (i != row) {
            EXPECT_EQ(cell(0, h, i), clean_j) << h << " " << i;
          }
        }
      }
    }
    if (hook == "resid_post") {  // layers[0] is the last layer
      for (int i = 0; i < n; ++i) EXPECT_EQ(cell(0, 0, i), i == row ? src_j : clean_j) << i;
    }
    if (hook == "resid_pre") {  // layers[1] is layer 0: a token swap
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

// all_positions (TransformerLens's …_all_pos): every row of a stream site from the source
// is the source's own run from that layer on, so each cell is the source's score, exactly;
// over rows [2, n) of layer 0's resid_pre, the input with those tokens swapped; in the last
// layer, every row of a head's q or z scores as its row at the objective's row.
TEST_F(PatchSweepTest, AllPositionsCellsAreTheRunsTheyMustBe) {
  if (NoModel()) return;
  const ModelConfig& c = model_->config;
  const int n = 9, row = 5, L = c.num_layers, V = c.vocab_size;
  const SequenceInput<double> input{testing::RandomTokens(n, 6, V)},
      source{testing::RandomTokens(n, 7, V)};
  const Objective o = Objective::LogitDiff(row, source.tokens[row + 1], input.tokens[row + 1]);
  std::vector<int> every(L);
  for (int l = 0; l < L; ++l) every[l] = l;
  auto src = RunForward(*model_, be_, source);
  ASSERT_TRUE(src.ok());
  const double src_j = EvaluateObjective(o, c, *src);
  for (const char* name : {"resid_pre", "resid_mid", "resid_post"}) {
    SCOPED_TRACE(name);
    auto r = PatchSweep(*model_, be_, input, source, *PatchTargetByName(name), every, 0, n, o,
                        /*all_positions=*/true);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->metric, std::vector<double>(L, src_j));
  }
  auto swapped = PatchSweep(*model_, be_, input, source, PatchTarget{}, {0}, 2, n, o, true);
  ASSERT_TRUE(swapped.ok());
  SequenceInput<double> tail = input;
  for (int i = 2; i < n; ++i) tail.tokens[i] = source.tokens[i];
  auto t = RunForward(*model_, be_, tail);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(swapped->metric, std::vector<double>{EvaluateObjective(o, c, *t)});
  for (const char* name : {"q", "z"}) {
    SCOPED_TRACE(name);
    const PatchTarget target = *PatchTargetByName(name);
    auto all = PatchSweep(*model_, be_, input, source, target, {L - 1}, 0, n, o, true);
    auto one = PatchSweep(*model_, be_, input, source, target, {L - 1}, row, row + 1, o);
    ASSERT_TRUE(all.ok() && one.ok());
    ASSERT_EQ(all->metric.size(), static_cast<size_t>(c.num_heads));
    EXPECT_EQ(all->metric, one->metric);
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
    const SequenceInput<float> input{testing::RandomTokens(n, 11, c.vocab_size)},
        source{testing::RandomTokens(n, 12, c.vocab_size)};
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
  const SequenceInput<double> input{testing::RandomTokens(8, 4, c.vocab_size)},
      source{testing::RandomTokens(8, 5, c.vocab_size)},
      short_source{testing::RandomTokens(7, 5, c.vocab_size)};
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

TEST(PatchSweepOracle, Stories260KEverySite) {
  sweep_oracle::ExpectStoriesSweeps({"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out",
                                     "q", "k", "v", "z", "pattern"});
  sweep_oracle::ExpectStoriesSweeps({"attn_out", "k", "z", "pattern"}, {.all_positions = true});
}

TEST(PatchSweepOracle, DefaultGpt2Model) {
  sweep_oracle::ExpectDefaultGpt2Sweeps({"attn_out", "v", "z", "pattern"});
}

TEST(PatchSweepOracle, Gemma2) {
  sweep_oracle::ExpectGemma2Sweeps({"attn_out", "mlp_out", "resid_mid", "k", "pattern"});
}

}  // namespace
}  // namespace kvlens::interpret
