// An fp32 cache's blocks copied to fp16 for the flash kernel (kv_f16_copy.h).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/flash_common.cuh"
#include "kernels/cuda/kv_f16_copy.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma_sync.cuh"

namespace kvlens::kernels::cuda {

int KvF16CopyPlan::FirstKeyRead(int query_offset, int window) {
  return window > 0 ? std::max(0, query_offset - window + 1) / kBlockN * kBlockN : 0;
}

void KvF16CopyPlan::Renumber(int32_t* table, int blocks, int block_size, int first_key) {
  const int first = std::min(first_key / block_size, blocks);
  std::fill(table, table + first, 0);
  for (int b = first; b < blocks; ++b) {
    const auto [it, added] = copy_of_.try_emplace(table[b], static_cast<int32_t>(sources_.size()));
    if (added) sources_.push_back(table[b]);
    table[b] = it->second;
  }
}

namespace {

constexpr int kThreads = 256;

// Eight elements from `row` (vector loads where the row is 16-byte aligned) as four fp16
// pairs.
template <bool kVec>
__device__ __forceinline__ uint4 EightAsHalves(const float* row) {
  float x[8];
  if constexpr (kVec) {
    const float4 a = *reinterpret_cast<const float4*>(row);
    const float4 b = *reinterpret_cast<const float4*>(row + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = row[e];
  }
  uint4 h;
  h.x = PackHalf2(x[0], x[1]);
  h.y = PackHalf2(x[2], x[3]);
  h.z = PackHalf2(x[4], x[5]);
  h.w = PackHalf2(x[6], x[7]);
  return h;
}

// A thread per 8 elements of a row, K and V both.
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    KvF16CopyKernel(const float* k, const float* v, int64_t src_row_stride, int block_size,
                    const int32_t* sources, int64_t rows, int64_t src_rows, int row_elems,
                    uint16_t* dst_k, uint16_t* dst_v, int64_t dst_row_stride) {
  WaitForPriorGrids();  // first: see launch.cuh
  const int pieces = row_elems / 8;
  const int64_t total = rows * pieces;
  for (int64_t idx = blockIdx.x * int64_t{kThreads} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * kThreads) {
    const int64_t row = idx / pieces;
    const int e = 8 * static_cast<int>(idx % pieces);
    const int64_t c = row / block_size;
    const int64_t src = (sources != nullptr ? sources[c] : c) * block_size + row % block_size;
    uint4 hk = make_uint4(0, 0, 0, 0), hv = hk;
    if (sources != nullptr || src < src_rows) {
      hk = EightAsHalves<kVec>(k + src * src_row_stride + e);
      hv = EightAsHalves<kVec>(v + src * src_row_stride + e);
    }
    *reinterpret_cast<uint4*>(dst_k + row * dst_row_stride + e) = hk;
    *reinterpret_cast<uint4*>(dst_v + row * dst_row_stride + e) = hv;
  }
}

}  // namespace

absl::Status LaunchKvF16Copy(const float* k, const float* v, int64_t src_row_stride, int block_size,
                             const int32_t* sources, int copies, int64_t src_rows, int row_elems,
                             uint16_t* dst_k, uint16_t* dst_v, int64_t dst_row_stride,
                             cudaStream_t stream) {
  if (row_elems % 8 != 0 || dst_row_stride % 8 != 0 || block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the fp16 KV copy takes rows of a multiple of 8 elements and a block size "
                     "of at least 1; got row_elems ",
                     row_elems, ", dst_row_stride ", dst_row_stride, ", block_size ", block_size));
  }
  const int64_t rows = int64_t{copies} * block_size;
  if (rows == 0) return absl::OkStatus();
  const bool vec = src_row_stride % 4 == 0 && reinterpret_cast<uintptr_t>(k) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(v) % 16 == 0;
  // A grid-stride loop over at most 64K blocks of 256 threads.
  const int64_t blocks =
      std::min<int64_t>((rows * (row_elems / 8) + kThreads - 1) / kThreads, int64_t{1} << 16);
  auto* kernel = vec ? KvF16CopyKernel<true> : KvF16CopyKernel<false>;
  LaunchKernel("KvF16CopyKernel", kernel, static_cast<unsigned>(blocks), kThreads, 0, stream, k, v,
               src_row_stride, block_size, sources, rows, src_rows, row_elems, dst_k, dst_v,
               dst_row_stride);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("KvF16CopyKernel");
  return absl::OkStatus();
}

}  // namespace kvlens::kernels::cuda
