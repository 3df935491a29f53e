// Attention on the device under random shapes and options, against the double reference
// (CudaBackend*: ctest label `gpu`, skipped with the reason without a device; in CI on the
// emulator). The parity table (cuda_parity_attention.h) runs each option over fixed shapes
// one option at a time. Here each seed of the forward draws a model's heads and head size,
// a cache type, a window and a soft cap, a batch of decode rows and prefill chunks (some
// with documents, some asking for their attention maps) over one shuffled, NaN-filled
// cache, and every option the backend has at once (the bf16 flash layout, its block order,
// split-KV's warps, splits, tensor cores, fused combine and balancing, programmatic
// launches), run directly or as recorded steps, so that options which each pass alone are
// also checked together and on batches no table row lists; each seed of the backward
// draws one call's shape, mask and cache layout. Every output, map and gradient must be
// within twice the naive low-precision run's error of the reference (parity::Judge), as
// every parity row.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/launch.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"
#include "tests/kernels/cuda/random_draws.h"

namespace kvlens::kernels::cuda {
namespace {

// One seed's draw: the model's attention shape, the batch and the backend's options.
struct FuzzCase {
  int heads = 0, kv_heads = 0, dh = 0;
  bool bf16_cache = false;
  std::vector<parity::AttnShape> seqs;
  AttentionKernels kernels;
  bool flash_bf16 = true;
  int splits = 0;  // SetSplitKvSplits; 0: the backend's choice
  bool programmatic = false;
  int recorded_steps = 0;  // AttentionBatchCase's: 0, or 3 (eager, captured, replayed)
  std::string name;
};

using fuzz::Pick;
using fuzz::Uniform;

FuzzCase DrawCase(uint64_t seed) {
  std::mt19937_64 rng(seed);
  FuzzCase c;
  c.dh = Pick(rng, {64, 128, 128, 256});
  c.kv_heads = Pick(rng, {1, 2, 4});
  c.heads = c.kv_heads * Pick(rng, {1, 2, 4, 8});
  c.bf16_cache = Pick(rng, {false, true});
  // A model's window and soft cap hold for every sequence of the batch.
  const int window = Pick(rng, {0, 0, Uniform(rng, 8, 200)});
  const double softcap = Pick(rng, {0.0, 0.0, 1.0, 30.0});
  const int n = Uniform(rng, 1, 6);
  for (int e = 0; e < n; ++e) {
    parity::AttnShape s;
    if (Pick(rng, {false, true})) {  // a decode-like call (split-KV)
      s.tq = Uniform(rng, 1, 4);
      s.tk = s.tq + Uniform(rng, 0, 700);
    } else {  // a prefill chunk (flash past kFlashMinQueries)
      s.tq = Uniform(rng, 20, 140);
      s.tk = s.tq + Pick(rng, {0, Uniform(rng, 1, 300)});
    }
    if (Uniform(rng, 0, 6) == 0) {  // packed documents over the keys
      s.doc_lengths = fuzz::DocLengths(rng, s.tk);
    }
    if (Uniform(rng, 0, 4) == 0) {  // its maps too (the materialising kernel)
      (Pick(rng, {false, true}) ? s.want_maps : s.want_probs_only) = true;
    }
    s.window = window;
    s.softcap = softcap;
    c.seqs.push_back(s);
  }
  c.kernels.flash_layout.tile_queries = Pick(rng, {64, 128, kFlashBf16WideTileQueries});
  c.kernels.flash_layout.warp_queries = Pick(rng, {16, 32});
  c.kernels.flash_layout.stages = Pick(rng, {2, kFlashMaxStages});
  c.kernels.flash_layout.key_tile = Pick(rng, {kFlashDefaultKeyTile, kFlashNarrowKeyTile});
  c.kernels.flash_head_group = Pick(rng, {kFlashAutoHeadGroup, 1, 3, 64});
  c.kernels.split_kv_warps = Pick(rng, {kSplitKvWarps, kSplitKvWideWarps});
  c.kernels.split_kv_fused_combine = Pick(rng, {false, true});
  c.kernels.split_kv_tensor_cores = Pick(rng, {false, true});
  c.kernels.split_kv_balanced = Pick(rng, {false, true});
  c.flash_bf16 = Pick(rng, {true, true, false});
  c.splits = Pick(rng, {0, 0, 1, 7, 64});
  c.programmatic = Pick(rng, {false, true});
  c.recorded_steps = Pick(rng, {0, 3});

  std::vector<std::string> seqs;
  for (const parity::AttnShape& s : c.seqs) {
    seqs.push_back(absl::StrCat(
        s.tq, "/", s.tk,
        s.doc_lengths.empty() ? "" : absl::StrCat(" docs ", absl::StrJoin(s.doc_lengths, "+")),
        s.want_maps         ? " maps"
        : s.want_probs_only ? " probs"
                            : ""));
  }
  const FlashBf16Layout& l = c.kernels.flash_layout;
  c.name = absl::StrCat(
      "seed ", seed, ": H=", c.heads, "/", c.kv_heads, " Dh=", c.dh,
      c.bf16_cache ? " bf16" : " fp32", " cache, window ", window, ", soft cap ", softcap,
      ", Tq/Tk ", absl::StrJoin(seqs, ", "), "; flash ", c.flash_bf16 ? "bf16" : "fp16", " ",
      l.tile_queries, "q/", l.warp_queries, "w/", l.stages, "st/", l.key_tile, "k, head group ",
      c.kernels.flash_head_group, "; split-KV ", c.kernels.split_kv_warps, " warps, splits ",
      c.splits, c.kernels.split_kv_tensor_cores ? ", tensor cores" : "",
      c.kernels.split_kv_fused_combine ? ", fused combine" : "",
      c.kernels.split_kv_balanced ? ", balanced" : "", c.programmatic ? ", PDL" : "",
      c.recorded_steps > 0 ? ", 3 recorded steps" : "");
  return c;
}

// Puts the process-wide launch option back whatever the test's outcome.
class CudaBackendFuzzTest : public CudaBackendTest {
 protected:
  void TearDown() override { SetProgrammaticLaunches(false); }
};

TEST_F(CudaBackendFuzzTest, RandomBatchesUnderRandomKernelOptionsWithinTolerance) {
  constexpr uint64_t kSeeds = 16;
  int passed = 0;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    const FuzzCase c = DrawCase(seed);
    ASSERT_TRUE(backend_->SetAttentionKernels(c.kernels).ok()) << c.name;
    ASSERT_TRUE(backend_->SetSplitKvSplits(c.splits).ok()) << c.name;
    backend_->SetFlashBf16(c.flash_bf16);
    backend_->SetProgrammaticLaunches(c.programmatic);
    std::mt19937_64 rng(seed);
    const StepGraph::Stats graphs = backend_->graph_stats();
    const parity::ParityResult r =
        parity::AttentionBatchCase(*backend_, rng, c.name, c.seqs, c.heads, c.kv_heads, c.dh,
                                   nullptr, c.bf16_cache, c.recorded_steps);
    EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
    passed += r.pass() ? 1 : 0;
    if (c.recorded_steps > 0) {  // eager, then captured, then replayed
      EXPECT_EQ(backend_->graph_stats().captures - graphs.captures, 1) << c.name;
      EXPECT_EQ(backend_->graph_stats().replays - graphs.replays, 2) << c.name;
    }
  }
  EXPECT_EQ(passed, kSeeds);
}

// The attention backward (dQ, dK, dV, dA, dS) of random calls: head sizes 32 to 256, GQA
// groups 1 to 4, causal with an offset (a window and documents at times) or not, a soft cap
// at times, cache blocks of 4, 8 or 16 rows with K/V rows read float by float or in
// float4s, each within twice the naive fp32 run's error of the double reference.
TEST_F(CudaBackendFuzzTest, RandomBackwardCallsWithinTolerance) {
  constexpr uint64_t kSeeds = 64;
  int passed = 0;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    std::mt19937_64 rng(seed);
    parity::AttnShape s;
    s.dh = Pick(rng, {32, 64, 80, 128, 256});
    s.kv_heads = Pick(rng, {1, 2, 4});
    s.heads = s.kv_heads * Pick(rng, {1, 2, 4});
    s.causal = Uniform(rng, 0, 3) != 0;
    s.tq = Pick(rng, {1, Uniform(rng, 2, 40)});
    s.tk = s.tq + Uniform(rng, 0, 200);
    s.offset = s.tk - s.tq;
    if (Uniform(rng, 0, 3) == 0) {
      s.doc_lengths = fuzz::DocLengths(rng, s.tk);
    }
    if (s.causal) s.window = Pick(rng, {0, 0, Uniform(rng, 1, 60)});
    s.softcap = Pick(rng, {0.0, 0.0, 1.0, 30.0});
    s.block_size = Pick(rng, {4, 8, 16});
    s.kv_pad = Pick(rng, {3, 4});
    s.label = absl::StrCat(
        "seed ", seed, s.causal ? " causal" : " non-causal", s.window > 0 ? " window " : "",
        s.window > 0 ? absl::StrCat(s.window) : "", " soft cap ", s.softcap, " blocks of ",
        s.block_size, " pad ", s.kv_pad,
        s.doc_lengths.empty() ? "" : absl::StrCat(" docs ", absl::StrJoin(s.doc_lengths, "+")));
    bool all = true;
    for (const parity::ParityResult& r : parity::AttentionBackwardCase(*backend_, rng, s)) {
      EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
      all = all && r.pass();
    }
    passed += all ? 1 : 0;
  }
  EXPECT_EQ(passed, kSeeds);
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_HAVE_CUDA
