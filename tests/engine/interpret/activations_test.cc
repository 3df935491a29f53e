// Activations (TransformerLens's hook names over a tape). On tiny models of every family,
// each hook against what it must equal by construction, from other tensors than the ones it
// is read from: the stream's hooks add up (resid_post = resid_pre + attn_out + mlp_out), the
// per-head results (formed here, never by the forward) sum through b_O or the block-output
// norm to attn_out, zero-ablating a head moves resid_mid by exactly its result, a one-token
// row 0 reads its own value (z = v), ln_final through the unembedding gives the logits, and
// each pattern row is the softmax of its attn_scores row (−∞ where masked, computed here),
// each score the scaled product of the rotated q and k rows, and the unrotated ones of a
// first layer repeat with their token.
// Against the PyTorch float64 oracle (tests/oracle, --activations, run at test time): every
// hook of every layer for stories260K and a random Gemma 2, on both backends.
#include "engine/interpret/activations.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/weight.h"
#include "tests/engine/interpret/tiny_model.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

const std::vector<int32_t> kTokens = {1, 7, 3, 19, 4, 12, 9, 2};

std::vector<double> Hook64(const Model& m, const Tape<double>& t, Hook hook, int layer) {
  kernels::ReferenceBackend be;
  const int rows = HookRowsAreKeys(hook) ? t.num_keys : t.n;
  auto v = ReadHook(m, be, t, hook, layer, 0, rows);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? *v : std::vector<double>{};
}

Tape<double> MustTape(const Model& m, const Edits& edits = {}) {
  kernels::ReferenceBackend be;
  auto t = RunForward(m, be, SequenceInput<double>{kTokens}, edits);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

std::vector<double> Row(const kernels::WeightView& w, int64_t r) {
  std::vector<double> out(static_cast<size_t>(w.cols));
  kernels::DequantizeRow(w, r, out.data());
  return out;
}

std::vector<Hook> AllHooks() {
  std::vector<Hook> all;
  for (int h = 0; h <= static_cast<int>(Hook::kLn2PostNormalized); ++h) {
    all.push_back(static_cast<Hook>(h));
  }
  return all;
}

class TinyActivations : public ::testing::TestWithParam<int> {};

TEST_P(TinyActivations, StreamHooksAddUp) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  for (int l = 0; l < c.num_layers; ++l) {
    const auto pre = Hook64(*m, t, Hook::kResidPre, l), mid = Hook64(*m, t, Hook::kResidMid, l),
               post = Hook64(*m, t, Hook::kResidPost, l), attn = Hook64(*m, t, Hook::kAttnOut, l),
               mlp = Hook64(*m, t, Hook::kMlpOut, l);
    ASSERT_EQ(pre.size(), size_t{kTokens.size()} * c.dim);
    for (size_t i = 0; i < pre.size(); ++i) {
      EXPECT_NEAR(mid[i], pre[i] + attn[i], 1e-12) << l;
      EXPECT_NEAR(post[i], pre[i] + attn[i] + mlp[i], 1e-12) << l;
    }
    if (l + 1 < c.num_layers) {
      EXPECT_EQ(post, Hook64(*m, t, Hook::kResidPre, l + 1));
    }
  }
}

// Σ_h result_h (+ b_O) = attn_out; under the block-output norms attn_out is that sum through
// RMSNorm(·) ⊙ w_post, computed here by hand.
TEST_P(TinyActivations, HeadResultsSumToTheAttentionOutput) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  const int n = t.n, H = c.num_heads, D = c.dim;
  for (int l = 0; l < c.num_layers; ++l) {
    const auto result = Hook64(*m, t, Hook::kResult, l), attn = Hook64(*m, t, Hook::kAttnOut, l);
    ASSERT_EQ(result.size(), size_t(n) * H * D);
    const LayerWeights& lw = m->weights.layers[l];
    const std::vector<double> bo = lw.bo.empty() ? std::vector<double>(D, 0.0) : Row(lw.bo, 0);
    for (int i = 0; i < n; ++i) {
      std::vector<double> sum(bo);
      for (int h = 0; h < H; ++h)
        for (int j = 0; j < D; ++j) sum[j] += result[(int64_t{i} * H + h) * D + j];
      if (c.sandwich_norms) {
        double ss = 0;
        for (double v : sum) ss += v * v;
        const double r = 1.0 / std::sqrt(ss / D + c.norm_eps);
        const std::vector<double> w = Row(lw.post_attn_norm, 0);
        for (int j = 0; j < D; ++j) sum[j] *= r * w[j];
      }
      for (int j = 0; j < D; ++j) EXPECT_NEAR(sum[j], attn[int64_t{i} * D + j], 1e-12) << l;
    }
  }
}

// Zero-ablating head h of layer l (the tape's own edit) moves resid_mid by exactly −result_h
// (models whose attention output is added to the stream as it is).
TEST_P(TinyActivations, AblatingAHeadRemovesItsResult) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  if (c.sandwich_norms) GTEST_SKIP() << "the block-output norm is not additive";
  const Tape<double> clean = MustTape(*m);
  const int l = c.num_layers - 1, h = 1, H = c.num_heads, D = c.dim;
  Edits e;
  e.ablations.push_back({l, h, AblationMode::kZero});
  const Tape<double> ablated = MustTape(*m, e);
  const auto result = Hook64(*m, clean, Hook::kResult, l);
  const auto mid = Hook64(*m, clean, Hook::kResidMid, l),
             mid_ablated = Hook64(*m, ablated, Hook::kResidMid, l);
  for (int i = 0; i < clean.n; ++i)
    for (int j = 0; j < D; ++j)
      EXPECT_NEAR(mid[int64_t{i} * D + j] - mid_ablated[int64_t{i} * D + j],
                  result[(int64_t{i} * H + h) * D + j], 1e-12);
}

// Row 0 sees only key 0 (probability exactly 1): each head's z is its KV head's v.
TEST_P(TinyActivations, TheFirstRowReadsItsOwnValue) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  const int group = c.num_heads / c.num_kv_heads, dh = c.head_dim;
  for (int l = 0; l < c.num_layers; ++l) {
    const auto z = Hook64(*m, t, Hook::kZ, l), v = Hook64(*m, t, Hook::kV, l);
    for (int h = 0; h < c.num_heads; ++h)
      for (int d = 0; d < dh; ++d) EXPECT_EQ(z[h * dh + d], v[(h / group) * dh + d]) << h;
  }
}

// attn_scores[h, i, j] = scale · rot_q[i, h] · rot_k[j, h's KV head] (soft-capped where the
// model caps them) wherever key j is visible; GPT-2's q and k are the rotated ones.
TEST_P(TinyActivations, ScoresAreTheRotatedQueriesDotTheRotatedKeys) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  const bool rotary = CheckModelHasHook(c, Hook::kRotQ).ok();
  EXPECT_EQ(rotary, c.arch == Architecture::kLlama);
  const int n = t.n, tk = t.num_keys, H = c.num_heads, dh = c.head_dim;
  const int group = H / c.num_kv_heads;
  for (int l = 0; l < c.num_layers; ++l) {
    const auto q = Hook64(*m, t, rotary ? Hook::kRotQ : Hook::kQ, l),
               k = Hook64(*m, t, rotary ? Hook::kRotK : Hook::kK, l),
               scores = Hook64(*m, t, Hook::kAttnScores, l);
    int seen = 0;
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < tk; ++j) {
          const double got = scores[(int64_t{h} * n + i) * tk + j];
          if (std::isinf(got)) continue;
          double dot = 0;
          for (int d = 0; d < dh; ++d) {
            dot += q[(int64_t{i} * H + h) * dh + d] *
                   k[(int64_t{j} * c.num_kv_heads + h / group) * dh + d];
          }
          double want = dot * c.AttentionScale();
          if (c.attention_softcap > 0) {
            want = c.attention_softcap * std::tanh(want / c.attention_softcap);
          }
          EXPECT_NEAR(got, want, 1e-12) << l << " " << h << " " << i << " " << j;
          ++seen;
        }
      }
    }
    EXPECT_GE(seen, H * n) << l;  // at least each row's own key
  }
}

// Before the rotation a Llama's first-layer q and k rows depend on the token alone (no
// position enters its stream): a repeated token repeats them exactly. After it they differ,
// and at position 0 (no turn) the two agree.
TEST_P(TinyActivations, UnrotatedQueriesAndKeysDependOnTheTokenAlone) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  if (c.arch != Architecture::kLlama) GTEST_SKIP() << "no rotary embedding";
  kernels::ReferenceBackend be;
  auto t = RunForward(*m, be, SequenceInput<double>{{5, 9, 5, 9, 5}});
  ASSERT_TRUE(t.ok()) << t.status();
  for (auto [hook, rot, heads] : {std::tuple{Hook::kQ, Hook::kRotQ, c.num_heads},
                                  std::tuple{Hook::kK, Hook::kRotK, c.num_kv_heads}}) {
    const auto plain = Hook64(*m, *t, hook, 0), turned = Hook64(*m, *t, rot, 0);
    const int64_t w = int64_t{heads} * c.head_dim;
    const auto row = [w](const std::vector<double>& v, int i) {
      return std::vector<double>(v.begin() + i * w, v.begin() + (i + 1) * w);
    };
    EXPECT_EQ(row(plain, 0), row(turned, 0)) << HookName(hook);
    for (int i : {2, 4}) {
      const auto a = row(plain, 0), b = row(plain, i);
      for (int64_t d = 0; d < w; ++d) EXPECT_NEAR(a[d], b[d], 1e-12) << HookName(hook) << i;
      EXPECT_NE(row(turned, 0), row(turned, i)) << HookName(rot) << i;
    }
    const auto a = row(plain, 1), b = row(plain, 3);
    for (int64_t d = 0; d < w; ++d) EXPECT_NEAR(a[d], b[d], 1e-12) << HookName(hook);
  }
}

// Each norm's normalized rows, through its weight (and GPT-2's bias), are what the forward's
// norm wrote (the tape's xn, hn, xf); times the scale they give back the stream it read
// (centred, for LayerNorm).
TEST_P(TinyActivations, NormalizedRowsThroughTheWeightAreTheNormsOutput) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  const int n = t.n, D = c.dim;
  struct Norm {
    Hook scale, normalized, input;
    int layer;
    const std::vector<double>* out;
    kernels::WeightView w, b;
  };
  std::vector<Norm> norms;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = m->weights.layers[l];
    norms.push_back({Hook::kLn1Scale, Hook::kLn1Normalized, Hook::kResidPre, l, &t.layers[l].xn,
                     lw.attn_norm, lw.attn_norm_bias});
    norms.push_back({Hook::kLn2Scale, Hook::kLn2Normalized, Hook::kResidMid, l, &t.layers[l].hn,
                     lw.ffn_norm, lw.ffn_norm_bias});
  }
  norms.push_back({Hook::kLnFinalScale, Hook::kLnFinalNormalized, Hook::kResidPost,
                   c.num_layers - 1, &t.xf, m->weights.final_norm, m->weights.final_norm_bias});
  for (const Norm& nm : norms) {
    const int layer = HookIsPerLayer(nm.normalized) ? nm.layer : -1;
    const auto scale = Hook64(*m, t, nm.scale, layer),
               normalized = Hook64(*m, t, nm.normalized, layer),
               x = Hook64(*m, t, nm.input, nm.layer);
    ASSERT_EQ(scale.size(), size_t(n));
    ASSERT_EQ(normalized.size(), size_t(n) * D);
    const std::vector<double> w = Row(nm.w, 0);
    const std::vector<double> b = nm.b.empty() ? std::vector<double>(D, 0.0) : Row(nm.b, 0);
    for (int i = 0; i < n; ++i) {
      double mean = 0;
      if (c.arch == Architecture::kGpt2) {
        for (int j = 0; j < D; ++j) mean += x[int64_t{i} * D + j] / D;
      }
      for (int j = 0; j < D; ++j) {
        const int64_t at = int64_t{i} * D + j;
        EXPECT_NEAR(normalized[at] * w[j] + b[j], (*nm.out)[at], 1e-12) << HookName(nm.normalized);
        EXPECT_NEAR(normalized[at] * scale[i], x[at] - mean, 1e-12) << HookName(nm.scale);
      }
    }
  }
}

// Gemma 2/3's block-output norms (TransformerLens's ln1_post, ln2_post), from inputs formed
// here: the heads' results summed (O·W_Oᵀ) and mlp_post through W_out. Each scale is
// √(mean(in²) + ε) of that input, normalized · scale gives it back, and normalized through
// the norm's weight is attn_out / mlp_out. Models without the norms refuse the hooks.
TEST_P(TinyActivations, BlockOutputNormsReadTheBlocksOutputs) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  kernels::ReferenceBackend be;
  if (!c.sandwich_norms) {
    for (Hook hook : {Hook::kLn1PostScale, Hook::kLn1PostNormalized, Hook::kLn2PostScale,
                      Hook::kLn2PostNormalized}) {
      const auto r = ReadHook(*m, be, t, hook, 0, 0, t.n);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << HookName(hook);
      EXPECT_NE(r.status().message().find(absl::StrCat(std::string(HookName(hook)), ": the model")),
                std::string::npos)
          << r.status();
    }
    return;
  }
  const int n = t.n, H = c.num_heads, D = c.dim, F = c.hidden_dim;
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = m->weights.layers[l];
    const auto result = Hook64(*m, t, Hook::kResult, l), post = Hook64(*m, t, Hook::kMlpPost, l);
    std::vector<double> attn_in(int64_t{n} * D, 0.0), ffn_in(int64_t{n} * D, 0.0);
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < H; ++h)
        for (int j = 0; j < D; ++j)
          attn_in[int64_t{i} * D + j] += result[(int64_t{i} * H + h) * D + j];
      for (int j = 0; j < D; ++j) {
        const std::vector<double> down = Row(lw.w_out, j);
        for (int f = 0; f < F; ++f)
          ffn_in[int64_t{i} * D + j] += post[int64_t{i} * F + f] * down[f];
      }
    }
    for (auto [scale_hook, normalized_hook, out_hook, in, weight] :
         {std::tuple{Hook::kLn1PostScale, Hook::kLn1PostNormalized, Hook::kAttnOut, &attn_in,
                     lw.post_attn_norm},
          std::tuple{Hook::kLn2PostScale, Hook::kLn2PostNormalized, Hook::kMlpOut, &ffn_in,
                     lw.post_ffn_norm}}) {
      const auto scale = Hook64(*m, t, scale_hook, l),
                 normalized = Hook64(*m, t, normalized_hook, l), out = Hook64(*m, t, out_hook, l);
      ASSERT_EQ(scale.size(), size_t(n));
      ASSERT_EQ(normalized.size(), size_t(n) * D);
      const std::vector<double> w = Row(weight, 0);
      for (int i = 0; i < n; ++i) {
        double ss = 0;
        for (int j = 0; j < D; ++j) ss += (*in)[int64_t{i} * D + j] * (*in)[int64_t{i} * D + j];
        EXPECT_NEAR(scale[i], std::sqrt(ss / D + c.norm_eps), 1e-12) << HookName(scale_hook);
        for (int j = 0; j < D; ++j) {
          const int64_t at = int64_t{i} * D + j;
          EXPECT_NEAR(normalized[at] * scale[i], (*in)[at], 1e-12) << HookName(normalized_hook);
          EXPECT_NEAR(normalized[at] * w[j], out[at], 1e-12) << HookName(normalized_hook);
        }
      }
    }
  }
}

// The embeddings read from the tables (Gemma's times √D) are the first layer's stream:
// resid_pre.0 = embed (+ GPT-2's pos_embed).
TEST_P(TinyActivations, EmbeddingsAreTheFirstStream) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  const bool gpt2 = c.arch == Architecture::kGpt2;
  const auto embed = Hook64(*m, t, Hook::kEmbed, -1), x = Hook64(*m, t, Hook::kResidPre, 0);
  const auto pos = gpt2 ? Hook64(*m, t, Hook::kPosEmbed, -1) : std::vector<double>(x.size());
  ASSERT_EQ(embed.size(), x.size());
  ASSERT_EQ(pos.size(), x.size());
  for (int i = 0; i < t.n; ++i) {
    const std::vector<double> row = Row(m->weights.token_embedding, kTokens[i]);
    for (int j = 0; j < c.dim; ++j) {
      const int64_t at = int64_t{i} * c.dim + j;
      EXPECT_NEAR(embed[at], row[j] * c.embedding_scale, 1e-12) << i;
      EXPECT_NEAR(embed[at] + pos[at], x[at], 1e-12) << i;
    }
  }
}

// A gated FFN's hidden is its activation of mlp_pre times mlp_pre_linear (SiLU, or Gemma's
// GELU with the tanh approximation), computed here; GPT-2 has no such hook.
TEST_P(TinyActivations, GatedHiddenIsTheGateTimesTheUpProjection) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  if (c.arch != Architecture::kLlama) {
    kernels::ReferenceBackend be;
    const auto r = ReadHook(*m, be, t, Hook::kMlpPreLinear, 0, 0, 1);
    EXPECT_NE(r.status().message().find("mlp_pre_linear: the model (gpt2) has no gated"),
              std::string::npos)
        << r.status();
    return;
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const auto pre = Hook64(*m, t, Hook::kMlpPre, l), up = Hook64(*m, t, Hook::kMlpPreLinear, l),
               post = Hook64(*m, t, Hook::kMlpPost, l);
    ASSERT_EQ(up.size(), size_t(t.n) * c.hidden_dim);
    for (size_t i = 0; i < up.size(); ++i) {
      const double g = pre[i];
      const double act =
          c.gate_activation == GateActivation::kSilu
              ? g / (1 + std::exp(-g))
              : 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)));
      EXPECT_NEAR(post[i], act * up[i], 1e-12) << l << " " << i;
    }
  }
}

// pattern = softmax(attn_scores) row by row, head first [H, n, Tk]: a masked key is −∞
// there and 0 here; row 0 puts all of it on key 0.
TEST_P(TinyActivations, PatternIsTheSoftmaxOfTheScores) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  const int n = t.n, tk = t.num_keys, H = c.num_heads;
  for (int l = 0; l < c.num_layers; ++l) {
    const auto scores = Hook64(*m, t, Hook::kAttnScores, l), p = Hook64(*m, t, Hook::kPattern, l);
    ASSERT_EQ(scores.size(), size_t(H) * n * tk);
    ASSERT_EQ(p.size(), scores.size());
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < n; ++i) {
        const double* s = scores.data() + (int64_t{h} * n + i) * tk;
        const double* row = p.data() + (int64_t{h} * n + i) * tk;
        double top = -INFINITY, sum = 0;
        for (int k = 0; k < tk; ++k) top = std::max(top, s[k]);
        for (int k = 0; k < tk; ++k) sum += std::exp(s[k] - top);
        for (int k = 0; k < tk; ++k) {
          if (k > i) {
            EXPECT_EQ(s[k], -INFINITY) << l << " " << h << " " << i << " " << k;
          }
          EXPECT_NEAR(row[k], std::exp(s[k] - top) / sum, 1e-12) << l << " " << h << " " << i;
        }
        if (i == 0) {
          EXPECT_EQ(row[0], 1.0);
        }
      }
    }
  }
}

// ln_final · W_Uᵀ = the logits (soft-capped after, where the model caps them).
TEST_P(TinyActivations, FinalNormThroughTheUnembeddingIsTheLogits) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  const auto xf = Hook64(*m, t, Hook::kLnFinal, -1);
  for (int i = 0; i < t.n; ++i) {
    for (int v = 0; v < c.vocab_size; ++v) {
      const std::vector<double> u = Row(m->weights.output, v);
      double s = 0;
      for (int j = 0; j < c.dim; ++j) s += xf[int64_t{i} * c.dim + j] * u[j];
      if (c.final_softcap > 0) s = c.final_softcap * std::tanh(s / c.final_softcap);
      EXPECT_NEAR(s, t.logits[int64_t{i} * c.vocab_size + v], 1e-12);
    }
  }
}

// A range of rows is that slice of the whole; fp32 on the CPU backend agrees with fp64.
TEST_P(TinyActivations, RowRangesAndTheFp32Backend) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  kernels::CpuBackend fast(2);
  kernels::ReferenceBackend ref;
  auto t32 = RunForward(*m, fast, SequenceInput<float>{kTokens});
  ASSERT_TRUE(t32.ok()) << t32.status();
  for (Hook hook : AllHooks()) {
    if (!CheckModelHasHook(c, hook).ok()) continue;
    const int layer = HookIsPerLayer(hook) ? 1 : -1;
    const auto all = Hook64(*m, t, hook, layer);
    auto part = ReadHook(*m, ref, t, hook, layer, 2, 5);
    ASSERT_TRUE(part.ok()) << part.status();
    const int64_t w = HookRowElements(c, hook, t.num_keys);
    std::vector<double> want;  // rows 2 … 4 of each head's map, or of the rows
    const bool maps = hook == Hook::kAttnScores || hook == Hook::kPattern;
    for (int64_t h = 0; h < (maps ? c.num_heads : 1); ++h) {
      const int64_t head = maps ? h * t.n * t.num_keys : 0, row = maps ? t.num_keys : w;
      want.insert(want.end(), all.begin() + head + 2 * row, all.begin() + head + 5 * row);
    }
    EXPECT_EQ(*part, want) << HookName(hook);
    std::vector<int64_t> shape = {3};
    for (int64_t d : HookRowShape(c, hook, t.num_keys)) shape.push_back(d);
    if (maps) shape = {c.num_heads, 3, t.num_keys};
    EXPECT_EQ(HookShape(c, hook, 3, t.num_keys), shape) << HookName(hook);
    auto f = ReadHook(*m, fast, *t32, hook, layer, 0, static_cast<int>(kTokens.size()));
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_EQ(f->size(), all.size());
    double scale = 0, err = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      if ((*f)[i] == all[i]) continue;  // (a masked score: −∞ in both)
      scale = std::max(scale, std::abs(all[i]));
      err = std::max(err, std::abs((*f)[i] - all[i]));
    }
    EXPECT_LE(err, 1e-5 * std::max(scale, 1.0)) << HookName(hook);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TinyActivations, ::testing::Range(0, testing::kTinyFamilies));

TEST(Activations, NamesAndErrors) {
  constexpr const char* kNames[] = {"resid_pre",
                                    "resid_mid",
                                    "resid_post",
                                    "attn_out",
                                    "mlp_out",
                                    "z",
                                    "result",
                                    "q",
                                    "k",
                                    "v",
                                    "mlp_pre",
                                    "mlp_post",
                                    "ln_final",
                                    "attn_scores",
                                    "pattern",
                                    "rot_q",
                                    "rot_k",
                                    "ln1_scale",
                                    "ln1_normalized",
                                    "ln2_scale",
                                    "ln2_normalized",
                                    "ln_final_scale",
                                    "ln_final_normalized",
                                    "embed",
                                    "pos_embed",
                                    "mlp_pre_linear",
                                    "ln1_post_scale",
                                    "ln1_post_normalized",
                                    "ln2_post_scale",
                                    "ln2_post_normalized"};
  for (const char* name : kNames) {
    const auto h = HookByName(name);
    ASSERT_TRUE(h.has_value()) << name;
    EXPECT_EQ(HookName(*h), name);
    const auto named = ParseHookName(name);
    ASSERT_TRUE(named.has_value()) << name;
    EXPECT_EQ(named->hook, *h);
    EXPECT_FALSE(named->layer.has_value()) << name;
  }
  EXPECT_EQ(AllHooks().size(), std::size(kNames));
  EXPECT_FALSE(HookByName("hook_resid_pre").has_value());
  EXPECT_NE(HookNameList().find("rot_k"), std::string::npos);
  // TransformerLens's full names, as its utils.get_act_name writes them.
  for (auto [full, hook, layer] :
       {std::tuple{"blocks.0.hook_resid_pre", Hook::kResidPre, 0},
        std::tuple{"blocks.11.hook_resid_post", Hook::kResidPost, 11},
        std::tuple{"blocks.3.attn.hook_pattern", Hook::kPattern, 3},
        std::tuple{"blocks.2.attn.hook_attn_scores", Hook::kAttnScores, 2},
        std::tuple{"blocks.1.attn.hook_rot_q", Hook::kRotQ, 1},
        std::tuple{"blocks.1.attn.hook_k", Hook::kK, 1},
        std::tuple{"blocks.4.mlp.hook_pre", Hook::kMlpPre, 4},
        std::tuple{"blocks.4.mlp.hook_post", Hook::kMlpPost, 4},
        std::tuple{"blocks.4.mlp.hook_pre_linear", Hook::kMlpPreLinear, 4},
        std::tuple{"blocks.5.attn.hook_result", Hook::kResult, 5},
        std::tuple{"blocks.2.ln1.hook_scale", Hook::kLn1Scale, 2},
        std::tuple{"blocks.0.ln2.hook_normalized", Hook::kLn2Normalized, 0},
        std::tuple{"blocks.3.ln1_post.hook_scale", Hook::kLn1PostScale, 3},
        std::tuple{"blocks.0.ln2_post.hook_normalized", Hook::kLn2PostNormalized, 0}}) {
    const auto named = ParseHookName(full);
    ASSERT_TRUE(named.has_value()) << full;
    EXPECT_EQ(named->hook, hook) << full;
    EXPECT_EQ(named->layer, std::optional<int>(layer)) << full;
    EXPECT_EQ(HookFullName(hook, layer), full);
  }
  for (auto [full, hook] :
       {std::pair{"ln_final.hook_normalized", Hook::kLnFinalNormalized},
        std::pair{"ln_final.hook_scale", Hook::kLnFinalScale},
        std::pair{"hook_embed", Hook::kEmbed}, std::pair{"hook_pos_embed", Hook::kPosEmbed}}) {
    const auto final_norm = ParseHookName(full);
    ASSERT_TRUE(final_norm.has_value()) << full;
    EXPECT_EQ(final_norm->hook, hook);
    EXPECT_FALSE(final_norm->layer.has_value());
    EXPECT_EQ(HookFullName(hook, 3), full);
  }
  // The final norm's output, weight in, is no hook of TransformerLens's: its short name.
  EXPECT_EQ(HookFullName(Hook::kLnFinal, 3), "ln_final");
  for (const char* bad :
       {"blocks.1.hook_q", "blocks.-1.hook_resid_pre", "blocks.x.attn.hook_z",
        "blocks..hook_resid_pre", "blocks.1.ln_final.hook_normalized",
        "blocks.1.attn.hook_pattern ", "hook_pattern", "blocks.1", "blocks.1.ln_final.hook_scale",
        "ln1.hook_scale", "blocks.0.hook_embed"}) {
    EXPECT_FALSE(ParseHookName(bad).has_value()) << bad;
  }
  // GPT-2 has no rotary embedding: rot_q and rot_k are refused, naming themselves.
  auto gpt2 = testing::MakeTinyModel(testing::TinyFamilySpec(0));
  ASSERT_EQ(gpt2->config.arch, Architecture::kGpt2);
  const Tape<double> gt = MustTape(*gpt2);
  kernels::ReferenceBackend ref;
  for (Hook hook : {Hook::kRotQ, Hook::kRotK}) {
    const auto r = ReadHook(*gpt2, ref, gt, hook, 0, 0, 2);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(absl::StrCat(std::string(HookName(hook)),
                                                     ": the model (gpt2) has no "
                                                     "rotary embedding")),
              std::string::npos)
        << r.status();
  }
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(1));
  const Tape<double> t = MustTape(*m);
  kernels::ReferenceBackend be;
  const int n = static_cast<int>(kTokens.size());
  // A rotary model has no learned positions: pos_embed is refused, naming itself.
  const auto pos = ReadHook(*m, be, t, Hook::kPosEmbed, -1, 0, 2);
  EXPECT_EQ(pos.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(pos.status().message().find("pos_embed: the model (llama) has no learned position"),
            std::string::npos)
      << pos.status();
  for (auto [hook, layer, b, e] :
       {std::tuple{Hook::kZ, 2, 0, n}, std::tuple{Hook::kZ, -1, 0, n},
        std::tuple{Hook::kQ, 0, 0, n + 1}, std::tuple{Hook::kResidPre, 0, 3, 3},
        std::tuple{Hook::kLnFinal, -1, -1, 2}}) {
    const auto r = ReadHook(*m, be, t, hook, layer, b, e);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << HookName(hook);
    EXPECT_NE(r.status().message().find(std::string(HookName(hook))), std::string::npos)
        << r.status();
  }
}

// Every hook of every layer against the oracle's; fp64 ≤ 1e-9, fp32 ≤ 1e-4 of each
// tensor's largest magnitude.
template <typename T>
double WorstAgainstOracle(const Model& m, kernels::Backend<T>& be,
                          const std::vector<int32_t>& tokens, const testing::OracleResult& ref) {
  const ModelConfig& c = m.config;
  auto t = RunForward(m, be, SequenceInput<T>{tokens});
  EXPECT_TRUE(t.ok()) << t.status();
  double worst = 0;
  for (Hook hook : AllHooks()) {
    if (!CheckModelHasHook(c, hook).ok()) {  // (GPT-2's rot_q, rot_k: the oracle has none)
      EXPECT_EQ(ref.arrays.count(absl::StrCat("act.", std::string(HookName(hook)), ".0")), 0u);
      continue;
    }
    for (int l = HookIsPerLayer(hook) ? 0 : -1; l < (HookIsPerLayer(hook) ? c.num_layers : 0);
         ++l) {
      const std::string name = l < 0 ? absl::StrCat("act.", std::string(HookName(hook)))
                                     : absl::StrCat("act.", std::string(HookName(hook)), ".", l);
      const auto it = ref.arrays.find(name);
      EXPECT_NE(it, ref.arrays.end()) << name;
      if (it == ref.arrays.end()) continue;
      auto ours = ReadHook(m, be, *t, hook, l, 0, static_cast<int>(tokens.size()));
      EXPECT_TRUE(ours.ok()) << ours.status();
      EXPECT_EQ(ours->size(), it->second.data.size()) << name;
      if (ours->size() != it->second.data.size()) continue;
      double num = 0, den = 0;
      for (size_t i = 0; i < ours->size(); ++i) {
        const double got = static_cast<double>((*ours)[i]), want = it->second.data[i];
        if (std::isinf(want) && got == want) continue;  // a masked score, −∞ in both
        num = std::max(num, std::abs(got - want));      // (∞ when only one is masked)
        den = std::max(den, std::abs(want));
      }
      const double e = den > 0 ? num / den : num;
      EXPECT_LE(e, sizeof(T) == 8 ? 1e-9 : 1e-4) << name;
      worst = std::max(worst, e);
    }
  }
  return worst;
}

void ExpectOracleActivations(const std::string& path, const char* label,
                             const std::vector<int32_t>& tokens) {
  auto m = LoadModel({path, ""});
  ASSERT_TRUE(m.ok()) << m.status();
  const testing::OracleResult ref = testing::RunOracleWith(path, tokens, "--activations");
  ASSERT_TRUE(ref.error.empty()) << ref.error;
  kernels::ReferenceBackend ref_be;
  kernels::CpuBackend fast(2);
  const double e64 = WorstAgainstOracle<double>(**m, ref_be, tokens, ref);
  const double e32 = WorstAgainstOracle<float>(**m, fast, tokens, ref);
  std::printf("[oracle] %s activations: worst relative error fp64 %.3g, fp32 %.3g\n", label, e64,
              e32);
}

TEST(ActivationsOracle, Stories260K) {
  const std::string bin = testing::TestData("stories260K/stories260K.bin");
  KVLENS_REQUIRE_FILE(bin);
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  ExpectOracleActivations(bin, "stories260K", {1, 403, 407, 261, 378, 11, 300, 42, 7, 99});
}

TEST(ActivationsOracle, DefaultGpt2Model) {
  const std::string dir = testing::DefaultModelPath();
  KVLENS_REQUIRE_FILE(dir + "/config.json");
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  ExpectOracleActivations(dir, "kjv-gpt2-4l", {0, 34, 290, 1021, 17, 88, 5, 400, 61});
}

// Gemma 2: the block-output norms (attn_out, mlp_out after them; result before), soft caps.
TEST(ActivationsOracle, Gemma2) {
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  const std::string path = testing::MakeQuantizedModel(
      "--f32 --gemma2 --set gemma2.attention.sliding_window=3 --set-float "
      "gemma2.attn_logit_softcapping=2 --set-float gemma2.final_logit_softcapping=3");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  ExpectOracleActivations(path, "gemma2", {2, 5, 300, 17, 42, 383, 9, 77});
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvlens::interpret
