// The q/k/v matvec with the rope and the cache store in its epilogue (LaunchMatVecRopeStore,
// CudaBackend::RmsNormQkvRopeStoreKv): one launch where the separate calls make three, and
// the same numbers as those calls (its parity against the double reference is the parity
// table's RmsNormQkvRopeStoreKv rows). The device suite is CudaBackend*, labelled `gpu`
// (kernels/cuda/gpu_test_labels.cmake.in).
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <cfloat>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/matvec.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels::cuda {
namespace {

// What one call leaves behind: q, k, v and both caches (f32 values, bf16 widened).
struct QkvResult {
  std::vector<double> q, k, v, k_cache, v_cache;
};

// The largest |a − b| over the parts, a NaN against a number infinite; and the largest
// |value|.
double MaxDiff(const QkvResult& a, const QkvResult& b, double* scale) {
  std::vector<double> all_a, all_b;
  for (const auto& [pa, pb] :
       {std::pair{&a.q, &b.q}, std::pair{&a.k, &b.k}, std::pair{&a.v, &b.v},
        std::pair{&a.k_cache, &b.k_cache}, std::pair{&a.v_cache, &b.v_cache}}) {
    all_a.insert(all_a.end(), pa->begin(), pa->end());
    all_b.insert(all_b.end(), pb->begin(), pb->end());
  }
  *scale = parity::MaxFinite(all_b);
  return parity::MaxErr(all_a, all_b);
}

class CudaBackendRopeStoreTest : public CudaBackendTest {
 protected:
  // A layer of heads 4/2 of Dh 64 on bf16 weights over in = 512, biases on q, k and v.
  static constexpr int kIn = 512, kQHeads = 4, kKvHeads = 2, kDh = 64, kCacheRows = 12;
  static constexpr int64_t kQd = kQHeads * kDh, kKvd = kKvHeads * kDh;

  CudaBackendRopeStoreTest()
      : rng_(31),
        norm_(kernels::testing::RandomVector(rng_, kIn, 0.5, 1.5), 1, kIn, DType::kBF16),
        wq_(kernels::testing::RandomVector(rng_, kQd * kIn), kQd, kIn, DType::kBF16),
        wk_(kernels::testing::RandomVector(rng_, kKvd * kIn), kKvd, kIn, DType::kBF16),
        wv_(kernels::testing::RandomVector(rng_, kKvd * kIn), kKvd, kIn, DType::kBF16),
        bq_(kernels::testing::RandomVector(rng_, kQd), 1, kQd, DType::kF32),
        bk_(kernels::testing::RandomVector(rng_, kKvd), 1, kKvd, DType::kF32),
        bv_(kernels::testing::RandomVector(rng_, kKvd), 1, kKvd, DType::kF32) {}

  // n rows of x at positions {900, 3, 65000, 17}, cache rows {7, −1, 2, 11}; fused: one
  // RmsNormQkvRopeStoreKv call, else RmsNormMatMulMany then RopeQKStoreKv. Recorded as one
  // step, whose launcher calls go to *calls.
  QkvResult Run(int n, const RopeSpec& rope, KvDtype cache_dtype, bool fused, int64_t* calls) {
    const std::vector<double> x =
        kernels::testing::RandomFloatExact(rng_x_, size_t(n) * kIn, -3, 3);
    const std::vector<int32_t> positions = {900, 3, 65000, 17};
    const std::vector<int64_t> rows = {7, -1, 2, 11};
    const bool bf16 = cache_dtype == KvDtype::kBF16;
    const std::vector<double> nan_cache(size_t{kCacheRows} * kKvd, parity::kNaN);
    auto dx = parity::ToDevice(x);
    auto dxn = parity::ToDevice(std::vector<double>(x.size(), parity::kNaN));
    auto dq = parity::ToDevice(std::vector<double>(size_t(n) * kQd, parity::kNaN));
    auto dk = parity::ToDevice(std::vector<double>(size_t(n) * kKvd, parity::kNaN));
    auto dv = parity::ToDevice(std::vector<double>(size_t(n) * kKvd, parity::kNaN));
    auto dkc = bf16 ? parity::ToDeviceBf16(nan_cache) : parity::ToDevice(nan_cache);
    auto dvc = bf16 ? parity::ToDeviceBf16(nan_cache) : parity::ToDevice(nan_cache);
    EXPECT_TRUE(dx.ok() && dxn.ok() && dq.ok() && dk.ok() && dv.ok() && dkc.ok() && dvc.ok());
    const MatMulOutput<float> qkv[] = {{wq_.view(), bq_.view(), dq->as<float>()},
                                       {wk_.view(), bk_.view(), dk->as<float>()},
                                       {wv_.view(), bv_.view(), dv->as<float>()}};
    backend_->BeginStep();
    if (fused) {
      QkvRopeStore kv;
      kv.q_heads = kQHeads;
      kv.kv_heads = kKvHeads;
      kv.head_dim = kDh;
      kv.positions = positions.data();
      kv.rope = &rope;
      kv.dst_rows = rows.data();
      kv.k_cache = dkc->get();
      kv.v_cache = dvc->get();
      kv.cache_stride = kKvd;
      kv.cache_dtype = cache_dtype;
      backend_->RmsNormQkvRopeStoreKv(dx->as<float>(), n, kIn, norm_.view(), 1e-5, dxn->as<float>(),
                                      qkv, kv);
    } else {
      backend_->RmsNormMatMulMany(dx->as<float>(), n, kIn, norm_.view(), 1e-5, dxn->as<float>(),
                                  qkv);
      backend_->RopeQKStoreKv(dq->as<float>(), kQd, kQHeads, dk->as<float>(), dv->as<float>(), kKvd,
                              kKvHeads, n, kDh, positions.data(), rope, rows.data(), dkc->get(),
                              dvc->get(), kKvd, cache_dtype);
    }
    EXPECT_TRUE(backend_->EndStep(/*run=*/true).ok()) << backend_->status();
    *calls = backend_->graph_stats().last_step_calls;
    QkvResult r;
    const size_t cache_elems = nan_cache.size();
    auto cache = [&](const DeviceBuffer& b) {
      return bf16 ? parity::FromDeviceBf16(*backend_, b, cache_elems)
                  : parity::FromDevice(*backend_, b, cache_elems);
    };
    for (const auto& [to, got] :
         {std::pair{&r.q, parity::FromDevice(*backend_, *dq, size_t(n) * kQd)},
          std::pair{&r.k, parity::FromDevice(*backend_, *dk, size_t(n) * kKvd)},
          std::pair{&r.v, parity::FromDevice(*backend_, *dv, size_t(n) * kKvd)},
          std::pair{&r.k_cache, cache(*dkc)}, std::pair{&r.v_cache, cache(*dvc)}}) {
      EXPECT_TRUE(got.ok()) << got.status();
      if (got.ok()) *to = *got;
    }
    return r;
  }

  std::mt19937_64 rng_;
  std::mt19937_64 rng_x_{47};
  kernels::testing::OwnedWeight norm_, wq_, wk_, wv_, bq_, bk_, bv_;
};

TEST_F(CudaBackendRopeStoreTest, OneLaunchGivesTheSeparateCallsNumbers) {
  std::vector<float> factors(kDh / 2);
  for (int p = 0; p < kDh / 2; ++p) factors[p] = 1.0f + 0.25f * static_cast<float>(p % 5);
  for (int n = 1; n <= kMatVecMaxRows; ++n) {
    for (RopeStyle style : {RopeStyle::kHalfSplit, RopeStyle::kAdjacentPairs}) {
      for (KvDtype cache : {KvDtype::kActivation, KvDtype::kBF16}) {
        SCOPED_TRACE(::testing::Message()
                     << "n " << n << ", half-split " << (style == RopeStyle::kHalfSplit)
                     << ", bf16 cache " << (cache == KvDtype::kBF16));
        const RopeSpec rope{10000.0, style, n == 3 ? factors.data() : nullptr};
        // The same x for both: the generator restarts.
        rng_x_.seed(47 + n);
        int64_t separate_calls = 0, fused_calls = 0;
        const QkvResult separate = Run(n, rope, cache, false, &separate_calls);
        rng_x_.seed(47 + n);
        const QkvResult fused = Run(n, rope, cache, true, &fused_calls);
        // Launched programmatically, its blocks prefetch their first weight rows before
        // the wait (launch_prefetch_test.cc): the same bits.
        SetProgrammaticLaunches(true);
        rng_x_.seed(47 + n);
        const QkvResult prefetched = Run(n, rope, cache, true, &fused_calls);
        SetProgrammaticLaunches(false);
        double unused = 0.0;
        EXPECT_EQ(MaxDiff(prefetched, fused, &unused), 0.0);
        // the matvec, then the index upload and RopeKernel; the upload and the matvec
        EXPECT_EQ(separate_calls, 3);
        EXPECT_EQ(fused_calls, 2);
        double scale = 0.0;
        const double diff = MaxDiff(fused, separate, &scale);
        // The same sums, angle and rotation code: equal but for a contraction the compiler
        // may choose differently in the two kernels (a few ulps of the largest value).
        EXPECT_LE(diff, 4 * FLT_EPSILON * scale) << "largest value " << scale;
        // and not trivially: rows were stored, one (the padding row's) was not
        int stored = 0;
        for (double e : fused.k_cache) stored += std::isnan(e) ? 0 : 1;
        EXPECT_EQ(stored, (n >= 2 ? n - 1 : n) * kKvd);
      }
    }
  }
  EXPECT_TRUE(backend_->status().ok()) << backend_->status();
}

TEST(MatVecRopeStore, RejectsWhatItCannotFuseNamingTheField) {
  const MatVecProduct q{nullptr, 128, nullptr, DType::kF32, nullptr};
  const MatVecProduct kv{nullptr, 64, nullptr, DType::kF32, nullptr};
  MatVecRopeStore rs;
  rs.head_dim = 32;
  auto launch = [&](std::vector<MatVecProduct> products, int64_t in) {
    return LaunchMatVecRopeStore(nullptr, 1, in, MatVecNorm{}, products, rs, DType::kBF16, nullptr);
  };
  absl::Status s = launch({q, kv}, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("3 products (q, k, v), got 2"), std::string::npos) << s;
  rs.head_dim = 6;
  s = launch({q, kv, kv}, 64);
  EXPECT_NE(s.message().find("head_dim must be a positive multiple of 4, got 6"), std::string::npos)
      << s;
  rs.head_dim = 32;
  const MatVecProduct v_short{nullptr, 32, nullptr, DType::kF32, nullptr};
  s = launch({q, kv, v_short}, 64);
  EXPECT_NE(s.message().find("k's and v's (64, 32) must be whole heads of 32"), std::string::npos)
      << s;
  MatVecProduct gelu = kv;
  gelu.gelu = true;
  s = launch({q, kv, gelu}, 64);
  EXPECT_NE(s.message().find("plain products"), std::string::npos) << s;
  s = launch({q, kv, kv}, 100);  // not the vectorized loop
  EXPECT_NE(s.message().find("in must be a multiple of 8"), std::string::npos) << s;
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(CudaBackendRopeStoreTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
