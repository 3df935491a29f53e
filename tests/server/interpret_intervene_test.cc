// kvlens.v1.Interpret end to end on stories260K: Intervene (ablations of heads and of FFN
// neurons, the latter against the PyTorch oracle, attention-row overrides, residual and
// head-output patching), LogitLens, and the cached-KV probe of an open
// session, each through the RPC and checked against its definition (engine/interpret run directly
// in fp64 on the same model).

#include <algorithm>
#include <cmath>
#include <tuple>

#include "engine/interpret/interventions.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/server/interpret_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

v1::InterveneResponse CallIntervene(v1::Interpret::Stub& stub, const v1::InterveneRequest& r) {
  v1::InterveneResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  const grpc::Status s = stub.Intervene(&context, r, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response;
}

// A call that may fail: its status.
grpc::Status TryIntervene(v1::Interpret::Stub& stub, const v1::InterveneRequest& r) {
  v1::InterveneResponse ignored;
  grpc::ClientContext context;
  SetDeadline(context);
  return stub.Intervene(&context, r, &ignored);
}

void AddTarget(v1::InterveneRequest& r, int position, int token) {
  v1::TokenTarget* t = r.add_targets();
  t->set_position(position);
  t->set_token(token);
}

TEST(InterpretIntervene, PatchingACleanRunIntoItselfChangesNothing) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const ModelConfig& c = server.model().config;
  const std::vector<int32_t> tokens = RandomPromptTokens(10, 2);
  v1::InterveneRequest r;
  *r.mutable_input() = IdsInput(tokens);
  *r.mutable_patch_source() = IdsInput(tokens);
  r.set_precision(v1::PRECISION_FP64);
  for (int l = 0; l <= c.num_layers; ++l) {
    for (int p = 0; p < 10; ++p) {
      v1::ResidualPatch* patch = r.add_patches();
      patch->set_layer(l);
      patch->set_position(p);
      patch->set_source_position(p);
    }
  }
  // and every head's output and query, every KV head's key and value, layers and heads
  // counted from the end, at two positions (240 patches, within --max-interp-targets 256)
  for (const char* hook : {"", "q", "k", "v"}) {
    const bool kv = hook[0] == 'k' || hook[0] == 'v';
    for (int l = 1; l <= c.num_layers; ++l) {
      for (int h = 1; h <= (kv ? c.num_kv_heads : c.num_heads); ++h) {
        for (int p : {4, 9}) {
          v1::HeadPatch* patch = r.add_head_patches();
          patch->set_hook(hook);
          patch->set_layer(-l);
          patch->set_head(-h);
          patch->set_position(p);
          patch->set_source_position(p);
        }
      }
    }
  }
  AddTarget(r, 9, 42);
  const v1::InterveneResponse response = CallIntervene(*stub, r);
  EXPECT_EQ(response.precision(), v1::PRECISION_FP64);
  EXPECT_EQ(response.max_abs_logit_change(), 0.0);
  ASSERT_EQ(response.effects_size(), 1);
  EXPECT_EQ(response.effects(0).clean_logprob(), response.effects(0).edited_logprob());

  // Patching from a different prompt does change the output.
  *r.mutable_patch_source() = IdsInput(RandomPromptTokens(10, 3));
  r.clear_patches();
  r.clear_head_patches();
  v1::ResidualPatch* patch = r.add_patches();
  patch->set_layer(2);
  patch->set_position(9);
  patch->set_source_position(9);
  EXPECT_GT(CallIntervene(*stub, r).max_abs_logit_change(), 1e-3);
}

// A head's output, query or key patched from another prompt (TransformerLens's
// attn.hook_z / hook_q / hook_k patching; a key per KV head): the
// RPC's effect is engine/interpret's with the same patch taken from the source's fp64 tape;
// layer and head count from the end; a bad patch names its field.
TEST(InterpretIntervene, HeadPatchesAsTheEngineDefinesThem) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const Model& model = server.model();
  const ModelConfig& c = model.config;
  const std::vector<int32_t> tokens = RandomPromptTokens(10, 2), source = RandomPromptTokens(12, 5);
  v1::InterveneRequest r;
  *r.mutable_input() = IdsInput(tokens);
  *r.mutable_patch_source() = IdsInput(source);
  r.set_precision(v1::PRECISION_FP64);
  v1::HeadPatch* p = r.add_head_patches();
  p->set_layer(-1);  // the last layer, head 3
  p->set_head(3);
  p->set_position(6);
  p->set_source_position(-1);  // the source's last position, 11
  p = r.add_head_patches();
  p->set_layer(1);
  p->set_head(-1);  // the last head
  p->set_position(8);
  p->set_source_position(2);
  p = r.add_head_patches();
  p->set_hook("k");
  p->set_layer(2);
  p->set_head(-1);  // the last KV head, 3
  p->set_position(7);
  p->set_source_position(4);
  p = r.add_head_patches();
  p->set_hook("q");
  p->set_layer(0);
  p->set_head(6);
  p->set_position(9);
  p->set_source_position(9);
  AddTarget(r, 9, 42);
  AddTarget(r, 5, 300);
  const v1::InterveneResponse response = CallIntervene(*stub, r);

  kernels::ReferenceBackend be;
  auto src = interpret::RunForward(model, be, interpret::SequenceInput<double>{source});
  ASSERT_TRUE(src.ok()) << src.status();
  interpret::Edits edits;
  ASSERT_EQ(c.num_kv_heads, 4);
  for (auto [layer, head, from, to, kind] :
       {std::tuple{c.num_layers - 1, 3, 11, 6, interpret::TensorKind::kAttnOut},
        std::tuple{1, c.num_heads - 1, 2, 8, interpret::TensorKind::kAttnOut},
        std::tuple{2, 3, 4, 7, interpret::TensorKind::kK},
        std::tuple{0, 6, 9, 9, interpret::TensorKind::kQ}}) {
    auto patch = interpret::HeadPatchFrom(*src, c, layer, head, from, to, kind);
    ASSERT_TRUE(patch.ok()) << patch.status();
    edits.head_patches.push_back(*std::move(patch));
  }
  const std::vector<interpret::TokenTarget> targets = {{9, 42}, {5, 300}};
  auto want =
      interpret::Intervene(model, be, interpret::SequenceInput<double>{tokens}, edits, targets);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(response.effects_size(), 2);
  EXPECT_DOUBLE_EQ(response.effects(0).edited_logprob(), want->edited_logprobs[0]);
  EXPECT_NE(response.effects(0).edited_logprob(), response.effects(0).clean_logprob());
  // Position 5 comes before both patched positions: untouched.
  EXPECT_EQ(response.effects(1).edited_logprob(), response.effects(1).clean_logprob());

  v1::InterveneRequest bad = r;
  bad.mutable_head_patches(1)->set_head(99);
  ExpectInvalid(TryIntervene(*stub, bad), "head_patches[1].head = 99");
  bad = r;
  bad.mutable_head_patches(0)->set_source_position(12);
  ExpectInvalid(TryIntervene(*stub, bad), "head_patches[0].source_position = 12");
  bad = r;
  bad.mutable_head_patches(2)->set_head(4);  // k: a KV head
  ExpectInvalid(TryIntervene(*stub, bad), "head_patches[2].head = 4 must be in [-4, 4)");
  bad = r;
  bad.mutable_head_patches(3)->set_hook("pattern");
  ExpectInvalid(TryIntervene(*stub, bad),
                "head_patches[3].hook = \"pattern\": not a head's vector (q, k, v, z;");
  bad.mutable_head_patches(3)->set_hook("hook_q");
  ExpectInvalid(TryIntervene(*stub, bad), "head_patches[3].hook = \"hook_q\": not a patching site");
  bad = r;
  bad.clear_patch_source();
  ExpectInvalid(TryIntervene(*stub, bad), "patch_source: required with patches or head_patches");
  // More patches than the server allows (InterpLimits::max_targets) are refused before any
  // forward runs.
  server::InterpretOptions few;
  few.limits.max_targets = 2;
  TestServer small(Stories260KPath(), TestServer::DefaultOptions(), 1, few);
  ASSERT_TRUE(small.ok()) << small.error();
  bad = r;
  bad.clear_targets();
  *bad.add_head_patches() = r.head_patches(0);
  ExpectInvalid(TryIntervene(*InterpretStub(small), bad),
                "head_patches has 5 entries, more than the server allows (2)");
}

// Patches at TransformerLens's other sites (hook "resid_mid", "attn_out", "mlp_out",
// "resid_post"): the RPC's effect is the engine's with the same sites taken from the
// source's fp64 tape; resid_post of layer l is resid_pre of l + 1 (of -1: the output);
// an unknown site, or a layer past the last, is refused naming the field.
TEST(InterpretIntervene, PatchesAtEverySite) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const Model& model = server.model();
  const ModelConfig& c = model.config;
  const int L = c.num_layers;
  const std::vector<int32_t> tokens = RandomPromptTokens(10, 2), source = RandomPromptTokens(12, 5);
  auto request = [&](std::initializer_list<std::tuple<const char*, int, int, int>> patches) {
    v1::InterveneRequest r;
    *r.mutable_input() = IdsInput(tokens);
    *r.mutable_patch_source() = IdsInput(source);
    r.set_precision(v1::PRECISION_FP64);
    for (auto [hook, layer, position, from] : patches) {
      v1::ResidualPatch* p = r.add_patches();
      p->set_hook(hook);
      p->set_layer(layer);
      p->set_position(position);
      p->set_source_position(from);
    }
    AddTarget(r, 9, 42);
    AddTarget(r, 3, 300);
    return r;
  };
  const v1::InterveneResponse got = CallIntervene(
      *stub, request({{"attn_out", -1, 7, 4}, {"mlp_out", 1, 5, 11}, {"resid_mid", 2, 6, 6}}));
  kernels::ReferenceBackend be;
  auto src = interpret::RunForward(model, be, interpret::SequenceInput<double>{source});
  ASSERT_TRUE(src.ok()) << src.status();
  interpret::Edits edits;
  for (auto [site, layer, from, to] : {std::tuple{interpret::PatchSite::kAttnOut, L - 1, 4, 7},
                                       std::tuple{interpret::PatchSite::kMlpOut, 1, 11, 5},
                                       std::tuple{interpret::PatchSite::kResidMid, 2, 6, 6}}) {
    auto patch = interpret::PatchFrom(*src, c, layer, from, to, site);
    ASSERT_TRUE(patch.ok()) << patch.status();
    edits.patches.push_back(*std::move(patch));
  }
  const std::vector<interpret::TokenTarget> targets = {{9, 42}, {3, 300}};
  auto want =
      interpret::Intervene(model, be, interpret::SequenceInput<double>{tokens}, edits, targets);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(got.effects_size(), 2);
  EXPECT_DOUBLE_EQ(got.effects(0).edited_logprob(), want->edited_logprobs[0]);
  EXPECT_NE(got.effects(0).edited_logprob(), got.effects(0).clean_logprob());
  EXPECT_EQ(got.effects(1).edited_logprob(), got.effects(1).clean_logprob());  // row 3 < 5
  // resid_post of layer 1 is resid_pre of 2; of -1, the stream the final norm reads.
  for (auto [post, pre] : {std::pair{1, 2}, std::pair{-1, L}}) {
    const v1::InterveneResponse a = CallIntervene(*stub, request({{"resid_post", post, 9, 2}}));
    const v1::InterveneResponse b = CallIntervene(*stub, request({{"", pre, 9, 2}}));
    ASSERT_EQ(a.effects_size(), 2);
    EXPECT_EQ(a.effects(0).edited_logprob(), b.effects(0).edited_logprob()) << post;
    EXPECT_NE(a.effects(0).edited_logprob(), a.effects(0).clean_logprob()) << post;
  }
  ExpectInvalid(TryIntervene(*stub, request({{"hook_attn_out", 0, 1, 1}})),
                "patches[0].hook = \"hook_attn_out\": not a patching site");
  ExpectInvalid(TryIntervene(*stub, request({{"mlp_out", L, 1, 1}})),
                absl::StrCat("patches[0].layer = ", L));
  ExpectInvalid(TryIntervene(*stub, request({{"resid_pre", L + 1, 1, 1}})),
                absl::StrCat("patches[0].layer = ", L + 1));
}

TEST(InterpretIntervene, AblationsAndRowOverridesAsDefined) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const Model& model = server.model();
  const std::vector<int32_t> tokens = RandomPromptTokens(12, 8);
  v1::InterveneRequest r;
  *r.mutable_input() = IdsInput(tokens);
  r.set_precision(v1::PRECISION_FP64);
  v1::HeadAblation* a = r.add_ablations();
  a->set_layer(1);
  a->set_head(2);
  a = r.add_ablations();
  a->set_layer(3);
  a->set_head(0);
  a->set_mode(v1::HeadAblation::MODE_MEAN);
  v1::RowOverride* o = r.add_row_overrides();
  o->set_layer(0);
  o->set_head(4);
  o->set_position(7);
  o->add_masked_keys(0);
  o->add_masked_keys(6);
  AddTarget(r, 11, 42);
  AddTarget(r, 5, 300);
  const v1::InterveneResponse response = CallIntervene(*stub, r);

  // The same edits through engine/interpret directly.
  interpret::Edits edits;
  edits.ablations = {{1, 2, interpret::AblationMode::kZero},
                     {3, 0, interpret::AblationMode::kMean}};
  edits.row_overrides.push_back({0, 4, 7, {}, {0, 6}});
  kernels::ReferenceBackend be;
  interpret::SequenceInput<double> in;
  in.tokens = tokens;
  const std::vector<interpret::TokenTarget> targets = {{11, 42}, {5, 300}};
  auto want = interpret::Intervene(model, be, in, edits, targets);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(response.effects_size(), 2);
  for (int k = 0; k < 2; ++k) {
    EXPECT_DOUBLE_EQ(response.effects(k).clean_logprob(), want->clean_logprobs[k]);
    EXPECT_DOUBLE_EQ(response.effects(k).edited_logprob(), want->edited_logprobs[k]);
    EXPECT_NE(response.effects(k).clean_logprob(), response.effects(k).edited_logprob());
  }
  // Causality: overriding row 7 alone leaves row 6's output alone and changes row 7's.
  v1::InterveneRequest only = r;
  only.clear_ablations();
  only.clear_targets();
  AddTarget(only, 6, 42);
  AddTarget(only, 7, 42);
  const v1::InterveneResponse o2 = CallIntervene(*stub, only);
  EXPECT_EQ(o2.effects(0).clean_logprob(), o2.effects(0).edited_logprob());
  EXPECT_NE(o2.effects(1).clean_logprob(), o2.effects(1).edited_logprob());

  // Errors name the field.
  v1::InterveneRequest bad = r;
  bad.mutable_ablations(0)->set_head(99);
  ExpectInvalid(TryIntervene(*stub, bad), "ablations[0].head = 99");
}

// Neuron ablations against the oracle's own (--ablate-neuron: mlp_post of that neuron set
// to 0 or its mean in a PyTorch forward), by the edited log-probs of the targets; layers and
// positions count from the end; bad neurons and positions are refused by field.
TEST(InterpretIntervene, NeuronAblationsMatchTheOracle) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  if (!OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const ModelConfig& c = server.model().config;
  const std::vector<int32_t> tokens = RandomPromptTokens(12, 21);
  const int L = c.num_layers, F = c.hidden_dim;
  for (const bool mean : {false, true}) {
    v1::InterveneRequest r;
    *r.mutable_input() = IdsInput(tokens);
    r.set_precision(v1::PRECISION_FP64);
    const auto mode = mean ? v1::HeadAblation::MODE_MEAN : v1::HeadAblation::MODE_ZERO;
    v1::NeuronAblation* a = r.add_neuron_ablations();
    a->set_layer(1);
    a->set_neuron(5);
    a->set_mode(mode);
    a = r.add_neuron_ablations();
    a->set_layer(-1);
    a->set_neuron(F - 1);
    a->set_position(-6);
    a->set_mode(mode);
    AddTarget(r, 11, 42);
    AddTarget(r, 6, 300);
    const v1::InterveneResponse response = CallIntervene(*stub, r);
    const OracleResult ref =
        RunOracleWith(Stories260KPath(), tokens,
                      absl::StrCat("--ablate-neuron 1:5 --ablate-neuron ", L - 1, ":", F - 1, ":6",
                                   mean ? " --ablate-mean" : ""));
    ASSERT_TRUE(ref.error.empty()) << ref.error;
    const OracleArray& logits = ref.arrays.at("logits");
    ASSERT_EQ(response.effects_size(), 2);
    for (int k = 0; k < 2; ++k) {
      const v1::TargetEffect& e = response.effects(k);
      const int row = e.target().position(), V = c.vocab_size;
      double m = -1e300, z = 0;
      for (int v = 0; v < V; ++v) m = std::max(m, logits.data[int64_t{row} * V + v]);
      for (int v = 0; v < V; ++v) z += std::exp(logits.data[int64_t{row} * V + v] - m);
      const double want = logits.data[int64_t{row} * V + e.target().token()] - m - std::log(z);
      EXPECT_NEAR(e.edited_logprob(), want, 1e-10) << (mean ? "mean" : "zero") << " row " << row;
      EXPECT_NE(e.edited_logprob(), e.clean_logprob());
    }
  }
  v1::InterveneRequest bad;
  *bad.mutable_input() = IdsInput(tokens);
  AddTarget(bad, 11, 42);
  v1::NeuronAblation* a = bad.add_neuron_ablations();
  a->set_neuron(F);
  ExpectInvalid(TryIntervene(*stub, bad),
                absl::StrCat("neuron_ablations[0].neuron = ", F, " must be in [0, ", F, ")"));
  a->set_neuron(0);
  a->set_position(12);
  ExpectInvalid(TryIntervene(*stub, bad), "neuron_ablations[0].position = 12");
  a->clear_position();
  a->set_layer(L);
  ExpectInvalid(TryIntervene(*stub, bad), absl::StrCat("neuron_ablations[0].layer = ", L));
}

TEST(InterpretLens, LastLayerIsTheModelsOwnOutput) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const ModelConfig& c = server.model().config;
  const std::vector<int32_t> tokens = RandomPromptTokens(9, 4);
  v1::LogitLensRequest lens;
  *lens.mutable_input() = IdsInput(tokens);
  lens.set_precision(v1::PRECISION_FP64);
  lens.set_top_k(3);
  lens.add_positions(4);
  lens.add_positions(8);
  v1::LogitLensResponse lr;
  grpc::ClientContext context;
  SetDeadline(context);
  ASSERT_TRUE(stub->LogitLens(&context, lens, &lr).ok());
  ASSERT_EQ(lr.rows_size(), (c.num_layers + 1) * 2);
  const v1::LensRow& last = lr.rows(lr.rows_size() - 1);
  EXPECT_EQ(last.layer(), c.num_layers);
  EXPECT_EQ(last.position(), 8);
  ASSERT_EQ(last.top_size(), 3);
  EXPECT_GE(last.top(0).logprob(), last.top(1).logprob());
  EXPECT_FALSE(last.top(0).piece().empty());
  // The model's own log-probability of that token at that position (Intervene's clean run).
  v1::InterveneRequest r;
  *r.mutable_input() = IdsInput(tokens);
  r.set_precision(v1::PRECISION_FP64);
  AddTarget(r, 8, last.top(0).token());
  EXPECT_NEAR(CallIntervene(*stub, r).effects(0).clean_logprob(), last.top(0).logprob(), 1e-12);
}

TEST(InterpretCachedKv, SessionProbeEqualsFullTapeWithLeafPrefix) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const Model& model = server.model();
  const ModelConfig& c = model.config;
  const GeneratedSession session = OpenSessionAndGenerate(server, "Once upon a time", 6);
  ASSERT_TRUE(session.error.empty()) << session.error;
  const std::vector<int32_t>& tokens = session.tokens;
  const int cached = session.cached;
  ASSERT_EQ(cached + 1, static_cast<int>(tokens.size()));  // the last token is not cached yet

  const int32_t target = 42;
  std::vector<v1::CachedKvProbeResponse> responses(2);
  for (int k = 0; k < 2; ++k) {
    v1::CachedKvProbeRequest r;
    r.set_session_id(session.id);
    r.set_target(target);
    r.set_precision(k == 0 ? v1::PRECISION_FP64 : v1::PRECISION_FP32);
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status s = stub->CachedKvProbe(&context, r, &responses[k]);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(responses[k].num_cached(), cached);
    ASSERT_EQ(responses[k].tensors_size(), 2 * c.num_layers);
  }
  // Definition: a full fp64 tape over the session's tokens whose prefix K/V are leaves.
  kernels::ReferenceBackend be;
  interpret::SequenceInput<double> in;
  in.tokens = tokens;
  auto tape = interpret::RunForward(model, be, in);
  ASSERT_TRUE(tape.ok());
  interpret::BackwardOptions options;
  options.kv_leaf_end = cached;
  const int last = static_cast<int>(tokens.size()) - 1;
  auto grads = interpret::ObjectiveGradients(
      model, *tape, interpret::Objective::LogProb({{last, target}}), options);
  ASSERT_TRUE(grads.ok());
  EXPECT_NEAR(
      responses[0].objective(),
      interpret::EvaluateObjective(interpret::Objective::LogProb({{last, target}}), c, *tape),
      1e-4);
  double worst64 = 0, worst32 = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    for (const char* name : {"grad.cached_k", "grad.cached_v"}) {
      const bool is_k = std::string(name) == "grad.cached_k";
      const std::vector<double>& full = is_k ? grads->k[l] : grads->v[l];
      const std::vector<double> want(full.begin(),
                                     full.begin() + static_cast<int64_t>(cached) * c.kv_dim());
      const v1::Tensor* t64 = FindTensor(responses[0].tensors(), name, l, -1);
      const v1::Tensor* t32 = FindTensor(responses[1].tensors(), name, l, -1);
      ASSERT_NE(t64, nullptr);
      ASSERT_NE(t32, nullptr);
      worst64 = std::max(worst64, RelErr(DecodeTensor(*t64), want));
      worst32 = std::max(worst32, RelErr(DecodeTensor(*t32), want));
    }
  }
  // The cache holds the engine's fp32 K/V; the definition recomputes them in fp64.
  EXPECT_LE(worst64, 1e-4);
  EXPECT_LE(worst32, 1e-4);
  std::printf("[interp] cached-KV probe vs full tape with leaf prefix: fp64 %.3g, fp32 %.3g\n",
              worst64, worst32);

  // AttentionMaps on the session: the session's tokens.
  v1::AttentionMapsRequest maps;
  maps.mutable_input()->set_session_id(session.id);
  maps.add_layers(0);
  const AttentionResult ar = RunAttentionMaps(*stub, maps);
  ASSERT_TRUE(ar.status.ok()) << ar.status.error_message();
  EXPECT_EQ(std::vector<int32_t>(ar.info.token_ids().begin(), ar.info.token_ids().end()), tokens);

  // Unknown sessions are NOT_FOUND.
  v1::CachedKvProbeRequest r;
  r.set_session_id(12345);
  v1::CachedKvProbeResponse ignored;
  grpc::ClientContext context;
  SetDeadline(context);
  EXPECT_EQ(stub->CachedKvProbe(&context, r, &ignored).error_code(), grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace kvlens::testing
