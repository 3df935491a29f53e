// Activation-patching sweeps on the CPU (engine/interpret/patch_sweep.h): the time of a
// sweep over every layer × 16 positions at each site (and, for z_all_pos, every layer ×
// head with the 16 positions patched at once), per cell, against one tape forward
// over the same tokens, and against what the same cells cost as full forwards (RunForward
// with that one patch, as before cells resumed at their layer) and through Intervene (a
// clean, a source and an edited forward per cell: 3 forwards). On a Llama-shaped model
// with random f32 weights (D 512, 8 layers, 8 heads of 64, FFN 1376, vocab 4096), 64
// tokens. A resumed cell runs L − l of the L layers, so a sweep over all layers should
// take about (L + 1) / 2L of the full-forward cells. Last, the z grid by attribution
// patching (AttributionPatchSweep: two forwards and a backward for every cell), and its q and
// k grids over every position with and without AtP*'s QK fix. Prints a table, then one JSON
// line.
//
//   kvlens_bench_patch_sweep [threads=1]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/bench_help.h"
#include "bench/interpret_bench_model.h"
#include "common/malloc_tuning.h"
#include "engine/interpret/attribution_patching.h"
#include "engine/interpret/interventions.h"
#include "engine/interpret/patch_sweep.h"
#include "kernels/cpu/cpu_backend.h"

namespace {

template <typename Fn>
double Seconds(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Must(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "kvlens_bench_patch_sweep: %s failed\n", what);
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  namespace ki = kvlens::interpret;
  if (kvlens::bench::PrintedHelp(
          argc, argv,
          "usage: kvlens_bench_patch_sweep [threads=1]\n"
          "Times activation-patching sweeps (every layer x 16 positions, each site) per cell\n"
          "against one tape forward and against full-forward cells, on a random\n"
          "Llama-shaped model (D 512, 8 layers, 8 heads of 64) at 64 tokens, on a CpuBackend\n"
          "with `threads` threads. Prints a table, then one JSON line.\n")) {
    return 0;
  }
  const int threads = argc > 1 ? std::max(1, std::atoi(argv[1])) : 1;
  kvlens::RetainFreedMemory();
  const kvlens::testing::TinySpec spec = kvlens::bench::InterpretBenchSpec();
  const std::unique_ptr<kvlens::Model> model = kvlens::testing::MakeTinyModel(spec);
  const kvlens::ModelConfig& c = model->config;
  kvlens::kernels::CpuBackend be(threads);
  const int n = 64, rows = 16, L = c.num_layers;
  std::mt19937 rng(1);
  std::vector<int32_t> a(n), b(n);
  for (int i = 0; i < n; ++i) {
    a[i] = static_cast<int32_t>(rng() % spec.vocab);
    b[i] = static_cast<int32_t>(rng() % spec.vocab);
  }
  const ki::SequenceInput<float> input{a}, source{b};
  std::vector<int> layers(L);
  for (int l = 0; l < L; ++l) layers[l] = l;
  const ki::Objective o = ki::Objective::LogitDiff(n - 1, 5, 9);

  double tape = 1e30;
  for (int r = 0; r < 3; ++r) {
    tape =
        std::min(tape, Seconds([&] { Must(ki::RunForward(*model, be, input).ok(), "forward"); }));
  }
  // The same cells as full forwards (resid_pre, every layer × the last 16 rows).
  auto src = ki::RunForward(*model, be, source);
  Must(src.ok(), "source forward");
  const double full = Seconds([&] {
    for (int l = 0; l < L; ++l) {
      for (int row = n - rows; row < n; ++row) {
        ki::Edits e;
        auto p = ki::PatchFrom(*src, c, l, row, row);
        Must(p.ok(), "patch");
        e.patches.push_back(*p);
        Must(ki::RunForward(*model, be, input, e).ok(), "patched forward");
      }
    }
  });
  const double full_cell = full / (L * rows);

  std::printf("patch sweep: D %d, %d layers, %d heads of %d, %d tokens, %d thread(s)\n", c.dim, L,
              c.num_heads, c.head_dim, n, threads);
  std::printf("tape forward %.1f ms; a full-forward cell %.1f ms; via Intervene ~%.1f ms\n",
              tape * 1e3, full_cell * 1e3, 3 * tape * 1e3);
  std::printf("%10s %8s %10s %12s %14s %16s\n", "site", "cells", "sweep s", "ms / cell",
              "cell / fwd", "cell / full cell");
  std::string json = absl::StrFormat(
      "{\"bench\":\"patch_sweep\",\"dim\":%d,\"layers\":%d,\"tokens\":%d,\"threads\":%d,"
      "\"tape_forward_ms\":%.2f,\"full_cell_ms\":%.2f,\"sites\":[",
      c.dim, L, n, threads, tape * 1e3, full_cell * 1e3);
  bool first = true;
  for (const char* site : {"resid_pre", "resid_mid", "attn_out", "mlp_out", "resid_post", "q", "k",
                           "v", "z", "pattern", "z_all_pos"}) {
    // z_all_pos: a cell per layer and head, its 16 rows patched at once
    const bool all = std::string(site) == "z_all_pos";
    const ki::PatchTarget target = *ki::PatchTargetByName(all ? "z" : site);
    const int cells = L * target.Heads(c) * (all ? 1 : rows);
    const double s = Seconds([&] {
      Must(ki::PatchSweep(*model, be, input, source, target, layers, n - rows, n, o, all).ok(),
           site);
    });
    // (the sweep also runs the clean and the source forward once)
    const double per = (s - 2 * tape) / cells;
    std::printf("%10s %8d %10.2f %12.2f %14.2f %16.2f\n", site, cells, s, per * 1e3, per / tape,
                per / full_cell);
    json += absl::StrFormat(
        "%s{\"site\":\"%s\",\"cells\":%d,\"sweep_s\":%.3f,\"cell_ms\":%.2f,"
        "\"cell_over_full_cell\":%.3f}",
        first ? "" : ",", site, cells, s, per * 1e3, per / full_cell);
    first = false;
  }
  // Attribution patching: the same z grid estimated from one backward pass, whole-sweep
  // time against the tape forward (the exact sweep's is cells × a cell).
  const ki::PatchTarget z = *ki::PatchTargetByName("z");
  const int z_cells = L * z.Heads(c) * rows;
  const double atp = Seconds([&] {
    Must(ki::AttributionPatchSweep(*model, be, input, source, z, layers, n - rows, n, o, false, &be)
             .ok(),
         "attribution");
  });
  std::printf("attribution patching, z (%d cells): %.3f s, %.2f tape forwards\n", z_cells, atp,
              atp / tape);
  json += absl::StrFormat(
      "],\"attribution_z\":{\"cells\":%d,\"sweep_s\":%.3f,"
      "\"over_tape_forward\":%.2f},\"attribution_qk\":[",
      z_cells, atp, atp / tape);
  // q and k over every position, first order and with AtP*'s QK fix (each cell's pattern
  // rows recomputed)
  for (const char* site : {"q", "k"}) {
    const ki::PatchTarget target = *ki::PatchTargetByName(site);
    const int cells = L * target.Heads(c) * n;
    double secs[2];
    for (const bool fix : {false, true}) {
      secs[fix] = Seconds([&] {
        Must(ki::AttributionPatchSweep(*model, be, input, source, target, layers, 0, n, o, false,
                                       &be, fix)
                 .ok(),
             site);
      });
    }
    std::printf(
        "attribution patching, %s at every position (%d cells): %.3f s; with the QK fix %.3f s "
        "(%.2f tape forwards)\n",
        site, cells, secs[0], secs[1], secs[1] / tape);
    json += absl::StrFormat("%s{\"site\":\"%s\",\"cells\":%d,\"sweep_s\":%.3f,\"qk_fix_s\":%.3f}",
                            std::string(site) == "q" ? "" : ",", site, cells, secs[0], secs[1]);
  }
  json += "]";
  std::printf("%s}\n", json.c_str());
  return 0;
}
