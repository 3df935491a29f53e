// A recorded step's signature (kernels/cuda/step_graph.h) must change with every field of
// the attention parameters: a graph is replayed only for a step whose signature equals the
// one it was captured from, so a field left out would replay a step with the old value
// (the window and the soft cap once were). Host arithmetic: no device needed.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
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
static_assert(sizeof(AttentionParams) == 168,
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
  };
  for (const Edit& e : edits) {
    AttentionParams p = base;
    e.apply(p);
    EXPECT_NE(Of(p), before) << e.field;
  }
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(StepGraphSignatureTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
