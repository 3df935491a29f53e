// Products of the 256-element block types (q2_K, q3_K, q4_K, q5_K, q6_K, iq4_xs) with
// 8-bit activations: the int8-activation mode's scheme for them (q8_products.h has the
// 32-element types'). As llama.cpp pairs these types with its q8_K activations:
//
// - An activation row is rounded per unit of 256 elements: d = max|x| / 127 (in float) and
//   a = x · (1/d) rounded to nearest, ties to even (std::nearbyint), so x ≈ d · a, |a| ≤ 127.
//   A unit holding a NaN or an infinity gets d = NaN (its products are NaN, as the exact
//   ones would be) and a = 0.
// - A weight unit is written in integers: per element a quant q (unsigned) with the type's
//   fixed offset o, per 16 elements an integer scale c_s and, for the types with mins, an
//   integer min m_s, and two floats D and M, such that weight_i = D · c_s · (q_i − o) − M · m_s
//   exactly (kernels/ggml_quants.h's decoders, before their one rounding).
// - A unit's share of Σ_i weight_i · d · a_i is then two integers, exact whatever order they
//   are summed in,
//       I = Σ_s c_s · Σ_{i∈s} (q_i − o) · a_i,      J = Σ_s m_s · Σ_{i∈s} a_i,
//   and a row's output is the float chain y ← fma(I, D·d, y), then y ← fma(−J, M·d, y) for
//   the types with mins, over the units in order, plus the bias at the end.
//
// So a row's result is the same bits whether it is computed alone along k (Q8KDotUnit, for
// a few rows) or with 15 others in the lanes of a vector (Q8KGemmTile, from kQ8TileRows
// rows on): batching never changes results. The integer sums use AVX-512 VNNI (64 byte
// products an instruction). In the tile the per-unit float work is shared by 16 rows, where
// q8_products.h's scheme (a float scale per 16 elements of each row) spends four float
// operations on every 64 products: this one multiplies a long prompt's rows about twice as
// fast as the exact float path.
//
// Like simd.h, included only by cpu_int8.cc, inside an anonymous namespace.
#ifndef KVLENS_KERNELS_CPU_Q8K_PRODUCTS_H_
#define KVLENS_KERNELS_CPU_Q8K_PRODUCTS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/cpu/q8_products.h"
#include "kernels/dtype.h"
#include "kernels/ggml_quants.h"

namespace kvlens::kernels {
namespace {

// The block types this scheme multiplies: those of 256 elements.
constexpr bool UsesQ8K(DType t) { return DTypeBlockSize(t) == 256; }

// ---- The activations ----
//
// Row r of n, quantised: a[in] (signed), d[in / 256] and per 16 elements B = Σ a.
struct Q8KActRow {
  const int8_t* a;
  const float* d;
  const int32_t* bsum;
};

inline void QuantizeUnitQ8KScalar(const float* x, int8_t* a, float* d, int32_t* bsum) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < kQ8Unit; ++i) {
    const float v = std::fabs(x[i]);
    finite &= v <= std::numeric_limits<float>::max();
    amax = v > amax ? v : amax;
  }
  const float du = amax / 127.0f;
  const float id = finite && du != 0.0f ? 1.0f / du : 0.0f;
  for (int s = 0; s < kQ8Subs; ++s) {
    int sum = 0;
    for (int i = 16 * s; i < 16 * s + 16; ++i) {
      float v = finite ? std::nearbyint(x[i] * id) : 0.0f;
      v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
      a[i] = static_cast<int8_t>(v);
      sum += a[i];
    }
    bsum[s] = sum;
  }
  *d = finite ? du : std::numeric_limits<float>::quiet_NaN();
}

#if defined(KVLENS_Q8_VNNI)
// The sum of v's lanes. Through memory, as VSum: GCC 12's 256-bit extracts warn spuriously.
inline int32_t IReduce(__m512i v) {
  alignas(64) int32_t t[16];
  _mm512_store_si512(t, v);
  const __m128i* p = reinterpret_cast<const __m128i*>(t);
  __m128i q = _mm_add_epi32(_mm_add_epi32(_mm_load_si128(p), _mm_load_si128(p + 1)),
                            _mm_add_epi32(_mm_load_si128(p + 2), _mm_load_si128(p + 3)));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(1, 0, 3, 2)));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(q);
}

// The same values as QuantizeUnitQ8KScalar (builds without VNNI run that one; Q8ProductsTest
// checks either against the definition): the same float operations, the conversion to
// nearest-even by the default MXCSR.
inline void QuantizeUnitQ8K(const float* x, int8_t* a, float* d, int32_t* bsum) {
  constexpr __mmask16 kAll16 = 0xFFFF;
  __m512 m = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int v = 0; v < kQ8Subs; ++v) {
    const __m512 xv = _mm512_loadu_ps(x + 16 * v);
    bad |= _mm512_fpclass_ps_mask(xv, 0x99);  // NaNs and infinities
    const __m512 ax = _mm512_castsi512_ps(
        _mm512_maskz_and_epi32(kAll16, _mm512_castps_si512(xv), _mm512_set1_epi32(0x7FFFFFFF)));
    m = _mm512_maskz_max_ps(kAll16, m, ax);
  }
  alignas(64) float t[16];
  _mm512_store_ps(t, m);
  float amax = 0.0f;
  for (float v : t) amax = v > amax ? v : amax;
  const bool finite = bad == 0;
  const float du = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(finite && du != 0.0f ? 1.0f / du : 0.0f);
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  for (int v = 0; v < kQ8Subs; ++v) {
    __m512i q = _mm512_maskz_cvtps_epi32(kAll16, _mm512_mul_ps(_mm512_loadu_ps(x + 16 * v), id));
    q = _mm512_maskz_max_epi32(kAll16, _mm512_maskz_min_epi32(kAll16, q, hi), lo);
    if (!finite) q = _mm512_setzero_si512();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16 * v), _mm512_maskz_cvtepi32_epi8(kAll16, q));
    bsum[v] = IReduce(q);
  }
  *d = finite ? du : std::numeric_limits<float>::quiet_NaN();
}
#else
inline void QuantizeUnitQ8K(const float* x, int8_t* a, float* d, int32_t* bsum) {
  QuantizeUnitQ8KScalar(x, a, d, bsum);
}
#endif

// x[0 … in) (in a multiple of 256) into a[in], d[in / 256], bsum[in / 16].
inline void QuantizeRowQ8K(const float* x, int64_t in, int8_t* a, float* d, int32_t* bsum) {
  for (int64_t u = 0; u * kQ8Unit < in; ++u) {
    QuantizeUnitQ8K(x + u * kQ8Unit, a + u * kQ8Unit, d + u, bsum + u * kQ8Subs);
  }
}

// ---- The weights in integer form ----

// The type's quant offset o (UnpackUnit's unsigned quants are q_i = w_i + o) and whether it
// has mins.
constexpr int Q8KOffset(DType t) {
  return t == DType::kQ6_K ? 32 : t == DType::kQ3_K ? 4 : t == DType::kIQ4_XS ? 128 : 0;
}
constexpr bool Q8KHasMins(DType t) {
  return t == DType::kQ2_K || t == DType::kQ4_K || t == DType::kQ5_K;
}

// One weight unit: the quants as UnpackUnitOf writes them (q; its float scales unused),
// c and m per 16 elements, D and M.
struct Q8KUnit {
  Q8WeightUnit quants;
  alignas(64) int32_t c[kQ8Subs];
  alignas(64) int32_t m[kQ8Subs];
  float D, M;
};

// The integer scales and mins of one super-block b of type kType, per 16 elements.
template <DType kType>
inline void Q8KScales(const uint8_t* b, int32_t* c, int32_t* m, float* D, float* M) {
  for (int s = 0; s < kQ8Subs; ++s) m[s] = 0;
  *M = 0.0f;
  if constexpr (kType == DType::kQ2_K) {
    for (int s = 0; s < kQ8Subs; ++s) {
      c[s] = b[s] & 0xF;
      m[s] = b[s] >> 4;
    }
    *D = HalfAt<float>(b + 80);
    *M = HalfAt<float>(b + 82);
  } else if constexpr (kType == DType::kQ3_K) {
    for (int s = 0; s < kQ8Subs; ++s) c[s] = ScaleK3(s, b + 96);
    *D = HalfAt<float>(b + 108);
  } else if constexpr (kType == DType::kQ4_K || kType == DType::kQ5_K) {
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      ScaleMinK4(j, b + 4, &sc, &mn);
      c[2 * j] = c[2 * j + 1] = sc;
      m[2 * j] = m[2 * j + 1] = mn;
    }
    *D = HalfAt<float>(b);
    *M = HalfAt<float>(b + 2);
  } else if constexpr (kType == DType::kQ6_K) {
    for (int s = 0; s < kQ8Subs; ++s) c[s] = static_cast<int8_t>(b[192 + s]);
    *D = HalfAt<float>(b + 208);
  } else if constexpr (kType == DType::kIQ4_XS) {
    for (int j = 0; j < 8; ++j) c[2 * j] = c[2 * j + 1] = ScaleIQ4XS(j, b);
    *D = HalfAt<float>(b);
  }
}

// Unit u (super-block u) of a weight row of type kType.
template <DType kType>
inline void UnpackQ8K(const uint8_t* row, int64_t in, int64_t u, Q8KUnit* out) {
  const uint8_t* b = row + u * DTypeBlockOf(kType).bytes;
#if !defined(KVLENS_Q8_VNNI)
  UnpackUnitOf<kType>(row, in, u, &out->quants);
#else
  (void)in;
  UnpackUnitFast<kType, /*kFloatScales=*/false>(b, &out->quants);
  // The common types' scales in lanes; q2_K's and q3_K's through Q8KScales (Q8ProductsTest
  // checks every type's products against the definition).
  constexpr __mmask16 kAll16 = 0xFFFF;
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  if constexpr (kType == DType::kQ4_K || kType == DType::kQ5_K) {
    const __m512i sm = ScalesK4Ints(b);
    _mm512_store_si512(out->c, _mm512_maskz_permutexvar_epi32(kAll16, pairs, sm));
    _mm512_store_si512(out->m, _mm512_maskz_permutexvar_epi32(
                                   kAll16, _mm512_add_epi32(pairs, _mm512_set1_epi32(8)), sm));
    out->D = HalfAt<float>(b);
    out->M = HalfAt<float>(b + 2);
    return;
  } else if constexpr (kType == DType::kQ6_K) {
    _mm512_store_si512(out->c,
                       _mm512_maskz_cvtepi8_epi32(
                           kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    _mm512_store_si512(out->m, _mm512_setzero_si512());
    out->D = HalfAt<float>(b + 208);
    out->M = 0.0f;
    return;
  } else if constexpr (kType == DType::kIQ4_XS) {
    _mm512_store_si512(out->c, ScalesIQ4XSInts(b, pairs));
    _mm512_store_si512(out->m, _mm512_setzero_si512());
    out->D = HalfAt<float>(b);
    out->M = 0.0f;
    return;
  }
#endif
  Q8KScales<kType>(b, out->c, out->m, &out->D, &out->M);
}

// ---- One unit's integers, along k (a few rows) ----

#if defined(KVLENS_Q8_VNNI)
// out[r] = the sum of v[r]'s lanes, four rows' reductions sharing their shuffles.
template <int NR>
[[gnu::always_inline]] inline void IReduceRows(const __m512i* v, int32_t* out) {
  if constexpr (NR == 4) {
    // The four quarters' [v0, v1, v2, v3] sums (QuarterSums4), added.
    alignas(64) int32_t q[16];
    _mm512_store_si512(q, QuarterSums4(v));
    const __m128i* p = reinterpret_cast<const __m128i*>(q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_add_epi32(_mm_add_epi32(_mm_load_si128(p), _mm_load_si128(p + 1)),
                                   _mm_add_epi32(_mm_load_si128(p + 2), _mm_load_si128(p + 3))));
  } else {
    for (int r = 0; r < NR; ++r) out[r] = IReduce(v[r]);
  }
}
#endif

// I[r] and J[r] of weight unit w with unit u of the NR activation rows x[0 … NR).
template <int kOffset, bool kMins, int NR>
[[gnu::always_inline]] inline void Q8KUnitInts(const Q8KUnit& w, const Q8KActRow* x, int64_t u,
                                               int32_t* I, int32_t* J) {
#if defined(KVLENS_Q8_VNNI)
  constexpr __mmask16 kAll16 = 0xFFFF;
  const __m512i c16 = _mm512_load_si512(w.c);
  __m512i scl[4], q[4];
#pragma GCC unroll 4
  for (int ch = 0; ch < 4; ++ch) {
    // Lane j of a 64-element chunk's dot holds elements 4j … 4j + 3: sub-block 4·ch + j/4.
    const __m512i idx = _mm512_setr_epi32(
        4 * ch, 4 * ch, 4 * ch, 4 * ch, 4 * ch + 1, 4 * ch + 1, 4 * ch + 1, 4 * ch + 1, 4 * ch + 2,
        4 * ch + 2, 4 * ch + 2, 4 * ch + 2, 4 * ch + 3, 4 * ch + 3, 4 * ch + 3, 4 * ch + 3);
    scl[ch] = _mm512_maskz_permutexvar_epi32(kAll16, idx, c16);
    q[ch] = _mm512_load_si512(w.quants.q + 64 * ch);
  }
  __m512i v[NR], z[NR];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
    const int8_t* a = x[r].a + u * kQ8Unit;
    v[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int ch = 0; ch < 4; ++ch) {
      const __m512i p = _mm512_maskz_dpbusd_epi32(kAll16, _mm512_setzero_si512(), q[ch],
                                                  _mm512_loadu_si512(a + 64 * ch));
      v[r] = _mm512_maskz_add_epi32(kAll16, v[r], _mm512_maskz_mullo_epi32(kAll16, p, scl[ch]));
    }
    const __m512i b16 = _mm512_loadu_si512(x[r].bsum + u * kQ8Subs);
    if constexpr (kMins) {
      z[r] = _mm512_maskz_mullo_epi32(kAll16, _mm512_load_si512(w.m), b16);
    } else {
      // Σ c_s (q − o) a = Σ c_s q a − o Σ c_s B_s (o a power of two).
      static_assert(kOffset > 0 && (kOffset & (kOffset - 1)) == 0);
      constexpr int kShift = __builtin_ctz(kOffset);
      v[r] = _mm512_maskz_sub_epi32(
          kAll16, v[r],
          _mm512_maskz_slli_epi32(kAll16, _mm512_maskz_mullo_epi32(kAll16, c16, b16), kShift));
    }
  }
  IReduceRows<NR>(v, I);
  if constexpr (kMins) IReduceRows<NR>(z, J);
#else
  for (int r = 0; r < NR; ++r) {
    const int8_t* a = x[r].a + u * kQ8Unit;
    const int32_t* bsum = x[r].bsum + u * kQ8Subs;
    int32_t i_sum = 0, j_sum = 0;
    for (int s = 0; s < kQ8Subs; ++s) {
      int32_t dot = 0;
      for (int i = 16 * s; i < 16 * s + 16; ++i) {
        dot += (static_cast<int32_t>(w.quants.q[i]) - kOffset) * a[i];
      }
      i_sum += w.c[s] * dot;
      j_sum += w.m[s] * bsum[s];
    }
    I[r] = i_sum;
    J[r] = j_sum;
  }
#endif
}

// y ← the unit's share, in the scheme's order.
template <bool kMins>
[[gnu::always_inline]] inline float Q8KStep(float y, int32_t I, int32_t J, float D, float M,
                                            float d) {
  y = std::fma(static_cast<float>(I), D * d, y);
  if constexpr (kMins) y = std::fma(-static_cast<float>(J), M * d, y);
  return y;
}

// ---- Many rows: 16 rows a vector ----
#if defined(KVLENS_Q8_VNNI)
constexpr int kQ8KCols = 8;  // weight rows a tile (kQ8TileRows rows: q8_products.h)

// One weight unit as the tile reads it: the signed quants q − o (broadcast 4 at a time), c
// per 16 elements, the mins in int16 pairs (m_2j, m_2j+1), D and M, and corr = 128 ·
// Σ_s c_s Σ_{i∈s} (q_i − o), which takes back the + 128 of the tile's unsigned activations.
struct Q8KGemmUnit {
  alignas(64) int8_t w[kQ8Unit];
  int32_t c[kQ8Subs];
  int32_t mpair[kQ8Subs / 2];
  int32_t corr;
  float D, M;
};

template <int kOffset>
inline void ToGemmUnit(const Q8KUnit& u, Q8KGemmUnit* g) {
  constexpr __mmask16 kAll16 = 0xFFFF;
  const __m512i c16 = _mm512_load_si512(u.c);
  __m512i wsum = _mm512_setzero_si512();
  for (int ch = 0; ch < 4; ++ch) {
    const __m512i q = _mm512_load_si512(u.quants.q + 64 * ch);
    _mm512_store_si512(
        g->w + 64 * ch,
        _mm512_maskz_sub_epi8(~__mmask64{0}, q, _mm512_set1_epi8(static_cast<char>(kOffset))));
    // Σ q over each lane's 4 elements, times the lane's c (sub-block 4·ch + j/4).
    const __m512i idx = _mm512_setr_epi32(
        4 * ch, 4 * ch, 4 * ch, 4 * ch, 4 * ch + 1, 4 * ch + 1, 4 * ch + 1, 4 * ch + 1, 4 * ch + 2,
        4 * ch + 2, 4 * ch + 2, 4 * ch + 2, 4 * ch + 3, 4 * ch + 3, 4 * ch + 3, 4 * ch + 3);
    const __m512i s4 =
        _mm512_maskz_dpbusd_epi32(kAll16, _mm512_setzero_si512(), q, _mm512_set1_epi8(1));
    wsum = _mm512_maskz_add_epi32(
        kAll16, wsum,
        _mm512_maskz_mullo_epi32(kAll16, s4, _mm512_maskz_permutexvar_epi32(kAll16, idx, c16)));
  }
  // Σ_s c_s Σ (q − o) = Σ c_s Σ q − 16 · o · Σ c_s.
  g->corr = 128 * (IReduce(wsum) - 16 * kOffset * IReduce(c16));
  for (int s = 0; s < kQ8Subs; ++s) g->c[s] = u.c[s];
  for (int j = 0; j < kQ8Subs / 2; ++j) {
    g->mpair[j] = static_cast<int32_t>((static_cast<uint32_t>(u.m[2 * j]) & 0xFFFFu) |
                                       (static_cast<uint32_t>(u.m[2 * j + 1]) << 16));
  }
  g->D = u.D;
  g->M = u.M;
}

// A group of up to 16 activation rows' unit u as the tile reads it: A[t] holds in lane r
// row r's elements 4t … 4t + 3 as unsigned bytes a + 128; d and the B pairs (B_2j, B_2j+1)
// one row a lane. Missing rows are zeros (a = 0, d = 0).
struct Q8KGemmAct {
  alignas(64) uint8_t A[kQ8Unit / 4][64];
  alignas(64) float d[16];
  alignas(64) int32_t bpair[kQ8Subs / 2][16];
};

inline void PackQ8KGroup(const Q8KActRow* rows, int count, int64_t u, Q8KGemmAct* p) {
  for (int r = 0; r < kQ8TileRows; ++r) {
    if (r >= count) {
      for (int t = 0; t < kQ8Unit / 4; ++t) std::memset(&p->A[t][4 * r], 0x80, 4);
      p->d[r] = 0.0f;
      for (int j = 0; j < kQ8Subs / 2; ++j) p->bpair[j][r] = 0;
      continue;
    }
    const int8_t* a = rows[r].a + u * kQ8Unit;
    for (int t = 0; t < kQ8Unit / 4; ++t) {
      uint32_t v;
      std::memcpy(&v, a + 4 * t, 4);
      v ^= 0x80808080u;
      std::memcpy(&p->A[t][4 * r], &v, 4);
    }
    p->d[r] = rows[r].d[u];
    const int32_t* b = rows[r].bsum + u * kQ8Subs;
    for (int j = 0; j < kQ8Subs / 2; ++j) {
      p->bpair[j][r] = static_cast<int32_t>((static_cast<uint32_t>(b[2 * j]) & 0xFFFFu) |
                                            (static_cast<uint32_t>(b[2 * j + 1]) << 16));
    }
  }
}

// y[c] (lane r: row r) = the chain over the units of weight rows w[c] (units each) with a
// packed group (units Q8KGemmAct); kSub is the width of the type's scales, 16 or 32.
template <int W, int kSub, bool kMins>
inline void Q8KGemmTile(const Q8KGemmAct* act, int64_t units, const Q8KGemmUnit* const* w,
                        __m512 (&y)[W]) {
  constexpr __mmask16 kAll16 = 0xFFFF;
#pragma GCC unroll 8
  for (int c = 0; c < W; ++c) y[c] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {
    const Q8KGemmAct& p = act[u];
    __m512i tot[W];
#pragma GCC unroll 8
    for (int c = 0; c < W; ++c) tot[c] = _mm512_setzero_si512();
    for (int s0 = 0; s0 < kQ8Unit; s0 += kSub) {
      __m512i acc[W];
#pragma GCC unroll 8
      for (int c = 0; c < W; ++c) acc[c] = _mm512_setzero_si512();
        // A constant trip count: GCC at -O2 ignores (and warns about) the unroll otherwise.
#pragma GCC unroll 8
      for (int i = 0; i < kSub / 4; ++i) {
        const int t = s0 / 4 + i;
        const __m512i a = _mm512_load_si512(p.A[t]);
#pragma GCC unroll 8
        for (int c = 0; c < W; ++c) {
          int32_t q4;
          std::memcpy(&q4, w[c][u].w + 4 * t, 4);
          acc[c] = _mm512_maskz_dpbusd_epi32(kAll16, acc[c], a, _mm512_set1_epi32(q4));
        }
      }
#pragma GCC unroll 8
      for (int c = 0; c < W; ++c) {
        tot[c] = _mm512_maskz_add_epi32(
            kAll16, tot[c],
            _mm512_maskz_mullo_epi32(kAll16, acc[c], _mm512_set1_epi32(w[c][u].c[s0 / 16])));
      }
    }
    const __m512 dv = _mm512_load_ps(p.d);
#pragma GCC unroll 8
    for (int c = 0; c < W; ++c) {
      const __m512i I = _mm512_maskz_sub_epi32(kAll16, tot[c], _mm512_set1_epi32(w[c][u].corr));
      y[c] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAll16, I),
                             _mm512_mul_ps(dv, _mm512_set1_ps(w[c][u].D)), y[c]);
      if constexpr (kMins) {
        __m512i J = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < kQ8Subs / 2; ++j) {
          J = _mm512_maskz_dpwssd_epi32(kAll16, J, _mm512_load_si512(p.bpair[j]),
                                        _mm512_set1_epi32(w[c][u].mpair[j]));
        }
        y[c] = _mm512_fnmadd_ps(_mm512_maskz_cvtepi32_ps(kAll16, J),
                                _mm512_mul_ps(dv, _mm512_set1_ps(w[c][u].M)), y[c]);
      }
    }
  }
}

#endif

// The 256-element types' scheme, as CpuBackend::MatMulInt8 and MatMulTiled drive it (see
// Q8BScheme): d per unit, Σ a per 16 elements.
template <DType kType>
struct Q8KScheme {
  using Row = Q8KActRow;
  using Unit = Q8KUnit;
  static int64_t Padded(int64_t in) { return in; }  // whole super-blocks already
  static int64_t Scales(int64_t in) { return in / kQ8Unit; }
  static int64_t Sums(int64_t in) { return in / 16; }
  static void Quantize(const float* x, int64_t in, int8_t* a, float* d, int32_t* bsum) {
    QuantizeRowQ8K(x, in, a, d, bsum);
  }
  static Row RowAt(int8_t* a, float* d, int32_t* bsum) { return Row{a, d, bsum}; }
  static void UnpackUnit(const uint8_t* row, int64_t in, int64_t u, Unit* out) {
    UnpackQ8K<kType>(row, in, u, out);
  }
  template <int NR>
  static void Step(const Unit& w, const Row* x, int64_t u, float* acc) {
    constexpr bool kMins = Q8KHasMins(kType);
    int32_t I[NR], J[NR];
    Q8KUnitInts<Q8KOffset(kType), kMins, NR>(w, x, u, I, J);
    for (int r = 0; r < NR; ++r) acc[r] = Q8KStep<kMins>(acc[r], I[r], J[r], w.D, w.M, x[r].d[u]);
  }
#if defined(KVLENS_Q8_VNNI)
  using Act = Q8KGemmAct;
  using TileUnit = Q8KGemmUnit;
  static constexpr int kCols = kQ8KCols;
  static void Pack(const Row* rows, int count, int64_t u, Act* p) {
    PackQ8KGroup(rows, count, u, p);
  }
  static void UnpackTile(const uint8_t* row, int64_t in, int64_t u, TileUnit* g) {
    Q8KUnit tmp;
    UnpackQ8K<kType>(row, in, u, &tmp);
    ToGemmUnit<Q8KOffset(kType)>(tmp, g);
  }
  template <int W>
  static void Tile(const Act* act, int64_t units, const TileUnit* const* w, __m512 (&y)[W]) {
    // kSub: the width of the type's scales.
    constexpr int kSub =
        kType == DType::kQ4_K || kType == DType::kQ5_K || kType == DType::kIQ4_XS ? 32 : 16;
    Q8KGemmTile<W, kSub, Q8KHasMins(kType)>(act, units, w, y);
  }
#endif
};

}  // namespace
}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_Q8K_PRODUCTS_H_
