// The CPU attention tiles that run one (row, head) pair a SIMD lane (ScoreTile, ValueTile),
// shared by the forward (cpu_attention.cc) and the backward (cpu_backward.cc). Like simd.h,
// included only by files compiled with -march=native where the build allows it, inside an
// anonymous namespace.
#ifndef KVLENS_KERNELS_CPU_ATTENTION_TILES_H_
#define KVLENS_KERNELS_CPU_ATTENTION_TILES_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/simd.h"
#include "kernels/dtype.h"

namespace kvlens::kernels {
namespace {

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

// The scores of NK keys for pair vectors v < NV, each in the order above (then scaled):
// per lane l of a key's dot, the chain over d = l, l + kLanes, … (qt holds
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

// Where dim d of a query sits in qt: a dot's lane chains one after another (lane l's dims
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

// s_out[j·lanes + u]: the scores of keys j < key_end for the nv pair vectors of qt (packed
// by QtRow), 6 keys and two pair vectors at a time.
template <typename KT>
inline void ScoresAcrossPairs(const float* qt, int64_t lanes, int nv, const KT* const* keys,
                              int key_end, int dh, float scale, float* s_out) {
  for (int j0 = 0; j0 < key_end; j0 += 6) {
    const int nk = std::min(6, key_end - j0);
    for (int v = 0; v < nv; v += 2) {
      float* out = s_out + j0 * lanes + v * kLanes;
      if (v + 1 < nv) {
        ScoreTileOf<2, KT>(nk, qt + v * kLanes, lanes, keys + j0, dh, scale, out);
      } else {
        ScoreTileOf<1, KT>(nk, qt + v * kLanes, lanes, keys + j0, dh, scale, out);
      }
    }
  }
}

// ot[d·lanes + u] = Σ_{j < key_end} p[j·lanes + u] · values_j[d] for the nv pair vectors,
// 6 dims and two pair vectors at a time.
template <typename KT>
inline void ValuesAcrossPairs(const float* p, int64_t lanes, int nv, const KT* const* values,
                              int key_end, int dh, float* ot) {
  for (int d0 = 0; d0 < dh; d0 += 6) {
    const int nd = std::min(6, dh - d0);
    for (int v = 0; v < nv; v += 2) {
      if (v + 1 < nv) {
        ValueTileOf<2, KT>(nd, p + v * kLanes, lanes, values, key_end, d0, ot + v * kLanes);
      } else {
        ValueTileOf<1, KT>(nd, p + v * kLanes, lanes, values, key_end, d0, ot + v * kLanes);
      }
    }
  }
}

}  // namespace
}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_ATTENTION_TILES_H_
