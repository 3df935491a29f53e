// Element types of stored weights, and the scalar conversions every backend shares.
#ifndef KVLENS_KERNELS_DTYPE_H_
#define KVLENS_KERNELS_DTYPE_H_

#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

namespace kvlens::kernels {

// The storage types a weight may have. Activations are always float (served paths) or
// double (the reference); only weights come in these.
enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kQ8_0,  // ggml block quantisation: blocks of 32 int8 with one f16 scale (34 bytes)
  // ggml's other block quantisations (layouts in kernels/ggml_quants.h): 32-element blocks
  // of 4 or 5 bits with a scale (and an offset, _1); and the k-quants, super-blocks of 256
  // elements with 16 or 8 sub-block scales, 2 to 6 bits an element.
  kQ4_0,
  kQ4_1,
  kQ5_0,
  kQ5_1,
  kQ2_K,
  kQ3_K,
  kQ4_K,
  kQ5_K,
  kQ6_K,
  // ggml's 4-bit non-linear types: each nibble indexes a fixed table of 16 values
  // (kIQ4Values in ggml_quants.h). iq4_nl: blocks of 32 with one f16 scale, as q4_0;
  // iq4_xs: super-blocks of 256 with a 6-bit scale per 32.
  kIQ4_NL,
  kIQ4_XS,
};

inline constexpr int kQ8_0BlockSize = 32;
inline constexpr int kQ8_0BlockBytes = 34;

std::string_view DTypeName(DType t);

// A dtype's storage unit: `elems` consecutive elements take `bytes` bytes (1 element for
// the float types). A row of a block type holds a whole number of blocks.
struct DTypeBlock {
  int elems;
  int bytes;
};
inline constexpr DTypeBlock DTypeBlockOf(DType t) {
  switch (t) {
    case DType::kF32:
      return {1, 4};
    case DType::kF16:
    case DType::kBF16:
      return {1, 2};
    case DType::kQ8_0:
      return {kQ8_0BlockSize, kQ8_0BlockBytes};
    case DType::kQ4_0:
      return {32, 18};
    case DType::kQ4_1:
      return {32, 20};
    case DType::kQ5_0:
      return {32, 22};
    case DType::kQ5_1:
      return {32, 24};
    case DType::kQ2_K:
      return {256, 84};
    case DType::kQ3_K:
      return {256, 110};
    case DType::kQ4_K:
      return {256, 144};
    case DType::kQ5_K:
      return {256, 176};
    case DType::kQ6_K:
      return {256, 210};
    case DType::kIQ4_NL:
      return {32, 18};
    case DType::kIQ4_XS:
      return {256, 136};
  }
  return {1, 0};
}
inline constexpr int DTypeBlockSize(DType t) { return DTypeBlockOf(t).elems; }
// True for the ggml block types (q8_0, q4_K, …), which only CPU code decodes.
inline constexpr bool DTypeIsBlockQuantized(DType t) { return DTypeBlockSize(t) > 1; }

// fn(std::integral_constant<DType, t>{}) for a ggml block type t, nothing for the float
// types: the one switch through which code reaches its per-type templates (weight readers,
// the int8 products' unpacking).
template <typename Fn>
inline void VisitBlockType(DType t, Fn&& fn) {
  switch (t) {
    case DType::kQ8_0:
      return fn(std::integral_constant<DType, DType::kQ8_0>{});
    case DType::kQ4_0:
      return fn(std::integral_constant<DType, DType::kQ4_0>{});
    case DType::kQ4_1:
      return fn(std::integral_constant<DType, DType::kQ4_1>{});
    case DType::kQ5_0:
      return fn(std::integral_constant<DType, DType::kQ5_0>{});
    case DType::kQ5_1:
      return fn(std::integral_constant<DType, DType::kQ5_1>{});
    case DType::kQ2_K:
      return fn(std::integral_constant<DType, DType::kQ2_K>{});
    case DType::kQ3_K:
      return fn(std::integral_constant<DType, DType::kQ3_K>{});
    case DType::kQ4_K:
      return fn(std::integral_constant<DType, DType::kQ4_K>{});
    case DType::kQ5_K:
      return fn(std::integral_constant<DType, DType::kQ5_K>{});
    case DType::kQ6_K:
      return fn(std::integral_constant<DType, DType::kQ6_K>{});
    case DType::kIQ4_NL:
      return fn(std::integral_constant<DType, DType::kIQ4_NL>{});
    case DType::kIQ4_XS:
      return fn(std::integral_constant<DType, DType::kIQ4_XS>{});
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      return;
  }
}

// Bytes used by `count` consecutive elements (a multiple of DTypeBlockSize(t)).
inline int64_t DTypeRowBytes(DType t, int64_t count) {
  const DTypeBlock b = DTypeBlockOf(t);
  return count / b.elems * b.bytes;
}

// IEEE half → float, exact for every finite, infinite and NaN input.
inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float → IEEE half, round to nearest even (overflow → inf, NaN stays NaN).
inline uint16_t F32ToF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow → inf
  if (abs < 0x38800000u) {                                               // subnormal or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // value / 2^-24 == m >> shift, rounded
    const uint32_t half_m = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t r = half_m;
    if (rem > halfway || (rem == halfway && (half_m & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 → 15
  const uint32_t rem = r & 0x1fffu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

inline float BF16ToF32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t F32ToBF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_DTYPE_H_
