#include "engine/model/generation_config.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvlens {
namespace {

class GenerationConfigTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& text) {
    std::ofstream(path_) << text;
    return path_;
  }
  void TearDown() override { std::remove(path_.c_str()); }
  std::string path_ = absl::StrCat(::testing::TempDir(), "/generation_config_", getpid(), ".json");
};

TEST_F(GenerationConfigTest, AbsentFileIsEmpty) {
  auto c = ReadGenerationConfig(path_ + ".missing");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->repetition_penalty.has_value());
}

TEST_F(GenerationConfigTest, ReadsRepetitionPenaltyAndIgnoresOtherKeys) {
  auto c = ReadGenerationConfig(Write(
      R"({"bos_token_id": 3, "eos_token_id": [3, 4], "do_sample": true, "temperature": 0.7,
          "repetition_penalty": 1.3, "transformers_version": "4.40.0"})"));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->repetition_penalty.has_value());
  EXPECT_EQ(*c->repetition_penalty, 1.3);
  auto none = ReadGenerationConfig(Write(R"({"repetition_penalty": null})"));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->repetition_penalty.has_value());
}

TEST_F(GenerationConfigTest, ErrorsNameTheFieldAndTheRange) {
  for (const char* bad : {R"({"repetition_penalty": 0})", R"({"repetition_penalty": 10.5})",
                          R"({"repetition_penalty": -1})", R"({"repetition_penalty": "1.2"})"}) {
    auto c = ReadGenerationConfig(Write(bad));
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("repetition_penalty"), std::string::npos) << c.status();
    EXPECT_NE(c.status().message().find("(0, 10]"), std::string::npos) << c.status();
    EXPECT_NE(c.status().message().find(path_), std::string::npos) << c.status();
  }
  for (const char* bad : {"{", "[1, 2]", "not json"}) {
    auto c = ReadGenerationConfig(Write(bad));
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(path_), std::string::npos) << c.status();
  }
}

}  // namespace
}  // namespace kvlens
