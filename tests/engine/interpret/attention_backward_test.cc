// The attention backward (kernels/cpu/reference_backward.h) on the seeds' worked examples,
// and against centred finite differences of ReferenceBackend::Attention on random shapes
// with grouped-query heads, a causal mask, a query offset, document ids and a paged cache.
#include <cmath>
#include <numbers>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cpu/reference_backward.h"

namespace kvlens::kernels {
namespace {

struct Problem {
  int tq, tk, h, hkv, dh, offset;
  bool causal;
  double softcap = 0.0;            // Gemma 2's soft-capped scores (0: none)
  std::vector<double> q, k, v, g;  // q, g [Tq, H, Dh]; k, v [Tk, Hkv, Dh] contiguous
  std::vector<int32_t> q_doc, k_doc;
};

AttentionArgs<double> Forward(const Problem& p, const std::vector<double>& q,
                              const std::vector<double>& k, const std::vector<double>& v,
                              std::vector<double>& out, std::vector<double>& probs) {
  AttentionArgs<double> a;
  a.q = q.data();
  a.q_stride = int64_t{p.h} * p.dh;
  a.num_queries = p.tq;
  a.num_keys = p.tk;
  a.num_heads = p.h;
  a.num_kv_heads = p.hkv;
  a.head_dim = p.dh;
  a.query_offset = p.offset;
  a.causal = p.causal;
  a.scale = 1.0 / std::sqrt(static_cast<double>(p.dh));
  a.softcap = p.softcap;
  if (!p.q_doc.empty()) {
    a.q_doc_ids = p.q_doc.data();
    a.k_doc_ids = p.k_doc.data();
  }
  a.kv.k = k.data();
  a.kv.v = v.data();
  a.kv.row_stride = int64_t{p.hkv} * p.dh;
  out.assign(q.size(), 0.0);
  probs.assign(int64_t{p.h} * p.tq * p.tk, 0.0);
  a.out = out.data();
  a.out_stride = a.q_stride;
  a.probs = probs.data();
  return a;
}

// J = Σ G ⊙ O
double Objective(const Problem& p, const std::vector<double>& q, const std::vector<double>& k,
                 const std::vector<double>& v) {
  std::vector<double> out, probs;
  ReferenceBackend be;
  EXPECT_TRUE(be.Attention(Forward(p, q, k, v, out, probs)).ok());
  double j = 0;
  for (size_t e = 0; e < out.size(); ++e) j += p.g[e] * out[e];
  return j;
}

struct Grads {
  std::vector<double> dq, dk, dv, dprobs, dscores, probs;
};

Grads RunBackward(const Problem& p) {
  std::vector<double> out;
  Grads r;
  ReferenceBackend be;
  const AttentionArgs<double> fa = Forward(p, p.q, p.k, p.v, out, r.probs);
  EXPECT_TRUE(be.Attention(fa).ok());
  r.dq.resize(p.q.size());
  r.dk.resize(p.k.size());
  r.dv.resize(p.v.size());
  r.dprobs.resize(r.probs.size());
  r.dscores.resize(r.probs.size());
  AttentionBackwardArgs<double> b = BackwardArgsOf(fa);  // probs: r.probs
  b.dout = p.g.data();
  b.dout_stride = fa.q_stride;
  b.dq = r.dq.data();
  b.dk = r.dk.data();
  b.dv = r.dv.data();
  b.dprobs = r.dprobs.data();
  b.dscores = r.dscores.data();
  const absl::Status s = AttentionBackward(b);
  EXPECT_TRUE(s.ok()) << s;
  return r;
}

// The seeds' 2×2 example: Q = √2·ln3·I, K = I, V = [[2,0],[0,4]], G = [[1,0],[0,2]].
Problem TwoByTwo() {
  const double a = std::sqrt(2.0) * std::log(3.0);
  Problem p{2, 2, 1, 1, 2, 0, false};
  p.q = {a, 0, 0, a};
  p.k = {1, 0, 0, 1};
  p.v = {2, 0, 0, 4};
  p.g = {1, 0, 0, 2};
  return p;
}

TEST(AttentionBackwardSeeds, TwoByTwoWorkedExample) {
  const Problem p = TwoByTwo();
  EXPECT_NEAR(Objective(p, p.q, p.k, p.v), 7.5, 1e-14);  // J = Σ G ⊙ O = 15/2
  const Grads g = RunBackward(p);
  EXPECT_NEAR(g.probs[0], 0.75, 1e-15);
  EXPECT_NEAR(g.probs[1], 0.25, 1e-15);
  // dA = G Vᵀ = [[2, 0], [0, 8]]
  EXPECT_NEAR(g.dprobs[0], 2.0, 1e-14);
  EXPECT_NEAR(g.dprobs[1], 0.0, 1e-14);
  EXPECT_NEAR(g.dprobs[2], 0.0, 1e-14);
  EXPECT_NEAR(g.dprobs[3], 8.0, 1e-14);
  // dS rows [3/8, −3/8] and [−3/2, 3/2]
  EXPECT_NEAR(g.dscores[0], 3.0 / 8, 1e-14);
  EXPECT_NEAR(g.dscores[1], -3.0 / 8, 1e-14);
  EXPECT_NEAR(g.dscores[2], -1.5, 1e-14);
  EXPECT_NEAR(g.dscores[3], 1.5, 1e-14);
  // dV = Aᵀ G = [[3/4, 1/2], [1/4, 3/2]]
  EXPECT_NEAR(g.dv[0], 0.75, 1e-14);
  EXPECT_NEAR(g.dv[1], 0.5, 1e-14);
  EXPECT_NEAR(g.dv[2], 0.25, 1e-14);
  EXPECT_NEAR(g.dv[3], 1.5, 1e-14);
  // dQ = dS K / √2, dK = dSᵀ Q / √2
  const double r2 = std::sqrt(2.0), a = r2 * std::log(3.0);
  EXPECT_NEAR(g.dq[0], 3.0 / 8 / r2, 1e-14);
  EXPECT_NEAR(g.dq[1], -3.0 / 8 / r2, 1e-14);
  EXPECT_NEAR(g.dq[2], -1.5 / r2, 1e-14);
  EXPECT_NEAR(g.dq[3], 1.5 / r2, 1e-14);
  EXPECT_NEAR(g.dk[0], 3.0 / 8 * a / r2, 1e-14);
  EXPECT_NEAR(g.dk[1], -1.5 * a / r2, 1e-14);
  EXPECT_NEAR(g.dk[2], -3.0 / 8 * a / r2, 1e-14);
  EXPECT_NEAR(g.dk[3], 1.5 * a / r2, 1e-14);
}

TEST(AttentionBackwardSeeds, IdenticalKeysGiveZeroDqButNonzeroDk) {
  Problem p = TwoByTwo();
  p.k = {1, 0, 1, 0};  // both keys equal: every row uniform whatever the query
  const Grads g = RunBackward(p);
  for (double d : g.dq) EXPECT_NEAR(d, 0.0, 1e-15);
  double dk_norm = 0;
  for (double d : g.dk) dk_norm += d * d;
  EXPECT_GT(dk_norm, 1e-2);
}

TEST(AttentionBackwardSeeds, SoftmaxBackwardExample) {
  // p = (1/4, 3/4), g_p = (0, 8): p·g_p = 6, g_s = (¼(−6), ¾(2)), which adds to 0.
  const double p[2] = {0.25, 0.75}, dp[2] = {0.0, 8.0};
  double ds[2];
  SoftmaxBackwardRow(p, dp, 2, ds);
  EXPECT_DOUBLE_EQ(ds[0], -1.5);
  EXPECT_DOUBLE_EQ(ds[1], 1.5);
  // The diagonal Jacobian entry of (1/4, 3/4) is 3/16: g_p = e_0 gives g_s[0] = p0(1 − p0).
  const double e0[2] = {1.0, 0.0};
  SoftmaxBackwardRow(p, e0, 2, ds);
  EXPECT_DOUBLE_EQ(ds[0], 3.0 / 16);
  EXPECT_DOUBLE_EQ(ds[1], -3.0 / 16);
}

TEST(AttentionBackwardSeeds, ScalarRetrievalExample) {
  // q = 1, k = (0, ln2, ln3): a = (1/6, 1/3, 1/2); v = (2,0), (0,3), (4,2): y = (7/3, 2).
  // With G = (1, 0): dJ/ds_j = a_j (v_j − y)·G = (−1/18, −7/9, 5/6).
  Problem p{1, 3, 1, 1, 1, 0, false};
  p.q = {1};
  p.k = {0, std::log(2.0), std::log(3.0)};
  p.g = {1};
  // Dh = 1 for the score; the values are 1-wide here, so take their first coordinate.
  p.v = {2, 0, 4};
  const Grads g = RunBackward(p);
  EXPECT_NEAR(g.probs[0], 1.0 / 6, 1e-15);
  EXPECT_NEAR(g.probs[2], 0.5, 1e-15);
  EXPECT_NEAR(g.dscores[0], -1.0 / 18, 1e-15);
  EXPECT_NEAR(g.dscores[1], -7.0 / 9, 1e-15);
  EXPECT_NEAR(g.dscores[2], 5.0 / 6, 1e-15);
  EXPECT_NEAR(g.dscores[0] + g.dscores[1] + g.dscores[2], 0.0, 1e-15);
}

// Random problems: every entry of dQ, dK, dV against centred differences of J.
class AttentionBackwardFd : public ::testing::TestWithParam<int> {};

TEST_P(AttentionBackwardFd, MatchesCentredDifferences) {
  std::mt19937 rng(100 + GetParam());
  std::normal_distribution<double> nd(0.0, 1.0);
  struct Shape {
    int tq, tk, h, hkv, dh, offset;
    bool causal, docs;
    double softcap = 0.0;
  };
  const Shape shapes[] = {{3, 7, 4, 2, 5, 4, true, true},
                          {5, 5, 2, 2, 3, 0, true, false},
                          {2, 6, 6, 3, 4, 0, false, true},
                          {1, 9, 4, 1, 8, 8, true, false},
                          // soft-capped scores (Gemma 2), caps that bind on N(0, 1) inputs
                          {3, 7, 4, 2, 5, 4, true, true, 0.7},
                          {4, 9, 4, 1, 8, 5, true, false, 1.5}};
  const Shape& s = shapes[GetParam()];
  Problem p{s.tq, s.tk, s.h, s.hkv, s.dh, s.offset, s.causal, s.softcap};
  auto fill = [&](std::vector<double>& x, int64_t count) {
    x.resize(count);
    for (double& e : x) e = nd(rng);
  };
  fill(p.q, int64_t{s.tq} * s.h * s.dh);
  fill(p.g, int64_t{s.tq} * s.h * s.dh);
  fill(p.k, int64_t{s.tk} * s.hkv * s.dh);
  fill(p.v, int64_t{s.tk} * s.hkv * s.dh);
  if (s.docs) {  // two documents: keys 0…2 and 3…; every query lives in document 1
    for (int j = 0; j < s.tk; ++j) p.k_doc.push_back(j < 3 ? 0 : 1);
    p.q_doc.assign(s.tq, 1);
  }
  const Grads g = RunBackward(p);
  const double h = 1e-6;
  double max_err = 0, max_val = 0;
  auto check = [&](std::vector<double> Problem::*field, const std::vector<double>& grad) {
    for (size_t e = 0; e < grad.size(); ++e) {
      Problem plus = p, minus = p;
      (plus.*field)[e] += h;
      (minus.*field)[e] -= h;
      const double fd =
          (Objective(plus, plus.q, plus.k, plus.v) - Objective(minus, minus.q, minus.k, minus.v)) /
          (2 * h);
      max_err = std::max(max_err, std::abs(fd - grad[e]));
      max_val = std::max(max_val, std::abs(fd));
    }
  };
  check(&Problem::q, g.dq);
  check(&Problem::k, g.dk);
  check(&Problem::v, g.dv);
  EXPECT_GT(max_val, 1e-2);
  EXPECT_LE(max_err, 1e-8 * std::max(1.0, max_val)) << "shape " << GetParam();
  // Masked entries carry no gradient.
  for (size_t e = 0; e < g.probs.size(); ++e) {
    if (g.probs[e] == 0.0) {
      EXPECT_EQ(g.dprobs[e], 0.0);
      EXPECT_EQ(g.dscores[e], 0.0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionBackwardFd, ::testing::Range(0, 6));

TEST(AttentionBackward, PagedKeysGiveTheSameGradients) {
  // The same keys scattered over blocks of 2 through a block table.
  Problem p = TwoByTwo();
  p.tq = 1;
  p.tk = 2;
  p.q = {0.3, -0.2};
  p.g = {1.0, -1.0};
  p.offset = 1;
  p.causal = true;
  const Grads dense = RunBackward(p);
  std::vector<double> k_paged(8, std::nan("")), v_paged(8, std::nan(""));
  // block 1 holds tokens 0, 1 at slots 0, 1
  for (int e = 0; e < 4; ++e) {
    k_paged[4 + e] = p.k[e];
    v_paged[4 + e] = p.v[e];
  }
  const int32_t table[1] = {1};
  std::vector<double> probs = dense.probs, dq(2), dk(4), dv(4);
  AttentionBackwardArgs<double> b;
  b.q = p.q.data();
  b.q_stride = 2;
  b.num_queries = 1;
  b.num_keys = 2;
  b.num_heads = 1;
  b.num_kv_heads = 1;
  b.head_dim = 2;
  b.query_offset = 1;
  b.scale = 1.0 / std::sqrt(2.0);
  b.kv = KvSource<double>{k_paged.data(), v_paged.data(), 2, table, 2};
  b.probs = probs.data();
  b.dout = p.g.data();
  b.dout_stride = 2;
  b.dq = dq.data();
  b.dk = dk.data();
  b.dv = dv.data();
  ASSERT_TRUE(AttentionBackward(b).ok());
  for (int e = 0; e < 2; ++e) EXPECT_DOUBLE_EQ(dq[e], dense.dq[e]);
  for (int e = 0; e < 4; ++e) {
    EXPECT_DOUBLE_EQ(dk[e], dense.dk[e]);
    EXPECT_DOUBLE_EQ(dv[e], dense.dv[e]);
  }
}

TEST(AttentionBackward, RejectsRowWithoutVisibleKey) {
  Problem p = TwoByTwo();
  const Grads g = RunBackward(p);
  std::vector<double> dq(4), dk(4), dv(4);
  const int32_t q_doc[2] = {0, 5}, k_doc[2] = {0, 0};
  AttentionBackwardArgs<double> b;
  b.q = p.q.data();
  b.q_stride = 2;
  b.num_queries = 2;
  b.num_keys = 2;
  b.num_heads = 1;
  b.num_kv_heads = 1;
  b.head_dim = 2;
  b.scale = 1.0;
  b.q_doc_ids = q_doc;
  b.k_doc_ids = k_doc;
  b.kv = KvSource<double>{p.k.data(), p.v.data(), 2};
  b.probs = g.probs.data();
  b.dout = p.g.data();
  b.dout_stride = 2;
  b.dq = dq.data();
  b.dk = dk.data();
  b.dv = dv.data();
  const absl::Status s = AttentionBackward(b);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("row 1"), std::string::npos) << s;
}

}  // namespace
}  // namespace kvlens::kernels
