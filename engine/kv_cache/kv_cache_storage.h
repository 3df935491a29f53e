// KvCacheStorage: the memory behind the block pool — keys and values of every layer.
//
//   k(layer): [num_blocks · block_size, Hkv · Dh]   physical row = block · block_size + slot
//   v(layer): same
//
// A sequence's token t lives at physical row block_table[t / block_size] · block_size +
// t % block_size (kernels::KvSource). New storage is NaN-filled when asked, so a kernel
// that reads a slot it was never given fails loudly in tests.
//
// The storage lives in a backend's Memory (Create): host memory for the CPU backends,
// device memory for CUDA, where k()/v() are device pointers that only the backend may
// dereference. CopyRowsToHost reads rows out either way (a memcpy on the host).
#ifndef KVLENS_ENGINE_KV_CACHE_KV_CACHE_STORAGE_H_
#define KVLENS_ENGINE_KV_CACHE_KV_CACHE_STORAGE_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/buffer.h"
#include "kernels/memory.h"

namespace kvlens {

template <typename T>
class KvCacheStorage {
 public:
  // Storage in `memory` (a backend's memory()). RESOURCE_EXHAUSTED when it does not fit.
  static absl::StatusOr<KvCacheStorage> Create(kernels::Memory& memory, int num_layers,
                                               int num_blocks, int block_size, int kv_dim,
                                               bool fill_nan) {
    KvCacheStorage s(memory, num_blocks, block_size, kv_dim);
    if (absl::Status st = s.Init(num_layers, fill_nan); !st.ok()) {
      return absl::Status(
          st.code(), absl::StrCat("KV cache (", num_blocks, " blocks of ", block_size, " tokens, ",
                                  std::string(memory.name()), "): ", st.message()));
    }
    return s;
  }

  // Host storage (the CPU backends'); throws std::bad_alloc like the std::vector it was.
  KvCacheStorage(int num_layers, int num_blocks, int block_size, int kv_dim, bool fill_nan)
      : KvCacheStorage(kernels::HostMemory(), num_blocks, block_size, kv_dim) {
    if (!Init(num_layers, fill_nan).ok()) throw std::bad_alloc();
  }

  T* k(int layer) { return k_[layer].data(); }
  T* v(int layer) { return v_[layer].data(); }
  const T* k(int layer) const { return k_[layer].data(); }
  const T* v(int layer) const { return v_[layer].data(); }
  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int kv_dim() const { return kv_dim_; }
  kernels::Memory& memory() const { return *memory_; }

  // Copies physical rows [first_row, first_row + num_rows) of `layer` to the host:
  // k_out and v_out get num_rows · kv_dim values each.
  absl::Status CopyRowsToHost(int layer, int64_t first_row, int64_t num_rows, T* k_out,
                              T* v_out) const {
    if (absl::Status s = k_[layer].CopyToHost(k_out, num_rows * kv_dim_, first_row * kv_dim_);
        !s.ok()) {
      return s;
    }
    return v_[layer].CopyToHost(v_out, num_rows * kv_dim_, first_row * kv_dim_);
  }

  // Bytes one block takes across all layers, keys and values.
  static int64_t BlockBytes(int num_layers, int block_size, int kv_dim) {
    return int64_t{2} * num_layers * block_size * kv_dim * static_cast<int64_t>(sizeof(T));
  }

 private:
  KvCacheStorage(kernels::Memory& memory, int num_blocks, int block_size, int kv_dim)
      : memory_(&memory), num_blocks_(num_blocks), block_size_(block_size), kv_dim_(kv_dim) {}

  absl::Status Init(int num_layers, bool fill_nan) {
    const int64_t per_layer = int64_t{num_blocks_} * block_size_ * kv_dim_;
    for (int l = 0; l < num_layers; ++l) {
      for (std::vector<kernels::Buffer<T>>* kv : {&k_, &v_}) {
        auto b = kernels::Buffer<T>::Allocate(*memory_, per_layer);
        if (!b.ok()) return b.status();
        if (fill_nan && memory_->host_accessible()) {
          std::fill_n(b->data(), per_layer, std::numeric_limits<T>::quiet_NaN());
        } else if (absl::Status s = memory_->Memset(b->data(), fill_nan ? 0xFF : 0,
                                                    static_cast<size_t>(per_layer) * sizeof(T));
                   !s.ok()) {
          return s;  // all-ones bytes are a NaN in float and double
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
  std::vector<kernels::Buffer<T>> k_;  // [layer]
  std::vector<kernels::Buffer<T>> v_;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_KV_CACHE_STORAGE_H_
