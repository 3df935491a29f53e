// CpuBackend's products and elementwise ops (attention: cpu_attention.cc). Compiled with
// -march=native when the build allows it (kernels/CMakeLists.txt). Every SIMD helper lives
// in an anonymous namespace (this file's, or simd.h's), so code built for different
// instruction sets never meets in one inline function.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/simd.h"
#include "kernels/cpu/weight_rows.h"
#include "kernels/fast_exp.h"
#include "kernels/ggml_quants.h"

namespace kvlens::kernels {
namespace {

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
constexpr int kTileW = 2;              // 8 accumulators + 2 + 1 of 16 ymm
#endif
// Weight rows dequantised together; each is then used by every x row of the chunk.
constexpr int kWBlock = 8;
// Activation rows per pass over a weight block (keeps the x chunk in L2).
constexpr int kNChunk = 64;
// Inner-dimension slice: kWBlock weight slices plus a kTileN x tile stay in L1 (24 KiB).
constexpr int64_t kKBlock = 512;

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
#if defined(__AVX512F__)
  if constexpr (kStepsSuperBlocks<Row>) {
    // A k-quant super-block a step (k0 and k are multiples of 256), then its sub-blocks of
    // 32 as below: the same FMAs in the same order.
    for (; k + 256 <= len; k += 256) {
      SuperBlockScratch scratch[WR];
#pragma GCC unroll 16
      for (int c = 0; c < WR; ++c) w[c].Prepare(k0 + k, scratch[c]);
      // The scratch as memory the compiler cannot see into: LoadSub's broadcasts of its
      // scales stay loads (GCC would otherwise take the just-stored floats from their
      // register by lane permutes, which queue with the byte widening on the shuffle unit).
      asm("" : "+m"(scratch));
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        Vec lo[WR], hi[WR];
#pragma GCC unroll 16
        for (int c = 0; c < WR; ++c) w[c].LoadSub(k0 + k, j, scratch[c], lo[c], hi[c]);
#pragma GCC unroll 16
        for (int r = 0; r < NR; ++r) {
          const float* xr = x + r * x_stride + k + 32 * j;
          const Vec xa = VLoad(xr), xb = VLoad(xr + kLanes);
#pragma GCC unroll 16
          for (int c = 0; c < WR; ++c) acc[r][c] = VFma(xb, hi[c], VFma(xa, lo[c], acc[r][c]));
        }
      }
    }
  }
  if constexpr (kStepsBlocks<Row>) {
    // 32 elements a step, a block of q8_0 or q4_0, a sub-block of a k-quant (k0 and k are
    // multiples of 32): its scales read once.
    // Each accumulator takes the same FMAs in the same order as two single steps.
    for (; k + kQ8_0BlockSize <= len; k += kQ8_0BlockSize) {
      Vec lo[WR], hi[WR];
#pragma GCC unroll 16
      for (int c = 0; c < WR; ++c) w[c].LoadBlock(k0 + k, lo[c], hi[c]);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        const Vec xa = VLoad(x + r * x_stride + k), xb = VLoad(x + r * x_stride + k + kLanes);
#pragma GCC unroll 16
        for (int c = 0; c < WR; ++c) acc[r][c] = VFma(xb, hi[c], VFma(xa, lo[c], acc[r][c]));
      }
    }
  }
#endif
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
#else
inline void TransposeLanes(Vec (&r)[kLanes]) {  // the portable Vec (the path is off there)
  for (int i = 0; i < kLanes; ++i) {
    for (int j = i + 1; j < kLanes; ++j) std::swap(r[i].l[j], r[j].l[i]);
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
      const Q8Row row{src};  // the blocks' scales and quants, as DotTile reads them
      for (int64_t k = 0; k + kQ8_0BlockSize <= n; k += kQ8_0BlockSize) {
        const float d = row.Scale(k);
        const int8_t* q = row.Quants(k);
        for (int i = 0; i < kQ8_0BlockSize; ++i) out[k + i] = d * static_cast<float>(q[i]);
      }
      return;
    }
    default:
#if defined(__AVX512F__)
      // The in-place readers' registers, stored: the same floats, 32 at a time.
      VisitBlockRow(w.dtype, src, [&](auto row) { StoreBlocks(row, n, out); });
#else
      DecodeBlocks(w.dtype, src, n / DTypeBlockSize(w.dtype), out);
#endif
      return;
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

// y[N, out] = x[N, in] · Wᵀ + bias. From kPackedMinRows rows on (SIMD builds),
// MatMulPacked. Otherwise parallel over output features; inside a task, a block of kWBlock
// weight rows (read in place, or dequantised once into a copy) is multiplied with every x
// row of a chunk of kNChunk, slice by slice of kKBlock inputs, through kTileN × kTileW
// register tiles.
void CpuBackend::MatMul(const float* x, int n, const WeightView& w, const WeightView& bias,
                        float* y) {
  const int64_t in = w.cols, out = w.rows;
  if (n <= 0 || out <= 0) return;
  if (int8_activations_ && DTypeIsBlockQuantized(w.dtype)) {
    return MatMulQ8(x, n, w, bias.empty() ? std::vector<float>() : VectorOf(bias), y);
  }
  if (kPackedMatMul && n >= kPackedMinRows) return MatMulPacked(x, n, w, bias, y);
  const std::vector<float> b = bias.empty() ? std::vector<float>() : VectorOf(bias);
  // Below kPackedMinRows rows the products read the stored weights in place, widening
  // them as they load (each element is used by a few tiles of kTileN rows: converting it
  // each time measured faster than writing a float copy and reading it back, by 1.2–2.5×
  // at 1 to 12 rows). More rows (without the packed path) take the copy.
  const bool direct = n < kPackedMinRows && HasRowReader(w.dtype);
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
            rows[c] = F32Row{reinterpret_cast<const uint8_t*>(w_buf.data() + c * in)};
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
          case DType::kF32:
            in_place(F32Row{});
            break;
          case DType::kBF16:
            in_place(Bf16Row{});
            break;
          case DType::kF16:
            in_place(F16Row{});
            break;
          case DType::kQ8_0:
            in_place(Q8Row{});
            break;
          default:  // ggml's other blocks: their BlockRow (HasRowReader says where)
#if defined(__AVX512F__)
            VisitBlockRow(w.dtype, nullptr, in_place);
#endif
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
                      const int32_t* positions, const RopeSpec& rope) {
  const int half = head_dim / 2;
  std::vector<double> inv_freq(half);
  for (int p = 0; p < half; ++p) inv_freq[p] = rope.Frequency(p, head_dim);
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
        if (rope.style == RopeStyle::kAdjacentPairs) {
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

void CpuBackend::GeGlu(const float* gate, const float* up, int64_t count, float* out) {
  ParallelRange(count, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = GeluOne(gate[i]) * up[i];
  });
}

void CpuBackend::SoftCap(float* x, int64_t count, double cap) {
  const float c = static_cast<float>(cap), inv = 1.0f / c;
  ParallelRange(count, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) x[i] = c * std::tanh(x[i] * inv);
  });
}

void CpuBackend::Scale(float* x, int64_t count, double factor) {
  const float f = static_cast<float>(factor);
  ParallelRange(count, 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) x[i] *= f;
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

}  // namespace kvlens::kernels
