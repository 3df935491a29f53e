// End-to-end tests of kvlens.v1.Generation over loopback TCP against an in-process server:
// streaming, logprobs, stop strings, the unary RPCs, health and drain, and validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "tests/linked_model_dir.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/server/interpret_test_util.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

#define START_SERVER(server, ...)         \
  KVLENS_REQUIRE_FILE(Stories260KPath()); \
  TestServer server{__VA_ARGS__};         \
  ASSERT_TRUE(server.ok()) << server.error()

TEST(GenerationServiceTest, StreamsTheOfflineGreedyText) {
  START_SERVER(server);
  const StreamResult r = RunGenerate(server.stub(), GreedyRequest("Once upon a time", 40));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  // The first message names the request, so a client can cancel before any token. (It
  // goes out at once, but a loaded machine may finish all 40 tokens before the first
  // write: then that one message carries the id, the tokens and the final.)
  EXPECT_GT(r.request_id, 0);
  EXPECT_GE(r.messages, 1);
  ASSERT_TRUE(r.has_final);
  EXPECT_EQ(r.final.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(r.final.usage().prompt_tokens(), 5);  // BOS + 4
  EXPECT_EQ(r.final.usage().generated_tokens(), 40);
  EXPECT_EQ(r.tokens.size(), 40u);
  EXPECT_EQ(("Once upon a time" + r.text).rfind(kReferenceText, 0), 0u)
      << "Once upon a time" << r.text;
  const v1::Timings& t = r.final.timings();
  EXPECT_GE(t.first_token_seconds(), t.queue_seconds());
  EXPECT_GE(t.decode_seconds(), 0);

  // The same tokens and text as offline generation with the same model.
  kernels::CpuBackend backend(1);
  const std::vector<int32_t> prompt = server.model().tokenizer->Encode("Once upon a time", true);
  GenerateOptions options;
  options.max_new_tokens = 40;
  auto offline = Generate<float>(server.model(), backend, prompt, options);
  ASSERT_TRUE(offline.ok()) << offline.status();
  EXPECT_EQ(r.tokens, offline->tokens);
  IncrementalDecoder decoder(*server.model().tokenizer, prompt.back());
  std::string text;
  for (int32_t t2 : offline->tokens) text += decoder.Push(t2);
  EXPECT_EQ(r.text, text + decoder.Flush());
}

// --kv-cache-dtype bf16: GetModelInfo says so, the blocks are the same count, and the
// stream equals offline generation on a bf16 cache token for token.
TEST(GenerationServiceTest, Bf16KvCacheServesTheOfflineBf16Text) {
  EngineOptions options = TestServer::DefaultOptions();
  options.kv_cache_dtype = kernels::KvDtype::kBF16;
  START_SERVER(server, options);
  {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::ModelInfo info;
    ASSERT_TRUE(server.stub().GetModelInfo(&context, {}, &info).ok());
    EXPECT_EQ(info.kv_cache_dtype(), "bf16");
    EXPECT_EQ(info.num_blocks(), 256);
  }
  const StreamResult r = RunGenerate(server.stub(), GreedyRequest("Once upon a time", 40));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  kernels::CpuBackend backend(1);
  const std::vector<int32_t> prompt = server.model().tokenizer->Encode("Once upon a time", true);
  GenerateOptions offline_options;
  offline_options.max_new_tokens = 40;
  offline_options.kv_cache_dtype = kernels::KvDtype::kBF16;
  auto offline = Generate<float>(server.model(), backend, prompt, offline_options);
  ASSERT_TRUE(offline.ok()) << offline.status();
  EXPECT_EQ(r.tokens, offline->tokens);
}

TEST(GenerationServiceTest, TokenIdPromptsGiveTheSameStreamAsText) {
  START_SERVER(server);
  v1::GenerateRequest request = GreedyRequest("", 20);
  for (int32_t id : server.model().tokenizer->Encode("Once upon a time", true)) {
    request.mutable_token_ids()->add_ids(id);
  }
  const StreamResult by_ids = RunGenerate(server.stub(), request);
  const StreamResult by_text = RunGenerate(server.stub(), GreedyRequest("Once upon a time", 20));
  ASSERT_TRUE(by_ids.status.ok()) << by_ids.status.error_message();
  EXPECT_EQ(by_ids.tokens, by_text.tokens);
  EXPECT_EQ(by_ids.text, by_text.text);
}

TEST(GenerationServiceTest, LogprobsAndTopLogprobs) {
  START_SERVER(server);
  v1::GenerateRequest request = GreedyRequest("Once upon a time", 10);
  request.set_top_logprobs(3);  // implies logprobs
  const StreamResult r = RunGenerate(server.stub(), request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.logprobs.size(), r.tokens.size());
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    const v1::TokenLogprob& lp = r.logprobs[i];
    EXPECT_EQ(lp.token(), r.tokens[i]);
    EXPECT_LE(lp.logprob(), 0.0f);
    ASSERT_EQ(lp.top_size(), 3);
    // Greedy picks the most likely token.
    EXPECT_EQ(lp.top(0).token(), r.tokens[i]);
    EXPECT_FLOAT_EQ(lp.top(0).logprob(), lp.logprob());
    EXPECT_GE(lp.top(0).logprob(), lp.top(1).logprob());
  }
  // Without the flag, none.
  const StreamResult plain = RunGenerate(server.stub(), GreedyRequest("Once upon a time", 10));
  EXPECT_TRUE(plain.logprobs.empty());
}

TEST(GenerationServiceTest, StopStringEndsTheStreamBeforeIt) {
  START_SERVER(server);
  v1::GenerateRequest request = GreedyRequest("Once upon a time", 60);
  request.mutable_stopping()->add_stop("Lily");
  const StreamResult r = RunGenerate(server.stub(), request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.final.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(r.text, ", there was a little girl named ");
}

// stopping.min_new_tokens: a +100 logit bias makes EOS certain, yet it comes only after
// the minimum, the tokens before it the unbiased greedy ones.
TEST(GenerationServiceTest, MinNewTokensHoldsEosBack) {
  START_SERVER(server);
  const int32_t eos = server.model().tokenizer->eos_id();
  v1::GenerateRequest plain = GreedyRequest("Once upon a time", 3);
  const StreamResult want = RunGenerate(server.stub(), plain);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  v1::GenerateRequest request = GreedyRequest("Once upon a time", 10);
  (*request.mutable_sampling()->mutable_logit_bias())[eos] = 100;
  request.mutable_stopping()->set_min_new_tokens(3);
  const StreamResult r = RunGenerate(server.stub(), request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.final.finish_reason(), v1::FINISH_REASON_EOS);
  std::vector<int32_t> expected = want.tokens;
  expected.push_back(eos);
  EXPECT_EQ(r.tokens, expected);
}

TEST(GenerationServiceTest, GetModelInfo) {
  START_SERVER(server);
  grpc::ClientContext context;
  SetDeadline(context);
  v1::ModelInfo info;
  ASSERT_TRUE(server.stub().GetModelInfo(&context, {}, &info).ok());
  const ModelConfig& c = server.model().config;
  EXPECT_EQ(info.architecture(), "llama");
  EXPECT_EQ(info.format(), "gguf");
  EXPECT_EQ(info.num_layers(), c.num_layers);
  EXPECT_EQ(info.num_heads(), c.num_heads);
  EXPECT_EQ(info.num_kv_heads(), c.num_kv_heads);
  EXPECT_EQ(info.head_dim(), c.head_dim);
  EXPECT_EQ(info.dim(), 64);
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_EQ(info.context_length(), c.max_seq_len);
  EXPECT_EQ(info.bos_id(), 1);
  EXPECT_EQ(info.eos_id(), 2);
  EXPECT_EQ(info.block_size(), 16);
  EXPECT_EQ(info.num_blocks(), 256);
  EXPECT_EQ(info.backend(), "cpu-f32");
  EXPECT_EQ(info.kv_cache_dtype(), "f32");
  EXPECT_EQ(info.dtype(), "f32");  // stories260K.gguf holds f32 tensors only
}

// A GGUF in every ggml block type (tests/oracle/make_quantized_gguf.py) served over gRPC:
// GetModelInfo lists its linear weights' types by parameter count, and a greedy stream
// equals offline generation token for token.
TEST(GenerationServiceTest, ServesAQuantisedModel) {
  KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));  // its tokenizer
  ASSERT_TRUE(OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path =
      MakeQuantizedModel("--tokenizer " + TestData("stories260K/stories260K.gguf"));
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  TestServer server(path, TestServer::DefaultOptions());
  std::remove(path.c_str());  // mapped: the file's pages stay while the server runs
  ASSERT_TRUE(server.ok()) << server.error();
  grpc::ClientContext context;
  SetDeadline(context);
  v1::ModelInfo info;
  ASSERT_TRUE(server.stub().GetModelInfo(&context, {}, &info).ok());
  // Elements per type (make_quantized_gguf.py's layout): q3_K 65536 + 131072, q5_K and q6_K
  // 163840 (q6_K: 32768 and the output, 512 × 256), then 131072 each for iq4_xs, q2_K, q4_0
  // and q4_1 (ties by name), 65536 each for iq4_nl, q4_K and q5_0, and 32768 each for q5_1
  // and q8_0.
  EXPECT_EQ(info.dtype(), "q3_K+q5_K+q6_K+iq4_xs+q2_K+q4_0+q4_1+iq4_nl+q4_K+q5_0+q5_1+q8_0");

  v1::GenerateRequest request;
  const std::vector<int32_t> prompt = {1, 5, 300, 17, 42};
  for (int32_t id : prompt) request.mutable_token_ids()->add_ids(id);
  request.mutable_stopping()->set_max_new_tokens(24);
  request.mutable_stopping()->set_ignore_eos(true);
  const StreamResult r = RunGenerate(server.stub(), request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  kernels::CpuBackend backend(1);
  GenerateOptions options;
  options.max_new_tokens = 24;
  options.stop_at_eos = false;
  auto offline = Generate<float>(server.model(), backend, prompt, options);
  ASSERT_TRUE(offline.ok()) << offline.status();
  EXPECT_EQ(r.tokens, offline->tokens);
  EXPECT_EQ(r.tokens.size(), 24u);
}

// Serves make_quantized_gguf.py's f32 model of `args` (with stories260K's tokenizer):
// `info` is its GetModelInfo, and 12 greedy tokens streamed after {1, 5, 300, 17, 42} must
// equal the oracle's (PyTorch float64, a full recompute per token).
void ExpectServedGreedyEqualsTheOracle(
    const std::string& args, v1::ModelInfo& info,
    const EngineOptions& options = TestServer::DefaultOptions()) {
  ASSERT_TRUE(OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = MakeQuantizedModel("--f32 " + args + " --tokenizer " +
                                              TestData("stories260K/stories260K.gguf"));
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  const std::vector<int32_t> prompt = {1, 5, 300, 17, 42};
  const std::vector<int32_t> oracle = OracleGreedy(path, prompt, 12);
  ASSERT_EQ(oracle.size(), 12u) << "oracle.py --generate failed";
  TestServer server(path, options);
  std::remove(path.c_str());
  ASSERT_TRUE(server.ok()) << server.error();
  grpc::ClientContext context;
  SetDeadline(context);
  ASSERT_TRUE(server.stub().GetModelInfo(&context, {}, &info).ok());
  v1::GenerateRequest request;
  for (int32_t id : prompt) request.mutable_token_ids()->add_ids(id);
  request.mutable_stopping()->set_max_new_tokens(12);
  request.mutable_stopping()->set_ignore_eos(true);
  const StreamResult r = RunGenerate(server.stub(), request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, oracle);
}

// The server's engine in steps of 4 tokens from blocks of 4 (num_blocks of them).
EngineOptions FourTokenSteps(int num_blocks = TestServer::DefaultOptions().num_blocks) {
  EngineOptions o = TestServer::DefaultOptions();
  o.block_size = 4;
  o.num_blocks = num_blocks;
  o.max_batch_tokens = 4;
  return o;
}

// A Qwen3 GGUF (heads of 128 over a residual stream of 256, RMSNorm over each head of q and
// k): GetModelInfo names the file's architecture and the query heads' width, and a greedy
// stream equals the oracle's greedy continuation (PyTorch float64, full recompute per token).
TEST(GenerationServiceTest, ServesAQwen3) {
  KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));  // its tokenizer
  v1::ModelInfo info;
  ASSERT_NO_FATAL_FAILURE(ExpectServedGreedyEqualsTheOracle("--qwen3", info));
  EXPECT_EQ(info.architecture(), "llama");
  EXPECT_EQ(info.family(), "qwen3");
  EXPECT_EQ(info.dim(), 256);
  EXPECT_EQ(info.head_dim(), 128);
  EXPECT_EQ(info.q_dim(), 512);
}

// A Phi-3 (fused projections) whose sliding window of 4 binds within the prompt and the 12
// generated tokens: GetModelInfo reports it, and the stream (prefill, then decode steps
// over the paged cache) equals the oracle's greedy tokens, each a full windowed recompute.
// The server's cache holds 3 blocks of 4 tokens, the request 17 tokens: it is served
// because blocks go back to the pool as they leave the window (steps of 4 tokens: at most
// 4 + 3 + 4 tokens, 3 blocks, held at once).
TEST(GenerationServiceTest, ServesAPhi3WithASlidingWindow) {
  KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));  // its tokenizer
  v1::ModelInfo info;
  ASSERT_NO_FATAL_FAILURE(ExpectServedGreedyEqualsTheOracle(
      "--phi3 --set phi3.attention.sliding_window=4", info, FourTokenSteps(3)));
  EXPECT_EQ(info.family(), "phi3");
  EXPECT_EQ(info.sliding_window(), 4);
}

// A Gemma 3 as llama.cpp writes it (6 layers: layers 0–4 within 4 keys and RoPE base 1e4,
// layer 5 over every key with rope.freq_base and linear scaling by 8; norms on each
// block's outputs; GeGLU; embeddings times 16), served in steps of 4 tokens from blocks
// of 4: the stream equals the oracle's greedy tokens, each a full recompute. Its full
// layer keeps every block: the request's 5 blocks fit a pool of 5.
TEST(GenerationServiceTest, ServesAGemma3) {
  KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));  // its tokenizer
  v1::ModelInfo info;
  ASSERT_NO_FATAL_FAILURE(ExpectServedGreedyEqualsTheOracle(
      "--gemma3 --layers 6 --set gemma3.attention.sliding_window=4 --rope-scaling-linear 8", info,
      FourTokenSteps(5)));
  EXPECT_EQ(info.family(), "gemma3");
  EXPECT_EQ(info.sliding_window(), 4);
  EXPECT_EQ(info.head_dim(), 256);
}

// A Gemma 2 as llama.cpp writes it (layer 0 within 4 keys, layer 1 over all; scores
// soft-capped at 2, which binds; logits at llama.cpp's 30), served in steps of 4 tokens:
// the stream equals the oracle's greedy tokens.
TEST(GenerationServiceTest, ServesAGemma2) {
  KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));  // its tokenizer
  v1::ModelInfo info;
  ASSERT_NO_FATAL_FAILURE(ExpectServedGreedyEqualsTheOracle(
      "--gemma2 --set gemma2.attention.sliding_window=4 --set-float "
      "gemma2.attn_logit_softcapping=2",
      info, FourTokenSteps()));
  EXPECT_EQ(info.family(), "gemma2");
}

// The default model with a generation_config.json that sets repetition_penalty 1.3.
constexpr char kPenaltyConfig[] =
    R"({"bos_token_id": 4095, "eos_token_id": 4095, "repetition_penalty": 1.3})";

TEST(GenerationServiceTest, GenerationConfigRepetitionPenaltyIsTheDefault) {
  KVLENS_REQUIRE_FILE(DefaultModelPath());
  LinkedModelDir dir(DefaultModelPath(), {{"generation_config.json", kPenaltyConfig}});
  TestServer server(dir.path(), TestServer::DefaultOptions());
  ASSERT_TRUE(server.ok()) << server.error();
  v1::ModelInfo info;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(server.stub().GetModelInfo(&context, {}, &info).ok());
  }
  ASSERT_TRUE(info.has_default_repetition_penalty());
  EXPECT_EQ(info.default_repetition_penalty(), 1.3);
  auto run = [&](std::optional<double> penalty) {
    v1::GenerateRequest r = GreedyRequest("And God said", 40);
    if (penalty) r.mutable_sampling()->set_repetition_penalty(*penalty);
    StreamResult s = RunGenerate(server.stub(), r);
    EXPECT_TRUE(s.status.ok()) << s.status.error_message();
    return s.tokens;
  };
  const std::vector<int32_t> unset = run(std::nullopt), explicit_13 = run(1.3), off = run(1.0);
  EXPECT_EQ(unset, explicit_13);
  EXPECT_NE(unset, off);  // the penalty changes this greedy text, so the check has teeth
}

TEST(GenerationServiceTest, SpecialTokenSpellingsAreTokensUnlessTurnedOff) {
  KVLENS_REQUIRE_FILE(DefaultModelPath());
  TestServer server(DefaultModelPath(), TestServer::DefaultOptions());
  ASSERT_TRUE(server.ok()) << server.error();
  auto tokenize = [&](bool parse_special) {
    v1::TokenizeRequest r;
    r.set_text("And God said<|endoftext|>And God said");
    r.set_add_bos(false);
    if (!parse_special) r.set_parse_special(false);
    v1::TokenizeResponse out;
    grpc::ClientContext context;
    SetDeadline(context);
    EXPECT_TRUE(server.stub().Tokenize(&context, r, &out).ok());
    return std::vector<int32_t>(out.token_ids().begin(), out.token_ids().end());
  };
  // "And God said" = [295, 386, 387] and <|endoftext|> = 4095 (models/README.md).
  EXPECT_EQ(tokenize(true), (std::vector<int32_t>{295, 386, 387, 4095, 295, 386, 387}));
  const std::vector<int32_t> plain = tokenize(false);
  EXPECT_GT(plain.size(), 7u);
  for (int32_t id : plain) EXPECT_NE(id, 4095);
  // Generate's text prompt is tokenized the same way: the usage counts the 7 tokens + BOS.
  v1::GenerateRequest g = GreedyRequest("And God said<|endoftext|>And God said", 1);
  const StreamResult s = RunGenerate(server.stub(), g);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.final.usage().prompt_tokens(), 8);
}

// A model whose GGUF says tokenizer.ggml.add_bos_token = false (Qwen2's do) gets no BOS
// unless the request asks for one; Generate's text prompts follow the same default.
TEST(GenerationServiceTest, AbsentAddBosFollowsTheModel) {
  KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));  // its tokenizer
  ASSERT_TRUE(OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = MakeQuantizedModel(
      "--tokenizer " + TestData("stories260K/stories260K.gguf") + " --no-add-bos");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  TestServer server(path, TestServer::DefaultOptions());
  std::remove(path.c_str());
  ASSERT_TRUE(server.ok()) << server.error();
  auto tokenize = [&](std::optional<bool> add_bos) {
    v1::TokenizeRequest r;
    r.set_text("Once upon a time");
    if (add_bos) r.set_add_bos(*add_bos);
    v1::TokenizeResponse out;
    grpc::ClientContext context;
    SetDeadline(context);
    EXPECT_TRUE(server.stub().Tokenize(&context, r, &out).ok());
    return std::vector<int32_t>(out.token_ids().begin(), out.token_ids().end());
  };
  const std::vector<int32_t> plain = tokenize(std::nullopt);
  ASSERT_FALSE(plain.empty());
  EXPECT_NE(plain.front(), 1);  // stories260K's BOS
  std::vector<int32_t> with_bos = {1};
  with_bos.insert(with_bos.end(), plain.begin(), plain.end());
  EXPECT_EQ(tokenize(true), with_bos);
  EXPECT_EQ(tokenize(false), plain);
  const StreamResult s = RunGenerate(server.stub(), GreedyRequest("Once upon a time", 1));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.final.usage().prompt_tokens(), static_cast<int>(plain.size()));
}

// A chat prompt is the conversation as the model's chat template writes it: a GGUF whose
// tokenizer.chat_template is ChatML's gets "chatml" in GetModelInfo, and a chat request
// the prompt of the same conversation written out by hand as text. The default model has
// no template: chat is refused, naming --chat-template; so is a role no template knows.
TEST(GenerationServiceTest, ChatPromptsFollowTheModelsTemplate) {
  KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));  // its tokenizer
  ASSERT_TRUE(OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = MakeChatMlModel();
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  TestServer server(path, TestServer::DefaultOptions());
  std::remove(path.c_str());
  ASSERT_TRUE(server.ok()) << server.error();
  v1::ModelInfo info;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(server.stub().GetModelInfo(&context, {}, &info).ok());
  }
  EXPECT_EQ(info.chat_template(), "chatml");
  v1::GenerateRequest chat = GreedyRequest("", 1);
  auto* c = chat.mutable_chat();
  auto* m = c->add_messages();
  m->set_role("system");
  m->set_content("Be kind.");
  m = c->add_messages();
  m->set_role("user");
  m->set_content("Once upon a time");
  const StreamResult s = RunGenerate(server.stub(), chat);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  const StreamResult t = RunGenerate(
      server.stub(),
      GreedyRequest("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nOnce upon a "
                    "time<|im_end|>\n<|im_start|>assistant\n",
                    1));
  ASSERT_TRUE(t.status.ok()) << t.status.error_message();
  EXPECT_EQ(s.final.usage().prompt_tokens(), t.final.usage().prompt_tokens());
  EXPECT_EQ(s.tokens, t.tokens);
  // Tokenize and the Interpret inputs take the same conversation.
  auto tokenize = [&](const v1::TokenizeRequest& r) {
    v1::TokenizeResponse out;
    grpc::ClientContext context;
    SetDeadline(context);
    EXPECT_TRUE(server.stub().Tokenize(&context, r, &out).ok());
    return std::vector<int32_t>(out.token_ids().begin(), out.token_ids().end());
  };
  v1::TokenizeRequest by_chat, by_text;
  *by_chat.mutable_chat() = chat.chat();
  by_text.set_text(
      "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nOnce upon a "
      "time<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<int32_t> chat_ids = tokenize(by_chat);
  EXPECT_EQ(static_cast<int>(chat_ids.size()), s.final.usage().prompt_tokens());
  EXPECT_EQ(chat_ids, tokenize(by_text));
  auto interpret = InterpretStub(server);
  auto lens = [&](const v1::PromptInput& input) {
    v1::LogitLensRequest r;
    *r.mutable_input() = input;
    v1::LogitLensResponse out;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status st = interpret->LogitLens(&context, r, &out);
    EXPECT_TRUE(st.ok()) << st.error_message();
    std::vector<int32_t> tops;
    for (const v1::LensRow& row : out.rows()) tops.push_back(row.top(0).token());
    return tops;
  };
  v1::PromptInput chat_input, text_input;
  *chat_input.mutable_chat() = chat.chat();
  text_input.set_text(by_text.text());
  const std::vector<int32_t> chat_tops = lens(chat_input);
  EXPECT_FALSE(chat_tops.empty());
  EXPECT_EQ(chat_tops, lens(text_input));
  m->set_role("tool");
  const StreamResult bad = RunGenerate(server.stub(), chat);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.status.error_message().find("chat.messages[1].role"), std::string::npos)
      << bad.status.error_message();

  START_SERVER(plain);
  m->set_role("user");
  const StreamResult none = RunGenerate(plain.stub(), chat);
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(none.status.error_message().find("--chat-template"), std::string::npos)
      << none.status.error_message();
}

TEST(GenerationServiceTest, TokenizeDetokenizeRoundTrip) {
  START_SERVER(server);
  const std::string text = "Once upon a time, there was a little girl named Lily.";
  grpc::ClientContext c1;
  SetDeadline(c1);
  v1::TokenizeRequest treq;
  treq.set_text(text);
  v1::TokenizeResponse tokens;
  ASSERT_TRUE(server.stub().Tokenize(&c1, treq, &tokens).ok());
  ASSERT_GT(tokens.token_ids_size(), 1);
  EXPECT_EQ(tokens.token_ids(0), 1);  // BOS by default
  EXPECT_EQ(tokens.pieces_size(), tokens.token_ids_size());

  grpc::ClientContext c2;
  SetDeadline(c2);
  v1::DetokenizeRequest dreq;
  *dreq.mutable_token_ids() = tokens.token_ids();
  v1::DetokenizeResponse back;
  ASSERT_TRUE(server.stub().Detokenize(&c2, dreq, &back).ok());
  EXPECT_EQ(back.text(), text);

  grpc::ClientContext c3;
  SetDeadline(c3);
  treq.set_add_bos(false);
  v1::TokenizeResponse no_bos;
  ASSERT_TRUE(server.stub().Tokenize(&c3, treq, &no_bos).ok());
  EXPECT_EQ(no_bos.token_ids_size(), tokens.token_ids_size() - 1);
}

grpc::health::v1::HealthCheckResponse::ServingStatus Health(TestServer& server,
                                                            const std::string& service) {
  grpc::ClientContext context;
  SetDeadline(context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status s = server.health().Check(&context, request, &response);
  return s.ok() ? response.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
}

TEST(GenerationServiceTest, HealthServingThenDrainRefusesNewCalls) {
  START_SERVER(server);
  EXPECT_EQ(Health(server, ""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(server, "kvlens.v1.Generation"), grpc::health::v1::HealthCheckResponse::SERVING);

  server.server().BeginDrain();
  EXPECT_EQ(Health(server, ""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  const StreamResult r = RunGenerate(server.stub(), GreedyRequest("Once upon a time", 5));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  grpc::ClientContext context;
  SetDeadline(context);
  v1::TokenizeResponse tokens;
  v1::TokenizeRequest treq;
  treq.set_text("a");
  EXPECT_EQ(server.stub().Tokenize(&context, treq, &tokens).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

struct BadField {
  const char* name;
  std::function<void(v1::GenerateRequest&)> edit;
  grpc::StatusCode code;
  const char* message;  // a substring of the status message: the field, as the client wrote it
};

TEST(GenerationServiceTest, EveryBadFieldIsNamed) {
  START_SERVER(server);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  constexpr auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  const std::vector<BadField> cases = {
      {"no prompt", [](auto& r) { r.clear_text(); }, kInvalid,
       "prompt: set text, token_ids or chat"},
      {"empty text",
       [](auto& r) {
         r.set_text("");
         r.set_add_bos(false);
       },
       kInvalid, "text"},
      {"empty ids", [](auto& r) { r.mutable_token_ids(); }, kInvalid, "token_ids.ids"},
      {"id range",
       [](auto& r) {
         r.mutable_token_ids()->add_ids(1);
         r.mutable_token_ids()->add_ids(512);
       },
       kInvalid, "token_ids.ids[1] = 512"},
      {"temperature", [](auto& r) { r.mutable_sampling()->set_temperature(-1); }, kInvalid,
       "sampling.temperature = -1"},
      {"temperature nan", [&](auto& r) { r.mutable_sampling()->set_temperature(nan); }, kInvalid,
       "sampling.temperature"},
      {"top_k", [](auto& r) { r.mutable_sampling()->set_top_k(-2); }, kInvalid,
       "sampling.top_k = -2"},
      {"top_p", [](auto& r) { r.mutable_sampling()->set_top_p(1.5); }, kInvalid,
       "sampling.top_p = 1.5 must be in (0, 1]"},
      {"top_p 0", [](auto& r) { r.mutable_sampling()->set_top_p(0); }, kInvalid,
       "sampling.top_p = 0"},
      {"min_p", [](auto& r) { r.mutable_sampling()->set_min_p(1); }, kInvalid,
       "sampling.min_p = 1"},
      {"repetition", [](auto& r) { r.mutable_sampling()->set_repetition_penalty(0); }, kInvalid,
       "sampling.repetition_penalty = 0"},
      {"frequency", [](auto& r) { r.mutable_sampling()->set_frequency_penalty(3); }, kInvalid,
       "sampling.frequency_penalty = 3"},
      {"presence", [](auto& r) { r.mutable_sampling()->set_presence_penalty(-3); }, kInvalid,
       "sampling.presence_penalty = -3"},
      {"bias id", [](auto& r) { (*r.mutable_sampling()->mutable_logit_bias())[9999] = 1; },
       kInvalid, "sampling.logit_bias key = 9999"},
      {"bias value", [](auto& r) { (*r.mutable_sampling()->mutable_logit_bias())[7] = 1000; },
       kInvalid, "sampling.logit_bias[7] = 1000"},
      {"max_new_tokens", [](auto& r) { r.mutable_stopping()->set_max_new_tokens(0); }, kInvalid,
       "stopping.max_new_tokens = 0"},
      {"min_new_tokens", [](auto& r) { r.mutable_stopping()->set_min_new_tokens(-1); }, kInvalid,
       "stopping.min_new_tokens = -1 must be in [0, max_new_tokens = 8]"},
      {"min over max", [](auto& r) { r.mutable_stopping()->set_min_new_tokens(9); }, kInvalid,
       "stopping.min_new_tokens = 9 must be in [0, max_new_tokens = 8]"},
      {"stop empty", [](auto& r) { r.mutable_stopping()->add_stop(""); }, kInvalid,
       "stopping.stop[0]"},
      {"stop long", [](auto& r) { r.mutable_stopping()->add_stop(std::string(300, 'a')); },
       kInvalid, "stopping.stop[0] has 300 bytes"},
      {"stop count",
       [](auto& r) {
         for (int i = 0; i < 17; ++i) r.mutable_stopping()->add_stop()->push_back('x');
       },
       kInvalid, "stopping.stop: 17 strings"},
      {"stop token", [](auto& r) { r.mutable_stopping()->add_stop_token_ids(-1); }, kInvalid,
       "stopping.stop_token_ids[0] = -1"},
      {"top_logprobs", [](auto& r) { r.set_top_logprobs(21); }, kInvalid, "top_logprobs = 21"},
      {"session negative", [](auto& r) { r.set_session_id(-1); }, kInvalid, "session_id = -1"},
      {"session unknown", [](auto& r) { r.set_session_id(4242); }, kInvalid, "session_id 4242"},
      {"context", [](auto& r) { r.mutable_stopping()->set_max_new_tokens(128); },
       grpc::StatusCode::OUT_OF_RANGE, "exceeds the context length"},
  };
  for (const BadField& c : cases) {
    SCOPED_TRACE(c.name);
    v1::GenerateRequest request = GreedyRequest("Once upon a time", 8);
    c.edit(request);
    const StreamResult r = RunGenerate(server.stub(), request);
    EXPECT_EQ(r.status.error_code(), c.code) << r.status.error_message();
    EXPECT_NE(r.status.error_message().find(c.message), std::string::npos)
        << "message: " << r.status.error_message();
    EXPECT_EQ(r.messages, 0);
  }
}

TEST(GenerationServiceTest, BadFieldsOfTheUnaryCalls) {
  START_SERVER(server);
  {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::DetokenizeRequest request;
    request.add_token_ids(5);
    request.add_token_ids(600);
    v1::DetokenizeResponse response;
    const grpc::Status s = server.stub().Detokenize(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("token_ids[1] = 600"), std::string::npos) << s.error_message();
  }
  {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::CancelRequest request;
    request.set_request_id(777);
    v1::CancelResponse response;
    const grpc::Status s = server.stub().Cancel(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_NE(s.error_message().find("request_id = 777"), std::string::npos) << s.error_message();
  }
  {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::CloseSessionRequest request;
    v1::CloseSessionResponse response;
    const grpc::Status s = server.stub().CloseSession(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("session_id = 0"), std::string::npos) << s.error_message();
  }
  {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::CloseSessionRequest request;
    request.set_session_id(99);
    v1::CloseSessionResponse response;
    EXPECT_EQ(server.stub().CloseSession(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
}

}  // namespace
}  // namespace kvlens::testing
