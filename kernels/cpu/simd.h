// The CPU kernels' SIMD vocabulary: Vec holds kLanes floats (AVX-512, AVX2 + FMA, or a
// portable array), with the loads, stores and arithmetic the kernels use. Included only by
// the files compiled with -march=native where the build allows it (cpu_backend.cc,
// cpu_attention.cc; kernels/CMakeLists.txt), and inside an anonymous namespace, so code
// built for different instruction sets never meets in one inline function.
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

}  // namespace
}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_SIMD_H_
