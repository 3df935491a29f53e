// Chat templates against llama.cpp's: every test case of its tests/test-chat-template.cpp
// (testdata/chat_template_vectors.json, written by make_chat_template_vectors.py) is a real
// model's Jinja template with the text llama.cpp's built-in formatter writes for one
// conversation. DetectChatFormat must name the family (or none, for the families kvlens
// does not write) and ApplyChatTemplate must write that text byte for byte.
#include "engine/tokenizer/chat_template.h"

#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

// llama.cpp's test conversation.
const std::vector<ChatMessage> kConversation = {
    {"system", "You are a helpful assistant"},
    {"user", "Hello"},
    {"assistant", "Hi there"},
    {"user", "Who are you"},
    {"assistant", "   I am an assistant   "},
    {"user", "Another question"},
};

TEST(ChatTemplateTest, WritesLlamaCppsTextForEveryFamilyItKnows) {
  std::ifstream in(
      testing::SourcePath("tests/engine/tokenizer/testdata/chat_template_vectors.json"));
  ASSERT_TRUE(in) << "chat_template_vectors.json missing";
  const nlohmann::json vectors = nlohmann::json::parse(in)["vectors"];
  int known = 0, unknown = 0;
  for (const auto& v : vectors) {
    const std::string name = v["name"];
    absl::StatusOr<ChatFormat> f = DetectChatFormat(v["template"].get<std::string>());
    if (v["format"].is_null()) {
      EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound)
          << name << " detected as " << (f.ok() ? ChatFormatName(*f) : "");
      ++unknown;
      continue;
    }
    ASSERT_TRUE(f.ok()) << name << ": " << f.status();
    EXPECT_EQ(ChatFormatName(*f), v["format"].get<std::string>()) << name;
    absl::StatusOr<std::string> text = ApplyChatTemplate(*f, kConversation, true);
    ASSERT_TRUE(text.ok()) << name << ": " << text.status();
    EXPECT_EQ(*text, v["expected"].get<std::string>()) << name;
    ++known;
  }
  EXPECT_EQ(known, 21);
  EXPECT_EQ(unknown, 12);
}

TEST(ChatTemplateTest, NamesRoundTripAndUnknownOnesAreRefused) {
  for (const std::string_view n : {"chatml", "llama3", "mistral-v7", "gemma", "phi3"}) {
    absl::StatusOr<ChatFormat> f = ChatFormatByName(n);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(ChatFormatName(*f), n);
  }
  const absl::StatusOr<ChatFormat> bad = ChatFormatByName("jinja");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("\"jinja\" is not one of chatml, llama3"),
            std::string::npos)
      << bad.status();
  EXPECT_EQ(DetectChatFormat("").status().code(), absl::StatusCode::kNotFound);
}

// By hand: without the generation prompt a ChatML conversation ends after its last message;
// a Llama 3 one trims each message; Gemma folds a system message into the next user turn.
TEST(ChatTemplateTest, GenerationPromptAndFoldingByHand) {
  const std::vector<ChatMessage> two = {{"system", "Be brief."}, {"user", " Hi "}};
  EXPECT_EQ(*ApplyChatTemplate(ChatFormat::kChatMl, two, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n");
  EXPECT_EQ(*ApplyChatTemplate(ChatFormat::kLlama3, two, true),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(*ApplyChatTemplate(ChatFormat::kGemma, two, true),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n");
  // The [INST] families end a user turn with [/INST]: no generation prompt to add.
  EXPECT_EQ(*ApplyChatTemplate(ChatFormat::kMistralV7, two, true),
            "[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST]  Hi [/INST]");
}

TEST(ChatTemplateTest, RefusesNoMessagesAndOtherRoles) {
  const absl::StatusOr<std::string> none = ApplyChatTemplate(ChatFormat::kChatMl, {}, true);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<ChatMessage> tool = {{"user", "x"}, {"tool", "{}"}};
  const absl::StatusOr<std::string> bad = ApplyChatTemplate(ChatFormat::kChatMl, tool, true);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("messages[1].role: \"tool\""), std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace kvlens
