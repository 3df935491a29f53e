// The engine's device path on a CPU-only machine: FakeDeviceBackend computes with the CPU
// kernels but its memory is "not host-accessible", so the Transformer copies logits and
// attention captures out, the KV cache is NaN-filled by Memset and read back through
// CopyRowsToHost. Results must equal the plain CPU path bitwise (same kernels, same
// order); only the copies differ. The CUDA backend takes this same path (CudaEngine*).
#include <future>
#include <memory>

#include "engine/engine.h"
#include "engine/generator.h"
#include "engine/interpret/kv_probe.h"
#include "engine/model/model.h"
#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/engine/serve_together.h"
#include "tests/engine/stories_model_test.h"
#include "tests/kernels/fake_device_backend.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

class DeviceMemoryPathTest : public testing::StoriesModelTest {
 protected:
  void SetUp() override {
    StoriesModelTest::SetUp();
    if (NoModel()) return;
    prompt_ = model_->tokenizer->Encode("Once upon a time", true);
  }

  struct Run {
    std::vector<int32_t> tokens;
    std::vector<std::vector<float>> attention;  // per token
    std::vector<float> prefix_k0;               // the session's layer-0 keys, read back
  };
  // One greedy request on a session with attention rows of layer 1, heads 0 and 3, then
  // the session's cached keys through ReadSession + InputFromCache.
  Run Serve(kernels::Backend<float>& backend) {
    Run run;
    EngineOptions o;
    o.block_size = 7;
    Engine engine(*model_, backend, o);
    EXPECT_TRUE(engine.status().ok()) << engine.status();
    auto session = engine.OpenSession();
    EXPECT_TRUE(session.ok()) << session.status();
    GenerationRequest r;
    r.prompt = prompt_;
    r.stop.max_new_tokens = 12;
    r.stop.ignore_eos = true;
    r.session = *session;
    r.attention_rows = {{1}, {0, 3}};
    std::promise<void> done;
    r.callbacks.on_token = [&](const TokenEvent& e) {
      run.tokens.push_back(e.token);
      run.attention.push_back(e.attention);
    };
    r.callbacks.on_finish = [&](const FinishEvent&) { done.set_value(); };
    auto id = engine.Submit(std::move(r));
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return run;
    done.get_future().wait();
    absl::Status read;
    for (int i = 0; i < 200; ++i) {  // the session is released right after on_finish
      read = engine.ReadSession(*session, [&](const Engine::SessionView& v) {
        interpret::KvProbeRequest kr;
        kr.block_table = v.block_table;
        kr.num_cached = v.num_cached;
        const int32_t one = 1;
        kr.new_tokens = absl::MakeConstSpan(&one, 1);
        auto in = interpret::InputFromCache(model_->config, *v.cache, kr);
        EXPECT_TRUE(in.ok()) << in.status();
        if (in.ok()) run.prefix_k0 = in->prefix_k[0];
      });
      if (read.code() != absl::StatusCode::kFailedPrecondition) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_TRUE(read.ok()) << read;
    return run;
  }

  std::vector<int32_t> prompt_;
};

// Generate on a device backend takes each token from Backend::DrawTokens (greedy, then a
// seeded draw at temperature 1.5 with top-p, its uniform number reserved from the
// sampler's generator, greedy with a logit bias, and a seeded draw with a repetition
// penalty over the counts of the tokens so far): the CPU's tokens every time.
TEST_F(DeviceMemoryPathTest, GenerateEqualsCpuGreedySampledAndPenalised) {
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE(variant);
    GenerateOptions o;
    o.max_new_tokens = 30;
    o.stop_at_eos = false;
    o.block_size = 5;
    if (variant == 1) o.sampling.temperature = 1.5, o.sampling.top_p = 0.95, o.sampling.seed = 3;
    if (variant == 2) o.sampling.temperature = 1.5, o.sampling.repetition_penalty = 1.3;
    if (variant == 3) o.sampling.logit_bias = {{13, 4.0f}, {0, -100.0f}};
    kernels::CpuBackend cpu(1);
    testing::FakeDeviceBackend device(1);
    auto want = Generate<float>(*model_, cpu, prompt_, o);
    auto got = Generate<float>(*model_, device, prompt_, o);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->tokens, want->tokens);
    EXPECT_GT(device.fake_memory().memsets.load(), 0);          // NaN fill without host writes
    EXPECT_GE(device.fake_memory().copies_to_host.load(), 30);  // a row (or a pick) a step
    EXPECT_EQ(device.pick_rows.load(), 30);
    EXPECT_EQ(device.drawn_rows.load(), variant == 1 || variant == 2 ? 30 : 0);
    // (the first step's counts are the prompt's: its penalty applies from the start)
    EXPECT_EQ(device.penalized_rows.load(), variant == 2 ? 30 : 0);
  }
}

TEST_F(DeviceMemoryPathTest, EngineEqualsCpuWithAttentionRowsAndSessionReadBack) {
  kernels::CpuBackend cpu(1);
  testing::FakeDeviceBackend device(1);
  const Run want = Serve(cpu);
  const Run got = Serve(device);
  ASSERT_EQ(want.tokens.size(), 12u);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.attention, want.attention);
  ASSERT_FALSE(want.attention[0].empty());
  ASSERT_FALSE(want.prefix_k0.empty());
  EXPECT_EQ(got.prefix_k0, want.prefix_k0);
}

// Three requests streaming different attention rows (layers and heads) beside one that
// streams none, served together, their rows captured in the step they share: on the
// device the same tokens, log-probabilities and rows as on the CPU, bit for bit; and on
// the CPU each request's tokens and rows are those it streams alone (within 1e-6: a
// batched attention call against one), the plain one's too.
TEST_F(DeviceMemoryPathTest, RequestsStreamingRowsTogetherEqualCpuAndEachAlone) {
  kernels::CpuBackend cpu(1);
  testing::FakeDeviceBackend device(1);
  const std::vector<AttentionRowsRequest> rows = {
      {{1}, {0, 3}}, {{0, 4}, {7}}, {}, {{4, 2}, {1, 2, 5}}};
  const char* prompts[] = {"Once upon a time", "The cat", "Lily wanted to", "One day, a"};
  std::vector<GenerationRequest> requests;
  for (size_t i = 0; i < rows.size(); ++i) {
    GenerationRequest r;
    r.prompt = model_->tokenizer->Encode(prompts[i], true);
    r.stop.max_new_tokens = 10;
    r.stop.ignore_eos = true;
    r.attention_rows = rows[i];
    requests.push_back(r);
  }
  const std::vector<testing::Served> want = testing::ServeTogether(*model_, cpu, requests);
  const std::vector<testing::Served> got = testing::ServeTogether(*model_, device, requests);
  ASSERT_EQ(want.size(), requests.size());
  ASSERT_EQ(got.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    ASSERT_EQ(want[i].tokens.size(), 10u);
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    EXPECT_EQ(got[i].logprobs, want[i].logprobs);
    EXPECT_EQ(got[i].attention, want[i].attention);
    const size_t per_key = rows[i].layers.size() * rows[i].heads.size();
    const testing::Served alone = testing::ServeTogether(*model_, cpu, {requests[i]})[0];
    ASSERT_EQ(alone.tokens, want[i].tokens);
    for (size_t t = 0; t < want[i].tokens.size(); ++t) {
      const std::vector<float>& a = want[i].attention[t];
      ASSERT_EQ(a.size(), alone.attention[t].size()) << "token " << t;
      EXPECT_EQ(a.size(), per_key * (requests[i].prompt.size() + t)) << "token " << t;
      for (size_t k = 0; k < a.size(); ++k) {
        ASSERT_NEAR(a[k], alone.attention[t][k], 1e-6) << "token " << t << ", " << k;
      }
    }
  }
}

// Steered requests (one at resid_pre from position 0, one at resid_mid and, from position
// 6, before the final norm) beside an unsteered one: on device memory the default
// Backend::AddRows uploads a dense copy of each point's rows and adds it, which adds the
// same values as the host path (zero where no row is indexed), so the tokens and
// log-probabilities equal the CPU's bitwise, and the steering changes the tokens.
TEST_F(DeviceMemoryPathTest, SteeredRequestsEqualCpu) {
  kernels::CpuBackend cpu(1);
  testing::FakeDeviceBackend device(1);
  const int D = model_->config.dim, L = model_->config.num_layers;
  auto vector = [&](float scale) {
    std::vector<float> v(static_cast<size_t>(D));
    for (int d = 0; d < D; ++d) v[static_cast<size_t>(d)] = scale * float((d * 37) % 11 - 5);
    return v;
  };
  std::vector<GenerationRequest> requests(3);
  for (GenerationRequest& r : requests) {
    r.prompt = prompt_;
    r.stop.max_new_tokens = 10;
    r.stop.ignore_eos = true;
  }
  requests[1].steering = {{0, false, vector(0.8f)}};
  requests[2].steering = {{1, true, vector(-0.6f)}, {L, false, vector(0.5f), 6}};
  const std::vector<testing::Served> want = testing::ServeTogether(*model_, cpu, requests);
  const std::vector<testing::Served> got = testing::ServeTogether(*model_, device, requests);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    ASSERT_EQ(want[i].tokens.size(), 10u);
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    EXPECT_EQ(got[i].logprobs, want[i].logprobs);
  }
  EXPECT_NE(want[1].tokens, want[0].tokens);
  EXPECT_NE(want[2].tokens, want[0].tokens);
}

// Every request takes the device's pick (no logits row copied out): a plain greedy one,
// one with top log-probabilities, one with a repetition penalty (and frequency and
// presence penalties), a seeded temperature draw with top-p, whose uniform number the
// engine reserves from the request's generator before the step, and a greedy one with a
// logit bias. Served together: the same tokens and top log-probabilities as the CPU path
// (the same kernels and the same draws, so bitwise), and log-probabilities within 1e-6.
TEST_F(DeviceMemoryPathTest, GreedyPicksAndLogitRowsInOneBatchEqualCpu) {
  std::vector<GenerationRequest> requests(5);
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerationRequest& r = requests[i];
    r.prompt = prompt_;
    r.stop.max_new_tokens = 10 + static_cast<int>(i);
    r.stop.ignore_eos = true;
    if (i == 1) r.top_logprobs = 3;
    if (i == 2) {
      r.sampling.repetition_penalty = 1.3, r.sampling.frequency_penalty = 0.5;
      r.sampling.presence_penalty = 0.25;
    }
    if (i == 3) r.sampling.temperature = 1.5, r.sampling.top_p = 0.95, r.sampling.seed = 5;
    if (i == 4) r.sampling.logit_bias = {{13, 6.0f}, {13, 4.0f}, {0, -100.0f}};
  }
  kernels::CpuBackend cpu(1);
  testing::FakeDeviceBackend device(1);
  const std::vector<testing::Served> want = testing::ServeTogether(*model_, cpu, requests);
  const std::vector<testing::Served> got = testing::ServeTogether(*model_, device, requests);
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_EQ(want[i].tokens.size(), 10 + i);
    EXPECT_EQ(got[i].tokens, want[i].tokens);
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
    for (size_t t = 0; t < want[i].logprobs.size(); ++t) {
      EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], 1e-6) << "token " << t;
    }
    ASSERT_EQ(got[i].top.size(), want[i].top.size());
    for (size_t t = 0; t < want[i].top.size(); ++t) {
      ASSERT_EQ(got[i].top[t].size(), want[i].top[t].size());
      for (size_t j = 0; j < want[i].top[t].size(); ++j) {
        EXPECT_EQ(got[i].top[t][j].token, want[i].top[t][j].token);
        EXPECT_EQ(got[i].top[t][j].logprob, want[i].top[t][j].logprob);
      }
    }
  }
  EXPECT_EQ(want[1].top[0].size(), 3u);
  EXPECT_NE(want[4].tokens, want[0].tokens);  // the bias changed the greedy text
  EXPECT_NE(want[2].tokens, want[0].tokens);  // and so did the penalties
  // Every row: the 10 + … + 14 tokens; request 3's 13 drawn at a temperature and
  // request 2's 12 with its penalties, on the "device".
  EXPECT_EQ(device.pick_rows.load(), 60);
  EXPECT_EQ(device.drawn_rows.load(), 13);
  EXPECT_EQ(device.penalized_rows.load(), 12);
  EXPECT_EQ(device.top_rows.load(), 11);     // request 1's tokens, with their top 3
  EXPECT_EQ(device.biased_rows.load(), 14);  // request 4's, with its logit bias
}

TEST_F(DeviceMemoryPathTest, ForwardRejectsACacheInOtherMemory) {
  testing::FakeDeviceBackend device(1);
  Transformer<float> tr(*model_, device);
  KvCacheStorage<float> host_cache(model_->config.num_layers, 4, 16, model_->config.kv_dim(), true);
  const std::vector<int32_t> table = {0};
  BatchEntry e{absl::MakeConstSpan(prompt_), 0, table};
  ForwardOutput<float> out;
  const absl::Status s = tr.Forward({&e, 1}, host_cache, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("host"), std::string_view::npos) << s;
  EXPECT_NE(s.message().find("fake-device"), std::string_view::npos) << s;
}

}  // namespace
}  // namespace kvlens
