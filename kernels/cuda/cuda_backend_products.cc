// CudaBackend's matrix products: the small-batch matvec launches (its fused norms, gates,
// residual adds, rope and cache rows), cuBLAS GEMMs past kMatVecMaxRows, and the products'
// input gradient. The rest of the backend is cuda_backend.cc.
#include <cublas_v2.h>

#include <cstdint>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/ops.h"

namespace kvlens::kernels::cuda {
namespace {

// y = op_w(W) · x (+ beta · y) by cublasGemmEx on the handle's stream (the backend's).
absl::Status CublasGemm(cublasContext* handle, cublasOperation_t op_w, int m, int n, int k,
                        const void* w, cudaDataType_t type, int ldw, const void* x, int ldx,
                        float beta, float* y, int ldy, cudaStream_t) {
  const float alpha = 1.0f;
  return CublasStatus(
      cublasGemmEx(handle, op_w, CUBLAS_OP_N, m, n, k, &alpha, w, type, ldw, x, type, ldx, &beta, y,
                   CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx", __FILE__, __LINE__);
}

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

}  // namespace

absl::StatusOr<const void*> CudaBackend::GemmOperand(const float* x, int64_t count, DType dtype) {
  if (dtype == DType::kF32) return x;
  if (absl::Status s = ReserveScratch(gemm_input_, static_cast<size_t>(count) * 2); !s.ok()) {
    return s;
  }
  if (absl::Status s = Launch(&LaunchConvertF32, x, count, dtype, gemm_input_.get()); !s.ok()) {
    return s;
  }
  return gemm_input_.get();
}

// y[n, out] = x[n, in] · Wᵀ. Row-major y is column-major yᵀ [out, n], so cuBLAS computes
// yᵀ = W · xᵀ with W (column-major [in, out], ld in) transposed and xᵀ (column-major
// [in, n], ld in) as is.
absl::Status CudaBackend::MatMulImpl(const float* x, int n, const WeightView& w,
                                     const WeightView& bias, float* y, bool gelu, bool accumulate) {
  if (n <= 0) return absl::OkStatus();
  absl::StatusOr<const DeviceWeight*> dw = Upload(w);
  if (!dw.ok()) return dw.status();
  const DeviceWeight& W = **dw;
  const DeviceWeight* B = nullptr;
  if (!bias.empty()) {
    absl::StatusOr<const DeviceWeight*> db = Upload(bias);
    if (!db.ok()) return db.status();
    B = *db;
  }
  if (MatVecTakes(n, W.dtype)) {
    const MatVecProduct product{W.buffer.get(),
                                W.rows,
                                B != nullptr ? B->buffer.get() : nullptr,
                                B != nullptr ? B->dtype : DType::kF32,
                                y,
                                gelu,
                                accumulate};
    return Launch(&LaunchMatVec, x, n, W.cols, MatVecNorm{},
                  absl::Span<const MatVecProduct>(&product, 1), W.dtype);
  }
  absl::StatusOr<const void*> b = GemmOperand(x, static_cast<int64_t>(n) * W.cols, W.dtype);
  if (!b.ok()) return b.status();
  if (absl::Status s = Gemm(*b, n, W, B, y, accumulate); !s.ok() || !gelu) return s;
  return Launch(&LaunchGelu, y, static_cast<int64_t>(n) * W.rows);
}

absl::Status CudaBackend::Gemm(const void* operand, int n, const DeviceWeight& W,
                               const DeviceWeight* B, float* y, bool accumulate) {
  const int m = static_cast<int>(W.rows), k = static_cast<int>(W.cols);
  if (absl::Status s = Launch(&CublasGemm, cublas_, CUBLAS_OP_T, m, n, k,
                              static_cast<const void*>(W.buffer.get()), CudaType(W.dtype), k,
                              operand, k, accumulate ? 1.0f : 0.0f, y, m);
      !s.ok()) {
    return s;
  }
  if (B != nullptr) {
    return Launch(&LaunchAddBias, y, n, static_cast<int64_t>(m),
                  static_cast<const void*>(B->buffer.get()), B->dtype);
  }
  return absl::OkStatus();
}

// dx[n, in] += dy[n, out] · W. Row-major dx is column-major dxᵀ [in, n] = Wᵀ · dyᵀ, and
// row-major W [out, in] read column-major is already Wᵀ [in, out] (ld in).
absl::Status CudaBackend::MatMulBackwardInput(const float* dy, int n, const WeightView& w,
                                              float* dx) {
  if (!status_.ok()) return status_;
  if (n <= 0) return absl::OkStatus();
  absl::StatusOr<const DeviceWeight*> dw = Upload(w);
  if (!dw.ok()) return dw.status();
  const DeviceWeight& W = **dw;
  const int out = static_cast<int>(W.rows), in = static_cast<int>(W.cols);
  absl::StatusOr<const void*> b = GemmOperand(dy, static_cast<int64_t>(n) * out, W.dtype);
  if (!b.ok()) {
    Ok(b.status());
    return b.status();
  }
  const absl::Status s = Launch(&CublasGemm, cublas_, CUBLAS_OP_N, in, n, out,
                                static_cast<const void*>(W.buffer.get()), CudaType(W.dtype), in, *b,
                                out, 1.0f, dx, in);
  Ok(s);
  return s;
}

void CudaBackend::MatMul(const float* x, int n, const WeightView& w, const WeightView& bias,
                         float* y) {
  if (!status_.ok()) return;
  Ok(MatMulImpl(x, n, w, bias, y));
}

void CudaBackend::MatMulGelu(const float* x, int n, const WeightView& w, const WeightView& bias,
                             float* y) {
  if (!status_.ok()) return;
  Ok(MatMulImpl(x, n, w, bias, y, /*gelu=*/true));
}

void CudaBackend::MatMulAddTo(const float* x, int n, const WeightView& w, const WeightView& bias,
                              float* /*scratch*/, float* y) {
  if (!status_.ok()) return;
  Ok(MatMulImpl(x, n, w, bias, y, /*gelu=*/false, /*accumulate=*/true));
}

absl::StatusOr<MatVecNorm> CudaBackend::MatVecNormFor(const PreNorm* norm, int n, int64_t in,
                                                      bool matvec, const float** x) {
  if (norm == nullptr) return MatVecNorm{};
  absl::StatusOr<const DeviceWeight*> dw = Upload(norm->weight);
  if (!dw.ok()) return dw.status();
  if (matvec && norm->dim == in && MatVecNormFits(n, in)) {
    return MatVecNorm{(*dw)->buffer.get(), (*dw)->dtype, static_cast<float>(norm->eps)};
  }
  RmsNorm(*x, n, norm->dim, norm->weight, norm->eps, norm->xn);
  *x = norm->xn;
  return MatVecNorm{};
}

void CudaBackend::MatMulMany(const float* x, int n, absl::Span<const MatMulOutput<float>> outputs) {
  MatMulManyImpl(x, n, outputs, nullptr);
}

void CudaBackend::RmsNormMatMulMany(const float* x, int n, int dim, const WeightView& norm,
                                    double eps, float* xn,
                                    absl::Span<const MatMulOutput<float>> outputs) {
  const PreNorm pre{dim, norm, eps, xn};
  MatMulManyImpl(x, n, outputs, &pre);
}

void CudaBackend::RmsNormQkvRopeStoreKv(const float* x, int n, int dim, const WeightView& norm,
                                        double eps, float* xn,
                                        absl::Span<const MatMulOutput<float>> qkv,
                                        const QkvRopeStore& kv) {
  const PreNorm pre{dim, norm, eps, xn};
  MatMulManyImpl(x, n, qkv, &pre, &kv);
}

void CudaBackend::MatMulQkvRopeStoreKv(const float* x, int n,
                                       absl::Span<const MatMulOutput<float>> qkv,
                                       const QkvRopeStore& kv) {
  MatMulManyImpl(x, n, qkv, nullptr, &kv);
}

void CudaBackend::MatMulManyImpl(const float* x, int n,
                                 absl::Span<const MatMulOutput<float>> outputs, const PreNorm* norm,
                                 const QkvRopeStore* kv) {
  if (!status_.ok() || n <= 0 || outputs.empty()) return;
  // With kv: the products, then their rope and cache rows (below, or in the matvec).
  auto rope_store = [&] {
    if (kv != nullptr) RopeQKStoreKvOf(outputs, n, *kv);
  };
  // Inline for up to kMatVecMaxSegments outputs (a layer's q, k and v): no heap allocation
  // in a call a recorded step makes 32 times.
  absl::InlinedVector<const DeviceWeight*, kMatVecMaxSegments> ws, bs;
  bool shared = true;  // one dtype and input width: one matvec launch, or one GEMM operand
  for (const MatMulOutput<float>& o : outputs) {
    absl::StatusOr<const DeviceWeight*> w = Upload(o.w);
    if (!Ok(w.status())) return;
    const DeviceWeight* b = nullptr;
    if (!o.bias.empty()) {
      absl::StatusOr<const DeviceWeight*> db = Upload(o.bias);
      if (!Ok(db.status())) return;
      b = *db;
    }
    shared = shared &&
             (ws.empty() || ((*w)->dtype == ws.front()->dtype && (*w)->cols == ws.front()->cols));
    ws.push_back(*w);
    bs.push_back(b);
  }
  const DType dtype = ws.front()->dtype;
  const bool matvec =
      shared && MatVecTakes(n, dtype) && outputs.size() <= size_t{kMatVecMaxSegments};
  absl::StatusOr<MatVecNorm> fused = MatVecNormFor(norm, n, ws.front()->cols, matvec, &x);
  if (!Ok(fused.status())) return;
  if (!shared) {
    Backend<float>::MatMulMany(x, n, outputs);
    rope_store();
    return;
  }
  if (matvec) {
    absl::InlinedVector<MatVecProduct, kMatVecMaxSegments> products;
    for (size_t i = 0; i < outputs.size(); ++i) {
      products.push_back({ws[i]->buffer.get(), ws[i]->rows,
                          bs[i] != nullptr ? bs[i]->buffer.get() : nullptr,
                          bs[i] != nullptr ? bs[i]->dtype : DType::kF32, outputs[i].y});
    }
    const int64_t kv_rows = kv != nullptr ? int64_t{kv->kv_heads} * kv->head_dim : 0;
    const bool fuse_rope = kv != nullptr && outputs.size() == 3 && MatVecRopeTakes(kv->head_dim) &&
                           ws.front()->cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                           ws[0]->rows == int64_t{kv->q_heads} * kv->head_dim &&
                           ws[1]->rows == kv_rows && ws[2]->rows == kv_rows;
    if (!fuse_rope) {
      Ok(Launch(&LaunchMatVec, x, n, ws.front()->cols, *fused,
                absl::Span<const MatVecProduct>(products), dtype));
      rope_store();
      return;
    }
    absl::StatusOr<RopeSpec> d_rope = DeviceRope(*kv->rope, kv->head_dim);
    if (!Ok(d_rope.status())) return;
    const void* d[2] = {nullptr, nullptr};  // one upload, as RopeQKStoreKv's
    if (!Ok(UploadPacked(
            rope_store_pack_,
            {{kv->positions, sizeof(int32_t) * n}, {kv->dst_rows, sizeof(int64_t) * n}}, d))) {
      return;
    }
    const MatVecRopeStore rs{static_cast<const int32_t*>(d[0]),
                             *d_rope,
                             kv->head_dim,
                             static_cast<const int64_t*>(d[1]),
                             kv->k_cache,
                             kv->v_cache,
                             kv->cache_stride,
                             kv->cache_dtype == KvDtype::kBF16};
    Ok(Launch(&LaunchMatVecRopeStore, x, n, ws.front()->cols, *fused,
              absl::Span<const MatVecProduct>(products), rs, dtype));
    return;
  }
  // GEMMs: x rounded to the weights' dtype once for all of them.
  absl::StatusOr<const void*> operand =
      GemmOperand(x, static_cast<int64_t>(n) * ws.front()->cols, dtype);
  if (!Ok(operand.status())) return;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!Ok(Gemm(*operand, n, *ws[i], bs[i], outputs[i].y))) return;
  }
  rope_store();
}

void CudaBackend::MatMulSwiGlu(const float* x, int n, const WeightView& w_gate,
                               const WeightView& w_up, float* up_scratch, float* out) {
  MatMulGated(x, n, w_gate, w_up, GateActivation::kSilu, up_scratch, out);
}

void CudaBackend::MatMulGeGlu(const float* x, int n, const WeightView& w_gate,
                              const WeightView& w_up, float* up_scratch, float* out) {
  MatMulGated(x, n, w_gate, w_up, GateActivation::kGeluTanh, up_scratch, out);
}

void CudaBackend::RmsNormMatMulSwiGlu(const float* x, int n, int dim, const WeightView& norm,
                                      double eps, float* xn, const WeightView& w_gate,
                                      const WeightView& w_up, float* up_scratch, float* out) {
  const PreNorm pre{dim, norm, eps, xn};
  MatMulGated(x, n, w_gate, w_up, GateActivation::kSilu, up_scratch, out, &pre);
}

void CudaBackend::RmsNormMatMulGeGlu(const float* x, int n, int dim, const WeightView& norm,
                                     double eps, float* xn, const WeightView& w_gate,
                                     const WeightView& w_up, float* up_scratch, float* out) {
  const PreNorm pre{dim, norm, eps, xn};
  MatMulGated(x, n, w_gate, w_up, GateActivation::kGeluTanh, up_scratch, out, &pre);
}

void CudaBackend::MatMulGated(const float* x, int n, const WeightView& w_gate,
                              const WeightView& w_up, GateActivation gate, float* up_scratch,
                              float* out, const PreNorm* norm) {
  if (!status_.ok() || n <= 0) return;
  absl::StatusOr<const DeviceWeight*> g = Upload(w_gate);
  if (!Ok(g.status())) return;
  absl::StatusOr<const DeviceWeight*> u = Upload(w_up);
  if (!Ok(u.status())) return;
  const DeviceWeight &G = **g, &U = **u;
  const bool alike = U.dtype == G.dtype && U.rows == G.rows && U.cols == G.cols;
  const bool matvec = alike && MatVecTakes(n, G.dtype);
  absl::StatusOr<MatVecNorm> fused = MatVecNormFor(norm, n, G.cols, matvec, &x);
  if (!Ok(fused.status())) return;
  if (!alike) {
    if (gate == GateActivation::kSilu) {
      Backend<float>::MatMulSwiGlu(x, n, w_gate, w_up, up_scratch, out);
    } else {
      Backend<float>::MatMulGeGlu(x, n, w_gate, w_up, up_scratch, out);
    }
    return;
  }
  if (matvec) {
    Ok(Launch(&LaunchMatVecGated, x, n, G.cols, *fused, static_cast<const void*>(G.buffer.get()),
              static_cast<const void*>(U.buffer.get()), G.dtype, G.rows, gate, out));
    return;
  }
  // Two GEMMs on one rounding of x, then the gate.
  absl::StatusOr<const void*> operand = GemmOperand(x, static_cast<int64_t>(n) * G.cols, G.dtype);
  if (!Ok(operand.status()) || !Ok(Gemm(*operand, n, G, nullptr, out)) ||
      !Ok(Gemm(*operand, n, U, nullptr, up_scratch))) {
    return;
  }
  if (gate == GateActivation::kSilu) {
    SwiGlu(out, up_scratch, int64_t{n} * G.rows, out);
  } else {
    GeGlu(out, up_scratch, int64_t{n} * G.rows, out);
  }
}

}  // namespace kvlens::kernels::cuda
