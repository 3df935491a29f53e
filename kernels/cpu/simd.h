// The CPU kernels' SIMD vocabulary: Vec holds kLanes floats (AVX-512, AVX2 + FMA, or a
// portable array), with the loads, stores and arithmetic the kernels use. Included only by
// the files compiled with -march=native where the build allows it (cpu_backend.cc,
// cpu_attention.cc, cpu_int8.cc; kernels/CMakeLists.txt), and inside an anonymous namespace, so
// code built for different instruction sets never meets in one inline function.
#ifndef KVLENS_KERNELS_CPU_SIMD_H_
#define KVLENS_KERNELS_CPU_SIMD_H_

#include <cstdint>
#include <cstring>
#include <string_view>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels/dtype.h"

namespace kvlens::kernels {
namespace {

// ---- SIMD vocabulary: Vec holds kLanes floats. ----
#if defined(__AVX512F__)
constexpr std::string_view kSimdName = "avx512";
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec VZero() { return _mm512_setzero_ps(); }
inline Vec VLoad(const float* p) { return _mm512_loadu_ps(p); }
// kLanes bf16 values (bits) widened: each 16-bit pattern shifted into a float's top half.
inline Vec VLoad(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  // The masked form: GCC 12's plain _mm512_cvtepu16_epi32 warns spuriously (as VSum's).
  const __m512i w = _mm512_maskz_cvtepu16_epi32(static_cast<__mmask16>(0xFFFF), h);
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(static_cast<__mmask16>(0xFFFF), w, 16));
}
inline void VStore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec VSet1(float x) { return _mm512_set1_ps(x); }
inline Vec VAdd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec VMul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// Lane by lane (m < a) ? a : m, which is std::max(m, a): m where a is NaN or equal.
inline Vec VMax(Vec a, Vec m) {
  return _mm512_maskz_max_ps(static_cast<__mmask16>(0xFFFF), a, m);  // masked: as VLoad's
}
inline float VSum(Vec v) {
  // Through memory: GCC 12's _mm512_reduce_add_ps and 256-bit extracts warn spuriously
  // (-Wmaybe-uninitialized inside avx512fintrin.h).
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  __m128 s = _mm_add_ps(_mm_add_ps(_mm_load_ps(t), _mm_load_ps(t + 4)),
                        _mm_add_ps(_mm_load_ps(t + 8), _mm_load_ps(t + 12)));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr std::string_view kSimdName = "avx2";
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec VZero() { return _mm256_setzero_ps(); }
inline Vec VLoad(const float* p) { return _mm256_loadu_ps(p); }
inline Vec VLoad(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void VStore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec VSet1(float x) { return _mm256_set1_ps(x); }
inline Vec VAdd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec VMul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec VMax(Vec a, Vec m) { return _mm256_max_ps(a, m); }
inline float VSum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
// Portable fallback: plain arrays the compiler may vectorise for whatever it targets.
constexpr std::string_view kSimdName = "scalar";
constexpr int kLanes = 8;
struct Vec {
  float l[kLanes];
};
inline Vec VZero() { return Vec{}; }
inline Vec VLoad(const float* p) {
  Vec v;
  std::memcpy(v.l, p, sizeof(v.l));
  return v;
}
inline Vec VLoad(const uint16_t* p) {
  Vec v;
  for (int i = 0; i < kLanes; ++i) v.l[i] = BF16ToF32(p[i]);
  return v;
}
inline void VStore(float* p, Vec v) { std::memcpy(p, v.l, sizeof(v.l)); }
inline Vec VSet1(float x) {
  Vec v;
  for (float& e : v.l) e = x;
  return v;
}
inline Vec VAdd(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.l[i] += b.l[i];
  return a;
}
inline Vec VMul(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.l[i] *= b.l[i];
  return a;
}
inline Vec VFma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.l[i] += a.l[i] * b.l[i];
  return c;
}
inline Vec VMax(Vec a, Vec m) {
  for (int i = 0; i < kLanes; ++i) m.l[i] = m.l[i] < a.l[i] ? a.l[i] : m.l[i];
  return m;
}
inline float VSum(Vec v) {
  float s = 0.0f;
  for (float e : v.l) s += e;
  return s;
}
#endif

// VSum's order on kLanes lane values, lane by lane of p[0 … kLanes − 1]: the four-lane
// quarters (halves for 8 lanes) added pairwise, then (q0 + q2) + (q1 + q3).
inline Vec VSumTree(const Vec* p) {
  Vec q[4];
  for (int i = 0; i < 4; ++i) {
#if defined(__AVX512F__)
    q[i] = VAdd(VAdd(p[i], p[4 + i]), VAdd(p[8 + i], p[12 + i]));
#else
    q[i] = VAdd(p[i], p[4 + i]);
#endif
  }
  return VAdd(VAdd(q[0], q[2]), VAdd(q[1], q[3]));
}

// Lane t = VSum(a[t]) for t < kLanes, the same additions in the same tree, done for all
// kLanes vectors at once by shuffling as it adds (the transpose of VSumTree): the quarter
// sums c0 + c1 and c2 + c3 (AVX-512) or halves c0 + c1 (AVX2) of vectors t and t + 4
// (and t + 8, t + 12) side by side, then their sums q, then q0 + q2 and q1 + q3 of four
// vectors in each 128-bit lane, then those two; lane 4c + n ends with vector 4c + n.
#if defined(__AVX512F__)
inline Vec VSumLanes(const Vec* a) {
  constexpr __mmask16 kAll = 0xFFFF;  // the masked forms: GCC 12's plain ones warn spuriously
  constexpr __mmask8 kAll8 = 0xFF;
  auto pair_sums = [&](Vec x, Vec y) {  // [x.c0 + x.c1, x.c2 + x.c3, y.c0 + y.c1, y.c2 + y.c3]
    return _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, x, y, 0x88),
                         _mm512_maskz_shuffle_f32x4(kAll, x, y, 0xdd));
  };
  Vec c[4];
  for (int n = 0; n < 4; ++n) {
    // [q(n), q(n + 4), q(n + 8), q(n + 12)], q = (c0 + c1) + (c2 + c3) of that vector.
    c[n] = pair_sums(pair_sums(a[n], a[4 + n]), pair_sums(a[8 + n], a[12 + n]));
  }
  auto halves = [&](Vec x, Vec y) {  // per 128-bit lane: [x.q0 + x.q2, x.q1 + x.q3, y.…, y.…]
    const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_maskz_unpacklo_pd(kAll8, xd, yd)),
                         _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(kAll8, xd, yd)));
  };
  const Vec d0 = halves(c[0], c[1]), d1 = halves(c[2], c[3]);
  return _mm512_add_ps(_mm512_maskz_shuffle_ps(kAll, d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_maskz_shuffle_ps(kAll, d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline Vec VSumLanes(const Vec* a) {
  Vec c[4];
  for (int n = 0; n < 4; ++n) {  // [q(n), q(n + 4)], q = c0 + c1 of that vector
    c[n] = _mm256_add_ps(_mm256_permute2f128_ps(a[n], a[4 + n], 0x20),
                         _mm256_permute2f128_ps(a[n], a[4 + n], 0x31));
  }
  auto halves = [](Vec x, Vec y) {
    const __m256d xd = _mm256_castps_pd(x), yd = _mm256_castps_pd(y);
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(xd, yd)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(xd, yd)));
  };
  const Vec d0 = halves(c[0], c[1]), d1 = halves(c[2], c[3]);
  return _mm256_add_ps(_mm256_shuffle_ps(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#else
inline Vec VSumLanes(const Vec* a) {
  Vec r;
  for (int t = 0; t < kLanes; ++t) r.l[t] = VSum(a[t]);
  return r;
}
#endif

}  // namespace
}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_SIMD_H_
