// Parity cases of the matrix, row and elementwise ops (cuda_parity.h).
#ifndef KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_OPS_H_
#define KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_OPS_H_

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/matvec.h"
#include "tests/kernels/cuda/cuda_parity_util.h"

namespace kvlens::kernels::cuda::parity {

// ---------------------------------------------------------------------------------------
// Elementwise and row ops.

// GELU's tanh form in float, as the GPU's kernels compute it (GeluKernel, GeGluKernel, the
// matvec's epilogues).
inline float NaiveGeluTanh(float g) {
  return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// The naive low-precision MatMul: y[r, o] = Σ_i x[r, i] · W[o, i] (+ bias[o]), inputs
// rounded as the GPU rounds them, products summed in float. Up to kMatVecMaxRows rows,
// f16/bf16 weights meet x in fp32 (the matvec kernel); past it x is rounded to the
// weight's dtype for the tensor cores.
inline std::vector<double> NaiveMatMul(const std::vector<double>& x, int n, int in,
                                       const OwnedWeight& w, const OwnedWeight* bias) {
  const DType dtype = w.view().dtype;
  const DType x_dtype = n <= kMatVecMaxRows ? DType::kF32 : dtype;
  const int64_t out = w.view().rows;
  std::vector<double> y(size_t(n) * out);
  for (int r = 0; r < n; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      float sum = 0.0f;
      for (int i = 0; i < in; ++i) {
        sum += static_cast<float>(RoundTo(x_dtype, x[size_t(r) * in + i])) *
               static_cast<float>(RoundTo(dtype, w.values()[size_t(o) * in + i]));
      }
      y[size_t(r) * out + o] = bias != nullptr ? sum + static_cast<float>(bias->values()[o]) : sum;
    }
  }
  return y;
}

// MatMul (MatMulGelu with gelu: GPT-2's c_fc and its activation, the naive run's GELU in
// float) against the reference in double.
inline ParityResult MatMulCase(CudaBackend& gpu, std::mt19937_64& rng, DType dtype, int n, int in,
                               int out, bool with_bias, bool gelu = false) {
  const std::string name =
      absl::StrCat(gelu ? "MatMulGelu " : "MatMul ", std::string(DTypeName(dtype)), " n=", n,
                   " in=", in, " out=", out, with_bias ? " +bias" : "");
  const std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * in);
  const OwnedWeight w(kernels::testing::RandomVector(rng, size_t(out) * in), out, in, dtype);
  const OwnedWeight b(kernels::testing::RandomVector(rng, out), 1, out, DType::kF32);
  const WeightView bias = with_bias ? b.view() : WeightView{};
  std::vector<double> ref(size_t(n) * out);
  std::vector<double> naive = NaiveMatMul(x, n, in, w, with_bias ? &b : nullptr);
  if (gelu) {
    ReferenceBackend().MatMulGelu(x.data(), n, w.view(), bias, ref.data());
    for (double& v : naive) {
      const float g = static_cast<float>(v);
      v = NaiveGeluTanh(g);
    }
  } else {
    ReferenceBackend().MatMul(x.data(), n, w.view(), bias, ref.data());
  }
  auto dx = ToDevice(x);
  auto dy = ToDevice(std::vector<double>(ref.size(), kNaN));
  if (!dx.ok() || !dy.ok()) return Failed(name, !dx.ok() ? dx.status() : dy.status());
  if (gelu) {
    gpu.MatMulGelu(dx->as<float>(), n, w.view(), bias, dy->as<float>());
  } else {
    gpu.MatMul(dx->as<float>(), n, w.view(), bias, dy->as<float>());
  }
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

// The norm in float, as the GPU computes it (mean and sum of squares in float).
inline std::vector<double> NaiveNorm(const std::vector<double>& x, int n, int dim, bool layer_norm,
                                     const OwnedWeight& g, const OwnedWeight* b, double eps) {
  std::vector<double> naive(x.size());
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
      if (b != nullptr) y += static_cast<float>(b->values()[i]);
      naive[size_t(r) * dim + i] = y;
    }
  }
  return naive;
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
  std::vector<double> ref(x.size());
  if (layer_norm) {
    ReferenceBackend().LayerNorm(x.data(), n, dim, g.view(), bias, eps, ref.data());
  } else {
    ReferenceBackend().RmsNorm(x.data(), n, dim, g.view(), eps, ref.data());
  }
  const std::vector<double> naive =
      NaiveNorm(x, n, dim, layer_norm, g, with_bias ? &b : nullptr, eps);
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

// AddRmsNorm / AddLayerNorm: x += residual, then the norm. Judged on the new x and y
// together, against the reference's default (Add, then the norm, in double).
inline ParityResult AddNormCase(CudaBackend& gpu, std::mt19937_64& rng, bool layer_norm, int dim,
                                DType dtype) {
  const std::string name = absl::StrCat(layer_norm ? "AddLayerNorm" : "AddRmsNorm", " dim=", dim,
                                        " ", std::string(DTypeName(dtype)));
  const int n = 3;
  const double eps = 1e-5;
  const std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * dim, -3, 3);
  const std::vector<double> res = kernels::testing::RandomFloatExact(rng, x.size(), -3, 3);
  const OwnedWeight g(kernels::testing::RandomVector(rng, dim, 0.5, 1.5), 1, dim, dtype);
  const OwnedWeight b(kernels::testing::RandomVector(rng, dim), 1, dim, dtype);
  std::vector<double> x_ref = x, y_ref(x.size());
  if (layer_norm) {
    ReferenceBackend().AddLayerNorm(x_ref.data(), res.data(), n, dim, g.view(), b.view(), eps,
                                    y_ref.data());
  } else {
    ReferenceBackend().AddRmsNorm(x_ref.data(), res.data(), n, dim, g.view(), eps, y_ref.data());
  }
  std::vector<double> x_naive(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x_naive[i] = static_cast<float>(x[i]) + static_cast<float>(res[i]);
  }
  std::vector<double> naive = x_naive, ref = x_ref;
  const std::vector<double> y_naive =
      NaiveNorm(x_naive, n, dim, layer_norm, g, layer_norm ? &b : nullptr, eps);
  naive.insert(naive.end(), y_naive.begin(), y_naive.end());
  ref.insert(ref.end(), y_ref.begin(), y_ref.end());
  auto dx = ToDevice(x);
  auto dr = ToDevice(res);
  auto dy = ToDevice(std::vector<double>(x.size(), kNaN));
  if (!dx.ok() || !dr.ok() || !dy.ok()) return Failed(name, absl::InternalError("upload"));
  if (layer_norm) {
    gpu.AddLayerNorm(dx->as<float>(), dr->as<float>(), n, dim, g.view(), b.view(), eps,
                     dy->as<float>());
  } else {
    gpu.AddRmsNorm(dx->as<float>(), dr->as<float>(), n, dim, g.view(), eps, dy->as<float>());
  }
  auto got_x = FromDevice(gpu, *dx, x.size());
  auto got_y = FromDevice(gpu, *dy, x.size());
  if (!got_x.ok() || !got_y.ok()) {
    return Failed(name, !got_x.ok() ? got_x.status() : got_y.status());
  }
  std::vector<double> got = *got_x;
  got.insert(got.end(), got_y->begin(), got_y->end());
  return Judge(name, got, naive, ref);
}

// The products of MatMulManyCase and NormedMatMulCase, output by output (ws[1] with the
// bias b): the reference's MatMul of each in double, and NaiveMatMul of each.
inline std::vector<double> ReferenceMany(const std::vector<double>& x, int n,
                                         const std::vector<OwnedWeight>& ws, const OwnedWeight& b) {
  std::vector<double> ref;
  for (size_t i = 0; i < ws.size(); ++i) {
    std::vector<double> r(size_t(n) * ws[i].view().rows);
    ReferenceBackend().MatMul(x.data(), n, ws[i].view(), i == 1 ? b.view() : WeightView{},
                              r.data());
    ref.insert(ref.end(), r.begin(), r.end());
  }
  return ref;
}
inline std::vector<double> NaiveMany(const std::vector<double>& x, int n, int in,
                                     const std::vector<OwnedWeight>& ws, const OwnedWeight& b) {
  std::vector<double> naive;
  for (size_t i = 0; i < ws.size(); ++i) {
    const std::vector<double> nv = NaiveMatMul(x, n, in, ws[i], i == 1 ? &b : nullptr);
    naive.insert(naive.end(), nv.begin(), nv.end());
  }
  return naive;
}

// The gated products of MatMulGatedCase and NormedMatMulCase, silu (gelu_tanh with geglu)
// of x·W_gateᵀ times x·W_upᵀ: the reference's MatMulSwiGlu (MatMulGeGlu) in double, and
// NaiveMatMul of each, gated in float.
inline std::vector<double> ReferenceGated(const std::vector<double>& x, int n,
                                          const OwnedWeight& wg, const OwnedWeight& wu,
                                          bool geglu) {
  std::vector<double> ref(size_t(n) * wg.view().rows), scratch(ref.size());
  if (geglu) {
    ReferenceBackend().MatMulGeGlu(x.data(), n, wg.view(), wu.view(), scratch.data(), ref.data());
  } else {
    ReferenceBackend().MatMulSwiGlu(x.data(), n, wg.view(), wu.view(), scratch.data(), ref.data());
  }
  return ref;
}
inline std::vector<double> NaiveGated(const std::vector<double>& x, int n, int in,
                                      const OwnedWeight& wg, const OwnedWeight& wu, bool geglu) {
  const std::vector<double> gate = NaiveMatMul(x, n, in, wg, nullptr),
                            up = NaiveMatMul(x, n, in, wu, nullptr);
  std::vector<double> naive(gate.size());
  for (size_t e = 0; e < naive.size(); ++e) {
    const float g = static_cast<float>(gate[e]);
    const float a = geglu ? NaiveGeluTanh(g) : g / (1.0f + std::exp(-g));
    naive[e] = a * static_cast<float>(up[e]);
  }
  return naive;
}

// MatMulMany: three products of one x (q, k, v shaped: outs 48, 16, 16; the second with a
// bias), judged together against the reference's MatMul of each. mixed: the third weight
// in f32, so no single matvec launch can take them (each product its own MatMul).
inline ParityResult MatMulManyCase(CudaBackend& gpu, std::mt19937_64& rng, DType dtype, int n,
                                   int in, bool mixed) {
  const std::string name = absl::StrCat("MatMulMany ", std::string(DTypeName(dtype)), " n=", n,
                                        " in=", in, " outs=48,16+bias,16", mixed ? " (mixed)" : "");
  const std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * in);
  const int outs[3] = {48, 16, 16};
  std::vector<OwnedWeight> ws;
  for (int i = 0; i < 3; ++i) {
    ws.emplace_back(kernels::testing::RandomVector(rng, size_t(outs[i]) * in), outs[i], in,
                    mixed && i == 2 ? DType::kF32 : dtype);
  }
  const OwnedWeight b(kernels::testing::RandomVector(rng, outs[1]), 1, outs[1], DType::kF32);
  const std::vector<double> ref = ReferenceMany(x, n, ws, b), naive = NaiveMany(x, n, in, ws, b);
  auto dx = ToDevice(x);
  auto dy = ToDevice(std::vector<double>(ref.size(), kNaN));
  if (!dx.ok() || !dy.ok()) return Failed(name, !dx.ok() ? dx.status() : dy.status());
  float* y = dy->as<float>();
  const MatMulOutput<float> outputs[] = {{ws[0].view(), WeightView{}, y},
                                         {ws[1].view(), b.view(), y + size_t(n) * outs[0]},
                                         {ws[2].view(), WeightView{}, y + size_t(n) * 64}};
  gpu.MatMulMany(dx->as<float>(), n, outputs);
  auto got = FromDevice(gpu, *dy, ref.size());
  if (!got.ok()) return Failed(name, got.status());
  return Judge(name, *got, naive, ref);
}

// MatMulSwiGlu: silu(x·W_gateᵀ) ⊙ x·W_upᵀ (MatMulGeGlu with geglu: gelu_tanh for silu)
// against the reference's default (two products and the gate in double). Naive:
// NaiveMatMul of each, gated in float.
inline ParityResult MatMulGatedCase(CudaBackend& gpu, std::mt19937_64& rng, DType dtype, int n,
                                    int in, int out, bool geglu = false) {
  const std::string name =
      absl::StrCat(geglu ? "MatMulGeGlu " : "MatMulSwiGlu ", std::string(DTypeName(dtype)),
                   " n=", n, " in=", in, " out=", out);
  const std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * in);
  const OwnedWeight wg(kernels::testing::RandomVector(rng, size_t(out) * in), out, in, dtype);
  const OwnedWeight wu(kernels::testing::RandomVector(rng, size_t(out) * in), out, in, dtype);
  const std::vector<double> ref = ReferenceGated(x, n, wg, wu, geglu),
                            naive = NaiveGated(x, n, in, wg, wu, geglu);
  auto dx = ToDevice(x);
  auto dscratch = ToDevice(std::vector<double>(ref.size(), kNaN));
  auto dy = ToDevice(std::vector<double>(ref.size(), kNaN));
  if (!dx.ok() || !dscratch.ok() || !dy.ok()) return Failed(name, absl::InternalError("upload"));
  if (geglu) {
    gpu.MatMulGeGlu(dx->as<float>(), n, wg.view(), wu.view(), dscratch->as<float>(),
                    dy->as<float>());
  } else {
    gpu.MatMulSwiGlu(dx->as<float>(), n, wg.view(), wu.view(), dscratch->as<float>(),
                     dy->as<float>());
  }
  auto y = FromDevice(gpu, *dy, ref.size());
  if (!y.ok()) return Failed(name, y.status());
  return Judge(name, *y, naive, ref);
}

// The pre-norm products (kind 0 RmsNormMatMulMany with MatMulManyCase's three outputs,
// 1 RmsNormMatMulSwiGlu, 2 RmsNormMatMulGeGlu with 40 outputs) against the reference's
// defaults: the norm, then the products, in double. Naive: NaiveNorm in float, then
// NaiveMatMul of its rows (gated in float). xn starts NaN-filled: with `fused` (the matvec
// normalizes x itself) it must come back untouched, as no norm launch wrote it; else it
// must hold the norm, judged with the products.
inline ParityResult NormedMatMulCase(CudaBackend& gpu, std::mt19937_64& rng, int kind, DType dtype,
                                     DType norm_dtype, int n, int in, bool fused) {
  static constexpr const char* kOps[] = {"RmsNormMatMulMany", "RmsNormMatMulSwiGlu",
                                         "RmsNormMatMulGeGlu"};
  const std::string name = absl::StrCat(kOps[kind], " ", std::string(DTypeName(dtype)), " norm ",
                                        std::string(DTypeName(norm_dtype)), " n=", n, " in=", in,
                                        fused ? " (fused)" : " (norm launched)");
  const double eps = 1e-5;
  const std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * in, -3, 3);
  const OwnedWeight g(kernels::testing::RandomVector(rng, in, 0.5, 1.5), 1, in, norm_dtype);
  const std::vector<int> outs = kind == 0 ? std::vector<int>{48, 16, 16} : std::vector<int>{40, 40};
  std::vector<OwnedWeight> ws;
  for (int o : outs) {
    ws.emplace_back(kernels::testing::RandomVector(rng, size_t(o) * in), o, in, dtype);
  }
  const OwnedWeight b(kernels::testing::RandomVector(rng, outs[1]), 1, outs[1], DType::kF32);
  // The reference: its RmsNorm, then its products of the normalized rows.
  std::vector<double> xn_ref(x.size()), ref, naive;
  ReferenceBackend().RmsNorm(x.data(), n, in, g.view(), eps, xn_ref.data());
  const std::vector<double> xn_naive = NaiveNorm(x, n, in, false, g, nullptr, eps);
  if (kind == 0) {
    ref = ReferenceMany(xn_ref, n, ws, b);
    naive = NaiveMany(xn_naive, n, in, ws, b);
  } else {
    ref = ReferenceGated(xn_ref, n, ws[0], ws[1], kind == 2);
    naive = NaiveGated(xn_naive, n, in, ws[0], ws[1], kind == 2);
  }
  auto dx = ToDevice(x);
  auto dxn = ToDevice(std::vector<double>(x.size(), kNaN));
  auto dscratch = ToDevice(std::vector<double>(ref.size(), kNaN));
  auto dy = ToDevice(std::vector<double>(ref.size(), kNaN));
  if (!dx.ok() || !dxn.ok() || !dscratch.ok() || !dy.ok()) {
    return Failed(name, absl::InternalError("upload"));
  }
  float* y = dy->as<float>();
  if (kind == 0) {
    const MatMulOutput<float> outputs[] = {{ws[0].view(), WeightView{}, y},
                                           {ws[1].view(), b.view(), y + size_t(n) * outs[0]},
                                           {ws[2].view(), WeightView{}, y + size_t(n) * 64}};
    gpu.RmsNormMatMulMany(dx->as<float>(), n, in, g.view(), eps, dxn->as<float>(), outputs);
  } else if (kind == 1) {
    gpu.RmsNormMatMulSwiGlu(dx->as<float>(), n, in, g.view(), eps, dxn->as<float>(), ws[0].view(),
                            ws[1].view(), dscratch->as<float>(), y);
  } else {
    gpu.RmsNormMatMulGeGlu(dx->as<float>(), n, in, g.view(), eps, dxn->as<float>(), ws[0].view(),
                           ws[1].view(), dscratch->as<float>(), y);
  }
  auto got = FromDevice(gpu, *dy, ref.size());
  auto got_xn = FromDevice(gpu, *dxn, x.size());
  if (!got.ok() || !got_xn.ok()) return Failed(name, !got.ok() ? got.status() : got_xn.status());
  if (fused) {
    for (double v : *got_xn) {
      if (!std::isnan(v)) return Failed(name, absl::InternalError("xn written: no fused norm"));
    }
    return Judge(name, *got, naive, ref);
  }
  std::vector<double> all = *got_xn;
  all.insert(all.end(), got->begin(), got->end());
  naive.insert(naive.begin(), xn_naive.begin(), xn_naive.end());
  ref.insert(ref.begin(), xn_ref.begin(), xn_ref.end());
  return Judge(name, all, naive, ref);
}

// MatMulAddTo: y += x · Wᵀ (+ bias), y starting from random values, against the reference's
// default (MatMul, then Add, in double). Naive: NaiveMatMul, added to y in float.
inline ParityResult MatMulAddToCase(CudaBackend& gpu, std::mt19937_64& rng, DType dtype, int n,
                                    int in, int out, bool with_bias) {
  const std::string name = absl::StrCat("MatMulAddTo ", std::string(DTypeName(dtype)), " n=", n,
                                        " in=", in, " out=", out, with_bias ? " +bias" : "");
  const std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * in);
  const std::vector<double> y0 = kernels::testing::RandomFloatExact(rng, size_t(n) * out, -4, 4);
  const OwnedWeight w(kernels::testing::RandomVector(rng, size_t(out) * in), out, in, dtype);
  const OwnedWeight b(kernels::testing::RandomVector(rng, out), 1, out, DType::kF32);
  const WeightView bias = with_bias ? b.view() : WeightView{};
  std::vector<double> ref = y0, scratch(y0.size());
  ReferenceBackend().MatMulAddTo(x.data(), n, w.view(), bias, scratch.data(), ref.data());
  std::vector<double> naive = NaiveMatMul(x, n, in, w, with_bias ? &b : nullptr);
  for (size_t e = 0; e < naive.size(); ++e) {
    naive[e] = static_cast<float>(y0[e]) + static_cast<float>(naive[e]);
  }
  auto dx = ToDevice(x);
  auto dy = ToDevice(y0);
  auto dscratch = ToDevice(std::vector<double>(y0.size(), kNaN));
  if (!dx.ok() || !dy.ok() || !dscratch.ok()) return Failed(name, absl::InternalError("upload"));
  gpu.MatMulAddTo(dx->as<float>(), n, w.view(), bias, dscratch->as<float>(), dy->as<float>());
  auto got = FromDevice(gpu, *dy, y0.size());
  if (!got.ok()) return Failed(name, got.status());
  return Judge(name, *got, naive, ref);
}

// RoPE in place on x [n, heads, Dh] (rows stride apart) as the GPU computes it: angles in
// double, rotation in float.
inline void NaiveRope(std::vector<double>& x, int n, int64_t stride, int heads, int head_dim,
                      const std::vector<int32_t>& positions, const RopeSpec& rope) {
  const double theta = rope.theta;
  const RopeStyle style = rope.style;
  const int half = head_dim / 2;
  for (int r = 0; r < n; ++r) {
    for (int h = 0; h < heads; ++h) {
      double* head = x.data() + r * stride + int64_t{h} * head_dim;
      for (int p = 0; p < half; ++p) {
        const double factor = rope.freq_factors != nullptr ? rope.freq_factors[p] : 1.0;
        const double angle = positions[r] * std::pow(theta, -2.0 * p / head_dim) / factor;
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
}

inline ParityResult RopeCase(CudaBackend& gpu, std::mt19937_64& rng, RopeStyle style,
                             int head_dim) {
  const std::string name = absl::StrCat(
      "Rope ", style == RopeStyle::kAdjacentPairs ? "adjacent" : "half-split", " Dh=", head_dim);
  const int n = 5, heads = 3;
  const int64_t stride = int64_t{heads} * head_dim + 16;  // rows wider than the heads
  const RopeSpec rope{10000.0, style};
  const std::vector<int32_t> positions = {0, 1, 17, 4095, 100000};
  std::vector<double> x = kernels::testing::RandomFloatExact(rng, size_t(n) * stride, -2, 2);
  std::vector<double> ref = x, naive = x;
  ReferenceBackend().Rope(ref.data(), n, stride, heads, head_dim, positions.data(), rope);
  NaiveRope(naive, n, stride, heads, head_dim, positions, rope);
  auto dx = ToDevice(x);
  if (!dx.ok()) return Failed(name, dx.status());
  gpu.Rope(dx->as<float>(), n, stride, heads, head_dim, positions.data(), rope);
  auto y = FromDevice(gpu, *dx, x.size());
  if (!y.ok()) return Failed(name, y.status());
  return Judge(name, *y, naive, ref);
}

// RopeQK: q with 4 heads and k with 2 (GQA), rows of different widths, one launch; judged
// on q and k together against the reference's two Rope calls.
inline ParityResult RopeQKCase(CudaBackend& gpu, std::mt19937_64& rng, RopeStyle style,
                               int head_dim) {
  const std::string name =
      absl::StrCat("RopeQK ", style == RopeStyle::kAdjacentPairs ? "adjacent" : "half-split",
                   " Dh=", head_dim, " heads 4/2");
  const int n = 4, qh = 4, kh = 2;
  const int64_t qs = int64_t{qh} * head_dim + 8, ks = int64_t{kh} * head_dim + 4;
  const RopeSpec rope{500000.0, style};
  const std::vector<int32_t> positions = {3, 0, 70000, 9};
  const std::vector<double> q = kernels::testing::RandomFloatExact(rng, size_t(n) * qs, -2, 2);
  const std::vector<double> k = kernels::testing::RandomFloatExact(rng, size_t(n) * ks, -2, 2);
  std::vector<double> q_ref = q, k_ref = k, q_naive = q, k_naive = k;
  ReferenceBackend().RopeQK(q_ref.data(), qs, qh, k_ref.data(), ks, kh, n, head_dim,
                            positions.data(), rope);
  NaiveRope(q_naive, n, qs, qh, head_dim, positions, rope);
  NaiveRope(k_naive, n, ks, kh, head_dim, positions, rope);
  auto dq = ToDevice(q);
  auto dk = ToDevice(k);
  if (!dq.ok() || !dk.ok()) return Failed(name, !dq.ok() ? dq.status() : dk.status());
  gpu.RopeQK(dq->as<float>(), qs, qh, dk->as<float>(), ks, kh, n, head_dim, positions.data(), rope);
  auto gq = FromDevice(gpu, *dq, q.size());
  auto gk = FromDevice(gpu, *dk, k.size());
  if (!gq.ok() || !gk.ok()) return Failed(name, !gq.ok() ? gq.status() : gk.status());
  std::vector<double> got = *gq, naive = q_naive, ref = q_ref;
  got.insert(got.end(), gk->begin(), gk->end());
  naive.insert(naive.end(), k_naive.begin(), k_naive.end());
  ref.insert(ref.end(), k_ref.begin(), k_ref.end());
  return Judge(name, got, naive, ref);
}

// kind: 0 Gelu, 1 SwiGlu, 2 Add, 3 GeGlu (into its gate), 4 Scale by √2048 (Gemma's
// embeddings), 5 SoftCap at 5 (of values within ±8: some saturate)
inline ParityResult ElementwiseCase(CudaBackend& gpu, std::mt19937_64& rng, int kind) {
  const char* names[] = {"Gelu", "SwiGlu", "Add", "GeGlu", "Scale", "SoftCap"};
  const double factor = std::sqrt(2048.0);
  const std::string name = names[kind];
  const int64_t count = 10007;
  const std::vector<double> a = kernels::testing::RandomFloatExact(rng, count, -8, 8);
  const std::vector<double> b = kernels::testing::RandomFloatExact(rng, count, -8, 8);
  std::vector<double> ref = a, naive(count);
  ReferenceBackend reference;
  if (kind == 0) reference.Gelu(ref.data(), count);
  if (kind == 1) reference.SwiGlu(a.data(), b.data(), count, ref.data());
  if (kind == 2) reference.Add(ref.data(), b.data(), count);
  if (kind == 3) reference.GeGlu(a.data(), b.data(), count, ref.data());
  if (kind == 4) reference.Scale(ref.data(), count, factor);
  if (kind == 5) reference.SoftCap(ref.data(), count, 5.0);
  for (int64_t i = 0; i < count; ++i) {
    const float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    if (kind == 0) {
      naive[i] = NaiveGeluTanh(x);
    } else if (kind == 1) {
      naive[i] = x / (1.0f + std::exp(-x)) * y;
    } else if (kind == 3) {
      naive[i] = NaiveGeluTanh(x) * y;
    } else if (kind == 4) {
      naive[i] = x * static_cast<float>(factor);
    } else if (kind == 5) {
      naive[i] = 5.0f * std::tanh(x / 5.0f);
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
  if (kind == 3) gpu.GeGlu(da->as<float>(), db->as<float>(), count, da->as<float>());
  if (kind == 4) gpu.Scale(da->as<float>(), count, factor);
  if (kind == 5) gpu.SoftCap(da->as<float>(), count, 5.0);
  auto y = FromDevice(gpu, *result, count);
  if (!y.ok()) return Failed(name, y.status());
  return Judge(name, *y, naive, ref);
}

// StoreKv's inputs: n rows of k and v (src_stride apart) and their distinct destination
// rows among cache_rows, shuffled, one of them (padding_row) −1: a padding row.
struct StoreKvInputs {
  std::vector<double> k, v;
  std::vector<int64_t> rows;
};
inline StoreKvInputs MakeStoreKvInputs(std::mt19937_64& rng, int n, int64_t src_stride,
                                       int cache_rows, int padding_row) {
  StoreKvInputs in;
  in.k = kernels::testing::RandomFloatExact(rng, size_t(n) * src_stride);
  in.v = kernels::testing::RandomFloatExact(rng, size_t(n) * src_stride);
  in.rows.resize(cache_rows);
  std::iota(in.rows.begin(), in.rows.end(), 0);
  std::shuffle(in.rows.begin(), in.rows.end(), rng);
  in.rows.resize(n);
  in.rows[padding_row] = -1;  // stored nowhere
  return in;
}

inline ParityResult StoreKvCase(CudaBackend& gpu, std::mt19937_64& rng) {
  const std::string name = "StoreKv into a NaN-filled cache (one padding row)";
  const int n = 6, cache_rows = 40;
  const int64_t row_elems = 24, src_stride = 30, cache_stride = 32;
  const auto [k, v, rows] = MakeStoreKvInputs(rng, n, src_stride, cache_rows, 2);
  std::vector<double> k_ref(size_t(cache_rows) * cache_stride, kNaN), v_ref = k_ref;
  ReferenceBackend().StoreKv(k.data(), v.data(), n, src_stride, row_elems, rows.data(),
                             k_ref.data(), v_ref.data(), cache_stride, KvDtype::kActivation);
  auto dk = ToDevice(k);
  auto dv = ToDevice(v);
  auto dkc = ToDevice(std::vector<double>(k_ref.size(), kNaN));
  auto dvc = ToDevice(std::vector<double>(k_ref.size(), kNaN));
  if (!dk.ok() || !dv.ok() || !dkc.ok() || !dvc.ok()) {
    return Failed(name, absl::InternalError("upload"));
  }
  gpu.StoreKv(dk->as<float>(), dv->as<float>(), n, src_stride, row_elems, rows.data(),
              dkc->as<float>(), dvc->as<float>(), cache_stride, KvDtype::kActivation);
  auto kc = FromDevice(gpu, *dkc, k_ref.size());
  auto vc = FromDevice(gpu, *dvc, k_ref.size());
  if (!kc.ok() || !vc.ok()) return Failed(name, !kc.ok() ? kc.status() : vc.status());
  kc->insert(kc->end(), vc->begin(), vc->end());
  k_ref.insert(k_ref.end(), v_ref.begin(), v_ref.end());
  return Judge(name, *kc, k_ref, k_ref);  // a copy: exact
}

// RopeQKStoreKv (one launch on the GPU) against the reference's RopeQK and StoreKv: q and
// k rotated, k's rotated rows and v's rows in a NaN-filled cache at shuffled rows, one of
// them a padding row. Judged on q, k and both caches together. `scaled`: with frequency
// factors (Llama 3.1's rope scaling, as convert_hf_to_gguf.py computes them for factor 8).
inline ParityResult RopeQKStoreKvCase(CudaBackend& gpu, std::mt19937_64& rng, bool scaled) {
  const std::string name =
      absl::StrCat("RopeQKStoreKv half-split Dh=64 heads 4/2 (one padding row)",
                   scaled ? ", Llama 3.1 frequency factors" : "");
  const int n = 5, qh = 4, kh = 2, dh = 64, cache_rows = 24;
  const int64_t qs = int64_t{qh} * dh + 8, kvs = int64_t{kh} * dh + 4, cache_stride = kh * dh + 12;
  std::vector<float> factors(dh / 2);
  for (int p = 0; p < dh / 2; ++p) {  // 1 (high frequencies) … 8 (low), smooth between
    factors[p] = static_cast<float>(1.0 + 7.0 * std::clamp((p - 10.0) / 12.0, 0.0, 1.0));
  }
  const RopeSpec rope{10000.0, RopeStyle::kHalfSplit, scaled ? factors.data() : nullptr};
  const std::vector<int32_t> positions = {0, 7, 300, 12, 5};
  const std::vector<double> q = kernels::testing::RandomFloatExact(rng, size_t(n) * qs, -2, 2);
  const std::vector<double> k = kernels::testing::RandomFloatExact(rng, size_t(n) * kvs, -2, 2);
  const std::vector<double> v = kernels::testing::RandomFloatExact(rng, size_t(n) * kvs, -2, 2);
  std::vector<int64_t> rows(cache_rows);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(n);
  rows[3] = -1;  // a padding row: rotated, stored nowhere
  std::vector<double> q_ref = q, k_ref = k, q_naive = q, k_naive = k;
  std::vector<double> kc_ref(size_t(cache_rows) * cache_stride, kNaN), vc_ref = kc_ref;
  ReferenceBackend().RopeQKStoreKv(q_ref.data(), qs, qh, k_ref.data(), v.data(), kvs, kh, n, dh,
                                   positions.data(), rope, rows.data(), kc_ref.data(),
                                   vc_ref.data(), cache_stride, KvDtype::kActivation);
  NaiveRope(q_naive, n, qs, qh, dh, positions, rope);
  NaiveRope(k_naive, n, kvs, kh, dh, positions, rope);
  std::vector<double> kc_naive = kc_ref, vc_naive = vc_ref;  // NaN where nothing is stored
  for (int r = 0; r < n; ++r) {
    if (rows[r] < 0) continue;
    for (int64_t e = 0; e < int64_t{kh} * dh; ++e) {
      kc_naive[rows[r] * cache_stride + e] = k_naive[r * kvs + e];
      vc_naive[rows[r] * cache_stride + e] = v[r * kvs + e];
    }
  }
  auto dq = ToDevice(q);
  auto dk = ToDevice(k);
  auto dv = ToDevice(v);
  auto dkc = ToDevice(std::vector<double>(kc_ref.size(), kNaN));
  auto dvc = ToDevice(std::vector<double>(kc_ref.size(), kNaN));
  if (!dq.ok() || !dk.ok() || !dv.ok() || !dkc.ok() || !dvc.ok()) {
    return Failed(name, absl::InternalError("upload"));
  }
  gpu.RopeQKStoreKv(dq->as<float>(), qs, qh, dk->as<float>(), dv->as<float>(), kvs, kh, n, dh,
                    positions.data(), rope, rows.data(), dkc->as<float>(), dvc->as<float>(),
                    cache_stride, KvDtype::kActivation);
  std::vector<double> got, naive, ref;
  const std::pair<const DeviceBuffer*, size_t> outs[] = {
      {&*dq, q.size()}, {&*dk, k.size()}, {&*dkc, kc_ref.size()}, {&*dvc, kc_ref.size()}};
  for (const auto& [buffer, count] : outs) {
    auto y = FromDevice(gpu, *buffer, count);
    if (!y.ok()) return Failed(name, y.status());
    got.insert(got.end(), y->begin(), y->end());
  }
  for (const std::vector<double>* part : {&q_naive, &k_naive, &kc_naive, &vc_naive}) {
    naive.insert(naive.end(), part->begin(), part->end());
  }
  for (const std::vector<double>* part : {&q_ref, &k_ref, &kc_ref, &vc_ref}) {
    ref.insert(ref.end(), part->begin(), part->end());
  }
  return Judge(name, got, naive, ref);
}

// StoreKv into a bf16 cache against the reference's: every value rounded to nearest-even
// bf16 (the inputs are floats, so the reference's rounding through float is the same
// rounding), NaN wherever nothing is stored. Exact.
inline ParityResult StoreKvBf16Case(CudaBackend& gpu, std::mt19937_64& rng) {
  const std::string name = "StoreKv into a NaN-filled bf16 cache (one padding row)";
  const int n = 6, cache_rows = 40;
  const int64_t row_elems = 24, src_stride = 30, cache_stride = 28;
  const auto [k, v, rows] = MakeStoreKvInputs(rng, n, src_stride, cache_rows, 4);
  const size_t cache_elems = size_t(cache_rows) * cache_stride;
  std::vector<uint16_t> kb(cache_elems, 0xFFFF), vb(cache_elems, 0xFFFF);
  ReferenceBackend().StoreKv(k.data(), v.data(), n, src_stride, row_elems, rows.data(), kb.data(),
                             vb.data(), cache_stride, KvDtype::kBF16);
  std::vector<double> want(2 * cache_elems);
  for (size_t e = 0; e < cache_elems; ++e) {
    want[e] = BF16ToF32(kb[e]);
    want[cache_elems + e] = BF16ToF32(vb[e]);
  }
  auto dk = ToDevice(k);
  auto dv = ToDevice(v);
  auto dkc = ToDeviceBf16(std::vector<double>(cache_elems, kNaN));
  auto dvc = ToDeviceBf16(std::vector<double>(cache_elems, kNaN));
  if (!dk.ok() || !dv.ok() || !dkc.ok() || !dvc.ok()) {
    return Failed(name, absl::InternalError("upload"));
  }
  gpu.StoreKv(dk->as<float>(), dv->as<float>(), n, src_stride, row_elems, rows.data(), dkc->get(),
              dvc->get(), cache_stride, KvDtype::kBF16);
  auto kc = FromDeviceBf16(gpu, *dkc, cache_elems);
  auto vc = FromDeviceBf16(gpu, *dvc, cache_elems);
  if (!kc.ok() || !vc.ok()) return Failed(name, !kc.ok() ? kc.status() : vc.status());
  kc->insert(kc->end(), vc->begin(), vc->end());
  return Judge(name, *kc, want, want);  // a rounding of the same floats: exact
}

// RopeQKStoreKv into a bf16 cache: the cache holds exactly the bf16 rounding (on the host,
// kernels/dtype.h) of the k the kernel rotated, which it returns, and of v; NaN elsewhere.
// (The rotation itself is the float case's row.) Exact.
inline ParityResult RopeQKStoreKvBf16Case(CudaBackend& gpu, std::mt19937_64& rng) {
  const std::string name = "RopeQKStoreKv adjacent-pairs Dh=128 heads 8/2 into a bf16 cache";
  const int n = 4, qh = 8, kh = 2, dh = 128, cache_rows = 16;
  const int64_t qs = int64_t{qh} * dh, kvs = int64_t{kh} * dh, cache_stride = kh * dh;
  const std::vector<int32_t> positions = {3, 0, 1000, 17};
  const std::vector<double> q = kernels::testing::RandomFloatExact(rng, size_t(n) * qs, -2, 2);
  const std::vector<double> k = kernels::testing::RandomFloatExact(rng, size_t(n) * kvs, -2, 2);
  const std::vector<double> v = kernels::testing::RandomFloatExact(rng, size_t(n) * kvs, -2, 2);
  std::vector<int64_t> rows = {9, 2, -1, 14};
  const size_t cache_elems = size_t(cache_rows) * cache_stride;
  auto dq = ToDevice(q);
  auto dk = ToDevice(k);
  auto dv = ToDevice(v);
  auto dkc = ToDeviceBf16(std::vector<double>(cache_elems, kNaN));
  auto dvc = ToDeviceBf16(std::vector<double>(cache_elems, kNaN));
  if (!dq.ok() || !dk.ok() || !dv.ok() || !dkc.ok() || !dvc.ok()) {
    return Failed(name, absl::InternalError("upload"));
  }
  gpu.RopeQKStoreKv(dq->as<float>(), qs, qh, dk->as<float>(), dv->as<float>(), kvs, kh, n, dh,
                    positions.data(), RopeSpec{10000.0, RopeStyle::kAdjacentPairs}, rows.data(),
                    dkc->get(), dvc->get(), cache_stride, KvDtype::kBF16);
  auto rotated_k = FromDevice(gpu, *dk, k.size());
  auto kc = FromDeviceBf16(gpu, *dkc, cache_elems);
  auto vc = FromDeviceBf16(gpu, *dvc, cache_elems);
  if (!rotated_k.ok() || !kc.ok() || !vc.ok()) {
    return Failed(name, absl::InternalError("download"));
  }
  if (MaxErr(*rotated_k, k) == 0.0) return Failed(name, absl::InternalError("k was not rotated"));
  std::vector<double> want(2 * cache_elems, kNaN);
  for (int r = 0; r < n; ++r) {
    if (rows[r] < 0) continue;
    for (int64_t e = 0; e < kvs; ++e) {
      want[rows[r] * cache_stride + e] = RoundTo(DType::kBF16, (*rotated_k)[r * kvs + e]);
      want[cache_elems + rows[r] * cache_stride + e] = RoundTo(DType::kBF16, v[r * kvs + e]);
    }
  }
  kc->insert(kc->end(), vc->begin(), vc->end());
  return Judge(name, *kc, want, want);
}

}  // namespace kvlens::kernels::cuda::parity

#endif  // KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_OPS_H_
