// Attention semantics on both CPU backends: every worked example of the seed documents
// (/work/shared/seeds), the symmetry properties they prove, and argument errors. Expected
// values are the seeds' hand calculations, never outputs of the code under test.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/kernels/cpu/attention_test_util.h"

namespace kvlens::kernels {
namespace {

using testing::AttnProblem;
using testing::AttnResult;
using testing::RunAttention;

const double kLn2 = std::log(2.0), kLn3 = std::log(3.0);
const double kInf = std::numeric_limits<double>::infinity();

template <typename B>
std::unique_ptr<B> MakeBackend() {
  if constexpr (std::is_same_v<B, CpuBackend>) {
    return std::make_unique<CpuBackend>(4);  // more threads than cores: shakes out races
  } else {
    return std::make_unique<B>();
  }
}

template <typename B>
class AttentionTest : public ::testing::Test {
 protected:
  using T = decltype(testing::ScalarOf(static_cast<B*>(nullptr)));
  // Hand values are O(1); fp32 carries ~1e-7 relative error per operation.
  static constexpr double kTol = std::is_same_v<T, double> ? 1e-12 : 3e-6;

  AttnResult Run(const AttnProblem& p) { return RunAttention(*backend_, p); }
  AttnResult RunOk(const AttnProblem& p) {
    AttnResult r = Run(p);
    EXPECT_TRUE(r.status.ok()) << r.status;
    return r;
  }

  std::unique_ptr<B> backend_ = MakeBackend<B>();
};

using Backends = ::testing::Types<ReferenceBackend, CpuBackend>;
TYPED_TEST_SUITE(AttentionTest, Backends);

// Seed 001 "A complete attention calculation": q = 1, k = (0, ln2, ln3), scale 1 (d_k = 1).
// d_k = 1 is embedded in Dh = 2 with a zero second coordinate; values are 2-wide.
AttnProblem ThreeMemories() {
  AttnProblem p;
  p.tq = 1;
  p.tk = 3;
  p.dh = 2;
  p.scale = 1.0;
  p.q = {1, 0};
  p.k = {0, 0, kLn2, 0, kLn3, 0};
  p.v = {2, 0, 0, 3, 4, 2};
  return p;
}

// Gemma 2's soft-capping by hand: q = 1, keys 0 and atanh(1/2), scale 1, cap 1: the capped
// scores are 0 and 1/2 (the scores map holds them), so with values 1 and 3 the output is
// (1 + 3√e) / (1 + √e); uncapped, the weights would be 1 : 1.7321 instead of 1 : 1.6487.
TYPED_TEST(AttentionTest, SoftCappedScoresByHand) {
  AttnProblem p;
  p.tq = 1;
  p.tk = 2;
  p.dh = 1;
  p.scale = 1.0;
  p.softcap = 1.0;
  p.q = {1};
  p.k = {0, std::atanh(0.5)};
  p.v = {1, 3};
  const AttnResult r = this->RunOk(p);
  const double e = std::exp(0.5);
  EXPECT_NEAR(r.out[0], (1 + 3 * e) / (1 + e), this->kTol);
  EXPECT_NEAR(r.scores[0], 0.0, this->kTol);
  EXPECT_NEAR(r.scores[1], 0.5, this->kTol);
  EXPECT_NEAR(r.probs[1], e / (1 + e), this->kTol);
}

TYPED_TEST(AttentionTest, SeedThreeMemoriesGivesSevenThirdsAndTwo) {
  const AttnProblem p = ThreeMemories();
  const AttnResult r = this->RunOk(p);
  EXPECT_NEAR(r.S(0, 0, 0, p), 0.0, this->kTol);
  EXPECT_NEAR(r.S(0, 0, 1, p), kLn2, this->kTol);
  EXPECT_NEAR(r.S(0, 0, 2, p), kLn3, this->kTol);
  EXPECT_NEAR(r.P(0, 0, 0, p), 1.0 / 6, this->kTol);
  EXPECT_NEAR(r.P(0, 0, 1, p), 1.0 / 3, this->kTol);
  EXPECT_NEAR(r.P(0, 0, 2, p), 1.0 / 2, this->kTol);
  EXPECT_NEAR(r.O(0, 0, 0, p), 7.0 / 3, this->kTol);
  EXPECT_NEAR(r.O(0, 0, 1, p), 2.0, this->kTol);
}

// Masking the third memory renormalises over the other two: (1/3, 2/3, 0) → (2/3, 2).
// Masked through causality (query at position 1 sees keys 0, 1) and through document ids.
TYPED_TEST(AttentionTest, SeedMaskedThirdMemoryRenormalises) {
  AttnProblem causal = ThreeMemories();
  causal.causal = true;
  causal.offset = 1;
  AttnProblem docs = ThreeMemories();
  docs.q_doc = {4};
  docs.k_doc = {4, 4, 9};
  for (const AttnProblem& p : {causal, docs}) {
    const AttnResult r = this->RunOk(p);
    EXPECT_NEAR(r.P(0, 0, 0, p), 1.0 / 3, this->kTol);
    EXPECT_NEAR(r.P(0, 0, 1, p), 2.0 / 3, this->kTol);
    EXPECT_EQ(r.P(0, 0, 2, p), 0.0);
    EXPECT_EQ(r.S(0, 0, 2, p), -kInf);
    EXPECT_NEAR(r.O(0, 0, 0, p), 2.0 / 3, this->kTol);
    EXPECT_NEAR(r.O(0, 0, 1, p), 2.0, this->kTol);
  }
}

// Zeroing the third value keeps its weight 1/2 in the denominator:
// 1/6·(2,0) + 1/3·(0,3) = (1/3, 1), not the masked (2/3, 2).
TYPED_TEST(AttentionTest, SeedMaskingIsNotZeroingTheValue) {
  AttnProblem p = ThreeMemories();
  p.v[4] = p.v[5] = 0.0;
  const AttnResult r = this->RunOk(p);
  EXPECT_NEAR(r.P(0, 0, 2, p), 1.0 / 2, this->kTol);
  EXPECT_NEAR(r.O(0, 0, 0, p), 1.0 / 3, this->kTol);
  EXPECT_NEAR(r.O(0, 0, 1, p), 1.0, this->kTol);
  EXPECT_GT(std::abs(r.O(0, 0, 0, p) - 2.0 / 3), 0.3);
}

// Seed 004 Example 1: Q = √2·ln3·I, K = I, V = [[2,0],[0,4]], d_k = 2.
// S = [[ln3,0],[0,ln3]], A = [[3/4,1/4],[1/4,3/4]], O = [[3/2,1],[1/2,3]],
// J = Σ G ⊙ O = 15/2 with G = [[1,0],[0,2]].
TYPED_TEST(AttentionTest, SeedTwoByTwoForward) {
  const double a = std::sqrt(2.0) * kLn3;
  AttnProblem p;
  p.tq = p.tk = p.dh = 2;
  p.scale = 1.0 / std::sqrt(2.0);
  p.q = {a, 0, 0, a};
  p.k = {1, 0, 0, 1};
  p.v = {2, 0, 0, 4};
  const AttnResult r = this->RunOk(p);
  const double s[2][2] = {{kLn3, 0}, {0, kLn3}};
  const double w[2][2] = {{0.75, 0.25}, {0.25, 0.75}};
  const double o[2][2] = {{1.5, 1}, {0.5, 3}};
  const double g[2][2] = {{1, 0}, {0, 2}};
  double j_probe = 0;
  for (int i = 0; i < 2; ++i) {
    for (int c = 0; c < 2; ++c) {
      EXPECT_NEAR(r.S(0, i, c, p), s[i][c], this->kTol);
      EXPECT_NEAR(r.P(0, i, c, p), w[i][c], this->kTol);
      EXPECT_NEAR(r.O(i, 0, c, p), o[i][c], this->kTol);
      j_probe += g[i][c] * r.O(i, 0, c, p);
    }
  }
  EXPECT_NEAR(j_probe, 7.5, 4 * this->kTol);
  // The rows of A are non-negative and sum to one; O lies in the values' hull.
  for (int i = 0; i < 2; ++i) {
    EXPECT_NEAR(r.P(0, i, 0, p) + r.P(0, i, 1, p), 1.0, this->kTol);
    EXPECT_GE(r.O(i, 0, 0, p), 0.0);
    EXPECT_LE(r.O(i, 0, 0, p), 2.0);
    EXPECT_GE(r.O(i, 0, 1, p), 0.0);
    EXPECT_LE(r.O(i, 0, 1, p), 4.0);
  }
}

// Seed 004 §1: Q = [[1,2],[0,1]], K = [[1,0],[2,1]] gives QKᵀ = [[1,4],[0,1]]; a dropped
// transpose would give [[5,2],[2,1]].
TYPED_TEST(AttentionTest, SeedAsymmetricScoresCatchADroppedTranspose) {
  AttnProblem p;
  p.tq = p.tk = p.dh = 2;
  p.scale = 1.0;
  p.q = {1, 2, 0, 1};
  p.k = {1, 0, 2, 1};
  p.v = {0, 0, 0, 0};
  const AttnResult r = this->RunOk(p);
  EXPECT_NEAR(r.S(0, 0, 0, p), 1, this->kTol);
  EXPECT_NEAR(r.S(0, 0, 1, p), 4, this->kTol);
  EXPECT_NEAR(r.S(0, 1, 0, p), 0, this->kTol);
  EXPECT_NEAR(r.S(0, 1, 1, p), 1, this->kTol);
}

// Seed 004 Example 2: identical keys [1,1] give weights [1/2,1/2] and both outputs [1,2].
TYPED_TEST(AttentionTest, SeedIdenticalKeysCannotBeDiscriminated) {
  const double a = std::sqrt(2.0) * kLn3;
  AttnProblem p;
  p.tq = p.tk = p.dh = 2;
  p.scale = 1.0 / std::sqrt(2.0);
  p.q = {a, 0, 0, a};
  p.k = {1, 1, 1, 1};
  p.v = {2, 0, 0, 4};
  const AttnResult r = this->RunOk(p);
  for (int i = 0; i < 2; ++i) {
    EXPECT_NEAR(r.P(0, i, 0, p), 0.5, this->kTol);
    EXPECT_NEAR(r.P(0, i, 1, p), 0.5, this->kTol);
    EXPECT_NEAR(r.O(i, 0, 0, p), 1.0, this->kTol);
    EXPECT_NEAR(r.O(i, 0, 1, p), 2.0, this->kTol);
  }
}

// Scalar query 1 against scalar keys: scores are the keys times the scale.
AttnProblem TwoScalarKeys(double k0, double k1, double v0, double v1, double scale) {
  AttnProblem p;
  p.tk = 2;
  p.scale = scale;
  p.q = {1};
  p.k = {k0, k1};
  p.v = {v0, v1};
  return p;
}

// Seed 001 saturation: scores (0, ln3) → (1/4, 3/4), a(1−a) = 3/16; four times the scores
// → (1/82, 81/82), a(1−a) = 81/82² ≈ 0.01205.
TYPED_TEST(AttentionTest, SeedSaturation) {
  const AttnProblem p1 = TwoScalarKeys(0, kLn3, 0, 0, 1.0);
  const AttnResult r1 = this->RunOk(p1);
  EXPECT_NEAR(r1.P(0, 0, 0, p1), 0.25, this->kTol);
  EXPECT_NEAR(r1.P(0, 0, 1, p1), 0.75, this->kTol);
  EXPECT_NEAR(r1.P(0, 0, 0, p1) * (1 - r1.P(0, 0, 0, p1)), 3.0 / 16, this->kTol);
  const AttnProblem p4 = TwoScalarKeys(0, kLn3, 0, 0, 4.0);
  const AttnResult r4 = this->RunOk(p4);
  EXPECT_NEAR(r4.P(0, 0, 0, p4), 1.0 / 82, this->kTol);
  EXPECT_NEAR(r4.P(0, 0, 1, p4), 81.0 / 82, this->kTol);
  const double a = r4.P(0, 0, 0, p4);
  EXPECT_NEAR(a * (1 - a), 81.0 / (82.0 * 82.0), this->kTol);
  EXPECT_NEAR(a * (1 - a), 0.01205, 1e-5);
}

// Seed 000/001: adding c to every score changes nothing: (0, ln3) + c → (1/4, 3/4) for every
// c. Scores (c, ln3 + c) come from q = (1, c), k_j = (s_j, 1). c = ±100 overflows exp()
// in fp32 unless the row maximum is subtracted first.
TYPED_TEST(AttentionTest, SeedSoftmaxShiftInvariance) {
  for (double c : {-100.0, -7.5, 0.0, 3.0, 100.0}) {
    AttnProblem p;
    p.tk = 2;
    p.dh = 2;
    p.q = {1, c};
    p.k = {0, 1, kLn3, 1};
    p.v = {2, 0, 6, 0};
    const AttnResult r = this->RunOk(p);
    // fp32 holds ln3 + 100 only to ~4e-6.
    const double tol = std::is_same_v<typename TestFixture::T, double> ? 1e-12 : 2e-5;
    EXPECT_NEAR(r.P(0, 0, 0, p), 0.25, tol) << c;
    EXPECT_NEAR(r.P(0, 0, 1, p), 0.75, tol) << c;
    EXPECT_NEAR(r.O(0, 0, 0, p), 5.0, 4 * tol) << c;  // seed 002: output 5
  }
}

// Seed 002: at the first causal position only value 2 is allowed, so the output is 2
// whatever the future score or value.
TYPED_TEST(AttentionTest, SeedFirstCausalPositionIgnoresTheFuture) {
  for (double future : {-3.0, 0.0, kLn3, 50.0}) {
    AttnProblem p;
    p.tq = 2;
    p.tk = 2;
    p.causal = true;
    p.q = {1, 1};
    p.k = {0, future};
    p.v = {2, 6 + future};
    const AttnResult r = this->RunOk(p);
    EXPECT_NEAR(r.O(0, 0, 0, p), 2.0, this->kTol);
    EXPECT_EQ(r.P(0, 0, 1, p), 0.0);
  }
}

// Seed 001: values 0 and 10 with weights 0.9 and 0.1 give output 1.
TYPED_TEST(AttentionTest, SeedLargeWeightOnAZeroValue) {
  const AttnProblem p = TwoScalarKeys(std::log(9.0), 0, 0, 10, 1.0);
  const AttnResult r = this->RunOk(p);
  EXPECT_NEAR(r.P(0, 0, 0, p), 0.9, this->kTol);
  EXPECT_NEAR(r.O(0, 0, 0, p), 1.0, 10 * this->kTol);
}

// A causal one-head problem of 10 slots of 4 dims at scale 0.5, random from `seed`.
AttnProblem TenSlots(uint64_t seed) {
  std::mt19937_64 rng(seed);
  AttnProblem p;
  p.tq = p.tk = 10;
  p.dh = 4;
  p.causal = true;
  p.scale = 0.5;
  p.q = testing::RandomFloatExact(rng, 40);
  p.k = testing::RandomFloatExact(rng, 40);
  p.v = testing::RandomFloatExact(rng, 40);
  return p;
}

// Row 7 of a TenSlots problem that sees exactly slots 5, 6, 7: its probabilities (and −∞ scores
// elsewhere) and its output, by hand in double.
void ExpectSlotSevenSeesFiveToSeven(const AttnProblem& p, const AttnResult& r, double tol) {
  for (int j = 0; j < 10; ++j) {
    const bool allowed = j >= 5 && j <= 7;
    EXPECT_EQ(r.P(0, 7, j, p) > 0.0, allowed) << j;
    EXPECT_EQ(r.S(0, 7, j, p) == -kInf, !allowed) << j;
  }
  double s[3], z = 0, o[4] = {0, 0, 0, 0};
  for (int j = 5; j <= 7; ++j) {
    double dot = 0;
    for (int d = 0; d < 4; ++d) dot += p.q[7 * 4 + d] * p.k[j * 4 + d];
    s[j - 5] = std::exp(0.5 * dot);
    z += s[j - 5];
  }
  for (int j = 5; j <= 7; ++j) {
    EXPECT_NEAR(r.P(0, 7, j, p), s[j - 5] / z, tol);
    for (int d = 0; d < 4; ++d) o[d] += s[j - 5] / z * p.v[j * 4 + d];
  }
  for (int d = 0; d < 4; ++d) EXPECT_NEAR(r.O(7, 0, d, p), o[d], tol);
}

// Seed 002 packed documents: the second document begins at slot 5 (slots 0–4 are the
// prior example), so with causal order the query at slot 7 sees exactly slots 5, 6, 7.
TYPED_TEST(AttentionTest, SeedPackedDocumentSlotSevenSeesFiveToSeven) {
  AttnProblem p = TenSlots(11);
  p.q_doc = p.k_doc = {0, 0, 0, 0, 0, 1, 1, 1, 1, 1};
  const AttnResult r = this->RunOk(p);
  ExpectSlotSevenSeesFiveToSeven(p, r, this->kTol);
  // Slot 5, the new document's first token, sees only itself.
  EXPECT_NEAR(r.P(0, 5, 5, p), 1.0, this->kTol);
  for (int d = 0; d < 4; ++d) EXPECT_NEAR(r.O(5, 0, d, p), p.v[5 * 4 + d], this->kTol);
}

// A sliding window of 3 (Mistral 7B v0.1's rule, window 4096): the query at slot 7 sees
// slots 5, 6, 7 as in the packed example above, now because of the window; by hand. A
// window of 1 leaves each row its own value; one as long as the keys hides nothing; and
// the last rows alone (query offset 6) are the full computation's tail.
TYPED_TEST(AttentionTest, SlidingWindowSlotSevenSeesFiveToSeven) {
  AttnProblem p = TenSlots(12);
  p.window = 3;
  const AttnResult r = this->RunOk(p);
  ExpectSlotSevenSeesFiveToSeven(p, r, this->kTol);
  // Rows 0 and 1 are inside the window from the start: plain causal rows.
  AttnProblem causal = p;
  causal.window = 0;
  const AttnResult c = this->RunOk(causal);
  for (int d = 0; d < 4; ++d) EXPECT_NEAR(r.O(1, 0, d, p), c.O(1, 0, d, p), this->kTol);
  EXPECT_GT(std::abs(r.O(9, 0, 0, p) - c.O(9, 0, 0, p)), 1e-6);
  AttnProblem whole = p;
  whole.window = 10;
  const AttnResult w = this->RunOk(whole);
  for (size_t e = 0; e < w.out.size(); ++e) EXPECT_EQ(w.out[e], c.out[e]) << e;
  AttnProblem own = p;
  own.window = 1;
  const AttnResult one = this->RunOk(own);
  for (int i = 0; i < 10; ++i) {
    for (int d = 0; d < 4; ++d) EXPECT_NEAR(one.O(i, 0, d, p), p.v[i * 4 + d], this->kTol);
  }
  AttnProblem tail = p;
  tail.tq = 4;
  tail.offset = 6;
  tail.q.assign(p.q.begin() + 24, p.q.end());
  const AttnResult t = this->RunOk(tail);
  for (int i = 0; i < 4; ++i) {
    for (int d = 0; d < 4; ++d) EXPECT_NEAR(t.O(i, 0, d, tail), r.O(6 + i, 0, d, p), this->kTol);
  }
  AttnProblem bad = p;
  bad.window = -1;
  EXPECT_NE(this->Run(bad).status.message().find("window"), std::string::npos);
  bad.window = 3;
  bad.causal = false;
  EXPECT_NE(this->Run(bad).status.message().find("window"), std::string::npos);
}

// Seed 001 sinusoidal features: p_ω(t) = (sin ωt, cos ωt);
// p_ω(t+Δ) = [[cos ωΔ, sin ωΔ], [−sin ωΔ, cos ωΔ]] p_ω(t) and p_ω(t)ᵀp_ω(u) = cos ω(t−u).
// With ω_i = 10000^(−2i/d) the encoding's dot products, and so attention scores between
// encodings, depend only on the offset.
std::vector<double> SinusoidalPe(double t, int d) {
  std::vector<double> pe(d);
  for (int i = 0; i < d / 2; ++i) {
    const double w = std::pow(10000.0, -2.0 * i / d);
    pe[2 * i] = std::sin(w * t);
    pe[2 * i + 1] = std::cos(w * t);
  }
  return pe;
}

TEST(SinusoidalPositionTest, DisplacementIsARotationAndDotDependsOnOffset) {
  constexpr int kD = 16;
  for (double t : {0.0, 1.0, 7.0, 123.0}) {
    for (double delta : {1.0, 3.0, 50.0}) {
      const std::vector<double> a = SinusoidalPe(t, kD), b = SinusoidalPe(t + delta, kD);
      for (int i = 0; i < kD / 2; ++i) {
        const double w = std::pow(10000.0, -2.0 * i / kD);
        const double c = std::cos(w * delta), s = std::sin(w * delta);
        EXPECT_NEAR(b[2 * i], c * a[2 * i] + s * a[2 * i + 1], 1e-9);
        EXPECT_NEAR(b[2 * i + 1], -s * a[2 * i] + c * a[2 * i + 1], 1e-9);
        EXPECT_NEAR(a[2 * i] * b[2 * i] + a[2 * i + 1] * b[2 * i + 1], std::cos(w * delta), 1e-9);
      }
      double dot = 0, want = 0;
      for (int i = 0; i < kD; ++i) dot += a[i] * b[i];
      for (int i = 0; i < kD / 2; ++i) want += std::cos(std::pow(10000.0, -2.0 * i / kD) * delta);
      EXPECT_NEAR(dot, want, 1e-9);
    }
  }
}

TYPED_TEST(AttentionTest, SinusoidalQueriesAndKeysAttendByOffsetOnly) {
  constexpr int kD = 16, kKeys = 6;
  auto attend_from = [&](double start) {
    AttnProblem p;
    p.tk = kKeys;
    p.dh = kD;
    p.scale = 1.0;
    p.q = SinusoidalPe(start + kKeys, kD);
    for (int j = 0; j < kKeys; ++j) {
      const std::vector<double> pe = SinusoidalPe(start + j, kD);
      p.k.insert(p.k.end(), pe.begin(), pe.end());
    }
    p.v.assign(static_cast<size_t>(kKeys) * kD, 0.0);
    return this->RunOk(p);
  };
  const AttnResult base = attend_from(0);
  for (double start : {5.0, 40.0}) {
    const AttnResult moved = attend_from(start);
    for (int j = 0; j < kKeys; ++j) {
      EXPECT_NEAR(moved.probs[j], base.probs[j], 30 * this->kTol) << start << " " << j;
    }
  }
}

AttnProblem RandomProblem(std::mt19937_64& rng, int tq, int tk, int heads, int kv_heads, int dh) {
  AttnProblem p;
  p.tq = tq;
  p.tk = tk;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.dh = dh;
  p.scale = 1.0 / std::sqrt(static_cast<double>(dh));
  p.q = testing::RandomFloatExact(rng, static_cast<size_t>(tq) * heads * dh, -2, 2);
  p.k = testing::RandomFloatExact(rng, static_cast<size_t>(tk) * kv_heads * dh, -2, 2);
  p.v = testing::RandomFloatExact(rng, static_cast<size_t>(tk) * kv_heads * dh);
  return p;
}

// Seed 001: without a mask, permuting keys and values together leaves every output
// unchanged, and permuting the queries permutes the outputs (Y' = PY).
TYPED_TEST(AttentionTest, PermutationEquivarianceWithoutMask) {
  std::mt19937_64 rng(5);
  const AttnProblem p = RandomProblem(rng, 5, 7, 2, 1, 8);
  const AttnResult base = this->RunOk(p);
  std::vector<int> perm_k(7), perm_q(5);
  std::iota(perm_k.begin(), perm_k.end(), 0);
  std::iota(perm_q.begin(), perm_q.end(), 0);
  std::shuffle(perm_k.begin(), perm_k.end(), rng);
  std::shuffle(perm_q.begin(), perm_q.end(), rng);
  AttnProblem pk = p;
  for (int j = 0; j < 7; ++j) {
    for (int d = 0; d < 8; ++d) {
      pk.k[j * 8 + d] = p.k[perm_k[j] * 8 + d];
      pk.v[j * 8 + d] = p.v[perm_k[j] * 8 + d];
    }
  }
  const AttnResult rk = this->RunOk(pk);
  for (size_t e = 0; e < base.out.size(); ++e) EXPECT_NEAR(rk.out[e], base.out[e], this->kTol);
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 5; ++i) {
      for (int j = 0; j < 7; ++j) {
        EXPECT_NEAR(rk.P(h, i, j, pk), base.P(h, i, perm_k[j], p), this->kTol);
      }
    }
  }
  AttnProblem pq = p;
  for (int i = 0; i < 5; ++i) {
    for (int e = 0; e < 16; ++e) pq.q[i * 16 + e] = p.q[perm_q[i] * 16 + e];
  }
  const AttnResult rq = this->RunOk(pq);
  for (int i = 0; i < 5; ++i) {
    for (int h = 0; h < 2; ++h) {
      for (int d = 0; d < 8; ++d) {
        EXPECT_NEAR(rq.O(i, h, d, pq), base.O(perm_q[i], h, d, p), this->kTol);
      }
    }
  }
}

// Seed 002: with the causal mask, appending tokens (or changing future keys and values)
// never changes earlier rows — bit for bit, since row i reads only keys 0…i.
TYPED_TEST(AttentionTest, CausalPrefixInvariance) {
  std::mt19937_64 rng(6);
  AttnProblem shorter = RandomProblem(rng, 9, 9, 4, 2, 16);
  shorter.causal = true;
  AttnProblem longer = RandomProblem(rng, 13, 13, 4, 2, 16);
  longer.causal = true;
  std::copy(shorter.q.begin(), shorter.q.end(), longer.q.begin());
  std::copy(shorter.k.begin(), shorter.k.end(), longer.k.begin());
  std::copy(shorter.v.begin(), shorter.v.end(), longer.v.begin());
  const AttnResult a = this->RunOk(shorter), b = this->RunOk(longer);
  for (size_t e = 0; e < a.out.size(); ++e) ASSERT_EQ(a.out[e], b.out[e]) << e;
  for (int h = 0; h < 4; ++h) {
    for (int i = 0; i < 9; ++i) {
      for (int j = 0; j < 13; ++j) {
        EXPECT_EQ(b.P(h, i, j, longer), j < 9 ? a.P(h, i, j, shorter) : 0.0);
      }
    }
  }
  // NaN in every future key and value cannot reach earlier rows.
  AttnProblem poisoned = longer;
  std::fill(poisoned.k.begin() + 9 * 32, poisoned.k.end(), std::nan(""));
  std::fill(poisoned.v.begin() + 9 * 32, poisoned.v.end(), std::nan(""));
  poisoned.tq = 9;
  poisoned.q.resize(9 * 64);
  const AttnResult c = this->RunOk(poisoned);
  for (size_t e = 0; e < a.out.size(); ++e) ASSERT_EQ(a.out[e], c.out[e]) << e;
}

// Attending the last m queries with offset T − m over all T keys equals the last m rows
// of the full computation (decode and chunked prefill).
TYPED_TEST(AttentionTest, QueryOffsetMatchesTheTailOfTheFullComputation) {
  std::mt19937_64 rng(8);
  constexpr int kT = 12, kH = 4, kDh = 8;
  AttnProblem full = RandomProblem(rng, kT, kT, kH, 1, kDh);
  full.causal = true;
  const AttnResult all = this->RunOk(full);
  for (int m : {1, 3, kT}) {
    AttnProblem tail = full;
    tail.tq = m;
    tail.offset = kT - m;
    tail.q.assign(full.q.begin() + (kT - m) * kH * kDh, full.q.end());
    const AttnResult r = this->RunOk(tail);
    for (int i = 0; i < m; ++i) {
      for (int h = 0; h < kH; ++h) {
        for (int d = 0; d < kDh; ++d) {
          ASSERT_EQ(r.O(i, h, d, tail), all.O(kT - m + i, h, d, full));
        }
        for (int j = 0; j < kT; ++j) {
          ASSERT_EQ(r.P(h, i, j, tail), all.P(h, kT - m + i, j, full));
        }
      }
    }
  }
}

// Query head h reads KV head h / (H / Hkv): each head equals a single-head call on its
// own slices.
TYPED_TEST(AttentionTest, GroupedQueryHeadMapping) {
  std::mt19937_64 rng(9);
  constexpr int kTq = 3, kTk = 5, kH = 6, kHkv = 2, kDh = 4;
  AttnProblem p = RandomProblem(rng, kTq, kTk, kH, kHkv, kDh);
  const AttnResult r = this->RunOk(p);
  for (int h = 0; h < kH; ++h) {
    const int kvh = h / (kH / kHkv);
    AttnProblem one;
    one.tq = kTq;
    one.tk = kTk;
    one.dh = kDh;
    one.scale = p.scale;
    for (int i = 0; i < kTq; ++i) {
      for (int d = 0; d < kDh; ++d) one.q.push_back(p.q[(i * kH + h) * kDh + d]);
    }
    for (int j = 0; j < kTk; ++j) {
      for (int d = 0; d < kDh; ++d) {
        one.k.push_back(p.k[(j * kHkv + kvh) * kDh + d]);
        one.v.push_back(p.v[(j * kHkv + kvh) * kDh + d]);
      }
    }
    const AttnResult s = this->RunOk(one);
    for (int i = 0; i < kTq; ++i) {
      for (int d = 0; d < kDh; ++d) EXPECT_NEAR(r.O(i, h, d, p), s.O(i, 0, d, one), this->kTol);
    }
  }
}

TYPED_TEST(AttentionTest, RowWithoutVisibleKeyIsAnErrorNamingTheRow) {
  std::mt19937_64 rng(10);
  AttnProblem p = RandomProblem(rng, 5, 9, 2, 2, 4);
  p.causal = true;
  p.offset = 4;
  // Row 3 is position 7 and belongs to document 2, whose only key (slot 8) is in its future.
  p.q_doc = {0, 0, 1, 2, 1};
  p.k_doc = {0, 0, 0, 1, 1, 1, 1, 1, 2};
  const AttnResult r = this->Run(p);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status.message(), "attention query row 3 (position 7) has no visible key");
  for (double x : r.out) ASSERT_EQ(x, testing::kUntouched);
  for (double x : r.probs) ASSERT_EQ(x, testing::kUntouched);
  for (double x : r.out) ASSERT_FALSE(std::isnan(x));
  // Seeing its own key makes it valid.
  p.k_doc[7] = 2;
  EXPECT_TRUE(this->Run(p).status.ok());
}

TYPED_TEST(AttentionTest, InvalidArgumentsNameTheField) {
  std::mt19937_64 rng(12);
  const AttnProblem good = RandomProblem(rng, 2, 3, 4, 2, 8);
  ASSERT_TRUE(this->Run(good).status.ok());
  struct Case {
    std::string field;
    std::function<void(AttnProblem&)> edit;
  };
  const std::vector<Case> cases = {
      {"num_kv_heads", [](AttnProblem& p) { p.kv_heads = 3; }},
      {"num_heads", [](AttnProblem& p) { p.heads = 0; }},
      {"num_queries", [](AttnProblem& p) { p.tq = 0; }},
      {"num_keys", [](AttnProblem& p) { p.tk = -1; }},
      {"head_dim", [](AttnProblem& p) { p.dh = 0; }},
      {"query_offset", [](AttnProblem& p) { p.offset = -1; }},
      {"scale", [](AttnProblem& p) { p.scale = 0.0; }},
      {"scale", [](AttnProblem& p) { p.scale = std::nan(""); }},
      {"q_doc_ids",
       [](AttnProblem& p) {
         p.q_doc = {0, 0};
         p.k_doc.clear();
       }},
  };
  for (const Case& c : cases) {
    AttnProblem p = good;
    c.edit(p);
    const AttnResult r = this->Run(p);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(std::string(r.status.message()).find("AttentionArgs." + c.field), std::string::npos)
        << r.status;
  }
}

// Strides, null pointers and the block table, set directly on the args.
TYPED_TEST(AttentionTest, InvalidStridesAndBlockTable) {
  using T = typename TestFixture::T;
  std::vector<T> q(64, 0), kv(64, 0), out(64, 0);
  const int32_t table[2] = {0, 1};
  auto base = [&] {
    AttentionArgs<T> a;
    a.q = q.data();
    a.q_stride = 8;
    a.num_queries = 2;
    a.num_keys = 2;
    a.num_heads = 2;
    a.num_kv_heads = 1;
    a.head_dim = 4;
    a.scale = 0.5;
    a.kv.k = kv.data();
    a.kv.v = kv.data();
    a.kv.row_stride = 4;
    a.out = out.data();
    a.out_stride = 8;
    return a;
  };
  ASSERT_TRUE(this->backend_->Attention(base()).ok());
  auto expect_field = [&](AttentionArgs<T> a, const std::string& field) {
    const absl::Status s = this->backend_->Attention(a);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(std::string(s.message()).find("AttentionArgs." + field), std::string::npos) << s;
  };
  AttentionArgs<T> a = base();
  a.q_stride = 7;
  expect_field(a, "q_stride");
  a = base();
  a.out_stride = 4;
  expect_field(a, "out_stride");
  a = base();
  a.kv.row_stride = 3;
  expect_field(a, "kv.row_stride");
  a = base();
  a.kv.block_table = table;
  expect_field(a, "kv.block_size");
  a = base();
  a.q = nullptr;
  expect_field(a, "q");
  a = base();
  a.kv.v = nullptr;
  expect_field(a, "kv.v");
  a = base();
  a.out = nullptr;
  expect_field(a, "out");
  // probs and scores are optional; a padded stride is fine.
  a = base();
  a.kv.row_stride = 6;
  EXPECT_TRUE(this->backend_->Attention(a).ok());
}

}  // namespace
}  // namespace kvlens::kernels
