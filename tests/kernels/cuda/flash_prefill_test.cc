// The flash prefill kernels' layouts and edges on CudaBackend against the double
// ReferenceBackend: 64-query tiles; a negative scale; the bf16 kernel's other layouts (4 warps of
// 32, three K/V stages, 32-key tiles, 192-query blocks) on the parity table's bf16-cache shapes;
// which kernel a bf16 cache takes; what the cache holds past a block's keys. Split from
// cuda_backend_test.cc, whose fixture it shares. Suites are named CudaBackend* so that
// ctest labels them `gpu` (kernels/cuda/gpu_test_labels.cmake.in); without a device they
// skip with the reason.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <cmath>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"

namespace kvlens::kernels::cuda {
namespace {

// The 128-query flash blocks (8 warps; head sizes 64 and 128, the others keep 64) on the
// parity table's flash shapes and a batch of prefill chunks, within the same tolerance.
// The parity table runs the default 128-query flash tiles (64 for head sizes 80 and 96);
// this runs every flash shape with 64-query tiles.
TEST_F(CudaBackendTest, FlashWith64QueryTilesWithinTolerance) {
  static_assert(kFlashDefaultTileQueries == 128, "then this test should run 128-query tiles");
  EXPECT_EQ(backend_->SetFlashTileQueries(96).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(backend_->SetFlashTileQueries(64).ok());
  std::mt19937_64 rng(5);
  std::vector<parity::ParityResult> results;
  int flash_shapes = 0;
  for (const parity::AttnShape& s : parity::AttentionShapes()) {
    if (s.want_maps || s.want_probs_only || s.tq < kFlashMinQueries) continue;
    if (!FlashPrefillSupports(s.dh)) continue;
    flash_shapes += FlashTileQueries(s.dh, 64) == 64 ? 1 : 0;
    for (parity::ParityResult& r : parity::AttentionCase(*backend_, rng, s)) {
      results.push_back(std::move(r));
    }
  }
  // Dh 64 and 128 (9 shapes, two of them sliding windows, one soft-capped; 2 on a bf16
  // cache), 80 and 96, 256 (4 shapes); 16 on a bf16 cache in 16-byte pieces, all on the
  // bf16 kernel (4 of them at Dh 256; 2 soft-capped).
  EXPECT_EQ(flash_shapes, 33);
  int uploads = -1;
  results.push_back(parity::AttentionBatchFlashCase(*backend_, rng, &uploads));
  EXPECT_EQ(uploads, 4);
  results.push_back(parity::AttentionBatchFlashCase(*backend_, rng, &uploads, true));
  EXPECT_EQ(uploads, 4);
  for (const parity::ParityResult& r : results) {
    std::cerr << "[ parity   ] 64-query tiles: " << r.name << ": error " << r.err << ", tolerance "
              << r.tol << "\n";
    EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
  }
}

// A negative scale is valid (ValidateAttentionArgs asks only for a finite, non-zero one).
// The flash kernels run on |scale| with Q's sign flipped as it is loaded (FlashQSign), so
// that a row's largest scaled score is the scale times its largest raw one: the parity
// table's flash shapes with the scale −1/√Dh, on both kernels, Q in registers and in
// shared memory (Dh 256), with and without the soft cap, within the same tolerance.
TEST_F(CudaBackendTest, FlashWithANegativeScaleWithinTolerance) {
  std::mt19937_64 rng(9);
  std::vector<parity::ParityResult> results;
  const std::set<std::string> labels = {
      "prefill offset GQA 8/4",        "prefill offset GQA 8/4, rows in 16-byte pieces",
      "prefill head size 256 GQA 2/1", "prefill head size 256 GQA 2/1, rows in 16-byte pieces",
      "prefill softcap 1 GQA 4/2",     "prefill softcap 1 GQA 4/2, rows in 16-byte pieces"};
  int shapes = 0;
  for (parity::AttnShape s : parity::AttentionShapes()) {
    if (labels.count(s.label) == 0) continue;
    ++shapes;
    s.scale = -1.0 / std::sqrt(static_cast<double>(s.dh));
    s.label += ", scale -1/sqrt(Dh)";
    for (parity::ParityResult& r : parity::AttentionCase(*backend_, rng, s)) {
      results.push_back(std::move(r));
    }
  }
  // Each on an fp32 cache (the fp16 kernel) and a bf16 cache in 16-byte pieces (the bf16
  // kernel); the first also on a bf16 cache of 8-byte loads (the fp16 kernel).
  EXPECT_EQ(shapes, 7);
  for (const parity::ParityResult& r : results) {
    std::cerr << "[ parity   ] " << r.name << ": error " << r.err << ", tolerance " << r.tol
              << "\n";
    EXPECT_NE(r.name.find("flash"), std::string::npos) << r.name;
    EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
  }
}

// The parity table's 128-query blocks of the bf16 flash kernel are 8 warps of 16 queries
// (kFlashDefaultWarpQueries, Q's fragments in registers) with two K/V stages
// (kFlashDefaultStages). This runs its flash shapes on a bf16 cache with blocks of `tile`
// queries (128, or 192 where the head size has them), and a batch of prefill chunks, with
// the kernel set to warp_queries and stages, within the same tolerance; `layout` names the
// setting in the log.
void RunBf16FlashLayout(CudaBackend& backend, int tile, int warp_queries, int stages,
                        const char* layout, int key_tile = kFlashDefaultKeyTile) {
  static_assert(kFlashDefaultTileQueries == 128 && kFlashDefaultWarpQueries == 16 &&
                    kFlashDefaultStages == 2 && kFlashDefaultKeyTile == 64,
                "then the tests below should run the other layouts");
  ASSERT_TRUE(backend.SetFlashLayout({tile, warp_queries, stages, key_tile}).ok());
  std::mt19937_64 rng(6);
  std::vector<parity::ParityResult> results;
  int shapes = 0;
  for (const parity::AttnShape& s : parity::AttentionShapes()) {
    if (s.want_maps || s.want_probs_only || s.tq < kFlashMinQueries || !s.bf16_cache) continue;
    if (FlashBf16TileQueries(s.dh, tile) != tile) continue;
    ++shapes;
    for (parity::ParityResult& r : parity::AttentionCase(backend, rng, s)) {
      results.push_back(std::move(r));
    }
  }
  EXPECT_GE(shapes, 4);
  int uploads = -1;
  results.push_back(parity::AttentionBatchFlashCase(backend, rng, &uploads, true));
  ASSERT_TRUE(backend.SetFlashLayout(FlashBf16Layout{}).ok());
  for (const parity::ParityResult& r : results) {
    std::cerr << "[ parity   ] " << layout << ": " << r.name << ": error " << r.err
              << ", tolerance " << r.tol << "\n";
    EXPECT_TRUE(r.pass()) << layout << ": " << r.name << ": " << r.status << ", error " << r.err
                          << " > " << r.tol;
  }
}

// 4 warps of 32 queries: each K/V fragment serves two 16-row stripes, Q waits in shared
// memory.
TEST_F(CudaBackendTest, Bf16FlashWithWarpsOf32QueriesWithinTolerance) {
  EXPECT_EQ(backend_->SetFlashWarpQueries(64).code(), absl::StatusCode::kInvalidArgument);
  RunBf16FlashLayout(*backend_, 128, 32, 2, "warps of 32");
}

// Three K/V stages and one barrier a tile, for both warp layouts: the shapes include keys
// past three tiles (the stages' reuse), keys ending mid-tile, offsets, windows and documents.
TEST_F(CudaBackendTest, Bf16FlashWithThreeStagesWithinTolerance) {
  for (int stages : {1, 4}) {
    const absl::Status s = backend_->SetFlashStages(stages);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << stages;
    EXPECT_NE(std::string(s.message()).find("flash stages must be 2 or 3"), std::string::npos) << s;
  }
  RunBf16FlashLayout(*backend_, 128, 16, 3, "three stages, warps of 16");
  RunBf16FlashLayout(*backend_, 128, 32, 3, "three stages, warps of 32");
}

// 8 warps of 16 queries at 32 keys a tile (Q in shared memory, two blocks an SM), with two
// and three stages. The key tile is the 8-warp blocks' alone: 4 warps of 32 keep theirs.
TEST_F(CudaBackendTest, Bf16FlashWith32KeyTilesWithinTolerance) {
  for (int keys : {16, 48, 128}) {
    const absl::Status s = backend_->SetFlashKeyTile(keys);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << keys;
    EXPECT_NE(std::string(s.message()).find("flash key tile must be 64 or 32"), std::string::npos)
        << s;
  }
  RunBf16FlashLayout(*backend_, 128, 16, 2, "32-key tiles", 32);
  RunBf16FlashLayout(*backend_, 128, 16, 3, "32-key tiles, three stages", 32);
  RunBf16FlashLayout(*backend_, 128, 32, 2, "32-key tiles asked for, warps of 32", 32);
}

// 192-query blocks (12 warps of 16, Q in shared memory) at head sizes 64 and 128, with two
// and three stages: the shapes include a 200-query prompt (a full block and one of 8 rows).
// Elsewhere, and on the fp16 kernel, 192 asks for 128-query blocks (64 where those are
// missing).
TEST_F(CudaBackendTest, Bf16FlashWith192QueryBlocksWithinTolerance) {
  EXPECT_EQ(FlashBf16TileQueries(128, 192), 192);
  EXPECT_EQ(FlashBf16TileQueries(64, 192), 192);
  EXPECT_EQ(FlashBf16TileQueries(96, 192), 64);
  EXPECT_EQ(FlashBf16TileQueries(256, 192), 64);
  EXPECT_EQ(FlashBf16TileQueries(128, 128), 128);
  RunBf16FlashLayout(*backend_, 192, 16, 2, "192-query blocks");
  RunBf16FlashLayout(*backend_, 192, 16, 3, "192-query blocks, three stages");
  // The fp16 kernel (fp32 caches) with 192 asked for: it runs, within tolerance.
  ASSERT_TRUE(backend_->SetFlashTileQueries(192).ok());
  std::mt19937_64 rng(7);
  int shapes = 0;
  for (const parity::AttnShape& s : parity::AttentionShapes()) {
    if (s.want_maps || s.want_probs_only || s.tq < kFlashMinQueries || s.bf16_cache) continue;
    if (!FlashPrefillSupports(s.dh)) continue;
    ++shapes;
    for (const parity::ParityResult& r : parity::AttentionCase(*backend_, rng, s)) {
      EXPECT_TRUE(r.pass()) << "fp16 kernel, 192 asked for: " << r.name << ": " << r.status
                            << ", error " << r.err << " > " << r.tol;
    }
  }
  EXPECT_GE(shapes, 4);
  ASSERT_TRUE(backend_->SetFlashTileQueries(kFlashDefaultTileQueries).ok());
}

// Prefill over a bf16 cache whose rows are 16-byte pieces takes the bf16 flash kernel,
// which rounds Q and P to bf16; SetFlashBf16(false) sends it to the fp16 kernel. Told
// apart by which naive run the output follows: on one tile of keys (the running max is the
// final one, so P is rounded from the same values as the naive run's), a kernel's RMS
// difference from the naive run of its own precision is fp32 summation order plus a rare
// rounding flip, far below its difference from the other precision's run (Q rounded to
// bf16 against fp16 moves every score by ~2^-9 relative). Both stay within the parity
// tolerance.
TEST_F(CudaBackendTest, Bf16CacheTakesTheBf16FlashKernelUnlessTurnedOff) {
  const parity::AttnShape s{.label = "one tile",
                            .tq = 64,
                            .tk = 64,
                            .heads = 4,
                            .kv_heads = 2,
                            .dh = 64,
                            .causal = false,
                            .kv_pad = 8,
                            .bf16_cache = true};
  std::mt19937_64 rng(21);
  const parity::AttnInputs in = parity::MakeAttnInputs(s, rng);
  const std::vector<double> naive_bf16 =
      parity::NaiveAttention(s, DType::kBF16, in.q, in.k, in.v, in.docs, in.scale);
  const std::vector<double> naive_f16 =
      parity::NaiveAttention(s, DType::kF16, in.q, in.k, in.v, in.docs, in.scale);
  auto call = parity::UploadAttnCall(s, in);
  ASSERT_TRUE(call.ok()) << call.status();
  const AttentionArgs<float>& a = call->args;
  for (bool bf16_kernel : {true, false}) {
    backend_->SetFlashBf16(bf16_kernel);
    EXPECT_EQ(parity::AttentionPathDType(*backend_, a, true),
              bf16_kernel ? DType::kBF16 : DType::kF16);
    ASSERT_TRUE(backend_->Attention(a).ok());
    auto out = parity::FromDevice(*backend_, call->out, in.qs.size());
    ASSERT_TRUE(out.ok()) << out.status();
    double sq_bf16 = 0, sq_f16 = 0;
    for (int i = 0; i < s.tq; ++i) {
      for (int64_t c = 0; c < in.q_width; ++c) {
        const double got = (*out)[i * in.q_stride + c];
        sq_bf16 += std::pow(got - naive_bf16[i * in.q_width + c], 2);
        sq_f16 += std::pow(got - naive_f16[i * in.q_width + c], 2);
      }
    }
    const double own = std::sqrt(bf16_kernel ? sq_bf16 : sq_f16);
    const double other = std::sqrt(bf16_kernel ? sq_f16 : sq_bf16);
    EXPECT_LT(10 * own, other) << (bf16_kernel ? "bf16" : "fp16") << " kernel: RMS·n " << own
                               << " from its own precision's naive run, " << other
                               << " from the other's";
  }
  backend_->SetFlashBf16(true);
}

// A causal prefill block sees keys up to its last query only; what the cache holds past
// them (up to num_keys) must not matter, NaN included: the flash kernels zero those rows
// rather than multiply a NaN value row by a zero weight. Keys 74 … 127 of a 64-query call
// at offset 10 (the block's keys end mid-tile) NaN-filled against finite: the same
// outputs, all finite, for the fp16 kernel over fp32 and bf16 caches and for the bf16
// kernel with warps of 32 and of 16 queries, with two and three K/V stages (three issue
// the second tile, the one past the keys' end, before the loop), in 192-query blocks, and
// at 32 keys a tile.
TEST_F(CudaBackendTest, FlashIgnoresWhatTheCacheHoldsPastTheBlocksKeys) {
  struct Layout {
    int warp_queries, stages, tile, key_tile = kFlashDefaultKeyTile;  // warp_queries 0: fp16
  };
  for (bool bf16_cache : {false, true}) {
    for (const Layout layout :
         {Layout{0, 2, 128}, Layout{32, 2, 128}, Layout{16, 2, 128}, Layout{32, 3, 128},
          Layout{16, 3, 128}, Layout{16, 2, 192}, Layout{16, 3, 192}, Layout{16, 2, 128, 32},
          Layout{16, 3, 128, 32}}) {
      const int warp_queries = layout.warp_queries;
      const bool bf16_kernel = warp_queries != 0;
      if (!bf16_cache && !bf16_kernel) continue;
      SCOPED_TRACE(::testing::Message()
                   << "bf16 cache " << bf16_cache << ", bf16 kernel " << bf16_kernel
                   << ", warps of " << warp_queries << ", stages " << layout.stages << ", tile "
                   << layout.tile << ", keys a tile " << layout.key_tile);
      if (bf16_kernel) {
        ASSERT_TRUE(
            backend_->SetFlashLayout({layout.tile, warp_queries, layout.stages, layout.key_tile})
                .ok());
      }
      const parity::AttnShape s{.label = "keys past the block's",
                                .tq = 64,
                                .tk = 128,
                                .heads = 4,
                                .kv_heads = 2,
                                .dh = 64,
                                .offset = 10,
                                .causal = true,
                                .kv_pad = 8,
                                .bf16_cache = bf16_cache};
      std::mt19937_64 rng(23);
      parity::AttnInputs in = parity::MakeAttnInputs(s, rng);
      backend_->SetFlashBf16(bf16_kernel);
      auto run = [&]() -> std::vector<double> {
        auto call = parity::UploadAttnCall(s, in);
        EXPECT_TRUE(call.ok()) << call.status();
        if (!call.ok()) return {};
        const AttentionArgs<float>& a = call->args;
        EXPECT_EQ(parity::AttentionPathDType(*backend_, a, true),
                  bf16_cache && bf16_kernel ? DType::kBF16 : DType::kF16);
        EXPECT_TRUE(backend_->Attention(a).ok());
        auto out = parity::FromDevice(*backend_, call->out, in.qs.size());
        EXPECT_TRUE(out.ok()) << out.status();
        return out.ok() ? *out : std::vector<double>{};
      };
      const std::vector<double> finite = run();
      for (int j = s.offset + s.tq; j < s.tk; ++j) {
        const int64_t row = int64_t{in.table[j / s.block_size]} * s.block_size + j % s.block_size;
        for (int64_t e = 0; e < in.kv_stride; ++e) {
          in.kc[row * in.kv_stride + e] = in.vc[row * in.kv_stride + e] = parity::kNaN;
        }
      }
      const std::vector<double> poisoned = run();
      ASSERT_EQ(poisoned.size(), finite.size());
      for (int i = 0; i < s.tq; ++i) {
        for (int64_t c = 0; c < in.q_width; ++c) {
          const size_t at = static_cast<size_t>(i * in.q_stride + c);
          ASSERT_TRUE(std::isfinite(poisoned[at])) << "row " << i << ", column " << c;
          ASSERT_EQ(poisoned[at], finite[at]) << "row " << i << ", column " << c;
        }
      }
    }
  }
  backend_->SetFlashBf16(true);
  ASSERT_TRUE(backend_->SetFlashLayout(FlashBf16Layout{}).ok());
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(CudaBackendFlashTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
