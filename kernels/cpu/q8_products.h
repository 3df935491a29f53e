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
// it (cpu_backend.cc), inside an anonymous namespace.
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
// 16 elements the block's scale d and d · Σ a over the 16.
struct Q8ActRow {
  const int8_t* a;
  const float* d16;
  const float* s16;
};

// x[0 … in) (in a multiple of 32) into a[0 … padded), d16 and s16 [padded / 16]; padded is
// in rounded up to kQ8Unit. A block holding a NaN or an infinity gets d = NaN (the products
// that read it are NaN, as the exact products would be).
inline void QuantizeRowQ8(const float* x, int64_t in, int64_t padded, int8_t* a, float* d16,
                          float* s16) {
  for (int64_t b = 0; b < padded; b += 32) {
    if (b >= in) {
      std::memset(a + b, 0, 32);
      d16[b / 16] = d16[b / 16 + 1] = 0.0f;
      s16[b / 16] = s16[b / 16 + 1] = 0.0f;
      continue;
    }
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      const float v = std::fabs(x[b + i]);
      finite &= v <= std::numeric_limits<float>::max();
      amax = v > amax ? v : amax;
    }
    float d = amax / 127.0f;
    const float id = finite && d != 0.0f ? 1.0f / d : 0.0f;
    int sum[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::roundf(x[b + i] * id));
      a[b + i] = static_cast<int8_t>(v);
      sum[i / 16] += v;
    }
    if (!finite) d = std::numeric_limits<float>::quiet_NaN();
    for (int h = 0; h < 2; ++h) {
      d16[b / 16 + h] = d;
      s16[b / 16 + h] = d * static_cast<float>(sum[h]);
    }
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

// fn(unpack) with unpack(row, in, u, out) = UnpackUnitOf<t>.
template <typename Fn>
inline void VisitUnpacker(DType t, Fn&& fn) {
  VisitBlockType(t, [&](auto type) { fn(UnpackUnitOf<decltype(type)::value>); });
}

// ---- The products ----
//
// acc[r] += unit u's share of Σ_i w_i · x_r,i for NR activation rows. A row's accumulator
// takes the same operations in the same order whatever NR is, so a row's result does not
// depend on the rows beside it (batching never changes results).
#if defined(KVLENS_Q8_VNNI)
using Q8Acc = __m512;
inline Q8Acc Q8Zero() { return _mm512_setzero_ps(); }
inline float Q8Sum(Q8Acc v) { return VSum(v); }

template <int NR>
[[gnu::always_inline]] inline void Q8DotUnit(const Q8WeightUnit& w, const Q8ActRow* x, int64_t u,
                                             Q8Acc* acc) {
  constexpr __mmask16 kAll16 = 0xFFFF;
  const __m512 scale = _mm512_load_ps(w.scale);
  const __m512 neg_offset = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_load_ps(w.offset));
  // The unit's share in two partial sums (even and odd chunks), so that the chains of
  // fused multiply-adds a row waits on are short.
  Q8Acc cs[NR], part[NR][2];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    // −Σ offset · d · Σa over the unit's sub-blocks.
    part[r][0] = _mm512_mul_ps(neg_offset, _mm512_loadu_ps(x[r].s16 + u * kQ8Subs));
    part[r][1] = _mm512_setzero_ps();
    cs[r] = _mm512_mul_ps(scale, _mm512_loadu_ps(x[r].d16 + u * kQ8Subs));
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    // Lane j of a 64-element chunk's dot holds elements 4j … 4j + 3: sub-block 4c + j/4.
    const __m512i idx = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1,
                                          4 * c + 1, 4 * c + 1, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                                          4 * c + 2, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3);
    const __m512i q = _mm512_load_si512(w.q + 64 * c);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512i a = _mm512_loadu_si512(x[r].a + u * kQ8Unit + 64 * c);
      const __m512i dot = _mm512_maskz_dpbusd_epi32(kAll16, _mm512_setzero_si512(), q, a);
      const Vec term = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(kAll16, dot),
                                     _mm512_maskz_permutexvar_ps(kAll16, idx, cs[r]));
      part[r][c % 2] = _mm512_add_ps(part[r][c % 2], term);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
    acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(part[r][0], part[r][1]));
}
#else
using Q8Acc = float;
inline Q8Acc Q8Zero() { return 0.0f; }
inline float Q8Sum(Q8Acc v) { return v; }

template <int NR>
inline void Q8DotUnit(const Q8WeightUnit& w, const Q8ActRow* x, int64_t u, Q8Acc* acc) {
  for (int r = 0; r < NR; ++r) {
    const int8_t* a = x[r].a + u * kQ8Unit;
    const float* d16 = x[r].d16 + u * kQ8Subs;
    const float* s16 = x[r].s16 + u * kQ8Subs;
    for (int s = 0; s < kQ8Subs; ++s) {
      int32_t dot = 0;
      for (int i = 0; i < 16; ++i) dot += static_cast<int32_t>(w.q[16 * s + i]) * a[16 * s + i];
      acc[r] += w.scale[s] * d16[s] * static_cast<float>(dot) - w.offset[s] * s16[s];
    }
  }
}
#endif

}  // namespace
}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_Q8_PRODUCTS_H_
