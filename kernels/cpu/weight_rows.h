// The CPU products' weight-row readers: a stored weight row as DotTile reads it, widened to
// floats in registers (f32, bf16, f16, q8_0, and on AVX-512 all of ggml's other block
// types), and which dtypes have one. Like simd.h, included only by the files compiled
// with -march=native where the build allows it (cpu_backend.cc), and inside an anonymous
// namespace, so code built for different instruction sets never meets in one inline
// function.
#ifndef KVLENS_KERNELS_CPU_WEIGHT_ROWS_H_
#define KVLENS_KERNELS_CPU_WEIGHT_ROWS_H_

#include <cstdint>
#include <cstring>

#include "kernels/cpu/simd.h"
#include "kernels/dtype.h"
#include "kernels/ggml_quants.h"

namespace kvlens::kernels {
namespace {

// A weight row as DotTile reads it: kLanes weights from k as floats (Load), or one (At).
// Each gives exactly DequantizeRowFast's floats (a q8_0 weight is d · q, one rounding), so
// a product reads the stored row in place or a dequantised copy with the same result.
struct F32Row {
  const uint8_t* p;  // as the other rows: a WeightView's bytes, or a float copy's
  const float* f() const { return reinterpret_cast<const float*>(p); }
  Vec Load(int64_t k) const { return VLoad(f() + k); }
  float At(int64_t k) const { return f()[k]; }
};
struct Bf16Row {
  const uint8_t* p;
  Vec Load(int64_t k) const { return VLoad(reinterpret_cast<const uint16_t*>(p + 2 * k)); }
  float At(int64_t k) const {
    uint16_t b;
    std::memcpy(&b, p + 2 * k, 2);
    return BF16ToF32(b);
  }
};
struct F16Row {
  const uint8_t* p;
  float At(int64_t k) const {
    uint16_t h;
    std::memcpy(&h, p + 2 * k, 2);
    return F16ToF32(h);
  }
  Vec Load(int64_t k) const {
#if defined(__AVX512F__)
    // The masked forms here: GCC 12's plain ones warn spuriously (as in VLoad above).
    return _mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xFFFF),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * k)));
#elif defined(__AVX2__) && defined(__FMA__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * k)));
#else
    Vec v;
    for (int i = 0; i < kLanes; ++i) v.l[i] = At(k + i);
    return v;
#endif
  }
};
struct Q8Row {  // k and k + kLanes − 1 in one block of kQ8_0BlockSize
  const uint8_t* p;
#if defined(__AVX512F__)
  // kLanes quants times the scale d: d · q, one rounding, as DequantizeRowFast.
  static Vec Widened(const int8_t* q, Vec d) {
    const __m512 f = _mm512_maskz_cvtepi32_ps(
        static_cast<__mmask16>(0xFFFF),
        _mm512_maskz_cvtepi8_epi32(static_cast<__mmask16>(0xFFFF),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    return _mm512_mul_ps(d, f);
  }
  // A whole block from k (a multiple of kQ8_0BlockSize = 2 · kLanes), its scale read once.
  void LoadBlock(int64_t k, Vec& lo, Vec& hi) const {
    const Vec d = _mm512_set1_ps(Scale(k));
    lo = Widened(Quants(k), d);
    hi = Widened(Quants(k) + kLanes, d);
  }
#endif
  float Scale(int64_t k) const {
    uint16_t d;
    std::memcpy(&d, p + k / kQ8_0BlockSize * kQ8_0BlockBytes, 2);
#if defined(__F16C__)
    return _cvtsh_ss(d);  // exact, as F16ToF32
#else
    return F16ToF32(d);
#endif
  }
  const int8_t* Quants(int64_t k) const {
    return reinterpret_cast<const int8_t*>(p + k / kQ8_0BlockSize * kQ8_0BlockBytes + 2) +
           k % kQ8_0BlockSize;
  }
  float At(int64_t k) const { return Scale(k) * static_cast<float>(*Quants(k)); }
  Vec Load(int64_t k) const {
#if defined(__AVX512F__)
    return Widened(Quants(k), _mm512_set1_ps(Scale(k)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 q = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(Quants(k)))));
    return _mm256_mul_ps(_mm256_set1_ps(Scale(k)), q);
#else
    Vec v;
    for (int i = 0; i < kLanes; ++i) v.l[i] = At(k + i);
    return v;
#endif
  }
};
static_assert(kQ8_0BlockSize % kLanes == 0);

#if defined(__AVX512F__)
// ggml's 2- to 6-bit blocks read in place on AVX-512 (the other ISAs decode a row at a time
// into a float copy, HasRowReader): q4_0, q4_1, q5_0 and q5_1 a block of 32 at a time
// (LoadBlock), the k-quants a super-block of 256 at a time (Scales once, then LoadSub for
// each 32 elements; q2_K and q3_K read their 16-element scales there). They widen the
// quants in registers and scale them exactly as kernels/ggml_quants.h's decoders do: where
// those compute d·q + m or (d·sc)·q − dmin·m, d·sc and the product with q are exact, so one
// fused multiply-add gives the same bits; q6_K's (d·sc)·q is one product, rounded once
// either way. (ggml_quants_test checks them against ggml's
// floats through DequantizeRowFast, which stores these registers.)
//
// Integer lane ops in their masked forms (GCC 12's plain ones warn spuriously, as VLoad's).
constexpr __mmask16 kAll = 0xFFFF;
inline __m512i I32And(__m512i a, __m512i b) { return _mm512_maskz_and_epi32(kAll, a, b); }
inline __m512i I32Or(__m512i a, __m512i b) { return _mm512_maskz_or_epi32(kAll, a, b); }
inline __m512i I32Sub(__m512i a, __m512i b) { return _mm512_maskz_sub_epi32(kAll, a, b); }
inline __m512i I32Shr(__m512i a, int n) {
  return _mm512_maskz_srlv_epi32(kAll, a, _mm512_set1_epi32(n));
}
inline __m512i I32Shl(__m512i a, int n) {
  return _mm512_maskz_sllv_epi32(kAll, a, _mm512_set1_epi32(n));
}
inline __m512i WidenBytes(const uint8_t* p) {
  return _mm512_maskz_cvtepu8_epi32(kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec ToFloat(__m512i v) { return _mm512_maskz_cvtepi32_ps(kAll, v); }
inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
// What a k-quant row makes once per super-block for its LoadSubs: the 16 scale floats
// (stored, whence each is broadcast by a load rather than a lane permute: permutes and the
// byte widening share the shuffle unit, the products' bottleneck), and for q5_K and q6_K
// with AVX-512BW their 256 quants as bytes (q5_K's 0 … 31, q6_K's q − 32), assembled 64 at
// a time from the split low and high bits with byte-wide ops, so each LoadSub only widens
// 16 of them.
struct SuperBlockScratch {
  alignas(64) float scales[kLanes];
  alignas(64) int8_t q[256];
};
template <DType kType>
struct BlockRow {
  const uint8_t* p;
  float At(int64_t k) const {
    constexpr DTypeBlock kShape = DTypeBlockOf(kType);
    float block[256];
    DecodeBlocks(kType, p + k / kShape.elems * kShape.bytes, 1, block);
    return block[k % kShape.elems];
  }
  // 32-element blocks (q4_0): elements k … k + 31 (k a multiple of 32), the scale read once.
  void LoadBlock(int64_t k, Vec& lo, Vec& hi) const;
  // The k-quants, a super-block at a time (k a multiple of 256): Prepare(k, s) makes its
  // SuperBlockScratch once (Scales(k): the 16 scale floats); LoadSub(k, j, s, …) its
  // elements 32·j … 32·j + 31.
  Vec Scales(int64_t k) const;
  void Prepare(int64_t k, SuperBlockScratch& s) const { VStore(s.scales, Scales(k)); }
  void LoadSub(int64_t k, int j, const SuperBlockScratch& s, Vec& lo, Vec& hi) const;
  Vec Load(int64_t k) const {  // (the products step whole blocks and never call it)
    Vec lo, hi;
    if constexpr (DTypeBlockSize(kType) == 256) {
      SuperBlockScratch s;
      Prepare(k / 256 * 256, s);
      LoadSub(k / 256 * 256, static_cast<int>(k % 256 / 32), s, lo, hi);
    } else {
      LoadBlock(k / 32 * 32, lo, hi);
    }
    return k % 32 ? hi : lo;
  }
};
// q4_0: a block's first 16 elements are qs's low nibbles, the next 16 its high ones.
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ4_0>::LoadBlock(int64_t k, Vec& lo,
                                                                     Vec& hi) const {
  const uint8_t* b = p + k / 32 * 18;
  const __m512i bytes = WidenBytes(b + 2), mask = _mm512_set1_epi32(0xF);
  const __m512i eight = _mm512_set1_epi32(8);
  const Vec d = _mm512_set1_ps(HalfToFloat(b));
  lo = _mm512_mul_ps(ToFloat(I32Sub(I32And(bytes, mask), eight)), d);
  hi = _mm512_mul_ps(ToFloat(I32Sub(I32Shr(bytes, 4), eight)), d);
}
// q4_1: q4_0's nibbles, x = q·d + m (q·d exact: one fused multiply-add rounds as the add).
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ4_1>::LoadBlock(int64_t k, Vec& lo,
                                                                     Vec& hi) const {
  const uint8_t* b = p + k / 32 * 20;
  const __m512i bytes = WidenBytes(b + 4);
  const Vec d = _mm512_set1_ps(HalfToFloat(b)), m = _mm512_set1_ps(HalfToFloat(b + 2));
  lo = _mm512_fmadd_ps(ToFloat(I32And(bytes, _mm512_set1_epi32(0xF))), d, m);
  hi = _mm512_fmadd_ps(ToFloat(I32Shr(bytes, 4)), d, m);
}
// q5_0 and q5_1: q4_0's and q4_1's nibbles, each with a fifth bit: bit l of the 32-bit qh
// for element l. q5_0: x = (q − 16)·d; q5_1: x = q·d + m.
template <DType kType>
[[gnu::always_inline]] inline void LoadQ5(const uint8_t* b, Vec& lo, Vec& hi) {
  constexpr bool kMin = kType == DType::kQ5_1;
  uint32_t qh;
  std::memcpy(&qh, b + (kMin ? 4 : 2), 4);
  const __m512i bytes = WidenBytes(b + (kMin ? 8 : 6));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i bits = _mm512_set1_epi32(static_cast<int>(qh));
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i high_lo = I32And(_mm512_maskz_srlv_epi32(kAll, bits, lane), one);
  const __m512i high_hi = I32And(
      _mm512_maskz_srlv_epi32(kAll, bits, _mm512_add_epi32(lane, _mm512_set1_epi32(16))), one);
  const __m512i q_lo = I32Or(I32And(bytes, _mm512_set1_epi32(0xF)), I32Shl(high_lo, 4));
  const __m512i q_hi = I32Or(I32Shr(bytes, 4), I32Shl(high_hi, 4));
  const Vec d = _mm512_set1_ps(HalfToFloat(b));
  if constexpr (kMin) {
    const Vec m = _mm512_set1_ps(HalfToFloat(b + 2));
    lo = _mm512_fmadd_ps(ToFloat(q_lo), d, m);
    hi = _mm512_fmadd_ps(ToFloat(q_hi), d, m);
  } else {
    const __m512i sixteen = _mm512_set1_epi32(16);
    lo = _mm512_mul_ps(ToFloat(I32Sub(q_lo, sixteen)), d);
    hi = _mm512_mul_ps(ToFloat(I32Sub(q_hi, sixteen)), d);
  }
}
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ5_0>::LoadBlock(int64_t k, Vec& lo,
                                                                     Vec& hi) const {
  LoadQ5<DType::kQ5_0>(p + k / 32 * 22, lo, hi);
}
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ5_1>::LoadBlock(int64_t k, Vec& lo,
                                                                     Vec& hi) const {
  LoadQ5<DType::kQ5_1>(p + k / 32 * 24, lo, hi);
}
// q2_K and q3_K: sub-blocks of 16, so LoadSub(j) spans two, each with its own scale, read
// from the bytes (Scales is unused). Element e = 128·n + 32·s + 16·h + l (j = 4·n + s) has
// its 2 low bits at bits 2·s of qs[32·n + 16·h + l], its scale at index 8·n + 2·s + h;
// q3_K's third bit is bit 4·n + s of hmask[16·h + l].
template <>
inline Vec BlockRow<DType::kQ2_K>::Scales(int64_t) const {
  return VZero();
}
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ2_K>::LoadSub(int64_t k, int j,
                                                                   const SuperBlockScratch&,
                                                                   Vec& lo, Vec& hi) const {
  const uint8_t* b = p + k / 256 * 84;
  const int n = j / 4, s2 = 2 * (j % 4);
  const float d = HalfToFloat(b + 80), dmin = HalfToFloat(b + 82);
  Vec* out[2] = {&lo, &hi};
  for (int h = 0; h < 2; ++h) {
    const uint8_t sc = b[8 * n + s2 + h];
    const __m512i q =
        I32And(I32Shr(WidenBytes(b + 16 + 32 * n + 16 * h), s2), _mm512_set1_epi32(3));
    *out[h] = _mm512_fmsub_ps(ToFloat(q), _mm512_set1_ps(d * static_cast<float>(sc & 0xF)),
                              _mm512_set1_ps(dmin * static_cast<float>(sc >> 4)));
  }
}
template <>
inline Vec BlockRow<DType::kQ3_K>::Scales(int64_t) const {
  return VZero();
}
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ3_K>::LoadSub(int64_t k, int j,
                                                                   const SuperBlockScratch&,
                                                                   Vec& lo, Vec& hi) const {
  const uint8_t* b = p + k / 256 * 110;
  const uint8_t* packed = b + 96;
  const int n = j / 4, s = j % 4;
  const float d = HalfToFloat(b + 108);
  Vec* out[2] = {&lo, &hi};
  for (int h = 0; h < 2; ++h) {
    const __m512i q2 =
        I32And(I32Shr(WidenBytes(b + 32 + 32 * n + 16 * h), 2 * s), _mm512_set1_epi32(3));
    const __m512i hbit = I32And(I32Shr(WidenBytes(b + 16 * h), 4 * n + s), _mm512_set1_epi32(1));
    // q2 − (hbit ? 0 : 4) = q2 + 4·hbit − 4
    const __m512i q = I32Sub(I32Or(q2, I32Shl(hbit, 2)), _mm512_set1_epi32(4));
    const float dl = d * static_cast<float>(ScaleK3(8 * n + 2 * s + h, packed));
    *out[h] = _mm512_mul_ps(_mm512_set1_ps(dl), ToFloat(q));
  }
}
// q4_K and q5_K a super-block at a time: scales = [d·sc_0 … d·sc_7, dmin·m_0 … dmin·m_7].
// ScaleMinK4's unpacking in lanes: lane i < 8 is sc_i, lane 8 + j is m_j. With s the 12
// scale bytes: sc_j = s[j] & 63, m_j = s[j + 4] & 63 (j < 4); sc_j = (s[j + 4] & 15) |
// (s[j − 4] >> 6) << 4, m_j = (s[j + 4] >> 4) | (s[j] >> 6) << 4 (j ≥ 4).
// ScalesK4Ints: the integers [sc_0 … sc_7, m_0 … m_7].
inline __m512i ScalesK4Ints(const uint8_t* b) {
  const __m512i s = WidenBytes(b + 4);  // lanes 12–15 (qs bytes) unused
  const __m512i low_at = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
  const __m512i low_shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i low_mask =
      _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m512i high_at = _mm512_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7);
  const __m512i high_mask =
      _mm512_setr_epi32(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48);
  const __m512i low = I32And(
      _mm512_maskz_srlv_epi32(kAll, _mm512_maskz_permutexvar_epi32(kAll, low_at, s), low_shift),
      low_mask);
  const __m512i high =  // (byte >> 6) << 4
      I32And(I32Shr(_mm512_maskz_permutexvar_epi32(kAll, high_at, s), 2), high_mask);
  return I32Or(low, high);
}
inline Vec ScalesK4(const uint8_t* b) {
  const Vec d = _mm512_mask_blend_ps(static_cast<__mmask16>(0xFF00), _mm512_set1_ps(HalfToFloat(b)),
                                     _mm512_set1_ps(HalfToFloat(b + 2)));
  return _mm512_mul_ps(d, ToFloat(ScalesK4Ints(b)));
}
template <DType kType>
[[gnu::always_inline]] inline void LoadSubK4(const uint8_t* qs, const uint8_t* qh, int j,
                                             const float* scales, Vec& lo, Vec& hi) {
  const Vec d1 = _mm512_set1_ps(scales[j]), m1 = _mm512_set1_ps(scales[8 + j]);
  __m512i q[2];
  for (int h = 0; h < 2; ++h) {
    const __m512i bytes = WidenBytes(qs + 32 * (j / 2) + 16 * h);
    q[h] = j % 2 ? I32Shr(bytes, 4) : I32And(bytes, _mm512_set1_epi32(0xF));
    if constexpr (kType == DType::kQ5_K) {
      const __m512i high = I32And(I32Shr(WidenBytes(qh + 16 * h), j), _mm512_set1_epi32(1));
      q[h] = I32Or(q[h], I32Shl(high, 4));
    }
  }
  lo = _mm512_fmsub_ps(ToFloat(q[0]), d1, m1);
  hi = _mm512_fmsub_ps(ToFloat(q[1]), d1, m1);
}
template <>
inline Vec BlockRow<DType::kQ4_K>::Scales(int64_t k) const {
  return ScalesK4(p + k / 256 * 144);
}
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ4_K>::LoadSub(int64_t k, int j,
                                                                   const SuperBlockScratch& s,
                                                                   Vec& lo, Vec& hi) const {
  LoadSubK4<DType::kQ4_K>(p + k / 256 * 144 + 16, nullptr, j, s.scales, lo, hi);
}
template <>
inline Vec BlockRow<DType::kQ5_K>::Scales(int64_t k) const {
  return ScalesK4(p + k / 256 * 176);
}
#if defined(__AVX512BW__)
// The byte-wide assembly's pieces: 32 bytes at p in both halves of a register (the masked
// form: see kAll), and a 16-bit lane count per half (lower `lo`, upper `hi`).
inline __m512i Bytes32Twice(const uint8_t* p) {
  return _mm512_maskz_broadcast_i64x4(0xFF,
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i HalfCounts(int lo, int hi) {
  return _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(static_cast<int16_t>(lo)),
                                 _mm512_set1_epi16(static_cast<int16_t>(hi)));
}
// As q6_K's below, its 256 quants (0 … 31) made once with byte-wide ops: sub-block j takes
// nibble j % 2 of qs[32·(j / 2) + l] and bit j of qh[l] as its fifth. Each 64 bytes of qs
// (t = 0, 1) hold sub-blocks 4t … 4t + 3: the low nibbles j = 4t, 4t + 2, the high ones
// 4t + 1, 4t + 3, stored as they come (sub-block j at kQ5At[j]); qh, read twice over,
// brings bit j to bit 4 by a shift per 16-bit lane (left for j ≤ 4, right above; the
// neighbouring byte's bits land outside 0x10).
inline constexpr int kQ5At[8] = {0, 64, 32, 96, 128, 192, 160, 224};
template <>
[[gnu::noinline]] inline void BlockRow<DType::kQ5_K>::Prepare(int64_t k,
                                                              SuperBlockScratch& s) const {
  VStore(s.scales, Scales(k));
  const uint8_t* b = p + k / 256 * 176;
  const __m512i nibble = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  const __m512i qh = Bytes32Twice(b + 16);
  // Bit j → 4: t = 0: j = 0, 2 (low nibbles) << 4, << 2; j = 1, 3 << 3, << 1.
  //            t = 1: j = 4, 6 >> 0, >> 2;          j = 5, 7 >> 1, >> 3.
  const __m512i shift[2][2] = {{HalfCounts(4, 2), HalfCounts(3, 1)},
                               {HalfCounts(0, 2), HalfCounts(1, 3)}};
  for (int t = 0; t < 2; ++t) {
    const __m512i qs = _mm512_loadu_si512(b + 48 + 64 * t);
    const __m512i low = _mm512_and_si512(qs, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(qs, 4), nibble);
    const __m512i bit_low =
        t == 0 ? _mm512_sllv_epi16(qh, shift[t][0]) : _mm512_srlv_epi16(qh, shift[t][0]);
    const __m512i bit_high =
        t == 0 ? _mm512_sllv_epi16(qh, shift[t][1]) : _mm512_srlv_epi16(qh, shift[t][1]);
    _mm512_store_si512(s.q + 128 * t, _mm512_or_si512(low, _mm512_and_si512(bit_low, fifth)));
    _mm512_store_si512(s.q + 128 * t + 64,
                       _mm512_or_si512(high, _mm512_and_si512(bit_high, fifth)));
  }
}
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ5_K>::LoadSub(int64_t, int j,
                                                                   const SuperBlockScratch& s,
                                                                   Vec& lo, Vec& hi) const {
  const Vec d1 = _mm512_set1_ps(s.scales[j]), m1 = _mm512_set1_ps(s.scales[8 + j]);
  const int8_t* q = s.q + kQ5At[j];
  lo = _mm512_fmsub_ps(ToFloat(_mm512_maskz_cvtepu8_epi32(
                           kAll, _mm_load_si128(reinterpret_cast<const __m128i*>(q)))),
                       d1, m1);
  hi = _mm512_fmsub_ps(ToFloat(_mm512_maskz_cvtepu8_epi32(
                           kAll, _mm_load_si128(reinterpret_cast<const __m128i*>(q + 16)))),
                       d1, m1);
}
#else
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ5_K>::LoadSub(int64_t k, int j,
                                                                   const SuperBlockScratch& s,
                                                                   Vec& lo, Vec& hi) const {
  const uint8_t* b = p + k / 256 * 176;
  LoadSubK4<DType::kQ5_K>(b + 48, b + 16, j, s.scales, lo, hi);
}
#endif
// q6_K a super-block at a time: scales = d · sc[0 … 15], one per 16 elements.
template <>
inline Vec BlockRow<DType::kQ6_K>::Scales(int64_t k) const {
  const uint8_t* b = p + k / 256 * 210;
  const __m512i sc =
      _mm512_maskz_cvtepi8_epi32(kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  return _mm512_mul_ps(_mm512_set1_ps(HalfToFloat(b + 208)), ToFloat(sc));
}
#if defined(__AVX512BW__)
// With byte-wide ops, the quants of 64 elements at once: sub-blocks j = 4·n + c (c < 4)
// take the low nibbles (c < 2) or the high ones (c ≥ 2) of ql[64·n + 32·(c % 2) + l] and
// bits 2·c of qh[32·n + l] as their top two. Both halves of a 64-byte register hold c and
// c + 1's, so qh is read twice over and shifted by a count per 16-bit lane, its bits
// brought to 4 and 5 (the neighbouring byte's bits land outside 0x30, masked away).
// Not inlined: inlined into the product's loop, one thread decoding the 0.36B Q4_K_M file
// took 7% longer (its registers then spill around the loop's).
template <>
[[gnu::noinline]] inline void BlockRow<DType::kQ6_K>::Prepare(int64_t k,
                                                              SuperBlockScratch& s) const {
  VStore(s.scales, Scales(k));
  const uint8_t* b = p + k / 256 * 210;
  const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i thirty_two = _mm512_set1_epi8(32);
  // c = 0, 1: qh << 4, << 2; c = 2, 3: qh >> 0, >> 2 (per 16-bit lane, 16 lanes a half)
  const __m512i up = HalfCounts(4, 2), down = HalfCounts(0, 2);
  for (int n = 0; n < 2; ++n) {
    const __m512i ql = _mm512_loadu_si512(b + 64 * n);
    const __m512i qh = Bytes32Twice(b + 128 + 32 * n);
    const __m512i q01 = _mm512_or_si512(_mm512_and_si512(ql, nibble),
                                        _mm512_and_si512(_mm512_sllv_epi16(qh, up), top));
    const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble),
                                        _mm512_and_si512(_mm512_srlv_epi16(qh, down), top));
    _mm512_store_si512(s.q + 128 * n, _mm512_sub_epi8(q01, thirty_two));
    _mm512_store_si512(s.q + 128 * n + 64, _mm512_sub_epi8(q23, thirty_two));
  }
}
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ6_K>::LoadSub(int64_t, int j,
                                                                   const SuperBlockScratch& s,
                                                                   Vec& lo, Vec& hi) const {
  Vec* out[2] = {&lo, &hi};
  for (int h = 0; h < 2; ++h) {
    const __m512i q = _mm512_maskz_cvtepi8_epi32(
        kAll, _mm_load_si128(reinterpret_cast<const __m128i*>(s.q + 32 * j + 16 * h)));
    *out[h] = _mm512_mul_ps(_mm512_set1_ps(s.scales[2 * j + h]), ToFloat(q));
  }
}
#else
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kQ6_K>::LoadSub(int64_t k, int j,
                                                                   const SuperBlockScratch& s,
                                                                   Vec& lo, Vec& hi) const {
  const uint8_t* b = p + k / 256 * 210;
  const int n = j / 4, c = j % 4;
  Vec* out[2] = {&lo, &hi};
  for (int h = 0; h < 2; ++h) {
    const __m512i low4 = I32And(I32Shr(WidenBytes(b + 64 * n + 32 * (c % 2) + 16 * h), 4 * (c / 2)),
                                _mm512_set1_epi32(0xF));
    const __m512i high2 =
        I32And(I32Shr(WidenBytes(b + 128 + 32 * n + 16 * h), 2 * c), _mm512_set1_epi32(3));
    const __m512i q = I32Sub(I32Or(low4, I32Shl(high2, 4)), _mm512_set1_epi32(32));
    const Vec sc = _mm512_set1_ps(s.scales[2 * j + h]);
    *out[h] = _mm512_mul_ps(sc, ToFloat(q));
  }
}
#endif
// iq4_nl and iq4_xs: each nibble, widened, selects its table value as a float (a permute of
// kIQ4Values in a register), times the block's or the sub-block's scale: exact, as the
// decoders' products.
[[gnu::always_inline]] inline void LoadIQ4(const uint8_t* qs, Vec scale, Vec& lo, Vec& hi) {
  const Vec table = ToFloat(_mm512_maskz_cvtepi8_epi32(
      kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values))));
  const __m512i bytes = WidenBytes(qs);
  lo = _mm512_mul_ps(
      _mm512_maskz_permutexvar_ps(kAll, I32And(bytes, _mm512_set1_epi32(0xF)), table), scale);
  hi = _mm512_mul_ps(_mm512_maskz_permutexvar_ps(kAll, I32Shr(bytes, 4), table), scale);
}
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kIQ4_NL>::LoadBlock(int64_t k, Vec& lo,
                                                                       Vec& hi) const {
  const uint8_t* b = p + k / 32 * 18;
  LoadIQ4(b + 2, _mm512_set1_ps(HalfToFloat(b)), lo, hi);
}
// iq4_xs's sub-block scales sc (ScaleIQ4XS in lanes), and d · sc: lane i holds sub-block
// at[i]'s.
// Its low 4 bits are bits 4j of the 32-bit scales_l, its top 2 bits bits 2j of scales_h.
inline __m512i ScalesIQ4XSInts(const uint8_t* b, __m512i at) {
  uint32_t low_bits;
  uint16_t high_bits;
  std::memcpy(&high_bits, b + 2, 2);
  std::memcpy(&low_bits, b + 4, 4);
  const __m512i low = I32And(
      _mm512_maskz_srlv_epi32(kAll, _mm512_set1_epi32(static_cast<int>(low_bits)), I32Shl(at, 2)),
      _mm512_set1_epi32(0xF));
  const __m512i high =
      I32And(_mm512_maskz_srlv_epi32(kAll, _mm512_set1_epi32(high_bits), I32Shl(at, 1)),
             _mm512_set1_epi32(3));
  return I32Sub(I32Or(low, I32Shl(high, 4)), _mm512_set1_epi32(32));
}
inline Vec ScalesIQ4XS(const uint8_t* b, __m512i at) {
  return _mm512_mul_ps(_mm512_set1_ps(HalfToFloat(b)), ToFloat(ScalesIQ4XSInts(b, at)));
}
// iq4_xs a super-block at a time: scales = d · sc_j in lanes 0 … 7 (and again in 8 … 15).
template <>
inline Vec BlockRow<DType::kIQ4_XS>::Scales(int64_t k) const {
  return ScalesIQ4XS(p + k / 256 * 136,
                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7));
}
template <>
[[gnu::always_inline]] inline void BlockRow<DType::kIQ4_XS>::LoadSub(int64_t k, int j,
                                                                     const SuperBlockScratch& s,
                                                                     Vec& lo, Vec& hi) const {
  LoadIQ4(p + k / 256 * 136 + 8 + 16 * j, _mm512_set1_ps(s.scales[j]), lo, hi);
}
#endif

// Rows whose LoadBlock reads 32 elements at once, and those that also read a super-block
// of 256 a sub-block at a time, its scales made once (AVX-512 only).
template <typename Row>
constexpr bool kStepsBlocks = false;
template <typename Row>
constexpr bool kStepsSuperBlocks = false;
#if defined(__AVX512F__)
template <>
constexpr bool kStepsBlocks<Q8Row> = true;
template <DType kType>
constexpr bool kStepsBlocks<BlockRow<kType>> = DTypeBlockSize(kType) == 32;
template <DType kType>
constexpr bool kStepsSuperBlocks<BlockRow<kType>> = DTypeBlockSize(kType) == 256;
#endif

#if defined(__AVX512F__)
// fn(BlockRow<t>{p}) for the block type t other than q8_0 (Q8Row's); nothing otherwise.
template <typename Fn>
void VisitBlockRow(DType t, const uint8_t* p, Fn&& fn) {
  VisitBlockType(t, [&](auto type) {
    if constexpr (decltype(type)::value != DType::kQ8_0) fn(BlockRow<decltype(type)::value>{p});
  });
}
#endif

// The dtypes a product reads in place (a *Row above); the others (ggml's 4-, 5-bit, k-quant and iq4
// blocks) are decoded a weight row at a time into a float copy, DequantizeRowFast's floats.
constexpr bool HasRowReader(DType t) {
#if defined(__AVX512F__)
  if (DTypeIsBlockQuantized(t)) return true;
#endif
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16 || t == DType::kQ8_0;
}

#if defined(__AVX512F__)
// n elements (whole blocks) of a row read by `row`, stored as floats.
template <DType kType>
void StoreBlocks(const BlockRow<kType>& row, int64_t n, float* out) {
  for (int64_t k = 0; k < n; k += 32) {
    Vec lo, hi;
    if constexpr (DTypeBlockSize(kType) == 256) {  // a super-block, its scratch made once
      SuperBlockScratch s;
      row.Prepare(k, s);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        row.LoadSub(k, j, s, lo, hi);
        VStore(out + k + 32 * j, lo);
        VStore(out + k + 32 * j + kLanes, hi);
      }
      k += 256 - 32;
      continue;
    }
    row.LoadBlock(k, lo, hi);
    VStore(out + k, lo);
    VStore(out + k + kLanes, hi);
  }
}
#endif

}  // namespace
}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_WEIGHT_ROWS_H_
