// Compiled with -march=native when the build allows it, and -ffp-contract=off
// (kernels/CMakeLists.txt): the loops below vectorise to the machine's widest float lanes,
// and every element's arithmetic is the same as without vectors.
#include "kernels/cpu/row_reduce.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/fast_exp.h"

namespace kvlens::kernels {
// Over eight independent lanes: a float max reduction is not vectorised without
// -ffast-math; eight lanes let the compiler do it with vector maxes.
float MaxLogit(absl::Span<const float> logits) {
  float lane_max[8];
  std::fill_n(lane_max, 8, -std::numeric_limits<float>::infinity());
  size_t m = 0;
  for (; m + 8 <= logits.size(); m += 8) {
    for (int t = 0; t < 8; ++t) lane_max[t] = std::max(lane_max[t], logits[m + t]);
  }
  for (; m < logits.size(); ++m) lane_max[0] = std::max(lane_max[0], logits[m]);
  return *std::max_element(lane_max, lane_max + 8);
}

double LogSumExp(absl::Span<const float> logits) {
  if (logits.empty()) return -std::numeric_limits<double>::infinity();
  const float max_f = MaxLogit(logits);
  if (max_f == -std::numeric_limits<float>::infinity()) return max_f;
  // Σ e^(l − max): the exponentials in float (vectorised), summed in double.
  thread_local std::vector<float> e;
  e.resize(logits.size());
  const float* l = logits.data();
  float* ep = e.data();
  for (size_t i = 0; i < logits.size(); ++i) ep[i] = ExpNegated(max_f - l[i]);
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  size_t j = 0;
  for (; j + 4 <= e.size(); j += 4) {
    for (int t = 0; t < 4; ++t) acc[t] += e[j + t];
  }
  for (; j < e.size(); ++j) acc[0] += e[j];
  const double sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  return static_cast<double>(max_f) + std::log(sum);
}

void TemperatureWeights(absl::Span<const float> logits, float max_l, double temperature,
                        float* out) {
  const float inv_t = static_cast<float>(1.0 / temperature);
  const float* l = logits.data();
  for (size_t i = 0; i < logits.size(); ++i) out[i] = ExpNegated((max_l - l[i]) * inv_t);
}

int32_t ArgMax(absl::Span<const float> logits) {
  // The max (vectorised), then its first position: two passes over 128 KB of a
  // 32000-token row cost less than std::max_element's one dependent compare an element.
  const float max_f = MaxLogit(logits);
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] == max_f) return static_cast<int32_t>(i);
  }
  return 0;
}

}  // namespace kvlens::kernels
