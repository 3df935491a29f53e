// Launchers of the elementwise, normalisation, embedding and cache kernels (ops.cu). Each
// takes device pointers and a stream, enqueues its kernel and returns at once; a launch
// failure comes back as a Status. Index arrays (ids, positions, dst_rows) are device
// arrays here: CudaBackend uploads them from the engine's host arrays.
//
// Weights arrive in their device dtype (kF32, kF16 or kBF16; block types such as q8_0 are
// dequantised to f16 at upload, see cuda_backend.h) and are read as float; activations are always
// float.
#ifndef KVLENS_KERNELS_CUDA_OPS_H_
#define KVLENS_KERNELS_CUDA_OPS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"

namespace kvlens::kernels::cuda {

// out[n, dim] = table[ids[r], :]   (table [vocab, dim] in `dtype`)
absl::Status LaunchEmbedding(const void* table, DType dtype, int64_t dim, const int32_t* ids, int n,
                             float* out, cudaStream_t stream);
// y[r] = x[r] / sqrt(mean(x[r]²) + eps) ⊙ weight, rows of dim
absl::Status LaunchRmsNorm(const float* x, int n, int dim, const void* weight, DType dtype,
                           float eps, float* y, cudaStream_t stream);
// y[r] = (x[r] − mean) / sqrt(var + eps) ⊙ weight + bias (bias may be null; same dtype)
absl::Status LaunchLayerNorm(const float* x, int n, int dim, const void* weight, const void* bias,
                             DType dtype, float eps, float* y, cudaStream_t stream);
// x += residual, then the norm of x into y, in one pass per row (y must not alias x).
absl::Status LaunchAddRmsNorm(float* x, const float* residual, int n, int dim, const void* weight,
                              DType dtype, float eps, float* y, cudaStream_t stream);
absl::Status LaunchAddLayerNorm(float* x, const float* residual, int n, int dim, const void* weight,
                                const void* bias, DType dtype, float eps, float* y,
                                cudaStream_t stream);
// In place on x[n, num_heads, head_dim] (rows row_stride apart); angles in double. Here
// rope.freq_factors, when set, is a DEVICE pointer ([head_dim / 2] floats).
absl::Status LaunchRope(float* x, int n, int64_t row_stride, int num_heads, int head_dim,
                        const int32_t* positions, const RopeSpec& rope, cudaStream_t stream);
// LaunchRope on q [n, q_heads] and k [n, k_heads] (rows q_stride, k_stride apart) in one
// launch, both at `positions`.
absl::Status LaunchRopeQK(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride,
                          int k_heads, int n, int head_dim, const int32_t* positions,
                          const RopeSpec& rope, cudaStream_t stream);
absl::Status LaunchGelu(float* x, int64_t count, cudaStream_t stream);
absl::Status LaunchSwiGlu(const float* gate, const float* up, int64_t count, float* out,
                          cudaStream_t stream);
// out = GELU(gate) ⊙ up (tanh approximation); out may be gate.
absl::Status LaunchGeGlu(const float* gate, const float* up, int64_t count, float* out,
                         cudaStream_t stream);
// x ← float(factor) · x
absl::Status LaunchScale(float* x, int64_t count, double factor, cudaStream_t stream);
// x ← cap · tanh(x / cap), in float
absl::Status LaunchSoftCap(float* x, int64_t count, double cap, cudaStream_t stream);
absl::Status LaunchAdd(float* y, const float* x, int64_t count, cudaStream_t stream);
// y[r, :] += rows[index[r], :] for r < n (dim values a row) where index[r] >= 0
absl::Status LaunchAddRows(float* y, int n, int64_t dim, const float* rows, const int32_t* index,
                           cudaStream_t stream);
// y[r, c] += bias[c] for r < n, c < cols
absl::Status LaunchAddBias(float* y, int n, int64_t cols, const void* bias, DType dtype,
                           cudaStream_t stream);
// LaunchRopeQK on q and k, and in the same launch LaunchStoreKv of the rotated k and of v
// (rows kv_stride apart, kv_heads · head_dim values each). head_dim must be even.
absl::Status LaunchRopeQKStoreKv(float* q, int64_t q_stride, int q_heads, float* k, const float* v,
                                 int64_t kv_stride, int kv_heads, int n, int head_dim,
                                 const int32_t* positions, const RopeSpec& rope,
                                 const int64_t* dst_rows, void* k_cache, void* v_cache,
                                 int64_t cache_stride, KvDtype cache_dtype, cudaStream_t stream);
// k_cache[dst_rows[r] * cache_stride + e] = k[r * src_stride + e] (and v), e < row_elems,
// rounded to nearest-even bf16 in a bf16 cache; rows with dst_rows[r] < 0 store nothing.
absl::Status LaunchStoreKv(const float* k, const float* v, int n, int64_t src_stride,
                           int64_t row_elems, const int64_t* dst_rows, void* k_cache, void* v_cache,
                           int64_t cache_stride, KvDtype cache_dtype, cudaStream_t stream);
// out[i] = round_to_nearest_even(x[i]) in `to` (kF16 or kBF16): GEMM inputs for tensor cores.
absl::Status LaunchConvertF32(const float* x, int64_t count, DType to, void* out,
                              cudaStream_t stream);
// out[i] = uniform in [−scale, scale) from a counter hash of (seed, i), stored in `dtype`
// (kF32, kF16 or kBF16). For benchmarks that need gigabytes of weights without a host copy.
absl::Status LaunchFillRandom(void* out, DType dtype, int64_t count, uint64_t seed, float scale,
                              cudaStream_t stream);

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_OPS_H_
