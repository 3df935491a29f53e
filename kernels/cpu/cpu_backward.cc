// CpuBackend's BackwardOps (kernels/backward_ops.h): the interpretability backward's two
// heavy ops in fp32 on the thread pool, with this machine's vector width (compiled
// -march=native where allowed, as cpu_backend.cc); the input gradients of many rows
// through the forward's MatMul on W transposed, the attention backward on the forward's
// tiles (attention_tiles.h), one (row, head) pair a SIMD lane. The reference loops
// (kernels/cpu/reference_backward.h) accumulate in double on one thread and stay the
// oracle; these accumulate in float (FMA where the machine has it) and are checked against
// them within fp32 rounding.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/attention_check.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/simd.h"

namespace kvlens::kernels {
namespace {

// fn(0 … tasks) on the pool, or on the calling thread when the call's work (multiply-adds)
// is too small to pay for waking the pool (a cached-KV probe's one new token).
template <typename Fn>
void ForEachTask(ThreadPool& pool, int64_t tasks, int64_t work, Fn&& fn) {
  if (work < (int64_t{1} << 16) || pool.num_threads() == 1) {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
  } else {
    pool.ParallelFor(tasks, fn);
  }
}

// y[0 … n) += c · x[0 … n)
inline void Axpy(float* __restrict y, float c, const float* __restrict x, int n) {
  for (int d = 0; d < n; ++d) y[d] += c * x[d];
}

// dst[0 … n) += Σ_u w[u] · rows[u][0 … n) for u < m, kChunk dims at a time in registers (a
// row of weight 0 is skipped).
inline void AddRowCombination(float* dst, int n, const float* w, const float* const* rows, int m) {
  constexpr int kVecs = 4, kChunk = kVecs * kLanes;
  int d0 = 0;
  for (; d0 + kChunk <= n; d0 += kChunk) {
    Vec acc[kVecs];
    for (int k = 0; k < kVecs; ++k) acc[k] = VLoad(dst + d0 + k * kLanes);
    for (int u = 0; u < m; ++u) {
      if (w[u] == 0.0f) continue;
      const Vec c = VSet1(w[u]);
      for (int k = 0; k < kVecs; ++k) acc[k] = VFma(c, VLoad(rows[u] + d0 + k * kLanes), acc[k]);
    }
    for (int k = 0; k < kVecs; ++k) VStore(dst + d0 + k * kLanes, acc[k]);
  }
  for (; d0 + kLanes <= n; d0 += kLanes) {
    Vec acc = VLoad(dst + d0);
    for (int u = 0; u < m; ++u) {
      if (w[u] != 0.0f) acc = VFma(VSet1(w[u]), VLoad(rows[u] + d0), acc);
    }
    VStore(dst + d0, acc);
  }
  for (; d0 < n; ++d0) {
    float acc = dst[d0];
    for (int u = 0; u < m; ++u) acc += w[u] * rows[u][d0];
    dst[d0] = acc;
  }
}

// From this many rows of dy on, MatMulBackwardInput transposes W and runs MatMul.
constexpr int kTransposeRows = 16;

}  // namespace

absl::Status CpuBackend::MatMulBackwardInput(const float* dy, int n, const WeightView& w,
                                             float* dx) {
  if (n <= 0) return absl::OkStatus();
  const int64_t in = w.cols, out = w.rows;
  if (n >= kTransposeRows) {
    // Many rows: dx[:, c0 … c0 + width) += dy · (Wᵀ's rows c0 …)ᵀ by the forward's MatMul,
    // on Wᵀ's rows decoded and transposed a panel at a time (out · width floats; the
    // transpose costs out · in, the product n · out · in).
    constexpr int64_t kWidth = 256;  // a multiple of every block type's elements
    static_assert(kWidth % DTypeBlockSize(DType::kQ4_K) == 0);
    std::vector<float> panel(static_cast<size_t>(out * std::min(kWidth, in)));
    std::vector<float> wt(panel.size());
    std::vector<float> y(static_cast<size_t>(n * std::min(kWidth, in)));
    for (int64_t c0 = 0; c0 < in; c0 += kWidth) {
      const int64_t width = std::min(kWidth, in - c0);
      for (int64_t o = 0; o < out; ++o) {
        const WeightView columns{w.row(o) + DTypeRowBytes(w.dtype, c0), w.dtype, 1, width};
        DequantizeRow(columns, 0, panel.data() + o * width);
      }
      for (int64_t o = 0; o < out; ++o) {
        for (int64_t c = 0; c < width; ++c) wt[c * out + o] = panel[o * width + c];
      }
      MatMul(dy, n, WeightView{wt.data(), DType::kF32, width, out}, WeightView{}, y.data());
      for (int r = 0; r < n; ++r) {
        Axpy(dx + r * in + c0, 1.0f, y.data() + r * width, static_cast<int>(width));
      }
    }
    return absl::OkStatus();
  }
  // Few rows (a cached-KV probe's one new token), where a transpose would cost as much as
  // the product: a task per panel of panel_width columns of W (every row of W decoded once
  // into a float panel), then kRows rows of dy at a time over it, their accumulators in
  // L1; each task owns its columns of dx.
  // 128 columns, or a k-quant's 256 (a panel holds whole blocks); a column's sums do not
  // depend on the panel's width.
  constexpr int64_t kMaxWidth = 256;
  const int64_t panel_width = std::max<int64_t>(128, DTypeBlockSize(w.dtype));
  constexpr int kRows = 16;
  const int64_t panels = (in + panel_width - 1) / panel_width;
  ForEachTask(*pool_, panels, n * out * in, [&](int64_t p) {
    const int64_t c0 = p * panel_width, width = std::min(panel_width, in - c0);
    thread_local std::vector<float> panel;
    panel.resize(static_cast<size_t>(out * width));
    for (int64_t o = 0; o < out; ++o) {
      const WeightView columns{w.row(o) + DTypeRowBytes(w.dtype, c0), w.dtype, 1, width};
      DequantizeRow(columns, 0, panel.data() + o * width);
    }
    alignas(64) float acc[kRows * kMaxWidth];
    for (int r0 = 0; r0 < n; r0 += kRows) {
      const int rows = std::min(kRows, n - r0);
      std::fill(acc, acc + rows * width, 0.0f);
      for (int64_t o = 0; o < out; ++o) {
        const float* wp = panel.data() + o * width;
        for (int r = 0; r < rows; ++r) {
          const float g = dy[(r0 + r) * out + o];
          if (g != 0.0f) Axpy(acc + r * width, g, wp, static_cast<int>(width));
        }
      }
      for (int r = 0; r < rows; ++r) {
        Axpy(dx + (r0 + r) * in + c0, 1.0f, acc + r * width, static_cast<int>(width));
      }
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::AttentionBackward(const AttentionBackwardArgs<float>& b) {
  const AttentionArgs<float> a = ForwardArgsOf(b);
  if (absl::Status s = ValidateAttentionBackwardArgs(b); !s.ok()) return s;
  if (absl::Status s = CheckEveryRowSeesAKey(a); !s.ok()) return s;
  const int tq = b.num_queries, tk = b.num_keys, dh = b.head_dim;
  const int hkv = b.num_kv_heads, group = b.num_heads / hkv;
  const int64_t qw = static_cast<int64_t>(b.num_heads) * dh, kvw = static_cast<int64_t>(hkv) * dh;
  const float scale = static_cast<float>(b.scale);
  // A task per KV head and chunk of its (row, head) pairs (kChunkTasks tasks or more in
  // all, whatever the threads: a model with one KV head still fills them), the pairs
  // kPairTile at a time, one pair a SIMD lane as the forward's tiles run them. A task's dK
  // and dV accumulate in its chunk's own [Tk, Dh] arrays, summed in chunk order afterwards
  // (so the bits do not depend on the threads); dQ and the maps' rows of its pairs are its
  // own. Per tile, with p the forward's probabilities (0 off the visible keys; a masked
  // key's dA is formed from its row and dropped):
  //   dA[j] = g · v_j (ScoreTile on the packed g), mean = Σ_j p_j dA[j],
  //   dS[j] = p_j (dA[j] − mean), dQ = scale Σ_j dS[j] k_j (ValueTile on the keys),
  //   dV[j] += Σ_pairs p_j g, dK[j] += scale Σ_pairs dS[j] q (a key's row at a time).
  constexpr int kPairTile = 2 * kLanes;
  constexpr int kChunkTasks = 16;
  const int64_t pairs_total = int64_t{group} * tq;  // a KV head's; pair u = (head u / tq, row)
  const int64_t tiles = (pairs_total + kPairTile - 1) / kPairTile;
  const int chunks = static_cast<int>(std::clamp<int64_t>((kChunkTasks + hkv - 1) / hkv, 1, tiles));
  const int64_t tiles_per_chunk = (tiles + chunks - 1) / chunks;
  const int64_t kv_elems = static_cast<int64_t>(tk) * dh;
  std::vector<float> dk_parts(static_cast<size_t>(hkv * chunks * kv_elems), 0.0f);
  std::vector<float> dv_parts(dk_parts.size(), 0.0f);
  const int64_t work = int64_t{tq} * tk * dh * b.num_heads;
  ForEachTask(*pool_, int64_t{hkv} * chunks, work, [&](int64_t task) {
    const int kvh = static_cast<int>(task / chunks), chunk = static_cast<int>(task % chunks);
    thread_local std::vector<float> gt, da, pt, ot, w, qt, raw;
    thread_local std::vector<const float*> krows, vrows;
    float* dk = dk_parts.data() + task * kv_elems;
    float* dv = dv_parts.data() + task * kv_elems;
    auto row = [&](const void* base, int j) {  // (validated: the activation type)
      return static_cast<const float*>(base) + b.kv.PhysicalRow(j) * b.kv.row_stride +
             static_cast<int64_t>(kvh) * dh;
    };
    const int64_t u_end = std::min(pairs_total, (chunk + 1) * tiles_per_chunk * kPairTile);
    for (int64_t u0 = chunk * tiles_per_chunk * kPairTile; u0 < u_end; u0 += kPairTile) {
      const int pairs = static_cast<int>(std::min<int64_t>(kPairTile, u_end - u0));
      const int nv = (pairs + kLanes - 1) / kLanes;
      const int64_t lanes = int64_t{nv} * kLanes;
      int rows[kPairTile], heads[kPairTile], ends[kPairTile];
      const float *qs[kPairTile], *gs[kPairTile];
      int key_end = 0;
      for (int u = 0; u < pairs; ++u) {
        const int64_t pu = u0 + u;
        rows[u] = static_cast<int>(pu % tq);
        heads[u] = kvh * group + static_cast<int>(pu / tq);
        ends[u] = CausalKeyEnd(a, rows[u]);
        key_end = std::max(key_end, ends[u]);
        qs[u] = b.q + rows[u] * b.q_stride + static_cast<int64_t>(heads[u]) * dh;
        gs[u] = b.dout + rows[u] * b.dout_stride + static_cast<int64_t>(heads[u]) * dh;
      }
      gt.assign(static_cast<size_t>(dh * lanes), 0.0f);
      for (int u = 0; u < pairs; ++u) {
        for (int d = 0; d < dh; ++d) gt[QtRow(d, dh) * lanes + u] = gs[u][d];
      }
      krows.resize(static_cast<size_t>(key_end));
      vrows.resize(static_cast<size_t>(key_end));
      for (int j = 0; j < key_end; ++j) {
        krows[j] = row(b.kv.k, j);
        vrows[j] = row(b.kv.v, j);
      }
      // dA[j][u] (zero off the visible keys) and p[j][u].
      da.resize(static_cast<size_t>(key_end * lanes));
      pt.assign(da.size(), 0.0f);
      ScoresAcrossPairs(gt.data(), lanes, nv, vrows.data(), key_end, dh, 1.0f, da.data());
      float mean[kPairTile] = {};
      for (int u = 0; u < pairs; ++u) {
        const float* p = b.probs + (static_cast<int64_t>(heads[u]) * tq + rows[u]) * tk;
        for (int j = 0; j < key_end; ++j) {
          float& x = da[j * lanes + u];
          if (j < ends[u] && KeyVisible(a, rows[u], j)) {
            pt[j * lanes + u] = p[j];
            mean[u] += p[j] * x;
          } else {
            x = 0.0f;  // a masked key's row may hold anything
          }
        }
      }
      if (b.dprobs != nullptr) {
        for (int u = 0; u < pairs; ++u) {
          float* map = b.dprobs + (static_cast<int64_t>(heads[u]) * tq + rows[u]) * tk;
          for (int j = 0; j < key_end; ++j) map[j] = da[j * lanes + u];
          std::fill(map + key_end, map + tk, 0.0f);
        }
      }
      // dS in place of dA.
      for (int j = 0; j < key_end; ++j) {
        for (int u = 0; u < pairs; ++u) {
          float& x = da[j * lanes + u];
          x = pt[j * lanes + u] * (x - mean[u]);
        }
      }
      if (b.dscores != nullptr) {
        for (int u = 0; u < pairs; ++u) {
          float* map = b.dscores + (static_cast<int64_t>(heads[u]) * tq + rows[u]) * tk;
          for (int j = 0; j < key_end; ++j) map[j] = da[j * lanes + u];
          std::fill(map + key_end, map + tk, 0.0f);
        }
      }
      // Through a soft-cap: dR[j] = dS[j] (1 − tanh²(R[j] / cap)), R the uncapped scores
      // (formed again from the packed q, as the forward formed them).
      if (b.softcap > 0.0) {
        qt.assign(static_cast<size_t>(dh * lanes), 0.0f);
        for (int u = 0; u < pairs; ++u) {
          for (int d = 0; d < dh; ++d) qt[QtRow(d, dh) * lanes + u] = qs[u][d];
        }
        raw.resize(da.size());
        ScoresAcrossPairs(qt.data(), lanes, nv, krows.data(), key_end, dh, scale, raw.data());
        const double cap = b.softcap;
        for (size_t e = 0; e < da.size(); ++e) {
          if (da[e] == 0.0f) continue;
          const double t = std::tanh(raw[e] / cap);
          da[e] = static_cast<float>(da[e] * (1.0 - t * t));
        }
      }
      // dQ = scale Σ_j dR[j] k_j (a padding lane's is never read).
      ot.resize(static_cast<size_t>(dh * lanes));
      ValuesAcrossPairs(da.data(), lanes, nv, krows.data(), key_end, dh, ot.data());
      for (int u = 0; u < pairs; ++u) {
        float* dq = b.dq + rows[u] * qw + static_cast<int64_t>(heads[u]) * dh;
        for (int d = 0; d < dh; ++d) dq[d] = scale * ot[d * lanes + u];
      }
      // dV[j] += Σ_u p[j][u] g_u; dK[j] += Σ_u scale dR[j][u] q_u.
      w.resize(static_cast<size_t>(pairs));
      for (int j = 0; j < key_end; ++j) {
        const float* pj = pt.data() + j * lanes;
        AddRowCombination(dv + static_cast<int64_t>(j) * dh, dh, pj, gs, pairs);
        const float* sj = da.data() + j * lanes;
        for (int u = 0; u < pairs; ++u) w[u] = scale * sj[u];
        AddRowCombination(dk + static_cast<int64_t>(j) * dh, dh, w.data(), qs, pairs);
      }
    }
  });
  // dK and dV: the chunks' arrays summed in chunk order, a task per KV head and span of keys.
  constexpr int kKeySpan = 64;
  const int64_t spans = (tk + kKeySpan - 1) / kKeySpan;
  ForEachTask(*pool_, hkv * spans, int64_t{chunks} * kv_elems * hkv * 2, [&](int64_t task) {
    const int kvh = static_cast<int>(task / spans);
    const int j0 = static_cast<int>(task % spans) * kKeySpan, j1 = std::min(tk, j0 + kKeySpan);
    for (int j = j0; j < j1; ++j) {
      const int64_t at = static_cast<int64_t>(j) * kvw + static_cast<int64_t>(kvh) * dh;
      for (const auto& [parts, out] : {std::pair{&dk_parts, b.dk}, std::pair{&dv_parts, b.dv}}) {
        const float* first = parts->data() + (int64_t{kvh} * chunks * tk + j) * dh;
        std::copy_n(first, dh, out + at);
        for (int c = 1; c < chunks; ++c) {
          Axpy(out + at, 1.0f, first + int64_t{c} * kv_elems, dh);
        }
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace kvlens::kernels
