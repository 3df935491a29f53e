// The fused products of a decode step on the device under random shapes, against the
// double reference (CudaBackend*: ctest label `gpu`, skipped with the reason without a
// device; in CI on the emulator). The parity table (cuda_parity_ops.h, cuda_parity_qkv.h)
// runs each fused call on a few chosen shapes; here each seed draws the weights' dtype,
// the rows (1 to 6: the matvec's 1 to 4 and cuBLAS past them), the width (multiples of 8,
// whose rows the matvec reads in 16-byte pieces, or not), the heads and head size, the
// rope style, biases, Llama 3.1's frequency factors and the cache type, so the matvec's
// fused norm, its rope-and-store epilogue and their fallbacks meet shapes no row lists;
// and the plain products on every weight dtype, ggml's block types among them.
// Every result must be within twice the naive run's error of the reference
// (parity::Judge), and a norm the matvec fuses must leave xn unwritten.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <random>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/matvec.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"
#include "tests/kernels/cuda/random_draws.h"

namespace kvlens::kernels::cuda {
namespace {

using fuzz::Pick;
using fuzz::Uniform;

// A row width: a multiple of 8 up to 2048 (the matvec's vector loads), or any up to 300.
int Width(std::mt19937_64& rng) {
  return Pick(rng, {true, true, false}) ? 8 * Uniform(rng, 1, 256) : Uniform(rng, 1, 300);
}

// Whether the matvec normalizes x itself for n rows of width `in` on `dtype` weights, as
// docs/cuda.md states the rule: the matvec takes the rows (f16/bf16, n <= 4) and they fit
// its shared memory.
bool NormFused(DType dtype, int n, int in) {
  return MatVecTakes(n, dtype) && MatVecNormFits(n, in);
}

void ExpectPass(const parity::ParityResult& r, int* passed) {
  EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
  *passed += r.pass() ? 1 : 0;
}

// RmsNormQkvRopeStoreKv and MatMulQkvRopeStoreKv: q, k and v, rope, and the cache rows.
TEST_F(CudaBackendTest, FuzzQkvRopeStoreWithinTolerance) {
  constexpr int kSeeds = 40;
  int passed = 0;
  for (int seed = 1; seed <= kSeeds; ++seed) {
    std::mt19937_64 rng(seed);
    parity::QkvShape s;
    s.dtype = Pick(rng, {DType::kBF16, DType::kBF16, DType::kF16, DType::kF32});
    s.n = Uniform(rng, 1, 6);
    s.in = Width(rng);
    s.kv_heads = Uniform(rng, 1, 3);
    s.q_heads = s.kv_heads * Pick(rng, {1, 2, 4});
    s.head_dim = Pick(rng, {2, 6, 16, 32, 64, 128, 256});
    s.style = Pick(rng, {RopeStyle::kHalfSplit, RopeStyle::kAdjacentPairs});
    s.bias = Pick(rng, {false, true});
    s.bf16_cache = Pick(rng, {false, true});
    s.scaled = Pick(rng, {false, true});
    s.with_norm = Uniform(rng, 0, 3) != 0;
    s.fused_norm = s.with_norm && NormFused(s.dtype, s.n, s.in);
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    // The backend keeps a weight's device copy under its host address until told to
    // forget it, and a seed's weights may land where the last seed's were.
    backend_->ForgetWeights();
    ExpectPass(parity::QkvRopeStoreCase(*backend_, rng, s), &passed);
  }
  EXPECT_EQ(passed, kSeeds);
}

// RmsNormMatMulMany, RmsNormMatMulSwiGlu and RmsNormMatMulGeGlu, with the norm's weight in
// f32, f16 or bf16; MatMulAddTo with and without a bias; MatMulSwiGlu and MatMulGeGlu.
TEST_F(CudaBackendTest, FuzzNormedGatedAndAccumulatingProductsWithinTolerance) {
  constexpr int kSeeds = 40;
  int passed = 0;
  for (int seed = 1; seed <= kSeeds; ++seed) {
    std::mt19937_64 rng(1000 + seed);
    const DType dtype = Pick(rng, {DType::kBF16, DType::kBF16, DType::kF16, DType::kF32});
    const int n = Uniform(rng, 1, 6), in = Width(rng), out = Uniform(rng, 1, 200);
    SCOPED_TRACE(::testing::Message() << "seed " << 1000 + seed);
    // The backend keeps a weight's device copy under its host address until told to
    // forget it, and a seed's weights may land where the last seed's were.
    backend_->ForgetWeights();
    switch (Uniform(rng, 0, 2)) {
      case 0: {
        const int kind = Uniform(rng, 0, 2);
        const DType norm_dtype = Pick(rng, {DType::kF32, DType::kF16, DType::kBF16});
        ExpectPass(parity::NormedMatMulCase(*backend_, rng, kind, dtype, norm_dtype, n, in,
                                            NormFused(dtype, n, in)),
                   &passed);
        break;
      }
      case 1:
        ExpectPass(
            parity::MatMulAddToCase(*backend_, rng, dtype, n, in, out, Pick(rng, {false, true})),
            &passed);
        break;
      default:
        ExpectPass(parity::MatMulGatedCase(*backend_, rng, dtype, n, in, out,
                                           /*geglu=*/Pick(rng, {false, true})),
                   &passed);
    }
  }
  EXPECT_EQ(passed, kSeeds);
}

// MatMul, MatMulGelu and MatMulBackwardInput on every weight dtype, ggml's block types
// (dequantised to f16 at upload) among them, at 1 to 24 rows: the matvec, cuBLAS, and the
// element-at-a-time rows.
TEST_F(CudaBackendTest, FuzzPlainProductsOnEveryWeightDtypeWithinTolerance) {
  constexpr int kSeeds = 40;
  int passed = 0;
  for (int seed = 1; seed <= kSeeds; ++seed) {
    std::mt19937_64 rng(2000 + seed);
    const DType dtype = Pick(rng, {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0,
                                   DType::kQ4_0, DType::kQ4_K, DType::kQ6_K, DType::kIQ4_XS});
    const int n = Pick(rng, {Uniform(rng, 1, 4), Uniform(rng, 5, 24)});
    // A block type's rows hold whole blocks (32 or 256 values).
    const int block = DTypeIsBlockQuantized(dtype) ? static_cast<int>(DTypeBlockSize(dtype)) : 1;
    const int in = block > 1 ? block * Uniform(rng, 1, 512 / block + 1) : Width(rng);
    const int out = Uniform(rng, 1, 200);
    SCOPED_TRACE(::testing::Message() << "seed " << 2000 + seed);
    backend_->ForgetWeights();
    switch (Uniform(rng, 0, 2)) {
      case 0:
        ExpectPass(parity::MatMulCase(*backend_, rng, dtype, n, in, out, Pick(rng, {false, true})),
                   &passed);
        break;
      case 1:
        ExpectPass(parity::MatMulCase(*backend_, rng, dtype, n, in, out, Pick(rng, {false, true}),
                                      /*gelu=*/true),
                   &passed);
        break;
      default:
        ExpectPass(parity::MatMulBackwardInputCase(*backend_, rng, dtype, n, in, out), &passed);
    }
  }
  EXPECT_EQ(passed, kSeeds);
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_HAVE_CUDA
