// CpuBackend's BackwardOps (kernels/cpu/cpu_backward.cc) against the reference loops
// (double accumulation, one thread) within fp32 rounding, on shapes with GQA, documents,
// an offset, a paged cache in shuffled blocks, head sizes 64 and 80 (vector remainders)
// and partial weight panels, on 1 and 3 threads; and the seeds' 2×2 worked example by hand.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backward.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels {
namespace {

std::vector<float> Random(std::mt19937_64& rng, size_t n, double lo = -1, double hi = 1) {
  const std::vector<double> d = testing::RandomFloatExact(rng, n, lo, hi);
  return std::vector<float>(d.begin(), d.end());
}

// max |got − want| ≤ tol · (1 + max |want|), naming the tensor.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double tol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0.0, scale = 0.0;
  for (size_t e = 0; e < want.size(); ++e) {
    worst = std::max(worst, std::abs(static_cast<double>(got[e]) - want[e]));
    scale = std::max(scale, std::abs(static_cast<double>(want[e])));
  }
  EXPECT_LE(worst, tol * (1.0 + scale)) << what << ": worst " << worst << ", scale " << scale;
}

TEST(CpuBackwardTest, MatMulBackwardInputMatchesTheReference) {
  std::mt19937_64 rng(3);
  struct Shape {
    int n;
    int64_t out, in;
    DType dtype;
  };
  for (const int threads : {1, 3}) {
    CpuBackend cpu(threads);
    for (const Shape& s : {Shape{37, 300, 200, DType::kF32}, Shape{5, 64, 416, DType::kBF16},
                           Shape{17, 96, 160, DType::kQ8_0}, Shape{1, 7, 3, DType::kF32},
                           Shape{3, 40, 768, DType::kQ4_K}, Shape{20, 33, 512, DType::kQ6_K},
                           Shape{2, 9, 96, DType::kQ5_0}, Shape{4, 24, 96, DType::kIQ4_NL},
                           Shape{3, 17, 512, DType::kIQ4_XS}}) {
      SCOPED_TRACE(::testing::Message()
                   << threads << " threads, n " << s.n << ", " << s.out << " x " << s.in);
      const testing::OwnedWeight w(testing::RandomFloatExact(rng, size_t(s.out * s.in), -1, 1),
                                   s.out, s.in, s.dtype);
      std::vector<float> dy = Random(rng, size_t(s.n * s.out));
      for (size_t e = 0; e < dy.size(); e += 7) dy[e] = 0.0f;
      const std::vector<float> dx0 = Random(rng, size_t(s.n * s.in));  // accumulated into
      std::vector<float> want = dx0, got = dx0;
      MatMulBackwardInput(dy.data(), s.n, w.view(), want.data());
      ASSERT_TRUE(cpu.MatMulBackwardInput(dy.data(), s.n, w.view(), got.data()).ok());
      ExpectClose(got, want, 2e-6 * std::sqrt(static_cast<double>(s.out)), "dx");
    }
  }
}

// A forward call's arguments over a paged cache: Tq queries at an offset, GQA, documents.
struct Problem {
  int tq, tk, h, hkv, dh, off, bs = 4;
  double softcap = 0.0;  // Gemma 2's soft-capped scores
  std::vector<float> q, kc, vc, g;
  std::vector<int32_t> table, docs;
  std::vector<float> out, probs;

  AttentionArgs<float> Forward() {
    AttentionArgs<float> f;
    f.q = q.data();
    f.q_stride = int64_t{h} * dh + 5;
    f.num_queries = tq;
    f.num_keys = tk;
    f.num_heads = h;
    f.num_kv_heads = hkv;
    f.head_dim = dh;
    f.query_offset = off;
    f.scale = 1.0 / std::sqrt(static_cast<double>(dh));
    f.softcap = softcap;
    if (!docs.empty()) {
      f.q_doc_ids = docs.data() + off;
      f.k_doc_ids = docs.data();
    }
    f.kv = KvSource<float>{kc.data(), vc.data(), int64_t{hkv} * dh + 3, table.data(), bs};
    f.out = out.data();
    f.out_stride = f.q_stride;
    f.probs = probs.data();
    return f;
  }
};

Problem MakeProblem(std::mt19937_64& rng, int tq, int tk, int h, int hkv, int dh, bool docs) {
  Problem p{tq, tk, h, hkv, dh, tk - tq};
  const int64_t q_stride = int64_t{h} * dh + 5, kv_stride = int64_t{hkv} * dh + 3;
  const int blocks = (tk + p.bs - 1) / p.bs + 2;  // two blocks nobody names
  p.table.resize(static_cast<size_t>((tk + p.bs - 1) / p.bs));
  std::vector<int32_t> ids(static_cast<size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::copy_n(ids.begin(), p.table.size(), p.table.begin());
  p.q = Random(rng, size_t(tq) * q_stride, -2, 2);
  p.kc = Random(rng, size_t(blocks) * p.bs * kv_stride, -2, 2);
  p.vc = Random(rng, p.kc.size());
  p.g = Random(rng, size_t(tq) * q_stride);
  if (docs) {
    for (int t = 0; t < tk; ++t) p.docs.push_back(t < tk / 3 ? 0 : (t < tk / 2 ? 1 : 2));
  }
  p.out.assign(size_t(tq) * q_stride, 0.0f);
  p.probs.assign(size_t(h) * tq * tk, 0.0f);
  return p;
}

// The pairs of a KV head run a SIMD lane each, in tiles of two vectors, in chunks whose dK
// and dV are summed afterwards: every output and map against the double reference loops,
// and the same bits on 1 and 3 threads; GQA and MQA (one KV head: its pairs in up to 16
// chunks), documents, one row (decode), tiles with padding lanes (40 pairs: 32 + 8), head
// sizes that are and are not multiples of the vector (64, 80; 50).
TEST(CpuBackwardTest, AttentionBackwardMatchesTheReference) {
  std::mt19937_64 rng(11);
  struct Case {
    int tq, tk, h, hkv, dh;
    bool docs;
    double softcap = 0.0;
  };
  struct Out {
    std::vector<float> dq, dk, dv, da, ds;
  };
  for (const Case& c :
       {Case{9, 40, 8, 2, 64, true}, Case{40, 40, 4, 4, 80, false}, Case{1, 77, 6, 3, 64, false},
        Case{16, 100, 2, 1, 80, true}, Case{7, 30, 4, 2, 50, true}, Case{60, 70, 12, 1, 64, false},
        Case{9, 40, 8, 2, 64, true, 1.0}, Case{1, 77, 6, 3, 64, false, 0.5}}) {
    Problem p = MakeProblem(rng, c.tq, c.tk, c.h, c.hkv, c.dh, c.docs);
    p.softcap = c.softcap;
    Out first;
    for (const int threads : {1, 3}) {
      SCOPED_TRACE(::testing::Message()
                   << threads << " threads, Tq " << c.tq << ", Tk " << c.tk << ", heads " << c.h
                   << "/" << c.hkv << ", Dh " << c.dh << (c.docs ? ", documents" : "")
                   << (c.softcap > 0 ? ", soft-capped" : ""));
      CpuBackend cpu(threads);
      const AttentionArgs<float> f = p.Forward();
      ASSERT_TRUE(cpu.Attention(f).ok());
      auto run = [&](Out& r, auto&& backward) {
        r.dq.assign(size_t(c.tq) * c.h * c.dh, 7.0f);  // overwritten
        r.dk.assign(size_t(c.tk) * c.hkv * c.dh, 7.0f);
        r.dv = r.dk;
        r.da.assign(p.probs.size(), 7.0f);
        r.ds = r.da;
        AttentionBackwardArgs<float> b = BackwardArgsOf(f);
        b.dout = p.g.data();
        b.dout_stride = f.q_stride;
        b.dq = r.dq.data();
        b.dk = r.dk.data();
        b.dv = r.dv.data();
        b.dprobs = r.da.data();
        b.dscores = r.ds.data();
        return backward(b);
      };
      Out want, got;
      ASSERT_TRUE(run(want, [](const auto& b) { return AttentionBackward(b); }).ok());
      ASSERT_TRUE(run(got, [&](const auto& b) { return cpu.AttentionBackward(b); }).ok());
      ExpectClose(got.dq, want.dq, 1e-5, "dq");
      ExpectClose(got.dk, want.dk, 1e-5, "dk");
      ExpectClose(got.dv, want.dv, 1e-5, "dv");
      ExpectClose(got.da, want.da, 1e-5, "dprobs");
      ExpectClose(got.ds, want.ds, 1e-5, "dscores");
      if (threads == 1) {
        first = got;
        continue;
      }
      EXPECT_EQ(got.dq, first.dq);
      EXPECT_EQ(got.dk, first.dk);
      EXPECT_EQ(got.dv, first.dv);
      EXPECT_EQ(got.da, first.da);
      EXPECT_EQ(got.ds, first.ds);
    }
  }
}

// The seeds' 2×2 example: Q = √2·ln3·I, K = I, V = [[2,0],[0,4]], G = [[1,0],[0,2]], no
// mask. By hand: dA = G Vᵀ = [[2,0],[0,8]], dS rows [3/8, −3/8] and [−3/2, 3/2],
// dV = Aᵀ G = [[3/4, 1/2], [1/4, 3/2]], dQ = dS K/√2, dK = dSᵀ Q/√2; with both keys equal
// (K rows [1, 0] twice) every row is uniform whatever the query, so dQ = 0.
TEST(CpuBackwardTest, SeedsTwoByTwoWorkedExample) {
  CpuBackend cpu(2);
  const double r2 = std::sqrt(2.0), a = r2 * std::log(3.0);
  for (const bool identical : {false, true}) {
    SCOPED_TRACE(identical ? "identical keys" : "K = I");
    const std::vector<float> q = {static_cast<float>(a), 0, 0, static_cast<float>(a)};
    const std::vector<float> k =
        identical ? std::vector<float>{1, 0, 1, 0} : std::vector<float>{1, 0, 0, 1};
    const std::vector<float> v = {2, 0, 0, 4}, g = {1, 0, 0, 2};
    std::vector<float> out(4), probs(4), dq(4), dk(4), dv(4), da(4), ds(4);
    AttentionArgs<float> f;
    f.q = q.data();
    f.q_stride = 2;
    f.num_queries = f.num_keys = 2;
    f.num_heads = f.num_kv_heads = 1;
    f.head_dim = 2;
    f.causal = false;
    f.scale = 1.0 / r2;
    f.kv = KvSource<float>{k.data(), v.data(), 2, nullptr, 0};
    f.out = out.data();
    f.out_stride = 2;
    f.probs = probs.data();
    ASSERT_TRUE(cpu.Attention(f).ok());
    AttentionBackwardArgs<float> b = BackwardArgsOf(f);
    b.dout = g.data();
    b.dout_stride = 2;
    b.dq = dq.data();
    b.dk = dk.data();
    b.dv = dv.data();
    b.dprobs = da.data();
    b.dscores = ds.data();
    ASSERT_TRUE(cpu.AttentionBackward(b).ok());
    auto near = [](const std::vector<float>& got, const std::vector<double>& want, const char* w) {
      for (size_t e = 0; e < want.size(); ++e)
        EXPECT_NEAR(got[e], want[e], 1e-5) << w << "[" << e << "]";
    };
    if (!identical) {
      near(da, {2, 0, 0, 8}, "dA");
      near(ds, {3.0 / 8, -3.0 / 8, -1.5, 1.5}, "dS");
      near(dv, {0.75, 0.5, 0.25, 1.5}, "dV");
      near(dq, {3.0 / 8 / r2, -3.0 / 8 / r2, -1.5 / r2, 1.5 / r2}, "dQ");
      near(dk, {3.0 / 8 * a / r2, -1.5 * a / r2, -3.0 / 8 * a / r2, 1.5 * a / r2}, "dK");
    } else {
      near(probs, {0.5, 0.5, 0.5, 0.5}, "A");
      near(dq, {0, 0, 0, 0}, "dQ");
    }
  }
}

}  // namespace
}  // namespace kvlens::kernels
