// Measures what a gradient probe costs relative to a forward pass on stories260K (the
// numbers quoted in docs/interpretability.md), with the allocator set as the binaries set
// it (freed memory kept for reuse; it stays so for the rest of this test process). Asserts only a
// generous bound, so a slow machine does not fail it; the printed lines are the measurement.
#include <chrono>
#include <random>

#include "common/malloc_tuning.h"
#include "engine/interpret/kv_probe.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"
#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

const std::string kBin = testing::TestData("stories260K/stories260K.bin");

template <typename Fn>
double BestSeconds(Fn&& fn, int reps = 5) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

template <typename T>
void Measure(const Model& m, kernels::Backend<T>& be, const char* name, int n) {
  std::mt19937 rng(1);
  std::vector<int32_t> t = {1};
  while (static_cast<int>(t.size()) < n) t.push_back(static_cast<int32_t>(3 + rng() % 509));
  const int bs = 16, blocks = (n + bs - 1) / bs;
  KvCacheStorage<T> cache(m.config.num_layers, blocks, bs, m.config.kv_dim(), false);
  std::vector<int32_t> table(blocks);
  for (int b = 0; b < blocks; ++b) table[b] = b;
  Transformer<T> tr(m, be);
  const double fwd = BestSeconds([&] {
    BatchEntry e{t, 0, table, true};
    ForwardOutput<T> out;
    ASSERT_TRUE(tr.Forward({&e, 1}, cache, out).ok());
  });
  SequenceInput<T> in{t};
  const double tape = BestSeconds([&] { ASSERT_TRUE(RunForward(m, be, in).ok()); });
  const Objective o = Objective::LogProb({{n - 1, 42}});
  const double probe = BestSeconds([&] {
    auto tp = RunForward(m, be, in);
    ASSERT_TRUE(tp.ok());
    // The backend's backward ops where it has them (CpuBackend, as the server's fp32
    // probes), else the reference loops (fp64).
    ASSERT_TRUE(
        ObjectiveGradients(m, *tp, o, {}, dynamic_cast<kernels::BackwardOps<T>*>(&be)).ok());
  });
  // cached-KV probe of one new token after n − 1 cached ones
  const double kv = BestSeconds([&] {
    KvProbeRequest r{table, n - 1, absl::MakeConstSpan(t).subspan(n - 1), 42};
    ASSERT_TRUE(CachedKvProbe(m, be, cache, r, dynamic_cast<kernels::BackwardOps<T>*>(&be)).ok());
  });
  std::printf(
      "[cost] %s, %d tokens: forward %.3f ms, tape forward %.3f ms, "
      "forward+backward probe %.3f ms (%.1fx forward), cached-KV probe of the last "
      "token %.3f ms (%.2fx forward)\n",
      name, n, fwd * 1e3, tape * 1e3, probe * 1e3, probe / fwd, kv * 1e3, kv / fwd);
  EXPECT_LT(probe / fwd, 200.0);
}

TEST(ProbeCost, Stories260K) {
  KVLENS_REQUIRE_FILE(kBin);
  RetainFreedMemory();  // as the server and the CLI do (common/malloc_tuning.h)
  auto m = LoadModel({kBin, ""});
  ASSERT_TRUE(m.ok());
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  Measure<double>(**m, ref, "fp64 reference", 64);
  Measure<float>(**m, fast, "fp32 cpu (2 threads)", 64);
  Measure<float>(**m, fast, "fp32 cpu (2 threads)", 256);
}

}  // namespace
}  // namespace kvlens::interpret
