// CpuBackend's int8-activation products (SetInt8Activations; the server's and the CLI's
// --int8-activations): the drivers of q8_products.h's and q8k_products.h's schemes.
// Compiled like cpu_backend.cc, for this machine's instruction set where the build allows.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/q8_products.h"
#include "kernels/cpu/q8k_products.h"

namespace kvlens::kernels {

void CpuBackend::MatMulQ8(const float* x, int n, const WeightView& w, const std::vector<float>& b,
                          float* y) {
  VisitBlockType(w.dtype, [&](auto type) {
    constexpr DType kType = decltype(type)::value;
    if constexpr (UsesQ8K(kType)) {
      MatMulInt8<Q8KScheme<kType>>(x, n, w, b, y);
    } else {
      MatMulInt8<Q8BScheme<kType>>(x, n, w, b, y);
    }
  });
}

// Both schemes (q8_products.h: the 32-element types, q8k_products.h: the 256-element ones)
// take this shape: the activation rows quantised first (in parallel when there are many);
// from kQ8TileRows rows on MatMulTiled, else parallel over output features, a weight row's
// units unpacked once, then each activation row's steps, four rows at a time.
template <typename Scheme>
void CpuBackend::MatMulInt8(const float* x, int n, const WeightView& w, const std::vector<float>& b,
                            float* y) {
  using Row = typename Scheme::Row;
  using Unit = typename Scheme::Unit;
  const int64_t in = w.cols, out = w.rows;
  const int64_t padded = Scheme::Padded(in), units = (padded + kQ8Unit - 1) / kQ8Unit;
  const int64_t scales = Scheme::Scales(in), sums = Scheme::Sums(in);
  // Kept by the calling thread, as MatMulPackedChunk's packed rows; the pool's threads see
  // their own thread_locals, so the buffers go to them as pointers.
  thread_local std::vector<int8_t> act;
  thread_local std::vector<float> act_d;
  thread_local std::vector<int32_t> act_b;
  thread_local std::vector<Row> rows;
  act.resize(static_cast<size_t>(n * padded));
  act_d.resize(static_cast<size_t>(n * scales));
  act_b.resize(static_cast<size_t>(n * sums));
  rows.resize(static_cast<size_t>(n));
  int8_t* a = act.data();
  float* d = act_d.data();
  int32_t* bs = act_b.data();
  ParallelRange(n, std::max<int64_t>(1, (int64_t{1} << 14) / in), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      Scheme::Quantize(x + r * in, in, a + r * padded, d + r * scales, bs + r * sums);
    }
  });
  for (int r = 0; r < n; ++r)
    rows[r] = Scheme::RowAt(a + r * padded, d + r * scales, bs + r * sums);
  const Row* xr = rows.data();
#if defined(KVLENS_Q8_VNNI)
  if (n >= kQ8TileRows) return MatMulTiled<Scheme>(xr, n, w, b, y);
#endif
  const int64_t min_rows = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, in * n));
  ParallelRange(out, min_rows, [&](int64_t o0, int64_t o1) {
    thread_local std::vector<Unit> unit_buf;
    if (static_cast<int64_t>(unit_buf.size()) < units) unit_buf.resize(static_cast<size_t>(units));
    // NR rows' sums over the units of weight row o.
    auto rows_of = [&](auto nr, int r0, int64_t o) {
      constexpr int NR = decltype(nr)::value;
      float acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
      for (int64_t u = 0; u < units; ++u) Scheme::template Step<NR>(unit_buf[u], xr + r0, u, acc);
      for (int r = 0; r < NR; ++r) y[(r0 + r) * out + o] = acc[r] + (b.empty() ? 0.0f : b[o]);
    };
    for (int64_t o = o0; o < o1; ++o) {
      for (int64_t u = 0; u < units; ++u) Scheme::UnpackUnit(w.row(o), in, u, &unit_buf[u]);
      int r0 = 0;
      for (; r0 + 4 <= n; r0 += 4) rows_of(std::integral_constant<int, 4>{}, r0, o);
      for (; r0 < n; ++r0) rows_of(std::integral_constant<int, 1>{}, r0, o);
    }
  });
}

// Chunks of kChunkRows rows: the chunk's groups of 16 packed (Scheme::Pack, in parallel),
// then parallel over output features, Scheme::kCols weight rows unpacked at a time and
// multiplied with every group (Scheme::Tile), each lane's sum written to its row. The same
// bits as the rows alone: the same integers, the same float operations (q8_products.h,
// q8k_products.h).
template <typename Scheme>
void CpuBackend::MatMulTiled(const void* act_rows, int n, const WeightView& w,
                             const std::vector<float>& b, float* y) {
#if defined(KVLENS_Q8_VNNI)
  constexpr int kChunkRows = 16 * kQ8TileRows;  // ~600 KB packed at 2048 inputs
  constexpr int kCols = Scheme::kCols;
  using Act = typename Scheme::Act;
  using Unit = typename Scheme::TileUnit;
  const auto* xr = static_cast<const typename Scheme::Row*>(act_rows);
  const int64_t in = w.cols, out = w.rows, units = (in + kQ8Unit - 1) / kQ8Unit;
  thread_local std::vector<Act> packed;
  for (int r0 = 0; r0 < n; r0 += kChunkRows) {
    const int rows = std::min(kChunkRows, n - r0);
    const int groups = (rows + kQ8TileRows - 1) / kQ8TileRows;
    if (packed.size() < static_cast<size_t>(groups * units)) packed.resize(groups * units);
    Act* pk = packed.data();
    ParallelRange(groups * units, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int first = r0 + static_cast<int>(i / units) * kQ8TileRows;
        Scheme::Pack(xr + first, std::min(kQ8TileRows, n - first), i % units, pk + i);
      }
    });
    const int64_t min_cols = std::max<int64_t>(
        kCols, ((int64_t{1} << 16) / std::max<int64_t>(1, in * rows) + kCols - 1) / kCols * kCols);
    ParallelRange(out, min_cols, [&](int64_t o0, int64_t o1) {
      thread_local std::vector<Unit> wbuf;
      if (wbuf.size() < static_cast<size_t>(kCols * units)) wbuf.resize(kCols * units);
      for (int64_t ob = o0; ob < o1; ob += kCols) {
        const int cols = static_cast<int>(std::min<int64_t>(kCols, o1 - ob));
        const Unit* wc[kCols];
        for (int c = 0; c < cols; ++c) {
          for (int64_t u = 0; u < units; ++u)
            Scheme::UnpackTile(w.row(ob + c), in, u, &wbuf[c * units + u]);
          wc[c] = &wbuf[c * units];
        }
        for (int g = 0; g < groups; ++g) {
          const int first = r0 + g * kQ8TileRows;
          const int count = std::min(kQ8TileRows, n - first);
          alignas(64) float lanes[kCols][16];
          // The tile for `cols` weight rows (kCols, or the fewer left at the end).
          auto run = [&](auto self, auto width) {
            constexpr int W = decltype(width)::value;
            if constexpr (W > 1) {
              if (cols < W) return self(self, std::integral_constant<int, W - 1>{});
            }
            __m512 acc[W];
            Scheme::template Tile<W>(pk + g * units, units, wc, acc);
            for (int c = 0; c < W; ++c) _mm512_store_ps(lanes[c], acc[c]);
          };
          run(run, std::integral_constant<int, kCols>{});
          for (int r = 0; r < count; ++r) {
            for (int c = 0; c < cols; ++c) {
              y[(first + r) * out + ob + c] = lanes[c][r] + (b.empty() ? 0.0f : b[ob + c]);
            }
          }
        }
      }
    });
  }
#else
  (void)act_rows, (void)n, (void)w, (void)b, (void)y;
#endif
}

}  // namespace kvlens::kernels
