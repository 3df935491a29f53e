// ggml's block quantisations (the weights of most GGUF files: q4_0 … q8_0, the k-quants
// q2_K … q6_K of Q4_K_M and its siblings, and the non-linear iq4_nl and iq4_xs of IQ4_NL
// and IQ4_XS files): their layouts, as ggml-common.h defines them, and their decoding,
// element for element the arithmetic of ggml's dequantize_row_* (tests/kernels/
// ggml_quants_test.cc checks every type against ggml's own output). Every product below is
// exact in float (an f16 times an integer of at most 8 bits, and that times a quant of at
// most 6 bits or, iq4_xs, a table value of 8), except q6_K's last product, so a decoded
// float has at most one rounding, whether or not a compiler fuses a multiply and an add.
//
// Included by weight.cc (portable) and by the -march=native kernels (cpu_backend.cc):
// everything lives in an anonymous namespace, as in cpu/simd.h, so code built for different
// instruction sets never meets in one inline function.
#ifndef KVLENS_KERNELS_GGML_QUANTS_H_
#define KVLENS_KERNELS_GGML_QUANTS_H_

#include <cstdint>
#include <cstring>

#include "kernels/dtype.h"

namespace kvlens::kernels {
namespace {

template <typename T>
inline T HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<T>(F16ToF32(h));
}

// ---- 32-element blocks ----

// q8_0 (34 bytes): f16 d, int8 q[32]. x = d · q.
template <typename T>
inline void DecodeQ8_0(const uint8_t* b, T* y) {
  const T d = HalfAt<T>(b);
  const auto* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int l = 0; l < 32; ++l) y[l] = d * static_cast<T>(q[l]);
}

// q4_0 (18 bytes): f16 d, qs[16]. Element l < 16 is qs[l]'s low nibble, l + 16 its high
// one; x = (nibble − 8) · d.
template <typename T>
inline void DecodeQ4_0(const uint8_t* b, T* y) {
  const T d = HalfAt<T>(b);
  const uint8_t* qs = b + 2;
  for (int l = 0; l < 16; ++l) {
    y[l] = static_cast<T>((qs[l] & 0xF) - 8) * d;
    y[l + 16] = static_cast<T>((qs[l] >> 4) - 8) * d;
  }
}

// q4_1 (20 bytes): f16 d, f16 m, qs[16] as q4_0; x = nibble · d + m.
template <typename T>
inline void DecodeQ4_1(const uint8_t* b, T* y) {
  const T d = HalfAt<T>(b), m = HalfAt<T>(b + 2);
  const uint8_t* qs = b + 4;
  for (int l = 0; l < 16; ++l) {
    y[l] = static_cast<T>(qs[l] & 0xF) * d + m;
    y[l + 16] = static_cast<T>(qs[l] >> 4) * d + m;
  }
}

// q5_0 (22 bytes): f16 d, qh (32 bits, little-endian: bit l is element l's fifth bit),
// qs[16] as q4_0; x = (5-bit value − 16) · d.
template <typename T>
inline void DecodeQ5_0(const uint8_t* b, T* y) {
  const T d = HalfAt<T>(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int l = 0; l < 16; ++l) {
    const int lo = (qs[l] & 0xF) | static_cast<int>(((qh >> l) & 1u) << 4);
    const int hi = (qs[l] >> 4) | static_cast<int>(((qh >> (l + 16)) & 1u) << 4);
    y[l] = static_cast<T>(lo - 16) * d;
    y[l + 16] = static_cast<T>(hi - 16) * d;
  }
}

// q5_1 (24 bytes): f16 d, f16 m, qh, qs[16] as q5_0; x = 5-bit value · d + m.
template <typename T>
inline void DecodeQ5_1(const uint8_t* b, T* y) {
  const T d = HalfAt<T>(b), m = HalfAt<T>(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int l = 0; l < 16; ++l) {
    const int lo = (qs[l] & 0xF) | static_cast<int>(((qh >> l) & 1u) << 4);
    const int hi = (qs[l] >> 4) | static_cast<int>(((qh >> (l + 16)) & 1u) << 4);
    y[l] = static_cast<T>(lo) * d + m;
    y[l + 16] = static_cast<T>(hi) * d + m;
  }
}

// ---- 256-element super-blocks (k-quants) ----

// q2_K (84 bytes): scales[16] (low nibble: a sub-block's scale, high: its min), qs[64]
// (2 bits an element), f16 d, f16 dmin. Sub-blocks of 16; x = (d·sc) · q − dmin·m.
template <typename T>
inline void DecodeQ2_K(const uint8_t* b, T* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const T d = HalfAt<T>(b + 80), dmin = HalfAt<T>(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half, ++is) {
        const T dl = d * static_cast<T>(scales[is] & 0xF);
        const T ml = dmin * static_cast<T>(scales[is] >> 4);
        const uint8_t* qq = q + 16 * half;
        for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<T>((qq[l] >> shift) & 3) - ml;
      }
    }
  }
}

// q3_K's 6-bit scale j (of 16, stored biased by 32) from its 12 packed bytes: low 4 bits
// from bytes 0–7 (low nibbles for 0–7, high for 8–15), top 2 bits from bytes 8–11 (byte
// 8 + j%4, bits 2·(j/4)). Returns the unbiased scale.
inline int ScaleK3(int j, const uint8_t* packed) {
  const int low = j < 8 ? packed[j] & 0xF : packed[j - 8] >> 4;
  const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// q3_K (110 bytes): hmask[32] (each element's high bit), qs[64] (its low 2 bits), scales[12]
// (16 sub-block scales of 6 bits, stored biased by 32), f16 d. Sub-blocks of 16;
// x = (d·(sc − 32)) · (low 2 bits − (high bit ? 0 : 4)).
template <typename T>
inline void DecodeQ3_K(const uint8_t* b, T* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const uint8_t* packed = b + 96;
  const T d = HalfAt<T>(b + 108);
  int sc[16];
  for (int j = 0; j < 16; ++j) sc[j] = ScaleK3(j, packed);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128, q += 32) {
    for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
      for (int half = 0; half < 2; ++half, ++is) {
        const T dl = d * static_cast<T>(sc[is]);
        const uint8_t* qq = q + 16 * half;
        const uint8_t* hh = hm + 16 * half;
        for (int l = 0; l < 16; ++l) {
          *y++ = dl * static_cast<T>(((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4));
        }
      }
    }
  }
}

// The 6-bit scale and min of sub-block j (of 8) of q4_K and q5_K, from their 12 bytes.
inline void ScaleMinK4(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// q4_K (144 bytes): f16 d, f16 dmin, scales[12], qs[128]. Sub-blocks of 32, in pairs over
// 32 bytes of qs (low nibbles the first, high nibbles the second); x = (d·sc) · q − dmin·m.
template <typename T>
inline void DecodeQ4_K(const uint8_t* b, T* y) {
  const T d = HalfAt<T>(b), dmin = HalfAt<T>(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0; j < 8; j += 2, q += 32) {
    int sc, m;
    ScaleMinK4(j, scales, &sc, &m);
    const T d1 = d * static_cast<T>(sc), m1 = dmin * static_cast<T>(m);
    ScaleMinK4(j + 1, scales, &sc, &m);
    const T d2 = d * static_cast<T>(sc), m2 = dmin * static_cast<T>(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<T>(q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<T>(q[l] >> 4) - m2;
  }
}

// q5_K (176 bytes): f16 d, f16 dmin, scales[12], qh[32], qs[128]: q4_K plus a fifth bit,
// bit j of qh[l] for element l of sub-block j.
template <typename T>
inline void DecodeQ5_K(const uint8_t* b, T* y) {
  const T d = HalfAt<T>(b), dmin = HalfAt<T>(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + 48;
  for (int j = 0; j < 8; j += 2, q += 32) {
    int sc, m;
    ScaleMinK4(j, scales, &sc, &m);
    const T d1 = d * static_cast<T>(sc), m1 = dmin * static_cast<T>(m);
    ScaleMinK4(j + 1, scales, &sc, &m);
    const T d2 = d * static_cast<T>(sc), m2 = dmin * static_cast<T>(m);
    for (int l = 0; l < 32; ++l) {
      *y++ = d1 * static_cast<T>((q[l] & 0xF) | (((qh[l] >> j) & 1) << 4)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      *y++ = d2 * static_cast<T>((q[l] >> 4) | (((qh[l] >> (j + 1)) & 1) << 4)) - m2;
    }
  }
}

// q6_K (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], f16 d.
// Sub-blocks of 16; x = (d·sc) · (6-bit value − 32), the one product that may round.
template <typename T>
inline void DecodeQ6_K(const uint8_t* b, T* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const T d = HalfAt<T>(b + 208);
  for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<T>(sc[is]) * static_cast<T>(q1);
      y[l + 32] = d * static_cast<T>(sc[is + 2]) * static_cast<T>(q2);
      y[l + 64] = d * static_cast<T>(sc[is + 4]) * static_cast<T>(q3);
      y[l + 96] = d * static_cast<T>(sc[is + 6]) * static_cast<T>(q4);
    }
  }
}

// ---- 4-bit non-linear types (i-quants) ----

// The 16 values a nibble of iq4_nl and iq4_xs selects (ggml's kvalues_iq4nl): a
// non-uniform grid, denser near zero, that fits normally distributed weights better than
// q4_0's even steps.
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// iq4_nl (18 bytes): f16 d, qs[16] as q4_0's; x = d · kIQ4Values[nibble] (exact).
template <typename T>
inline void DecodeIQ4_NL(const uint8_t* b, T* y) {
  const T d = HalfAt<T>(b);
  const uint8_t* qs = b + 2;
  for (int l = 0; l < 16; ++l) {
    y[l] = d * static_cast<T>(kIQ4Values[qs[l] & 0xF]);
    y[l + 16] = d * static_cast<T>(kIQ4Values[qs[l] >> 4]);
  }
}

// iq4_xs's 6-bit scale of sub-block j (of 8, 32 elements each), stored biased by 32: low 4
// bits in nibble j%2 of scales_l[j/2] (byte 4 + j/2), top 2 bits at bits 2j of the 16-bit
// scales_h (bytes 2–3). Returns the unbiased scale (−32 … 31).
inline int ScaleIQ4XS(int j, const uint8_t* b) {
  const int scales_h = b[2] | (b[3] << 8);
  const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0xF;
  return (low | (((scales_h >> (2 * j)) & 3) << 4)) - 32;
}

// iq4_xs (136 bytes): f16 d, scales_h (16 bits), scales_l[4], qs[128]. Sub-blocks of 32,
// each over 16 bytes of qs laid out as an iq4_nl block's; x = (d·sc) · kIQ4Values[nibble],
// both products exact (11 significant bits of d, 5 of |sc| < 32 or 1 of 32, 7 of the value).
template <typename T>
inline void DecodeIQ4_XS(const uint8_t* b, T* y) {
  const T d = HalfAt<T>(b);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 8; ++j, y += 32, qs += 16) {
    const T dl = d * static_cast<T>(ScaleIQ4XS(j, b));
    for (int l = 0; l < 16; ++l) {
      y[l] = dl * static_cast<T>(kIQ4Values[qs[l] & 0xF]);
      y[l + 16] = dl * static_cast<T>(kIQ4Values[qs[l] >> 4]);
    }
  }
}

// Where a block's f16 fields lie: its scale d, and its min (dmin, or q4_1's and q5_1's m)
// or −1. For tools that build blocks (tests, benchmarks).
struct BlockHalves {
  int d_at;
  int min_at;
};
constexpr BlockHalves BlockHalvesOf(DType t) {
  switch (t) {
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ5_0:
    case DType::kIQ4_NL:
    case DType::kIQ4_XS:
      return {0, -1};
    case DType::kQ4_1:
    case DType::kQ5_1:
    case DType::kQ4_K:
    case DType::kQ5_K:
      return {0, 2};
    case DType::kQ2_K:
      return {80, 82};
    case DType::kQ3_K:
      return {108, -1};
    case DType::kQ6_K:
      return {208, -1};
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      break;
  }
  return {-1, -1};
}

// `blocks` consecutive blocks of block type t from src into out (DTypeBlockSize(t) each).
template <typename T>
inline void DecodeBlocks(DType t, const uint8_t* src, int64_t blocks, T* out) {
  const DTypeBlock shape = DTypeBlockOf(t);
  auto each = [&](auto decode) {
    for (int64_t i = 0; i < blocks; ++i) decode(src + i * shape.bytes, out + i * shape.elems);
  };
  switch (t) {
    case DType::kQ8_0:
      return each(DecodeQ8_0<T>);
    case DType::kQ4_0:
      return each(DecodeQ4_0<T>);
    case DType::kQ4_1:
      return each(DecodeQ4_1<T>);
    case DType::kQ5_0:
      return each(DecodeQ5_0<T>);
    case DType::kQ5_1:
      return each(DecodeQ5_1<T>);
    case DType::kQ2_K:
      return each(DecodeQ2_K<T>);
    case DType::kQ3_K:
      return each(DecodeQ3_K<T>);
    case DType::kQ4_K:
      return each(DecodeQ4_K<T>);
    case DType::kQ5_K:
      return each(DecodeQ5_K<T>);
    case DType::kQ6_K:
      return each(DecodeQ6_K<T>);
    case DType::kIQ4_NL:
      return each(DecodeIQ4_NL<T>);
    case DType::kIQ4_XS:
      return each(DecodeIQ4_XS<T>);
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      return;  // not block types
  }
}

}  // namespace
}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_GGML_QUANTS_H_
