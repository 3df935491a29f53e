// Flash prefill over a bf16 KV cache on bf16 tensor cores (LaunchFlashPrefillBf16,
// attention.h), and over an fp32 cache's fp16 copy on fp16 tensor cores
// (LaunchFlashPrefillF16Copy, kv_f16_copy.h): the same kernel, its operand type a template
// argument (Bf16Operands, F16Operands); "bf16" below stands for either. The loop and the online
// softmax are FlashPrefillKernel's (flash_prefill.cu, flash_common.cuh); what differs is how K and
// V reach the tensor cores. The cache's bf16 rows are already mma.sync's operand type, so a tile
// goes to shared memory as stored, 16 bytes at a time by cp.async (async_copy.cuh), without passing
// through registers or being converted, and the fragments come out of shared memory by ldmatrix
// (four 8×8 matrices an instruction) rather than one 32-bit load per register:
//
//   stage s (two or three):  Ks[s] [N keys][D + 8]   Vs[s] [N keys][D + 8]   (bf16, row-major)
//
// with N = 64 keys a tile, or 32 for warps of two stripes, past head size 128 and, as an
// option, for 8 warps of one stripe (Bf16Tiles::kN).
//
// S = Q·Kᵀ takes its B fragments from Ks by ldmatrix (a key's dims are a stored row), and
// O += P·V from Vs by ldmatrix.trans (a dim's keys are a stored column), so V needs no
// transposed copy. Rows are padded by 16 bytes: the eight 16-byte rows an ldmatrix phase
// reads then start in eight different bank groups (272 bytes apart at Dh 128).
//
// The pipeline, per N-key tile j (each thread's copies are committed in groups K0, V0,
// K1, V1, …; a group may be empty past the last tile):
//   wait until K(j) has landed (V(j) may be in flight); barrier
//   issue K(j+1), V(j+1) into the other stage (its tiles were last read before this
//     barrier: S(j−1) and P(j−1)·V(j−1))
//   S = Q·K(j)ᵀ; online softmax (flash_common.cuh)
//   wait until V(j) has landed; barrier
//   O += P·V(j)
// so tile j + 1's copies run under tile j's products. With three stages (a 128-query
// block's option, attention.h; K and V of a tile are one group):
//   wait until tile j has landed (tile j+1 may be in flight); barrier
//   issue tile j+2 into the stage tile j−1 used (read before this barrier)
//   S = Q·K(j)ᵀ; online softmax; O += P·V(j)
// one barrier a tile rather than two, so a warp that is through its softmax starts its
// P·V products without waiting for the block's slowest warp (with one 8-warp block an SM,
// a barrier also idles the SM's tensor cores until the last warp arrives): 34 KiB more
// shared memory at head size 128 (102 KiB), still one block an SM (two of 4 warps of 32:
// 85 KiB each). Q (fp32 activations) and P are
// rounded to bf16, the cache's K and V are used as stored; accumulation and the softmax
// are fp32. Masking, the tiles' rows and the output follow flash_common.cuh.
//
// A warp takes R = 1 or 2 stripes of 16 queries (W warps, 16·W·R queries a block). With
// R = 1 its Q fragments stay in registers (8 warps of 16 for a 128-query block) up to head
// size 128; at 256 (64-query blocks of 4 warps, Gemma) O alone takes 128 registers a lane,
// so Q waits in shared memory as for two stripes, and tiles are 32 keys. With
// R = 2 (4 warps of 32, FlashAttention-2's layout at head size 128) every K and V fragment
// an ldmatrix brings serves both stripes, so shared memory delivers half the bytes per
// product, the bound of a one-stripe warp; O and S then take twice the registers, so Q is
// kept in shared memory as bf16 (one more tile, written once) and read by ldmatrix, and a
// tile is 32 keys (with 64, ptxas spilled at 255 registers). Measured on an H200
// (2026-12-04, causal, H 32, Dh 128, 4k-16k tokens): one stripe, 8 warps, 182-236 TFLOP/s
// (the default); two stripes 153-205 (121-166 with 64-key tiles, spilling). In the
// products each fragment is requested one step before its mma.sync uses it, so a load's
// latency passes under the previous products rather than stalling the warp.
//
// A 192-query block (kFlashBf16WideTileQueries, head sizes 64 and 128) is 12 warps of one
// stripe: 384 threads may hold 170 registers each, so Q waits in shared memory (as for
// two stripes) and each warp keeps O, S and P (168 registers at head size 128; of those
// kernels only the uncapped one of two stages spills, 8 bytes). One block
// an SM then runs 3 warps a scheduler rather than 2, more to issue from while others wait
// at a barrier or on the softmax, and each K/V tile copied serves 192 queries rather than
// 128. Shared memory: Q 51 KiB, K/V 68 or 102 KiB (two or three stages) at head size 128.
//
// 8 warps of one stripe may also take 32-key tiles (SetFlashKeyTile): Q then waits in
// shared memory too, and a thread fits in 128 registers (ptxas: 128 at head size 128, no
// spills; the capped twins spill 8 and 16 bytes), so two blocks run an SM: 4 warps a
// scheduler, from two blocks whose barriers do not stall each other, as
// FlashAttention-2's two blocks of 4 warps, each K/V tile still serving 128 queries.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/flash_common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma_sync.cuh"

namespace kvlens::kernels::cuda {
namespace {

// The tensor cores' 16-bit operand type: bf16 (a bf16 cache, as stored), or fp16 (an fp32
// cache's fp16 copy, kv_f16_copy.h, rounded as FlashPrefillKernel rounds its tiles). Q and
// P are rounded to it; the tiles' copies and ldmatrix move 16-bit elements either way.
struct Bf16Operands {
  static __device__ __forceinline__ uint32_t Pack(float lo, float hi) { return PackBf162(lo, hi); }
  static __device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    MmaBf16(d, a, b);
  }
};
struct F16Operands {
  static __device__ __forceinline__ uint32_t Pack(float lo, float hi) { return PackHalf2(lo, hi); }
  static __device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    MmaF16(d, a, b);
  }
};

// Keys a tile (N below): 64, or 32 where O takes 128 registers a lane (two stripes, head
// size 256), whose O and S would otherwise take more than 255 registers a thread (on an
// H200, 2026-12-04, 64-key tiles of two stripes spilled and ran at 0.70× one stripe's
// speed). 8 warps of one stripe may also take 32 (SetFlashKeyTile, kFlashNarrowKeyTile):
// see kQInSmem.
template <int D, int R>
constexpr int kBf16KeyTile = R == 2 || D > 128 ? 32 : kBlockN;

template <int D, int W, int R, int S, int N>
struct Bf16Tiles {
  static_assert(D % 16 == 0 && D <= 256 && (R == 1 || R == 2) && (D <= 128 || R == 1));
  static_assert(W == 4 || W == 8 || (W == 12 && R == 1 && D <= 128));
  static_assert(S == 2 || (S == 3 && D <= 128));  // see kFlashMaxStages below
  static_assert(N == kBf16KeyTile<D, R> || (N == 32 && W == 8 && R == 1));
  // Q's fragments wait in shared memory (read by ldmatrix each step) for two stripes and
  // past head size 128, where O alone is 2·D/8·4 or D/2 registers a lane; for 12 warps,
  // whose 384 threads may hold 170 registers each; and for 8 warps of one stripe at 32
  // keys a tile, to fit 128 registers a thread (two blocks an SM). Else in registers.
  static constexpr bool kQInSmem = R == 2 || D > 128 || W == 12 || (W == 8 && N == 32);
  // A divisor of kBlockN, so FlashKeysOf's first tile (a multiple of kBlockN) starts one of
  // these tiles too.
  static constexpr int kN = N;
  static_assert(kBlockN % kN == 0);
  static constexpr int kLd = D + 8;         // bf16 elements a shared-memory row
  static constexpr int kElems = kN * kLd;   // one K or V tile
  static constexpr int kPieces = D / 8;     // 16-byte pieces of a head's row
  static constexpr int kRows = 16 * W * R;  // queries a block
  static constexpr size_t kKvBytes = S * 2 * kElems * sizeof(uint16_t);  // K, V × S stages
  static constexpr size_t kQBytes = kQInSmem ? kRows * kLd * sizeof(uint16_t) : 0;
  static constexpr size_t kBytes = kKvBytes + kQBytes;
};

// A thread's pieces of a K or V tile: consecutive threads take consecutive 16-byte pieces
// of a row, kIt a thread (the last partly, for 12 warps: 2⅔ pieces a thread).
template <int D, int W, int R, int S, int N>
struct TilePieces {
  using L = Bf16Tiles<D, W, R, S, N>;
  static constexpr int kThreads = W * 32, kTotal = L::kN * L::kPieces;
  static constexpr int kIt = (kTotal + kThreads - 1) / kThreads;
  // Piece `it` of this thread: false past the tile's pieces; else its row and 16-byte
  // column.
  __device__ __forceinline__ static bool At(int it, int& r, int& c) {
    const int idx = static_cast<int>(threadIdx.x) + it * kThreads;
    r = idx / L::kPieces;
    c = idx % L::kPieces;
    return kTotal % kThreads == 0 || idx < kTotal;
  }
};

// The cache rows of the thread's pieces of tile rows j0 … j0 + kN − 1, or −1 from key_end
// on (FlashKeysOf: no row of the block sees those keys). One block-table lookup a row
// serves the K tile and the V tile; block_shift: BlockShift(p.block_size). (A physical
// row fits in int32: the cache has fewer rows than that.)
template <int D, int W, int R, int S, int N>
__device__ __forceinline__ void TileRows(const AttentionParams& p, const FlashSeq& seq,
                                         int block_shift, int j0, int key_end,
                                         int32_t (&rows)[TilePieces<D, W, R, S, N>::kIt]) {
  using P = TilePieces<D, W, R, S, N>;
  const int32_t* table = p.block_table != nullptr ? p.block_table + seq.table_offset : nullptr;
#pragma unroll
  for (int it = 0; it < P::kIt; ++it) {
    int r, c;
    rows[it] = -1;
    if (P::At(it, r, c) && j0 + r < key_end) {
      rows[it] = static_cast<int32_t>(PhysicalRowIn(table, p.block_size, block_shift, j0 + r));
    }
  }
}

// Issues the copies of the thread's pieces of one K or V tile of KV head kvh from `cache`
// into `tile` (rows from TileRows): zeros where the row is −1, since whatever the cache
// holds there, a NaN say, would otherwise reach P·V as 0·NaN.
template <int D, int W, int R, int S, int N>
__device__ __forceinline__ void IssueTile(const AttentionParams& p, int kvh,
                                          const int32_t (&rows)[TilePieces<D, W, R, S, N>::kIt],
                                          const uint16_t* cache, uint16_t* tile) {
  using P = TilePieces<D, W, R, S, N>;
  using L = Bf16Tiles<D, W, R, S, N>;
#pragma unroll
  for (int it = 0; it < P::kIt; ++it) {
    int r, c;
    if (!P::At(it, r, c)) break;
    const bool in = rows[it] >= 0;
    const uint16_t* src = cache;  // not read when !in
    if (in) src += rows[it] * p.kv_row_stride + static_cast<int64_t>(kvh) * D + 8 * c;
    CpAsync16(tile + r * L::kLd + 8 * c, src, in ? 16 : 0);
  }
}

// Q's rows of the block as Op's pairs (signed and rounded as FlashLoadQ does; rows past the
// sequence's end zero) into qs [kRows][kLd], where Bf16Tiles::kQInSmem.
template <typename Op, int D, int W, int R, int S, int N>
__device__ __forceinline__ void StageQ(const AttentionParams& p, const FlashSeq& seq, int h,
                                       uint16_t* qs) {
  using L = Bf16Tiles<D, W, R, S, N>;
  const float sign = FlashQSign(p);
  for (int idx = threadIdx.x; idx < L::kRows * L::kPieces; idx += W * 32) {
    const int r = idx / L::kPieces, c = idx % L::kPieces;
    const int i = seq.q0 + r;
    uint32_t w[4] = {0, 0, 0, 0};
    if (i < seq.num_queries) {
      const float* q = p.q + static_cast<int64_t>(seq.row0 + i) * p.q_stride +
                       static_cast<int64_t>(h) * D + 8 * c;
#pragma unroll
      for (int e = 0; e < 4; ++e) w[e] = Op::Pack(sign * q[2 * e], sign * q[2 * e + 1]);
    }
    uint4 piece;
    piece.x = w[0];
    piece.y = w[1];
    piece.z = w[2];
    piece.w = w[3];
    *reinterpret_cast<uint4*>(qs + r * L::kLd + 8 * c) = piece;
  }
}

// Blocks an SM: two of two stripes; 64-query blocks three, but two at head size 128, where
// three (170 registers) spilled: on an H200 (2026-12-04) two ran 10-16% faster there, and
// two at head size 256 (101 KiB of shared memory each). One of 8 warps (218 registers at
// head size 128), or of 12 (at most 170 registers a thread: 167-168 at head size 128); two
// of 8 at 32 keys a tile (128 registers).
template <int D, int W, int R, int N>
constexpr int kBf16MinBlocks = R == 2   ? 2
                               : W == 4 ? (D >= 128 ? 2 : 3)
                               : W == 8 ? (N == 32 ? 2 : 1)
                                        : 1;

// kCap: Gemma 2's soft cap on the scores (FlashSoftmaxTile), instantiated apart. Op:
// Bf16Operands or F16Operands.
template <typename Op, int D, int W, int R, int S, int N, bool kCap>
__global__ void __launch_bounds__(W * 32, kBf16MinBlocks<D, W, R, N>)
    FlashPrefillBf16Kernel(AttentionParams p) {
  WaitForPriorGrids();             // first: see launch.cuh
  if (!FlashBlockRuns(p)) return;  // past the last head (FlashGrid's last group)
  using L = Bf16Tiles<D, W, R, S, N>;
  extern __shared__ __align__(16) uint16_t flash_bf16_smem[];
  auto ks = [&](int stage) { return flash_bf16_smem + (2 * stage) * L::kElems; };
  auto vs = [&](int stage) { return flash_bf16_smem + (2 * stage + 1) * L::kElems; };
  uint16_t* qs = flash_bf16_smem + 2 * S * L::kElems;  // kQInSmem only
  const uint16_t* kcache = static_cast<const uint16_t*>(p.k);
  const uint16_t* vcache = static_cast<const uint16_t*>(p.v);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4;
  const FlashSeq seq = FlashSeqOf<L::kRows>(p);
  const int h = FlashHead();
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  // The lane's rows: fragment rows g and g + 8 of each of the warp's stripes.
  int row_i[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    row_i[r][0] = seq.q0 + 16 * (R * warp + r) + g;
    row_i[r][1] = row_i[r][0] + 8;
  }
  const FlashKeyRange keys = FlashKeysOf(p, seq);
  const int key_end = keys.key_end;

  // The first tile's copies first (with three stages the second's too, K and V one group
  // a tile): they run while Q is read.
  const int block_shift = BlockShift(p.block_size);
  int32_t rows[TilePieces<D, W, R, S, N>::kIt];
  TileRows<D, W, R, S, N>(p, seq, block_shift, keys.key_begin, key_end, rows);
  IssueTile<D, W, R, S, N>(p, kvh, rows, kcache, ks(0));
  if constexpr (S == 2) CpAsyncCommit();
  IssueTile<D, W, R, S, N>(p, kvh, rows, vcache, vs(0));
  CpAsyncCommit();
  if constexpr (S == 3) {
    if (keys.key_begin + L::kN < key_end) {
      TileRows<D, W, R, S, N>(p, seq, block_shift, keys.key_begin + L::kN, key_end, rows);
      IssueTile<D, W, R, S, N>(p, kvh, rows, kcache, ks(1));
      IssueTile<D, W, R, S, N>(p, kvh, rows, vcache, vs(1));
    }
    CpAsyncCommit();  // empty past the keys: the loop's wait counts groups
  }

  // ldmatrix row addresses, relative to a tile: lane L gives row L % 8 of matrix L / 8.
  //   K (plain): matrices (keys +0, dims +0), (keys +0, dims +8), (keys +8, dims +0),
  //              (keys +8, dims +8) → B fragments {b0, b1} of key groups n and n + 1.
  //   V (.trans): (keys +0, dims +0), (keys +8, dims +0), (keys +0, dims +8),
  //              (keys +8, dims +8) → B fragments {b0, b1} of dim groups n and n + 1.
  //   Q (plain): (rows +0, dims +0), (rows +8, dims +0), (rows +0, dims +8),
  //              (rows +8, dims +8) → the A fragment a0 … a3 of 16 rows × 16 dims.
  const int mat = lane / 8, mrow = lane % 8;
  const int k_lane = (8 * (mat / 2) + mrow) * L::kLd + 8 * (mat % 2);
  const int v_lane = (8 * (mat % 2) + mrow) * L::kLd + 8 * (mat / 2);
  const uint16_t* q_warp = qs + 16 * R * warp * L::kLd + v_lane;  // Q's layout is V's

  // Q as Op's A fragments (as the naive bf16 or fp16 run rounds it): in registers for one stripe up
  // to head size 128, else in shared memory (read after the loop's first barrier, not
  // written again).
  uint32_t qf[L::kQInSmem ? 1 : D / 16][4];
  if constexpr (!L::kQInSmem) {
    FlashLoadQ<D>(
        p, seq, h, row_i[0], [](float a, float b) { return Op::Pack(a, b); }, qf);
  } else {
    StageQ<Op, D, W, R, S, N>(p, seq, h, qs);
  }
  // The A fragment of stripe r for dims 16kk … 16kk + 15.
  auto load_a = [&](uint32_t(&a)[4], int r, int kk) {
    if constexpr (!L::kQInSmem) {
      a[0] = qf[kk][0];
      a[1] = qf[kk][1];
      a[2] = qf[kk][2];
      a[3] = qf[kk][3];
    } else {
      LdMatrixX4<false>(a, q_warp + 16 * r * L::kLd + 16 * kk);
    }
  };

  float o[R][D / 8][4];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[r][nt][0] = o[r][nt][1] = o[r][nt][2] = o[r][nt][3] = 0.0f;
  }
  float m[R][2], l[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r) m[r][0] = m[r][1] = -INFINITY, l[r][0] = l[r][1] = 0.0f;
  const float c = FlashLog2Scale(p);  // |scale|·log2(e)

  int stage = 0;
  for (int j0 = keys.key_begin; j0 < key_end; j0 += L::kN, stage = stage + 1 == S ? 0 : stage + 1) {
    // Two stages: K(j) is here (V(j) may not be). Three: K(j) and V(j) are (tile j + 1 may
    // not be).
    CpAsyncWait<1>();
    __syncthreads();
    if constexpr (S == 2) {
      if (j0 + L::kN < key_end) {
        TileRows<D, W, R, S, N>(p, seq, block_shift, j0 + L::kN, key_end, rows);
        IssueTile<D, W, R, S, N>(p, kvh, rows, kcache, ks(stage ^ 1));
        CpAsyncCommit();
        IssueTile<D, W, R, S, N>(p, kvh, rows, vcache, vs(stage ^ 1));
      } else {
        CpAsyncCommit();  // empty groups keep the count: the wait below is for V(j)
      }
    } else {
      // Tile j + 2 into the stage tile j − 1 used: every thread has passed the barrier
      // above, so has finished with it.
      const int next = stage == 0 ? S - 1 : stage - 1;
      if (j0 + 2 * L::kN < key_end) {
        TileRows<D, W, R, S, N>(p, seq, block_shift, j0 + 2 * L::kN, key_end, rows);
        IssueTile<D, W, R, S, N>(p, kvh, rows, kcache, ks(next));
        IssueTile<D, W, R, S, N>(p, kvh, rows, vcache, vs(next));
      }
    }
    CpAsyncCommit();

    // S = Q·Kᵀ: per stripe 8 accumulator tiles of 16 rows × 8 keys, two a ldmatrix. Steps
    // (kk, np) in order, each one's fragments requested before the previous one's products.
    const uint16_t* kt = ks(stage);
    float s[R][L::kN / 8][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int nt = 0; nt < L::kN / 8; ++nt)
        s[r][nt][0] = s[r][nt][1] = s[r][nt][2] = s[r][nt][3] = 0.0f;
    }
    constexpr int kSSteps = (D / 16) * (L::kN / 16);
    uint32_t a[R][4], b[4];
#pragma unroll
    for (int r = 0; r < R; ++r) load_a(a[r], r, 0);
    LdMatrixX4<false>(b, kt + k_lane);
#pragma unroll
    for (int step = 0; step < kSSteps; ++step) {
      const int kk = step / (L::kN / 16), np = step % (L::kN / 16);
      uint32_t an[R][4] = {}, bn[4];
      if (step + 1 < kSSteps) {
        const int kk1 = (step + 1) / (L::kN / 16), np1 = (step + 1) % (L::kN / 16);
        LdMatrixX4<false>(bn, kt + 16 * np1 * L::kLd + 16 * kk1 + k_lane);
        if (kk1 != kk) {
#pragma unroll
          for (int r = 0; r < R; ++r) load_a(an[r], r, kk1);
        }
      }
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int r = 0; r < R; ++r) {
        Op::Mma(s[r][2 * np], a[r], b0);
        Op::Mma(s[r][2 * np + 1], a[r], b1);
      }
      if (step + 1 < kSSteps) {
#pragma unroll
        for (int e = 0; e < 4; ++e) b[e] = bn[e];
        if ((step + 1) / (L::kN / 16) != kk) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[r][e] = an[r][e];
          }
        }
      }
    }

    // P as Op's A fragments at once (keys 16kk … 16kk+15 are S tiles 2kk and 2kk + 1): half
    // the registers of S through the products below.
    uint32_t pa[R][L::kN / 16][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      FlashSoftmaxTile<D, kCap, L::kN>(p, seq, keys, j0, row_i[r], c, s[r], m[r], l[r], o[r]);
#pragma unroll
      for (int kk = 0; kk < L::kN / 16; ++kk) {
        pa[r][kk][0] = Op::Pack(s[r][2 * kk][0], s[r][2 * kk][1]);
        pa[r][kk][1] = Op::Pack(s[r][2 * kk][2], s[r][2 * kk][3]);
        pa[r][kk][2] = Op::Pack(s[r][2 * kk + 1][0], s[r][2 * kk + 1][1]);
        pa[r][kk][3] = Op::Pack(s[r][2 * kk + 1][2], s[r][2 * kk + 1][3]);
      }
    }

    if constexpr (S == 2) {
      CpAsyncWait<2>();  // V(j) is here (K(j+1), V(j+1) may not be)
      __syncthreads();
    }

    // O += P·V, steps (kk, dp) in order, each V fragment requested before the previous
    // step's products.
    const uint16_t* vt = vs(stage);
    constexpr int kVSteps = (L::kN / 16) * (D / 16);
    LdMatrixX4<true>(b, vt + v_lane);
#pragma unroll
    for (int step = 0; step < kVSteps; ++step) {
      const int kk = step / (D / 16), dp = step % (D / 16);
      uint32_t bn[4];
      if (step + 1 < kVSteps) {
        const int kk1 = (step + 1) / (D / 16), dp1 = (step + 1) % (D / 16);
        LdMatrixX4<true>(bn, vt + 16 * kk1 * L::kLd + 16 * dp1 + v_lane);
      }
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int r = 0; r < R; ++r) {
        Op::Mma(o[r][2 * dp], pa[r][kk], b0);
        Op::Mma(o[r][2 * dp + 1], pa[r][kk], b1);
      }
      if (step + 1 < kVSteps) {
#pragma unroll
        for (int e = 0; e < 4; ++e) b[e] = bn[e];
      }
    }
  }
  CpAsyncWait<0>();  // nothing may land after the block exits

#pragma unroll
  for (int r = 0; r < R; ++r) FlashWriteRows<D>(p, seq, h, row_i[r], l[r], o[r]);
}

template <typename Op, int D, int W, int R, int S, int N = kBf16KeyTile<D, R>>
absl::Status LaunchBf16(const AttentionParams& p, cudaStream_t stream) {
  using L = Bf16Tiles<D, W, R, S, N>;
  // Two stripes are never capped: LaunchFlashPrefillBf16 gives a capped call one stripe.
  auto* kernel = R == 1 && p.softcap > 0.0f ? FlashPrefillBf16Kernel<Op, D, W, R, S, N, R == 1>
                                            : FlashPrefillBf16Kernel<Op, D, W, R, S, N, false>;
  // Past 48 KiB of dynamic shared memory a kernel must opt in (every launch: the attribute
  // belongs to the device's context, and setting it is not a stream operation). Blocks past
  // 64 KiB (two stripes, three stages, 12 warps or head size 256: up to 153 KiB) also ask
  // for the largest shared-memory carveout, so that two fit on an SM beside each other where
  // they are two.
  if constexpr (L::kBytes > 48 * 1024) {
    KVLENS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(L::kBytes)));
  }
  if constexpr (L::kBytes > 64 * 1024) {
    KVLENS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  }
  const absl::StatusOr<dim3> grid = FlashLaunchGrid(p, L::kRows);
  if (!grid.ok()) return grid.status();
  LaunchKernel("FlashPrefillBf16Kernel", kernel, *grid, W * 32, L::kBytes, stream, p);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("FlashPrefillBf16Kernel");
  return absl::OkStatus();
}

// K and V of 16-bit elements in 16-byte pieces, at a head size the kernel has.
bool SixteenBitPieces(const AttentionParams& p) {
  return FlashPrefillSupports(p.head_dim) && p.kv_row_stride % 8 == 0 &&
         reinterpret_cast<uintptr_t>(p.k) % 16 == 0 && reinterpret_cast<uintptr_t>(p.v) % 16 == 0;
}

}  // namespace

bool FlashPrefillBf16Supports(const AttentionParams& p) {
  return p.kv_dtype == KvDtype::kBF16 && SixteenBitPieces(p);
}

absl::Status CheckFlashBf16Layout(const FlashBf16Layout& layout) {
  if (layout.tile_queries != 64 && layout.tile_queries != 128 &&
      layout.tile_queries != kFlashBf16WideTileQueries) {
    return absl::InvalidArgumentError(absl::StrCat("flash tile queries must be 64, 128 or ",
                                                   kFlashBf16WideTileQueries, ", got ",
                                                   layout.tile_queries));
  }
  if (layout.warp_queries != 16 && layout.warp_queries != 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash warp queries must be 16 or 32, got ", layout.warp_queries));
  }
  if (layout.stages != 2 && layout.stages != kFlashMaxStages) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash stages must be 2 or ", kFlashMaxStages, ", got ", layout.stages));
  }
  if (layout.key_tile != kFlashDefaultKeyTile && layout.key_tile != kFlashNarrowKeyTile) {
    return absl::InvalidArgumentError(absl::StrCat("flash key tile must be ", kFlashDefaultKeyTile,
                                                   " or ", kFlashNarrowKeyTile, ", got ",
                                                   layout.key_tile));
  }
  return absl::OkStatus();
}

int FlashBf16TileQueries(int head_dim, int requested) {
  if (requested == kFlashBf16WideTileQueries) {
    return head_dim == 64 || head_dim == 128 ? requested : FlashTileQueries(head_dim, 128);
  }
  return FlashTileQueries(head_dim, requested);
}

FlashBf16Layout ResolvedFlashBf16Layout(const AttentionParams& p, const FlashBf16Layout& asked) {
  FlashBf16Layout r;
  r.tile_queries = FlashBf16TileQueries(p.head_dim, asked.tile_queries);
  // 128-query blocks: 8 warps of 16 queries, or 4 of 32 (two stripes, uncapped only).
  const bool eight = r.tile_queries == 128;
  const bool two_stripes = eight && asked.warp_queries == 32 && p.softcap == 0.0f;
  r.warp_queries = two_stripes ? 32 : 16;
  r.stages = eight || r.tile_queries == kFlashBf16WideTileQueries ? asked.stages : 2;
  // kBf16KeyTile's own tile, or the narrow one where 8 warps of one stripe ask for it.
  const int own = two_stripes || p.head_dim > 128 ? kFlashNarrowKeyTile : kFlashDefaultKeyTile;
  r.key_tile =
      eight && !two_stripes && asked.key_tile == kFlashNarrowKeyTile ? kFlashNarrowKeyTile : own;
  return r;
}

namespace {

// The resolved layout's instantiation (the one the tuner names) for operands Op, once the
// layout is one the kernel has and p one it `supports` (else INVALID_ARGUMENT: `needs`,
// then p's row stride and head size).
template <typename Op>
absl::Status LaunchLayout(const AttentionParams& p, const FlashBf16Layout& layout, bool supports,
                          const char* needs, cudaStream_t stream) {
  if (absl::Status s = CheckFlashBf16Layout(layout); !s.ok()) return s;
  if (!supports) {
    return absl::InvalidArgumentError(
        absl::StrCat(needs, "; got kv_row_stride ", p.kv_row_stride, ", head_dim ", p.head_dim));
  }
  const FlashBf16Layout r = ResolvedFlashBf16Layout(p, layout);
  const int stages = r.stages;
  if (layout.tile_queries == kFlashBf16WideTileQueries) {  // 12 warps of 16 queries
    auto launch = [&](auto d) {
      constexpr int D = decltype(d)::value;
      return stages == 3 ? LaunchBf16<Op, D, 12, 1, 3>(p, stream)
                         : LaunchBf16<Op, D, 12, 1, 2>(p, stream);
    };
    switch (p.head_dim) {
      case 64:
        return launch(std::integral_constant<int, 64>{});
      case 128:
        return launch(std::integral_constant<int, 128>{});
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("the bf16 flash prefill has ", layout.tile_queries,
                         "-query tiles for head_dim 64 and 128 only, got ", p.head_dim));
    }
  }
  return DispatchFlash(p, layout.tile_queries, [&](auto d, auto w) {
    constexpr int D = decltype(d)::value, W = decltype(w)::value;
    // 128-query blocks: 8 warps of 16 queries (64 or 32 keys a tile) or 4 of 32 (uncapped),
    // two stages or three; 64-query blocks (the only ones at head size 256): 4 of 16, two
    // stages.
    if constexpr (W == 8) {
      constexpr int kNarrow = kFlashNarrowKeyTile;
      const bool narrow = r.key_tile == kNarrow;
      if (r.warp_queries == 32) {
        return stages == 3 ? LaunchBf16<Op, D, 4, 2, 3>(p, stream)
                           : LaunchBf16<Op, D, 4, 2, 2>(p, stream);
      }
      if (stages == 3) {
        return narrow ? LaunchBf16<Op, D, W, 1, 3, kNarrow>(p, stream)
                      : LaunchBf16<Op, D, W, 1, 3>(p, stream);
      }
      if (narrow) return LaunchBf16<Op, D, W, 1, 2, kNarrow>(p, stream);
    }
    return LaunchBf16<Op, D, W, 1, 2>(p, stream);
  });
}

}  // namespace

absl::Status LaunchFlashPrefillBf16(const AttentionParams& p, const FlashBf16Layout& layout,
                                    cudaStream_t stream) {
  return LaunchLayout<Bf16Operands>(
      p, layout, FlashPrefillBf16Supports(p),
      "the bf16 flash prefill needs a bf16 cache with kv_row_stride a multiple of 8 and "
      "16-byte aligned K and V and head_dim 64, 80, 96, 128 or 256",
      stream);
}

absl::Status LaunchFlashPrefillF16Copy(const AttentionParams& p, const FlashBf16Layout& layout,
                                       cudaStream_t stream) {
  return LaunchLayout<F16Operands>(
      p, layout, SixteenBitPieces(p),
      "the flash prefill on an fp16 copy needs kv_row_stride a multiple of 8, 16-byte "
      "aligned K and V and head_dim 64, 80, 96, 128 or 256",
      stream);
}

}  // namespace kvlens::kernels::cuda
