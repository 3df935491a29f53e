// Shared-memory staging for tensor-core kernels (sm_80 and later), through PTX:
//   cp.async   a 16-byte copy from global to shared memory that does not pass through
//              registers; the thread groups its copies (CpAsyncCommit) and waits until
//              all but its newest N groups have landed (CpAsyncWait<N>). What another
//              thread copied is visible after the wait and a __syncthreads.
//   ldmatrix   (x4) a warp loads four 8×8 matrices of 16-bit elements from shared
//              memory straight into mma.sync fragments (mma_sync.cuh): lane L gives the
//              address of row L % 8 of matrix L / 8 (16 bytes, 16-byte aligned), and with
//              g = lane / 4, t = lane % 4 receives in r[i]
//                plain:  M_i[g][2t], M_i[g][2t+1]          (an A or B fragment's word
//                .trans: M_i[2t][g], M_i[2t+1][g]           along a stored row / column)
//              (first element in the low half).
// The CUDA emulator implements both (tests/kernels/cuda/emu/emu_device.h): its cp.async
// copies only at the wait, so a read before the wait sees the old contents, as a GPU may.
#ifndef KVLENS_KERNELS_CUDA_ASYNC_COPY_CUH_
#define KVLENS_KERNELS_CUDA_ASYNC_COPY_CUH_

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "cp.async and ldmatrix need sm_80 or newer: set CMAKE_CUDA_ARCHITECTURES to 80 or above"
#endif

namespace kvlens::kernels::cuda {

// Copies src_bytes (0 or 16) of src to dst and zero-fills the rest of 16 bytes (src_bytes
// 0: dst becomes zeros and src is not read). Both 16-byte aligned.
__device__ __forceinline__ void CpAsync16(void* dst_shared, const void* src_global, int src_bytes) {
#ifdef KVLENS_CUDA_EMULATOR
  ::kvlens_emu::CpAsync16(dst_shared, src_global, src_bytes);
#else
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst_shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src_global),
               "r"(src_bytes));
#endif
}

__device__ __forceinline__ void CpAsyncCommit() {
#ifdef KVLENS_CUDA_EMULATOR
  ::kvlens_emu::CpAsyncCommit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
#ifdef KVLENS_CUDA_EMULATOR
  ::kvlens_emu::CpAsyncWait(kPending);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: see the top of the file.
template <bool kTrans>
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* row_shared) {
#ifdef KVLENS_CUDA_EMULATOR
  ::kvlens_emu::LdMatrixX4(r, row_shared, kTrans);
#else
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row_shared));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
#endif
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_ASYNC_COPY_CUH_
