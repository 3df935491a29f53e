#include "engine/interpret/head_scores.h"

#include <cmath>
#include <limits>

namespace kvlens::interpret {

template <typename T>
std::vector<HeadScores> ScoreHeads(const std::vector<T>& probs, int H, int n, int tk, int offset,
                                   InductionLayout ind) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<HeadScores> out(H);
  for (int h = 0; h < H; ++h) {
    double ent = 0, prev = 0, sink = 0, induct = 0;
    int n_prev = 0, n_ind = 0;
    for (int i = 0; i < n; ++i) {
      const T* a = probs.data() + (int64_t{h} * n + i) * tk;
      const int p = offset + i;
      for (int j = 0; j < tk; ++j) {
        if (a[j] > T(0)) ent -= static_cast<double>(a[j]) * std::log(static_cast<double>(a[j]));
      }
      sink += a[0];
      if (p >= 1 && p - 1 < tk) {
        prev += a[p - 1];
        ++n_prev;
      }
      if (ind.period > 0 && p >= ind.start + ind.period && p < ind.start + 2 * ind.period) {
        induct += a[p - ind.period + 1];
        ++n_ind;
      }
    }
    out[h].entropy = n > 0 ? ent / n : nan;
    out[h].sink = n > 0 ? sink / n : nan;
    out[h].prev_token = n_prev > 0 ? prev / n_prev : nan;
    out[h].induction = n_ind > 0 ? induct / n_ind : nan;
  }
  return out;
}

template std::vector<HeadScores> ScoreHeads<float>(const std::vector<float>&, int, int, int, int,
                                                   InductionLayout);
template std::vector<HeadScores> ScoreHeads<double>(const std::vector<double>&, int, int, int, int,
                                                    InductionLayout);

}  // namespace kvlens::interpret
