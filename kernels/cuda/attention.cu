// Attention kernels: split-KV (fp32, decode and fallback) and the probability-materialising
// kernel (fp32); the flash prefill kernels are flash_prefill.cu and flash_prefill_bf16.cu.
// See attention.h for when each runs. Every kernel applies the same visibility rule as
// attention_check.h and never reads a cache row at or past num_keys (those slots may hold
// anything, NaN included).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/exp2_approx.cuh"
#include "kernels/cuda/kv_load.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/split_kv_common.cuh"

namespace kvlens::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------
// Split-KV (decode, short chunks, head sizes the flash kernel lacks). Block (i, g, split):
// query row i, KV head g, the split's keys (SplitSteps, split_kv_common.cuh).
//
// Each K/V row is read once per head tile, by one warp, for every query head of the tile:
// the block's kWarps warps (kSplitKvWarps, or kSplitKvWideWarps: attention.h) take turns over steps
// of kStep consecutive keys (one block-table lookup a step), and a warp keeps its own (m, l, acc)
// per head. Lane owns dims 128c + 4·lane … +3 (one float4, or 8 bytes of bf16, per chunk where the
// pointers and strides allow, see SplitKvVectorized), so a step has 2 · kStep rows in flight per
// warp (kStep: 4, or 8 on a bf16 cache, kSplitStepKeys). The step's kStep × heads dot products are
// summed over the lanes together (SumAcrossLanes: N − 1 shuffles for N sums), which leaves each
// lane one (key, head) score; the online softmax update runs on those in parallel (the max and sum
// over a head's keys by shuffles, one exp2 a lane), and the weights and rescales reach
// every lane's acc through shared memory. The head tile is the GQA group rounded up to a
// power of two (at most 8 / C): a tile wider than the group would spend the same
// arithmetic on heads that do not exist. Scores are kept in base 2 (c = scale·log2 e, as
// the flash kernel).
// Measured on an H200 (Tk 8192, GQA 32/8, 4 heads a tile): a tile of 8 took 75 us, a tile
// of 4 34 us (the tile of 8 then kept its 32 sums in local memory: see HalveAcrossLanes); each lane
// redoing every head's softmax update serially issued ~1000 instructions a step with 3-4 warps a
// scheduler (ncu: issue-bound, not waiting on memory), and loading the next step early (in
// registers, or by cp.async into shared memory) made it slower (38-39 us), not faster. At the end
// of a head tile the warps' partial results are merged through shared memory; the block writes O
// directly with one split, else per split (m, l, acc[Dh]) in
//   workspace [Tq, H, splits, Dh + 2]     (m in base 2)
// merged by SplitKvCombineKernel.
constexpr int kStepKeys = 4;  // keys a warp takes a step (fp32); a split's span is a multiple

// Keys a warp takes a step: 4 on an fp32 cache; 8 on a bf16 cache where the step's dot
// products still fit SumAcrossLanes (8 · head tile <= 32). A warp waits for each step's
// rows before it computes (the kernel is bound by that latency, see above), so a bf16 row,
// half the bytes, would otherwise halve the bytes in flight and leave the time per key
// unchanged: with 8 keys a step a lane has as many bytes in flight as on fp32 (8 keys × 2
// rows × 8 bytes), held as raw bf16 (2 registers a row piece, not 4), and half the steps.
constexpr int SplitStepKeys(bool bf16_cache, int tile_heads) {
  return bf16_cache && 2 * kStepKeys * tile_heads <= 32 ? 2 * kStepKeys : kStepKeys;
}
template <typename KT, int kTileHeads>
constexpr int kSplitStepKeys = SplitStepKeys(sizeof(KT) == 2, kTileHeads);

// C float4 chunks per lane: head sizes up to 128·C. kTile query heads share each K/V row;
// q and acc take 2·4·C floats per head, a step's K and V rows 2·4·C per key.
template <int C, int kTileHeads, int kStep = kStepKeys, int kWarps = kSplitKvWarps>
struct SplitKvShape {
  static constexpr int kHeadTile = kTileHeads;
  static constexpr int kStepK = kStep;
  static constexpr int kSums = kStep * kHeadTile;  // dot products per step: 4 … 32
  static constexpr int kMaxDim = 128 * C;
  static_assert(kTileHeads * C <= 8, "q and acc past 64 floats a lane would spill");
  static_assert(kSums >= 4 && kSums <= 32, "SumAcrossLanes takes 4 to 32 values");
  // The block's warps' partial sums (part_acc) fit in static shared memory: a wide block
  // only takes head tiles of at most 4 heads of 128 dims.
  static_assert(kWarps == kSplitKvWarps || kTileHeads * C <= 4, "wide blocks: 32 KB of sums");
  // Blocks an SM should hold: up to 4 heads fit in 128 registers (16 warps an SM).
  static constexpr int kMinBlocks = kTileHeads * C <= 4 ? 16 / kWarps : 1;
};

// Whether the kernel has wide blocks for this head tile (SplitKvShape).
constexpr bool SplitKvHasWide(int chunks, int tile_heads) { return tile_heads * chunks <= 4; }

__device__ __forceinline__ float Dot4(float4 a, float4 b) {
  return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

__device__ __forceinline__ void Axpy4(float a, float4 x, float4& y) {
  y.x += a * x.x;
  y.y += a * x.y;
  y.z += a * x.z;
  y.w += a * x.w;
}

__device__ __forceinline__ void Scale4(float a, float4& y) {
  y.x *= a;
  y.y *= a;
  y.z *= a;
  y.w *= a;
}

// Four consecutive cache elements of a row (a lane's piece), as loaded and kept until
// used: a float4 for an fp32 cache, 8 bytes of bf16 (uint2) for a bf16 cache, widened to
// a float4 only where the arithmetic needs it (Widen). Zero past D, as Load4.
template <typename KT>
struct KvPiece {
  using Raw = float4;
  template <bool kVec>
  __device__ __forceinline__ static Raw Load(const float* row, int d, int D) {
    return Load4<kVec>(row, d, D);
  }
  __device__ __forceinline__ static Raw Zero() { return Zero4(); }
  __device__ __forceinline__ static float4 Widen(Raw r) { return r; }
};

template <>
struct KvPiece<uint16_t> {
  using Raw = uint2;
  template <bool kVec>
  __device__ __forceinline__ static Raw Load(const uint16_t* row, int d, int D) {
    if (d >= D) return make_uint2(0u, 0u);
    if constexpr (kVec) {
      return *reinterpret_cast<const uint2*>(row + d);
    } else {
      auto at = [&](int e) { return d + e < D ? static_cast<uint32_t>(row[d + e]) : 0u; };
      return make_uint2(at(0) | (at(1) << 16), at(2) | (at(3) << 16));
    }
  }
  __device__ __forceinline__ static Raw Zero() { return make_uint2(0u, 0u); }
  __device__ __forceinline__ static float4 Widen(Raw r) {
    return make_float4(__uint_as_float(r.x << 16), __uint_as_float(r.x & 0xffff0000u),
                       __uint_as_float(r.y << 16), __uint_as_float(r.y & 0xffff0000u));
  }
};

// One halving level of SumAcrossLanes (n values left, partner lanes o apart), then the
// next by template recursion: every index is a constant, so v stays in registers (a
// `#pragma unroll` over the levels was not unrolled at N = 32, and ptxas put v in a
// 128-byte local frame).
template <int N, int n, int o>
__device__ __forceinline__ void HalveAcrossLanes(float (&v)[N], int lane) {
  if constexpr (n > 1) {
    const unsigned upper = (lane & o) != 0 ? 0xffffffffu : 0u;
#pragma unroll
    for (int k = 0; k < n / 2; ++k) {
      const unsigned lo = __float_as_uint(v[k]), hi = __float_as_uint(v[k + n / 2]);
      const float keep = __uint_as_float((lo & ~upper) | (hi & upper));
      const float send = __uint_as_float((hi & ~upper) | (lo & upper));
      v[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    HalveAcrossLanes<N, n / 2, o / 2>(v, lane);
  }
}

// Sums each of the N values over the warp's 32 lanes. Halving: at offset o a lane keeps
// the half of its values selected by its bit o and adds the partner's copy of that half,
// so N − 1 shuffles leave one value per lane (then 5 − log2 N plain steps). Returns the
// total of value lane · N / 32 (lane L holds the sum of value L for N = 32).
// The halves are chosen with bit masks, not `upper ? v[a] : v[b]`: the compiler turns
// that into v[upper ? a : b], a run-time index, and moved v (32 floats) to local memory.
template <int N>
__device__ __forceinline__ float SumAcrossLanes(float (&v)[N], int lane) {
  HalveAcrossLanes<N, N, 16>(v, lane);
#pragma unroll
  for (int o = 16 / N; o > 0; o /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
  return v[0];
}

// N floats of shared memory, aligned to 4 · min(N, 4) bytes, in as few loads as that allows
// (a step's weights: 4 loads of 16 bytes rather than 16 of 4).
template <int N>
__device__ __forceinline__ void ReadShared(const float* src, float (&dst)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
      const float4 v = reinterpret_cast<const float4*>(src)[k];
      dst[4 * k] = v.x;
      dst[4 * k + 1] = v.y;
      dst[4 * k + 2] = v.z;
      dst[4 * k + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    dst[0] = v.x;
    dst[1] = v.y;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = src[k];
  }
}

template <int C, int kTileHeads, bool kVec, typename KT, int kWarps>
__global__ void __launch_bounds__(
    kWarps * 32, SplitKvShape<C, kTileHeads, kSplitStepKeys<KT, kTileHeads>, kWarps>::kMinBlocks)
    SplitKvKernel(AttentionParams p, int num_splits, float* workspace, int* arrivals) {
  using S = SplitKvShape<C, kTileHeads, kSplitStepKeys<KT, kTileHeads>, kWarps>;
  constexpr int kTile = S::kHeadTile, kSums = S::kSums, kStep = S::kStepK;
  if (p.prefetch) PrefetchFirstStep<KT, kStep>(p, num_splits);
  WaitForPriorGrids();                    // else first: see launch.cuh
  const float scale2 = p.scale * kLog2E;  // scores in base 2
  // A step's weights 2^(s − m') and each head's rescale 2^(m − m'), read back as vectors
  // (ReadShared).
  __shared__ __align__(16) float step_p[kWarps][kSums];
  __shared__ __align__(16) float step_alpha[kWarps][kTile];
  __shared__ float part_ml[kWarps][kTile][2];
  __shared__ float part_acc[kWarps][kTile][S::kMaxDim];

  const int i = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.num_heads / p.num_kv_heads;
  const int D = p.head_dim;
  const SplitSteps<kStep> steps(p, i, split, num_splits);
  const int j_begin = steps.j_begin, j_end = steps.j_end;
  const float* q_group =
      p.q + static_cast<int64_t>(i) * p.q_stride + static_cast<int64_t>(g) * group * D;

  // After SumAcrossLanes a lane holds the score of key su, head st of the step (lanes
  // 32 / kSums apart hold the next one); it keeps the running max and sum of head st.
  const int sidx = lane * kSums / 32, su = sidx / kTile, st = sidx % kTile;
  constexpr int kKeyLanes = 32 / kSums * kTile;  // lane distance between keys of one head

  for (int h0 = 0; h0 < group; h0 += kTile) {
    float4 qr[kTile][C], acc[kTile][C];
    float m = -INFINITY, l = 0.0f;  // of head h0 + st, over this warp's keys so far
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        qr[t][c] =
            h0 + t < group ? Load4<kVec>(q_group + (h0 + t) * D, 128 * c + 4 * lane, D) : Zero4();
        acc[t][c] = Zero4();
      }
    }

    // A step's table entry is looked up a step ahead (next_block): its load is in flight
    // while the warp computes the step before.
    int32_t next_block = steps.Block(j_begin + warp * kStep);
    for (int j0 = j_begin + warp * kStep; j0 < j_end; j0 += kWarps * kStep) {
      // The step's K and V rows, as stored (KvPiece); those of keys past j_end or in other
      // documents are zero and never read (a masked key's row may hold anything).
      typename KvPiece<KT>::Raw kr[kStep][C], vr[kStep][C];
      const int64_t first_row = steps.FirstRow(next_block, j0);
      next_block = steps.Block(j0 + kWarps * kStep);
      // Loads the step's rows: key j0 + u visible by is_visible(u), at cache row row_of(u).
      const auto load_step = [&](auto is_visible, auto row_of) {
#pragma unroll
        for (int u = 0; u < kStep; ++u) {
          const bool vis = is_visible(u);
          const int64_t off = vis ? row_of(u) * p.kv_row_stride + static_cast<int64_t>(g) * D : 0;
#pragma unroll
          for (int c = 0; c < C; ++c) {
            kr[u][c] =
                vis ? KvPiece<KT>::template Load<kVec>(KeysOf<KT>(p) + off, 128 * c + 4 * lane, D)
                    : KvPiece<KT>::Zero();
            vr[u][c] =
                vis ? KvPiece<KT>::template Load<kVec>(ValuesOf<KT>(p) + off, 128 * c + 4 * lane, D)
                    : KvPiece<KT>::Zero();
          }
        }
      };
      // Most steps (all but a split's last, without documents or a window's edge) see all
      // their keys in one block: their loads then take no per-key tests (on a bf16 cache,
      // tile 4, the eight keys' loads are 128 PTX instructions this way, 470 the other:
      // ncu found the kernel issue-bound).
      const bool whole_step = steps.Whole(j0);
      if (whole_step) {
        load_step([](int) { return true; }, [&](int u) { return first_row + u; });
      } else {
        load_step([&](int u) { return steps.Visible(j0 + u); },
                  [&](int u) { return steps.RowOf(first_row, j0, u); });
      }
      float s[kSums];  // s[u · kTile + t]: key u, head h0 + t
#pragma unroll
      for (int u = 0; u < kStep; ++u) {
#pragma unroll
        for (int t = 0; t < kTile; ++t) {
          float dot = 0.0f;
#pragma unroll
          for (int c = 0; c < C; ++c) dot += Dot4(qr[t][c], KvPiece<KT>::Widen(kr[u][c]));
          s[u * kTile + t] = dot;
        }
      }
      // The softmax update, lane-parallel: each lane takes its (key su, head st) score; the
      // max and the sum over a head's keys are shuffles across lanes kKeyLanes apart; each
      // lane makes one exp2 for its weight and (those of key 0) one for the head's rescale,
      // and the weights and rescales reach every lane through shared memory.
      const float total = SumAcrossLanes(s, lane);
      const float score = !(whole_step || steps.Visible(j0 + su)) ? -INFINITY
                          : p.softcap > 0.0f ? SoftCapped(total * p.scale, p.softcap) * kLog2E
                                             : total * scale2;
      float step_max = score;
#pragma unroll
      for (int o = kKeyLanes; o < 32; o *= 2) {
        step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, o));
      }
      const float m_new = fmaxf(m, step_max);
      // Nothing visible yet (m_new = −∞): weights 0, and acc (0) keeps its scale.
      const float alpha = m_new == -INFINITY ? 1.0f : Exp2Approx(m - m_new);
      const float w = score == -INFINITY ? 0.0f : Exp2Approx(score - m_new);
      float w_sum = w;
#pragma unroll
      for (int o = kKeyLanes; o < 32; o *= 2) w_sum += __shfl_xor_sync(0xffffffffu, w_sum, o);
      l = l * alpha + w_sum;
      m = m_new;
      if (lane % (32 / kSums) == 0) {
        step_p[warp][sidx] = w;
        if (su == 0) step_alpha[warp][st] = alpha;
      }
      __syncwarp();
      // Once the running maxima settle, most steps rescale nothing (every head's alpha is
      // 1, exactly: exp2 of 0): the warp then skips the rescale (4 · kTile · C multiplies
      // and a shared load).
      if (!__all_sync(0xffffffffu, alpha == 1.0f)) {
        float alpha_t[kTile];
        ReadShared(&step_alpha[warp][0], alpha_t);
#pragma unroll
        for (int t = 0; t < kTile; ++t) {
#pragma unroll
          for (int c = 0; c < C; ++c) Scale4(alpha_t[t], acc[t][c]);
        }
      }
#pragma unroll
      for (int u = 0; u < kStep; ++u) {
        // 0 for masked keys, whose vr is 0 too (never read): no 0 · NaN.
        float p_u[kTile];
        ReadShared(&step_p[warp][u * kTile], p_u);
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const float4 v = KvPiece<KT>::Widen(vr[u][c]);
#pragma unroll
          for (int t = 0; t < kTile; ++t) Axpy4(p_u[t], v, acc[t][c]);
        }
      }
      __syncwarp();  // step_p and step_alpha are read before the next step overwrites them
    }

    // Merge the warps: O = Σ_w e^{m_w − M} acc_w / Σ_w e^{m_w − M} l_w.
    if (su == 0 && lane % (32 / kSums) == 0) {
      part_ml[warp][st][0] = m;
      part_ml[warp][st][1] = l;
    }
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        float* a = &part_acc[warp][t][128 * c + 4 * lane];  // < kMaxDim = 128·C
        a[0] = acc[t][c].x;
        a[1] = acc[t][c].y;
        a[2] = acc[t][c].z;
        a[3] = acc[t][c].w;
      }
    }
    MergeWarps(p, part_ml, part_acc, i, g, h0, split, num_splits, workspace);
  }
  if (num_splits > 1 && arrivals != nullptr)
    CombineIfLast<kWarps>(p, i, g, num_splits, workspace, arrivals);
}

// The instantiation for SplitKvVariant (attention.h): bit 0 vector loads, bit 1 head sizes
// past 128, bits 2-3 log2 of the head tile, bit 4 a bf16 cache, bit 5 wide blocks.
using SplitKvKernelPtr = void (*)(AttentionParams, int, float*, int*);
template <int C, int kTileHeads, typename KT, int kWarps>
SplitKvKernelPtr SplitKvKernelWith(bool vec) {
  return vec ? SplitKvKernel<C, kTileHeads, true, KT, kWarps>
             : SplitKvKernel<C, kTileHeads, false, KT, kWarps>;
}
template <int C, int kTileHeads, typename KT>
SplitKvKernelPtr SplitKvKernelOf(bool vec, bool wide) {
  if constexpr (kTileHeads * C > 8) {
    return nullptr;  // SplitKvVariant never asks for it
  } else if constexpr (SplitKvHasWide(C, kTileHeads)) {
    return wide ? SplitKvKernelWith<C, kTileHeads, KT, kSplitKvWideWarps>(vec)
                : SplitKvKernelWith<C, kTileHeads, KT, kSplitKvWarps>(vec);
  } else {
    return wide ? nullptr  // nor for this
                : SplitKvKernelWith<C, kTileHeads, KT, kSplitKvWarps>(vec);
  }
}
template <int C, typename KT>
SplitKvKernelPtr SplitKvKernelOf(int tile_log2, bool vec, bool wide) {
  switch (tile_log2) {
    case 0:
      return SplitKvKernelOf<C, 1, KT>(vec, wide);
    case 1:
      return SplitKvKernelOf<C, 2, KT>(vec, wide);
    case 2:
      return SplitKvKernelOf<C, 4, KT>(vec, wide);
    default:
      return SplitKvKernelOf<C, 8, KT>(vec, wide);
  }
}
template <typename KT>
SplitKvKernelPtr SplitKvKernelOf(int variant) {
  const bool vec = (variant & 1) != 0, wide = (variant & 32) != 0;
  const int tile_log2 = (variant >> 2) & 3;
  return (variant & 2) != 0 ? SplitKvKernelOf<2, KT>(tile_log2, vec, wide)
                            : SplitKvKernelOf<1, KT>(tile_log2, vec, wide);
}
SplitKvKernelPtr SplitKvKernelOf(int variant) {
  return (variant & 16) != 0 ? SplitKvKernelOf<uint16_t>(variant) : SplitKvKernelOf<float>(variant);
}

// O = Σ_s 2^{m_s − M} acc_s / Σ_s 2^{m_s − M} l_s over the splits that saw a key.
// Block (row, head): kCombineParts threads a dim (D rounded up to a warp), thread (part, d)
// summing dim d of splits part, part + kCombineParts, …, whose partial values it requests
// all at once, before the weights are known, so their loads are in flight together. The
// splits' maxima and sums go through shared memory, each split's weight 2^(m_s − M)
// computed once by the first warp; the parts' sums meet in shared memory. Measured on an
// H200 (2026-12-04, 8k keys, 66 splits, a thread a dim summing the splits in turn): the
// combine took 8.5 us of a 33 us call, bound by its chain of dependent loads, not bytes.
constexpr int kCombineParts = 4;
constexpr int kCombinePerThread = kSplitKvMaxSplits / kCombineParts;  // splits a thread sums
constexpr int kCombineMaxThreads = kCombineParts * kSplitKvMaxHeadDim;

int SplitKvCombineThreads(int head_dim) {
  return kCombineParts * std::max(32, (head_dim + 31) / 32 * 32);
}

__global__ void __launch_bounds__(kCombineMaxThreads)
    SplitKvCombineKernel(AttentionParams p, int num_splits, const float* workspace) {
  WaitForPriorGrids();                         // first: see launch.cuh
  __shared__ float weight[kSplitKvMaxSplits];  // 2^(m_s − M), 0 for a split that saw no key
  __shared__ float total;                      // Σ_s 2^(m_s − M) l_s
  __shared__ float part_sums[kCombineParts - 1][kSplitKvMaxHeadDim];
  const int i = blockIdx.x, h = blockIdx.y, D = p.head_dim;
  const int dims = static_cast<int>(blockDim.x) / kCombineParts;
  const int d = static_cast<int>(threadIdx.x) % dims, part = static_cast<int>(threadIdx.x) / dims;
  const float* w = workspace + (static_cast<int64_t>(i) * p.num_heads + h) * num_splits * (D + 2);
  float v[kCombinePerThread];
#pragma unroll
  for (int k = 0; k < kCombinePerThread; ++k) {
    const int s = part + kCombineParts * k;
    v[k] = s < num_splits && d < D ? w[s * (D + 2) + 2 + d] : 0.0f;
  }
  if (threadIdx.x < 32) {
    const float l_sum = SplitWeights(w, num_splits, D, weight);
    if (threadIdx.x == 0) total = l_sum;
  }
  __syncthreads();
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < kCombinePerThread; ++k) {
    const int s = part + kCombineParts * k;
    if (s < num_splits) acc += weight[s] * v[k];
  }
  if (part > 0 && d < D) part_sums[part - 1][d] = acc;
  __syncthreads();
  if (part > 0 || d >= D) return;
#pragma unroll
  for (int q = 0; q < kCombineParts - 1; ++q) acc += part_sums[q][d];
  p.out[static_cast<int64_t>(i) * p.out_stride + static_cast<int64_t>(h) * D + d] = acc / total;
}

// ---------------------------------------------------------------------------------------
// Materialised. Block (i, h), fp32 throughout:
//   S[h,i,j] = scale · q·k_j (−∞ masked; SoftCapped); A = softmax(S) (masked 0); O = A·V,
// with O computed from the very A written out.
constexpr int kMaterializedThreads = 256;

// Query row i, head h of p (one block), its keys' blocks in `table` rather than
// p.block_table, so that a batch's rows read their parameters where they lie in global
// memory: a kernel's local copy of AttentionParams, to patch its table in, spilled 20 bytes.
template <typename KT>
__device__ __forceinline__ void MaterializedRow(const AttentionParams& p, const int32_t* table,
                                                int i, int h, float* scores, float* probs) {
  const int D = p.head_dim;
  const int g = h / (p.num_heads / p.num_kv_heads);
  const int64_t row = (static_cast<int64_t>(h) * p.num_queries + i) * p.num_keys;
  const float* q = p.q + static_cast<int64_t>(i) * p.q_stride + static_cast<int64_t>(h) * D;
  float local_max = -INFINITY;
  for (int j = threadIdx.x; j < p.num_keys; j += blockDim.x) {
    float s = -INFINITY;
    if (Visible(p, i, j)) {
      const KT* k = KeysOf<KT>(p) + PhysicalRowIn(table, p.block_size, -1, j) * p.kv_row_stride +
                    static_cast<int64_t>(g) * D;
      float dot = 0.0f;
      for (int d = 0; d < D; ++d) dot += q[d] * KvToFloat(k[d]);
      s = dot * p.scale;
      if (p.softcap > 0.0f) s = SoftCapped(s, p.softcap);
    }
    scores[row + j] = s;
    local_max = fmaxf(local_max, s);
  }
  const float m = BlockReduce(local_max, MaxOp());
  float local_sum = 0.0f;
  for (int j = threadIdx.x; j < p.num_keys; j += blockDim.x) {
    const float s = scores[row + j];
    const float e = s == -INFINITY ? 0.0f : expf(s - m);
    probs[row + j] = e;
    local_sum += e;
  }
  const float z = BlockReduce(local_sum, SumOp());  // ends with a barrier
  for (int j = threadIdx.x; j < p.num_keys; j += blockDim.x) probs[row + j] /= z;
  __syncthreads();  // every probability is final before any thread reads them all
  const int end = CausalEnd(p, i);
  float* o = p.out + static_cast<int64_t>(i) * p.out_stride + static_cast<int64_t>(h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < end; ++j) {
      if (!Visible(p, i, j)) continue;
      acc += probs[row + j] *
             KvToFloat(ValuesOf<KT>(p)[PhysicalRowIn(table, p.block_size, -1, j) * p.kv_row_stride +
                                       static_cast<int64_t>(g) * D + d]);
    }
    o[d] = acc;
  }
}

template <typename KT>
__global__ void __launch_bounds__(kMaterializedThreads)
    MaterializedKernel(AttentionParams p, float* scores, float* probs) {
  WaitForPriorGrids();  // first: see launch.cuh
  MaterializedRow<KT>(p, p.block_table, blockIdx.x, blockIdx.y, scores, probs);
}

// Block (h, c): head h of call c's one query row.
template <typename KT>
__global__ void __launch_bounds__(kMaterializedThreads)
    MaterializedRowsKernel(const MaterializedRowCall* calls, const int32_t* tables) {
  WaitForPriorGrids();  // first: see launch.cuh
  const MaterializedRowCall& call = calls[blockIdx.y];
  MaterializedRow<KT>(call.p, tables + call.table_offset, 0, blockIdx.x, call.scores, call.probs);
}

}  // namespace

int SplitKvVariant(const AttentionParams& p, int warps) {
  const int chunks = p.head_dim <= 128 ? 1 : 2;
  const int group = std::max(p.num_heads / std::max(p.num_kv_heads, 1), 1);
  int tile_log2 = 0;
  while ((1 << tile_log2) < group && (2 << tile_log2) * chunks <= 8) ++tile_log2;
  const bool wide = warps == kSplitKvWideWarps && SplitKvHasWide(chunks, 1 << tile_log2);
  return (wide ? 32 : 0) + (p.kv_dtype == KvDtype::kBF16 ? 16 : 0) + tile_log2 * 4 +
         (chunks == 2 ? 2 : 0) + (SplitKvVectorized(p) ? 1 : 0);
}

absl::Status CheckSplitKvWarps(int warps) {
  if (warps != kSplitKvWarps && warps != kSplitKvWideWarps) {
    return absl::InvalidArgumentError(absl::StrCat("split-KV warps must be ", kSplitKvWarps, " or ",
                                                   kSplitKvWideWarps, ", got ", warps));
  }
  return absl::OkStatus();
}

int SplitKvVariantWarps(int variant) {
  return (variant & 32) != 0 ? kSplitKvWideWarps : kSplitKvWarps;
}

absl::StatusOr<int> SplitKvBlocksPerSm(int variant) {
  int blocks = 0;
  KVLENS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, reinterpret_cast<const void*>(SplitKvKernelOf(variant)),
      SplitKvVariantWarps(variant) * 32, 0));
  return std::max(blocks, 1);
}

int SplitsForOneWave(const AttentionParams& p, int64_t slots, int64_t min_keys, int step) {
  const int64_t blocks = static_cast<int64_t>(p.num_queries) * p.num_kv_heads;
  // One full wave: as many blocks as fit at once, no partial second wave.
  const int64_t want = std::max<int64_t>(1, std::max<int64_t>(slots, 1) / blocks);
  // A row reads at most a sliding window's keys.
  const int64_t row_keys = p.window > 0 ? std::min(p.num_keys, p.window) : p.num_keys;
  const int64_t by_keys = std::max<int64_t>(1, row_keys / min_keys);
  const int64_t splits = std::clamp<int64_t>(std::min(want, by_keys), 1, kSplitKvMaxSplits);
  // The kernels give each split a span of whole steps (SplitSteps): count the splits
  // those spans fill, so that no block is launched without keys (66 splits of 8192 keys
  // are spans of 128, which 64 fill) and the combine reads no empty partials.
  const int64_t span = ((row_keys + splits - 1) / splits + step - 1) / step * step;
  return static_cast<int>(std::max<int64_t>(1, (row_keys + span - 1) / span));
}

int ChooseNumSplits(const AttentionParams& p, int num_sms, int blocks_per_sm, int warps) {
  // At least 4 steps of 4 keys for each of the block's warps a split (64 keys with 4 warps)
  // on an fp32 cache, 2 steps on a bf16 one (8-key steps).
  const int variant = SplitKvVariant(p, warps);
  const int64_t min_keys = 4 * SplitKvVariantWarps(variant) * kStepKeys;
  const int step = SplitStepKeys((variant & 16) != 0, 1 << ((variant >> 2) & 3));
  return SplitsForOneWave(p, static_cast<int64_t>(num_sms) * std::max(blocks_per_sm, 1), min_keys,
                          step);
}

int SplitKvImbalance(const int32_t* key_ends, int rows) {
  int64_t total = 0;
  int longest = 0;
  for (int r = 0; r < rows; ++r) {
    total += std::max(key_ends[r], 0);
    longest = std::max(longest, key_ends[r]);
  }
  if (total <= 0) return 1;
  // ceil(longest / mean) = ceil(longest · rows / total).
  const int64_t ratio = (int64_t{longest} * rows + total - 1) / total;
  int imbalance = 1;
  while (imbalance < ratio && imbalance < kSplitKvMaxSplits) imbalance *= 2;
  return imbalance;
}

bool SplitKvVectorized(const AttentionParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.head_dim % 4 == 0 && p.q_stride % 4 == 0 && aligned(p.q) && KvVectorized(p);
}

int64_t SplitKvArrivalCounts(const AttentionParams& p) {
  return static_cast<int64_t>(p.num_queries) * p.num_kv_heads;
}

int64_t SplitKvWorkspaceFloats(const AttentionParams& p, int num_splits) {
  if (num_splits <= 1) return 0;
  return static_cast<int64_t>(p.num_queries) * p.num_heads * num_splits * (p.head_dim + 2);
}

absl::Status LaunchSplitKv(const AttentionParams& p, int warps, int num_splits, float* workspace,
                           int* arrivals, cudaStream_t stream) {
  if (absl::Status s = CheckSplitKvWarps(warps); !s.ok()) return s;
  if (p.head_dim > kSplitKvMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split-KV attention supports head_dim <= ", kSplitKvMaxHeadDim, ", got ", p.head_dim));
  }
  if (num_splits > kSplitKvMaxSplits) {
    return absl::InvalidArgumentError(absl::StrCat("split-KV attention takes at most ",
                                                   kSplitKvMaxSplits, " splits, got ", num_splits));
  }
  num_splits = std::max(num_splits, 1);
  const dim3 grid(p.num_queries, p.num_kv_heads, num_splits);
  const int variant = SplitKvVariant(p, warps);
  const dim3 block(SplitKvVariantWarps(variant) * 32);
  auto* kernel = SplitKvKernelOf(variant);
  AttentionParams launched = p;
  launched.prefetch = PrefetchBeforeWait();  // its first step's K and V, before the wait
  LaunchKernel("SplitKvKernel", kernel, grid, block, 0, stream, launched, num_splits, workspace,
               num_splits > 1 ? arrivals : nullptr);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("SplitKvKernel");
  if (num_splits > 1 && arrivals == nullptr)
    return LaunchSplitKvCombine(p, num_splits, workspace, stream);
  return absl::OkStatus();
}

absl::Status LaunchSplitKvCombine(const AttentionParams& p, int num_splits, const float* workspace,
                                  cudaStream_t stream) {
  const dim3 combine_grid(p.num_queries, p.num_heads);
  const int threads = SplitKvCombineThreads(p.head_dim);
  LaunchKernel("SplitKvCombineKernel", SplitKvCombineKernel, combine_grid, threads, 0, stream, p,
               num_splits, workspace);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("SplitKvCombineKernel");
  return absl::OkStatus();
}

absl::Status LaunchMaterialized(const AttentionParams& p, float* scores, float* probs,
                                cudaStream_t stream) {
  const dim3 grid(p.num_queries, p.num_heads);
  if (p.kv_dtype == KvDtype::kBF16) {
    LaunchKernel("MaterializedKernel", MaterializedKernel<uint16_t>, grid, kMaterializedThreads, 0,
                 stream, p, scores, probs);
  } else {
    LaunchKernel("MaterializedKernel", MaterializedKernel<float>, grid, kMaterializedThreads, 0,
                 stream, p, scores, probs);
  }
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("MaterializedKernel");
  return absl::OkStatus();
}

absl::Status LaunchMaterializedRows(const MaterializedRowCall* calls, int num_calls,
                                    const int32_t* tables, int num_heads, KvDtype kv_dtype,
                                    cudaStream_t stream) {
  if (num_calls < 1) return absl::OkStatus();
  const dim3 grid(num_heads, num_calls);
  if (kv_dtype == KvDtype::kBF16) {
    LaunchKernel("MaterializedRowsKernel", MaterializedRowsKernel<uint16_t>, grid,
                 kMaterializedThreads, 0, stream, calls, tables);
  } else {
    LaunchKernel("MaterializedRowsKernel", MaterializedRowsKernel<float>, grid,
                 kMaterializedThreads, 0, stream, calls, tables);
  }
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("MaterializedRowsKernel");
  return absl::OkStatus();
}

}  // namespace kvlens::kernels::cuda
