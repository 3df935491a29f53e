// The oracle: every op as naive double loops written straight from its equation. Never
// optimised, single-threaded; every other backend is tested against it.
#ifndef KVLENS_KERNELS_CPU_REFERENCE_BACKEND_H_
#define KVLENS_KERNELS_CPU_REFERENCE_BACKEND_H_

#include "kernels/backend.h"

namespace kvlens::kernels {

class ReferenceBackend final : public Backend<double> {
 public:
  std::string_view name() const override { return "cpu-reference-f64"; }

  void MatMul(const double* x, int n, const WeightView& w, const WeightView& bias,
              double* y) override;
  void Embedding(const WeightView& table, const int32_t* ids, int n, double* out) override;
  void RmsNorm(const double* x, int n, int dim, const WeightView& weight, double eps,
               double* y) override;
  void LayerNorm(const double* x, int n, int dim, const WeightView& weight, const WeightView& bias,
                 double eps, double* y) override;
  void Rope(double* x, int n, int64_t row_stride, int num_heads, int head_dim,
            const int32_t* positions, const RopeSpec& rope) override;
  void Gelu(double* x, int64_t count) override;
  void SwiGlu(const double* gate, const double* up, int64_t count, double* out) override;
  void GeGlu(const double* gate, const double* up, int64_t count, double* out) override;
  void Scale(double* x, int64_t count, double factor) override;
  void SoftCap(double* x, int64_t count, double cap) override;
  void Add(double* y, const double* x, int64_t count) override;
  void StoreKv(const double* k, const double* v, int n, int64_t src_stride, int64_t row_elems,
               const int64_t* dst_rows, void* k_cache, void* v_cache, int64_t cache_stride,
               KvDtype cache_dtype) override;
  absl::Status Attention(const AttentionArgs<double>& args) override;
};

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_REFERENCE_BACKEND_H_
