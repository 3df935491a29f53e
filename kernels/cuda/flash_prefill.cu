// Flash prefill on fp16 tensor cores (LaunchFlashPrefill, attention.h): FlashAttention-2's
// loop on mma.sync (mma_sync.cuh) over a cache of any dtype (fp32, or bf16 widened as it is
// loaded), K and V rounded to fp16 in shared memory. Its bf16 twin, for bf16 caches in
// 16-byte pieces, is flash_prefill_bf16.cu; the online softmax, masking and the block's
// rows they share are flash_common.cuh's.
//
// One block = 16·W query rows of one head, W warps of 16 rows. A warp keeps its rows' S,
// P and O (fp32 accumulators) and the running max m and sum l in registers, and up to
// head size 128 its Q (fp16 A fragments) too; K and V pass through shared memory, rounded
// to fp16 once per tile:
//   Ks  [64 keys][D dims]    S = Q·Kᵀ reads its B fragments along a key's dims
//   Vt  [D dims][64 keys]    O += P·V reads its B fragments along a dim's keys
//   Qs  [64 rows][D dims]    head size 256 only (below)
// Per 64-key tile, the online softmax of flash_common.cuh (FlashSoftmaxTile; with Gemma 2's
// soft cap in instantiations of their own), then O += P·V with P rounded to fp16 (l sums the fp32
// p_j), and finally O / l. S's accumulator layout is P's A-fragment layout, so P never leaves the
// registers. Rows of Ks, Vt and Qs are 32-bit words (pairs of halves) padded to an odd multiple of
// 4 words mod 32, so the fragment loads (lane 4g + t reads word t of row g of an 8-row group) fall
// in 32 different banks. Head sizes: multiples of 16 whose rows pad that way (64, 80, 96, 128,
// 256). W warps a block: 4 (64 queries, up to 3 blocks per SM) or 8 (128 queries, one block per SM,
// half the K/V traffic per FLOP); see FlashTileQueries.
//
// Head size 256 (Gemma, Gemma 2 and 3 up to 12B): O alone is then 128 fp32 registers a
// lane and Q's fragments would be 64 more, past the 255 a thread may hold, so Q stays in
// shared memory as fp16 (written once, its A fragments read per 16-dim step, as
// FlashAttention-2 does by default) and blocks are 64 queries (4 warps). Ks, Vt and Qs then
// take 102 KiB: two blocks an SM, opted in past the 48 KiB default.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/flash_common.cuh"
#include "kernels/cuda/kv_load.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma_sync.cuh"

namespace kvlens::kernels::cuda {
namespace {

// Q's fragments stay in registers up to head size 128 (else in Qs).
template <int D>
constexpr bool kQInSmem = D > 128;

template <int D, int W>
struct FlashSmem {
  static_assert(D % 16 == 0 && D <= 256 && (D / 2 + 4) % 8 == 4, "see the padding above");
  static_assert(!kQInSmem<D> || W == 4, "head sizes past 128 take 64-query blocks");
  static constexpr int kKsLd = D / 2 + 4;        // words per Ks (and Qs) row
  static constexpr int kVtLd = kBlockN / 2 + 4;  // words per Vt row
  static constexpr int kQsRows = kQInSmem<D> ? kBlockM<W> : 0;
  static constexpr size_t kBytes = sizeof(uint32_t) * ((kBlockN + kQsRows) * kKsLd + D * kVtLd);
};

// K and V rows j0 … j0+63 of KV head kvh into Ks and Vt, zeros from key_end on (as the
// bf16 kernel's IssueTile: no row of the block sees them, and a NaN there would reach P·V).
template <int D, int W, bool kVec, typename KT>
__device__ __forceinline__ void LoadKvTile(const AttentionParams& p, const FlashSeq& seq, int kvh,
                                           int j0, int key_end, uint32_t* ks, uint32_t* vt) {
  using L = FlashSmem<D, W>;
  constexpr int kPieces = D / 4;  // four-element pieces of a head's row
  auto row = [&](const KT* base, int j) -> const KT* {
    if (j >= key_end) return nullptr;
    const int32_t* table = p.block_table != nullptr ? p.block_table + seq.table_offset : nullptr;
    return base +
           PhysicalRowIn(table, p.block_size, BlockShift(p.block_size), j) * p.kv_row_stride +
           static_cast<int64_t>(kvh) * D;
  };
  constexpr int kThreads = W * 32;
  static_assert(kBlockN * kPieces % kThreads == 0 && kBlockN / 2 * kPieces % kThreads == 0);
  // Fixed trip counts unrolled by 4: the loads of 4 pieces are issued before the stores
  // that wait for them (not one round trip to L2 per piece). Full unrolling hoists every
  // load of the tile and spills at Dh 128.
  // K: consecutive threads take consecutive pieces of a row (coalesced).
#pragma unroll 4
  for (int it = 0; it < kBlockN * kPieces / kThreads; ++it) {
    const int idx = static_cast<int>(threadIdx.x) + it * kThreads;
    const int r = idx / kPieces, c = idx % kPieces;
    const KT* k = row(KeysOf<KT>(p), j0 + r);
    const float4 x = k != nullptr ? Load4<kVec>(k, 4 * c, D) : Zero4();
    uint32_t* dst = ks + r * L::kKsLd + 2 * c;
    dst[0] = PackHalf2(x.x, x.y);
    dst[1] = PackHalf2(x.z, x.w);
  }
  // V transposed: a thread takes keys 2jp and 2jp + 1 at four dims and writes four words
  // (a key pair each); four consecutive threads read 64 bytes of each row.
#pragma unroll 4
  for (int it = 0; it < kBlockN / 2 * kPieces / kThreads; ++it) {
    const int idx = static_cast<int>(threadIdx.x) + it * kThreads;
    const int c = idx % 4 + 4 * (idx / (4 * (kBlockN / 2)));
    const int jp = (idx / 4) % (kBlockN / 2);
    const KT* v0 = row(ValuesOf<KT>(p), j0 + 2 * jp);
    const KT* v1 = row(ValuesOf<KT>(p), j0 + 2 * jp + 1);
    const float4 a = v0 != nullptr ? Load4<kVec>(v0, 4 * c, D) : Zero4();
    const float4 b = v1 != nullptr ? Load4<kVec>(v1, 4 * c, D) : Zero4();
    uint32_t* dst = vt + 4 * c * L::kVtLd + jp;
    dst[0] = PackHalf2(a.x, b.x);
    dst[L::kVtLd] = PackHalf2(a.y, b.y);
    dst[2 * L::kVtLd] = PackHalf2(a.z, b.z);
    dst[3 * L::kVtLd] = PackHalf2(a.w, b.w);
  }
}

// The block's Q rows as fp16 pairs into Qs (signed and rounded as FlashLoadQ does; rows past
// the sequence's end zero). Consecutive threads take consecutive pairs of a row.
template <int D, int W>
__device__ __forceinline__ void StoreQTile(const AttentionParams& p, const FlashSeq& seq, int h,
                                           uint32_t* qs) {
  using L = FlashSmem<D, W>;
  constexpr int kPairs = D / 2;
  static_assert(L::kQsRows * kPairs % (W * 32) == 0);
  const float sign = FlashQSign(p);
#pragma unroll 4
  for (int it = 0; it < L::kQsRows * kPairs / (W * 32); ++it) {
    const int idx = static_cast<int>(threadIdx.x) + it * W * 32;
    const int r = idx / kPairs, w = idx % kPairs, i = seq.q0 + r;
    float x0 = 0.0f, x1 = 0.0f;
    if (i < seq.num_queries) {
      const float* q =
          p.q + static_cast<int64_t>(seq.row0 + i) * p.q_stride + static_cast<int64_t>(h) * D;
      x0 = sign * q[2 * w];
      x1 = sign * q[2 * w + 1];
    }
    qs[r * L::kKsLd + w] = PackHalf2(x0, x1);
  }
}

template <int D, int W>
constexpr int kFlashMinBlocks = kQInSmem<D> ? 2 : (W == 4 ? 3 : 1);

template <int D, int W, bool kVec, typename KT, bool kCap>
__global__ void __launch_bounds__(W * 32, kFlashMinBlocks<D, W>)
    FlashPrefillKernel(AttentionParams p) {
  WaitForPriorGrids();             // first: see launch.cuh
  if (!FlashBlockRuns(p)) return;  // past the last head (FlashGrid's last group)
  using L = FlashSmem<D, W>;
  extern __shared__ __align__(16) uint32_t flash_smem[];
  uint32_t* ks = flash_smem;
  uint32_t* vt = ks + kBlockN * L::kKsLd;
  uint32_t* qs = vt + D * L::kVtLd;  // kQInSmem<D> only

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const FlashSeq seq = FlashSeqOf<kBlockM<W>>(p);
  const int q0 = seq.q0;
  const int h = FlashHead();
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  // The lane's two rows: fragment rows g and g + 8 of its warp's 16.
  const int row_i[2] = {q0 + 16 * warp + g, q0 + 16 * warp + g + 8};

  // Q as fp16 A fragments (as the naive fp16 run rounds it): in registers, or in Qs (seen
  // by every warp after the loop's first barrier).
  uint32_t qf[kQInSmem<D> ? 1 : D / 16][4];
  if constexpr (kQInSmem<D>) {
    StoreQTile<D, W>(p, seq, h, qs);
  } else {
    FlashLoadQ<D>(
        p, seq, h, row_i, [](float a, float b) { return PackHalf2(a, b); }, qf);
  }
  const uint32_t* q_row = qs + (16 * warp + g) * L::kKsLd + t;  // kQInSmem<D> only

  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float c = FlashLog2Scale(p);  // |scale|·log2(e)

  const FlashKeyRange keys = FlashKeysOf(p, seq);
  const int key_end = keys.key_end;

  for (int j0 = keys.key_begin; j0 < key_end; j0 += kBlockN) {
    __syncthreads();  // every warp is done with the previous tile
    LoadKvTile<D, W, kVec, KT>(p, seq, kvh, j0, key_end, ks, vt);
    __syncthreads();

    // S = Q·Kᵀ: 8 accumulator tiles of 16 rows × 8 keys.
    float s[kBlockN / 8][4];
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      if constexpr (kQInSmem<D>) {  // mma_sync.cuh's A layout: rows g, g + 8; words t, t + 4
        a[0] = q_row[8 * kk];
        a[1] = q_row[8 * L::kKsLd + 8 * kk];
        a[2] = q_row[8 * kk + 4];
        a[3] = q_row[8 * L::kKsLd + 8 * kk + 4];
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = qf[kk][e];
      }
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
        const uint32_t* kr = ks + (8 * nt + g) * L::kKsLd + 8 * kk + t;
        const uint32_t b[2] = {kr[0], kr[4]};
        MmaF16(s[nt], a, b);
      }
    }

    FlashSoftmaxTile<D, kCap>(p, seq, keys, j0, row_i, c, s, m, l, o);

    // O += P·V: P's A fragment for keys 16kk … 16kk+15 is S tiles 2kk and 2kk + 1.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t a[4] = {PackHalf2(s[2 * kk][0], s[2 * kk][1]),
                             PackHalf2(s[2 * kk][2], s[2 * kk][3]),
                             PackHalf2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             PackHalf2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        const uint32_t* vr = vt + (8 * nt + g) * L::kVtLd + 8 * kk + t;
        const uint32_t b[2] = {vr[0], vr[4]};
        MmaF16(o[nt], a, b);
      }
    }
  }

  FlashWriteRows<D>(p, seq, h, row_i, l, o);
}

// The instantiation for p's cache (dtype, vector loads) and soft cap.
template <int D, int W, bool kCap>
auto FlashKernelFor(const AttentionParams& p) {
  const bool vec = KvVectorized(p);
  return p.kv_dtype == KvDtype::kBF16 ? (vec ? FlashPrefillKernel<D, W, true, uint16_t, kCap>
                                             : FlashPrefillKernel<D, W, false, uint16_t, kCap>)
                                      : (vec ? FlashPrefillKernel<D, W, true, float, kCap>
                                             : FlashPrefillKernel<D, W, false, float, kCap>);
}

template <int D, int W>
absl::Status LaunchFlash(const AttentionParams& p, cudaStream_t stream) {
  constexpr size_t kBytes = FlashSmem<D, W>::kBytes;
  auto* kernel = p.softcap > 0.0f ? FlashKernelFor<D, W, true>(p) : FlashKernelFor<D, W, false>(p);
  // Past 48 KiB of dynamic shared memory a kernel must opt in (as flash_prefill_bf16.cu).
  if constexpr (kBytes > 48 * 1024) {
    KVLENS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kBytes)));
  }
  const absl::StatusOr<dim3> grid = FlashLaunchGrid(p, kBlockM<W>);
  if (!grid.ok()) return grid.status();
  LaunchKernel("FlashPrefillKernel", kernel, *grid, W * 32, kBytes, stream, p);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("FlashPrefillKernel");
  return absl::OkStatus();
}

}  // namespace

bool FlashPrefillSupports(int head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128 || head_dim == 256;
}

int FlashTileQueries(int head_dim, int requested) {
  return requested == 128 && (head_dim == 64 || head_dim == 128) ? 128 : 64;
}

int FlashHeadGroup(const AttentionParams& p, int asked, int64_t kv_keys, int64_t l2_bytes) {
  const int heads = std::max(p.num_heads, 1);
  if (asked != kFlashAutoHeadGroup) return std::clamp(asked, 1, heads);
  const int64_t element = p.kv_dtype == KvDtype::kBF16 ? 2 : 4;
  const int64_t kv_head_bytes = std::max<int64_t>(1, 2 * kv_keys * p.head_dim * element);
  int64_t kv_heads = 1;  // the largest power of two that fits, at least one
  while (2 * kv_heads * kv_head_bytes <= l2_bytes && 2 * kv_heads <= p.num_kv_heads) kv_heads *= 2;
  const int64_t group = kv_heads * (heads / std::max(p.num_kv_heads, 1));
  return static_cast<int>(std::clamp<int64_t>(group, 1, heads));
}

absl::Status CheckFlashHeadGroup(int heads) {
  if (heads < 0 || heads > kFlashMaxHeadGroup) {
    return absl::InvalidArgumentError(absl::StrCat("flash head group must be in [0, ",
                                                   kFlashMaxHeadGroup,
                                                   "] (0: sized to the L2 cache), got ", heads));
  }
  return absl::OkStatus();
}

absl::Status LaunchFlashPrefill(const AttentionParams& p, int tile_queries, cudaStream_t stream) {
  return DispatchFlash(p, tile_queries, [&](auto d, auto w) {
    return LaunchFlash<decltype(d)::value, decltype(w)::value>(p, stream);
  });
}

}  // namespace kvlens::kernels::cuda
