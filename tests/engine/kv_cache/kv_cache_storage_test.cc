// KvCacheStorage in a backend's memory: NaN or zero fill, rows read back to the host.
#include "engine/kv_cache/kv_cache_storage.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/fake_device_backend.h"

namespace kvlens {
namespace {

TEST(KvCacheStorageTest, HostStorageIsHostMemory) {
  KvCacheStorage<double> s(2, 3, 4, 5, /*fill_nan=*/true);
  EXPECT_EQ(&s.memory(), &kernels::HostMemory());
  EXPECT_TRUE(std::isnan(s.k(1)[3 * 4 * 5 - 1]));
  s.k(1)[7 * 5] = 2.5;  // host pointers: writable directly
  std::vector<double> k(5), v(5);
  ASSERT_TRUE(s.CopyRowsToHost(1, 7, 1, k.data(), v.data()).ok());
  EXPECT_EQ(k[0], 2.5);
  EXPECT_TRUE(std::isnan(v[0]));
}

TEST(KvCacheStorageTest, CreateFillsThroughTheMemory) {
  testing::FakeDeviceMemory memory;
  for (bool nan : {true, false}) {
    auto s = KvCacheStorage<float>::Create(memory, 3, 2, 4, 8, nan);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(&s->memory(), &memory);
    std::vector<float> k(2 * 8), v(2 * 8);
    ASSERT_TRUE(s->CopyRowsToHost(2, 6, 2, k.data(), v.data()).ok());
    for (float x : k) EXPECT_EQ(std::isnan(x), nan);
    for (float x : v) EXPECT_EQ(x == 0.0f, !nan);
  }
  EXPECT_EQ(memory.memsets.load(), 2 * 2 * 3);  // keys and values of every layer, twice
}

TEST(KvCacheStorageTest, BlockBytesCountsKeysAndValuesOfEveryLayer) {
  EXPECT_EQ(KvCacheStorage<float>::BlockBytes(4, 16, 128), 2 * 4 * 16 * 128 * 4);
}

}  // namespace
}  // namespace kvlens
