// Split-KV attention on tensor cores over a bf16 cache (attention.h, "Split-KV on tensor
// cores"). Block (i, g, split) as SplitKvKernel's (attention.cu): query row i, KV head g,
// the split's keys (SplitKeysOf), its kSplitKvMmaWarps warps taking turns over steps of 16
// keys, each keeping its own (m, l, O) for a tile of the group's heads, the warps merged in
// shared memory (MergeWarps), the splits by SplitKvCombineKernel or the last block
// (CombineIfLast).
//
// Fragments (mma_sync.cuh; r = lane / 4, t = lane % 4). The tile's heads h0 + r and
// h0 + r + 8 are the product's rows (kRows = 8: the second half is absent). A dot product
// may take its dims in any order so long as Q and K agree, and P·V its keys in any order
// so long as P and V agree; the loads pick orders that let each lane read 16 bytes of a
// row at a time:
//   Q·Kᵀ, chunk c = 2k + e (16 dims): lane (r, t) holds dims 32k + 8t + 4e + {0, 1} as the
//     chunk's 2t, 2t+1 and + {2, 3} as 2t+8, 2t+9, for Q (A: heads r, r+8) and for K (B:
//     key r of the step's first 8, key r + 8 of the second): one 16-byte load of K's row
//     feeds two chunks.
//   S (C): s[kt][0..1] = S[head r][key 8kt + 2t + {0, 1}], s[kt][2..3] the same of head r+8,
//     which as bf16 pairs are P·V's A operand as they stand (keys 2t, 2t+1, 2t+8, 2t+9).
//   P·V, dim tile n = 8·half + c: column r is dim 64·half + 8r + c, so lane (r, t) reads dims
//     64·half + 8r … +7 of the rows of keys 2t, 2t+1, 2t+8 and 2t+9 (16 bytes each) and
//     pairs element c of two keys' pieces for B. Its O (C) holds head r (and r+8), columns
//     2t and 2t+1: dims 64·half + 16t + c and 64·half + 16t + 8 + c.
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
constexpr int kStep = kSplitKvMmaStepKeys;

// Element c (0…7) of row pieces a and b (8 bf16 each), paired: a's in the low half.
__device__ __forceinline__ uint32_t PairOf(const uint4& a, const uint4& b, int c) {
  const uint32_t wa = c < 2 ? a.x : c < 4 ? a.y : c < 6 ? a.z : a.w;
  const uint32_t wb = c < 2 ? b.x : c < 4 ? b.y : c < 6 ? b.z : b.w;
  return c % 2 == 0 ? (wa & 0xffffu) | (wb << 16) : (wa >> 16) | (wb & 0xffff0000u);
}

// kDh: 64 or 128; kRows: heads a tile (8, or 16 for groups past 8). Bounded to 2 blocks an
// SM at Dh 128 (O alone is 64 floats a lane), 3 at 64.
template <int kDh, int kRows>
__global__ void __launch_bounds__(kWarps * 32, kDh == 64 ? 3 : 2)
    SplitKvMmaKernel(AttentionParams p, int num_splits, float* workspace, int* arrivals) {
  WaitForPriorGrids();                // first: see launch.cuh
  constexpr int kKLoads = kDh / 32;   // 16-byte pieces of a K row a lane loads
  constexpr int kHalves = kDh / 64;   // … and of a V row
  constexpr int kChunks = kDh / 16;   // k16 chunks of Q·Kᵀ
  constexpr int kDimTiles = kDh / 8;  // n8 tiles of P·V
  constexpr bool kTwoHalves = kRows == 16;
  __shared__ float part_ml[kWarps][kRows][2];
  __shared__ float part_acc[kWarps][kRows][kDh];

  const int i = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, t = lane % 4;
  const int group = p.num_heads / p.num_kv_heads;
  const float scale2 = p.scale * 1.4426950408889634f;  // scores in base 2
  const SplitKeys keys = SplitKeysOf(p, i, split, num_splits, kStep);
  const int key_begin = keys.key_begin, j_begin = keys.j_begin, j_end = keys.j_end;
  const int q_doc = p.q_doc != nullptr ? p.q_doc[i] : 0;
  const int32_t* table =
      p.row_table_offset != nullptr ? p.block_table + p.row_table_offset[i] : p.block_table;
  const float* q_group =
      p.q + static_cast<int64_t>(i) * p.q_stride + static_cast<int64_t>(g) * group * kDh;
  const uint16_t* k_cache = KeysOf<uint16_t>(p) + static_cast<int64_t>(g) * kDh;
  const uint16_t* v_cache = ValuesOf<uint16_t>(p) + static_cast<int64_t>(g) * kDh;
  const auto visible = [&](int j) {
    return j < j_end && j >= key_begin && (p.q_doc == nullptr || p.k_doc[j] == q_doc);
  };
  const bool step_in_one_block = p.block_size % kStep == 0;
  const int block_shift = BlockShift(p.block_size);
  const auto step_block = [&](int j0) {
    return step_in_one_block && table != nullptr && j0 < j_end
               ? table[BlockIndexOf(p.block_size, block_shift, j0)]
               : 0;
  };
  // The keys of a step whose rows a lane loads: K's r and r + 8, V's 2t, 2t+1, 2t+8, 2t+9.
  const int k_key[2] = {r, r + 8};
  const int v_key[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};

  for (int h0 = 0; h0 < group; h0 += kRows) {
    // Q as bf16 A fragments (rows past the group: 0).
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
          qa[c][half] = PackBf162(x.x, x.y);
          qa[c][2 + half] = PackBf162(x.z, x.w);
        }
      }
    }
    float o[kDimTiles][4];
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // heads r, r + 8; l: this lane's

    int32_t next_block = step_block(j_begin + warp * kStep);
    for (int j0 = j_begin + warp * kStep; j0 < j_end; j0 += kWarps * kStep) {
      const int64_t first_row = !step_in_one_block ? 0
                                : table == nullptr
                                    ? j0
                                    : RowInBlock(next_block, p.block_size, block_shift, j0);
      next_block = step_block(j0 + kWarps * kStep);
      // As SplitKvKernel's whole steps: every key visible, in one block, no per-key tests.
      const bool whole_step =
          step_in_one_block && p.q_doc == nullptr && j0 >= key_begin && j0 + kStep <= j_end;
      // The row of step key u, or −1 where it is hidden (its row is not read: it may be
      // past the sequence, NaN included).
      const auto row_of = [&](int u) -> int64_t {
        if (whole_step) return first_row + u;
        if (!visible(j0 + u)) return -1;
        return step_in_one_block ? first_row + u
                                 : PhysicalRowIn(table, p.block_size, block_shift, j0 + u);
      };
      uint4 kr[2][kKLoads], vr[4][kHalves];
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int64_t row = row_of(k_key[x]);
#pragma unroll
        for (int k = 0; k < kKLoads; ++k) {
          kr[x][k] = row >= 0 ? *reinterpret_cast<const uint4*>(k_cache + row * p.kv_row_stride +
                                                                32 * k + 8 * t)
                              : make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int64_t row = row_of(v_key[y]);
#pragma unroll
        for (int half = 0; half < kHalves; ++half) {
          vr[y][half] = row >= 0 ? *reinterpret_cast<const uint4*>(v_cache + row * p.kv_row_stride +
                                                                   64 * half + 8 * r)
                                 : make_uint4(0u, 0u, 0u, 0u);
        }
      }

      // S = Q·Kᵀ for the step's two groups of 8 keys.
      float s[2][4];
#pragma unroll
      for (int kt = 0; kt < 2; ++kt) {
        s[kt][0] = s[kt][1] = s[kt][2] = s[kt][3] = 0.0f;
#pragma unroll
        for (int k = 0; k < kKLoads; ++k) {
          const uint32_t b0[2] = {kr[kt][k].x, kr[kt][k].y}, b1[2] = {kr[kt][k].z, kr[kt][k].w};
          MmaBf16(s[kt], qa[2 * k], b0);
          MmaBf16(s[kt], qa[2 * k + 1], b1);
        }
      }
      // The online softmax of heads r and r + 8 over this lane's keys 8kt + 2t + e, the
      // row's maximum across its 4 lanes (t).
      float alpha[2] = {1.0f, 1.0f};
#pragma unroll
      for (int half = 0; half < (kTwoHalves ? 2 : 1); ++half) {
        float step_max = -INFINITY;
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[kt][2 * half + e];
            const bool vis = whole_step || visible(j0 + 8 * kt + 2 * t + e);
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
        for (int kt = 0; kt < 2; ++kt) {
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
      // O += P·V, P as bf16 (hidden keys' weights 0, their V rows 0: no 0 · NaN).
      const uint32_t pa[4] = {PackBf162(s[0][0], s[0][1]), PackBf162(s[0][2], s[0][3]),
                              PackBf162(s[1][0], s[1][1]), PackBf162(s[1][2], s[1][3])};
#pragma unroll
      for (int half = 0; half < kHalves; ++half) {
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const uint32_t b[2] = {PairOf(vr[0][half], vr[1][half], c),
                                 PairOf(vr[2][half], vr[3][half], c)};
          MmaBf16(o[8 * half + c], pa, b);
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
    __syncthreads();
    MergeWarps(p, part_ml, part_acc, i, g, h0, split, num_splits, workspace);
    __syncthreads();  // the next head tile reuses part_ml and part_acc
  }
  if (num_splits > 1 && arrivals != nullptr)
    CombineIfLast<kWarps>(p, i, g, num_splits, workspace, arrivals);
}

using SplitKvMmaKernelPtr = void (*)(AttentionParams, int, float*, int*);
SplitKvMmaKernelPtr SplitKvMmaKernelOf(int variant) {
  switch (variant) {
    case 0:
      return SplitKvMmaKernel<64, 8>;
    case 1:
      return SplitKvMmaKernel<64, 16>;
    case 2:
      return SplitKvMmaKernel<128, 8>;
    default:
      return SplitKvMmaKernel<128, 16>;
  }
}

}  // namespace

bool SplitKvMmaSupports(const AttentionParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.kv_dtype == KvDtype::kBF16 && (p.head_dim == 64 || p.head_dim == 128) &&
         p.kv_row_stride % 8 == 0 && aligned(p.k) && aligned(p.v) && aligned(p.q) &&
         p.q_stride % 4 == 0;
}

int SplitKvMmaVariant(const AttentionParams& p) {
  const int group = p.num_heads / std::max(p.num_kv_heads, 1);
  return (p.head_dim == 128 ? 2 : 0) + (group > 8 ? 1 : 0);
}

absl::StatusOr<int> SplitKvMmaBlocksPerSm(int variant) {
  int blocks = 0;
  KVLENS_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, reinterpret_cast<const void*>(SplitKvMmaKernelOf(variant)), kWarps * 32, 0));
  return std::max(blocks, 1);
}

int ChooseNumSplitsMma(const AttentionParams& p, int num_sms, int blocks_per_sm) {
  return SplitsForOneWave(p, static_cast<int64_t>(num_sms) * std::max(blocks_per_sm, 1),
                          2 * kWarps * kStep, kStep);
}

absl::Status LaunchSplitKvMma(const AttentionParams& p, int num_splits, float* workspace,
                              int* arrivals, cudaStream_t stream) {
  if (!SplitKvMmaSupports(p)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor-core split-KV attention needs a bf16 cache at head_dim 64 or 128 with 16-byte "
        "aligned rows, got head_dim ",
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
