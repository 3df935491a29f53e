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
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

// The reply the server gives to `messages` ((role, content) pairs), 6 greedy tokens.
std::string Reply(TestServer& server, const std::vector<std::pair<std::string, std::string>>& m) {
  v1::GenerateRequest request;
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

TEST(GenerateCliInteractive, EachTurnIsTheWholeConversationsReply) {
  KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));
  ASSERT_TRUE(OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = MakeChatMlModel();
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  TestServer server(path, TestServer::DefaultOptions());
  ASSERT_TRUE(server.ok()) << server.error();

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
  std::remove(path.c_str());
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

}  // namespace
}  // namespace kvlens::testing
