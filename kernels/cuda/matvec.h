// Small-batch matrix products on f16/bf16 weights (matvec.cu): y = x·Wᵀ (+ bias) for at
// most kMatVecMaxRows rows of x, as in a decode step. A decode step's products are bound by
// reading the weights once; cuBLAS's tensor-core path first needs x rounded to the weight's
// dtype (one more kernel per product) and pays its per-call overhead on every one of a
// 7B model's 224 products a token. This kernel reads W in its dtype (8 values per 16-byte
// load), keeps x in fp32 and accumulates in fp32, and adds the bias in the same pass.
#ifndef KVLENS_KERNELS_CUDA_MATVEC_H_
#define KVLENS_KERNELS_CUDA_MATVEC_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"

namespace kvlens::kernels::cuda {

// Rows of x up to which CudaBackend uses LaunchMatVec for f16/bf16 weights. Past it x is
// re-read from L1 once per row pair of W for every row of x, and the GEMM wins.
inline constexpr int kMatVecMaxRows = 4;

// Whether n rows of x against weights stored in `dtype` take this kernel.
inline bool MatVecTakes(int n, DType dtype) {
  return n >= 1 && n <= kMatVecMaxRows && (dtype == DType::kF16 || dtype == DType::kBF16);
}

// Products of one x per launch (a layer's q, k and v).
inline constexpr int kMatVecMaxSegments = 4;

// One product of LaunchMatVec: y [n, out] = x · Wᵀ + bias (bias null or [out]).
struct MatVecProduct {
  const void* w;
  int64_t out;
  const void* bias;
  DType bias_dtype;
  float* y;
  bool gelu = false;        // y = gelu_tanh(x·Wᵀ + bias) (GeluKernel's form)
  bool accumulate = false;  // y += x·Wᵀ + bias (a residual: y is the residual stream)
};

// An RMSNorm of x's rows fused into the products that read it: each row is taken as
// x / √(mean(x²) + eps) · weight, as LaunchRmsNorm computes it, into each block's shared
// memory (the normalized rows never reach device memory). weight null: x as it is.
struct MatVecNorm {
  const void* weight = nullptr;  // [in] in `dtype` (kF32, kF16 or kBF16)
  DType dtype = DType::kF32;
  float eps = 0.0f;
};

// Whether n rows of width `in` fit a fused norm's shared memory without costing occupancy.
// One row: up to 8192 (32 KiB a block, and the 6 blocks an SM the kernel runs at n = 1 still
// fit in the H200's 227 KiB); more rows, whose kernels run 2 blocks an SM: n · in up to
// 24576 (96 KiB a block, opted in past 48 KiB): four rows of 6144, two of 12288.
inline constexpr int64_t kMatVecNormMaxRowFloats = 8 * 1024;
inline constexpr int64_t kMatVecNormMaxFloats = 24 * 1024;
inline bool MatVecNormFits(int n, int64_t in) {
  return n == 1 ? in <= kMatVecNormMaxRowFloats : int64_t{n} * in <= kMatVecNormMaxFloats;
}

// RoPE and the KV-cache store fused into the epilogue of a launch of a layer's q, k and v
// products (in that order): q's and k's outputs turned at their row's position as
// RopeQK turns them, k's and v's stored into the cache rows as StoreKv stores them
// (LaunchRopeQKStoreKv's results, bit for bit: the same angle, rotation and rounding).
// Each unit reads both rows of its rotation pairs: rows 2p and 2p + 1 of a head
// (kAdjacentPairs), or p and p + Dh/2 (kHalfSplit), so a unit's pairs stay in one head
// when Dh % 4 == 0 (MatVecRopeTakes).
struct MatVecRopeStore {
  const int32_t* positions = nullptr;  // device [n]
  RopeSpec rope;                       // freq_factors: device [Dh/2] or null
  int head_dim = 0;
  const int64_t* dst_rows = nullptr;  // device [n]; a negative row stores nothing
  void* k_cache = nullptr;            // float, or bf16 bits when bf16_cache
  void* v_cache = nullptr;
  int64_t cache_stride = 0;  // elements between cache rows
  bool bf16_cache = false;
};

// Whether LaunchMatVecRopeStore takes heads of head_dim: whole units of rotation pairs.
inline bool MatVecRopeTakes(int head_dim) { return head_dim > 0 && head_dim % 4 == 0; }

// y[r, o] = Σ_i x[r, i] · W[o, i] + bias[o] for r < n (1 … kMatVecMaxRows), for each of
// 1 … kMatVecMaxSegments products of the same x, in one launch, x normalized by `norm`
// where its weight is set. Every W is [out, in] in `dtype` (kF16 or kBF16); x [n, in]
// and each y [n, out] are row-major fp32 device arrays. fp32 products and sums.
absl::Status LaunchMatVec(const float* x, int n, int64_t in, const MatVecNorm& norm,
                          absl::Span<const MatVecProduct> products, DType dtype,
                          cudaStream_t stream);

// LaunchMatVec of q, k and v (qkv: exactly 3 plain products; q's rows a multiple of
// head_dim, k's and v's equal and a multiple of it), their outputs then turned and stored
// as MatVecRopeStore says. Takes in % 8 == 0 and 16-byte aligned x and weights only (the
// vectorized loop): the caller launches the plain ops otherwise.
absl::Status LaunchMatVecRopeStore(const float* x, int n, int64_t in, const MatVecNorm& norm,
                                   absl::Span<const MatVecProduct> qkv,
                                   const MatVecRopeStore& rope_store, DType dtype,
                                   cudaStream_t stream);

// The activation of a gated product's gate: SwiGLU's silu(g) = g / (1 + e^−g), or GeGLU's
// gelu_tanh(g) = g/2 · (1 + tanh(√(2/π) · (g + 0.044715 g³))) (as SwiGluKernel, GeGluKernel).
enum class GateActivation : uint8_t { kSilu, kGeluTanh };

// y[r, o] = act(g) · u with g = Σ_i x[r, i] · W_gate[o, i], u = Σ_i x[r, i] · W_up[o, i]:
// SwiGLU's or GeGLU's gated product in one pass, both weights [out, in] in `dtype` (kF16 or
// kBF16), x normalized by `norm` where its weight is set (as LaunchMatVec).
absl::Status LaunchMatVecGated(const float* x, int n, int64_t in, const MatVecNorm& norm,
                               const void* w_gate, const void* w_up, DType dtype, int64_t out,
                               GateActivation gate, float* y, cudaStream_t stream);

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_MATVEC_H_
