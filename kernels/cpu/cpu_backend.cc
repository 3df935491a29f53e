// Compiled with -march=native when the build allows it (kernels/CMakeLists.txt). Every
// SIMD helper lives in this file's anonymous namespace, so code built for different
// instruction sets never meets in one inline function.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels/attention_check.h"
#include "kernels/fast_exp.h"

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

// Σ a[i]·b[i]
inline float Dot(const float* a, const float* b, int64_t n) {
  Vec acc0 = VZero(), acc1 = VZero();
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    acc0 = VFma(VLoad(a + i), VLoad(b + i), acc0);
    acc1 = VFma(VLoad(a + i + kLanes), VLoad(b + i + kLanes), acc1);
  }
  for (; i + kLanes <= n; i += kLanes) acc0 = VFma(VLoad(a + i), VLoad(b + i), acc0);
  float sum = VSum(VAdd(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Σ a[i]
inline float Sum(const float* a, int64_t n) {
  Vec acc = VZero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = VAdd(acc, VLoad(a + i));
  float sum = VSum(acc);
  for (; i < n; ++i) sum += a[i];
  return sum;
}

// ---- MatMul ----

// The register tile: kTileN activation rows × kTileW weight rows of dot products.
constexpr int kTileN = 4;
#if defined(__AVX512F__)
constexpr int kTileW = 4;  // 16 accumulators + 4 weight vectors + 1 x vector of 32 zmm
#else
constexpr int kTileW = 2;  // 8 accumulators + 2 + 1 of 16 ymm
#endif
// Weight rows dequantised together; each is then used by every x row of the chunk.
constexpr int kWBlock = 8;
// Activation rows per pass over a weight block (keeps the x chunk in L2).
constexpr int kNChunk = 64;
// Inner-dimension slice: kWBlock weight slices plus a kTileN x tile stay in L1 (24 KiB).
constexpr int64_t kKBlock = 512;

// A weight row as DotTile reads it: kLanes weights from k as floats (Load), or one (At).
// Each gives exactly DequantizeRowFast's floats (a q8_0 weight is d · q, one rounding), so
// a product reads the stored row in place or a dequantised copy with the same result.
struct F32Row {
  const float* p;
  Vec Load(int64_t k) const { return VLoad(p + k); }
  float At(int64_t k) const { return p[k]; }
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
    const __m512 q = _mm512_maskz_cvtepi32_ps(
        static_cast<__mmask16>(0xFFFF),
        _mm512_maskz_cvtepi8_epi32(static_cast<__mmask16>(0xFFFF),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(Quants(k)))));
    return _mm512_mul_ps(_mm512_set1_ps(Scale(k)), q);
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

// y[r·y_stride + c] (+)= Σ_k x[r·x_stride + k] · w[c][k0 + k]   for r < NR, c < WR, k < len
template <int NR, int WR, typename Row>
inline void DotTile(const float* x, int64_t x_stride, const Row* w, int64_t k0, int64_t len,
                    float* y, int64_t y_stride, bool accumulate) {
  Vec acc[NR][WR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < WR; ++c) acc[r][c] = VZero();
  }
  int64_t k = 0;
  for (; k + kLanes <= len; k += kLanes) {
    Vec wv[WR];
#pragma GCC unroll 16
    for (int c = 0; c < WR; ++c) wv[c] = w[c].Load(k0 + k);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const Vec xv = VLoad(x + r * x_stride + k);
#pragma GCC unroll 16
      for (int c = 0; c < WR; ++c) acc[r][c] = VFma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < WR; ++c) {
      float sum = VSum(acc[r][c]);
      for (int64_t t = k; t < len; ++t) sum = std::fma(x[r * x_stride + t], w[c].At(k0 + t), sum);
      y[r * y_stride + c] = accumulate ? y[r * y_stride + c] + sum : sum;
    }
  }
}

template <int NR, typename Row>
inline void DotRows(const float* x, int64_t x_stride, const Row* w, int num_w, int64_t k0,
                    int64_t len, float* y, int64_t y_stride, bool acc) {
  int c = 0;
  for (; c + kTileW <= num_w; c += kTileW) {
    DotTile<NR, kTileW>(x, x_stride, w + c, k0, len, y + c, y_stride, acc);
  }
  for (; c < num_w; ++c) DotTile<NR, 1>(x, x_stride, w + c, k0, len, y + c, y_stride, acc);
}

template <typename Row>
inline void DotBlock(const float* x, int64_t x_stride, int nr, const Row* w, int num_w, int64_t k0,
                     int64_t len, float* y, int64_t y_stride, bool acc) {
  switch (nr) {
    case 4:
      return DotRows<4>(x, x_stride, w, num_w, k0, len, y, y_stride, acc);
    case 3:
      return DotRows<3>(x, x_stride, w, num_w, k0, len, y, y_stride, acc);
    case 2:
      return DotRows<2>(x, x_stride, w, num_w, k0, len, y, y_stride, acc);
    default:
      return DotRows<1>(x, x_stride, w, num_w, k0, len, y, y_stride, acc);
  }
}

// ---- MatMul, many rows: the same sums, vectorised across rows ----
//
// DotTile's result for one x row and one weight row is a fixed sequence of roundings: per
// slice of kKBlock inputs, kLanes chains of FMAs (lane j takes k = j, j + kLanes, … of the
// slice), VSum's tree over the lanes, the slice's last len % kLanes products one FMA each,
// then the slice added to y. From kPackedMinRows rows of x on, MatMul computes that very
// sequence for kLanes rows at once, one row a lane, which spares DotTile's horizontal sums
// and half its loads: x is packed in groups of kGroup rows, column by column
// (xp[k·kGroup + r] = x[r][k], two vectors a column), and per k the column's vector loads
// and one broadcast of w[c][k] a weight row feed a fused multiply-add for each vector. A
// group of two vectors takes 6 weight rows (12 accumulators, 15 registers with the column
// and the broadcast), a group's last vector alone (at most kLanes rows) 12. So a row's
// outputs are bit for bit the same whatever else is in the batch (docs/architecture.md:
// batching never changes results). On this project's Zen 4 machine one thread went from
// 55 to ~90 GFLOP/s on 64 rows (kvlens_bench_matmul; its FMA peak is 116).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kPackedMatMul = true;
#else
constexpr bool kPackedMatMul = false;  // the portable Vec's VSum is another order
#endif
constexpr int kGroup = 2 * kLanes;  // x rows a packed group
constexpr int kPackW = 12;          // weight rows dequantised together
constexpr int kPackedMinRows = 16;

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

// r[i][j] ↔ r[j][i]: kLanes vectors transposed in registers (unpack, then shuffles of
// pairs, then of 128-bit quarters).
#if defined(__AVX512F__)
inline void TransposeLanes(Vec (&r)[kLanes]) {
  // The masked forms: GCC 12's plain ones warn spuriously (as in VLoad above).
  constexpr __mmask16 kAll = 0xFFFF;
  Vec t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_maskz_unpacklo_ps(kAll, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_maskz_unpackhi_ps(kAll, r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] =
        _mm512_maskz_shuffle_ps(kAll, t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] =
        _mm512_maskz_shuffle_ps(kAll, t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] =
        _mm512_maskz_shuffle_ps(kAll, t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] =
        _mm512_maskz_shuffle_ps(kAll, t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_maskz_shuffle_f32x4(kAll, r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_maskz_shuffle_f32x4(kAll, r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_maskz_shuffle_f32x4(kAll, r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_maskz_shuffle_f32x4(kAll, r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_maskz_shuffle_f32x4(kAll, t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_maskz_shuffle_f32x4(kAll, t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_maskz_shuffle_f32x4(kAll, t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_maskz_shuffle_f32x4(kAll, t[4 + i], t[12 + i], 0xdd);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
inline void TransposeLanes(Vec (&r)[kLanes]) {
  Vec t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}
#endif

// Where x's column k sits in a packed group: within each slice of kKBlock, the columns of
// lane j's chain (k = j, j + kLanes, …) one after another, so that each chain reads its
// columns in order; the slice's last len % kLanes columns stay in place.
inline int64_t PackedColumn(int64_t k, int64_t len) {
  const int64_t k0 = k / kKBlock * kKBlock;
  const int64_t steps = std::min(kKBlock, len - k0) / kLanes;
  const int64_t off = k - k0;
  return off < steps * kLanes ? k0 + off % kLanes * steps + off / kLanes : k;
}

// Group g of x's n rows (zeros past row n) packed by columns into dst (PackedColumn): per
// kLanes rows and kLanes consecutive columns, the loaded rows transposed in registers and
// each column stored whole; a slice's last len % kLanes columns one element at a time.
inline void PackGroup(const float* x, int n, int64_t in, int64_t g, float* dst) {
  for (int h = 0; h < kGroup / kLanes; ++h) {
    const int64_t row0 = g * kGroup + int64_t{h} * kLanes;
    const int rows = static_cast<int>(std::clamp<int64_t>(n - row0, 0, kLanes));
    for (int64_t k0 = 0; k0 < in; k0 += kKBlock) {
      const int64_t slice = std::min(kKBlock, in - k0);
      const int64_t steps = slice / kLanes;
      for (int64_t i = 0; i < steps; ++i) {
        Vec r[kLanes];
        for (int t = 0; t < kLanes; ++t) {
          r[t] = t < rows ? VLoad(x + (row0 + t) * in + k0 + i * kLanes) : VZero();
        }
        TransposeLanes(r);  // r[j]: the rows' column k0 + i·kLanes + j
        for (int j = 0; j < kLanes; ++j) {
          VStore(dst + (k0 + j * steps + i) * kGroup + h * kLanes, r[j]);
        }
      }
      for (int64_t k = k0 + steps * kLanes; k < k0 + slice; ++k) {
        for (int t = 0; t < kLanes; ++t) {
          dst[k * kGroup + h * kLanes + t] = t < rows ? x[(row0 + t) * in + k] : 0.0f;
        }
      }
    }
  }
}

// y[r·y_stride + c] as DotTile computes it, for r < rows (≤ XV·kLanes) of a packed group
// (columns placed by PackedColumn) and c < WR.
template <int WR, int XV>
inline void OuterTile(const float* xp, const float* const* w, int64_t len, float* y,
                      int64_t y_stride, int rows) {
  alignas(64) float part[WR][kLanes][XV * kLanes];  // the lanes' chains of one slice
  alignas(64) float sum[WR][XV * kLanes];
  for (int64_t k0 = 0; k0 < len; k0 += kKBlock) {
    const int64_t slice = std::min(kKBlock, len - k0);
    const int64_t steps = slice / kLanes;
    for (int j = 0; j < kLanes; ++j) {
      Vec acc[WR][XV];
#pragma GCC unroll 16
      for (int c = 0; c < WR; ++c) {
#pragma GCC unroll 2
        for (int v = 0; v < XV; ++v) acc[c][v] = VZero();
      }
      const float* col = xp + (k0 + j * steps) * kGroup;
      for (int64_t i = 0; i < steps; ++i, col += kGroup) {
        const int64_t k = k0 + j + i * kLanes;
        Vec xv[XV];
#pragma GCC unroll 2
        for (int v = 0; v < XV; ++v) xv[v] = VLoad(col + v * kLanes);
#pragma GCC unroll 16
        for (int c = 0; c < WR; ++c) {
          const Vec b = VSet1(w[c][k]);
#pragma GCC unroll 2
          for (int v = 0; v < XV; ++v) acc[c][v] = VFma(xv[v], b, acc[c][v]);
        }
      }
#pragma GCC unroll 16
      for (int c = 0; c < WR; ++c) {
#pragma GCC unroll 2
        for (int v = 0; v < XV; ++v) VStore(part[c][j] + v * kLanes, acc[c][v]);
      }
    }
    for (int c = 0; c < WR; ++c) {
      for (int v = 0; v < XV; ++v) {
        Vec lanes[kLanes];
        for (int j = 0; j < kLanes; ++j) lanes[j] = VLoad(part[c][j] + v * kLanes);
        Vec total = VSumTree(lanes);
        for (int64_t k = k0 + steps * kLanes; k < k0 + slice; ++k) {
          total = VFma(VLoad(xp + k * kGroup + v * kLanes), VSet1(w[c][k]), total);
        }
        VStore(sum[c] + v * kLanes, total);
      }
    }
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < WR; ++c) {
        y[r * y_stride + c] = k0 > 0 ? y[r * y_stride + c] + sum[c][r] : sum[c][r];
      }
    }
  }
}

// OuterTile for num_w ≤ WR weight rows.
template <int XV, int WR = 6>
inline void OuterTileOf(int num_w, const float* xp, const float* const* w, int64_t len, float* y,
                        int64_t y_stride, int rows) {
  if (num_w == WR) return OuterTile<WR, XV>(xp, w, len, y, y_stride, rows);
  if constexpr (WR > 1) OuterTileOf<XV, WR - 1>(num_w, xp, w, len, y, y_stride, rows);
}

// The num_w ≤ kPackW weight rows w against one packed group of `rows` rows.
inline void OuterGroup(const float* xp, const float* const* w, int num_w, int64_t len, float* y,
                       int64_t y_stride, int rows) {
  for (int c = 0; c < num_w; c += 6) {
    if (rows <= kLanes) {
      OuterTileOf<1>(std::min(6, num_w - c), xp, w + c, len, y + c, y_stride, rows);
    } else {
      OuterTileOf<2>(std::min(6, num_w - c), xp, w + c, len, y + c, y_stride, rows);
    }
  }
}

// Row r of w as floats (the SIMD-friendly twin of DequantizeRow<float>).
void DequantizeRowFast(const WeightView& w, int64_t r, float* out) {
  const uint8_t* src = w.row(r);
  const int64_t n = w.cols;
  switch (w.dtype) {
    case DType::kF32:
      std::memcpy(out, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16: {
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
      }
#endif
      for (; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = F16ToF32(h);
      }
      return;
    }
    case DType::kBF16: {
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        VStore(out + i, VLoad(reinterpret_cast<const uint16_t*>(src + 2 * i)));
      }
      for (; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(b) << 16;
        std::memcpy(out + i, &bits, 4);
      }
      return;
    }
    case DType::kQ8_0: {
      for (int64_t b = 0; b < n / kQ8_0BlockSize; ++b) {
        const uint8_t* block = src + b * kQ8_0BlockBytes;
        uint16_t d_bits;
        std::memcpy(&d_bits, block, 2);
#if defined(__F16C__)
        const float d = _cvtsh_ss(d_bits);  // exact, as F16ToF32
#else
        const float d = F16ToF32(d_bits);
#endif
        int8_t q[kQ8_0BlockSize];
        std::memcpy(q, block + 2, kQ8_0BlockSize);
        float* o = out + b * kQ8_0BlockSize;
        for (int i = 0; i < kQ8_0BlockSize; ++i) o[i] = d * static_cast<float>(q[i]);
      }
      return;
    }
  }
}

std::vector<float> VectorOf(const WeightView& w) {
  std::vector<float> v(static_cast<size_t>(w.cols));
  DequantizeRowFast(w, 0, v.data());
  return v;
}

// tanh z = sign(z)·(1 − e^(−2|z|)) / (1 + e^(−2|z|)), the exponential by ExpNegated: within
// ~2e-7 of tanh absolutely, and branch- and compare-free, so the loops below vectorise
// (libm's tanhf, one call an element, took 12% of a GPT-2 decode step's time).
inline float TanhOne(float z) {
  const float e = ExpNegated(2.0f * std::fabs(z));
  return std::copysign((1.0f - e) / (1.0f + e), z);
}

inline float GeluOne(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + TanhOne(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

// g·σ(g) = g / (1 + e^−g), as g·1 / (1 + e^−|g|) for g >= +0 and g·e^−|g| / (1 + e^−|g|)
// below, so the exponential never overflows; the sign is read from g's bits (a float
// compare would keep the loop from vectorising under -ftrapping-math).
inline float SiluOne(float g) {
  const float e = ExpNegated(std::fabs(g));
  uint32_t bits;
  std::memcpy(&bits, &g, sizeof(bits));
  const float num = (bits >> 31) != 0 ? e : 1.0f;
  return g * num / (1.0f + e);
}

}  // namespace

CpuBackend::CpuBackend(int num_threads) : pool_(std::make_unique<ThreadPool>(num_threads)) {}

std::string_view CpuBackend::SimdName() { return kSimdName; }

template <typename Fn>
void CpuBackend::ParallelRange(int64_t count, int64_t min_chunk, Fn&& fn) {
  if (count <= 0) return;
  const int64_t max_tasks = 4 * static_cast<int64_t>(pool_->num_threads());
  const int64_t chunk = std::max(min_chunk, (count + max_tasks - 1) / max_tasks);
  const int64_t tasks = (count + chunk - 1) / chunk;
  pool_->ParallelFor(tasks, [&](int64_t t) {
    const int64_t begin = t * chunk;
    fn(begin, std::min(count, begin + chunk));
  });
}

// y[N, out] = x[N, in] · Wᵀ + bias. From kPackedMinRows rows on (SIMD builds),
// MatMulPacked. Otherwise parallel over output features; inside a task, a block of kWBlock
// weight rows (read in place, or dequantised once into a copy) is multiplied with every x
// row of a chunk of kNChunk, slice by slice of kKBlock inputs, through kTileN × kTileW
// register tiles.
void CpuBackend::MatMul(const float* x, int n, const WeightView& w, const WeightView& bias,
                        float* y) {
  const int64_t in = w.cols, out = w.rows;
  if (n <= 0 || out <= 0) return;
  if (kPackedMatMul && n >= kPackedMinRows) return MatMulPacked(x, n, w, bias, y);
  const std::vector<float> b = bias.empty() ? std::vector<float>() : VectorOf(bias);
  // Below kPackedMinRows rows the products read the stored weights in place, widening
  // them as they load (each element is used by a few tiles of kTileN rows: converting it
  // each time measured faster than writing a float copy and reading it back, by 1.2–2.5×
  // at 1 to 12 rows). More rows (without the packed path) take the copy.
  const bool direct = n < kPackedMinRows;
  // Each task gets at least ~64K multiply-adds: waking threads costs more than tiny
  // products (a 260K-parameter model decodes fastest on one thread otherwise).
  const int64_t min_rows =
      std::max<int64_t>(kWBlock, ((int64_t{1} << 16) / std::max<int64_t>(1, in * n) + kWBlock - 1) /
                                     kWBlock * kWBlock);
  ParallelRange(out, min_rows, [&](int64_t o0, int64_t o1) {
    thread_local std::vector<float> w_buf;
    if (!direct) w_buf.resize(static_cast<size_t>(kWBlock * in));
    // The products of x rows n0 … n1 − 1 with weight rows ob … ob + num_w − 1.
    auto product = [&](int n0, int n1, int64_t ob, int num_w, const auto* rows) {
      for (int64_t k0 = 0; k0 < in; k0 += kKBlock) {
        const int64_t len = std::min(kKBlock, in - k0);
        for (int r0 = n0; r0 < n1; r0 += kTileN) {
          DotBlock(x + r0 * in + k0, in, std::min(kTileN, n1 - r0), rows, num_w, k0, len,
                   y + r0 * out + ob, out, /*acc=*/k0 > 0);
        }
      }
    };
    for (int n0 = 0; n0 < n; n0 += kNChunk) {
      const int n1 = std::min(n, n0 + kNChunk);
      for (int64_t ob = o0; ob < o1; ob += kWBlock) {
        const int num_w = static_cast<int>(std::min<int64_t>(kWBlock, o1 - ob));
        if (!direct) {
          F32Row rows[kWBlock];
          for (int c = 0; c < num_w; ++c) {
            DequantizeRowFast(w, ob + c, w_buf.data() + c * in);
            rows[c] = F32Row{w_buf.data() + c * in};
          }
          product(n0, n1, ob, num_w, rows);
          continue;
        }
        auto in_place = [&](auto row) {
          decltype(row) rows[kWBlock];
          for (int c = 0; c < num_w; ++c) rows[c] = decltype(row){w.row(ob + c)};
          product(n0, n1, ob, num_w, rows);
        };
        switch (w.dtype) {
          case DType::kF32: {
            F32Row rows[kWBlock];
            for (int c = 0; c < num_w; ++c) {
              rows[c] = F32Row{reinterpret_cast<const float*>(w.row(ob + c))};
            }
            product(n0, n1, ob, num_w, rows);
            break;
          }
          case DType::kBF16:
            in_place(Bf16Row{});
            break;
          case DType::kF16:
            in_place(F16Row{});
            break;
          case DType::kQ8_0:
            in_place(Q8Row{});
            break;
        }
      }
      if (!b.empty()) {
        for (int r = n0; r < n1; ++r) {
          for (int64_t o = o0; o < o1; ++o) y[r * out + o] += b[o];
        }
      }
    }
  });
}

// MatMul from kPackedMinRows rows on (see OuterTile), kPackedChunkRows rows of x at a time:
// the chunk packed, in parallel over its groups (zeros past its last row), then parallel
// over output features as above, kPackW weight rows dequantised at a time and multiplied
// with every group of the chunk.
void CpuBackend::MatMulPacked(const float* x, int n, const WeightView& w, const WeightView& bias,
                              float* y) {
  constexpr int kPackedChunkRows = 8 * kGroup;
  const int64_t in = w.cols, out = w.rows;
  for (int r0 = 0; r0 < n; r0 += kPackedChunkRows) {
    const int rows = std::min(kPackedChunkRows, n - r0);
    MatMulPackedChunk(x + int64_t{r0} * in, rows, w, bias, y + int64_t{r0} * out);
  }
}

void CpuBackend::MatMulPackedChunk(const float* x, int n, const WeightView& w,
                                   const WeightView& bias, float* y) {
  const int64_t in = w.cols, out = w.rows;
  const std::vector<float> b = bias.empty() ? std::vector<float>() : VectorOf(bias);
  const int groups = (n + kGroup - 1) / kGroup;
  const size_t group_floats = static_cast<size_t>(in) * kGroup;
  // Kept by the calling thread (a step's products reuse it: no page faults per call), at
  // most kPackedChunkRows · in floats.
  thread_local std::vector<float> packed;
  if (packed.size() < groups * group_floats) packed.resize(groups * group_floats);
  float* xp = packed.data();
  ParallelRange(groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) PackGroup(x, n, in, g, xp + g * group_floats);
  });
  const bool direct = w.dtype == DType::kF32;
  const int64_t min_rows = std::max<int64_t>(
      kPackW, ((int64_t{1} << 16) / std::max<int64_t>(1, in * n) + kPackW - 1) / kPackW * kPackW);
  ParallelRange(out, min_rows, [&](int64_t o0, int64_t o1) {
    thread_local std::vector<float> w_buf;
    if (!direct) w_buf.resize(static_cast<size_t>(kPackW * in));
    for (int64_t ob = o0; ob < o1; ob += kPackW) {
      const int num_w = static_cast<int>(std::min<int64_t>(kPackW, o1 - ob));
      const float* w_rows[kPackW];
      for (int c = 0; c < num_w; ++c) {
        if (direct) {
          w_rows[c] = reinterpret_cast<const float*>(w.row(ob + c));
        } else {
          DequantizeRowFast(w, ob + c, w_buf.data() + c * in);
          w_rows[c] = w_buf.data() + c * in;
        }
      }
      for (int g = 0; g < groups; ++g) {
        OuterGroup(xp + g * group_floats, w_rows, num_w, in, y + int64_t{g} * kGroup * out + ob,
                   out, std::min(kGroup, n - g * kGroup));
      }
    }
    if (!b.empty()) {
      for (int r = 0; r < n; ++r) {
        for (int64_t o = o0; o < o1; ++o) y[r * out + o] += b[o];
      }
    }
  });
}

void CpuBackend::Embedding(const WeightView& table, const int32_t* ids, int n, float* out) {
  for (int r = 0; r < n; ++r) DequantizeRowFast(table, ids[r], out + r * table.cols);
}

void CpuBackend::RmsNorm(const float* x, int n, int dim, const WeightView& weight, double eps,
                         float* y) {
  const std::vector<float> g = VectorOf(weight);
  ParallelRange(n, std::max<int64_t>(1, 16384 / std::max(dim, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      const float mean_sq = Dot(xr, xr, dim) / static_cast<float>(dim);
      const float inv_rms = static_cast<float>(1.0 / std::sqrt(static_cast<double>(mean_sq) + eps));
      for (int i = 0; i < dim; ++i) yr[i] = xr[i] * inv_rms * g[i];
    }
  });
}

void CpuBackend::LayerNorm(const float* x, int n, int dim, const WeightView& weight,
                           const WeightView& bias, double eps, float* y) {
  const std::vector<float> g = VectorOf(weight);
  const std::vector<float> b = bias.empty() ? std::vector<float>(dim, 0.0f) : VectorOf(bias);
  ParallelRange(n, std::max<int64_t>(1, 16384 / std::max(dim, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      const float mean = Sum(xr, dim) / static_cast<float>(dim);
      // Two passes (centre, then square) so a large mean does not cancel the variance.
      for (int i = 0; i < dim; ++i) yr[i] = xr[i] - mean;
      const float var = Dot(yr, yr, dim) / static_cast<float>(dim);
      const float inv_std = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var) + eps));
      for (int i = 0; i < dim; ++i) yr[i] = yr[i] * inv_std * g[i] + b[i];
    }
  });
}

void CpuBackend::Rope(float* x, int n, int64_t row_stride, int num_heads, int head_dim,
                      const int32_t* positions, double theta, RopeStyle style) {
  const int half = head_dim / 2;
  std::vector<double> inv_freq(half);
  for (int p = 0; p < half; ++p) inv_freq[p] = std::pow(theta, -2.0 * p / head_dim);
  ParallelRange(n, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> cos_t(half), sin_t(half);
    for (int64_t r = r0; r < r1; ++r) {
      // Angles in double: position · frequency reaches 1e5 rad, beyond float's precision.
      for (int p = 0; p < half; ++p) {
        const double angle = positions[r] * inv_freq[p];
        cos_t[p] = static_cast<float>(std::cos(angle));
        sin_t[p] = static_cast<float>(std::sin(angle));
      }
      for (int h = 0; h < num_heads; ++h) {
        float* head = x + r * row_stride + static_cast<int64_t>(h) * head_dim;
        if (style == RopeStyle::kAdjacentPairs) {
          for (int p = 0; p < half; ++p) {
            const float a = head[2 * p], b = head[2 * p + 1];
            head[2 * p] = a * cos_t[p] - b * sin_t[p];
            head[2 * p + 1] = a * sin_t[p] + b * cos_t[p];
          }
        } else {
          for (int p = 0; p < half; ++p) {
            const float a = head[p], b = head[p + half];
            head[p] = a * cos_t[p] - b * sin_t[p];
            head[p + half] = a * sin_t[p] + b * cos_t[p];
          }
        }
      }
    }
  });
}

void CpuBackend::Gelu(float* x, int64_t count) {
  ParallelRange(count, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) x[i] = GeluOne(x[i]);
  });
}

void CpuBackend::SwiGlu(const float* gate, const float* up, int64_t count, float* out) {
  ParallelRange(count, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = SiluOne(gate[i]) * up[i];
  });
}

void CpuBackend::Add(float* y, const float* x, int64_t count) {
  ParallelRange(count, 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] += x[i];
  });
}

void CpuBackend::StoreKv(const float* k, const float* v, int n, int64_t src_stride,
                         int64_t row_elems, const int64_t* dst_rows, void* k_cache, void* v_cache,
                         int64_t cache_stride, KvDtype cache_dtype) {
  for (int r = 0; r < n; ++r) {
    if (dst_rows[r] < 0) continue;  // a padding row
    KvStoreRow(k_cache, dst_rows[r] * cache_stride, k + r * src_stride, row_elems, cache_dtype);
    KvStoreRow(v_cache, dst_rows[r] * cache_stride, v + r * src_stride, row_elems, cache_dtype);
  }
}

// Asks for the cache lines of key (or value) t's n elements from column col: a paged
// cache's rows lie in blocks in any order, where the hardware prefetcher cannot follow.
inline void Prefetch(const KvSource<float>& kv, const void* base, int64_t t, int64_t col, int n) {
  const int64_t bytes = n * KvElementBytes<float>(kv.dtype);
  const char* p = static_cast<const char*>(base) +
                  (kv.PhysicalRow(t) * kv.row_stride + col) * KvElementBytes<float>(kv.dtype);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) { return BF16ToF32(bf16); }

// out[t] = Σ_i q[t][i]·k[i] for the m ≤ 4 vectors q[t] that meet the key row k (floats, or
// a bf16 cache's bits widened as they are loaded): one pass over k for all of them.
template <typename K>
inline void DotMany(const float* const* q, int m, const K* k, int64_t n, float* out) {
  Vec acc[4] = {VZero(), VZero(), VZero(), VZero()};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec kv = VLoad(k + i);
    for (int t = 0; t < m; ++t) acc[t] = VFma(VLoad(q[t] + i), kv, acc[t]);
  }
  for (int t = 0; t < m; ++t) {
    float sum = VSum(acc[t]);
    for (int64_t r = i; r < n; ++r) sum = std::fma(q[t][r], ToFloat(k[r]), sum);
    out[t] = sum;
  }
}

// o[t][i] += w[t]·v[i] for m ≤ 4 outputs: one pass over the value row v (as k above).
template <typename V>
inline void AxpyMany(float* const* o, int m, const float* w, const V* v, int64_t n) {
  Vec wv[4];
  for (int t = 0; t < m; ++t) wv[t] = VSet1(w[t]);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec vv = VLoad(v + i);
    for (int t = 0; t < m; ++t) VStore(o[t] + i, VFma(wv[t], vv, VLoad(o[t] + i)));
  }
  for (int t = 0; t < m; ++t) {
    for (int64_t r = i; r < n; ++r) o[t][r] = std::fma(w[t], ToFloat(v[r]), o[t][r]);
  }
}

// Decode attention split over the keys (FlashDecoding on the CPU): a task takes a span of
// kSplitSpan keys for every query row and every head, reading each key and value row
// whole (all KV heads, contiguous) once; it keeps per (row, head) the span's max m, sum
// l of its weights e^(s − m) and unnormalised output acc, merged at the end:
//   out = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s,  M = max_s m_s.
// Paged rows of a KV head are 4 KiB apart in fp32 (a row holds every KV head), so a task
// per KV head reads an eighth of each row it touches and waits on rows; this reads rows
// as they lie. Same visibility rule; no maps (those calls take the tiled path).
constexpr int kSplitSpan = 256;
constexpr int kSplitMaxQueries = 4;  // query rows of a call that takes this path

template <typename E>
void AttentionSplitKeys(const AttentionArgs<float>& a, ThreadPool& pool) {
  const int tq = a.num_queries, dh = a.head_dim, H = a.num_heads, Hkv = a.num_kv_heads;
  const int group = H / Hkv;
  const float scale = static_cast<float>(a.scale);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  int key_end = 0;
  for (int i = 0; i < tq; ++i) key_end = std::max(key_end, CausalKeyEnd(a, i));
  const int spans = (key_end + kSplitSpan - 1) / kSplitSpan;
  const int64_t rh = int64_t{tq} * H;  // (row, head) pairs
  std::vector<float> m(size_t(spans) * rh), l(m.size()), acc(m.size() * size_t(dh));
  const E* k_base = static_cast<const E*>(a.kv.k);
  const E* v_base = static_cast<const E*>(a.kv.v);
  pool.ParallelFor(spans, [&](int64_t sp) {
    const int j0 = static_cast<int>(sp) * kSplitSpan;
    const int j1 = std::min(key_end, j0 + kSplitSpan);
    thread_local std::vector<float> sc;  // [H][kSplitSpan] scores, then weights
    sc.resize(size_t(H) * kSplitSpan);
    for (int i = 0; i < tq; ++i) {
      const int end = std::min(j1, CausalKeyEnd(a, i));
      float* ms = m.data() + (sp * rh + int64_t{i} * H);
      float* ls = l.data() + (sp * rh + int64_t{i} * H);
      float* as = acc.data() + (sp * rh + int64_t{i} * H) * dh;
      std::fill(ms, ms + H, kNegInf);
      std::fill(ls, ls + H, 0.0f);
      std::fill(as, as + int64_t{H} * dh, 0.0f);
      if (end <= j0) continue;
      const float* q = a.q + i * a.q_stride;
      for (int j = j0; j < end; ++j) {
        float* sj = sc.data() + (j - j0);
        if (a.q_doc_ids != nullptr && a.q_doc_ids[i] != a.k_doc_ids[j]) {
          for (int h = 0; h < H; ++h) sj[size_t(h) * kSplitSpan] = kNegInf;
          continue;
        }
        const E* krow = k_base + a.kv.PhysicalRow(j) * a.kv.row_stride;
        for (int g = 0; g < Hkv; ++g) {
          for (int h0 = g * group; h0 < (g + 1) * group; h0 += 4) {
            const int n = std::min(4, (g + 1) * group - h0);
            const float* q4[4];
            float dots[4];
            for (int t = 0; t < n; ++t) q4[t] = q + int64_t{h0 + t} * dh;
            DotMany(q4, n, krow + int64_t{g} * dh, dh, dots);
            for (int t = 0; t < n; ++t) {
              const float x = scale * dots[t];
              sj[size_t(h0 + t) * kSplitSpan] = x;
              ms[h0 + t] = std::max(ms[h0 + t], x);
            }
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        float* sh = sc.data() + size_t(h) * kSplitSpan;
        if (ms[h] == kNegInf) continue;  // this span shows the row no key
        // e^(s − m), 0 for a masked key (s = −∞); a vectorised pass, then the sum.
        const float mh = ms[h];
        for (int j = 0; j < end - j0; ++j) sh[j] = ExpNegated(mh - sh[j]);
        float sum = 0.0f;
        for (int j = 0; j < end - j0; ++j) sum += sh[j];
        ls[h] = sum;
      }
      for (int j = j0; j < end; ++j) {
        const E* vrow = v_base + a.kv.PhysicalRow(j) * a.kv.row_stride;
        for (int g = 0; g < Hkv; ++g) {
          for (int h0 = g * group; h0 < (g + 1) * group; h0 += 4) {
            const int n = std::min(4, (g + 1) * group - h0);
            float* o4[4];
            float w[4];
            int live = 0;
            for (int t = 0; t < n; ++t) {
              const int h = h0 + t;
              const float wt = ms[h] == kNegInf ? 0.0f : sc[size_t(h) * kSplitSpan + (j - j0)];
              if (wt == 0.0f) continue;  // masked or underflowed: adds nothing
              o4[live] = as + int64_t{h} * dh;
              w[live++] = wt;
            }
            if (live > 0) AxpyMany(o4, live, w, vrow + int64_t{g} * dh, dh);
          }
        }
      }
    }
  });
  for (int i = 0; i < tq; ++i) {
    for (int h = 0; h < H; ++h) {
      float top = kNegInf;
      for (int sp = 0; sp < spans; ++sp) top = std::max(top, m[sp * rh + int64_t{i} * H + h]);
      float* o = a.out + i * a.out_stride + int64_t{h} * dh;
      std::fill(o, o + dh, 0.0f);
      float z = 0.0f;
      for (int sp = 0; sp < spans; ++sp) {
        const int64_t at = sp * rh + int64_t{i} * H + h;
        if (m[at] == kNegInf) continue;
        const float e = std::exp(m[at] - top);
        z += e * l[at];
        const float* as = acc.data() + at * dh;
        for (int d = 0; d < dh; ++d) o[d] += e * as[d];
      }
      const float inv_z = 1.0f / z;  // z > 0: every row sees a key (checked)
      for (int d = 0; d < dh; ++d) o[d] *= inv_z;
    }
  }
}

// Per (query row, head): scores of the causally reachable keys (−∞ for other documents),
// max subtracted, exponentials summed in fp32, p = e / Σe, then out = Σ p_j v_j with those
// very p. A task is (KV head, tile of query rows): every (row, head) pair of the tile that
// reads that KV head takes each key row, then each value row, in one pass (up to
// kMaxPairs of them; at most 4 share a register pass). One read of a row serves the whole
// tile, so decode reads the cache once per KV head (not once per query head) and a
// prefill chunk once per tile of rows. A bf16 cache's rows are widened in registers as
// they are loaded.
// ---- Attention, many (row, head) pairs: vectorised across the pairs ----
//
// From kLanes pairs of a call on (SIMD builds), scores, softmax and values run one pair a
// lane, as MatMulPacked runs rows: Q is packed by dims (qt[d][u]), and per dim a key's
// element is broadcast and a fused multiply-add goes into each pair vector's score for that
// key (6 keys and two pair vectors at a time: 12 accumulators); the softmax's max, e^(s −
// max) and sum run lane by lane down the keys; and O (packed by dims too) takes the
// weights of a key, a pair vector, times each of 6 of its value elements broadcast. Each
// score is formed exactly as DotMany forms it (its lanes' chains, then VSum's tree, done
// vertically), and each output exactly as AxpyMany's chain over the keys (a key of weight 0
// adds an exact 0), so a pair gets the same bits on either path, and rows after it in the
// call change none of them. Pairs past the task's last (padding lanes) see every key of
// the tile with a zero query, and are dropped.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kPairLanes = true;
#else
constexpr bool kPairLanes = false;
#endif

template <typename KT>
inline float KvAt(const KT* row, int d) {
  if constexpr (std::is_same_v<KT, float>) {
    return row[d];
  } else {
    return BF16ToF32(row[d]);
  }
}

// The scores of NK keys for pair vectors v < NV, each exactly as DotMany forms it (then
// scaled): per lane l of DotMany's vector, the chain over d = l, l + kLanes, … (qt holds
// the dims in that order: QtRow), VSum's tree over the lanes (VSumTree), then the last
// dh % kLanes dims one FMA each.
template <int NK, int NV, typename KT>
inline void ScoreTile(const float* qt, int64_t lanes, const KT* const* keys, int dh, float scale,
                      float* s_out) {
  const int steps = dh / kLanes;
  Vec part[kLanes][NK][NV];
  for (int l = 0; l < kLanes; ++l) {
    Vec acc[NK][NV];
#pragma GCC unroll 8
    for (int t = 0; t < NK; ++t) {
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[t][v] = VZero();
    }
    const float* q = qt + int64_t{l} * steps * lanes;
    for (int i = 0; i < steps; ++i, q += lanes) {
      const int d = l + i * kLanes;
      Vec qv[NV];
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) qv[v] = VLoad(q + v * kLanes);
#pragma GCC unroll 8
      for (int t = 0; t < NK; ++t) {
        const Vec b = VSet1(KvAt(keys[t], d));
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) acc[t][v] = VFma(qv[v], b, acc[t][v]);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NK; ++t) {
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) part[l][t][v] = acc[t][v];
    }
  }
  const Vec sv = VSet1(scale);
  for (int t = 0; t < NK; ++t) {
    for (int v = 0; v < NV; ++v) {
      Vec lanes_of[kLanes];
      for (int l = 0; l < kLanes; ++l) lanes_of[l] = part[l][t][v];
      Vec total = VSumTree(lanes_of);
      for (int d = steps * kLanes; d < dh; ++d) {
        total = VFma(VLoad(qt + int64_t{d} * lanes + v * kLanes), VSet1(KvAt(keys[t], d)), total);
      }
      VStore(s_out + t * lanes + v * kLanes, VMul(sv, total));
    }
  }
}

// Where dim d of a query sits in qt: DotMany's lane chains one after another (lane l's dims
// l, l + kLanes, … at rows l·steps …), the last dh % kLanes dims in place.
inline int QtRow(int d, int dh) {
  const int steps = dh / kLanes;
  return d < steps * kLanes ? d % kLanes * steps + d / kLanes : d;
}

// ot[d][v] += Σ_j p[j][v] · value_j[d] for dims d0 … d0 + ND − 1, pair vectors v < NV.
template <int ND, int NV, typename KT>
inline void ValueTile(const float* p, int64_t lanes, const KT* const* values, int key_end, int d0,
                      float* ot) {
  Vec acc[ND][NV];
#pragma GCC unroll 8
  for (int t = 0; t < ND; ++t) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[t][v] = VZero();
  }
  for (int j = 0; j < key_end; ++j) {
    Vec pv[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) pv[v] = VLoad(p + j * lanes + v * kLanes);
#pragma GCC unroll 8
    for (int t = 0; t < ND; ++t) {
      const Vec b = VSet1(KvAt(values[j], d0 + t));
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[t][v] = VFma(pv[v], b, acc[t][v]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < ND; ++t) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) VStore(ot + (d0 + t) * lanes + v * kLanes, acc[t][v]);
  }
}

template <int NV, typename KT, int ND = 6>
inline void ValueTileOf(int nd, const float* p, int64_t lanes, const KT* const* values, int key_end,
                        int d0, float* ot) {
  if (nd == ND) return ValueTile<ND, NV>(p, lanes, values, key_end, d0, ot);
  if constexpr (ND > 1) ValueTileOf<NV, KT, ND - 1>(nd, p, lanes, values, key_end, d0, ot);
}

template <int NV, typename KT, int NK = 6>
inline void ScoreTileOf(int nk, const float* qt, int64_t lanes, const KT* const* keys, int dh,
                        float scale, float* s_out) {
  if (nk == NK) return ScoreTile<NK, NV>(qt, lanes, keys, dh, scale, s_out);
  if constexpr (NK > 1) ScoreTileOf<NV, KT, NK - 1>(nk, qt, lanes, keys, dh, scale, s_out);
}

// The pairs u < pairs of one task (pair u: row rows[u], q qs[u], out os[u], keys below
// ends[u]) over keys 0 … key_end − 1 of the KV head whose slice of a cache row row_at gives.
// scores/probs rows (maps) are written as the pair-by-pair path writes them.
template <typename KT, typename RowAt>
void AttendAcrossPairs(const AttentionArgs<float>& a, int pairs, const int* rows,
                       const int* heads_of, const float* const* qs, float* const* os,
                       const int* ends, int key_end, RowAt row_at) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int dh = a.head_dim, tk = a.num_keys, tq = a.num_queries;
  const int nv = (pairs + kLanes - 1) / kLanes;
  const int64_t lanes = int64_t{nv} * kLanes;
  thread_local std::vector<float> qt, sp, ot;
  thread_local std::vector<const KT*> krows;
  qt.assign(static_cast<size_t>(dh * lanes), 0.0f);
  sp.resize(static_cast<size_t>(key_end * lanes));
  ot.resize(static_cast<size_t>(dh * lanes));
  krows.resize(static_cast<size_t>(key_end));
  for (int u = 0; u < pairs; ++u) {
    for (int d = 0; d < dh; ++d) qt[QtRow(d, dh) * lanes + u] = qs[u][d];
  }
  // Scores, 6 keys at a time, two pair vectors at a time.
  for (int j = 0; j < key_end; ++j) krows[j] = static_cast<const KT*>(row_at(a.kv.k, j));
  const float scale = static_cast<float>(a.scale);
  for (int j0 = 0; j0 < key_end; j0 += 6) {
    const int nk = std::min(6, key_end - j0);
    for (int v = 0; v < nv; v += 2) {
      float* out = sp.data() + j0 * lanes + v * kLanes;
      if (v + 1 < nv) {
        ScoreTileOf<2, KT>(nk, qt.data() + v * kLanes, lanes, krows.data() + j0, dh, scale, out);
      } else {
        ScoreTileOf<1, KT>(nk, qt.data() + v * kLanes, lanes, krows.data() + j0, dh, scale, out);
      }
    }
  }
  // Masks, then e^(s − max) / Σ lane by lane (a padding lane sees every key).
  thread_local std::vector<float> mx, z;
  mx.assign(static_cast<size_t>(lanes), kNegInf);
  z.assign(static_cast<size_t>(lanes), 0.0f);
  for (int j = 0; j < key_end; ++j) {
    float* sj = sp.data() + j * lanes;
    for (int u = 0; u < pairs; ++u) {
      const bool vis =
          j < ends[u] && (a.q_doc_ids == nullptr || a.q_doc_ids[rows[u]] == a.k_doc_ids[j]);
      if (!vis) sj[u] = kNegInf;
    }
    for (int64_t l = 0; l < lanes; ++l) mx[l] = std::max(mx[l], sj[l]);
  }
  if (a.scores != nullptr) {
    for (int u = 0; u < pairs; ++u) {
      float* map = a.scores + (static_cast<int64_t>(heads_of[u]) * tq + rows[u]) * tk;
      for (int j = 0; j < ends[u]; ++j) map[j] = sp[j * lanes + u];
      std::fill(map + ends[u], map + tk, kNegInf);
    }
  }
  for (int j = 0; j < key_end; ++j) {
    float* sj = sp.data() + j * lanes;
    for (int64_t l = 0; l < lanes; ++l) {
      sj[l] = ExpNegated(mx[l] - sj[l]);  // 0 for a masked key (s = −∞)
      z[l] += sj[l];
    }
  }
  for (int64_t l = 0; l < lanes; ++l) z[l] = 1.0f / z[l];
  for (int j = 0; j < key_end; ++j) {
    float* sj = sp.data() + j * lanes;
    for (int64_t l = 0; l < lanes; ++l) sj[l] *= z[l];
  }
  if (a.probs != nullptr) {
    for (int u = 0; u < pairs; ++u) {
      float* map = a.probs + (static_cast<int64_t>(heads_of[u]) * tq + rows[u]) * tk;
      for (int j = 0; j < ends[u]; ++j) map[j] = sp[j * lanes + u];
      std::fill(map + ends[u], map + tk, 0.0f);
    }
  }
  // Values, 6 dims at a time, two pair vectors at a time.
  for (int j = 0; j < key_end; ++j) krows[j] = static_cast<const KT*>(row_at(a.kv.v, j));
  for (int d0 = 0; d0 < dh; d0 += 6) {
    const int nd = std::min(6, dh - d0);
    for (int v = 0; v < nv; v += 2) {
      if (v + 1 < nv) {
        ValueTileOf<2, KT>(nd, sp.data() + v * kLanes, lanes, krows.data(), key_end, d0,
                           ot.data() + v * kLanes);
      } else {
        ValueTileOf<1, KT>(nd, sp.data() + v * kLanes, lanes, krows.data(), key_end, d0,
                           ot.data() + v * kLanes);
      }
    }
  }
  for (int u = 0; u < pairs; ++u) {
    for (int d = 0; d < dh; ++d) os[u][d] = ot[d * lanes + u];
  }
}

absl::Status CpuBackend::Attention(const AttentionArgs<float>& a) {
  if (absl::Status s = ValidateAttentionArgs(a); !s.ok()) return s;
  if (absl::Status s = CheckEveryRowSeesAKey(a); !s.ok()) return s;
  if (TakesSplitKeys(a)) {
    RunSplitKeys(a);
    return absl::OkStatus();
  }
  const TiledAttention t = PlanTiled(a);
  if (t.inline_run) {
    for (int64_t task = 0; task < t.count; ++task) t.run(task);
  } else {
    pool_->ParallelFor(t.count, t.run);
  }
  return absl::OkStatus();
}

// Several calls (a decode step's sequences): those on the tiled path share one ParallelFor,
// their tasks side by side (each task computes what it computes in Attention, so the bits
// are the same); a call that splits its keys runs on its own. As the default: calls before
// a failing one have run, and *failed names it.
absl::Status CpuBackend::AttentionBatch(absl::Span<const AttentionArgs<float>> calls, int* failed) {
  std::vector<TiledAttention> tiled;
  std::vector<int64_t> first;  // tiled[c]'s first task in the shared range
  int64_t total = 0;
  auto run_tiled = [&] {
    if (tiled.empty()) return;
    pool_->ParallelFor(total, [&](int64_t task) {
      const size_t c =
          static_cast<size_t>(std::upper_bound(first.begin(), first.end(), task) - first.begin()) -
          1;
      tiled[c].run(task - first[c]);
    });
  };
  for (size_t i = 0; i < calls.size(); ++i) {
    const AttentionArgs<float>& a = calls[i];
    absl::Status s = ValidateAttentionArgs(a);
    if (s.ok()) s = CheckEveryRowSeesAKey(a);
    if (!s.ok()) {
      run_tiled();
      *failed = static_cast<int>(i);
      return s;
    }
    if (TakesSplitKeys(a)) {
      RunSplitKeys(a);
      continue;
    }
    first.push_back(total);
    tiled.push_back(PlanTiled(a));
    total += tiled.back().count;
  }
  run_tiled();
  return absl::OkStatus();
}

// Decode over a long context: split over the keys, rows read whole.
bool CpuBackend::TakesSplitKeys(const AttentionArgs<float>& a) {
  return a.num_queries <= kSplitMaxQueries && a.num_keys >= 2 * kSplitSpan && a.probs == nullptr &&
         a.scores == nullptr;
}

void CpuBackend::RunSplitKeys(const AttentionArgs<float>& a) {
  if (a.kv.dtype == KvDtype::kBF16) {
    AttentionSplitKeys<uint16_t>(a, *pool_);
  } else {
    AttentionSplitKeys<float>(a, *pool_);
  }
}

// A checked call on the tiled path: its tasks (a KV head × a tile of query rows each) and
// what task t computes. The closure holds a reference to `a`, which must outlive it.
CpuBackend::TiledAttention CpuBackend::PlanTiled(const AttentionArgs<float>& a) {
  const int tq = a.num_queries, tk = a.num_keys, dh = a.head_dim;
  const int group = a.num_heads / a.num_kv_heads;
  const float scale = static_cast<float>(a.scale);
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kMaxPairs = 64;
  constexpr int kPrefetchAhead = 6;  // keys: a row's cache lines are asked for this early
  // Rows of a tile: as many as fit kMaxPairs pairs, fewer when that would leave threads
  // without a task.
  const int64_t threads = pool_->num_threads();
  const int rows_per_task = static_cast<int>(
      std::clamp<int64_t>(std::min<int64_t>(kMaxPairs / std::max(group, 1),
                                            int64_t{tq} * a.num_kv_heads / (4 * threads)),
                          1, tq));
  // A call of at least kLanes (row, head) pairs runs every tile across the pairs
  // (AttendAcrossPairs; a tile's spare lanes are padding); either path gives a pair the
  // same bits, so this only decides which is faster.
  const bool across = kPairLanes && int64_t{tq} * group >= kLanes;
  const int row_blocks = (tq + rows_per_task - 1) / rows_per_task;
  const int64_t num_tasks = int64_t{row_blocks} * a.num_kv_heads;
  // Tiny calls (decode over a short context) run on the calling thread.
  const int64_t work = int64_t{tq} * tk * dh * a.num_heads;
  const bool inline_run = work < (int64_t{1} << 15);
  return {
      num_tasks, inline_run, [&a, tq, tk, dh, group, scale, rows_per_task, across](int64_t task) {
        const int kvh = static_cast<int>(task % a.num_kv_heads);
        const int i0 = static_cast<int>(task / a.num_kv_heads) * rows_per_task;
        const int i1 = std::min(tq, i0 + rows_per_task);
        const int64_t col = static_cast<int64_t>(kvh) * dh;
        // Key (or value) j's slice of this KV head, in the cache's own element type.
        const bool bf16 = a.kv.dtype == KvDtype::kBF16;
        const int64_t elem = KvElementBytes<float>(a.kv.dtype);
        auto row_at = [&](const void* base, int j) -> const void* {
          return static_cast<const char*>(base) +
                 (a.kv.PhysicalRow(j) * a.kv.row_stride + col) * elem;
        };
        // The tile's (row, head) pairs, in chunks of up to kMaxPairs (a large group).
        for (int h_first = kvh * group; h_first < (kvh + 1) * group; h_first += kMaxPairs) {
          const int h_last = std::min((kvh + 1) * group, h_first + kMaxPairs);
          const int heads = h_last - h_first;
          const int rows = std::min(i1 - i0, std::max(1, kMaxPairs / heads));
          for (int r0 = i0; r0 < i1; r0 += rows) {
            const int r1 = std::min(i1, r0 + rows);
            const int pairs = (r1 - r0) * heads;
            // Pair u = (row r0 + u / heads, head h_first + u % heads): its q and out, the end
            // of its keys, scores s[u][·] and weights p[u][·].
            const float* qs[kMaxPairs];
            float* os[kMaxPairs];
            int ends[kMaxPairs];
            float max_s[kMaxPairs], dots[4], w[4];
            int key_end = 0;
            for (int u = 0; u < pairs; ++u) {
              const int i = r0 + u / heads, h = h_first + u % heads;
              qs[u] = a.q + i * a.q_stride + static_cast<int64_t>(h) * dh;
              os[u] = a.out + i * a.out_stride + static_cast<int64_t>(h) * dh;
              ends[u] = CausalKeyEnd(a, i);
              key_end = std::max(key_end, ends[u]);
              max_s[u] = kNegInf;
              std::fill(os[u], os[u] + dh, 0.0f);
            }
            if (across) {
              int pair_rows[kMaxPairs], pair_heads[kMaxPairs];
              for (int u = 0; u < pairs; ++u) {
                pair_rows[u] = r0 + u / heads;
                pair_heads[u] = h_first + u % heads;
              }
              if (bf16) {
                AttendAcrossPairs<uint16_t>(a, pairs, pair_rows, pair_heads, qs, os, ends, key_end,
                                            row_at);
              } else {
                AttendAcrossPairs<float>(a, pairs, pair_rows, pair_heads, qs, os, ends, key_end,
                                         row_at);
              }
              continue;
            }
            thread_local std::vector<float> s, p;
            s.resize(size_t(pairs) * tk);
            p.resize(s.size());
            // Scores: a pair sees key j when j < its end and the documents match.
            for (int j = 0; j < key_end; ++j) {
              if (j + kPrefetchAhead < key_end) Prefetch(a.kv, a.kv.k, j + kPrefetchAhead, col, dh);
              const void* k = nullptr;
              for (int u0 = 0; u0 < pairs; u0 += 4) {
                const float* q4[4];
                int live[4], m = 0;
                for (int u = u0; u < std::min(pairs, u0 + 4); ++u) {
                  const int i = r0 + u / heads;
                  const bool vis =
                      j < ends[u] && (a.q_doc_ids == nullptr || a.q_doc_ids[i] == a.k_doc_ids[j]);
                  if (!vis) {
                    s[size_t(u) * tk + j] = kNegInf;
                    continue;
                  }
                  q4[m] = qs[u];
                  live[m++] = u;
                }
                if (m == 0) continue;
                if (k == nullptr) k = row_at(a.kv.k, j);
                if (bf16) {
                  DotMany(q4, m, static_cast<const uint16_t*>(k), dh, dots);
                } else {
                  DotMany(q4, m, static_cast<const float*>(k), dh, dots);
                }
                for (int t = 0; t < m; ++t) {
                  const int u = live[t];
                  s[size_t(u) * tk + j] = scale * dots[t];
                  max_s[u] = std::max(max_s[u], s[size_t(u) * tk + j]);
                }
              }
            }
            for (int u = 0; u < pairs; ++u) {
              const float* su = s.data() + size_t(u) * tk;
              float* pu = p.data() + size_t(u) * tk;
              // e^(s − max), 0 for a masked key (s = −∞); a vectorised pass, then the sum.
              const float mu = max_s[u];
              for (int j = 0; j < ends[u]; ++j) pu[j] = ExpNegated(mu - su[j]);
              float z = 0.0f;
              for (int j = 0; j < ends[u]; ++j) z += pu[j];
              const float inv_z = 1.0f / z;
              for (int j = 0; j < ends[u]; ++j) pu[j] *= inv_z;
            }
            // Values: each row read once for the pairs that give it weight (a masked key, or
            // one whose weight underflowed, adds nothing and is never read for that pair).
            for (int j = 0; j < key_end; ++j) {
              const void* v = nullptr;
              bool prefetched = false;
              for (int u0 = 0; u0 < pairs; u0 += 4) {
                float* o4[4];
                int m = 0;
                for (int u = u0; u < std::min(pairs, u0 + 4); ++u) {
                  const float pu = j < ends[u] ? p[size_t(u) * tk + j] : 0.0f;
                  if (pu == 0.0f) continue;
                  o4[m] = os[u];
                  w[m++] = pu;
                }
                if (m == 0) continue;
                if (v == nullptr) {
                  if (!prefetched && j + kPrefetchAhead < key_end) {
                    Prefetch(a.kv, a.kv.v, j + kPrefetchAhead, col, dh);
                  }
                  prefetched = true;
                  v = row_at(a.kv.v, j);
                }
                if (bf16) {
                  AxpyMany(o4, m, w, static_cast<const uint16_t*>(v), dh);
                } else {
                  AxpyMany(o4, m, w, static_cast<const float*>(v), dh);
                }
              }
            }
            for (int u = 0; u < pairs; ++u) {
              const int i = r0 + u / heads, h = h_first + u % heads;
              const int64_t map = (static_cast<int64_t>(h) * tq + i) * tk;
              if (a.scores != nullptr) {
                const float* su = s.data() + size_t(u) * tk;
                std::copy(su, su + ends[u], a.scores + map);
                std::fill(a.scores + map + ends[u], a.scores + map + tk, kNegInf);
              }
              if (a.probs != nullptr) {
                const float* pu = p.data() + size_t(u) * tk;
                std::copy(pu, pu + ends[u], a.probs + map);
                std::fill(a.probs + map + ends[u], a.probs + map + tk, 0.0f);
              }
            }
          }
        }
      }};
}

}  // namespace kvlens::kernels
