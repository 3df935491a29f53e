#include "engine/kv_cache/block_pool.h"

#include <set>

#include "gtest/gtest.h"

namespace kvlens {
namespace {

TEST(BlockPoolTest, HandsOutEveryBlockOnceThenReportsExhaustion) {
  BlockPool pool(4);
  std::set<BlockId> got;
  for (int i = 0; i < 4; ++i) {
    auto b = pool.Allocate();
    ASSERT_TRUE(b.has_value());
    EXPECT_TRUE(got.insert(*b).second) << "block " << *b << " handed out twice";
  }
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_FALSE(pool.Allocate().has_value());  // a normal outcome, not a crash
  pool.Release(2);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.Allocate(), std::optional<BlockId>(2));
}

TEST(BlockPoolTest, SharedBlockReturnsOnlyWhenLastOwnerReleases) {
  BlockPool pool(2);
  const BlockId b = *pool.Allocate();
  pool.AddRef(b);
  EXPECT_EQ(pool.ref_count(b), 2);
  pool.Release(b);
  EXPECT_EQ(pool.num_free(), 1);
  pool.Release(b);
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.num_used(), 0);
}

TEST(BlockPoolDeathTest, DoubleReleaseAborts) {
  BlockPool pool(1);
  const BlockId b = *pool.Allocate();
  pool.Release(b);
  EXPECT_DEATH(pool.Release(b), "");
}

}  // namespace
}  // namespace kvlens
