// BackwardOps: the two heavy ops of the interpretability backward pass, for a backend that
// runs them on its own memory like its forward ops. engine/interpret's Backward uses the
// reference loops of kernels/cpu/reference_backward.h on the host unless given one
// (CpuBackend, in float on its thread pool; CudaBackend on device pointers; StagedBackend
// on host arrays, staged onto its device).
// Everything else in the backward (norms, RoPE, activations, one layer's weight gradients)
// is O(tokens · width) and stays on the host.
#ifndef KVLENS_KERNELS_BACKWARD_OPS_H_
#define KVLENS_KERNELS_BACKWARD_OPS_H_

#include "absl/status/status.h"
#include "kernels/attention_backward.h"
#include "kernels/weight.h"

namespace kvlens::kernels {

template <typename T>
class BackwardOps {
 public:
  virtual ~BackwardOps() = default;
  // dx[n, in] += dy[n, out] · W (W [out, in]: the input gradient of y = x · Wᵀ). A
  // device backend may return before the work is done; its errors then show up in the
  // next call's status or the backend's Synchronize().
  virtual absl::Status MatMulBackwardInput(const T* dy, int n, const WeightView& w, T* dx) = 0;
  // kernels/attention_backward.h; the same argument errors as the reference.
  virtual absl::Status AttentionBackward(const AttentionBackwardArgs<T>& args) = 0;
};

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_BACKWARD_OPS_H_
