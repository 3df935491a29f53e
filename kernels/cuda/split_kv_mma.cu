// Split-KV attention on tensor cores (attention.h, "Split-KV on tensor cores"). Block
// (i, g, split) as SplitKvKernel's (attention.cu): query row i, KV head g, the split's keys
// (SplitSteps), its kSplitKvMmaWarps warps taking turns over steps of 16 keys on a bf16
// cache, 8 on fp32, each keeping its own (m, l, O) for a tile of the group's heads, the
// warps merged in shared memory (MergeWarps), the splits by SplitKvCombineKernel or the last
// block (CombineIfLast). The products take bf16 on a bf16 cache, fp16 on fp32 (Piece8).
//
// The step's keys are the products' rows and the group's heads their columns: Sᵀ = K·Qᵀ
// (m16n8k16: 16 keys × 8 heads, k the dims), then Oᵀ = Vᵀ·Pᵀ (16 dims × 8 heads, k the
// keys). A GQA group of up to 8 heads (Llama 3's 4, Mistral's 4, Llama 2's 1) fits in a
// product's 8 columns; as the product's rows (until the second session of 2026-12-05) it
// left at least 8 of 16 rows zero, which took products and registers all the same: now 16
// products a bf16 step at Dh 128 (32 before), and O 32 floats a lane rather than 64
// (ptxas: 154–160 registers against 204–214, three blocks an SM rather than two), which
// also leaves room for head size 256 (Gemma). Groups past 8 take two head tiles, which
// share each K and V fragment (at Dh 256 they loop over tiles of 8). Between the
// products, Sᵀ's accumulator (lane (r, t): keys r and r + 8 of heads 2t, 2t+1) becomes
// Pᵀ's B fragment (keys 2t, 2t+1 and 2t+8, 2t+9 of head r) by two 8×8 transposes across
// the warp (movmatrix, mma_sync.cuh).
//
// Fragments (mma_sync.cuh; r = lane / 4, t = lane % 4). A dot product may take its dims in
// any order so long as Q and K agree, and P·V its keys in any order so long as P and V
// agree; the loads pick orders that let each lane read 8 elements of a row at a time (a
// Piece8: 16 bytes of bf16, 32 of fp32):
//   Sᵀ = K·Qᵀ, chunk c = 2k + e (16 dims): lane (r, t) holds dims 32k + 8t + 4e + {0, 1} as
//     the chunk's 2t, 2t+1 and + {2, 3} as 2t+8, 2t+9, for K (A: keys r and r + 8 of the
//     step, the second absent with 8-key steps) and for Q (B: head r of the tile): one
//     piece of K's row feeds two chunks.
//   Sᵀ (C): s[0..1] = S[heads 2t, 2t+1][key r], s[2..3] the same of key r + 8.
//   Oᵀ = Vᵀ·Pᵀ, dim tile n (of Dh / 16): its row r is the lane's slot n, its row r + 8 slot
//     n + Dh/16, where slot u is dim 64·(u / 8) + 8r + u % 8: lane (r, t) reads dims
//     64x + 8r … +7 of the rows of keys 2t, 2t+1 (and 2t+8, 2t+9) and pairs element u % 8 of
//     two keys' pieces for A. Its Oᵀ (C) holds heads 2t, 2t+1 at the dims of slots n and
//     n + Dh/16.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/exp2_approx.cuh"
#include "kernels/cuda/kv_load.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma_sync.cuh"
#include "kernels/cuda/reduce.cuh"
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

// KT: the cache's element; kDh: 64, 128 or 256; kHeadTiles: n8 tiles of the group's heads
// a pass (1, or 2 for groups past 8 at Dh 64 and 128; at 256 two tiles' partials would take
// 64 KiB of shared memory, so larger groups loop over tiles of 8). Bounded to 3 blocks an
// SM; 2 where O is 64 floats a lane, for two head tiles at Dh 128 (at 3, ptxas spilled 56
// and 96 bytes) and at Dh 256.
template <typename KT, int kDh, int kHeadTiles>
__global__ void __launch_bounds__(kWarps * 32,
                                  kDh == 256 || (kDh == 128 && kHeadTiles == 2) ? 2 : 3)
    SplitKvMmaKernel(AttentionParams p, int num_splits, float* workspace, int* arrivals) {
  using Piece = Piece8<KT>;
  constexpr int kStep = sizeof(KT) == 2 ? kSplitKvMmaBf16StepKeys : kSplitKvMmaF32StepKeys;
  if (p.prefetch) PrefetchFirstStep<KT, kStep>(p, num_splits);
  WaitForPriorGrids();                   // else first: see launch.cuh
  constexpr int kKeyHalves = kStep / 8;  // the step's keys r (and r + 8) a lane loads for K
  constexpr int kKLoads = kDh / 32;      // 8-element pieces of a K row a lane loads
  constexpr int kVLoads = kDh / 64;      // … and of a V row
  constexpr int kChunks = kDh / 16;      // k16 chunks of S = K·Qᵀ
  constexpr int kDimTiles = kDh / 16;    // m16 tiles of Oᵀ = Vᵀ·Pᵀ
  constexpr int kRows = 8 * kHeadTiles;  // heads a pass
  __shared__ float part_ml[kWarps][kRows][2];
  __shared__ float part_acc[kWarps][kRows][kDh];

  const int i = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, t = lane % 4;
  const int group = p.num_heads / p.num_kv_heads;
  const float scale2 = p.scale * kLog2E;                   // scores in base 2
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
  // Oᵀ's row r of dim tile n is dim dim_of(n), its row r + 8 dim dim_of(n + kDimTiles): slot
  // s of the lane's V pieces is element s % 8 of piece s / 8, dims 64·(s / 8) + 8r + s % 8.
  const auto dim_of = [&](int s) { return 64 * (s / 8) + 8 * r + s % 8; };

  for (int h0 = 0; h0 < group; h0 += kRows) {
    // Qᵀ as B fragments of the products' type (heads past the group: 0).
    uint32_t qb[kHeadTiles][kChunks][2];
#pragma unroll
    for (int ht = 0; ht < kHeadTiles; ++ht) {
      const int h = h0 + 8 * ht + r;
#pragma unroll
      for (int k = 0; k < kKLoads; ++k) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float4 x =
              h < group
                  ? *reinterpret_cast<const float4*>(q_group + h * kDh + 32 * k + 8 * t + 4 * e)
                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          qb[ht][2 * k + e][0] = Piece::Pack(x.x, x.y);
          qb[ht][2 * k + e][1] = Piece::Pack(x.z, x.w);
        }
      }
    }
    float o[kDimTiles][kHeadTiles][4] = {};
    // Heads 8ht + 2t + e; l: this lane's keys' share.
    float m[kHeadTiles][2], l[kHeadTiles][2] = {};
#pragma unroll
    for (int ht = 0; ht < kHeadTiles; ++ht) m[ht][0] = m[ht][1] = -INFINITY;

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
      Piece kr[kKeyHalves][kKLoads], vr[2 * kKeyHalves][kVLoads];
#pragma unroll
      for (int x = 0; x < kKeyHalves; ++x) {
        const int64_t row = row_of(k_key[x]);
#pragma unroll
        for (int k = 0; k < kKLoads; ++k) {
          kr[x][k] = row >= 0 ? Piece::Load(k_cache + row * p.kv_row_stride + 32 * k + 8 * t)
                              : Piece::Zero();
        }
      }
#pragma unroll
      for (int y = 0; y < 2 * kKeyHalves; ++y) {
        const int64_t row = row_of(v_key[y]);
#pragma unroll
        for (int x = 0; x < kVLoads; ++x) {
          vr[y][x] = row >= 0 ? Piece::Load(v_cache + row * p.kv_row_stride + 64 * x + 8 * r)
                              : Piece::Zero();
        }
      }

      // Sᵀ = K·Qᵀ: keys as rows (r, r + 8), heads as columns (2t, 2t + 1). Chunk c = 2k + e
      // of a key's row is dims 32k + 8t + 4e + {0, 1} (the chunk's 2t, 2t+1) and + {2, 3}
      // (2t+8, 2t+9), as Q's.
      float s[kHeadTiles][4] = {};
#pragma unroll
      for (int k = 0; k < kKLoads; ++k) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t a[4] = {kr[0][k].Pair(2 * e),
                                 kKeyHalves == 2 ? kr[kKeyHalves - 1][k].Pair(2 * e) : 0u,
                                 kr[0][k].Pair(2 * e + 1),
                                 kKeyHalves == 2 ? kr[kKeyHalves - 1][k].Pair(2 * e + 1) : 0u};
#pragma unroll
          for (int ht = 0; ht < kHeadTiles; ++ht) Piece::Mma(s[ht], a, qb[ht][2 * k + e]);
        }
      }
      // The online softmax of heads 2t + e over keys r and r + 8, each head's maximum
      // across the 8 lanes (r) that hold it.
      const bool vis[2] = {whole_step || steps.Visible(j0 + r),
                           kKeyHalves == 2 && (whole_step || steps.Visible(j0 + r + 8))};
      float alpha[kHeadTiles][2];
      bool settled = true;
#pragma unroll
      for (int ht = 0; ht < kHeadTiles; ++ht) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float step_max = -INFINITY;
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            float& v = s[ht][2 * x + e];
            v = !vis[x]            ? -INFINITY
                : p.softcap > 0.0f ? SoftCapped(v * p.scale, p.softcap) * kLog2E
                                   : v * scale2;
            step_max = fmaxf(step_max, v);
          }
          step_max = WarpReduce<4>(step_max, MaxOp());  // over the 8 lanes of the head
          const float m_new = fmaxf(m[ht][e], step_max);
          // Nothing visible yet (m_new = −∞): weights 0, and O (0) keeps its scale.
          alpha[ht][e] = m_new == -INFINITY ? 1.0f : Exp2Approx(m[ht][e] - m_new);
          settled = settled && alpha[ht][e] == 1.0f;
          float w_sum = 0.0f;
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            float& v = s[ht][2 * x + e];
            v = v == -INFINITY ? 0.0f : Exp2Approx(v - m_new);
            w_sum += v;
          }
          l[ht][e] = l[ht][e] * alpha[ht][e] + w_sum;
          m[ht][e] = m_new;
        }
      }
      // Once the maxima settle most steps rescale nothing (alpha exactly 1).
      if (!__all_sync(0xffffffffu, settled)) {
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
          for (int ht = 0; ht < kHeadTiles; ++ht) {
            o[n][ht][0] *= alpha[ht][0];
            o[n][ht][1] *= alpha[ht][1];
            o[n][ht][2] *= alpha[ht][0];
            o[n][ht][3] *= alpha[ht][1];
          }
        }
      }
      // Oᵀ += Vᵀ·Pᵀ: Pᵀ's B fragment (keys 2t, 2t+1 and 2t+8, 2t+9 of head r) is the
      // transpose of Sᵀ's 8×8 halves (keys r and r + 8 of heads 2t, 2t+1), P rounded as Q
      // (hidden keys' weights 0, their V rows 0: no 0 · NaN). With 8-key steps keys 8 … 15
      // are absent: their P and V are 0.
      uint32_t pb[kHeadTiles][2];
#pragma unroll
      for (int ht = 0; ht < kHeadTiles; ++ht) {
        pb[ht][0] = MovMatrixTrans(Piece::Pack(s[ht][0], s[ht][1]));
        pb[ht][1] = kKeyHalves == 2 ? MovMatrixTrans(Piece::Pack(s[ht][2], s[ht][3])) : 0u;
      }
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        const int lo = n, hi = n + kDimTiles;  // the slots of Vᵀ's rows r and r + 8
        const uint32_t a[4] = {
            Piece::Across(vr[0][lo / 8], vr[1][lo / 8], lo % 8),
            Piece::Across(vr[0][hi / 8], vr[1][hi / 8], hi % 8),
            kKeyHalves == 2 ? Piece::Across(vr[2 * kKeyHalves - 2][lo / 8],
                                            vr[2 * kKeyHalves - 1][lo / 8], lo % 8)
                            : 0u,
            kKeyHalves == 2 ? Piece::Across(vr[2 * kKeyHalves - 2][hi / 8],
                                            vr[2 * kKeyHalves - 1][hi / 8], hi % 8)
                            : 0u};
#pragma unroll
        for (int ht = 0; ht < kHeadTiles; ++ht) Piece::Mma(o[n][ht], a, pb[ht]);
      }
    }

    // The warp's (m, l, O) to shared memory (l summed over the 8 lanes of a head), then
    // merged.
#pragma unroll
    for (int ht = 0; ht < kHeadTiles; ++ht) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int head = 8 * ht + 2 * t + e;
        const float l_head = WarpReduce<4>(l[ht][e], SumOp());
        if (r == 0) {
          part_ml[warp][head][0] = m[ht][e];
          part_ml[warp][head][1] = l_head;
        }
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          part_acc[warp][head][dim_of(n)] = o[n][ht][e];
          part_acc[warp][head][dim_of(n + kDimTiles)] = o[n][ht][2 + e];
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
  switch (variant % kSplitKvMmaKernelsPerCache) {
    case 0:
      return SplitKvMmaKernel<KT, 64, 1>;
    case 1:
      return SplitKvMmaKernel<KT, 64, 2>;
    case 2:
      return SplitKvMmaKernel<KT, 128, 1>;
    case 3:
      return SplitKvMmaKernel<KT, 128, 2>;
    default:
      return SplitKvMmaKernel<KT, 256, 1>;
  }
}
SplitKvMmaKernelPtr SplitKvMmaKernelOf(int variant) {
  return variant >= kSplitKvMmaKernelsPerCache ? SplitKvMmaKernelOf<uint16_t>(variant)
                                               : SplitKvMmaKernelOf<float>(variant);
}

}  // namespace

bool SplitKvMmaSupports(const AttentionParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  // A lane's pieces of 8 elements: 16 bytes of bf16, two float4s of fp32.
  const int64_t piece_stride = p.kv_dtype == KvDtype::kBF16 ? 8 : 4;
  return (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256) &&
         p.kv_row_stride % piece_stride == 0 && aligned(p.k) && aligned(p.v) && aligned(p.q) &&
         p.q_stride % 4 == 0;
}

int SplitKvMmaVariant(const AttentionParams& p) {
  const int group = p.num_heads / std::max(p.num_kv_heads, 1);
  const int by_size = p.head_dim == 64    ? (group > 8 ? 1 : 0)
                      : p.head_dim == 128 ? (group > 8 ? 3 : 2)
                                          : 4;  // 256: head tiles of 8
  return (p.kv_dtype == KvDtype::kBF16 ? kSplitKvMmaKernelsPerCache : 0) + by_size;
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
        "tensor-core split-KV attention needs head_dim 64, 128 or 256 and 16-byte aligned cache "
        "rows, got head_dim ",
        p.head_dim));
  }
  if (num_splits > kSplitKvMaxSplits) {
    return absl::InvalidArgumentError(absl::StrCat("split-KV attention takes at most ",
                                                   kSplitKvMaxSplits, " splits, got ", num_splits));
  }
  num_splits = std::max(num_splits, 1);
  const dim3 grid(p.num_queries, p.num_kv_heads, num_splits);
  AttentionParams launched = p;
  launched.prefetch = PrefetchBeforeWait();  // its first step's K and V, before the wait
  LaunchKernel("SplitKvMmaKernel", SplitKvMmaKernelOf(SplitKvMmaVariant(p)), grid,
               dim3(kWarps * 32), 0, stream, launched, num_splits, workspace,
               num_splits > 1 ? arrivals : nullptr);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("SplitKvMmaKernel");
  if (num_splits > 1 && arrivals == nullptr)
    return LaunchSplitKvCombine(p, num_splits, workspace, stream);
  return absl::OkStatus();
}

}  // namespace kvlens::kernels::cuda
