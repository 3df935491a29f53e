// StagedBackend: a Backend<float> over host arrays whose arithmetic runs on a device
// backend (one whose memory() is not host-accessible, e.g. CudaBackend). Each op copies
// its inputs into device scratch, runs the device op, and copies its outputs back before
// it returns. For callers that keep every tensor on the host but want the device's
// matrix products: the interpretability tape (engine/interpret/tape.h), whose forward
// records each activation on the host anyway. Weights are not copied per op (the device
// backend caches uploads by host address); activations are, both ways.
//
// Attention stages its inputs (q, and the keys and values: the logical rows, or every row of
// the blocks a table names) and copies back out, probs and scores; the block table and
// document ids stay host arrays, as every backend takes them. A bf16 cache's Attention,
// and StoreKv, run on `host`, a CPU backend. The backward ops (kernels/backward_ops.h)
// stage onto the device backend's BackwardOps when given one.
//
// Errors: the void ops record their first failure (a copy, an allocation, a device op)
// and then do nothing; Synchronize() returns it, and Recover() clears it as CudaBackend
// does. One thread at a time.
#ifndef KVLENS_KERNELS_STAGED_BACKEND_H_
#define KVLENS_KERNELS_STAGED_BACKEND_H_

#include <array>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/backward_ops.h"
#include "kernels/buffer.h"

namespace kvlens::kernels {

class StagedBackend final : public Backend<float>, public BackwardOps<float> {
 public:
  // All must outlive this; `device` is used from the calling thread (MakeCurrent first).
  // device_backward: the device backend's backward ops (e.g. the same CudaBackend), which
  // the backward ops below then stage onto; null: they run the reference loops on the host.
  StagedBackend(Backend<float>& device, Backend<float>& host,
                BackwardOps<float>* device_backward = nullptr);

  std::string_view name() const override { return name_; }
  absl::Status MakeCurrent() override { return device_.MakeCurrent(); }
  // Waits for the device; the first failure of any op so far.
  absl::Status Synchronize() override;
  // Its failures are its device's (allocations, copies, the device's ops): out of memory
  // is cleared when the device recovers (device.Recover()); any other is kept.
  absl::Status Recover() override;
  Backend<float>& device() { return device_; }

  void MatMul(const float* x, int n, const WeightView& w, const WeightView& bias,
              float* y) override;
  void Embedding(const WeightView& table, const int32_t* ids, int n, float* out) override;
  void RmsNorm(const float* x, int n, int dim, const WeightView& weight, double eps,
               float* y) override;
  void LayerNorm(const float* x, int n, int dim, const WeightView& weight, const WeightView& bias,
                 double eps, float* y) override;
  void Rope(float* x, int n, int64_t row_stride, int num_heads, int head_dim,
            const int32_t* positions, const RopeSpec& rope) override;
  void Gelu(float* x, int64_t count) override;
  void SwiGlu(const float* gate, const float* up, int64_t count, float* out) override;
  void GeGlu(const float* gate, const float* up, int64_t count, float* out) override;
  void Scale(float* x, int64_t count, double factor) override;
  void SoftCap(float* x, int64_t count, double cap) override;
  void Add(float* y, const float* x, int64_t count) override;
  void StoreKv(const float* k, const float* v, int n, int64_t src_stride, int64_t row_elems,
               const int64_t* dst_rows, void* k_cache, void* v_cache, int64_t cache_stride,
               KvDtype cache_dtype) override;
  absl::Status Attention(const AttentionArgs<float>& args) override;

  // BackwardOps on host arrays: inputs staged in, results (dx; dq, dk, dv, dprobs,
  // dscores) copied back before returning.
  absl::Status MatMulBackwardInput(const float* dy, int n, const WeightView& w, float* dx) override;
  absl::Status AttentionBackward(const AttentionBackwardArgs<float>& args) override;

 private:
  // Device scratch slot `slot` holding `count` floats, filled from `host` when non-null.
  float* Stage(int slot, const float* host, int64_t count);
  // The first `count` floats of slot `slot` into `host`.
  void Fetch(float* host, int slot, int64_t count);
  bool Ok(const absl::Status& s);

  Backend<float>& device_;
  Backend<float>& host_;
  BackwardOps<float>* device_backward_;
  std::string name_;
  std::array<Buffer<float>, 10> scratch_;
  absl::Status status_;
};

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_STAGED_BACKEND_H_
