// Buffer<T> on host memory (the CPU backends'): growth drops contents and never shrinks,
// copies in and out at an offset, moves transfer ownership.
#include "kernels/buffer.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::kernels {
namespace {

TEST(BufferTest, AllocatesAlignedHostMemory) {
  auto b = Buffer<float>::Allocate(HostMemory(), 100);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->size(), 100);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u);
  for (int i = 0; i < 100; ++i) b->data()[i] = static_cast<float>(i);  // host-writable
  EXPECT_EQ(b->data()[99], 99.0f);
}

TEST(BufferTest, ResizeGrowsGeometricallyAndNeverShrinks) {
  Buffer<double> b;
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(b.data(), nullptr);
  ASSERT_TRUE(b.Resize(10).ok());
  EXPECT_EQ(b.capacity(), 10);
  const double* first = b.data();
  ASSERT_TRUE(b.Resize(4).ok());
  EXPECT_EQ(b.size(), 4);
  EXPECT_EQ(b.data(), first);  // shrinking keeps the allocation
  ASSERT_TRUE(b.Resize(11).ok());
  EXPECT_EQ(b.capacity(), 15);  // 1.5 × 10
  EXPECT_EQ(b.size(), 11);
  EXPECT_EQ(b.Resize(-1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(BufferTest, CopiesInAndOutAtAnOffset) {
  auto b = Buffer<float>::Allocate(HostMemory(), 8);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(HostMemory().Memset(b->data(), 0xFF, 8 * sizeof(float)).ok());
  EXPECT_TRUE(std::isnan(b->data()[0]));  // all-ones bytes are NaN
  const std::vector<float> in = {1, 2, 3};
  ASSERT_TRUE(b->CopyFromHost(in.data(), 3, /*offset=*/4).ok());
  std::vector<float> out(4);
  ASSERT_TRUE(b->CopyToHost(out.data(), 4, /*offset=*/3).ok());
  EXPECT_TRUE(std::isnan(out[0]));
  EXPECT_EQ(out[1], 1);
  EXPECT_EQ(out[3], 3);
  ASSERT_TRUE(HostMemory().Copy(b->data(), b->data() + 4, 3 * sizeof(float)).ok());
  EXPECT_EQ(b->data()[2], 3);
}

TEST(BufferTest, MoveTransfersOwnership) {
  auto a = Buffer<int32_t>::Allocate(HostMemory(), 5);
  ASSERT_TRUE(a.ok());
  int32_t* p = a->data();
  Buffer<int32_t> b = *std::move(a);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.size(), 5);
  Buffer<int32_t> c;
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(&c.memory(), &HostMemory());
}

TEST(BufferTest, ZeroElementsHoldNoMemory) {
  auto b = Buffer<float>::Allocate(HostMemory(), 0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data(), nullptr);
  EXPECT_TRUE(b->CopyToHost(nullptr, 0).ok());
}

}  // namespace
}  // namespace kvlens::kernels
