// Small-batch products on f16/bf16 weights (see matvec.h). A launch covers up to
// kMatVecMaxSegments products of the same x (segments: a layer's q, k and v), each a range of
// blocks. One warp per pair of weight rows: W rows o, o + 1 (plain), or W_gate row o and
// W_up row o (gated: SwiGLU). Lane reads
// both rows in 16-byte pieces (8 values) at 8·lane, + 256, …, dots them with the matching
// x values of each of the n rows (float4 pairs, through L1), and the warp sums its 2·n
// partial dots by shuffles. Unaligned rows (in % 8 ≠ 0, or a pointer off 16 bytes) take
// the same path one element at a time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
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

// One product of a launch. kGated: w is W_gate and w_up W_up, y = silu(x·W_gateᵀ) ⊙
// x·W_upᵀ (no bias); else w_up is unused and y = x·Wᵀ + bias.
struct Segment {
  const unsigned short* w;
  const unsigned short* w_up;
  const void* bias;
  DType bias_dtype;
  float* y;
  int64_t out;
  unsigned first_block;  // the segment's blocks are [first_block, next's first_block)
};

struct Segments {
  const float* x;
  int64_t in;
  int count;
  Segment seg[kMatVecMaxSegments];
};

template <bool kBf16, int N, bool kVec, bool kGated>
__global__ void __launch_bounds__(kWarps * 32) MatVecKernel(Segments segs) {
  int si = 0;
  while (si + 1 < segs.count && blockIdx.x >= segs.seg[si + 1].first_block) ++si;
  const Segment& sg = segs.seg[si];
  const float* __restrict__ x = segs.x;
  const int64_t in = segs.in, out = sg.out;
  float* __restrict__ y = sg.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t o0 =
      (static_cast<int64_t>(blockIdx.x - sg.first_block) * kWarps + warp) * kOutputsPerWarp<kGated>;
  if (o0 >= out) return;  // whole warps only: no barrier below
  // Plain: rows o0, o0 + 1 (a missing second row reads the first again; its sums are
  // never written). Gated: gate and up rows of o0.
  const int rows = kGated ? 1 : (out - o0 < kOutPerWarp ? static_cast<int>(out - o0) : 2);
  const unsigned short* __restrict__ wrow[kOutPerWarp];
#pragma unroll
  for (int t = 0; t < kOutPerWarp; ++t) {
    wrow[t] = kGated ? (t == 0 ? sg.w : sg.w_up) + o0 * in : sg.w + (o0 + (t < rows ? t : 0)) * in;
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
      if (sg.bias != nullptr) {
        const int64_t o = o0 + t;
        switch (sg.bias_dtype) {
          case DType::kF16:
            b = __half2float(static_cast<const __half*>(sg.bias)[o]);
            break;
          case DType::kBF16:
            b = __bfloat162float(static_cast<const __nv_bfloat16*>(sg.bias)[o]);
            break;
          default:
            b = static_cast<const float*>(sg.bias)[o];
        }
      }
#pragma unroll
      for (int r = 0; r < N; ++r) y[r * out + o0 + t] = acc[t][r] + b;
    }
  }
}

template <bool kBf16, int N, bool kGated>
void Launch(bool vec, unsigned blocks, const Segments& segs, cudaStream_t stream) {
  auto* kernel = vec ? MatVecKernel<kBf16, N, true, kGated> : MatVecKernel<kBf16, N, false, kGated>;
  kernel<<<blocks, kWarps * 32, 0, stream>>>(segs);
}

template <bool kBf16, bool kGated>
void LaunchRows(int n, bool vec, unsigned blocks, const Segments& segs, cudaStream_t stream) {
  switch (n) {
    case 1:
      return Launch<kBf16, 1, kGated>(vec, blocks, segs, stream);
    case 2:
      return Launch<kBf16, 2, kGated>(vec, blocks, segs, stream);
    case 3:
      return Launch<kBf16, 3, kGated>(vec, blocks, segs, stream);
    default:
      return Launch<kBf16, 4, kGated>(vec, blocks, segs, stream);
  }
}

// segs.seg[i].first_block is filled in here.
absl::Status LaunchSegments(int n, DType dtype, bool gated, Segments segs, cudaStream_t stream) {
  static_assert(kMatVecMaxRows == 4, "LaunchRows instantiates 1 … 4 rows");
  if (n < 1 || n > kMatVecMaxRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchMatVec: n must be 1 to ", kMatVecMaxRows, ", got ", n));
  }
  if (dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError("LaunchMatVec: weights must be f16 or bf16");
  }
  if (segs.in <= 0) return absl::OkStatus();
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool vec = segs.in % 8 == 0 && aligned(segs.x);
  const int64_t per_block = int64_t{kWarps} * (gated ? 1 : kOutPerWarp);
  int64_t blocks = 0;
  for (int i = 0; i < segs.count; ++i) {
    Segment& sg = segs.seg[i];
    vec = vec && aligned(sg.w) && (sg.w_up == nullptr || aligned(sg.w_up));
    sg.first_block = static_cast<unsigned>(blocks);
    blocks += (std::max<int64_t>(sg.out, 0) + per_block - 1) / per_block;
  }
  if (blocks == 0) return absl::OkStatus();
  const auto b = static_cast<unsigned>(blocks);
  const bool bf16 = dtype == DType::kBF16;
  if (bf16 && gated) LaunchRows<true, true>(n, vec, b, segs, stream);
  if (bf16 && !gated) LaunchRows<true, false>(n, vec, b, segs, stream);
  if (!bf16 && gated) LaunchRows<false, true>(n, vec, b, segs, stream);
  if (!bf16 && !gated) LaunchRows<false, false>(n, vec, b, segs, stream);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("MatVecKernel");
  return absl::OkStatus();
}

const unsigned short* Bits(const void* w) { return static_cast<const unsigned short*>(w); }

}  // namespace

absl::Status LaunchMatVec(const float* x, int n, int64_t in,
                          absl::Span<const MatVecProduct> products, DType dtype,
                          cudaStream_t stream) {
  if (products.empty() || products.size() > static_cast<size_t>(kMatVecMaxSegments)) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchMatVec: 1 to ", kMatVecMaxSegments,
                                                   " products, got ", products.size()));
  }
  Segments segs{x, in, static_cast<int>(products.size()), {}};
  for (int i = 0; i < segs.count; ++i) {
    const MatVecProduct& p = products[i];
    segs.seg[i] = {Bits(p.w), nullptr, p.bias, p.bias_dtype, p.y, p.out, 0};
  }
  return LaunchSegments(n, dtype, false, segs, stream);
}

absl::Status LaunchMatVecSwiGlu(const float* x, int n, int64_t in, const void* w_gate,
                                const void* w_up, DType dtype, int64_t out, float* y,
                                cudaStream_t stream) {
  if (w_up == nullptr) return absl::InvalidArgumentError("LaunchMatVecSwiGlu: w_up is null");
  Segments segs{x, in, 1, {}};
  segs.seg[0] = {Bits(w_gate), Bits(w_up), nullptr, DType::kF32, y, out, 0};
  return LaunchSegments(n, dtype, true, segs, stream);
}

}  // namespace kvlens::kernels::cuda
