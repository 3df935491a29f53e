// Small-batch products on f16/bf16 weights (see matvec.h). A launch covers up to
// kMatVecMaxSegments products of the same x (segments: a layer's q, k and v). The work is
// cut into units of R weight rows (kUnitRows: 2 for one row of x, 4 for more): W rows o …
// o + R − 1 (plain), or W_gate and W_up rows of outputs o … o + R/2 − 1 (gated: SwiGLU
// or GeGLU),
// so each x value read from L1 serves R rows. The grid is
// persistent: exactly as many blocks as fit on the GPU at once, block b taking units b,
// b + grid, … So every block reads the same number of weight bytes, give or take one
// unit, whatever the shape. (The first version gave each warp a unit and launched a block
// per 8 warps: 11008 rows made one full wave and a partial one of 29 blocks, and an H200
// read the weights at 64% of its copy bandwidth.) For one row of x the kernel fits in 40
// registers (ptxas, sm_90; the vectorized ones spill 4 to 8 bytes), so 6 blocks (1536
// threads, __launch_bounds__) share an SM and one block's loads are in flight while
// another sums. In a unit the block's 256 threads read the rows in 16-byte pieces
// (8 values) at
// 8·thread, + 2048, …, dot them with the matching x values of each of the n rows (float4
// pairs, through L1), sum over the warp by shuffles and over the 8 warps through shared
// memory (double-buffered, so one barrier a unit). Unaligned rows (in % 8 ≠ 0, or a
// pointer off 16 bytes) take the same path one element at a time.
//
// With an RMSNorm fused in (MatVecNorm; kNorm), each block first normalizes x's rows into
// shared memory (x · 1/rms · weight, as RmsNormRegisterKernel computes them: Σ x² by warp
// shuffles, one barrier, the rows written, one more barrier), and its units read x from
// there. The products' loop is the same code either way (only x's address differs), so
// the registers, the loads in flight and the occupancy are those measured unfused. Rows
// are held whole, so the fusion takes rows that fit without costing occupancy
// (MatVecNormFits: one row of up to 8192, four of 6144). Before it each q/k/v and gate/up
// product followed an RMSNorm launch of its own (on an H200: 9% of a Llama-7B batch-1 step
// under ncu, 7 µs a launch cold). (Folding the norm into the loop instead, the weight
// multiplied as x is read and x's squares summed by the first unit, spilled at one row's
// 40 registers.)
//
// With the rope and the cache store fused in (LaunchMatVecRopeStore; kRope, vectorized
// loop only), the units of q and k are whole rotation pairs (for half-split heads, rows
// p, p + 1, p + Dh/2, p + Dh/2 + 1 at n ≥ 2), each block first fills a table of its rows'
// cos and sin in shared memory (behind the normalized rows, and after them: filled before,
// the n = 1 kernel spilled 16 bytes), and warp 0's epilogue adds the bias,
// turns the pairs and writes k's and v's cache rows. That replaces a Llama layer's
// RopeQKStoreKv launch; the products' loop is again the unfused code.
//
// Launched programmatically (launch.h), each block first asks the L2 cache for the start
// of its first unit's weight rows (UnitWeightRows, kPrefetchValues), then waits for the
// previous grid: blocks scheduled while that grid drains have DRAM bring their weights in
// meanwhile. Weights are written by no kernel, so no value read changes (launch.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/load_as_float.cuh"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/rope_store.cuh"

namespace kvlens::kernels::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

// One 16-bit weight to float.
template <bool kBf16>
__device__ __forceinline__ float HalfBitsToFloat(unsigned short bits) {
  if constexpr (kBf16) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

// One product of a launch. kGated: w is W_gate and w_up W_up, y = act(x·W_gateᵀ) ⊙
// x·W_upᵀ (no bias; act is gelu_tanh with `gelu`, else silu); else w_up is unused and
// y = x·Wᵀ + bias, or gelu_tanh of that with `gelu`.
struct Segment {
  const unsigned short* w;
  const unsigned short* w_up;
  const void* bias;
  DType bias_dtype;
  float* y;
  int64_t out;
  int64_t first_unit;  // the segment's units are [first_unit, next's first_unit)
  bool gelu;           // the activation is GELU's tanh form (above)
  bool accumulate;     // y += the output (plain products only)
};

struct Segments {
  const float* x;
  int64_t in;
  int count;
  int64_t units;  // Σ of the segments' units
  MatVecNorm norm;
  Segment seg[kMatVecMaxSegments];
  MatVecRopeStore rope_store;  // kRope: segments 0, 1, 2 are q, k and v
  // Launched programmatically with prefetches (PrefetchBeforeWait, launch.h): each block prefetches
  // the start of its first unit's weight rows into L2 before it waits for the previous grid.
  bool prefetch;
};

// Weight rows a unit reads for N rows of x: 2, or 4 from N = 2 on. Each x value a thread
// loads (through L1) serves R weight rows, so L1 carries 2N / R times the weight bytes in
// fp32 x: at N = 4 with 2 rows, four times the weights' bytes, and the kernel read weights
// at 50% of copy bandwidth on an H200 (80% at N = 1); 4 rows halve that (2026-11-30, not
// yet measured). (At N = 1 more rows a unit did not pay: two units at once ran at 74%.)
template <int N>
constexpr int kUnitRows = N >= 2 ? 4 : 2;
int UnitRows(int n) { return n >= 2 ? kUnitRows<2> : kUnitRows<1>; }

// The R weight rows unit `unit` reads, as the products' loop in MatVecKernel places them
// (its segment, its first output o, then the rows: see there). For the prefetch before
// the wait only: the loop keeps its own copy of these lines, since the n = 1 kernels run
// at their 40-register cap and calling this from the loop moved 4 to 28 bytes of spills
// into the rope kernels (ptxas -v); kept alike by
// CudaBackendPrefetchTest.PrefetchedProductsGiveTheSameBits, whose emulator faults a prefetch
// outside the weights.
template <int R, bool kGated, bool kRope>
__device__ __forceinline__ void UnitWeightRows(const Segments& segs, int64_t unit,
                                               const unsigned short* (&wrow)[R]) {
  constexpr int kOuts = kGated ? R / 2 : R;
  int si = 0;
  while (si + 1 < segs.count && unit >= segs.seg[si + 1].first_unit) ++si;
  const Segment& sg = segs.seg[si];
  const int64_t in = segs.in, o = kOuts * (unit - sg.first_unit);
  if constexpr (kRope) {
    const bool split = si < 2 && segs.rope_store.rope.style == RopeStyle::kHalfSplit;
    const int half = segs.rope_store.head_dim / 2;
    const int64_t head = o / 2 / half * (2 * half);
    const int p0 = static_cast<int>(o / 2 % half);
#pragma unroll
    for (int t = 0; t < R; ++t) {
      wrow[t] = sg.w + (split ? head + p0 + t / 2 + (t % 2) * half : o + t) * in;
    }
  } else {
    const int outs = static_cast<int>(min(static_cast<int64_t>(kOuts), sg.out - o));
#pragma unroll
    for (int t = 0; t < R; ++t) {
      if constexpr (kGated) {
        wrow[t] = (t % 2 == 0 ? sg.w : sg.w_up) + (o + min(t / 2, outs - 1)) * in;
      } else {
        wrow[t] = sg.w + (o + min(t, outs - 1)) * in;
      }
    }
  }
}

// Weight values of each row a block prefetches before its wait (Segments::prefetch): the
// first two steps of the vectorized loop, 8 KiB of a 16-bit row. At one row of x an
// H200's 132 SMs of 6 blocks ask for 13 MB (the L2 holds 50), two to three times what the
// memory pipeline holds in flight at its bandwidth and latency (4.8 TB/s × ~1 µs).
constexpr int64_t kPrefetchValues = 2 * 8 * kThreads;

// Dynamic shared memory: the normalized rows [N, in] (kNorm), then the rotations' cos and
// sin [N, Dh/2] (kRope).
template <bool kBf16, int N, bool kVec, bool kGated, bool kNorm, bool kRope = false>
__global__ void __launch_bounds__(kThreads, N == 1 ? 6 : 2) MatVecKernel(Segments segs) {
  static_assert(!(kRope && kGated), "rope takes plain products (q, k, v)");
  constexpr int R = kUnitRows<N>;  // weight rows a unit reads
  if (segs.prefetch && blockIdx.x < segs.units) {
    // Before the wait (launch.cuh): weights only, which no kernel writes.
    const unsigned short* first[R];
    UnitWeightRows<R, kGated, kRope>(segs, blockIdx.x, first);
    const int64_t bytes = 2 * min(segs.in, kPrefetchValues);
#pragma unroll
    for (int t = 0; t < R; ++t) {
      const char* row = reinterpret_cast<const char*>(first[t]);
      for (int64_t b = 128 * threadIdx.x; b < bytes; b += 128 * kThreads) PrefetchL2(row + b);
    }
  }
  WaitForPriorGrids();                       // else first: see launch.cuh
  constexpr int kOuts = kGated ? R / 2 : R;  // outputs a unit writes
  __shared__ float part[2][kWarps][R * N];
  extern __shared__ __align__(16) float dynamic_smem[];
  const float* __restrict__ x = segs.x;
  const int64_t in = segs.in;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // kRope: row r's cos and sin for pair p at [r · Dh/2 + p], read by the epilogue after
  // the first unit's barrier.
  float2* rope_cs = reinterpret_cast<float2*>(dynamic_smem + (kNorm ? N * in : 0));
  if constexpr (kNorm) {
    float* normed = dynamic_smem;
    float inv_rms[N];
#pragma unroll
    for (int r = 0; r < N; ++r) {
      float sq = 0.0f;
      for (int64_t i = threadIdx.x; i < in; i += kThreads) sq += x[r * in + i] * x[r * in + i];
      sq = WarpReduce(sq, SumOp());
      if (lane == 0) part[0][warp][r] = sq;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < N; ++r) {
      float sq = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sq += part[0][w][r];
      inv_rms[r] = rsqrtf(sq / static_cast<float>(in) + segs.norm.eps);
    }
    for (int64_t i = threadIdx.x; i < in; i += kThreads) {
      const float g = LoadAsFloat(segs.norm.weight, segs.norm.dtype, i);
#pragma unroll
      for (int r = 0; r < N; ++r) normed[r * in + i] = x[r * in + i] * inv_rms[r] * g;
    }
    // Also orders the reads of part[0] above before the first unit writes it.
    __syncthreads();
    x = normed;
  }
  if constexpr (kRope) {
    const MatVecRopeStore& rs = segs.rope_store;
    const int half = rs.head_dim / 2;
    for (int i = threadIdx.x; i < N * half; i += kThreads) {
      rope_cs[i] = RopeCosSin(rs.positions[i / half], i % half, rs.head_dim, rs.rope.theta,
                              rs.rope.freq_factors);
    }
  }
  int buf = 0;
  for (int64_t unit = blockIdx.x; unit < segs.units; unit += gridDim.x, buf ^= 1) {
    int si = 0;
    while (si + 1 < segs.count && unit >= segs.seg[si + 1].first_unit) ++si;
    const Segment& sg = segs.seg[si];
    // Outputs o … o + kOuts − 1, of which `outs` exist. Plain: weight rows o + t (a missing
    // row reads the last one again; its sums are never written). Gated: the gate and up
    // rows of each output, interleaved.
    const int64_t o = kOuts * (unit - sg.first_unit);
    // kRope, q's and k's half-split heads: output t of the unit is row
    // head + p0 + t / 2 + (t % 2) · Dh/2 (pair p0 + t / 2, its first or second row), where
    // its pairs p0 … of the head starting at row `head` are the segment's pairs o/2 ….
    // Else (and for adjacent pairs, whose pairs are rows o + t already) row o + t.
    // (UnitWeightRows, above, repeats these lines for the prefetch.)
    const bool split = kRope && si < 2 && segs.rope_store.rope.style == RopeStyle::kHalfSplit;
    const int half = kRope ? segs.rope_store.head_dim / 2 : 0;
    const int64_t head = kRope ? o / 2 / half * (2 * half) : 0;
    const int p0 = kRope ? static_cast<int>(o / 2 % half) : 0;
    auto row = [&](int t) -> int64_t { return split ? head + p0 + t / 2 + (t % 2) * half : o + t; };
    int outs;
    const unsigned short* __restrict__ wrow[R];
    if constexpr (kRope) {  // whole units (Dh % 4 == 0)
      outs = R;
#pragma unroll
      for (int t = 0; t < R; ++t) wrow[t] = sg.w + row(t) * in;
    } else if constexpr (R == 2) {  // one row of x: the code the H200 measured at 80%
      outs = kGated || o + 1 >= sg.out ? 1 : 2;
      wrow[0] = sg.w + o * in;
      wrow[1] = kGated ? sg.w_up + o * in : sg.w + (o + outs - 1) * in;
    } else {
      outs = static_cast<int>(min(static_cast<int64_t>(kOuts), sg.out - o));
#pragma unroll
      for (int t = 0; t < R; ++t) {
        if constexpr (kGated) {
          wrow[t] = (t % 2 == 0 ? sg.w : sg.w_up) + (o + min(t / 2, outs - 1)) * in;
        } else {
          wrow[t] = sg.w + (o + min(t, outs - 1)) * in;
        }
      }
    }
    float acc[R][N];
#pragma unroll
    for (int t = 0; t < R; ++t) {
#pragma unroll
      for (int r = 0; r < N; ++r) acc[t][r] = 0.0f;
    }
    if constexpr (kVec) {
#pragma unroll 2
      for (int64_t i = 8 * threadIdx.x; i < in; i += 8 * kThreads) {
        uint4 wv[R];
#pragma unroll
        for (int t = 0; t < R; ++t) wv[t] = *reinterpret_cast<const uint4*>(wrow[t] + i);
#pragma unroll
        for (int r = 0; r < N; ++r) {
          const float4 xa = *reinterpret_cast<const float4*>(x + r * in + i);
          const float4 xb = *reinterpret_cast<const float4*>(x + r * in + i + 4);
          const float xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
          for (int t = 0; t < R; ++t) {
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
      for (int64_t i = threadIdx.x; i < in; i += kThreads) {
#pragma unroll
        for (int t = 0; t < R; ++t) {
          const float wt = HalfBitsToFloat<kBf16>(wrow[t][i]);
#pragma unroll
          for (int r = 0; r < N; ++r) acc[t][r] += x[r * in + i] * wt;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < R; ++t) {
#pragma unroll
      for (int r = 0; r < N; ++r) {
        const float v = WarpReduce(acc[t][r], SumOp());
        if (lane == 0) part[buf][warp][t * N + r] = v;
      }
    }
    // The only barrier of the unit: part[buf] is next written two units on, after every
    // warp (warp 0's reads below included) has passed the next unit's barrier.
    __syncthreads();
    if (warp == 0 && lane < N) {  // lane r: row r of x
      float sum[R];
#pragma unroll
      for (int t = 0; t < R; ++t) {
        sum[t] = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum[t] += part[buf][w][t * N + lane];
      }
      float* y = sg.y + static_cast<int64_t>(lane) * sg.out + o;
      if constexpr (kRope) {
        // Bias, then q's and k's pairs turned (rope_cs), then k's and v's cache rows.
        const MatVecRopeStore& rs = segs.rope_store;
        float val[R];
#pragma unroll
        for (int t = 0; t < R; ++t) {
          val[t] =
              sum[t] + (sg.bias != nullptr ? LoadAsFloat(sg.bias, sg.bias_dtype, row(t)) : 0.0f);
        }
        if (si < 2) {
#pragma unroll
          for (int k = 0; k < R / 2; ++k) {
            const float2 turned =
                RotatePair(val[2 * k], val[2 * k + 1], rope_cs[lane * half + p0 + k]);
            val[2 * k] = turned.x;
            val[2 * k + 1] = turned.y;
          }
        }
        float* y_row = sg.y + static_cast<int64_t>(lane) * sg.out;
        const int64_t dst = rs.dst_rows[lane];
        void* cache = si == 1 ? rs.k_cache : rs.v_cache;
#pragma unroll
        for (int t = 0; t < R; ++t) {
          y_row[row(t)] = val[t];
          if (si > 0 && dst >= 0) {
            StoreCacheElement(cache, dst * rs.cache_stride + row(t), val[t], rs.bf16_cache);
          }
        }
      } else if constexpr (kGated) {
#pragma unroll
        for (int k = 0; k < kOuts; ++k) {
          if (k >= outs) break;        // unrolled, so sum stays in registers
          const float g = sum[2 * k];  // as SwiGluKernel and GeGluKernel
          const float a = sg.gelu ? GeluTanh(g) : Silu(g);
          y[k] = a * sum[2 * k + 1];
        }
      } else {
#pragma unroll
        for (int t = 0; t < R; ++t) {
          if (t >= outs) break;  // unrolled, so sum stays in registers
          const float b = sg.bias != nullptr ? LoadAsFloat(sg.bias, sg.bias_dtype, o + t) : 0.0f;
          const float v = sg.gelu ? GeluTanh(sum[t] + b) : sum[t] + b;
          y[t] = sg.accumulate ? y[t] + v : v;
        }
      }
    }
  }
}

// Blocks of the kernel that fit on one SM with `smem` bytes of dynamic shared memory (the
// normalized rows; 0 unfused). Asked once per instantiation and size: the last answer is
// kept (a model's products share one width, so that is one question a product kind).
template <bool kBf16, int N, bool kVec, bool kGated, bool kNorm, bool kRope>
int BlocksPerSm(int smem) {
  static std::atomic<int64_t> last{-1};  // smem << 8 | blocks
  const int64_t known = last.load(std::memory_order_relaxed);
  if (known >= 0 && known >> 8 == smem) return static_cast<int>(known & 0xff);
  int b = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &b, reinterpret_cast<const void*>(MatVecKernel<kBf16, N, kVec, kGated, kNorm, kRope>),
          kThreads, smem) != cudaSuccess) {
    b = 1;
  }
  b = std::clamp(b, 1, 255);
  last.store(int64_t{smem} << 8 | b, std::memory_order_relaxed);
  return b;
}

template <bool kBf16, int N, bool kVec, bool kGated, bool kNorm, bool kRope = false>
void Launch(Segments segs, cudaStream_t stream) {
  constexpr auto kernel = MatVecKernel<kBf16, N, kVec, kGated, kNorm, kRope>;
  int device = 0, sms = 1;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    sms = 1;
  }
  const int smem =
      static_cast<int>((kNorm ? N * segs.in * sizeof(float) : 0) +
                       (kRope ? N * (segs.rope_store.head_dim / 2) * sizeof(float2) : 0));
  if constexpr (kNorm || kRope) {
    // The rows' bytes, opted in (the default 48 KiB covers static and dynamic shared
    // memory together); and, as x comes from shared memory and nothing is reused through
    // L1, the largest carveout, so the blocks that fit unfused still fit. Both belong to the
    // device's context, so they are set at every launch, as the flash kernels do; a refusal
    // fails the launch, which the caller reports.
    (void)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    (void)cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  }
  const int per_sm = BlocksPerSm<kBf16, N, kVec, kGated, kNorm, kRope>(smem);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(segs.units, int64_t{sms} * per_sm));
  // Programmatically launched, the blocks may start while the previous grid drains: they
  // prefetch their first weights then (a graph keeps the mode it was captured in).
  segs.prefetch = PrefetchBeforeWait();
  LaunchKernel("MatVecKernel", kernel, blocks, kThreads, smem, stream, segs);
}

template <bool kBf16, int N, bool kGated>
void LaunchVariant(bool vec, bool norm, bool rope, const Segments& segs, cudaStream_t stream) {
  if constexpr (!kGated) {  // rope: vectorized only (LaunchMatVecRopeStore checks)
    if (rope && norm) return Launch<kBf16, N, true, false, true, true>(segs, stream);
    if (rope) return Launch<kBf16, N, true, false, false, true>(segs, stream);
  }
  if (vec && norm) return Launch<kBf16, N, true, kGated, true>(segs, stream);
  if (vec) return Launch<kBf16, N, true, kGated, false>(segs, stream);
  if (norm) return Launch<kBf16, N, false, kGated, true>(segs, stream);
  return Launch<kBf16, N, false, kGated, false>(segs, stream);
}

template <bool kBf16, bool kGated>
void LaunchRows(int n, bool vec, bool norm, bool rope, const Segments& segs, cudaStream_t stream) {
  switch (n) {
    case 1:
      return LaunchVariant<kBf16, 1, kGated>(vec, norm, rope, segs, stream);
    case 2:
      return LaunchVariant<kBf16, 2, kGated>(vec, norm, rope, segs, stream);
    case 3:
      return LaunchVariant<kBf16, 3, kGated>(vec, norm, rope, segs, stream);
    default:
      return LaunchVariant<kBf16, 4, kGated>(vec, norm, rope, segs, stream);
  }
}

// segs.seg[i].first_unit and segs.units are filled in here. rope: segs.rope_store applies
// (LaunchMatVecRopeStore has checked it).
absl::Status LaunchSegments(int n, DType dtype, bool gated, Segments segs, cudaStream_t stream,
                            bool rope = false) {
  static_assert(kMatVecMaxRows == 4, "LaunchRows instantiates 1 … 4 rows");
  if (n < 1 || n > kMatVecMaxRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchMatVec: n must be 1 to ", kMatVecMaxRows, ", got ", n));
  }
  if (dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError("LaunchMatVec: weights must be f16 or bf16");
  }
  const bool norm = segs.norm.weight != nullptr;
  if (norm && segs.norm.dtype != DType::kF32 && segs.norm.dtype != DType::kF16 &&
      segs.norm.dtype != DType::kBF16) {
    return absl::InvalidArgumentError("LaunchMatVec: the norm's weight must be f32, f16 or bf16");
  }
  if (norm && !MatVecNormFits(n, segs.in)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LaunchMatVec: a fused norm holds one row of up to ", kMatVecNormMaxRowFloats,
        " values or n · in up to ", kMatVecNormMaxFloats, ", got ", n, " · ", segs.in));
  }
  if (segs.in <= 0) return absl::OkStatus();
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool vec = segs.in % 8 == 0 && aligned(segs.x);
  int64_t units = 0;
  // Outputs a unit writes (MatVecKernel's kOuts).
  const int64_t unit_outs = gated ? UnitRows(n) / 2 : UnitRows(n);
  for (int i = 0; i < segs.count; ++i) {
    Segment& sg = segs.seg[i];
    vec = vec && aligned(sg.w) && (sg.w_up == nullptr || aligned(sg.w_up));
    sg.first_unit = units;
    units += (std::max<int64_t>(sg.out, 0) + unit_outs - 1) / unit_outs;
  }
  if (rope && !vec) {
    return absl::InvalidArgumentError(
        "LaunchMatVecRopeStore: in must be a multiple of 8 and x and the weights 16-byte aligned");
  }
  if (units == 0) return absl::OkStatus();
  segs.units = units;
  const bool bf16 = dtype == DType::kBF16;
  if (bf16 && gated) LaunchRows<true, true>(n, vec, norm, false, segs, stream);
  if (bf16 && !gated) LaunchRows<true, false>(n, vec, norm, rope, segs, stream);
  if (!bf16 && gated) LaunchRows<false, true>(n, vec, norm, false, segs, stream);
  if (!bf16 && !gated) LaunchRows<false, false>(n, vec, norm, rope, segs, stream);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("MatVecKernel");
  return absl::OkStatus();
}

const unsigned short* Bits(const void* w) { return static_cast<const unsigned short*>(w); }

}  // namespace

absl::Status LaunchMatVec(const float* x, int n, int64_t in, const MatVecNorm& norm,
                          absl::Span<const MatVecProduct> products, DType dtype,
                          cudaStream_t stream) {
  if (products.empty() || products.size() > static_cast<size_t>(kMatVecMaxSegments)) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchMatVec: 1 to ", kMatVecMaxSegments,
                                                   " products, got ", products.size()));
  }
  Segments segs{x, in, static_cast<int>(products.size()), 0, norm, {}, {}, false};
  for (int i = 0; i < segs.count; ++i) {
    const MatVecProduct& p = products[i];
    segs.seg[i] = {Bits(p.w), nullptr, p.bias, p.bias_dtype, p.y, p.out, 0, p.gelu, p.accumulate};
  }
  return LaunchSegments(n, dtype, false, segs, stream);
}

absl::Status LaunchMatVecRopeStore(const float* x, int n, int64_t in, const MatVecNorm& norm,
                                   absl::Span<const MatVecProduct> qkv,
                                   const MatVecRopeStore& rope_store, DType dtype,
                                   cudaStream_t stream) {
  const int dh = rope_store.head_dim;
  if (qkv.size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchMatVecRopeStore: 3 products (q, k, v), got ", qkv.size()));
  }
  if (!MatVecRopeTakes(dh)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchMatVecRopeStore: head_dim must be a positive multiple of 4, got ", dh));
  }
  if (qkv[0].out % dh != 0 || qkv[1].out % dh != 0 || qkv[1].out != qkv[2].out) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LaunchMatVecRopeStore: q's rows (", qkv[0].out, ") and k's and v's (", qkv[1].out, ", ",
        qkv[2].out, ") must be whole heads of ", dh, ", k's equal to v's"));
  }
  for (const MatVecProduct& p : qkv) {
    if (p.gelu || p.accumulate) {
      return absl::InvalidArgumentError("LaunchMatVecRopeStore: q, k and v are plain products");
    }
  }
  Segments segs{x, in, 3, 0, norm, {}, rope_store, false};
  for (int i = 0; i < 3; ++i) {
    const MatVecProduct& p = qkv[i];
    segs.seg[i] = {Bits(p.w), nullptr, p.bias, p.bias_dtype, p.y, p.out, 0, false, false};
  }
  return LaunchSegments(n, dtype, false, segs, stream, /*rope=*/true);
}

absl::Status LaunchMatVecGated(const float* x, int n, int64_t in, const MatVecNorm& norm,
                               const void* w_gate, const void* w_up, DType dtype, int64_t out,
                               GateActivation gate, float* y, cudaStream_t stream) {
  if (w_up == nullptr) return absl::InvalidArgumentError("LaunchMatVecGated: w_up is null");
  Segments segs{x, in, 1, 0, norm, {}, {}, false};
  segs.seg[0] = {
      Bits(w_gate), Bits(w_up), nullptr, DType::kF32, y, out, 0, gate == GateActivation::kGeluTanh,
      false};
  return LaunchSegments(n, dtype, true, segs, stream);
}

}  // namespace kvlens::kernels::cuda
