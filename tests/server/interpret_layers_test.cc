// Layers and heads counted from the end in requests, as Python and TransformerLens index
// (cache["resid_post", -1]; −1 the last layer or head): every request that names layers or
// heads (attention maps, gradient probes with their attn_out_probe objective and
// param_layer, interventions, activations, Generate's attention rows) gives the answer of
// the same request written with the absolute indices, bit for bit, and the response says
// which indices it resolved to. A patch's layer runs 0 … L (L the model's output) and
// counts from L too, so −1 is the stream entering the last layer. Out of range is refused
// naming the field and [−n, n); an index given once from each end as repeated.

#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/server/interpret_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

constexpr int kN = 10;  // prompt tokens

class InterpretLayers : public ::testing::Test {
 protected:
  void SetUp() override {
    KVLENS_REQUIRE_FILE(Stories260KPath());
    ASSERT_TRUE(server_.ok()) << server_.error();
    L_ = server_.model().config.num_layers;
    H_ = server_.model().config.num_heads;
    ASSERT_GE(L_, 3);
    ASSERT_GE(H_, 3);
  }
  TestServer server_;
  const std::vector<int32_t> tokens_ = RandomPromptTokens(kN, 11);
  int L_ = 0, H_ = 0;
};

TEST_F(InterpretLayers, AttentionMapsResolveLayersAndHeads) {
  auto maps = [&](std::vector<int> layers, std::vector<int> heads) {
    v1::AttentionMapsRequest r;
    *r.mutable_input() = IdsInput(tokens_);
    r.mutable_layers()->Add(layers.begin(), layers.end());
    r.mutable_heads()->Add(heads.begin(), heads.end());
    r.set_head_summaries(true);
    auto stub = InterpretStub(server_);
    return RunAttentionMaps(*stub, r);
  };
  const AttentionResult absolute = maps({L_ - 1, 0}, {H_ - 1, 1});
  const AttentionResult from_end = maps({-1, -L_}, {-1, 1 - H_});
  ASSERT_TRUE(absolute.status.ok()) << absolute.status.error_message();
  ASSERT_TRUE(from_end.status.ok()) << from_end.status.error_message();
  EXPECT_EQ(std::vector<int>(from_end.info.layers().begin(), from_end.info.layers().end()),
            (std::vector<int>{L_ - 1, 0}));
  EXPECT_EQ(std::vector<int>(from_end.info.heads().begin(), from_end.info.heads().end()),
            (std::vector<int>{H_ - 1, 1}));
  EXPECT_EQ(from_end.info.SerializeAsString(), absolute.info.SerializeAsString());
  ASSERT_FALSE(absolute.probs.empty());
  EXPECT_EQ(from_end.probs, absolute.probs);
  ASSERT_EQ(from_end.summaries.size(), absolute.summaries.size());
  for (size_t i = 0; i < absolute.summaries.size(); ++i) {
    EXPECT_EQ(from_end.summaries[i].SerializeAsString(), absolute.summaries[i].SerializeAsString());
  }
  // A different layer gives different maps (the resolution is not a no-op).
  EXPECT_NE(maps({L_ - 2, 0}, {H_ - 1, 1}).probs, absolute.probs);

  const AttentionResult out_of_range = maps({-L_ - 1}, {});
  ExpectInvalid(out_of_range.status,
                absl::StrCat("layers[0] = ", -L_ - 1, " must be in [-", L_, ", ", L_, ")"));
  const AttentionResult twice = maps({0, L_ - 1, -1}, {});
  ExpectInvalid(twice.status, absl::StrCat("layers[2] = -1 (", L_ - 1, ") is repeated"));
  const AttentionResult head_out = maps({}, {H_});
  ExpectInvalid(head_out.status, absl::StrCat("heads[0] = ", H_, " must be in [-", H_, ", "));
}

TEST_F(InterpretLayers, GradientProbeResolvesLayersHeadsObjectiveAndParamLayer) {
  const ModelConfig& c = server_.model().config;
  auto probe = [&](int probe_layer, int probe_head, std::vector<int> layers, std::vector<int> heads,
                   int param_layer) {
    v1::GradientProbeRequest r;
    *r.mutable_input() = IdsInput(tokens_);
    v1::AttnOutProbeObjective* p = r.mutable_attn_out_probe();
    p->set_layer(probe_layer);
    p->set_head(probe_head);
    for (int i = 0; i < kN * c.head_dim; ++i) p->add_g(std::sin(0.37 * i));
    r.mutable_layers()->Add(layers.begin(), layers.end());
    r.mutable_heads()->Add(heads.begin(), heads.end());
    r.set_scores(true);
    r.set_q(true);
    r.set_param_layer(param_layer);
    return r;
  };
  const v1::GradientProbeResponse absolute =
      CallGradientProbe(server_, probe(L_ - 1, H_ - 2, {0, L_ - 1}, {H_ - 1}, L_ - 2));
  const v1::GradientProbeResponse from_end =
      CallGradientProbe(server_, probe(-1, -2, {-L_, -1}, {-1}, -2));
  ASSERT_GT(absolute.tensors_size(), 0);
  EXPECT_NE(absolute.objective(), 0.0);
  EXPECT_EQ(from_end.SerializeAsString(), absolute.SerializeAsString());
  EXPECT_NE(FindTensor(from_end.tensors(), "grad.wq", L_ - 2, -1), nullptr);
  EXPECT_NE(FindTensor(from_end.tensors(), "grad.scores", L_ - 1, H_ - 1), nullptr);
  // Another probed head gives another J.
  EXPECT_NE(CallGradientProbe(server_, probe(-1, -3, {-1}, {-1}, -2)).objective(),
            absolute.objective());

  v1::GradientProbeResponse ignored;
  const auto method = &v1::Interpret::Stub::GradientProbe;
  ExpectInvalid(CallInterpret(server_, method, probe(-L_ - 1, 0, {}, {}, 0), &ignored),
                absl::StrCat("attn_out_probe.layer = ", -L_ - 1, " must be in [-", L_));
  ExpectInvalid(CallInterpret(server_, method, probe(0, -H_ - 1, {}, {}, 0), &ignored),
                absl::StrCat("attn_out_probe.head = ", -H_ - 1, " must be in [-", H_));
  ExpectInvalid(CallInterpret(server_, method, probe(0, 0, {}, {}, L_), &ignored),
                absl::StrCat("param_layer = ", L_, " must be in [-", L_, ", ", L_, ")"));
}

TEST_F(InterpretLayers, InterventionsAndActivationsResolveLayers) {
  const std::vector<int32_t> source = RandomPromptTokens(kN, 3);
  auto intervene = [&](int ablated_layer, int ablated_head, int row_layer, int row_head,
                       int masked_key, int patch_layer) {
    v1::InterveneRequest r;
    *r.mutable_input() = IdsInput(tokens_);
    *r.mutable_patch_source() = IdsInput(source);
    v1::HeadAblation* a = r.add_ablations();
    a->set_layer(ablated_layer);
    a->set_head(ablated_head);
    v1::RowOverride* o = r.add_row_overrides();
    o->set_layer(row_layer);
    o->set_head(row_head);
    o->set_position(kN - 1);
    o->add_masked_keys(masked_key);
    v1::ResidualPatch* p = r.add_patches();
    p->set_layer(patch_layer);
    p->set_position(kN - 3);
    p->set_source_position(kN - 3);
    v1::TokenTarget* t = r.add_targets();
    t->set_position(kN - 1);
    t->set_token(42);
    return r;
  };
  const auto method = &v1::Interpret::Stub::Intervene;
  v1::InterveneResponse absolute, from_end, output_patch;
  ASSERT_TRUE(CallInterpret(server_, method, intervene(L_ - 1, H_ - 1, L_ - 2, 0, kN - 1, L_ - 1),
                            &absolute)
                  .ok());
  ASSERT_TRUE(CallInterpret(server_, method, intervene(-1, -1, -2, -H_, -1, -1), &from_end).ok());
  EXPECT_GT(absolute.max_abs_logit_change(), 0.0);
  EXPECT_EQ(from_end.SerializeAsString(), absolute.SerializeAsString());
  // L itself (the model's output) is still a patch layer, and not the same as −1.
  ASSERT_TRUE(
      CallInterpret(server_, method, intervene(-1, -1, -2, -H_, -1, L_), &output_patch).ok());
  EXPECT_NE(output_patch.SerializeAsString(), absolute.SerializeAsString());

  v1::InterveneResponse ignored;
  ExpectInvalid(CallInterpret(server_, method, intervene(-L_ - 1, 0, 0, 0, 0, 0), &ignored),
                absl::StrCat("ablations[0].layer = ", -L_ - 1));
  ExpectInvalid(CallInterpret(server_, method, intervene(0, H_, 0, 0, 0, 0), &ignored),
                absl::StrCat("ablations[0].head = ", H_));
  ExpectInvalid(CallInterpret(server_, method, intervene(0, 0, L_, 0, 0, 0), &ignored),
                absl::StrCat("row_overrides[0].layer = ", L_));
  ExpectInvalid(CallInterpret(server_, method, intervene(0, 0, 0, 0, -kN - 1, 0), &ignored),
                absl::StrCat("row_overrides[0].masked_keys[0] = ", -kN - 1));
  ExpectInvalid(CallInterpret(server_, method, intervene(0, 0, 0, 0, 0, -L_ - 1), &ignored),
                absl::StrCat("patches[0].layer = ", -L_ - 1, " must be in [-", L_, ", ", L_, "]"));
  ExpectInvalid(CallInterpret(server_, method, intervene(0, 0, 0, 0, 0, L_ + 1), &ignored),
                absl::StrCat("patches[0].layer = ", L_ + 1, " must be in [-", L_, ", ", L_, "]"));

  auto activations = [&](std::vector<int> layers, v1::ActivationsResponse* response) {
    v1::ActivationsRequest r;
    *r.mutable_input() = IdsInput(tokens_);
    r.add_hooks("resid_pre");
    r.add_hooks("z");
    r.add_hooks("ln_final");
    r.mutable_layers()->Add(layers.begin(), layers.end());
    return CallInterpret(server_, &v1::Interpret::Stub::Activations, r, response);
  };
  v1::ActivationsResponse a_absolute, a_from_end;
  const grpc::Status a_status = activations({L_ - 1, 1}, &a_absolute);
  ASSERT_TRUE(a_status.ok()) << a_status.error_message();
  ASSERT_TRUE(activations({-1, 1 - L_}, &a_from_end).ok());
  ASSERT_GT(a_absolute.tensors_size(), 0);
  EXPECT_EQ(a_from_end.SerializeAsString(), a_absolute.SerializeAsString());
  EXPECT_EQ(a_from_end.tensors(0).layer(), L_ - 1);
  ExpectInvalid(activations({1, -1, 1 - L_}, &a_from_end), "layers[2] = ");
}

TEST_F(InterpretLayers, GenerateAttentionRowsResolveLayersAndHeads) {
  auto rows = [&](std::vector<int> layers, std::vector<int> heads, grpc::Status* status) {
    v1::GenerateRequest r = GreedyRequest("Once upon a time", 6);
    r.mutable_attention_rows()->mutable_layers()->Add(layers.begin(), layers.end());
    r.mutable_attention_rows()->mutable_heads()->Add(heads.begin(), heads.end());
    grpc::ClientContext context;
    SetDeadline(context);
    auto reader = server_.stub().Generate(&context, r);
    std::vector<std::string> out;
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      for (const v1::AttentionRow& row : chunk.attention_rows()) {
        out.push_back(row.SerializeAsString());
      }
    }
    *status = reader->Finish();
    return out;
  };
  grpc::Status s;
  const std::vector<std::string> absolute = rows({L_ - 1, 0}, {H_ - 1}, &s);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(absolute.size(), 6u);
  // each row echoes the layers and heads resolved, its probabilities' first two axes
  v1::AttentionRow first;
  ASSERT_TRUE(first.ParseFromString(absolute.front()));
  EXPECT_EQ(std::vector<int>(first.layers().begin(), first.layers().end()),
            (std::vector<int>{L_ - 1, 0}));
  EXPECT_EQ(std::vector<int>(first.heads().begin(), first.heads().end()), std::vector<int>{H_ - 1});
  EXPECT_EQ(first.probs_size(), 2 * first.num_keys());
  EXPECT_EQ(rows({-1, -L_}, {-1}, &s), absolute);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_NE(rows({L_ - 2, 0}, {H_ - 1}, &s), absolute);
  rows({-L_ - 1}, {}, &s);
  ExpectInvalid(s, absl::StrCat("attention_rows.layers[0] = ", -L_ - 1, " must be in [-", L_));
  rows({}, {0, -H_}, &s);
  ExpectInvalid(s, "attention_rows.heads[1] = ");
}

// kvlens-cli passes layers from the end through: `attention --layers` and `intervene
// --ablate` print what they print given the absolute layers and heads.
TEST_F(InterpretLayers, CliFlagsCountFromTheEnd) {
  auto cli = [&](const std::string& command, const std::string& flags) {
    const auto [code, out] = RunCommand(
        absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " ", command, " --server ", server_.address(),
                     " --ids '", absl::StrJoin(tokens_, " "), "' ", flags, " 2>&1"));
    EXPECT_EQ(code, 0) << command << " " << flags << "\n" << out;
    return out;
  };
  EXPECT_EQ(
      cli("attention", "--layers '-1' --heads '-1 0' --summaries"),
      cli("attention", absl::StrCat("--layers ", L_ - 1, " --heads '", H_ - 1, " 0' --summaries")));
  EXPECT_EQ(cli("intervene", "--ablate '-1:-2' --target-token 42"),
            cli("intervene", absl::StrCat("--ablate ", L_ - 1, ":", H_ - 2, " --target-token 42")));
}

}  // namespace
}  // namespace kvlens::testing
