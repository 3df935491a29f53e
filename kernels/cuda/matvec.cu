// Small-batch products on f16/bf16 weights (see matvec.h). One warp per pair of weight
// rows: W rows o, o + 1 (plain), or W_gate row o and W_up row o (gated: SwiGLU). Lane reads
// both rows in 16-byte pieces (8 values) at 8·lane, + 256, …, dots them with the matching
// x values of each of the n rows (float4 pairs, through L1), and the warp sums its 2·n
// partial dots by shuffles. Unaligned rows (in % 8 ≠ 0, or a pointer off 16 bytes) take
// the same path one element at a time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/reduce.cuh"

namespace kvlens::kernels::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kOutPerWarp = 2;

// One 16-bit weight to float.
template <bool kBf16>
__device__ __forceinline__ float HalfBitsToFloat(unsigned short bits) {
  if constexpr (kBf16) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

template <bool kBf16>
__device__ __forceinline__ float WeightAt(const unsigned short* w, int64_t i) {
  return HalfBitsToFloat<kBf16>(w[i]);
}

// Pairs of weight rows a warp reads: output features per warp (plain), or 1 (gated).
template <bool kGated>
constexpr int kOutputsPerWarp = kGated ? 1 : kOutPerWarp;

// kGated: w is W_gate and w_up W_up, y = silu(x·W_gateᵀ) ⊙ x·W_upᵀ (no bias); else w_up is
// unused and y = x·Wᵀ + bias.
template <bool kBf16, int N, bool kVec, bool kGated>
__global__ void __launch_bounds__(kWarps * 32)
    MatVecKernel(const float* __restrict__ x, int64_t in, const unsigned short* __restrict__ w,
                 const unsigned short* __restrict__ w_up, int64_t out, const void* bias,
                 DType bias_dtype, float* __restrict__ y) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t o0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kOutputsPerWarp<kGated>;
  if (o0 >= out) return;  // whole warps only: no barrier below
  // Plain: rows o0, o0 + 1 (a missing second row reads the first again; its sums are
  // never written). Gated: gate and up rows of o0.
  const int rows = kGated ? 1 : (out - o0 < kOutPerWarp ? static_cast<int>(out - o0) : 2);
  const unsigned short* wrow[kOutPerWarp];
#pragma unroll
  for (int t = 0; t < kOutPerWarp; ++t) {
    wrow[t] = kGated ? (t == 0 ? w : w_up) + o0 * in : w + (o0 + (t < rows ? t : 0)) * in;
  }
  float acc[kOutPerWarp][N];
#pragma unroll
  for (int t = 0; t < kOutPerWarp; ++t) {
#pragma unroll
    for (int r = 0; r < N; ++r) acc[t][r] = 0.0f;
  }
  if constexpr (kVec) {
#pragma unroll 2
    for (int64_t i = 8 * lane; i < in; i += 8 * 32) {
      uint4 wv[kOutPerWarp];
#pragma unroll
      for (int t = 0; t < kOutPerWarp; ++t) wv[t] = *reinterpret_cast<const uint4*>(wrow[t] + i);
#pragma unroll
      for (int r = 0; r < N; ++r) {
        const float4 xa = *reinterpret_cast<const float4*>(x + r * in + i);
        const float4 xb = *reinterpret_cast<const float4*>(x + r * in + i + 4);
        const float xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int t = 0; t < kOutPerWarp; ++t) {
          const unsigned int words[4] = {wv[t].x, wv[t].y, wv[t].z, wv[t].w};
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const auto bits =
                static_cast<unsigned short>((words[e / 2] >> (16 * (e % 2))) & 0xffffu);
            acc[t][r] += xs[e] * HalfBitsToFloat<kBf16>(bits);
          }
        }
      }
    }
  } else {
    for (int64_t i = lane; i < in; i += 32) {
#pragma unroll
      for (int t = 0; t < kOutPerWarp; ++t) {
        const float wt = WeightAt<kBf16>(wrow[t], i);
#pragma unroll
        for (int r = 0; r < N; ++r) acc[t][r] += x[r * in + i] * wt;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kOutPerWarp; ++t) {
#pragma unroll
    for (int r = 0; r < N; ++r) acc[t][r] = WarpReduce(acc[t][r], SumOp());
  }
  if (kGated) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < N; ++r) {
        const float g = acc[0][r];  // as SwiGluKernel
        y[r * out + o0] = g / (1.0f + expf(-g)) * acc[1][r];
      }
    }
    return;
  }
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < kOutPerWarp; ++t) {
      if (t >= rows) break;  // unrolled, so acc stays in registers
      float b = 0.0f;
      if (bias != nullptr) {
        const int64_t o = o0 + t;
        switch (bias_dtype) {
          case DType::kF16:
            b = __half2float(static_cast<const __half*>(bias)[o]);
            break;
          case DType::kBF16:
            b = __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[o]);
            break;
          default:
            b = static_cast<const float*>(bias)[o];
        }
      }
#pragma unroll
      for (int r = 0; r < N; ++r) y[r * out + o0 + t] = acc[t][r] + b;
    }
  }
}

// The weight pointers, dtype and shape of one launch.
struct MatVecArgs {
  const float* x;
  int64_t in;
  const unsigned short* w;
  const unsigned short* w_up;  // gated when set
  int64_t out;
  const void* bias;
  DType bias_dtype;
  float* y;
};

template <bool kBf16, int N, bool kGated>
void Launch(bool vec, const MatVecArgs& a, cudaStream_t stream) {
  const int64_t per_block = int64_t{kWarps} * kOutputsPerWarp<kGated>;
  const dim3 grid(static_cast<unsigned>((a.out + per_block - 1) / per_block));
  auto* kernel = vec ? MatVecKernel<kBf16, N, true, kGated> : MatVecKernel<kBf16, N, false, kGated>;
  kernel<<<grid, kWarps * 32, 0, stream>>>(a.x, a.in, a.w, a.w_up, a.out, a.bias, a.bias_dtype,
                                           a.y);
}

template <bool kBf16, bool kGated>
void LaunchRows(int n, bool vec, const MatVecArgs& a, cudaStream_t stream) {
  switch (n) {
    case 1:
      return Launch<kBf16, 1, kGated>(vec, a, stream);
    case 2:
      return Launch<kBf16, 2, kGated>(vec, a, stream);
    case 3:
      return Launch<kBf16, 3, kGated>(vec, a, stream);
    default:
      return Launch<kBf16, 4, kGated>(vec, a, stream);
  }
}

absl::Status LaunchAny(int n, DType dtype, const MatVecArgs& a, cudaStream_t stream) {
  static_assert(kMatVecMaxRows == 4, "LaunchRows instantiates 1 … 4 rows");
  if (n < 1 || n > kMatVecMaxRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchMatVec: n must be 1 to ", kMatVecMaxRows, ", got ", n));
  }
  if (dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError("LaunchMatVec: weights must be f16 or bf16");
  }
  if (a.in <= 0 || a.out <= 0) return absl::OkStatus();
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec =
      a.in % 8 == 0 && aligned(a.x) && aligned(a.w) && (a.w_up == nullptr || aligned(a.w_up));
  const bool bf16 = dtype == DType::kBF16, gated = a.w_up != nullptr;
  if (bf16 && gated) LaunchRows<true, true>(n, vec, a, stream);
  if (bf16 && !gated) LaunchRows<true, false>(n, vec, a, stream);
  if (!bf16 && gated) LaunchRows<false, true>(n, vec, a, stream);
  if (!bf16 && !gated) LaunchRows<false, false>(n, vec, a, stream);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("MatVecKernel");
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchMatVec(const float* x, int n, int64_t in, const void* w, DType dtype,
                          int64_t out, const void* bias, DType bias_dtype, float* y,
                          cudaStream_t stream) {
  return LaunchAny(
      n, dtype, {x, in, static_cast<const unsigned short*>(w), nullptr, out, bias, bias_dtype, y},
      stream);
}

absl::Status LaunchMatVecSwiGlu(const float* x, int n, int64_t in, const void* w_gate,
                                const void* w_up, DType dtype, int64_t out, float* y,
                                cudaStream_t stream) {
  if (w_up == nullptr) return absl::InvalidArgumentError("LaunchMatVecSwiGlu: w_up is null");
  return LaunchAny(n, dtype,
                   {x, in, static_cast<const unsigned short*>(w_gate),
                    static_cast<const unsigned short*>(w_up), out, nullptr, DType::kF32, y},
                   stream);
}

}  // namespace kvlens::kernels::cuda
