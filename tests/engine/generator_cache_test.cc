// GenerateCache: a conversation's turns through one kept cache on stories260K. Each call
// gives a fresh Generate's tokens and log-probabilities bit for bit, having computed only
// the prompt after the longest prefix the cache held: the previous call's prompt and every
// generated token but the last (which was drawn, never run), counted here from those
// token lists; always the prompt's last token. Another block size or prompt scoring
// computes the whole prompt (0 cached), other steering from the first position either
// steers; a sequence past the cache's room doubles
// it and keeps the rows (every turn of a conversation grows it). A sliding window keeps
// the bits too (the kept cache holds every position, the fresh run a ring), and so does
// fp64. On a device's memory the grown cache's rows are copied by its Memory; another
// backend's memory computes anew.
#include <algorithm>
#include <vector>

#include "engine/generator.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/stories_model_test.h"
#include "tests/kernels/fake_device_backend.h"

namespace kvlens {
namespace {

class GenerateCacheTest : public testing::StoriesModelTest {
 protected:
  void SetUp() override {
    StoriesModelTest::SetUp();
    if (NoModel()) return;
    options_.max_new_tokens = 8;
    options_.stop_at_eos = false;
    options_.prefill_chunk = 5;
    options_.sampling.temperature = 0.8;  // (drawn: the seed's draws must line up too)
    options_.sampling.seed = 7;
  }

  // Generate through `cache`; expects a fresh run's tokens and log-probabilities and
  // `cached` prompt tokens taken from the cache.
  template <typename T>
  GenerateResult Turn(kernels::Backend<T>& backend, GenerateCache<T>& cache,
                      const std::vector<int32_t>& prompt, int cached,
                      const GenerateOptions* options = nullptr) {
    const GenerateOptions& o = options ? *options : options_;
    auto fresh = Generate<T>(*model_, backend, prompt, o);
    auto kept = Generate<T>(*model_, backend, prompt, o, nullptr, &cache);
    EXPECT_TRUE(fresh.ok() && kept.ok()) << fresh.status() << kept.status();
    if (!fresh.ok() || !kept.ok()) return {};
    EXPECT_EQ(kept->tokens, fresh->tokens);
    EXPECT_EQ(kept->logprobs, fresh->logprobs);
    EXPECT_EQ(kept->finish_reason, fresh->finish_reason);
    EXPECT_EQ(kept->cached_prompt_tokens, cached);
    EXPECT_EQ(fresh->cached_prompt_tokens, 0);
    return *kept;
  }

  // What a call leaves in the cache: its prompt and its generated tokens but the last.
  static std::vector<int32_t> Held(const std::vector<int32_t>& prompt, const GenerateResult& r) {
    std::vector<int32_t> held = prompt;
    held.insert(held.end(), r.tokens.begin(), r.tokens.end() - (r.tokens.empty() ? 0 : 1));
    return held;
  }
  static int CommonPrefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
    int n = 0;
    while (n < static_cast<int>(std::min(a.size(), b.size())) && a[n] == b[n]) ++n;
    return n;
  }

  std::vector<int32_t> Encode(const std::string& text, bool bos) const {
    return model_->tokenizer->Encode(text, bos);
  }

  GenerateOptions options_;
};

TEST_F(GenerateCacheTest, TurnsComputeOnlyTheirNewTokens) {
  kernels::CpuBackend cpu(2);
  GenerateCache<float> cache;
  const std::vector<int32_t> first = Encode("Once upon a time", true);
  const GenerateResult r1 = Turn(cpu, cache, first, 0);
  ASSERT_EQ(r1.tokens.size(), 8u);

  // The next turn: the conversation so far and a new line.
  std::vector<int32_t> second = first;
  second.insert(second.end(), r1.tokens.begin(), r1.tokens.end());
  for (int32_t t : Encode(" Then the cat", false)) second.push_back(t);
  const int held = static_cast<int>(first.size() + r1.tokens.size() - 1);
  ASSERT_EQ(CommonPrefix(Held(first, r1), second), held);
  const GenerateResult r2 = Turn(cpu, cache, second, held);

  // A prompt that leaves the conversation after its fourth token.
  std::vector<int32_t> third(second.begin(), second.begin() + 4);
  for (int32_t t : Encode(" a dog ran", false)) third.push_back(t);
  const int shared = CommonPrefix(Held(second, r2), third);
  ASSERT_GE(shared, 4);
  const GenerateResult r3 = Turn(cpu, cache, third, shared);

  // The very prompt the cache holds: its last token is computed again, for the draw.
  const std::vector<int32_t> again = Held(third, r3);
  Turn(cpu, cache, again, static_cast<int>(again.size()) - 1);
}

// On a device's memory (the device path: draws where the logits are, the rows copied into
// a grown cache by Memory::Copy), and on another backend's memory, whose rows it cannot
// read: computed anew there.
TEST_F(GenerateCacheTest, DeviceMemoryKeepsItsRowsAndAnotherMemoryStartsAnew) {
  testing::FakeDeviceBackend device(2);
  GenerateCache<float> cache;
  const std::vector<int32_t> first = Encode("Once upon a time", true);
  const GenerateResult r1 = Turn(device, cache, first, 0);
  std::vector<int32_t> second = Held(first, r1);
  for (int32_t t : Encode(" and then", false)) second.push_back(t);
  Turn(device, cache, second, static_cast<int>(Held(first, r1).size()));
  kernels::CpuBackend cpu(1);
  ASSERT_NE(&cpu.memory(), &device.memory());
  Turn(cpu, cache, second, 0);
  EXPECT_EQ(&cache.sequence->storage.memory(), &cpu.memory());
}

TEST_F(GenerateCacheTest, OtherSettingsStartItAnew) {
  kernels::CpuBackend cpu(1);
  GenerateCache<float> cache;
  const std::vector<int32_t> prompt = Encode("Once upon a time there was", true);
  const int n = static_cast<int>(prompt.size());
  Turn(cpu, cache, prompt, 0);

  GenerateOptions other = options_;
  other.block_size = 4;
  Turn(cpu, cache, prompt, 0, &other);
  Turn(cpu, cache, prompt, n - 1, &other);  // (now the cache's)

  // Steered from position 3: rows 0 … 2 are the unsteered ones held; then all but the last.
  GenerateOptions steered = other;
  steered.steering.push_back({1, false, std::vector<float>(model_->config.dim, 0.5f), 3});
  ASSERT_GT(n, 5);
  Turn(cpu, cache, prompt, 3, &steered);
  Turn(cpu, cache, prompt, n - 1, &steered);
  steered.steering[0].from_position = 4;  // row 3 now unsteered: from 3 again
  Turn(cpu, cache, prompt, 3, &steered);
  steered.steering[0].from_position = 2;  // and now row 2 steered
  Turn(cpu, cache, prompt, 2, &steered);
  steered.steering[0].delta[0] = -1.0f;  // another vector from the same position
  Turn(cpu, cache, prompt, 2, &steered);

  // prompt_logprobs scores every row: computed whole, and its events a fresh run's.
  GenerateOptions scored = steered;
  std::vector<float> kept_scores, fresh_scores;
  scored.prompt_logprobs = 2;
  scored.on_prompt_logprobs = [&](const PromptLogprobsEvent& e) {
    kept_scores.insert(kept_scores.end(), e.logprobs.begin(), e.logprobs.end());
  };
  ASSERT_TRUE(Generate<float>(*model_, cpu, prompt, scored, nullptr, &cache).ok());
  scored.on_prompt_logprobs = [&](const PromptLogprobsEvent& e) {
    fresh_scores.insert(fresh_scores.end(), e.logprobs.begin(), e.logprobs.end());
  };
  auto fresh = Generate<float>(*model_, cpu, prompt, scored);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh_scores.size(), static_cast<size_t>(n - 1));
  EXPECT_EQ(kept_scores, fresh_scores);

  // Past its room (the prompt and 8 new tokens in blocks of 16, kept through the changes
  // above): twice it, the rows taken along.
  const int64_t room = (n + 8 + 15) / 16 * 16;
  EXPECT_EQ(cache.capacity(), room);
  GenerateOptions longer = steered;
  longer.max_new_tokens = static_cast<int>(room) + 1 - n;
  Turn(cpu, cache, prompt, n - 1, &longer);
  EXPECT_EQ(cache.capacity(), 2 * room);
}

TEST_F(GenerateCacheTest, FullPrecisionAndSlidingWindowKeepTheBits) {
  kernels::ReferenceBackend reference;
  GenerateCache<double> cache;
  const std::vector<int32_t> first = Encode("Lily had a red ball", true);
  const GenerateResult r1 = Turn(reference, cache, first, 0);
  std::vector<int32_t> second = first;
  second.insert(second.end(), r1.tokens.begin(), r1.tokens.end());
  second.push_back(first[1]);
  Turn(reference, cache, second, static_cast<int>(first.size() + r1.tokens.size() - 1));

  // A window of 6 over prompts of 20 and more: a fresh run keeps a ring of blocks, the kept
  // cache every position; the keys a row sees are the same.
  model_->config.sliding_window = 6;
  kernels::CpuBackend cpu(1);
  GenerateCache<float> windowed;
  GenerateOptions o = options_;
  o.block_size = 2;
  o.prefill_chunk = 3;
  const GenerateResult w1 = Turn(cpu, windowed, second, 0, &o);
  std::vector<int32_t> longer = second;
  longer.insert(longer.end(), w1.tokens.begin(), w1.tokens.end());
  Turn(cpu, windowed, longer, static_cast<int>(second.size() + w1.tokens.size() - 1), &o);
}

}  // namespace
}  // namespace kvlens
