// kvlens-cli's flag parser: both value forms, switches, repeated flags, '_' for '-', and
// errors that name the flag (an unknown one with the flag it is nearest to, by edits).
#include "clients/cli/args.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::cli {
namespace {

const std::vector<FlagSpec> kSpecs = {
    {"server", "", "address"},  {"text", "", "prompt"},       {"max-new-tokens", "64", "count"},
    {"stop", "", "repeatable"}, {"fp16", "", "switch", true},
};

absl::StatusOr<Args> Parse(std::vector<std::string> words) {
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  return Args::Parse(static_cast<int>(argv.size()), argv.data(), 0, kSpecs);
}

TEST(ArgsTest, ValuesSwitchesAndRepeats) {
  absl::StatusOr<Args> a =
      Parse({"--server", "h:1", "--max_new_tokens=7", "--stop", "a", "--stop=b", "--fp16"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->Str("server"), "h:1");
  EXPECT_EQ(*a->Int("max-new-tokens", 1, 10), 7);  // given as --max_new_tokens
  EXPECT_TRUE(a->Has("max-new-tokens"));
  EXPECT_EQ(a->All("stop"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(a->Str("stop"), "b");
  EXPECT_TRUE(a->Switch("fp16"));
  EXPECT_FALSE(a->Has("text"));
  absl::StatusOr<Args> d = Parse({});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d->Int("max-new-tokens", 1, 100), 64);
  EXPECT_FALSE(d->Switch("fp16"));
  EXPECT_EQ(d->Int("max-new-tokens", 1, 10).status().message(),
            "--max-new-tokens = '64' must be an integer in [1, 10]");
}

TEST(ArgsTest, ErrorsNameTheFlag) {
  struct Case {
    std::vector<std::string> words;
    std::string message;
  };
  const Case cases[] = {
      {{"--max-new-token", "3"}, "unknown flag --max-new-token; did you mean --max-new-tokens?"},
      {{"--severs=x"}, "unknown flag --severs; did you mean --server?"},
      {{"--prompt", "hi"},
       "unknown flag --prompt; this command takes --server --text --max-new-tokens --stop "
       "--fp16 (see --help)"},
      {{"--text"}, "--text needs a value"},
      {{"--fp16=yes"}, "--fp16 takes true or false"},
      {{"loose"}, "unexpected argument 'loose'"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Args> a = Parse(c.words);
    ASSERT_FALSE(a.ok()) << c.message;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(a.status().message(), c.message);
  }
}

}  // namespace
}  // namespace kvlens::cli
