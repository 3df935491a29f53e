// ReadHookGradient's layout and refusals on the tiny models of every family (the values
// against autograd: OracleGradients in oracle_grad_test.cc). Every hook with a gradient
// comes back in HookShape's size; the FFN's only for the layers of BackwardOptions::ffn_layers
// (a layer out of range or twice there is refused); the norms' hooks, layers out of range and
// hooks the model lacks are refused, naming the hook.
#include "engine/interpret/hook_gradients.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/interpret/objective.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/interpret/tiny_model.h"
#include "tests/engine/random_tokens.h"

namespace kvlens::interpret {
namespace {

template <typename V>
void ExpectRefused(const absl::StatusOr<V>& r, const std::string& needle) {
  ASSERT_FALSE(r.ok()) << needle;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
}

class TinyHookGradients : public ::testing::TestWithParam<int> {};

TEST_P(TinyHookGradients, EveryHookComesBackInItsShapeOrIsRefused) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  kernels::ReferenceBackend be;
  const int n = 7;
  auto tape = RunForward(*m, be, SequenceInput<double>{testing::RandomTokens(n, 3, c.vocab_size)});
  ASSERT_TRUE(tape.ok()) << tape.status();
  const Objective o = Objective::LogProb({{n - 1, 2}});
  const int last = c.num_layers - 1;
  BackwardOptions with_ffn;
  with_ffn.ffn_layers = {last};
  auto g = ObjectiveGradients(*m, *tape, o, with_ffn);
  auto lean = ObjectiveGradients(*m, *tape, o);
  ASSERT_TRUE(g.ok() && lean.ok()) << g.status() << lean.status();
  EXPECT_TRUE(lean->mlp_post.empty());
  ASSERT_GT(last, 0);
  // only the layers asked for keep theirs
  EXPECT_TRUE(g->mlp_post[0].empty() && g->mlp_pre[0].empty());
  EXPECT_FALSE(g->mlp_post[last].empty());
  for (const auto& [bad, message] :
       {std::pair<std::vector<int>, std::string>{
            {last, c.num_layers},
            absl::StrCat("ffn_layers[1] = ", c.num_layers, " outside [0, ", c.num_layers, ")")},
        {{-1}, absl::StrCat("ffn_layers[0] = -1 outside [0, ", c.num_layers, ")")},
        {{0, last, 0}, "ffn_layers[2] = 0 twice"}}) {
    BackwardOptions wrong;
    wrong.ffn_layers = bad;
    ExpectRefused(ObjectiveGradients(*m, *tape, o, wrong), message);
  }
  const bool rotary = c.arch == Architecture::kLlama;
  int read = 0;
  for (Hook hook : HooksWithGradient()) {
    const std::string name(HookName(hook));
    const int layer = HookIsPerLayer(hook) ? c.num_layers - 1 : -1;
    auto x = ReadHookGradient(*m, *tape, *g, hook, layer);
    if (!CheckModelHasHook(c, hook).ok()) {
      ExpectRefused(x, name + ": the model (");
      continue;
    }
    ASSERT_TRUE(x.ok()) << name << ": " << x.status();
    int64_t size = 1;
    for (int64_t d : HookShape(c, hook, n, n)) size *= d;
    EXPECT_EQ(static_cast<int64_t>(x->size()), size) << name;
    ++read;
    if (HookGradientNeedsFfn(hook)) {
      const std::string not_kept = "'s FFN gradients were not kept (BackwardOptions::ffn_layers)";
      ExpectRefused(ReadHookGradient(*m, *tape, *lean, hook, layer),
                    name + ": layer " + std::to_string(layer) + not_kept);
      ExpectRefused(ReadHookGradient(*m, *tape, *g, hook, 0), name + ": layer 0" + not_kept);
    }
    if (HookIsPerLayer(hook)) {
      ExpectRefused(ReadHookGradient(*m, *tape, *g, hook, c.num_layers),
                    name + ": layer " + std::to_string(c.num_layers) + " is outside [0, ");
    }
  }
  // embed; 12 stream and attention hooks (resid_pre, attn_scores, pattern, q, k, v, z,
  // result, attn_out, resid_mid, mlp_out, resid_post); mlp_pre, mlp_post; ln_final; then
  // GPT-2's pos_embed, or a rotary gated model's rot_q, rot_k and mlp_pre_linear
  EXPECT_EQ(read, rotary ? 19 : 17);
  for (Hook hook : {Hook::kLn1Scale, Hook::kLn1Normalized, Hook::kLn2Normalized,
                    Hook::kLnFinalScale, Hook::kLnFinalNormalized}) {
    EXPECT_FALSE(HookHasGradient(hook));
    ExpectRefused(ReadHookGradient(*m, *tape, *g, hook, 0),
                  std::string(HookName(hook)) + ": no gradient is kept there");
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TinyHookGradients, ::testing::Range(0, testing::kTinyFamilies));

}  // namespace
}  // namespace kvlens::interpret
