// The fast fp32 CPU path used for serving: a persistent thread pool, weight rows
// dequantised on the fly, SIMD inner loops (AVX-512 or AVX2/FMA when compiled for them,
// portable loops otherwise). Checked op by op against ReferenceBackend.
#ifndef KVLENS_KERNELS_CPU_CPU_BACKEND_H_
#define KVLENS_KERNELS_CPU_CPU_BACKEND_H_

#include <functional>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/backward_ops.h"
#include "kernels/cpu/thread_pool.h"

namespace kvlens::kernels {

class CpuBackend final : public Backend<float>, public BackwardOps<float> {
 public:
  // num_threads counts the calling thread; 0 means std::thread::hardware_concurrency().
  explicit CpuBackend(int num_threads = 0);

  std::string_view name() const override { return "cpu-f32"; }
  int num_threads() const { return pool_->num_threads(); }
  // "avx512", "avx2" or "scalar": the inner loops this build was compiled with.
  static std::string_view SimdName();

  // Opt-in: products with block-quantised weights (q8_0, q4_K, …) round their activations
  // to 8 bits per block of 32, as llama.cpp does, and multiply in integers (q8_products.h):
  // faster, no longer exact. Other weights, the backward and the other ops are unchanged.
  void SetInt8Activations(bool on) { int8_activations_ = on; }
  bool int8_activations() const { return int8_activations_; }

  void MatMul(const float* x, int n, const WeightView& w, const WeightView& bias,
              float* y) override;
  void Embedding(const WeightView& table, const int32_t* ids, int n, float* out) override;
  void RmsNorm(const float* x, int n, int dim, const WeightView& weight, double eps,
               float* y) override;
  void LayerNorm(const float* x, int n, int dim, const WeightView& weight, const WeightView& bias,
                 double eps, float* y) override;
  void Rope(float* x, int n, int64_t row_stride, int num_heads, int head_dim,
            const int32_t* positions, const RopeSpec& rope) override;
  void Gelu(float* x, int64_t count) override;
  void SwiGlu(const float* gate, const float* up, int64_t count, float* out) override;
  void GeGlu(const float* gate, const float* up, int64_t count, float* out) override;
  void Scale(float* x, int64_t count, double factor) override;
  void SoftCap(float* x, int64_t count, double cap) override;
  void Add(float* y, const float* x, int64_t count) override;
  void StoreKv(const float* k, const float* v, int n, int64_t src_stride, int64_t row_elems,
               const int64_t* dst_rows, void* k_cache, void* v_cache, int64_t cache_stride,
               KvDtype cache_dtype) override;
  absl::Status Attention(const AttentionArgs<float>& args) override;
  absl::Status AttentionBatch(absl::Span<const AttentionArgs<float>> calls, int* failed) override;

  // The interpretability backward's heavy ops (cpu_backward.cc): fp32 on the pool,
  // accumulated in float; the reference loops (double, one thread) are their oracle.
  absl::Status MatMulBackwardInput(const float* dy, int n, const WeightView& w, float* dx) override;
  absl::Status AttentionBackward(const AttentionBackwardArgs<float>& args) override;

 private:
  // Splits [0, count) into chunks of at least min_chunk and runs fn(begin, end) on the pool.
  template <typename Fn>
  void ParallelRange(int64_t count, int64_t min_chunk, Fn&& fn);

  // MatMul's path for many rows (cpu_backend.cc, OuterTile).
  void MatMulPacked(const float* x, int n, const WeightView& w, const WeightView& bias, float* y);
  void MatMulPackedChunk(const float* x, int n, const WeightView& w, const WeightView& bias,
                         float* y);
  // MatMul's int8-activation path (SetInt8Activations; block-quantised weights only):
  // the 32-element types' scheme (q8_products.h), the 256-element types' (q8k_products.h),
  // driven alike (Scheme: Q8BScheme or Q8KScheme), with their 16-rows-a-vector path.
  void MatMulQ8(const float* x, int n, const WeightView& w, const std::vector<float>& bias,
                float* y);
  template <typename Scheme>
  void MatMulInt8(const float* x, int n, const WeightView& w, const std::vector<float>& bias,
                  float* y);
  template <typename Scheme>
  void MatMulTiled(const void* rows, int n, const WeightView& w, const std::vector<float>& bias,
                   float* y);

  // Attention's two paths (cpu_attention.cc): decode over a long context split over the
  // keys, and the tiled path, planned as independent tasks so that AttentionBatch can run
  // several calls' tasks in one ParallelFor; a split call's finish (after all its tasks)
  // merges its spans.
  struct AttentionPlan {
    int64_t count = 0;
    bool inline_run = false;  // tiny: Attention runs it on the calling thread
    std::function<void(int64_t)> run;
    std::function<void()> finish;  // empty on the tiled path
  };
  static bool TakesSplitKeys(const AttentionArgs<float>& a);
  static AttentionPlan PlanSplitKeys(const AttentionArgs<float>& a);
  // min_tasks: the fewest tasks a narrow call (fewer than kLanes pairs a KV head) is split
  // into, where it can be (the pool's threads for a call on its own).
  AttentionPlan PlanTiled(const AttentionArgs<float>& a, int min_tasks);
  // The plan for a checked call: split keys or tiled.
  AttentionPlan Plan(const AttentionArgs<float>& a, int min_tasks);

  std::unique_ptr<ThreadPool> pool_;
  bool int8_activations_ = false;
};

// Used by cpu_backend.cc and cpu_int8.cc.
template <typename Fn>
inline void CpuBackend::ParallelRange(int64_t count, int64_t min_chunk, Fn&& fn) {
  if (count <= 0) return;
  const int64_t max_tasks = 4 * static_cast<int64_t>(pool_->num_threads());
  const int64_t chunk = std::max(min_chunk, (count + max_tasks - 1) / max_tasks);
  const int64_t tasks = (count + chunk - 1) / chunk;
  pool_->ParallelFor(tasks, [&](int64_t t) {
    const int64_t begin = t * chunk;
    fn(begin, std::min(count, begin + chunk));
  });
}

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_CPU_BACKEND_H_
