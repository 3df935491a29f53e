// Sample statistics for kvlens-load: latency summaries (mean and percentiles) and the
// Poisson arrival process of open-loop runs.
#ifndef KVLENS_CLIENTS_LOAD_STATS_H_
#define KVLENS_CLIENTS_LOAD_STATS_H_

#include <cstdint>
#include <random>
#include <vector>

namespace kvlens::load {

// The p-th percentile (p in [0, 100]) of `sorted` (ascending), linearly interpolated
// between the two closest ranks: rank = p/100 · (n − 1), as numpy.percentile's default.
// 0 for an empty sample.
double Percentile(const std::vector<double>& sorted, double p);

struct Summary {
  int64_t count = 0;
  double mean = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
};

// Summarises `samples` (any order; copied and sorted).
Summary Summarize(std::vector<double> samples);

// Arrival times of a Poisson process with `rate` events per second: exponential gaps with
// mean 1/rate from a seeded generator, so a run's schedule is reproducible.
class PoissonArrivals {
 public:
  PoissonArrivals(double rate, uint64_t seed) : gap_(rate), rng_(seed) {}
  // Seconds until the next arrival.
  double NextGap() { return gap_(rng_); }

 private:
  std::exponential_distribution<double> gap_;
  std::mt19937_64 rng_;
};

}  // namespace kvlens::load

#endif  // KVLENS_CLIENTS_LOAD_STATS_H_
