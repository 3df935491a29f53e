// The backends a binary can serve with, by name: "cpu" (CpuBackend, fp32) or "cuda[:N]"
// (CudaBackend on GPU N, only in builds with KVLENS_CUDA). The server's and the CLI's
// --device flag come here, so neither calls CUDA itself.
#ifndef KVLENS_KERNELS_BACKEND_FACTORY_H_
#define KVLENS_KERNELS_BACKEND_FACTORY_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/attention_tuning.h"
#include "kernels/backend.h"

namespace kvlens::kernels {

struct DeviceSpec {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;  // the GPU (kCuda)
  // kCuda: run the engine's forward steps as CUDA graphs (CudaBackend::SetCudaGraphs).
  bool cuda_graphs = true;
  // kCuda: decode attention (split-KV) on tensor cores where it applies, head sizes 64, 128
  // and 256 (CudaBackend::SetSplitKvTensorCores): Q, K, P and V rounded to bf16 on a bf16
  // cache, to fp16 on fp32, as prefill on those caches rounds them. Off by default until a
  // GPU has timed it.
  bool attention_tensor_cores = false;
  // kCuda: launch kernels as programmatic dependent launches (sm_90; kernels/cuda/launch.h):
  // each may be scheduled while the one before drains, the matvec prefetching its first
  // weights and split-KV its first K and V rows meanwhile. Process-wide once on: every
  // CUDA backend of the process launches so. Off by default until a GPU has timed it.
  bool programmatic_launches = false;
  // kCpu: products with block-quantised weights take 8-bit activations, as llama.cpp's do
  // (CpuBackend::SetInt8Activations): faster, no longer exact. Off by default.
  bool int8_activations = false;

  std::string ToString() const;  // "cpu", "cuda:0"
};

// "cpu", "cuda" (= "cuda:0") or "cuda:N". INVALID_ARGUMENT naming the accepted forms.
absl::StatusOr<DeviceSpec> ParseDevice(std::string_view text);

// True when this build has the CUDA backend (KVLENS_CUDA=ON).
bool HasCudaSupport();

struct CreatedBackend {
  std::unique_ptr<Backend<float>> backend;
  std::string description;  // for GetModelInfo / --stats: "cpu-f32", "cuda:0 (NVIDIA H200)"
};

// The backend for `device`. cpu_threads: CpuBackend threads (0: all cores). Errors (the
// caller names its flag):
// FAILED_PRECONDITION when the build has no CUDA support or there is no usable GPU;
// INVALID_ARGUMENT for a GPU index that does not exist, int8_activations on CUDA, or
// attention_tensor_cores or programmatic_launches on the CPU.
// share_weights_with: another backend made here; when both are CUDA backends of the same
// GPU, the new one shares its uploaded weights (one copy on the device) instead of
// uploading its own, and takes its attention kernels (CudaBackend::SetAttentionKernels:
// what --attention-tune chose). Ignored otherwise.
absl::StatusOr<CreatedBackend> CreateBackend(const DeviceSpec& device, int cpu_threads,
                                             Backend<float>* share_weights_with = nullptr);

// Tunes a CUDA backend's attention kernels on its own GPU for calls of `shape`
// (kernels/attention_tuning.h; kernels/cuda/attention_tuner.h), leaving it with the fastest
// that agree with the defaults. FAILED_PRECONDITION for a CPU backend (one attention kernel)
// and in builds without CUDA; INVALID_ARGUMENT for the shape, naming the field.
absl::StatusOr<AttentionTuneReport> TuneAttention(Backend<float>& backend,
                                                  const AttentionTuneShape& shape);

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_BACKEND_FACTORY_H_
