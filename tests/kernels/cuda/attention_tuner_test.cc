// The attention tuner (kernels/cuda/attention_tuner.h) on a CudaBackend: every candidate
// runs, agrees with the default (each kernel computes the same attention) and is timed;
// the fastest is kept and the backend left with it; a bad shape leaves the backend as it
// was. Suites named CudaBackend* (ctest label `gpu`); without a device they skip with the
// reason. On the CUDA emulator the times are the emulator's, so the choice is arbitrary
// there, but it must still be the fastest of the report and set on the backend.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_tuner.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"

namespace kvlens::kernels::cuda {
namespace {

AttentionTuneShape SmallShape(KvDtype cache) {
  AttentionTuneShape z;
  z.num_heads = 4;
  z.num_kv_heads = 2;
  z.head_dim = 64;
  z.cache_dtype = cache;
  z.block_size = 16;
  z.prefill_tokens = 40;  // one partial block of every layout
  z.decode_keys = 75;     // a partial cache block
  z.decode_batches = {1, 3};
  return z;
}

// Every candidate ran each of the phase's `calls` and agreed; the chosen one is the
// fastest relative to the default, and exactly one is chosen.
void ExpectOneFastestChosen(const std::vector<TunedCandidate>& list, size_t calls) {
  const std::vector<double> relative = RelativeTimes(list);
  int chosen = -1;
  for (int i = 0; i < static_cast<int>(list.size()); ++i) {
    const TunedCandidate& c = list[i];
    SCOPED_TRACE(c.name);
    EXPECT_TRUE(c.failure.empty()) << c.failure;
    EXPECT_GT(c.tolerance, 0.0);
    EXPECT_LE(c.max_error, c.tolerance);
    ASSERT_EQ(c.seconds.size(), calls);
    for (double sec : c.seconds) EXPECT_GT(sec, 0.0);
    EXPECT_GT(relative[i], 0.0);
    if (c.chosen) {
      EXPECT_EQ(chosen, -1) << "two chosen";
      chosen = i;
    }
  }
  ASSERT_GE(chosen, 0);
  EXPECT_DOUBLE_EQ(relative.front(), 1.0);
  for (size_t i = 0; i < list.size(); ++i) EXPECT_GE(relative[i], relative[chosen]) << list[i].name;
}

const TunedCandidate& Chosen(const std::vector<TunedCandidate>& list) {
  for (const TunedCandidate& c : list) {
    if (c.chosen) return c;
  }
  return list.front();
}

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// bf16 cache: the bf16 flash kernel's eight layouts (the default first) and the decode
// kernels, all agreeing; the backend keeps what the report says was chosen.
TEST_F(CudaBackendTest, TunerKeepsTheFastestKernelsThatAgree) {
  CudaBackend& b = *backend_;
  b.SetSplitKvTensorCores(true);  // the tuner measures from the defaults, whatever was set
  absl::StatusOr<AttentionTuneReport> r = TuneAttention(b, SmallShape(KvDtype::kBF16));
  ASSERT_TRUE(r.ok()) << r.status();
  SCOPED_TRACE(r->ToString());
  // Eight layouts, then the fastest in one other block order: 4 heads are all the heads,
  // and the 2 KV heads' 40 keys fit the emulator's 1 MiB L2, so every order asked for is
  // that one.
  ASSERT_EQ(r->prefill.size(), 9u);
  EXPECT_EQ(r->prefill.front().name,
            "flash, 128-query blocks of 8 warps, 2 K/V stages, 64-key tiles (default)");
  EXPECT_TRUE(Has(r->prefill.back().name, "; longest first across 4 heads (sized to L2)"))
      << r->prefill.back().name;
  ExpectOneFastestChosen(r->prefill, 1);
  // Split-KV at 4 warps, fused or not; 16 warps (a head tile of 2 heads of 64); tensor
  // cores, fused or not; then the fastest of them splitting the batch of 3 unequal rows
  // (25, 50 and 75 keys) by its imbalance.
  ASSERT_EQ(r->decode.size(), 6u);
  EXPECT_TRUE(Has(r->decode.back().name, "; splits by the batch's imbalance"))
      << r->decode.back().name;
  EXPECT_EQ(r->decode.front().name, "split-KV, 4 warps a block (default)");
  ExpectOneFastestChosen(r->decode, 2);
  EXPECT_EQ(r->decode.front().max_error, 0.0);

  AttentionParams p;
  p.head_dim = 64;
  const FlashBf16Layout l = ResolvedFlashBf16Layout(p, b.flash_layout());
  EXPECT_TRUE(Has(Chosen(r->prefill).name,
                  absl::StrCat(l.tile_queries, "-query blocks of ", l.tile_queries / l.warp_queries,
                               " warps, ", l.stages, " K/V stages, ", l.key_tile, "-key tiles")));
  // The order candidate is the fastest layout's, and the backend keeps the order chosen.
  std::string layout = r->prefill[FastestAccepted(absl::MakeConstSpan(r->prefill).first(8))].name;
  layout = layout.substr(0, layout.rfind(" (default)"));
  EXPECT_EQ(r->prefill.back().name.rfind(layout + "; longest first", 0), 0u) << layout;
  EXPECT_EQ(b.flash_head_group(),
            Has(Chosen(r->prefill).name, "longest first") ? kFlashAutoHeadGroup : 1);
  const std::string& decode = Chosen(r->decode).name;
  EXPECT_EQ(b.split_kv_tensor_cores(), Has(decode, "tensor cores"));
  EXPECT_EQ(b.split_kv_fused_combine(), Has(decode, "fused combine"));
  EXPECT_EQ(b.split_kv_warps(), Has(decode, "16 warps") ? kSplitKvWideWarps : kSplitKvWarps);
  EXPECT_EQ(b.split_kv_balanced(), Has(decode, "imbalance"));
  EXPECT_TRUE(b.status().ok()) << b.status();
}

// fp32 cache: the fp16 flash kernel, whose block size alone is a layout, then the bf16
// kernel's layouts on an fp16 copy of the blocks (under the soft cap, Gemma 2's, in every
// candidate, two stripes resolve to one: 7 of the 8); the backend keeps the copy where
// the chosen candidate runs on it.
TEST_F(CudaBackendTest, TunerOnAnFp32CacheTimesTheFp16KernelAndTheFp16Copy) {
  AttentionTuneShape z = SmallShape(KvDtype::kActivation);
  z.softcap = 50.0;
  absl::StatusOr<AttentionTuneReport> r = TuneAttention(*backend_, z);
  ASSERT_TRUE(r.ok()) << r.status();
  SCOPED_TRACE(r->ToString());
  ASSERT_EQ(r->prefill.size(), 10u);
  EXPECT_EQ(r->prefill[0].name, "flash (fp16 kernel), 128-query blocks (default)");
  EXPECT_EQ(r->prefill[1].name, "flash (fp16 kernel), 64-query blocks");
  EXPECT_EQ(r->prefill[2].name,
            "on an fp16 copy, flash, 128-query blocks of 8 warps, 2 K/V stages, 64-key tiles");
  EXPECT_EQ(r->prefill[8].name,
            "on an fp16 copy, flash, 64-query blocks of 4 warps, 2 K/V stages, 64-key tiles");
  for (int i = 2; i < 9; ++i) EXPECT_EQ(r->prefill[i].name.rfind("on an fp16 copy, ", 0), 0u);
  EXPECT_TRUE(Has(r->prefill[9].name, "; longest first across 4 heads (sized to L2)"))
      << r->prefill[9].name;
  ExpectOneFastestChosen(r->prefill, 1);
  EXPECT_EQ(backend_->flash_f16_copy(), Has(Chosen(r->prefill).name, "on an fp16 copy"));
  ExpectOneFastestChosen(r->decode, 2);
  EXPECT_TRUE(Has(r->shape, "fp32 cache in blocks of 16, soft cap 50")) << r->shape;
  EXPECT_TRUE(Has(r->shape, "prefill 40 tokens, decode 1 / 3 sequences of up to 75 keys;"))
      << r->shape;
}

// Gemma 2's head size 256 under its soft cap: every layout asked for runs as 64-query blocks
// of 4 warps, two stages, 32-key tiles, so prefill has one layout, named as it runs, and
// that layout in one other order.
TEST_F(CudaBackendTest, TunerTimesEachPrefillKernelOnce) {
  AttentionTuneShape z = SmallShape(KvDtype::kBF16);
  z.head_dim = 256;
  z.softcap = 50.0;
  absl::StatusOr<AttentionTuneReport> r = TuneAttention(*backend_, z);
  ASSERT_TRUE(r.ok()) << r.status();
  SCOPED_TRACE(r->ToString());
  ASSERT_EQ(r->prefill.size(), 2u);
  EXPECT_EQ(r->prefill[0].name,
            "flash, 64-query blocks of 4 warps, 2 K/V stages, 32-key tiles (default)");
  EXPECT_EQ(r->prefill[1].name,
            "flash, 64-query blocks of 4 warps, 2 K/V stages, 32-key tiles; longest first across "
            "4 heads (sized to L2)");
  ExpectOneFastestChosen(r->prefill, 1);
  ExpectOneFastestChosen(r->decode, 2);
}

// A head size no decode kernel takes (past kSplitKvMaxHeadDim, and past the flash
// kernels'): each candidate is reported with the backend's refusal, none is kept, and
// nothing changes.
TEST_F(CudaBackendTest, TunerReportsCandidatesTheBackendRefuses) {
  CudaBackend& b = *backend_;
  b.SetSplitKvFusedCombine(true);
  AttentionTuneShape z = SmallShape(KvDtype::kActivation);
  z.head_dim = 2 * kSplitKvMaxHeadDim;
  absl::StatusOr<AttentionTuneReport> r = TuneAttention(b, z);
  ASSERT_TRUE(r.ok()) << r.status();
  SCOPED_TRACE(r->ToString());
  EXPECT_TRUE(r->prefill.empty());
  ASSERT_FALSE(r->decode.empty());
  for (const TunedCandidate& c : r->decode) {
    EXPECT_TRUE(Has(c.failure, "is not supported by the CUDA backend"))
        << c.name << ": " << c.failure;
    EXPECT_FALSE(c.chosen);
  }
  EXPECT_TRUE(Has(r->ToString(), "not run: AttentionArgs.head_dim"));
  EXPECT_TRUE(b.split_kv_fused_combine());
  EXPECT_TRUE(b.status().ok()) << b.status();
}

// A bad shape changes nothing, and neither does a shape with nothing to tune: a prefill too
// short for the flash kernels and decode_keys 0.
TEST_F(CudaBackendTest, TunerLeavesTheBackendAsItWasOnABadShape) {
  CudaBackend& b = *backend_;
  ASSERT_TRUE(b.SetFlashLayout({128, 16, 3, 32}).ok());
  ASSERT_TRUE(b.SetFlashHeadGroup(2).ok());
  b.SetSplitKvFusedCombine(true);
  AttentionTuneShape z = SmallShape(KvDtype::kBF16);
  z.num_kv_heads = 3;
  absl::StatusOr<AttentionTuneReport> r = TuneAttention(b, z);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "attention tuning: num_kv_heads 3 must be >= 1 and divide num_heads 4");
  EXPECT_EQ(b.flash_layout().stages, 3);
  EXPECT_EQ(b.flash_layout().key_tile, 32);
  EXPECT_EQ(b.flash_head_group(), 2);
  EXPECT_TRUE(b.split_kv_fused_combine());

  z = SmallShape(KvDtype::kBF16);
  z.prefill_tokens = kFlashMinQueries - 1;
  z.decode_keys = 0;
  r = TuneAttention(b, z);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->prefill.empty());
  EXPECT_TRUE(r->decode.empty());
  // Nothing was timed, so nothing changed.
  EXPECT_EQ(b.flash_layout().stages, 3);
  EXPECT_EQ(b.flash_head_group(), 2);
  EXPECT_TRUE(b.split_kv_fused_combine());
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else

TEST(CudaBackendTunerTest, SkippedInThisBuild) { GTEST_SKIP() << "built without CUDA"; }

#endif  // KVLENS_HAVE_CUDA
