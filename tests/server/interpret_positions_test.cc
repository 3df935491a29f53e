// Positions counted from the end in Interpret requests, as Python and TransformerLens index
// (−1 the last): every request that names a position (probe targets, a logit difference,
// intervention targets, row overrides and patches, lens positions, the attributed
// position, and the bounds of a range) gives the answer of the same request written with
// the absolute positions, and says which positions it resolved to where the response
// carries them. A position before the first (−n − 1) is refused naming its field and
// [−n, n); a position given twice, once from each end, is refused as repeated.
#include <array>

#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/server/interpret_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

constexpr int kN = 10;  // prompt tokens

class InterpretPositions : public ::testing::Test {
 protected:
  void SetUp() override {
    KVLENS_REQUIRE_FILE(Stories260KPath());
    ASSERT_TRUE(server_.ok()) << server_.error();
  }
  TestServer server_;
  const std::vector<int32_t> tokens_ = RandomPromptTokens(kN, 5);
};

TEST_F(InterpretPositions, ProbeTargetsAndLogitDiffCountFromTheEnd) {
  auto probe = [&](int p1, int p2) {
    v1::GradientProbeRequest r;
    *r.mutable_input() = IdsInput(tokens_);
    r.mutable_log_prob()->add_targets()->set_position(p1);
    r.mutable_log_prob()->mutable_targets(0)->set_token(42);
    r.mutable_log_prob()->add_targets()->set_position(p2);
    r.mutable_log_prob()->mutable_targets(1)->set_token(7);
    r.set_scores(true);
    r.set_q(true);
    r.set_embeddings(true);
    return r;
  };
  const v1::GradientProbeResponse absolute = CallGradientProbe(server_, probe(kN - 1, kN - 4));
  const v1::GradientProbeResponse from_end = CallGradientProbe(server_, probe(-1, -4));
  ASSERT_GT(absolute.tensors_size(), 0);
  EXPECT_EQ(from_end.objective(), absolute.objective());
  ASSERT_EQ(from_end.tensors_size(), absolute.tensors_size());
  for (int i = 0; i < absolute.tensors_size(); ++i) {
    EXPECT_EQ(from_end.tensors(i).data(), absolute.tensors(i).data()) << absolute.tensors(i).name();
  }
  // Either end is the same target: J of the last position differs from the first's.
  EXPECT_NE(CallGradientProbe(server_, probe(0, kN - 4)).objective(), absolute.objective());

  v1::GradientProbeRequest diff;
  *diff.mutable_input() = IdsInput(tokens_);
  diff.mutable_logit_diff()->set_token_a(42);
  diff.mutable_logit_diff()->set_token_b(7);
  diff.mutable_logit_diff()->set_position(kN - 2);
  const double j = CallGradientProbe(server_, diff).objective();
  diff.mutable_logit_diff()->set_position(-2);
  EXPECT_EQ(CallGradientProbe(server_, diff).objective(), j);

  v1::GradientProbeResponse ignored;
  ExpectInvalid(
      CallInterpret(server_, &v1::Interpret::Stub::GradientProbe, probe(-1, -kN - 1), &ignored),
      "log_prob.targets[1].position = -11 must be in [-10, 10)");
  diff.mutable_logit_diff()->set_position(-kN - 1);
  ExpectInvalid(CallInterpret(server_, &v1::Interpret::Stub::GradientProbe, diff, &ignored),
                "logit_diff.position = -11 must be in [-10, 10)");
}

TEST_F(InterpretPositions, InterventionsCountFromTheEndOfTheirOwnPrompt) {
  const std::vector<int32_t> source = RandomPromptTokens(7, 9);  // shorter than the prompt
  auto intervene = [&](int target, int row, int patched, int source_position) {
    v1::InterveneRequest r;
    *r.mutable_input() = IdsInput(tokens_);
    *r.mutable_patch_source() = IdsInput(source);
    v1::RowOverride* o = r.add_row_overrides();
    o->set_layer(1);
    o->set_head(2);
    o->set_position(row);
    o->add_masked_keys(0);
    v1::ResidualPatch* p = r.add_patches();
    p->set_layer(2);
    p->set_position(patched);
    p->set_source_position(source_position);
    v1::TokenTarget* t = r.add_targets();
    t->set_position(target);
    t->set_token(42);
    return r;
  };
  v1::InterveneResponse absolute, from_end;
  const auto method = &v1::Interpret::Stub::Intervene;
  ASSERT_TRUE(CallInterpret(server_, method, intervene(kN - 1, kN - 3, kN - 2, 5), &absolute).ok());
  ASSERT_TRUE(CallInterpret(server_, method, intervene(-1, -3, -2, -2), &from_end).ok());
  ASSERT_EQ(from_end.effects_size(), 1);
  EXPECT_EQ(from_end.effects(0).target().position(), kN - 1);  // resolved
  EXPECT_EQ(from_end.effects(0).clean_logit(), absolute.effects(0).clean_logit());
  EXPECT_EQ(from_end.effects(0).edited_logit(), absolute.effects(0).edited_logit());
  EXPECT_EQ(from_end.max_abs_logit_change(), absolute.max_abs_logit_change());
  EXPECT_GT(absolute.max_abs_logit_change(), 0.0);  // the edits did something

  // The source position counts from the end of the source prompt (7 tokens), not the
  // prompt's (10).
  v1::InterveneResponse refused;
  ExpectInvalid(CallInterpret(server_, method, intervene(-1, -3, -2, -8), &refused),
                "patches[0].source_position = -8 must be in [-7, 7)");
  ExpectInvalid(CallInterpret(server_, method, intervene(-1, -3, -11, 0), &refused),
                "patches[0].position = -11 must be in [-10, 10)");
  ExpectInvalid(CallInterpret(server_, method, intervene(-1, -11, -2, 0), &refused),
                "row_overrides[0].position = -11");
  ExpectInvalid(CallInterpret(server_, method, intervene(-11, -3, -2, 0), &refused),
                "targets[0].position = -11");
}

TEST_F(InterpretPositions, LensAndAttributionCountFromTheEnd) {
  v1::LogitLensRequest lens;
  *lens.mutable_input() = IdsInput(tokens_);
  lens.add_positions(kN - 1);
  lens.add_positions(2);
  v1::LogitLensResponse absolute, from_end;
  const auto lens_method = &v1::Interpret::Stub::LogitLens;
  ASSERT_TRUE(CallInterpret(server_, lens_method, lens, &absolute).ok());
  lens.set_positions(0, -1);
  lens.set_positions(1, 2 - kN);
  ASSERT_TRUE(CallInterpret(server_, lens_method, lens, &from_end).ok());
  ASSERT_GT(absolute.rows_size(), 0);
  EXPECT_EQ(from_end.SerializeAsString(), absolute.SerializeAsString());  // positions resolved
  lens.set_positions(1, kN - 1);
  ExpectInvalid(CallInterpret(server_, lens_method, lens, &from_end),
                "positions[1] = 9 is repeated");
  lens.set_positions(0, kN - 1);
  lens.set_positions(1, -1);
  ExpectInvalid(CallInterpret(server_, lens_method, lens, &from_end),
                "positions[1] = -1 (9) is repeated");

  v1::LogitAttributionRequest attribute;
  *attribute.mutable_input() = IdsInput(tokens_);
  attribute.set_token(42);
  attribute.set_heads(true);
  attribute.set_position(kN - 3);
  v1::LogitAttributionResponse a_absolute, a_from_end;
  const auto attribute_method = &v1::Interpret::Stub::LogitAttribution;
  ASSERT_TRUE(CallInterpret(server_, attribute_method, attribute, &a_absolute).ok());
  attribute.set_position(-3);
  ASSERT_TRUE(CallInterpret(server_, attribute_method, attribute, &a_from_end).ok());
  EXPECT_EQ(a_from_end.position(), kN - 3);
  EXPECT_EQ(a_from_end.SerializeAsString(), a_absolute.SerializeAsString());
  attribute.set_position(-kN - 1);
  ExpectInvalid(CallInterpret(server_, attribute_method, attribute, &a_from_end),
                "position = -11 must be in [-10, 10)");
}

TEST_F(InterpretPositions, RangeBoundsCountFromTheEnd) {
  auto rows = [&](int begin, int end, v1::ActivationsResponse* response) {
    v1::ActivationsRequest r;
    *r.mutable_input() = IdsInput(tokens_);
    r.add_hooks("resid_post");
    r.add_layers(1);
    r.mutable_positions()->set_begin(begin);
    r.mutable_positions()->set_end(end);
    return CallInterpret(server_, &v1::Interpret::Stub::Activations, r, response);
  };
  // The last three rows: [-3, 0) is [7, 10); all but the last: [0, -1) is [0, 9).
  for (auto [begin, end, abs_begin, abs_end] :
       std::vector<std::array<int, 4>>{{-3, 0, 7, 10}, {0, -1, 0, 9}, {-4, -2, 6, 8}}) {
    v1::ActivationsResponse absolute, from_end;
    ASSERT_TRUE(rows(abs_begin, abs_end, &absolute).ok());
    ASSERT_TRUE(rows(begin, end, &from_end).ok());
    EXPECT_EQ(from_end.positions().begin(), abs_begin);
    EXPECT_EQ(from_end.positions().end(), abs_end);
    EXPECT_EQ(from_end.SerializeAsString(), absolute.SerializeAsString()) << begin << " " << end;
  }
  v1::ActivationsResponse ignored;
  ExpectInvalid(rows(-11, 0, &ignored), "positions = [-11, 0) must be a non-empty range");
  ExpectInvalid(rows(-1, -1, &ignored), "positions = [-1, -1) must be a non-empty range");
  ExpectInvalid(rows(0, -10, &ignored), "positions = [0, -10) must be a non-empty range");
}

// kvlens-cli's position flags pass a position from the end to the server as it is: each
// command prints what it prints given the absolute position.
TEST_F(InterpretPositions, CliFlagsCountFromTheEnd) {
  auto cli = [&](const std::string& command, const std::string& flags) {
    const auto [code, out] = RunCommand(
        absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " ", command, " --server ", server_.address(),
                     " --ids '", absl::StrJoin(tokens_, " "), "' ", flags, " 2>&1"));
    EXPECT_EQ(code, 0) << command << " " << flags << "\n" << out;
    return out;
  };
  EXPECT_EQ(cli("probe", "--target-position -3 --target-token 42"),
            cli("probe", "--target-position 7 --target-token 42"));
  EXPECT_NE(cli("probe", "--target-token 42").find("log p(42 | position 9)"), std::string::npos);
  EXPECT_EQ(cli("intervene", "--ablate 0:1 --target-position -2 --target-token 42"),
            cli("intervene", "--ablate 0:1 --target-position 8 --target-token 42"));
  EXPECT_EQ(cli("attribute", "--token 42 --position -4"),
            cli("attribute", "--token 42 --position 6"));
  EXPECT_EQ(cli("lens", "--positions '-1 2'"), cli("lens", "--positions '9 2'"));
}

}  // namespace
}  // namespace kvlens::testing
