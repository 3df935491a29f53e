// The order flash blocks start in (attention.h, FlashGrid; CudaBackend::SetFlashHeadGroup):
// the grid's blocks in the order they start, as (tile, head), on the host, against orders
// written out by hand; the group sized to the L2 cache (FlashHeadGroup) against
// sizes worked out by hand; and on CudaBackend both flash kernels, alone and batched,
// giving the very bits of the head-by-head order in every group. Suites named
// CudaBackend* need a device (ctest label `gpu`; they skip with the reason without one);
// FlashBlockOrder* are host arithmetic.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"

namespace kvlens::kernels::cuda {
namespace {

// FlashGrid's blocks in the order they start (x fastest, then y, then z) as the kernels
// read them (FlashSeqOf: tile y, head z·x-extent + x), those past the last head left out.
std::vector<std::pair<int, int>> Order(int tiles, int heads, int group) {
  const FlashGridShape g = FlashGrid(tiles, heads, group);
  std::vector<std::pair<int, int>> out;
  for (int z = 0; z < g.z; ++z) {
    for (int y = 0; y < g.y; ++y) {
      for (int x = 0; x < g.x; ++x) {
        if (z * g.x + x < heads) out.emplace_back(y, z * g.x + x);
      }
    }
  }
  return out;
}

// Written out by hand: 3 tiles of 6 heads. Head by head (group 1, and 0 alike) is the
// grid's own order; in groups of 4, heads 0-3 tile by tile, then the last group (heads 4
// and 5); in one group of all 6, every head's tile 0 first.
TEST(FlashBlockOrderTest, MatchesOrdersWrittenOutByHand) {
  using P = std::vector<std::pair<int, int>>;
  EXPECT_EQ(Order(3, 6, 1), (P{{0, 0},
                               {1, 0},
                               {2, 0},
                               {0, 1},
                               {1, 1},
                               {2, 1},
                               {0, 2},
                               {1, 2},
                               {2, 2},
                               {0, 3},
                               {1, 3},
                               {2, 3},
                               {0, 4},
                               {1, 4},
                               {2, 4},
                               {0, 5},
                               {1, 5},
                               {2, 5}}));
  EXPECT_EQ(Order(3, 6, 0), Order(3, 6, 1));
  EXPECT_EQ(Order(3, 6, 4), (P{{0, 0},
                               {0, 1},
                               {0, 2},
                               {0, 3},
                               {1, 0},
                               {1, 1},
                               {1, 2},
                               {1, 3},
                               {2, 0},
                               {2, 1},
                               {2, 2},
                               {2, 3},
                               {0, 4},
                               {0, 5},
                               {1, 4},
                               {1, 5},
                               {2, 4},
                               {2, 5}}));
  EXPECT_EQ(Order(3, 6, 6), (P{{0, 0},
                               {0, 1},
                               {0, 2},
                               {0, 3},
                               {0, 4},
                               {0, 5},
                               {1, 0},
                               {1, 1},
                               {1, 2},
                               {1, 3},
                               {1, 4},
                               {1, 5},
                               {2, 0},
                               {2, 1},
                               {2, 2},
                               {2, 3},
                               {2, 4},
                               {2, 5}}));
}

// Every (tile, head) exactly once for any group (one past the heads included), and within a
// group of G heads no block starts before a longer one of the group (tiles never decrease).
TEST(FlashBlockOrderTest, EveryBlockOnceLongestFirstInEachGroup) {
  for (int tiles : {1, 2, 7}) {
    for (int heads : {1, 3, 6, 32}) {
      for (int group : {1, 2, 4, 5, 8, 32, 64}) {
        SCOPED_TRACE(::testing::Message()
                     << tiles << " tiles, " << heads << " heads, group " << group);
        const std::vector<std::pair<int, int>> order = Order(tiles, heads, group);
        const std::set<std::pair<int, int>> seen(order.begin(), order.end());
        ASSERT_EQ(order.size(), static_cast<size_t>(tiles * heads));
        ASSERT_EQ(seen.size(), order.size());
        // Blocks with no head: fewer than a group's.
        const FlashGridShape g = FlashGrid(tiles, heads, group);
        EXPECT_LT(g.x * g.z - heads, g.x);
        for (const auto& [tile, head] : order) {
          ASSERT_TRUE(tile >= 0 && tile < tiles && head >= 0 && head < heads);
        }
        if (group <= 1) continue;
        for (size_t i = 1; i < order.size(); ++i) {
          if (order[i].second / group != order[i - 1].second / group) continue;
          EXPECT_GE(order[i].first, order[i - 1].first) << "block " << i;
        }
      }
    }
  }
}

// The group sized to the L2 cache: KV heads of 2·keys·Dh elements (K and V), the largest
// power of two of them within L2 and the KV heads there are, times the heads sharing one.
TEST(FlashBlockOrderTest, AutoGroupFitsTheL2Cache) {
  AttentionParams p;
  p.num_heads = 32;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.kv_dtype = KvDtype::kBF16;
  const int64_t mib = int64_t{1} << 20;
  // 4096 keys: 2 MiB a KV head; 50 MiB hold 25, all 8 fit: every head in one group.
  EXPECT_EQ(FlashHeadGroup(p, kFlashAutoHeadGroup, 4096, 50 * mib), 32);
  // 16384 keys: 8 MiB; 6 fit, so 4 KV heads, 16 heads.
  EXPECT_EQ(FlashHeadGroup(p, kFlashAutoHeadGroup, 16384, 50 * mib), 16);
  // An fp32 cache at 16384 keys: 16 MiB; 3 fit, so 2 KV heads, 8 heads.
  p.kv_dtype = KvDtype::kActivation;
  EXPECT_EQ(FlashHeadGroup(p, kFlashAutoHeadGroup, 16384, 50 * mib), 8);
  // Nothing fits (1 MiB): one KV head's 4 heads.
  EXPECT_EQ(FlashHeadGroup(p, kFlashAutoHeadGroup, 16384, mib), 4);
  // Asked for: at most the heads; at least 1.
  EXPECT_EQ(FlashHeadGroup(p, 4, 16384, mib), 4);
  EXPECT_EQ(FlashHeadGroup(p, 64, 16384, mib), 32);
  EXPECT_EQ(FlashHeadGroup(p, 1, 4096, 50 * mib), 1);
  EXPECT_TRUE(CheckFlashHeadGroup(0).ok());
  EXPECT_TRUE(CheckFlashHeadGroup(kFlashMaxHeadGroup).ok());
  const absl::Status s = CheckFlashHeadGroup(-1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "flash head group must be in [0, 1024] (0: sized to the L2 cache), got -1");
}

// One call's output (NaN where never written) with the backend's flash head group set.
std::vector<double> RunWithGroup(CudaBackend& b, int group, const parity::AttnShape& s,
                                 const parity::AttnInputs& in) {
  EXPECT_TRUE(b.SetFlashHeadGroup(group).ok());
  auto call = parity::UploadAttnCall(s, in);
  EXPECT_TRUE(call.ok()) << call.status();
  if (!call.ok()) return {};
  EXPECT_TRUE(b.Attention(call->args).ok());
  auto out = parity::FromDevice(b, call->out, in.qs.size());
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : std::vector<double>{};
}

// A block computes the same whatever starts before it: every group gives the head-by-head
// order's bits, on the bf16 kernel and the fp16 one, with 6 heads (groups of 4 leave a
// smaller last group), grouped-query heads, a prompt of three tiles (the last partial), an
// offset and documents. The NaN-filled output shows a block never run.
TEST_F(CudaBackendTest, FlashHeadGroupsGiveTheSameBits) {
  CudaBackend& b = *backend_;
  EXPECT_EQ(b.flash_head_group(), 1);
  EXPECT_EQ(b.SetFlashHeadGroup(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.SetFlashHeadGroup(kFlashMaxHeadGroup + 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.flash_head_group(), 1);
  for (bool bf16_cache : {true, false}) {
    for (int dh : {64, 128}) {
      const parity::AttnShape s{.label = "head groups",
                                .tq = 300,
                                .tk = 340,
                                .heads = 6,
                                .kv_heads = 2,
                                .dh = dh,
                                .offset = 40,
                                .doc_lengths = {150, 190},
                                .bf16_cache = bf16_cache};
      SCOPED_TRACE(::testing::Message() << "bf16 cache " << bf16_cache << ", Dh " << dh);
      std::mt19937_64 rng(31);
      const parity::AttnInputs in = parity::MakeAttnInputs(s, rng);
      const std::vector<double> head_by_head = RunWithGroup(b, 1, s, in);
      ASSERT_FALSE(head_by_head.empty());
      for (int group : {2, 4, 6, 64, kFlashAutoHeadGroup}) {
        const std::vector<double> out = RunWithGroup(b, group, s, in);
        ASSERT_EQ(out.size(), head_by_head.size()) << "group " << group;
        for (int i = 0; i < s.tq; ++i) {
          for (int64_t c = 0; c < in.q_width; ++c) {
            const size_t at = static_cast<size_t>(i * in.q_stride + c);
            ASSERT_TRUE(std::isfinite(out[at]))
                << "group " << group << ", row " << i << ", col " << c;
            ASSERT_EQ(out[at], head_by_head[at]) << "group " << group << ", row " << i;
          }
        }
      }
    }
  }
  ASSERT_TRUE(b.SetFlashHeadGroup(1).ok());
}

// Batched prefill chunks (a flash launch's tile list, longest first) in groups, within the
// parity tolerance of the reference, on both kernels.
TEST_F(CudaBackendTest, BatchedFlashInHeadGroupsWithinTolerance) {
  for (int group : {2, 8, kFlashAutoHeadGroup}) {
    ASSERT_TRUE(backend_->SetFlashHeadGroup(group).ok());
    for (bool bf16_cache : {false, true}) {
      std::mt19937_64 rng(32);
      int uploads = -1;
      const parity::ParityResult r =
          parity::AttentionBatchFlashCase(*backend_, rng, &uploads, bf16_cache);
      EXPECT_TRUE(r.pass()) << "group " << group << ": " << r.name << ": " << r.status << ", error "
                            << r.err << " > " << r.tol;
      EXPECT_EQ(uploads, 4);
    }
  }
  ASSERT_TRUE(backend_->SetFlashHeadGroup(1).ok());
}

// A grid's y extent holds at most kFlashMaxTiles tiles (65535): a launch of more (a
// prompt of 65536 128-query tiles, 8388608 rows, or a batched list of 65536 tiles) is
// refused before anything runs, on both kernels and whatever the head group, with the
// limit and the count in the message. Nothing here is read: the pointers are never used.
TEST_F(CudaBackendTest, FlashLaunchesPastTheGridsTileLimitAreRefused) {
  const int32_t unread_tiles[kFlashTileInts] = {};
  for (bool batched : {false, true}) {
    for (int group : {1, 8}) {
      AttentionParams p;
      p.num_heads = 8;
      p.num_kv_heads = 8;
      p.head_dim = 128;
      p.kv_row_stride = 8 * 128;
      p.q_stride = p.out_stride = 8 * 128;
      p.scale = 0.125f;
      p.flash_head_group = group;
      if (batched) {
        p.flash_tiles = unread_tiles;
        p.num_flash_tiles = kFlashMaxTiles + 1;
      } else {
        p.num_queries = p.num_keys = (kFlashMaxTiles + 1) * 128;
      }
      const std::string want = absl::StrCat("at most ", kFlashMaxTiles,
                                            " query tiles a launch, got ", kFlashMaxTiles + 1);
      SCOPED_TRACE(::testing::Message() << "batched " << batched << ", group " << group);
      p.kv_dtype = KvDtype::kActivation;
      const absl::Status fp16 = LaunchFlashPrefill(p, 128, nullptr);
      EXPECT_EQ(fp16.code(), absl::StatusCode::kInvalidArgument) << fp16;
      EXPECT_NE(fp16.message().find(want), absl::string_view::npos) << fp16;
      p.kv_dtype = KvDtype::kBF16;
      const absl::Status bf16 = LaunchFlashPrefillBf16(p, FlashBf16Layout{}, nullptr);
      EXPECT_EQ(bf16.code(), absl::StatusCode::kInvalidArgument) << bf16;
      EXPECT_NE(bf16.message().find(want), absl::string_view::npos) << bf16;
    }
  }
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(FlashBlockOrderTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
