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
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels/attention_check.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/simd.h"
#include "kernels/fast_exp.h"

namespace kvlens::kernels {
namespace {

// Gemma 2's soft-capping of n scaled scores in place (AttentionArgs::softcap; none at 0),
// each cap · tanh(s / cap) in fp32, before the masks.
inline void SoftCap(const AttentionArgs<float>& a, float* s, int64_t n) {
  if (a.softcap <= 0.0) return;
  const float cap = static_cast<float>(a.softcap), inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv);
}

// Per (query row, head) pair: scores of the causally reachable keys (−∞ for other
// documents), max subtracted, exponentials summed in fp32, p = e / Σe, then out = Σ p_j v_j
// with those very p. The order of every rounding on the tiled paths (this defines a pair's
// bits, whatever its call's other rows, tiling or threads; the split path below keeps it
// within each span of keys, then merges the spans):
//   - score s_j = scale · dot, the dot formed as kLanes lane chains (lane l: the FMAs over
//     d = l, l + kLanes, … in order), VSum's tree over the lanes, then the last dh % kLanes
//     dims one FMA each (then, with a soft-cap, cap · tanh(s_j · (1/cap)));
//   - the weights' sum in key order; p_j = e_j · (1 / Σ);
//   - out[d] the chain of FMAs p_j · v_j[d] + out[d] over the keys in order from 0, a key
//     of weight 0 adding nothing (under a sliding window a tile starts at its earliest
//     row's window, TiledKeyBegin: the keys before it have weight 0 for every row).
// A task is a tile of query rows and one KV head (many pairs) or several (few): the pairs
// that read a cache row take it in one pass, so decode reads the cache once per KV head
// (not once per query head) and a prefill chunk once per tile of rows. A bf16 cache's rows
// are widened in registers as they are loaded.
// ---- Attention, many (row, head) pairs: vectorised across the pairs ----
//
// From kLanes pairs of a call on (SIMD builds), scores, softmax and values run one pair a
// lane, as MatMulPacked runs rows: Q is packed by dims (qt[d][u]), and per dim a key's
// element is broadcast and a fused multiply-add goes into each pair vector's score for that
// key (6 keys and two pair vectors at a time: 12 accumulators); the softmax's max, e^(s −
// max) and sum run lane by lane down the keys; and O (packed by dims too) takes the
// weights of a key, a pair vector, times each of 6 of its value elements broadcast. Each
// score is formed in the order above (its lanes' chains, then VSum's tree, done
// vertically), and each output as the chain over the keys (a key of weight 0 adds an
// exact 0), so a pair gets the same bits on either path, and rows after it in the
// call change none of them. Pairs past the task's last (padding lanes) see every key of
// the tile with a zero query, and are dropped.
// The pairs u < pairs of one task (pair u: row rows[u], q qs[u], out os[u], keys below
// ends[u]) over keys key_begin … key_end − 1 of the KV head whose slice of a cache row
// row_at gives (keys before key_begin, outside every pair's sliding window, would add
// weights and products of exactly 0: TiledKeyBegin). scores/probs rows (maps) are written
// as AttendNarrow writes them (−∞ and 0 before key_begin, as the mask would have made them).
template <typename KT, typename RowAt>
void AttendAcrossPairs(const AttentionArgs<float>& a, int pairs, const int* rows,
                       const int* heads_of, const float* const* qs, float* const* os,
                       const int* ends, int key_begin, int key_end, RowAt row_at) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int dh = a.head_dim, tk = a.num_keys, tq = a.num_queries;
  const int nv = (pairs + kLanes - 1) / kLanes;
  const int64_t lanes = int64_t{nv} * kLanes;
  const int nk = key_end - key_begin;  // sp and krows hold keys key_begin … from index 0
  thread_local std::vector<float> qt, sp, ot;
  thread_local std::vector<const KT*> krows;
  qt.assign(static_cast<size_t>(dh * lanes), 0.0f);
  sp.resize(static_cast<size_t>(nk * lanes));
  ot.resize(static_cast<size_t>(dh * lanes));
  krows.resize(static_cast<size_t>(nk));
  for (int u = 0; u < pairs; ++u) {
    for (int d = 0; d < dh; ++d) qt[QtRow(d, dh) * lanes + u] = qs[u][d];
  }
  // Scores (ScoresAcrossPairs).
  for (int r = 0; r < nk; ++r) krows[r] = static_cast<const KT*>(row_at(a.kv.k, key_begin + r));
  ScoresAcrossPairs(qt.data(), lanes, nv, krows.data(), nk, dh, static_cast<float>(a.scale),
                    sp.data());
  SoftCap(a, sp.data(), static_cast<int64_t>(nk) * lanes);
  // Masks, then e^(s − max) / Σ lane by lane (a padding lane sees every key).
  thread_local std::vector<float> mx, z;
  mx.assign(static_cast<size_t>(lanes), kNegInf);
  z.assign(static_cast<size_t>(lanes), 0.0f);
  for (int j = key_begin; j < key_end; ++j) {
    float* sj = sp.data() + (j - key_begin) * lanes;
    for (int u = 0; u < pairs; ++u) {
      const bool vis = j < ends[u] &&
                       (a.q_doc_ids == nullptr || a.q_doc_ids[rows[u]] == a.k_doc_ids[j]) &&
                       j >= WindowKeyBegin(a, rows[u]);
      if (!vis) sj[u] = kNegInf;
    }
    for (int64_t l = 0; l < lanes; ++l) mx[l] = std::max(mx[l], sj[l]);
  }
  if (a.scores != nullptr) {
    for (int u = 0; u < pairs; ++u) {
      float* map = a.scores + (static_cast<int64_t>(heads_of[u]) * tq + rows[u]) * tk;
      std::fill(map, map + key_begin, kNegInf);
      for (int j = key_begin; j < ends[u]; ++j) map[j] = sp[(j - key_begin) * lanes + u];
      std::fill(map + ends[u], map + tk, kNegInf);
    }
  }
  for (int r = 0; r < nk; ++r) {
    float* sj = sp.data() + r * lanes;
    for (int64_t l = 0; l < lanes; ++l) {
      sj[l] = ExpNegated(mx[l] - sj[l]);  // 0 for a masked key (s = −∞)
      z[l] += sj[l];
    }
  }
  for (int64_t l = 0; l < lanes; ++l) z[l] = 1.0f / z[l];
  for (int r = 0; r < nk; ++r) {
    float* sj = sp.data() + r * lanes;
    for (int64_t l = 0; l < lanes; ++l) sj[l] *= z[l];
  }
  if (a.probs != nullptr) {
    for (int u = 0; u < pairs; ++u) {
      float* map = a.probs + (static_cast<int64_t>(heads_of[u]) * tq + rows[u]) * tk;
      std::fill(map, map + key_begin, 0.0f);
      for (int j = key_begin; j < ends[u]; ++j) map[j] = sp[(j - key_begin) * lanes + u];
      std::fill(map + ends[u], map + tk, 0.0f);
    }
  }
  // Values (ValuesAcrossPairs).
  for (int r = 0; r < nk; ++r) krows[r] = static_cast<const KT*>(row_at(a.kv.v, key_begin + r));
  ValuesAcrossPairs(sp.data(), lanes, nv, krows.data(), nk, dh, ot.data());
  for (int u = 0; u < pairs; ++u) {
    for (int d = 0; d < dh; ++d) os[u][d] = ot[d * lanes + u];
  }
}

// Value rows chained into kLanes·NV dims of one output, j in order: o = p_j·v_j + o as
// the order above makes it, a key of weight 0 skipped.
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

// A set of (row, head) pairs over the keys [j_begin, j_end) of a cache, one pair at a time
// but each step vectorised, every rounding in the order above:
// a pair's scores kLanes keys at a time (each key's lane chains, then VSumLanes: VSum's
// tree for all kLanes keys at once), and its output chained in registers over the keys.
// The keys are taken in blocks (kLanes for scores, kValueBlock for values) that every pair
// reads before the next block, so a cache row is read from memory once for them all.
// Pair u: row rows[u], q qs[u], keys below ends[u], its KV head's column cols[u] of a row.
template <typename KT>
struct NarrowPairs {
  NarrowPairs(const AttentionArgs<float>& a_in, int pairs_in, const int* rows_in,
              const float* const* qs_in, const int* ends_in, const int64_t* cols_in, int begin,
              int end, std::vector<float>& sp_in, std::vector<float>& mx_in,
              std::vector<const KT*>& rows_of_in)
      : a(a_in),
        pairs(pairs_in),
        rows(rows_in),
        qs(qs_in),
        ends(ends_in),
        cols(cols_in),
        j_begin(begin),
        j_end(end),
        sp(sp_in),
        mx(mx_in),
        rows_of(rows_of_in) {}

  const AttentionArgs<float>& a;
  int pairs;
  const int* rows;
  const float* const* qs;
  const int* ends;
  const int64_t* cols;
  int j_begin, j_end;
  // Scores (then weights) of pair u at sp[u · stride + j − j_begin]; per pair, lane by lane,
  // the max of its scores at mx[u · kLanes …]; the key and value rows.
  std::vector<float>& sp;
  std::vector<float>& mx;
  std::vector<const KT*>& rows_of;
  int64_t stride = 0;

  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  static constexpr int kValueBlock = 64;
  // Rows are asked for (into L2) about this many bytes ahead of the score pass: a paged
  // cache's blocks lie anywhere, where the hardware prefetcher cannot follow, and a short
  // distance leaves a core waiting on memory (16 KiB ahead rather than 8 rows: a decode
  // step of the default model's shape 2.1–2.4 → 1.5–1.8 ms in kvlens_bench_attention).
  static constexpr int64_t kAheadBytes = 16 << 10;

  int End(int u) const { return std::min(j_end, ends[u]); }

  int64_t span_lo = 0, span_bytes = 0;  // the part of a row the pairs read

  template <typename RowBase>
  void LoadRows(const void* base, RowBase row_base) {
    rows_of.resize(static_cast<size_t>(stride));
    for (int j = j_begin; j < j_end; ++j) {
      rows_of[j - j_begin] = static_cast<const KT*>(row_base(base, j));
    }
    int64_t hi = cols[0];
    span_lo = cols[0];
    for (int u = 1; u < pairs; ++u) {
      span_lo = std::min(span_lo, cols[u]);
      hi = std::max(hi, cols[u]);
    }
    span_bytes = (hi + a.head_dim - span_lo) * static_cast<int64_t>(sizeof(KT));
  }

  // Asks for the part of row r (an index into rows_of) that the pairs read, into L2.
  void Prefetch(int r) const {
    const char* c = reinterpret_cast<const char*>(rows_of[r] + span_lo);
    for (int64_t b = 0; b < span_bytes; b += 64) __builtin_prefetch(c + b, 0, 2);
  }

  // Scaled scores of every pair's visible keys (−∞ for a key of another document, and past
  // a pair's end within its last block), and their max.
  template <typename RowBase>
  void Scores(RowBase row_base) {
    const int dh = a.head_dim, steps = dh / kLanes;
    stride = (j_end - j_begin + kLanes - 1) / kLanes * kLanes;
    sp.resize(static_cast<size_t>(pairs * stride));
    mx.assign(static_cast<size_t>(pairs * kLanes), kNegInf);
    LoadRows(a.kv.k, row_base);
    const Vec sv = VSet1(static_cast<float>(a.scale));
    const int n_rows = j_end - j_begin;
    const int ahead = static_cast<int>(std::clamp<int64_t>(kAheadBytes / span_bytes, 2, 64));
    for (int r = 0; r < std::min(n_rows, ahead); ++r) Prefetch(r);
    for (int r0 = 0; r0 < n_rows; r0 += kLanes) {
      for (int r = r0 + ahead; r < std::min(n_rows, r0 + ahead + kLanes); ++r) Prefetch(r);
      const int j0 = j_begin + r0;
      for (int u = 0; u < pairs; ++u) {
        if (j0 >= End(u)) continue;
        const int n = std::min(kLanes, End(u) - j0);
        const float* q = qs[u];
        // The kLanes keys' chains side by side (a lane past the pair's end reads the
        // block's first key, and its score is replaced by −∞ below).
        const KT* k[kLanes];
        for (int t = 0; t < kLanes; ++t) k[t] = rows_of[r0 + (t < n ? t : 0)] + cols[u];
        Vec acc[kLanes];
#pragma GCC unroll 16
        for (int t = 0; t < kLanes; ++t) acc[t] = VZero();
        for (int i = 0; i < steps; ++i) {
          const Vec qv = VLoad(q + i * kLanes);
#pragma GCC unroll 16
          for (int t = 0; t < kLanes; ++t) acc[t] = VFma(qv, VLoad(k[t] + i * kLanes), acc[t]);
        }
        float* su = sp.data() + u * stride + r0;
        Vec total = VSumLanes(acc);
        if (steps * kLanes < dh) {  // the last dh % kLanes dims, one FMA each
          VStore(su, total);
          for (int t = 0; t < n; ++t) {
            for (int d = steps * kLanes; d < dh; ++d) {
              su[t] = std::fma(q[d], KvAt(k[t], d), su[t]);
            }
          }
          total = VLoad(su);
        }
        VStore(su, VMul(sv, total));
        SoftCap(a, su, n);
        for (int t = n; t < kLanes; ++t) su[t] = kNegInf;
        if (a.q_doc_ids != nullptr) {
          const int32_t doc = a.q_doc_ids[rows[u]];
          for (int t = 0; t < n; ++t) {
            if (a.k_doc_ids[j0 + t] != doc) su[t] = kNegInf;
          }
        }
        for (int t = 0; t < std::min(n, WindowKeyBegin(a, rows[u]) - j0); ++t) su[t] = kNegInf;
        float* m = mx.data() + u * kLanes;
        VStore(m, VMax(VLoad(su), VLoad(m)));
      }
    }
  }

  float Max(int u) const {
    float mu = kNegInf;
    for (int l = 0; l < kLanes; ++l) mu = std::max(mu, mx[u * kLanes + l]);
    return mu;
  }

  // Pair u's weights e^(s − mu) in place (0 for a masked key, s = −∞; a vectorised pass),
  // and their sum.
  float Exponentials(int u, float mu) {
    float* su = sp.data() + u * stride;
    const int n = End(u) - j_begin;
    for (int r = 0; r < n; ++r) su[r] = ExpNegated(mu - su[r]);
    float z = 0.0f;
    for (int r = 0; r < n; ++r) z += su[r];
    return z;
  }

  // os[u][d] += Σ_j w_j · value_j[d] over the pairs' keys in order, for the pairs with
  // live[u] (all when live is null).
  template <typename RowBase>
  void Values(RowBase row_base, float* const* os, const uint8_t* live) {
    const int dh = a.head_dim, steps = dh / kLanes;
    LoadRows(a.kv.v, row_base);
    constexpr int kChunk = 8 * kLanes;  // dims a chain keeps in registers
    const int n_rows = j_end - j_begin;
    for (int r0 = 0; r0 < n_rows; r0 += kValueBlock) {
      const int r1 = std::min(n_rows, r0 + kValueBlock);
      for (int r = r1; r < std::min(n_rows, r1 + kValueBlock); ++r) Prefetch(r);
      for (int u = 0; u < pairs; ++u) {
        const int e = std::min(r1, End(u) - j_begin);
        if (r0 >= e || (live != nullptr && !live[u])) continue;
        const float* pu = sp.data() + u * stride;
        for (int d0 = 0; d0 < steps * kLanes; d0 += kChunk) {
          const int nv = std::min(steps - d0 / kLanes, 8);
          ValueChainOf<KT>(nv, pu, r0, e, rows_of.data(), cols[u], d0, os[u]);
        }
        for (int d = steps * kLanes; d < dh; ++d) {  // the last dh % kLanes dims
          float o = os[u][d];
          for (int r = r0; r < e; ++r) {
            if (pu[r] != 0.0f) o = std::fma(pu[r], KvAt(rows_of[r] + cols[u], d), o);
          }
          os[u][d] = o;
        }
      }
    }
  }
};

// The pairs of a tile too few to fill the lanes (pairs < kLanes a KV head: a decode step,
// a few rows of a small group), over keys key_begin … key_end − 1 (as AttendAcrossPairs):
// NarrowPairs' scores, the softmax (e^(s − max), summed in key order, times 1/Σ), then the
// outputs; maps as AttendAcrossPairs writes them.
template <typename KT, typename RowBase>
void AttendNarrow(const AttentionArgs<float>& a, int pairs, const int* rows, const int* heads_of,
                  const float* const* qs, float* const* os, const int* ends, const int64_t* cols,
                  int key_begin, int key_end, RowBase row_base) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int tk = a.num_keys, tq = a.num_queries;
  thread_local std::vector<float> sp, mx;
  thread_local std::vector<const KT*> rows_of;
  NarrowPairs<KT> np(a, pairs, rows, qs, ends, cols, key_begin, key_end, sp, mx, rows_of);
  np.Scores(row_base);
  for (int u = 0; u < pairs; ++u) {
    float* su = sp.data() + u * np.stride;
    const int end = ends[u];  // su[r]: key key_begin + r
    if (a.scores != nullptr) {
      float* map = a.scores + (static_cast<int64_t>(heads_of[u]) * tq + rows[u]) * tk;
      std::fill(map, map + key_begin, kNegInf);
      std::copy(su, su + end - key_begin, map + key_begin);
      std::fill(map + end, map + tk, kNegInf);
    }
    const float inv_z = 1.0f / np.Exponentials(u, np.Max(u));
    for (int r = 0; r < end - key_begin; ++r) su[r] *= inv_z;
    if (a.probs != nullptr) {
      float* map = a.probs + (static_cast<int64_t>(heads_of[u]) * tq + rows[u]) * tk;
      std::fill(map, map + key_begin, 0.0f);
      std::copy(su, su + end - key_begin, map + key_begin);
      std::fill(map + end, map + tk, 0.0f);
    }
  }
  for (int u = 0; u < pairs; ++u) std::fill(os[u], os[u] + a.head_dim, 0.0f);  // chains' start
  np.Values(row_base, os, nullptr);
}

// The first key a tile's pairs (rows rows[u < pairs]) read: under a sliding window, the
// first key of the earliest row's window (a key before every pair's window has weight
// exactly 0, and adds exact zeros to the sum and the value chains: skipping it changes no
// bit, except that a sum or output of 0 could have been −0; maps get the −∞ and 0 the
// mask gives them); 0 without a window.
int TiledKeyBegin(const AttentionArgs<float>& a, int pairs, const int* rows) {
  if (a.window <= 0) return 0;
  int begin = a.num_keys;
  for (int u = 0; u < pairs; ++u) begin = std::min(begin, WindowKeyBegin(a, rows[u]));
  return begin;
}

// Decode attention split over the keys (FlashDecoding on the CPU): a task takes a span of
// kSplitSpan keys for every query row and every head (NarrowPairs over the span: each
// block of key and value rows, all KV heads, read once), and keeps per (row, head) the
// span's max m, sum l of its weights e^(s − m) and unnormalised output acc, merged at the
// end:
//   out = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s,  M = max_s m_s.
// Paged rows of a KV head are 4 KiB apart in fp32 (a row holds every KV head), so a task
// per KV head reads an eighth of each row it touches and waits on rows; this reads rows
// as they lie. Same visibility rule; no maps (those calls take the tiled path).
constexpr int kSplitSpan = 256;
constexpr int kSplitMaxQueries = 4;  // query rows of a call that takes this path

template <typename E>
class SplitKeysPlan {
 public:
  explicit SplitKeysPlan(const AttentionArgs<float>& a)
      : a_(a), dh_(a.head_dim), heads_(a.num_heads), rh_(a.num_queries * a.num_heads) {
    const int tq = a.num_queries, group = heads_ / a.num_kv_heads;
    key_begin_ = a.num_keys;
    for (int i = 0; i < tq; ++i) {
      key_end_ = std::max(key_end_, CausalKeyEnd(a, i));
      key_begin_ = std::min(key_begin_, WindowKeyBegin(a, i));
    }
    spans_ = (key_end_ + kSplitSpan - 1) / kSplitSpan;
    m_.resize(size_t(spans_) * rh_);
    l_.resize(m_.size());
    acc_.resize(m_.size() * size_t(dh_));
    rows_.resize(rh_);  // (row, head) pairs: u = i·H + h
    ends_.resize(rh_);
    qs_.resize(rh_);
    cols_.resize(rh_);
    for (int u = 0; u < rh_; ++u) {
      const int i = u / heads_, h = u % heads_;
      rows_[u] = i;
      ends_[u] = CausalKeyEnd(a, i);
      qs_[u] = a.q + i * a.q_stride + int64_t{h} * dh_;
      cols_[u] = int64_t{h / group} * dh_;
    }
  }

  int spans() const { return spans_; }

  // Span sp's max, sum and unnormalised output for every pair.
  void Run(int64_t sp) {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const int j0 = static_cast<int>(sp) * kSplitSpan;
    const int j1 = std::min(key_end_, j0 + kSplitSpan);
    auto row_base = [this](const void* base, int j) -> const void* {
      return static_cast<const E*>(base) + a_.kv.PhysicalRow(j) * a_.kv.row_stride;
    };
    thread_local std::vector<float> w, mx;
    thread_local std::vector<const E*> rows_of;
    thread_local std::vector<float*> os;
    thread_local std::vector<uint8_t> live;
    os.resize(size_t(rh_));
    live.assign(size_t(rh_), 0);
    float* ms = m_.data() + sp * rh_;
    float* ls = l_.data() + sp * rh_;
    float* as = acc_.data() + sp * rh_ * dh_;
    std::fill(ms, ms + rh_, kNegInf);
    std::fill(ls, ls + rh_, 0.0f);
    std::fill(as, as + int64_t{rh_} * dh_, 0.0f);
    if (j1 <= key_begin_) return;  // before every row's sliding window: no key shown
    NarrowPairs<E> np(a_, rh_, rows_.data(), qs_.data(), ends_.data(), cols_.data(), j0, j1, w, mx,
                      rows_of);
    np.Scores(row_base);
    for (int u = 0; u < rh_; ++u) {
      os[u] = as + int64_t{u} * dh_;
      if (np.End(u) <= j0) continue;
      const float mu = np.Max(u);
      if (mu == kNegInf) continue;  // this span shows the row no key
      ms[u] = mu;
      ls[u] = np.Exponentials(u, mu);
      live[u] = 1;
    }
    np.Values(row_base, os.data(), live.data());
  }

  // The spans merged into the output, after every Run.
  void Finish() const {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (int u = 0; u < rh_; ++u) {
      const int i = u / heads_, h = u % heads_;
      float top = kNegInf;
      for (int sp = 0; sp < spans_; ++sp) top = std::max(top, m_[sp * rh_ + u]);
      float* o = a_.out + i * a_.out_stride + int64_t{h} * dh_;
      std::fill(o, o + dh_, 0.0f);
      float z = 0.0f;
      for (int sp = 0; sp < spans_; ++sp) {
        const int64_t at = int64_t{sp} * rh_ + u;
        if (m_[at] == kNegInf) continue;
        const float e = std::exp(m_[at] - top);
        z += e * l_[at];
        const float* as = acc_.data() + at * dh_;
        for (int d = 0; d < dh_; ++d) o[d] += e * as[d];
      }
      const float inv_z = 1.0f / z;  // z > 0: every row sees a key (checked)
      for (int d = 0; d < dh_; ++d) o[d] *= inv_z;
    }
  }

 private:
  const AttentionArgs<float>& a_;
  const int dh_, heads_, rh_;
  int key_end_ = 0, key_begin_ = 0, spans_ = 0;
  std::vector<float> m_, l_, acc_;  // per span and pair: max, sum, output
  std::vector<int> rows_, ends_;
  std::vector<const float*> qs_;
  std::vector<int64_t> cols_;
};

}  // namespace

absl::Status CpuBackend::Attention(const AttentionArgs<float>& a) {
  if (absl::Status s = ValidateAttentionArgs(a); !s.ok()) return s;
  if (absl::Status s = CheckEveryRowSeesAKey(a); !s.ok()) return s;
  const AttentionPlan t = Plan(a, pool_->num_threads());
  if (t.inline_run) {
    for (int64_t task = 0; task < t.count; ++task) t.run(task);
  } else {
    pool_->ParallelFor(t.count, t.run);
  }
  if (t.finish) t.finish();
  return absl::OkStatus();
}

// Several calls (a decode step's sequences): all their tasks side by side in one
// ParallelFor (each task computes what it computes in Attention, so the bits are the
// same), then the split calls' merges, one task a call. As the default: calls before a
// failing one have run, and *failed names it.
absl::Status CpuBackend::AttentionBatch(absl::Span<const AttentionArgs<float>> calls, int* failed) {
  std::vector<AttentionPlan> plans;
  std::vector<int64_t> first;  // plans[c]'s first task in the shared range
  int64_t total = 0;
  auto run = [&] {
    if (plans.empty()) return;
    pool_->ParallelFor(total, [&](int64_t task) {
      const size_t c =
          static_cast<size_t>(std::upper_bound(first.begin(), first.end(), task) - first.begin()) -
          1;
      plans[c].run(task - first[c]);
    });
    std::vector<const AttentionPlan*> merges;
    for (const AttentionPlan& p : plans) {
      if (p.finish) merges.push_back(&p);
    }
    pool_->ParallelFor(static_cast<int64_t>(merges.size()),
                       [&](int64_t c) { merges[static_cast<size_t>(c)]->finish(); });
  };
  const int min_tasks = static_cast<int>((pool_->num_threads() + calls.size() - 1) /
                                         std::max<size_t>(calls.size(), 1));
  for (size_t i = 0; i < calls.size(); ++i) {
    const AttentionArgs<float>& a = calls[i];
    absl::Status s = ValidateAttentionArgs(a);
    if (s.ok()) s = CheckEveryRowSeesAKey(a);
    if (!s.ok()) {
      run();
      *failed = static_cast<int>(i);
      return s;
    }
    first.push_back(total);
    plans.push_back(Plan(a, min_tasks));
    total += plans.back().count;
  }
  run();
  return absl::OkStatus();
}

CpuBackend::AttentionPlan CpuBackend::Plan(const AttentionArgs<float>& a, int min_tasks) {
  return TakesSplitKeys(a) ? PlanSplitKeys(a) : PlanTiled(a, min_tasks);
}

// Decode over a long context: split over the keys, rows read whole.
bool CpuBackend::TakesSplitKeys(const AttentionArgs<float>& a) {
  return a.num_queries <= kSplitMaxQueries && a.num_keys >= 2 * kSplitSpan && a.probs == nullptr &&
         a.scores == nullptr;
}

// A checked call on the split path: a task per span of keys, then the merge. The closures
// share the plan's state and hold a reference to `a`, which must outlive them.
CpuBackend::AttentionPlan CpuBackend::PlanSplitKeys(const AttentionArgs<float>& a) {
  auto make = [](auto plan) {
    AttentionPlan t;
    t.count = plan->spans();
    t.run = [plan](int64_t sp) { plan->Run(sp); };
    t.finish = [plan] { plan->Finish(); };
    return t;
  };
  if (a.kv.dtype == KvDtype::kBF16) {
    return make(std::make_shared<SplitKeysPlan<uint16_t>>(a));
  }
  return make(std::make_shared<SplitKeysPlan<float>>(a));
}

// A checked call on the tiled path: its tasks (a KV head, or several for a narrow call, × a
// tile of query rows each) and what task t computes. The closure holds a reference to `a`,
// which must outlive it.
CpuBackend::AttentionPlan CpuBackend::PlanTiled(const AttentionArgs<float>& a, int min_tasks) {
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
              const int key_begin = TiledKeyBegin(a, pairs, pair_rows);
              if (across) {
                const int64_t col = cols[0];
                auto row_at = [&](const void* base, int j) -> const void* {
                  return static_cast<const char*>(row_base(base, j)) + col * elem;
                };
                if (bf16) {
                  AttendAcrossPairs<uint16_t>(a, pairs, pair_rows, pair_heads, qs, os, ends,
                                              key_begin, key_end, row_at);
                } else {
                  AttendAcrossPairs<float>(a, pairs, pair_rows, pair_heads, qs, os, ends, key_begin,
                                           key_end, row_at);
                }
              } else if (bf16) {
                AttendNarrow<uint16_t>(a, pairs, pair_rows, pair_heads, qs, os, ends, cols,
                                       key_begin, key_end, row_base);
              } else {
                AttendNarrow<float>(a, pairs, pair_rows, pair_heads, qs, os, ends, cols, key_begin,
                                    key_end, row_base);
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
