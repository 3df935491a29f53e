// CudaBackend against the double ReferenceBackend: the parity table of cuda_parity.h, the
// error contract of Attention, and creation without a device (the flash kernels' layouts
// and edges: flash_prefill_test.cc). Suites are named
// CudaBackend* so that ctest labels them `gpu` (kernels/cuda/CMakeLists.txt); without a
// device they skip with the reason. About 950 lines: the backend-level checks of one
// fixture (the parity table, the error contract, weight sharing, index uploads and graph
// replay, the kernel options), each a few dozen lines; the kernels' own suites have files
// of their own.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"

namespace kvlens::kernels::cuda {
namespace {

TEST(CudaBackendCreateTest, FailsCleanlyWithoutADevice) {
  if (NoDeviceReason().empty()) GTEST_SKIP() << "a CUDA device is present";
  absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(0);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
}

// Key splits for one full wave of split-KV blocks, at least 64 keys a split, none left
// without keys (no device needed: the H200's 132 SMs and 3 or 4 resident blocks are passed
// in).
TEST(CudaSplitKv, SplitsFillOneWaveWithAtLeast64KeysEach) {
  auto splits = [](int queries, int kv_heads, int keys, int blocks_per_sm = 3,
                   int warps = kSplitKvWarps, int head_dim = 128) {
    AttentionParams p;
    p.num_queries = queries;
    p.num_heads = 4 * kv_heads;
    p.num_kv_heads = kv_heads;
    p.head_dim = head_dim;
    p.num_keys = keys;
    return ChooseNumSplits(p, /*num_sms=*/132, blocks_per_sm, warps);
  };
  EXPECT_EQ(splits(1, 32, 512), 8);      // 396 / 32 = 12 wanted; 512 / 64 = 8 allowed
  EXPECT_EQ(splits(1, 8, 8192), 49);     // 49 · 8 = 392 blocks <= 396 slots
  EXPECT_EQ(splits(64, 32, 4096), 1);    // 2048 blocks: more than a wave already
  EXPECT_EQ(splits(1, 1, 100), 1);       // fewer than 128 keys: one split
  EXPECT_EQ(splits(1, 1, 100000), 128);  // the cap
  // 528 / 8 = 66 wanted; 8192 / 66 rounded up to whole 4-key steps is 128 keys a split,
  // which 64 splits fill: two more would have none.
  EXPECT_EQ(splits(1, 8, 8192, 4), 64);
  EXPECT_EQ(splits(1, 8, 32768, 4), 66);  // 32768 / 66 → 497 → 500 keys; the 66th has 268
  // Blocks of 16 warps, one an SM: 132 / 8 = 16 wanted, at least 16 · 16 = 256 keys each.
  EXPECT_EQ(splits(1, 8, 8192, 1, kSplitKvWideWarps), 16);
  EXPECT_EQ(splits(1, 8, 2000, 1, kSplitKvWideWarps), 7);  // 2000 / 256 = 7 allowed
  // Head size 256 with a tile of 4 heads has no wide blocks: 4 warps, 64 keys a split.
  EXPECT_EQ(splits(1, 8, 2000, 1, kSplitKvWideWarps, 256), 16);
}

// Which kernels have blocks of 16 warps: head tiles of at most 4 heads of 128 dims.
TEST(CudaSplitKv, WideBlocksOnlyWhereTheHeadTileFits) {
  auto warps = [](int group, int head_dim) {
    AttentionParams p;
    p.num_kv_heads = 2;
    p.num_heads = 2 * group;
    p.head_dim = head_dim;
    return SplitKvVariantWarps(SplitKvVariant(p, kSplitKvWideWarps));
  };
  EXPECT_EQ(warps(4, 128), 16);
  EXPECT_EQ(warps(3, 128), 16);  // a tile of 4
  EXPECT_EQ(warps(8, 128), 4);   // a tile of 8
  EXPECT_EQ(warps(2, 256), 16);  // 2 heads of 256 dims
  EXPECT_EQ(warps(4, 256), 4);
  AttentionParams p;
  p.num_heads = p.num_kv_heads = 1;
  p.head_dim = 64;
  EXPECT_EQ(SplitKvVariantWarps(SplitKvVariant(p)), kSplitKvWarps);  // the default
}

// Which calls split-KV on tensor cores takes (cache rows in pieces of 8 elements at head
// sizes 64, 128 and 256, q in float4s), which of its kernels, and its splits: one wave of 2
// or 3 blocks an SM (132 SMs), at least 2 steps a warp each, as many as whole steps fill (no
// device).
TEST(CudaSplitKv, TensorCoresTakeRowsInPiecesOfEightAtHeadSizes64To256) {
  alignas(16) static float q[4];
  alignas(16) static uint16_t cache[16];
  AttentionParams p;
  p.q = q;
  p.q_stride = 8 * 128;
  p.k = cache;
  p.v = cache;
  p.kv_row_stride = 2 * 128;
  p.kv_dtype = KvDtype::kBF16;
  p.num_queries = 1;
  p.num_heads = 32;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.num_keys = 8192;
  EXPECT_TRUE(SplitKvMmaSupports(p));
  EXPECT_EQ(SplitKvMmaVariant(p), 5 + 2);  // bf16 (the second 5), Dh 128, 8 heads a tile
  // 264 slots / 8 KV heads = 33 wanted; 8192 / 33 → 249 → 256 keys a split, which 32 fill.
  EXPECT_EQ(ChooseNumSplitsMma(p, 132, 2), 32);
  // 3 blocks an SM (this kernel's bound): 396 / 8 = 49 wanted; 8192 / 49 → 168 → 176 keys a
  // split, which 47 fill.
  EXPECT_EQ(ChooseNumSplitsMma(p, 132, 3), 47);
  p.num_keys = 300;
  EXPECT_EQ(ChooseNumSplitsMma(p, 132, 2), 2);  // 300 / 128 = 2 allowed
  p.num_keys = 100;
  EXPECT_EQ(ChooseNumSplitsMma(p, 132, 2), 1);
  p.num_heads = 72;  // a group of 9: 16 heads a tile
  EXPECT_EQ(SplitKvMmaVariant(p), 5 + 3);
  p.head_dim = 256;  // tiles of 8 heads, whatever the group
  EXPECT_TRUE(SplitKvMmaSupports(p));
  EXPECT_EQ(SplitKvMmaVariant(p), 5 + 4);
  p.head_dim = 64;
  EXPECT_EQ(SplitKvMmaVariant(p), 5 + 1);
  p.num_heads = 8;
  EXPECT_EQ(SplitKvMmaVariant(p), 5);
  EXPECT_TRUE(SplitKvMmaSupports(p));
  auto without = [&](auto change) {
    AttentionParams v = p;
    change(v);
    return !SplitKvMmaSupports(v);
  };
  EXPECT_TRUE(without([](AttentionParams& v) { v.head_dim = 96; }));
  EXPECT_TRUE(without([](AttentionParams& v) { v.head_dim = 32; }));
  EXPECT_TRUE(without([](AttentionParams& v) { v.kv_row_stride = 2 * 64 + 4; }));
  EXPECT_TRUE(without([](AttentionParams& v) { v.v = cache + 4; }));
  EXPECT_TRUE(without([](AttentionParams& v) { v.q = q + 2; }));
  EXPECT_TRUE(without([](AttentionParams& v) { v.q_stride = 8 * 64 + 2; }));
  // An fp32 cache: rows in float4s, 8-key steps, at least 64 keys a split.
  p.kv_dtype = KvDtype::kActivation;
  p.kv_row_stride = 2 * 64 + 4;
  EXPECT_TRUE(SplitKvMmaSupports(p));
  EXPECT_EQ(SplitKvMmaVariant(p), 0);
  EXPECT_TRUE(without([](AttentionParams& v) { v.kv_row_stride = 2 * 64 + 2; }));
  p.num_heads = 32;
  p.head_dim = 128;
  EXPECT_EQ(SplitKvMmaVariant(p), 2);
  p.head_dim = 256;
  EXPECT_EQ(SplitKvMmaVariant(p), 4);
  p.head_dim = 128;
  p.num_keys = 8192;
  EXPECT_EQ(ChooseNumSplitsMma(p, 132, 2), 32);  // 8192 / 33 → 249 → 256, as on bf16
  p.num_keys = 300;
  EXPECT_EQ(ChooseNumSplitsMma(p, 132, 2), 4);  // 300 / 64 = 4 allowed: spans of 75 → 80
}

TEST_F(CudaBackendTest, RejectsAMissingDevice) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(1 << 20);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
}

TEST_F(CudaBackendTest, ParityTableWithinTwiceTheNaiveLowPrecisionError) {
  const std::vector<parity::ParityResult> results = parity::RunParitySuite(*backend_);
  EXPECT_EQ(results.size(), 224u);  // one per case; maps cases add probs (and scores)
  for (const parity::ParityResult& r : results) {
    std::cerr << "[ parity   ] " << r.name << ": error " << r.err << ", tolerance " << r.tol
              << "\n";
    EXPECT_TRUE(r.status.ok()) << r.name << ": " << r.status;
    EXPECT_LE(r.err, r.tol) << r.name << ": error " << r.err << ", naive error " << r.naive_err;
  }
}

// The engine's per-layer AttentionBatch with prefill chunks of several sequences: each run
// of flash-sized calls is one launch (one index upload: the tables and the tiles), not one
// per sequence, and the results stay within the parity tolerance.
TEST_F(CudaBackendTest, PrefillChunksOfARunShareOneFlashLaunch) {
  std::mt19937_64 rng(11);
  int uploads = -1;
  const parity::ParityResult r = parity::AttentionBatchFlashCase(*backend_, rng, &uploads);
  EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
  EXPECT_EQ(uploads, 4);  // [Tq 40, 100, 33] | documents alone | decode alone | [64, 70]
}

// The parity table's decode and short-chunk cases (those split-KV takes), the batched
// decode case and a decode step of a 16-head group over both caches, with the automatic split count
// and with 5 and 128 splits, each run twice. Returns the results; *shapes counts the table's shapes
// taken.
std::vector<parity::ParityResult> SplitKvCasesTwice(CudaBackend& backend, std::mt19937_64& rng,
                                                    int* shapes) {
  std::vector<parity::ParityResult> results;
  *shapes = 0;
  for (int splits : {0, 5, 128}) {
    EXPECT_TRUE(backend.SetSplitKvSplits(splits).ok());
    for (const parity::AttnShape& s : parity::AttentionShapes()) {
      if (s.want_maps || s.want_probs_only) continue;
      if (s.tq >= kFlashMinQueries && FlashPrefillSupports(s.dh)) continue;  // flash
      *shapes += splits == 0 ? 1 : 0;
      for (int twice = 0; twice < 2; ++twice) {
        for (parity::ParityResult& r : parity::AttentionCase(backend, rng, s)) {
          r.name += absl::StrCat(", ", splits, " splits");
          results.push_back(std::move(r));
        }
      }
    }
    for (bool bf16 : {false, true}) {
      // A group of 16 heads: the fused merge takes 8 heads at a time (CombineIfLast).
      const parity::AttnShape wide_group{.label = "decode GQA 16/1",
                                         .tq = 1,
                                         .tk = 700,
                                         .heads = 16,
                                         .kv_heads = 1,
                                         .dh = 64,
                                         .offset = 699,
                                         .block_size = 16,
                                         .bf16_cache = bf16};
      for (int twice = 0; twice < 2; ++twice) {
        results.push_back(parity::AttentionBatchSplitKvCase(backend, rng, bf16));
        for (parity::ParityResult& r : parity::AttentionCase(backend, rng, wide_group)) {
          r.name += absl::StrCat(", ", splits, " splits");
          results.push_back(std::move(r));
        }
      }
    }
  }
  EXPECT_TRUE(backend.SetSplitKvSplits(0).ok());
  return results;
}

// The split-KV launch merging its own splits (SetSplitKvFusedCombine: the last block of a
// row and KV head to finish merges them) gives the parity table's answers (SplitKvCasesTwice);
// each case runs twice, so a launch that left its arrival counts off 0 would fail the
// second (no block would see itself last, and the output would keep its NaN fill).
TEST_F(CudaBackendTest, FusedSplitCombineWithinToleranceAndLeavesItsCountsAtZero) {
  backend_->SetSplitKvFusedCombine(true);
  std::mt19937_64 rng(8);
  int shapes = 0;
  const std::vector<parity::ParityResult> results = SplitKvCasesTwice(*backend_, rng, &shapes);
  backend_->SetSplitKvFusedCombine(false);
  EXPECT_GE(shapes, 8);
  for (const parity::ParityResult& r : results) {
    EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
  }
}

// Blocks of 16 warps (SetSplitKvWarps; where the head tile allows, 4 elsewhere) give the
// parity table's answers (SplitKvCasesTwice) with the combine launch and merging their
// own splits; any other warp count is an error naming the two.
TEST_F(CudaBackendTest, WideSplitBlocksWithinTolerance) {
  const absl::Status eight = backend_->SetSplitKvWarps(8);
  EXPECT_EQ(eight.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(eight.message().find("4 or 16, got 8"), std::string_view::npos) << eight;
  ASSERT_TRUE(backend_->SetSplitKvWarps(kSplitKvWideWarps).ok());
  std::mt19937_64 rng(12);
  for (bool fused : {false, true}) {
    backend_->SetSplitKvFusedCombine(fused);
    int shapes = 0;
    for (const parity::ParityResult& r : SplitKvCasesTwice(*backend_, rng, &shapes)) {
      EXPECT_TRUE(r.pass()) << r.name << (fused ? ", fused" : "") << ": " << r.status << ", error "
                            << r.err << " > " << r.tol;
    }
    EXPECT_GE(shapes, 8);
  }
  backend_->SetSplitKvFusedCombine(false);
  ASSERT_TRUE(backend_->SetSplitKvWarps(kSplitKvWarps).ok());
}

// Split-KV on tensor cores (SetSplitKvTensorCores) gives the reference's answers within
// twice the naive run's error at its precision (Q, K, P and V rounded to bf16 on a bf16
// cache, to fp16 on fp32): the parity table's decode and short-chunk shapes at head sizes
// 64, 128 and 256 on both caches, rows in pieces of 8 elements (GQA groups 1 to 8, blocks
// of 4, 8, 12 and 16 rows, 1 to 5 query rows, a sliding window, the soft cap), groups of 16
// heads (two head tiles at Dh 64, two passes of one at Dh 256) and 32 (two passes of two
// tiles at Dh 128), Gemma 2's decode (Dh 256, GQA 2/1, a window, the soft cap), and the
// batched decode case (documents, rows of unequal key counts), at the automatic, 5 and 128
// splits, with the combine launch and merged by the last block. Every one of those shapes
// runs on tensor cores; other head sizes and rows not in such pieces keep SplitKvKernel.
TEST_F(CudaBackendTest, TensorCoreSplitKvWithinTolerance) {
  const auto in_pieces = [](parity::AttnShape s, bool bf16) {
    s.bf16_cache = bf16;
    s.kv_pad = bf16 ? 8 : 4;
    s.label += bf16 ? ", rows in 16-byte pieces" : ", rows in float4s";
    return s;
  };
  std::vector<parity::AttnShape> shapes;
  for (const parity::AttnShape& s : parity::AttentionShapes()) {
    if (s.want_maps || s.want_probs_only || s.bf16_cache || s.tq >= kFlashMinQueries) continue;
    if (s.dh != 64 && s.dh != 128 && s.dh != 256) continue;
    for (bool bf16 : {false, true}) shapes.push_back(in_pieces(s, bf16));
  }
  ASSERT_GE(shapes.size(), 16u);
  for (const auto& [heads, dh] : {std::pair{16, 64}, {32, 128}, {16, 256}}) {
    for (bool bf16 : {false, true}) {
      shapes.push_back(in_pieces({.label = absl::StrCat("decode GQA ", heads, "/1 Dh ", dh),
                                  .tq = 1,
                                  .tk = 700,
                                  .heads = heads,
                                  .kv_heads = 1,
                                  .dh = dh,
                                  .offset = 699},
                                 bf16));
    }
  }
  for (bool bf16 : {false, true}) {
    shapes.push_back(in_pieces({.label = "decode Gemma 2 window 300 soft cap 1 GQA 4/2",
                                .tq = 1,
                                .tk = 900,
                                .heads = 4,
                                .kv_heads = 2,
                                .dh = 256,
                                .offset = 899,
                                .window = 300,
                                .softcap = 1.0},
                               bf16));
  }
  backend_->SetSplitKvTensorCores(true);
  std::mt19937_64 rng(14);
  int cases = 0, on_tensor_cores = 0;
  for (bool fused : {false, true}) {
    backend_->SetSplitKvFusedCombine(fused);
    for (int splits : {0, 5, 128}) {
      ASSERT_TRUE(backend_->SetSplitKvSplits(splits).ok());
      const std::string how = absl::StrCat(", ", splits, " splits", fused ? ", fused" : "");
      for (const parity::AttnShape& s : shapes) {
        for (const parity::ParityResult& r : parity::AttentionCase(*backend_, rng, s)) {
          ++cases;
          on_tensor_cores += r.name.find("split-KV tensor cores") != std::string::npos;
          EXPECT_TRUE(r.pass()) << r.name << how << ": " << r.status << ", error " << r.err << " > "
                                << r.tol;
        }
      }
      for (bool bf16 : {false, true}) {
        const parity::ParityResult batch = parity::AttentionBatchSplitKvCase(*backend_, rng, bf16);
        EXPECT_TRUE(batch.pass()) << batch.name << how << ": " << batch.status << ", error "
                                  << batch.err << " > " << batch.tol;
      }
    }
  }
  EXPECT_EQ(on_tensor_cores, cases);
  // Rows not in pieces of 8 (a stride of 131 floats, of 132 bf16) keep SplitKvKernel (the
  // label of its fp32 path).
  for (const parity::AttnShape& s : parity::AttentionShapes()) {
    if (s.label != "decode long GQA 8/1") continue;
    for (bool bf16 : {false, true}) {
      parity::AttnShape v = s;
      v.bf16_cache = bf16;
      v.kv_pad = bf16 ? 4 : 3;
      for (const parity::ParityResult& r : parity::AttentionCase(*backend_, rng, v)) {
        EXPECT_NE(r.name.find(" split-KV"), std::string::npos) << r.name;
        EXPECT_EQ(r.name.find("tensor cores"), std::string::npos) << r.name;
        EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > "
                              << r.tol;
      }
    }
  }
  backend_->SetSplitKvFusedCombine(false);
  backend_->SetSplitKvTensorCores(false);
  ASSERT_TRUE(backend_->SetSplitKvSplits(0).ok());
}

// SetSplitKvSplits (kvlens_gpu_check's sweep): any fixed number of key splits, more than
// some rows have keys for included, gives the reference's outputs within the parity
// tolerance, on fp32 and bf16 caches; out of range is an error naming the limit.
TEST_F(CudaBackendTest, FixedSplitCountsWithinTolerance) {
  EXPECT_EQ(backend_->SetSplitKvSplits(-1).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status too_many = backend_->SetSplitKvSplits(kSplitKvMaxSplits + 1);
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.message().find("[0, 128]"), std::string_view::npos) << too_many;
  std::mt19937_64 rng(9);
  for (int splits : {1, 7, 128}) {
    ASSERT_TRUE(backend_->SetSplitKvSplits(splits).ok());
    for (bool bf16 : {false, true}) {
      parity::AttnShape s{.label = absl::StrCat("decode, ", splits, " splits"),
                          .tq = 2,
                          .tk = 300,
                          .heads = 8,
                          .kv_heads = 2,
                          .dh = 64,
                          .offset = 298,
                          .block_size = 8,
                          .bf16_cache = bf16};
      for (const parity::ParityResult& r : parity::AttentionCase(*backend_, rng, s)) {
        EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > "
                              << r.tol;
      }
    }
  }
  ASSERT_TRUE(backend_->SetSplitKvSplits(0).ok());
}

// A row whose document has no key at or before its position: the same INVALID_ARGUMENT
// as the CPU reference, naming the row, and the backend stays usable.
TEST_F(CudaBackendTest, RowWithNoVisibleKeyIsInvalidArgumentNamingTheRow) {
  const int tq = 3, tk = 3, dh = 64;
  std::vector<double> zeros_d(static_cast<size_t>(tk) * dh, 0.5);
  std::vector<double> out_d(static_cast<size_t>(tq) * dh);
  const std::vector<int32_t> q_doc = {0, 0, 1}, k_doc = {0, 0, 0};
  AttentionArgs<double> ra;
  ra.q = zeros_d.data();
  ra.q_stride = dh;
  ra.num_queries = tq;
  ra.num_keys = tk;
  ra.num_heads = ra.num_kv_heads = 1;
  ra.head_dim = dh;
  ra.scale = 0.125;
  ra.q_doc_ids = q_doc.data();
  ra.k_doc_ids = k_doc.data();
  ra.kv = KvSource<double>{zeros_d.data(), zeros_d.data(), dh, nullptr, 0};
  ra.out = out_d.data();
  ra.out_stride = dh;
  const absl::Status want = ReferenceBackend().Attention(ra);
  ASSERT_EQ(want.code(), absl::StatusCode::kInvalidArgument);

  auto buf = parity::ToDevice(std::vector<double>(static_cast<size_t>(tk) * dh, 0.5));
  ASSERT_TRUE(buf.ok()) << buf.status();
  AttentionArgs<float> a;
  a.q = buf->as<float>();
  a.q_stride = dh;
  a.num_queries = tq;
  a.num_keys = tk;
  a.num_heads = a.num_kv_heads = 1;
  a.head_dim = dh;
  a.scale = 0.125;
  a.q_doc_ids = q_doc.data();
  a.k_doc_ids = k_doc.data();
  a.kv = KvSource<float>{buf->as<float>(), buf->as<float>(), dh, nullptr, 0};
  a.out = buf->as<float>();
  a.out_stride = dh;
  const absl::Status got = backend_->Attention(a);
  EXPECT_EQ(got, want);
  EXPECT_NE(std::string(got.message()).find("row 2"), std::string::npos) << got;
  EXPECT_TRUE(backend_->Synchronize().ok());
}

// One decode query of one head (Dh 64) over 20 keys of the cache `kv` (blocks of 16
// listed in `table`), reading q at q and writing out.
AttentionArgs<float> DecodeCall(const float* q, const float* kv, const int32_t* table, float* out) {
  const int dh = 64;
  AttentionArgs<float> a;
  a.q = q;
  a.q_stride = dh;
  a.num_queries = 1;
  a.num_keys = 20;
  a.query_offset = 19;
  a.num_heads = a.num_kv_heads = 1;
  a.head_dim = dh;
  a.scale = 0.125;
  a.kv = KvSource<float>{kv, kv, dh, table, 16};
  a.out = out;
  a.out_stride = dh;
  return a;
}

TEST_F(CudaBackendTest, NegativeBlockIdIsInvalidArgumentLikeTheReference) {
  const int dh = 64;
  auto buf = parity::ToDevice(std::vector<double>(64 * dh, 0.5));
  ASSERT_TRUE(buf.ok()) << buf.status();
  const std::vector<int32_t> table = {1, -1};
  const AttentionArgs<float> a =
      DecodeCall(buf->as<float>(), buf->as<float>(), table.data(), buf->as<float>());
  const absl::Status got = backend_->Attention(a);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument) << got;
  EXPECT_NE(std::string(got.message()).find("kv.block_table"), std::string::npos) << got;
  EXPECT_TRUE(backend_->status().ok());
}

// A batch whose third call names a negative block: that call's INVALID_ARGUMENT (the
// reference's message) with its index, nothing launched (the first call's output stays
// NaN), and the backend stays usable.
TEST_F(CudaBackendTest, AttentionBatchWithABadCallRunsNothingAndNamesIt) {
  const int dh = 64;
  auto buf = parity::ToDevice(std::vector<double>(64 * dh, 0.5));
  auto out = parity::ToDevice(std::vector<double>(3 * dh, parity::kNaN));
  ASSERT_TRUE(buf.ok() && out.ok());
  const std::vector<int32_t> good = {1, 2}, bad = {1, -1};
  std::vector<AttentionArgs<float>> calls(3);
  for (int c = 0; c < 3; ++c) {
    calls[c] = DecodeCall(buf->as<float>() + c * dh, buf->as<float>(),
                          c == 2 ? bad.data() : good.data(), out->as<float>() + c * dh);
  }
  int failed = -1;
  const absl::Status got = backend_->AttentionBatch(calls, &failed);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument) << got;
  EXPECT_EQ(failed, 2);
  EXPECT_NE(std::string(got.message()).find("kv.block_table"), std::string::npos) << got;
  EXPECT_TRUE(backend_->status().ok());
  auto h = parity::FromDevice(*backend_, *out, 3 * dh);
  ASSERT_TRUE(h.ok());
  for (double x : *h) EXPECT_TRUE(std::isnan(x));
  calls.pop_back();  // the two good ones: one batched launch
  ASSERT_TRUE(backend_->AttentionBatch(calls, &failed).ok());
  h = parity::FromDevice(*backend_, *out, 3 * dh);
  ASSERT_TRUE(h.ok());
  for (int e = 0; e < 2 * dh; ++e) EXPECT_NEAR((*h)[e], 0.5, 1e-6) << e;  // all V rows are 0.5
}

// SetAttentionKernels sets every option TuneAttention chooses, reads back through each
// option's own getter, and on a bad value changes none of them.
TEST_F(CudaBackendTest, AttentionKernelsAreSetAllTogetherOrNotAtAll) {
  AttentionKernels k;
  k.flash_layout.tile_queries = 64;
  k.flash_layout.stages = kFlashMaxStages;
  k.flash_head_group = kFlashAutoHeadGroup;
  k.split_kv_warps = kSplitKvWideWarps;
  k.split_kv_fused_combine = k.split_kv_tensor_cores = k.split_kv_balanced = true;
  ASSERT_TRUE(backend_->SetAttentionKernels(k).ok());
  auto expect_set = [&](const std::string& when) {
    EXPECT_EQ(backend_->flash_layout().tile_queries, 64) << when;
    EXPECT_EQ(backend_->flash_layout().stages, kFlashMaxStages) << when;
    EXPECT_EQ(backend_->flash_head_group(), kFlashAutoHeadGroup) << when;
    EXPECT_EQ(backend_->split_kv_warps(), kSplitKvWideWarps) << when;
    EXPECT_TRUE(backend_->split_kv_fused_combine() && backend_->split_kv_tensor_cores() &&
                backend_->split_kv_balanced())
        << when;
    const AttentionKernels got = backend_->attention_kernels();
    EXPECT_EQ(got.flash_layout.tile_queries, 64) << when;
    EXPECT_EQ(got.flash_head_group, kFlashAutoHeadGroup) << when;
    EXPECT_EQ(got.split_kv_warps, kSplitKvWideWarps) << when;
    EXPECT_TRUE(got.split_kv_fused_combine && got.split_kv_tensor_cores && got.split_kv_balanced)
        << when;
  };
  expect_set("set");
  // Each bad option refused by name, after the good ones before it: nothing changes.
  AttentionKernels bad = AttentionKernels{};
  bad.split_kv_warps = 5;
  absl::Status s = backend_->SetAttentionKernels(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("split-KV warps"), std::string_view::npos) << s;
  expect_set("after bad warps");
  bad = AttentionKernels{};
  bad.flash_head_group = kFlashMaxHeadGroup + 1;
  s = backend_->SetAttentionKernels(bad);
  EXPECT_NE(s.message().find("flash head group"), std::string_view::npos) << s;
  expect_set("after a bad head group");
  bad = AttentionKernels{};
  bad.flash_layout.stages = kFlashMaxStages + 1;
  EXPECT_FALSE(backend_->SetAttentionKernels(bad).ok());
  expect_set("after bad stages");
  // The defaults back.
  ASSERT_TRUE(backend_->SetAttentionKernels(AttentionKernels{}).ok());
  EXPECT_EQ(backend_->flash_layout().tile_queries, FlashBf16Layout{}.tile_queries);
  EXPECT_EQ(backend_->flash_head_group(), 1);
  EXPECT_EQ(backend_->split_kv_warps(), kSplitKvWarps);
  EXPECT_FALSE(backend_->split_kv_fused_combine() || backend_->split_kv_tensor_cores() ||
               backend_->split_kv_balanced());
  EXPECT_TRUE(backend_->status().ok());
}

// Two backends of one device sharing weights: the second finds the first's upload (no new
// device memory) and computes the same product on its own stream.
TEST_F(CudaBackendTest, SharedWeightsAreUploadedOnce) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> other = CudaBackend::Create(0);
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_TRUE((*other)->ShareWeightsWith(*backend_).ok());
  std::mt19937_64 rng(3);
  const kernels::testing::OwnedWeight w(kernels::testing::RandomFloatExact(rng, 32 * 16), 32, 16,
                                        DType::kF32);
  auto x = parity::ToDevice(kernels::testing::RandomFloatExact(rng, 2 * 16));
  auto y1 = parity::ToDevice(std::vector<double>(2 * 32, 0.0));
  auto y2 = parity::ToDevice(std::vector<double>(2 * 32, 0.0));
  ASSERT_TRUE(x.ok() && y1.ok() && y2.ok());
  backend_->MatMul(x->as<float>(), 2, w.view(), WeightView{}, y1->as<float>());
  const int64_t bytes = backend_->weight_bytes();
  EXPECT_GE(bytes, 32 * 16 * 4);  // the buffer may round up
  (*other)->MatMul(x->as<float>(), 2, w.view(), WeightView{}, y2->as<float>());
  EXPECT_EQ((*other)->weight_bytes(), bytes);
  EXPECT_EQ(backend_->weight_bytes(), bytes);
  auto h1 = parity::FromDevice(*backend_, *y1, 64);
  auto h2 = parity::FromDevice(**other, *y2, 64);
  ASSERT_TRUE(h1.ok() && h2.ok());
  EXPECT_EQ(*h1, *h2);
  backend_->ForgetWeights();
  EXPECT_EQ((*other)->weight_bytes(), 0);
}

// Uploads are cached by host address: the same address named with another shape or dtype
// (a freed weight's memory reused without ForgetWeights) is INVALID_ARGUMENT naming both,
// never a product of the stale copy; after ForgetWeights it is uploaded afresh.
TEST_F(CudaBackendTest, AWeightAddressReusedAsAnotherWeightIsRefusedUntilForgotten) {
  std::mt19937_64 rng(5);
  const std::vector<double> values = kernels::testing::RandomFloatExact(rng, 32 * 16);
  const kernels::testing::OwnedWeight w(values, 32, 16, DType::kF32);
  auto x = parity::ToDevice(kernels::testing::RandomFloatExact(rng, 16));
  auto y = parity::ToDevice(std::vector<double>(32, 0.0));
  ASSERT_TRUE(x.ok() && y.ok());
  backend_->MatMul(x->as<float>(), 1, w.view(), WeightView{}, y->as<float>());
  ASSERT_TRUE(backend_->Synchronize().ok());
  // The same bytes as 16 × 32, then (half of them) as f16 of the same shape.
  for (const WeightView& again : {WeightView{w.view().data, DType::kF32, 16, 32},
                                  WeightView{w.view().data, DType::kF16, 32, 16}}) {
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(0);
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_TRUE((*b)->ShareWeightsWith(*backend_).ok());
    (*b)->MatMul(x->as<float>(), 1, again, WeightView{}, y->as<float>());
    const absl::Status s = (*b)->status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    const std::string want =
        absl::StrCat("was uploaded as f32 [32, 16] and is now used as ",
                     again.dtype == DType::kF32 ? "f32 [16, 32]" : "f16 [32, 16]");
    EXPECT_NE(s.message().find(want), std::string::npos) << s;
  }
  backend_->ForgetWeights();
  backend_->MatMul(x->as<float>(), 1, WeightView{w.view().data, DType::kF16, 32, 16}, WeightView{},
                   y->as<float>());
  EXPECT_TRUE(backend_->Synchronize().ok()) << backend_->status();
}

// The seeds' 2×2 example on the device, forward then backward: Q = √2·ln3·I, K = I,
// V = [[2,0],[0,4]], G = [[1,0],[0,2]], no mask. By hand: A rows [3/4, 1/4] and [1/4, 3/4]
// (J = Σ G ⊙ O = 15/2), dA = G Vᵀ = [[2,0],[0,8]], dS rows [3/8, −3/8] and [−3/2, 3/2],
// dV = Aᵀ G = [[3/4, 1/2], [1/4, 3/2]], dQ = dS K/√2, dK = dSᵀ Q/√2. With both keys equal
// every row is uniform whatever the query, so dQ = 0.
struct SeedResult {
  std::vector<double> out, probs, dq, dk, dv, dprobs, dscores;
};

SeedResult RunSeed(CudaBackend& backend, const std::vector<double>& k) {
  const double a = std::sqrt(2.0) * std::log(3.0);
  auto dq_in = parity::ToDevice({a, 0, 0, a});
  auto dk_in = parity::ToDevice(k);
  auto dv_in = parity::ToDevice({2, 0, 0, 4});
  auto dg = parity::ToDevice({1, 0, 0, 2});
  std::vector<absl::StatusOr<DeviceBuffer>> outs;
  for (int t = 0; t < 7; ++t)
    outs.push_back(parity::ToDevice(std::vector<double>(4, parity::kNaN)));
  for (const auto* b : {&dq_in, &dk_in, &dv_in, &dg}) EXPECT_TRUE(b->ok()) << b->status();
  for (const auto& b : outs) EXPECT_TRUE(b.ok()) << b.status();
  AttentionArgs<float> f;
  f.q = dq_in->as<float>();
  f.q_stride = 2;
  f.num_queries = f.num_keys = 2;
  f.num_heads = f.num_kv_heads = 1;
  f.head_dim = 2;
  f.causal = false;
  f.scale = 1.0 / std::sqrt(2.0);
  f.kv = KvSource<float>{dk_in->as<float>(), dv_in->as<float>(), 2, nullptr, 0};
  f.out = outs[0]->as<float>();
  f.out_stride = 2;
  f.probs = outs[1]->as<float>();
  EXPECT_TRUE(backend.Attention(f).ok());
  AttentionBackwardArgs<float> b = BackwardArgsOf(f);  // probs: what the forward wrote
  b.dout = dg->as<float>();
  b.dout_stride = 2;
  b.dq = outs[2]->as<float>();
  b.dk = outs[3]->as<float>();
  b.dv = outs[4]->as<float>();
  b.dprobs = outs[5]->as<float>();
  b.dscores = outs[6]->as<float>();
  const absl::Status s = backend.AttentionBackward(b);
  EXPECT_TRUE(s.ok()) << s;
  SeedResult r;
  std::vector<double>* dst[] = {&r.out, &r.probs, &r.dq, &r.dk, &r.dv, &r.dprobs, &r.dscores};
  for (int t = 0; t < 7; ++t) {
    auto h = parity::FromDevice(backend, *outs[t], 4);
    EXPECT_TRUE(h.ok()) << h.status();
    if (h.ok()) *dst[t] = *h;
  }
  return r;
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t e = 0; e < want.size(); ++e)
    EXPECT_NEAR(got[e], want[e], 1e-6) << what << "[" << e << "]";
}

// The engine's layers repeat a step's index arrays (RoPE positions for q and k, cache rows,
// block tables): bytes equal to a recent upload reuse its copy, and the results stay
// right; an upload that grows the ring forgets what was staged before.
TEST_F(CudaBackendTest, RepeatedIndexArraysAreCopiedOnce) {
  const std::vector<float> table = {10, 20, 30, 40};  // 4 rows of dim 1
  const WeightView w{table.data(), DType::kF32, 4, 1};
  const int big_n = 300000;  // 1.2 MB of ids: more than the ring's first 1 MiB
  auto out = parity::ToDevice(std::vector<double>(big_n, parity::kNaN));
  ASSERT_TRUE(out.ok()) << out.status();
  auto embed = [&](const std::vector<int32_t>& ids) {
    backend_->Embedding(w, ids.data(), static_cast<int>(ids.size()), out->as<float>());
    absl::StatusOr<std::vector<double>> got = parity::FromDevice(*backend_, *out, ids.size());
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? *got : std::vector<double>();
  };
  auto want = [&](const std::vector<int32_t>& ids) {
    std::vector<double> rows;
    for (int32_t id : ids) rows.push_back(table[id]);
    return rows;
  };
  const std::vector<int32_t> a = {3, 0, 2}, b = {1, 1, 3};
  const CudaBackend::IndexUploadStats s0 = backend_->index_upload_stats();
  EXPECT_EQ(embed(a), want(a));
  EXPECT_EQ(embed(b), want(b));
  EXPECT_EQ(embed(a), want(a));  // the older of the two recent uploads
  const CudaBackend::IndexUploadStats s1 = backend_->index_upload_stats();
  EXPECT_EQ(s1.copies - s0.copies, 2);
  EXPECT_EQ(s1.bytes_copied - s0.bytes_copied, 2 * 3 * 4);
  EXPECT_EQ(s1.reused - s0.reused, 1);

  std::vector<int32_t> big(big_n);
  for (int i = 0; i < big_n; ++i) big[i] = (i * 7) % 4;
  EXPECT_EQ(embed(big), want(big));
  EXPECT_EQ(embed(a), want(a));  // copied again: the ring grew
  const CudaBackend::IndexUploadStats s2 = backend_->index_upload_stats();
  EXPECT_EQ(s2.copies - s1.copies, 2);
  EXPECT_EQ(s2.reused, s1.reused);
  EXPECT_TRUE(backend_->status().ok()) << backend_->status();
}

// An op's index arrays go up in one upload: RopeQKStoreKv's positions (4 bytes a token)
// and cache rows (8) staged apart would let the rows wrap the 1 MiB ring onto the
// positions before the launch read them. Here a 400 KB upload first (Embedding's ids)
// leaves the positions of 60000 tokens at [400 KB, 640 KB) and their rows past the end:
// q and k must still be rotated by their own positions (the reference's, in double) and
// stored at their own rows. (The wrap to the ring's start must first wait for the ids'
// copy, still pending: on the emulator, staging over it ends the process.)
TEST_F(CudaBackendTest, AnOpsIndexArraysShareOneUpload) {
  const std::vector<float> table = {10, 20, 30, 40};
  const WeightView w{table.data(), DType::kF32, 4, 1};
  const int n_ids = 100000, n = 60000, dh = 2;
  auto embedded = parity::ToDevice(std::vector<double>(n_ids, parity::kNaN));
  ASSERT_TRUE(embedded.ok()) << embedded.status();
  std::vector<int32_t> ids(n_ids);
  for (int i = 0; i < n_ids; ++i) ids[i] = i % 4;
  std::mt19937_64 rng(23);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    backend_->Embedding(w, ids.data(), n_ids, embedded->as<float>());
    std::vector<int32_t> positions(n);
    std::vector<int64_t> rows(n);
    for (int i = 0; i < n; ++i) {
      positions[i] = (i * 13 + 7 + round) % 4096;
      rows[i] = n - 1 - i;
    }
    const std::vector<double> q = kernels::testing::RandomFloatExact(rng, size_t{2} * n, -2, 2);
    const std::vector<double> k = kernels::testing::RandomFloatExact(rng, size_t{2} * n, -2, 2);
    const std::vector<double> v = kernels::testing::RandomFloatExact(rng, size_t{2} * n, -2, 2);
    std::vector<double> q_ref = q, k_ref = k;
    std::vector<double> kc_ref(size_t{2} * n, parity::kNaN), vc_ref = kc_ref;
    ReferenceBackend().RopeQKStoreKv(q_ref.data(), dh, 1, k_ref.data(), v.data(), dh, 1, n, dh,
                                     positions.data(), RopeSpec{10000.0, RopeStyle::kHalfSplit},
                                     rows.data(), kc_ref.data(), vc_ref.data(), dh,
                                     KvDtype::kActivation);
    auto dq = parity::ToDevice(q);
    auto dk = parity::ToDevice(k);
    auto dv = parity::ToDevice(v);
    auto dkc = parity::ToDevice(kc_ref);  // (overwritten everywhere)
    auto dvc = parity::ToDevice(kc_ref);
    ASSERT_TRUE(dq.ok() && dk.ok() && dv.ok() && dkc.ok() && dvc.ok());
    backend_->RopeQKStoreKv(dq->as<float>(), dh, 1, dk->as<float>(), dv->as<float>(), dh, 1, n, dh,
                            positions.data(), RopeSpec{10000.0, RopeStyle::kHalfSplit}, rows.data(),
                            dkc->as<float>(), dvc->as<float>(), dh, KvDtype::kActivation);
    const std::pair<const DeviceBuffer*, const std::vector<double>*> outs[] = {
        {&*dq, &q_ref}, {&*dk, &k_ref}, {&*dkc, &kc_ref}, {&*dvc, &vc_ref}};
    for (const auto& [buffer, want] : outs) {
      absl::StatusOr<std::vector<double>> got =
          parity::FromDevice(*backend_, *buffer, want->size());
      ASSERT_TRUE(got.ok()) << got.status();
      double worst = 0.0;  // (angles up to 4095 rad, computed in float on the device)
      for (size_t e = 0; e < want->size(); ++e) {
        worst = std::max(worst, std::abs((*got)[e] - (*want)[e]));
      }
      EXPECT_LT(worst, 2e-3);
    }
  }
  EXPECT_TRUE(backend_->status().ok()) << backend_->status();
}

// A recorded step's index arrays are staged and copied to the device once, before its first
// kernel (CudaBackend::EndStep): one copy a step however many arrays, two when the staging
// ring had to grow part way (the full ring's bytes, then the new one's), and every replay
// reads that step's arrays.
TEST_F(CudaBackendTest, RecordedStepCopiesItsIndexArraysOnceBeforeItsKernels) {
  const std::vector<float> table = {10, 20, 30, 40, 50};  // 5 rows of dim 1
  const WeightView w{table.data(), DType::kF32, 5, 1};
  const int big = 150000;  // ids: 600 KB an array, two of them past the 1 MiB ring
  auto out_a = parity::ToDevice(std::vector<double>(big, parity::kNaN));
  auto out_b = parity::ToDevice(std::vector<double>(big, parity::kNaN));
  ASSERT_TRUE(out_a.ok() && out_b.ok());
  auto step = [&](int n, int shift) {
    std::vector<int32_t> a(n), b(n);
    for (int i = 0; i < n; ++i) {
      a[i] = (i + shift) % 5;
      b[i] = (3 * i + shift + 1) % 5;
    }
    const int64_t copies = backend_->index_upload_stats().copies;
    backend_->BeginStep();
    backend_->Embedding(w, a.data(), n, out_a->as<float>());
    backend_->Embedding(w, b.data(), n, out_b->as<float>());
    EXPECT_TRUE(backend_->EndStep(/*run=*/true).ok()) << backend_->status();
    const int64_t made = backend_->index_upload_stats().copies - copies;
    for (const auto& [ids, out] : {std::pair{&a, &*out_a}, std::pair{&b, &*out_b}}) {
      absl::StatusOr<std::vector<double>> got = parity::FromDevice(*backend_, *out, n);
      EXPECT_TRUE(got.ok()) << got.status();
      if (!got.ok()) return made;
      for (int i = 0; i < n; ++i) {
        if ((*got)[i] != table[(*ids)[i]]) {
          ADD_FAILURE() << "row " << i << " of " << n << ", shift " << shift << ": " << (*got)[i]
                        << ", not " << table[(*ids)[i]];
          break;
        }
      }
    }
    return made;
  };
  const StepGraph::Stats s0 = backend_->graph_stats();
  for (int shift = 0; shift < 4; ++shift) EXPECT_EQ(step(6, shift), 1) << shift;
  const StepGraph::Stats s1 = backend_->graph_stats();
  EXPECT_EQ(s1.replays - s0.replays, 3);
  EXPECT_EQ(s1.last_step_calls, 3);  // the one copy and the two embeddings
  EXPECT_EQ(step(big, 0), 2);        // the ring grew while the step was recorded
  EXPECT_TRUE(backend_->status().ok()) << backend_->status();
}

// CUDA graphs (step_graph.h): a recorded step runs launch by launch the first time its
// launches are seen, is captured the second time and replayed after that, each replay
// reading that step's own index arrays (staged in the ring at the same offsets).
TEST_F(CudaBackendTest, GraphReplaysReadEachStepsIndexArrays) {
  const std::vector<float> table = {10, 20, 30, 40, 50};  // 5 rows of dim 1
  const WeightView w{table.data(), DType::kF32, 5, 1};
  auto out = parity::ToDevice(std::vector<double>(3, parity::kNaN));
  auto add = parity::ToDevice(std::vector<double>{1, 2, 3});
  ASSERT_TRUE(out.ok() && add.ok());
  auto step = [&](const std::vector<int32_t>& ids) {
    const int n = static_cast<int>(ids.size());
    backend_->BeginStep();
    backend_->Embedding(w, ids.data(), n, out->as<float>());
    backend_->Add(out->as<float>(), add->as<float>(), n);
    EXPECT_TRUE(backend_->EndStep(/*run=*/true).ok()) << backend_->status();
    std::vector<double> want;
    for (int i = 0; i < n; ++i) want.push_back(table[ids[i]] + 1.0 + i);
    absl::StatusOr<std::vector<double>> got = parity::FromDevice(*backend_, *out, ids.size());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, want) << "ids " << ids[0] << ", …";
  };
  const StepGraph::Stats s0 = backend_->graph_stats();
  for (int i = 0; i < 5; ++i) step({i, (i + 2) % 5, 4 - i});
  const StepGraph::Stats s1 = backend_->graph_stats();
  EXPECT_EQ(s1.steps - s0.steps, 5);
  EXPECT_EQ(s1.eager - s0.eager, 1);        // first sighting
  EXPECT_EQ(s1.captures - s0.captures, 1);  // second: captured, then launched
  EXPECT_EQ(s1.replays - s0.replays, 4);    // the second to the fifth
  EXPECT_EQ(s1.last_step_calls, 3);         // the ids' copy, Embedding, Add
  // Other launches (two rows) are another step: run one by one, then captured.
  step({4, 0});
  step({1, 3});
  const StepGraph::Stats s2 = backend_->graph_stats();
  EXPECT_EQ(s2.eager - s1.eager, 1);
  EXPECT_EQ(s2.captures - s1.captures, 1);
  EXPECT_EQ(s2.graphs, 2);
  // Without graphs nothing is recorded.
  backend_->SetCudaGraphs(false);
  step({2, 2, 2});
  EXPECT_EQ(backend_->graph_stats().steps, s2.steps);  // nothing recorded
  EXPECT_EQ(backend_->graph_stats().graphs, 0);        // and the graphs destroyed
  EXPECT_TRUE(backend_->status().ok()) << backend_->status();
}

// AddRows (activation steering) stages its rows with the step's index arrays, so a step
// that adds new values at the same places is one graph: replayed, each step adds its own
// rows. Three rows of 2 get source 1, nothing, source 0; an index past the sources is
// refused before anything is recorded or launched.
TEST_F(CudaBackendTest, GraphReplaysAddEachStepsRows) {
  const std::vector<float> table = {1, 2, 3, 4, 5, 6};  // 3 rows of dim 2
  const WeightView w{table.data(), DType::kF32, 3, 2};
  const std::vector<int32_t> ids = {0, 1, 2}, index = {1, -1, 0};
  auto out = parity::ToDevice(std::vector<double>(6, parity::kNaN));
  ASSERT_TRUE(out.ok());
  const StepGraph::Stats s0 = backend_->graph_stats();
  for (int step = 1; step <= 4; ++step) {
    const double s = step;
    const std::vector<float> rows = {float(s), float(2 * s), float(10 * s), float(20 * s)};
    backend_->BeginStep();
    backend_->Embedding(w, ids.data(), 3, out->as<float>());
    ASSERT_TRUE(backend_->AddRows(out->as<float>(), 3, 2, rows.data(), 2, index.data()).ok());
    ASSERT_TRUE(backend_->EndStep(/*run=*/true).ok()) << backend_->status();
    absl::StatusOr<std::vector<double>> got = parity::FromDevice(*backend_, *out, 6);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, (std::vector<double>{1 + 10 * s, 2 + 20 * s, 3, 4, 5 + s, 6 + 2 * s}))
        << "step " << step;
  }
  const StepGraph::Stats s1 = backend_->graph_stats();
  EXPECT_EQ(s1.eager - s0.eager, 1);
  EXPECT_EQ(s1.captures - s0.captures, 1);
  EXPECT_EQ(s1.replays - s0.replays, 3);  // the second (captured, then launched) to the fourth

  const std::vector<float> rows = {100, 200};
  const std::vector<int32_t> past = {0, 1};
  const absl::Status s = backend_->AddRows(out->as<float>(), 2, 2, rows.data(), 1, past.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("index[1] = 1 is outside [-1, num_rows = 1)"), std::string::npos) << s;
  EXPECT_TRUE(backend_->status().ok()) << backend_->status();
  absl::StatusOr<std::vector<double>> got = parity::FromDevice(*backend_, *out, 6);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<double>{41, 82, 3, 4, 9, 14}));  // step 4's, untouched
}

TEST_F(CudaBackendTest, ADroppedStepRunsNothing) {
  const std::vector<float> table = {10, 20};
  const WeightView w{table.data(), DType::kF32, 2, 1};
  auto out = parity::ToDevice(std::vector<double>(2, parity::kNaN));
  ASSERT_TRUE(out.ok());
  const std::vector<int32_t> ids = {1, 0};
  for (int i = 0; i < 3; ++i) {  // eager, captured, replayed: none of them runs
    backend_->BeginStep();
    backend_->Embedding(w, ids.data(), 2, out->as<float>());
    EXPECT_TRUE(backend_->EndStep(/*run=*/false).ok());
  }
  absl::StatusOr<std::vector<double>> got = parity::FromDevice(*backend_, *out, 2);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(std::isnan((*got)[0]) && std::isnan((*got)[1]));
  EXPECT_EQ(backend_->graph_stats().steps, 0);  // a dropped step is not counted
}

TEST_F(CudaBackendTest, AttentionBackwardSeedsTwoByTwoWorkedExample) {
  const SeedResult r = RunSeed(*backend_, {1, 0, 0, 1});
  ExpectNear(r.probs, {0.75, 0.25, 0.25, 0.75}, "A");
  // J = Σ G ⊙ O = 15/2
  EXPECT_NEAR(r.out[0] * 1 + r.out[3] * 2, 7.5, 1e-5);
  ExpectNear(r.dprobs, {2, 0, 0, 8}, "dA");
  ExpectNear(r.dscores, {3.0 / 8, -3.0 / 8, -1.5, 1.5}, "dS");
  ExpectNear(r.dv, {0.75, 0.5, 0.25, 1.5}, "dV");
  const double r2 = std::sqrt(2.0), a = r2 * std::log(3.0);
  ExpectNear(r.dq, {3.0 / 8 / r2, -3.0 / 8 / r2, -1.5 / r2, 1.5 / r2}, "dQ");
  ExpectNear(r.dk, {3.0 / 8 * a / r2, -1.5 * a / r2, -3.0 / 8 * a / r2, 1.5 * a / r2}, "dK");
}

TEST_F(CudaBackendTest, AttentionBackwardSeedsIdenticalKeysGiveZeroDq) {
  const SeedResult r = RunSeed(*backend_, {1, 0, 1, 0});
  ExpectNear(r.probs, {0.5, 0.5, 0.5, 0.5}, "A");
  ExpectNear(r.dq, {0, 0, 0, 0}, "dQ");
  double dk_norm = 0;
  for (double d : r.dk) dk_norm += d * d;
  EXPECT_GT(dk_norm, 1e-2);
}

// The backward's argument errors are the reference's, and leave the backend usable.
TEST_F(CudaBackendTest, AttentionBackwardRejectsMissingProbsLikeTheReference) {
  auto buf = parity::ToDevice(std::vector<double>(16, 0.5));
  ASSERT_TRUE(buf.ok()) << buf.status();
  AttentionBackwardArgs<float> b;
  b.q = buf->as<float>();
  b.q_stride = 2;
  b.num_queries = b.num_keys = 2;
  b.num_heads = b.num_kv_heads = 1;
  b.head_dim = 2;
  b.scale = 0.5;
  b.kv = KvSource<float>{buf->as<float>(), buf->as<float>(), 2, nullptr, 0};
  b.dout = buf->as<float>();
  b.dout_stride = 2;
  b.dq = b.dk = b.dv = buf->as<float>();
  const absl::Status got = backend_->AttentionBackward(b);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument) << got;
  EXPECT_NE(std::string(got.message()).find("AttentionBackwardArgs.probs"), std::string::npos)
      << got;
  EXPECT_TRUE(backend_->status().ok());
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(CudaBackendTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
