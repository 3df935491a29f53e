// Kernel launches that may overlap the previous kernel on their stream (programmatic
// dependent launch, sm_90; the switch is in launch.h). The contract, for every kernel
// launched by LaunchKernel: its first statement is WaitForPriorGrids(), so nothing it does
// to global memory happens before the previous grid has completed and its writes are
// visible. Two exceptions, both harmless whatever the previous grid does: PrefetchL2 (of
// any memory), and reads of index arrays that copies write and never a kernel (block
// tables, key ends: CudaBackend::UploadIndices), since a copy is never launched
// programmatically, so the one before this launch has completed (split-KV reads them to
// find what to prefetch). What overlaps is the launch itself, and those prefetches: the
// next grid's blocks are scheduled while this one runs, rather than after it drains. The
// CUDA emulator fails a LaunchKernel launch in which a thread exits without the wait.
#ifndef KVLENS_KERNELS_CUDA_LAUNCH_CUH_
#define KVLENS_KERNELS_CUDA_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda/launch.h"

namespace kvlens::kernels::cuda {

// griddepcontrol.wait: returns once every grid this one depends on has completed and its
// memory is visible (at once when launched without the attribute). Then
// griddepcontrol.launch_dependents: the next kernel may be scheduled from now on (it, in
// turn, waits before touching memory).
__device__ __forceinline__ void WaitForPriorGrids() {
#if defined(KVLENS_CUDA_EMULATOR)
  ::kvlens_emu::GridDependencyWait();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// prefetch.global.L2: asks for the 128-byte line holding `global` to be brought into the
// L2 cache, and returns at once. A kernel may prefetch before its WaitForPriorGrids(),
// even memory the previous grid is writing: it changes no value read, since L2 is where
// every SM's view of memory meets (a line prefetched before a store is updated by it), and
// it lets a programmatically launched kernel's blocks, scheduled while the previous grid
// drains, have DRAM bring in their first bytes meanwhile (the matvec's weights, split-KV's
// first K and V rows). The CUDA emulator faults a prefetch outside
// device memory (a GPU drops it silently), so that a wrong address shows in the tests.
__device__ __forceinline__ void PrefetchL2(const void* global) {
#if defined(KVLENS_CUDA_EMULATOR)
  ::kvlens_emu::PrefetchL2(global);
#else
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(global));
#endif
}

#ifndef KVLENS_CUDA_EMULATOR
// Whether kernel's code was generated for sm_90 or later, so that its WaitForPriorGrids()
// is a real griddepcontrol.wait. A binary built for an older architecture and JIT-compiled
// from its PTX on the device has an empty wait, and must not be launched programmatically.
inline bool KernelWaitsForPriorGrids(const void* kernel) {
  cudaFuncAttributes a = {};
  const bool waits = cudaFuncGetAttributes(&a, kernel) == cudaSuccess && a.ptxVersion >= 90;
  if (!waits) cudaGetLastError();  // a failed query is not a launch's error
  return waits;
}
#endif

// kernel<<<grid, block, shared_bytes, stream>>>(args...), with the programmatic
// stream-serialization attribute when ProgrammaticLaunches() (and the kernel's code has the
// wait: KernelWaitsForPriorGrids). Errors as a <<<>>> launch's: in cudaGetLastError()
// (KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED).
template <typename... P, typename... A>
void LaunchKernel(const char* name, void (*kernel)(P...), dim3 grid, dim3 block,
                  size_t shared_bytes, cudaStream_t stream, A&&... args) {
#ifdef KVLENS_CUDA_EMULATOR
  ::kvlens_emu::Launch(kernel, name, grid, block, shared_bytes, stream,
                       /*requires_grid_wait=*/true)(std::forward<A>(args)...);
#else
  (void)name;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attr;
  if (ProgrammaticLaunches()) {
    // Asked once per kernel signature, not per launch: every kernel of the binary was
    // compiled for the same architectures, so one of them answers for all.
    static const bool waits = KernelWaitsForPriorGrids(reinterpret_cast<const void*>(kernel));
    config.numAttrs = waits ? 1 : 0;
  }
  cudaLaunchKernelEx(&config, kernel, std::forward<A>(args)...);
#endif
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_LAUNCH_CUH_
