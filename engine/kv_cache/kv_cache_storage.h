// KvCacheStorage: the memory behind the block pool — keys and values of every layer.
//
//   k(layer): [num_blocks · block_size, Hkv · Dh]   physical row = block · block_size + slot
//   v(layer): same
//
// Elements are of type dtype() (kernels/kv_dtype.h): T, or bf16 at half the bytes.
//
// A sequence's token t lives at physical row block_table[t / block_size] · block_size +
// t % block_size (kernels::KvSource). New storage is NaN-filled when asked, so a kernel
// that reads a slot it was never given fails loudly in tests.
//
// The storage lives in a backend's Memory (Create): host memory for the CPU backends,
// device memory for CUDA, where k()/v() are device pointers that only the backend may
// dereference. CopyRowsToHost reads rows out either way, as T.
#ifndef KVLENS_ENGINE_KV_CACHE_KV_CACHE_STORAGE_H_
#define KVLENS_ENGINE_KV_CACHE_KV_CACHE_STORAGE_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/buffer.h"
#include "kernels/kv_dtype.h"
#include "kernels/memory.h"

namespace kvlens {

template <typename T>
class KvCacheStorage {
 public:
  // Storage in `memory` (a backend's memory()). RESOURCE_EXHAUSTED when it does not fit.
  static absl::StatusOr<KvCacheStorage> Create(
      kernels::Memory& memory, int num_layers, int num_blocks, int block_size, int kv_dim,
      bool fill_nan, kernels::KvDtype dtype = kernels::KvDtype::kActivation) {
    KvCacheStorage s(memory, num_blocks, block_size, kv_dim, dtype);
    if (absl::Status st = s.Init(num_layers, fill_nan); !st.ok()) {
      return absl::Status(
          st.code(), absl::StrCat("KV cache (", num_blocks, " blocks of ", block_size, " tokens, ",
                                  std::string(kernels::KvDtypeName(dtype)), ", ",
                                  std::string(memory.name()), "): ", st.message()));
    }
    return s;
  }

  // Host storage (the CPU backends'); throws std::bad_alloc like the std::vector it was.
  KvCacheStorage(int num_layers, int num_blocks, int block_size, int kv_dim, bool fill_nan,
                 kernels::KvDtype dtype = kernels::KvDtype::kActivation)
      : KvCacheStorage(kernels::HostMemory(), num_blocks, block_size, kv_dim, dtype) {
    if (!Init(num_layers, fill_nan).ok()) throw std::bad_alloc();
  }

  void* k(int layer) { return k_[layer].data(); }
  void* v(int layer) { return v_[layer].data(); }
  const void* k(int layer) const { return k_[layer].data(); }
  const void* v(int layer) const { return v_[layer].data(); }
  kernels::KvDtype dtype() const { return dtype_; }
  // Where layer `layer`'s keys and values are, for an AttentionArgs (no block table yet).
  kernels::KvSource<T> Source(int layer) const {
    kernels::KvSource<T> s;
    s.k = k(layer);
    s.v = v(layer);
    s.row_stride = kv_dim_;
    s.block_size = block_size_;
    s.dtype = dtype_;
    return s;
  }
  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int kv_dim() const { return kv_dim_; }
  kernels::Memory& memory() const { return *memory_; }

  // Copies physical rows [first_row, first_row + num_rows) of `layer` to the host:
  // k_out and v_out get num_rows · kv_dim values each.
  absl::Status CopyRowsToHost(int layer, int64_t first_row, int64_t num_rows, T* k_out,
                              T* v_out) const {
    const int64_t n = num_rows * kv_dim_, elem = kernels::KvElementBytes<T>(dtype_);
    std::vector<uint16_t> narrow(dtype_ == kernels::KvDtype::kActivation ? 0 : n);
    for (auto [src, out] : {std::pair{&k_[layer], k_out}, std::pair{&v_[layer], v_out}}) {
      void* dst = narrow.empty() ? static_cast<void*>(out) : narrow.data();
      if (absl::Status s = src->CopyToHost(static_cast<unsigned char*>(dst), n * elem,
                                           first_row * kv_dim_ * elem);
          !s.ok()) {
        return s;
      }
      for (int64_t e = 0; e < static_cast<int64_t>(narrow.size()); ++e) {
        out[e] = kernels::KvLoad<T>(narrow.data(), e, dtype_);
      }
    }
    return absl::OkStatus();
  }

  // Bytes one block takes across all layers, keys and values.
  static int64_t BlockBytes(int num_layers, int block_size, int kv_dim,
                            kernels::KvDtype dtype = kernels::KvDtype::kActivation) {
    return int64_t{2} * num_layers * block_size * kv_dim * kernels::KvElementBytes<T>(dtype);
  }

 private:
  KvCacheStorage(kernels::Memory& memory, int num_blocks, int block_size, int kv_dim,
                 kernels::KvDtype dtype)
      : memory_(&memory),
        num_blocks_(num_blocks),
        block_size_(block_size),
        kv_dim_(kv_dim),
        dtype_(dtype) {}

  absl::Status Init(int num_layers, bool fill_nan) {
    const int64_t per_layer = int64_t{num_blocks_} * block_size_ * kv_dim_;
    const int64_t bytes = per_layer * kernels::KvElementBytes<T>(dtype_);
    for (int l = 0; l < num_layers; ++l) {
      for (std::vector<kernels::Buffer<unsigned char>>* kv : {&k_, &v_}) {
        auto b = kernels::Buffer<unsigned char>::Allocate(*memory_, bytes);
        if (!b.ok()) return b.status();
        if (fill_nan && memory_->host_accessible() && dtype_ == kernels::KvDtype::kActivation) {
          std::fill_n(reinterpret_cast<T*>(b->data()), per_layer,
                      std::numeric_limits<T>::quiet_NaN());
        } else if (absl::Status s =
                       memory_->Memset(b->data(), fill_nan ? 0xFF : 0, static_cast<size_t>(bytes));
                   !s.ok()) {
          return s;  // all-ones bytes are a NaN in float, double and bf16
        }
        kv->push_back(*std::move(b));
      }
    }
    return absl::OkStatus();
  }

  kernels::Memory* memory_;
  int num_blocks_;
  int block_size_;
  int kv_dim_;
  kernels::KvDtype dtype_;
  std::vector<kernels::Buffer<unsigned char>> k_;  // [layer], kv_dim_ · rows elements of dtype_
  std::vector<kernels::Buffer<unsigned char>> v_;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_KV_CACHE_STORAGE_H_
