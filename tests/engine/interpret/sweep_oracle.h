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

namespace kvlens::interpret::sweep_oracle {

struct SweepKind {
  bool all_positions = false;
  bool attribution = false;  // AttributionPatchSweep against the oracle's autograd estimate
};

// Against the PyTorch float64 oracle's own patching (tests/oracle/kvlens_oracle/
// patching.py: its forward with the row replaced, a full forward per cell; or with
// `attribution`, its first-order estimates from torch.autograd): every layer and row (and
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
                                       kind.all_positions, ops)
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
                     kind.attribution ? " --patch-attribution" : ""));
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
        kind.attribution ? "attribution patching" : "patch", hook,
        all_positions ? " (all positions)" : "", grid.size(), e64, e32);
  }
}

}  // namespace kvlens::interpret::sweep_oracle

#endif  // KVLENS_TESTS_ENGINE_INTERPRET_SWEEP_ORACLE_H_
