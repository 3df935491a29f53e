// kvlens-cli generate's sampling and stopping flags, through the server (Generate's
// sampling.logit_bias, stopping.min_new_tokens and stopping.stop) and on the local model
// (the offline generator): --logit-bias EOS:100 makes EOS the certain next token, so where
// the output ends is known in advance; --min-new-tokens 5 holds it back until five
// tokens, which are the unbiased greedy ones (the text of --max-new-tokens 5 without
// either flag); --stop ends the text before a stop string.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

TEST(GenerateCliFlags, LogitBiasAndMinNewTokensOnTheServerAndLocally) {
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  const int32_t eos = server.model().tokenizer->eos_id();
  ASSERT_GE(eos, 0);
  const std::string certain_eos = absl::StrCat(" --logit-bias ", eos, ":100");
  for (const std::string& where :
       {absl::StrCat("--server ", server.address()), absl::StrCat("--model ", Stories260KPath())}) {
    SCOPED_TRACE(where);
    auto run = [&](const std::string& flags) {
      return RunCommand(absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " generate ", where,
                                     " --prompt 'Once upon a time' ", flags));
    };
    const auto [plain_code, plain] = run("--max-new-tokens 5");
    ASSERT_EQ(plain_code, 0) << plain;
    ASSERT_GT(plain.size(), std::string("Once upon a time\n").size());
    // Held back for five tokens, then EOS (which prints nothing): the plain text.
    const auto [late_code, late] =
        run("--max-new-tokens 12 --min-new-tokens 5 --stats 2>&1" + certain_eos);
    ASSERT_EQ(late_code, 0) << late;
    EXPECT_EQ(late.rfind(plain, 0), 0u) << late;
    EXPECT_NE(late.find("generated 6 tokens"), std::string::npos) << late;
    EXPECT_NE(late.find("finish: eos"), std::string::npos) << late;
    // Without the minimum: EOS at once.
    const auto [now_code, now] = run("--max-new-tokens 12 --stats 2>&1" + certain_eos);
    ASSERT_EQ(now_code, 0) << now;
    EXPECT_EQ(now.rfind("Once upon a time\n", 0), 0u) << now;
    EXPECT_NE(now.find("generated 1 tokens"), std::string::npos) << now;
    // --logit-bias given twice: both apply (EOS's first, which alone ends the output).
    const auto [both_code, both] =
        run("--max-new-tokens 12 --stats" + certain_eos + " --logit-bias 7:0 2>&1");
    ASSERT_EQ(both_code, 0) << both;
    EXPECT_NE(both.find("generated 1 tokens"), std::string::npos) << both;
    // --stop: the output ends before the stop string (llama2.c's reference text up to its
    // first "Lily"), the finish is "stop".
    const auto [stop_code, stopped] = run("--max-new-tokens 40 --stop Lily --stats 2>&1");
    ASSERT_EQ(stop_code, 0) << stopped;
    const std::string reference = kReferenceText;
    EXPECT_EQ(stopped.rfind(reference.substr(0, reference.find("Lily")) + "\n", 0), 0u) << stopped;
    EXPECT_NE(stopped.find("finish: stop"), std::string::npos) << stopped;
    // Given twice, each string applies (the last, zzz, never occurs).
    const auto [two_code, two] = run("--max-new-tokens 40 --stop Lily --stop zzz 2>&1");
    ASSERT_EQ(two_code, 0) << two;
    EXPECT_EQ(two.rfind(reference.substr(0, reference.find("Lily")) + "\n", 0), 0u) << two;
    // Malformed or contradictory flags: refused by name, before anything runs.
    const auto [bad_code, bad] = run("--logit-bias 7 2>&1");
    EXPECT_EQ(bad_code, 2) << bad;
    EXPECT_NE(bad.find("--logit-bias: \"7\" is not ID:BIAS"), std::string::npos) << bad;
    const auto [twice_code, twice] = run("--logit-bias 7:1,7:2 2>&1");
    EXPECT_EQ(twice_code, 2) << twice;
    EXPECT_NE(twice.find("token 7 is given twice"), std::string::npos) << twice;
    const auto [split_code, split] = run("--logit-bias 7:1 --logit-bias 7:2 2>&1");
    EXPECT_EQ(split_code, 2) << split;
    EXPECT_NE(split.find("token 7 is given twice"), std::string::npos) << split;
    const auto [min_code, min] = run("--max-new-tokens 5 --min-new-tokens 6 2>&1");
    EXPECT_EQ(min_code, 2) << min;
    EXPECT_NE(min.find("--min-new-tokens = 6 must be <= --max-new-tokens = 5"), std::string::npos)
        << min;
    // Past the vocabulary: the engine's (server's) range check, naming the token; nothing
    // on stdout (the prompt is printed with the first token).
    const auto [range_code, range] = run("--logit-bias 600:1 2>&1");
    EXPECT_EQ(range_code, 1) << range;
    EXPECT_NE(range.find("600"), std::string::npos) << range;
    const auto [quiet_code, quiet] = run("--logit-bias 600:1 2>/dev/null");
    EXPECT_EQ(quiet_code, 1) << quiet;
    EXPECT_EQ(quiet, "");
  }
}

// --logprobs N prints each generated token's log-probability and its top N (stderr), the
// RPC's entries through the server and on the local model (the offline generator's,
// GenerateResult::logprobs), positions counted from the prompt's length; then the sum.
TEST(GenerateCliFlags, LogprobsPrintTheRpcsEntries) {
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  v1::GenerateRequest r = GreedyRequest("Once upon a time", 6);
  r.set_logprobs(true);
  r.set_top_logprobs(2);
  const StreamResult want = RunGenerate(server.stub(), r);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  ASSERT_EQ(want.logprobs.size(), 6u);
  const int prompt_tokens = want.final.usage().prompt_tokens();
  for (const std::string& where :
       {absl::StrCat("--server ", server.address()), absl::StrCat("--model ", Stories260KPath())}) {
    SCOPED_TRACE(where);
    const auto [code, printed] = RunCommand(absl::StrCat(
        "timeout 60 ", KVLENS_CLI_PATH, " generate ", where,
        " --prompt 'Once upon a time' --max-new-tokens 6 --logprobs 2 2>&1 >/dev/null"));
    ASSERT_EQ(code, 0) << printed;
    const std::vector<std::string> lines = absl::StrSplit(printed, '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), want.logprobs.size() + 2) << printed;
    double sum = 0;
    for (size_t i = 0; i < want.logprobs.size(); ++i) {
      const v1::TokenLogprob& lp = want.logprobs[i];
      const std::vector<std::string> f = absl::StrSplit(lines[i + 1], '\t');
      ASSERT_EQ(f.size(), 5u) << lines[i + 1];
      EXPECT_EQ(f[0], std::to_string(prompt_tokens + static_cast<int>(i)));
      EXPECT_EQ(f[1], std::to_string(lp.token()));
      EXPECT_NEAR(std::stod(f[3]), lp.logprob(), 2e-5) << lines[i + 1];
      const std::vector<std::string> top = absl::StrSplit(f[4], "  ");
      ASSERT_EQ(top.size(), 2u) << f[4];
      EXPECT_NEAR(std::stod(top[1].substr(top[1].rfind(' ') + 1)), lp.top(1).logprob(), 2e-5);
      sum += lp.logprob();
    }
    double got_sum = 0, ppl = 0;
    int count = 0;
    ASSERT_EQ(
        std::sscanf(lines.back().c_str(), "generated: %d tokens scored, sum %lf, perplexity %lf",
                    &count, &got_sum, &ppl),
        3)
        << lines.back();
    EXPECT_EQ(count, 6);
    EXPECT_NEAR(got_sum, sum, 1e-4);
  }
}

// --frequency-penalty and --presence-penalty are Generate's sampling fields: through the
// server the CLI prints the text the C++ stub gets with those fields set, the local model
// prints the same, and the greedy text changes (the reference text repeats its tokens).
TEST(GenerateCliFlags, FrequencyAndPresencePenaltiesOnTheServerAndLocally) {
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  v1::GenerateRequest request;
  request.set_text("Once upon a time");
  request.mutable_stopping()->set_max_new_tokens(40);
  request.mutable_sampling()->set_frequency_penalty(0.5);
  request.mutable_sampling()->set_presence_penalty(1.5);
  const StreamResult penalized = RunGenerate(server.stub(), request);
  ASSERT_TRUE(penalized.status.ok()) << penalized.status.error_message();
  const std::string want = "Once upon a time" + penalized.text + "\n";
  EXPECT_NE(want, std::string(kReferenceText).substr(0, want.size() - 1) + "\n");
  for (const std::string& where :
       {absl::StrCat("--server ", server.address()), absl::StrCat("--model ", Stories260KPath())}) {
    const auto [code, out] = RunCommand(
        absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " generate ", where,
                     " --prompt 'Once upon a time' --max-new-tokens 40 --frequency-penalty 0.5 "
                     "--presence-penalty 1.5"));
    ASSERT_EQ(code, 0) << where << "\n" << out;
    EXPECT_EQ(out, want) << where;
    const auto [bad_code, bad] = RunCommand(absl::StrCat(
        KVLENS_CLI_PATH, " generate ", where, " --prompt x --presence-penalty 2.5 2>&1"));
    EXPECT_EQ(bad_code, 2) << bad;
    EXPECT_NE(bad.find("--presence-penalty = '2.5' must be a number in [-2, 2]"), std::string::npos)
        << bad;
  }
}

// Text that is not UTF-8 (printf's octal escapes: a lone 0xff, a truncated 3-byte
// sequence) is refused before it is sent, naming the request field, with exit code 2 and
// nothing on stdout; left to protobuf, the server's parse fails and gRPC answers
// UNIMPLEMENTED with an empty message. The server still answers the same flags in UTF-8.
TEST(GenerateCliFlags, TextThatIsNotUtf8IsRefusedNamingTheField) {
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  const std::string cli = absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " ");
  const std::string at = absl::StrCat(" --server ", server.address());
  struct Case {
    std::string args;
    std::string message;
  };
  const Case cases[] = {
      {"generate --prompt \"$(printf 'ab\\377')\"",
       "kvlens-cli generate: text is not valid UTF-8: byte 0xff at offset 2"},
      {"generate --prompt Once --stop x --stop \"$(printf 'y\\342\\234')\"",
       "kvlens-cli generate: stopping.stop[1] is not valid UTF-8: byte 0xe2 at offset 1"},
      {"attention --text \"$(printf '\\377')\"",
       "kvlens-cli attention: input.text is not valid UTF-8: byte 0xff at offset 0"},
  };
  for (const Case& c : cases) {
    const auto [code, out] = RunCommand(cli + c.args + at + " 2>/dev/null");
    EXPECT_EQ(code, 2) << c.args;
    EXPECT_EQ(out, "") << c.args;
    const auto [err_code, err] = RunCommand(cli + c.args + at + " 2>&1");
    EXPECT_NE(err.find(c.message), std::string::npos) << err;
  }
  const auto [ok_code, ok] =
      RunCommand(cli + "generate --prompt \"$(printf 'Once \\342\\234\\223')\"" + at +
                 " --max-new-tokens 2 2>&1");
  EXPECT_EQ(ok_code, 0) << ok;
  EXPECT_EQ(ok.rfind("Once \xe2\x9c\x93", 0), 0u) << ok;
}

}  // namespace
}  // namespace kvlens::testing
