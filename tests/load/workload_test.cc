#include "clients/load/workload.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>

namespace kvlens::load {
namespace {

TEST(LengthDistTest, ParsesFixedAndRange) {
  auto fixed = LengthDist::Parse("64", "prompt-tokens");
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->min, 64);
  EXPECT_EQ(fixed->max, 64);
  auto range = LengthDist::Parse("8:32", "output-tokens");
  ASSERT_TRUE(range.ok());
  EXPECT_EQ(range->min, 8);
  EXPECT_EQ(range->max, 32);
  for (const char* bad : {"", "0", "-3", "9:8", "a", "4:", ":4", "1:2:3"}) {
    auto d = LengthDist::Parse(bad, "output-tokens");
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_NE(d.status().message().find("--output-tokens"), std::string::npos);
  }
}

TEST(LengthDistTest, UniformDrawsCoverTheRange) {
  std::mt19937_64 rng(3);
  const LengthDist d{2, 5};
  std::map<int, int> seen;
  for (int i = 0; i < 4000; ++i) ++seen[d.Draw(rng)];
  ASSERT_EQ(seen.size(), 4u);
  for (const auto& [len, n] : seen) {
    EXPECT_GE(len, 2);
    EXPECT_LE(len, 5);
    EXPECT_NEAR(n, 1000, 150);
  }
}

TEST(WorkloadTest, SyntheticPromptsShareThePrefixAndStayInVocabulary) {
  WorkloadOptions o;
  o.prompt_tokens = {20, 30};
  o.output_tokens = {16, 16};
  o.shared_prefix_tokens = 8;
  o.vocab_size = 50;
  Workload w(o);
  const RequestSpec a = w.Next();
  const RequestSpec b = w.Next();
  for (const RequestSpec* s : {&a, &b}) {
    EXPECT_EQ(s->kind, Kind::kGenerate);
    EXPECT_GE(s->token_ids.size(), 20u);
    EXPECT_LE(s->token_ids.size(), 30u);
    EXPECT_EQ(s->max_new_tokens, 16);
    for (int32_t id : s->token_ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, 50);
    }
  }
  EXPECT_TRUE(std::equal(a.token_ids.begin(), a.token_ids.begin() + 8, b.token_ids.begin()));
  EXPECT_NE(a.token_ids, b.token_ids);
  const v1::GenerateRequest r = w.ToGenerateRequest(a, 9);
  EXPECT_EQ(r.token_ids().ids_size(), static_cast<int>(a.token_ids.size()));
  EXPECT_EQ(r.stopping().max_new_tokens(), 16);
  EXPECT_TRUE(r.stopping().ignore_eos());
  EXPECT_EQ(r.sampling().seed(), 9u);
  EXPECT_FALSE(r.has_prompt_logprobs());
  WorkloadOptions scoring = o;
  scoring.prompt_logprobs = 0;
  EXPECT_EQ(Workload(scoring).ToGenerateRequest(a, 9).prompt_logprobs(), 0);
}

TEST(WorkloadTest, SharesPickKindsInProportion) {
  WorkloadOptions o;
  o.prompt_tokens = {4, 4};
  o.output_tokens = {4, 4};
  o.vocab_size = 10;
  o.attention_share = 0.2;
  o.probe_share = 0.1;
  o.activations_share = 0.15;
  o.attribution_share = 0.05;
  o.patch_share = 0.1;
  Workload w(o);
  std::map<Kind, int> n;
  for (int i = 0; i < 10000; ++i) ++n[w.Next().kind];
  EXPECT_NEAR(n[Kind::kAttention], 2000, 200);
  EXPECT_NEAR(n[Kind::kProbe], 1000, 150);
  EXPECT_NEAR(n[Kind::kActivations], 1500, 175);
  EXPECT_NEAR(n[Kind::kAttribution], 500, 110);
  EXPECT_NEAR(n[Kind::kPatch], 1000, 150);
  EXPECT_NEAR(n[Kind::kGenerate], 4000, 250);
  EXPECT_STREQ(KindName(Kind::kActivations), "activations");
  EXPECT_STREQ(KindName(Kind::kAttribution), "attribution");
  EXPECT_STREQ(KindName(Kind::kPatch), "patch");
}

// turns > 1: a conversation's next turn is drawn once its turn has ended, its prompt the
// turn's prompt, its output and turn_tokens new ids; a new conversation starts while none
// is ready; the last turn, a failed turn and a turn that could pass the context end it;
// interpretability requests are never turns.
TEST(WorkloadTest, ConversationsResendTheirHistory) {
  WorkloadOptions o;
  o.prompt_tokens = {10, 10};
  o.output_tokens = {4, 4};
  o.turn_tokens = {3, 3};
  o.turns = 3;
  o.vocab_size = 100;
  Workload w(o);
  const RequestSpec a0 = w.Next();
  const RequestSpec b0 = w.Next();  // nothing ready: a second conversation
  EXPECT_EQ(a0.conversation, 0);
  EXPECT_EQ(b0.conversation, 1);
  EXPECT_EQ(a0.turn, 0);
  EXPECT_TRUE(w.WantsOutput(a0));

  const std::vector<int32_t> out = {101, 102, 103, 104};  // (ids past the random ones')
  w.Finished(a0, true, out);
  EXPECT_EQ(w.ready_turns(), 1);
  const RequestSpec a1 = w.Next();
  EXPECT_EQ(a1.conversation, 0);
  EXPECT_EQ(a1.turn, 1);
  ASSERT_EQ(a1.token_ids.size(), 10u + 4 + 3);
  EXPECT_TRUE(std::equal(a0.token_ids.begin(), a0.token_ids.end(), a1.token_ids.begin()));
  EXPECT_TRUE(std::equal(out.begin(), out.end(), a1.token_ids.begin() + 10));
  for (size_t i = 14; i < a1.token_ids.size(); ++i) EXPECT_LT(a1.token_ids[i], 100);

  w.Finished(a1, true, out);
  const RequestSpec a2 = w.Next();
  EXPECT_EQ(a2.turn, 2);
  EXPECT_EQ(a2.token_ids.size(), 17u + 4 + 3);
  EXPECT_FALSE(w.WantsOutput(a2));  // the last turn
  w.Finished(a2, true, out);
  EXPECT_EQ(w.ready_turns(), 0);

  w.Finished(b0, false, {});  // a failed turn ends its conversation
  EXPECT_EQ(w.ready_turns(), 0);
  EXPECT_EQ(w.Next().conversation, 2);

  // A context of 30 (a turn's prompt + 4 new tokens): after turn 0 the history is 14
  // tokens and turn 1 needs at most 14 + 3 + 4 = 21; after it 21 and 28; after turn 2,
  // 28 + 3 + 4 = 35 would not fit.
  o.turns = 4;
  o.context_length = 30;
  Workload bounded(o);
  RequestSpec t = bounded.Next();
  for (int turn = 1; turn <= 2; ++turn) {
    bounded.Finished(t, true, out);
    ASSERT_EQ(bounded.ready_turns(), 1) << turn;
    t = bounded.Next();
    EXPECT_EQ(t.turn, turn);
  }
  bounded.Finished(t, true, out);
  EXPECT_EQ(bounded.ready_turns(), 0);

  // Interpretability calls take no turn; one conversation-less workload has none.
  o.attention_share = 1;
  Workload maps(o);
  EXPECT_EQ(maps.Next().conversation, -1);
  WorkloadOptions single = o;
  single.turns = 1;
  single.attention_share = 0;
  Workload plain(single);
  const RequestSpec p = plain.Next();
  EXPECT_EQ(p.conversation, -1);
  EXPECT_FALSE(plain.WantsOutput(p));
}

TEST(WorkloadTest, FilePromptsAreUsedInTurn) {
  const std::string path = ::testing::TempDir() + "/kvlens_load_prompts.txt";
  {
    std::ofstream f(path);
    f << "In the beginning\n\nAnd God said\\nLet there be light\r\n";
  }
  auto prompts = ReadPromptsFile(path);
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  ASSERT_EQ(prompts->size(), 2u);
  EXPECT_EQ((*prompts)[1], "And God said\nLet there be light");
  WorkloadOptions o;
  o.output_tokens = {4, 4};
  o.prompts = *prompts;
  Workload w(o);
  EXPECT_EQ(w.Next().text, "In the beginning");
  EXPECT_EQ(w.Next().text, (*prompts)[1]);
  EXPECT_EQ(w.Next().text, "In the beginning");
  EXPECT_EQ(w.ToGenerateRequest(w.Next(), 1).text(), (*prompts)[1]);
  // A line that is not UTF-8 (a lone 0xff) is refused by its number and offset.
  {
    std::ofstream f(path);
    f << "In the beginning\n\nAnd God \xff said\n";
  }
  const absl::Status bad = ReadPromptsFile(path).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(),
            "--prompts-file '" + path + "' line 3 is not valid UTF-8: byte 0xff at offset 8");
  std::remove(path.c_str());
  EXPECT_FALSE(ReadPromptsFile(path).ok());
}

}  // namespace
}  // namespace kvlens::load
