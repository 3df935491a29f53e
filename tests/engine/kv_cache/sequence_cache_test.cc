// SequenceCache: every position its own row, or under a sliding window a ring of blocks
// just large enough that a chunk never overwrites a row some query still sees.
#include "engine/kv_cache/sequence_cache.h"

#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens {
namespace {

ModelConfig Config(int window) {
  ModelConfig c;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  c.dim = 8;
  c.sliding_window = window;
  return c;
}

TEST(SequenceCacheTest, WithoutAWindowEveryBlockIsItsOwn) {
  auto cache = SequenceCache<float>::Create(kernels::HostMemory(), Config(0), 65, 4,
                                            kernels::KvDtype::kActivation, /*max_chunk=*/3);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::vector<BlockId>& table = (*cache)->table();
  ASSERT_EQ(table.size(), 17u);  // ceil(65 / 4)
  EXPECT_EQ(std::set<BlockId>(table.begin(), table.end()).size(), 17u);
  EXPECT_EQ((*cache)->storage.num_blocks(), 17);
}

// Window 16, chunks of at most 3, blocks of 4: a chunk [c, c + 3) writes rows of positions
// c + 2 − R·4 and earlier, which must come before c − 15, the first key its first query
// sees: R·4 ≥ 3 + 16 − 1 = 18, so R = 5 blocks. Logical block b is physical block b mod 5.
TEST(SequenceCacheTest, ASlidingWindowSharesARingOfBlocks) {
  auto cache = SequenceCache<float>::Create(kernels::HostMemory(), Config(16), 65, 4,
                                            kernels::KvDtype::kActivation, /*max_chunk=*/3);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::vector<BlockId>& table = (*cache)->table();
  ASSERT_EQ(table.size(), 17u);
  EXPECT_EQ((*cache)->storage.num_blocks(), 5);
  EXPECT_EQ(std::set<BlockId>(table.begin(), table.begin() + 5).size(), 5u);
  for (size_t b = 5; b < table.size(); ++b) EXPECT_EQ(table[b], table[b % 5]) << b;
  // A ring as long as the sequence, or no chunk size given: no sharing.
  for (int64_t chunk : {int64_t{0}, int64_t{60}}) {
    auto whole = SequenceCache<float>::Create(kernels::HostMemory(), Config(16), 65, 4,
                                              kernels::KvDtype::kActivation, chunk);
    ASSERT_TRUE(whole.ok());
    EXPECT_EQ((*whole)->storage.num_blocks(), 17) << chunk;
  }
}

}  // namespace
}  // namespace kvlens
