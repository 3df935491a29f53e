// The interpretability tape on the CPU (engine/interpret): time of a recording forward
// (every layer's scores and probabilities kept) and of a forward + backward gradient
// probe (J = log p of the last token's target), its backward's heavy ops on the
// CpuBackend (kernels/cpu/cpu_backward.cc, as the server's fp32 probes) and, for
// comparison, the reference loops (double, one thread), against the engine's plain
// forward over the same tokens, on a Llama-shaped model with random f32 weights (D 512, 8 layers,
// 8 heads of 64, FFN 1376, vocab 4096) at 256 and 1024 tokens. The attention share grows
// with the tokens (the products' share with the model), so the longer row shows what the
// tape's attention costs. The last columns are the probe that also keeps every layer's FFN
// gradients (BackwardOptions::ffn_layers, what a gradient cache at mlp_pre / mlp_post needs):
// its time, and its working memory over the plain probe's (TapeBytes), then that of one
// layer's (a hook of one layer asked for). Prints a table, then one JSON line for scripts.
//
//   kvlens_bench_interpret [threads=1]
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
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"
#include "engine/model/transformer.h"
#include "kernels/cpu/cpu_backend.h"

namespace {

// The best of `reps` runs of fn, in seconds.
template <typename Fn>
double BestSeconds(int reps, Fn&& fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

void Must(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "kvlens_bench_interpret: %s failed\n", what);
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (kvlens::bench::PrintedHelp(
          argc, argv,
          "usage: kvlens_bench_interpret [threads=1]\n"
          "Times the interpretability tape's recording forward and a forward + backward\n"
          "gradient probe (backward on the reference loops, and on the CpuBackend's ops)\n"
          "against the plain forward, on a random Llama-shaped model (D 512,\n"
          "8 layers, 8 heads of 64) at 256 and 1024 tokens, on a CpuBackend with `threads`\n"
          "threads (the server's --interp-threads). Prints a table, then one JSON line.\n")) {
    return 0;
  }
  const int threads = argc > 1 ? std::max(1, std::atoi(argv[1])) : 1;
  kvlens::RetainFreedMemory();  // as the server and the CLI
  const kvlens::testing::TinySpec spec = kvlens::bench::InterpretBenchSpec();
  const std::unique_ptr<kvlens::Model> model = kvlens::testing::MakeTinyModel(spec);
  const kvlens::ModelConfig& c = model->config;
  kvlens::kernels::CpuBackend be(threads);

  std::printf("interpret tape: D %d, %d layers, %d heads of %d, %d thread(s)\n", c.dim,
              c.num_layers, c.num_heads, c.head_dim, threads);
  std::printf("%8s %12s %16s %22s %20s %10s %16s %12s %14s\n", "tokens", "forward ms",
              "tape forward ms", "probe, reference ms", "probe, cpu ops ms", "probe/fwd",
              "+ffn grads ms", "+ffn memory", "+1 layer's ffn");
  std::string json = absl::StrFormat(
      "{\"bench\":\"interpret\",\"dim\":%d,\"layers\":%d,\"heads\":%d,\"threads\":%d,\"results\":[",
      c.dim, c.num_layers, c.num_heads, threads);
  bool first = true;
  for (const int n : {256, 1024}) {
    std::mt19937 rng(1);
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(spec.vocab));
    const int bs = 16, blocks = (n + bs - 1) / bs;
    kvlens::KvCacheStorage<float> cache(c.num_layers, blocks, bs, c.kv_dim(), false);
    std::vector<int32_t> table(static_cast<size_t>(blocks));
    for (int b = 0; b < blocks; ++b) table[static_cast<size_t>(b)] = b;
    kvlens::Transformer<float> tr(*model, be);
    const int reps = n <= 256 ? 3 : 2;
    const double fwd = BestSeconds(reps, [&] {
      kvlens::BatchEntry e{tokens, 0, table, true};
      kvlens::ForwardOutput<float> out;
      Must(tr.Forward({&e, 1}, cache, out).ok(), "forward");
    });
    kvlens::interpret::SequenceInput<float> in{tokens};
    const double tape = BestSeconds(
        reps, [&] { Must(kvlens::interpret::RunForward(*model, be, in).ok(), "tape forward"); });
    const kvlens::interpret::Objective o = kvlens::interpret::Objective::LogProb({{n - 1, 42}});
    auto probe_with = [&](kvlens::kernels::BackwardOps<float>* ops, bool ffn) {
      kvlens::interpret::BackwardOptions options;
      for (int l = 0; ffn && l < c.num_layers; ++l) options.ffn_layers.push_back(l);
      return BestSeconds(reps, [&] {
        auto t = kvlens::interpret::RunForward(*model, be, in);
        Must(t.ok(), "tape forward");
        Must(kvlens::interpret::ObjectiveGradients(*model, *t, o, options, ops).ok(), "gradients");
      });
    };
    const double probe_ref = probe_with(nullptr, false);
    const double probe = probe_with(&be, false);
    const double probe_ffn = probe_with(&be, true);
    // mlp_pre, mlp_post, mlp_pre_linear of every layer, and of one (a hook of one layer
    // asked for), over the probe's tape and gradients
    const double probe_bytes = static_cast<double>(kvlens::interpret::TapeBytes(c, n, n, 4, true));
    const double ffn_share =
        static_cast<double>(kvlens::interpret::FfnGradientBytes(c, n, 4, c.num_layers)) /
        probe_bytes;
    const double one_share =
        static_cast<double>(kvlens::interpret::FfnGradientBytes(c, n, 4, 1)) / probe_bytes;
    std::printf("%8d %12.1f %16.1f %22.1f %20.1f %10.1f %16.1f %11.1f%% %13.1f%%\n", n, fwd * 1e3,
                tape * 1e3, probe_ref * 1e3, probe * 1e3, probe / fwd, probe_ffn * 1e3,
                ffn_share * 100, one_share * 100);
    json += absl::StrFormat(
        "%s{\"tokens\":%d,\"forward_ms\":%.2f,\"tape_forward_ms\":%.2f,"
        "\"probe_reference_ms\":%.2f,\"probe_ms\":%.2f,\"probe_ffn_ms\":%.2f,"
        "\"ffn_memory_share\":%.4f,\"ffn_one_layer_memory_share\":%.4f}",
        first ? "" : ",", n, fwd * 1e3, tape * 1e3, probe_ref * 1e3, probe * 1e3, probe_ffn * 1e3,
        ffn_share, one_share);
    first = false;
  }
  std::printf("%s]}\n", json.c_str());
  return 0;
}
