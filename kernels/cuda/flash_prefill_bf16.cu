// Flash prefill over a bf16 KV cache on bf16 tensor cores (LaunchFlashPrefillBf16,
// attention.h). The loop and the online softmax are FlashPrefillKernel's (attention.cu,
// flash_common.cuh); what differs is how K and V reach the tensor cores. The cache's bf16
// rows are already mma.sync's operand type, so a tile goes to shared memory as stored,
// 16 bytes at a time by cp.async (async_copy.cuh), without passing through registers or
// being converted, and the fragments come out of shared memory by ldmatrix (four 8×8
// matrices an instruction) rather than one 32-bit load per register:
//
//   stage s (two):  Ks[s] [64 keys][D + 8]   Vs[s] [64 keys][D + 8]   (bf16, row-major)
//
// S = Q·Kᵀ takes its B fragments from Ks by ldmatrix (a key's dims are a stored row), and
// O += P·V from Vs by ldmatrix.trans (a dim's keys are a stored column), so V needs no
// transposed copy. Rows are padded by 16 bytes: the eight 16-byte rows an ldmatrix phase
// reads then start in eight different bank groups (272 bytes apart at Dh 128).
//
// The pipeline, per 64-key tile j (each thread's copies are committed in groups K0, V0,
// K1, V1, …; a group may be empty past the last tile):
//   wait until K(j) has landed (V(j) may be in flight); barrier
//   issue K(j+1), V(j+1) into the other stage (its tiles were last read before this
//     barrier: S(j−1) and P(j−1)·V(j−1))
//   S = Q·K(j)ᵀ; online softmax (flash_common.cuh)
//   wait until V(j) has landed; barrier
//   O += P·V(j)
// so tile j + 1's copies run under tile j's products. Q (fp32 activations) and P are
// rounded to bf16, the cache's K and V are used as stored; accumulation and the softmax
// are fp32. Masking, the tiles' rows and the output follow flash_common.cuh.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/flash_common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma_sync.cuh"

namespace kvlens::kernels::cuda {
namespace {

template <int D>
struct Bf16Tiles {
  static_assert(D % 16 == 0 && D <= 128);
  static constexpr int kLd = D + 8;             // bf16 elements a shared-memory row
  static constexpr int kElems = kBlockN * kLd;  // one K or V tile
  static constexpr int kPieces = D / 8;         // 16-byte pieces of a head's row
  static constexpr size_t kBytes = 2 * 2 * kElems * sizeof(uint16_t);  // K, V × 2 stages
};

// Issues the copies of rows j0 … j0 + 63 of KV head kvh of `cache` (K or V) into `tile`,
// zeros from key_end on (FlashKeysOf: no row of the block sees them; whatever the cache
// holds there, a NaN say, would otherwise reach P·V as 0·NaN). Consecutive threads take
// consecutive pieces of a row.
template <int D, int W>
__device__ __forceinline__ void IssueTile(const AttentionParams& p, const FlashSeq& seq, int kvh,
                                          int j0, int key_end, const uint16_t* cache,
                                          uint16_t* tile) {
  using L = Bf16Tiles<D>;
  constexpr int kThreads = W * 32;
  static_assert(kBlockN * L::kPieces % kThreads == 0);
  const int32_t* table = p.block_table != nullptr ? p.block_table + seq.table_offset : nullptr;
#pragma unroll
  for (int it = 0; it < kBlockN * L::kPieces / kThreads; ++it) {
    const int idx = static_cast<int>(threadIdx.x) + it * kThreads;
    const int r = idx / L::kPieces, c = idx % L::kPieces;
    const int j = j0 + r;
    const bool in = j < key_end;
    const uint16_t* src = cache;  // not read when !in
    if (in) {
      src += PhysicalRowIn(table, p.block_size, j) * p.kv_row_stride +
             static_cast<int64_t>(kvh) * D + 8 * c;
    }
    CpAsync16(tile + r * L::kLd + 8 * c, src, in ? 16 : 0);
  }
}

template <int D, int W>
__global__ void __launch_bounds__(W * 32, W == 4 ? 3 : 1)
    FlashPrefillBf16Kernel(AttentionParams p) {
  WaitForPriorGrids();  // first: see launch.cuh
  using L = Bf16Tiles<D>;
  extern __shared__ __align__(16) uint16_t flash_bf16_smem[];
  auto ks = [&](int stage) { return flash_bf16_smem + (2 * stage) * L::kElems; };
  auto vs = [&](int stage) { return flash_bf16_smem + (2 * stage + 1) * L::kElems; };
  const uint16_t* kcache = static_cast<const uint16_t*>(p.k);
  const uint16_t* vcache = static_cast<const uint16_t*>(p.v);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4;
  const FlashSeq seq = FlashSeqOf<W>(p);
  const int h = blockIdx.y;
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  const int row_i[2] = {seq.q0 + 16 * warp + g, seq.q0 + 16 * warp + g + 8};
  const auto [key_end, first_end] = FlashKeysOf(p, seq);

  // Tile 0's copies first: they run while Q is read.
  IssueTile<D, W>(p, seq, kvh, 0, key_end, kcache, ks(0));
  CpAsyncCommit();
  IssueTile<D, W>(p, seq, kvh, 0, key_end, vcache, vs(0));
  CpAsyncCommit();

  // Q as bf16 A fragments (as the naive bf16 run rounds it).
  uint32_t qf[D / 16][4];
  FlashLoadQ<D>(
      p, seq, h, row_i, [](float a, float b) { return PackBf162(a, b); }, qf);

  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float c = p.scale * 1.4426950408889634f;  // scale·log2(e)

  // ldmatrix row addresses, relative to a tile: lane L gives row L % 8 of matrix L / 8.
  //   K (plain): matrices (keys +0, dims +0), (keys +0, dims +8), (keys +8, dims +0),
  //              (keys +8, dims +8) → B fragments {b0, b1} of key groups n and n + 1.
  //   V (.trans): (keys +0, dims +0), (keys +8, dims +0), (keys +0, dims +8),
  //              (keys +8, dims +8) → B fragments {b0, b1} of dim groups n and n + 1.
  const int mat = lane / 8, mrow = lane % 8;
  const int k_lane = (8 * (mat / 2) + mrow) * L::kLd + 8 * (mat % 2);
  const int v_lane = (8 * (mat % 2) + mrow) * L::kLd + 8 * (mat / 2);

  int stage = 0;
  for (int j0 = 0; j0 < key_end; j0 += kBlockN, stage ^= 1) {
    CpAsyncWait<1>();  // K(j) is here (V(j) may not be)
    __syncthreads();
    if (j0 + kBlockN < key_end) {
      IssueTile<D, W>(p, seq, kvh, j0 + kBlockN, key_end, kcache, ks(stage ^ 1));
      CpAsyncCommit();
      IssueTile<D, W>(p, seq, kvh, j0 + kBlockN, key_end, vcache, vs(stage ^ 1));
    } else {
      CpAsyncCommit();  // empty groups keep the count: the wait below is for V(j)
    }
    CpAsyncCommit();

    // S = Q·Kᵀ: 8 accumulator tiles of 16 rows × 8 keys, two a ldmatrix.
    const uint16_t* kt = ks(stage);
    float s[kBlockN / 8][4];
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t b[4];
        LdMatrixX4<false>(b, kt + 16 * np * L::kLd + 16 * kk + k_lane);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        MmaBf16(s[2 * np], qf[kk], b0);
        MmaBf16(s[2 * np + 1], qf[kk], b1);
      }
    }

    FlashSoftmaxTile<D>(p, seq, first_end, j0, row_i, c, s, m, l, o);

    CpAsyncWait<2>();  // V(j) is here (K(j+1), V(j+1) may not be)
    __syncthreads();

    // O += P·V: P's A fragment for keys 16kk … 16kk+15 is S tiles 2kk and 2kk + 1.
    const uint16_t* vt = vs(stage);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t a[4] = {PackBf162(s[2 * kk][0], s[2 * kk][1]),
                             PackBf162(s[2 * kk][2], s[2 * kk][3]),
                             PackBf162(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             PackBf162(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        LdMatrixX4<true>(b, vt + 16 * kk * L::kLd + 16 * dp + v_lane);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        MmaBf16(o[2 * dp], a, b0);
        MmaBf16(o[2 * dp + 1], a, b1);
      }
    }
  }
  CpAsyncWait<0>();  // nothing may land after the block exits

  FlashWriteRows<D>(p, seq, h, row_i, l, o);
}

template <int D, int W>
absl::Status LaunchBf16(const AttentionParams& p, cudaStream_t stream) {
  constexpr size_t kBytes = Bf16Tiles<D>::kBytes;
  auto* kernel = FlashPrefillBf16Kernel<D, W>;
  // Past 48 KiB of dynamic shared memory a kernel must opt in (every launch: the attribute
  // belongs to the device's context, and setting it is not a stream operation).
  if constexpr (kBytes > 48 * 1024) {
    KVLENS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kBytes)));
  }
  const int tiles =
      p.flash_tiles != nullptr ? p.num_flash_tiles : (p.num_queries + kBlockM<W> - 1) / kBlockM<W>;
  const dim3 grid(tiles, p.num_heads);
  LaunchKernel("FlashPrefillBf16Kernel", kernel, grid, W * 32, kBytes, stream, p);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("FlashPrefillBf16Kernel");
  return absl::OkStatus();
}

}  // namespace

bool FlashPrefillBf16Supports(const AttentionParams& p) {
  return p.kv_dtype == KvDtype::kBF16 && FlashPrefillSupports(p.head_dim) &&
         p.kv_row_stride % 8 == 0 && reinterpret_cast<uintptr_t>(p.k) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.v) % 16 == 0;
}

absl::Status LaunchFlashPrefillBf16(const AttentionParams& p, int tile_queries,
                                    cudaStream_t stream) {
  if (!FlashPrefillBf16Supports(p)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the bf16 flash prefill needs a bf16 cache with kv_row_stride a multiple of 8 and "
        "16-byte aligned K and V, head_dim 64, 80, 96 or 128; got kv_row_stride ",
        p.kv_row_stride, ", head_dim ", p.head_dim));
  }
  return DispatchFlash(p, tile_queries, [&](auto d, auto w) {
    return LaunchBf16<decltype(d)::value, decltype(w)::value>(p, stream);
  });
}

}  // namespace kvlens::kernels::cuda
