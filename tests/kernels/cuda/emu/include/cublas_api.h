// kvlens CUDA emulator: the cuBLAS subset kvlens uses (cublasGemmEx in fp32, f16 and bf16
// with fp32 accumulation), computed naively on the CPU by emu_runtime.cc.
#ifndef KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUBLAS_API_H_
#define KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUBLAS_API_H_

#include <cuda_runtime_api.h>

struct cublasContext;  // global, as in cuBLAS (kernels/cuda/cuda_backend.h declares it)

namespace kvlens_emu {

using cublasHandle_t = ::cublasContext*;

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};

enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };
enum cublasMath_t { CUBLAS_DEFAULT_MATH = 0, CUBLAS_TF32_TENSOR_OP_MATH = 3 };

cublasStatus_t cublasCreate(cublasHandle_t* handle);
cublasStatus_t cublasDestroy(cublasHandle_t handle);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
// C[m, n] = alpha · op(A) · op(B) + beta · C, column-major, as cuBLAS.
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType_t Atype, int lda, const void* B,
                            cudaDataType_t Btype, int ldb, const void* beta, void* C,
                            cudaDataType_t Ctype, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo);

}  // namespace kvlens_emu

#endif  // KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUBLAS_API_H_
