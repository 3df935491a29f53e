// Flash prefill over an fp32 cache on an fp16 copy of its blocks (kv_f16_copy.h;
// CudaBackend::SetFlashF16Copy): the copies' plan on the host against tables renumbered by
// hand; on CudaBackend, the fp16 kernel's very bits where both run the same tiles (the
// fp16 kernel converts each element itself), alone and batched over blocks two sequences
// share, and the parity table's flash shapes in every layout within the tolerance of the
// naive fp16 run. Suites named CudaBackend* need a device (ctest label `gpu`; they skip
// with the reason without one); KvF16CopyPlan* are host arithmetic.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <cmath>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/kv_f16_copy.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"

namespace kvlens::kernels::cuda {
namespace {

// Worked by hand: without a window every key may be read (0); with a window of 100 the
// first row at position 300 sees keys from 201 on, in the 64-key tile from 192; at
// position 50 from 0; a window of 1 at position 64 sees key 64 alone, tile 64.
TEST(KvF16CopyPlanTest, FirstKeyReadIsTheTileOfTheFirstRowsFirstKey) {
  EXPECT_EQ(KvF16CopyPlan::FirstKeyRead(300, 0), 0);
  EXPECT_EQ(KvF16CopyPlan::FirstKeyRead(300, 100), 192);
  EXPECT_EQ(KvF16CopyPlan::FirstKeyRead(50, 100), 0);
  EXPECT_EQ(KvF16CopyPlan::FirstKeyRead(64, 1), 64);
  EXPECT_EQ(KvF16CopyPlan::FirstKeyRead(63, 1), 0);
}

// Two sequences sharing a prefix of two blocks (7 and 3), then a third whose window starts
// at key 40 (blocks of 16: its entries 0 and 1 are never read): each cache block is copied
// once, in the order first met, and the tables point at the copies.
TEST(KvF16CopyPlanTest, RenumbersEachBlockOnceInTheOrderFirstRead) {
  KvF16CopyPlan plan;
  std::vector<int32_t> a = {7, 3, 9};
  std::vector<int32_t> b = {7, 3, 5, 2};
  std::vector<int32_t> c = {11, 12, 9, 13};
  plan.Renumber(a.data(), 3, 16, 0);
  plan.Renumber(b.data(), 4, 16, 0);
  plan.Renumber(c.data(), 4, 16, 40);
  EXPECT_EQ(a, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(b, (std::vector<int32_t>{0, 1, 3, 4}));
  EXPECT_EQ(c, (std::vector<int32_t>{0, 0, 2, 5}));
  EXPECT_EQ(plan.sources(), (std::vector<int32_t>{7, 3, 9, 5, 2, 13}));
  // A first key past the table's keys reads nothing.
  std::vector<int32_t> d = {20, 21};
  plan.Renumber(d.data(), 2, 16, 64);
  EXPECT_EQ(d, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(plan.sources().size(), 6u);
}

// One call's output (NaN where never written), the fp16 copy on or off; `contiguous`: the
// cache's rows in key order without a block table (the parity inputs' K and V as they are).
std::vector<double> RunCall(CudaBackend& b, bool f16_copy, bool contiguous,
                            const parity::AttnShape& s, const parity::AttnInputs& in) {
  b.SetFlashF16Copy(f16_copy);
  auto call = parity::UploadAttnCall(s, in);
  EXPECT_TRUE(call.ok()) << call.status();
  if (!call.ok()) return {};
  AttentionArgs<float> a = call->args;
  absl::StatusOr<DeviceBuffer> k = parity::ToDevice(in.k), v = parity::ToDevice(in.v);
  EXPECT_TRUE(k.ok() && v.ok());
  if (!k.ok() || !v.ok()) return {};
  if (contiguous) {
    a.kv.k = k->get();
    a.kv.v = v->get();
    a.kv.row_stride = in.kv_width;
    a.kv.block_table = nullptr;
  }
  EXPECT_TRUE(b.Attention(a).ok());
  auto out = parity::FromDevice(b, call->out, in.qs.size());
  EXPECT_TRUE(out.ok()) << out.status();
  b.SetFlashF16Copy(false);
  return out.ok() ? *out : std::vector<double>{};
}

// Where the copy's launch runs the fp16 kernel's tiles (128-query blocks of 8 warps at head
// sizes 64 and 128, 64-query blocks of 4 at 80 and 96; 64 keys a tile), it rounds K, V, Q
// and P to fp16 alike and adds the same products in the same order: the same bits, over a
// paged NaN-filled cache (a row stride of 4-float pieces and one of single floats: both of
// the copy's loads) and a contiguous one, with offsets, documents, grouped-query heads,
// a sliding window that hides the first tiles (their blocks not copied), the soft cap, and
// a last block whose keys end mid-tile.
TEST_F(CudaBackendTest, FlashOnAnF16CopyGivesTheFp16KernelsBits) {
  CudaBackend& b = *backend_;
  EXPECT_FALSE(b.flash_f16_copy());
  std::vector<parity::AttnShape> shapes = {
      {.label = "Dh 64, documents",
       .tq = 150,
       .tk = 190,
       .heads = 6,
       .kv_heads = 2,
       .dh = 64,
       .offset = 40,
       .doc_lengths = {90, 100}},
      {.label = "Dh 128, offset, row stride of single floats",
       .tq = 130,
       .tk = 200,
       .heads = 4,
       .kv_heads = 1,
       .dh = 128,
       .offset = 70,
       .kv_pad = 3},
      {.label = "Dh 64, window of 50",
       .tq = 100,
       .tk = 400,
       .heads = 4,
       .kv_heads = 2,
       .dh = 64,
       .offset = 300,
       .window = 50},
      {.label = "Dh 96, soft cap",
       .tq = 70,
       .tk = 70,
       .heads = 2,
       .kv_heads = 1,
       .dh = 96,
       .softcap = 1.0},
      {.label = "Dh 80, not causal", .tq = 40, .tk = 90, .heads = 2, .dh = 80, .causal = false},
  };
  for (const parity::AttnShape& s : shapes) {
    for (bool contiguous : {false, true}) {
      SCOPED_TRACE(::testing::Message() << s.label << ", contiguous " << contiguous);
      std::mt19937_64 rng(41);
      const parity::AttnInputs in = parity::MakeAttnInputs(s, rng);
      const std::vector<double> fp16_kernel = RunCall(b, false, contiguous, s, in);
      const std::vector<double> on_copy = RunCall(b, true, contiguous, s, in);
      ASSERT_FALSE(fp16_kernel.empty());
      ASSERT_EQ(on_copy.size(), fp16_kernel.size());
      for (int i = 0; i < s.tq; ++i) {
        for (int64_t c = 0; c < in.q_width; ++c) {
          const size_t at = static_cast<size_t>(i * in.q_stride + c);
          ASSERT_TRUE(std::isfinite(on_copy[at])) << "row " << i << ", col " << c;
          ASSERT_EQ(on_copy[at], fp16_kernel[at]) << "row " << i << ", col " << c;
        }
      }
    }
  }
}

// AttentionBatch's one flash launch over two prefill chunks whose tables share their first
// three blocks (a common prefix, copied once) and a third chunk's, the copy on and off: the
// same bits. The shared blocks are read by two sequences through one copy.
TEST_F(CudaBackendTest, BatchedFlashOnAnF16CopyOfSharedBlocksGivesTheFp16KernelsBits) {
  constexpr int kHeads = 4, kKvHeads = 2, kDh = 64, kBs = 16;
  constexpr int64_t kQw = kHeads * kDh, kKvw = kKvHeads * kDh, kKvStride = kKvw + 4;
  struct Seq {
    int tq, tk;
    std::vector<int32_t> table;
  };
  // 20 cache blocks; blocks 4, 9 and 1 hold the shared prefix (48 keys).
  const std::vector<Seq> seqs = {{40, 100, {4, 9, 1, 12, 6, 17, 0}},
                                 {64, 130, {4, 9, 1, 3, 15, 8, 11, 19, 5}},
                                 {33, 33, {14, 2, 7}}};
  std::mt19937_64 rng(43);
  const int num_blocks = 20;
  std::vector<double> kc(size_t{num_blocks} * kBs * kKvStride, parity::kNaN), vc = kc;
  const std::vector<double> k = kernels::testing::RandomFloatExact(rng, kc.size(), -2, 2);
  const std::vector<double> v = kernels::testing::RandomFloatExact(rng, vc.size());
  for (const Seq& s : seqs) {
    for (int j = 0; j < s.tk; ++j) {  // each key's row written (a shared one twice, alike)
      const int64_t row = int64_t{s.table[j / kBs]} * kBs + j % kBs;
      for (int64_t e = 0; e < kKvw; ++e) {
        kc[row * kKvStride + e] = k[row * kKvStride + e];
        vc[row * kKvStride + e] = v[row * kKvStride + e];
      }
    }
  }
  int rows = 0;
  for (const Seq& s : seqs) rows += s.tq;
  const std::vector<double> q = kernels::testing::RandomFloatExact(rng, size_t(rows) * kQw, -2, 2);
  auto dq = parity::ToDevice(q), dk = parity::ToDevice(kc), dv = parity::ToDevice(vc);
  ASSERT_TRUE(dq.ok() && dk.ok() && dv.ok());
  auto run = [&](bool f16_copy) -> std::vector<double> {
    backend_->SetFlashF16Copy(f16_copy);
    auto out = parity::ToDevice(std::vector<double>(q.size(), parity::kNaN));
    EXPECT_TRUE(out.ok());
    if (!out.ok()) return {};
    std::vector<AttentionArgs<float>> calls;
    int row0 = 0;
    for (const Seq& s : seqs) {
      AttentionArgs<float> a;
      a.q = dq->as<float>() + row0 * kQw;
      a.q_stride = kQw;
      a.num_queries = s.tq;
      a.num_keys = s.tk;
      a.num_heads = kHeads;
      a.num_kv_heads = kKvHeads;
      a.head_dim = kDh;
      a.query_offset = s.tk - s.tq;
      a.scale = 0.125;
      a.kv = KvSource<float>{dk->get(), dv->get(), kKvStride, s.table.data(), kBs};
      a.out = out->as<float>() + row0 * kQw;
      a.out_stride = kQw;
      calls.push_back(a);
      row0 += s.tq;
    }
    const CudaBackend::IndexUploadStats before = backend_->index_upload_stats();
    int failed = -1;
    EXPECT_TRUE(backend_->AttentionBatch(calls, &failed).ok()) << "call " << failed;
    // One upload: the tables, the tiles and (on the copy) the copies' sources.
    EXPECT_EQ(backend_->index_upload_stats().copies - before.copies, 1);
    backend_->SetFlashF16Copy(false);
    auto got = parity::FromDevice(*backend_, *out, q.size());
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? *got : std::vector<double>{};
  };
  const std::vector<double> fp16_kernel = run(false), on_copy = run(true);
  ASSERT_EQ(fp16_kernel.size(), q.size());
  ASSERT_EQ(on_copy.size(), q.size());
  for (size_t e = 0; e < q.size(); ++e) {
    ASSERT_TRUE(std::isfinite(on_copy[e])) << "element " << e;
    ASSERT_EQ(on_copy[e], fp16_kernel[e]) << "element " << e;
  }
}

// Every flash shape of the parity table on an fp32 cache, with batches of prefill chunks
// and of sliding windows, on the copy in each of the bf16 kernel's layouts (the default's
// 128-query blocks, 64-query ones, two stripes, three stages, 32-key tiles, 192-query
// blocks), within the tolerance of the naive fp16 run (AttentionPathDType: fp16 on an fp32
// cache). Head size 256 runs 32-key tiles here, where the fp16 kernel runs 64.
TEST_F(CudaBackendTest, FlashOnAnF16CopyWithinToleranceInEveryLayout) {
  const FlashBf16Layout layouts[] = {FlashBf16Layout{},
                                     FlashBf16Layout{64, 16, 2, 64},
                                     FlashBf16Layout{128, 32, 2, 64},
                                     FlashBf16Layout{128, 16, 3, 64},
                                     FlashBf16Layout{128, 16, 2, 32},
                                     FlashBf16Layout{192, 16, 2, 64}};
  for (const FlashBf16Layout& layout : layouts) {
    SCOPED_TRACE(::testing::Message()
                 << layout.tile_queries << "-query blocks, warps of " << layout.warp_queries << ", "
                 << layout.stages << " stages, " << layout.key_tile << "-key tiles");
    ASSERT_TRUE(backend_->SetFlashLayout(layout).ok());
    backend_->SetFlashF16Copy(true);
    std::mt19937_64 rng(47);
    std::vector<parity::ParityResult> results;
    int shapes = 0;
    const bool all = layout.tile_queries == kFlashDefaultTileQueries &&
                     layout.warp_queries == kFlashDefaultWarpQueries &&
                     layout.stages == kFlashDefaultStages &&
                     layout.key_tile == kFlashDefaultKeyTile;
    for (const parity::AttnShape& s : parity::AttentionShapes()) {
      if (s.want_maps || s.want_probs_only || s.tq < kFlashMinQueries || s.bf16_cache) continue;
      if (!FlashPrefillSupports(s.dh)) continue;
      // The default layout on every shape, the others on those whose blocks they change.
      if (!all && FlashBf16TileQueries(s.dh, layout.tile_queries) != layout.tile_queries) continue;
      ++shapes;
      for (parity::ParityResult& r : parity::AttentionCase(*backend_, rng, s)) {
        results.push_back(std::move(r));
      }
    }
    EXPECT_GE(shapes, 4);
    int uploads = -1;
    results.push_back(parity::AttentionBatchFlashCase(*backend_, rng, &uploads));
    EXPECT_EQ(uploads, 4);
    results.push_back(parity::AttentionBatchWindowCase(*backend_, rng));
    backend_->SetFlashF16Copy(false);
    for (const parity::ParityResult& r : results) {
      std::cerr << "[ parity   ] fp16 copy: " << r.name << ": error " << r.err << ", tolerance "
                << r.tol << "\n";
      EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
    }
  }
  ASSERT_TRUE(backend_->SetFlashLayout(FlashBf16Layout{}).ok());
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(KvF16CopyTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
