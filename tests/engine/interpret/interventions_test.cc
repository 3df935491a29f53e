// Interventions behave as defined on stories260K: ablating a head changes nothing upstream
// of it, patching a clean run into itself (the stream or a head's output) or overriding a
// row with its own probabilities changes nothing at all (bit for bit), patching a row
// leaves earlier rows alone, a head's patch moves the stream through W_O and equals the
// row override that yields its value, a q, k or v patch equals the perturbations that
// reach its value and follows a cached prefix, masking
// keys renormalises the rest; the logit lens's last layer is the model's logits; and the
// head scores follow their definitions on hand-built attention maps.
#include "engine/interpret/interventions.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/interpret/head_scores.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/weight.h"
#include "tests/engine/random_tokens.h"
#include "tests/engine/stories_model_test.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

class InterventionsTest : public testing::StoriesModelTest {
 protected:
  void SetUp() override {
    StoriesModelTest::SetUp();
    if (NoModel()) return;
    input_.tokens = testing::RandomTokens(14, 9, model_->config.vocab_size);
  }
  Tape<double> Run(const Edits& e = {}) {
    auto t = RunForward(*model_, be_, input_, e);
    EXPECT_TRUE(t.ok()) << t.status();
    return *std::move(t);
  }
  kernels::ReferenceBackend be_;
  SequenceInput<double> input_;
};

// Two edits that must agree: the largest |a − b| over the logits, and how far b moved them
// from `clean` (the largest |b − clean|), which a meaningful check needs well above 0.
struct Agreement {
  double worst = 0;
  double moved = 0;
};
Agreement Agree(const std::vector<double>& a, const std::vector<double>& b,
                const std::vector<double>& clean) {
  Agreement r;
  for (size_t i = 0; i < a.size(); ++i) {
    r.worst = std::max(r.worst, std::abs(a[i] - b[i]));
    r.moved = std::max(r.moved, std::abs(b[i] - clean[i]));
  }
  return r;
}

TEST_F(InterventionsTest, ZeroAblationChangesOnlyDownstream) {
  const int layer = 2, head = 3, dh = model_->config.head_dim, D = model_->config.dim;
  const Tape<double> clean = Run();
  Edits e;
  e.ablations.push_back({layer, head, AblationMode::kZero});
  const Tape<double> ab = Run(e);
  for (int l = 0; l <= layer; ++l) EXPECT_EQ(ab.layers[l].x, clean.layers[l].x) << l;
  EXPECT_EQ(ab.layers[layer].probs, clean.layers[layer].probs);
  for (int i = 0; i < ab.n; ++i) {
    for (int h = 0; h < model_->config.num_heads; ++h) {
      for (int d = 0; d < dh; ++d) {
        const double got = ab.layers[layer].att[i * D + h * dh + d];
        EXPECT_EQ(got, h == head ? 0.0 : clean.layers[layer].att[i * D + h * dh + d]);
      }
    }
  }
  EXPECT_NE(ab.layers[layer + 1].x, clean.layers[layer + 1].x);
  EXPECT_NE(ab.logits, clean.logits);

  const std::vector<TokenTarget> targets = {{13, 42}, {5, 7}};
  auto r = Intervene(*model_, be_, input_, e, targets);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->clean_logits, std::vector<double>(clean.logits.begin(), clean.logits.end()));
  EXPECT_EQ(r->edited_logits, std::vector<double>(ab.logits.begin(), ab.logits.end()));
  ASSERT_EQ(r->edited_logprobs.size(), 2u);
  EXPECT_NE(r->edited_logprobs[0], r->clean_logprobs[0]);
}

TEST_F(InterventionsTest, MeanAblationUsesTheHeadsMeanOutput) {
  const int layer = 1, head = 0, dh = model_->config.head_dim, D = model_->config.dim;
  const Tape<double> clean = Run();
  Edits e;
  e.ablations.push_back({layer, head, AblationMode::kMean});
  const Tape<double> ab = Run(e);
  for (int d = 0; d < dh; ++d) {
    double mean = 0;
    for (int i = 0; i < clean.n; ++i) mean += clean.layers[layer].att[i * D + head * dh + d];
    mean /= clean.n;
    for (int i = 0; i < ab.n; ++i)
      EXPECT_NEAR(ab.layers[layer].att[i * D + head * dh + d], mean, 1e-15);
  }
}

TEST_F(InterventionsTest, PatchingACleanRunIntoItselfChangesNothing) {
  const Tape<double> clean = Run();
  Edits e;
  for (PatchSite site :
       {PatchSite::kResidPre, PatchSite::kResidMid, PatchSite::kAttnOut, PatchSite::kMlpOut}) {
    const int last =
        site == PatchSite::kResidPre ? model_->config.num_layers : model_->config.num_layers - 1;
    for (int l = 0; l <= last; ++l) {
      for (int row : {0, 6, 13}) {
        auto p = PatchFrom(clean, model_->config, l, row, row, site);
        ASSERT_TRUE(p.ok()) << p.status();
        e.patches.push_back(*p);
      }
    }
  }
  EXPECT_EQ(Run(e).logits, clean.logits);
}

// Patching what a block adds (attn_out, mlp_out) or the stream between the blocks
// (resid_mid) from another prompt: the patched row carries the source's tensor and the
// stream adds it to its own; and the sites agree with one another where they must, bit for
// bit on the rows up to the patched one: resid_pre + attn_out of a row is its resid_mid,
// and resid_mid + mlp_out of layer l is resid_pre of layer l + 1.
TEST_F(InterventionsTest, PatchingBlockOutputsAndTheMiddleStream) {
  const ModelConfig& c = model_->config;
  SequenceInput<double> other{testing::RandomTokens(14, 10, c.vocab_size)};
  auto src = RunForward(*model_, be_, other);
  ASSERT_TRUE(src.ok());
  const Tape<double> clean = Run();
  const int layer = 2, row = 7, D = c.dim, V = c.vocab_size;
  auto patched = [&](std::initializer_list<std::pair<PatchSite, int>> sites) {
    Edits e;
    for (auto [site, l] : sites) {
      auto p = PatchFrom(*src, c, l, row, row, site);
      EXPECT_TRUE(p.ok()) << p.status();
      if (p.ok()) e.patches.push_back(*p);
    }
    return Run(e);
  };
  const Tape<double> attn = patched({{PatchSite::kAttnOut, layer}}),
                     mlp = patched({{PatchSite::kMlpOut, layer}}),
                     mid = patched({{PatchSite::kResidMid, layer}});
  const LayerTape<double>& s = src->layers[layer];
  for (int d = 0; d < D; ++d) {
    const int64_t at = int64_t{row} * D + d;
    EXPECT_EQ(attn.layers[layer].attn_delta[at], s.attn_delta[at]);
    EXPECT_EQ(attn.layers[layer].h[at], clean.layers[layer].x[at] + s.attn_delta[at]);
    EXPECT_EQ(mlp.layers[layer].ffn_delta[at], s.ffn_delta[at]);
    EXPECT_EQ(mlp.layers[layer + 1].x[at], clean.layers[layer].h[at] + s.ffn_delta[at]);
    EXPECT_EQ(mid.layers[layer].h[at], s.h[at]);
  }
  EXPECT_EQ(mid.layers[layer].attn_delta, clean.layers[layer].attn_delta);
  for (const Tape<double>* t : {&attn, &mlp, &mid}) {
    for (int i = 0; i < row * V; ++i) ASSERT_EQ(t->logits[i], clean.logits[i]) << i / V;
    EXPECT_NE(t->logits[row * V], clean.logits[row * V]);
  }
  auto same_rows = [&](const Tape<double>& a, const Tape<double>& b) {
    for (int i = 0; i < (row + 1) * V; ++i) {
      if (a.logits[i] != b.logits[i]) return ::testing::AssertionFailure() << "logit " << i;
    }
    return ::testing::AssertionSuccess();
  };
  EXPECT_TRUE(
      same_rows(patched({{PatchSite::kResidPre, layer}, {PatchSite::kAttnOut, layer}}), mid));
  EXPECT_TRUE(same_rows(patched({{PatchSite::kResidMid, layer}, {PatchSite::kMlpOut, layer}}),
                        patched({{PatchSite::kResidPre, layer + 1}})));
  // resid_mid, attn_out and mlp_out have no layer L; the error names the site.
  EXPECT_FALSE(PatchFrom(*src, c, c.num_layers, row, row, PatchSite::kMlpOut).ok());
  Edits bad;
  bad.patches.push_back({c.num_layers, row, std::vector<double>(D, 0.0), PatchSite::kResidMid});
  const auto t = RunForward(*model_, be_, input_, bad);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("residual patch of resid_mid (layer"), std::string::npos)
      << t.status();
}

TEST_F(InterventionsTest, PatchingFromAnotherPromptChangesOnlyLaterRows) {
  SequenceInput<double> other{testing::RandomTokens(14, 10, model_->config.vocab_size)};
  auto src = RunForward(*model_, be_, other);
  ASSERT_TRUE(src.ok());
  const Tape<double> clean = Run();
  const int layer = 3, row = 8, V = model_->config.vocab_size;
  auto p = PatchFrom(*src, model_->config, layer, row, row);
  ASSERT_TRUE(p.ok());
  Edits e;
  e.patches.push_back(*p);
  const Tape<double> patched = Run(e);
  for (int i = 0; i < row * V; ++i) ASSERT_EQ(patched.logits[i], clean.logits[i]) << i / V;
  EXPECT_NE(patched.logits[row * V], clean.logits[row * V]);
  // From the patched layer on, the patched row carries the other prompt's stream exactly.
  for (int d = 0; d < model_->config.dim; ++d) {
    EXPECT_EQ(patched.layers[layer].x[row * model_->config.dim + d],
              src->layers[layer].x[row * model_->config.dim + d]);
  }
}

// Head patching (TransformerLens's attn.hook_z patched by position): a clean run into
// itself changes nothing, bit for bit; from another prompt, the patched head's row carries
// the source's output, the stream after the layer moves by exactly (z_src − z)·W_O[:, h]ᵀ
// (computed here from the weights) at that row, and earlier rows do not move.
TEST_F(InterventionsTest, PatchingAHeadMovesTheStreamByItsOutputThroughWO) {
  const ModelConfig& c = model_->config;
  const Tape<double> clean = Run();
  Edits self;
  for (int l = 0; l < c.num_layers; ++l) {
    for (int row : {0, 13}) {
      auto p = HeadPatchFrom(clean, c, l, (l * 3) % c.num_heads, row, row);
      ASSERT_TRUE(p.ok()) << p.status();
      self.head_patches.push_back(*p);
    }
  }
  EXPECT_EQ(Run(self).logits, clean.logits);

  SequenceInput<double> other{testing::RandomTokens(14, 10, c.vocab_size)};
  auto src = RunForward(*model_, be_, other);
  ASSERT_TRUE(src.ok());
  const int layer = 3, head = 5, row = 8, from = 11, V = c.vocab_size, D = c.dim, dh = c.head_dim,
            QD = c.q_dim();
  auto p = HeadPatchFrom(*src, c, layer, head, from, row);
  ASSERT_TRUE(p.ok()) << p.status();
  Edits e;
  e.head_patches.push_back(*p);
  const Tape<double> patched = Run(e);
  for (int i = 0; i < row * V; ++i) ASSERT_EQ(patched.logits[i], clean.logits[i]) << i / V;
  EXPECT_NE(patched.logits[row * V], clean.logits[row * V]);
  const LayerTape<double>&cl = clean.layers[layer], &pl = patched.layers[layer];
  EXPECT_EQ(pl.x, cl.x);
  for (int i = 0; i < clean.n; ++i) {
    for (int h = 0; h < c.num_heads; ++h) {
      for (int d = 0; d < dh; ++d) {
        const int64_t at = int64_t{i} * QD + h * dh + d;
        const double want =
            i == row && h == head ? src->layers[layer].att[from * QD + h * dh + d] : cl.att[at];
        ASSERT_EQ(pl.att[at], want) << i << " " << h << " " << d;
      }
    }
  }
  std::vector<double> wo(static_cast<size_t>(QD));
  for (int j = 0; j < D; ++j) {
    kernels::DequantizeRow(model_->weights.layers[layer].wo, j, wo.data());
    double moved = 0;
    for (int d = 0; d < dh; ++d) {
      moved +=
          (pl.att[row * QD + head * dh + d] - cl.att[row * QD + head * dh + d]) * wo[head * dh + d];
    }
    EXPECT_NEAR(pl.h[row * D + j] - cl.h[row * D + j], moved, 1e-12) << j;
    EXPECT_EQ(pl.h[(row - 1) * D + j], cl.h[(row - 1) * D + j]) << j;
  }
  // Out of range, or a value of the wrong width, is refused naming the patch.
  for (auto [l, h, r, width] :
       {std::tuple{c.num_layers, 0, 0, dh}, std::tuple{0, c.num_heads, 0, dh},
        std::tuple{0, 0, 14, dh}, std::tuple{0, 0, 0, dh + 1}}) {
    Edits bad;
    bad.head_patches.push_back({l, h, r, std::vector<double>(width, 0.0)});
    const auto t = RunForward(*model_, be_, input_, bad);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("head patch"), std::string::npos) << t.status();
  }
  EXPECT_FALSE(HeadPatchFrom(*src, c, 0, 0, 14, 0).ok());
}

// A q, k or v patch writes where the tape's perturbations of that tensor (Coord, a separate
// mechanism) do: it equals the perturbations by source − clean of its Dh entries, up to the
// sum's rounding, and leaves the earlier rows' logits exact. k and v of stories260K's KV
// head 3 (8 heads on 4).
TEST_F(InterventionsTest, PatchingAQueryKeyOrValueIsThePerturbationThatReachesIt) {
  const ModelConfig& c = model_->config;
  const Tape<double> clean = Run();
  auto src =
      RunForward(*model_, be_, SequenceInput<double>{testing::RandomTokens(14, 10, c.vocab_size)});
  ASSERT_TRUE(src.ok());
  const int layer = 2, head = 3, row = 9, from = 7, V = c.vocab_size;
  for (TensorKind kind : {TensorKind::kQ, TensorKind::kK, TensorKind::kV}) {
    SCOPED_TRACE(TensorKindName(kind));
    auto p = HeadPatchFrom(*src, c, layer, head, from, row, kind);
    ASSERT_TRUE(p.ok()) << p.status();
    Edits patch, perturb;
    patch.head_patches.push_back(*p);
    for (int d = 0; d < c.head_dim; ++d) {
      const Coord at{kind, layer, head, row, d};
      EXPECT_EQ(p->value[d], TapeValue(*src, c, Coord{kind, layer, head, from, d})) << d;
      perturb.perturbations.push_back({at, p->value[d] - TapeValue(clean, c, at)});
    }
    const Tape<double> a = Run(patch), b = Run(perturb);
    for (int i = 0; i < row * V; ++i) ASSERT_EQ(a.logits[i], clean.logits[i]) << i / V;
    const Agreement g = Agree(a.logits, b.logits, clean.logits);
    EXPECT_GT(g.moved, 1e-3);  // the patch matters
    EXPECT_LE(g.worst, 1e-12);
  }
  // A KV head past num_kv_heads, or a tensor that is not a head's vector, is refused.
  Edits bad;
  bad.head_patches.push_back(
      {0, c.num_kv_heads, 0, std::vector<double>(c.head_dim, 0.0), TensorKind::kV});
  auto t = RunForward(*model_, be_, input_, bad);
  EXPECT_NE(t.status().message().find("head patch of v (layer 0, head 4, row 0) is out of range"),
            std::string::npos)
      << t.status();
  bad.head_patches[0] = {0, 0, 0, std::vector<double>(c.head_dim, 0.0), TensorKind::kScores};
  t = RunForward(*model_, be_, input_, bad);
  EXPECT_NE(t.status().message().find("only q, k, v and attn_out"), std::string::npos)
      << t.status();
  EXPECT_FALSE(HeadPatchFrom(*src, c, 0, c.num_kv_heads, 0, 0, TensorKind::kK).ok());
  EXPECT_TRUE(HeadPatchFrom(*src, c, 0, c.num_kv_heads, 0, 0, TensorKind::kQ).ok());
}

// With the first 6 tokens as a cached prefix (its keys and values leaves, as a session's
// cache gives them), patching the k or v of new row r — read from a source run that also
// has a prefix — is patching row 6 + r of the whole sequence.
TEST_F(InterventionsTest, KeyAndValuePatchesOfNewTokensFollowTheCachedPrefix) {
  const ModelConfig& c = model_->config;
  const int offset = 6, layer = 1, kv_head = 2, row = 4, from = 5, V = c.vocab_size;
  const int64_t prefix = int64_t{offset} * c.kv_dim();
  auto with_prefix = [&](const SequenceInput<double>& whole) {
    const Tape<double> t = *RunForward(*model_, be_, whole);
    SequenceInput<double> in;
    in.tokens.assign(whole.tokens.begin() + offset, whole.tokens.end());
    in.offset = offset;
    for (const LayerTape<double>& lt : t.layers) {
      in.prefix_k.emplace_back(lt.k.begin(), lt.k.begin() + prefix);
      in.prefix_v.emplace_back(lt.v.begin(), lt.v.begin() + prefix);
    }
    return in;
  };
  const Tape<double> clean = Run();
  const SequenceInput<double> other{testing::RandomTokens(14, 10, c.vocab_size)};
  const SequenceInput<double> part = with_prefix(input_), other_part = with_prefix(other);
  auto src = RunForward(*model_, be_, other), src_part = RunForward(*model_, be_, other_part);
  ASSERT_TRUE(src.ok() && src_part.ok());
  for (TensorKind kind : {TensorKind::kK, TensorKind::kV}) {
    SCOPED_TRACE(TensorKindName(kind));
    auto whole_patch = HeadPatchFrom(*src, c, layer, kv_head, offset + from, offset + row, kind);
    auto part_patch = HeadPatchFrom(*src_part, c, layer, kv_head, from, row, kind);
    ASSERT_TRUE(whole_patch.ok() && part_patch.ok());
    for (int d = 0; d < c.head_dim; ++d) {
      EXPECT_NEAR(part_patch->value[d], whole_patch->value[d], 1e-12) << d;
    }
    Edits e_whole, e_part;
    e_whole.head_patches.push_back(*whole_patch);
    e_part.head_patches.push_back(*part_patch);
    const Tape<double> whole = Run(e_whole);
    auto t = RunForward(*model_, be_, part, e_part);
    ASSERT_TRUE(t.ok()) << t.status();
    // the new rows against the whole sequence's rows offset …
    const auto tail = [&](const std::vector<double>& logits) {
      return std::vector<double>(logits.begin() + int64_t{offset} * V, logits.end());
    };
    const Agreement g = Agree(t->logits, tail(whole.logits), tail(clean.logits));
    EXPECT_GT(g.moved, 1e-3);
    EXPECT_LE(g.worst, 1e-11);
  }
}

// Patching a head's row with Σ_j r_j v_j (the values of its KV head, computed here) for a
// hand-made attention row r is overriding that row with r: the two edits reach the same
// logits by different paths.
TEST_F(InterventionsTest, PatchingAHeadWithAWeightingOfItsValuesIsARowOverride) {
  const ModelConfig& c = model_->config;
  const Tape<double> clean = Run();
  const int layer = 2, head = 6, row = 9, tk = clean.num_keys, dh = c.head_dim;
  const int kvh = head / (c.num_heads / c.num_kv_heads);
  std::vector<double> r(tk, 0.0);
  for (int j = 0; j <= row; ++j) r[j] = (j + 1.0) / ((row + 1) * (row + 2) / 2.0);
  HeadPatch p{layer, head, row, std::vector<double>(dh, 0.0)};
  for (int j = 0; j <= row; ++j) {
    for (int d = 0; d < dh; ++d) {
      p.value[d] += r[j] * clean.layers[layer].v[int64_t{j} * c.kv_dim() + kvh * dh + d];
    }
  }
  Edits patch, over;
  patch.head_patches.push_back(p);
  over.row_overrides.push_back({layer, head, row, r, {}});
  const Tape<double> a = Run(patch), b = Run(over);
  const Agreement g = Agree(a.logits, b.logits, clean.logits);
  EXPECT_GT(g.moved, 1e-3);  // the edit matters
  EXPECT_LE(g.worst, 1e-12);
}

TEST_F(InterventionsTest, OverridingARowWithItsOwnProbabilitiesChangesNothing) {
  const Tape<double> clean = Run();
  const int tk = clean.num_keys, n = clean.n;
  Edits e;
  for (int row : {0, 7, 13}) {
    RowOverride o{2, 1, row};
    const double* p = clean.layers[2].probs.data() + (1 * n + row) * tk;
    o.probs.assign(p, p + tk);
    e.row_overrides.push_back(o);
  }
  EXPECT_EQ(Run(e).logits, clean.logits);
  // the same in fp32
  kernels::CpuBackend fast(1);
  SequenceInput<float> in{input_.tokens};
  auto cf = RunForward(*model_, fast, in);
  ASSERT_TRUE(cf.ok());
  Edits ef;
  RowOverride of{4, 7, 9};
  const float* pf = cf->layers[4].probs.data() + (7 * n + 9) * tk;
  of.probs.assign(pf, pf + tk);
  ef.row_overrides.push_back(of);
  auto ff = RunForward(*model_, fast, in, ef);
  ASSERT_TRUE(ff.ok());
  EXPECT_EQ(ff->logits, cf->logits);
}

TEST_F(InterventionsTest, MaskingKeysRenormalisesTheRest) {
  const Tape<double> clean = Run();
  const int tk = clean.num_keys, n = clean.n, layer = 1, head = 2, row = 10;
  Edits e;
  e.row_overrides.push_back({layer, head, row, {}, {0, 3, 4}});
  const Tape<double> ed = Run(e);
  const double* a = clean.layers[layer].probs.data() + (head * n + row) * tk;
  const double* b = ed.layers[layer].probs.data() + (head * n + row) * tk;
  const double kept = 1.0 - a[0] - a[3] - a[4];
  for (int j = 0; j < tk; ++j) {
    const double want = (j == 0 || j == 3 || j == 4) ? 0.0 : a[j] / kept;
    EXPECT_NEAR(b[j], want, 1e-15) << j;
  }
  // masking every visible key is an error naming the row
  Edits all;
  std::vector<int> keys(row + 1);
  for (int j = 0; j <= row; ++j) keys[j] = j;
  all.row_overrides.push_back({layer, head, row, {}, keys});
  auto bad = RunForward(*model_, be_, input_, all);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("row 10"), std::string::npos) << bad.status();
  // giving probability to a future key is rejected too
  Edits future;
  std::vector<double> p(tk, 0.0);
  p[row + 1] = 1.0;
  future.row_overrides.push_back({layer, head, row, p, {}});
  EXPECT_EQ(RunForward(*model_, be_, input_, future).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(InterventionsTest, LogitLensLastLayerIsTheModelsLogits) {
  const Tape<double> clean = Run();
  const int L = model_->config.num_layers, V = model_->config.vocab_size;
  auto last = LensLogits(*model_, be_, clean, L);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(*last, clean.logits);
  auto lens = LogitLens(*model_, be_, clean, 5);
  ASSERT_TRUE(lens.ok()) << lens.status();
  ASSERT_EQ(lens->size(), static_cast<size_t>(L + 1));
  for (int i = 0; i < clean.n; ++i) {
    const double* row = clean.logits.data() + i * V;
    const int argmax = static_cast<int>(std::max_element(row, row + V) - row);
    EXPECT_EQ((*lens)[L][i][0].token, argmax);
    EXPECT_EQ((*lens)[L][i][0].logit, row[argmax]);
    for (int r = 1; r < 5; ++r) EXPECT_GE((*lens)[L][i][r - 1].logit, (*lens)[L][i][r].logit);
    EXPECT_LT((*lens)[L][i][0].logprob, 0.0);
  }
  EXPECT_FALSE(LogitLens(*model_, be_, clean, 0).ok());
}

// Head scores on hand-built maps with known answers.
TEST(HeadScores, FollowTheirDefinitions) {
  const int n = 6, tk = 6;
  // head 0: uniform causal rows; head 1: exact previous-token (row 0 on itself);
  // head 2: induction for period 2 starting at position 1 (tokens 1,2 repeated at 3,4).
  std::vector<double> a(3 * n * tk, 0.0);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j <= i; ++j) a[(0 * n + i) * tk + j] = 1.0 / (i + 1);
    a[(1 * n + i) * tk + std::max(i - 1, 0)] = 1.0;
    a[(2 * n + i) * tk + ((i == 3 || i == 4) ? i - 1 : 0)] = 1.0;
  }
  const auto s = ScoreHeads(a, 3, n, tk, 0, InductionLayout{2, 1});
  double ent = 0, sink = 0, prev = 0;
  for (int i = 0; i < n; ++i) {
    ent += std::log(i + 1.0);
    sink += 1.0 / (i + 1);
    if (i >= 1) prev += 1.0 / (i + 1);
  }
  EXPECT_NEAR(s[0].entropy, ent / n, 1e-15);
  EXPECT_NEAR(s[0].sink, sink / n, 1e-15);
  EXPECT_NEAR(s[0].prev_token, prev / (n - 1), 1e-15);
  EXPECT_NEAR(s[1].entropy, 0.0, 1e-15);
  EXPECT_NEAR(s[1].prev_token, 1.0, 1e-15);
  EXPECT_NEAR(s[1].sink, 2.0 / n, 1e-15);   // rows 0 and 1 attend to position 0
  EXPECT_NEAR(s[2].induction, 1.0, 1e-15);  // rows 3, 4 → keys 2, 3
  EXPECT_NEAR(s[0].induction, (1.0 / 4 + 1.0 / 5) / 2, 1e-15);
  EXPECT_TRUE(std::isnan(ScoreHeads(a, 3, n, tk, 0)[0].induction));
}

// The induction experiment on stories260K: random tokens repeated twice. Only the scores'
// ranges are asserted; the measured values go to docs/interpretability.md.
TEST_F(InterventionsTest, InductionScoresOnRepeatedRandomTokens) {
  const int P = 20;
  std::vector<int32_t> t = {1};
  std::mt19937 rng(17);
  for (int i = 0; i < P; ++i) t.push_back(static_cast<int32_t>(3 + rng() % 500));
  for (int i = 0; i < P; ++i) t.push_back(t[1 + i]);
  input_.tokens = t;
  const Tape<double> tape = Run();
  double best = 0;
  int best_l = 0, best_h = 0;
  for (int l = 0; l < model_->config.num_layers; ++l) {
    const auto s = ScoreHeads(tape.layers[l].probs, model_->config.num_heads, tape.n, tape.num_keys,
                              0, InductionLayout{P, 1});
    for (int h = 0; h < model_->config.num_heads; ++h) {
      EXPECT_GE(s[h].induction, 0.0);
      EXPECT_LE(s[h].induction, 1.0);
      EXPECT_GE(s[h].entropy, 0.0);
      if (s[h].induction > best) {
        best = s[h].induction;
        best_l = l;
        best_h = h;
      }
    }
  }
  std::printf("[induction] stories260K best head: layer %d head %d, score %.3f\n", best_l, best_h,
              best);
}

}  // namespace
}  // namespace kvlens::interpret
