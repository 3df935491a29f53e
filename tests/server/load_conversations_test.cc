// kvlens-load --turns against a live server (stories260K, blocks of 16, one stream): two
// conversations of three turns, each turn's prompt the previous prompt, its 8 generated
// tokens and 10 new ones. The server's prefix cache then holds each turn's full blocks for
// the next, so the report's cached tokens are what the block rules give by hand: a turn
// of prompt P computes P + 7 positions (the last generated token is drawn, never run),
// and the next turn finds floor((P + 7) / 16) blocks. Turn 0: 40 tokens, none cached;
// turn 1: 58, with 47 computed before: 2 blocks (32); turn 2: 76, with 65: 4 blocks (64).
// Two conversations: 2 × (32 + 64) = 192 of 2 × (40 + 58 + 76) = 348 prompt tokens.
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

TEST(LoadConversations, EachTurnFindsThePreviousTurnsBlocksCached) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  const LoadRun run =
      RunLoad(server.address(),
              "--mode closed --concurrency 1 --requests 6 --turns 3 --prompt-tokens 40 "
              "--output-tokens 8 --turn-tokens 10 --seed 5 --metrics none --progress=false");
  ASSERT_EQ(run.code, 0) << run.output;
  const nlohmann::json report = nlohmann::json::parse(run.report);
  EXPECT_EQ(report["requests"]["ok"], 6) << report.dump(2);
  EXPECT_EQ(report["tokens"]["prompt"], 2 * (40 + 58 + 76)) << report.dump(2);
  EXPECT_EQ(report["tokens"]["cached"], 2 * (32 + 64)) << report.dump(2);
  EXPECT_EQ(report["tokens"]["output"], 6 * 8) << report.dump(2);
  EXPECT_EQ(report["config"]["turns"], 3);

  // Conversations need synthetic prompts.
  const auto [bad_code, bad] =
      RunCommand(absl::StrCat(KVLENS_LOAD_PATH, " --turns 2 --prompts-file /dev/null --server ",
                              server.address(), " 2>&1"));
  EXPECT_EQ(bad_code, 2) << bad;
  EXPECT_NE(bad.find("--turns > 1 needs synthetic prompts (not --prompts-file)"), std::string::npos)
      << bad;
}

}  // namespace
}  // namespace kvlens::testing
