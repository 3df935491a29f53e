// A recorded step's signature (kernels/cuda/step_graph.h) must change with every field of
// the attention parameters: a graph is replayed only for a step whose signature equals the
// one it was captured from, so a field left out would replay a step with the old value
// (the window and the soft cap once were). And a recorded launch must run with the
// arguments it was given, though the caller's arrays are gone and the recordings' memory
// (StepArena) is reused from step to step. Host code: no device needed (a step seen once
// runs its closures eagerly, and these closures launch nothing).
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/step_graph.h"

namespace kvlens::kernels::cuda {
namespace {

Signature Of(const AttentionParams& p) {
  Signature s;
  AppendWords(s, p);
  return s;
}

// The struct as the list below knows it (on LP64): a field added grows it, and then belongs
// in AppendWords (step_graph.cc) and in this list.
static_assert(sizeof(AttentionParams) == 176,
              "AttentionParams changed: sign its new field in step_graph.cc and edit it below");

TEST(StepGraphSignatureTest, EveryAttentionFieldChangesIt) {
  static int32_t ints[2];
  static float floats[2];
  const AttentionParams base;
  const Signature before = Of(base);
  struct Edit {
    const char* field;
    std::function<void(AttentionParams&)> apply;
  };
  const std::vector<Edit> edits = {
      {"q", [](AttentionParams& p) { p.q = floats; }},
      {"q_stride", [](AttentionParams& p) { p.q_stride = 7; }},
      {"k", [](AttentionParams& p) { p.k = floats; }},
      {"v", [](AttentionParams& p) { p.v = floats; }},
      {"kv_row_stride", [](AttentionParams& p) { p.kv_row_stride = 7; }},
      {"kv_dtype", [](AttentionParams& p) { p.kv_dtype = KvDtype::kBF16; }},
      {"block_table", [](AttentionParams& p) { p.block_table = ints; }},
      {"block_size", [](AttentionParams& p) { p.block_size = 16; }},
      {"q_doc", [](AttentionParams& p) { p.q_doc = ints; }},
      {"k_doc", [](AttentionParams& p) { p.k_doc = ints; }},
      {"out", [](AttentionParams& p) { p.out = floats; }},
      {"out_stride", [](AttentionParams& p) { p.out_stride = 7; }},
      {"num_queries", [](AttentionParams& p) { p.num_queries = 7; }},
      {"num_keys", [](AttentionParams& p) { p.num_keys = 7; }},
      {"num_heads", [](AttentionParams& p) { p.num_heads = 7; }},
      {"num_kv_heads", [](AttentionParams& p) { p.num_kv_heads = 7; }},
      {"head_dim", [](AttentionParams& p) { p.head_dim = 7; }},
      {"query_offset", [](AttentionParams& p) { p.query_offset = 7; }},
      {"causal", [](AttentionParams& p) { p.causal = !p.causal; }},
      {"window", [](AttentionParams& p) { p.window = 4096; }},
      {"scale", [](AttentionParams& p) { p.scale = 0.125f; }},
      {"softcap", [](AttentionParams& p) { p.softcap = 50.0f; }},
      {"row_key_end", [](AttentionParams& p) { p.row_key_end = ints; }},
      {"row_table_offset", [](AttentionParams& p) { p.row_table_offset = ints; }},
      {"flash_tiles", [](AttentionParams& p) { p.flash_tiles = ints; }},
      {"num_flash_tiles", [](AttentionParams& p) { p.num_flash_tiles = 7; }},
      {"flash_head_group", [](AttentionParams& p) { p.flash_head_group = 4; }},
      {"prefetch", [](AttentionParams& p) { p.prefetch = true; }},
  };
  for (const Edit& e : edits) {
    AttentionParams p = base;
    e.apply(p);
    EXPECT_NE(Of(p), before) << e.field;
  }
}

TEST(StepArenaTest, AlignsGrowsAndStartsOverAfterReset) {
  StepArena arena;
  auto address = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  const void* first = arena.Allocate(3, 1);
  EXPECT_EQ(address(arena.Allocate(8, 8)) % 8, 0u);
  EXPECT_EQ(address(arena.Allocate(1, 64)) % 64, 0u);
  // Past one 64 KiB chunk: a chunk of its own, as aligned.
  void* big = arena.Allocate(size_t{200} << 10, 32);
  EXPECT_EQ(address(big) % 32, 0u);
  std::memset(big, 0xab, size_t{200} << 10);  // all of it writable (ASan would say)
  const size_t grown = arena.capacity();
  EXPECT_GE(grown, (size_t{64} << 10) + (size_t{200} << 10));
  arena.Reset();
  EXPECT_EQ(arena.Allocate(3, 1), first);  // the same memory again
  arena.Allocate(size_t{200} << 10, 32);
  EXPECT_EQ(arena.capacity(), grown);  // and no more of it
}

// What the launches below received, in the order they ran.
std::vector<std::vector<float>> g_ran;

absl::Status RecordProducts(absl::Span<const MatVecProduct> products, int tag,
                            cudaStream_t /*stream*/) {
  std::vector<float> got;
  for (const MatVecProduct& p : products) got.push_back(static_cast<float>(p.out));
  got.push_back(static_cast<float>(tag));
  g_ran.push_back(got);
  return absl::OkStatus();
}

absl::Status RecordParams(const AttentionParams& p, double x, cudaStream_t /*stream*/) {
  g_ran.push_back(
      {static_cast<float>(p.num_keys), static_cast<float>(p.scale), static_cast<float>(x)});
  return absl::OkStatus();
}

TEST(StepGraphRecordingTest, LaunchesRunWithTheArgumentsTheyWereGiven) {
  StepGraph graph;
  // Steps of different sizes, each seen once (so End runs them one by one), the second far
  // past one arena chunk, the third smaller again: the arena's memory is reused.
  for (int calls : {3, 2000, 5}) {
    g_ran.clear();
    std::vector<std::vector<float>> expected;
    graph.Begin();
    for (int c = 0; c < calls; ++c) {
      std::vector<MatVecProduct> products(1 + c % 4);
      for (size_t i = 0; i < products.size(); ++i) products[i].out = 1000 * calls + 10 * c + i;
      std::vector<float>& e = expected.emplace_back();
      for (const MatVecProduct& p : products) e.push_back(static_cast<float>(p.out));
      e.push_back(static_cast<float>(c));
      ASSERT_TRUE(
          graph.Run(cudaStream_t{}, &RecordProducts, absl::Span<const MatVecProduct>(products), c)
              .ok());
      // The caller's array changes and goes: the recording kept its own copy.
      for (MatVecProduct& p : products) p.out = -1;
      AttentionParams params;
      params.num_keys = calls + c;
      params.scale = 0.5f;
      ASSERT_TRUE(graph.Run(cudaStream_t{}, &RecordParams, params, 0.25 * c).ok());
      expected.push_back({static_cast<float>(calls + c), 0.5f, static_cast<float>(0.25 * c)});
    }
    EXPECT_TRUE(g_ran.empty()) << "a recorded launch ran before End";
    ASSERT_TRUE(graph.End(cudaStream_t{}).ok());
    EXPECT_EQ(g_ran, expected) << calls << " calls";
    EXPECT_EQ(graph.stats().last_step_calls, 2 * calls);
  }
  EXPECT_EQ(graph.stats().eager, 3);
  // A dropped step runs nothing.
  g_ran.clear();
  const int64_t arena = graph.stats().arena_bytes;
  graph.Begin();
  std::vector<MatVecProduct> one(1);
  ASSERT_TRUE(
      graph.Run(cudaStream_t{}, &RecordProducts, absl::Span<const MatVecProduct>(one), 9).ok());
  graph.Drop();
  EXPECT_TRUE(g_ran.empty());
  EXPECT_EQ(graph.stats().arena_bytes, arena);
}

TEST(StepGraphRecordingTest, RunFirstGoesBeforeTheStepsOtherLaunchesInItsOwnOrder) {
  StepGraph graph;
  std::vector<MatVecProduct> none;
  auto run = [&](int tag, bool first) {
    const absl::Span<const MatVecProduct> span(none);
    return first ? graph.RunFirst(cudaStream_t{}, &RecordProducts, span, tag)
                 : graph.Run(cudaStream_t{}, &RecordProducts, span, tag);
  };
  g_ran.clear();
  graph.Begin();
  for (const auto& [tag, first] : {std::pair{1, false}, std::pair{2, false}, std::pair{3, true},
                                   std::pair{4, false}, std::pair{5, true}}) {
    ASSERT_TRUE(run(tag, first).ok());
  }
  ASSERT_TRUE(graph.End(cudaStream_t{}).ok());
  EXPECT_EQ(g_ran, (std::vector<std::vector<float>>{{3}, {5}, {1}, {2}, {4}}));
  // The next step starts with no prologue; outside a step RunFirst runs at once.
  g_ran.clear();
  graph.Begin();
  ASSERT_TRUE(run(6, false).ok());
  ASSERT_TRUE(run(7, true).ok());
  ASSERT_TRUE(graph.End(cudaStream_t{}).ok());
  ASSERT_TRUE(run(8, true).ok());
  EXPECT_EQ(g_ran, (std::vector<std::vector<float>>{{7}, {6}, {8}}));
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(StepGraphSignatureTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
