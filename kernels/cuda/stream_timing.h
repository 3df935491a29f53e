// Timing work enqueued on a stream with CUDA events, every CUDA call checked: for
// kvlens_gpu_check's benchmarks and the attention tuner (attention_tuner.h).
#ifndef KVLENS_KERNELS_CUDA_STREAM_TIMING_H_
#define KVLENS_KERNELS_CUDA_STREAM_TIMING_H_

#include <cuda_runtime_api.h>

#include <functional>

#include "absl/status/statusor.h"

namespace kvlens::kernels::cuda {

// Seconds a call, over `calls` calls of `call` enqueued on `stream` between two events. No
// warm-up: the caller runs one first. The first failing call's status, if any.
absl::StatusOr<double> EventSeconds(cudaStream_t stream, int calls,
                                    const std::function<absl::Status()>& call);

// Seconds a call on the GPU alone (a decode call's host part would otherwise time the
// host): `calls` calls captured in a CUDA graph, launched once unmeasured (its upload),
// then `replays` times between events. The call must have run before outside a capture,
// so that its workspaces are sized: memory cannot be allocated while a stream is captured.
absl::StatusOr<double> ReplayedSeconds(cudaStream_t stream, int calls, int replays,
                                       const std::function<absl::Status()>& call);

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_STREAM_TIMING_H_
