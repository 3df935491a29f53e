// Golden gradients from the PyTorch float64 oracle (tests/oracle, autograd; run as a
// separate process at test time): every tensor the probe returns, for stories260K, at
// fp64 (relative error ≤ 1e-6) and fp32 (≤ 1e-4). Relative error = max|ours − oracle| /
// max|oracle| per tensor; probabilities' gradients are compared on visible entries (the
// oracle's A·V also differentiates masked entries, which the probe reports as 0).
#include <cmath>
#include <filesystem>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/interpret/hook_gradients.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

const std::string kBin = testing::TestData("stories260K/stories260K.bin");

testing::OracleResult RunGradOracle(const std::string& model, const std::vector<int32_t>& tokens,
                                    const std::vector<TokenTarget>& targets,
                                    const std::vector<int32_t>& docs, int param_layer = -1) {
  char tmpl[] = "/tmp/kvlens_oracle_grad_XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd >= 0) close(fd);
  std::vector<std::string> t;
  for (const TokenTarget& tg : targets) t.push_back(absl::StrCat(tg.row, ":", tg.token));
  std::string cmd = std::string(testing::OraclePython()) + " " + KVLENS_SOURCE_DIR +
                    "/tests/oracle/oracle.py --model '" + model + "' --tokens '" +
                    absl::StrJoin(tokens, " ") + "' --out " + tmpl + " --grad-logprob '" +
                    absl::StrJoin(t, " ") + "'";
  if (!docs.empty()) cmd += " --doc-ids '" + absl::StrJoin(docs, " ") + "'";
  if (param_layer >= 0) cmd += absl::StrCat(" --grad-param-layer ", param_layer);
  testing::OracleResult r;
  if (std::system(cmd.c_str()) != 0) {
    r.error = "oracle failed: " + cmd;
  } else {
    r = testing::ReadOracleContainer(tmpl);
  }
  std::remove(tmpl);
  return r;
}

// Ours (already permuted to the oracle's layout) against the oracle's array.
double RelErr(const std::vector<double>& ours, const testing::OracleArray& ref,
              const std::vector<bool>* keep = nullptr) {
  EXPECT_EQ(ours.size(), ref.data.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < ours.size() && i < ref.data.size(); ++i) {
    if (keep && !(*keep)[i]) continue;
    num = std::max(num, std::abs(ours[i] - ref.data[i]));
    den = std::max(den, std::abs(ref.data[i]));
  }
  return den > 0 ? num / den : num;
}

// [T, heads, hd] → [heads, T, hd]
template <typename T>
std::vector<double> HeadsFirst(const std::vector<T>& x, int rows, int heads, int hd) {
  std::vector<double> out(x.size());
  for (int i = 0; i < rows; ++i)
    for (int h = 0; h < heads; ++h)
      for (int d = 0; d < hd; ++d)
        out[(int64_t{h} * rows + i) * hd + d] = x[(int64_t{i} * heads + h) * hd + d];
  return out;
}

template <typename T>
double WorstError(const Model& m, kernels::Backend<T>& be, const std::vector<int32_t>& tokens,
                  const std::vector<TokenTarget>& targets, const std::vector<int32_t>& docs,
                  const testing::OracleResult& ref) {
  const ModelConfig& c = m.config;
  SequenceInput<T> in{tokens};
  in.doc_ids = docs;
  auto tape = RunForward(m, be, in);
  EXPECT_TRUE(tape.ok()) << tape.status();
  BackwardOptions with_ffn;
  for (int l = 0; l < m.config.num_layers; ++l) with_ffn.ffn_layers.push_back(l);
  auto g = ObjectiveGradients(m, *tape, Objective::LogProb(targets), with_ffn);
  EXPECT_TRUE(g.ok()) << g.status();
  const int n = tape->n, H = c.num_heads, KV = c.num_kv_heads, hd = c.head_dim;
  EXPECT_NEAR(EvaluateObjective(Objective::LogProb(targets), c, *tape),
              ref.arrays.at("objective").data[0], sizeof(T) == 8 ? 1e-10 : 1e-3);
  // The entries layer l's mask shows (its own window: Gemma 3's layers differ).
  std::vector<bool> visible(int64_t{H} * n * n);
  auto visible_in = [&](int l) {
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < n; ++j)
          visible[(int64_t{h} * n + i) * n + j] = KeyVisible(in, i, j, c.WindowOf(l));
    return &visible;
  };
  double worst = 0;
  auto note = [&](const std::string& name, double e) {
    EXPECT_LE(e, sizeof(T) == 8 ? 1e-6 : 1e-4) << name;
    worst = std::max(worst, e);
  };
  auto as_double = [](const std::vector<T>& v) { return std::vector<double>(v.begin(), v.end()); };
  note("embeds", RelErr(as_double(g->residual[0]), ref.arrays.at("grad.embeds")));
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string s = absl::StrCat(".", l);
    note("resid" + s, RelErr(as_double(g->residual[l + 1]), ref.arrays.at("grad.resid" + s)));
    // The tape's q and k are after RoPE (the oracle's rot_q / rot_k on a rotary model);
    // TurnBackRope gives the oracle's q and k, TransformerLens's hook_q / hook_k.
    const bool rotary = ref.arrays.count("grad.rot_q" + s) > 0;
    note("rot_q" + s, RelErr(HeadsFirst(g->q[l], n, H, hd),
                             ref.arrays.at((rotary ? "grad.rot_q" : "grad.q") + s)));
    note("rot_k" + s, RelErr(HeadsFirst(g->k[l], n, KV, hd),
                             ref.arrays.at((rotary ? "grad.rot_k" : "grad.k") + s)));
    std::vector<T> pre_q = g->q[l], pre_k = g->k[l];
    TurnBackRope(m, *tape, TensorKind::kQ, l, 0, n, pre_q.data());
    TurnBackRope(m, *tape, TensorKind::kK, l, 0, n, pre_k.data());
    note("q" + s, RelErr(HeadsFirst(pre_q, n, H, hd), ref.arrays.at("grad.q" + s)));
    note("k" + s, RelErr(HeadsFirst(pre_k, n, KV, hd), ref.arrays.at("grad.k" + s)));
    note("v" + s, RelErr(HeadsFirst(g->v[l], n, KV, hd), ref.arrays.at("grad.v" + s)));
    note("attn_out" + s,
         RelErr(HeadsFirst(g->attn_out[l], n, H, hd), ref.arrays.at("grad.attn_out" + s)));
    note("scores" + s,
         RelErr(as_double(g->scores[l]), ref.arrays.at("grad.scores" + s), visible_in(l)));
    note("probs" + s, RelErr(as_double(g->probs[l]), ref.arrays.at("grad.probs" + s), &visible));
    // Every hook's gradient as ReadHookGradient lays it out (TransformerLens's) against
    // autograd at the oracle's tensor of that hook (its pattern's masked entries aside).
    for (Hook hook : HooksWithGradient()) {
      if (!HookIsPerLayer(hook) || !CheckModelHasHook(c, hook).ok()) continue;
      const std::string name(HookName(hook));
      auto x = ReadHookGradient(m, *tape, *g, hook, l);
      EXPECT_TRUE(x.ok()) << x.status();
      if (!x.ok()) continue;
      note("hook " + name + s, RelErr(as_double(*x), ref.arrays.at("grad.hook." + name + s),
                                      hook == Hook::kPattern ? visible_in(l) : nullptr));
    }
  }
  auto embed = ReadHookGradient(m, *tape, *g, Hook::kEmbed, -1);
  EXPECT_TRUE(embed.ok()) << embed.status();
  if (embed.ok()) note("hook embed", RelErr(as_double(*embed), ref.arrays.at("grad.embeds")));
  auto ln_final = ReadHookGradient(m, *tape, *g, Hook::kLnFinal, -1);
  EXPECT_TRUE(ln_final.ok()) << ln_final.status();
  if (ln_final.ok()) {
    note("hook ln_final", RelErr(as_double(*ln_final), ref.arrays.at("grad.hook.ln_final")));
  }
  return worst;
}

// The oracle's autograd on the model at `path` (with param_layer >= 0 that layer's
// attention weights too) against both backends' tapes (WorstError: fp64 ≤ 1e-6, fp32
// ≤ 1e-4), printed under `label`; the oracle's arrays, or its error.
testing::OracleResult ExpectBothBackendsMatchAutograd(const Model& m, const std::string& path,
                                                      const char* label,
                                                      const std::vector<int32_t>& tokens,
                                                      const std::vector<TokenTarget>& targets,
                                                      int param_layer = -1) {
  testing::OracleResult ref = RunGradOracle(path, tokens, targets, {}, param_layer);
  EXPECT_TRUE(ref.error.empty()) << ref.error;
  if (!ref.error.empty()) return ref;
  kernels::ReferenceBackend ref_be;
  kernels::CpuBackend fast(2);
  const double e64 = WorstError<double>(m, ref_be, tokens, targets, {}, ref);
  const double e32 = WorstError<float>(m, fast, tokens, targets, {}, ref);
  std::printf("[oracle] %s: worst relative error fp64 %.3g, fp32 %.3g\n", label, e64, e32);
  return ref;
}

// Layer `layer`'s weight gradients `names` ("wq", "wk", "wv", "wo") of the fp64 tape
// against the oracle's (relative error ≤ 1e-6).
void ExpectParamGradientsMatch(const Model& m, const std::vector<int32_t>& tokens,
                               const std::vector<TokenTarget>& targets, int layer,
                               const testing::OracleResult& ref,
                               std::initializer_list<const char*> names) {
  kernels::ReferenceBackend ref_be;
  auto tape = RunForward(m, ref_be, SequenceInput<double>{tokens});
  ASSERT_TRUE(tape.ok()) << tape.status();
  auto g = ObjectiveGradients(m, *tape, Objective::LogProb(targets), BackwardOptions{layer});
  ASSERT_TRUE(g.ok()) << g.status();
  const std::map<std::string, const std::vector<double>*> ours = {
      {"wq", &g->params.wq}, {"wk", &g->params.wk}, {"wv", &g->params.wv}, {"wo", &g->params.wo}};
  for (const char* name : names) {
    EXPECT_LE(RelErr(*ours.at(name), ref.arrays.at(absl::StrCat("grad.", name))), 1e-6) << name;
  }
}

TEST(OracleGradients, Stories260KMatchesAutograd) {
  KVLENS_REQUIRE_FILE(kBin);
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  auto m = LoadModel({kBin, ""});
  ASSERT_TRUE(m.ok());
  std::mt19937 rng(31);
  std::vector<int32_t> tokens = {1};
  while (tokens.size() < 17) tokens.push_back(static_cast<int32_t>(3 + rng() % 509));
  const std::vector<TokenTarget> targets = {{16, 42}, {9, 300}, {3, 7}};
  for (const std::vector<int32_t>& docs :
       {std::vector<int32_t>{},
        std::vector<int32_t>{0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2}}) {
    const testing::OracleResult ref = RunGradOracle(kBin, tokens, targets, docs);
    ASSERT_TRUE(ref.error.empty()) << ref.error;
    kernels::ReferenceBackend ref_be;
    kernels::CpuBackend fast(2);
    const double e64 = WorstError<double>(**m, ref_be, tokens, targets, docs, ref);
    const double e32 = WorstError<float>(**m, fast, tokens, targets, docs, ref);
    std::printf("[oracle] stories260K%s: worst relative error fp64 %.3g, fp32 %.3g\n",
                docs.empty() ? "" : " with doc ids", e64, e32);
  }
}

// Gradient probes on a model in every ggml block type (tests/oracle/make_quantized_gguf.py):
// the tape's forward and backward read the quantised weights through kvlens' decoders and
// must match autograd on the oracle's own decoding of the same bytes. (CpuBackend's
// MatMulBackwardInput over block types: CpuBackwardTest.)
TEST(OracleGradients, QuantizedModelMatchesAutograd) {
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  const std::string path = testing::MakeQuantizedModel();
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto m = LoadModel({path, ""});
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128};
  const std::vector<TokenTarget> targets = {{11, 42}, {4, 300}};
  ExpectBothBackendsMatchAutograd(**m, path, "quantized model", tokens, targets);
  std::remove(path.c_str());
}

// A Gemma (tests/oracle/make_quantized_gguf.py --gemma, f32): the backward passes through
// the GELU(tanh)-gated feed-forward into heads of 256, and the embeddings' gradient is the
// first layer's input's (the lookup times √256).
TEST(OracleGradients, GemmaGeGluMatchesAutograd) {
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  const std::string path = testing::MakeQuantizedModel("--f32 --gemma");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto m = LoadModel({path, ""});
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ((*m)->config.gate_activation, GateActivation::kGeluTanh);
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128};
  const std::vector<TokenTarget> targets = {{11, 42}, {4, 300}, {0, 9}};
  ExpectBothBackendsMatchAutograd(**m, path, "gemma", tokens, targets);
  std::remove(path.c_str());
}

// A Gemma 3 text model (make_quantized_gguf.py --gemma3, its Hugging Face directory): the
// backward passes through the norms on each block's outputs and the head norms, layer 0
// windowed (3 keys) and layer 1 not, with their RoPE bases; W_O's gradient is taken through
// the attention output's norm.
TEST(OracleGradients, Gemma3SandwichNormsMatchAutograd) {
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  char dir_template[] = "/tmp/kvlens_gemma3_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const std::string gguf = testing::MakeQuantizedModel(
      "--f32 --gemma3 --hf " + dir +
      " --hf-config '{\"sliding_window\": 3, \"sliding_window_pattern\": 2, "
      "\"query_pre_attn_scalar\": 100}'");
  ASSERT_FALSE(gguf.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  std::remove(gguf.c_str());
  auto m = LoadModel({dir, ""});
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE((*m)->config.sandwich_norms);
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128};
  const std::vector<TokenTarget> targets = {{11, 42}, {4, 300}, {0, 9}};
  const testing::OracleResult ref =
      ExpectBothBackendsMatchAutograd(**m, dir, "gemma3", tokens, targets, /*param_layer=*/0);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(ref.error.empty());
  ExpectParamGradientsMatch(**m, tokens, targets, 0, ref, {"wo", "wq"});
}

// A Gemma 2 (make_quantized_gguf.py --gemma2, f32): the backward passes through the
// soft-capped logits (at 3) and scores (at 2) and the norms on each block's outputs, layer
// 0 windowed to 3 keys.
TEST(OracleGradients, Gemma2SoftCapsMatchAutograd) {
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  const std::string path = testing::MakeQuantizedModel(
      "--f32 --gemma2 --set gemma2.attention.sliding_window=3 --set-float "
      "gemma2.attn_logit_softcapping=2 --set-float gemma2.final_logit_softcapping=3");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto m = LoadModel({path, ""});
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ((*m)->config.attention_softcap, 2.0);
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128};
  const std::vector<TokenTarget> targets = {{11, 42}, {4, 300}, {0, 9}};
  const testing::OracleResult ref =
      ExpectBothBackendsMatchAutograd(**m, path, "gemma2", tokens, targets, /*param_layer=*/1);
  std::remove(path.c_str());
  ASSERT_TRUE(ref.error.empty());
  ExpectParamGradientsMatch(**m, tokens, targets, 1, ref, {"wq", "wk"});
}

// A Qwen3 (tests/oracle/make_quantized_gguf.py --qwen3, f32): the backward passes through
// the RMSNorm over each head of q and k, and its query heads (4 × 128) are wider than the
// residual stream (256), so W_Q's and W_O's gradients are 512 × 256 and 256 × 512.
TEST(OracleGradients, Qwen3HeadNormsMatchAutograd) {
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  const std::string path = testing::MakeQuantizedModel("--f32 --qwen3");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto m = LoadModel({path, ""});
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ((*m)->config.q_dim(), 2 * (*m)->config.dim);
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128};
  const std::vector<TokenTarget> targets = {{11, 42}, {4, 300}, {0, 9}};
  const std::vector<int32_t> docs = {0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1};
  for (const std::vector<int32_t>& d : {std::vector<int32_t>{}, docs}) {
    const testing::OracleResult ref = RunGradOracle(path, tokens, targets, d);
    ASSERT_TRUE(ref.error.empty()) << ref.error;
    kernels::ReferenceBackend ref_be;
    kernels::CpuBackend fast(2);
    const double e64 = WorstError<double>(**m, ref_be, tokens, targets, d, ref);
    const double e32 = WorstError<float>(**m, fast, tokens, targets, d, ref);
    std::printf("[oracle] qwen3%s: worst relative error fp64 %.3g, fp32 %.3g\n",
                d.empty() ? "" : " with doc ids", e64, e32);
  }
  // Layer 1's attention weights, [out, in] as the weights: W_Q 512 × 256, W_O 256 × 512.
  const testing::OracleResult ref = RunGradOracle(path, tokens, targets, {}, /*param_layer=*/1);
  std::remove(path.c_str());
  ASSERT_TRUE(ref.error.empty()) << ref.error;
  kernels::ReferenceBackend ref_be;
  auto tape = RunForward(**m, ref_be, SequenceInput<double>{tokens});
  ASSERT_TRUE(tape.ok()) << tape.status();
  BackwardOptions options;
  options.param_layer = 1;
  auto g = ObjectiveGradients(**m, *tape, Objective::LogProb(targets), options);
  ASSERT_TRUE(g.ok()) << g.status();
  const ParamGradients& p = g->params;
  for (const auto& [name, ours] : {std::pair{"grad.wq", &p.wq}, std::pair{"grad.wk", &p.wk},
                                   std::pair{"grad.wv", &p.wv}, std::pair{"grad.wo", &p.wo}}) {
    const testing::OracleArray& want = ref.arrays.at(name);
    ASSERT_EQ(ours->size(), want.data.size()) << name;
    EXPECT_LE(RelErr(*ours, want), 1e-6) << name;
  }
  EXPECT_EQ(ref.arrays.at("grad.wq").dims, (std::vector<int64_t>{512, 256}));
  EXPECT_EQ(ref.arrays.at("grad.wo").dims, (std::vector<int64_t>{256, 512}));
}

}  // namespace
}  // namespace kvlens::interpret
