// Split-KV decode over a batch of unequal rows (attention.h, SplitKvImbalance;
// CudaBackend::SetSplitKvBalanced): the imbalance and the splits it leads to, worked out
// by hand (host arithmetic, no device: CudaSplitKvBalance*), and on CudaBackend the
// balanced launches within the parity tolerance of the reference (CudaBackend*: ctest
// label `gpu`, skipped with the reason without a device).
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <random>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"

namespace kvlens::kernels::cuda {
namespace {

int Imbalance(const std::vector<int32_t>& key_ends) {
  return SplitKvImbalance(key_ends.data(), static_cast<int>(key_ends.size()));
}

// ceil(longest · rows / total keys), rounded up to a power of two.
TEST(CudaSplitKvBalanceTest, ImbalanceIsTheLongestOverTheMeanAsAPowerOfTwo) {
  EXPECT_EQ(Imbalance({100, 100, 100}), 1);
  EXPECT_EQ(Imbalance({}), 1);
  EXPECT_EQ(Imbalance({0, 0}), 1);
  EXPECT_EQ(Imbalance({300, 100}), 2);    // mean 200: 1.5 → 2
  EXPECT_EQ(Imbalance({500, 100}), 2);    // mean 300: 1.67 → 2
  EXPECT_EQ(Imbalance({700, 100}), 2);    // mean 400: 1.75 → 2
  EXPECT_EQ(Imbalance({900, 100}), 2);    // mean 500: 1.8 → 2
  EXPECT_EQ(Imbalance({1000, 0}), 2);     // mean 500: exactly 2
  EXPECT_EQ(Imbalance({1000, 0, 0}), 4);  // mean 333: 3 → 4
  // One of 8192 and 63 of 256 keys (kvlens_gpu_check's unequal batch): mean 380, 21.6 → 32.
  std::vector<int32_t> unequal(64, 256);
  unequal[0] = 8192;
  EXPECT_EQ(Imbalance(unequal), 32);
  // At most kSplitKvMaxSplits.
  std::vector<int32_t> extreme(1000, 1);
  extreme[0] = 1000000;
  EXPECT_EQ(Imbalance(extreme), kSplitKvMaxSplits);
}

// The splits SplitKv then takes for 64 decode rows of 8 KV heads (Llama 3 8B) over 8192
// keys on an H200 (132 SMs, 4 blocks each): one wave of 512 blocks is one split; with 32
// times the slots, 16896 / 512 = 33 splits, 8192 / 33 = 249 keys rounded up to whole
// 4-key steps, 252, which 33 splits fill.
TEST(CudaSplitKvBalanceTest, AnUnequalBatchTakesTheSplitsOfItsImbalance) {
  AttentionParams p;
  p.num_queries = 64;
  p.num_heads = 32;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.num_keys = 8192;
  EXPECT_EQ(ChooseNumSplits(p, 132, 4), 1);
  EXPECT_EQ(ChooseNumSplits(p, 132, 4 * 32), 33);
}

// Balanced launches on the parity table's batched decode cases (unequal rows, so more
// splits than the plain choice), and one long row among short ones, fp32 and bf16 caches,
// within the parity tolerance.
TEST_F(CudaBackendTest, BalancedSplitKvWithinTolerance) {
  CudaBackend& b = *backend_;
  EXPECT_FALSE(b.split_kv_balanced());
  b.SetSplitKvBalanced(true);
  std::mt19937_64 rng(41);
  std::vector<parity::ParityResult> results;
  for (bool bf16_cache : {false, true}) {
    results.push_back(parity::AttentionBatchSplitKvCase(b, rng, bf16_cache));
    std::vector<parity::AttnShape> rows(8, parity::AttnShape{.tq = 1, .tk = 20});
    rows[3].tk = 700;
    results.push_back(parity::AttentionBatchCase(
        b, rng,
        bf16_cache ? "one long row among 7 short, bf16 cache" : "one long row among 7 short", rows,
        8, 2, 128, nullptr, bf16_cache));
  }
  b.SetSplitKvBalanced(false);
  for (const parity::ParityResult& r : results) {
    EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
  }
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(CudaSplitKvBalanceTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
