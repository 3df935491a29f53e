// kvlens-cli perplexity end to end. The default model's held-out perplexity is a number
// PyTorch computed when the model was trained (models/kjv-gpt2-4l/training_log.json,
// "heldout_loss": the mean cross-entropy over every window of 256 + 1 held-out tokens);
// kvlens must reproduce it from the same text.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/clients/cli/run_cli.h"

namespace kvlens {
namespace {

using testing::RunCli;
using testing::RunResult;

std::string DefaultModel() { return std::string(KVLENS_SOURCE_DIR) + "/models/kjv-gpt2-4l"; }

TEST(PerplexityCliTest, ReproducesTheDefaultModelsHeldOutLossFromTraining) {
  if (std::system("command -v bible >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "the `bible` program (Debian bible-kjv) is missing: run "
                    "scripts/install-deps.sh";
  }
  std::ifstream log_file(DefaultModel() + "/training_log.json");
  ASSERT_TRUE(log_file) << "no training_log.json in " << DefaultModel();
  const nlohmann::json log = nlohmann::json::parse(log_file);
  const double want_loss = log.at("heldout_loss").get<double>();
  const int64_t want_tokens = log.at("heldout_tokens_evaluated").get<int64_t>();

  const std::string text = "/tmp/kvlens_kjv_heldout_" + std::to_string(::getpid()) + ".txt";
  ASSERT_EQ(std::system(("/usr/bin/python3 " + std::string(KVLENS_SOURCE_DIR) +
                         "/models/kjv_heldout_text.py > " + text)
                            .c_str()),
            0);
  const RunResult r =
      RunCli("perplexity --model " + DefaultModel() + " --file " + text + " --no-bos --json");
  std::remove(text.c_str());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json got = nlohmann::json::parse(r.out);
  EXPECT_EQ(got.at("ctx").get<int>(), 256);  // the model's context length
  EXPECT_EQ(got.at("windows").get<int>(), 199);
  EXPECT_EQ(got.at("tokens").get<int64_t>(), want_tokens);
  // Training evaluated in float32 PyTorch; kvlens' fp32 path sums in another order.
  EXPECT_NEAR(got.at("mean_nll").get<double>(), want_loss, 1e-5);
  EXPECT_NEAR(got.at("perplexity").get<double>(), std::exp(want_loss), 1e-3);
}

TEST(PerplexityCliTest, BadInputNamesTheFlagOrTheLimit) {
  const std::string text = "/tmp/kvlens_ppl_short_" + std::to_string(::getpid()) + ".txt";
  std::ofstream(text) << "And God said";
  const std::string base = "perplexity --model " + DefaultModel() + " --file " + text;
  RunResult r = RunCli(base + " --ctx 300 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--ctx 300 is more than the model's context length 256"), std::string::npos)
      << r.out;
  r = RunCli(base + " 2>&1");  // a few tokens: less than one window of 256 + 1
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("a context of 256 needs at least 257"), std::string::npos) << r.out;
  r = RunCli(base + " --ctx 2 --json");  // short windows score it
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("\"scoring\":\"all\""), std::string::npos) << r.out;
  r = RunCli(base + " --scoring llama 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--scoring must be all or second-half, got \"llama\""), std::string::npos)
      << r.out;
  r = RunCli(base + " --scoring second-half --ctx 2 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("context = 2 must be at least 3"), std::string::npos) << r.out;
  r = RunCli(base + " --scoring second-half --ctx 3 --json");  // 3 tokens a window, 1 scored
  EXPECT_EQ(r.exit_code, 0) << r.out;
  if (r.exit_code == 0) {
    const nlohmann::json got = nlohmann::json::parse(r.out);
    EXPECT_EQ(got.at("scoring").get<std::string>(), "second-half");
    EXPECT_EQ(got.at("windows").get<int>(), got.at("text_tokens").get<int>() / 3);
    EXPECT_EQ(got.at("tokens").get<int>(), got.at("windows").get<int>());
  }
  std::remove(text.c_str());
  r = RunCli("perplexity --model " + DefaultModel() + " 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--file is required"), std::string::npos) << r.out;
  r = RunCli("perplexity --model " + DefaultModel() + " --file /nonexistent.txt 2>&1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("cannot read --file /nonexistent.txt"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace kvlens
