// CpuBackend's attention (declared in cpu_backend.h; split from cpu_backend.cc for size):
// decode over a long context split over the keys, and the tiled path, pair by pair or one
// pair a SIMD lane, with the same roundings either way. Compiled with -march=native when
// the build allows it (kernels/CMakeLists.txt); the helpers live in this file's anonymous
// namespace.
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

}  // namespace

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
