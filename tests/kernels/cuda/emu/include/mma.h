// kvlens CUDA emulator: nvcuda::wmma for m16n16k16 tiles. A fragment's 256 elements are
// spread over the warp (lane l holds elements l, l + 32, …, row-major within the tile), so
// element-wise loops over x[] behave as on a GPU, and a load, fill or store touches each
// element once. mma_sync is a warp collective: the lanes pool A and B in the warp's
// scratch, each computes its own elements of D = A·B + C in fp32 (products of halves are
// exact in fp32), then the warp meets again before the scratch is reused.
#ifndef KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_MMA_H_
#define KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_MMA_H_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "tests/kernels/cuda/emu/emu_device.h"

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator has m16n16k16 tiles only");
  static constexpr int num_elements = 8;
  T x[num_elements];
};

namespace detail {
inline float ToFloat(float v) { return v; }
inline float ToFloat(__half v) { return __half2float(v); }
inline float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
// Element t of this lane's share: row, column within the 16×16 tile.
inline int Row(int t) { return (::kvlens_emu::LaneId() + 32 * t) / 16; }
inline int Col(int t) { return (::kvlens_emu::LaneId() + 32 * t) % 16; }
}  // namespace detail

template <typename Use, typename T, typename Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, T v) {
  for (int t = 0; t < 8; ++t) f.x[t] = v;
}
inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) {
  for (int t = 0; t < 8; ++t) f.x[t] = v;
}

// matrix_a is (m, k), matrix_b is (k, n): row_major reads (r, c) at p[r·ldm + c].
template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "accumulators take a layout_t");
  for (int t = 0; t < 8; ++t) {
    const int r = detail::Row(t), c = detail::Col(t);
    f.x[t] = std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r];
  }
  ::kvlens_emu::SyncWarp();
}

template <typename T>
void load_matrix_sync(fragment<accumulator, 16, 16, 16, T>& f, const T* p, unsigned ldm,
                      layout_t layout) {
  for (int t = 0; t < 8; ++t) {
    const int r = detail::Row(t), c = detail::Col(t);
    f.x[t] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
  }
  ::kvlens_emu::SyncWarp();
}

template <typename T>
void store_matrix_sync(T* p, const fragment<accumulator, 16, 16, 16, T>& f, unsigned ldm,
                       layout_t layout) {
  ::kvlens_emu::SyncWarp();
  for (int t = 0; t < 8; ++t) {
    const int r = detail::Row(t), c = detail::Col(t);
    (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[t];
  }
}

template <typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  float* s = ::kvlens_emu::WarpScratch();  // A [16][16], B [16][16]
  for (int t = 0; t < 8; ++t) {
    const int e = ::kvlens_emu::LaneId() + 32 * t;
    s[e] = detail::ToFloat(a.x[t]);
    s[256 + e] = detail::ToFloat(b.x[t]);
  }
  ::kvlens_emu::SyncWarp();
  float out[8];
  for (int t = 0; t < 8; ++t) {
    const int r = detail::Row(t), col = detail::Col(t);
    float acc = c.x[t];
    for (int k = 0; k < 16; ++k) acc += s[r * 16 + k] * s[256 + k * 16 + col];
    out[t] = acc;
  }
  ::kvlens_emu::SyncWarp();
  for (int t = 0; t < 8; ++t) d.x[t] = out[t];
}

}  // namespace nvcuda::wmma

#endif  // KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_MMA_H_
