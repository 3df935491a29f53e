// Direct logit attribution. On tiny models of every family: the shares add up to the
// model's own logit (the tape's, computed through the final norm and the unembedding, soft
// cap undone by its formula), a difference of two tokens is the difference of their logits,
// heads (+ b_O) add up to each layer's attention share and all neurons (+ b_out) to its FFN
// share, and the top neurons are the largest of them. Against the PyTorch float64 oracle
// (tests/oracle, --logit-attribution, run at test time): every share for stories260K, the
// default GPT-2 model (LayerNorm: centred read-out, its bias, position embeddings) and a
// random Gemma 2 (frozen block-output norms, soft caps), on both backends.
#include "engine/interpret/logit_attribution.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/interpret/tiny_model.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

const std::vector<int32_t> kTokens = {1, 7, 3, 19, 4, 12, 9, 2};

Tape<double> MustTape(const Model& m) {
  kernels::ReferenceBackend be;
  auto t = RunForward(m, be, SequenceInput<double>{kTokens});
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

class TinyAttribution : public ::testing::TestWithParam<int> {};

TEST_P(TinyAttribution, SharesAddUpToTheModelsLogit) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  const AttributionOptions all{true, c.hidden_dim};
  for (int row : {0, 4, 7}) {
    const double* logits = t.logits.data() + int64_t{row} * c.vocab_size;
    // The tape's logits are capped (Gemma 2); undo the cap: l = cap · atanh(capped / cap).
    auto uncapped = [&](int v) {
      return c.final_softcap > 0 ? c.final_softcap * std::atanh(logits[v] / c.final_softcap)
                                 : logits[v];
    };
    auto r = AttributeLogit(*m, t, row, 5, -1, all);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->logit, uncapped(5), 1e-9);
    EXPECT_NEAR(r->Total(), r->logit, 1e-12);
    auto d = AttributeLogit(*m, t, row, 5, 11, all);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_NEAR(d->logit, uncapped(5) - uncapped(11), 1e-9);
    EXPECT_NEAR(d->Total(), d->logit, 1e-12);
    for (int l = 0; l < c.num_layers; ++l) {
      const double heads = std::accumulate(r->heads.begin() + int64_t{l} * c.num_heads,
                                           r->heads.begin() + int64_t{l + 1} * c.num_heads, 0.0);
      EXPECT_NEAR(heads + r->attn_bias[l], r->attn[l], 1e-12) << l;
      double neurons = 0;
      for (const NeuronShare& s : r->neurons) {
        if (s.layer == l) neurons += s.value;
      }
      EXPECT_NEAR(neurons + r->mlp_bias[l], r->mlp[l], 1e-12) << l;
    }
    EXPECT_EQ(r->pos_embed != 0.0, c.arch == Architecture::kGpt2);
    EXPECT_EQ(r->final_norm_bias != 0.0, c.arch == Architecture::kGpt2);
  }
}

// The top k neurons of a layer are its k largest |shares| among all of them, in order.
TEST_P(TinyAttribution, TopNeuronsAreTheLargest) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const ModelConfig& c = m->config;
  const Tape<double> t = MustTape(*m);
  auto all = AttributeLogit(*m, t, 6, 3, -1, {false, c.hidden_dim});
  auto top = AttributeLogit(*m, t, 6, 3, -1, {false, 4});
  ASSERT_TRUE(all.ok() && top.ok());
  EXPECT_TRUE(top->heads.empty());
  ASSERT_EQ(top->neurons.size(), size_t(4) * c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    std::vector<double> mags;
    for (const NeuronShare& s : all->neurons) {
      if (s.layer == l) mags.push_back(std::abs(s.value));
    }
    std::sort(mags.rbegin(), mags.rend());
    for (int k = 0; k < 4; ++k) EXPECT_EQ(std::abs(top->neurons[l * 4 + k].value), mags[k]);
  }
}

// fp32 (CpuBackend's tape) within 1e-4 of fp64, and its shares add up as well.
TEST_P(TinyAttribution, Fp32AgreesWithFp64) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(GetParam()));
  const Tape<double> t = MustTape(*m);
  kernels::CpuBackend fast(2);
  auto t32 = RunForward(*m, fast, SequenceInput<float>{kTokens});
  ASSERT_TRUE(t32.ok());
  auto a = AttributeLogit(*m, t, 7, 2, 9, {true, 3});
  auto b = AttributeLogit(*m, *t32, 7, 2, 9, {true, 3});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NEAR(b->logit, a->logit, 1e-4);
  EXPECT_NEAR(b->Total(), b->logit, 1e-4);
  for (size_t i = 0; i < a->heads.size(); ++i) EXPECT_NEAR(b->heads[i], a->heads[i], 1e-4);
  for (size_t i = 0; i < a->mlp.size(); ++i) EXPECT_NEAR(b->mlp[i], a->mlp[i], 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Families, TinyAttribution, ::testing::Range(0, testing::kTinyFamilies));

TEST(LogitAttribution, ErrorsNameTheField) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(1));
  const Tape<double> t = MustTape(*m);
  const int V = m->config.vocab_size;
  for (auto [row, token, baseline, top, field] :
       {std::tuple{8, 1, -1, 0, "position"}, std::tuple{-1, 1, -1, 0, "position"},
        std::tuple{0, V, -1, 0, "token"}, std::tuple{0, -1, -1, 0, "token"},
        std::tuple{0, 1, V, 0, "baseline_token"},
        std::tuple{0, 1, -1, m->config.hidden_dim + 1, "top_neurons"}}) {
    const auto r = AttributeLogit(*m, t, row, token, baseline, {false, top});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status();
  }
}

// Every share against the oracle's dla.* arrays: fp64 ≤ 1e-9, fp32 ≤ 1e-4 of the logit's
// scale (the largest |share|).
template <typename T>
double WorstAgainstOracle(const Model& m, kernels::Backend<T>& be,
                          const std::vector<int32_t>& tokens, int row, int token, int baseline,
                          const testing::OracleResult& ref) {
  const ModelConfig& c = m.config;
  auto t = RunForward(m, be, SequenceInput<T>{tokens});
  EXPECT_TRUE(t.ok()) << t.status();
  auto r = AttributeLogit(m, *t, row, token, baseline, {true, c.hidden_dim});
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return 1.0;
  std::vector<std::pair<std::string, std::vector<double>>> ours = {
      {"dla.logit", {r->logit}},
      {"dla.scale", {r->scale}},
      {"dla.embed", {r->embed}},
      {"dla.pos_embed", {r->pos_embed}},
      {"dla.final_norm_bias", {r->final_norm_bias}},
      {"dla.attn", r->attn},
      {"dla.mlp", r->mlp},
      {"dla.heads", r->heads},
      {"dla.attn_bias", r->attn_bias},
      {"dla.mlp_bias", r->mlp_bias}};
  std::vector<double> neurons(int64_t{c.num_layers} * c.hidden_dim);
  for (const NeuronShare& s : r->neurons)
    neurons[int64_t{s.layer} * c.hidden_dim + s.neuron] = s.value;
  ours.emplace_back("dla.neurons", neurons);
  double scale = 0;
  for (const auto& [name, v] : ours) {
    if (name == "dla.scale") continue;
    for (double x : ref.arrays.at(name).data) scale = std::max(scale, std::abs(x));
  }
  double worst = 0;
  for (const auto& [name, v] : ours) {
    const auto it = ref.arrays.find(name);
    EXPECT_NE(it, ref.arrays.end()) << name;
    if (it == ref.arrays.end()) continue;
    EXPECT_EQ(v.size(), it->second.data.size()) << name;
    const double s = name == "dla.scale" ? std::abs(it->second.data[0]) : scale;
    for (size_t i = 0; i < v.size() && i < it->second.data.size(); ++i) {
      const double e = std::abs(v[i] - it->second.data[i]) / s;
      EXPECT_LE(e, sizeof(T) == 8 ? 1e-9 : 1e-4) << name << "[" << i << "]";
      worst = std::max(worst, e);
    }
  }
  return worst;
}

void ExpectOracleAttribution(const std::string& path, const char* label,
                             const std::vector<int32_t>& tokens, int row, int token, int baseline) {
  auto m = LoadModel({path, ""});
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string spec =
      baseline < 0 ? absl::StrCat(row, ":", token) : absl::StrCat(row, ":", token, ":", baseline);
  const testing::OracleResult ref =
      testing::RunOracleWith(path, tokens, "--logit-attribution " + spec);
  ASSERT_TRUE(ref.error.empty()) << ref.error;
  kernels::ReferenceBackend ref_be;
  kernels::CpuBackend fast(2);
  const double e64 = WorstAgainstOracle<double>(**m, ref_be, tokens, row, token, baseline, ref);
  const double e32 = WorstAgainstOracle<float>(**m, fast, tokens, row, token, baseline, ref);
  std::printf("[oracle] %s attribution: worst error / largest share fp64 %.3g, fp32 %.3g\n", label,
              e64, e32);
}

TEST(LogitAttributionOracle, Stories260K) {
  const std::string bin = testing::TestData("stories260K/stories260K.bin");
  KVLENS_REQUIRE_FILE(bin);
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  ExpectOracleAttribution(bin, "stories260K", {1, 403, 407, 261, 378, 11, 300, 42, 7, 99}, 9, 42,
                          -1);
}

TEST(LogitAttributionOracle, DefaultGpt2Model) {
  const std::string dir = testing::DefaultModelPath();
  KVLENS_REQUIRE_FILE(dir + "/config.json");
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  ExpectOracleAttribution(dir, "kjv-gpt2-4l", {0, 34, 290, 1021, 17, 88, 5, 400, 61}, 6, 290, 17);
}

TEST(LogitAttributionOracle, Gemma2) {
  if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  const std::string path = testing::MakeQuantizedModel(
      "--f32 --gemma2 --set gemma2.attention.sliding_window=3 --set-float "
      "gemma2.attn_logit_softcapping=2 --set-float gemma2.final_logit_softcapping=3");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  ExpectOracleAttribution(path, "gemma2", {2, 5, 300, 17, 42, 383, 9, 77}, 7, 42, 300);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvlens::interpret
