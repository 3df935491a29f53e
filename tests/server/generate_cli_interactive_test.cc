// kvlens-cli generate --server --interactive: a conversation read from stdin. Each turn's
// reply is the C++ stub's Generate of the whole conversation so far (the earlier replies
// as the assistant's turns) in the model's chat template; the second turn finds the
// first's blocks in the prefix cache; "/reset" forgets the turns (the third reply, to the
// first question again, is the first reply); a refused turn (text that is not UTF-8) is
// dropped and the conversation goes on; a local model file holds the same conversation,
// its second turn also computing only what the first did not.
// The model is stories260K with a ChatML
// template written into its GGUF (as the Python client's chat test).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "server/request_convert.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

// The reply the server gives to `messages` ((role, content) pairs), 6 greedy tokens, with
// `steering` if any.
std::string Reply(TestServer& server, const std::vector<std::pair<std::string, std::string>>& m,
                  const std::vector<v1::SteeringVector>& steering = {}) {
  v1::GenerateRequest request;
  for (const v1::SteeringVector& s : steering) *request.add_steering() = s;
  for (const auto& [role, content] : m) {
    v1::ChatMessage* message = request.mutable_chat()->add_messages();
    message->set_role(role);
    message->set_content(content);
  }
  request.mutable_stopping()->set_max_new_tokens(6);
  const StreamResult r = RunGenerate(server.stub(), request);
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  return r.text;
}

// A server on the chat model, whose file the tests also load locally.
class GenerateCliInteractive : public ::testing::Test {
 protected:
  void SetUp() override {
    KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));
    ASSERT_TRUE(OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
    path_ = MakeChatMlModel();
    ASSERT_FALSE(path_.empty()) << "tests/oracle/make_quantized_gguf.py failed";
    server_ = std::make_unique<TestServer>(path_, TestServer::DefaultOptions());
    ASSERT_TRUE(server_->ok()) << server_->error();
  }
  void TearDown() override {
    if (!path_.empty()) std::remove(path_.c_str());
  }
  std::string path_;
  std::unique_ptr<TestServer> server_;
};

TEST_F(GenerateCliInteractive, EachTurnIsTheWholeConversationsReply) {
  TestServer& server = *server_;
  const std::string& path = path_;

  const std::string input =
      "printf 'Tell me a story\\n\\377\\nWhat did Lily do?\\n/reset\\n\\nTell me a story\\n' | ";
  const std::string flags = " --interactive --system 'Be kind.' --max-new-tokens 6 ";
  const std::string stats = ::testing::TempDir() + "kvlens_interactive_stats.txt";
  const auto [code, out] =
      RunCommand(absl::StrCat(input, "timeout 60 ", KVLENS_CLI_PATH, " generate --server ",
                              server.address(), flags, "--stats 2>", stats));
  EXPECT_EQ(code, 2) << out;  // the refused turn's
  const auto [cat_code, stderr_text] = RunCommand("cat " + stats);
  std::remove(stats.c_str());

  const std::string first = Reply(server, {{"system", "Be kind."}, {"user", "Tell me a story"}});
  const std::string second = Reply(server, {{"system", "Be kind."},
                                            {"user", "Tell me a story"},
                                            {"assistant", first},
                                            {"user", "What did Lily do?"}});
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(out, absl::StrCat(first, "\n", second, "\n", first, "\n"));
  // One stats line a turn, the refused one's error in its place: the second turn's prompt
  // starts with the first's, cached.
  const std::vector<std::string> lines = absl::StrSplit(stderr_text, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u) << stderr_text;
  EXPECT_NE(lines[0].find("(0 cached)"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("chat.messages[3].content is not valid UTF-8: byte 0xff"),
            std::string::npos)
      << lines[1];
  EXPECT_EQ(lines[2].find("(0 cached)"), std::string::npos) << lines[2];
  EXPECT_NE(lines[2].find(" cached)"), std::string::npos) << lines[2];

  // The same conversation on the local model file (which takes any bytes: the line that
  // is not UTF-8 left out): the same replies, the second turn's prompt starting with what
  // the generator's kept cache holds of the first (GenerateCache).
  const auto [local_code, local] = RunCommand(absl::StrCat(
      "printf 'Tell me a story\\nWhat did Lily do?\\n/reset\\nTell me a story\\n' | timeout 60 ",
      KVLENS_CLI_PATH, " generate --model ", path, flags, "--stats 2>", stats));
  const auto [local_cat_code, local_stats] = RunCommand("cat " + stats);
  std::remove(stats.c_str());
  EXPECT_EQ(local_code, 0) << local;
  EXPECT_EQ(local, out);
  const std::vector<std::string> local_lines = absl::StrSplit(local_stats, '\n', absl::SkipEmpty());
  ASSERT_EQ(local_lines.size(), 3u) << local_stats;
  EXPECT_NE(local_lines[0].find("(0 cached)"), std::string::npos) << local_lines[0];
  EXPECT_EQ(local_lines[1].find("(0 cached)"), std::string::npos) << local_lines[1];
  EXPECT_NE(local_lines[1].find(" cached)"), std::string::npos) << local_lines[1];
  // Without a chat template the conversation cannot be written: refused before the first
  // turn, locally and by a server.
  const auto [plain_code, plain] = RunCommand(absl::StrCat(
      "echo hi | ", KVLENS_CLI_PATH, " generate --model ", Stories260KPath(), flags, "2>&1"));
  EXPECT_EQ(plain_code, 2) << plain;
  EXPECT_NE(plain.find("chat template is missing"), std::string::npos) << plain;
  TestServer no_template;
  ASSERT_TRUE(no_template.ok()) << no_template.error();
  const auto [remote_code, remote] =
      RunCommand(absl::StrCat("printf 'hi\\nhello\\n' | ", KVLENS_CLI_PATH, " generate --server ",
                              no_template.address(), flags, "2>&1"));
  EXPECT_EQ(remote_code, 2) << remote;
  EXPECT_EQ(remote,
            "kvlens-cli generate: --interactive: the server's model has no chat template "
            "(GetModelInfo.chat_template); start kvlens-server with --chat-template\n");
}

// --steer with a start from the prompt's end (@-1: every generated token) on a local
// conversation: each turn's reply is the server's to the same conversation with the same
// start_position -1, which the server resolves against that turn's prompt. The start moves
// with each turn, so the second turn takes from the kept cache only the rows before the
// first turn's steered ones: its prompt's first P1 − 1 tokens.
TEST_F(GenerateCliInteractive, SteeringFromThePromptsEndMovesWithEachTurn) {
  TestServer& server = *server_;
  const std::string& path = path_;
  const int D = static_cast<int>(server.model().config.dim);
  v1::SteeringVector steer;
  steer.set_hook("blocks.0.hook_resid_post");
  std::string numbers;
  for (int i = 0; i < D; ++i) {
    steer.add_vector(0.5f * static_cast<float>(i % 5) - 1.0f);
    absl::StrAppend(&numbers, steer.vector(i), " ");
  }
  steer.set_coefficient(4.0f);
  steer.set_start_position(-1);
  const std::string file = ::testing::TempDir() + "kvlens_interactive_steer.txt";
  const std::string stats = ::testing::TempDir() + "kvlens_interactive_steer_stats.txt";
  ASSERT_EQ(RunCommand(absl::StrCat("printf '%s' '", numbers, "' > ", file)).first, 0);
  const auto [code, out] = RunCommand(absl::StrCat(
      "printf 'Tell me a story\nWhat did Lily do?\n' | timeout 60 ", KVLENS_CLI_PATH,
      " generate --model ", path, " --interactive --max-new-tokens 6 --stats --steer '",
      steer.hook(), ":", file, ":4@-1' 2>", stats));
  const auto [cat_code, stats_text] = RunCommand("cat " + stats);
  // A start before the prompt is refused naming the spec and the prompt's length.
  const auto [bad_code, bad] = RunCommand(absl::StrCat(KVLENS_CLI_PATH, " generate --model ", path,
                                                       " --prompt hi --max-new-tokens 2 --steer '",
                                                       steer.hook(), ":", file, ":4@-99' 2>&1"));
  std::remove(file.c_str());
  std::remove(stats.c_str());
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(bad_code, 2) << bad;
  EXPECT_NE(bad.find("@-99\": start = -99 must be >= -"), std::string::npos) << bad;

  const std::string first = Reply(server, {{"user", "Tell me a story"}}, {steer});
  const std::string second = Reply(
      server, {{"user", "Tell me a story"}, {"assistant", first}, {"user", "What did Lily do?"}},
      {steer});
  ASSERT_FALSE(first.empty());
  EXPECT_NE(first, Reply(server, {{"user", "Tell me a story"}}));  // the steering steers
  EXPECT_EQ(out, absl::StrCat(first, "\n", second, "\n"));
  v1::ChatPrompt chat;
  v1::ChatMessage* m = chat.add_messages();
  m->set_role("user");
  m->set_content("Tell me a story");
  const auto p1 = server::EncodeChat(server.model(), chat, std::nullopt, "chat");
  ASSERT_TRUE(p1.ok()) << p1.status();
  const std::vector<std::string> lines = absl::StrSplit(stats_text, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << stats_text;
  EXPECT_NE(lines[0].find("(0 cached)"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find(absl::StrCat("(", p1->size() - 1, " cached)")), std::string::npos)
      << lines[1];
}

}  // namespace
}  // namespace kvlens::testing
