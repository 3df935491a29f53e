// ExpNegated: e^−y for y >= 0 in float, branch-free, for loops the compiler vectorises
// (softmax weights and log-sum-exps over whole rows).
#ifndef KVLENS_KERNELS_FAST_EXP_H_
#define KVLENS_KERNELS_FAST_EXP_H_

#include <cstdint>
#include <cstring>

namespace kvlens::kernels {

// e^−y within about 2e-7 relative for 0 <= y < 87.3: 2^n · e^r with n = round(−y / ln 2)
// and |r| <= ln 2 / 2, e^r by its Taylor series to r^6 (truncation 1.3e-7). Exactly 0
// for y >= 87.3 (e^−87.3 ≈ 1.2e-38: nothing next to the e^0 = 1 of a softmax's max),
// +inf (a masked score) and NaN of either sign. The cap compares y's bits as integers (for y >= 0
// their order is the floats'), so a loop calling this has no float compare and vectorises under the
// default -ftrapping-math; std::exp costs ~5 ns an element in double.
inline float ExpNegated(float y) {
  constexpr int32_t kCapBits = 0x42ae999a;  // 87.3f
  int32_t yb;
  std::memcpy(&yb, &y, sizeof(yb));
  // The sign bit cleared: −0 is 0, and a NaN of either sign (x86's default NaN, from
  // −inf − −inf, has it set) has larger bits than the cap.
  yb &= 0x7fffffff;
  const bool small = yb < kCapBits;  // (NaN and +inf have larger bits)
  yb = small ? yb : kCapBits;
  float yc;
  std::memcpy(&yc, &yb, sizeof(yc));
  const float x = -yc;
  constexpr float kRound = 12582912.0f;  // 1.5 · 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504f + kRound) - kRound;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 = hi + lo
  const float p =
      1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 +
                                          r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  const int32_t bits = small ? (static_cast<int32_t>(n) + 127) << 23 : 0;  // 2^n, or 0
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_FAST_EXP_H_
