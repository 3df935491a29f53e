// The offline generator's per-token log-probabilities (GenerateResult::logprobs and
// top_logprobs, kvlens-cli generate --logprobs) on stories260K: each generated token's is
// the double-precision reference backend's, from one forward over the prompt and the
// generated tokens, log-softmaxed here; greedy and at a temperature (the model's
// log-probability, not the draw's), on the CPU and on a device's draws.
#include "engine/generator.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/stories_model_test.h"
#include "tests/kernels/fake_device_backend.h"

namespace kvlens {
namespace {

class GeneratorLogprobsTest : public testing::StoriesModelTest {
 protected:
  // Every generated token's log-probability within 5e-5 of the reference's log-softmax
  // (an fp32 forward), and its `top` most likely tokens the reference's while their
  // neighbours are more than 1e-4 apart.
  void ExpectReference(const std::vector<int32_t>& prompt, const GenerateResult& got,
                       int top) const {
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), got.tokens.begin(), got.tokens.end());
    const int n = static_cast<int>(all.size());
    KvCacheStorage<double> cache(model_->config.num_layers, 1, n, model_->config.kv_dim(), true);
    const std::vector<int32_t> table = {0};
    kernels::ReferenceBackend reference;
    Transformer<double> tr(*model_, reference);
    BatchEntry e{all, 0, table, /*all_logits=*/true};
    ForwardOutput<double> out;
    ASSERT_TRUE(tr.Forward({&e, 1}, cache, out).ok());
    const int64_t V = model_->config.vocab_size;
    ASSERT_EQ(got.logprobs.size(), got.tokens.size());
    ASSERT_EQ(got.top_logprobs.size(), top > 0 ? got.tokens.size() : 0u);
    for (size_t i = 0; i < got.tokens.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "token " << i);
      const double* row = out.logits.data() + (prompt.size() - 1 + i) * V;
      const double m = *std::max_element(row, row + V);
      double z = 0;
      for (int64_t t = 0; t < V; ++t) z += std::exp(row[t] - m);
      const double lse = m + std::log(z);
      EXPECT_NEAR(got.logprobs[i], row[got.tokens[i]] - lse, 5e-5);
      if (top == 0) continue;
      std::vector<int32_t> order(V);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return row[a] > row[b]; });
      ASSERT_EQ(got.top_logprobs[i].size(), static_cast<size_t>(top));
      for (int k = 0; k < top; ++k) {
        EXPECT_NEAR(got.top_logprobs[i][k].logprob, row[order[k]] - lse, 5e-5) << k;
        const bool tie_before = k > 0 && row[order[k - 1]] - row[order[k]] < 1e-4;
        const bool tie_after = row[order[k]] - row[order[k + 1]] < 1e-4;
        if (!tie_before && !tie_after) {
          EXPECT_EQ(got.top_logprobs[i][k].token, order[k]) << k;
        }
      }
    }
  }
};

TEST_F(GeneratorLogprobsTest, EachTokensIsTheReferencesGreedyOrDrawnOnEitherPath) {
  const std::vector<int32_t> prompt = model_->tokenizer->Encode("Once upon a time", true);
  kernels::CpuBackend cpu(1);
  testing::FakeDeviceBackend device(1);
  for (bool drawn : {false, true}) {
    SCOPED_TRACE(drawn ? "temperature 1" : "greedy");
    GenerateOptions o;
    o.max_new_tokens = 10;
    o.stop_at_eos = false;
    o.prefill_chunk = 3;
    o.top_logprobs = 3;
    if (drawn) o.sampling.temperature = 1.0, o.sampling.seed = 7;
    auto on_cpu = Generate<float>(*model_, cpu, prompt, o);
    auto on_device = Generate<float>(*model_, device, prompt, o);
    ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
    ASSERT_TRUE(on_device.ok()) << on_device.status();
    ExpectReference(prompt, *on_cpu, 3);
    ExpectReference(prompt, *on_device, 3);
    EXPECT_EQ(on_device->tokens, on_cpu->tokens);
  }
  EXPECT_EQ(device.top_rows.load(), 20);  // every token's draw asked for its top 3
  // Without top tokens: the log-probabilities alone.
  GenerateOptions plain;
  plain.max_new_tokens = 4;
  auto bare = Generate<float>(*model_, cpu, prompt, plain);
  ASSERT_TRUE(bare.ok()) << bare.status();
  ExpectReference(prompt, *bare, 0);
  plain.top_logprobs = 21;
  const absl::Status s = Generate<float>(*model_, cpu, prompt, plain).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("top_logprobs = 21"), std::string::npos) << s;
}

}  // namespace
}  // namespace kvlens
