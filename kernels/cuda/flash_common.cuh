// What the two flash prefill kernels share (FlashPrefillKernel in flash_prefill.cu, on fp16
// tensor cores over any cache; FlashPrefillBf16Kernel in flash_prefill_bf16.cu, on bf16
// tensor cores over a bf16 cache): the block's tile of queries, and the per-warp steps
// around the tensor-core products, all in registers in mma.sync's accumulator layout
// (mma_sync.cuh: lane 4g + t holds rows g and g + 8 of its warp's 16, columns 2t, 2t + 1
// of each 8-wide tile).
//
// Per 64-key tile and row, with c = scale·log2(e) (FlashSoftmaxTile; under Gemma 2's soft
// cap each raw score s_j first becomes cap · tanh(scale · s_j / cap) / scale):
//   m' = max(m, max_j c·s_j),  α = 2^(m − m'),  p_j = 2^(c·s_j − m'),  l = α·l + Σ_j p_j,
//   O = α·O   (then the kernel adds P·V, P rounded to its tensor cores' type)
// with c·s_j − m' one FFMA (the scores kept raw, the kernels on |scale|: FlashQSign) and
// each p_j, but in the soft-capped twins, one MUFU.EX2 (Exp2Approx, exp2_approx.cuh),
// and finally O / l (FlashWriteRows). Masking (causal, documents, the end of the keys, a
// sliding window) is applied only to tiles that some row of the block does not see whole,
// and under a window the tiles that no row sees are not visited (FlashKeysOf). DispatchFlash picks
// the instantiation for a call's head size and block size.
#ifndef KVLENS_KERNELS_CUDA_FLASH_COMMON_CUH_
#define KVLENS_KERNELS_CUDA_FLASH_COMMON_CUH_

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/exp2_approx.cuh"

namespace kvlens::kernels::cuda {

template <int W>
constexpr int kBlockM = 16 * W;  // queries a block: W warps of 16
constexpr int kBlockN = 64;      // keys a tile

// What one block works on: rows q0 … q0 + rows − 1 of a sequence of num_queries rows
// (query_offset, num_keys) whose q and out rows start at row0 of p.q and p.out and whose
// blocks start at table_offset in p.block_table; a batched launch's tile is a sequence of
// its own (q0 = 0). Integers only, kept in registers across the tile loop.
struct FlashSeq {
  int row0, table_offset, q0, rows, num_queries, num_keys, query_offset;
};

// The block's tile and head as FlashGrid lays them out: tile blockIdx.y (0: a head's
// longest causal rows), head blockIdx.z · gridDim.x + blockIdx.x, which may be past the last
// head (FlashBlockRuns). Read from the block's indices where used, not kept in FlashSeq:
// ptxas then holds no register for the head across the tile loop (with it there, the
// 12-warp kernels, capped at 168 registers, spilled 40 bytes rather than 24).
__device__ __forceinline__ int FlashHead() {
  return static_cast<int>(blockIdx.z * gridDim.x + blockIdx.x);
}
__device__ __forceinline__ bool FlashBlockRuns(const AttentionParams& p) {
  return FlashHead() < p.num_heads;
}

// A flash launch's grid for blocks of `block_rows` queries: its tiles (the batched list's,
// else the prompt's in blocks) laid out by FlashGrid, or INVALID_ARGUMENT past a grid's y
// extent. Both flash kernels launch on it.
inline absl::StatusOr<dim3> FlashLaunchGrid(const AttentionParams& p, int block_rows) {
  const int tiles =
      p.flash_tiles != nullptr ? p.num_flash_tiles : (p.num_queries + block_rows - 1) / block_rows;
  const FlashGridShape g = FlashGrid(tiles, p.num_heads, p.flash_head_group);
  if (g.y > kFlashMaxTiles) {
    return absl::InvalidArgumentError(absl::StrCat("flash attention takes at most ", kFlashMaxTiles,
                                                   " query tiles a launch, got ", g.y));
  }
  return dim3(g.x, g.y, g.z);
}

// BM: the block's queries (kBlockM<W> for warps of 16 queries).
template <int BM>
__device__ __forceinline__ FlashSeq FlashSeqOf(const AttentionParams& p) {
  const int tile = static_cast<int>(blockIdx.y);
  if (p.flash_tiles == nullptr) {
    const int q0 = (static_cast<int>(gridDim.y) - 1 - tile) * BM;  // longest causal rows first
    return {0, 0, q0, min(BM, p.num_queries - q0), p.num_queries, p.num_keys, p.query_offset};
  }
  const int32_t* t = p.flash_tiles + kFlashTileInts * tile;
  return {t[0], t[4], 0, t[1], t[1], t[3], t[2]};
}

// The keys a block reads: the last row, q0 + rows − 1, sees keys up to query_offset + q0 +
// rows − 1 (key_end); the first row sees every key below first_end (so do all the block's
// rows, without documents). Under a sliding window of W keys no row sees a key below the
// first row's position − W + 1: the block starts at the tile holding that key (key_begin,
// a multiple of kBlockN, so the tiles it walks are the ones it walked before and give the
// same bits; the tiles it skips were wholly masked), and from window_clear (the last row's
// position − W + 1) on the window hides no key of any row. Positions fit in int32 (a
// sequence's keys are counted in int).
struct FlashKeyRange {
  int key_begin, key_end, first_end, window_clear;
};

__device__ __forceinline__ FlashKeyRange FlashKeysOf(const AttentionParams& p,
                                                     const FlashSeq& seq) {
  const int q_first = seq.query_offset + seq.q0;
  const int key_begin = p.window > 0 ? max(0, q_first - p.window + 1) / kBlockN * kBlockN : 0;
  const int window_clear = p.window > 0 ? q_first + seq.rows - p.window : 0;
  return {key_begin, p.causal ? min(seq.num_keys, q_first + seq.rows) : seq.num_keys,
          p.causal ? min(seq.num_keys, q_first + 1) : seq.num_keys, window_clear};
}

// The kernels run on |scale|, with Q's sign flipped as it is loaded where the scale is
// negative (exact, and so is the products' sign: q·k for −q is −(q·k) bit for bit), so
// that c = |scale|·log2(e) > 0 and a row's largest c·s_j is c times its largest s_j
// (FlashSoftmaxTile). The soft cap, cap · tanh(scale · s / cap), is odd in s: the same.
__device__ __forceinline__ float FlashQSign(const AttentionParams& p) {
  return p.scale < 0.0f ? -1.0f : 1.0f;
}
__device__ __forceinline__ float FlashLog2Scale(const AttentionParams& p) {
  return fabsf(p.scale) * kLog2E;
}

// The lane's Q values as A fragments (unscaled; signed by FlashQSign), each pair rounded by pack
// (PackHalf2 or PackBf162: as the naive run of the kernel's precision rounds them); rows past the
// sequence's end are zero.
template <int D, typename Pack>
__device__ __forceinline__ void FlashLoadQ(const AttentionParams& p, const FlashSeq& seq, int h,
                                           const int (&row_i)[2], Pack pack,
                                           uint32_t (&qf)[D / 16][4]) {
  const int t = threadIdx.x % 4;
  const float sign = FlashQSign(p);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int i = row_i[r % 2], d = 16 * kk + 2 * t + 8 * (r / 2);
      float x0 = 0.0f, x1 = 0.0f;
      if (i < seq.num_queries) {
        const float* q =
            p.q + static_cast<int64_t>(seq.row0 + i) * p.q_stride + static_cast<int64_t>(h) * D;
        x0 = sign * q[d];
        x1 = sign * q[d + 1];
      }
      qf[kk][r] = pack(x0, x1);
    }
  }
}

// One tile's online-softmax step on the warp's scores s (the tile's keys j0 … j0 + N − 1, raw
// Q·Kᵀ; `keys` the block's FlashKeysOf), for the lane's rows row_i[0], row_i[1]: s becomes
// the unnormalised weights p_j, and m, l (this lane's share of the row sum; the four lanes
// of a row are added at the end) and O are rescaled. kCap: apply p.softcap first (a
// template argument, not a branch on p.softcap: the tanh's registers, though never used
// without a cap, made ptxas spill the uncapped kernels at head size 128).
template <int D, bool kCap = false, int N = kBlockN>
__device__ __forceinline__ void FlashSoftmaxTile(const AttentionParams& p, const FlashSeq& seq,
                                                 const FlashKeyRange& keys, int j0,
                                                 const int (&row_i)[2], float c,
                                                 float (&s)[N / 8][4], float (&m)[2], float (&l)[2],
                                                 float (&o)[D / 8][4]) {
  const int t = threadIdx.x % 4;
  if constexpr (kCap) {  // c·s is then log2(e) · cap · tanh(scale · s / cap)
    const float in = fabsf(p.scale) / p.softcap, out = p.softcap / fabsf(p.scale);
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = out * tanhf(s[nt][e] * in);
    }
  }
  const bool mask = p.q_doc != nullptr || j0 < keys.window_clear || j0 + N > keys.first_end;
  float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[nt][e];
      if (mask) {
        const int i = row_i[e / 2], j = j0 + 8 * nt + 2 * t + e % 2;
        // Rows past the end see every key (their q is zero; they are never written). The
        // document ids are read only for a real row and key: their arrays end there.
        bool visible = j < seq.num_keys;
        if (visible && i < seq.num_queries) {
          visible = (!p.causal || j <= seq.query_offset + i) &&
                    (p.window == 0 || seq.query_offset + i - j < p.window) &&
                    (p.q_doc == nullptr || p.q_doc[i] == p.k_doc[j]);
        }
        if (!visible) x = -INFINITY;
      }
      s[nt][e] = x;
      mt[e / 2] = fmaxf(mt[e / 2], x);
    }
  }
  float m_use[2], alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
    mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
    const float m_new = fmaxf(m[r], c * mt[r]);
    // Nothing seen yet (m_new = −∞): p and α must be 0, not 2^(−∞ + ∞).
    m_use[r] = m_new == -INFINITY ? 0.0f : m_new;
    alpha[r] = exp2f(m[r] - m_use[r]);
    m[r] = m_new;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // (Under the cap, whose tanh takes registers of its own, exp2f: with Exp2Approx
      // two capped twins at 168 registers spilled 36 bytes a thread, past the 24 of
      // check-ptxas.sh. α, two a tile, stays exp2f too.)
      const float x = fmaf(s[nt][e], c, -m_use[e / 2]);
      s[nt][e] = kCap ? exp2f(x) : Exp2Approx(x);
      l[e / 2] += s[nt][e];
    }
  }
  // Once a row's running maximum stays put, its α is 1 exactly (2^0); where that holds for
  // every row of the warp, O's rescale (D / 2 multiplies a lane) would change no bit, and
  // is skipped, as split-KV skips its own. (Not under the cap: there the test's registers
  // made ptxas spill 28 bytes in the fp16 kernel's 4-warp twins at Dh 128.)
  if (!kCap && __all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) return;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    o[nt][0] *= alpha[0];
    o[nt][1] *= alpha[0];
    o[nt][2] *= alpha[1];
    o[nt][3] *= alpha[1];
  }
}

// O / l to the lane's rows of p.out (rows past the sequence's end are not written). Every
// real row saw a key (checked on the host), so l > 0.
template <int D>
__device__ __forceinline__ void FlashWriteRows(const AttentionParams& p, const FlashSeq& seq, int h,
                                               const int (&row_i)[2], float (&l)[2],
                                               const float (&o)[D / 8][4]) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int i = row_i[r];
    if (i >= seq.num_queries) continue;
    const float inv = 1.0f / l[r];
    float* out =
        p.out + static_cast<int64_t>(seq.row0 + i) * p.out_stride + static_cast<int64_t>(h) * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      out[8 * nt + 2 * t] = o[nt][2 * r] * inv;
      out[8 * nt + 2 * t + 1] = o[nt][2 * r + 1] * inv;
    }
  }
}

// Host side: launch(D, W) (std::integral_constant tags) for p's head size and the block of
// tile_queries queries (FlashTileQueries must allow it: W = tile_queries / 16 warps), or
// INVALID_ARGUMENT naming what is not supported.
template <typename Launch>
absl::Status DispatchFlash(const AttentionParams& p, int tile_queries, Launch&& launch) {
  using W4 = std::integral_constant<int, 4>;
  using W8 = std::integral_constant<int, 8>;
  if (tile_queries != FlashTileQueries(p.head_dim, tile_queries)) {
    return absl::InvalidArgumentError(absl::StrCat("flash prefill has no ", tile_queries,
                                                   "-query tiles for head_dim ", p.head_dim));
  }
  const bool wide = tile_queries == 128;
  switch (p.head_dim) {
    case 64: {
      using D = std::integral_constant<int, 64>;
      return wide ? launch(D{}, W8{}) : launch(D{}, W4{});
    }
    case 80:
      return launch(std::integral_constant<int, 80>{}, W4{});
    case 96:
      return launch(std::integral_constant<int, 96>{}, W4{});
    case 128: {
      using D = std::integral_constant<int, 128>;
      return wide ? launch(D{}, W8{}) : launch(D{}, W4{});
    }
    case 256:
      return launch(std::integral_constant<int, 256>{}, W4{});
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "flash prefill supports head_dim 64, 80, 96, 128 and 256, got ", p.head_dim));
  }
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_FLASH_COMMON_CUH_
