// The hooks' finite-difference check on the tiny models of every family: for each hook an
// edit can move (at the first and the last layer), ReadHookGradient's float64 values agree
// with centred differences of the objective through that edit; the same check fails on a
// gradient scaled by 1.01 and on another layer's (so it can tell), and refuses the hooks
// it cannot move, a gradient of the wrong size and a layer out of range.
#include "engine/interpret/hook_finite_difference.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/interpret/hook_gradients.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/interpret/tiny_model.h"
#include "tests/engine/random_tokens.h"

namespace kvlens::interpret {
namespace {

class TinyHookFiniteDifferences : public ::testing::TestWithParam<int> {};

TEST_P(TinyHookFiniteDifferences, EveryMovableHookAgreesWithItsGradient) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  kernels::ReferenceBackend be;
  const int n = 6;
  const SequenceInput<double> in{testing::RandomTokens(n, 5, c.vocab_size)};
  auto tape = RunForward(*m, be, in);
  ASSERT_TRUE(tape.ok()) << tape.status();
  const Objective o = Objective::LogProb({{n - 1, 2}, {n - 3, 1}});
  auto g = ObjectiveGradients(*m, *tape, o);
  ASSERT_TRUE(g.ok()) << g.status();
  FdOptions opt;
  opt.samples_per_tensor = 3;
  int checked = 0;
  for (Hook hook : HooksWithGradient()) {
    if (!HookHasFiniteDifference(hook) || !CheckModelHasHook(c, hook).ok()) continue;
    for (int layer : {0, c.num_layers - 1}) {
      SCOPED_TRACE(HookFullName(hook, layer));
      auto grad = ReadHookGradient(*m, *tape, *g, hook, layer);
      ASSERT_TRUE(grad.ok()) << grad.status();
      auto r = CheckHookGradientByFiniteDifferences(*m, in, o, hook, layer, *grad, opt);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->samples.size(), 3u);
      EXPECT_LT(r->max_rel_err, 1e-7) << "abs " << r->max_abs_err;
      ++checked;
      if (layer == 0 && hook == Hook::kResidMid) {
        // A gradient 1% off, or the last layer's, is caught.
        std::vector<double> off = *grad;
        for (double& v : off) v *= 1.01;
        auto bad = CheckHookGradientByFiniteDifferences(*m, in, o, hook, layer, off, opt);
        ASSERT_TRUE(bad.ok()) << bad.status();
        EXPECT_GT(bad->max_rel_err, 5e-3);
        auto other = ReadHookGradient(*m, *tape, *g, hook, c.num_layers - 1);
        ASSERT_TRUE(other.ok()) << other.status();
        auto wrong = CheckHookGradientByFiniteDifferences(*m, in, o, hook, layer, *other, opt);
        ASSERT_TRUE(wrong.ok()) << wrong.status();
        EXPECT_GT(wrong->max_rel_err, 1e-3);
      }
    }
  }
  // resid_pre, resid_mid, resid_post, attn_out, mlp_out, z, q, k, v, attn_scores, pattern
  // at two layers, embed and pos_embed (no layer: counted twice), rot_q and rot_k with RoPE.
  const bool rotary = c.arch == Architecture::kLlama;
  const bool positions = CheckModelHasHook(c, Hook::kPosEmbed).ok();
  EXPECT_EQ(checked, 2 * (11 + 1 + (positions ? 1 : 0) + (rotary ? 2 : 0)));
}

TEST_P(TinyHookFiniteDifferences, RefusesWhatItCannotCheck) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const int n = 4;
  const SequenceInput<double> in{testing::RandomTokens(n, 9, c.vocab_size)};
  const Objective o = Objective::LogProb({{n - 1, 1}});
  const std::vector<double> row(static_cast<size_t>(n) * c.dim, 0.0);
  auto expect = [](const absl::StatusOr<FdHookReport>& r, const std::string& needle) {
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
  };
  expect(CheckHookGradientByFiniteDifferences(*m, in, o, Hook::kMlpPost, 0, row),
         "hook mlp_post has no finite-difference check");
  expect(CheckHookGradientByFiniteDifferences(*m, in, o, Hook::kResidPre, 0,
                                              std::vector<double>(5, 0.0)),
         "has 5 values; its shape holds " + std::to_string(n * c.dim));
  expect(CheckHookGradientByFiniteDifferences(*m, in, o, Hook::kResidMid, c.num_layers, row),
         absl::StrCat("layer ", c.num_layers, " of hook resid_mid is outside [0, ", c.num_layers,
                      ")"));
}

INSTANTIATE_TEST_SUITE_P(Families, TinyHookFiniteDifferences,
                         ::testing::Range(0, testing::kTinyFamilies));

}  // namespace
}  // namespace kvlens::interpret
