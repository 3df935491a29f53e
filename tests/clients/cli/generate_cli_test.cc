// End to end through the kvlens-cli binary: greedy generation on stories260K reproduces
// the reference text of llama2.c's run.c (../shared/testdata/README.md) word for word,
// from both the GGUF file and the llama2.c checkpoint.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "tests/clients/cli/run_cli.h"
#include "tests/linked_model_dir.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

using testing::RunCli;
using testing::RunResult;
using testing::TestData;

int CountTokens(const std::string& ids_line) {
  std::istringstream in(ids_line);
  int n = 0;
  std::string tok;
  while (in >> tok) ++n;
  return n;
}

// run.c's 64 steps are positions 0…63; each prints the token after it, so the prompt
// (BOS + n tokens) leaves 64 − n = 65 − prompt_tokens generated tokens.
constexpr char kReference64[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high.\n"
    "Lily";

void ExpectReferenceText(const std::string& model_flags) {
  const RunResult tok = RunCli("tokenize " + model_flags + " --bos --text 'Once upon a time'");
  ASSERT_EQ(tok.exit_code, 0);
  const int prompt_tokens = CountTokens(tok.out);
  ASSERT_GT(prompt_tokens, 1);
  for (const char* precision : {"fp32", "fp64"}) {
    const RunResult gen =
        RunCli("generate " + model_flags + " --prompt 'Once upon a time' " + "--max-new-tokens " +
               std::to_string(65 - prompt_tokens) + " --precision " + precision);
    ASSERT_EQ(gen.exit_code, 0);
    EXPECT_EQ(gen.out, std::string(kReference64) + "\n") << precision;
  }
}

TEST(GenerateCliTest, StoriesGgufReproducesRunC) {
  const std::string gguf = TestData("stories260K/stories260K.gguf");
  KVLENS_REQUIRE_FILE(gguf);
  ExpectReferenceText("--model " + gguf);
}

TEST(GenerateCliTest, StoriesLlama2cReproducesRunC) {
  const std::string bin = TestData("stories260K/stories260K.bin");
  KVLENS_REQUIRE_FILE(bin);
  ExpectReferenceText("--model " + bin + " --tokenizer " + TestData("stories260K/tok512.bin"));
}

TEST(GenerateCliTest, GenerationConfigRepetitionPenaltyIsTheDefault) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  testing::LinkedModelDir dir(testing::DefaultModelPath(),
                              {{"generation_config.json", R"({"repetition_penalty": 1.3})"}});
  const std::string base =
      "generate --model " + dir.path() + " --prompt 'And God said' --max-new-tokens 40 ";
  const RunResult unset = RunCli(base), explicit_13 = RunCli(base + "--repetition-penalty 1.3"),
                  off = RunCli(base + "--repetition-penalty 1");
  ASSERT_EQ(unset.exit_code, 0);
  ASSERT_EQ(explicit_13.exit_code, 0);
  ASSERT_EQ(off.exit_code, 0);
  EXPECT_EQ(unset.out, explicit_13.out);
  EXPECT_NE(unset.out, off.out);  // the penalty changes this greedy text
}

TEST(GenerateCliTest, DeviceCudaWithoutAGpuIsAClearError) {
  if (kernels::CreateBackend({kernels::DeviceSpec::Kind::kCuda, 0}, 1).ok()) {
    GTEST_SKIP() << "a CUDA device is present";
  }
  // Fails before the model loads: no model file is needed.
  RunResult r = RunCli("generate --model /nonexistent.gguf --prompt x --device cuda:0 2>&1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_EQ(r.out.rfind("kvlens-cli generate: --device cuda:0: ", 0), 0u) << r.out;
  EXPECT_TRUE(r.out.find("no CUDA support (configure with -DKVLENS_CUDA=ON)") !=
                  std::string::npos ||
              r.out.find("CUDA device") != std::string::npos)
      << r.out;
}

// --chat writes --system and --prompt as the chat template does and prints only the reply:
// with --chat-template chatml on stories260K (whose GGUF has no template) the reply is the
// completion of the same conversation written out by hand as a text prompt. Without a
// template, --chat is refused naming --chat-template; an unknown name is refused listing
// the known ones.
TEST(GenerateCliTest, ChatWritesTheConversationInTheTemplate) {
  const std::string gguf = TestData("stories260K/stories260K.gguf");
  const std::string text =
      "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nOnce upon a "
      "time<|im_end|>\n<|im_start|>assistant\n";
  // (sh keeps the newlines inside single quotes.)
  const RunResult plain =
      RunCli("generate --model " + gguf + " --max-new-tokens 12 --prompt '" + text + "'");
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  ASSERT_EQ(plain.out.substr(0, text.size()), text);
  const RunResult chat =
      RunCli("generate --model " + gguf +
             " --max-new-tokens 12 --chat --chat-template chatml --system 'Be kind.' "
             "--prompt 'Once upon a time'");
  ASSERT_EQ(chat.exit_code, 0) << chat.out;
  EXPECT_EQ(chat.out, plain.out.substr(text.size()));
  RunResult r = RunCli("generate --model " + gguf + " --chat --prompt x 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--chat-template"), std::string::npos) << r.out;
  r = RunCli("generate --model " + gguf + " --chat --chat-template jinja --prompt x 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("\"jinja\" is not one of chatml, llama3"), std::string::npos) << r.out;
}

TEST(GenerateCliTest, DeviceBogusIsRejectedNamingTheFlag) {
  RunResult r = RunCli("generate --model /nonexistent.gguf --prompt x --device bogus 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--device: device \"bogus\" is not one of cpu, cuda, cuda:N"),
            std::string::npos)
      << r.out;
  r = RunCli("generate --model /nonexistent.gguf --prompt x --device cuda --precision fp64 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--precision fp64 runs on the CPU only"), std::string::npos) << r.out;
}

// --int8-activations: named in --stats; float weights ignore it (stories260K is f32), so
// the text is the exact path's; fp64 and CUDA refuse it by name.
TEST(GenerateCliTest, Int8ActivationsLeaveFloatWeightsAloneAndNameTheirLimits) {
  const std::string gguf = TestData("stories260K/stories260K.gguf");
  KVLENS_REQUIRE_FILE(gguf);
  const std::string base =
      "generate --model " + gguf + " --prompt 'Once upon a time' --max-new-tokens 30";
  const RunResult exact = RunCli(base);
  const RunResult int8 = RunCli(base + " --int8-activations --stats 2>/tmp/kvlens_int8_stats.txt");
  ASSERT_EQ(exact.exit_code, 0);
  ASSERT_EQ(int8.exit_code, 0);
  EXPECT_EQ(int8.out, exact.out);
  std::ifstream stats("/tmp/kvlens_int8_stats.txt");
  const std::string line((std::istreambuf_iterator<char>(stats)), std::istreambuf_iterator<char>());
  std::remove("/tmp/kvlens_int8_stats.txt");
  EXPECT_NE(line.find("backend cpu-f32 (int8 activations for quantised weights)"),
            std::string::npos)
      << line;
  for (const char* bad : {" --precision fp64", " --device cuda"}) {
    const RunResult r = RunCli(base + " --int8-activations" + bad + " 2>&1");
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.out;
    EXPECT_NE(r.out.find("--int8-activations applies to --device cpu with --precision fp32"),
              std::string::npos)
        << r.out;
  }
}

// --attention-tensor-cores is a CUDA option: the CPU paths refuse it by name.
TEST(GenerateCliTest, TensorCoreAttentionOnCpuIsRefusedByName) {
  for (const char* precision : {"fp32", "fp64"}) {
    const RunResult r =
        RunCli(std::string("generate --model /nonexistent.gguf --prompt x --precision ") +
               precision + " --attention-tensor-cores 2>&1");
    EXPECT_EQ(r.exit_code, 2) << precision << ": " << r.out;
    EXPECT_NE(r.out.find("--attention-tensor-cores applies to --device cuda"), std::string::npos)
        << r.out;
  }
}

// --programmatic-launches likewise.
TEST(GenerateCliTest, ProgrammaticLaunchesOnCpuAreRefusedByName) {
  for (const char* precision : {"fp32", "fp64"}) {
    const RunResult r =
        RunCli(std::string("generate --model /nonexistent.gguf --prompt x --precision ") +
               precision + " --programmatic-launches 2>&1");
    EXPECT_EQ(r.exit_code, 2) << precision << ": " << r.out;
    EXPECT_NE(r.out.find("--programmatic-launches applies to --device cuda"), std::string::npos)
        << r.out;
  }
}

// --attention-tune likewise, and beside --attention-tensor-cores (which it would
// overrule) it is refused before any device starts.
TEST(GenerateCliTest, AttentionTuningOnCpuIsRefusedByName) {
  for (const char* command : {"generate --prompt x", "perplexity --file /dev/null"}) {
    for (const char* precision : {"fp32", "fp64"}) {
      const RunResult r = RunCli(std::string(command) + " --model /nonexistent.gguf --precision " +
                                 precision + " --attention-tune 2>&1");
      EXPECT_EQ(r.exit_code, 2) << command << " " << precision << ": " << r.out;
      EXPECT_NE(r.out.find("--attention-tune applies to --device cuda"), std::string::npos)
          << r.out;
    }
  }
  const RunResult both = RunCli(
      "generate --model /nonexistent.gguf --prompt x --device cuda --attention-tune "
      "--attention-tensor-cores 2>&1");
  EXPECT_EQ(both.exit_code, 2) << both.out;
  EXPECT_NE(both.out.find("--attention-tune chooses decode attention's kernel itself"),
            std::string::npos)
      << both.out;
}

// --kv-cache-dtype bf16: the fp32 path and the double reference, both on a bf16 cache,
// generate the same greedy text; an unknown type is named.
TEST(GenerateCliTest, Bf16KvCacheFp32AndFp64Agree) {
  const std::string gguf = TestData("stories260K/stories260K.gguf");
  KVLENS_REQUIRE_FILE(gguf);
  const std::string base = "generate --model " + gguf +
                           " --prompt 'Once upon a time' --max-new-tokens 40 --kv-cache-dtype bf16";
  const RunResult fp32 = RunCli(base), fp64 = RunCli(base + " --precision fp64");
  ASSERT_EQ(fp32.exit_code, 0);
  ASSERT_EQ(fp64.exit_code, 0);
  EXPECT_EQ(fp32.out, fp64.out);
  EXPECT_EQ(fp32.out.rfind("Once upon a time", 0), 0u) << fp32.out;
  const RunResult bad =
      RunCli("generate --model " + gguf + " --prompt x --kv-cache-dtype fp8 2>&1");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  EXPECT_NE(bad.out.find("--kv-cache-dtype: kv_cache_dtype: unknown type \"fp8\""),
            std::string::npos)
      << bad.out;
}

TEST(GenerateCliTest, BadFlagsNameTheFlag) {
  RunResult r = RunCli("generate --model /nonexistent.gguf --prompt x 2>&1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("/nonexistent.gguf"), std::string::npos) << r.out;
  r = RunCli("generate --model x --top-p 2 2>&1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("--top-p"), std::string::npos) << r.out;
  r = RunCli("generate --bogus 1 2>&1");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("unknown flag --bogus"), std::string::npos) << r.out;
}

TEST(TokenizeCliTest, VocabularyOnlyGgufIsEnough) {
  const std::string vocab = TestData("tokenizers/ggml-vocab-gpt-2.gguf");
  KVLENS_REQUIRE_FILE(vocab);
  // GPT-2: "Hello world" is 15496 995 (the published GPT-2 vocabulary).
  const RunResult r = RunCli("tokenize --model " + vocab + " --text 'Hello world'");
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, "15496 995\n");
}

}  // namespace
}  // namespace kvlens
