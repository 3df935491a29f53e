// CpuBackend's attention (declared in cpu_backend.h; split from cpu_backend.cc for size):
// decode over a long context split over the keys, and the tiled path: one (row, head) pair
// a SIMD lane when a KV head has kLanes pairs or more (AttendAcrossPairs), else a pair at a
// time with its keys kLanes at a time (AttendNarrow), with the same roundings either way. Compiled
// with -march=native when the build allows it (kernels/CMakeLists.txt); the helpers live in this
// file's anonymous namespace.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/attention_check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/simd.h"
#include "kernels/fast_exp.h"

namespace kvlens::kernels {
namespace {

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
// scores/probs rows (maps) are written as AttendNarrow writes them.
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

// Value rows chained into kLanes·NV dims of one output, j in order: o = p_j·v_j + o as
// AxpyMany forms it, a key of weight 0 skipped.
template <int NV, typename KT>
inline void ValueChain(const float* p, int j0, int j1, const KT* const* values, int64_t col, int d0,
                       float* o) {
  Vec acc[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) acc[v] = VLoad(o + d0 + v * kLanes);
  for (int j = j0; j < j1; ++j) {
    if (p[j] == 0.0f) continue;
    const Vec w = VSet1(p[j]);
    const KT* row = values[j] + col + d0;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[v] = VFma(w, VLoad(row + v * kLanes), acc[v]);
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) VStore(o + d0 + v * kLanes, acc[v]);
}

template <typename KT, int NV = 8>
inline void ValueChainOf(int nv, const float* p, int j0, int j1, const KT* const* values,
                         int64_t col, int d0, float* o) {
  if (nv == NV) return ValueChain<NV>(p, j0, j1, values, col, d0, o);
  if constexpr (NV > 1) ValueChainOf<KT, NV - 1>(nv, p, j0, j1, values, col, d0, o);
}

// The pairs of a tile too few to fill the lanes (pairs < kLanes: a decode step, a few rows
// of a small group), one pair at a time but each step vectorised, every rounding as the
// order of DotMany and AxpyMany makes it: a pair's scores kLanes keys at a time
// (each key's lane chains, then VSumLanes: VSum's tree for all kLanes keys at once), its
// softmax, then its output chained in registers over the keys. The keys are taken in
// blocks (kLanes for scores, kValueBlock for values) that every pair of the tile reads
// before the next block, so a row is read from memory once for the tile.
template <typename KT, typename RowBase>
void AttendNarrow(const AttentionArgs<float>& a, int pairs, const int* rows, const int* heads_of,
                  const float* const* qs, float* const* os, const int* ends, const int64_t* cols,
                  int key_end, RowBase row_base) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int kValueBlock = 64;
  constexpr int kAhead = 8;  // rows asked for this many keys early (a paged cache's blocks)
  const int dh = a.head_dim, tk = a.num_keys, tq = a.num_queries;
  const int steps = dh / kLanes;
  const int64_t stride = (key_end + kLanes - 1) / kLanes * kLanes;  // a pair's score row
  thread_local std::vector<float> sp;
  thread_local std::vector<const KT*> krows;
  sp.resize(static_cast<size_t>(pairs * stride));
  krows.resize(static_cast<size_t>(stride));
  // The span of a cache row the pairs read: their KV heads' columns.
  int64_t lo = cols[0], hi = cols[0];
  for (int u = 1; u < pairs; ++u) {
    lo = std::min(lo, cols[u]);
    hi = std::max(hi, cols[u]);
  }
  const int64_t span_bytes = (hi + dh - lo) * static_cast<int64_t>(sizeof(KT));
  auto prefetch = [&](const KT* row) {
    const char* c = reinterpret_cast<const char*>(row + lo);
    for (int64_t b = 0; b < span_bytes; b += 64) __builtin_prefetch(c + b);
  };
  for (int j = 0; j < key_end; ++j) krows[j] = static_cast<const KT*>(row_base(a.kv.k, j));
  const float scale = static_cast<float>(a.scale);
  const Vec sv = VSet1(scale);
  thread_local std::vector<float> mx;  // per pair, lane by lane: the max of its scores
  mx.assign(static_cast<size_t>(pairs * kLanes), kNegInf);
  for (int j0 = 0; j0 < key_end; j0 += kLanes) {
    for (int j = j0 + kAhead; j < std::min(key_end, j0 + kAhead + kLanes); ++j) {
      prefetch(krows[j]);
    }
    for (int u = 0; u < pairs; ++u) {
      if (j0 >= ends[u]) continue;
      const int n = std::min(kLanes, ends[u] - j0);
      const float* q = qs[u];
      Vec acc[kLanes];
      for (int t = 0; t < kLanes; ++t) acc[t] = VZero();
      for (int t = 0; t < n; ++t) {
        const KT* k = krows[j0 + t] + cols[u];
        for (int i = 0; i < steps; ++i) {
          acc[t] = VFma(VLoad(q + i * kLanes), VLoad(k + i * kLanes), acc[t]);
        }
      }
      float* su = sp.data() + u * stride + j0;
      Vec total = VSumLanes(acc);
      if (steps * kLanes < dh) {  // the last dh % kLanes dims, one FMA each (as DotMany)
        VStore(su, total);
        for (int t = 0; t < n; ++t) {
          for (int d = steps * kLanes; d < dh; ++d)
            su[t] = std::fma(q[d], KvAt(krows[j0 + t] + cols[u], d), su[t]);
        }
        total = VLoad(su);
      }
      VStore(su, VMul(sv, total));
      for (int t = n; t < kLanes; ++t) su[t] = kNegInf;
      if (a.q_doc_ids != nullptr) {
        const int32_t doc = a.q_doc_ids[rows[u]];
        for (int t = 0; t < n; ++t) {
          if (a.k_doc_ids[j0 + t] != doc) su[t] = kNegInf;
        }
      }
      float* m = mx.data() + u * kLanes;
      VStore(m, VMax(VLoad(su), VLoad(m)));
    }
  }
  for (int u = 0; u < pairs; ++u) {
    float* su = sp.data() + u * stride;
    const int end = ends[u];
    if (a.scores != nullptr) {
      float* map = a.scores + (static_cast<int64_t>(heads_of[u]) * tq + rows[u]) * tk;
      std::copy(su, su + end, map);
      std::fill(map + end, map + tk, kNegInf);
    }
    float mu = kNegInf;
    for (int l = 0; l < kLanes; ++l) mu = std::max(mu, mx[u * kLanes + l]);
    // e^(s − max), 0 for a masked key (s = −∞); a vectorised pass, then the sum.
    for (int j = 0; j < end; ++j) su[j] = ExpNegated(mu - su[j]);
    float z = 0.0f;
    for (int j = 0; j < end; ++j) z += su[j];
    const float inv_z = 1.0f / z;
    for (int j = 0; j < end; ++j) su[j] *= inv_z;
    if (a.probs != nullptr) {
      float* map = a.probs + (static_cast<int64_t>(heads_of[u]) * tq + rows[u]) * tk;
      std::copy(su, su + end, map);
      std::fill(map + end, map + tk, 0.0f);
    }
  }
  for (int j = 0; j < key_end; ++j) krows[j] = static_cast<const KT*>(row_base(a.kv.v, j));
  constexpr int kChunk = 8 * kLanes;  // dims a chain keeps in registers
  for (int j0 = 0; j0 < key_end; j0 += kValueBlock) {
    const int j1 = std::min(key_end, j0 + kValueBlock);
    for (int j = j1; j < std::min(key_end, j1 + kValueBlock); ++j) prefetch(krows[j]);
    for (int u = 0; u < pairs; ++u) {
      const int e = std::min(j1, ends[u]);
      if (j0 >= e) continue;
      const float* pu = sp.data() + u * stride;
      for (int d0 = 0; d0 < steps * kLanes; d0 += kChunk) {
        const int nv = std::min(steps - d0 / kLanes, 8);
        ValueChainOf<KT>(nv, pu, j0, e, krows.data(), cols[u], d0, os[u]);
      }
      for (int d = steps * kLanes; d < dh; ++d) {  // the last dh % kLanes dims (as AxpyMany)
        float o = os[u][d];
        for (int j = j0; j < e; ++j) {
          if (pu[j] != 0.0f) o = std::fma(pu[j], KvAt(krows[j] + cols[u], d), o);
        }
        os[u][d] = o;
      }
    }
  }
}

}  // namespace

absl::Status CpuBackend::Attention(const AttentionArgs<float>& a) {
  if (absl::Status s = ValidateAttentionArgs(a); !s.ok()) return s;
  if (absl::Status s = CheckEveryRowSeesAKey(a); !s.ok()) return s;
  if (TakesSplitKeys(a)) {
    RunSplitKeys(a);
    return absl::OkStatus();
  }
  const TiledAttention t = PlanTiled(a, pool_->num_threads());
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
    tiled.push_back(
        PlanTiled(a, static_cast<int>((pool_->num_threads() + calls.size() - 1) / calls.size())));
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

// A checked call on the tiled path: its tasks (a KV head, or several for a narrow call, × a
// tile of query rows each) and
// what task t computes. The closure holds a reference to `a`, which must outlive it.
CpuBackend::TiledAttention CpuBackend::PlanTiled(const AttentionArgs<float>& a, int min_tasks) {
  const int tq = a.num_queries, tk = a.num_keys, dh = a.head_dim;
  const int group = a.num_heads / a.num_kv_heads;
  constexpr int kMaxPairs = 64;
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
  // A tile across the pairs takes one KV head; a narrow one takes several, so that it reads
  // kNarrowSlice bytes or more of each cache row at a time (a row holds every KV head, and
  // reading an eighth of each row, as one KV head of eight does, waits on memory), as long
  // as that leaves min_tasks tasks.
  constexpr int64_t kNarrowSlice = 2048;
  const int64_t head_bytes = int64_t{dh} * KvElementBytes<float>(a.kv.dtype);
  const int kv_per_task =
      across ? 1
             : static_cast<int>(std::clamp<int64_t>(
                   std::min<int64_t>(kNarrowSlice / head_bytes,
                                     int64_t{row_blocks} * a.num_kv_heads / std::max(min_tasks, 1)),
                   1, a.num_kv_heads));
  const int kv_tasks = (a.num_kv_heads + kv_per_task - 1) / kv_per_task;
  const int64_t num_tasks = int64_t{row_blocks} * kv_tasks;
  // Tiny calls (decode over a short context) run on the calling thread.
  const int64_t work = int64_t{tq} * tk * dh * a.num_heads;
  const bool inline_run = work < (int64_t{1} << 15);
  return {num_tasks, inline_run,
          [&a, tq, dh, group, rows_per_task, across, kv_per_task, kv_tasks](int64_t task) {
            const int kv0 = static_cast<int>(task % kv_tasks) * kv_per_task;
            const int kv1 = std::min(a.num_kv_heads, kv0 + kv_per_task);
            const int i0 = static_cast<int>(task / kv_tasks) * rows_per_task;
            const int i1 = std::min(tq, i0 + rows_per_task);
            const bool bf16 = a.kv.dtype == KvDtype::kBF16;
            const int64_t elem = KvElementBytes<float>(a.kv.dtype);
            // Key (or value) j's whole row, in the cache's own element type.
            auto row_base = [&](const void* base, int j) -> const void* {
              return static_cast<const char*>(base) + a.kv.PhysicalRow(j) * a.kv.row_stride * elem;
            };
            // The task's (row, head) pairs, run kMaxPairs at a time (a tile across the pairs
            // holds one KV head's): pair u's q and out, the end of its keys, its KV head's
            // column in a cache row.
            const float* qs[kMaxPairs];
            float* os[kMaxPairs];
            int ends[kMaxPairs], pair_rows[kMaxPairs], pair_heads[kMaxPairs];
            int64_t cols[kMaxPairs];
            int pairs = 0, key_end = 0;
            auto run = [&] {
              if (pairs == 0) return;
              if (across) {
                const int64_t col = cols[0];
                auto row_at = [&](const void* base, int j) -> const void* {
                  return static_cast<const char*>(row_base(base, j)) + col * elem;
                };
                if (bf16) {
                  AttendAcrossPairs<uint16_t>(a, pairs, pair_rows, pair_heads, qs, os, ends,
                                              key_end, row_at);
                } else {
                  AttendAcrossPairs<float>(a, pairs, pair_rows, pair_heads, qs, os, ends, key_end,
                                           row_at);
                }
              } else if (bf16) {
                AttendNarrow<uint16_t>(a, pairs, pair_rows, pair_heads, qs, os, ends, cols, key_end,
                                       row_base);
              } else {
                AttendNarrow<float>(a, pairs, pair_rows, pair_heads, qs, os, ends, cols, key_end,
                                    row_base);
              }
              pairs = 0;
              key_end = 0;
            };
            for (int kvh = kv0; kvh < kv1; ++kvh) {
              for (int i = i0; i < i1; ++i) {
                for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
                  pair_rows[pairs] = i;
                  pair_heads[pairs] = h;
                  qs[pairs] = a.q + i * a.q_stride + static_cast<int64_t>(h) * dh;
                  os[pairs] = a.out + i * a.out_stride + static_cast<int64_t>(h) * dh;
                  std::fill(os[pairs], os[pairs] + dh, 0.0f);
                  ends[pairs] = CausalKeyEnd(a, i);
                  cols[pairs] = static_cast<int64_t>(kvh) * dh;
                  key_end = std::max(key_end, ends[pairs]);
                  if (++pairs == kMaxPairs) run();
                }
              }
              if (across) run();
            }
            run();
          }};
}

}  // namespace kvlens::kernels
