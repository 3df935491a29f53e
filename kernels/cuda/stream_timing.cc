#include "kernels/cuda/stream_timing.h"

#include "kernels/cuda/cuda_status.h"

namespace kvlens::kernels::cuda {

absl::StatusOr<double> EventSeconds(cudaStream_t stream, int calls,
                                    const std::function<absl::Status()>& call) {
  cudaEvent_t start = nullptr, stop = nullptr;
  absl::Status s = KVLENS_CUDA_STATUS(cudaEventCreate(&start));
  if (s.ok()) s = KVLENS_CUDA_STATUS(cudaEventCreate(&stop));
  if (s.ok()) s = KVLENS_CUDA_STATUS(cudaEventRecord(start, stream));
  for (int i = 0; i < calls && s.ok(); ++i) s = call();
  if (s.ok()) s = KVLENS_CUDA_STATUS(cudaEventRecord(stop, stream));
  if (s.ok()) s = KVLENS_CUDA_STATUS(cudaEventSynchronize(stop));
  float ms = 0.0f;
  if (s.ok()) s = KVLENS_CUDA_STATUS(cudaEventElapsedTime(&ms, start, stop));
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  if (!s.ok()) return s;
  return ms / 1e3 / calls;
}

absl::StatusOr<double> ReplayedSeconds(cudaStream_t stream, int calls, int replays,
                                       const std::function<absl::Status()>& call) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  absl::Status s =
      KVLENS_CUDA_STATUS(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  if (!s.ok()) return s;
  for (int i = 0; i < calls && s.ok(); ++i) s = call();
  // Ended whatever happened, so that the stream is usable again.
  const absl::Status ended = KVLENS_CUDA_STATUS(cudaStreamEndCapture(stream, &graph));
  if (s.ok()) s = ended;
  if (s.ok()) s = KVLENS_CUDA_STATUS(cudaGraphInstantiate(&exec, graph, 0));
  auto launch = [&] { return KVLENS_CUDA_STATUS(cudaGraphLaunch(exec, stream)); };
  if (s.ok()) s = launch();
  absl::StatusOr<double> sec = 0.0;
  if (s.ok()) sec = EventSeconds(stream, replays, launch);
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!s.ok()) return s;
  if (!sec.ok()) return sec.status();
  return *sec / calls;
}

}  // namespace kvlens::kernels::cuda
