// Parity cases of a Llama layer's attention inputs in one call (cuda_parity.h):
// RmsNormQkvRopeStoreKv, the norm, the q/k/v products, the rope and the new cache rows,
// which the CUDA backend runs as one matvec launch where it can (LaunchMatVecRopeStore).
#ifndef KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_QKV_H_
#define KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_QKV_H_

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/kernels/cuda/cuda_parity_ops.h"
#include "tests/kernels/cuda/cuda_parity_util.h"

namespace kvlens::kernels::cuda::parity {

struct QkvShape {
  DType dtype;  // the products' weights
  int n, in, q_heads, kv_heads, head_dim;
  RopeStyle style;
  bool bias = false;        // a bias on each product (Qwen2)
  bool bf16_cache = false;  // else an fp32 cache
  bool scaled = false;      // Llama 3.1's frequency factors (RopeQKStoreKvCase's)
  bool fused_norm = true;   // the matvec normalizes x: xn must stay NaN
  bool with_norm = true;    // false: MatMulQkvRopeStoreKv of x itself (Gemma 2)
};

// RmsNormQkvRopeStoreKv (MatMulQkvRopeStoreKv without the norm) against the reference's
// default in double (its RmsNorm, MatMul of each, RopeQKStoreKv). Naive: NaiveNorm, NaiveMatMul of
// each (+ bias), NaiveRope. q, k and v come back NaN-filled outputs; the cache is NaN-filled at
// shuffled rows with a padding row (−1) from two rows on, positions up to 100000. Judged on q, k, v
// and, in an fp32 cache, both caches' rows (NaN elsewhere); a bf16 cache must hold exactly the bf16
// rounding of the k and v the call returned (RopeQKStoreKvBf16Case's rule), NaN elsewhere.
inline ParityResult QkvRopeStoreCase(CudaBackend& gpu, std::mt19937_64& rng, const QkvShape& s) {
  const std::string name = absl::StrCat(
      s.with_norm ? "RmsNormQkvRopeStoreKv " : "MatMulQkvRopeStoreKv ",
      std::string(DTypeName(s.dtype)), " n=", s.n, " in=", s.in, " heads ", s.q_heads, "/",
      s.kv_heads, " Dh=", s.head_dim,
      s.style == RopeStyle::kAdjacentPairs ? " adjacent" : " half-split", s.bias ? " +bias" : "",
      s.scaled ? " Llama 3.1 factors" : "", s.bf16_cache ? " bf16 cache" : " f32 cache",
      !s.with_norm   ? ""
      : s.fused_norm ? " (norm fused)"
                     : " (norm launched)");
  const int n = s.n, in = s.in, dh = s.head_dim, cache_rows = 16;
  const int64_t qd = int64_t{s.q_heads} * dh, kvd = int64_t{s.kv_heads} * dh;
  const int64_t cache_stride = kvd + 8;
  const double eps = 1e-5;
  std::vector<float> factors(dh / 2);
  for (int p = 0; p < dh / 2; ++p) {
    factors[p] = static_cast<float>(1.0 + 7.0 * std::clamp((p - dh / 6.0) / (dh / 5.0), 0.0, 1.0));
  }
  const RopeSpec rope{500000.0, s.style, s.scaled ? factors.data() : nullptr};
  const std::vector<int32_t> all_positions = {4097, 0, 100000, 31, 7, 2};
  const std::vector<int32_t> positions(all_positions.begin(), all_positions.begin() + n);
  std::vector<int64_t> rows(cache_rows);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(n);
  if (n >= 2) rows[1] = -1;  // a padding row: computed, stored nowhere

  const std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * in, -3, 3);
  const OwnedWeight g(kernels::testing::RandomVector(rng, in, 0.5, 1.5), 1, in, DType::kBF16);
  std::vector<OwnedWeight> ws, bs;
  for (int64_t out : {qd, kvd, kvd}) {
    ws.emplace_back(kernels::testing::RandomVector(rng, size_t(out) * in), out, in, s.dtype);
    bs.emplace_back(kernels::testing::RandomVector(rng, out), 1, out, DType::kF32);
  }
  auto outputs_of = [&](auto* q, auto* k, auto* v) {
    using T = std::remove_pointer_t<decltype(q)>;
    auto bias = [&](int i) { return s.bias ? bs[i].view() : WeightView{}; };
    return std::vector<MatMulOutput<T>>{
        {ws[0].view(), bias(0), q}, {ws[1].view(), bias(1), k}, {ws[2].view(), bias(2), v}};
  };
  QkvRopeStore kv;
  kv.q_heads = s.q_heads;
  kv.kv_heads = s.kv_heads;
  kv.head_dim = dh;
  kv.positions = positions.data();
  kv.rope = &rope;
  kv.dst_rows = rows.data();
  kv.cache_stride = cache_stride;

  // The reference, into double caches.
  const size_t cache_elems = size_t(cache_rows) * cache_stride;
  std::vector<double> xn_ref(x.size()), q_ref(size_t(n) * qd), k_ref(size_t(n) * kvd),
      v_ref(k_ref.size()), kc_ref(cache_elems, kNaN), vc_ref(cache_elems, kNaN);
  {
    QkvRopeStore ref_kv = kv;
    ref_kv.k_cache = kc_ref.data();
    ref_kv.v_cache = vc_ref.data();
    const auto outputs = outputs_of(q_ref.data(), k_ref.data(), v_ref.data());
    if (s.with_norm) {
      ReferenceBackend().RmsNormQkvRopeStoreKv(x.data(), n, in, g.view(), eps, xn_ref.data(),
                                               outputs, ref_kv);
    } else {
      ReferenceBackend().MatMulQkvRopeStoreKv(x.data(), n, outputs, ref_kv);
    }
  }
  // The naive run.
  const std::vector<double> xn_naive =
      s.with_norm ? NaiveNorm(x, n, in, false, g, nullptr, eps) : x;
  std::vector<double> q_naive = NaiveMatMul(xn_naive, n, in, ws[0], s.bias ? &bs[0] : nullptr);
  std::vector<double> k_naive = NaiveMatMul(xn_naive, n, in, ws[1], s.bias ? &bs[1] : nullptr);
  const std::vector<double> v_naive =
      NaiveMatMul(xn_naive, n, in, ws[2], s.bias ? &bs[2] : nullptr);
  NaiveRope(q_naive, n, qd, s.q_heads, dh, positions, rope);
  NaiveRope(k_naive, n, kvd, s.kv_heads, dh, positions, rope);
  std::vector<double> kc_naive(cache_elems, kNaN), vc_naive(cache_elems, kNaN);
  for (int r = 0; r < n; ++r) {
    if (rows[r] < 0) continue;
    for (int64_t e = 0; e < kvd; ++e) {
      kc_naive[rows[r] * cache_stride + e] = k_naive[r * kvd + e];
      vc_naive[rows[r] * cache_stride + e] = v_naive[r * kvd + e];
    }
  }

  auto dx = ToDevice(x);
  auto dxn = ToDevice(std::vector<double>(x.size(), kNaN));
  auto dq = ToDevice(std::vector<double>(q_ref.size(), kNaN));
  auto dk = ToDevice(std::vector<double>(k_ref.size(), kNaN));
  auto dv = ToDevice(std::vector<double>(v_ref.size(), kNaN));
  const std::vector<double> nan_cache(cache_elems, kNaN);
  auto dkc = s.bf16_cache ? ToDeviceBf16(nan_cache) : ToDevice(nan_cache);
  auto dvc = s.bf16_cache ? ToDeviceBf16(nan_cache) : ToDevice(nan_cache);
  if (!dx.ok() || !dxn.ok() || !dq.ok() || !dk.ok() || !dv.ok() || !dkc.ok() || !dvc.ok()) {
    return Failed(name, absl::InternalError("upload"));
  }
  kv.k_cache = dkc->get();
  kv.v_cache = dvc->get();
  kv.cache_dtype = s.bf16_cache ? KvDtype::kBF16 : KvDtype::kActivation;
  const auto outputs = outputs_of(dq->as<float>(), dk->as<float>(), dv->as<float>());
  if (s.with_norm) {
    gpu.RmsNormQkvRopeStoreKv(dx->as<float>(), n, in, g.view(), eps, dxn->as<float>(), outputs, kv);
  } else {
    gpu.MatMulQkvRopeStoreKv(dx->as<float>(), n, outputs, kv);
  }
  auto got_xn = FromDevice(gpu, *dxn, x.size());
  auto got_q = FromDevice(gpu, *dq, q_ref.size());
  auto got_k = FromDevice(gpu, *dk, k_ref.size());
  auto got_v = FromDevice(gpu, *dv, v_ref.size());
  auto got_kc =
      s.bf16_cache ? FromDeviceBf16(gpu, *dkc, cache_elems) : FromDevice(gpu, *dkc, cache_elems);
  auto got_vc =
      s.bf16_cache ? FromDeviceBf16(gpu, *dvc, cache_elems) : FromDevice(gpu, *dvc, cache_elems);
  for (const auto* got : {&got_xn, &got_q, &got_k, &got_v, &got_kc, &got_vc}) {
    if (!got->ok()) return Failed(name, got->status());
  }
  std::vector<double> got, naive, ref;
  auto append = [](std::vector<double>& to, const std::vector<double>& part) {
    to.insert(to.end(), part.begin(), part.end());
  };
  auto judged = [&](const std::vector<double>& g_part, const std::vector<double>& n_part,
                    const std::vector<double>& r_part) {
    append(got, g_part);
    append(naive, n_part);
    append(ref, r_part);
  };
  judged(*got_q, q_naive, q_ref);
  judged(*got_k, k_naive, k_ref);
  judged(*got_v, v_naive, v_ref);
  if (!s.with_norm) {
    // no norm: xn is not an argument
  } else if (s.fused_norm) {
    for (double e : *got_xn) {
      if (!std::isnan(e)) return Failed(name, absl::InternalError("xn written: no fused norm"));
    }
  } else {
    judged(*got_xn, xn_naive, xn_ref);
  }
  if (!s.bf16_cache) {
    judged(*got_kc, kc_naive, kc_ref);
    judged(*got_vc, vc_naive, vc_ref);
    return Judge(name, got, naive, ref);
  }
  // bf16: the cache rows are the returned k's and v's roundings, exactly.
  std::vector<double> want(2 * cache_elems, kNaN);
  for (int r = 0; r < n; ++r) {
    if (rows[r] < 0) continue;
    for (int64_t e = 0; e < kvd; ++e) {
      want[rows[r] * cache_stride + e] = RoundTo(DType::kBF16, (*got_k)[r * kvd + e]);
      want[cache_elems + rows[r] * cache_stride + e] = RoundTo(DType::kBF16, (*got_v)[r * kvd + e]);
    }
  }
  std::vector<double> caches = *got_kc;
  append(caches, *got_vc);
  if (MaxErr(caches, want) != 0.0) {
    return Failed(name, absl::InternalError(absl::StrCat(
                            "the bf16 cache is not the rounding of the returned k and v (max "
                            "error ",
                            MaxErr(caches, want), ")")));
  }
  return Judge(name, got, naive, ref);
}

}  // namespace kvlens::kernels::cuda::parity

#endif  // KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_QKV_H_
