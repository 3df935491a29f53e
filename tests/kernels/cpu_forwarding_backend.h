// A Backend<float> whose every op runs on a CpuBackend it owns. Tests derive from it to
// watch or alter a few ops (FakeDeviceBackend's memory, the int8 golden test's product
// checks) and forward the rest unchanged.
#ifndef KVLENS_TESTS_KERNELS_CPU_FORWARDING_BACKEND_H_
#define KVLENS_TESTS_KERNELS_CPU_FORWARDING_BACKEND_H_

#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace kvlens::testing {

class CpuForwardingBackend : public kernels::Backend<float> {
 public:
  explicit CpuForwardingBackend(int threads) : cpu_(threads) {}
  kernels::CpuBackend& cpu() { return cpu_; }

  void MatMul(const float* x, int n, const kernels::WeightView& w, const kernels::WeightView& b,
              float* y) override {
    cpu_.MatMul(x, n, w, b, y);
  }
  void Embedding(const kernels::WeightView& t, const int32_t* ids, int n, float* out) override {
    cpu_.Embedding(t, ids, n, out);
  }
  void RmsNorm(const float* x, int n, int dim, const kernels::WeightView& w, double eps,
               float* y) override {
    cpu_.RmsNorm(x, n, dim, w, eps, y);
  }
  void LayerNorm(const float* x, int n, int dim, const kernels::WeightView& w,
                 const kernels::WeightView& b, double eps, float* y) override {
    cpu_.LayerNorm(x, n, dim, w, b, eps, y);
  }
  void Rope(float* x, int n, int64_t row_stride, int num_heads, int head_dim,
            const int32_t* positions, const kernels::RopeSpec& rope) override {
    cpu_.Rope(x, n, row_stride, num_heads, head_dim, positions, rope);
  }
  void Gelu(float* x, int64_t count) override { cpu_.Gelu(x, count); }
  void SwiGlu(const float* g, const float* u, int64_t count, float* out) override {
    cpu_.SwiGlu(g, u, count, out);
  }
  void GeGlu(const float* g, const float* u, int64_t count, float* out) override {
    cpu_.GeGlu(g, u, count, out);
  }
  void Scale(float* x, int64_t count, double factor) override { cpu_.Scale(x, count, factor); }
  void SoftCap(float* x, int64_t count, double cap) override { cpu_.SoftCap(x, count, cap); }
  void Add(float* y, const float* x, int64_t count) override { cpu_.Add(y, x, count); }
  void StoreKv(const float* k, const float* v, int n, int64_t src_stride, int64_t row_elems,
               const int64_t* dst_rows, void* k_cache, void* v_cache, int64_t cache_stride,
               kernels::KvDtype cache_dtype) override {
    cpu_.StoreKv(k, v, n, src_stride, row_elems, dst_rows, k_cache, v_cache, cache_stride,
                 cache_dtype);
  }
  absl::Status Attention(const kernels::AttentionArgs<float>& a) override {
    return cpu_.Attention(a);
  }

 protected:
  kernels::CpuBackend cpu_;
};

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_KERNELS_CPU_FORWARDING_BACKEND_H_
