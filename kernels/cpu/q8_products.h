// Products of block-quantised weights with 8-bit activations: CpuBackend's opt-in
// int8-activation mode (SetInt8Activations; the server's and the CLI's
// --int8-activations), llama.cpp's trade of exactness for speed. This file has the
// scheme of the 32-element types (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl) and the weights'
// integer form that both schemes unpack; q8k_products.h has the 256-element types' scheme
// (activations per 256 as llama.cpp's q8_K, integer scales), which multiplies many rows at
// once far faster.
//
// The activations are rounded as ggml's quantize_row_q8_0 rounds them: per block of 32,
// d = max|x| / 127 and a = roundf(x / d) (as x · (1/d), in float), so x ≈ d · a with
// |a| ≤ 127; the scale d stays a float (ggml rounds it to f16). The weights stay exact:
// each block type is rewritten as unsigned integer quants q with, per 16 elements, a scale
// and an offset such that weight = scale · q − offset, exactly the value its decoder in
// kernels/ggml_quants.h gives (before the decoder's one rounding, for q6_K). Then
//
//   Σ_i w_i · d_i·a_i = Σ_s d_s · (scale_s · Σ_{i∈s} q_i·a_i − offset_s · Σ_{i∈s} a_i),
//
// the inner sums exact in integers (AVX-512 VNNI: 64 products an instruction), the rest in
// float. The error against the exact product is the activations' rounding, at most d/2 an
// element (tests/kernels/cpu/q8_products_test.cc checks both).
//
// Like simd.h, included only by files compiled with -march=native where the build allows
// it (cpu_int8.cc), inside an anonymous namespace.
#ifndef KVLENS_KERNELS_CPU_Q8_PRODUCTS_H_
#define KVLENS_KERNELS_CPU_Q8_PRODUCTS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/cpu/simd.h"
#include "kernels/cpu/weight_rows.h"
#include "kernels/dtype.h"
#include "kernels/ggml_quants.h"

namespace kvlens::kernels {
namespace {

// Elements of a unit: one super-block of a k-quant, eight blocks of the 32-element types.
constexpr int kQ8Unit = 256;
constexpr int kQ8Subs = kQ8Unit / 16;

// One activation row, quantised: a[k] for k < padded length (zeros past the row), and per
// block of 32 its scale d and Σ a.
struct Q8ActRow {
  const int8_t* a;
  const float* d;
  const int32_t* bsum;
};

// x[0 … in) (in a multiple of 32) into a[0 … padded), d and bsum [padded / 32]; padded is
// in rounded up to kQ8Unit. A block holding a NaN or an infinity gets d = NaN (the products
// that read it are NaN, as the exact products would be) and a = 0.
inline void QuantizeRowQ8(const float* x, int64_t in, int64_t padded, int8_t* a, float* d,
                          int32_t* bsum) {
  for (int64_t b = 0; b < padded; b += 32) {
    if (b >= in) {
      std::memset(a + b, 0, 32);
      d[b / 32] = 0.0f;
      bsum[b / 32] = 0;
      continue;
    }
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      const float v = std::fabs(x[b + i]);
      finite &= v <= std::numeric_limits<float>::max();
      amax = v > amax ? v : amax;
    }
    const float db = amax / 127.0f;
    const float id = finite && db != 0.0f ? 1.0f / db : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = finite ? static_cast<int>(std::roundf(x[b + i] * id)) : 0;
      a[b + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b / 32] = finite ? db : std::numeric_limits<float>::quiet_NaN();
    bsum[b / 32] = sum;
  }
}

// ---- The weights in integer form ----
//
// One unit of a weight row: quants q (unsigned, element order) and per 16 elements scale
// and offset with weight = scale · q − offset. Each Unpack* below writes one block's share
// (32 or 256 elements) from its bytes, following its Decode* in ggml_quants.h.
struct Q8WeightUnit {
  alignas(64) uint8_t q[kQ8Unit];
  alignas(64) float scale[kQ8Subs];
  alignas(64) float offset[kQ8Subs];
};

// q8_0: q + 128 (an unsigned byte), offset 128 · d.
inline void UnpackQ8_0(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const float d = HalfAt<float>(b);
  for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + l]) + 128);
  scale[0] = scale[1] = d;
  offset[0] = offset[1] = 128.0f * d;
}
// q4_0: the nibble, offset 8 · d. q4_1: the nibble, offset −m.
template <bool kMin>
inline void UnpackQ4(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const float d = HalfAt<float>(b);
  const uint8_t* qs = b + (kMin ? 4 : 2);
  for (int l = 0; l < 16; ++l) {
    q[l] = qs[l] & 0xF;
    q[l + 16] = qs[l] >> 4;
  }
  scale[0] = scale[1] = d;
  offset[0] = offset[1] = kMin ? -HalfAt<float>(b + 2) : 8.0f * d;
}
// q5_0: the 5-bit value, offset 16 · d. q5_1: offset −m.
template <bool kMin>
inline void UnpackQ5(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const float d = HalfAt<float>(b);
  uint32_t qh;
  std::memcpy(&qh, b + (kMin ? 4 : 2), 4);
  const uint8_t* qs = b + (kMin ? 8 : 6);
  for (int l = 0; l < 16; ++l) {
    q[l] = static_cast<uint8_t>((qs[l] & 0xF) | (((qh >> l) & 1u) << 4));
    q[l + 16] = static_cast<uint8_t>((qs[l] >> 4) | (((qh >> (l + 16)) & 1u) << 4));
  }
  scale[0] = scale[1] = d;
  offset[0] = offset[1] = kMin ? -HalfAt<float>(b + 2) : 16.0f * d;
}
// q2_K: the 2-bit value, scale d · sc, offset dmin · m.
inline void UnpackQ2_K(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = HalfAt<float>(b + 80), dmin = HalfAt<float>(b + 82);
  int is = 0;
  for (int n = 0; n < 2; ++n, qs += 32) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half, ++is, q += 16) {
        scale[is] = d * static_cast<float>(scales[is] & 0xF);
        offset[is] = dmin * static_cast<float>(scales[is] >> 4);
        for (int l = 0; l < 16; ++l) q[l] = (qs[16 * half + l] >> shift) & 3;
      }
    }
  }
}
// q3_K: low 2 bits + 4 · high bit (0 … 7), scale d · (sc − 32), offset 4 · scale.
inline void UnpackQ3_K(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const uint8_t* hm = b;
  const uint8_t* qs = b + 32;
  const uint8_t* packed = b + 96;
  const float d = HalfAt<float>(b + 108);
  for (int j = 0; j < 16; ++j) {
    scale[j] = d * static_cast<float>(ScaleK3(j, packed));
    offset[j] = 4.0f * scale[j];
  }
  uint8_t m = 1;
  for (int n = 0; n < 2; ++n, qs += 32) {
    for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
      for (int half = 0; half < 2; ++half, q += 16) {
        for (int l = 0; l < 16; ++l) {
          q[l] = static_cast<uint8_t>(((qs[16 * half + l] >> shift) & 3) |
                                      ((hm[16 * half + l] & m) ? 4 : 0));
        }
      }
    }
  }
}
// q4_K and q5_K: the 4- or 5-bit value, scale d · sc, offset dmin · m (per 32 elements).
template <bool kFifthBit>
inline void UnpackK4(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const float d = HalfAt<float>(b), dmin = HalfAt<float>(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (kFifthBit ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    ScaleMinK4(j, scales, &sc, &m);
    scale[2 * j] = scale[2 * j + 1] = d * static_cast<float>(sc);
    offset[2 * j] = offset[2 * j + 1] = dmin * static_cast<float>(m);
  }
  for (int j = 0; j < 8; j += 2, qs += 32, q += 64) {
    for (int l = 0; l < 32; ++l) {
      q[l] = qs[l] & 0xF;
      q[l + 32] = qs[l] >> 4;
      if constexpr (kFifthBit) {
        q[l] |= static_cast<uint8_t>(((qh[l] >> j) & 1) << 4);
        q[l + 32] |= static_cast<uint8_t>(((qh[l] >> (j + 1)) & 1) << 4);
      }
    }
  }
}
// q6_K: the 6-bit value (0 … 63), scale d · sc, offset 32 · scale.
inline void UnpackQ6_K(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = HalfAt<float>(b + 208);
  for (int j = 0; j < 16; ++j) {
    scale[j] = d * static_cast<float>(sc[j]);
    offset[j] = 32.0f * scale[j];
  }
  for (int n = 0; n < 2; ++n, q += 128, ql += 64, qh += 32) {
    for (int l = 0; l < 32; ++l) {
      q[l] = static_cast<uint8_t>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
      q[l + 32] = static_cast<uint8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
      q[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
      q[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
    }
  }
}

// iq4_nl and iq4_xs: the table value + 128 (an unsigned byte), offset 128 · the scale, as
// q8_0; iq4_xs's scale is d · sc per 32 elements.
inline void UnpackIQ4(const uint8_t* qs, float d, uint8_t* q, float* scale, float* offset) {
  for (int l = 0; l < 16; ++l) {
    q[l] = static_cast<uint8_t>(kIQ4Values[qs[l] & 0xF] + 128);
    q[l + 16] = static_cast<uint8_t>(kIQ4Values[qs[l] >> 4] + 128);
  }
  scale[0] = scale[1] = d;
  offset[0] = offset[1] = 128.0f * d;
}
inline void UnpackIQ4_XS(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  const float d = HalfAt<float>(b);
  for (int j = 0; j < 8; ++j) {
    UnpackIQ4(b + 8 + 16 * j, d * static_cast<float>(ScaleIQ4XS(j, b)), q + 32 * j, scale + 2 * j,
              offset + 2 * j);
  }
}

// Block type kType's Unpack*.
template <DType kType>
inline void UnpackBlock(const uint8_t* b, uint8_t* q, float* scale, float* offset) {
  if constexpr (kType == DType::kQ8_0) UnpackQ8_0(b, q, scale, offset);
  if constexpr (kType == DType::kQ4_0 || kType == DType::kQ4_1) {
    UnpackQ4<kType == DType::kQ4_1>(b, q, scale, offset);
  }
  if constexpr (kType == DType::kQ5_0 || kType == DType::kQ5_1) {
    UnpackQ5<kType == DType::kQ5_1>(b, q, scale, offset);
  }
  if constexpr (kType == DType::kQ2_K) UnpackQ2_K(b, q, scale, offset);
  if constexpr (kType == DType::kQ3_K) UnpackQ3_K(b, q, scale, offset);
  if constexpr (kType == DType::kQ4_K || kType == DType::kQ5_K) {
    UnpackK4<kType == DType::kQ5_K>(b, q, scale, offset);
  }
  if constexpr (kType == DType::kQ6_K) UnpackQ6_K(b, q, scale, offset);
  if constexpr (kType == DType::kIQ4_NL) UnpackIQ4(b + 2, HalfAt<float>(b), q, scale, offset);
  if constexpr (kType == DType::kIQ4_XS) UnpackIQ4_XS(b, q, scale, offset);
}

// Unit u (elements 256·u …) of a weight row of `in` elements in block type kType; a unit
// past the row's last block is zero (quants, scales and offsets).
template <DType kType>
inline void UnpackUnit(const uint8_t* row, int64_t in, int64_t u, Q8WeightUnit* out) {
  constexpr DTypeBlock shape = DTypeBlockOf(kType);
  const int64_t first = u * kQ8Unit;
  const int elems = static_cast<int>(std::min<int64_t>(kQ8Unit, in - first));
  const uint8_t* src = row + first / shape.elems * shape.bytes;
  if (elems < kQ8Unit) {
    std::memset(out->q + elems, 0, kQ8Unit - elems);
    for (int s = elems / 16; s < kQ8Subs; ++s) out->scale[s] = out->offset[s] = 0.0f;
  }
  for (int e = 0; e < elems; e += shape.elems, src += shape.bytes) {
    UnpackBlock<kType>(src, out->q + e, out->scale + e / 16, out->offset + e / 16);
  }
}

// ---- AVX-512 (BW, VL, VNNI): the unpacking in registers ----
//
// UnpackUnitFast writes the same unit as UnpackUnit (q8_products_test checks every type),
// for a whole unit; the unit past a 32-element type's last whole 256 takes UnpackUnit.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVLENS_Q8_VNNI 1
constexpr __mmask64 kAll64 = ~__mmask64{0};
constexpr __mmask32 kAll32 = ~__mmask32{0};  // the 16-bit lanes
inline __m512i U8And(__m512i a, int m) {
  return _mm512_maskz_and_epi32(kAll, a, _mm512_set1_epi8(static_cast<char>(m)));
}
// 32 bytes at p in both halves of a register.
inline __m512i Both32(const uint8_t* p) {
  return _mm512_maskz_broadcast_i64x4(static_cast<__mmask8>(0xFF),
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Each 16-bit lane shifted right by lo (lower 256 bits) or hi (upper 256 bits).
inline __m512i ShrHalves(__m512i v, int lo, int hi) {
  const __m512i n = _mm512_mask_blend_epi64(static_cast<__mmask8>(0xF0), _mm512_set1_epi16(lo),
                                            _mm512_set1_epi16(hi));
  return _mm512_maskz_srlv_epi16(kAll32, v, n);
}
// The byte mask of lanes whose byte in v has bit `lo` (lower 256 bits) or `hi` (upper) set.
inline __mmask64 BitHalves(__m512i v, int lo, int hi) {
  const __m512i m = _mm512_mask_blend_epi64(static_cast<__mmask8>(0xF0),
                                            _mm512_set1_epi8(static_cast<char>(1 << lo)),
                                            _mm512_set1_epi8(static_cast<char>(1 << hi)));
  return _mm512_mask_test_epi8_mask(kAll64, v, m);
}
inline __m512i AddWhere(__m512i v, __mmask64 where, int add) {
  return _mm512_mask_add_epi8(v, where, v, _mm512_set1_epi8(static_cast<char>(add)));
}
inline void StoreScales(Q8WeightUnit* out, Vec scale, Vec offset) {
  _mm512_store_ps(out->scale, scale);
  _mm512_store_ps(out->offset, offset);
}
// Per 16 elements, a 32-element block's f16 at byte `at` of each of 8 blocks `stride` apart.
inline Vec BlockHalves16(const uint8_t* b, int stride, int at) {
  // Eight scalar loads into one register (a gather measured slower on Zen 4), each half
  // doubled, widened.
  auto bits = [&](int j) {
    uint16_t v;
    std::memcpy(&v, b + j * stride + at, 2);
    return v;
  };
  __m128i h = _mm_setzero_si128();
  h = _mm_insert_epi16(h, bits(0), 0);
  h = _mm_insert_epi16(h, bits(1), 1);
  h = _mm_insert_epi16(h, bits(2), 2);
  h = _mm_insert_epi16(h, bits(3), 3);
  h = _mm_insert_epi16(h, bits(4), 4);
  h = _mm_insert_epi16(h, bits(5), 5);
  h = _mm_insert_epi16(h, bits(6), 6);
  h = _mm_insert_epi16(h, bits(7), 7);
  return _mm512_maskz_cvtph_ps(
      kAll, _mm256_set_m128i(_mm_unpackhi_epi16(h, h), _mm_unpacklo_epi16(h, h)));
}
// The 32-element types, 8 blocks: kQuants(block, q) writes its 32 quants.
template <int kStride, int kMinAt, typename Quants>
inline void UnpackBlocks8(const uint8_t* b, float offset_of_d, Q8WeightUnit* out, Quants quants) {
  for (int j = 0; j < 8; ++j) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(out->q + 32 * j), quants(b + kStride * j));
  }
  const Vec d = BlockHalves16(b, kStride, 0);
  const Vec offset = kMinAt < 0
                         ? _mm512_mul_ps(_mm512_set1_ps(offset_of_d), d)
                         : _mm512_sub_ps(_mm512_setzero_ps(), BlockHalves16(b, kStride, kMinAt));
  StoreScales(out, d, offset);
}
// 16 packed nibbles at p as 32 bytes: the low nibbles, then the high ones.
inline __m256i Nibbles32(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0xF));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0xF));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}
// q5_0 and q5_1: the nibbles plus 16 where bit l of the 32-bit qh is set.
inline __m256i Quants5(const uint8_t* qh, const uint8_t* qs) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  return _mm256_mask_add_epi8(Nibbles32(qs), h, Nibbles32(qs), _mm256_set1_epi8(16));
}

// iq4_nl and iq4_xs: 16 packed nibbles at p as 32 table values + 128 (Nibbles32's order).
inline __m256i IQ4Quants32(const uint8_t* p) {
  const __m128i table = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)),
                                     _mm_set1_epi8(static_cast<char>(128)));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), Nibbles32(p));
}
// kFloatScales false: the quants only (q8k_products.h makes its own integer scales).
template <DType kType, bool kFloatScales = true>
inline void UnpackUnitFast(const uint8_t* b, Q8WeightUnit* out) {
  if constexpr (kType == DType::kQ8_0) {
    UnpackBlocks8<34, -1>(b, 128.0f, out, [](const uint8_t* p) {
      return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)),
                              _mm256_set1_epi8(static_cast<char>(0x80)));
    });
  } else if constexpr (kType == DType::kQ4_0) {
    UnpackBlocks8<18, -1>(b, 8.0f, out, [](const uint8_t* p) { return Nibbles32(p + 2); });
  } else if constexpr (kType == DType::kQ4_1) {
    UnpackBlocks8<20, 2>(b, 0.0f, out, [](const uint8_t* p) { return Nibbles32(p + 4); });
  } else if constexpr (kType == DType::kQ5_0) {
    UnpackBlocks8<22, -1>(b, 16.0f, out, [](const uint8_t* p) { return Quants5(p + 2, p + 6); });
  } else if constexpr (kType == DType::kQ5_1) {
    UnpackBlocks8<24, 2>(b, 0.0f, out, [](const uint8_t* p) { return Quants5(p + 4, p + 8); });
  } else if constexpr (kType == DType::kQ2_K) {
    // Chunk c: qs[32·(c/2) …] shifted by 4·(c%2) (first 32) and 4·(c%2) + 2 (last 32).
    for (int c = 0; c < 4; ++c) {
      const __m512i v = Both32(b + 16 + 32 * (c / 2));
      _mm512_store_si512(out->q + 64 * c, U8And(ShrHalves(v, 4 * (c % 2), 4 * (c % 2) + 2), 3));
    }
    const __m512i sc = WidenBytes(b);
    if constexpr (kFloatScales)
      StoreScales(out,
                  _mm512_mul_ps(_mm512_set1_ps(HalfToFloat(b + 80)),
                                ToFloat(I32And(sc, _mm512_set1_epi32(0xF)))),
                  _mm512_mul_ps(_mm512_set1_ps(HalfToFloat(b + 82)), ToFloat(I32Shr(sc, 4))));
  } else if constexpr (kType == DType::kQ3_K) {
    // As q2_K, plus 4 where hmask's bit 2c (first 32) or 2c + 1 (last 32) is set.
    const __m512i hm = Both32(b);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = Both32(b + 32 + 32 * (c / 2));
      const __m512i low2 = U8And(ShrHalves(v, 4 * (c % 2), 4 * (c % 2) + 2), 3);
      _mm512_store_si512(out->q + 64 * c, AddWhere(low2, BitHalves(hm, 2 * c, 2 * c + 1), 4));
    }
    const uint8_t* packed = b + 96;
    const float d = HalfToFloat(b + 108);
    for (int j = 0; j < 16 && kFloatScales; ++j) {
      out->scale[j] = d * static_cast<float>(ScaleK3(j, packed));
      out->offset[j] = 4.0f * out->scale[j];
    }
  } else if constexpr (kType == DType::kQ4_K || kType == DType::kQ5_K) {
    // Chunk c: qs[32c …]'s low nibbles (sub-block 2c), then its high ones (2c + 1).
    constexpr bool kFifth = kType == DType::kQ5_K;
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    const __m512i qh = kFifth ? Both32(b + 16) : _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i q = U8And(ShrHalves(Both32(qs + 32 * c), 0, 4), 0xF);
      if constexpr (kFifth) q = AddWhere(q, BitHalves(qh, 2 * c, 2 * c + 1), 16);
      _mm512_store_si512(out->q + 64 * c, q);
    }
    const Vec sm = ScalesK4(b);  // [d·sc_0 … d·sc_7, dmin·m_0 … dmin·m_7]
    const __m512i at = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    if constexpr (kFloatScales)
      StoreScales(
          out, _mm512_maskz_permutexvar_ps(kAll, at, sm),
          _mm512_maskz_permutexvar_ps(kAll, _mm512_add_epi32(at, _mm512_set1_epi32(8)), sm));
  } else if constexpr (kType == DType::kIQ4_NL) {
    UnpackBlocks8<18, -1>(b, 128.0f, out, [](const uint8_t* p) { return IQ4Quants32(p + 2); });
  } else if constexpr (kType == DType::kIQ4_XS) {
    for (int j = 0; j < 8; ++j) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(out->q + 32 * j), IQ4Quants32(b + 8 + 16 * j));
    }
    const Vec scale =
        ScalesIQ4XS(b, _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
    if constexpr (kFloatScales)
      StoreScales(out, scale, _mm512_mul_ps(_mm512_set1_ps(128.0f), scale));
  } else if constexpr (kType == DType::kQ6_K) {
    // Chunk c (n = c/2): ql[64n …]'s low nibbles (c even) or high ones, plus qh[32n …]'s
    // bits 4·(c%2) (first 32) and 4·(c%2) + 2 (last 32) as the value's bits 4 and 5.
    for (int c = 0; c < 4; ++c) {
      const int n = c / 2, g = c % 2;
      const __m512i ql = _mm512_loadu_si512(b + 64 * n);
      const __m512i low4 = U8And(g ? _mm512_maskz_srli_epi16(kAll32, ql, 4) : ql, 0xF);
      const __m512i high2 = U8And(ShrHalves(Both32(b + 128 + 32 * n), 4 * g, 4 * g + 2), 3);
      _mm512_store_si512(
          out->q + 64 * c,
          _mm512_maskz_or_epi32(kAll, low4, _mm512_maskz_slli_epi16(kAll32, high2, 4)));
    }
    const Vec scale =
        _mm512_mul_ps(_mm512_set1_ps(HalfToFloat(b + 208)),
                      ToFloat(_mm512_maskz_cvtepi8_epi32(
                          kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
    if constexpr (kFloatScales)
      StoreScales(out, scale, _mm512_mul_ps(_mm512_set1_ps(32.0f), scale));
  }
}

// Unit u of a row, through UnpackUnitFast where the unit is whole.
template <DType kType>
inline void UnpackUnitOf(const uint8_t* row, int64_t in, int64_t u, Q8WeightUnit* out) {
  if ((u + 1) * kQ8Unit > in) return UnpackUnit<kType>(row, in, u, out);
  constexpr DTypeBlock shape = DTypeBlockOf(kType);
  UnpackUnitFast<kType>(row + u * kQ8Unit / shape.elems * shape.bytes, out);
}
#else
template <DType kType>
inline void UnpackUnitOf(const uint8_t* row, int64_t in, int64_t u, Q8WeightUnit* out) {
  UnpackUnit<kType>(row, in, u, out);
}
#endif

// ---- The products ----
//
// Block b of a unit (32 elements, weight = D_b · (q − o) + M_b with o the type's offset
// and M_b its min, zero for the types without) and an activation row's block (d_b, a):
//   I_b = Σ (q_i − o) · a_i and B_b = Σ a_i, exact integers;
//   t_b = fma(I_b, D_b · d_b, 0) (the product, never contracted into the sums below), then
//   for the types with mins t_b ← fma(B_b, M_b · d_b, t_b);
// a unit's share is ((t_0 + t_1) + (t_2 + t_3)) + ((t_4 + t_5) + (t_6 + t_7)), and a row's
// output the sum of its units' shares in order, then the bias. Q8BlockUnit computes it
// along k for a few rows, Q8BGemmTile with 16 rows in a vector's lanes: the same float
// operations, so a row's result does not depend on the rows beside it (batching never
// changes results).

// The type's quant offset o (UnpackUnit's quants are q = o + the signed value) and whether
// it has mins (q4_1, q5_1: weight = d · q + m).
constexpr int Q8BOffset(DType t) {
  return t == DType::kQ8_0 || t == DType::kIQ4_NL ? 128
         : t == DType::kQ4_0                      ? 8
         : t == DType::kQ5_0                      ? 16
                                                  : 0;
}
constexpr bool Q8BHasMins(DType t) { return t == DType::kQ4_1 || t == DType::kQ5_1; }

#if defined(KVLENS_Q8_VNNI)
// Quarter q (128 bits) of the result holds [v0, v1, v2, v3]'s sums over their quarter q.
inline __m512i QuarterSums4(const __m512i* v) {
  constexpr __mmask16 kAll16 = 0xFFFF;
  constexpr __mmask8 kAll8 = 0xFF;
  const __m512i t01 = _mm512_add_epi32(_mm512_maskz_unpacklo_epi32(kAll16, v[0], v[1]),
                                       _mm512_maskz_unpackhi_epi32(kAll16, v[0], v[1]));
  const __m512i t23 = _mm512_add_epi32(_mm512_maskz_unpacklo_epi32(kAll16, v[2], v[3]),
                                       _mm512_maskz_unpackhi_epi32(kAll16, v[2], v[3]));
  return _mm512_add_epi32(_mm512_maskz_unpacklo_epi64(kAll8, t01, t23),
                          _mm512_maskz_unpackhi_epi64(kAll8, t01, t23));
}

// [b_0 … b_7]: b_2c the sum of p[c]'s lanes 0 … 7, b_2c+1 of its lanes 8 … 15.
inline __m256i BlockSums8(const __m512i* p) {
  constexpr __mmask16 kAll16 = 0xFFFF;
  const __m512i t = QuarterSums4(p);
  // Quarters 0 + 1: the even blocks; 2 + 3: the odd ones.
  // Through memory: GCC 12's 512-bit extracts warn spuriously (as VSum's).
  alignas(64) int32_t q[16];
  _mm512_store_si512(q, _mm512_add_epi32(t, _mm512_maskz_shuffle_i32x4(kAll16, t, t, 0xB1)));
  const __m128i even = _mm_load_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i odd = _mm_load_si128(reinterpret_cast<const __m128i*>(q + 8));
  return _mm256_set_m128i(_mm_unpackhi_epi32(even, odd), _mm_unpacklo_epi32(even, odd));
}
// ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)).
inline float TreeSum8(__m256 t) {
  const __m256 p = _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m256 q = _mm256_add_ps(p, _mm256_permute_ps(p, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}
#endif

// acc[r] += unit u's share for NR activation rows x[0 … NR).
template <int kOffset, bool kMins, int NR>
[[gnu::always_inline]] inline void Q8BlockUnit(const Q8WeightUnit& w, const Q8ActRow* x, int64_t u,
                                               float* acc) {
#if defined(KVLENS_Q8_VNNI)
  constexpr __mmask16 kAll16 = 0xFFFF;
  // Per block the first of its two per-16 values: lanes 0, 2, … 14 of v.
  auto evens = [](const float* v) {
    const __m256 pairs =
        _mm256_shuffle_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8), _MM_SHUFFLE(2, 0, 2, 0));
    return _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(pairs), _MM_SHUFFLE(3, 1, 2, 0)));
  };
  const __m256 D = evens(w.scale);
  // M_b = −offset (UnpackQ4<true> and UnpackQ5<true> store offset = −m), negated as the
  // scalar code and the tile negate (the sign bit flipped).
  const __m256 M =
      kMins ? _mm256_xor_ps(_mm256_set1_ps(-0.0f), evens(w.offset)) : _mm256_setzero_ps();
  __m512i q[4];
#pragma GCC unroll 4
  for (int ch = 0; ch < 4; ++ch) q[ch] = _mm512_load_si512(w.q + 64 * ch);
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const int8_t* a = x[r].a + u * kQ8Unit;
    __m512i p[4];
#pragma GCC unroll 4
    for (int ch = 0; ch < 4; ++ch) {
      p[ch] = _mm512_maskz_dpbusd_epi32(kAll16, _mm512_setzero_si512(), q[ch],
                                        _mm512_loadu_si512(a + 64 * ch));
    }
    __m256i I = BlockSums8(p);
    const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r].bsum + u * 8));
    const __m256 dv = _mm256_loadu_ps(x[r].d + u * 8);
    if constexpr (!kMins) {
      static_assert(kOffset > 0 && (kOffset & (kOffset - 1)) == 0);
      I = _mm256_sub_epi32(I, _mm256_slli_epi32(B, __builtin_ctz(kOffset)));
    }
    // The product as an FMA with zero: a plain product feeding the sums below could be
    // contracted into an FMA one way here and another way in the tile.
    __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(D, dv), _mm256_setzero_ps());
    if constexpr (kMins) t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(B), _mm256_mul_ps(M, dv), t);
    acc[r] = acc[r] + TreeSum8(t);
  }
#else
  for (int r = 0; r < NR; ++r) {
    const int8_t* a = x[r].a + u * kQ8Unit;
    float t[8];
    for (int b = 0; b < 8; ++b) {
      int32_t dot = 0;
      for (int i = 32 * b; i < 32 * b + 32; ++i) {
        dot += (static_cast<int32_t>(w.q[i]) - kOffset) * a[i];
      }
      const float db = x[r].d[u * 8 + b];
      t[b] = std::fma(static_cast<float>(dot), w.scale[2 * b] * db, 0.0f);
      if constexpr (kMins) {
        t[b] = std::fma(static_cast<float>(x[r].bsum[u * 8 + b]), -w.offset[2 * b] * db, t[b]);
      }
    }
    acc[r] = acc[r] + (((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7])));
  }
#endif
}

#if defined(KVLENS_Q8_VNNI)
// ---- Many rows: 16 rows a vector ----

// The fewest rows the tiles take (CpuBackend::MatMulTiled), and the rows of a packed group,
// one a lane.
constexpr int kQ8TileRows = 16;

// One weight unit as the tile reads it: the signed quants q − o (broadcast 4 at a time), per
// block D, M and corr = 128 · Σ (q − o), which takes back the + 128 of the tile's unsigned
// activations.
struct Q8BGemmUnit {
  alignas(64) int8_t w[kQ8Unit];
  float D[8], M[8];
  int32_t corr[8];
};

template <int kOffset, bool kMins>
inline void ToQ8BGemmUnit(const Q8WeightUnit& u, Q8BGemmUnit* g) {
  for (int ch = 0; ch < 4; ++ch) {
    _mm512_store_si512(g->w + 64 * ch,
                       _mm512_maskz_sub_epi8(~__mmask64{0}, _mm512_load_si512(u.q + 64 * ch),
                                             _mm512_set1_epi8(static_cast<char>(kOffset))));
  }
  for (int b = 0; b < 8; ++b) {
    int32_t sum = 0;
    for (int i = 32 * b; i < 32 * b + 32; ++i) sum += g->w[i];
    g->corr[b] = 128 * sum;
    g->D[b] = u.scale[2 * b];
    g->M[b] = kMins ? -u.offset[2 * b] : 0.0f;
  }
}

// A group of up to 16 activation rows' unit u as the tile reads it: A[t] holds in lane r
// row r's elements 4t … 4t + 3 as unsigned bytes a + 128; per block d and Σ a, one row a
// lane. Missing rows are zeros (a = 0, d = 0).
struct Q8BGemmAct {
  alignas(64) uint8_t A[kQ8Unit / 4][64];
  alignas(64) float d[8][16];
  alignas(64) int32_t bsum[8][16];
};

inline void PackQ8BGroup(const Q8ActRow* rows, int count, int64_t u, Q8BGemmAct* p) {
  for (int r = 0; r < 16; ++r) {
    const bool real = r < count;
    for (int t = 0; t < kQ8Unit / 4; ++t) {
      uint32_t v = 0;
      if (real) std::memcpy(&v, rows[r].a + u * kQ8Unit + 4 * t, 4);
      v ^= 0x80808080u;
      std::memcpy(&p->A[t][4 * r], &v, 4);
    }
    for (int b = 0; b < 8; ++b) {
      p->d[b][r] = real ? rows[r].d[u * 8 + b] : 0.0f;
      p->bsum[b][r] = real ? rows[r].bsum[u * 8 + b] : 0;
    }
  }
}

// y[c] (lane r: row r) = Σ over the units of weight rows w[c] (units each) with a packed
// group (units Q8BGemmAct), in Q8BlockUnit's order.
template <int W, bool kMins>
inline void Q8BGemmTile(const Q8BGemmAct* act, int64_t units, const Q8BGemmUnit* const* w,
                        __m512 (&y)[W]) {
  constexpr __mmask16 kAll16 = 0xFFFF;
#pragma GCC unroll 8
  for (int c = 0; c < W; ++c) y[c] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    const Q8BGemmAct& p = act[u];
    __m512 t_even[W], pair_even[W], quad_even[W];
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      __m512i acc[W];
#pragma GCC unroll 8
      for (int c = 0; c < W; ++c) acc[c] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const int t = 8 * b + i;
        const __m512i a = _mm512_load_si512(p.A[t]);
#pragma GCC unroll 8
        for (int c = 0; c < W; ++c) {
          int32_t q4;
          std::memcpy(&q4, w[c][u].w + 4 * t, 4);
          acc[c] = _mm512_maskz_dpbusd_epi32(kAll16, acc[c], a, _mm512_set1_epi32(q4));
        }
      }
      const __m512 dv = _mm512_load_ps(p.d[b]);
#pragma GCC unroll 8
      for (int c = 0; c < W; ++c) {
        const __m512i I =
            _mm512_maskz_sub_epi32(kAll16, acc[c], _mm512_set1_epi32(w[c][u].corr[b]));
        __m512 t =
            _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAll16, I),
                            _mm512_mul_ps(dv, _mm512_set1_ps(w[c][u].D[b])), _mm512_setzero_ps());
        if constexpr (kMins) {
          t = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAll16, _mm512_load_si512(p.bsum[b])),
                              _mm512_mul_ps(dv, _mm512_set1_ps(w[c][u].M[b])), t);
        }
        if (b % 2 == 0) {
          t_even[c] = t;
          continue;
        }
        const __m512 pair = _mm512_add_ps(t_even[c], t);
        if (b % 4 == 1) {
          pair_even[c] = pair;
          continue;
        }
        const __m512 quad = _mm512_add_ps(pair_even[c], pair);
        if (b == 3) {
          quad_even[c] = quad;
        } else {
          y[c] = _mm512_add_ps(y[c], _mm512_add_ps(quad_even[c], quad));
        }
      }
    }
  }
}

#endif

// The 32-element types' scheme, as CpuBackend::MatMulInt8 and MatMulTiled drive it: the
// activation row's buffers (a padded to whole units, d and Σ a per block), the weight unit
// along k and a unit's step for NR rows, and the 16-row tile's parts.
template <DType kType>
struct Q8BScheme {
  using Row = Q8ActRow;
  using Unit = Q8WeightUnit;
  static int64_t Padded(int64_t in) { return (in + kQ8Unit - 1) / kQ8Unit * kQ8Unit; }
  static int64_t Scales(int64_t in) { return Padded(in) / 32; }
  static int64_t Sums(int64_t in) { return Padded(in) / 32; }
  static void Quantize(const float* x, int64_t in, int8_t* a, float* d, int32_t* bsum) {
    QuantizeRowQ8(x, in, Padded(in), a, d, bsum);
  }
  static Row RowAt(int8_t* a, float* d, int32_t* bsum) { return Row{a, d, bsum}; }
  static void UnpackUnit(const uint8_t* row, int64_t in, int64_t u, Unit* out) {
    UnpackUnitOf<kType>(row, in, u, out);
  }
  template <int NR>
  static void Step(const Unit& w, const Row* x, int64_t u, float* acc) {
    Q8BlockUnit<Q8BOffset(kType), Q8BHasMins(kType), NR>(w, x, u, acc);
  }
#if defined(KVLENS_Q8_VNNI)
  using Act = Q8BGemmAct;
  using TileUnit = Q8BGemmUnit;
  static constexpr int kCols = 4;  // weight rows a tile: 4 × 5 vectors of state
  static void Pack(const Row* rows, int count, int64_t u, Act* p) {
    PackQ8BGroup(rows, count, u, p);
  }
  static void UnpackTile(const uint8_t* row, int64_t in, int64_t u, TileUnit* g) {
    Q8WeightUnit tmp;
    UnpackUnitOf<kType>(row, in, u, &tmp);
    ToQ8BGemmUnit<Q8BOffset(kType), Q8BHasMins(kType)>(tmp, g);
  }
  template <int W>
  static void Tile(const Act* act, int64_t units, const TileUnit* const* w, __m512 (&y)[W]) {
    Q8BGemmTile<W, Q8BHasMins(kType)>(act, units, w, y);
  }
#endif
};

}  // namespace
}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_Q8_PRODUCTS_H_
