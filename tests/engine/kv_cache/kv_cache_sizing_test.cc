// SizeKvCacheForUtilization on the device path's test double (FakeDeviceMemory with a
// budget: it reports free and total bytes as cudaMemGetInfo would, and keeps the peak).
// The property checked is the one a server relies on, measured by the fake memory's own
// accounting: the sized cache plus a worst-case step (max_batch_tokens tokens, every
// row's logits) peaks within utilization × total, and no whole block more would have fit.
#include "engine/kv_cache/kv_cache_sizing.h"

#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/model.h"
#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/fake_device_backend.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

class KvCacheSizingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
    auto m = LoadModel({testing::DefaultModelPath(), ""});
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *std::move(m);
  }

  // One step of `tokens` new tokens with every row's logits, on a cache of `blocks`.
  void Step(kernels::Backend<float>& backend, KvCacheStorage<float>& cache, int tokens) {
    Transformer<float> transformer(*model_, backend);
    const std::vector<int32_t> ids(tokens, 1);
    std::vector<int32_t> table((tokens + cache.block_size() - 1) / cache.block_size());
    std::iota(table.begin(), table.end(), 0);
    BatchEntry e;
    e.tokens = ids;
    e.block_table = table;
    e.all_logits = true;
    ForwardOutput<float> out;
    ASSERT_TRUE(transformer.Forward({&e, 1}, cache, out).ok());
  }

  // The server's defaults but for a step of 64 tokens and 8 sequences.
  static constexpr KvCacheSizingLimits kLimits{
      .block_size = 16, .max_batch_tokens = 64, .max_running = 8};
  std::unique_ptr<Model> model_;
};

TEST_F(KvCacheSizingTest, CachePlusAWorstCaseStepFitsTheBudgetToTheBlock) {
  testing::FakeDeviceBackend backend;
  const size_t total = size_t{16} << 20;
  backend.fake_memory().set_budget(total);
  const int block_size = kLimits.block_size, max_batch_tokens = kLimits.max_batch_tokens;
  const double utilization = 0.5;
  auto sizing = SizeKvCacheForUtilization(*model_, backend, kLimits, utilization);
  ASSERT_TRUE(sizing.ok()) << sizing.status();
  EXPECT_EQ(sizing->total, static_cast<int64_t>(total));
  EXPECT_EQ(sizing->in_use_before, 0);
  EXPECT_GT(sizing->model_and_step, 0);  // the step's activations and logits
  EXPECT_EQ(sizing->tokens % block_size, 0);
  const ModelConfig& c = model_->config;
  const int64_t block_bytes = int64_t{2} * c.num_layers * block_size * c.kv_dim() * 4;
  EXPECT_EQ(sizing->cache_bytes, sizing->tokens / block_size * block_bytes);

  // The server's next moves: the cache, then steps as large as the budget allows.
  EXPECT_EQ(backend.fake_memory().in_use(), 0u);  // the profile step left nothing behind
  backend.fake_memory().reset_peak();
  auto cache = KvCacheStorage<float>::Create(backend.memory(), c.num_layers,
                                             static_cast<int>(sizing->tokens / block_size),
                                             block_size, c.kv_dim(), true);
  ASSERT_TRUE(cache.ok()) << cache.status();
  Step(backend, *cache, max_batch_tokens);
  const double limit = utilization * static_cast<double>(total);
  EXPECT_LE(static_cast<double>(backend.fake_memory().peak()), limit);
  EXPECT_GT(static_cast<double>(backend.fake_memory().peak() + block_bytes), limit);
}

// A bf16 cache (--kv-cache-dtype bf16): two bytes an element, so the same budget holds
// twice the tokens (to the block), and the cache created with them fits as before.
TEST_F(KvCacheSizingTest, Bf16CacheHoldsTwiceTheTokens) {
  testing::FakeDeviceBackend backend;
  const size_t total = size_t{16} << 20;
  backend.fake_memory().set_budget(total);
  const int block_size = kLimits.block_size, max_batch_tokens = kLimits.max_batch_tokens;
  const double utilization = 0.5;
  auto f32 = SizeKvCacheForUtilization(*model_, backend, kLimits, utilization);
  auto bf16 =
      SizeKvCacheForUtilization(*model_, backend, kLimits, utilization, kernels::KvDtype::kBF16);
  ASSERT_TRUE(f32.ok()) << f32.status();
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  const ModelConfig& c = model_->config;
  const int64_t bf16_block = int64_t{2} * c.num_layers * block_size * c.kv_dim() * 2;
  EXPECT_EQ(bf16->cache_bytes, bf16->tokens / block_size * bf16_block);
  // The same bytes to within a block of either type.
  EXPECT_GE(bf16->tokens, 2 * f32->tokens);
  EXPECT_LE(bf16->tokens, 2 * f32->tokens + 2 * block_size);
  backend.fake_memory().reset_peak();
  auto cache = KvCacheStorage<float>::Create(backend.memory(), c.num_layers,
                                             static_cast<int>(bf16->tokens / block_size),
                                             block_size, c.kv_dim(), true, kernels::KvDtype::kBF16);
  ASSERT_TRUE(cache.ok()) << cache.status();
  Step(backend, *cache, max_batch_tokens);
  EXPECT_LE(static_cast<double>(backend.fake_memory().peak()),
            utilization * static_cast<double>(total));
}

TEST_F(KvCacheSizingTest, MemoryInUseBeforeCountsAgainstTheBudget) {
  testing::FakeDeviceBackend backend;
  const size_t total = size_t{16} << 20;
  backend.fake_memory().set_budget(total);
  auto alone = SizeKvCacheForUtilization(*model_, backend, kLimits, 0.9);
  ASSERT_TRUE(alone.ok()) << alone.status();
  // Another tenant takes 3 MiB: the cache shrinks by that much, to the block.
  auto other = backend.memory().Allocate(size_t{3} << 20);
  ASSERT_TRUE(other.ok());
  auto shared = SizeKvCacheForUtilization(*model_, backend, kLimits, 0.9);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->in_use_before, int64_t{3} << 20);
  EXPECT_LE(shared->cache_bytes, alone->cache_bytes - (int64_t{3} << 20));
  EXPECT_GT(shared->cache_bytes +
                16 * int64_t{2} * model_->config.num_layers * model_->config.kv_dim() * 4,
            alone->cache_bytes - (int64_t{3} << 20));
  backend.memory().Free(*other);
}

TEST_F(KvCacheSizingTest, UtilizationOutsideZeroToOneIsInvalidArgument) {
  testing::FakeDeviceBackend backend;
  backend.fake_memory().set_budget(size_t{16} << 20);
  for (double u : {0.0, -0.5, 1.01, std::nan("")}) {
    auto s = SizeKvCacheForUtilization(*model_, backend, kLimits, u);
    ASSERT_FALSE(s.ok()) << u;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << u;
    EXPECT_NE(s.status().message().find("utilization"), std::string::npos) << s.status();
  }
}

TEST_F(KvCacheSizingTest, ALimitBelowOneIsInvalidArgumentNamingIt) {
  testing::FakeDeviceBackend backend;
  backend.fake_memory().set_budget(size_t{16} << 20);
  for (auto [field, name] : {std::pair{&KvCacheSizingLimits::block_size, "block_size"},
                             {&KvCacheSizingLimits::max_batch_tokens, "max_batch_tokens"},
                             {&KvCacheSizingLimits::max_running, "max_running"}}) {
    KvCacheSizingLimits limits = kLimits;
    limits.*field = 0;
    auto s = SizeKvCacheForUtilization(*model_, backend, limits, 0.9);
    ASSERT_FALSE(s.ok()) << name;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find(std::string(name) + " is 0"), std::string::npos)
        << s.status();
  }
  EXPECT_EQ(backend.fake_memory().in_use(), 0u);
}

TEST_F(KvCacheSizingTest, HostMemoryHasNoBudget) {
  kernels::CpuBackend cpu(1);
  auto s = SizeKvCacheForUtilization(*model_, cpu, kLimits, 0.9);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnimplemented) << s.status();
}

TEST_F(KvCacheSizingTest, NotOneBlockIsResourceExhaustedWithTheNumbers) {
  testing::FakeDeviceBackend backend;
  backend.fake_memory().set_budget(size_t{16} << 20);
  auto s = SizeKvCacheForUtilization(*model_, backend, kLimits, 0.01);  // 168 KB
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find("one block of 16 tokens needs"), std::string::npos)
      << s.status();
  EXPECT_EQ(backend.fake_memory().in_use(), 0u);  // nothing left allocated
}

}  // namespace
}  // namespace kvlens
