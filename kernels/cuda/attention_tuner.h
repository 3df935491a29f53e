// Tunes a CudaBackend's attention kernels on its own GPU (kernels/attention_tuning.h says
// why): times the bf16 flash kernel's layouts (FlashBf16Layout; the fp16 kernel's block
// sizes on an fp32 cache) on one prompt, then the fastest of them in other block orders
// (CudaBackend::SetFlashHeadGroup), and the decode kernels (split-KV with 4 or 16
// warps a block, its combine fused or not, on CUDA cores or tensor cores) on a decode step,
// each on the same random inputs, and leaves the backend with the fastest of each whose
// output agrees with the default's within 2% of its largest value: a check that a kernel
// computes the same attention on this GPU, not a parity test (tests/kernels/cuda has those).
#ifndef KVLENS_KERNELS_CUDA_ATTENTION_TUNER_H_
#define KVLENS_KERNELS_CUDA_ATTENTION_TUNER_H_

#include "absl/status/statusor.h"
#include "kernels/attention_tuning.h"
#include "kernels/cuda/cuda_backend.h"

namespace kvlens::kernels::cuda {

// The candidates' agreement allowed: max |output − default's| <= this × max |default's|.
inline constexpr double kTuneRelativeTolerance = 0.02;

// On success the backend keeps the chosen prefill layout and order and decode kernel (its other
// settings as they were); on error (INVALID_ARGUMENT for the shape, naming the field, or a
// CUDA failure) its settings are as they were. A candidate the backend refuses for this
// shape is reported with why and not chosen. Uses device memory for the inputs (freed
// before it returns) and grows the backend's workspaces as the calls need.
absl::StatusOr<AttentionTuneReport> TuneAttention(CudaBackend& b, const AttentionTuneShape& shape);

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_ATTENTION_TUNER_H_
