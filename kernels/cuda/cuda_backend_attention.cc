// CudaBackend's attention: the host-side checks, the index uploads, the choice between
// the flash, split-KV and materialising kernels (attention.h), AttentionBatch's batched
// launches, and the attention backward. The rest of the backend is cuda_backend.cc.
#include <algorithm>
#include <array>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/attention_check.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_backward.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/kv_f16_copy.h"

namespace kvlens::kernels::cuda {
namespace {

// The same rule and message as CheckEveryRowSeesAKey, in O(Tq + Tk): a row sees a key
// iff some key before its causal end shares its document.
absl::Status CheckRowsSeeAKey(const AttentionArgs<float>& a) {
  if (a.q_doc_ids == nullptr) {
    // Without documents a row sees key 0 unless causality hides it: row i sees keys
    // 0 … offset + i, never empty since offset >= 0. Kept explicit for the record.
    return absl::OkStatus();
  }
  std::unordered_map<int32_t, int> first_key;  // document → its first key
  first_key.reserve(static_cast<size_t>(a.num_keys));
  for (int j = 0; j < a.num_keys; ++j) first_key.emplace(a.k_doc_ids[j], j);
  for (int i = 0; i < a.num_queries; ++i) {
    const auto it = first_key.find(a.q_doc_ids[i]);
    if (it == first_key.end() || it->second >= CausalKeyEnd(a, i)) {
      return NoVisibleKeyError(i, static_cast<int64_t>(a.query_offset) + i);
    }
  }
  return absl::OkStatus();
}

// The host-side checks of one Attention call, with the CPU backends' messages.
absl::Status CheckAttention(const AttentionArgs<float>& a) {
  if (absl::Status s = ValidateAttentionArgs(a); !s.ok()) return s;
  return CheckRowsSeeAKey(a);
}

// Whether `a` (without probs or scores) runs on a flash prefill kernel.
bool TakesFlash(const AttentionArgs<float>& a) {
  return a.num_queries >= kFlashMinQueries && FlashPrefillSupports(a.head_dim);
}

}  // namespace

AttentionParams HostAttentionParams(const AttentionArgs<float>& a) {
  AttentionParams p;
  p.q = a.q;
  p.q_stride = a.q_stride;
  p.k = a.kv.k;
  p.v = a.kv.v;
  p.kv_row_stride = a.kv.row_stride;
  p.kv_dtype = a.kv.dtype;
  p.block_size = a.kv.block_size;
  p.out = a.out;
  p.out_stride = a.out_stride;
  p.num_queries = a.num_queries;
  p.num_keys = a.num_keys;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.head_dim = a.head_dim;
  p.query_offset = a.query_offset;
  p.causal = a.causal;
  p.window = a.window;
  p.scale = static_cast<float>(a.scale);
  p.softcap = static_cast<float>(a.softcap);
  return p;
}

absl::StatusOr<AttentionParams> CudaBackend::DeviceParams(const AttentionArgs<float>& a,
                                                          absl::Span<const int32_t> extra,
                                                          const int32_t** d_extra) {
  AttentionParams p = HostAttentionParams(a);
  // One upload for all index arrays of the call: [block table | q docs | k docs | extra].
  const int num_blocks =
      a.kv.block_table != nullptr ? (a.num_keys + a.kv.block_size - 1) / a.kv.block_size : 0;
  const int num_docs = a.q_doc_ids != nullptr ? a.num_queries + a.num_keys : 0;
  if (num_blocks + num_docs + extra.size() > 0) {
    std::vector<int32_t>& packed = index_pack_;
    packed.clear();
    if (num_blocks > 0)
      packed.insert(packed.end(), a.kv.block_table, a.kv.block_table + num_blocks);
    if (num_docs > 0) {
      packed.insert(packed.end(), a.q_doc_ids, a.q_doc_ids + a.num_queries);
      packed.insert(packed.end(), a.k_doc_ids, a.k_doc_ids + a.num_keys);
    }
    packed.insert(packed.end(), extra.begin(), extra.end());
    absl::StatusOr<const void*> d = UploadIndices(packed.data(), sizeof(int32_t) * packed.size());
    if (!d.ok()) return d.status();
    const int32_t* base = static_cast<const int32_t*>(*d);
    if (num_blocks > 0) p.block_table = base;
    if (num_docs > 0) {
      p.q_doc = base + num_blocks;
      p.k_doc = base + num_blocks + a.num_queries;
    }
    if (!extra.empty()) *d_extra = base + num_blocks + num_docs;
  }
  return p;
}

absl::Status CudaBackend::AttentionImpl(const AttentionArgs<float>& a) {
  // Host-side checks first, with the CPU backends' messages; nothing is written on error.
  if (absl::Status s = CheckAttention(a); !s.ok()) return s;
  return AttentionChecked(a);
}

absl::Status CudaBackend::SplitKv(const AttentionParams& p, int imbalance) {
  // The kernel (tensor cores, or SplitKvKernel's variant), its blocks an SM (asked once)
  // and its split count.
  const bool mma = kernels_.split_kv_tensor_cores && SplitKvMmaSupports(p);
  const int variant = mma ? SplitKvMmaVariant(p) : SplitKvVariant(p, kernels_.split_kv_warps);
  int& per_sm = mma ? split_kv_mma_blocks_per_sm_[variant] : split_kv_blocks_per_sm_[variant];
  if (per_sm == 0) {
    absl::StatusOr<int> asked = mma ? SplitKvMmaBlocksPerSm(variant) : SplitKvBlocksPerSm(variant);
    if (!asked.ok()) return asked.status();
    per_sm = *asked;
  }
  // An unequal batch's splits as for `imbalance` times the blocks an SM (SplitKvImbalance).
  const int slots = per_sm * imbalance;
  const int splits = split_kv_splits_ > 0 ? split_kv_splits_
                     : mma                ? ChooseNumSplitsMma(p, num_sms_, slots)
                           : ChooseNumSplits(p, num_sms_, slots, kernels_.split_kv_warps);
  if (const int64_t ws = SplitKvWorkspaceFloats(p, splits); ws > 0) {
    if (absl::Status s = ReserveScratch(attention_workspace_, sizeof(float) * ws); !s.ok()) {
      return s;
    }
  }
  int* arrivals = nullptr;
  if (kernels_.split_kv_fused_combine && splits > 1) {
    // At least 64K counts (256 KB), so that a growing batch rarely regrows them.
    const size_t bytes = sizeof(int) * std::max<int64_t>(SplitKvArrivalCounts(p), int64_t{1} << 16);
    if (bytes > split_kv_arrivals_.bytes()) {
      if (absl::Status s = ReserveScratch(split_kv_arrivals_, bytes); !s.ok()) return s;
      // Zero before the launch; in a recorded step, as a node of its graph (each launch
      // leaves the counts at 0 again).
      KVLENS_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(split_kv_arrivals_.get(), 0, split_kv_arrivals_.bytes(), stream_));
    }
    arrivals = split_kv_arrivals_.as<int>();
  }
  if (mma) return Launch(&LaunchSplitKvMma, p, splits, attention_workspace_.as<float>(), arrivals);
  return Launch(&LaunchSplitKv, p, kernels_.split_kv_warps, splits,
                attention_workspace_.as<float>(), arrivals);
}

absl::Status CudaBackend::AttentionChecked(const AttentionArgs<float>& a) {
  const bool maps = a.probs != nullptr || a.scores != nullptr;
  // A flash call on the fp16 copy uploads its own index arrays (its table renumbered).
  if (!maps && TakesFlash(a) && TakesFlashF16Copy(HostAttentionParams(a))) {
    return FlashOnF16Copy(a);
  }
  absl::StatusOr<AttentionParams> params = DeviceParams(a);
  if (!params.ok()) return params.status();
  const AttentionParams& p = *params;
  if (maps) {
    // Materialised: S and A go to the caller's buffers, or to the map workspace when only
    // one of the two is wanted (not split-KV's: a last query's rerun after each recorded
    // step, over a growing key count, would move the partials the step's graph reads).
    const size_t map_bytes = sizeof(float) * static_cast<size_t>(a.num_heads) *
                             static_cast<size_t>(a.num_queries) * static_cast<size_t>(a.num_keys);
    float* scores = a.scores;
    float* probs = a.probs;
    if (scores == nullptr || probs == nullptr) {
      if (absl::Status s = ReserveScratch(map_workspace_, map_bytes); !s.ok()) return s;
      (scores == nullptr ? scores : probs) = map_workspace_.as<float>();
    }
    return Launch(&LaunchMaterialized, p, scores, probs);
  }
  if (TakesFlash(a)) return Flash(p, a.num_keys);
  if (a.head_dim > kSplitKvMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat("AttentionArgs.head_dim ", a.head_dim,
                                                   " is not supported by the CUDA "
                                                   "backend without probs/scores (at most ",
                                                   kSplitKvMaxHeadDim, ")"));
  }
  return SplitKv(p);
}

absl::Status CudaBackend::Attention(const AttentionArgs<float>& args) {
  if (!status_.ok()) return status_;
  absl::Status s = AttentionImpl(args);
  // Argument errors are the caller's and leave the backend usable; CUDA failures stick.
  if (s.code() != absl::StatusCode::kInvalidArgument) Ok(s);
  return s;
}

namespace {

// Which batched launch may take call `a` (after its checks passed) with others: paged,
// causal, no documents, no maps; the flash kernel's or the split-KV kernel's.
enum class BatchKind { kNone, kSplitKv, kFlash, kMaterializedRows };
BatchKind BatchKindOf(const AttentionArgs<float>& a) {
  if (a.q_doc_ids != nullptr || a.kv.block_table == nullptr) return BatchKind::kNone;
  if (a.probs != nullptr || a.scores != nullptr) {
    return a.num_queries == 1 ? BatchKind::kMaterializedRows : BatchKind::kNone;
  }
  if (!a.causal) return BatchKind::kNone;
  if (TakesFlash(a)) return BatchKind::kFlash;
  return a.head_dim <= kSplitKvMaxHeadDim ? BatchKind::kSplitKv : BatchKind::kNone;
}

// Whether `a` continues the run of `kind` that starts with `first` and has `rows` query
// rows so far: the same cache and shapes, and its q and out rows right after the run's;
// for materialised rows (each call its own cache, rows and maps), the same cache type and
// heads.
bool Continues(BatchKind kind, const AttentionArgs<float>& first, int rows,
               const AttentionArgs<float>& a) {
  if (kind == BatchKind::kMaterializedRows) {
    return a.kv.dtype == first.kv.dtype && a.num_heads == first.num_heads;
  }
  auto at = [](const float* base, int64_t stride, int r) {
    return reinterpret_cast<uintptr_t>(base) +
           static_cast<uintptr_t>(r) * static_cast<uintptr_t>(stride) * sizeof(float);
  };
  return a.kv.k == first.kv.k && a.kv.v == first.kv.v && a.kv.row_stride == first.kv.row_stride &&
         a.kv.dtype == first.kv.dtype && a.kv.block_size == first.kv.block_size &&
         a.num_heads == first.num_heads && a.num_kv_heads == first.num_kv_heads &&
         a.head_dim == first.head_dim && a.scale == first.scale && a.window == first.window &&
         a.softcap == first.softcap && a.q_stride == first.q_stride &&
         a.out_stride == first.out_stride &&
         reinterpret_cast<uintptr_t>(a.q) == at(first.q, first.q_stride, rows) &&
         reinterpret_cast<uintptr_t>(a.out) == at(first.out, first.out_stride, rows);
}

}  // namespace

absl::Status CudaBackend::LaunchMaterializedRowsBatched(
    absl::Span<const AttentionArgs<float>> calls) {
  // What a call does not take of S and A goes to the map workspace, each its own part.
  int64_t scratch_floats = 0;
  for (const AttentionArgs<float>& a : calls) {
    const int64_t map = int64_t{a.num_heads} * a.num_keys;
    scratch_floats += (a.scores == nullptr ? map : 0) + (a.probs == nullptr ? map : 0);
  }
  if (scratch_floats > 0) {
    if (absl::Status s = ReserveScratch(map_workspace_, sizeof(float) * scratch_floats); !s.ok()) {
      return s;
    }
  }
  // One upload: [the calls' parameters | every call's blocks].
  std::vector<MaterializedRowCall> rows(calls.size());
  float* scratch = map_workspace_.as<float>();
  int64_t table_ints = 0;
  for (size_t c = 0; c < calls.size(); ++c) {
    const AttentionArgs<float>& a = calls[c];
    MaterializedRowCall& row = rows[c];
    row.p = HostAttentionParams(a);
    row.p.block_table = nullptr;
    const int64_t map = int64_t{a.num_heads} * a.num_keys;
    row.scores = a.scores != nullptr ? a.scores : std::exchange(scratch, scratch + map);
    row.probs = a.probs != nullptr ? a.probs : std::exchange(scratch, scratch + map);
    row.table_offset = table_ints;
    table_ints += (a.num_keys + a.kv.block_size - 1) / a.kv.block_size;
  }
  const size_t rows_bytes = sizeof(MaterializedRowCall) * rows.size();
  std::vector<unsigned char> pack(rows_bytes + sizeof(int32_t) * static_cast<size_t>(table_ints));
  std::memcpy(pack.data(), rows.data(), rows_bytes);
  for (size_t c = 0; c < calls.size(); ++c) {
    const AttentionArgs<float>& a = calls[c];
    const int blocks = (a.num_keys + a.kv.block_size - 1) / a.kv.block_size;
    std::memcpy(pack.data() + rows_bytes + sizeof(int32_t) * rows[c].table_offset, a.kv.block_table,
                sizeof(int32_t) * blocks);
  }
  absl::StatusOr<const void*> d = UploadIndices(pack.data(), pack.size());
  if (!d.ok()) return d.status();
  const auto* base = static_cast<const unsigned char*>(*d);
  return Launch(&LaunchMaterializedRows, reinterpret_cast<const MaterializedRowCall*>(base),
                static_cast<int>(calls.size()), reinterpret_cast<const int32_t*>(base + rows_bytes),
                calls.front().num_heads, calls.front().kv.dtype);
}

absl::Status CudaBackend::LaunchSplitKvBatched(absl::Span<const AttentionArgs<float>> calls) {
  // One upload: [every call's blocks | key end of each row | table offset of each row],
  // written in place (index_pack_ keeps its capacity: no allocation a recorded step).
  std::vector<int32_t>& packed = index_pack_;
  int max_keys = 0;
  const int block_size = calls.front().kv.block_size;
  // While a step is recorded every table is padded to a power of two of blocks, and the
  // splits are chosen for that many keys: the launch stays the same while the sequences
  // grow (the padding is never read: each row divides its own keys among the splits).
  int padded_blocks = 0;
  if (graph_.recording()) {
    for (const AttentionArgs<float>& a : calls) max_keys = std::max(max_keys, a.num_keys);
    padded_blocks = 1;
    while (padded_blocks * block_size < max_keys) padded_blocks *= 2;
  }
  auto blocks_of = [&](const AttentionArgs<float>& a) {
    return (a.num_keys + block_size - 1) / block_size;
  };
  int tables = 0, rows = 0;
  for (const AttentionArgs<float>& a : calls) {
    tables += std::max(blocks_of(a), padded_blocks);
    rows += a.num_queries;
  }
  packed.assign(static_cast<size_t>(tables) + 2 * static_cast<size_t>(rows), 0);
  int32_t* key_end = packed.data() + tables;
  int32_t* table_offset = key_end + rows;
  int offset = 0, row = 0;
  for (const AttentionArgs<float>& a : calls) {
    const int blocks = blocks_of(a);
    std::copy(a.kv.block_table, a.kv.block_table + blocks, packed.begin() + offset);
    for (int i = 0; i < a.num_queries; ++i, ++row) {
      key_end[row] = CausalKeyEnd(a, i);
      table_offset[row] = offset;
    }
    offset += std::max(blocks, padded_blocks);
    max_keys = std::max(max_keys, a.num_keys);
  }
  if (padded_blocks > 0) max_keys = padded_blocks * block_size;
  absl::StatusOr<const void*> d = UploadIndices(packed.data(), sizeof(int32_t) * packed.size());
  if (!d.ok()) return d.status();
  const int32_t* base = static_cast<const int32_t*>(*d);
  AttentionParams p = HostAttentionParams(calls.front());
  p.block_table = base;
  p.num_queries = rows;
  p.num_keys = max_keys;  // sizes the splits; each row divides its own keys among them
  p.query_offset = 0;
  p.row_key_end = base + tables;
  p.row_table_offset = base + tables + rows;
  return SplitKv(p, kernels_.split_kv_balanced ? SplitKvImbalance(key_end, rows) : 1);
}

absl::Status CudaBackend::LaunchFlashBatched(absl::Span<const AttentionArgs<float>> calls) {
  // One upload: [every call's blocks | the tiles, longest causal key range first].
  std::vector<int32_t>& packed = index_pack_;
  packed.clear();
  std::vector<std::array<int32_t, kFlashTileInts>> tiles;
  AttentionParams p = HostAttentionParams(calls.front());
  const int tile = FlashTile(p);
  int row0 = 0;
  int64_t kv_keys = 0;  // a head's keys over all the sequences
  for (const AttentionArgs<float>& a : calls) {
    kv_keys += a.num_keys;
    const int offset = static_cast<int>(packed.size());
    const int blocks = (a.num_keys + a.kv.block_size - 1) / a.kv.block_size;
    packed.insert(packed.end(), a.kv.block_table, a.kv.block_table + blocks);
    for (int t0 = 0; t0 < a.num_queries; t0 += tile) {
      tiles.push_back(
          {row0 + t0, std::min(tile, a.num_queries - t0), a.query_offset + t0, a.num_keys, offset});
    }
    row0 += a.num_queries;
  }
  auto work = [](const std::array<int32_t, kFlashTileInts>& t) {
    return std::min<int64_t>(t[3], int64_t{t[2]} + t[1]);  // keys the tile's last row sees
  };
  std::stable_sort(tiles.begin(), tiles.end(),
                   [&](const auto& x, const auto& y) { return work(x) > work(y); });
  const int tables = static_cast<int>(packed.size());
  // On an fp16 copy: the tables renumbered to the copies, whose sources follow the tiles
  // (where the copies' workspace fits: else the fp16 kernel, on the tables as they are).
  bool f16_copy = TakesFlashF16Copy(p);
  KvF16CopyPlan plan;
  if (f16_copy) {
    std::vector<int32_t> renumbered(packed.begin(), packed.end());
    int offset = 0;
    for (const AttentionArgs<float>& a : calls) {
      const int blocks = (a.num_keys + a.kv.block_size - 1) / a.kv.block_size;
      plan.Renumber(renumbered.data() + offset, blocks, a.kv.block_size,
                    KvF16CopyPlan::FirstKeyRead(a.query_offset, a.window));
      offset += blocks;
    }
    absl::StatusOr<bool> fits =
        ReserveKvF16(p, static_cast<int>(plan.sources().size()), p.block_size);
    if (!fits.ok()) return fits.status();
    f16_copy = *fits;
    if (f16_copy) packed = std::move(renumbered);
  }
  for (const auto& t : tiles) packed.insert(packed.end(), t.begin(), t.end());
  const int sources = static_cast<int>(packed.size());
  if (f16_copy) packed.insert(packed.end(), plan.sources().begin(), plan.sources().end());
  absl::StatusOr<const void*> d = UploadIndices(packed.data(), sizeof(int32_t) * packed.size());
  if (!d.ok()) return d.status();
  const int32_t* base = static_cast<const int32_t*>(*d);
  p.block_table = base;
  p.flash_tiles = base + tables;
  p.num_flash_tiles = static_cast<int>(tiles.size());
  if (f16_copy) {
    const int copies = static_cast<int>(plan.sources().size());
    // (src_rows, a contiguous cache's, is not read where the sources are given.)
    if (absl::Status s = CopyKvF16(p, base + sources, copies, p.block_size, 0); !s.ok()) return s;
  }
  return Flash(p, kv_keys, f16_copy);
}

bool CudaBackend::TakesFlashBf16(const AttentionParams& p) const {
  return flash_bf16_ && FlashPrefillBf16Supports(p);
}

bool CudaBackend::TakesFlashF16Copy(const AttentionParams& p) const {
  return kernels_.flash_f16_copy && p.kv_dtype == KvDtype::kActivation &&
         FlashPrefillSupports(p.head_dim);
}

int CudaBackend::FlashTile(const AttentionParams& p) const {
  // The fp16 kernel has no 192-query tiles: 128 where asked for them.
  const int asked = kernels_.flash_layout.tile_queries;
  return TakesFlashBf16(p) || TakesFlashF16Copy(p)
             ? FlashBf16TileQueries(p.head_dim, asked)
             : FlashTileQueries(p.head_dim, std::min(asked, 128));
}

absl::Status CudaBackend::Flash(AttentionParams p, int64_t kv_keys, bool on_f16_copy) {
  // (On the copy, the L2 holds twice the keys of the fp32 cache's: 2-byte elements.)
  AttentionParams sized = p;
  if (on_f16_copy) sized.kv_dtype = KvDtype::kBF16;
  p.flash_head_group = FlashHeadGroup(sized, kernels_.flash_head_group, kv_keys, l2_bytes_);
  if (on_f16_copy || TakesFlashBf16(p)) {
    FlashBf16Layout layout = kernels_.flash_layout;
    layout.tile_queries = FlashTile(p);
    return on_f16_copy ? Launch(&LaunchFlashPrefillF16Copy, p, layout)
                       : Launch(&LaunchFlashPrefillBf16, p, layout);
  }
  return Launch(&LaunchFlashPrefill, p, FlashTile(p));
}

namespace {

// Bytes of K's (or V's) copies: copies × block_size rows of p's KV heads.
size_t KvF16HalfBytes(const AttentionParams& p, int copies, int block_size) {
  return sizeof(uint16_t) * static_cast<size_t>(copies) * static_cast<size_t>(block_size) *
         static_cast<size_t>(p.num_kv_heads) * static_cast<size_t>(p.head_dim);
}

}  // namespace

absl::StatusOr<bool> CudaBackend::ReserveKvF16(const AttentionParams& p, int copies,
                                               int block_size) {
  const absl::Status s = ReserveScratch(kv_f16_, 2 * KvF16HalfBytes(p, copies, block_size));
  if (s.ok()) return true;
  if (s.code() != absl::StatusCode::kResourceExhausted) return s;
  ++flash_f16_copy_fallbacks_;  // (DeviceMalloc has cleared the failed cudaMalloc's error)
  return false;
}

absl::Status CudaBackend::CopyKvF16(AttentionParams& p, const int32_t* d_sources, int copies,
                                    int block_size, int64_t src_rows) {
  const int row_elems = p.num_kv_heads * p.head_dim;  // a multiple of 16 (FlashPrefillSupports)
  uint16_t* k = kv_f16_.as<uint16_t>();
  uint16_t* v = k + KvF16HalfBytes(p, copies, block_size) / sizeof(uint16_t);
  if (absl::Status s =
          Launch(&LaunchKvF16Copy, static_cast<const float*>(p.k), static_cast<const float*>(p.v),
                 p.kv_row_stride, block_size, d_sources, copies, src_rows, row_elems, k, v,
                 static_cast<int64_t>(row_elems));
      !s.ok()) {
    return s;
  }
  p.k = k;
  p.v = v;
  p.kv_row_stride = row_elems;
  return absl::OkStatus();
}

absl::Status CudaBackend::FlashOnF16Copy(const AttentionArgs<float>& a) {
  // A paged call's table renumbered to its copies, uploaded with the documents and the
  // copies' sources (one upload); a contiguous cache is copied whole, in blocks of
  // kContiguousRows.
  constexpr int kContiguousRows = 64;
  AttentionArgs<float> renumbered = a;
  std::vector<int32_t> table;
  KvF16CopyPlan plan;
  if (a.kv.block_table != nullptr) {
    table.assign(a.kv.block_table,
                 a.kv.block_table + (a.num_keys + a.kv.block_size - 1) / a.kv.block_size);
    plan.Renumber(table.data(), static_cast<int>(table.size()), a.kv.block_size,
                  KvF16CopyPlan::FirstKeyRead(a.query_offset, a.window));
    renumbered.kv.block_table = table.data();
  }
  int copies = (a.num_keys + kContiguousRows - 1) / kContiguousRows;
  int block_size = kContiguousRows;
  if (a.kv.block_table != nullptr) {
    copies = static_cast<int>(plan.sources().size());
    block_size = a.kv.block_size;
  }
  absl::StatusOr<bool> fits = ReserveKvF16(HostAttentionParams(a), copies, block_size);
  if (!fits.ok()) return fits.status();
  if (!*fits) {  // the fp16 kernel, as without the copy
    absl::StatusOr<AttentionParams> p = DeviceParams(a);
    if (!p.ok()) return p.status();
    return Flash(*p, a.num_keys);
  }
  const int32_t* d_sources = nullptr;
  absl::StatusOr<AttentionParams> p = DeviceParams(renumbered, plan.sources(), &d_sources);
  if (!p.ok()) return p.status();
  if (absl::Status s = CopyKvF16(*p, d_sources, copies, block_size, a.num_keys); !s.ok()) return s;
  return Flash(*p, a.num_keys, true);
}

absl::Status CudaBackend::SetSplitKvSplits(int splits) {
  if (splits < 0 || splits > kSplitKvMaxSplits) {
    return absl::InvalidArgumentError(
        absl::StrCat("split-KV splits must be in [0, ", kSplitKvMaxSplits, "], got ", splits));
  }
  split_kv_splits_ = splits;
  return absl::OkStatus();
}

absl::Status CudaBackend::SetSplitKvWarps(int warps) {
  if (absl::Status s = CheckSplitKvWarps(warps); !s.ok()) return s;
  kernels_.split_kv_warps = warps;
  return absl::OkStatus();
}

absl::Status CudaBackend::SetAttentionKernels(const AttentionKernels& k) {
  if (absl::Status s = CheckFlashBf16Layout(k.flash_layout); !s.ok()) return s;
  if (absl::Status s = CheckFlashHeadGroup(k.flash_head_group); !s.ok()) return s;
  if (absl::Status s = CheckSplitKvWarps(k.split_kv_warps); !s.ok()) return s;
  kernels_ = k;
  return absl::OkStatus();
}

absl::Status CudaBackend::SetFlashHeadGroup(int heads) {
  if (absl::Status s = CheckFlashHeadGroup(heads); !s.ok()) return s;
  kernels_.flash_head_group = heads;
  return absl::OkStatus();
}

absl::Status CudaBackend::SetFlashLayout(const FlashBf16Layout& layout) {
  if (absl::Status s = CheckFlashBf16Layout(layout); !s.ok()) return s;
  kernels_.flash_layout = layout;
  return absl::OkStatus();
}

absl::Status CudaBackend::SetFlashLayoutField(int FlashBf16Layout::*field, int value) {
  FlashBf16Layout layout = kernels_.flash_layout;
  layout.*field = value;
  return SetFlashLayout(layout);
}

absl::Status CudaBackend::SetFlashWarpQueries(int queries) {
  return SetFlashLayoutField(&FlashBf16Layout::warp_queries, queries);
}

absl::Status CudaBackend::SetFlashStages(int stages) {
  return SetFlashLayoutField(&FlashBf16Layout::stages, stages);
}

absl::Status CudaBackend::SetFlashKeyTile(int keys) {
  return SetFlashLayoutField(&FlashBf16Layout::key_tile, keys);
}

absl::Status CudaBackend::SetFlashTileQueries(int queries) {
  return SetFlashLayoutField(&FlashBf16Layout::tile_queries, queries);
}

absl::Status CudaBackend::AttentionBatch(absl::Span<const AttentionArgs<float>> calls,
                                         int* failed) {
  *failed = 0;
  if (!status_.ok()) return status_;
  for (size_t c = 0; c < calls.size(); ++c) {
    if (absl::Status s = CheckAttention(calls[c]); !s.ok()) {
      *failed = static_cast<int>(c);
      return s;
    }
  }
  // Runs [begin, end) of batchable calls in row order; anything else alone.
  size_t begin = 0;
  while (begin < calls.size()) {
    size_t end = begin + 1;
    int rows = calls[begin].num_queries;
    const BatchKind kind = BatchKindOf(calls[begin]);
    if (kind != BatchKind::kNone) {
      while (end < calls.size() && BatchKindOf(calls[end]) == kind &&
             Continues(kind, calls[begin], rows, calls[end])) {
        rows += calls[end].num_queries;
        ++end;
      }
    }
    const absl::Span<const AttentionArgs<float>> run = calls.subspan(begin, end - begin);
    // (While a step is recorded, a lone decode-like call takes the batched split-KV launch
    // too: its key ends come from the device, so its launch does not change every step.)
    const bool alone = run.size() == 1 && !(kind == BatchKind::kSplitKv && graph_.recording());
    const absl::Status s = alone                       ? AttentionChecked(run.front())
                           : kind == BatchKind::kFlash ? LaunchFlashBatched(run)
                           : kind == BatchKind::kMaterializedRows
                               ? LaunchMaterializedRowsBatched(run)
                               : LaunchSplitKvBatched(run);
    if (!s.ok()) {
      *failed = static_cast<int>(begin);
      if (s.code() != absl::StatusCode::kInvalidArgument) Ok(s);
      return s;
    }
    begin = end;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::AttentionBackwardImpl(const AttentionBackwardArgs<float>& b) {
  if (absl::Status s = ValidateAttentionBackwardArgs(b); !s.ok()) return s;
  const AttentionArgs<float> a = ForwardArgsOf(b);
  if (absl::Status s = CheckRowsSeeAKey(a); !s.ok()) return s;
  absl::StatusOr<AttentionParams> params = DeviceParams(a);
  if (!params.ok()) return params.status();
  AttentionBackwardParams p;
  p.fwd = *params;
  p.probs = b.probs;
  p.dout = b.dout;
  p.dout_stride = b.dout_stride;
  p.dq = b.dq;
  p.dk = b.dk;
  p.dv = b.dv;
  p.dprobs = b.dprobs;
  p.dscores = b.dscores;
  // dS is needed for dK (dR, through a soft-cap, too): what the caller does not take is
  // kept in the workspace.
  const size_t map_elems = static_cast<size_t>(a.num_heads) * static_cast<size_t>(a.num_queries) *
                           static_cast<size_t>(a.num_keys);
  const size_t maps = (p.dscores == nullptr ? 1 : 0) + (a.softcap > 0.0 ? 1 : 0);
  if (maps > 0) {
    if (absl::Status s = ReserveScratch(map_workspace_, maps * map_elems * sizeof(float));
        !s.ok()) {
      return s;
    }
    float* scratch = map_workspace_.as<float>();
    if (p.dscores == nullptr) {
      p.dscores = scratch;
      scratch += map_elems;
    }
    if (a.softcap > 0.0) p.dscores_raw = scratch;
  }
  if (graph_.recording()) {
    return absl::FailedPreconditionError("AttentionBackward: not part of a recorded forward step");
  }
  return LaunchAttentionBackward(p, stream_);
}

absl::Status CudaBackend::AttentionBackward(const AttentionBackwardArgs<float>& args) {
  if (!status_.ok()) return status_;
  absl::Status s = AttentionBackwardImpl(args);
  if (s.code() != absl::StatusCode::kInvalidArgument) Ok(s);
  return s;
}

}  // namespace kvlens::kernels::cuda
