// KvCacheStorage: the memory behind the block pool — keys and values of every layer.
//
//   k(layer): [num_blocks · block_size, Hkv · Dh]   physical row = block · block_size + slot
//   v(layer): same
//
// A sequence's token t lives at physical row block_table[t / block_size] · block_size +
// t % block_size (kernels::KvSource). New storage is NaN-filled when asked, so a kernel
// that reads a slot it was never given fails loudly in tests.
#ifndef KVLENS_ENGINE_KV_CACHE_KV_CACHE_STORAGE_H_
#define KVLENS_ENGINE_KV_CACHE_KV_CACHE_STORAGE_H_

#include <cstdint>
#include <limits>
#include <vector>

namespace kvlens {

template <typename T>
class KvCacheStorage {
 public:
  KvCacheStorage(int num_layers, int num_blocks, int block_size, int kv_dim, bool fill_nan)
      : num_blocks_(num_blocks), block_size_(block_size), kv_dim_(kv_dim) {
    const size_t per_layer = static_cast<size_t>(num_blocks) * block_size * kv_dim;
    const T fill = fill_nan ? std::numeric_limits<T>::quiet_NaN() : T(0);
    k_.assign(num_layers, std::vector<T>(per_layer, fill));
    v_.assign(num_layers, std::vector<T>(per_layer, fill));
  }

  T* k(int layer) { return k_[layer].data(); }
  T* v(int layer) { return v_[layer].data(); }
  const T* k(int layer) const { return k_[layer].data(); }
  const T* v(int layer) const { return v_[layer].data(); }
  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int kv_dim() const { return kv_dim_; }
  // Bytes one block takes across all layers, keys and values.
  static int64_t BlockBytes(int num_layers, int block_size, int kv_dim) {
    return int64_t{2} * num_layers * block_size * kv_dim * static_cast<int64_t>(sizeof(T));
  }

 private:
  int num_blocks_;
  int block_size_;
  int kv_dim_;
  std::vector<std::vector<T>> k_;
  std::vector<std::vector<T>> v_;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_KV_CACHE_STORAGE_H_
