// KvCacheStorage in a backend's memory: NaN or zero fill, rows read back to the host.
#include "engine/kv_cache/kv_cache_storage.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/fake_device_backend.h"

namespace kvlens {
namespace {

TEST(KvCacheStorageTest, HostStorageIsHostMemory) {
  KvCacheStorage<double> s(2, 3, 4, 5, /*fill_nan=*/true);
  EXPECT_EQ(&s.memory(), &kernels::HostMemory());
  EXPECT_EQ(s.dtype(), kernels::KvDtype::kActivation);
  EXPECT_TRUE(std::isnan(static_cast<double*>(s.k(1))[3 * 4 * 5 - 1]));
  static_cast<double*>(s.k(1))[7 * 5] = 2.5;  // host pointers: writable directly
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

// A bf16 cache holds bf16 bits (two bytes an element) and reads them back widened
// exactly: 0x3FC0 is 1.5, 0xC049 is −(1 + 73/128) · 2 = −3.140625. All-ones bytes are NaN.
TEST(KvCacheStorageTest, Bf16StorageReadsBackWidened) {
  KvCacheStorage<double> s(2, 3, 4, 5, /*fill_nan=*/true, kernels::KvDtype::kBF16);
  EXPECT_EQ(s.dtype(), kernels::KvDtype::kBF16);
  uint16_t* k1 = static_cast<uint16_t*>(s.k(1));
  k1[7 * 5] = 0x3FC0;
  k1[7 * 5 + 4] = 0xC049;
  std::vector<double> k(5), v(5);
  ASSERT_TRUE(s.CopyRowsToHost(1, 7, 1, k.data(), v.data()).ok());
  EXPECT_EQ(k[0], 1.5);
  EXPECT_EQ(k[4], -3.140625);
  EXPECT_TRUE(std::isnan(k[1]));
  for (double x : v) EXPECT_TRUE(std::isnan(x));
  const kernels::KvSource<double> src = s.Source(1);
  EXPECT_EQ(src.dtype, kernels::KvDtype::kBF16);
  EXPECT_EQ(src.k, s.k(1));
  EXPECT_EQ(src.row_stride, 5);
  EXPECT_EQ(src.block_size, 4);
}

TEST(KvCacheStorageTest, Bf16StorageInDeviceMemory) {
  testing::FakeDeviceMemory memory;
  auto s =
      KvCacheStorage<float>::Create(memory, 3, 2, 4, 8, /*fill_nan=*/true, kernels::KvDtype::kBF16);
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<float> k(2 * 8), v(2 * 8);
  ASSERT_TRUE(s->CopyRowsToHost(2, 6, 2, k.data(), v.data()).ok());
  for (float x : k) EXPECT_TRUE(std::isnan(x));
  EXPECT_EQ(memory.memsets.load(), 2 * 3);
}

TEST(KvCacheStorageTest, BlockBytesCountsKeysAndValuesOfEveryLayer) {
  EXPECT_EQ(KvCacheStorage<float>::BlockBytes(4, 16, 128), 2 * 4 * 16 * 128 * 4);
  EXPECT_EQ(KvCacheStorage<double>::BlockBytes(4, 16, 128), 2 * 4 * 16 * 128 * 8);
  EXPECT_EQ(KvCacheStorage<float>::BlockBytes(4, 16, 128, kernels::KvDtype::kBF16),
            2 * 4 * 16 * 128 * 2);
}

}  // namespace
}  // namespace kvlens
