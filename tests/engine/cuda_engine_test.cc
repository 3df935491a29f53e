// The engine on the CUDA backend, end to end (suites CudaEngine*, ctest label `gpu`):
// activations and the KV cache on the device, logits copied out. Skipped, with the reason
// printed, in builds without CUDA or on machines without a GPU.
//
// Tolerances: stories260K greedy text must equal the CPU path's (and llama2.c's). The
// default model's logits on CUDA are compared with the CpuBackend's: its prefill attention
// runs on fp16 tensor cores (Tq ≥ 32), so the bound is 1e-2 of the largest |logit| (plus
// 1e-3); decode and short chunks are fp32 end to end, so incremental decode on CUDA equals
// a full recompute on CUDA within 1e-4 of the largest |logit|.
//
// One file of about 1200 lines: these suites share their model loaders and comparisons, and
// the GPU machine's standalone build names its test sources
// (kernels/cuda/standalone/sources.cmake, KVLENS_GPU_TEST_SOURCES); each TEST stands alone.
#include <algorithm>
#include <cmath>
#include <functional>
#include <future>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <string>

#include "engine/engine.h"
#include "engine/generator.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"
#include "engine/model/model.h"
#include "engine/model/transformer.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/staged_backend.h"
#include "tests/engine/serve_together.h"
#ifdef KVLENS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/launch.h"
#endif
#include "tests/engine/interpret/tiny_model.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

const std::string kStories = testing::TestData("stories260K/stories260K.bin");
// llama2.c's run.c continuation of "Once upon a time" (tests/server/server_test_util.h).
constexpr char kReferenceText[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park.";

// The CUDA backend, or a skip with the reason (no CUDA in this build, no usable GPU).
// Built into cuda_emu_tests (tests/kernels/cuda/emu), the backend is the emulated one.
#ifdef KVLENS_CUDA_EMULATOR
absl::StatusOr<kernels::CreatedBackend> CreateCudaBackend() {
  auto b = kernels::cuda::CudaBackend::Create(0);
  if (!b.ok()) return b.status();
  kernels::CreatedBackend created;
  created.description = "cuda:0 (" + (*b)->device_name() + ")";
  created.backend = *std::move(b);
  return created;
}
#else
absl::StatusOr<kernels::CreatedBackend> CreateCudaBackend() {
  return kernels::CreateBackend({kernels::DeviceSpec::Kind::kCuda, 0}, 1);
}
#endif

#define KVLENS_REQUIRE_CUDA(var)                                                          \
  auto var##_or = CreateCudaBackend();                                                    \
  if (!var##_or.ok()) GTEST_SKIP() << "no CUDA backend: " << var##_or.status().message(); \
  kernels::Backend<float>& var = *var##_or->backend;                                      \
  std::cerr << "[ CUDA     ] " << var##_or->description << "\n"

std::unique_ptr<Model> Load(const std::string& path) {
  auto m = LoadModel({path, ""});
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

std::string Greedy(const Model& model, kernels::Backend<float>& backend, int max_new) {
  IncrementalDecoder decoder(*model.tokenizer);
  std::string text = "Once upon a time";
  const std::vector<int32_t> prompt = model.tokenizer->Encode(text, true);
  for (int32_t id : prompt) decoder.Push(id);
  GenerateOptions o;
  o.max_new_tokens = max_new;
  o.stop_at_eos = false;
  o.block_size = 7;
  auto r = Generate<float>(model, backend, prompt, o);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return "";
  for (int32_t t : r->tokens) text += decoder.Push(t);
  return text + decoder.Flush();
}

// Logits of every position of `tokens` in one prefill (NaN cache, scattered blocks), with
// `adds` steering its rows.
std::vector<float> AllLogits(const Model& model, kernels::Backend<float>& backend,
                             const std::vector<int32_t>& tokens, int chunk,
                             kernels::KvDtype cache_dtype = kernels::KvDtype::kActivation,
                             absl::Span<const ResidualAdd> adds = {}) {
  const int bs = 7, blocks = static_cast<int>(tokens.size() + bs - 1) / bs;
  std::vector<int32_t> table(blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(7));
  for (int32_t& b : table) b = 2 * b + 1;  // odd blocks only: even ones stay NaN
  auto cache =
      KvCacheStorage<float>::Create(backend.memory(), model.config.num_layers, 2 * blocks + 1, bs,
                                    model.config.kv_dim(), true, cache_dtype);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return {};
  Transformer<float> tr(model, backend);
  std::vector<float> all;
  for (size_t i = 0; i < tokens.size(); i += chunk) {
    BatchEntry e;
    e.tokens = absl::MakeConstSpan(tokens).subspan(i, std::min<size_t>(chunk, tokens.size() - i));
    e.num_cached = static_cast<int>(i);
    e.block_table = table;
    e.all_logits = true;
    e.residual_adds = adds;
    ForwardOutput<float> out;
    const absl::Status s = tr.Forward({&e, 1}, *cache, out);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return {};
    all.insert(all.end(), out.logits.begin(), out.logits.end());
  }
  return all;
}

// max |a − b| ≤ rel · max|b| + abs, every value finite.
void ExpectClose(const std::vector<float>& a, const std::vector<float>& b, double rel, double abs) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  double scale = 0, err = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(std::isfinite(a[i])) << "value " << i << " is " << a[i];
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
    err = std::max(err, std::abs(static_cast<double>(a[i]) - b[i]));
  }
  EXPECT_LE(err, rel * scale + abs) << "max |logit| " << scale;
  std::cerr << "[ CUDA     ] max error " << err << " (max |logit| " << scale << ")\n";
}

TEST(CudaEngineGenerate, Stories260KGreedyTextEqualsCpuAndReference) {
  KVLENS_REQUIRE_FILE(kStories);
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(kStories);
  ASSERT_NE(model, nullptr);
  kernels::CpuBackend cpu(2);
  const std::string want = Greedy(*model, cpu, 40);
  const std::string got = Greedy(*model, cuda, 40);
  EXPECT_EQ(got, want);
  EXPECT_EQ(got.rfind(kReferenceText, 0), 0u) << got;
}

TEST(CudaEngineServe, Stories260KThroughTheEngineEqualsCpu) {
  KVLENS_REQUIRE_FILE(kStories);
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(kStories);
  ASSERT_NE(model, nullptr);
  kernels::CpuBackend cpu(2);
  auto serve = [&](kernels::Backend<float>& backend) {
    Engine engine(*model, backend, EngineOptions{});
    EXPECT_TRUE(engine.status().ok()) << engine.status();
    std::string text = "Once upon a time";
    std::promise<void> done;
    GenerationRequest r;
    r.prompt = model->tokenizer->Encode(text, true);
    r.stop.max_new_tokens = 40;
    r.stop.ignore_eos = true;
    r.callbacks.on_token = [&](const TokenEvent& e) { text += e.text; };
    r.callbacks.on_finish = [&](const FinishEvent& e) {
      text += e.text;
      done.set_value();
    };
    auto id = engine.Submit(std::move(r));
    EXPECT_TRUE(id.ok()) << id.status();
    if (id.ok()) done.get_future().wait();
    return text;
  };
  const std::string want = serve(cpu);
  const std::string got = serve(cuda);
  EXPECT_EQ(got, want);
  EXPECT_EQ(got.rfind(kReferenceText, 0), 0u) << got;
}

// Attention rows streamed with each token (layers 1 and 3, heads 0, 5 and 7): each step
// runs a chosen layer's last query again alone, its probabilities into the step's row
// buffer on the device, copied out once a step. The tokens equal the CPU engine's, and
// every row is the CPU's within 1e-5 (fp32 on both); on CUDA the rows, read beside each
// step, leave its tokens and log-probabilities bit for bit as the same request gets
// without them (both drawn on the device; the step without rows from a graph).
TEST(CudaEngineServe, StreamedAttentionRowsEqualCpu) {
  KVLENS_REQUIRE_FILE(kStories);
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(kStories);
  ASSERT_NE(model, nullptr);
  kernels::CpuBackend cpu(2);
  auto serve = [&](kernels::Backend<float>& backend, bool rows = true) {
    Engine engine(*model, backend, EngineOptions{});
    EXPECT_TRUE(engine.status().ok()) << engine.status();
    std::vector<TokenEvent> events;
    std::promise<void> done;
    GenerationRequest r;
    r.prompt = model->tokenizer->Encode("Once upon a time", true);
    r.stop.max_new_tokens = 12;
    r.stop.ignore_eos = true;
    if (rows) r.attention_rows = {{1, 3}, {0, 5, 7}};
    r.callbacks.on_token = [&](const TokenEvent& e) { events.push_back(e); };
    r.callbacks.on_finish = [&](const FinishEvent&) { done.set_value(); };
    auto id = engine.Submit(std::move(r));
    EXPECT_TRUE(id.ok()) << id.status();
    if (id.ok()) done.get_future().wait();
    return events;
  };
  const std::vector<TokenEvent> want = serve(cpu), got = serve(cuda);
  const std::vector<TokenEvent> plain = serve(cuda, false);
  ASSERT_EQ(want.size(), 12u);
  ASSERT_EQ(got.size(), want.size());
  ASSERT_EQ(plain.size(), want.size());
  for (size_t t = 0; t < got.size(); ++t) {
    EXPECT_EQ(got[t].token, want[t].token) << "token " << t;
    EXPECT_EQ(got[t].token, plain[t].token) << "token " << t;
    EXPECT_EQ(got[t].logprob, plain[t].logprob) << "token " << t;
    EXPECT_TRUE(plain[t].attention.empty());
    ASSERT_EQ(got[t].attention_keys, want[t].attention_keys) << "token " << t;
    ASSERT_EQ(got[t].attention.size(), size_t{6} * want[t].attention_keys) << "token " << t;
    ASSERT_EQ(got[t].attention.size(), want[t].attention.size()) << "token " << t;
    for (size_t i = 0; i < got[t].attention.size(); ++i) {
      ASSERT_NEAR(got[t].attention[i], want[t].attention[i], 1e-5) << "token " << t << ", " << i;
    }
  }
}

// Steered requests (vectors at resid_pre, resid_mid and, from position 3, before the final
// norm) served with an unsteered one: the device stages each point's rows with the step's
// index arrays and adds them (AddRows); every request's tokens and log-probabilities equal the CPU
// engine's, and the unsteered request's the ones it gets alone.
TEST(CudaEngineServe, SteeredRequestsEqualCpu) {
  KVLENS_REQUIRE_FILE(kStories);
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(kStories);
  ASSERT_NE(model, nullptr);
  const int D = static_cast<int>(model->config.dim), L = model->config.num_layers;
  auto request = [&](std::vector<ResidualAdd> steering) {
    GenerationRequest r;
    r.prompt = model->tokenizer->Encode("Once upon a time", true);
    r.stop.max_new_tokens = 24;
    r.stop.ignore_eos = true;
    r.steering = std::move(steering);
    return r;
  };
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 0.6f);
  auto vector = [&] {
    std::vector<float> v(static_cast<size_t>(D));
    for (float& x : v) x = normal(rng);
    return v;
  };
  std::vector<GenerationRequest> requests = {
      request({}), request({{0, false, vector()}}),
      request({{1, true, vector()}, {L, false, vector(), 3}})};
  kernels::CpuBackend cpu(2);
  const std::vector<testing::Served> want = testing::ServeTogether(*model, cpu, requests);
  const std::vector<testing::Served> got = testing::ServeTogether(*model, cuda, requests);
  const std::vector<testing::Served> alone = testing::ServeTogether(*model, cuda, {request({})});
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
    for (size_t t = 0; t < want[i].logprobs.size() && t < got[i].logprobs.size(); ++t) {
      EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], 1e-3) << i << ", token " << t;
    }
  }
  EXPECT_NE(want[1].tokens, want[0].tokens);
  EXPECT_NE(want[2].tokens, want[0].tokens);
  EXPECT_EQ(got[0].tokens, alone[0].tokens);
}

// Scored prompts (prompt_logprobs) beside a plain request, in chunks of 8 tokens: the
// scored entries' rows are read on the device (DrawTokens with each row's next prompt token
// forced) with the others' device picks in the same step, no row copied out; every prompt
// position's log-probability and top tokens, and every generated token,
// equal the CPU engine's. A fourth request holds back EOS for 4 tokens (min_new_tokens: a
// −∞ logit bias in the device's draw at a temperature) though a +100 bias makes it certain.
TEST(CudaEngineServe, ScoredPromptsAndHeldBackEosEqualCpu) {
  KVLENS_REQUIRE_FILE(kStories);
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(kStories);
  ASSERT_NE(model, nullptr);
  auto request = [&](const std::string& text, int prompt_logprobs) {
    GenerationRequest r;
    r.prompt = model->tokenizer->Encode(text, true);
    r.stop.max_new_tokens = 12;
    r.stop.ignore_eos = true;
    r.prompt_logprobs = prompt_logprobs;
    return r;
  };
  std::vector<GenerationRequest> requests = {
      request("Once upon a time", -1), request(kReferenceText, 3),
      request("The little dog ran to the park and saw a big red ball.", 0),
      request("Once upon a time", -1)};
  const int32_t eos = model->tokenizer->eos_id();
  requests[3].stop.ignore_eos = false;
  requests[3].stop.min_new_tokens = 4;
  requests[3].sampling.logit_bias = {{eos, 100.0f}};
  requests[3].sampling.temperature = 0.7;
  requests[3].sampling.seed = 5;
  EngineOptions options;
  options.max_batch_tokens = 8;
  kernels::CpuBackend cpu(2);
  const std::vector<testing::Served> want = testing::ServeTogether(*model, cpu, requests, options);
  const std::vector<testing::Served> got = testing::ServeTogether(*model, cuda, requests, options);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    ASSERT_EQ(got[i].prompt_logprobs.size(), want[i].prompt_logprobs.size());
    EXPECT_EQ(want[i].prompt_logprobs.size(), i == 0 || i == 3 ? 0 : requests[i].prompt.size() - 1);
    // Top tokens only where asked (request 1: 3 a position).
    ASSERT_EQ(got[i].prompt_top.size(), want[i].prompt_top.size());
    EXPECT_EQ(want[i].prompt_top.size(), i == 1 ? want[i].prompt_logprobs.size() : 0);
    for (size_t p = 0; p < want[i].prompt_logprobs.size(); ++p) {
      EXPECT_NEAR(got[i].prompt_logprobs[p], want[i].prompt_logprobs[p], 1e-3) << p;
    }
    for (size_t p = 0; p < want[i].prompt_top.size(); ++p) {
      ASSERT_EQ(got[i].prompt_top[p].size(), 3u) << p;
      ASSERT_EQ(want[i].prompt_top[p].size(), 3u) << p;
      for (size_t k = 0; k < 3; ++k) {
        EXPECT_NEAR(got[i].prompt_top[p][k].logprob, want[i].prompt_top[p][k].logprob, 1e-3);
      }
    }
  }
  ASSERT_EQ(got[3].tokens.size(), 5u);
  EXPECT_EQ(got[3].tokens[4], eos);
  for (int t = 0; t < 4; ++t) EXPECT_NE(got[3].tokens[t], eos) << t;
}

// A sliding window of 16 whose blocks the engine gives back as they leave it (blocks of 4
// in a pool of 10, three requests of 50–70 tokens sharing steps): the block tables' released
// entries alias a live block, and the device's kernels (split-KV decode, prefill chunks,
// decode graphs) read only keys in the window; every request's text and log-probabilities
// equal the CPU engine's.
TEST(CudaEngineServe, SlidingWindowReleasingBlocksEqualsCpu) {
  KVLENS_REQUIRE_FILE(kStories);
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(kStories);
  ASSERT_NE(model, nullptr);
  model->config.sliding_window = 16;
  std::vector<GenerationRequest> requests;
  for (const char* p : {"Once upon a time", "The cat", "Lily and Ben went"}) {
    GenerationRequest r;
    r.prompt = model->tokenizer->Encode(p, true);
    r.stop.max_new_tokens = 45 + 10 * static_cast<int>(requests.size());
    r.stop.ignore_eos = true;
    requests.push_back(std::move(r));
  }
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 10;
  o.max_batch_tokens = 8;
  kernels::CpuBackend cpu(2);
  const std::vector<testing::Served> want = testing::ServeTogether(*model, cpu, requests, o);
  const std::vector<testing::Served> got = testing::ServeTogether(*model, cuda, requests, o);
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
    ASSERT_EQ(got[i].logprobs.size(), size_t(45 + 10 * i));
    for (size_t t = 0; t < got[i].logprobs.size(); ++t) {
      EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], 1e-4)
          << "request " << i << " token " << t;
    }
  }
}

// Seeded temperature draws through the Engine: on CUDA they are drawn where the logits
// are (CudaBackend::DrawTokens, with the uniform number the engine reserves from each
// request's generator), on the CPU by the Sampler; the same tokens, and log-probabilities
// within 1e-4, and one request's top-5 log-probabilities too; one draws with a logit bias, one
// with repetition, frequency and presence penalties over its tokens so far (their counts
// uploaded with the draws), and one greedily with a repetition penalty. (The logits differ by float
// rounding, ~1e-6 here: a draw within that of a boundary could differ; none of these does.)
TEST(CudaEngineServe, Stories260KSeededDrawsEqualCpu) {
  KVLENS_REQUIRE_FILE(kStories);
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(kStories);
  ASSERT_NE(model, nullptr);
  std::vector<GenerationRequest> requests(5);
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerationRequest& r = requests[i];
    r.prompt = model->tokenizer->Encode(i % 2 == 0 ? "Once upon a time" : "The cat", true);
    r.stop.max_new_tokens = 30;
    r.stop.ignore_eos = true;
    r.sampling.seed = 100 + i;
    r.sampling.temperature = i == 0 ? 1.0 : 0.8;
    if (i == 1) r.sampling.top_p = 0.9, r.top_logprobs = 5;
    if (i == 2) {
      r.sampling.top_k = 40, r.sampling.min_p = 0.02;
      r.sampling.logit_bias = {{50, 3.0f}, {50, 1.0f}, {1, -100.0f}};
    }
    if (i == 3) {
      r.sampling.repetition_penalty = 1.2, r.sampling.frequency_penalty = 0.3;
      r.sampling.presence_penalty = 0.2;
    }
    if (i == 4) r.sampling.temperature = 0.0, r.sampling.repetition_penalty = 1.5;
  }
  kernels::CpuBackend cpu(2);
  const std::vector<testing::Served> want = testing::ServeTogether(*model, cpu, requests);
  const std::vector<testing::Served> got = testing::ServeTogether(*model, cuda, requests);
  // Request 1's top log-probabilities (from the device on CUDA): the same tokens, values
  // within 1e-4.
  ASSERT_EQ(got[1].top.size(), want[1].top.size());
  for (size_t t = 0; t < want[1].top.size(); ++t) {
    ASSERT_EQ(want[1].top[t].size(), 5u);
    ASSERT_EQ(got[1].top[t].size(), 5u);
    for (size_t j = 0; j < 5; ++j) {
      EXPECT_EQ(got[1].top[t][j].token, want[1].top[t][j].token) << "token " << t << ", top " << j;
      EXPECT_NEAR(got[1].top[t][j].logprob, want[1].top[t][j].logprob, 1e-4);
    }
  }
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_EQ(want[i].tokens.size(), 30u);
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
    for (size_t t = 0; t < want[i].logprobs.size(); ++t) {
      EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], 1e-4) << "token " << t;
    }
  }
  // Seeds that differ draw differently (the test would pass vacuously otherwise).
  EXPECT_NE(want[0].tokens, want[2].tokens);
}

TEST(CudaEngineLogits, DefaultModelWithinToleranceOfCpu) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  const std::vector<int32_t> tokens = model->tokenizer->Encode(
      "In the beginning God created the heaven and the earth. And the earth was without form, "
      "and void; and darkness was upon the face of the deep.",
      false);
  ASSERT_GE(tokens.size(), 32u);  // long enough for the flash prefill kernel
  kernels::CpuBackend cpu(2);
  for (int chunk : {static_cast<int>(tokens.size()), 5}) {
    SCOPED_TRACE(chunk);
    ExpectClose(AllLogits(*model, cuda, tokens, chunk), AllLogits(*model, cpu, tokens, chunk), 1e-2,
                1e-3);
  }
}

// A 2-layer Llama-shaped model with head size 64 (4 heads of 64, 2 KV heads), a vocabulary
// of 50, random weights.
testing::TinySpec HeadSize64Spec(kernels::RopeStyle rope_style, int max_seq, int seed) {
  testing::TinySpec spec;
  spec.arch = Architecture::kLlama;
  spec.rope_style = rope_style;
  spec.dim = 256;
  spec.heads = 4;
  spec.kv_heads = 2;
  spec.hidden = 384;
  spec.layers = 2;
  spec.vocab = 50;
  spec.max_seq = max_seq;
  spec.seed = seed;
  return spec;
}
std::unique_ptr<Model> HeadSize64Model(kernels::RopeStyle rope_style, int max_seq, int seed) {
  return testing::MakeTinyModel(HeadSize64Spec(rope_style, max_seq, seed));
}

// `n` random token ids below 50, from seed (the tiny models' vocabularies have more).
std::vector<int32_t> RandomTokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> tokens(n);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 50);
  return tokens;
}

// `n` random tokens in one prefill and in chunks of 7 (decode-like calls over a growing
// cache), each step's logits against the CpuBackend's.
void ExpectPrefillAndChunksCloseToCpu(const Model& model, kernels::Backend<float>& cuda, int n,
                                      uint32_t seed) {
  const std::vector<int32_t> tokens = RandomTokens(n, seed);
  kernels::CpuBackend cpu(2);
  ExpectClose(AllLogits(model, cuda, tokens, n), AllLogits(model, cpu, tokens, n), 1e-2, 1e-3);
  ExpectClose(AllLogits(model, cuda, tokens, 7), AllLogits(model, cpu, tokens, 7), 1e-4, 1e-5);
}

// A Llama-shaped model with head size 64 (the real models' flash path; the default model's
// 32 never reaches it) and grouped-query heads, random weights: 600 tokens in one prefill
// (flash kernel, fp16 tensor cores) and in chunks of 7 (split-KV over up to 600 keys, so
// several splits are merged), each against the CpuBackend.
TEST(CudaEngineLogits, LlamaHeadSize64FlashAndSplitKvWithinToleranceOfCpu) {
  KVLENS_REQUIRE_CUDA(cuda);
  const std::unique_ptr<Model> model =
      HeadSize64Model(kernels::RopeStyle::kAdjacentPairs, /*max_seq=*/640, /*seed=*/3);
  ASSERT_EQ(model->config.head_dim, 64);
  ExpectPrefillAndChunksCloseToCpu(*model, cuda, 600, 5);
}

// Qwen3's shape: an RMSNorm over each head of q and k before RoPE (in place, on the
// device), and 4 query heads of 64 over a residual stream of 128, so q and the attention
// output are twice the stream's width. One prefill (flash kernel) and chunks of 7.
TEST(CudaEngineLogits, Qwen3HeadNormsAndWideHeadsWithinToleranceOfCpu) {
  KVLENS_REQUIRE_CUDA(cuda);
  testing::TinySpec spec;
  spec.arch = Architecture::kLlama;
  spec.rope_style = kernels::RopeStyle::kHalfSplit;
  spec.dim = 128;
  spec.heads = 4;
  spec.kv_heads = 2;
  spec.head_dim = 64;
  spec.qk_norm = true;
  spec.hidden = 256;
  spec.vocab = 50;
  spec.max_seq = 128;
  spec.seed = 9;
  const std::unique_ptr<Model> model = testing::MakeTinyModel(spec);
  ASSERT_EQ(model->config.q_dim(), 256);
  ExpectPrefillAndChunksCloseToCpu(*model, cuda, 100, 6);
}

// Gemma's shape: a GELU(tanh)-gated feed-forward, embeddings times √128, and heads of 256
// (2 query heads over a stream of 128, one KV head), which the flash kernel does not take:
// split-KV attention in the prefill too. One prefill and chunks of 7; then Gemma 3's and
// Gemma 2's.
testing::TinySpec GemmaHeadSize256Spec() {
  testing::TinySpec spec;
  spec.arch = Architecture::kLlama;
  spec.rope_style = kernels::RopeStyle::kHalfSplit;
  spec.dim = 128;
  spec.heads = 2;
  spec.kv_heads = 1;
  spec.head_dim = 256;
  spec.gemma = true;
  spec.hidden = 256;
  spec.vocab = 50;
  spec.max_seq = 128;
  spec.seed = 12;
  return spec;
}

TEST(CudaEngineLogits, GemmaGeGluAndHeadSize256WithinToleranceOfCpu) {
  KVLENS_REQUIRE_CUDA(cuda);
  testing::TinySpec spec = GemmaHeadSize256Spec();
  const std::unique_ptr<Model> model = testing::MakeTinyModel(spec);
  ASSERT_EQ(model->config.q_dim(), 512);
  ExpectPrefillAndChunksCloseToCpu(*model, cuda, 100, 6);
  // Gemma 3: norms on each block's outputs and over each head of q and k, layer 0 within 20
  // keys (RoPE base 1e4), layer 1 over all of them (base 1e6), scores times 0.3.
  spec.gemma3 = true;
  spec.qk_norm = true;
  spec.window = 20;
  const std::unique_ptr<Model> gemma3 = testing::MakeTinyModel(spec);
  ASSERT_EQ(gemma3->config.WindowOf(1), 0);
  ExpectPrefillAndChunksCloseToCpu(*gemma3, cuda, 100, 6);
  // Gemma 2: scores soft-capped at 1 (split-KV in the prefill too), logits at 2.
  spec.gemma3 = false;
  spec.qk_norm = false;
  spec.gemma2 = true;
  spec.head_dim = 64;  // a size the flash kernels take, but not soft-capped
  const std::unique_ptr<Model> gemma2 = testing::MakeTinyModel(spec);
  ASSERT_GT(gemma2->config.attention_softcap, 0.0);
  ExpectPrefillAndChunksCloseToCpu(*gemma2, cuda, 100, 6);
}

// Every weight of `model` (f32: MakeTinyModel's) rounded to bf16, stored as bf16.
void ToBf16Weights(Model& model) {
  auto convert = [&](kernels::WeightView& w) {
    if (w.empty()) return;
    ASSERT_EQ(w.dtype, kernels::DType::kF32);
    const auto* src = static_cast<const float*>(w.data);
    auto bits = std::make_shared<std::vector<uint16_t>>(static_cast<size_t>(w.rows * w.cols));
    for (size_t i = 0; i < bits->size(); ++i) (*bits)[i] = kernels::F32ToBF16(src[i]);
    model.weights.storage.push_back(bits);
    w = kernels::WeightView{bits->data(), kernels::DType::kBF16, w.rows, w.cols};
  };
  Weights& wt = model.weights;
  for (kernels::WeightView* w : {&wt.token_embedding, &wt.final_norm, &wt.output}) convert(*w);
  for (LayerWeights& lw : wt.layers) {
    for (kernels::WeightView* w : {&lw.attn_norm, &lw.wq, &lw.wk, &lw.wv, &lw.wo, &lw.ffn_norm,
                                   &lw.w_in, &lw.w_up, &lw.w_out, &lw.q_norm, &lw.k_norm}) {
      convert(*w);
    }
  }
}

// HeadSize64Spec's Llama, and a Gemma (GeGLU) of that shape, on bf16 weights, decoded one
// and three tokens a step: the matvec then normalizes x itself (RmsNormMatMulMany,
// RmsNormMatMulSwiGlu/GeGlu) and adds each residual into x (MatMulAddTo), where the
// CpuBackend runs the norm, the products and the add one by one (the Backend defaults).
// The logits against the CpuBackend's on the same weights.
TEST(CudaEngineLogits, Bf16DecodeWithFusedNormsAndResidualsWithinToleranceOfCpu) {
  KVLENS_REQUIRE_CUDA(cuda);
  // Both models live to the end: the backend keys its weights' device copies by host
  // address, which a freed model's successor could reuse.
  std::vector<std::unique_ptr<Model>> models;
  for (bool gemma : {false, true}) {
    testing::TinySpec spec =
        HeadSize64Spec(kernels::RopeStyle::kHalfSplit, /*max_seq=*/64, /*seed=*/gemma ? 14 : 13);
    spec.gemma = gemma;
    models.push_back(testing::MakeTinyModel(spec));
    ToBf16Weights(*models.back());
  }
  for (const std::unique_ptr<Model>& model : models) {
    SCOPED_TRACE(model->config.gate_activation == GateActivation::kGeluTanh ? "gemma" : "llama");
    const std::vector<int32_t> tokens = RandomTokens(40, 8);
    kernels::CpuBackend cpu(2);
    for (int chunk : {1, 3}) {
      SCOPED_TRACE(chunk);
      ExpectClose(AllLogits(*model, cuda, tokens, chunk), AllLogits(*model, cpu, tokens, chunk),
                  1e-4, 1e-5);
    }
  }
}

// Mistral 7B v0.1's sliding window (here 50 positions over 300 tokens): one prefill (the
// flash kernel masks each tile to the rows' windows) and chunks of 7 (split-KV, most
// splits outside the window), each against the CpuBackend, whose window the oracle checks
// (tests/engine/model/golden_test.cc).
TEST(CudaEngineLogits, SlidingWindowWithinToleranceOfCpu) {
  KVLENS_REQUIRE_CUDA(cuda);
  testing::TinySpec spec;
  spec.arch = Architecture::kLlama;
  spec.rope_style = kernels::RopeStyle::kHalfSplit;
  spec.dim = 256;
  spec.heads = 4;
  spec.kv_heads = 2;
  spec.hidden = 384;
  spec.vocab = 50;
  spec.max_seq = 320;
  spec.window = 50;
  spec.seed = 10;
  const std::unique_ptr<Model> model = testing::MakeTinyModel(spec);
  ExpectPrefillAndChunksCloseToCpu(*model, cuda, 300, 7);
}

// Phi-3's fused projections: q, k and v as row views of one [QD + 2·KVD, D] tensor and gate
// and up of one [2F, D] tensor (the device copies are keyed by where each view starts), with
// a sliding window; against the same model on the CpuBackend.
TEST(CudaEngineLogits, Phi3FusedRowViewsWithinToleranceOfCpu) {
  KVLENS_REQUIRE_CUDA(cuda);
  testing::TinySpec spec;
  spec.arch = Architecture::kLlama;
  spec.rope_style = kernels::RopeStyle::kHalfSplit;
  spec.dim = 128;
  spec.heads = 4;
  spec.kv_heads = 2;
  spec.hidden = 192;
  spec.vocab = 50;
  spec.max_seq = 128;
  spec.window = 20;
  spec.seed = 11;
  const std::unique_ptr<Model> model = testing::MakeTinyModel(spec);
  const ModelConfig& c = model->config;
  for (LayerWeights& lw : model->weights.layers) {
    auto fuse = [&](std::initializer_list<kernels::WeightView*> parts) {
      auto buf = std::make_shared<std::vector<float>>();
      for (const kernels::WeightView* w : parts) {
        const float* p = static_cast<const float*>(w->data);
        buf->insert(buf->end(), p, p + w->rows * w->cols);
      }
      int64_t row = 0;
      for (kernels::WeightView* w : parts) {
        w->data = buf->data() + row * c.dim;
        row += w->rows;
      }
      model->weights.storage.push_back(buf);
    };
    fuse({&lw.wq, &lw.wk, &lw.wv});
    fuse({&lw.w_in, &lw.w_up});
    ASSERT_EQ(lw.wk.data, lw.wq.row(c.q_dim()));
  }
  ExpectPrefillAndChunksCloseToCpu(*model, cuda, 90, 8);
}

// One engine step over several sequences: three decode tokens and a 4-token chunk in one
// Forward (CudaBackend::AttentionBatch: one split-KV launch for them), after each
// sequence's prompt was prefilled on its own; against the same steps on the CpuBackend.
std::vector<float> BatchedStepLogits(const Model& model, kernels::Backend<float>& backend,
                                     kernels::KvDtype cache_dtype = kernels::KvDtype::kActivation) {
  const std::vector<std::vector<int32_t>> prompts = {
      model.tokenizer->Encode("In the beginning God created", false),
      model.tokenizer->Encode("And the LORD spake unto Moses, saying, Speak unto", false),
      model.tokenizer->Encode("Blessed are the meek: for they", false),
      model.tokenizer->Encode("The LORD is my shepherd; I shall not want.", false)};
  const int bs = 4;
  const int max_len = 64, per_seq = max_len / bs;
  auto cache = KvCacheStorage<float>::Create(backend.memory(), model.config.num_layers,
                                             static_cast<int>(prompts.size()) * per_seq * 2, bs,
                                             model.config.kv_dim(), true, cache_dtype);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return {};
  // Sequence s owns blocks s, s + 4, s + 8, … (interleaved), every other block stays NaN.
  std::vector<std::vector<int32_t>> tables(prompts.size());
  for (size_t s = 0; s < prompts.size(); ++s) {
    for (int b = 0; b < per_seq; ++b) {
      tables[s].push_back(static_cast<int32_t>(2 * (b * prompts.size() + s)));
    }
  }
  Transformer<float> tr(model, backend);
  // Prefill: all but the last token (the fourth sequence: all but its last 4).
  std::vector<int> held(prompts.size(), 1);
  held[3] = 4;
  for (size_t s = 0; s < prompts.size(); ++s) {
    BatchEntry e;
    e.tokens = absl::MakeConstSpan(prompts[s]).first(prompts[s].size() - held[s]);
    e.block_table = tables[s];
    ForwardOutput<float> out;
    EXPECT_TRUE(tr.Forward({&e, 1}, *cache, out).ok());
  }
  std::vector<BatchEntry> step(prompts.size());
  for (size_t s = 0; s < prompts.size(); ++s) {
    step[s].tokens = absl::MakeConstSpan(prompts[s]).last(held[s]);
    step[s].num_cached = static_cast<int>(prompts[s].size()) - held[s];
    step[s].block_table = tables[s];
    step[s].all_logits = true;
  }
  ForwardOutput<float> out;
  const absl::Status st = tr.Forward(step, *cache, out);
  EXPECT_TRUE(st.ok()) << st;
  return out.logits;
}

TEST(CudaEngineBatch, OneStepOverSeveralSequencesWithinToleranceOfCpu) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  kernels::CpuBackend cpu(2);
  const std::vector<float> want = BatchedStepLogits(*model, cpu);
  ASSERT_EQ(want.size(), size_t{7} * model->config.vocab_size);  // 3 decode rows + 4 chunk rows
  ExpectClose(BatchedStepLogits(*model, cuda), want, 1e-4, 1e-5);
}

// fp32 paths on a bf16 cache: CUDA's logits against the CpuBackend's on a bf16 cache
// differ by more than on a float cache, because a key or value that the two backends
// compute a float ulp apart can round to neighbouring bf16 values (2^-8 apart); those
// flips are rare, so the difference stays well below what the bf16 cache itself moves
// (the CpuBackend on a bf16 against a float cache). Measured on the emulator, split-KV
// chunks of 7: 1.2e-3 against 2.7e-2 moved (on float caches the backends differ by 7.5e-6).
void ExpectBf16CacheAgreement(const std::vector<float>& cuda_bf16,
                              const std::vector<float>& cpu_bf16,
                              const std::vector<float>& cpu_f32) {
  ASSERT_EQ(cuda_bf16.size(), cpu_bf16.size());
  ASSERT_EQ(cpu_f32.size(), cpu_bf16.size());
  double err = 0, moved = 0;
  for (size_t i = 0; i < cpu_bf16.size(); ++i) {
    ASSERT_TRUE(std::isfinite(cuda_bf16[i])) << "value " << i << " is " << cuda_bf16[i];
    err = std::max(err, std::abs(static_cast<double>(cuda_bf16[i]) - cpu_bf16[i]));
    moved = std::max(moved, std::abs(static_cast<double>(cpu_bf16[i]) - cpu_f32[i]));
  }
  std::cerr << "[ CUDA     ] bf16 cache: max error " << err << ", the cache type moves " << moved
            << "\n";
  EXPECT_GT(moved, 0.0);
  EXPECT_LE(err, moved / 4);
}

// A bf16 KV cache (--kv-cache-dtype bf16): the head-size-64 model's flash prefill (the
// bf16 flash kernel: Q and P rounded to bf16, within the float cache's flash tolerance)
// and split-KV chunks, and one batched step of the default model (AttentionBatch).
TEST(CudaEngineLogits, Bf16CacheWithinToleranceOfCpu) {
  KVLENS_REQUIRE_CUDA(cuda);
  constexpr auto kBf16 = kernels::KvDtype::kBF16;
  const std::unique_ptr<Model> model =
      HeadSize64Model(kernels::RopeStyle::kHalfSplit, /*max_seq=*/320, /*seed=*/4);
  const std::vector<int32_t> tokens = RandomTokens(300, 6);
  kernels::CpuBackend cpu(2);
  ExpectClose(AllLogits(*model, cuda, tokens, 300, kBf16),
              AllLogits(*model, cpu, tokens, 300, kBf16), 1e-2, 1e-3);
  ExpectBf16CacheAgreement(AllLogits(*model, cuda, tokens, 7, kBf16),
                           AllLogits(*model, cpu, tokens, 7, kBf16),
                           AllLogits(*model, cpu, tokens, 7));
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  auto bible = Load(testing::DefaultModelPath());
  ASSERT_NE(bible, nullptr);
  ExpectBf16CacheAgreement(BatchedStepLogits(*bible, cuda, kBf16),
                           BatchedStepLogits(*bible, cpu, kBf16), BatchedStepLogits(*bible, cpu));
}

TEST(CudaEngineDecode, IncrementalEqualsFullRecomputeOverANanCache) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  std::vector<int32_t> tokens =
      model->tokenizer->Encode("And God said, Let there be light: and there was light.", false);
  tokens.resize(std::min<size_t>(tokens.size(), 24));  // < 32: fp32 attention throughout
  // one prefill vs one token per step; unused (even) blocks hold NaN and must stay unread
  ExpectClose(AllLogits(*model, cuda, tokens, 1),
              AllLogits(*model, cuda, tokens, static_cast<int>(tokens.size())), 1e-4, 1e-5);
}

#ifdef KVLENS_HAVE_CUDA
// How the steps between two readings of a backend's graph statistics ran.
struct GraphRuns {
  int64_t steps, eager, captures, replays;
  bool operator==(const GraphRuns&) const = default;
  friend std::ostream& operator<<(std::ostream& os, const GraphRuns& r) {
    return os << "{steps " << r.steps << ", eager " << r.eager << ", captures " << r.captures
              << ", replays " << r.replays << "}";
  }
};
GraphRuns RunsBetween(const kernels::cuda::StepGraph::Stats& before,
                      const kernels::cuda::StepGraph::Stats& after) {
  return {after.steps - before.steps, after.eager - before.eager, after.captures - before.captures,
          after.replays - before.replays};
}

// Split-KV on tensor cores (SetSplitKvTensorCores) in the engine: the head-size-64 model's
// chunks of 7 tokens, and Gemma 2's at head size 256 (soft-capped scores, a sliding window
// on layer 0), on a bf16 cache (bf16 products) and on an fp32 one (fp16 products), each
// within the flash prefill's tolerance above (Q, K, P and V rounded alike) of the
// CpuBackend on the same cache; and not the fp32 kernel's logits, so the option took
// effect. (The default model's head size, 32, keeps the fp32 kernel.)
TEST(CudaEngineLogits, TensorCoreSplitKvWithinToleranceOfCpu) {
  KVLENS_REQUIRE_CUDA(cuda);
  auto* backend = dynamic_cast<kernels::cuda::CudaBackend*>(&cuda);
  ASSERT_NE(backend, nullptr);
  testing::TinySpec gemma2 = GemmaHeadSize256Spec();
  gemma2.gemma2 = true;
  gemma2.window = 20;
  gemma2.max_seq = 320;
  std::vector<std::unique_ptr<Model>> models;
  models.push_back(HeadSize64Model(kernels::RopeStyle::kHalfSplit, /*max_seq=*/320, /*seed=*/4));
  models.push_back(testing::MakeTinyModel(gemma2));
  ASSERT_GT(models[1]->config.attention_softcap, 0.0);
  ASSERT_EQ(models[1]->config.head_dim, 256);
  const std::vector<int32_t> tokens = RandomTokens(300, 6);
  kernels::CpuBackend cpu(2);
  for (const std::unique_ptr<Model>& model : models) {
    for (const kernels::KvDtype cache : {kernels::KvDtype::kBF16, kernels::KvDtype::kActivation}) {
      const std::vector<float> fp32_kernel = AllLogits(*model, cuda, tokens, 7, cache);
      backend->SetSplitKvTensorCores(true);
      const std::vector<float> tensor_cores = AllLogits(*model, cuda, tokens, 7, cache);
      backend->SetSplitKvTensorCores(false);
      ExpectClose(tensor_cores, AllLogits(*model, cpu, tokens, 7, cache), 1e-2, 1e-3);
      EXPECT_NE(tensor_cores, fp32_kernel);
    }
  }
}

// Prefill over an fp32 cache on an fp16 copy of its blocks (SetFlashF16Copy) in the engine:
// prompt chunks of 100 tokens over the NaN-filled cache in blocks of 7 that the earlier
// chunks wrote. The head-size-64 model's logits are the fp16 kernel's bits (both run
// 128-query blocks of 8 warps over 64-key tiles, and round alike); Gemma 2's at head size
// 256 (soft-capped scores, a window of 20 on layer 0; 32-key tiles on the copy, 64 on the
// fp16 kernel) are within the flash prefill's tolerance of the CpuBackend's.
TEST(CudaEngineLogits, FlashOnAnF16CopyGivesTheFp16KernelsLogits) {
  KVLENS_REQUIRE_CUDA(cuda);
  auto* backend = dynamic_cast<kernels::cuda::CudaBackend*>(&cuda);
  ASSERT_NE(backend, nullptr);
  const std::vector<int32_t> tokens = RandomTokens(300, 8);
  const auto head64 = HeadSize64Model(kernels::RopeStyle::kHalfSplit, /*max_seq=*/320, /*seed=*/5);
  const std::vector<float> fp16_kernel = AllLogits(*head64, cuda, tokens, 100);
  backend->SetFlashF16Copy(true);
  const std::vector<float> on_copy = AllLogits(*head64, cuda, tokens, 100);
  backend->SetFlashF16Copy(false);
  ASSERT_FALSE(fp16_kernel.empty());
  EXPECT_EQ(on_copy, fp16_kernel);

  testing::TinySpec gemma2 = GemmaHeadSize256Spec();
  gemma2.gemma2 = true;
  gemma2.window = 20;
  gemma2.max_seq = 320;
  const std::unique_ptr<Model> gemma = testing::MakeTinyModel(gemma2);
  ASSERT_EQ(gemma->config.head_dim, 256);
  backend->SetFlashF16Copy(true);
  const std::vector<float> gemma_on_copy = AllLogits(*gemma, cuda, tokens, 100);
  backend->SetFlashF16Copy(false);
  kernels::CpuBackend cpu(2);
  ExpectClose(gemma_on_copy, AllLogits(*gemma, cpu, tokens, 100), 1e-2, 1e-3);
  EXPECT_NE(gemma_on_copy, AllLogits(*gemma, cuda, tokens, 100));  // the copy ran
}

// Genesis 1:1-2 in the default model's tokens (more than 40).
std::vector<int32_t> GenesisTokens(const Model& model) {
  return model.tokenizer->Encode(
      "In the beginning God created the heaven and the earth. And the earth was without form, "
      "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
      "the face of the waters.",
      false);
}

// CUDA graphs in the engine's decode, one token a step (graphs are the backend's default).
// A recorded step pads each split-KV block table to a power of two of blocks, so with
// blocks of 7 tokens the steps with 1–7, 8–14, 15–28 and 29–40 keys make four different
// steps: each runs launch by launch the first time, is captured the second and replayed
// from then on (36 of 40 steps by a graph). Their logits equal the same steps' without
// graphs; a replay that read a stale token, position, cache row or key count would not.
TEST(CudaEngineGraphs, DecodeStepsReplayFourGraphsAndEqualStepsWithoutGraphs) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto* backend = dynamic_cast<kernels::cuda::CudaBackend*>(&cuda);
  ASSERT_NE(backend, nullptr);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  std::vector<int32_t> tokens = GenesisTokens(*model);
  ASSERT_GE(tokens.size(), 40u);
  tokens.resize(40);
  const kernels::cuda::StepGraph::Stats s0 = backend->graph_stats();
  const std::vector<float> with = AllLogits(*model, cuda, tokens, 1);
  const kernels::cuda::StepGraph::Stats s1 = backend->graph_stats();
  EXPECT_EQ(RunsBetween(s0, s1), (GraphRuns{40, 4, 4, 36}));
  EXPECT_EQ(s1.capture_failures, 0);
  backend->SetCudaGraphs(false);
  ExpectClose(with, AllLogits(*model, cuda, tokens, 1), 1e-6, 0);
  EXPECT_EQ(backend->graph_stats().steps, s1.steps);  // nothing recorded
  EXPECT_EQ(backend->graph_stats().graphs, 0);        // and the graphs destroyed
}

// Steered decode steps are recorded as any other: vectors at layer 1's resid_pre from
// position 0 and from 30, and at layer 2's resid_mid from 20. The new point at 20 and the
// padded tables (7-token blocks: 1–7, 8–14, 15–28, 29–40 keys) make five different steps,
// and at 30 the rows added at layer 1 change within one graph: 5 eager runs, 5 captures
// and 35 steps run by a graph (the captured ones too), each adding its own step's rows:
// the logits equal those of the same steps without graphs and stay within the batch
// test's tolerance of the CPU backend's.
TEST(CudaEngineGraphs, SteeredDecodeStepsReplayGraphsWithEachStepsRows) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto* backend = dynamic_cast<kernels::cuda::CudaBackend*>(&cuda);
  ASSERT_NE(backend, nullptr);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  ASSERT_GE(model->config.num_layers, 3);
  std::vector<int32_t> tokens = GenesisTokens(*model);
  ASSERT_GE(tokens.size(), 40u);
  tokens.resize(40);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  auto vector = [&] {
    std::vector<float> v(static_cast<size_t>(model->config.dim));
    for (float& x : v) x = normal(rng);
    return v;
  };
  const std::vector<ResidualAdd> adds = {
      {1, false, vector(), 0}, {2, true, vector(), 20}, {1, false, vector(), 30}};
  const kernels::cuda::StepGraph::Stats s0 = backend->graph_stats();
  const std::vector<float> with =
      AllLogits(*model, cuda, tokens, 1, kernels::KvDtype::kActivation, adds);
  const kernels::cuda::StepGraph::Stats s1 = backend->graph_stats();
  EXPECT_EQ(RunsBetween(s0, s1), (GraphRuns{40, 5, 5, 35}));
  EXPECT_EQ(s1.capture_failures, 0);
  kernels::CpuBackend cpu(2);
  const std::vector<float> want =
      AllLogits(*model, cpu, tokens, 1, kernels::KvDtype::kActivation, adds);
  ExpectClose(with, want, 1e-4, 1e-5);
  backend->SetCudaGraphs(false);
  ExpectClose(with, AllLogits(*model, cuda, tokens, 1, kernels::KvDtype::kActivation, adds), 1e-6,
              0);
  // The vector from 30 moves the logits: replaying step 29's rows would be seen.
  const std::vector<ResidualAdd> first_two(adds.begin(), adds.begin() + 2);
  const std::vector<float> without_third =
      AllLogits(*model, cpu, tokens, 1, kernels::KvDtype::kActivation, first_two);
  ASSERT_EQ(without_third.size(), want.size());
  const size_t V = static_cast<size_t>(model->config.vocab_size);
  double moved = 0;
  for (size_t i = 30 * V; i < 40 * V; ++i) {
    moved = std::max(moved, std::abs(static_cast<double>(want[i]) - without_third[i]));
  }
  EXPECT_GT(moved, 0.1);
}

// Four sequences prefilled one by one, then 10 decode steps with fixed inputs: 6 of the
// first three sequences, then 4 of all four. Every logit row, in step order; with `rows`,
// each decode step also captures the second sequence's last query rows at layers 1 and 3,
// appended to *rows.
std::vector<float> DecodeThreeThenFour(const Model& model, kernels::Backend<float>& backend,
                                       const std::function<void()>& before_decode,
                                       std::vector<float>* rows = nullptr) {
  const std::vector<std::vector<int32_t>> prompts = {
      model.tokenizer->Encode("In the beginning God created", false),
      model.tokenizer->Encode("And the LORD spake unto Moses, saying", false),
      model.tokenizer->Encode("Blessed are the meek", false),
      model.tokenizer->Encode("The LORD is my shepherd", false)};
  const int bs = 32;  // every sequence stays within its one block: one padded table size
  auto cache = KvCacheStorage<float>::Create(backend.memory(), model.config.num_layers, 8, bs,
                                             model.config.kv_dim(), true);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return {};
  std::vector<std::vector<int32_t>> tables = {{1}, {3}, {5}, {7}};  // even blocks stay NaN
  std::vector<int> len(prompts.size());
  Transformer<float> tr(model, backend);
  for (size_t q = 0; q < prompts.size(); ++q) {
    BatchEntry e;
    e.tokens = prompts[q];
    e.block_table = tables[q];
    ForwardOutput<float> out;
    EXPECT_TRUE(tr.Forward({&e, 1}, *cache, out).ok());
    len[q] = static_cast<int>(prompts[q].size());
  }
  before_decode();
  std::vector<float> all;
  std::vector<int32_t> next(prompts.size());
  for (int t = 0; t < 10; ++t) {
    const int active = t < 6 ? 3 : 4;
    std::vector<BatchEntry> step(active);
    for (int q = 0; q < active; ++q) {
      next[q] = static_cast<int32_t>((37 * t + 11 * q + 5) % model.config.vocab_size);
      step[q].tokens = {&next[q], 1};
      step[q].num_cached = len[q]++;
      step[q].block_table = tables[q];
    }
    ForwardOutput<float> out;
    std::vector<AttentionCapture<float>> captures;
    if (rows != nullptr) {
      captures.push_back({.entry = 1, .layers = {1, 3}, .last_query_only = true});
    }
    const absl::Status st = tr.Forward(step, *cache, out, absl::MakeSpan(captures));
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(out.logits.size(), size_t(active) * model.config.vocab_size);  // no padding row
    all.insert(all.end(), out.logits.begin(), out.logits.end());
    for (const AttentionCapture<float>& c : captures) {
      EXPECT_EQ(c.probs[1].size(), size_t(model.config.num_heads) * len[1]);
      for (int l : {1, 3}) rows->insert(rows->end(), c.probs[l].begin(), c.probs[l].end());
    }
  }
  return all;
}

// With graphs, a decode step of 3 sequences is padded to 4 rows (PaddedDecodeRows), so
// the steps of 3 and of 4 sequences are one step to the graph cache: of the 10 decode
// steps 1 runs eagerly, 1 is captured and 9 are run by that graph. The padding row reads
// a real key and stores nothing: every sequence's logits stay within the batch test's
// tolerance of the CPU backend, which does not pad.
TEST(CudaEngineGraphs, DecodeBatchesOfThreeAndFourShareOnePaddedGraph) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto* backend = dynamic_cast<kernels::cuda::CudaBackend*>(&cuda);
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(cuda.PaddedDecodeRows(3), 4);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  kernels::CpuBackend cpu(2);
  EXPECT_EQ(cpu.PaddedDecodeRows(3), 3);
  const std::vector<float> want = DecodeThreeThenFour(*model, cpu, [] {});
  kernels::cuda::StepGraph::Stats s0;
  const std::vector<float> got =
      DecodeThreeThenFour(*model, cuda, [&] { s0 = backend->graph_stats(); });
  const kernels::cuda::StepGraph::Stats s1 = backend->graph_stats();
  EXPECT_EQ(RunsBetween(s0, s1), (GraphRuns{10, 1, 1, 9}));
  ExpectClose(got, want, 1e-4, 1e-5);
}

// A request streaming attention rows in the batch (its last query rows at layers 1 and 3)
// leaves the steps recorded and padded: the queries are saved in the step and their
// attention runs again after it, so the padded steps of three and four sequences are one
// graph as without rows (1 eager run, 1 capture, 9 replays), and the rows (against keys
// the step stored) and the logits stay within 1e-5 and the batch test's tolerance of the
// CPU backend's.
TEST(CudaEngineGraphs, StepsCapturingLastQueryRowsArePaddedAndReplayed) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto* backend = dynamic_cast<kernels::cuda::CudaBackend*>(&cuda);
  ASSERT_NE(backend, nullptr);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  ASSERT_GE(model->config.num_layers, 4);
  kernels::CpuBackend cpu(2);
  std::vector<float> want_rows, got_rows;
  const std::vector<float> want = DecodeThreeThenFour(
      *model, cpu, [] {}, &want_rows);
  kernels::cuda::StepGraph::Stats s0;
  const std::vector<float> got = DecodeThreeThenFour(
      *model, cuda, [&] { s0 = backend->graph_stats(); }, &got_rows);
  const kernels::cuda::StepGraph::Stats s1 = backend->graph_stats();
  EXPECT_EQ(RunsBetween(s0, s1), (GraphRuns{10, 1, 1, 9}));
  ExpectClose(got, want, 1e-4, 1e-5);
  ASSERT_EQ(got_rows.size(), want_rows.size());
  ASSERT_GT(want_rows.size(), size_t{20} * model->config.num_heads);  // 10 steps, 2 layers
  for (size_t i = 0; i < got_rows.size(); ++i) {
    ASSERT_NEAR(got_rows[i], want_rows[i], 1e-5) << "value " << i;
  }
}

// Programmatic dependent launch (kernels/cuda/launch.h): a kernel may be scheduled before
// the one before it has finished, but waits for it before it touches memory, so nothing a
// step computes changes: the default model's prefill in one call (the flash kernel) and
// batched decode steps run as graphs give the same logits with it on and off. (On the
// emulator kernels run one after another; there, every kernel launched this way must call
// griddepcontrol.wait before it exits, or its launch fails.)
TEST(CudaEngineGraphs, ProgrammaticLaunchesLeaveTheLogitsUnchanged) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto* backend = dynamic_cast<kernels::cuda::CudaBackend*>(&cuda);
  ASSERT_NE(backend, nullptr);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  std::vector<int32_t> tokens = GenesisTokens(*model);
  ASSERT_GE(tokens.size(), 34u);
  tokens.resize(34);                                    // >= kFlashMinQueries: the flash kernel
  ASSERT_FALSE(kernels::cuda::ProgrammaticLaunches());  // the default
  const std::vector<float> prefill_off = AllLogits(*model, cuda, tokens, 34);
  const std::vector<float> decode_off = DecodeThreeThenFour(*model, cuda, [] {});
  backend->SetProgrammaticLaunches(true);
  EXPECT_TRUE(kernels::cuda::ProgrammaticLaunches());
  const std::vector<float> prefill_on = AllLogits(*model, cuda, tokens, 34);
  const std::vector<float> decode_on = DecodeThreeThenFour(*model, cuda, [] {});
  backend->SetProgrammaticLaunches(false);
  ExpectClose(prefill_on, prefill_off, 1e-6, 0);
  ExpectClose(decode_on, decode_off, 1e-6, 0);
}

// Split-KV's options in recorded, replayed decode steps: merging its own splits
// (SetSplitKvFusedCombine), with and without programmatic launches, and 16-warp blocks
// (SetSplitKvWarps, whose launches' signature carries the warps), with the combine launch
// and fused. The same logits as the defaults' (the same arithmetic, so within 1e-6: past
// 16 keys a split, 16-warp blocks would give the warps other keys and round apart, but
// these prompts' splits have fewer).
TEST(CudaEngineGraphs, SplitKvOptionsLeaveTheLogitsUnchanged) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto* backend = dynamic_cast<kernels::cuda::CudaBackend*>(&cuda);
  ASSERT_NE(backend, nullptr);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  ASSERT_FALSE(backend->split_kv_fused_combine());  // the default
  ASSERT_TRUE(backend->SetSplitKvSplits(6).ok());   // splits on any device's SM count
  const std::vector<float> separate = DecodeThreeThenFour(*model, cuda, [] {});
  backend->SetSplitKvFusedCombine(true);
  const std::vector<float> fused = DecodeThreeThenFour(*model, cuda, [] {});
  backend->SetProgrammaticLaunches(true);
  const std::vector<float> fused_pdl = DecodeThreeThenFour(*model, cuda, [] {});
  backend->SetProgrammaticLaunches(false);
  ASSERT_TRUE(backend->SetSplitKvWarps(kernels::cuda::kSplitKvWideWarps).ok());
  const std::vector<float> wide_fused = DecodeThreeThenFour(*model, cuda, [] {});
  backend->SetSplitKvFusedCombine(false);
  const std::vector<float> wide = DecodeThreeThenFour(*model, cuda, [] {});
  ASSERT_TRUE(backend->SetSplitKvWarps(kernels::cuda::kSplitKvWarps).ok());
  ASSERT_TRUE(backend->SetSplitKvSplits(0).ok());
  ExpectClose(fused, separate, 1e-6, 0);
  ExpectClose(fused_pdl, separate, 1e-6, 0);
  ExpectClose(wide, separate, 1e-6, 0);
  ExpectClose(wide_fused, separate, 1e-6, 0);
}

// Continuous batching on the GPU: five requests submitted together, with different
// prompts and lengths, so the decode batch shrinks from five to one as they finish (steps
// padded to 8, 4, 2 and 1 rows with graphs) and prompts are prefilled beside decodes.
// Each request's greedy text equals the CPU engine's, which neither pads nor uses graphs,
// and so does the log-probability of every token, within 1e-4 (fp32 decode both sides).
TEST(CudaEngineGraphs, ConcurrentRequestsThroughTheEngineEqualCpu) {
  KVLENS_REQUIRE_FILE(kStories);
  KVLENS_REQUIRE_CUDA(cuda);
  auto* backend = dynamic_cast<kernels::cuda::CudaBackend*>(&cuda);
  ASSERT_NE(backend, nullptr);
  auto model = Load(kStories);
  ASSERT_NE(model, nullptr);
  const std::vector<std::string> prompts = {"Once upon a time", "The cat", "Lily and Ben went",
                                            "One day, a little", "Tom had a big red"};
  std::vector<std::vector<float>> logprobs;
  auto serve = [&](kernels::Backend<float>& b) {
    Engine engine(*model, b, EngineOptions{});
    EXPECT_TRUE(engine.status().ok()) << engine.status();
    std::vector<std::string> texts(prompts.size());
    logprobs.assign(prompts.size(), {});
    std::vector<std::promise<void>> done(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      GenerationRequest r;
      r.prompt = model->tokenizer->Encode(prompts[i], true);
      r.stop.max_new_tokens = 12 + 7 * static_cast<int>(i);
      r.stop.ignore_eos = true;
      r.callbacks.on_token = [&texts, &logprobs, i](const TokenEvent& e) {
        texts[i] += e.text;
        logprobs[i].push_back(e.logprob);
      };
      r.callbacks.on_finish = [&texts, &done, i](const FinishEvent& e) {
        texts[i] += e.text;
        done[i].set_value();
      };
      EXPECT_TRUE(engine.Submit(std::move(r)).ok());
    }
    for (auto& d : done) d.get_future().wait();
    return texts;
  };
  kernels::CpuBackend cpu(2);
  const std::vector<std::string> want = serve(cpu);
  const std::vector<std::vector<float>> want_logprobs = logprobs;
  const kernels::cuda::StepGraph::Stats s0 = backend->graph_stats();
  const std::vector<std::string> got = serve(cuda);
  const kernels::cuda::StepGraph::Stats s1 = backend->graph_stats();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[i], want[i]) << "request " << i << " (" << prompts[i] << ")";
    EXPECT_GE(want[i].size(), size_t{20}) << want[i];
    ASSERT_EQ(logprobs[i].size(), want_logprobs[i].size());
    for (size_t t = 0; t < logprobs[i].size(); ++t) {
      EXPECT_NEAR(logprobs[i][t], want_logprobs[i][t], 1e-4) << "request " << i << ", token " << t;
    }
  }
  const int64_t steps = s1.steps - s0.steps, replays = s1.replays - s0.replays;
  std::cerr << "[ CUDA     ] " << steps << " steps, " << replays << " run by a graph, "
            << s1.captures - s0.captures << " captures\n";
  EXPECT_GT(2 * replays, steps) << "most steps should be run by a graph";
}
#endif

// Interpretability on the GPU: the tape's forward through a StagedBackend over the CUDA
// backend (matrix products, norms, RoPE, activations on the device; the tape's own
// attention loop on the host) and its backward with the products' input gradients and the
// attention backward on the device, against the same tape and backward on the CpuBackend:
// logits, every layer's attention probabilities, and the gradients of a log-probability
// (input embeddings, Q/K/V, scores) within 1e-4 of the largest value (fp32 both sides).
void ExpectCloseNamed(const std::vector<float>& a, const std::vector<float>& b, double rel,
                      const char* what) {
  SCOPED_TRACE(what);
  ExpectClose(a, b, rel, 1e-6);
}

TEST(CudaEngineInterpret, DefaultModelTapeAndGradientsWithinToleranceOfCpu) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  KVLENS_REQUIRE_CUDA(cuda);
  auto model = Load(testing::DefaultModelPath());
  ASSERT_NE(model, nullptr);
  interpret::SequenceInput<float> in;
  in.tokens =
      model->tokenizer->Encode("And God said, Let there be light: and there was light.", false);
  ASSERT_GE(in.tokens.size(), 8u);
  kernels::CpuBackend cpu(2), host(1);
  // The backward's heavy ops too, when the backend has them (CudaBackend does).
  kernels::StagedBackend staged(cuda, host, dynamic_cast<kernels::BackwardOps<float>*>(&cuda));
  auto want = interpret::RunForward(*model, cpu, in);
  auto got = interpret::RunForward(*model, staged, in);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectCloseNamed(got->logits, want->logits, 1e-4, "logits");
  for (int l = 0; l < model->config.num_layers; ++l) {
    ExpectCloseNamed(got->layers[l].probs, want->layers[l].probs, 1e-4, "probs");
  }
  const int last = static_cast<int>(in.tokens.size()) - 1;
  const interpret::Objective o = interpret::Objective::LogProb({{last - 1, in.tokens[last]}});
  auto gw = interpret::ObjectiveGradients(*model, *want, o);
  auto gg = interpret::ObjectiveGradients(*model, *got, o, {}, &staged);
  ASSERT_TRUE(gw.ok()) << gw.status();
  ASSERT_TRUE(gg.ok()) << gg.status();
  ExpectCloseNamed(gg->embeddings(), gw->embeddings(), 1e-4, "d embeddings");
  for (int l = 0; l < model->config.num_layers; ++l) {
    ExpectCloseNamed(gg->q[l], gw->q[l], 1e-4, "dQ");
    ExpectCloseNamed(gg->k[l], gw->k[l], 1e-4, "dK");
    ExpectCloseNamed(gg->v[l], gw->v[l], 1e-4, "dV");
    ExpectCloseNamed(gg->scores[l], gw->scores[l], 1e-4, "dS");
  }
}

}  // namespace
}  // namespace kvlens
