// A "device" backend for CPU-only machines: CpuBackend's kernels over memory that claims
// not to be host-accessible. The engine then takes its device path (logits and attention
// captures copied out, KV cache read back with CopyRowsToHost, NaN fill by Memset), so
// that path is tested where no GPU exists; the numbers must equal the CPU path's bitwise.
#ifndef KVLENS_TESTS_KERNELS_FAKE_DEVICE_BACKEND_H_
#define KVLENS_TESTS_KERNELS_FAKE_DEVICE_BACKEND_H_

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string_view>
#include <unordered_map>

#include "kernels/backend.h"
#include "kernels/backward_ops.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backward.h"
#include "kernels/memory.h"
#include "tests/kernels/cpu_forwarding_backend.h"

namespace kvlens::testing {

// Host memory under another identity, counting the copies out. With a budget (set_budget)
// it also reports usage() as a device would: free = budget − bytes allocated now, and
// keeps the peak; allocations past the budget are RESOURCE_EXHAUSTED.
class FakeDeviceMemory final : public kernels::Memory {
 public:
  std::string_view name() const override { return "fake-device"; }
  bool host_accessible() const override { return false; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (budget_ > 0 && in_use_ + bytes > budget_) {
      return absl::ResourceExhaustedError("fake-device: out of memory");
    }
    absl::StatusOr<void*> p = host().Allocate(bytes);
    if (p.ok() && *p != nullptr) {
      sizes_[*p] = bytes;
      in_use_ += bytes;
      peak_ = std::max(peak_, in_use_);
    }
    return p;
  }
  void Free(void* p) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = sizes_.find(p); it != sizes_.end()) {
      in_use_ -= it->second;
      sizes_.erase(it);
    }
    host().Free(p);
  }
  absl::StatusOr<Usage> usage() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (budget_ == 0) return kernels::Memory::usage();
    return Usage{budget_ - in_use_, budget_};
  }
  void set_budget(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    budget_ = bytes;
  }
  size_t in_use() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_use_;
  }
  // The most bytes allocated at once since the last reset_peak().
  size_t peak() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = in_use_;
  }
  absl::Status CopyFromHost(void* dst, const void* src, size_t bytes) override {
    return host().CopyFromHost(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    ++copies_to_host;
    return host().CopyToHost(dst, src, bytes);
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    return host().Copy(dst, src, bytes);
  }
  absl::Status Memset(void* dst, int byte, size_t bytes) override {
    ++memsets;
    return host().Memset(dst, byte, bytes);
  }

  std::atomic<int> copies_to_host{0};
  std::atomic<int> memsets{0};

 private:
  static kernels::Memory& host() { return kernels::HostMemory(); }

  mutable std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;
  size_t budget_ = 0, in_use_ = 0, peak_ = 0;
};

// Also the backward ops (the reference loops, on its host-backed "device" memory), so that
// kernels::StagedBackend's staging of them can be checked.
class FakeDeviceBackend final : public CpuForwardingBackend, public kernels::BackwardOps<float> {
 public:
  explicit FakeDeviceBackend(int threads = 1) : CpuForwardingBackend(threads) {}
  std::string_view name() const override { return "fake-device"; }
  kernels::Memory& memory() override { return memory_; }
  FakeDeviceMemory& fake_memory() { return memory_; }

  absl::Status Attention(const kernels::AttentionArgs<float>& a) override {
    ++attention_calls;
    return cpu_.Attention(a);
  }
  // Backend's default (the rows copied out, drawn on the host), counting the rows, those
  // drawn at a temperature and those of each other kind.
  absl::Status DrawTokens(const float* logits, int rows, int vocab, const kernels::TokenDraw* draws,
                          int32_t* token, float* logprob, int32_t* top_token,
                          float* top_logprob) override {
    pick_rows += rows;
    for (int r = 0; r < rows; ++r) {
      drawn_rows += draws[r].temperature > 0.0 ? 1 : 0;
      top_rows += draws[r].top_logprobs > 0 ? 1 : 0;
      biased_rows += draws[r].logit_bias.empty() ? 0 : 1;
      penalized_rows += draws[r].HasPenalties() ? 1 : 0;
      forced_rows += draws[r].forced_token >= 0 ? 1 : 0;
    }
    return kernels::Backend<float>::DrawTokens(logits, rows, vocab, draws, token, logprob,
                                               top_token, top_logprob);
  }
  std::atomic<int> pick_rows{0};
  std::atomic<int> drawn_rows{0};
  std::atomic<int> top_rows{0};
  std::atomic<int> biased_rows{0};
  std::atomic<int> penalized_rows{0};
  std::atomic<int> forced_rows{0};  // a scored prompt's rows (TokenDraw::forced_token)
  std::atomic<int> attention_calls{0};
  // The CPU backend's backward ops, as every other op here.
  absl::Status MatMulBackwardInput(const float* dy, int n, const kernels::WeightView& w,
                                   float* dx) override {
    return cpu_.MatMulBackwardInput(dy, n, w, dx);
  }
  absl::Status AttentionBackward(const kernels::AttentionBackwardArgs<float>& a) override {
    return cpu_.AttentionBackward(a);
  }

 private:
  FakeDeviceMemory memory_;
};

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_KERNELS_FAKE_DEVICE_BACKEND_H_
