// The CUDA backend's parity table (op × shape × dtype) against the double ReferenceBackend,
// shared by the GoogleTest suite (cuda_backend_test.cc) and by kvlens_gpu_check (which must
// build without GoogleTest on a bare GPU machine). Needs a device.
//
// Tolerance (FlashAttention's rule): the GPU's max error against the fp64 reference must be
// at most twice the max error of a naive run on the host at the precision the GPU path
// uses (fp32 arithmetic; inputs rounded to f16/bf16 where the GPU rounds them), plus a
// floor of 8 fp32 ulps of the largest reference value for ops whose naive run is exact.
// Caches are NaN-filled outside the sequence's rows and block tables are shuffled, so a
// kernel that reads a slot it should not fails.
#ifndef KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_H_
#define KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cpu/reference_backward.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels::cuda::parity {

using kernels::testing::OwnedWeight;

struct ParityResult {
  std::string name;
  absl::Status status;     // a failed CUDA call or a backend error
  double err = 0.0;        // max |gpu − reference|
  double naive_err = 0.0;  // max |naive − reference|
  double tol = 0.0;
  bool pass() const { return status.ok() && err <= tol; }
};

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

// Max |a − ref|; a NaN or infinity where the reference has a different value is infinite.
inline double MaxErr(const std::vector<double>& a, const std::vector<double>& ref) {
  if (a.size() != ref.size()) return kInf;
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(ref[i]) || std::isnan(a[i])) {
      if (std::isnan(ref[i]) != std::isnan(a[i])) return kInf;
      continue;
    }
    if (std::isinf(ref[i]) || std::isinf(a[i])) {
      if (a[i] != ref[i]) return kInf;
      continue;
    }
    m = std::max(m, std::abs(a[i] - ref[i]));
  }
  return m;
}

inline double MaxFinite(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) {
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  }
  return m;
}

inline ParityResult Judge(std::string name, const std::vector<double>& gpu,
                          const std::vector<double>& naive, const std::vector<double>& ref) {
  ParityResult r;
  r.name = std::move(name);
  r.err = MaxErr(gpu, ref);
  r.naive_err = MaxErr(naive, ref);
  r.tol = 2.0 * r.naive_err + 8.0 * FLT_EPSILON * MaxFinite(ref);
  return r;
}

inline ParityResult Failed(std::string name, absl::Status s) {
  ParityResult r;
  r.name = std::move(name);
  r.status = std::move(s);
  r.err = kInf;
  return r;
}

// Rounds as the GPU's tensor-core inputs are rounded.
inline double RoundTo(DType t, double x) {
  switch (t) {
    case DType::kF16:
    case DType::kQ8_0:
      return F16ToF32(F32ToF16(static_cast<float>(x)));
    case DType::kBF16:
      return BF16ToF32(F32ToBF16(static_cast<float>(x)));
    default:
      return static_cast<float>(x);
  }
}

inline std::vector<float> ToFloat(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

inline absl::StatusOr<DeviceBuffer> ToDevice(const std::vector<double>& h) {
  const std::vector<float> f = ToFloat(h);
  DeviceBuffer b;
  if (absl::Status s = b.Reserve(std::max<size_t>(f.size(), 1) * sizeof(float)); !s.ok()) return s;
  KVLENS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(b.get(), f.data(), f.size() * sizeof(float), cudaMemcpyHostToDevice));
  return b;
}

inline absl::StatusOr<std::vector<double>> FromDevice(CudaBackend& backend, const DeviceBuffer& b,
                                                      size_t n) {
  if (absl::Status s = backend.Synchronize(); !s.ok()) return s;
  std::vector<float> f(n);
  KVLENS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(f.data(), b.get(), n * sizeof(float), cudaMemcpyDeviceToHost));
  return std::vector<double>(f.begin(), f.end());
}

// ---------------------------------------------------------------------------------------
// Elementwise and row ops.

inline ParityResult MatMulCase(CudaBackend& gpu, std::mt19937_64& rng, DType dtype, int n, int in,
                               int out, bool with_bias) {
  const std::string name = absl::StrCat("MatMul ", std::string(DTypeName(dtype)), " n=", n,
                                        " in=", in, " out=", out, with_bias ? " +bias" : "");
  const std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * in);
  const OwnedWeight w(kernels::testing::RandomVector(rng, size_t(out) * in), out, in, dtype);
  const OwnedWeight b(kernels::testing::RandomVector(rng, out), 1, out, DType::kF32);
  const WeightView bias = with_bias ? b.view() : WeightView{};
  std::vector<double> ref(size_t(n) * out);
  ReferenceBackend().MatMul(x.data(), n, w.view(), bias, ref.data());
  // Naive: inputs rounded as the GPU rounds them, float products summed in float.
  std::vector<double> naive(ref.size());
  for (int r = 0; r < n; ++r) {
    for (int o = 0; o < out; ++o) {
      float sum = 0.0f;
      for (int i = 0; i < in; ++i) {
        sum += static_cast<float>(RoundTo(dtype, x[size_t(r) * in + i])) *
               static_cast<float>(RoundTo(dtype, w.values()[size_t(o) * in + i]));
      }
      naive[size_t(r) * out + o] = with_bias ? sum + static_cast<float>(b.values()[o]) : sum;
    }
  }
  auto dx = ToDevice(x);
  auto dy = ToDevice(std::vector<double>(ref.size(), kNaN));
  if (!dx.ok() || !dy.ok()) return Failed(name, !dx.ok() ? dx.status() : dy.status());
  gpu.MatMul(dx->as<float>(), n, w.view(), bias, dy->as<float>());
  auto y = FromDevice(gpu, *dy, ref.size());
  if (!y.ok()) return Failed(name, y.status());
  return Judge(name, *y, naive, ref);
}

// dx += dy · W (the input gradient of MatMul), dx starting from random values: against the
// reference's MatMulBackwardInput in double.
inline ParityResult MatMulBackwardInputCase(CudaBackend& gpu, std::mt19937_64& rng, DType dtype,
                                            int n, int in, int out) {
  const std::string name = absl::StrCat("MatMulBackwardInput ", std::string(DTypeName(dtype)),
                                        " n=", n, " in=", in, " out=", out);
  const std::vector<double> dy = kernels::testing::RandomFloatExact(rng, size_t(n) * out);
  const std::vector<double> dx0 = kernels::testing::RandomFloatExact(rng, size_t(n) * in);
  const OwnedWeight w(kernels::testing::RandomVector(rng, size_t(out) * in), out, in, dtype);
  std::vector<double> ref = dx0;
  MatMulBackwardInput(dy.data(), n, w.view(), ref.data());
  // Naive: dy rounded to the weight's dtype as the GPU rounds it, float sums.
  std::vector<double> naive(ref.size());
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < in; ++i) {
      float sum = 0.0f;
      for (int o = 0; o < out; ++o) {
        sum += static_cast<float>(RoundTo(dtype, dy[size_t(r) * out + o])) *
               static_cast<float>(RoundTo(dtype, w.values()[size_t(o) * in + i]));
      }
      naive[size_t(r) * in + i] = static_cast<float>(dx0[size_t(r) * in + i]) + sum;
    }
  }
  auto ddy = ToDevice(dy);
  auto ddx = ToDevice(dx0);
  if (!ddy.ok() || !ddx.ok()) return Failed(name, !ddy.ok() ? ddy.status() : ddx.status());
  if (absl::Status st = gpu.MatMulBackwardInput(ddy->as<float>(), n, w.view(), ddx->as<float>());
      !st.ok()) {
    return Failed(name, st);
  }
  auto got = FromDevice(gpu, *ddx, ref.size());
  if (!got.ok()) return Failed(name, got.status());
  return Judge(name, *got, naive, ref);
}

inline ParityResult EmbeddingCase(CudaBackend& gpu, std::mt19937_64& rng, DType dtype) {
  const std::string name = absl::StrCat("Embedding ", std::string(DTypeName(dtype)));
  const int vocab = 50, dim = 64, n = 9;
  const OwnedWeight table(kernels::testing::RandomVector(rng, size_t(vocab) * dim), vocab, dim,
                          dtype);
  std::vector<int32_t> ids(n);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % vocab);
  std::vector<double> ref(size_t(n) * dim);
  ReferenceBackend().Embedding(table.view(), ids.data(), n, ref.data());
  std::vector<double> naive(ref.size());
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < dim; ++c) {
      naive[size_t(r) * dim + c] = RoundTo(dtype, table.values()[size_t(ids[r]) * dim + c]);
    }
  }
  auto dy = ToDevice(std::vector<double>(ref.size(), kNaN));
  if (!dy.ok()) return Failed(name, dy.status());
  gpu.Embedding(table.view(), ids.data(), n, dy->as<float>());
  auto y = FromDevice(gpu, *dy, ref.size());
  if (!y.ok()) return Failed(name, y.status());
  return Judge(name, *y, naive, ref);
}

inline ParityResult NormCase(CudaBackend& gpu, std::mt19937_64& rng, bool layer_norm, int dim,
                             DType dtype, bool with_bias) {
  const std::string name = absl::StrCat(layer_norm ? "LayerNorm" : "RmsNorm", " dim=", dim, " ",
                                        std::string(DTypeName(dtype)), with_bias ? " +bias" : "");
  const int n = 3;
  const double eps = 1e-5;
  const std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * dim, -3, 3);
  const OwnedWeight g(kernels::testing::RandomVector(rng, dim, 0.5, 1.5), 1, dim, dtype);
  const OwnedWeight b(kernels::testing::RandomVector(rng, dim), 1, dim, dtype);
  const WeightView bias = with_bias ? b.view() : WeightView{};
  std::vector<double> ref(x.size()), naive(x.size());
  if (layer_norm) {
    ReferenceBackend().LayerNorm(x.data(), n, dim, g.view(), bias, eps, ref.data());
  } else {
    ReferenceBackend().RmsNorm(x.data(), n, dim, g.view(), eps, ref.data());
  }
  for (int r = 0; r < n; ++r) {
    const double* xr = x.data() + size_t(r) * dim;
    float mean = 0.0f, sq = 0.0f;
    if (layer_norm) {
      for (int i = 0; i < dim; ++i) mean += static_cast<float>(xr[i]);
      mean /= static_cast<float>(dim);
    }
    for (int i = 0; i < dim; ++i) {
      const float d = static_cast<float>(xr[i]) - mean;
      sq += d * d;
    }
    const float inv = 1.0f / std::sqrt(sq / static_cast<float>(dim) + static_cast<float>(eps));
    for (int i = 0; i < dim; ++i) {
      float y = (static_cast<float>(xr[i]) - mean) * inv * static_cast<float>(g.values()[i]);
      if (with_bias) y += static_cast<float>(b.values()[i]);
      naive[size_t(r) * dim + i] = y;
    }
  }
  auto dx = ToDevice(x);
  auto dy = ToDevice(std::vector<double>(x.size(), kNaN));
  if (!dx.ok() || !dy.ok()) return Failed(name, !dx.ok() ? dx.status() : dy.status());
  if (layer_norm) {
    gpu.LayerNorm(dx->as<float>(), n, dim, g.view(), bias, eps, dy->as<float>());
  } else {
    gpu.RmsNorm(dx->as<float>(), n, dim, g.view(), eps, dy->as<float>());
  }
  auto y = FromDevice(gpu, *dy, x.size());
  if (!y.ok()) return Failed(name, y.status());
  return Judge(name, *y, naive, ref);
}

inline ParityResult RopeCase(CudaBackend& gpu, std::mt19937_64& rng, RopeStyle style,
                             int head_dim) {
  const std::string name = absl::StrCat(
      "Rope ", style == RopeStyle::kAdjacentPairs ? "adjacent" : "half-split", " Dh=", head_dim);
  const int n = 5, heads = 3;
  const int64_t stride = int64_t{heads} * head_dim + 16;  // rows wider than the heads
  const double theta = 10000.0;
  const std::vector<int32_t> positions = {0, 1, 17, 4095, 100000};
  std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * stride, -2, 2);
  std::vector<double> ref = x, naive = x;
  ReferenceBackend().Rope(ref.data(), n, stride, heads, head_dim, positions.data(), theta, style);
  const int half = head_dim / 2;
  for (int r = 0; r < n; ++r) {
    for (int h = 0; h < heads; ++h) {
      double* head = naive.data() + r * stride + int64_t{h} * head_dim;
      for (int p = 0; p < half; ++p) {
        const double angle = positions[r] * std::pow(theta, -2.0 * p / head_dim);
        const float c = static_cast<float>(std::cos(angle)),
                    s = static_cast<float>(std::sin(angle));
        const int ia = style == RopeStyle::kAdjacentPairs ? 2 * p : p;
        const int ib = style == RopeStyle::kAdjacentPairs ? 2 * p + 1 : p + half;
        const float a = static_cast<float>(head[ia]), b = static_cast<float>(head[ib]);
        head[ia] = a * c - b * s;
        head[ib] = a * s + b * c;
      }
    }
  }
  auto dx = ToDevice(x);
  if (!dx.ok()) return Failed(name, dx.status());
  gpu.Rope(dx->as<float>(), n, stride, heads, head_dim, positions.data(), theta, style);
  auto y = FromDevice(gpu, *dx, x.size());
  if (!y.ok()) return Failed(name, y.status());
  return Judge(name, *y, naive, ref);
}

// kind: 0 Gelu, 1 SwiGlu, 2 Add
inline ParityResult ElementwiseCase(CudaBackend& gpu, std::mt19937_64& rng, int kind) {
  const char* names[] = {"Gelu", "SwiGlu", "Add"};
  const std::string name = names[kind];
  const int64_t count = 10007;
  const std::vector<double> a = kernels::testing::RandomFloatExact(rng, count, -8, 8);
  const std::vector<double> b = kernels::testing::RandomFloatExact(rng, count, -8, 8);
  std::vector<double> ref = a, naive(count);
  ReferenceBackend reference;
  if (kind == 0) reference.Gelu(ref.data(), count);
  if (kind == 1) reference.SwiGlu(a.data(), b.data(), count, ref.data());
  if (kind == 2) reference.Add(ref.data(), b.data(), count);
  for (int64_t i = 0; i < count; ++i) {
    const float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    if (kind == 0) {
      naive[i] = 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    } else if (kind == 1) {
      naive[i] = x / (1.0f + std::exp(-x)) * y;
    } else {
      naive[i] = x + y;
    }
  }
  auto da = ToDevice(a);
  auto db = ToDevice(b);
  auto dout = ToDevice(std::vector<double>(count, kNaN));
  if (!da.ok() || !db.ok() || !dout.ok()) return Failed(name, absl::InternalError("upload"));
  const DeviceBuffer* result = &*da;
  if (kind == 0) gpu.Gelu(da->as<float>(), count);
  if (kind == 1) {
    gpu.SwiGlu(da->as<float>(), db->as<float>(), count, dout->as<float>());
    result = &*dout;
  }
  if (kind == 2) gpu.Add(da->as<float>(), db->as<float>(), count);
  auto y = FromDevice(gpu, *result, count);
  if (!y.ok()) return Failed(name, y.status());
  return Judge(name, *y, naive, ref);
}

inline ParityResult StoreKvCase(CudaBackend& gpu, std::mt19937_64& rng) {
  const std::string name = "StoreKv into a NaN-filled cache";
  const int n = 6, cache_rows = 40;
  const int64_t row_elems = 24, src_stride = 30, cache_stride = 32;
  const std::vector<double> k = kernels::testing::RandomFloatExact(rng, size_t(n) * src_stride);
  const std::vector<double> v = kernels::testing::RandomFloatExact(rng, size_t(n) * src_stride);
  std::vector<int64_t> rows(cache_rows);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(n);
  std::vector<double> k_ref(size_t(cache_rows) * cache_stride, kNaN), v_ref = k_ref;
  ReferenceBackend().StoreKv(k.data(), v.data(), n, src_stride, row_elems, rows.data(),
                             k_ref.data(), v_ref.data(), cache_stride);
  auto dk = ToDevice(k);
  auto dv = ToDevice(v);
  auto dkc = ToDevice(std::vector<double>(k_ref.size(), kNaN));
  auto dvc = ToDevice(std::vector<double>(k_ref.size(), kNaN));
  if (!dk.ok() || !dv.ok() || !dkc.ok() || !dvc.ok()) {
    return Failed(name, absl::InternalError("upload"));
  }
  gpu.StoreKv(dk->as<float>(), dv->as<float>(), n, src_stride, row_elems, rows.data(),
              dkc->as<float>(), dvc->as<float>(), cache_stride);
  auto kc = FromDevice(gpu, *dkc, k_ref.size());
  auto vc = FromDevice(gpu, *dvc, k_ref.size());
  if (!kc.ok() || !vc.ok()) return Failed(name, !kc.ok() ? kc.status() : vc.status());
  kc->insert(kc->end(), vc->begin(), vc->end());
  k_ref.insert(k_ref.end(), v_ref.begin(), v_ref.end());
  return Judge(name, *kc, k_ref, k_ref);  // a copy: exact
}

// ---------------------------------------------------------------------------------------
// Attention over a paged, NaN-filled cache with a shuffled block table.

struct AttnShape {
  std::string label;
  int tq = 1, tk = 1, heads = 1, kv_heads = 1, dh = 64, offset = 0;
  bool causal = true;
  std::vector<int> doc_lengths;  // documents packed in order over the Tk keys; empty: none
  int block_size = 16;
  bool want_maps = false;  // request probs and scores (materialising kernel)
  bool want_probs_only = false;
};

// The host naive run of the path the backend picks: fp16-rounded Q, K, P, V with fp32
// softmax for the flash kernel, plain fp32 otherwise.
inline std::vector<double> NaiveAttention(const AttnShape& s, bool flash,
                                          const std::vector<double>& q,
                                          const std::vector<double>& k,
                                          const std::vector<double>& v,
                                          const std::vector<int32_t>& docs, double scale) {
  auto rd = [&](double x) { return flash ? RoundTo(DType::kF16, x) : static_cast<float>(x); };
  const int group = s.heads / s.kv_heads;
  std::vector<double> out(size_t(s.tq) * s.heads * s.dh);
  std::vector<float> sc(s.tk);
  std::vector<bool> vis(s.tk);
  for (int h = 0; h < s.heads; ++h) {
    const int g = h / group;
    for (int i = 0; i < s.tq; ++i) {
      float m = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < s.tk; ++j) {
        vis[j] =
            (!s.causal || j <= s.offset + i) && (docs.empty() || docs[s.offset + i] == docs[j]);
        if (!vis[j]) continue;
        float dot = 0.0f;
        for (int d = 0; d < s.dh; ++d) {
          dot += static_cast<float>(rd(q[(size_t(i) * s.heads + h) * s.dh + d])) *
                 static_cast<float>(rd(k[(size_t(j) * s.kv_heads + g) * s.dh + d]));
        }
        sc[j] = dot * static_cast<float>(scale);
        m = std::max(m, sc[j]);
      }
      float l = 0.0f;
      std::vector<float> acc(s.dh, 0.0f);
      for (int j = 0; j < s.tk; ++j) {
        if (!vis[j]) continue;
        const float p = std::exp(sc[j] - m);
        l += p;
        for (int d = 0; d < s.dh; ++d) {
          acc[d] += static_cast<float>(rd(p)) *
                    static_cast<float>(rd(v[(size_t(j) * s.kv_heads + g) * s.dh + d]));
        }
      }
      for (int d = 0; d < s.dh; ++d) out[(size_t(i) * s.heads + h) * s.dh + d] = acc[d] / l;
    }
  }
  return out;
}

// Random inputs of one attention shape, contiguous (for the naive runs) and laid out as
// the backends read them: q rows padded with NaN, K and V in a paged cache of twice the
// blocks needed, NaN everywhere but the sequence's rows, its blocks shuffled.
struct AttnInputs {
  int64_t q_width = 0, kv_width = 0, q_stride = 0, kv_stride = 0;
  double scale = 0.0;
  std::vector<double> q, k, v;  // [Tq, H, Dh], [Tk, Hkv, Dh], [Tk, Hkv, Dh]
  std::vector<int32_t> docs;    // [offset + Tq] = [Tk] document of each position, or empty
  std::vector<int32_t> q_docs;  // [Tq]
  std::vector<int32_t> table;   // the sequence's blocks
  std::vector<double> kc, vc;   // the paged cache
  std::vector<double> qs;       // [Tq, q_stride]
};

inline AttnInputs MakeAttnInputs(const AttnShape& s, std::mt19937_64& rng) {
  AttnInputs in;
  in.q_width = int64_t{s.heads} * s.dh;
  in.kv_width = int64_t{s.kv_heads} * s.dh;
  in.q_stride = in.q_width + 8;
  in.kv_stride = in.kv_width + 4;
  in.scale = 1.0 / std::sqrt(static_cast<double>(s.dh));
  in.q = kernels::testing::RandomFloatExact(rng, size_t(s.tq) * in.q_width, -2, 2);
  in.k = kernels::testing::RandomFloatExact(rng, size_t(s.tk) * in.kv_width, -2, 2);
  in.v = kernels::testing::RandomFloatExact(rng, size_t(s.tk) * in.kv_width);
  for (size_t d = 0; d < s.doc_lengths.size(); ++d)
    in.docs.insert(in.docs.end(), s.doc_lengths[d], int32_t(d));
  const int needed = (s.tk + s.block_size - 1) / s.block_size;
  const int num_blocks = 2 * needed + 1;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  in.table.assign(perm.begin(), perm.begin() + needed);
  in.kc.assign(size_t(num_blocks) * s.block_size * in.kv_stride, kNaN);
  in.vc = in.kc;
  in.qs.assign(size_t(s.tq) * in.q_stride, kNaN);
  for (int j = 0; j < s.tk; ++j) {
    const int64_t row = int64_t{in.table[j / s.block_size]} * s.block_size + j % s.block_size;
    std::copy_n(in.k.begin() + j * in.kv_width, in.kv_width, in.kc.begin() + row * in.kv_stride);
    std::copy_n(in.v.begin() + j * in.kv_width, in.kv_width, in.vc.begin() + row * in.kv_stride);
  }
  for (int i = 0; i < s.tq; ++i)
    std::copy_n(in.q.begin() + i * in.q_width, in.q_width, in.qs.begin() + i * in.q_stride);
  if (!in.docs.empty()) {
    in.q_docs.assign(in.docs.begin() + s.offset, in.docs.begin() + s.offset + s.tq);
  }
  return in;
}

inline std::string ShapeName(const char* op, const AttnShape& s) {
  return absl::StrCat(op, " ", s.label, " (Tq=", s.tq, " Tk=", s.tk, " H=", s.heads, "/",
                      s.kv_heads, " Dh=", s.dh, " off=", s.offset, ")");
}

inline std::vector<ParityResult> AttentionCase(CudaBackend& gpu, std::mt19937_64& rng,
                                               const AttnShape& s) {
  const std::string name = ShapeName("Attention", s);
  const AttnInputs in = MakeAttnInputs(s, rng);
  const int64_t q_width = in.q_width, q_stride = in.q_stride, kv_stride = in.kv_stride;
  const double scale = in.scale;
  const std::vector<double>&q = in.q, &k = in.k, &v = in.v, &kc = in.kc, &vc = in.vc, &qs = in.qs;
  const std::vector<int32_t>&docs = in.docs, &q_docs = in.q_docs, &table = in.table;

  const size_t map_size = size_t(s.heads) * s.tq * s.tk;
  const bool maps = s.want_maps || s.want_probs_only;
  // Reference (double) on the same paged layout.
  std::vector<double> ref_out(size_t(s.tq) * q_stride, kNaN), ref_probs(map_size),
      ref_scores(map_size);
  AttentionArgs<double> ra;
  ra.q = qs.data();
  ra.q_stride = q_stride;
  ra.num_queries = s.tq;
  ra.num_keys = s.tk;
  ra.num_heads = s.heads;
  ra.num_kv_heads = s.kv_heads;
  ra.head_dim = s.dh;
  ra.query_offset = s.offset;
  ra.causal = s.causal;
  ra.scale = scale;
  if (!docs.empty()) {
    ra.q_doc_ids = q_docs.data();
    ra.k_doc_ids = docs.data();
  }
  ra.kv = KvSource<double>{kc.data(), vc.data(), kv_stride, table.data(), s.block_size};
  ra.out = ref_out.data();
  ra.out_stride = q_stride;
  ra.probs = ref_probs.data();
  ra.scores = ref_scores.data();
  if (absl::Status st = ReferenceBackend().Attention(ra); !st.ok()) return {Failed(name, st)};

  auto dq = ToDevice(qs);
  auto dk = ToDevice(kc);
  auto dv = ToDevice(vc);
  auto dout = ToDevice(std::vector<double>(size_t(s.tq) * q_stride, kNaN));
  auto dprobs = ToDevice(std::vector<double>(maps ? map_size : 1, kNaN));
  auto dscores = ToDevice(std::vector<double>(maps ? map_size : 1, kNaN));
  if (!dq.ok() || !dk.ok() || !dv.ok() || !dout.ok() || !dprobs.ok() || !dscores.ok()) {
    return {Failed(name, absl::InternalError("device upload failed"))};
  }
  AttentionArgs<float> a;
  a.q = dq->as<float>();
  a.q_stride = q_stride;
  a.num_queries = s.tq;
  a.num_keys = s.tk;
  a.num_heads = s.heads;
  a.num_kv_heads = s.kv_heads;
  a.head_dim = s.dh;
  a.query_offset = s.offset;
  a.causal = s.causal;
  a.scale = scale;
  a.q_doc_ids = ra.q_doc_ids;
  a.k_doc_ids = ra.k_doc_ids;
  a.kv = KvSource<float>{dk->as<float>(), dv->as<float>(), kv_stride, table.data(), s.block_size};
  a.out = dout->as<float>();
  a.out_stride = q_stride;
  if (maps) a.probs = dprobs->as<float>();
  if (s.want_maps) a.scores = dscores->as<float>();
  if (absl::Status st = gpu.Attention(a); !st.ok()) return {Failed(name, st)};
  auto out = FromDevice(gpu, *dout, size_t(s.tq) * q_stride);
  if (!out.ok()) return {Failed(name, out.status())};

  // Compare the heads' columns only; the row padding must stay NaN (never written).
  std::vector<double> got, want, naive_rows;
  const bool flash = !maps && s.tq >= kFlashMinQueries && FlashPrefillSupports(s.dh);
  const std::vector<double> naive = NaiveAttention(s, flash, q, k, v, docs, scale);
  for (int i = 0; i < s.tq; ++i) {
    for (int64_t c = 0; c < q_stride; ++c) {
      got.push_back((*out)[i * q_stride + c]);
      want.push_back(ref_out[i * q_stride + c]);
      naive_rows.push_back(c < q_width ? naive[i * q_width + c] : kNaN);
    }
  }
  std::vector<ParityResult> results = {Judge(absl::StrCat(name, flash  ? " flash"
                                                                : maps ? " materialised"
                                                                       : " split-KV"),
                                             got, naive_rows, want)};
  if (maps) {
    auto probs = FromDevice(gpu, *dprobs, map_size);
    if (!probs.ok()) return {Failed(name, probs.status())};
    // Naive probabilities: fp32 softmax of fp32 scores, the materialising kernel's maths.
    std::vector<double> naive_probs(map_size, 0.0), naive_scores(map_size);
    for (size_t row = 0; row < map_size / s.tk; ++row) {
      const int h = static_cast<int>(row / s.tq), i = static_cast<int>(row % s.tq);
      const int g = h / (s.heads / s.kv_heads);
      float m = -std::numeric_limits<float>::infinity(), z = 0.0f;
      for (int j = 0; j < s.tk; ++j) {
        const bool vis =
            (!s.causal || j <= s.offset + i) && (docs.empty() || docs[s.offset + i] == docs[j]);
        float dot = 0.0f;
        for (int d = 0; d < s.dh; ++d) {
          dot += static_cast<float>(q[(size_t(i) * s.heads + h) * s.dh + d]) *
                 static_cast<float>(k[(size_t(j) * s.kv_heads + g) * s.dh + d]);
        }
        naive_scores[row * s.tk + j] = vis ? dot * static_cast<float>(scale) : -kInf;
        if (vis) m = std::max(m, static_cast<float>(naive_scores[row * s.tk + j]));
      }
      for (int j = 0; j < s.tk; ++j) {
        if (std::isinf(naive_scores[row * s.tk + j])) continue;
        const float e = std::exp(static_cast<float>(naive_scores[row * s.tk + j]) - m);
        naive_probs[row * s.tk + j] = e;
        z += e;
      }
      for (int j = 0; j < s.tk; ++j)
        naive_probs[row * s.tk + j] = static_cast<float>(naive_probs[row * s.tk + j]) / z;
    }
    results.push_back(Judge(name + " probs", *probs, naive_probs, ref_probs));
    if (s.want_maps) {
      auto scores = FromDevice(gpu, *dscores, map_size);
      if (!scores.ok()) return {Failed(name, scores.status())};
      results.push_back(Judge(name + " scores", *scores, naive_scores, ref_scores));
    }
  }
  return results;
}

// ---------------------------------------------------------------------------------------
// AttentionBatch: five sequences in one call over one shared paged cache (NaN elsewhere,
// blocks shuffled), their q and out rows one after another as the engine lays them out.
// The third has documents, so it runs alone and splits the others into two batched
// launches. Against the reference's Attention per sequence; naive = fp32 per sequence.
inline ParityResult AttentionBatchCase(CudaBackend& gpu, std::mt19937_64& rng) {
  const std::string name =
      "AttentionBatch 5 sequences (Tq 1/5/3/1/2, Tk 300/40/30/700/9, "
      "H=8/2 Dh=64, one with documents)";
  std::vector<AttnShape> seqs = {{.tq = 1, .tk = 300},
                                 {.tq = 5, .tk = 40},
                                 {.tq = 3, .tk = 30, .doc_lengths = {12, 18}},
                                 {.tq = 1, .tk = 700},
                                 {.tq = 2, .tk = 9}};
  const int heads = 8, kv_heads = 2, dh = 64, bs = 16;
  const int64_t qw = heads * dh, kvw = kv_heads * dh, q_stride = qw + 8, kv_stride = kvw + 4;
  const double scale = 1.0 / std::sqrt(double(dh));
  int total_blocks = 0, total_rows = 0;
  for (AttnShape& s : seqs) {
    s.heads = heads;
    s.kv_heads = kv_heads;
    s.dh = dh;
    s.block_size = bs;
    s.offset = s.tk - s.tq;
    total_blocks += (s.tk + bs - 1) / bs;
    total_rows += s.tq;
  }
  const int num_blocks = 2 * total_blocks + 1;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<double> kc(size_t(num_blocks) * bs * kv_stride, kNaN), vc = kc;
  std::vector<double> qs(size_t(total_rows) * q_stride, kNaN), want(qs.size(), kNaN),
      naive_rows(qs.size(), kNaN);
  std::vector<std::vector<int32_t>> tables(seqs.size()), docs(seqs.size());
  std::vector<std::vector<double>> qv(seqs.size()), kv(seqs.size()), vv(seqs.size());
  int next_block = 0, row0 = 0;
  for (size_t e = 0; e < seqs.size(); ++e) {
    const AttnShape& s = seqs[e];
    qv[e] = kernels::testing::RandomFloatExact(rng, size_t(s.tq) * qw, -2, 2);
    kv[e] = kernels::testing::RandomFloatExact(rng, size_t(s.tk) * kvw, -2, 2);
    vv[e] = kernels::testing::RandomFloatExact(rng, size_t(s.tk) * kvw);
    for (size_t d = 0; d < s.doc_lengths.size(); ++d)
      docs[e].insert(docs[e].end(), s.doc_lengths[d], int32_t(d));
    for (int b = 0; b * bs < s.tk; ++b) tables[e].push_back(perm[next_block++]);
    for (int j = 0; j < s.tk; ++j) {
      const int64_t row = int64_t{tables[e][j / bs]} * bs + j % bs;
      std::copy_n(kv[e].begin() + j * kvw, kvw, kc.begin() + row * kv_stride);
      std::copy_n(vv[e].begin() + j * kvw, kvw, vc.begin() + row * kv_stride);
    }
    for (int i = 0; i < s.tq; ++i)
      std::copy_n(qv[e].begin() + i * qw, qw, qs.begin() + (row0 + i) * q_stride);
    row0 += s.tq;
  }
  auto args = [&](auto* q, auto* k, auto* v, auto* out, size_t e, int r0) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(q)>>;
    const AttnShape& s = seqs[e];
    AttentionArgs<T> a;
    a.q = q + int64_t{r0} * q_stride;
    a.q_stride = q_stride;
    a.num_queries = s.tq;
    a.num_keys = s.tk;
    a.num_heads = heads;
    a.num_kv_heads = kv_heads;
    a.head_dim = dh;
    a.query_offset = s.offset;
    a.scale = scale;
    if (!docs[e].empty()) {
      a.q_doc_ids = docs[e].data() + s.offset;
      a.k_doc_ids = docs[e].data();
    }
    a.kv = KvSource<T>{k, v, kv_stride, tables[e].data(), bs};
    a.out = out + int64_t{r0} * q_stride;
    a.out_stride = q_stride;
    return a;
  };
  auto dq = ToDevice(qs);
  auto dk = ToDevice(kc);
  auto dv = ToDevice(vc);
  auto dout = ToDevice(std::vector<double>(qs.size(), kNaN));
  if (!dq.ok() || !dk.ok() || !dv.ok() || !dout.ok()) {
    return Failed(name, absl::InternalError("device upload failed"));
  }
  std::vector<AttentionArgs<float>> calls;
  row0 = 0;
  for (size_t e = 0; e < seqs.size(); ++e) {
    const AttentionArgs<double> ra = args(qs.data(), kc.data(), vc.data(), want.data(), e, row0);
    if (absl::Status st = ReferenceBackend().Attention(ra); !st.ok()) return Failed(name, st);
    const std::vector<double> naive =
        NaiveAttention(seqs[e], false, qv[e], kv[e], vv[e], docs[e], scale);
    for (int i = 0; i < seqs[e].tq; ++i)
      std::copy_n(naive.begin() + i * qw, qw, naive_rows.begin() + (row0 + i) * q_stride);
    calls.push_back(
        args(dq->as<float>(), dk->as<float>(), dv->as<float>(), dout->as<float>(), e, row0));
    row0 += seqs[e].tq;
  }
  int failed = -1;
  if (absl::Status st = gpu.AttentionBatch(calls, &failed); !st.ok()) {
    return Failed(name, absl::Status(st.code(), absl::StrCat("call ", failed, ": ", st.message())));
  }
  auto got = FromDevice(gpu, *dout, qs.size());
  if (!got.ok()) return Failed(name, got.status());
  return Judge(name, *got, naive_rows, want);
}

// ---------------------------------------------------------------------------------------
// Attention backward: CudaBackend::AttentionBackward against the double reference's
// AttentionBackward (kernels/cpu/reference_backward.h), given the reference forward's
// probabilities rounded to fp32. The naive run is the same maths in fp32 on the host.

struct BackwardGrads {
  std::vector<double> dq, dk, dv, dprobs, dscores;
};

inline BackwardGrads NaiveAttentionBackward(const AttnShape& s, const AttnInputs& in,
                                            const std::vector<double>& probs,
                                            const std::vector<double>& g) {
  const int group = s.heads / s.kv_heads;
  BackwardGrads r;
  r.dq.assign(size_t(s.tq) * in.q_width, 0.0);
  r.dprobs.assign(size_t(s.heads) * s.tq * s.tk, 0.0);
  r.dscores = r.dprobs;
  std::vector<float> dk(size_t(s.tk) * in.kv_width, 0.0f), dv(dk.size(), 0.0f);
  const float scale = static_cast<float>(in.scale);
  for (int h = 0; h < s.heads; ++h) {
    const int kv = h / group;
    for (int i = 0; i < s.tq; ++i) {
      const size_t qrow = (size_t(i) * s.heads + h) * s.dh, map = (size_t(h) * s.tq + i) * s.tk;
      std::vector<float> da(s.tk, 0.0f);
      std::vector<bool> vis(s.tk);
      float mean = 0.0f;
      for (int j = 0; j < s.tk; ++j) {
        vis[j] = (!s.causal || j <= s.offset + i) &&
                 (in.docs.empty() || in.docs[s.offset + i] == in.docs[j]);
        if (!vis[j]) continue;
        const size_t krow = (size_t(j) * s.kv_heads + kv) * s.dh;
        for (int d = 0; d < s.dh; ++d) {
          da[j] += static_cast<float>(g[qrow + d]) * static_cast<float>(in.v[krow + d]);
        }
        mean += static_cast<float>(probs[map + j]) * da[j];
      }
      std::vector<float> dq(s.dh, 0.0f);
      for (int j = 0; j < s.tk; ++j) {
        if (!vis[j]) continue;
        const float a = static_cast<float>(probs[map + j]);
        const float ds = a * (da[j] - mean);
        r.dprobs[map + j] = da[j];
        r.dscores[map + j] = ds;
        const size_t krow = (size_t(j) * s.kv_heads + kv) * s.dh;
        for (int d = 0; d < s.dh; ++d) {
          dq[d] += ds * static_cast<float>(in.k[krow + d]);
          dk[krow + d] += scale * ds * static_cast<float>(in.q[qrow + d]);
          dv[krow + d] += a * static_cast<float>(g[qrow + d]);
        }
      }
      for (int d = 0; d < s.dh; ++d) r.dq[qrow + d] = scale * dq[d];
    }
  }
  r.dk.assign(dk.begin(), dk.end());
  r.dv.assign(dv.begin(), dv.end());
  return r;
}

inline std::vector<ParityResult> AttentionBackwardCase(CudaBackend& gpu, std::mt19937_64& rng,
                                                       const AttnShape& s) {
  const std::string name = ShapeName("AttentionBackward", s);
  const AttnInputs in = MakeAttnInputs(s, rng);
  const std::vector<double> g =
      kernels::testing::RandomFloatExact(rng, size_t(s.tq) * in.q_width, -1, 1);
  std::vector<double> gs(size_t(s.tq) * in.q_stride, kNaN);  // rows padded like q
  for (int i = 0; i < s.tq; ++i)
    std::copy_n(g.begin() + i * in.q_width, in.q_width, gs.begin() + i * in.q_stride);
  const size_t map_size = size_t(s.heads) * s.tq * s.tk;
  const size_t q_size = size_t(s.tq) * in.q_width, kv_size = size_t(s.tk) * in.kv_width;

  // Reference forward for the probabilities, then the reference backward (double).
  std::vector<double> out(size_t(s.tq) * in.q_stride, kNaN), probs(map_size);
  AttentionArgs<double> fa;
  fa.q = in.qs.data();
  fa.q_stride = in.q_stride;
  fa.num_queries = s.tq;
  fa.num_keys = s.tk;
  fa.num_heads = s.heads;
  fa.num_kv_heads = s.kv_heads;
  fa.head_dim = s.dh;
  fa.query_offset = s.offset;
  fa.causal = s.causal;
  fa.scale = in.scale;
  if (!in.docs.empty()) {
    fa.q_doc_ids = in.q_docs.data();
    fa.k_doc_ids = in.docs.data();
  }
  fa.kv = KvSource<double>{in.kc.data(), in.vc.data(), in.kv_stride, in.table.data(), s.block_size};
  fa.out = out.data();
  fa.out_stride = in.q_stride;
  fa.probs = probs.data();
  if (absl::Status st = ReferenceBackend().Attention(fa); !st.ok()) return {Failed(name, st)};
  for (double& p : probs) p = static_cast<float>(p);  // what the GPU is given

  BackwardGrads want;
  want.dq.resize(q_size);
  want.dk.resize(kv_size);
  want.dv.resize(kv_size);
  want.dprobs.resize(map_size);
  want.dscores.resize(map_size);
  AttentionBackwardArgs<double> rb;
  rb.q = fa.q;
  rb.q_stride = fa.q_stride;
  rb.num_queries = s.tq;
  rb.num_keys = s.tk;
  rb.num_heads = s.heads;
  rb.num_kv_heads = s.kv_heads;
  rb.head_dim = s.dh;
  rb.query_offset = s.offset;
  rb.causal = s.causal;
  rb.scale = in.scale;
  rb.q_doc_ids = fa.q_doc_ids;
  rb.k_doc_ids = fa.k_doc_ids;
  rb.kv = fa.kv;
  rb.probs = probs.data();
  rb.dout = gs.data();
  rb.dout_stride = in.q_stride;
  rb.dq = want.dq.data();
  rb.dk = want.dk.data();
  rb.dv = want.dv.data();
  rb.dprobs = want.dprobs.data();
  rb.dscores = want.dscores.data();
  if (absl::Status st = AttentionBackward(rb); !st.ok()) return {Failed(name, st)};

  // The GPU, every output NaN-filled first.
  auto dq_in = ToDevice(in.qs);
  auto dkc = ToDevice(in.kc);
  auto dvc = ToDevice(in.vc);
  auto dprobs_in = ToDevice(probs);
  auto dg = ToDevice(gs);
  auto ddq = ToDevice(std::vector<double>(q_size, kNaN));
  auto ddk = ToDevice(std::vector<double>(kv_size, kNaN));
  auto ddv = ToDevice(std::vector<double>(kv_size, kNaN));
  auto dda = ToDevice(std::vector<double>(map_size, kNaN));
  auto dds = ToDevice(std::vector<double>(map_size, kNaN));
  for (const auto* b : {&dq_in, &dkc, &dvc, &dprobs_in, &dg, &ddq, &ddk, &ddv, &dda, &dds}) {
    if (!b->ok()) return {Failed(name, b->status())};
  }
  AttentionBackwardArgs<float> b;
  b.q = dq_in->as<float>();
  b.q_stride = in.q_stride;
  b.num_queries = s.tq;
  b.num_keys = s.tk;
  b.num_heads = s.heads;
  b.num_kv_heads = s.kv_heads;
  b.head_dim = s.dh;
  b.query_offset = s.offset;
  b.causal = s.causal;
  b.scale = in.scale;
  b.q_doc_ids = fa.q_doc_ids;
  b.k_doc_ids = fa.k_doc_ids;
  b.kv = KvSource<float>{dkc->as<float>(), dvc->as<float>(), in.kv_stride, in.table.data(),
                         s.block_size};
  b.probs = dprobs_in->as<float>();
  b.dout = dg->as<float>();
  b.dout_stride = in.q_stride;
  b.dq = ddq->as<float>();
  b.dk = ddk->as<float>();
  b.dv = ddv->as<float>();
  b.dprobs = dda->as<float>();
  b.dscores = dds->as<float>();
  if (absl::Status st = gpu.AttentionBackward(b); !st.ok()) return {Failed(name, st)};

  const BackwardGrads naive = NaiveAttentionBackward(s, in, probs, g);
  std::vector<ParityResult> results;
  const std::pair<const char*, const DeviceBuffer*> parts[] = {
      {"dQ", &*ddq}, {"dK", &*ddk}, {"dV", &*ddv}, {"dA", &*dda}, {"dS", &*dds}};
  const std::vector<double>* wants[] = {&want.dq, &want.dk, &want.dv, &want.dprobs, &want.dscores};
  const std::vector<double>* naives[] = {&naive.dq, &naive.dk, &naive.dv, &naive.dprobs,
                                         &naive.dscores};
  for (int t = 0; t < 5; ++t) {
    auto got = FromDevice(gpu, *parts[t].second, wants[t]->size());
    if (!got.ok()) return {Failed(name, got.status())};
    results.push_back(Judge(absl::StrCat(name, " ", parts[t].first), *got, *naives[t], *wants[t]));
  }
  return results;
}

inline std::vector<AttnShape> AttentionBackwardShapes() {
  return {
      {.label = "causal docs offset GQA 8/4",
       .tq = 20,
       .tk = 60,
       .heads = 8,
       .kv_heads = 4,
       .dh = 64,
       .offset = 40,
       .doc_lengths = {35, 25},
       .block_size = 8},
      {.label = "non-causal GQA 2/1",
       .tq = 33,
       .tk = 33,
       .heads = 2,
       .kv_heads = 1,
       .dh = 128,
       .causal = false},
      {.label = "decode head size 80",
       .tq = 1,
       .tk = 300,
       .heads = 4,
       .kv_heads = 2,
       .dh = 80,
       .offset = 299},
      {.label = "chunk head size 32",
       .tq = 7,
       .tk = 50,
       .heads = 6,
       .kv_heads = 6,
       .dh = 32,
       .offset = 43},
  };
}

inline std::vector<AttnShape> AttentionShapes() {
  std::vector<AttnShape> shapes;
  auto add = [&](AttnShape s) { shapes.push_back(std::move(s)); };
  add({.label = "prefill causal", .tq = 150, .tk = 150, .heads = 4, .kv_heads = 4, .dh = 64});
  add({.label = "prefill offset GQA 8/4",
       .tq = 70,
       .tk = 200,
       .heads = 8,
       .kv_heads = 4,
       .dh = 128,
       .offset = 130});
  add({.label = "prefill docs GQA 8/1",
       .tq = 130,
       .tk = 130,
       .heads = 8,
       .kv_heads = 1,
       .dh = 128,
       .doc_lengths = {40, 50, 40}});
  add({.label = "prefill non-causal docs",
       .tq = 64,
       .tk = 64,
       .heads = 2,
       .kv_heads = 2,
       .dh = 64,
       .causal = false,
       .doc_lengths = {10, 54}});
  add({.label = "chunk with docs and offset",
       .tq = 40,
       .tk = 100,
       .heads = 8,
       .kv_heads = 4,
       .dh = 64,
       .offset = 60,
       .doc_lengths = {70, 30},
       .block_size = 8});
  add({.label = "decode long GQA 8/1",
       .tq = 1,
       .tk = 3000,
       .heads = 8,
       .kv_heads = 1,
       .dh = 128,
       .offset = 2999});
  add({.label = "decode GQA 8/4",
       .tq = 1,
       .tk = 37,
       .heads = 8,
       .kv_heads = 4,
       .dh = 64,
       .offset = 36,
       .block_size = 4});
  add({.label = "short chunk",
       .tq = 5,
       .tk = 600,
       .heads = 4,
       .kv_heads = 2,
       .dh = 128,
       .offset = 595});
  add({.label = "fallback head size 80",
       .tq = 100,
       .tk = 100,
       .heads = 4,
       .kv_heads = 2,
       .dh = 80});
  add({.label = "fallback head size 256 decode",
       .tq = 3,
       .tk = 700,
       .heads = 2,
       .kv_heads = 1,
       .dh = 256,
       .offset = 697});
  add({.label = "maps docs offset GQA 8/4",
       .tq = 20,
       .tk = 60,
       .heads = 8,
       .kv_heads = 4,
       .dh = 128,
       .offset = 40,
       .doc_lengths = {35, 25},
       .want_maps = true});
  add({.label = "probs only (flash-sized)",
       .tq = 48,
       .tk = 48,
       .heads = 2,
       .kv_heads = 1,
       .dh = 64,
       .want_probs_only = true});
  return shapes;
}

// Every case of the table, in order.
inline std::vector<ParityResult> RunParitySuite(CudaBackend& gpu, uint64_t seed = 2024) {
  std::mt19937_64 rng(seed);
  std::vector<ParityResult> r;
  // Each case frees its weights, and the next may get the same host addresses: drop the
  // backend's upload cache (keyed by address) after each.
  auto add = [&](ParityResult p) {
    r.push_back(std::move(p));
    gpu.ForgetWeights();
  };
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0}) {
    add(MatMulCase(gpu, rng, t, 1, 64, 96, false));
    add(MatMulCase(gpu, rng, t, 17, 256, 160, true));
    add(EmbeddingCase(gpu, rng, t));
    add(MatMulBackwardInputCase(gpu, rng, t, 17, 160, 256));
  }
  add(NormCase(gpu, rng, false, 64, DType::kF32, false));
  add(NormCase(gpu, rng, false, 4096, DType::kBF16, false));
  add(NormCase(gpu, rng, true, 96, DType::kF32, true));
  add(NormCase(gpu, rng, true, 4096, DType::kF16, false));
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalfSplit}) {
    for (int dh : {64, 128}) add(RopeCase(gpu, rng, style, dh));
  }
  for (int kind = 0; kind < 3; ++kind) add(ElementwiseCase(gpu, rng, kind));
  add(StoreKvCase(gpu, rng));
  for (const AttnShape& s : AttentionShapes()) {
    for (ParityResult& p : AttentionCase(gpu, rng, s)) r.push_back(std::move(p));
  }
  add(AttentionBatchCase(gpu, rng));
  for (const AttnShape& s : AttentionBackwardShapes()) {
    for (ParityResult& p : AttentionBackwardCase(gpu, rng, s)) r.push_back(std::move(p));
  }
  return r;
}

}  // namespace kvlens::kernels::cuda::parity

#endif  // KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_H_
