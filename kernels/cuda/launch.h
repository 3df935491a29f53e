// Programmatic dependent launch (sm_90): the process-wide switch for kernels/cuda's kernel
// launches (launch.cuh). Off by default until a GPU run has measured it.
#ifndef KVLENS_KERNELS_CUDA_LAUNCH_H_
#define KVLENS_KERNELS_CUDA_LAUNCH_H_

namespace kvlens::kernels::cuda {

// When on, each kernel launched by LaunchKernel may start (be scheduled, run up to its
// griddepcontrol.wait) while the kernel before it on the stream is still running, which
// hides the launch latency between the many small kernels of a decode step. Every such
// kernel waits for the previous grid to complete, and its writes to be visible, before it
// reads or writes global memory, so results do not change. Affects launches made after
// the call, on every backend of the process; a step graph keeps the mode it was captured
// with (CudaBackend::SetProgrammaticLaunches also drops its graphs).
void SetProgrammaticLaunches(bool on);
bool ProgrammaticLaunches();

// Whether kernels launched programmatically prefetch what they read first before they wait
// (the matvec's first weight rows, split-KV's first K and V rows; launch.cuh, PrefetchL2).
// On by default; off leaves the launches programmatic, so that one run can time the
// prefetches apart from the launch overlap. Same scope as SetProgrammaticLaunches.
void SetLaunchPrefetches(bool on);
// ProgrammaticLaunches() and the prefetches on: what a launcher passes its kernel.
bool PrefetchBeforeWait();

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_LAUNCH_H_
