// Whole-model gradients of the Tape: the forward reproduces Transformer::Forward, every
// returned tensor matches centred finite differences in float64 (stories260K, a Llama
// checkpoint with grouped-query attention and adjacent-pair RoPE; tiny in-memory GPT-2 and
// half-split-RoPE Llama models), also before RoPE (TransformerLens's hook_q / hook_k),
// parameter gradients match differences in the weights, and the fp32 probe tracks the fp64
// one.
#include "engine/interpret/tape.h"

#include <cmath>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "engine/interpret/finite_difference.h"
#include "engine/interpret/objective.h"
#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/interpret/tiny_model.h"
#include "tests/engine/random_tokens.h"
#include "tests/engine/stories_model_test.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

using testing::TestData;

template <typename A, typename B>
double RelErr(const std::vector<A>& a, const std::vector<B>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    den = std::max(den, std::abs(static_cast<double>(b[i])));
  }
  return den > 0 ? num / den : num;
}

template <typename T>
std::vector<T> TransformerLogits(const Model& m, kernels::Backend<T>& be,
                                 const std::vector<int32_t>& t,
                                 const std::vector<int32_t>& docs = {}) {
  const int bs = 4, blocks = (static_cast<int>(t.size()) + bs - 1) / bs;
  KvCacheStorage<T> cache(m.config.num_layers, blocks, bs, m.config.kv_dim(), true);
  std::vector<int32_t> table(blocks);
  for (int b = 0; b < blocks; ++b) table[b] = blocks - 1 - b;
  Transformer<T> tr(m, be);
  BatchEntry e{t, 0, table, true, docs};
  ForwardOutput<T> out;
  const absl::Status s = tr.Forward({&e, 1}, cache, out);
  EXPECT_TRUE(s.ok()) << s;
  return out.logits;
}

Tape<double> MustTape(const Model& m, const SequenceInput<double>& in) {
  kernels::ReferenceBackend be;
  auto t = RunForward(m, be, in);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

void ExpectFdAgrees(const Model& m, const SequenceInput<double>& in, const Objective& o, double tol,
                    const std::string& what, int samples = 6, double min_nonzero = 1.0 / 3) {
  const Tape<double> t = MustTape(m, in);
  auto g = ObjectiveGradients(m, t, o);
  ASSERT_TRUE(g.ok()) << g.status();
  FdOptions opt;
  opt.samples_per_tensor = samples;
  auto r = CheckByFiniteDifferences(m, in, o, *g, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const FdTensorReport& tr : r->tensors) {
    EXPECT_LE(tr.max_rel_err, tol)
        << what << ": " << TensorKindName(tr.kind) << " abs " << tr.max_abs_err;
  }
  // the check is not vacuous: most sampled gradients are non-zero
  int nonzero = 0, total = 0;
  for (const FdTensorReport& tr : r->tensors) {
    for (const FdSample& s : tr.samples) {
      ++total;
      nonzero += std::abs(s.fd) > 1e-9 ? 1 : 0;
    }
  }
  EXPECT_GE(nonzero, min_nonzero * total) << what;
  std::printf("[fd] %s: max abs %.3g, max rel %.3g over %d samples\n", what.c_str(), r->max_abs_err,
              r->max_rel_err, total);
}

class StoriesTape : public testing::StoriesModelTest {
 protected:
};

TEST_F(StoriesTape, LogitsEqualTransformerForward) {
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  const auto t = testing::RandomTokens(23, 1, model_->config.vocab_size);
  SequenceInput<double> in{t};
  const Tape<double> tape = MustTape(*model_, in);
  EXPECT_LE(RelErr(tape.logits, TransformerLogits<double>(*model_, ref, t)), 1e-14);
  SequenceInput<float> inf{t};
  auto tf = RunForward(*model_, fast, inf);
  ASSERT_TRUE(tf.ok()) << tf.status();
  EXPECT_LE(RelErr(tf->logits, TransformerLogits<float>(*model_, fast, t)), 1e-5);
  // with document ids
  std::vector<int32_t> docs(t.size(), 0);
  for (size_t i = 9; i < docs.size(); ++i) docs[i] = 1;
  in.doc_ids = docs;
  EXPECT_LE(RelErr(MustTape(*model_, in).logits, TransformerLogits<double>(*model_, ref, t, docs)),
            1e-14);
}

TEST_F(StoriesTape, LogProbGradientsMatchFiniteDifferences) {
  SequenceInput<double> in{testing::RandomTokens(12, 2, model_->config.vocab_size)};
  ExpectFdAgrees(*model_, in, Objective::LogProb({{11, 37}, {6, 100}}), 1e-6, "stories logprob");
}

TEST_F(StoriesTape, LogitDiffWithDocumentIdsMatchesFiniteDifferences) {
  SequenceInput<double> in{testing::RandomTokens(10, 3, model_->config.vocab_size)};
  in.doc_ids = {0, 0, 0, 0, 1, 1, 1, 1, 1, 1};
  // Only rows 4…9 (document 1) influence row 9: the other samples are exact zeros. The
  // gradients here are small (many entries ~1e-7) while the differences' float64 noise is
  // ~1e-12 absolute, so the per-entry relative error is bounded by noise at ~1e-5.
  ExpectFdAgrees(*model_, in, Objective::LogitDiff(9, 5, 77), 1e-4, "stories logit diff + docs", 6,
                 0.2);
}

TEST_F(StoriesTape, AttnOutProbeMatchesFiniteDifferences) {
  const ModelConfig& c = model_->config;
  const int n = 9;
  std::mt19937 rng(4);
  std::normal_distribution<double> nd;
  std::vector<double> g(n * c.head_dim);
  for (double& x : g) x = nd(rng);
  SequenceInput<double> in{testing::RandomTokens(n, 5, c.vocab_size)};
  ExpectFdAgrees(*model_, in, Objective::AttnOutProbe(3, 5, g), 1e-6, "stories probe G⊙O");
}

TEST_F(StoriesTape, Fp32GradientsTrackFp64) {
  kernels::CpuBackend fast(2);
  const auto t = testing::RandomTokens(20, 6, model_->config.vocab_size);
  const Objective o = Objective::LogProb({{19, 42}});
  const Tape<double> td = MustTape(*model_, SequenceInput<double>{t});
  auto tf = RunForward(*model_, fast, SequenceInput<float>{t});
  ASSERT_TRUE(tf.ok());
  auto gd = ObjectiveGradients(*model_, td, o);
  auto gf = ObjectiveGradients(*model_, *tf, o);
  ASSERT_TRUE(gd.ok() && gf.ok());
  double worst = 0;
  for (int l = 0; l < model_->config.num_layers; ++l) {
    for (auto [a, b] : {std::pair{&gf->scores, &gd->scores},
                        {&gf->q, &gd->q},
                        {&gf->k, &gd->k},
                        {&gf->v, &gd->v},
                        {&gf->attn_out, &gd->attn_out},
                        {&gf->residual, &gd->residual}}) {
      worst = std::max(worst, RelErr((*a)[l], (*b)[l]));
    }
    // probabilities' gradients: compare on visible entries (masked ones are 0 in both)
    worst = std::max(worst, RelErr(gf->probs[l], gd->probs[l]));
  }
  EXPECT_LE(worst, 1e-4);
  std::printf("[fp32] worst relative error of fp32 gradients vs fp64: %.3g\n", worst);
  // and the fp32 gradient passes the fp64 finite-difference check at fp32 tolerance
  FdOptions opt;
  opt.samples_per_tensor = 3;
  auto r = CheckByFiniteDifferences(*model_, SequenceInput<double>{t}, o, *gf, opt);
  ASSERT_TRUE(r.ok());
  EXPECT_LE(r->max_rel_err, 1e-3);
}

TEST_F(StoriesTape, LaterPositionsGetNoGradient) {
  const auto t = testing::RandomTokens(10, 7, model_->config.vocab_size);
  const Tape<double> tape = MustTape(*model_, SequenceInput<double>{t});
  auto g = ObjectiveGradients(*model_, tape, Objective::LogProb({{5, 9}}));
  ASSERT_TRUE(g.ok());
  const std::vector<double> sal = InputTimesGradient(tape, *g, model_->config.dim);
  for (int i = 6; i < 10; ++i) EXPECT_EQ(sal[i], 0.0) << i;
  for (int i = 0; i <= 5; ++i) EXPECT_NE(sal[i], 0.0) << i;
  const auto axg = AttentionTimesGradient(tape, *g, 2);
  EXPECT_EQ(axg.size(), tape.layers[2].probs.size());
}

TEST_F(StoriesTape, RejectsEditedTapesAndBadObjectives) {
  kernels::ReferenceBackend be;
  const auto t = testing::RandomTokens(6, 8, model_->config.vocab_size);
  Edits e;
  e.ablations.push_back({0, 0, AblationMode::kZero});
  auto tape = RunForward(*model_, be, SequenceInput<double>{t}, e);
  ASSERT_TRUE(tape.ok());
  EXPECT_EQ(ObjectiveGradients(*model_, *tape, Objective::LogProb({{0, 1}})).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const Tape<double> clean = MustTape(*model_, SequenceInput<double>{t});
  const auto bad = ObjectiveGradients(*model_, clean, Objective::LogProb({{6, 1}}));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("row 6"), std::string::npos) << bad.status();
  e = Edits{};
  e.perturbations.push_back({Coord{TensorKind::kQ, 9, 0, 0, 0}, 1.0});
  EXPECT_EQ(RunForward(*model_, be, SequenceInput<double>{t}, e).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Tiny in-memory models of every family (testing::TinyFamilySpec).
class TinyTape : public ::testing::TestWithParam<int> {
 protected:
  static testing::TinySpec Spec(int i) { return testing::TinyFamilySpec(i); }
};

TEST_P(TinyTape, ForwardAndGradientsMatch) {
  auto m = testing::MakeTinyModel(Spec(GetParam()));
  kernels::ReferenceBackend ref;
  const auto t = testing::RandomTokens(9, 10 + GetParam(), m->config.vocab_size);
  SequenceInput<double> in{t};
  EXPECT_LE(RelErr(MustTape(*m, in).logits, TransformerLogits<double>(*m, ref, t)), 1e-14);
  const std::string name = "tiny model " + std::to_string(GetParam());
  ExpectFdAgrees(*m, in, Objective::LogProb({{8, 3}, {4, 7}}), 1e-6, name + " logprob", 8);
  in.doc_ids = {0, 0, 0, 1, 1, 1, 1, 2, 2};
  ExpectFdAgrees(*m, in, Objective::LogitDiff(8, 1, 2), 1e-6, name + " logit diff + docs", 8, 0.1);
}

// TurnBackRope takes the tape's post-RoPE q and k gradients to TransformerLens's hook_q /
// hook_k ones: each entry equals the centred difference of J along that entry's direction
// before RoPE (R·e, which the check builds with the forward's own Rope), under a 3-token
// cached prefix so that query and key positions differ from their rows. On a rotary family
// the post-RoPE gradient at the same entry misses the difference somewhere, so the
// comparison can tell the two apart.
TEST_P(TinyTape, GradientsBeforeRopeMatchFiniteDifferences) {
  auto m = testing::MakeTinyModel(Spec(GetParam()));
  const ModelConfig& c = m->config;
  const auto t = testing::RandomTokens(9, 40 + GetParam(), c.vocab_size);
  const int offset = 3;
  const Tape<double> prefix =
      MustTape(*m, SequenceInput<double>{std::vector<int32_t>(t.begin(), t.begin() + offset)});
  SequenceInput<double> in{std::vector<int32_t>(t.begin() + offset, t.end())};
  in.offset = offset;
  for (const LayerTape<double>& lt : prefix.layers) {
    in.prefix_k.push_back(lt.k);
    in.prefix_v.push_back(lt.v);
  }
  const Tape<double> tape = MustTape(*m, in);
  const Objective o = Objective::LogProb({{5, 3}, {2, 11}});
  auto g = ObjectiveGradients(*m, tape, o);
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<std::vector<double>> pre_q = g->q, pre_k = g->k;
  for (int l = 0; l < c.num_layers; ++l) {
    TurnBackRope(*m, tape, TensorKind::kQ, l, 0, tape.n, pre_q[l].data());
    TurnBackRope(*m, tape, TensorKind::kK, l, 0, tape.num_keys, pre_k[l].data());
  }
  FdOptions opt;
  opt.samples_per_tensor = 16;
  opt.tensors = {{TensorKind::kQ, true}, {TensorKind::kK, true}};
  auto r = CheckByFiniteDifferences(*m, in, o, *g, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  const bool rotary = c.arch == Architecture::kLlama;
  int post_misses = 0, nonzero = 0;
  for (const FdTensorReport& tr : r->tensors) {
    EXPECT_TRUE(tr.before_rope);
    const auto& pre = tr.kind == TensorKind::kQ ? pre_q : pre_k;
    double scale = 0;
    for (const auto& layer : pre) {
      for (double v : layer) scale = std::max(scale, std::abs(v));
    }
    for (const FdSample& s : tr.samples) {
      const int64_t at = HeadVectorAt(c, tr.kind, 0, s.at.row, s.at.head) + s.at.col;
      const double want = pre[s.at.layer][at],
                   post = (tr.kind == TensorKind::kQ ? g->q : g->k)[s.at.layer][at];
      EXPECT_NEAR(want, s.fd, 1e-6 * scale) << TensorKindName(tr.kind) << " layer " << s.at.layer
                                            << " row " << s.at.row << " col " << s.at.col;
      nonzero += std::abs(s.fd) > 1e-6 * scale ? 1 : 0;
      post_misses += std::abs(post - s.fd) > 1e-3 * scale ? 1 : 0;
    }
  }
  EXPECT_GE(nonzero, 8);
  if (rotary) {
    EXPECT_GE(post_misses, 1);
  } else {
    EXPECT_EQ(pre_q, g->q);  // GPT-2: nothing to turn
  }
}

// Ablating FFN neuron i of layer l is patching what the FFN adds (mlp_out) at each row by
// itself minus act[row, i] · W_out[:, i] (zero), or minus (act[row, i] − mean_i) · W_out[:, i]
// (mean), computed here from the clean tape and the weights: two edits on different paths
// give the same logits. (Not for Gemma 2/3, whose norm on the FFN output is not linear.)
TEST_P(TinyTape, NeuronAblationIsAPatchOfWhatTheFfnAdds) {
  auto m = testing::MakeTinyModel(Spec(GetParam()));
  const ModelConfig& c = m->config;
  if (c.sandwich_norms) GTEST_SKIP() << "the FFN output's norm is not linear";
  const int n = 6, layer = 1, F = c.hidden_dim, D = c.dim;
  const SequenceInput<double> in{testing::RandomTokens(n, 50 + GetParam(), c.vocab_size)};
  const Tape<double> clean = MustTape(*m, in);
  const LayerTape<double>& lt = clean.layers[layer];
  for (const auto& [neuron, row, mode] :
       {std::tuple{3, -1, AblationMode::kZero}, std::tuple{F - 1, 4, AblationMode::kMean},
        std::tuple{0, -1, AblationMode::kMean}}) {
    double mean = 0;
    for (int i = 0; i < n; ++i) mean += lt.act[int64_t{i} * F + neuron] / n;
    Edits ablate, patch;
    ablate.neuron_ablations.push_back({layer, neuron, row, mode});
    for (int i = 0; i < n; ++i) {
      if (row >= 0 && i != row) continue;
      const double shift =
          lt.act[int64_t{i} * F + neuron] - (mode == AblationMode::kMean ? mean : 0.0);
      std::vector<double> value(lt.ffn_delta.begin() + int64_t{i} * D,
                                lt.ffn_delta.begin() + int64_t{i + 1} * D);
      for (int d = 0; d < D; ++d) {
        value[d] -= shift * *testing::Param(m->weights.layers[layer].w_out, d, neuron);
      }
      patch.patches.push_back({layer, i, value, PatchSite::kMlpOut});
    }
    kernels::ReferenceBackend be;
    auto a = RunForward(*m, be, in, ablate);
    auto p = RunForward(*m, be, in, patch);
    ASSERT_TRUE(a.ok() && p.ok()) << a.status() << p.status();
    EXPECT_TRUE(a->edited);
    EXPECT_LE(RelErr(a->logits, p->logits), 1e-12) << "neuron " << neuron << " row " << row;
    EXPECT_GT(RelErr(a->logits, clean.logits), 1e-6) << "the ablation changes the logits";
    EXPECT_EQ(a->layers[layer - 1].h, clean.layers[layer - 1].h);  // and nothing upstream
  }
  Edits bad;
  bad.neuron_ablations.push_back({layer, F, -1, AblationMode::kZero});
  kernels::ReferenceBackend be;
  const auto refused = RunForward(*m, be, in, bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find(
                absl::StrCat("neuron ablation (layer 1, neuron ", F, ", row -1) is out of range")),
            std::string::npos)
      << refused.status();
}

TEST_P(TinyTape, ParameterGradientsMatchDifferencesInTheWeights) {
  auto m = testing::MakeTinyModel(Spec(GetParam()));
  const auto t = testing::RandomTokens(7, 20 + GetParam(), m->config.vocab_size);
  const Objective o = Objective::LogProb({{6, 5}, {3, 2}});
  const SequenceInput<double> in{t};
  const int layer = 1;
  const LayerWeights& lw = m->weights.layers[layer];
  const WeightView* views[4] = {&lw.wq, &lw.wk, &lw.wv, &lw.wo};
  std::mt19937 rng(5);
  double worst = 0;
  for (int which = 0; which < 4; ++which) {
    const WeightView& w = *views[which];
    for (int s = 0; s < 6; ++s) {
      const int64_t r = rng() % w.rows, col = rng() % w.cols;
      float* p = testing::Param(w, r, col);
      // Round the weight to a multiple of 2^-12 so that w ± 2^-10 and w ± 2^-9 are exact
      // floats; the gradient is taken at the rounded weight.
      const float orig = std::round(*p * 4096.0f) / 4096.0f, h = 1.0f / 1024;
      auto j_at = [&](float k) {
        *p = orig + k * h;
        return EvaluateObjective(o, m->config, MustTape(*m, in));
      };
      const double fd = (-j_at(2) + 8 * j_at(1) - 8 * j_at(-1) + j_at(-2)) / (12.0 * h);
      *p = orig;
      auto g = ObjectiveGradients(*m, MustTape(*m, in), o, BackwardOptions{layer});
      ASSERT_TRUE(g.ok());
      ASSERT_EQ(g->params.layer, layer);
      const std::vector<double>* grads[4] = {&g->params.wq, &g->params.wk, &g->params.wv,
                                             &g->params.wo};
      const double an = (*grads[which])[r * w.cols + col];
      worst = std::max(worst, std::abs(fd - an) / std::max({std::abs(fd), std::abs(an), 1e-3}));
    }
  }
  EXPECT_LE(worst, 1e-5);
}

// TapeBytes (what the server checks --max-interp-tape-bytes with) against the elements the
// tape and the gradients actually hold, counted vector by vector, with and without a prefix.
TEST_P(TinyTape, TapeBytesCountsWhatTheTapeAndGradientsHold) {
  auto m = testing::MakeTinyModel(Spec(GetParam()));
  const ModelConfig& c = m->config;
  for (const int offset : {0, 3}) {
    SequenceInput<double> in{testing::RandomTokens(6, 30 + GetParam(), c.vocab_size)};
    in.offset = offset;
    std::mt19937 rng(7);
    std::normal_distribution<double> nd(0.0, 1.0);
    for (auto* prefix : {&in.prefix_k, &in.prefix_v}) {
      prefix->assign(c.num_layers, std::vector<double>(int64_t{offset} * c.kv_dim()));
      for (auto& rows : *prefix) {
        for (double& x : rows) x = nd(rng);
      }
    }
    const Tape<double> t = MustTape(*m, in);
    int64_t held = static_cast<int64_t>(t.x_final.size() + t.xf.size() + t.logits.size());
    for (int l = 0; l < c.num_layers; ++l) {
      const LayerTape<double>& lt = t.layers[l];
      for (const auto* v : {&lt.x,
                            &lt.xn,
                            &lt.q_pre,
                            &lt.k_pre,
                            &lt.q,
                            &lt.k,
                            &lt.v,
                            &lt.scores,
                            &lt.probs,
                            &lt.att,
                            &lt.attn_proj,
                            &lt.h,
                            &lt.hn,
                            &lt.pre,
                            &lt.up,
                            &lt.act,
                            &lt.ffn_out,
                            &lt.attn_delta,
                            &lt.ffn_delta,
                            &t.input.prefix_k[l],
                            &t.input.prefix_v[l]}) {
        held += static_cast<int64_t>(v->size());
      }
    }
    const int tk = offset + 6;
    EXPECT_EQ(TapeBytes(c, 6, tk, 8, false), held * 8) << "offset " << offset;
    auto g = ObjectiveGradients(*m, t, Objective::LogProb({{5, 3}}));
    ASSERT_TRUE(g.ok()) << g.status();
    for (const auto* per_layer :
         {&g->scores, &g->probs, &g->q, &g->k, &g->v, &g->attn_out, &g->residual, &g->resid_mid}) {
      for (const auto& v : *per_layer) held += static_cast<int64_t>(v.size());
    }
    held += static_cast<int64_t>(g->ln_final.size());
    EXPECT_EQ(TapeBytes(c, 6, tk, 8, true), held * 8) << "offset " << offset;
    EXPECT_EQ(TapeBytes(c, 6, tk, 4, true), held * 4);
  }
}

// RunForwardFrom (a patching sweep's cells) gives RunForward's tape bit for bit: from every
// layer, with edits at that layer (a residual patch, a head ablation and patch, a row
// override) or none, on both backends; and refuses an edit before its first layer or an
// edited tape to resume.
template <typename T>
void ExpectResumedEqualsFull(const Model& m, kernels::Backend<T>& be) {
  const ModelConfig& c = m.config;
  const int n = 7;
  SequenceInput<T> in{testing::RandomTokens(n, 31, c.vocab_size)};
  auto clean = RunForward(m, be, in);
  ASSERT_TRUE(clean.ok()) << clean.status();
  for (int first = 0; first <= c.num_layers; ++first) {
    for (bool edited : {false, true}) {
      Edits e;
      if (edited) {
        e.patches.push_back({first, 3, std::vector<double>(c.dim, 0.25)});
        if (first < c.num_layers) {
          e.ablations.push_back({first, c.num_heads - 1, AblationMode::kMean});
          e.head_patches.push_back({first, 0, 5, std::vector<double>(c.head_dim, -0.5)});
          e.row_overrides.push_back({first, 0, 4, {}, {1, 2}});
          e.patches.push_back({first, 6, std::vector<double>(c.dim, 0.125), PatchSite::kMlpOut});
          e.neuron_ablations.push_back({first, 2, -1, AblationMode::kMean});
        }
      }
      auto full = RunForward(m, be, in, e);
      auto resumed = RunForwardFrom(m, be, *clean, first, e);
      ASSERT_TRUE(full.ok() && resumed.ok()) << full.status() << resumed.status();
      EXPECT_EQ(resumed->logits, full->logits) << first << " " << edited;
      EXPECT_EQ(resumed->x_final, full->x_final) << first;
      EXPECT_EQ(resumed->edited, full->edited);
      for (int l = 0; l < c.num_layers; ++l) {
        const LayerTape<T>&a = resumed->layers[l], &b = full->layers[l];
        EXPECT_TRUE(a.x == b.x && a.h == b.h && a.att == b.att && a.probs == b.probs &&
                    a.k == b.k && a.ffn_delta == b.ffn_delta)
            << "layer " << l << " from " << first;
      }
      // Without the copy: the same logits and later layers, the skipped ones empty.
      auto lean = RunForwardFrom(m, be, *clean, first, e, /*copy_skipped=*/false);
      ASSERT_TRUE(lean.ok()) << lean.status();
      EXPECT_EQ(lean->logits, full->logits) << first;
      for (int l = 0; l < c.num_layers; ++l) {
        EXPECT_EQ(lean->layers[l].x.empty(), l < first) << l;
        if (l >= first) {
          EXPECT_EQ(lean->layers[l].h, full->layers[l].h) << l;
        }
      }
    }
  }
  Edits early;
  early.ablations.push_back({0, 0, AblationMode::kZero});
  const auto before = RunForwardFrom(m, be, *clean, 1, early);
  EXPECT_EQ(before.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(before.status().message().find("an edit at layer 0 comes before layer 1"),
            std::string::npos)
      << before.status();
  auto edited = RunForward(m, be, in, early);
  ASSERT_TRUE(edited.ok());
  EXPECT_FALSE(RunForwardFrom(m, be, *edited, 1, Edits{}).ok());
  EXPECT_FALSE(RunForwardFrom(m, be, *clean, c.num_layers + 1, Edits{}).ok());
}

TEST_P(TinyTape, ResumedForwardIsTheFullForward) {
  auto m = testing::MakeTinyModel(Spec(GetParam()));
  kernels::ReferenceBackend ref;
  ExpectResumedEqualsFull<double>(*m, ref);
  kernels::CpuBackend fast(2);
  ExpectResumedEqualsFull<float>(*m, fast);
}

INSTANTIATE_TEST_SUITE_P(Families, TinyTape, ::testing::Range(0, testing::kTinyFamilies));

}  // namespace
}  // namespace kvlens::interpret
