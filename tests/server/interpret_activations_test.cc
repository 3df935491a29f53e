// kvlens.v1.Interpret Activations and LogitAttribution end to end on the default model
// (GPT-2 family: LayerNorm, biases, learned positions): through the RPC against the
// PyTorch float64 oracle (tests/oracle --activations / --logit-attribution, run at test
// time), fp16 on the wire, every malformed request refused naming its field, the byte limit
// naming its flag, and the calls counted under their metric kinds.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/server/interpret_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

const std::vector<int32_t> kTokens = {4095, 34, 290, 1021, 17, 88, 5, 400, 61, 7};

TestServer DefaultModelServer(server::InterpretOptions interpret = {}) {
  return TestServer(DefaultModelPath(), TestServer::DefaultOptions(), 1, interpret);
}

grpc::Status CallActivations(TestServer& server, const v1::ActivationsRequest& request,
                             v1::ActivationsResponse* response) {
  auto stub = InterpretStub(server);
  grpc::ClientContext context;
  SetDeadline(context);
  return stub->Activations(&context, request, response);
}

grpc::Status CallAttribution(TestServer& server, const v1::LogitAttributionRequest& request,
                             v1::LogitAttributionResponse* response) {
  auto stub = InterpretStub(server);
  grpc::ClientContext context;
  SetDeadline(context);
  return stub->LogitAttribution(&context, request, response);
}

// Rows [begin, end) of an oracle array whose first dimension is the position.
std::vector<double> OracleRows(const OracleArray& a, int begin, int end) {
  const int64_t width = static_cast<int64_t>(a.data.size()) / a.dims[0];
  return std::vector<double>(a.data.begin() + begin * width, a.data.begin() + end * width);
}

// Query rows [begin, end) of an oracle map [H, T, T], head first: [H, end − begin, T].
std::vector<double> OracleMapRows(const OracleArray& a, int begin, int end) {
  const int64_t t = a.dims[1], keys = a.dims[2];
  std::vector<double> out;
  for (int64_t h = 0; h < a.dims[0]; ++h) {
    out.insert(out.end(), a.data.begin() + (h * t + begin) * keys,
               a.data.begin() + (h * t + end) * keys);
  }
  return out;
}

// The relative error of `got` against `want` where both are finite; the masked entries
// (−∞ scores) must be −∞ in both.
double MaskedRelErr(const std::vector<double>& got, std::vector<double> want) {
  std::vector<double> finite = got;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) return INFINITY;
      finite[i] = want[i] = 0;
    }
  }
  return RelErr(finite, want);
}

TEST(InterpretActivations, MatchTheOracle) {
  KVLENS_REQUIRE_FILE(DefaultModelPath() + "/config.json");
  if (!OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  TestServer server = DefaultModelServer();
  ASSERT_TRUE(server.ok()) << server.error();
  const OracleResult ref = RunOracleWith(DefaultModelPath(), kTokens, "--activations");
  ASSERT_TRUE(ref.error.empty()) << ref.error;
  const ModelConfig& c = server.model().config;
  v1::ActivationsRequest r;
  *r.mutable_input() = IdsInput(kTokens);
  // Short names at every layer asked for; TransformerLens's full names at their own.
  for (const char* h :
       {"resid_pre", "resid_post", "attn_out", "mlp_out", "z", "result", "blocks.2.attn.hook_k",
        "mlp_post", "attn_scores", "blocks.0.attn.hook_pattern", "ln_final.hook_normalized"}) {
    r.add_hooks(h);
  }
  r.add_layers(3);
  r.add_layers(1);
  r.mutable_positions()->set_begin(2);
  r.mutable_positions()->set_end(7);
  for (const v1::Precision precision : {v1::PRECISION_FP64, v1::PRECISION_FP32}) {
    r.set_precision(precision);
    v1::ActivationsResponse a;
    const grpc::Status s = CallActivations(server, r, &a);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(a.precision(), precision);
    EXPECT_EQ(std::vector<int32_t>(a.token_ids().begin(), a.token_ids().end()), kTokens);
    EXPECT_EQ(a.positions().begin(), 2);
    EXPECT_EQ(a.positions().end(), 7);
    ASSERT_EQ(a.tensors_size(), 8 * 2 + 3);  // k, pattern and ln_final once
    double worst = 0;
    for (const v1::Tensor& t : a.tensors()) {
      EXPECT_EQ(t.dtype(), precision == v1::PRECISION_FP64 ? v1::DTYPE_FP64 : v1::DTYPE_FP32);
      const std::string name = t.layer() < 0 ? absl::StrCat("act.", t.name())
                                             : absl::StrCat("act.", t.name(), ".", t.layer());
      const OracleArray& want = ref.arrays.at(name);
      // The maps are head first ([H, rows, T], as TransformerLens's); the rest rows first.
      const bool map = t.name() == "attn_scores" || t.name() == "pattern";
      std::vector<int64_t> shape = want.dims;
      shape[map ? 1 : 0] = 5;
      EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), shape) << name;
      const double e = map ? MaskedRelErr(DecodeTensor(t), OracleMapRows(want, 2, 7))
                           : RelErr(DecodeTensor(t), OracleRows(want, 2, 7));
      EXPECT_LE(e, precision == v1::PRECISION_FP64 ? 1e-9 : 1e-4) << name;
      worst = std::max(worst, e);
    }
    EXPECT_EQ(a.tensors(0).name(), "resid_pre");
    EXPECT_EQ(a.tensors(0).layer(), 3);  // in the order asked
    EXPECT_EQ(a.tensors(12).name(), "k");
    EXPECT_EQ(a.tensors(12).layer(), 2);
    EXPECT_EQ(a.tensors(17).name(), "pattern");
    EXPECT_EQ(a.tensors(17).layer(), 0);
    EXPECT_EQ(a.tensors(a.tensors_size() - 1).name(), "ln_final_normalized");
    EXPECT_EQ(a.tensors(a.tensors_size() - 1).layer(), -1);
    std::printf("[interp] kjv-gpt2-4l Activations %s: worst relative error vs oracle %.3g\n",
                precision == v1::PRECISION_FP64 ? "fp64" : "fp32", worst);
  }
  // fp16 on the wire: within half precision's rounding of the fp32 values.
  r.set_precision(v1::PRECISION_FP32);
  r.set_dtype(v1::DTYPE_FP16);
  r.clear_hooks();
  r.add_hooks("resid_mid");
  v1::ActivationsResponse h;
  ASSERT_TRUE(CallActivations(server, r, &h).ok());
  ASSERT_EQ(h.tensors_size(), 2);
  EXPECT_EQ(h.tensors(0).data().size(), size_t{5} * c.dim * 2);
  const std::vector<double> want = OracleRows(ref.arrays.at("act.resid_pre.3"), 2, 7);
  const std::vector<double> attn = OracleRows(ref.arrays.at("act.attn_out.3"), 2, 7);
  std::vector<double> mid(want.size());
  for (size_t i = 0; i < mid.size(); ++i) mid[i] = want[i] + attn[i];
  EXPECT_LE(RelErr(DecodeTensor(h.tensors(0)), mid), 1e-3);
}

TEST(InterpretAttribution, MatchesTheOracle) {
  KVLENS_REQUIRE_FILE(DefaultModelPath() + "/config.json");
  if (!OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  TestServer server = DefaultModelServer();
  ASSERT_TRUE(server.ok()) << server.error();
  const ModelConfig& c = server.model().config;
  const OracleResult ref =
      RunOracleWith(DefaultModelPath(), kTokens, "--logit-attribution 6:290:17");
  ASSERT_TRUE(ref.error.empty()) << ref.error;
  v1::LogitAttributionRequest r;
  *r.mutable_input() = IdsInput(kTokens);
  r.set_position(6);
  r.set_token(290);
  r.set_baseline_token(17);
  r.set_heads(true);
  r.set_top_neurons(5);
  for (const v1::Precision precision : {v1::PRECISION_FP64, v1::PRECISION_FP32}) {
    r.set_precision(precision);
    const double tol = precision == v1::PRECISION_FP64 ? 1e-9 : 1e-4;
    v1::LogitAttributionResponse a;
    const grpc::Status s = CallAttribution(server, r, &a);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(a.position(), 6);
    const double logit = ref.arrays.at("dla.logit").data[0];
    const double scale = std::max(1.0, std::abs(logit));
    EXPECT_NEAR(a.logit(), logit, tol * scale);
    EXPECT_NEAR(a.total(), logit, tol * scale);
    EXPECT_NEAR(a.final_norm_scale(), ref.arrays.at("dla.scale").data[0],
                tol * ref.arrays.at("dla.scale").data[0]);
    double sum = 0;
    ASSERT_EQ(a.components_size(), 2 + 2 * c.num_layers + 1);
    for (const v1::Attribution& p : a.components()) {
      sum += p.value();
      const std::string name = "dla." + p.component();
      const double want =
          p.layer() < 0 ? ref.arrays.at(name).data[0] : ref.arrays.at(name).data[p.layer()];
      EXPECT_NEAR(p.value(), want, tol * scale) << name << " " << p.layer();
    }
    EXPECT_NEAR(sum, a.total(), 1e-12 * scale);
    ASSERT_EQ(a.heads_size(), c.num_layers * (c.num_heads + 1));
    for (const v1::Attribution& p : a.heads()) {
      const double want = p.component() == "head"
                              ? ref.arrays.at("dla.heads").data[p.layer() * c.num_heads + p.index()]
                              : ref.arrays.at("dla.attn_bias").data[p.layer()];
      EXPECT_NEAR(p.value(), want, tol * scale) << p.component() << " " << p.layer();
    }
    // Five neurons a layer, each the oracle's share at that index and no smaller in |·|
    // than the layer's sixth largest; then mlp_bias per layer.
    ASSERT_EQ(a.neurons_size(), c.num_layers * 6);
    const std::vector<double>& all = ref.arrays.at("dla.neurons").data;
    for (const v1::Attribution& p : a.neurons()) {
      if (p.component() == "mlp_bias") {
        EXPECT_NEAR(p.value(), ref.arrays.at("dla.mlp_bias").data[p.layer()], tol * scale);
        continue;
      }
      EXPECT_EQ(p.component(), "neuron");
      const double* row = all.data() + int64_t{p.layer()} * c.hidden_dim;
      EXPECT_NEAR(p.value(), row[p.index()], tol * scale);
      std::vector<double> mags(row, row + c.hidden_dim);
      for (double& m : mags) m = std::abs(m);
      std::nth_element(mags.begin(), mags.begin() + 5, mags.end(), std::greater<>());
      EXPECT_GE(std::abs(row[p.index()]), mags[5] - tol * scale);
    }
  }
}

TEST(InterpretActivations, BadRequestsNameTheirField) {
  KVLENS_REQUIRE_FILE(DefaultModelPath() + "/config.json");
  server::InterpretOptions small;
  small.limits.max_bytes = 100000;
  TestServer server = DefaultModelServer(small);
  ASSERT_TRUE(server.ok()) << server.error();
  const int L = server.model().config.num_layers;
  auto with = [&](auto edit) {
    v1::ActivationsRequest r;
    *r.mutable_input() = IdsInput(kTokens);
    r.add_hooks("resid_pre");
    edit(r);
    v1::ActivationsResponse a;
    return CallActivations(server, r, &a);
  };
  const auto invalid = grpc::StatusCode::INVALID_ARGUMENT;
  ExpectRefused(with([](auto& r) { r.clear_hooks(); }), invalid, "hooks");
  ExpectRefused(with([](auto& r) { r.add_hooks("hook_resid_pre"); }), invalid,
                "unknown hook \"hook_resid_pre\"");
  ExpectRefused(with([](auto& r) { r.add_hooks("resid_pre"); }), invalid,
                "hooks: \"resid_pre\" asks again for blocks.0.hook_resid_pre");
  ExpectRefused(with([](auto& r) { r.add_hooks("blocks.3.hook_resid_pre"); }), invalid,
                "asks again for blocks.3.hook_resid_pre");
  ExpectRefused(
      with([&](auto& r) { r.add_hooks(absl::StrCat("blocks.", L, ".attn.hook_z")); }), invalid,
      absl::StrCat("hooks: \"blocks.", L, ".attn.hook_z\": layer ", L, " is outside [0, ", L, ")"));
  // GPT-2 has learned positions: TransformerLens has no hook_rot_q for it either.
  ExpectRefused(with([](auto& r) { r.add_hooks("rot_q"); }), invalid,
                "hooks: rot_q: the model (gpt2) has no rotary embedding");
  ExpectRefused(with([](auto& r) { r.add_hooks("blocks.0.attn.hook_rot_k"); }), invalid,
                "hooks: rot_k: the model (gpt2)");
  // Only Gemma 2 and 3 norm their blocks' outputs (TransformerLens's ln1_post, ln2_post).
  ExpectRefused(with([](auto& r) { r.add_hooks("blocks.1.ln2_post.hook_scale"); }), invalid,
                "hooks: ln2_post_scale: the model (gpt2) has no norm on the feed-forward output");
  ExpectRefused(with([&](auto& r) { r.add_layers(L); }), invalid, "layers");
  ExpectRefused(with([](auto& r) { r.mutable_positions()->set_begin(10); }), invalid, "positions");
  ExpectRefused(with([](auto& r) { r.set_dtype(static_cast<v1::DType>(7)); }), invalid, "dtype");
  // 10 positions × 4 layers × [6, 192] doubles of result = 368,640 bytes > 100,000.
  ExpectRefused(with([](auto& r) {
                  r.clear_hooks();
                  r.add_hooks("result");
                  r.set_precision(v1::PRECISION_FP64);
                }),
                grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-interp-bytes");
  EXPECT_TRUE(with([](auto& r) {
                r.clear_hooks();
                r.add_hooks("result");
                r.set_dtype(v1::DTYPE_FP16);
                r.add_layers(0);
              }).ok());
}

TEST(InterpretAttribution, BadRequestsNameTheirField) {
  KVLENS_REQUIRE_FILE(DefaultModelPath() + "/config.json");
  TestServer server = DefaultModelServer();
  ASSERT_TRUE(server.ok()) << server.error();
  const ModelConfig& c = server.model().config;
  auto with = [&](auto edit) {
    v1::LogitAttributionRequest r;
    *r.mutable_input() = IdsInput(kTokens);
    r.set_token(5);
    edit(r);
    v1::LogitAttributionResponse a;
    return CallAttribution(server, r, &a);
  };
  const auto invalid = grpc::StatusCode::INVALID_ARGUMENT;
  ExpectRefused(with([](auto& r) { r.set_position(10); }), invalid, "position = 10");
  ExpectRefused(with([](auto& r) { r.set_position(-11); }), invalid,
                "position = -11 must be in [-10, 10)");
  ExpectRefused(with([&](auto& r) { r.set_token(c.vocab_size); }), invalid, "token = ");
  ExpectRefused(with([](auto& r) { r.set_baseline_token(-2); }), invalid, "baseline_token");
  ExpectRefused(with([&](auto& r) { r.set_top_neurons(c.hidden_dim + 1); }), invalid,
                "top_neurons");
  ExpectRefused(with([](auto& r) { r.mutable_input()->clear_token_ids(); }), invalid, "input");
  // Defaults: the last position, no heads, no neurons.
  v1::LogitAttributionRequest r;
  *r.mutable_input() = IdsInput(kTokens);
  r.set_token(5);
  v1::LogitAttributionResponse a;
  ASSERT_TRUE(CallAttribution(server, r, &a).ok());
  EXPECT_EQ(a.position(), static_cast<int>(kTokens.size()) - 1);
  EXPECT_EQ(a.heads_size(), 0);
  EXPECT_EQ(a.neurons_size(), 0);
  EXPECT_NEAR(a.total(), a.logit(), 1e-4 * std::max(1.0, std::abs(a.logit())));
}

// kvlens-cli attribute prints the RPC's numbers: the logit and the sum of shares, and every
// component's share (6 decimals).
TEST(InterpretAttribution, CliPrintsTheRpcsAnswer) {
  KVLENS_REQUIRE_FILE(DefaultModelPath() + "/config.json");
  TestServer server = DefaultModelServer();
  ASSERT_TRUE(server.ok()) << server.error();
  const auto [code, out] = RunCommand(absl::StrCat(
      "timeout 60 ", KVLENS_CLI_PATH, " attribute --server ", server.address(),
      " --ids '4095 34 290 1021 17' --token 290 --baseline 17 --heads --top 3 --top-neurons 1 "
      "--precision fp64"));
  EXPECT_EQ(code, 0) << out;
  v1::LogitAttributionRequest r;
  *r.mutable_input() = IdsInput({4095, 34, 290, 1021, 17});
  r.set_token(290);
  r.set_baseline_token(17);
  r.set_heads(true);
  r.set_top_neurons(1);
  r.set_precision(v1::PRECISION_FP64);
  v1::LogitAttributionResponse a;
  ASSERT_TRUE(CallAttribution(server, r, &a).ok());
  EXPECT_NE(
      out.find(absl::StrFormat("position 4: logit %.6f, sum of shares %.6f", a.logit(), a.total())),
      std::string::npos)
      << out;
  for (const v1::Attribution& c : a.components()) {
    EXPECT_NE(
        out.find(absl::StrFormat("%16s %5s %6s %12.6f\n", c.component(),
                                 c.layer() < 0 ? "-" : absl::StrCat(c.layer()), "-", c.value())),
        std::string::npos)
        << c.component() << " " << c.layer() << "\n"
        << out;
  }
  EXPECT_NE(out.find("heads, largest |share| first:"), std::string::npos) << out;
  EXPECT_NE(out.find("neurons:"), std::string::npos) << out;
}

TEST(InterpretActivations, CountedUnderTheirMetricKinds) {
  KVLENS_REQUIRE_FILE(DefaultModelPath() + "/config.json");
  TestServer server = DefaultModelServer();
  ASSERT_TRUE(server.ok()) << server.error();
  v1::ActivationsRequest r;
  *r.mutable_input() = IdsInput(kTokens);
  r.add_hooks("z");
  v1::ActivationsResponse a;
  ASSERT_TRUE(CallActivations(server, r, &a).ok());
  v1::LogitAttributionRequest d;
  *d.mutable_input() = IdsInput(kTokens);
  d.set_token(1);
  v1::LogitAttributionResponse b;
  ASSERT_TRUE(CallAttribution(server, d, &b).ok());
  ASSERT_TRUE(CallAttribution(server, d, &b).ok());
  const std::string m = ScrapeMetrics(server.metrics_port());
  EXPECT_EQ(MetricValue(m, "kvlens_interp_requests_total{kind=\"activations\"}"), 1);
  EXPECT_EQ(MetricValue(m, "kvlens_interp_requests_total{kind=\"attribution\"}"), 2);
  EXPECT_GT(MetricValue(m, "kvlens_interp_response_bytes_total{kind=\"activations\"}"),
            10 * 192 * 4 * 4);
  EXPECT_EQ(MetricValue(m, R"(kvlens_requests_total{code="OK",rpc="LogitAttribution"})"), 2);
}

}  // namespace
}  // namespace kvlens::testing
