#include "engine/kv_cache/kv_cache_manager.h"

#include "gtest/gtest.h"

namespace kvlens {
namespace {

TEST(KvCacheManagerTest, GrowsBlockTablesByWholeBlocks) {
  KvCacheManager m(/*num_blocks=*/8, /*block_size=*/16);
  ASSERT_TRUE(m.Reserve(1, 1));
  EXPECT_EQ(m.BlockTable(1).size(), 1u);
  ASSERT_TRUE(m.Reserve(1, 16));
  EXPECT_EQ(m.BlockTable(1).size(), 1u);
  ASSERT_TRUE(m.Reserve(1, 17));
  EXPECT_EQ(m.BlockTable(1).size(), 2u);
  EXPECT_EQ(m.Capacity(1), 32);
  EXPECT_EQ(m.pool().num_free(), 6);
}

TEST(KvCacheManagerTest, FailedReserveChangesNothing) {
  KvCacheManager m(4, 16);
  ASSERT_TRUE(m.Reserve(1, 40));   // 3 blocks
  EXPECT_FALSE(m.Reserve(2, 40));  // needs 3, 1 free
  EXPECT_TRUE(m.BlockTable(2).empty());
  EXPECT_EQ(m.pool().num_free(), 1);
  EXPECT_FALSE(m.Reserve(1, 80));  // needs 2 more, 1 free
  EXPECT_EQ(m.BlockTable(1).size(), 3u);
  EXPECT_EQ(m.pool().num_free(), 1);
}

TEST(KvCacheManagerTest, FreeReturnsEveryBlock) {
  KvCacheManager m(4, 16);
  ASSERT_TRUE(m.Reserve(1, 64));
  EXPECT_EQ(m.pool().num_free(), 0);
  m.Free(1);
  EXPECT_EQ(m.pool().num_free(), 4);
  EXPECT_TRUE(m.BlockTable(1).empty());
  m.Free(1);  // unknown sequence: no-op
  ASSERT_TRUE(m.Reserve(2, 64));
}

}  // namespace
}  // namespace kvlens
