// kvlens.v1.Interpret PatchSweep end to end on stories260K: the grid is engine/interpret's
// PatchSweep (fp64, same prompts; also with all_positions), or AttributionPatchSweep with
// attribution (with qk_fix its QK-fixed cells), with more_pairs the mean of each pair's own sweep
// (and with per_pair each of those sweeps beside it), each resid_pre cell is what Intervene answers
// for that one ResidualPatch (another RPC, another path), layers and positions come back resolved,
// and every malformed request is refused naming its field or flag.
#include <tuple>
#include <vector>

#include "engine/interpret/attribution_patching.h"
#include "engine/interpret/patch_sweep.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/server/interpret_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

grpc::Status CallSweep(TestServer& server, const v1::PatchSweepRequest& r,
                       v1::PatchSweepResponse* response) {
  auto stub = InterpretStub(server);
  grpc::ClientContext context;
  SetDeadline(context);
  return stub->PatchSweep(&context, r, response);
}

v1::PatchSweepRequest SweepRequest(const std::vector<int32_t>& input,
                                   const std::vector<int32_t>& source, const char* hook) {
  v1::PatchSweepRequest r;
  *r.mutable_input() = IdsInput(input);
  *r.mutable_patch_source() = IdsInput(source);
  r.set_hook(hook);
  r.set_precision(v1::PRECISION_FP64);
  return r;
}

TEST(InterpretPatchSweep, TheGridIsTheEnginesAndEachCellIsAnIntervention) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  const Model& model = server.model();
  const ModelConfig& c = model.config;
  const std::vector<int32_t> input = RandomPromptTokens(9, 2), source = RandomPromptTokens(9, 7);

  // z, two layers (one from the end), positions [2, 8): against the engine directly.
  v1::PatchSweepRequest r = SweepRequest(input, source, "z");
  r.add_layers(-1);
  r.add_layers(1);
  r.mutable_positions()->set_begin(2);
  r.mutable_positions()->set_end(-1);
  r.mutable_logit_diff()->set_position(-2);
  r.mutable_logit_diff()->set_token_a(300);
  r.mutable_logit_diff()->set_token_b(42);
  v1::PatchSweepResponse z;
  const grpc::Status s = CallSweep(server, r, &z);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(z.precision(), v1::PRECISION_FP64);
  EXPECT_EQ(std::vector<int>(z.layers().begin(), z.layers().end()),
            (std::vector<int>{c.num_layers - 1, 1}));
  EXPECT_EQ(z.positions().begin(), 2);
  EXPECT_EQ(z.positions().end(), 8);
  EXPECT_EQ(z.num_heads(), c.num_heads);
  EXPECT_EQ(std::vector<int32_t>(z.source_token_ids().begin(), z.source_token_ids().end()), source);
  kernels::ReferenceBackend be;
  auto want = interpret::PatchSweep(model, be, interpret::SequenceInput<double>{input},
                                    interpret::SequenceInput<double>{source},
                                    *interpret::PatchTargetByName("z"), {c.num_layers - 1, 1}, 2, 8,
                                    interpret::Objective::LogitDiff(7, 300, 42));
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(z.clean(), want->clean);
  EXPECT_EQ(z.source(), want->source);
  EXPECT_EQ(std::vector<double>(z.metric().begin(), z.metric().end()), want->metric);
  // all_positions: a cell per layer and head, positions [2, 8) patched at once
  r.set_all_positions(true);
  v1::PatchSweepResponse z_all;
  ASSERT_TRUE(CallSweep(server, r, &z_all).ok());
  want = interpret::PatchSweep(model, be, interpret::SequenceInput<double>{input},
                               interpret::SequenceInput<double>{source},
                               *interpret::PatchTargetByName("z"), {c.num_layers - 1, 1}, 2, 8,
                               interpret::Objective::LogitDiff(7, 300, 42), true);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(z_all.metric_size(), 2 * c.num_heads);
  EXPECT_EQ(std::vector<double>(z_all.metric().begin(), z_all.metric().end()), want->metric);
  // attribution: engine/interpret's AttributionPatchSweep, the same layout
  r.set_all_positions(false);
  r.set_attribution(true);
  v1::PatchSweepResponse z_atp;
  ASSERT_TRUE(CallSweep(server, r, &z_atp).ok());
  want = interpret::AttributionPatchSweep(model, be, interpret::SequenceInput<double>{input},
                                          interpret::SequenceInput<double>{source},
                                          *interpret::PatchTargetByName("z"), {c.num_layers - 1, 1},
                                          2, 8, interpret::Objective::LogitDiff(7, 300, 42));
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(z_atp.clean(), z.clean());
  EXPECT_EQ(std::vector<double>(z_atp.metric().begin(), z_atp.metric().end()), want->metric);
  EXPECT_NE(want->metric, std::vector<double>(z.metric().begin(), z.metric().end()));
  // qk_fix (q): AttributionPatchSweep's QK-fixed cells
  v1::PatchSweepRequest q = r;
  q.set_hook("q");
  q.set_qk_fix(true);
  v1::PatchSweepResponse q_fixed;
  const grpc::Status qs = CallSweep(server, q, &q_fixed);
  ASSERT_TRUE(qs.ok()) << qs.error_message();
  want = interpret::AttributionPatchSweep(
      model, be, interpret::SequenceInput<double>{input}, interpret::SequenceInput<double>{source},
      *interpret::PatchTargetByName("q"), {c.num_layers - 1, 1}, 2, 8,
      interpret::Objective::LogitDiff(7, 300, 42), false,
      static_cast<kernels::BackwardOps<double>*>(nullptr), /*qk_fix=*/true);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(std::vector<double>(q_fixed.metric().begin(), q_fixed.metric().end()), want->metric);

  // more_pairs: a second prompt pair with its own objective; every cell, clean and source
  // are the mean of the two pairs' own sweeps (each asked for alone), exact or estimated.
  const std::vector<int32_t> input2 = RandomPromptTokens(9, 11),
                             source2 = RandomPromptTokens(9, 12);
  for (const bool atp : {false, true}) {
    v1::PatchSweepRequest one = r, two = SweepRequest(input2, source2, "z"), both = r;
    one.set_attribution(atp);
    *two.mutable_layers() = r.layers();
    *two.mutable_positions() = r.positions();
    two.mutable_logit_diff()->set_position(-1);
    two.mutable_logit_diff()->set_token_a(77);
    two.mutable_logit_diff()->set_token_b(300);
    two.set_attribution(atp);
    both.set_attribution(atp);
    v1::PatchSweepPair* pair = both.add_more_pairs();
    *pair->mutable_input() = two.input();
    *pair->mutable_patch_source() = two.patch_source();
    *pair->mutable_logit_diff() = two.logit_diff();
    v1::PatchSweepResponse a, b, mean;
    ASSERT_TRUE(CallSweep(server, one, &a).ok());
    ASSERT_TRUE(CallSweep(server, two, &b).ok());
    const grpc::Status ms = CallSweep(server, both, &mean);
    ASSERT_TRUE(ms.ok()) << ms.error_message();
    EXPECT_EQ(a.num_pairs(), 1);
    EXPECT_EQ(mean.num_pairs(), 2);
    EXPECT_DOUBLE_EQ(mean.clean(), (a.clean() + b.clean()) / 2);
    EXPECT_DOUBLE_EQ(mean.source(), (a.source() + b.source()) / 2);
    ASSERT_EQ(mean.metric_size(), a.metric_size());
    for (int e = 0; e < a.metric_size(); ++e) {
      EXPECT_DOUBLE_EQ(mean.metric(e), (a.metric(e) + b.metric(e)) / 2) << e << " " << atp;
    }
    EXPECT_EQ(std::vector<int32_t>(mean.token_ids().begin(), mean.token_ids().end()), input);
    EXPECT_EQ(mean.pairs_size(), 0);
    // per_pair: each pair's own sweep beside the mean, in the request's order
    both.set_per_pair(true);
    v1::PatchSweepResponse per;
    ASSERT_TRUE(CallSweep(server, both, &per).ok());
    EXPECT_EQ(std::vector<double>(per.metric().begin(), per.metric().end()),
              std::vector<double>(mean.metric().begin(), mean.metric().end()));
    ASSERT_EQ(per.pairs_size(), 2);
    for (int k = 0; k < 2; ++k) {
      const v1::PatchSweepResponse& alone = k == 0 ? a : b;
      const v1::PatchSweepPairResult& own = per.pairs(k);
      EXPECT_EQ(own.clean(), alone.clean()) << k;
      EXPECT_EQ(own.source(), alone.source()) << k;
      EXPECT_EQ(std::vector<double>(own.metric().begin(), own.metric().end()),
                std::vector<double>(alone.metric().begin(), alone.metric().end()))
          << k << " " << atp;
    }
  }

  // resid_pre over every layer and position, log p(token 5 | last): each cell is Intervene's
  // edited log-prob under that one residual patch.
  v1::PatchSweepRequest pre = SweepRequest(input, source, "");
  v1::TokenTarget* t = pre.mutable_log_prob()->add_targets();
  t->set_position(-1);
  t->set_token(5);
  v1::PatchSweepResponse grid;
  ASSERT_TRUE(CallSweep(server, pre, &grid).ok());
  ASSERT_EQ(grid.metric_size(), c.num_layers * 9);
  auto stub = InterpretStub(server);
  bool moved = false;
  for (int l = 0; l < c.num_layers; ++l) {
    for (int p = 0; p < 9; ++p) {
      v1::InterveneRequest one;
      *one.mutable_input() = IdsInput(input);
      *one.mutable_patch_source() = IdsInput(source);
      one.set_precision(v1::PRECISION_FP64);
      v1::ResidualPatch* patch = one.add_patches();
      patch->set_layer(l);
      patch->set_position(p);
      patch->set_source_position(p);
      *one.add_targets() = *t;
      v1::InterveneResponse effect;
      grpc::ClientContext context;
      SetDeadline(context);
      ASSERT_TRUE(stub->Intervene(&context, one, &effect).ok());
      EXPECT_EQ(grid.metric(l * 9 + p), effect.effects(0).edited_logprob()) << l << " " << p;
      EXPECT_EQ(grid.clean(), effect.effects(0).clean_logprob());
      moved |= grid.metric(l * 9 + p) != grid.clean();
    }
  }
  EXPECT_TRUE(moved);
}

// Sweeps are counted under their own metric kind, patch, apart from Intervene's.
TEST(InterpretPatchSweep, CountedUnderThePatchMetricKind) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  const std::vector<int32_t> input = RandomPromptTokens(5, 2), source = RandomPromptTokens(5, 3);
  v1::PatchSweepRequest r = SweepRequest(input, source, "attn_out");
  r.add_layers(0);
  v1::TokenTarget* t = r.mutable_log_prob()->add_targets();
  t->set_position(-1);
  t->set_token(5);
  v1::PatchSweepResponse response;
  ASSERT_TRUE(CallSweep(server, r, &response).ok());
  ASSERT_TRUE(CallSweep(server, r, &response).ok());
  const std::string m = ScrapeMetrics(server.metrics_port());
  EXPECT_EQ(MetricValue(m, R"(kvlens_interp_requests_total{kind="patch"})"), 2);
  EXPECT_EQ(MetricValue(m, R"(kvlens_interp_requests_total{kind="intervene"})"), 0);
  EXPECT_GT(MetricValue(m, R"(kvlens_interp_response_bytes_total{kind="patch"})"), 2 * 5 * 8);
}

TEST(InterpretPatchSweep, BadRequestsNameTheirField) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  server::InterpretOptions few;
  few.limits.max_sweep_runs = 20;
  few.limits.max_bytes = 4000;
  TestServer server(Stories260KPath(), TestServer::DefaultOptions(), 1, few);
  ASSERT_TRUE(server.ok()) << server.error();
  const std::vector<int32_t> input = RandomPromptTokens(6, 2), source = RandomPromptTokens(6, 3);
  auto with = [&](auto edit) {
    v1::PatchSweepRequest r = SweepRequest(input, source, "attn_out");
    r.add_layers(0);
    r.mutable_logit_diff()->set_position(5);
    r.mutable_logit_diff()->set_token_a(1);
    r.mutable_logit_diff()->set_token_b(2);
    edit(r);
    v1::PatchSweepResponse ignored;
    return CallSweep(server, r, &ignored);
  };
  ASSERT_TRUE(with([](auto&) {}).ok());
  const auto invalid = grpc::StatusCode::INVALID_ARGUMENT;
  ExpectRefused(with([](auto& r) { r.clear_patch_source(); }), invalid, "patch_source: required");
  ExpectRefused(with([](auto& r) {
                  *r.mutable_patch_source() = IdsInput({1, 5, 9});
                }),
                invalid, "patch_source has 3 tokens and input 6");
  ExpectRefused(with([](auto& r) { r.set_hook("hook_z"); }), invalid,
                "hook = \"hook_z\": not a patching site (resid_pre, resid_mid, resid_post, "
                "attn_out, mlp_out, q, k, v, z, pattern)");
  ExpectRefused(with([](auto& r) { r.add_layers(9); }), invalid, "layers");
  ExpectRefused(with([](auto& r) { r.mutable_positions()->set_begin(7); }), invalid, "positions");
  ExpectRefused(with([](auto& r) { r.clear_logit_diff(); }), invalid,
                "objective: set one of log_prob, logit_diff");
  ExpectRefused(with([](auto& r) { r.mutable_logit_diff()->set_token_a(1 << 20); }), invalid,
                "logit_diff.token_a");
  // z over one layer: 8 heads × 6 positions = 48 cells > 20.
  ExpectRefused(with([](auto& r) { r.set_hook("z"); }), invalid,
                "the sweep has 48 cells (layers × heads × positions), more than "
                "--max-interp-sweep-runs = 20");
  // all positions at once: 8 heads × 1 layer fit; over every layer, 5 × 8 = 40 do not.
  ASSERT_TRUE(with([](auto& r) {
                r.set_hook("z");
                r.set_all_positions(true);
              }).ok());
  ExpectRefused(with([](auto& r) {
                  r.set_hook("z");
                  r.set_all_positions(true);
                  r.clear_layers();
                }),
                invalid,
                "the sweep has 40 cells (layers × heads), more than --max-interp-sweep-runs = 20; "
                "ask for fewer layers");
  // qk_fix: with attribution, on q or k only
  ASSERT_TRUE(with([](auto& r) {
                r.set_hook("k");
                r.set_attribution(true);
                r.set_qk_fix(true);
              }).ok());
  ExpectRefused(with([](auto& r) {
                  r.set_hook("z");
                  r.set_attribution(true);
                  r.set_qk_fix(true);
                }),
                invalid, "qk_fix: only with attribution and hook q or k (hook = \"z\")");
  ExpectRefused(with([](auto& r) {
                  r.set_hook("q");
                  r.set_qk_fix(true);
                }),
                invalid,
                "qk_fix: only with attribution and hook q or k (hook = \"q\", attribution unset)");
  // attribution: no forward per cell, so no cell limit (every layer × 8 heads × 6 = 240)
  ASSERT_TRUE(with([](auto& r) {
                r.set_hook("z");
                r.set_attribution(true);
                r.clear_layers();
              }).ok());
  // per_pair: each pair's grid counts against --max-interp-bytes (the mean's and two pairs'
  // 240 cells, 8 bytes each: 5760 > 4000; the mean alone fits, above), refused before it runs
  ExpectRefused(with([&](auto& r) {
                  r.set_hook("z");
                  r.set_attribution(true);
                  r.clear_layers();
                  r.set_per_pair(true);
                  v1::PatchSweepPair* p = r.add_more_pairs();
                  *p->mutable_input() = IdsInput(source);
                  *p->mutable_patch_source() = IdsInput(input);
                  *p->mutable_logit_diff() = r.logit_diff();
                }),
                grpc::StatusCode::RESOURCE_EXHAUSTED,
                "PatchSweep would return 5760 bytes of metric (240 cells × 3 grids: the mean and "
                "each pair's), more than --max-interp-bytes = 4000; ask for fewer layers or "
                "positions, or without per_pair");
  // more_pairs: each pair checked as the first is, its fields named by index; the cells
  // count once per pair (attn_out over one layer: 6 positions × 4 pairs = 24 > 20).
  auto pair = [&](auto edit) {
    return [&, edit](v1::PatchSweepRequest& r) {
      v1::PatchSweepPair* p = r.add_more_pairs();
      *p->mutable_input() = IdsInput(source);
      *p->mutable_patch_source() = IdsInput(input);
      *p->mutable_logit_diff() = r.logit_diff();
      edit(*p);
    };
  };
  ASSERT_TRUE(with(pair([](auto&) {})).ok());
  ExpectRefused(with(pair([](auto& p) {
                  *p.mutable_input() = IdsInput({1, 5, 9});
                })),
                invalid, "more_pairs[0].patch_source has 6 tokens and more_pairs[0].input 3");
  ExpectRefused(with(pair([](auto& p) {
                  *p.mutable_input() = IdsInput({1, 5, 9});
                  *p.mutable_patch_source() = IdsInput({1, 5, 9});
                })),
                invalid, "more_pairs[0].input has 3 tokens and the first pair's input 6");
  ExpectRefused(with(pair([](auto& p) { p.clear_patch_source(); })), invalid,
                "more_pairs[0].patch_source: required");
  ExpectRefused(with(pair([](auto& p) { p.clear_logit_diff(); })), invalid,
                "more_pairs[0].objective: set one of log_prob, logit_diff");
  ExpectRefused(with(pair([](auto& p) { p.mutable_logit_diff()->set_token_b(1 << 20); })), invalid,
                "more_pairs[0].logit_diff.token_b");
  ExpectRefused(with([&](auto& r) {
                  for (int k = 0; k < 3; ++k) pair([](auto&) {})(r);
                }),
                invalid,
                "the sweep has 24 cells (layers × positions × pairs), more than "
                "--max-interp-sweep-runs = 20; ask for fewer layers or positions or pairs");
  // v: stories260K's 4 KV heads × 6 positions = 24 cells > 20; 3 positions fit.
  ExpectRefused(with([](auto& r) { r.set_hook("v"); }), invalid, "the sweep has 24 cells");
  v1::PatchSweepResponse v;
  v1::PatchSweepRequest r = SweepRequest(input, source, "v");
  r.add_layers(0);
  r.mutable_positions()->set_begin(3);
  r.mutable_logit_diff()->set_position(5);
  r.mutable_logit_diff()->set_token_a(1);
  r.mutable_logit_diff()->set_token_b(2);
  ASSERT_TRUE(CallSweep(server, r, &v).ok());
  EXPECT_EQ(v.num_heads(), 4);
  EXPECT_EQ(v.metric_size(), 4 * 3);
}

}  // namespace
}  // namespace kvlens::testing
