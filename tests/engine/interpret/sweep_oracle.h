// The oracle check of every patching sweep test: kvlens's sweep (PatchSweep or
// AttributionPatchSweep, fp64 reference and fp32 CPU backends) against
// tests/oracle/oracle.py --patch-sweep on the same prompts, cell by cell.
#ifndef KVLENS_TESTS_ENGINE_INTERPRET_SWEEP_ORACLE_H_
#define KVLENS_TESTS_ENGINE_INTERPRET_SWEEP_ORACLE_H_

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/interpret/attribution_patching.h"
#include "engine/interpret/patch_sweep.h"
#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/test_paths.h"

namespace kvlens::interpret::sweep_oracle {

struct SweepKind {
  bool all_positions = false;
  bool attribution = false;  // AttributionPatchSweep against the oracle's autograd estimate
  bool qk_fix = false;       // with attribution (q, k): AtP*'s QK fix, against the oracle's
};

// Against the PyTorch float64 oracle's own patching (tests/oracle/kvlens_oracle/
// patching.py: its forward with the row replaced, a full forward per cell; or with
// `attribution`, its first-order estimates from torch.autograd; with `qk_fix` as well, its
// patched forwards' patterns times the pattern's autograd gradient): every layer and row (and
// head, for q, k, v, z and pattern), fp64 ≤ 1e-9 and fp32 ≤ 1e-4 of the largest |score|,
// the score the logit difference between the two prompts' next tokens.
inline void ExpectOracleSweeps(const std::string& path, const char* label,
                               const std::vector<int32_t>& tokens,
                               const std::vector<int32_t>& source,
                               std::initializer_list<const char*> hooks, SweepKind kind = {}) {
  const bool all_positions = kind.all_positions;
  // (fp32 attribution: the backward's heavy ops on the CPU backend, as the server runs them)
  const auto sweep = [&](const Model& model, auto& be, const auto& in, const auto& src,
                         PatchTarget target, const std::vector<int>& layers, int begin, int end,
                         const Objective& o, auto* ops) {
    return kind.attribution
               ? AttributionPatchSweep(model, be, in, src, target, layers, begin, end, o,
                                       kind.all_positions, ops, kind.qk_fix)
               : PatchSweep(model, be, in, src, target, layers, begin, end, o, kind.all_positions);
  };
  auto m = LoadModel({path, ""});
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config;
  // the logit difference at the last row but one between the prompts' next tokens
  const int n = static_cast<int>(tokens.size()), row = n - 2;
  const int32_t a = source[row + 1], b = tokens[row + 1];
  std::vector<int> layers(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) layers[l] = l;
  std::string src;
  for (int32_t t : source) absl::StrAppend(&src, src.empty() ? "" : " ", t);
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  for (const char* hook : hooks) {
    SCOPED_TRACE(hook);
    const testing::OracleResult want = testing::RunOracleWith(
        path, tokens,
        absl::StrCat("--patch-sweep ", hook, ":", row, ":", a, ":", b, " --source-tokens '", src,
                     "'", all_positions ? " --patch-all-positions" : "",
                     kind.qk_fix        ? " --patch-qk-fix"
                     : kind.attribution ? " --patch-attribution"
                                        : ""));
    ASSERT_TRUE(want.error.empty()) << want.error;
    const std::vector<double>& grid = want.arrays.at("sweep.metric").data;
    const Objective o = Objective::LogitDiff(row, a, b);
    const PatchTarget target = *PatchTargetByName(hook);
    auto r64 = sweep(**m, ref, SequenceInput<double>{tokens}, SequenceInput<double>{source}, target,
                     layers, 0, n, o, static_cast<kernels::BackwardOps<double>*>(nullptr));
    auto r32 = sweep(**m, fast, SequenceInput<float>{tokens}, SequenceInput<float>{source}, target,
                     layers, 0, n, o, &fast);
    ASSERT_TRUE(r64.ok() && r32.ok()) << r64.status() << r32.status();
    ASSERT_EQ(r64->metric.size(), grid.size());
    double scale = 0, e64 = 0, e32 = 0;
    for (double v : grid) scale = std::max(scale, std::abs(v));
    for (size_t i = 0; i < grid.size(); ++i) {
      e64 = std::max(e64, std::abs(r64->metric[i] - grid[i]) / scale);
      e32 = std::max(e32, std::abs(r32->metric[i] - grid[i]) / scale);
    }
    EXPECT_NEAR(r64->clean, want.arrays.at("sweep.clean").data[0], 1e-9 * scale);
    EXPECT_NEAR(r64->source, want.arrays.at("sweep.source").data[0], 1e-9 * scale);
    EXPECT_LE(e64, 1e-9);
    EXPECT_LE(e32, 1e-4) << "scale " << scale;
    std::printf(
        "[oracle] %s %s sweep %s%s (%zu cells): worst relative error fp64 %.3g, fp32 %.3g\n", label,
        kind.qk_fix        ? "QK-fixed attribution patching"
        : kind.attribution ? "attribution patching"
                           : "patch",
        hook, all_positions ? " (all positions)" : "", grid.size(), e64, e32);
  }
}

// The models and prompt pairs both sweeps' oracle tests use, skipped when the model or
// PyTorch is missing. stories260K (word tokens: its byte tokens 3 … 258 are untrained, their
// logits barely differ):
inline void ExpectStoriesSweeps(std::initializer_list<const char*> hooks, SweepKind kind = {}) {
  const std::string bin = kvlens::testing::TestData("stories260K/stories260K.bin");
  KVLENS_REQUIRE_FILE(bin);
  if (!kvlens::testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  ExpectOracleSweeps(bin, "stories260K", {1, 403, 407, 261, 378, 300, 290, 420},
                     {1, 333, 407, 299, 378, 270, 290, 460}, hooks, kind);
}
// the default model (GPT-2: biases, learned positions):
inline void ExpectDefaultGpt2Sweeps(std::initializer_list<const char*> hooks, SweepKind kind = {}) {
  const std::string dir = kvlens::testing::DefaultModelPath();
  KVLENS_REQUIRE_FILE(dir + "/config.json");
  if (!kvlens::testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  ExpectOracleSweeps(dir, "kjv-gpt2-4l", {0, 34, 290, 1021, 17, 88, 5},
                     {0, 34, 77, 1021, 40, 88, 9}, hooks, kind);
}
// a random Gemma 2 (block-output norms: attn_out / mlp_out after them; capped logits):
inline void ExpectGemma2Sweeps(std::initializer_list<const char*> hooks, SweepKind kind = {}) {
  if (!kvlens::testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  const std::string path = kvlens::testing::MakeQuantizedModel(
      "--f32 --gemma2 --set-float gemma2.final_logit_softcapping=3");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  ExpectOracleSweeps(path, "gemma2", {2, 5, 300, 17, 42, 383}, {2, 9, 77, 17, 250, 4}, hooks, kind);
  std::remove(path.c_str());
}

}  // namespace kvlens::interpret::sweep_oracle

#endif  // KVLENS_TESTS_ENGINE_INTERPRET_SWEEP_ORACLE_H_
