// Launchers of the attention kernels (attention.cu, split_kv_mma.cu, flash_prefill.cu,
// flash_prefill_bf16.cu).
// All pointers are device pointers;
// CudaBackend validates the call on the host first (attention_check.h, including the "row
// with no visible key" error), uploads the block table and document ids, and picks one:
//
//   flash prefill   Dh 64, 80, 96, 128 or 256, Tq >= kFlashMinQueries: 64 or 128 queries
//                   × 64 keys, Q·Kᵀ and P·V on fp16 tensor cores (mma.sync) with fp32
//                   accumulation, online softmax in fp32 (soft cap included), S, P and O
//                   in registers; never the full Tq×Tk matrix. Over a bf16 cache (rows in
//                   16-byte pieces) its bf16 twin instead (every head size, the soft
//                   cap too): K/V tiles copied to shared memory as stored (cp.async, two
//                   stages, or three as an option) and read by ldmatrix, Q·Kᵀ and P·V on
//                   bf16 tensor cores; optionally 192-query blocks at Dh 64 and 128.
//                   Over an fp32 cache, as an option, that twin on fp16 tensor cores
//                   over an fp16 copy of the blocks the launch reads (kv_f16_copy.h).
//   split-KV        any Dh <= 256, any Tq (decode, short chunks, other head sizes): fp32,
//                   one block per (query, KV head, key split); its four warps (16 as an
//                   option) take turns over the keys and each K/V row is read once for
//                   all the GQA group's heads (8 at a time, 4 past Dh 128); partial
//                   (m, l, acc) per split merged by a second kernel (or, as an option,
//                   by the split's last block to finish). As an option at Dh 64 and
//                   128, its twin on tensor cores (split_kv_mma.cu).
//   materialised    when probabilities or scores are requested: fp32, writes S and A
//                   [H, Tq, Tk] and computes O = A·V from exactly the A it returns;
//                   many calls of one query row each in one launch (LaunchMaterializedRows).
//
// Each reads the cache as it is stored (p.kv_dtype): fp32, or bf16 widened to fp32 as it
// is loaded (half the bytes a key; the flash kernel rounds both to fp16 for its tensor
// cores alike).
#ifndef KVLENS_KERNELS_CUDA_ATTENTION_H_
#define KVLENS_KERNELS_CUDA_ATTENTION_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kv_dtype.h"

namespace kvlens::kernels::cuda {

// One parameter struct for the whole family (strides in elements).
struct AttentionParams {
  const float* q = nullptr;  // [Tq, H, Dh], rows q_stride apart
  int64_t q_stride = 0;
  const void* k = nullptr;  // physical rows of [Hkv, Dh], kv_row_stride elements apart,
  const void* v = nullptr;  // of type kv_dtype: float, or bf16 bits (uint16_t)
  int64_t kv_row_stride = 0;
  KvDtype kv_dtype = KvDtype::kActivation;
  const int32_t* block_table = nullptr;  // [ceil(Tk / block_size)] or null (contiguous)
  int block_size = 0;
  const int32_t* q_doc = nullptr;  // [Tq] or null
  const int32_t* k_doc = nullptr;  // [Tk] or null (with q_doc)
  float* out = nullptr;            // [Tq, H, Dh], rows out_stride apart
  int64_t out_stride = 0;
  int num_queries = 0;   // Tq
  int num_keys = 0;      // Tk
  int num_heads = 0;     // H
  int num_kv_heads = 0;  // Hkv
  int head_dim = 0;      // Dh
  int query_offset = 0;
  bool causal = true;
  int window = 0;  // > 0: a row sees only its last `window` positions (causal only)
  float scale = 0.0f;
  float softcap = 0.0f;  // > 0: scores softcap · tanh(scale · q·k / softcap)
  // Several sequences in one split-KV launch (CudaBackend::AttentionBatch): per query row,
  // the end of its visible keys (causal) and where its sequence's blocks start in
  // block_table. num_keys is then the largest key end; query_offset and causal are unused.
  const int32_t* row_key_end = nullptr;
  const int32_t* row_table_offset = nullptr;
  // Several sequences in one flash launch (CudaBackend::AttentionBatch): one block per
  // tile of at most FlashTileQueries rows of one sequence, kFlashTileInts each:
  //   {first q and out row, rows, query_offset of that row, num_keys, block-table offset}
  // in the order the blocks should start (longest first). num_queries, num_keys and
  // query_offset are then unused; documents are not supported.
  const int32_t* flash_tiles = nullptr;
  int num_flash_tiles = 0;
  // The flash kernels' block order (FlashGrid): heads in groups of this many, 1 (head by
  // head) unless CudaBackend::SetFlashHeadGroup says otherwise.
  int flash_head_group = 1;
  // The split-KV kernels, launched programmatically with prefetches (set by their launchers
  // from PrefetchBeforeWait(), launch.h): each warp prefetches its first step's K and V rows into
  // L2 before it waits for the previous grid (PrefetchFirstStep, split_kv_common.cuh).
  bool prefetch = false;
};

inline constexpr int kFlashMinQueries = 32;
inline constexpr int kFlashTileInts = 5;
// Queries a flash block takes: 64 (4 warps, up to 3 blocks per SM) or 128 (8 warps, one
// block per SM, half the K/V reads per FLOP; the default). kvlens_gpu_check times both:
// on an H200 (2026-11-30, causal, H=32, Dh=128) 128 ran 72/84/89 TFLOP/s at 4k/8k/16k
// tokens against 59/71/76 for 64.
inline constexpr int kFlashDefaultTileQueries = 128;
inline constexpr int kSplitKvMaxHeadDim = 256;
inline constexpr int kSplitKvMaxSplits = 128;  // key splits of one split-KV launch at most

bool FlashPrefillSupports(int head_dim);

// The order flash blocks start in. Blocks start in the order of their linear index (x
// fastest, then y, then z), and a head's tile 0 is its costliest (the longest causal rows,
// or a batched launch's first tile, its list sorted longest first). A flash launch of
// `tiles` tiles of `heads` heads in groups of G (FlashGrid) has the grid (G, tiles,
// ceil(heads / G)), and block (x, y, z) takes tile y of head z·G + x (none past the last
// head: the block returns at once). With G = 1, head by head: each head's tiles longest
// first, then the next head's, so the launch's last wave mixes long and short blocks.
// With G > 1 tile 0 of each head of a group, then tile 1 of each, …: the longest blocks of
// G heads all start before any shorter one (longest processing time first) and the launch
// ends on its shortest blocks, while the blocks running at once read the keys and values
// of about G heads, which the L2 cache may hold (FlashAttention 3's LPT tile scheduler
// groups heads by what fits in L2 likewise). Greedy dispatch of 128-query blocks (cost ∝
// keys + a fixed part) onto 132 SMs, H 32, Dh 128, causal: head by head ends 14% past the
// ideal makespan at 4k tokens, 6% at 8k, 0.6% at 16k; groups of 4 to 32 heads end within
// 1% at 4k and 8k. The tile and head come from the block's indices alone, which the kernel
// can re-read at any time rather than keep in a register.
struct FlashGridShape {
  int x, y, z;
};
inline constexpr int kFlashMaxTiles = 65535;  // a grid's y extent
inline FlashGridShape FlashGrid(int tiles, int heads, int group) {
  const int g = group < 1 ? 1 : group > heads ? heads : group;
  return {g, tiles, (heads + g - 1) / g};
}
// The group a launch takes when asked for `asked` heads (CudaBackend::SetFlashHeadGroup):
// at most the launch's heads; kFlashAutoHeadGroup: as many heads as share the largest
// power-of-two count of KV heads whose keys and values (kv_keys rows each, in the cache's
// element size) fit in l2_bytes (at least one KV head's heads), FlashAttention 3's rule.
inline constexpr int kFlashAutoHeadGroup = 0;
inline constexpr int kFlashMaxHeadGroup = 1024;
int FlashHeadGroup(const AttentionParams& p, int asked, int64_t kv_keys, int64_t l2_bytes);
// INVALID_ARGUMENT naming the limit unless 0 <= heads <= kFlashMaxHeadGroup.
absl::Status CheckFlashHeadGroup(int heads);
// The tile size a launch for head_dim takes when `requested` is asked for: 128 for head
// sizes 64 and 128, else 64 (head size 256 keeps Q in shared memory: flash_prefill.cu).
int FlashTileQueries(int head_dim, int requested);
// tile_queries: FlashTileQueries(p.head_dim, ·); p.flash_tiles (if set) cut to that size.
absl::Status LaunchFlashPrefill(const AttentionParams& p, int tile_queries, cudaStream_t stream);
// The bf16 twin (flash_prefill_bf16.cu) takes p when the cache is bf16, kv_row_stride a
// multiple of 8 and k, v 16-byte aligned (its copies move 16 bytes), at the head sizes of
// FlashPrefillSupports (Gemma 2's soft cap in instantiations of its own, as the fp16
// kernel's). It rounds Q and P to bf16 (FlashPrefillKernel: fp16).
// warp_queries (16 or 32): the queries a warp takes in a 128-query block (8 warps of 16,
// or 4 of 32, uncapped only: each K/V fragment read from shared memory then serves twice
// the products; with 64-key tiles their O and S needed more than 255 registers a thread
// and spilled: on an H200 on 2026-12-04, 4 warps of 32 ran at 0.70× the 8 warps of 16,
// which are the default, and at 0.85× with the 32-key tiles they now take);
// 64-query blocks always have 4 warps of 16.
// stages (2 or kFlashMaxStages): the K/V tiles a 128-query block keeps in shared memory. Two
// (the default) take two barriers a tile, the second before P·V waits for V(j); three
// take one, since tile j + 2 is copied while tile j is used. 64-query blocks and head
// size 256 (Gemma's 101 KiB blocks, two an SM) always take two.
// tile_queries may also be kFlashBf16WideTileQueries at head sizes 64 and 128
// (FlashBf16TileQueries): 12 warps of 16 queries (whatever warp_queries says), Q in shared
// memory, one block an SM: 3 warps a scheduler rather than 2, and each K/V tile serves
// 1.5 times the queries of a 128-query block.
// key_tile (64 or 32): the keys a tile of 8 warps of 16 queries. At 32, Q waits in shared
// memory, so a thread needs no more than 128 registers and two blocks run an SM: 4 warps a
// scheduler, from two blocks whose barriers do not stall each other. Other blocks keep
// their own tile (64, or 32 for two stripes and head size 256).
bool FlashPrefillBf16Supports(const AttentionParams& p);
inline constexpr int kFlashBf16WideTileQueries = 192;
// FlashTileQueries for the bf16 kernel: also kFlashBf16WideTileQueries where asked for and
// the head size has them (else 128-query tiles where it has those).
int FlashBf16TileQueries(int head_dim, int requested);
inline constexpr int kFlashDefaultWarpQueries = 16;
inline constexpr int kFlashDefaultStages = 2;
inline constexpr int kFlashMaxStages = 3;
inline constexpr int kFlashDefaultKeyTile = 64;
inline constexpr int kFlashNarrowKeyTile = 32;
// The bf16 kernel's layout of a call (CudaBackend's SetFlash… calls; the defaults are the
// ones measured fastest on an H200).
struct FlashBf16Layout {
  int tile_queries = kFlashDefaultTileQueries;  // at launch FlashBf16TileQueries(head_dim, ·)
  int warp_queries = kFlashDefaultWarpQueries;
  int stages = kFlashDefaultStages;
  int key_tile = kFlashDefaultKeyTile;
};
// INVALID_ARGUMENT naming the field of `layout` that the kernel does not have (tile_queries
// as asked for: 64, 128 or kFlashBf16WideTileQueries, whatever the head size).
absl::Status CheckFlashBf16Layout(const FlashBf16Layout& layout);
absl::Status LaunchFlashPrefillBf16(const AttentionParams& p, const FlashBf16Layout& layout,
                                    cudaStream_t stream);
// The bf16 kernel's loop on fp16 tensor cores, for p.k and p.v holding fp16 elements (an fp32
// cache's copy, kv_f16_copy.h; p.kv_dtype is not read) in 16-byte pieces, as the bf16
// kernel asks of a bf16 cache: Q and P rounded to fp16, as FlashPrefillKernel rounds them.
absl::Status LaunchFlashPrefillF16Copy(const AttentionParams& p, const FlashBf16Layout& layout,
                                       cudaStream_t stream);
// The layout LaunchFlashPrefillBf16 runs for p's head size and soft cap when asked for
// `asked` (valid, its tile_queries as FlashBf16TileQueries gives): two asked layouts that
// resolve alike run the same kernel. Its block's queries; 32 queries a warp only for two
// stripes (128-query blocks, uncapped), else 16; the stages asked for on 128- and 192-query
// blocks, else 2; and the keys a tile the kernel takes (32 for two stripes and head size
// 256, the asked 32 on 8 warps of 16, else 64).
FlashBf16Layout ResolvedFlashBf16Layout(const AttentionParams& p, const FlashBf16Layout& asked);

// Warps of a split-KV block: kSplitKvWarps (the default; up to four blocks an SM) or
// kSplitKvWideWarps (one block an SM: as many warps in flight, a quarter of the splits,
// and so a quarter of the partial results to write and merge; only where a head tile of
// at most 4 heads of 128 dims leaves the block's 16 warps' partial sums room in shared
// memory, else kSplitKvWarps). The warps merge their results in shared memory.
inline constexpr int kSplitKvWarps = 4;
inline constexpr int kSplitKvWideWarps = 16;
// INVALID_ARGUMENT naming the two unless warps is one of them.
absl::Status CheckSplitKvWarps(int warps);
// Which split-KV kernel LaunchSplitKv runs for p with `warps` asked for
// (0…kSplitKvVariants − 1: vector loads, head size past 128, the head tile that covers
// the GQA group, a bf16 cache, wide blocks), its warps, and how many of its blocks fit on
// one SM at once (cudaOccupancyMaxActiveBlocksPerMultiprocessor; at least 1).
inline constexpr int kSplitKvVariants = 64;
int SplitKvVariant(const AttentionParams& p, int warps = kSplitKvWarps);
int SplitKvVariantWarps(int variant);
absl::StatusOr<int> SplitKvBlocksPerSm(int variant);
// How many key splits to use: enough blocks for one full wave (num_sms × blocks_per_sm;
// a partial second wave would run its blocks with the SMs half idle), at least 4 steps of
// each warp a split (64 keys with 4 warps, 256 with 16), and as many as the kernel's spans
// of whole steps fill (none left empty). A Llama-7B decode step at batch 1 and 512 keys
// (32 KV heads) gets 8 splits.
int ChooseNumSplits(const AttentionParams& p, int num_sms, int blocks_per_sm,
                    int warps = kSplitKvWarps);
// A batched split-KV launch's imbalance: the longest row's keys over the rows' mean, rounded
// up to a power of two (at most kSplitKvMaxSplits; 1 for equal rows, or none). Each row
// divides its keys among the launch's splits, which ChooseNumSplits sizes for one wave of
// rows × KV heads blocks: at 64 decode rows of 8 KV heads one split, so one long row among
// short ones runs its blocks alone at the end of the step. Choosing the splits as if each
// SM held this many times the blocks (CudaBackend::SetSplitKvBalanced) cuts the long row's
// blocks to about the mean's keys; a power of two, so that the choice, and a recorded
// step's launch, change rarely while the rows grow.
int SplitKvImbalance(const int32_t* key_ends, int rows);

// The split-KV kernel reads q as float4 and K and V four elements at a time (a float4, or
// 8 bytes of bf16): head_dim, q_stride and kv_row_stride multiples of 4, q 16-byte
// aligned and k, v aligned to four elements (else it reads them one by one).
bool SplitKvVectorized(const AttentionParams& p);
// Floats of workspace LaunchSplitKv needs (0 when num_splits == 1).
int64_t SplitKvWorkspaceFloats(const AttentionParams& p, int num_splits);
// Ints of `arrivals` LaunchSplitKv needs to merge the splits in the same launch: one per
// (row, KV head).
int64_t SplitKvArrivalCounts(const AttentionParams& p);
// Also runs batched params (row_key_end set; no documents). With num_splits > 1 the splits'
// partial results are merged by SplitKvCombineKernel, a second launch, or, given
// `arrivals` (SplitKvArrivalCounts ints, all 0; left 0), by the last block of each row and
// KV head to finish, in the same launch. warps: as SplitKvVariant's.
absl::Status LaunchSplitKv(const AttentionParams& p, int warps, int num_splits, float* workspace,
                           int* arrivals, cudaStream_t stream);
// LaunchSplitKv's second launch (and LaunchSplitKvMma's): the splits' partial results in
// `workspace` merged into p.out.
absl::Status LaunchSplitKvCombine(const AttentionParams& p, int num_splits, const float* workspace,
                                  cudaStream_t stream);
// ChooseNumSplits for a split-KV kernel whose splits take at least min_keys keys each, in
// whole steps of `step` keys, with `slots` of its blocks on the device at once.
int SplitsForOneWave(const AttentionParams& p, int64_t slots, int64_t min_keys, int step);

// Split-KV on tensor cores (split_kv_mma.cu; CudaBackend::SetSplitKvTensorCores, off by
// default): the same blocks, splits and partial results as SplitKvKernel, at head sizes 64,
// 128 and 256, where SplitKvKernel is bound by its instruction issue (keys × dims × the GQA
// group's heads of fp32 FMAs a step, plus the lanes' sums). Each warp puts Sᵀ = K·Qᵀ and
// Oᵀ = Vᵀ·Pᵀ on tensor cores, the step's keys or the head's dims as the rows of mma.sync
// m16n8k16 and 8 (or 16) heads of the group as its columns, fp32 sums: on a bf16 cache 16
// keys a step in bf16 (16 products at Dh 128, a group of up to 8), on an fp32 cache 8 keys
// a step rounded to fp16 (the products' other 8 keys absent), as the flash kernels round
// them (Q and P too); P goes from one product to the next by movmatrix transposes. Each
// lane loads 8 elements of a row at a time, K and V straight into their fragments (V's
// pairs of keys formed by permutes or conversions), 256 bytes a
// step in flight. Needs kv_row_stride a multiple of 8 (bf16) or 4 (fp32), k, v and q
// 16-byte aligned, q_stride a multiple of 4; documents, windows, the soft cap and batched
// rows as SplitKvKernel.
inline constexpr int kSplitKvMmaWarps = 4;
inline constexpr int kSplitKvMmaBf16StepKeys = 16, kSplitKvMmaF32StepKeys = 8;
constexpr int SplitKvMmaStepKeys(KvDtype cache) {
  return cache == KvDtype::kBF16 ? kSplitKvMmaBf16StepKeys : kSplitKvMmaF32StepKeys;
}
bool SplitKvMmaSupports(const AttentionParams& p);
// Which of its kernels p takes (0…kSplitKvMmaVariants − 1: kSplitKvMmaKernelsPerCache for
// an fp32 cache, then as many for bf16, each: head size 64 with 8 heads a tile, with 16 (GQA
// groups past 8), 128 with 8, with 16, 256 with 8), and how many of its blocks fit on one
// SM at once (at least 1).
inline constexpr int kSplitKvMmaKernelsPerCache = 5;
inline constexpr int kSplitKvMmaVariants = 2 * kSplitKvMmaKernelsPerCache;
int SplitKvMmaVariant(const AttentionParams& p);
absl::StatusOr<int> SplitKvMmaBlocksPerSm(int variant);
// Splits for one full wave, at least 2 steps of each warp a split (128 keys on bf16, 64 on
// fp32).
int ChooseNumSplitsMma(const AttentionParams& p, int num_sms, int blocks_per_sm);
// As LaunchSplitKv (the workspace, arrivals and combine alike) for p where
// SplitKvMmaSupports(p).
absl::Status LaunchSplitKvMma(const AttentionParams& p, int num_splits, float* workspace,
                              int* arrivals, cudaStream_t stream);

// scores and probs: [H, Tq, Tk] device buffers (scratch when the caller wants neither).
absl::Status LaunchMaterialized(const AttentionParams& p, float* scores, float* probs,
                                cudaStream_t stream);

// One query row of several materialised calls in one launch (CudaBackend::AttentionBatch:
// the engine's last-query reruns for streamed attention rows, one a request and layer),
// each as LaunchMaterialized computes it alone. calls[c].p.block_table is unused: call c's
// table starts at tables + calls[c].table_offset (one upload for the batch). The calls
// share num_heads and kv_dtype and have num_queries 1 and no documents.
struct MaterializedRowCall {
  AttentionParams p;
  float* scores = nullptr;  // [H, Tk]
  float* probs = nullptr;   // [H, Tk]
  int64_t table_offset = 0;
};
absl::Status LaunchMaterializedRows(const MaterializedRowCall* calls, int num_calls,
                                    const int32_t* tables, int num_heads, KvDtype kv_dtype,
                                    cudaStream_t stream);

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_ATTENTION_H_
