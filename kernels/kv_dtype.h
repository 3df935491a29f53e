// The element type of the KV cache.
//
// The cache keeps keys and values either in the activation type (float on the served
// paths, double in the reference) or rounded to bf16, which halves the cache's bytes: twice
// the tokens in the same memory, and half the bytes that decode attention reads each step
// (vLLM's --kv-cache-dtype, llama.cpp's --cache-type-k/-v). A bf16 cache changes the
// values attention sees, never the maths: every backend rounds a new key or value to
// nearest-even bf16 when it stores it (the reference through float) and widens it back
// exactly when it reads it, so backends agree on a bf16 cache as they do on a float one.
#ifndef KVLENS_KERNELS_KV_DTYPE_H_
#define KVLENS_KERNELS_KV_DTYPE_H_

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/dtype.h"

namespace kvlens::kernels {

enum class KvDtype : uint8_t {
  kActivation,  // T itself: float, or double in the reference
  kBF16,        // bf16 bits (uint16_t), read back as T exactly
};

// The element a float backend's cache of type d stores (kF32 or kBF16): for code that fills
// or reads such a cache as raw elements (LaunchFillRandom in benchmarks and the tuner).
constexpr DType KvStoredDType(KvDtype d) {
  return d == KvDtype::kBF16 ? DType::kBF16 : DType::kF32;
}

// "auto" or "bf16", as --kv-cache-dtype spells them.
std::string_view KvDtypeName(KvDtype d);
// Parses --kv-cache-dtype: "auto" or "bf16" (also "bfloat16").
absl::StatusOr<KvDtype> ParseKvDtype(std::string_view name);

// Bytes of one cached element.
template <typename T>
constexpr int64_t KvElementBytes(KvDtype d) {
  return d == KvDtype::kBF16 ? 2 : static_cast<int64_t>(sizeof(T));
}

// Element i of a cache array of type d, as T.
template <typename T>
inline T KvLoad(const void* base, int64_t i, KvDtype d) {
  if (d == KvDtype::kBF16) return static_cast<T>(BF16ToF32(static_cast<const uint16_t*>(base)[i]));
  return static_cast<const T*>(base)[i];
}

// Stores n values of src at elements offset … offset + n − 1 of a cache array of type d
// (bf16: rounded to nearest even through float).
template <typename T>
inline void KvStoreRow(void* base, int64_t offset, const T* src, int64_t n, KvDtype d) {
  if (d == KvDtype::kBF16) {
    uint16_t* dst = static_cast<uint16_t*>(base) + offset;
    for (int64_t e = 0; e < n; ++e) dst[e] = F32ToBF16(static_cast<float>(src[e]));
    return;
  }
  T* dst = static_cast<T*>(base) + offset;
  for (int64_t e = 0; e < n; ++e) dst[e] = src[e];
}

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_KV_DTYPE_H_
