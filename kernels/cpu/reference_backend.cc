#include "kernels/cpu/reference_backend.h"

#include <cmath>
#include <limits>
#include <numbers>
#include <vector>

#include "kernels/attention_check.h"

namespace kvlens::kernels {
namespace {

std::vector<double> Row(const WeightView& w, int64_t r) {
  std::vector<double> out(static_cast<size_t>(w.cols));
  DequantizeRow(w, r, out.data());
  return out;
}

}  // namespace

// y[n, o] = Σ_i x[n, i] · W[o, i] + bias[o]
void ReferenceBackend::MatMul(const double* x, int n, const WeightView& w, const WeightView& bias,
                              double* y) {
  const int64_t in = w.cols, out = w.rows;
  const std::vector<double> b = bias.empty() ? std::vector<double>(out, 0.0) : Row(bias, 0);
  for (int64_t o = 0; o < out; ++o) {
    const std::vector<double> w_row = Row(w, o);
    for (int r = 0; r < n; ++r) {
      double sum = 0.0;
      for (int64_t i = 0; i < in; ++i) sum += x[r * in + i] * w_row[i];
      y[r * out + o] = sum + b[o];
    }
  }
}

void ReferenceBackend::Embedding(const WeightView& table, const int32_t* ids, int n, double* out) {
  for (int r = 0; r < n; ++r) DequantizeRow(table, ids[r], out + r * table.cols);
}

// y = x / sqrt(mean(x²) + eps) ⊙ weight
void ReferenceBackend::RmsNorm(const double* x, int n, int dim, const WeightView& weight,
                               double eps, double* y) {
  const std::vector<double> g = Row(weight, 0);
  for (int r = 0; r < n; ++r) {
    const double* xr = x + static_cast<int64_t>(r) * dim;
    double sum_sq = 0.0;
    for (int i = 0; i < dim; ++i) sum_sq += xr[i] * xr[i];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / dim + eps);
    for (int i = 0; i < dim; ++i) y[static_cast<int64_t>(r) * dim + i] = xr[i] * inv_rms * g[i];
  }
}

// y = (x − μ) / sqrt(v + eps) ⊙ weight + bias, v the biased variance
void ReferenceBackend::LayerNorm(const double* x, int n, int dim, const WeightView& weight,
                                 const WeightView& bias, double eps, double* y) {
  const std::vector<double> g = Row(weight, 0);
  const std::vector<double> b = bias.empty() ? std::vector<double>(dim, 0.0) : Row(bias, 0);
  for (int r = 0; r < n; ++r) {
    const double* xr = x + static_cast<int64_t>(r) * dim;
    double mean = 0.0;
    for (int i = 0; i < dim; ++i) mean += xr[i];
    mean /= dim;
    double var = 0.0;
    for (int i = 0; i < dim; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= dim;
    const double inv_std = 1.0 / std::sqrt(var + eps);
    for (int i = 0; i < dim; ++i) {
      y[static_cast<int64_t>(r) * dim + i] = (xr[i] - mean) * inv_std * g[i] + b[i];
    }
  }
}

// Pair p = (a, b) of each head turns by angle pos · rope.Frequency(p, Dh):
//   (a, b) ← (a cos − b sin, a sin + b cos)
void ReferenceBackend::Rope(double* x, int n, int64_t row_stride, int num_heads, int head_dim,
                            const int32_t* positions, const RopeSpec& rope) {
  const int half = head_dim / 2;
  for (int r = 0; r < n; ++r) {
    for (int h = 0; h < num_heads; ++h) {
      double* head = x + r * row_stride + static_cast<int64_t>(h) * head_dim;
      for (int p = 0; p < half; ++p) {
        const double angle = positions[r] * rope.Frequency(p, head_dim);
        const double c = std::cos(angle), s = std::sin(angle);
        const int ia = rope.style == RopeStyle::kAdjacentPairs ? 2 * p : p;
        const int ib = rope.style == RopeStyle::kAdjacentPairs ? 2 * p + 1 : p + half;
        const double a = head[ia], b = head[ib];
        head[ia] = a * c - b * s;
        head[ib] = a * s + b * c;
      }
    }
  }
}

// GELU(x) = x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))
void ReferenceBackend::Gelu(double* x, int64_t count) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  for (int64_t i = 0; i < count; ++i) {
    const double v = x[i];
    x[i] = 0.5 * v * (1.0 + std::tanh(k * (v + 0.044715 * v * v * v)));
  }
}

// out = gate · σ(gate) ⊙ up
void ReferenceBackend::SwiGlu(const double* gate, const double* up, int64_t count, double* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
}

// out = GELU(gate) ⊙ up (GELU as above)
void ReferenceBackend::GeGlu(const double* gate, const double* up, int64_t count, double* out) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  for (int64_t i = 0; i < count; ++i) {
    const double g = gate[i];
    out[i] = 0.5 * g * (1.0 + std::tanh(k * (g + 0.044715 * g * g * g))) * up[i];
  }
}

void ReferenceBackend::Scale(double* x, int64_t count, double factor) {
  for (int64_t i = 0; i < count; ++i) x[i] *= factor;
}

void ReferenceBackend::SoftCap(double* x, int64_t count, double cap) {
  for (int64_t i = 0; i < count; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

void ReferenceBackend::Add(double* y, const double* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] += x[i];
}

void ReferenceBackend::StoreKv(const double* k, const double* v, int n, int64_t src_stride,
                               int64_t row_elems, const int64_t* dst_rows, void* k_cache,
                               void* v_cache, int64_t cache_stride, KvDtype cache_dtype) {
  for (int r = 0; r < n; ++r) {
    if (dst_rows[r] < 0) continue;  // a padding row
    KvStoreRow(k_cache, dst_rows[r] * cache_stride, k + r * src_stride, row_elems, cache_dtype);
    KvStoreRow(v_cache, dst_rows[r] * cache_stride, v + r * src_stride, row_elems, cache_dtype);
  }
}

// For each head h and query row i:
//   S[j] = scale · q·k_j if key j is visible (softcap: softcap · tanh(scale · q·k_j / softcap)),
//          −∞ if masked
//   A[j] = exp(S[j] − max S) / Σ_l exp(S[l] − max S)
//   out  = Σ_j A[j] v_j
absl::Status ReferenceBackend::Attention(const AttentionArgs<double>& a) {
  if (absl::Status s = ValidateAttentionArgs(a); !s.ok()) return s;
  const int tq = a.num_queries, tk = a.num_keys, dh = a.head_dim;
  const int group = a.num_heads / a.num_kv_heads;
  auto visible = [&](int i, int j) {
    const bool causal_ok = !a.causal || static_cast<int64_t>(j) <= int64_t{a.query_offset} + i;
    const bool doc_ok = a.q_doc_ids == nullptr || a.q_doc_ids[i] == a.k_doc_ids[j];
    const bool window_ok = a.window == 0 || int64_t{a.query_offset} + i - j < a.window;
    return causal_ok && doc_ok && window_ok;
  };
  // Reject before writing anything.
  for (int i = 0; i < tq; ++i) {
    int num_visible = 0;
    for (int j = 0; j < tk; ++j) num_visible += visible(i, j) ? 1 : 0;
    if (num_visible == 0) return NoVisibleKeyError(i, int64_t{a.query_offset} + i);
  }
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::vector<double> s(tk), p(tk), row(dh);  // row: a bf16 cache row widened
  for (int h = 0; h < a.num_heads; ++h) {
    const int kvh = h / group;
    for (int i = 0; i < tq; ++i) {
      const double* q = a.q + i * a.q_stride + static_cast<int64_t>(h) * dh;
      double max_s = neg_inf;
      for (int j = 0; j < tk; ++j) {
        if (!visible(i, j)) {
          s[j] = neg_inf;
          continue;
        }
        const double* k = a.kv.KeyRow(j, static_cast<int64_t>(kvh) * dh, dh, row.data());
        double dot = 0.0;
        for (int d = 0; d < dh; ++d) dot += q[d] * k[d];
        s[j] = a.scale * dot;
        if (a.softcap > 0.0) s[j] = a.softcap * std::tanh(s[j] / a.softcap);
        if (s[j] > max_s) max_s = s[j];
      }
      double z = 0.0;
      for (int j = 0; j < tk; ++j) {
        p[j] = visible(i, j) ? std::exp(s[j] - max_s) : 0.0;
        z += p[j];
      }
      for (int j = 0; j < tk; ++j) p[j] /= z;
      double* o = a.out + i * a.out_stride + static_cast<int64_t>(h) * dh;
      for (int d = 0; d < dh; ++d) o[d] = 0.0;
      for (int j = 0; j < tk; ++j) {
        if (!visible(i, j)) continue;  // never read a masked key's value row
        const double* v = a.kv.ValueRow(j, static_cast<int64_t>(kvh) * dh, dh, row.data());
        for (int d = 0; d < dh; ++d) o[d] += p[j] * v[d];
      }
      const int64_t map = (static_cast<int64_t>(h) * tq + i) * tk;
      if (a.scores != nullptr) {
        for (int j = 0; j < tk; ++j) a.scores[map + j] = s[j];
      }
      if (a.probs != nullptr) {
        for (int j = 0; j < tk; ++j) a.probs[map + j] = p[j];
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvlens::kernels
