// kvlens.v1.Interpret end to end: attention maps and gradient probes through the RPCs on
// stories260K and the default model against the PyTorch float64 oracle (autograd, run at test time;
// relative error ≤ 1e-6 at fp64, ≤ 1e-4 at fp32), the `verify` finite-difference report, chunking,
// limits that name their flag, and the kvlens_interp_* metrics.
#include <unistd.h>

#include <cstdio>
#include <random>

#include "engine/interpret/hook_gradients.h"
#include "engine/interpret/tape.h"
#include "gtest/gtest.h"
#include "tests/server/interpret_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

std::vector<int32_t> RandomTokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t = {1};
  while (static_cast<int>(t.size()) < n) t.push_back(static_cast<int32_t>(3 + rng() % 509));
  return t;
}

const std::vector<int32_t> kDocs = {0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2};

bool Visible(const std::vector<int32_t>& docs, int i, int j) {
  return j <= i && (docs.empty() || docs[i] == docs[j]);
}

// A random Qwen3 (tests/oracle/make_quantized_gguf.py --qwen3, f32, with stories260K's
// tokenizer): RMSNorm over each head of q and k, 4 query heads of 128 over a residual
// stream of 256. Written once per process and removed at exit; "" when it cannot be.
std::string Qwen3Path() {
  static const std::string path = [] {
    if (!OracleAvailable() || access(Stories260KPath().c_str(), R_OK) != 0) return std::string();
    return MakeQuantizedModel("--f32 --qwen3 --tokenizer " + Stories260KPath());
  }();
  static const struct Remove {
    ~Remove() {
      if (!path.empty()) std::remove(path.c_str());
    }
  } remove;
  return path;
}

// A random Gemma 2 (make_quantized_gguf.py --gemma2, f32, stories260K's tokenizer): GeGLU,
// embeddings times 16, norms on each block's outputs, heads of 256, attention scores
// soft-capped at 2 (which binds) and logits at llama.cpp's 30; no window. As Qwen3Path.
std::string Gemma2Path() {
  static const std::string path = [] {
    if (!OracleAvailable() || access(Stories260KPath().c_str(), R_OK) != 0) return std::string();
    return MakeQuantizedModel(
        "--f32 --gemma2 --set-float gemma2.attn_logit_softcapping=2 "
        "--tokenizer " +
        Stories260KPath());
  }();
  static const struct Remove {
    ~Remove() {
      if (!path.empty()) std::remove(path.c_str());
    }
  } remove;
  return path;
}

// The oracle comparisons run on both model families: stories260K (Llama: RMSNorm, RoPE,
// SwiGLU, GQA), a Qwen3 (a Llama with head norms and heads wider than dim / heads), a
// Gemma 2 (soft-capped scores and logits) and the default model (GPT-2: LayerNorm, learned
// positions, GELU, biases).
struct OracleModel {
  const char* name;
  std::string (*path)();
};
const OracleModel kOracleModels[] = {{"stories260K", Stories260KPath},
                                     {"qwen3", Qwen3Path},
                                     {"gemma2", Gemma2Path},
                                     {"kjv_gpt2_4l", DefaultModelPath}};

// Skips without the model or the oracle; else serves the model.
class InterpretOracle : public ::testing::TestWithParam<OracleModel> {
 protected:
  void SetUp() override {
    model_ = GetParam().path();
    KVLENS_REQUIRE_FILE(model_);
    if (!OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
    server_ = std::make_unique<TestServer>(model_, TestServer::DefaultOptions());
    ASSERT_TRUE(server_->ok()) << server_->error();
  }
  std::string model_;
  std::unique_ptr<TestServer> server_;
};
INSTANTIATE_TEST_SUITE_P(Models, InterpretOracle, ::testing::ValuesIn(kOracleModels),
                         [](const auto& p) { return std::string(p.param.name); });

TEST_P(InterpretOracle, AttentionMapsMatchOracle) {
  const std::string& model = model_;
  TestServer& server = *server_;
  auto stub = InterpretStub(server);
  const ModelConfig& c = server.model().config;
  const std::vector<int32_t> tokens = RandomTokens(17, 5);
  for (const std::vector<int32_t>& docs : {std::vector<int32_t>{}, kDocs}) {
    const OracleResult ref = RunGradOracle(model, tokens, {{16, 42}}, docs);
    ASSERT_TRUE(ref.error.empty()) << ref.error;
    for (const v1::Precision p : {v1::PRECISION_FP64, v1::PRECISION_FP32}) {
      v1::AttentionMapsRequest request;
      *request.mutable_input() = IdsInput(tokens, docs);
      request.set_precision(p);
      request.set_scores(true);
      const AttentionResult r = RunAttentionMaps(*stub, request);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      EXPECT_EQ(r.info.precision(), p);
      EXPECT_EQ(r.info.dtype(), v1::DTYPE_FP32);
      ASSERT_EQ(r.info.layers_size(), c.num_layers);
      ASSERT_EQ(r.info.heads_size(), c.num_heads);
      EXPECT_EQ(r.chunks, c.num_layers);  // small maps: one chunk per layer
      std::vector<double> ours, oracle;
      for (int l = 0; l < c.num_layers; ++l) {
        const std::vector<double>& a = ref.arrays.at(absl::StrCat("attn.", l)).data;
        oracle.insert(oracle.end(), a.begin(), a.end());
      }
      const double err = RelErr(r.probs, oracle);
      EXPECT_LE(err, p == v1::PRECISION_FP64 ? 1e-6 : 1e-4);
      std::printf("[interp] %s AttentionMaps%s %s: relative error vs oracle %.3g\n",
                  GetParam().name, docs.empty() ? "" : " (doc ids)",
                  p == v1::PRECISION_FP64 ? "fp64" : "fp32", err);
      // Masked scores are −∞, visible ones finite.
      const int n = static_cast<int>(tokens.size());
      for (int i = 0; i < n; ++i) {
        for (int j = 0; j < n; ++j) {
          const double s = r.scores[static_cast<size_t>(i) * n + j];  // layer 0, head 0
          EXPECT_EQ(std::isinf(s) && s < 0, !Visible(docs, i, j)) << i << "," << j;
        }
      }
    }
  }
}

TEST(InterpretAttention, RangesFp16AndChunks) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  server::InterpretOptions options;
  options.limits.chunk_bytes = 100000;
  TestServer server(TestServer::DefaultOptions(), 1, options);
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const ModelConfig& c = server.model().config;
  const std::vector<int32_t> tokens = RandomTokens(120, 9);
  v1::AttentionMapsRequest full;
  *full.mutable_input() = IdsInput(tokens);
  const AttentionResult all = RunAttentionMaps(*stub, full);
  ASSERT_TRUE(all.status.ok()) << all.status.error_message();
  // 8 heads × 120 × 120 fp32 = 460 kB per layer: five chunks of ≤ 100 kB per layer.
  EXPECT_EQ(all.chunks, 5 * c.num_layers);
  for (double x : all.probs) ASSERT_FALSE(std::isnan(x));

  v1::AttentionMapsRequest part = full;
  part.add_layers(3);
  part.add_layers(1);
  part.add_heads(5);
  part.add_heads(2);
  part.mutable_queries()->set_begin(40);
  part.mutable_queries()->set_end(60);
  part.mutable_keys()->set_begin(10);
  part.mutable_keys()->set_end(50);
  part.set_dtype(v1::DTYPE_FP16);
  const AttentionResult sub = RunAttentionMaps(*stub, part);
  ASSERT_TRUE(sub.status.ok()) << sub.status.error_message();
  EXPECT_EQ(sub.info.dtype(), v1::DTYPE_FP16);
  const int n = 120, H = c.num_heads;
  const int layers[] = {3, 1}, heads[] = {5, 2};
  double worst = 0;
  for (int li = 0; li < 2; ++li)
    for (int hi = 0; hi < 2; ++hi)
      for (int q = 0; q < 20; ++q)
        for (int k = 0; k < 40; ++k) {
          const double want =
              all.probs[((static_cast<size_t>(layers[li]) * H + heads[hi]) * n + 40 + q) * n + 10 +
                        k];
          const double got = sub.probs[((li * 2 + hi) * 20 + q) * 40 + k];
          worst = std::max(worst, std::abs(want - got));
        }
  EXPECT_LE(worst, 5e-4);  // fp16 rounding of values ≤ 1
}

TEST(InterpretAttention, HeadSummaries) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  std::vector<int32_t> tokens = RandomTokens(21, 3);  // BOS + 20, then the 20 again
  tokens.insert(tokens.end(), tokens.begin() + 1, tokens.end());
  v1::AttentionMapsRequest request;
  *request.mutable_input() = IdsInput(tokens);
  request.set_head_summaries(true);
  request.set_probabilities_off(true);
  request.set_induction_start(1);
  request.set_induction_period(20);
  const AttentionResult r = RunAttentionMaps(*stub, request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.chunks, 0);
  const ModelConfig& c = server.model().config;
  ASSERT_EQ(static_cast<int>(r.summaries.size()), c.num_layers * c.num_heads);
  for (const v1::HeadSummary& s : r.summaries) {
    EXPECT_GE(s.sink(), 0);
    EXPECT_LE(s.sink(), 1);
    EXPECT_GE(s.induction(), 0);
    EXPECT_LE(s.induction(), 1);
    EXPECT_GE(s.entropy(), 0);
  }
}

// Our per-head slice against the oracle's [heads, rows, cols] array.
std::vector<double> OracleHead(const OracleArray& a, int h) {
  const int64_t per = a.dims[1] * a.dims[2];
  return std::vector<double>(a.data.begin() + h * per, a.data.begin() + (h + 1) * per);
}

TEST_P(InterpretOracle, GradientsMatchOracle) {
  const std::string& model = model_;
  TestServer& server = *server_;
  auto stub = InterpretStub(server);
  const ModelConfig& c = server.model().config;
  const std::vector<int32_t> tokens = RandomTokens(17, 31);
  const std::vector<std::pair<int, int>> targets = {{16, 42}, {9, 300}, {3, 7}};
  for (const std::vector<int32_t>& docs : {std::vector<int32_t>{}, kDocs}) {
    constexpr int kParamLayer = 1;
    const OracleResult ref = RunGradOracle(model, tokens, targets, docs, kParamLayer);
    ASSERT_TRUE(ref.error.empty()) << ref.error;
    const int n = static_cast<int>(tokens.size());
    std::vector<bool> visible(static_cast<size_t>(n) * n);
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) visible[static_cast<size_t>(i) * n + j] = Visible(docs, i, j);
    for (const v1::Precision p : {v1::PRECISION_FP64, v1::PRECISION_FP32}) {
      v1::GradientProbeRequest request;
      *request.mutable_input() = IdsInput(tokens, docs);
      for (const auto& [row, token] : targets) {
        v1::TokenTarget* t = request.mutable_log_prob()->add_targets();
        t->set_position(row);
        t->set_token(token);
      }
      request.set_precision(p);
      for (auto set :
           {&v1::GradientProbeRequest::set_scores, &v1::GradientProbeRequest::set_probs,
            &v1::GradientProbeRequest::set_q, &v1::GradientProbeRequest::set_k,
            &v1::GradientProbeRequest::set_v, &v1::GradientProbeRequest::set_attn_out,
            &v1::GradientProbeRequest::set_residual, &v1::GradientProbeRequest::set_embeddings,
            &v1::GradientProbeRequest::set_attention_times_gradient}) {
        (request.*set)(true);
      }
      // q and k before RoPE (hook_q / hook_k), and after it (rot_q / rot_k) on a rotary model
      const bool rotary = ref.arrays.count("grad.rot_q.0") > 0;
      request.set_rot_q(rotary);
      request.set_rot_k(rotary);
      // and the gradient at every hook that has one, at every layer
      for (interpret::Hook hook : interpret::HooksWithGradient()) {
        if (interpret::CheckModelHasHook(c, hook).ok()) {
          request.add_hooks(std::string(interpret::HookName(hook)));
        }
      }
      request.set_param_layer(kParamLayer);
      v1::GradientProbeResponse response;
      grpc::ClientContext context;
      SetDeadline(context);
      const grpc::Status status = stub->GradientProbe(&context, request, &response);
      ASSERT_TRUE(status.ok()) << status.error_message();
      const bool fp64 = p == v1::PRECISION_FP64;
      EXPECT_EQ(response.precision(), p);
      EXPECT_NEAR(response.objective(), ref.arrays.at("objective").data[0], fp64 ? 1e-10 : 1e-3);
      const double tol = fp64 ? 1e-6 : 1e-4;
      double worst = 0;
      auto check = [&](const std::string& what, const v1::Tensor* t,
                       const std::vector<double>& want, const std::vector<bool>* keep = nullptr) {
        ASSERT_NE(t, nullptr) << what;
        EXPECT_EQ(t->dtype(), fp64 ? v1::DTYPE_FP64 : v1::DTYPE_FP32);
        const double e = RelErr(DecodeTensor(*t), want, keep);
        EXPECT_LE(e, tol) << what;
        worst = std::max(worst, e);
      };
      const auto& ts = response.tensors();
      check("embeddings", FindTensor(ts, "grad.embeddings", -1, -1),
            ref.arrays.at("grad.embeds").data);
      for (int l = 0; l < c.num_layers; ++l) {
        const std::string s = absl::StrCat(".", l);
        check("resid" + s, FindTensor(ts, "grad.residual", l + 1, -1),
              ref.arrays.at("grad.resid" + s).data);
        for (int h = 0; h < c.num_heads; ++h) {
          const std::string at = absl::StrCat(s, " head ", h);
          check("q" + at, FindTensor(ts, "grad.q", l, h),
                OracleHead(ref.arrays.at("grad.q" + s), h));
          if (rotary) {
            check("rot_q" + at, FindTensor(ts, "grad.rot_q", l, h),
                  OracleHead(ref.arrays.at("grad.rot_q" + s), h));
          }
          check("attn_out" + at, FindTensor(ts, "grad.attn_out", l, h),
                OracleHead(ref.arrays.at("grad.attn_out" + s), h));
          check("scores" + at, FindTensor(ts, "grad.scores", l, h),
                OracleHead(ref.arrays.at("grad.scores" + s), h), &visible);
          check("probs" + at, FindTensor(ts, "grad.probs", l, h),
                OracleHead(ref.arrays.at("grad.probs" + s), h), &visible);
          // attention × gradient = A ⊙ dJ/dA from the oracle's own A and dA.
          const std::vector<double> a = OracleHead(ref.arrays.at("attn" + s), h);
          std::vector<double> da = OracleHead(ref.arrays.at("grad.probs" + s), h);
          for (size_t i = 0; i < da.size(); ++i) da[i] = visible[i] ? a[i] * da[i] : 0.0;
          check("attention_x_gradient" + at, FindTensor(ts, "attention_x_gradient", l, h), da);
        }
        for (int h = 0; h < c.num_kv_heads; ++h) {
          const std::string at = absl::StrCat(s, " kv head ", h);
          check("k" + at, FindTensor(ts, "grad.k", l, h),
                OracleHead(ref.arrays.at("grad.k" + s), h));
          if (rotary) {
            check("rot_k" + at, FindTensor(ts, "grad.rot_k", l, h),
                  OracleHead(ref.arrays.at("grad.rot_k" + s), h));
          }
          check("v" + at, FindTensor(ts, "grad.v", l, h),
                OracleHead(ref.arrays.at("grad.v" + s), h));
        }
      }
      // One layer's attention weights (returned in fp64 whatever the precision), [out, in].
      for (const char* w : {"wq", "wk", "wv", "wo"}) {
        const v1::Tensor* t = FindTensor(ts, absl::StrCat("grad.", w), kParamLayer, -1);
        ASSERT_NE(t, nullptr) << w;
        const std::string name = w;
        const int out = name == "wq" ? c.q_dim() : name == "wo" ? c.dim : c.kv_dim();
        const int in = name == "wo" ? c.q_dim() : c.dim;
        ASSERT_EQ(t->shape_size(), 2) << w;
        EXPECT_EQ(t->shape(0), out) << w;
        EXPECT_EQ(t->shape(1), in) << w;
        const double e = RelErr(DecodeTensor(*t), ref.arrays.at(absl::StrCat("grad.", w)).data);
        EXPECT_LE(e, tol) << w;
        worst = std::max(worst, e);
      }
      // Each hook's gradient against autograd at the oracle's tensor of that hook
      // (the pattern's masked entries aside: the oracle's are dO · v there, ours 0).
      int hooks_read = 0;
      for (const v1::Tensor& t : response.hook_gradients()) {
        const bool per_layer = t.layer() >= 0;
        const std::string key = per_layer ? absl::StrCat("grad.hook.", t.name(), ".", t.layer())
                                : t.name() == "ln_final" ? std::string("grad.hook.ln_final")
                                                         : std::string("grad.embeds");
        std::vector<bool> keep;
        if (t.name() == "pattern") {
          for (int h = 0; h < c.num_heads; ++h)
            keep.insert(keep.end(), visible.begin(), visible.end());
        }
        check("hook " + key, &t, ref.arrays.at(key).data, keep.empty() ? nullptr : &keep);
        ++hooks_read;
      }
      // embed, ln_final (and GPT-2's pos_embed) once
      const int once = rotary ? 2 : 3;
      EXPECT_EQ(hooks_read, (request.hooks_size() - once) * c.num_layers + once);
      const v1::Tensor* saliency = FindTensor(ts, "saliency", -1, -1);
      ASSERT_NE(saliency, nullptr);
      EXPECT_EQ(saliency->shape(0), n);
      std::printf("[interp] %s GradientProbe%s %s: worst relative error vs oracle %.3g\n",
                  GetParam().name, docs.empty() ? "" : " (doc ids)", fp64 ? "fp64" : "fp32", worst);
      v1::GradientProbeResponse ignored;
      for (const char* hook :
           {"ln1_scale", "blocks.0.ln2.hook_normalized", "ln_final.hook_normalized"}) {
        v1::GradientProbeRequest bad = request;
        bad.add_hooks(hook);
        ExpectInvalid(CallInterpret(server, &v1::Interpret::Stub::GradientProbe, bad, &ignored),
                      "no gradient is kept there");
      }
      v1::GradientProbeRequest twice = request;
      twice.add_hooks("blocks.1.hook_resid_pre");
      ExpectInvalid(CallInterpret(server, &v1::Interpret::Stub::GradientProbe, twice, &ignored),
                    "hooks: \"blocks.1.hook_resid_pre\" asks again for blocks.1.hook_resid_pre");
      if (!rotary) {  // GPT-2's q and k are what its scores use: there is no rot_q / rot_k
        request.set_rot_q(true);
        ExpectInvalid(CallInterpret(server, &v1::Interpret::Stub::GradientProbe, request, &ignored),
                      "rot_q: the model (gpt2) has no rotary embedding");
        request.set_rot_q(false);
        request.set_rot_k(true);
        ExpectInvalid(CallInterpret(server, &v1::Interpret::Stub::GradientProbe, request, &ignored),
                      "rot_k: the model (gpt2) has no rotary embedding");
      }
    }
  }
}

TEST(InterpretProbe, VerifyReportsSmallFiniteDifferenceErrors) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const ModelConfig& c = server.model().config;
  const std::vector<int32_t> tokens = RandomTokens(12, 77);
  std::vector<v1::GradientProbeRequest> requests(3);
  requests[0].mutable_logit_diff()->set_position(11);
  requests[0].mutable_logit_diff()->set_token_a(40);
  requests[0].mutable_logit_diff()->set_token_b(41);
  requests[1].mutable_attn_out_probe()->set_layer(2);
  requests[1].mutable_attn_out_probe()->set_head(3);
  std::mt19937 rng(4);
  std::normal_distribution<double> nd;
  for (int i = 0; i < 12 * c.head_dim; ++i) requests[1].mutable_attn_out_probe()->add_g(nd(rng));
  v1::TokenTarget* t = requests[2].mutable_log_prob()->add_targets();
  t->set_position(11);
  t->set_token(99);
  requests[2].set_param_layer(1);
  for (v1::GradientProbeRequest& r : requests) {
    *r.mutable_input() = IdsInput(tokens);
    r.set_precision(v1::PRECISION_FP64);
    r.set_q(true);
    r.set_k(true);
    r.set_rot_q(true);
    r.set_rot_k(true);
    r.set_probs(true);
    r.set_residual(true);
    r.set_verify(true);
    r.set_verify_samples(4);
    v1::GradientProbeResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status status = stub->GradientProbe(&context, r, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_TRUE(response.has_verify());
    std::vector<std::string> names;
    for (const v1::VerifyTensorReport& tr : response.verify().tensors()) names.push_back(tr.name());
    EXPECT_EQ(names, (std::vector<std::string>{"probs", "q", "k", "rot_q", "rot_k", "residual"}));
    EXPECT_GT(response.verify().num_forwards(), 0);
    // FD noise is ~1e-12 absolute; relative errors grow only where gradients are ~1e-7.
    EXPECT_LE(response.verify().max_abs_err(), 1e-9);
    EXPECT_LE(response.verify().max_rel_err(), 1e-4);
    std::printf("[interp] verify (%s): max abs %.3g, max rel %.3g over %d forwards\n",
                r.has_logit_diff()       ? "logit diff"
                : r.has_attn_out_probe() ? "attn-out probe"
                                         : "log-prob",
                response.verify().max_abs_err(), response.verify().max_rel_err(),
                response.verify().num_forwards());
    if (r.has_param_layer()) {
      const v1::Tensor* wq = FindTensor(response.tensors(), "grad.wq", 1, -1);
      ASSERT_NE(wq, nullptr);
      EXPECT_EQ(wq->shape(0), c.dim);
      EXPECT_EQ(wq->dtype(), v1::DTYPE_FP64);
    }
  }
}

// verify with hooks: each (hook, layer) asked gets a report of its own, by its full name,
// after the tensor kinds' (the residual when none is asked); the hooks an edit moves are
// sampled and agree with finite differences, mlp.hook_post (no edit moves one entry of the
// FFN's hidden row alone) reports 0 samples.
TEST(InterpretProbe, VerifyChecksEachAskedHookAtItsLayer) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  v1::GradientProbeRequest r;
  *r.mutable_input() = IdsInput(RandomTokens(10, 31));
  v1::TokenTarget* t = r.mutable_log_prob()->add_targets();
  t->set_position(9);
  t->set_token(57);
  r.set_precision(v1::PRECISION_FP64);
  const std::vector<std::string> hooks = {"blocks.1.hook_resid_mid", "blocks.0.attn.hook_pattern",
                                          "blocks.2.hook_mlp_out", "blocks.0.attn.hook_q",
                                          "blocks.2.mlp.hook_post"};
  for (const std::string& h : hooks) r.add_hooks(h);
  r.set_verify(true);
  r.set_verify_samples(3);
  v1::GradientProbeResponse response;
  const grpc::Status status =
      CallInterpret(server, &v1::Interpret::Stub::GradientProbe, r, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.verify().tensors_size(), 1 + static_cast<int>(hooks.size()));
  EXPECT_EQ(response.verify().tensors(0).name(), "residual");
  for (size_t k = 0; k < hooks.size(); ++k) {
    const v1::VerifyTensorReport& tr = response.verify().tensors(static_cast<int>(k) + 1);
    EXPECT_EQ(tr.name(), hooks[k]);
    EXPECT_EQ(tr.samples(), hooks[k] == "blocks.2.mlp.hook_post" ? 0 : 3) << hooks[k];
    EXPECT_LE(tr.max_abs_err(), 1e-9) << hooks[k];
    EXPECT_LE(tr.max_rel_err(), 1e-4) << hooks[k];
    std::printf("[interp] verify %s: %d samples, max abs %.3g, max rel %.3g\n", tr.name().c_str(),
                tr.samples(), tr.max_abs_err(), tr.max_rel_err());
  }
  // 3 samples × 4 forwards: the residual and four hooks, and two unedited forwards for the
  // patched resid_mid and mlp_out.
  EXPECT_EQ(response.verify().num_forwards(), 5 * 3 * 4 + 2);
}

TEST(InterpretLimits, ErrorsNameTheLimitOrField) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  server::InterpretOptions options;
  options.limits.max_positions = 64;
  options.limits.max_layer_heads = 6;
  options.limits.max_bytes = 20000;
  TestServer server(TestServer::DefaultOptions(), 1, options);
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  auto maps = [&](const v1::AttentionMapsRequest& r) { return RunAttentionMaps(*stub, r).status; };
  auto expect = [](const grpc::Status& s, grpc::StatusCode code, const std::string& needle) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(needle), std::string::npos) << s.error_message();
  };
  v1::AttentionMapsRequest r;
  *r.mutable_input() = IdsInput(RandomTokens(65, 1));
  expect(maps(r), grpc::StatusCode::INVALID_ARGUMENT, "--max-interp-positions = 64");
  *r.mutable_input() = IdsInput(RandomTokens(40, 1));
  expect(maps(r), grpc::StatusCode::INVALID_ARGUMENT, "--max-interp-layer-heads = 6");
  r.add_layers(0);
  r.add_heads(0);
  r.add_heads(1);
  // 2 heads × 40 × 40 × 4 bytes = 12800 ≤ 20000; with scores 25600 > 20000
  EXPECT_TRUE(maps(r).ok());
  r.set_scores(true);
  expect(maps(r), grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-interp-bytes = 20000");
  r.set_dtype(v1::DTYPE_FP16);  // halves it
  EXPECT_TRUE(maps(r).ok());
  v1::AttentionMapsRequest bad = r;
  bad.add_heads(99);
  expect(maps(bad), grpc::StatusCode::INVALID_ARGUMENT, "heads[2] = 99");
  r.mutable_queries()->set_begin(30);
  r.mutable_queries()->set_end(20);
  expect(maps(r), grpc::StatusCode::INVALID_ARGUMENT, "queries");
  r.clear_queries();
  // A packed input whose first position is in a later document than... every row sees
  // itself, so rows are never empty; a mismatched doc_ids length is the error.
  r.mutable_input()->add_doc_ids(0);
  expect(maps(r), grpc::StatusCode::INVALID_ARGUMENT, "doc_ids");

  v1::GradientProbeRequest p;
  *p.mutable_input() = IdsInput(RandomTokens(10, 1));
  grpc::ClientContext c1;
  SetDeadline(c1);
  v1::GradientProbeResponse pr;
  expect(stub->GradientProbe(&c1, p, &pr), grpc::StatusCode::INVALID_ARGUMENT, "objective");
  p.mutable_log_prob()->add_targets()->set_position(10);
  grpc::ClientContext c2;
  SetDeadline(c2);
  expect(stub->GradientProbe(&c2, p, &pr), grpc::StatusCode::INVALID_ARGUMENT,
         "log_prob.targets[0].position = 10");
  p.mutable_log_prob()->mutable_targets(0)->set_position(9);
  p.add_layers(0);
  p.add_heads(0);
  p.set_scores(true);
  p.set_residual(true);  // 2 × [10, 64] fp32 + … > 20000 bytes? no: the limit below
  p.set_param_layer(0);  // 4 × [64, 64] fp64 = 131 kB > 20000
  grpc::ClientContext c3;
  SetDeadline(c3);
  expect(stub->GradientProbe(&c3, p, &pr), grpc::StatusCode::RESOURCE_EXHAUSTED,
         "--max-interp-bytes");
}

// --max-interp-tape-bytes: a request whose tapes would need more working memory than the
// flag allows is refused before it allocates, naming the flag; the limit here is exactly
// one fp32 tape of 40 positions (interpret::TapeBytes, checked against real tapes in
// tests/engine/interpret/tape_test.cc), so 40 positions of maps fit and 41 do not, and a
// probe (tape + gradients) of 40 does not.
TEST(InterpretLimits, WorkingMemoryNamesTheFlag) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  server::InterpretOptions options;
  TestServer probe_size(TestServer::DefaultOptions(), 1, options);
  ASSERT_TRUE(probe_size.ok()) << probe_size.error();
  const int64_t one_tape = interpret::TapeBytes(probe_size.model().config, 40, 40, 4, false);
  options.limits.max_tape_bytes = one_tape;
  TestServer server(TestServer::DefaultOptions(), 1, options);
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const std::string flag = "--max-interp-tape-bytes = " + std::to_string(one_tape);
  v1::AttentionMapsRequest r;
  r.add_layers(0);
  r.add_heads(0);
  *r.mutable_input() = IdsInput(RandomTokens(40, 1));
  EXPECT_TRUE(RunAttentionMaps(*stub, r).status.ok());
  *r.mutable_input() = IdsInput(RandomTokens(41, 1));
  const grpc::Status big = RunAttentionMaps(*stub, r).status;
  EXPECT_EQ(big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << big.error_message();
  EXPECT_NE(big.error_message().find(flag), std::string::npos) << big.error_message();
  EXPECT_NE(big.error_message().find("over 41 positions"), std::string::npos)
      << big.error_message();

  v1::GradientProbeRequest p;
  *p.mutable_input() = IdsInput(RandomTokens(40, 1));
  p.mutable_log_prob()->add_targets()->set_position(39);
  grpc::ClientContext context;
  SetDeadline(context);
  v1::GradientProbeResponse pr;
  const grpc::Status probe = stub->GradientProbe(&context, p, &pr);
  EXPECT_EQ(probe.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << probe.error_message();
  EXPECT_NE(probe.error_message().find("GradientProbe over 40 positions"), std::string::npos)
      << probe.error_message();
  EXPECT_NE(probe.error_message().find(flag), std::string::npos) << probe.error_message();
  // The server still answers.
  *r.mutable_input() = IdsInput(RandomTokens(8, 1));
  EXPECT_TRUE(RunAttentionMaps(*stub, r).status.ok());
}

// The FFN's gradients (hooks mlp_pre, mlp_post, mlp_pre_linear) are kept only when asked,
// and then counted: with the limit at exactly a 12-position probe's tape and gradients, the
// resid_post gradient fits and mlp_post's is refused, its need 3 · L · n · F floats more.
TEST(InterpretLimits, FeedForwardGradientsCountWhenAsked) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  server::InterpretOptions options;
  TestServer probe_size(TestServer::DefaultOptions(), 1, options);
  ASSERT_TRUE(probe_size.ok()) << probe_size.error();
  const ModelConfig& c = probe_size.model().config;
  const int n = 12;
  options.limits.max_tape_bytes = interpret::TapeBytes(c, n, n, 4, true);
  TestServer server(TestServer::DefaultOptions(), 1, options);
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  auto probe = [&](const char* hook, v1::GradientProbeResponse* out) {
    v1::GradientProbeRequest p;
    *p.mutable_input() = IdsInput(RandomTokens(n, 1));
    p.mutable_log_prob()->add_targets()->set_position(n - 1);
    p.add_hooks(hook);
    grpc::ClientContext context;
    SetDeadline(context);
    return stub->GradientProbe(&context, p, out);
  };
  v1::GradientProbeResponse ok, refused;
  const grpc::Status fits = probe("resid_post", &ok);
  EXPECT_TRUE(fits.ok()) << fits.error_message();
  EXPECT_EQ(ok.hook_gradients_size(), c.num_layers);
  const grpc::Status over = probe("mlp_post", &refused);
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << over.error_message();
  const int64_t need =
      options.limits.max_tape_bytes + int64_t{3} * c.num_layers * n * c.hidden_dim * 4;
  EXPECT_NE(over.error_message().find(
                absl::StrCat("GradientProbe over ", n, " positions needs ", need, " bytes")),
            std::string::npos)
      << over.error_message();
  // one layer's mlp_post keeps only that layer's FFN gradients: a limit with room for one
  // layer's takes it and refuses two layers'
  options.limits.max_tape_bytes += int64_t{3} * n * c.hidden_dim * 4;
  TestServer roomier(TestServer::DefaultOptions(), 1, options);
  ASSERT_TRUE(roomier.ok()) << roomier.error();
  stub = InterpretStub(roomier);
  v1::GradientProbeResponse one;
  const grpc::Status one_layer = probe("blocks.1.mlp.hook_post", &one);
  ASSERT_TRUE(one_layer.ok()) << one_layer.error_message();
  ASSERT_EQ(one.hook_gradients_size(), 1);
  EXPECT_EQ(one.hook_gradients(0).layer(), 1);
  v1::GradientProbeRequest two;
  *two.mutable_input() = IdsInput(RandomTokens(n, 1));
  two.mutable_log_prob()->add_targets()->set_position(n - 1);
  two.add_hooks("blocks.0.mlp.hook_post");
  two.add_hooks("blocks.1.mlp.hook_pre");
  grpc::ClientContext context;
  SetDeadline(context);
  const grpc::Status both = stub->GradientProbe(&context, two, &refused);
  EXPECT_EQ(both.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << both.error_message();
  // and the same layer's two hooks share its one set
  v1::GradientProbeRequest same = two;
  same.set_hooks(0, "blocks.1.mlp.hook_post");
  grpc::ClientContext same_context;
  SetDeadline(same_context);
  const grpc::Status shared = stub->GradientProbe(&same_context, same, &one);
  EXPECT_TRUE(shared.ok()) << shared.error_message();
  EXPECT_EQ(one.hook_gradients_size(), 2);
}

TEST(InterpretMetrics, RecordedByKind) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  v1::AttentionMapsRequest r;
  *r.mutable_input() = IdsInput(RandomTokens(8, 1));
  ASSERT_TRUE(RunAttentionMaps(*stub, r).status.ok());
  v1::LogitLensRequest lens;
  *lens.mutable_input() = IdsInput(RandomTokens(8, 1));
  v1::LogitLensResponse lr;
  grpc::ClientContext context;
  SetDeadline(context);
  ASSERT_TRUE(stub->LogitLens(&context, lens, &lr).ok());
  const std::string m = ScrapeMetrics(server.metrics_port());
  EXPECT_EQ(MetricValue(m, "kvlens_interp_requests_total{kind=\"attention\"}"), 1);
  EXPECT_EQ(MetricValue(m, "kvlens_interp_requests_total{kind=\"lens\"}"), 1);
  EXPECT_EQ(MetricValue(m, "kvlens_interp_requests_total{kind=\"probe\"}"), 0);
  EXPECT_GT(MetricValue(m, "kvlens_interp_response_bytes_total{kind=\"attention\"}"),
            5 * 8 * 8 * 8 * 4);
  EXPECT_EQ(MetricValue(m, "kvlens_interp_duration_seconds_count{kind=\"attention\"}"), 1);
  EXPECT_EQ(MetricValue(m, R"(kvlens_requests_total{code="OK",rpc="AttentionMaps"})"), 1);
}

}  // namespace
}  // namespace kvlens::testing
