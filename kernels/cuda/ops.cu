// Elementwise, normalisation, embedding and KV-cache kernels: memory-bound, fp32
// arithmetic, weights read in their stored dtype. Three levels per op: a static __global__
// kernel, its launcher (ops.h), and the CudaBackend entry that calls the launcher.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/load_as_float.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/rope_store.cuh"

namespace kvlens::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Enough blocks of kThreads to cover count with grid-stride loops, capped so that huge
// tensors reuse blocks instead of launching millions.
unsigned GridFor(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, int64_t{1} << 16));
}

__global__ void EmbeddingKernel(const void* table, DType dtype, int64_t dim, const int32_t* ids,
                                float* out) {
  WaitForPriorGrids();  // first: see launch.cuh
  const int64_t r = blockIdx.x;
  const int64_t base = static_cast<int64_t>(ids[r]) * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    out[r * dim + c] = LoadAsFloat(table, dtype, base + c);
  }
}

// The row the norms read: x's, or with a residual x + residual, stored back into x first
// (AddRmsNorm, AddLayerNorm). Each thread later reads back only what it wrote itself.
__device__ __forceinline__ const float* NormInput(float* x, const float* residual, int dim) {
  float* xr = x + static_cast<int64_t>(blockIdx.x) * dim;
  if (residual != nullptr) {
    const float* rr = residual + static_cast<int64_t>(blockIdx.x) * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xr[i] += rr[i];
  }
  return xr;
}

// One block per row. x is read only (const_cast in the launcher) unless residual is set.
__global__ void RmsNormKernel(float* x, const float* residual, int dim, const void* weight,
                              DType dtype, float eps, float* y) {
  WaitForPriorGrids();  // first: see launch.cuh
  const float* xr = NormInput(x, residual, dim);
  float* yr = y + static_cast<int64_t>(blockIdx.x) * dim;
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) sum_sq += xr[i] * xr[i];
  const float inv_rms = rsqrtf(BlockReduce(sum_sq, SumOp()) / static_cast<float>(dim) + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    yr[i] = xr[i] * inv_rms * LoadAsFloat(weight, dtype, i);
  }
}

// The same for rows of up to 4 · 1024 values: each thread holds its (at most) four values
// in registers, so x, the residual and the weight are all requested before the sum of
// squares is reduced: one trip to memory, not one per pass. (On an H200 the looped kernel
// took 6 us a row of 4096, 8% of a Llama-7B decode step at batch 1.)
__global__ void RmsNormRegisterKernel(float* x, const float* residual, int dim, const void* weight,
                                      DType dtype, float eps, float* y) {
  WaitForPriorGrids();  // first: see launch.cuh
  const int64_t row = static_cast<int64_t>(blockIdx.x) * dim;
  const int i0 = 4 * static_cast<int>(threadIdx.x);
  float v[4], w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int i = i0 + e;
    v[e] = i < dim ? x[row + i] : 0.0f;
    w[e] = i < dim ? LoadAsFloat(weight, dtype, i) : 0.0f;
    if (residual != nullptr && i < dim) v[e] += residual[row + i];
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e) sum_sq += v[e] * v[e];
  const float inv_rms = rsqrtf(BlockReduce(sum_sq, SumOp()) / static_cast<float>(dim) + eps);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int i = i0 + e;
    if (i >= dim) continue;
    if (residual != nullptr) x[row + i] = v[e];
    y[row + i] = v[e] * inv_rms * w[e];
  }
}

// One block per row; two passes (mean, then the variance about it) for accuracy.
__global__ void LayerNormKernel(float* x, const float* residual, int dim, const void* weight,
                                const void* bias, DType dtype, float eps, float* y) {
  WaitForPriorGrids();  // first: see launch.cuh
  const float* xr = NormInput(x, residual, dim);
  float* yr = y + static_cast<int64_t>(blockIdx.x) * dim;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) sum += xr[i];
  const float mean = BlockReduce(sum, SumOp()) / static_cast<float>(dim);
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const float d = xr[i] - mean;
    sum_sq += d * d;
  }
  const float inv_std = rsqrtf(BlockReduce(sum_sq, SumOp()) / static_cast<float>(dim) + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const float b = bias != nullptr ? LoadAsFloat(bias, dtype, i) : 0.0f;
    yr[i] = (xr[i] - mean) * inv_std * LoadAsFloat(weight, dtype, i) + b;
  }
}

// One thread per (row, head, pair), over x's heads and then x2's (RopeQK: q and k in one
// launch; x2 null for one tensor); the angle and the rotation are rope_store.cuh's.
// With k_cache set (RopeQKStoreKv; head_dim even), the threads of x2's heads (k) also
// store the rotated pair into k_cache and v's same pair into v_cache, at cache row
// dst_rows[r] (none for a negative row): the cache rows in the same launch.
struct KvStore {
  const float* v;
  const int64_t* dst_rows;
  void* k_cache;  // float, or bf16 bits (uint16_t) when bf16
  void* v_cache;
  int64_t cache_stride;
  bool bf16;
};

__global__ void RopeKernel(float* x, int64_t row_stride, int num_heads, float* x2,
                           int64_t row_stride2, int num_heads2, int n, int head_dim,
                           const int32_t* positions, double theta, const float* freq_factors,
                           bool adjacent, KvStore store) {
  WaitForPriorGrids();  // first: see launch.cuh
  const int half = head_dim / 2;
  const int heads = num_heads + num_heads2;
  const int64_t total = static_cast<int64_t>(n) * heads * half;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int p = static_cast<int>(t % half);
    const int64_t rh = t / half;
    const int h = static_cast<int>(rh % heads);
    const int64_t r = rh / heads;
    const float2 cs = RopeCosSin(positions[r], p, head_dim, theta, freq_factors);
    float* head = h < num_heads
                      ? x + r * row_stride + static_cast<int64_t>(h) * head_dim
                      : x2 + r * row_stride2 + static_cast<int64_t>(h - num_heads) * head_dim;
    const int ia = adjacent ? 2 * p : p;
    const int ib = adjacent ? 2 * p + 1 : p + half;
    const float2 rotated = RotatePair(head[ia], head[ib], cs);
    const float ra = rotated.x, rb = rotated.y;
    head[ia] = ra;
    head[ib] = rb;
    if (store.k_cache != nullptr && h >= num_heads && store.dst_rows[r] >= 0) {
      const int64_t in_row = static_cast<int64_t>(h - num_heads) * head_dim;
      const int64_t dst = store.dst_rows[r] * store.cache_stride + in_row;
      const float* vr = store.v + r * row_stride2 + in_row;
      StoreCacheElement(store.k_cache, dst + ia, ra, store.bf16);
      StoreCacheElement(store.k_cache, dst + ib, rb, store.bf16);
      StoreCacheElement(store.v_cache, dst + ia, vr[ia], store.bf16);
      StoreCacheElement(store.v_cache, dst + ib, vr[ib], store.bf16);
    }
  }
}

__global__ void GeluKernel(float* x, int64_t count) {
  WaitForPriorGrids();  // first: see launch.cuh
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = GeluTanh(x[i]);
  }
}

__global__ void SwiGluKernel(const float* gate, const float* up, int64_t count, float* out) {
  WaitForPriorGrids();  // first: see launch.cuh
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = Silu(gate[i]) * up[i];
  }
}

__global__ void GeGluKernel(const float* gate, const float* up, int64_t count, float* out) {
  WaitForPriorGrids();  // first: see launch.cuh
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = GeluTanh(gate[i]) * up[i];
  }
}

__global__ void ScaleKernel(float* x, int64_t count, float factor) {
  WaitForPriorGrids();  // first: see launch.cuh
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] *= factor;
  }
}

__global__ void SoftCapKernel(float* x, int64_t count, float cap) {
  WaitForPriorGrids();  // first: see launch.cuh
  const float inv = 1.0f / cap;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = cap * tanhf(x[i] * inv);
  }
}

__global__ void AddKernel(float* y, const float* x, int64_t count) {
  WaitForPriorGrids();  // first: see launch.cuh
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

__global__ void AddRowsKernel(float* y, int64_t total, int64_t dim, const float* rows,
                              const int32_t* index) {
  WaitForPriorGrids();  // first: see launch.cuh
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t row = index[i / dim];
    if (row >= 0) y[i] += rows[row * dim + i % dim];
  }
}

__global__ void AddBiasKernel(float* y, int64_t total, int64_t cols, const void* bias,
                              DType dtype) {
  WaitForPriorGrids();  // first: see launch.cuh
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += LoadAsFloat(bias, dtype, i % cols);
  }
}

__global__ void StoreKvKernel(const float* k, const float* v, int n, int64_t src_stride,
                              int64_t row_elems, const int64_t* dst_rows, void* k_cache,
                              void* v_cache, int64_t cache_stride, bool bf16) {
  WaitForPriorGrids();  // first: see launch.cuh
  const int64_t total = static_cast<int64_t>(n) * row_elems;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / row_elems, e = t % row_elems;
    if (dst_rows[r] < 0) continue;  // a padding row
    const int64_t dst = dst_rows[r] * cache_stride + e;
    StoreCacheElement(k_cache, dst, k[r * src_stride + e], bf16);
    StoreCacheElement(v_cache, dst, v[r * src_stride + e], bf16);
  }
}

__global__ void ConvertF32Kernel(const float* x, int64_t count, bool to_bf16, void* out) {
  WaitForPriorGrids();  // first: see launch.cuh
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (to_bf16) {
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x[i]);
    } else {
      static_cast<__half*>(out)[i] = __float2half_rn(x[i]);
    }
  }
}

__device__ __forceinline__ uint64_t SplitMix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void FillRandomKernel(void* out, DType dtype, int64_t count, uint64_t seed,
                                 float scale) {
  WaitForPriorGrids();  // first: see launch.cuh
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = SplitMix64(seed * 0x100000001b3ull + static_cast<uint64_t>(i));
    const float u = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    const float value = (2.0f * u - 1.0f) * scale;
    switch (dtype) {
      case DType::kF16:
        static_cast<__half*>(out)[i] = __float2half_rn(value);
        break;
      case DType::kBF16:
        static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(value);
        break;
      default:
        static_cast<float*>(out)[i] = value;
        break;
    }
  }
}

}  // namespace

absl::Status LaunchEmbedding(const void* table, DType dtype, int64_t dim, const int32_t* ids, int n,
                             float* out, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel("EmbeddingKernel", EmbeddingKernel, n, kThreads, 0, stream, table, dtype, dim, ids,
               out);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("EmbeddingKernel");
  return absl::OkStatus();
}

absl::Status LaunchRmsNorm(const float* x, int n, int dim, const void* weight, DType dtype,
                           float eps, float* y, cudaStream_t stream) {
  return LaunchAddRmsNorm(const_cast<float*>(x), nullptr, n, dim, weight, dtype, eps, y, stream);
}

absl::Status LaunchAddRmsNorm(float* x, const float* residual, int n, int dim, const void* weight,
                              DType dtype, float eps, float* y, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  if (dim <= 4 * 1024) {
    const int threads = std::max(32, ((dim + 3) / 4 + 31) / 32 * 32);
    LaunchKernel("RmsNormRegisterKernel", RmsNormRegisterKernel, n, threads, 0, stream, x, residual,
                 dim, weight, dtype, eps, y);
    KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("RmsNormRegisterKernel");
    return absl::OkStatus();
  }
  LaunchKernel("RmsNormKernel", RmsNormKernel, n, 1024, 0, stream, x, residual, dim, weight, dtype,
               eps, y);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("RmsNormKernel");
  return absl::OkStatus();
}

absl::Status LaunchLayerNorm(const float* x, int n, int dim, const void* weight, const void* bias,
                             DType dtype, float eps, float* y, cudaStream_t stream) {
  return LaunchAddLayerNorm(const_cast<float*>(x), nullptr, n, dim, weight, bias, dtype, eps, y,
                            stream);
}

absl::Status LaunchAddLayerNorm(float* x, const float* residual, int n, int dim, const void* weight,
                                const void* bias, DType dtype, float eps, float* y,
                                cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  const int threads = dim >= 4096 ? 1024 : kThreads;
  LaunchKernel("LayerNormKernel", LayerNormKernel, n, threads, 0, stream, x, residual, dim, weight,
               bias, dtype, eps, y);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("LayerNormKernel");
  return absl::OkStatus();
}

absl::Status LaunchRope(float* x, int n, int64_t row_stride, int num_heads, int head_dim,
                        const int32_t* positions, const RopeSpec& rope, cudaStream_t stream) {
  return LaunchRopeQK(x, row_stride, num_heads, nullptr, 0, 0, n, head_dim, positions, rope,
                      stream);
}

namespace {

// RopeKernel over q's heads and k's, storing the cache rows when `store` has a cache.
absl::Status LaunchRopeKernel(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride,
                              int k_heads, int n, int head_dim, const int32_t* positions,
                              const RopeSpec& rope, const KvStore& store, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(n) * (q_heads + k_heads) * (head_dim / 2);
  if (total <= 0) return absl::OkStatus();
  LaunchKernel("RopeKernel", RopeKernel, GridFor(total), kThreads, 0, stream, q, q_stride, q_heads,
               k, k_stride, k_heads, n, head_dim, positions, rope.theta, rope.freq_factors,
               rope.style == RopeStyle::kAdjacentPairs, store);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("RopeKernel");
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchRopeQK(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride,
                          int k_heads, int n, int head_dim, const int32_t* positions,
                          const RopeSpec& rope, cudaStream_t stream) {
  return LaunchRopeKernel(q, q_stride, q_heads, k, k_stride, k_heads, n, head_dim, positions, rope,
                          KvStore{nullptr, nullptr, nullptr, nullptr, 0, false}, stream);
}

absl::Status LaunchRopeQKStoreKv(float* q, int64_t q_stride, int q_heads, float* k, const float* v,
                                 int64_t kv_stride, int kv_heads, int n, int head_dim,
                                 const int32_t* positions, const RopeSpec& rope,
                                 const int64_t* dst_rows, void* k_cache, void* v_cache,
                                 int64_t cache_stride, KvDtype cache_dtype, cudaStream_t stream) {
  if (head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchRopeQKStoreKv: head_dim must be even, got ", head_dim));
  }
  return LaunchRopeKernel(
      q, q_stride, q_heads, k, kv_stride, kv_heads, n, head_dim, positions, rope,
      KvStore{v, dst_rows, k_cache, v_cache, cache_stride, cache_dtype == KvDtype::kBF16}, stream);
}

absl::Status LaunchGelu(float* x, int64_t count, cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  LaunchKernel("GeluKernel", GeluKernel, GridFor(count), kThreads, 0, stream, x, count);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("GeluKernel");
  return absl::OkStatus();
}

absl::Status LaunchSwiGlu(const float* gate, const float* up, int64_t count, float* out,
                          cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  LaunchKernel("SwiGluKernel", SwiGluKernel, GridFor(count), kThreads, 0, stream, gate, up, count,
               out);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("SwiGluKernel");
  return absl::OkStatus();
}

absl::Status LaunchGeGlu(const float* gate, const float* up, int64_t count, float* out,
                         cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  LaunchKernel("GeGluKernel", GeGluKernel, GridFor(count), kThreads, 0, stream, gate, up, count,
               out);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("GeGluKernel");
  return absl::OkStatus();
}

absl::Status LaunchSoftCap(float* x, int64_t count, double cap, cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  LaunchKernel("SoftCapKernel", SoftCapKernel, GridFor(count), kThreads, 0, stream, x, count,
               static_cast<float>(cap));
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("SoftCapKernel");
  return absl::OkStatus();
}

absl::Status LaunchScale(float* x, int64_t count, double factor, cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  LaunchKernel("ScaleKernel", ScaleKernel, GridFor(count), kThreads, 0, stream, x, count,
               static_cast<float>(factor));
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("ScaleKernel");
  return absl::OkStatus();
}

absl::Status LaunchAdd(float* y, const float* x, int64_t count, cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  LaunchKernel("AddKernel", AddKernel, GridFor(count), kThreads, 0, stream, y, x, count);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("AddKernel");
  return absl::OkStatus();
}

absl::Status LaunchAddRows(float* y, int n, int64_t dim, const float* rows, const int32_t* index,
                           cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(n) * dim;
  if (total <= 0) return absl::OkStatus();
  LaunchKernel("AddRowsKernel", AddRowsKernel, GridFor(total), kThreads, 0, stream, y, total, dim,
               rows, index);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("AddRowsKernel");
  return absl::OkStatus();
}

absl::Status LaunchAddBias(float* y, int n, int64_t cols, const void* bias, DType dtype,
                           cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(n) * cols;
  if (total <= 0) return absl::OkStatus();
  LaunchKernel("AddBiasKernel", AddBiasKernel, GridFor(total), kThreads, 0, stream, y, total, cols,
               bias, dtype);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("AddBiasKernel");
  return absl::OkStatus();
}

absl::Status LaunchStoreKv(const float* k, const float* v, int n, int64_t src_stride,
                           int64_t row_elems, const int64_t* dst_rows, void* k_cache, void* v_cache,
                           int64_t cache_stride, KvDtype cache_dtype, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(n) * row_elems;
  if (total <= 0) return absl::OkStatus();
  LaunchKernel("StoreKvKernel", StoreKvKernel, GridFor(total), kThreads, 0, stream, k, v, n,
               src_stride, row_elems, dst_rows, k_cache, v_cache, cache_stride,
               cache_dtype == KvDtype::kBF16);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("StoreKvKernel");
  return absl::OkStatus();
}

absl::Status LaunchConvertF32(const float* x, int64_t count, DType to, void* out,
                              cudaStream_t stream) {
  if (to != DType::kF16 && to != DType::kBF16) {
    return absl::InvalidArgumentError("LaunchConvertF32: target must be f16 or bf16");
  }
  if (count <= 0) return absl::OkStatus();
  LaunchKernel("ConvertF32Kernel", ConvertF32Kernel, GridFor(count), kThreads, 0, stream, x, count,
               to == DType::kBF16, out);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("ConvertF32Kernel");
  return absl::OkStatus();
}

absl::Status LaunchFillRandom(void* out, DType dtype, int64_t count, uint64_t seed, float scale,
                              cudaStream_t stream) {
  if (DTypeIsBlockQuantized(dtype)) {
    return absl::InvalidArgumentError("LaunchFillRandom: block types are not device dtypes");
  }
  if (count <= 0) return absl::OkStatus();
  LaunchKernel("FillRandomKernel", FillRandomKernel, GridFor(count), kThreads, 0, stream, out,
               dtype, count, seed, scale);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("FillRandomKernel");
  return absl::OkStatus();
}

}  // namespace kvlens::kernels::cuda
