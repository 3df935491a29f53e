// Host-side sampling of one engine step: for each of `rows` logit rows (vocabulary 32000,
// Gaussian logits, 600 tokens of history for the penalties) the engine's per-row work on a
// host backend: Sampler::ReserveDraw (the draw's uniform number and the history's token
// counts, kept from step to step: here the history does not grow, so after the first
// step this is the draw alone; a growing one adds a hash lookup a token) and kvlens::DrawRow
// (bias and penalties on a copy of the row, the draw, the log-probability), on the step
// thread alone and spread over a ThreadPool as the Engine does
// (EngineOptions::sampling_threads).
// On a GPU a 64-row decode step takes a few milliseconds; this is what the host adds.
// Each figure is the median of 7 timings of 5 steps. Prints a table, then one JSON line
// for scripts.
//
//   kvlens_bench_sampling [rows] [vocab]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_help.h"
#include "engine/sampler.h"
#include "kernels/cpu/thread_pool.h"

namespace {

using kvlens::SamplingParams;

struct Mode {
  const char* name;
  SamplingParams params;
};

}  // namespace

int main(int argc, char** argv) {
  if (kvlens::bench::PrintedHelp(
          argc, argv,
          "usage: kvlens_bench_sampling [rows=64] [vocab=32000]\n"
          "Times one engine step's host sampling (Sampler::ReserveDraw and kvlens::DrawRow on\n"
          "each of `rows` rows of Gaussian logits) on one thread and on a pool, per sampling\n"
          "mode. Prints a table, then one JSON line.\n")) {
    return 0;
  }
  const int rows = argc > 1 ? std::atoi(argv[1]) : 64;
  const int vocab = argc > 2 ? std::atoi(argv[2]) : 32000;
  if (rows < 1 || vocab < 2) {
    std::fprintf(stderr, "rows must be >= 1 and vocab >= 2 (got %d and %d); see --help\n", rows,
                 vocab);
    return 2;
  }
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<std::vector<float>> logits(rows, std::vector<float>(vocab));
  for (auto& row : logits) {
    for (float& l : row) l = normal(gen);
  }
  std::vector<int32_t> history(600);
  for (int32_t& t : history) t = static_cast<int32_t>(gen() % vocab);

  // Over these logits (σ = 3) the draws look at: top-p 0.95 at t 0.8 ~430 candidates; the
  // plain draw at t 1 a few hundred on average, now and then thousands; at t 0.3 a few.
  std::vector<Mode> modes(5);
  modes[0].name = "greedy";
  modes[1].name = "t0.8,top_p0.95,rep1.1";
  modes[1].params.temperature = 0.8;
  modes[1].params.top_p = 0.95;
  modes[1].params.repetition_penalty = 1.1;
  modes[2].name = "t0.8,top_p0.95";
  modes[2].params.temperature = 0.8;
  modes[2].params.top_p = 0.95;
  modes[3].name = "t1.0";
  modes[3].params.temperature = 1.0;
  modes[4].name = "t0.3,top_p0.95";
  modes[4].params.temperature = 0.3;
  modes[4].params.top_p = 0.95;

  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::printf("sampling: %d rows x %d vocabulary, %d cores\n", rows, vocab, cores);
  std::printf("%-24s %8s %14s %12s\n", "mode", "threads", "ms/step", "us/row");
  std::string json = "{\"bench\":\"sampling\",\"rows\":" + std::to_string(rows) +
                     ",\"vocab\":" + std::to_string(vocab) + ",\"results\":[";
  bool first = true;
  for (const Mode& mode : modes) {
    for (int threads : {1, std::min(8, cores)}) {
      kvlens::kernels::ThreadPool pool(threads);
      std::vector<kvlens::Sampler> samplers;
      for (int r = 0; r < rows; ++r) {
        SamplingParams p = mode.params;
        p.seed = static_cast<uint64_t>(r);
        samplers.emplace_back(p);
      }
      std::vector<int32_t> picked(rows);
      auto step = [&] {
        pool.ParallelFor(rows, [&](int64_t r) {
          kvlens::Sampler& sampler = samplers[static_cast<size_t>(r)];
          const kvlens::kernels::TokenDraw draw = sampler.ReserveDraw(history);
          picked[static_cast<size_t>(r)] =
              kvlens::DrawRow(sampler, logits[static_cast<size_t>(r)], draw).token;
        });
      };
      for (int i = 0; i < 3; ++i) step();  // warm-up (first-touch of the row buffers)
      // The median of 7 timings of 5 steps each: a shared machine's hiccups land in a few.
      std::vector<double> timings;
      for (int rep = 0; rep < 7; ++rep) {
        const int iters = 5;
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) step();
        timings.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count() /
            iters);
      }
      std::nth_element(timings.begin(), timings.begin() + 3, timings.end());
      const double ms = timings[3];
      std::printf("%-24s %8d %14.2f %12.1f\n", mode.name, threads, ms, ms * 1e3 / rows);
      char item[200];
      std::snprintf(item, sizeof(item), "%s{\"mode\":\"%s\",\"threads\":%d,\"ms_per_step\":%.3f}",
                    first ? "" : ",", mode.name, threads, ms);
      json += item;
      first = false;
    }
  }
  json += "]}";
  std::printf("%s\n", json.c_str());
  return 0;
}
