// Split-KV attention on tensor cores (attention.h, "Split-KV on tensor cores"). Block
// (i, g, split) as SplitKvKernel's (attention.cu): query row i, KV head g, the split's keys
// (SplitSteps), its kSplitKvMmaWarps warps taking turns over steps of 16 keys on a bf16
// cache, 8 on fp32, each keeping its own (m, l, O) for a tile of the group's heads, the
// warps merged in shared memory (MergeWarps), the splits by SplitKvCombineKernel or the last
// block (CombineIfLast). The products take bf16 on a bf16 cache, fp16 on fp32 (Piece8).
//
// Fragments (mma_sync.cuh; r = lane / 4, t = lane % 4). The tile's heads h0 + r and
// h0 + r + 8 are the product's rows (kRows = 8: the second half is absent). A dot product
// may take its dims in any order so long as Q and K agree, and P·V its keys in any order
// so long as P and V agree; the loads pick orders that let each lane read 8 elements of a
// row at a time (a Piece8: 16 bytes of bf16, 32 of fp32):
//   Q·Kᵀ, chunk c = 2k + e (16 dims): lane (r, t) holds dims 32k + 8t + 4e + {0, 1} as the
//     chunk's 2t, 2t+1 and + {2, 3} as 2t+8, 2t+9, for Q (A: heads r, r+8) and for K (B:
//     key r of the step's first 8, key r + 8 of the second): one piece of K's row feeds
//     two chunks.
//   S (C): s[kt][0..1] = S[head r][key 8kt + 2t + {0, 1}], s[kt][2..3] the same of head r+8,
//     which packed in pairs are P·V's A operand as they stand (keys 2t, 2t+1, 2t+8, 2t+9;
//     the last two 0 with 8-key steps).
//   P·V, dim tile n = 8·half + c: column r is dim 64·half + 8r + c, so lane (r, t) reads dims
//     64·half + 8r … +7 of the rows of keys 2t, 2t+1 (and 2t+8, 2t+9) and pairs element c of
//     two keys' pieces for B. Its O (C) holds head r (and r+8), columns 2t and 2t+1: dims
//     64·half + 16t + c and 64·half + 16t + 8 + c.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/kv_load.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma_sync.cuh"
#include "kernels/cuda/split_kv_common.cuh"

namespace kvlens::kernels::cuda {
namespace {

constexpr int kWarps = kSplitKvMmaWarps;

// Eight consecutive elements of a cache row as a lane loads them (KT: uint16_t for bf16,
// 16 bytes; float, 32 bytes, rounded to fp16 for the products), and the products' element
// type: Pair(e) packs elements 2e and 2e + 1, Across(a, b, c) element c of a and of b, two
// 16-bit values in one register, the first in the low half.
template <typename KT>
struct Piece8;

template <>
struct Piece8<uint16_t> {
  uint4 raw;
  __device__ __forceinline__ static Piece8 Load(const uint16_t* at) {
    return {*reinterpret_cast<const uint4*>(at)};
  }
  __device__ __forceinline__ static Piece8 Zero() { return {make_uint4(0u, 0u, 0u, 0u)}; }
  __device__ __forceinline__ uint32_t Word(int w) const {
    return w == 0 ? raw.x : w == 1 ? raw.y : w == 2 ? raw.z : raw.w;
  }
  __device__ __forceinline__ uint32_t Pair(int e) const { return Word(e); }
  __device__ __forceinline__ static uint32_t Across(const Piece8& a, const Piece8& b, int c) {
    const uint32_t wa = a.Word(c / 2), wb = b.Word(c / 2);
    return c % 2 == 0 ? (wa & 0xffffu) | (wb << 16) : (wa >> 16) | (wb & 0xffff0000u);
  }
  __device__ __forceinline__ static uint32_t Pack(float lo, float hi) { return PackBf162(lo, hi); }
  __device__ __forceinline__ static void Mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    MmaBf16(d, a, b);
  }
};

template <>
struct Piece8<float> {
  float4 lo, hi;
  __device__ __forceinline__ static Piece8 Load(const float* at) {
    return {reinterpret_cast<const float4*>(at)[0], reinterpret_cast<const float4*>(at)[1]};
  }
  __device__ __forceinline__ static Piece8 Zero() {
    return {make_float4(0.0f, 0.0f, 0.0f, 0.0f), make_float4(0.0f, 0.0f, 0.0f, 0.0f)};
  }
  __device__ __forceinline__ float At(int c) const {
    const float4& v = c < 4 ? lo : hi;
    const int k = c % 4;
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
  }
  __device__ __forceinline__ uint32_t Pair(int e) const { return Pack(At(2 * e), At(2 * e + 1)); }
  __device__ __forceinline__ static uint32_t Across(const Piece8& a, const Piece8& b, int c) {
    return Pack(a.At(c), b.At(c));
  }
  __device__ __forceinline__ static uint32_t Pack(float lo, float hi) { return PackHalf2(lo, hi); }
  __device__ __forceinline__ static void Mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    MmaF16(d, a, b);
  }
};

// KT: the cache's element; kDh: 64 or 128; kRows: heads a tile (8, or 16 for groups past
// 8). Bounded to 2 blocks an SM at Dh 128 (O alone is 64 floats a lane), 3 at 64.
template <typename KT, int kDh, int kRows>
__global__ void __launch_bounds__(kWarps * 32, kDh == 64 ? 3 : 2)
    SplitKvMmaKernel(AttentionParams p, int num_splits, float* workspace, int* arrivals) {
  WaitForPriorGrids();  // first: see launch.cuh
  using Piece = Piece8<KT>;
  constexpr int kStep = sizeof(KT) == 2 ? kSplitKvMmaBf16StepKeys : kSplitKvMmaF32StepKeys;
  constexpr int kKeyTiles = kStep / 8;  // n8 tiles of Q·Kᵀ a step: 2 (bf16) or 1 (fp32)
  constexpr int kKLoads = kDh / 32;     // 8-element pieces of a K row a lane loads
  constexpr int kHalves = kDh / 64;     // … and of a V row
  constexpr int kChunks = kDh / 16;     // k16 chunks of Q·Kᵀ
  constexpr int kDimTiles = kDh / 8;    // n8 tiles of P·V
  constexpr bool kTwoHalves = kRows == 16;
  __shared__ float part_ml[kWarps][kRows][2];
  __shared__ float part_acc[kWarps][kRows][kDh];

  const int i = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, t = lane % 4;
  const int group = p.num_heads / p.num_kv_heads;
  const float scale2 = p.scale * 1.4426950408889634f;      // scores in base 2
  const SplitSteps<kStep> steps(p, i, split, num_splits);  // as ChooseNumSplitsMma
  const int j_begin = steps.j_begin, j_end = steps.j_end;
  const float* q_group =
      p.q + static_cast<int64_t>(i) * p.q_stride + static_cast<int64_t>(g) * group * kDh;
  const KT* k_cache = KeysOf<KT>(p) + static_cast<int64_t>(g) * kDh;
  const KT* v_cache = ValuesOf<KT>(p) + static_cast<int64_t>(g) * kDh;
  // The keys of a step whose rows a lane loads: K's r (and r + 8), V's 2t, 2t+1 (and 2t+8,
  // 2t+9): the second of each with 16-key steps.
  const int k_key[2] = {r, r + 8};
  const int v_key[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
  constexpr int kVKeys = 2 * kKeyTiles;

  for (int h0 = 0; h0 < group; h0 += kRows) {
    // Q as A fragments of the products' type (rows past the group: 0).
    uint32_t qa[kChunks][4];
#pragma unroll
    for (int k = 0; k < kKLoads; ++k) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 2 * k + e, d = 32 * k + 8 * t + 4 * e;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int h = h0 + r + 8 * half;
          const float4 x = (half == 0 || kTwoHalves) && h < group
                               ? *reinterpret_cast<const float4*>(q_group + h * kDh + d)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          qa[c][half] = Piece::Pack(x.x, x.y);
          qa[c][2 + half] = Piece::Pack(x.z, x.w);
        }
      }
    }
    float o[kDimTiles][4];
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // heads r, r + 8; l: this lane's

    int32_t next_block = steps.Block(j_begin + warp * kStep);  // a step ahead
    for (int j0 = j_begin + warp * kStep; j0 < j_end; j0 += kWarps * kStep) {
      const int64_t first_row = steps.FirstRow(next_block, j0);
      next_block = steps.Block(j0 + kWarps * kStep);
      const bool whole_step = steps.Whole(j0);
      // The row of step key u, or −1 where it is hidden (its row is not read: it may be
      // past the sequence, NaN included).
      const auto row_of = [&](int u) -> int64_t {
        if (whole_step) return first_row + u;
        return steps.Visible(j0 + u) ? steps.RowOf(first_row, j0, u) : -1;
      };
      Piece kr[kKeyTiles][kKLoads], vr[kVKeys][kHalves];
#pragma unroll
      for (int x = 0; x < kKeyTiles; ++x) {
        const int64_t row = row_of(k_key[x]);
#pragma unroll
        for (int k = 0; k < kKLoads; ++k) {
          kr[x][k] = row >= 0 ? Piece::Load(k_cache + row * p.kv_row_stride + 32 * k + 8 * t)
                              : Piece::Zero();
        }
      }
#pragma unroll
      for (int y = 0; y < kVKeys; ++y) {
        const int64_t row = row_of(v_key[y]);
#pragma unroll
        for (int half = 0; half < kHalves; ++half) {
          vr[y][half] = row >= 0 ? Piece::Load(v_cache + row * p.kv_row_stride + 64 * half + 8 * r)
                                 : Piece::Zero();
        }
      }

      // S = Q·Kᵀ for the step's groups of 8 keys.
      float s[kKeyTiles][4];
#pragma unroll
      for (int kt = 0; kt < kKeyTiles; ++kt) {
        s[kt][0] = s[kt][1] = s[kt][2] = s[kt][3] = 0.0f;
#pragma unroll
        for (int k = 0; k < kKLoads; ++k) {
          const uint32_t b0[2] = {kr[kt][k].Pair(0), kr[kt][k].Pair(1)},
                         b1[2] = {kr[kt][k].Pair(2), kr[kt][k].Pair(3)};
          Piece::Mma(s[kt], qa[2 * k], b0);
          Piece::Mma(s[kt], qa[2 * k + 1], b1);
        }
      }
      // The online softmax of heads r and r + 8 over this lane's keys 8kt + 2t + e, the
      // row's maximum across its 4 lanes (t).
      float alpha[2] = {1.0f, 1.0f};
#pragma unroll
      for (int half = 0; half < (kTwoHalves ? 2 : 1); ++half) {
        float step_max = -INFINITY;
#pragma unroll
        for (int kt = 0; kt < kKeyTiles; ++kt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[kt][2 * half + e];
            const bool vis = whole_step || steps.Visible(j0 + 8 * kt + 2 * t + e);
            x = !vis               ? -INFINITY
                : p.softcap > 0.0f ? SoftCapped(x * p.scale, p.softcap) * 1.4426950408889634f
                                   : x * scale2;
            step_max = fmaxf(step_max, x);
          }
        }
        step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 1));
        step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 2));
        const float m_new = fmaxf(m[half], step_max);
        // Nothing visible yet (m_new = −∞): weights 0, and O (0) keeps its scale.
        alpha[half] = m_new == -INFINITY ? 1.0f : exp2f(m[half] - m_new);
        float w_sum = 0.0f;
#pragma unroll
        for (int kt = 0; kt < kKeyTiles; ++kt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[kt][2 * half + e];
            x = x == -INFINITY ? 0.0f : exp2f(x - m_new);
            w_sum += x;
          }
        }
        l[half] = l[half] * alpha[half] + w_sum;
        m[half] = m_new;
      }
      // Once the maxima settle most steps rescale nothing (alpha exactly 1).
      if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          o[n][0] *= alpha[0];
          o[n][1] *= alpha[0];
          o[n][2] *= alpha[1];
          o[n][3] *= alpha[1];
        }
      }
      // O += P·V, P rounded as Q (hidden keys' weights 0, their V rows 0: no 0 · NaN). With
      // 8-key steps the product's keys 8 … 15 are absent: their P and V are 0.
      const uint32_t pa[4] = {
          Piece::Pack(s[0][0], s[0][1]), Piece::Pack(s[0][2], s[0][3]),
          kKeyTiles == 2 ? Piece::Pack(s[kKeyTiles - 1][0], s[kKeyTiles - 1][1]) : 0u,
          kKeyTiles == 2 ? Piece::Pack(s[kKeyTiles - 1][2], s[kKeyTiles - 1][3]) : 0u};
#pragma unroll
      for (int half = 0; half < kHalves; ++half) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const uint32_t b[2] = {
              Piece::Across(vr[0][half], vr[1][half], c),
              kKeyTiles == 2 ? Piece::Across(vr[kVKeys - 2][half], vr[kVKeys - 1][half], c) : 0u};
          Piece::Mma(o[8 * half + c], pa, b);
        }
      }
    }

    // The warp's (m, l, O) to shared memory (l summed over the row's 4 lanes), then merged.
#pragma unroll
    for (int half = 0; half < (kTwoHalves ? 2 : 1); ++half) {
      float l_row = l[half];
      l_row += __shfl_xor_sync(0xffffffffu, l_row, 1);
      l_row += __shfl_xor_sync(0xffffffffu, l_row, 2);
      if (t == 0) {
        part_ml[warp][r + 8 * half][0] = m[half];
        part_ml[warp][r + 8 * half][1] = l_row;
      }
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          float* row = part_acc[warp][r + 8 * half] + 64 * hf + 16 * t + c;
          row[0] = o[8 * hf + c][2 * half];
          row[8] = o[8 * hf + c][2 * half + 1];
        }
      }
    }
    MergeWarps(p, part_ml, part_acc, i, g, h0, split, num_splits, workspace);
  }
  if (num_splits > 1 && arrivals != nullptr)
    CombineIfLast<kWarps>(p, i, g, num_splits, workspace, arrivals);
}

using SplitKvMmaKernelPtr = void (*)(AttentionParams, int, float*, int*);
template <typename KT>
SplitKvMmaKernelPtr SplitKvMmaKernelOf(int variant) {
  switch (variant & 3) {
    case 0:
      return SplitKvMmaKernel<KT, 64, 8>;
    case 1:
      return SplitKvMmaKernel<KT, 64, 16>;
    case 2:
      return SplitKvMmaKernel<KT, 128, 8>;
    default:
      return SplitKvMmaKernel<KT, 128, 16>;
  }
}
SplitKvMmaKernelPtr SplitKvMmaKernelOf(int variant) {
  return (variant & 4) != 0 ? SplitKvMmaKernelOf<uint16_t>(variant)
                            : SplitKvMmaKernelOf<float>(variant);
}

}  // namespace

bool SplitKvMmaSupports(const AttentionParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  // A lane's pieces of 8 elements: 16 bytes of bf16, two float4s of fp32.
  const int64_t piece_stride = p.kv_dtype == KvDtype::kBF16 ? 8 : 4;
  return (p.head_dim == 64 || p.head_dim == 128) && p.kv_row_stride % piece_stride == 0 &&
         aligned(p.k) && aligned(p.v) && aligned(p.q) && p.q_stride % 4 == 0;
}

int SplitKvMmaVariant(const AttentionParams& p) {
  const int group = p.num_heads / std::max(p.num_kv_heads, 1);
  return (p.kv_dtype == KvDtype::kBF16 ? 4 : 0) + (p.head_dim == 128 ? 2 : 0) + (group > 8 ? 1 : 0);
}

absl::StatusOr<int> SplitKvMmaBlocksPerSm(int variant) {
  int blocks = 0;
  KVLENS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, reinterpret_cast<const void*>(SplitKvMmaKernelOf(variant)), kWarps * 32, 0));
  return std::max(blocks, 1);
}

int ChooseNumSplitsMma(const AttentionParams& p, int num_sms, int blocks_per_sm) {
  const int step = SplitKvMmaStepKeys(p.kv_dtype);
  return SplitsForOneWave(p, static_cast<int64_t>(num_sms) * std::max(blocks_per_sm, 1),
                          2 * kWarps * step, step);
}

absl::Status LaunchSplitKvMma(const AttentionParams& p, int num_splits, float* workspace,
                              int* arrivals, cudaStream_t stream) {
  if (!SplitKvMmaSupports(p)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor-core split-KV attention needs head_dim 64 or 128 and 16-byte aligned cache "
        "rows, got head_dim ",
        p.head_dim));
  }
  if (num_splits > kSplitKvMaxSplits) {
    return absl::InvalidArgumentError(absl::StrCat("split-KV attention takes at most ",
                                                   kSplitKvMaxSplits, " splits, got ", num_splits));
  }
  num_splits = std::max(num_splits, 1);
  const dim3 grid(p.num_queries, p.num_kv_heads, num_splits);
  LaunchKernel("SplitKvMmaKernel", SplitKvMmaKernelOf(SplitKvMmaVariant(p)), grid,
               dim3(kWarps * 32), 0, stream, p, num_splits, workspace,
               num_splits > 1 ? arrivals : nullptr);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("SplitKvMmaKernel");
  if (num_splits > 1 && arrivals == nullptr)
    return LaunchSplitKvCombine(p, num_splits, workspace, stream);
  return absl::OkStatus();
}

}  // namespace kvlens::kernels::cuda
