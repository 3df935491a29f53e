// CpuBackend (fp32, threaded, SIMD) against the double ReferenceBackend on random shapes.
// Both see the same float-exact inputs; tolerances scale with the magnitudes involved.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numbers>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/kernels/cpu/attention_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels {
namespace {

using testing::AttnProblem;
using testing::AttnResult;
using testing::OwnedWeight;

TEST(CpuBackendTest, ReportsItsConfiguration) {
  CpuBackend cpu(3);
  EXPECT_EQ(cpu.num_threads(), 3);
  EXPECT_EQ(cpu.name(), "cpu-f32");
  const std::string simd(CpuBackend::SimdName());
  EXPECT_TRUE(simd == "avx512" || simd == "avx2" || simd == "scalar") << simd;
}

// y = x·Wᵀ + b in fp32 vs double. Error bound per output: c · eps32 · Σ|x_i||w_i| (+ |b|).
TEST(CpuBackendTest, MatMulMatchesReferenceForEveryDtypeAndBatch) {
  std::mt19937_64 rng(21);
  ReferenceBackend ref;
  struct Shape {
    int in, out;
  };
  for (int threads : {1, 3}) {
    CpuBackend cpu(threads);
    for (DType dt : testing::kAllDTypes) {
      for (Shape s : {Shape{64, 37}, Shape{96, 130}, Shape{288, 9}, Shape{32, 1}}) {
        if (!DTypeIsBlockQuantized(dt)) s.in += 5;  // odd widths exercise the SIMD tails
        // k-quants: 512, 768, 2304 (4.5 slices of 512) and 256 inputs
        if (DTypeBlockSize(dt) == 256) s.in *= 8;
        const OwnedWeight w(testing::RandomVector(rng, static_cast<size_t>(s.in) * s.out), s.out,
                            s.in, dt);
        const OwnedWeight bias(testing::RandomVector(rng, s.out), 1, s.out,
                               DTypeIsBlockQuantized(dt) ? DType::kF16 : dt);
        for (int n : {1, 2, 5, 64, 71}) {
          const std::vector<double> x =
              testing::RandomFloatExact(rng, static_cast<size_t>(n) * s.in);
          const std::vector<float> xf = testing::Cast<float>(x);
          for (bool with_bias : {false, true}) {
            const WeightView b = with_bias ? bias.view() : WeightView{};
            std::vector<double> y_ref(static_cast<size_t>(n) * s.out);
            std::vector<float> y(y_ref.size(), std::nanf(""));
            ref.MatMul(x.data(), n, w.view(), b, y_ref.data());
            cpu.MatMul(xf.data(), n, w.view(), b, y.data());
            const std::vector<double>& wv = w.values();
            for (int r = 0; r < n; ++r) {
              for (int o = 0; o < s.out; ++o) {
                double mag = with_bias ? std::abs(bias.values()[o]) : 0.0;
                for (int i = 0; i < s.in; ++i) mag += std::abs(x[r * s.in + i] * wv[o * s.in + i]);
                ASSERT_NEAR(y[r * s.out + o], y_ref[r * s.out + o], 4e-7 * mag + 1e-30)
                    << DTypeName(dt) << " in=" << s.in << " out=" << s.out << " n=" << n
                    << " r=" << r << " o=" << o << " threads=" << threads;
              }
            }
          }
        }
      }
    }
  }
}

// A row's outputs are the same bits whatever else is in the batch (docs/architecture.md:
// batching never changes results): from 16 rows on MatMul vectorises the dot products
// across rows rather than along k, and must round exactly as the one-row path does. Rows
// of batches that fill a packed group's two vectors, one vector and part of one, over
// widths with one, two and three slices of 512 inputs (the last with a remainder of 12),
// every dtype, a bias, 1 and 3 threads, against each row multiplied alone.
TEST(CpuBackendTest, MatMulGivesARowTheSameBitsInAnyBatch) {
  std::mt19937_64 rng(22);
  for (int threads : {1, 3}) {
    CpuBackend cpu(threads);
    for (DType dt : testing::kAllDTypes) {
      for (int in : {96, 544, 1100}) {
        if (DTypeBlockSize(dt) == 32) in = in / 32 * 32;
        if (DTypeBlockSize(dt) == 256) in = in == 96 ? 256 : in == 544 ? 1280 : 2560;
        const int out = 50;  // past the tiles of 6 and 12 weight rows
        const OwnedWeight w(testing::RandomVector(rng, static_cast<size_t>(in) * out), out, in, dt);
        const OwnedWeight bias(testing::RandomVector(rng, out), 1, out, DType::kF32);
        for (int n : {16, 20, 37, 70}) {
          const std::vector<float> x =
              testing::Cast<float>(testing::RandomFloatExact(rng, static_cast<size_t>(n) * in));
          std::vector<float> batch(static_cast<size_t>(n) * out, std::nanf(""));
          cpu.MatMul(x.data(), n, w.view(), bias.view(), batch.data());
          for (int r = 0; r < n; ++r) {
            std::vector<float> alone(out, std::nanf(""));
            cpu.MatMul(x.data() + static_cast<size_t>(r) * in, 1, w.view(), bias.view(),
                       alone.data());
            for (int o = 0; o < out; ++o) {
              ASSERT_EQ(std::bit_cast<uint32_t>(batch[r * out + o]),
                        std::bit_cast<uint32_t>(alone[o]))
                  << DTypeName(dt) << " in=" << in << " n=" << n << " r=" << r << " o=" << o
                  << " threads=" << threads << ": " << batch[r * out + o] << " vs " << alone[o];
            }
          }
        }
      }
    }
  }
}

// The reference's own input (double) is the float-exact copy, so the only differences are
// fp32 rounding inside CpuBackend.
void ExpectNearRelative(const std::vector<float>& got, const std::vector<double>& want, double rel,
                        const std::string& what) {
  const double scale = std::max(testing::MaxAbs(want), 1e-30);
  for (size_t e = 0; e < want.size(); ++e) {
    ASSERT_NEAR(got[e], want[e], rel * scale) << what << " at " << e;
  }
}

TEST(CpuBackendTest, ElementwiseAndNormOpsMatchReference) {
  std::mt19937_64 rng(22);
  ReferenceBackend ref;
  CpuBackend cpu(3);
  constexpr int kN = 7, kD = 301;
  const std::vector<double> x = testing::RandomFloatExact(rng, kN * kD, -3, 3);
  const std::vector<double> x2 = testing::RandomFloatExact(rng, kN * kD, -3, 3);
  const std::vector<float> xf = testing::Cast<float>(x), x2f = testing::Cast<float>(x2);
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    const OwnedWeight g(testing::RandomVector(rng, kD, 0.5, 1.5), 1, kD, dt);
    const OwnedWeight b(testing::RandomVector(rng, kD), 1, kD, dt);
    std::vector<double> yr(kN * kD);
    std::vector<float> y(kN * kD);
    ref.RmsNorm(x.data(), kN, kD, g.view(), 1e-5, yr.data());
    cpu.RmsNorm(xf.data(), kN, kD, g.view(), 1e-5, y.data());
    ExpectNearRelative(y, yr, 2e-6, "rmsnorm");
    ref.LayerNorm(x.data(), kN, kD, g.view(), b.view(), 1e-5, yr.data());
    cpu.LayerNorm(xf.data(), kN, kD, g.view(), b.view(), 1e-5, y.data());
    ExpectNearRelative(y, yr, 2e-6, "layernorm");
  }
  {
    std::vector<double> yr = x;
    std::vector<float> y = xf;
    ref.Gelu(yr.data(), kN * kD);
    cpu.Gelu(y.data(), kN * kD);
    ExpectNearRelative(y, yr, 1e-6, "gelu");
  }
  {
    std::vector<double> yr(kN * kD);
    std::vector<float> y(kN * kD);
    ref.SwiGlu(x.data(), x2.data(), kN * kD, yr.data());
    cpu.SwiGlu(xf.data(), x2f.data(), kN * kD, y.data());
    ExpectNearRelative(y, yr, 1e-6, "swiglu");
  }
  {
    // Large enough to be split over the pool.
    const std::vector<double> big = testing::RandomFloatExact(rng, 300000);
    std::vector<double> yr(big.size(), 1.5);
    std::vector<float> y(big.size(), 1.5f);
    const std::vector<float> bigf = testing::Cast<float>(big);
    ref.Add(yr.data(), big.data(), static_cast<int64_t>(big.size()));
    cpu.Add(y.data(), bigf.data(), static_cast<int64_t>(big.size()));
    ExpectNearRelative(y, yr, 1e-7, "add");
    ref.Gelu(yr.data(), static_cast<int64_t>(yr.size()));
    cpu.Gelu(y.data(), static_cast<int64_t>(y.size()));
    ExpectNearRelative(y, yr, 1e-6, "gelu large");
  }
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalfSplit}) {
    // Positions up to 10⁵: angles must be formed in double.
    constexpr int kHeads = 3, kDh = 64, kStride = kHeads * kDh + 5;
    const int32_t pos[4] = {0, 17, 4095, 100000};
    const std::vector<double> q = testing::RandomFloatExact(rng, 4 * kStride);
    // Llama 3.1-like factors: 1 for the high frequencies, up to 8 for the low ones.
    std::vector<float> factors(kDh / 2);
    for (int p = 0; p < kDh / 2; ++p) factors[p] = 1.0f + 7.0f * p / (kDh / 2 - 1);
    const float* const factor_sets[] = {nullptr, factors.data()};
    for (const float* f : factor_sets) {
      std::vector<double> qr = q;
      std::vector<float> qf = testing::Cast<float>(q);
      ref.Rope(qr.data(), 4, kStride, kHeads, kDh, pos, RopeSpec{500000.0, style, f});
      cpu.Rope(qf.data(), 4, kStride, kHeads, kDh, pos, RopeSpec{500000.0, style, f});
      ExpectNearRelative(qf, qr, 2e-6, "rope");
    }
  }
  for (DType dt : testing::kAllDTypes) {
    const int64_t cols = testing::BlockCols(dt, 64);
    const OwnedWeight table(testing::RandomVector(rng, 50 * cols), 50, cols, dt);
    const int32_t ids[5] = {49, 0, 7, 7, 23};
    std::vector<double> er(5 * cols);
    std::vector<float> e(5 * cols);
    ref.Embedding(table.view(), ids, 5, er.data());
    cpu.Embedding(table.view(), ids, 5, e.data());
    for (size_t i = 0; i < e.size(); ++i) ASSERT_EQ(e[i], er[i]) << DTypeName(dt);
  }
}

// Copies p's contiguous K/V into a paged cache (elements of type cache_dtype) through a
// shuffled block table, with three spare blocks, padded rows, and NaN in every slot no
// token owns; then runs attention through the block table.
template <typename B>
AttnResult RunPaged(B& backend, const AttnProblem& p, int block_size, std::mt19937_64& rng,
                    KvDtype cache_dtype = KvDtype::kActivation, bool maps = true) {
  using T = decltype(testing::ScalarOf(static_cast<B*>(nullptr)));
  const int num_blocks = (p.tk + block_size - 1) / block_size;
  const int physical_blocks = num_blocks + 3;
  std::vector<int32_t> all(physical_blocks);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  const std::vector<int32_t> table(all.begin(), all.begin() + num_blocks);
  const int64_t row_elems = static_cast<int64_t>(p.kv_heads) * p.dh;
  const int64_t cache_stride = row_elems + 3;
  const size_t cache_elems = static_cast<size_t>(physical_blocks) * block_size * cache_stride;
  // All-ones bytes: NaN in T and in bf16.
  std::vector<unsigned char> k_cache(cache_elems * KvElementBytes<T>(cache_dtype), 0xFF);
  std::vector<unsigned char> v_cache(k_cache.size(), 0xFF);
  KvSource<T> kv;
  kv.row_stride = cache_stride;
  kv.block_table = table.data();
  kv.block_size = block_size;
  kv.dtype = cache_dtype;
  std::vector<int64_t> dst(p.tk);
  for (int t = 0; t < p.tk; ++t) dst[t] = kv.PhysicalRow(t);
  const std::vector<T> k = testing::Cast<T>(p.k), v = testing::Cast<T>(p.v);
  backend.StoreKv(k.data(), v.data(), p.tk, row_elems, row_elems, dst.data(), k_cache.data(),
                  v_cache.data(), cache_stride, cache_dtype);
  kv.k = k_cache.data();
  kv.v = v_cache.data();

  const std::vector<T> q = testing::Cast<T>(p.q);
  const int64_t q_stride = static_cast<int64_t>(p.heads) * p.dh + 2;  // padded rows
  std::vector<T> q_padded(static_cast<size_t>(p.tq) * q_stride,
                          std::numeric_limits<T>::quiet_NaN());
  for (int i = 0; i < p.tq; ++i) {
    std::copy(q.begin() + i * p.heads * p.dh, q.begin() + (i + 1) * p.heads * p.dh,
              q_padded.begin() + i * q_stride);
  }
  std::vector<T> out(static_cast<size_t>(p.tq) * q_stride, static_cast<T>(testing::kUntouched));
  std::vector<T> probs(static_cast<size_t>(p.heads) * p.tq * p.tk), scores(probs.size());
  AttentionArgs<T> a =
      testing::ContiguousArgs<T>(p, q_padded.data(), nullptr, nullptr, out.data(),
                                 maps ? probs.data() : nullptr, maps ? scores.data() : nullptr);
  a.q_stride = q_stride;  // padded rows, and the cache through its block table
  a.out_stride = q_stride;
  a.kv = kv;
  AttnResult r;
  r.status = backend.Attention(a);
  for (int i = 0; i < p.tq; ++i) {
    for (int e = 0; e < p.heads * p.dh; ++e) r.out.push_back(out[i * q_stride + e]);
    EXPECT_EQ(out[i * q_stride + p.heads * p.dh], static_cast<T>(testing::kUntouched));
  }
  r.probs = testing::ToDouble(probs);
  r.scores = testing::ToDouble(scores);
  return r;
}

struct AttnConfig {
  int tq, tk, heads, kv_heads, dh, offset;
  bool causal, docs;
  int window = 0;
  double softcap = 0.0;
  std::string Name() const {
    return absl::StrCat("tq=", tq, " tk=", tk, " H=", heads, " Hkv=", kv_heads, " Dh=", dh,
                        " off=", offset, causal ? " causal" : "", docs ? " docs" : "",
                        window > 0 ? absl::StrCat(" window=", window) : "",
                        softcap > 0 ? absl::StrCat(" softcap=", softcap) : "");
  }
};

AttnProblem MakeProblem(const AttnConfig& c, std::mt19937_64& rng) {
  AttnProblem p;
  p.tq = c.tq;
  p.tk = c.tk;
  p.heads = c.heads;
  p.kv_heads = c.kv_heads;
  p.dh = c.dh;
  p.offset = c.offset;
  p.causal = c.causal;
  p.window = c.window;
  p.softcap = c.softcap;
  p.scale = 1.0 / std::sqrt(static_cast<double>(c.dh));
  p.q = testing::RandomFloatExact(rng, static_cast<size_t>(c.tq) * c.heads * c.dh, -2, 2);
  p.k = testing::RandomFloatExact(rng, static_cast<size_t>(c.tk) * c.kv_heads * c.dh, -2, 2);
  p.v = testing::RandomFloatExact(rng, static_cast<size_t>(c.tk) * c.kv_heads * c.dh, -3, 3);
  if (c.docs) {
    // Documents of random lengths, packed; each query takes its position's document.
    std::vector<int32_t> doc_of(c.offset + c.tq + c.tk);
    int32_t doc = 100;
    for (size_t t = 0; t < doc_of.size(); ++t) {
      if (t > 0 && rng() % 5 == 0) ++doc;
      doc_of[t] = doc;
    }
    p.k_doc.assign(doc_of.begin(), doc_of.begin() + c.tk);
    for (int i = 0; i < c.tq; ++i) p.q_doc.push_back(doc_of[c.offset + i]);
  }
  return p;
}

void ExpectAttentionClose(const AttnProblem& p, const AttnResult& got, const AttnResult& want,
                          const std::string& what) {
  ASSERT_TRUE(want.status.ok()) << want.status;
  ASSERT_TRUE(got.status.ok()) << got.status << " " << what;
  const double v_scale = testing::MaxAbs(p.v);
  for (size_t e = 0; e < want.out.size(); ++e) {
    ASSERT_NEAR(got.out[e], want.out[e], 2e-5 * v_scale) << what << " out " << e;
  }
  // Scores: |S| ≤ scale · Σ|q||k| ≈ scale · 4 · Dh at worst.
  const double s_tol = 1e-6 * p.scale * 4 * p.dh;
  for (size_t e = 0; e < want.probs.size(); ++e) {
    ASSERT_NEAR(got.probs[e], want.probs[e], 2e-5) << what << " probs " << e;
    if (std::isinf(want.scores[e])) {
      ASSERT_EQ(got.scores[e], want.scores[e]) << what << " scores " << e;
      ASSERT_EQ(got.probs[e], 0.0) << what << " probs " << e;
    } else {
      ASSERT_NEAR(got.scores[e], want.scores[e], s_tol) << what << " scores " << e;
    }
  }
}

// GELU and SwiGLU form their exponentials in float (kernels/fast_exp.h), not by libm:
// floats from −20 to 20 on a 1e-4 grid, and the edges (±0, tiny, huge), within
// 2e-7 · max(1, |x|) of the double formula (as libm's tanhf and expf would be);
// from ±9 (GELU) and ±88 (SiLU) on the results are the asymptotes, x or 0, exactly.
TEST(CpuBackendTest, GeluAndSiluAreWithinAFewUlpsOfTheFormula) {
  std::vector<float> x;
  for (int i = -200000; i <= 200000; ++i) x.push_back(static_cast<float>(i) * 1e-4f);
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, 1e-7f, -1e-7f, 30.0f, -30.0f, 87.0f, -87.0f, 88.0f,
                  -88.0f, 1e4f, -1e4f, 3e38f, -3e38f}) {
    x.push_back(v);
  }
  const int64_t n = static_cast<int64_t>(x.size());
  CpuBackend cpu(2);
  std::vector<float> gelu = x;
  cpu.Gelu(gelu.data(), n);
  std::vector<float> ones(x.size(), 1.0f), silu(x.size());
  cpu.SwiGlu(x.data(), ones.data(), n, silu.data());
  const double c = std::sqrt(2.0 / std::numbers::pi);
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    const double tol = 2e-7 * std::max(1.0, std::abs(v));
    const double want_gelu = 0.5 * v * (1.0 + std::tanh(c * (v + 0.044715 * v * v * v)));
    const double want_silu = v / (1.0 + std::exp(-v));
    ASSERT_NEAR(gelu[i], want_gelu, tol) << "gelu(" << v << ")";
    ASSERT_NEAR(silu[i], want_silu, tol) << "silu(" << v << ")";
    if (std::abs(v) >= 9.0) {
      EXPECT_EQ(gelu[i], v > 0 ? v : 0.0) << "gelu(" << v << ")";
    }
    if (std::abs(v) >= 88.0) {
      EXPECT_EQ(silu[i], v > 0 ? v : 0.0) << "silu(" << v << ")";
    }
  }
}

TEST(CpuBackendTest, AttentionMatchesReferenceContiguousAndPaged) {
  std::mt19937_64 rng(23);
  ReferenceBackend ref;
  CpuBackend cpu(3);
  const std::vector<AttnConfig> configs = {
      {1, 1, 1, 1, 8, 0, true, false},        // a single token
      {7, 7, 4, 4, 16, 0, true, false},       // causal prefill, MHA
      {13, 13, 8, 4, 32, 0, true, false},     // GQA 8/4
      {9, 9, 8, 1, 64, 0, true, false},       // MQA 8/1
      {5, 23, 6, 3, 40, 0, false, false},     // cross-attention shape, Tq ≠ Tk
      {23, 5, 2, 2, 24, 0, false, false},     // more queries than keys
      {1, 50, 8, 2, 128, 49, true, false},    // decode with an offset
      {6, 41, 4, 2, 128, 35, true, false},    // chunked prefill with an offset
      {20, 20, 4, 2, 16, 0, true, true},      // packed documents
      {7, 30, 4, 4, 8, 23, true, true},       // documents and offset
      {11, 11, 2, 1, 8, 0, false, true},      // documents without causality
      {3, 300, 16, 8, 72, 297, true, false},  // a longer history, odd head size
      // Sliding windows: decode over split keys whose first spans are all outside it, a
      // chunk (across pairs), a prefill with documents, a window that ends mid-span.
      {1, 700, 8, 2, 64, 699, true, false, 300},
      {6, 41, 4, 2, 128, 35, true, false, 10},
      {20, 20, 4, 2, 16, 0, true, true, 5},
      {24, 24, 4, 4, 48, 0, true, false, 7},
      {3, 600, 16, 8, 72, 597, true, false, 257},
      // Gemma 2's soft-capped scores (cap 1.5, which binds on these): a chunk across pairs,
      // a few rows of a group (narrow), a decode over split keys, with documents.
      {13, 40, 8, 4, 32, 27, true, false, 0, 1.5},
      {2, 30, 4, 2, 64, 28, true, false, 0, 1.5},
      {1, 700, 8, 2, 64, 699, true, false, 0, 1.5},
      {20, 20, 4, 2, 16, 0, true, true, 5, 1.5},
  };
  for (const AttnConfig& c : configs) {
    const AttnProblem p = MakeProblem(c, rng);
    const AttnResult want = testing::RunAttention(ref, p);
    ExpectAttentionClose(p, testing::RunAttention(cpu, p), want, c.Name());
    for (int block_size : {1, 16, 7}) {
      const std::string what = c.Name() + absl::StrCat(" block_size=", block_size);
      // The reference through a block table reads exactly the same numbers.
      const AttnResult ref_paged = RunPaged(ref, p, block_size, rng);
      ASSERT_TRUE(ref_paged.status.ok()) << what;
      for (size_t e = 0; e < want.out.size(); ++e) ASSERT_EQ(ref_paged.out[e], want.out[e]) << what;
      ExpectAttentionClose(p, RunPaged(cpu, p, block_size, rng), want, what);
    }
  }
}

// x rounded to the nearest bf16 (8 significant bits), ties to even: x / ulp rounded by
// nearbyint in the default rounding mode, for normal x. Independent of kernels/dtype.h's
// bit manipulation.
double RoundToBf16(double x) {
  if (x == 0.0) return x;
  const double ulp = std::ldexp(1.0, std::ilogb(x) - 7);
  return std::nearbyint(x / ulp) * ulp;
}

// On a bf16 cache, attention sees each key and value rounded to bf16 once, as it was
// stored: the reference through the block table equals the reference on the rounded K and V
// exactly, and the fast backend is as close to it as on a float cache.
TEST(CpuBackendTest, AttentionOnABf16CacheReadsTheRoundedValues) {
  std::mt19937_64 rng(29);
  ReferenceBackend ref;
  CpuBackend cpu(3);
  const std::vector<AttnConfig> configs = {
      {7, 7, 4, 4, 16, 0, true, false},      {13, 13, 8, 4, 32, 0, true, false},
      {1, 50, 8, 2, 128, 49, true, false},   {7, 30, 4, 4, 8, 23, true, true},
      {3, 300, 16, 8, 72, 297, true, false},
  };
  for (const AttnConfig& c : configs) {
    const AttnProblem p = MakeProblem(c, rng);
    AttnProblem rounded = p;
    for (std::vector<double>* kv : {&rounded.k, &rounded.v}) {
      for (double& x : *kv) x = RoundToBf16(x);
    }
    ASSERT_NE(rounded.k, p.k) << "float inputs that bf16 holds exactly test nothing";
    const AttnResult want = testing::RunAttention(ref, rounded);
    for (int block_size : {1, 16, 7}) {
      const std::string what = c.Name() + absl::StrCat(" block_size=", block_size, " bf16");
      const AttnResult ref_paged = RunPaged(ref, p, block_size, rng, KvDtype::kBF16);
      ASSERT_TRUE(ref_paged.status.ok()) << what;
      for (size_t e = 0; e < want.out.size(); ++e) ASSERT_EQ(ref_paged.out[e], want.out[e]) << what;
      ExpectAttentionClose(rounded, RunPaged(cpu, p, block_size, rng, KvDtype::kBF16), want, what);
    }
  }
}

// Calls of at least a vector's width of (row, head) pairs run across the pairs, one a SIMD
// lane (AttendAcrossPairs): the reference's outputs, probabilities and scores with GQA and
// MQA, documents (causal and not), offsets, head sizes past and short of the 6-dim value
// tiles (50, 72), pair counts that leave padding lanes, contiguous and paged (block size 7)
// fp32 caches and a bf16 cache; the same bits on 1, 2 and 3 threads, whose tiles differ
// (a row's lane never depends on the other rows of its tile); and, for the causal calls
// without documents, the same bits as the last row computed alone (a call of fewer pairs
// than a vector takes the narrow tiles, AttendNarrow, which must round identically).
TEST(CpuBackendTest, AttentionAcrossPairsMatchesReferenceOnAnyTiling) {
  std::mt19937_64 rng(37);
  ReferenceBackend ref;
  const std::vector<AttnConfig> configs = {
      {40, 40, 4, 2, 64, 0, true, false},   // 80 pairs, GQA 4/2
      {37, 60, 8, 2, 50, 23, true, true},   // documents and offset, head size 50
      {64, 64, 2, 2, 128, 0, false, true},  // documents without causality
      {33, 33, 16, 1, 72, 0, true, false},  // MQA 16/1, head size 72
      {16, 16, 1, 1, 8, 0, true, false},    // exactly one vector of pairs
  };
  for (const AttnConfig& c : configs) {
    const AttnProblem p = MakeProblem(c, rng);
    AttnProblem rounded = p;
    for (std::vector<double>* kv : {&rounded.k, &rounded.v}) {
      for (double& x : *kv) x = RoundToBf16(x);
    }
    const AttnResult want = testing::RunAttention(ref, p);
    const AttnResult want_bf16 = testing::RunAttention(ref, rounded);
    if (c.causal && !c.docs && c.tq == c.tk && c.heads / c.kv_heads < 16) {
      AttnProblem last = p;  // the last row alone, at its offset
      last.tq = 1;
      last.offset = c.tq - 1;
      last.q.assign(p.q.end() - int64_t{c.heads} * c.dh, p.q.end());
      CpuBackend cpu(2);
      const AttnResult alone = testing::RunAttention(cpu, last);
      const AttnResult whole = testing::RunAttention(cpu, p);
      for (int h = 0; h < c.heads; ++h) {
        for (int d = 0; d < c.dh; ++d) {
          ASSERT_EQ(alone.O(0, h, d, last), whole.O(c.tq - 1, h, d, p)) << c.Name() << " h=" << h;
        }
        for (int j = 0; j < c.tk; ++j) {
          ASSERT_EQ(alone.P(h, 0, j, last), whole.P(h, c.tq - 1, j, p)) << c.Name() << " h=" << h;
        }
      }
    }
    AttnResult first;
    for (int threads : {1, 2, 3}) {
      CpuBackend cpu(threads);
      const std::string what = c.Name() + absl::StrCat(" threads=", threads);
      const AttnResult got = testing::RunAttention(cpu, p);
      ExpectAttentionClose(p, got, want, what);
      ExpectAttentionClose(p, RunPaged(cpu, p, 7, rng), want, what + " block_size=7");
      ExpectAttentionClose(rounded, RunPaged(cpu, p, 7, rng, KvDtype::kBF16), want_bf16,
                           what + " bf16");
      if (threads == 1) {
        first = got;
        continue;
      }
      for (size_t e = 0; e < got.out.size(); ++e) {
        ASSERT_EQ(got.out[e], first.out[e]) << what << " out " << e;
      }
      for (size_t e = 0; e < got.probs.size(); ++e) {
        ASSERT_EQ(got.probs[e], first.probs[e]) << what << " probs " << e;
        ASSERT_EQ(got.scores[e], first.scores[e]) << what << " scores " << e;
      }
    }
  }
}

// A call of fewer pairs than the lanes (a decode row, a few rows of a small group) takes
// the narrow tiles (AttendNarrow: one pair at a time, its keys kLanes at a time, several
// KV heads a task): each row alone and each chunk of three rows, at their offsets, gives
// every pair the bits the whole call gave it (across the pairs where it fills the lanes),
// on 1 and 3 threads, fp32 and bf16 paged caches with maps; the whole call within
// tolerance of the double reference. Head sizes with and without a remainder of the
// lanes (8 to 128), documents, non-causal, MHA (80 heads: more pairs a task than one run
// of them takes), GQA and MQA, and more keys than a block of values.
TEST(CpuBackendTest, AttentionOfFewPairsGivesEachPairTheBitsOfTheWholeCall) {
  std::mt19937_64 rng(43);
  ReferenceBackend ref;
  const std::vector<AttnConfig> configs = {
      {24, 60, 6, 6, 32, 36, true, false},     // the default model's heads
      {20, 45, 12, 4, 72, 25, true, true},     // GQA 12/4 with documents, head size 72
      {16, 40, 4, 4, 50, 24, false, true},     // documents without causality, head size 50
      {18, 300, 2, 1, 128, 282, true, false},  // MQA 2/1 over 300 keys
      {16, 20, 80, 80, 8, 4, true, false},     // 80 heads of 8
  };
  for (const AttnConfig& c : configs) {
    const AttnProblem p = MakeProblem(c, rng);
    CpuBackend two(2);
    const AttnResult whole = RunPaged(two, p, 7, rng);
    ExpectAttentionClose(p, whole, testing::RunAttention(ref, p), c.Name());
    const AttnResult whole_bf16 = RunPaged(two, p, 7, rng, KvDtype::kBF16);
    ASSERT_TRUE(whole_bf16.status.ok()) << c.Name();
    for (int rows : {1, 3}) {
      for (int i0 = 0; i0 < c.tq; i0 += rows) {
        AttnProblem part = p;  // rows i0 … i0 + n − 1 alone, at their offset
        const int n = std::min(rows, c.tq - i0);
        part.tq = n;
        part.offset = p.offset + i0;
        const int64_t row = int64_t{c.heads} * c.dh;
        part.q.assign(p.q.begin() + i0 * row, p.q.begin() + (i0 + n) * row);
        if (c.docs) part.q_doc.assign(p.q_doc.begin() + i0, p.q_doc.begin() + i0 + n);
        for (int threads : {1, 3}) {
          CpuBackend cpu(threads);
          const std::string what =
              absl::StrCat(c.Name(), " rows ", i0, "+", n, " threads=", threads);
          for (const KvDtype dtype : {KvDtype::kActivation, KvDtype::kBF16}) {
            const AttnResult& want = dtype == KvDtype::kBF16 ? whole_bf16 : whole;
            const AttnResult got = RunPaged(cpu, part, 5, rng, dtype);
            ASSERT_TRUE(got.status.ok()) << what;
            for (int i = 0; i < n; ++i) {
              for (int h = 0; h < c.heads; ++h) {
                for (int d = 0; d < c.dh; ++d) {
                  ASSERT_EQ(got.O(i, h, d, part), want.O(i0 + i, h, d, p)) << what << " h=" << h;
                }
                for (int j = 0; j < c.tk; ++j) {
                  ASSERT_EQ(got.P(h, i, j, part), want.P(h, i0 + i, j, p)) << what << " h=" << h;
                  ASSERT_EQ(got.S(h, i, j, part), want.S(h, i0 + i, j, p)) << what << " h=" << h;
                }
              }
            }
          }
        }
      }
    }
  }
}

// A sliding window's tiled calls read only the keys from the earliest row's window on
// (TiledKeyBegin; with b that key, every key before b has weight 0 for every row). So each
// call gives the very bits of the same call over keys b … alone (the cache's rows from b,
// the offset b less): outputs, and maps whose keys before b are −∞ (scores) and 0
// (probabilities), as the mask makes them; with and without maps; within tolerance of the
// reference too. fp32 and bf16 paged caches, 1 and 3 threads: prefill chunks across the
// pairs (most keys before the window, or windows ending mid-chunk), narrow calls (a few
// rows of GQA 4/2, a decode row) over keys far past the window, documents.
TEST(CpuBackendTest, SlidingWindowGivesTheBitsOfTheCallOverItsKeysAlone) {
  std::mt19937_64 rng(47);
  ReferenceBackend ref;
  const std::vector<AttnConfig> configs = {
      {40, 240, 4, 2, 64, 200, true, false, 30},  // a chunk across the pairs, 171 keys before
      {24, 24, 4, 4, 48, 0, true, false, 7},      // a prefill, windows ending mid-chunk
      {20, 60, 8, 4, 64, 40, true, true, 9},      // with documents
      {2, 300, 4, 2, 72, 298, true, false, 50},   // narrow: 4 pairs a KV head, head size 72
      {1, 200, 6, 6, 32, 199, true, false, 20},   // a decode row (tiled: short context)
  };
  for (const AttnConfig& c : configs) {
    const AttnProblem p = MakeProblem(c, rng);
    const int b = std::max(0, c.offset - c.window + 1);
    AttnProblem alone = p;  // keys b … only
    alone.tk = c.tk - b;
    alone.offset = c.offset - b;
    const int64_t row = int64_t{c.kv_heads} * c.dh;
    alone.k.assign(p.k.begin() + b * row, p.k.end());
    alone.v.assign(p.v.begin() + b * row, p.v.end());
    if (c.docs) alone.k_doc.assign(p.k_doc.begin() + b, p.k_doc.end());
    const AttnResult want = testing::RunAttention(ref, p);
    ASSERT_TRUE(want.status.ok()) << c.Name();
    const double v_scale = testing::MaxAbs(p.v);
    for (int threads : {1, 3}) {
      CpuBackend cpu(threads);
      for (const KvDtype dtype : {KvDtype::kActivation, KvDtype::kBF16}) {
        const std::string what = absl::StrCat(c.Name(), " threads=", threads,
                                              dtype == KvDtype::kBF16 ? " bf16" : " fp32");
        const AttnResult got = RunPaged(cpu, p, 7, rng, dtype, true);
        const AttnResult got_alone = RunPaged(cpu, alone, 7, rng, dtype, true);
        const AttnResult no_maps = RunPaged(cpu, p, 7, rng, dtype, false);
        ASSERT_TRUE(got.status.ok()) << what << " " << got.status;
        ASSERT_TRUE(got_alone.status.ok()) << what << " " << got_alone.status;
        ASSERT_TRUE(no_maps.status.ok()) << what << " " << no_maps.status;
        // A bf16 cache rounds K and V: 8 significant bits, 2^-8 relative.
        const double tol = (dtype == KvDtype::kBF16 ? 1e-2 : 2e-5) * v_scale;
        for (size_t e = 0; e < want.out.size(); ++e) {
          ASSERT_NEAR(got.out[e], want.out[e], tol) << what << " out " << e;
          ASSERT_EQ(got.out[e], got_alone.out[e]) << what << " out " << e;
          ASSERT_EQ(no_maps.out[e], got.out[e]) << what << " out " << e;
        }
        for (int h = 0; h < c.heads; ++h) {
          for (int i = 0; i < c.tq; ++i) {
            for (int j = 0; j < c.tk; ++j) {
              const std::string at = absl::StrCat(what, " h=", h, " i=", i, " j=", j);
              if (j < b) {
                ASSERT_EQ(got.P(h, i, j, p), 0.0) << at;
                ASSERT_EQ(got.S(h, i, j, p), -std::numeric_limits<double>::infinity()) << at;
              } else {
                ASSERT_EQ(got.P(h, i, j, p), got_alone.P(h, i, j - b, alone)) << at;
                ASSERT_EQ(got.S(h, i, j, p), got_alone.S(h, i, j - b, alone)) << at;
              }
            }
          }
        }
      }
    }
  }
}

// AttentionBatch runs the tiled calls' tasks in one ParallelFor (and a call that splits its
// keys on its own): every output the same bits as the calls made one by one, decode rows
// over short and long (split) contexts, a prefill chunk with documents, GQA and MHA, with
// and without maps. A call that fails its checks (here a row that sees no key) stops the
// batch there: the calls before it have run, *failed names it, and the calls after it are
// untouched.
TEST(CpuBackendTest, AttentionBatchEqualsTheCallsOneByOne) {
  std::mt19937_64 rng(41);
  const std::vector<AttnConfig> configs = {
      {1, 40, 6, 6, 32, 39, true, false},         // decode, MHA, short context
      {1, 700, 8, 2, 64, 699, true, false},       // decode over a long context: split keys
      {20, 50, 8, 4, 64, 30, true, true},         // a chunk with documents and an offset
      {2, 33, 4, 1, 16, 31, true, false},         // two rows, MQA
      {24, 24, 4, 4, 48, 0, true, false},         // prefill across pairs
      {1, 700, 8, 2, 64, 699, true, false, 300},  // decode in a sliding window
      {20, 50, 8, 4, 64, 30, true, false, 9},     // a chunk in a sliding window
  };
  struct Owned {
    std::vector<float> q, k, v, out, probs, scores;
    AttentionArgs<float> args;
  };
  auto make = [](const AttnProblem& p, bool maps) {
    auto o = std::make_unique<Owned>();
    o->q = testing::Cast<float>(p.q);
    o->k = testing::Cast<float>(p.k);
    o->v = testing::Cast<float>(p.v);
    o->out.assign(static_cast<size_t>(p.tq) * p.heads * p.dh, 12345.0f);
    o->probs.assign(static_cast<size_t>(p.heads) * p.tq * p.tk, 12345.0f);
    o->scores = o->probs;
    o->args = testing::ContiguousArgs<float>(p, o->q.data(), o->k.data(), o->v.data(),
                                             o->out.data(), maps ? o->probs.data() : nullptr,
                                             maps ? o->scores.data() : nullptr);
    return o;
  };
  std::vector<AttnProblem> problems;
  for (const AttnConfig& c : configs) problems.push_back(MakeProblem(c, rng));
  for (bool maps : {false, true}) {
    CpuBackend cpu(2);
    std::vector<std::unique_ptr<Owned>> alone, batch;
    std::vector<AttentionArgs<float>> args;
    for (const AttnProblem& p : problems) {
      alone.push_back(make(p, maps));
      ASSERT_TRUE(cpu.Attention(alone.back()->args).ok());
      batch.push_back(make(p, maps));
      args.push_back(batch.back()->args);
    }
    int failed = -1;
    ASSERT_TRUE(cpu.AttentionBatch(args, &failed).ok());
    for (size_t c = 0; c < problems.size(); ++c) {
      EXPECT_EQ(batch[c]->out, alone[c]->out) << configs[c].Name() << " maps " << maps;
      EXPECT_EQ(batch[c]->probs, alone[c]->probs) << configs[c].Name() << " maps " << maps;
      EXPECT_EQ(batch[c]->scores, alone[c]->scores) << configs[c].Name() << " maps " << maps;
    }
    // A row that sees no key: the third call of the batch.
    std::vector<std::unique_ptr<Owned>> again;
    std::vector<AttentionArgs<float>> failing;
    for (const AttnProblem& p : problems) {
      again.push_back(make(p, maps));
      failing.push_back(again.back()->args);
    }
    std::vector<int32_t> lonely = problems[2].k_doc;
    for (int32_t& d : lonely) d = 999;
    failing[2].k_doc_ids = lonely.data();
    failed = -1;
    const absl::Status s = cpu.AttentionBatch(failing, &failed);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(failed, 2);
    for (size_t c = 0; c < problems.size(); ++c) {
      if (c < 2) {
        EXPECT_EQ(again[c]->out, alone[c]->out) << "ran before the failing call: " << c;
      } else {
        for (float x : again[c]->out)
          ASSERT_EQ(x, 12345.0f) << "untouched from the failing call on: " << c;
      }
    }
  }
}

// Decode-like calls (up to 4 query rows) over 512 keys or more, without maps, split the
// keys into spans of 256 read row by row and merge the spans' softmax partials: the same
// outputs as the reference, on fp32 and bf16 caches, with GQA, documents (a span may show
// a row no key), offsets and non-causal rows, and span boundaries inside blocks.
TEST(CpuBackendTest, LongDecodeSplitOverKeysMatchesReference) {
  std::mt19937_64 rng(31);
  ReferenceBackend ref;
  CpuBackend cpu(2);
  const std::vector<AttnConfig> configs = {
      {1, 512, 8, 2, 64, 511, true, false},     // exactly two spans
      {1, 1000, 32, 8, 128, 999, true, false},  // Llama's GQA 32/8
      {3, 1500, 12, 4, 40, 1497, true, false},  // three rows, a group of 3
      {4, 700, 4, 4, 16, 696, true, true},      // documents: some spans show a row nothing
      {2, 600, 6, 1, 24, 0, false, false},      // non-causal, MQA
      {1, 530, 2, 1, 72, 529, true, false},     // a short last span
  };
  for (const AttnConfig& c : configs) {
    const AttnProblem p = MakeProblem(c, rng);
    AttnProblem rounded = p;
    for (std::vector<double>* kv : {&rounded.k, &rounded.v}) {
      for (double& x : *kv) x = RoundToBf16(x);
    }
    for (KvDtype dtype : {KvDtype::kActivation, KvDtype::kBF16}) {
      const AttnProblem& seen = dtype == KvDtype::kBF16 ? rounded : p;
      const AttnResult want = testing::RunAttention(ref, seen);
      ASSERT_TRUE(want.status.ok()) << want.status;
      for (int block_size : {16, 7}) {
        const std::string what = c.Name() + absl::StrCat(" block_size=", block_size,
                                                         dtype == KvDtype::kBF16 ? " bf16" : "");
        const AttnResult got = RunPaged(cpu, p, block_size, rng, dtype, /*maps=*/false);
        ASSERT_TRUE(got.status.ok()) << got.status << " " << what;
        const double v_scale = testing::MaxAbs(seen.v);
        for (size_t e = 0; e < want.out.size(); ++e) {
          ASSERT_NEAR(got.out[e], want.out[e], 2e-5 * v_scale) << what << " out " << e;
        }
      }
    }
  }
}

// Softmax stays finite when scores are huge in fp32 (the row max is subtracted first).
TEST(CpuBackendTest, AttentionWithLargeScoresStaysFinite) {
  std::mt19937_64 rng(24);
  ReferenceBackend ref;
  CpuBackend cpu(2);
  AttnProblem p = MakeProblem({4, 4, 2, 1, 16, 0, true, false}, rng);
  for (double& x : p.q) x *= 200;  // scores of order 10³, exp would overflow
  const AttnResult want = testing::RunAttention(ref, p);
  const AttnResult got = testing::RunAttention(cpu, p);
  ASSERT_TRUE(got.status.ok());
  for (size_t e = 0; e < got.out.size(); ++e) {
    ASSERT_TRUE(std::isfinite(got.out[e]));
    ASSERT_NEAR(got.out[e], want.out[e], 1e-3);
  }
}

}  // namespace
}  // namespace kvlens::kernels
