// CUDA runtime and cuBLAS results as absl::Status: every CUDA call in kernels/cuda goes
// through one of these, so a failure names the call, the file and the line.
#ifndef KVLENS_KERNELS_CUDA_CUDA_STATUS_H_
#define KVLENS_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvlens::kernels::cuda {

// Out-of-memory is RESOURCE_EXHAUSTED (the scheduler may react to it); "no device" or "no
// driver" is FAILED_PRECONDITION; anything else is INTERNAL.
inline absl::Status CudaStatus(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, " failed: ", cudaGetErrorName(e), " (",
                                       cudaGetErrorString(e), ") at ", file, ":", line);
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

inline absl::Status CublasStatus(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string msg =
      absl::StrCat(what, " failed: cuBLAS status ", static_cast<int>(s), " at ", file, ":", line);
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

}  // namespace kvlens::kernels::cuda

// KVLENS_CUDA_STATUS(cudaMalloc(&p, n)): the call's absl::Status, naming it.
#define KVLENS_CUDA_STATUS(expr) \
  ::kvlens::kernels::cuda::CudaStatus((expr), #expr, __FILE__, __LINE__)

// KVLENS_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, n)); returns the Status from the caller.
#define KVLENS_CUDA_RETURN_IF_ERROR(expr)                                           \
  do {                                                                              \
    if (absl::Status _kvlens_s =                                                    \
            ::kvlens::kernels::cuda::CudaStatus((expr), #expr, __FILE__, __LINE__); \
        !_kvlens_s.ok())                                                            \
      return _kvlens_s;                                                             \
  } while (0)

#define KVLENS_CUBLAS_RETURN_IF_ERROR(expr)                                           \
  do {                                                                                \
    if (absl::Status _kvlens_s =                                                      \
            ::kvlens::kernels::cuda::CublasStatus((expr), #expr, __FILE__, __LINE__); \
        !_kvlens_s.ok())                                                              \
      return _kvlens_s;                                                               \
  } while (0)

// After a kernel launch (name is a string literal): a bad launch configuration shows up in
// cudaGetLastError().
#define KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED(name)                       \
  do {                                                                  \
    if (absl::Status _kvlens_s = ::kvlens::kernels::cuda::CudaStatus(   \
            cudaGetLastError(), "launch of " name, __FILE__, __LINE__); \
        !_kvlens_s.ok())                                                \
      return _kvlens_s;                                                 \
  } while (0)

#endif  // KVLENS_KERNELS_CUDA_CUDA_STATUS_H_
