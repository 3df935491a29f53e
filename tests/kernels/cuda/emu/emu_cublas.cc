// kvlens CUDA emulator: cuBLAS's cublasGemmEx as a naive loop with fp32 accumulation
// (include/cublas_api.h). A, B and C must lie in device memory (emu_runtime.cc's
// allocations), as on a GPU.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/kernels/cuda/emu/include/cublas_api.h"
#include "tests/kernels/cuda/emu/include/cuda_bf16.h"
#include "tests/kernels/cuda/emu/include/cuda_fp16.h"

struct cublasContext {
  kvlens_emu::cudaStream_t stream = nullptr;
};

namespace kvlens_emu {

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t) {
  return handle == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : CUBLAS_STATUS_SUCCESS;
}

namespace {

float Load(const void* p, cudaDataType_t t, int64_t i) {
  switch (t) {
    case CUDA_R_16F:
      return __half2float(static_cast<const __half*>(p)[i]);
    case CUDA_R_16BF:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case CUDA_R_32F:
      break;
  }
  return static_cast<const float*>(p)[i];
}

size_t ElementBytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

// The bytes a column-major matrix of `rows` × `cols` with leading dimension ld spans.
size_t MatrixBytes(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld) {
  if (rows == 0 || cols == 0) return 0;
  return static_cast<size_t>((cols - 1) * ld + rows) * ElementBytes(t);
}

// Whether a column-major matrix of `rows` × `cols` with leading dimension ld lies in one
// device allocation.
bool InDevice(const void* p, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld) {
  if (rows == 0 || cols == 0) return true;
  return IsDeviceRange(p, MatrixBytes(t, rows, cols, ld));
}

cublasStatus_t BlasFail(cublasStatus_t s, const std::string& why) {
  std::fprintf(stderr, "[cuda-emu] cublasGemmEx: %s\n", why.c_str());
  return s;
}

}  // namespace

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType_t Atype, int lda, const void* B,
                            cudaDataType_t Btype, int ldb, const void* beta, void* C,
                            cudaDataType_t Ctype, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  {
    // Captured: alpha and beta are read now (host pointer mode), the matrices when the
    // graph runs.
    const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
    if (RecordIfCapturing(handle->stream, [=, stream = handle->stream] {
          cublasContext replay;  // the same call, on the stream, when it no longer captures
          replay.stream = stream;
          cublasGemmEx(&replay, transa, transb, m, n, k, &al, A, Atype, lda, B, Btype, ldb, &be, C,
                       Ctype, ldc, compute, CUBLAS_GEMM_DEFAULT);
        })) {
      return CUBLAS_STATUS_SUCCESS;
    }
  }
  if (m < 0 || n < 0 || k < 0) return BlasFail(CUBLAS_STATUS_INVALID_VALUE, "negative size");
  const int a_rows = transa == CUBLAS_OP_N ? m : k, a_cols = transa == CUBLAS_OP_N ? k : m;
  const int b_rows = transb == CUBLAS_OP_N ? k : n, b_cols = transb == CUBLAS_OP_N ? n : k;
  if (lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) || ldc < std::max(1, m)) {
    return BlasFail(CUBLAS_STATUS_INVALID_VALUE, "a leading dimension is too small");
  }
  if (Atype != Btype || Ctype != CUDA_R_32F || compute != CUBLAS_COMPUTE_32F) {
    return BlasFail(CUBLAS_STATUS_NOT_SUPPORTED, "types other than A = B, C fp32, compute fp32");
  }
  if (!InDevice(A, Atype, a_rows, a_cols, lda) || !InDevice(B, Btype, b_rows, b_cols, ldb) ||
      !InDevice(C, Ctype, m, n, ldc)) {
    return BlasFail(CUBLAS_STATUS_EXECUTION_FAILED, "A, B or C is not in device memory");
  }
  AccessDevice(handle->stream, A, MatrixBytes(Atype, a_rows, a_cols, lda), false,
               "cublasGemmEx's A");
  AccessDevice(handle->stream, B, MatrixBytes(Btype, b_rows, b_cols, ldb), false,
               "cublasGemmEx's B");
  AccessDevice(handle->stream, C, MatrixBytes(Ctype, m, n, ldc), true, "cublasGemmEx's C");
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  float* c = static_cast<float*>(C);
  std::vector<float> b_col(static_cast<size_t>(k));
  for (int j = 0; j < n; ++j) {
    for (int l = 0; l < k; ++l) {
      b_col[static_cast<size_t>(l)] =
          Load(B, Btype,
               transb == CUBLAS_OP_N ? l + static_cast<int64_t>(j) * ldb
                                     : j + static_cast<int64_t>(l) * ldb);
    }
    for (int i = 0; i < m; ++i) {
      float acc = 0.0f;
      for (int l = 0; l < k; ++l) {
        const float a = Load(A, Atype,
                             transa == CUBLAS_OP_N ? i + static_cast<int64_t>(l) * lda
                                                   : l + static_cast<int64_t>(i) * lda);
        acc += a * b_col[static_cast<size_t>(l)];
      }
      float& out = c[i + static_cast<int64_t>(j) * ldc];
      out = be == 0.0f ? al * acc : al * acc + be * out;  // beta 0: C is not read (may be NaN)
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace kvlens_emu
