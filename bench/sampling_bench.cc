// Host-side sampling of one engine step: for each of `rows` logit rows (vocabulary 32000,
// Gaussian logits, 600 tokens of history for the penalties) the engine's per-row work,
// kvlens::SampleRow (LogSoftmax for the reported log-probabilities, then Sampler::Sample),
// on the step thread alone and spread over a ThreadPool as the Engine does
// (EngineOptions::sampling_threads).
// On a GPU a 64-row decode step takes a few milliseconds; this is what the host adds.
// Prints a table, then one JSON line for scripts.
//
//   kvlens_bench_sampling [rows] [vocab]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

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
  const int rows = argc > 1 ? std::atoi(argv[1]) : 64;
  const int vocab = argc > 2 ? std::atoi(argv[2]) : 32000;
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<std::vector<float>> logits(rows, std::vector<float>(vocab));
  for (auto& row : logits) {
    for (float& l : row) l = normal(gen);
  }
  std::vector<int32_t> history(600);
  for (int32_t& t : history) t = static_cast<int32_t>(gen() % vocab);

  std::vector<Mode> modes(2);
  modes[0].name = "greedy";
  modes[1].name = "t0.8,top_p0.95,rep1.1";
  modes[1].params.temperature = 0.8;
  modes[1].params.top_p = 0.95;
  modes[1].params.repetition_penalty = 1.1;

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
          picked[static_cast<size_t>(r)] =
              kvlens::SampleRow(samplers[static_cast<size_t>(r)], logits[static_cast<size_t>(r)],
                                history, /*top_logprobs=*/0)
                  .token;
        });
      };
      for (int i = 0; i < 3; ++i) step();  // warm-up (first-touch of the row buffers)
      const int iters = 10;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) step();
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
          iters;
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
