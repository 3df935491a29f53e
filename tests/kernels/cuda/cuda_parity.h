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

#include <random>
#include <vector>

#include "tests/kernels/cuda/cuda_parity_attention.h"
#include "tests/kernels/cuda/cuda_parity_backward.h"
#include "tests/kernels/cuda/cuda_parity_ops.h"
#include "tests/kernels/cuda/cuda_parity_qkv.h"
#include "tests/kernels/cuda/cuda_parity_util.h"

namespace kvlens::kernels::cuda::parity {

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
    add(MatMulCase(gpu, rng, t, 2, 512, 33, true));  // odd out: a warp's second row missing
    // in % 8 != 0: one element at a time (q8_0 needs whole blocks of 32).
    add(MatMulCase(gpu, rng, t, 3, t == DType::kQ8_0 ? 96 : 100, 37, true));
    add(MatMulCase(gpu, rng, t, 17, 256, 160, true));
    add(EmbeddingCase(gpu, rng, t));
    add(MatMulBackwardInputCase(gpu, rng, t, 17, 160, 256));
    add(MatMulManyCase(gpu, rng, t, 1, 256, false));
    add(MatMulManyCase(gpu, rng, t, 3, t == DType::kQ8_0 ? 96 : 100, false));
    add(MatMulGatedCase(gpu, rng, t, 1, 256, 40));
    add(MatMulGatedCase(gpu, rng, t, 3, t == DType::kQ8_0 ? 96 : 100, 33));
  }
  // ggml's other block types, dequantised to f16 at upload (rows of whole blocks).
  for (DType t : {DType::kQ4_0, DType::kQ4_K, DType::kQ6_K, DType::kIQ4_XS}) {
    add(MatMulCase(gpu, rng, t, 1, 256, 96, false));
    add(MatMulCase(gpu, rng, t, 17, 512, 160, true));
    add(MatMulBackwardInputCase(gpu, rng, t, 17, 256, 160));
    add(MatMulGatedCase(gpu, rng, t, 1, 256, 40));
  }
  // Four rows of x: the matvec's 4-row units (a last unit of 2 rows, and of 1 gated output
  // of 2); two rows with the q/k/v segments.
  add(MatMulCase(gpu, rng, DType::kF16, 4, 256, 38, true));
  add(MatMulCase(gpu, rng, DType::kBF16, 4, 100, 39, false));  // one element at a time
  add(MatMulGatedCase(gpu, rng, DType::kBF16, 4, 256, 41));
  add(MatMulManyCase(gpu, rng, DType::kBF16, 2, 256, false));
  add(MatMulGatedCase(gpu, rng, DType::kBF16, 6, 128, 24));  // two GEMMs and SwiGlu
  // GeGLU (Gemma) through the same kernels: the matvec at 1 and 3 rows (one element at a
  // time), two GEMMs and GeGlu on f16 weights, and on f32 weights.
  add(MatMulGatedCase(gpu, rng, DType::kBF16, 1, 256, 40, true));
  add(MatMulGatedCase(gpu, rng, DType::kF16, 3, 100, 33, true));
  add(MatMulGatedCase(gpu, rng, DType::kF16, 6, 128, 24, true));
  add(MatMulGatedCase(gpu, rng, DType::kF32, 2, 64, 20, true));
  // GPT-2's c_fc with its bias and GELU: in the matvec's epilogue (1 and 4 rows; 100 inputs:
  // one element at a time), after a GEMM, and on f32 weights.
  add(MatMulCase(gpu, rng, DType::kF16, 1, 256, 41, true, true));
  add(MatMulCase(gpu, rng, DType::kBF16, 4, 100, 39, true, true));
  add(MatMulCase(gpu, rng, DType::kBF16, 9, 128, 40, true, true));
  add(MatMulCase(gpu, rng, DType::kF32, 3, 64, 24, true, true));
  add(MatMulManyCase(gpu, rng, DType::kBF16, 2, 128, true));  // one MatMul each
  add(MatMulManyCase(gpu, rng, DType::kF16, 6, 128, false));  // three GEMMs, one operand
  add(AddNormCase(gpu, rng, false, 4096, DType::kBF16));
  add(AddNormCase(gpu, rng, true, 96, DType::kF32));
  add(NormCase(gpu, rng, false, 64, DType::kF32, false));
  add(NormCase(gpu, rng, false, 4096, DType::kBF16, false));
  add(NormCase(gpu, rng, true, 96, DType::kF32, true));
  add(NormCase(gpu, rng, true, 4096, DType::kF16, false));
  // RMSNorm keeps rows of up to 4096 in registers (a row of 1001 ends inside a thread's
  // four values); longer rows take the looped kernel.
  add(NormCase(gpu, rng, false, 1001, DType::kBF16, false));
  add(AddNormCase(gpu, rng, false, 5003, DType::kF16));
  // The pre-norm products (the engine's Llama layers): the matvec normalizing x itself
  // (a row of 4096 on bf16 norms, two rows on f32 norms, three of 100: one element at a
  // time, the gated kernels on f16 and bf16, four rows of 4096: 64 KiB of shared memory,
  // opted in), and the norm launched first: four rows of 6400 and one of 10000 (more than
  // the matvec holds), f32 weights (cuBLAS), six and nine rows (GEMMs).
  add(NormedMatMulCase(gpu, rng, 0, DType::kBF16, DType::kBF16, 1, 4096, true));
  add(NormedMatMulCase(gpu, rng, 0, DType::kF16, DType::kF32, 2, 256, true));
  add(NormedMatMulCase(gpu, rng, 0, DType::kBF16, DType::kF16, 3, 100, true));
  add(NormedMatMulCase(gpu, rng, 1, DType::kBF16, DType::kBF16, 1, 256, true));
  add(NormedMatMulCase(gpu, rng, 2, DType::kF16, DType::kF32, 3, 100, true));
  add(NormedMatMulCase(gpu, rng, 1, DType::kBF16, DType::kF32, 4, 4096, true));
  add(NormedMatMulCase(gpu, rng, 0, DType::kBF16, DType::kBF16, 4, 6400, false));
  add(NormedMatMulCase(gpu, rng, 1, DType::kBF16, DType::kBF16, 1, 10000, false));
  add(NormedMatMulCase(gpu, rng, 0, DType::kF32, DType::kF32, 1, 256, false));
  add(NormedMatMulCase(gpu, rng, 2, DType::kBF16, DType::kBF16, 6, 128, false));
  add(NormedMatMulCase(gpu, rng, 1, DType::kF16, DType::kF16, 9, 256, false));
  // The residual products, y += x · Wᵀ: the matvec's epilogue (one and four rows; 100
  // inputs: one element at a time), cuBLAS accumulating into y (β = 1), then the bias.
  add(MatMulAddToCase(gpu, rng, DType::kBF16, 1, 256, 96, false));
  add(MatMulAddToCase(gpu, rng, DType::kF16, 4, 100, 37, true));
  add(MatMulAddToCase(gpu, rng, DType::kBF16, 9, 128, 40, true));
  add(MatMulAddToCase(gpu, rng, DType::kF32, 2, 64, 24, true));
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalfSplit}) {
    for (int dh : {64, 128}) add(RopeCase(gpu, rng, style, dh));
    add(RopeQKCase(gpu, rng, style, style == RopeStyle::kAdjacentPairs ? 64 : 128));
  }
  for (int kind = 0; kind < 6; ++kind) add(ElementwiseCase(gpu, rng, kind));
  add(StoreKvCase(gpu, rng));
  add(RopeQKStoreKvCase(gpu, rng, false));
  add(RopeQKStoreKvCase(gpu, rng, true));
  add(StoreKvBf16Case(gpu, rng));
  add(RopeQKStoreKvBf16Case(gpu, rng));
  // A Llama layer's norm, q/k/v products, rope and cache rows in one call: one matvec
  // launch (one to four rows, both rope styles, biases, Llama 3.1's factors, both cache
  // types, four rows of 2048: 34 KiB of shared memory); unaligned rows (in 100)
  // and heads of 6 take the matvec, then RopeQKStoreKv; past four rows the norm, GEMMs,
  // then RopeQKStoreKv; f32 weights cuBLAS.
  using RS = RopeStyle;
  add(QkvRopeStoreCase(gpu, rng, {DType::kBF16, 1, 256, 4, 2, 64, RS::kHalfSplit, true}));
  add(QkvRopeStoreCase(gpu, rng,
                       {DType::kF16, 3, 128, 2, 1, 128, RS::kAdjacentPairs, false, true}));
  add(QkvRopeStoreCase(gpu, rng,
                       {DType::kBF16, 4, 2048, 4, 2, 128, RS::kHalfSplit, false, true, true}));
  add(QkvRopeStoreCase(gpu, rng,
                       {DType::kF16, 2, 256, 3, 3, 32, RS::kHalfSplit, true, false, true}));
  add(QkvRopeStoreCase(gpu, rng, {DType::kBF16, 2, 100, 2, 2, 32, RS::kHalfSplit, true}));
  add(QkvRopeStoreCase(gpu, rng, {DType::kBF16, 1, 64, 4, 2, 6, RS::kHalfSplit}));
  add(QkvRopeStoreCase(
      gpu, rng, {DType::kBF16, 6, 128, 2, 1, 64, RS::kHalfSplit, true, false, false, false}));
  add(QkvRopeStoreCase(
      gpu, rng, {DType::kF32, 2, 64, 2, 1, 16, RS::kAdjacentPairs, false, false, false, false}));
  // Gemma 2's (its norm launched first, adding the pending residual): without the norm,
  // heads of 256.
  add(QkvRopeStoreCase(gpu, rng,
                       {DType::kBF16, 2, 512, 2, 1, 256, RS::kHalfSplit, false, true, false, true,
                        /*with_norm=*/false}));
  for (const AttnShape& s : AttentionShapes()) {
    for (ParityResult& p : AttentionCase(gpu, rng, s)) r.push_back(std::move(p));
  }
  add(AttentionBatchSplitKvCase(gpu, rng));
  add(AttentionBatchSplitKvCase(gpu, rng, /*bf16_cache=*/true));
  add(AttentionBatchFlashCase(gpu, rng));
  add(AttentionBatchFlashCase(gpu, rng, nullptr, /*bf16_cache=*/true));
  add(AttentionBatchWindowCase(gpu, rng));
  add(AttentionBatchGemmaCase(gpu, rng));
  add(AttentionBatchGemmaCase(gpu, rng, /*bf16_cache=*/true));
  for (const AttnShape& s : AttentionBackwardShapes()) {
    for (ParityResult& p : AttentionBackwardCase(gpu, rng, s)) r.push_back(std::move(p));
  }
  return r;
}

}  // namespace kvlens::kernels::cuda::parity

#endif  // KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_H_
