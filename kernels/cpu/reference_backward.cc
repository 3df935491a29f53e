#include "kernels/cpu/reference_backward.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "kernels/attention_check.h"

namespace kvlens::kernels {
namespace {

template <typename T>
std::vector<double> Row(const WeightView& w, int64_t r) {
  std::vector<double> out(static_cast<size_t>(w.cols));
  DequantizeRow(w, r, out.data());
  return out;
}

}  // namespace

template <typename T>
absl::Status AttentionBackward(const AttentionBackwardArgs<T>& b) {
  const AttentionArgs<T> a = ForwardArgsOf(b);
  if (absl::Status s = ValidateAttentionBackwardArgs(b); !s.ok()) return s;
  if (absl::Status s = CheckEveryRowSeesAKey(a); !s.ok()) return s;
  const int tq = b.num_queries, tk = b.num_keys, dh = b.head_dim;
  const int hkv = b.num_kv_heads, group = b.num_heads / hkv;
  const int64_t qw = static_cast<int64_t>(b.num_heads) * dh, kvw = static_cast<int64_t>(hkv) * dh;
  for (int64_t e = 0; e < tq * qw; ++e) b.dq[e] = T(0);
  for (int64_t e = 0; e < tk * kvw; ++e) b.dk[e] = T(0);
  for (int64_t e = 0; e < tk * kvw; ++e) b.dv[e] = T(0);
  // dK and dV accumulate over query rows and over the query heads of a group: in double.
  std::vector<double> dk(tk * kvw, 0.0), dv(tk * kvw, 0.0);
  std::vector<double> da(tk), ds(tk);
  auto krow = [&](int j, int kvh) {  // ValidateAttentionBackwardArgs: the activation type
    return static_cast<const T*>(b.kv.k) + b.kv.PhysicalRow(j) * b.kv.row_stride +
           static_cast<int64_t>(kvh) * dh;
  };
  auto vrow = [&](int j, int kvh) {
    return static_cast<const T*>(b.kv.v) + b.kv.PhysicalRow(j) * b.kv.row_stride +
           static_cast<int64_t>(kvh) * dh;
  };
  for (int h = 0; h < b.num_heads; ++h) {
    const int kvh = h / group;
    for (int i = 0; i < tq; ++i) {
      const T* q = b.q + i * b.q_stride + static_cast<int64_t>(h) * dh;
      const T* g = b.dout + i * b.dout_stride + static_cast<int64_t>(h) * dh;
      const T* p = b.probs + (static_cast<int64_t>(h) * tq + i) * tk;
      // dA[j] = g · v_j on visible keys; dV[j] += A[j] g
      double mean = 0.0;  // rowsum(A ⊙ dA)
      const int end = CausalKeyEnd(a, i);
      std::fill(da.begin(), da.end(), 0.0);
      std::fill(ds.begin(), ds.end(), 0.0);
      for (int j = 0; j < end; ++j) {
        if (!KeyVisible(a, i, j)) continue;  // never read a masked key's rows
        const T* v = vrow(j, kvh);
        double dot = 0.0;
        for (int d = 0; d < dh; ++d) dot += static_cast<double>(g[d]) * v[d];
        da[j] = dot;
        mean += static_cast<double>(p[j]) * dot;
        double* dvj = dv.data() + j * kvw + static_cast<int64_t>(kvh) * dh;
        for (int d = 0; d < dh; ++d) dvj[d] += static_cast<double>(p[j]) * g[d];
      }
      // dS = A ⊙ (dA − rowsum); dQ = scale Σ_j dS[j] k_j; dK[j] += scale dS[j] q
      T* dq = b.dq + i * qw + static_cast<int64_t>(h) * dh;
      std::vector<double> dq_acc(dh, 0.0);
      for (int j = 0; j < end; ++j) {
        ds[j] = KeyVisible(a, i, j) ? static_cast<double>(p[j]) * (da[j] - mean) : 0.0;
        if (ds[j] == 0.0) continue;
        const T* k = krow(j, kvh);
        double dr = ds[j];  // through the cap: dS · (1 − tanh²(R / softcap))
        if (b.softcap > 0.0) {
          double dot = 0.0;
          for (int d = 0; d < dh; ++d) dot += static_cast<double>(q[d]) * k[d];
          const double t = std::tanh(b.scale * dot / b.softcap);
          dr *= 1.0 - t * t;
        }
        double* dkj = dk.data() + j * kvw + static_cast<int64_t>(kvh) * dh;
        for (int d = 0; d < dh; ++d) {
          dq_acc[d] += b.scale * dr * k[d];
          dkj[d] += b.scale * dr * q[d];
        }
      }
      for (int d = 0; d < dh; ++d) dq[d] = static_cast<T>(dq_acc[d]);
      const int64_t map = (static_cast<int64_t>(h) * tq + i) * tk;
      if (b.dprobs != nullptr) {
        for (int j = 0; j < tk; ++j) b.dprobs[map + j] = static_cast<T>(da[j]);
      }
      if (b.dscores != nullptr) {
        for (int j = 0; j < tk; ++j) b.dscores[map + j] = static_cast<T>(ds[j]);
      }
    }
  }
  for (int64_t e = 0; e < tk * kvw; ++e) {
    b.dk[e] = static_cast<T>(dk[e]);
    b.dv[e] = static_cast<T>(dv[e]);
  }
  return absl::OkStatus();
}

template <typename T>
void SoftmaxBackwardRow(const T* p, const T* dp, int n, T* ds) {
  double mean = 0.0;
  for (int j = 0; j < n; ++j) mean += static_cast<double>(p[j]) * dp[j];
  for (int j = 0; j < n; ++j) ds[j] = static_cast<T>(p[j] * (dp[j] - mean));
}

template <typename T>
void MatMulBackwardInput(const T* dy, int n, const WeightView& w, T* dx) {
  const int64_t in = w.cols, out = w.rows;
  std::vector<double> acc(static_cast<size_t>(n) * in, 0.0);
  std::vector<double> w_row(in);
  for (int64_t o = 0; o < out; ++o) {
    DequantizeRow(w, o, w_row.data());
    for (int r = 0; r < n; ++r) {
      const double g = dy[r * out + o];
      if (g == 0.0) continue;
      double* a = acc.data() + r * in;
      for (int64_t i = 0; i < in; ++i) a[i] += g * w_row[i];
    }
  }
  for (int64_t e = 0; e < n * in; ++e) dx[e] += static_cast<T>(acc[e]);
}

template <typename T>
void MatMulBackwardWeight(const T* dy, const T* x, int n, int64_t out, int64_t in, double* dw) {
  for (int r = 0; r < n; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      const double g = dy[r * out + o];
      if (g == 0.0) continue;
      for (int64_t i = 0; i < in; ++i) dw[o * in + i] += g * x[r * in + i];
    }
  }
}

template <typename T>
void RmsNormBackward(const T* x, int n, int dim, const WeightView& weight, double eps, const T* dy,
                     T* dx) {
  const std::vector<double> g = Row<T>(weight, 0);
  for (int r = 0; r < n; ++r) {
    const T* xr = x + static_cast<int64_t>(r) * dim;
    const T* dyr = dy + static_cast<int64_t>(r) * dim;
    double sum_sq = 0.0, dot = 0.0;
    for (int i = 0; i < dim; ++i) {
      sum_sq += static_cast<double>(xr[i]) * xr[i];
      dot += static_cast<double>(xr[i]) * g[i] * dyr[i];
    }
    const double inv_rms = 1.0 / std::sqrt(sum_sq / dim + eps);
    const double c = inv_rms * inv_rms * inv_rms * dot / dim;
    for (int i = 0; i < dim; ++i) {
      dx[static_cast<int64_t>(r) * dim + i] = static_cast<T>(inv_rms * g[i] * dyr[i] - xr[i] * c);
    }
  }
}

template <typename T>
void LayerNormBackward(const T* x, int n, int dim, const WeightView& weight, double eps,
                       const T* dy, T* dx) {
  const std::vector<double> g = Row<T>(weight, 0);
  std::vector<double> xhat(dim), u(dim);
  for (int r = 0; r < n; ++r) {
    const T* xr = x + static_cast<int64_t>(r) * dim;
    const T* dyr = dy + static_cast<int64_t>(r) * dim;
    double mean = 0.0;
    for (int i = 0; i < dim; ++i) mean += xr[i];
    mean /= dim;
    double var = 0.0;
    for (int i = 0; i < dim; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= dim;
    const double inv_std = 1.0 / std::sqrt(var + eps);
    double mean_u = 0.0, mean_ux = 0.0;
    for (int i = 0; i < dim; ++i) {
      xhat[i] = (xr[i] - mean) * inv_std;
      u[i] = g[i] * dyr[i];
      mean_u += u[i];
      mean_ux += u[i] * xhat[i];
    }
    mean_u /= dim;
    mean_ux /= dim;
    for (int i = 0; i < dim; ++i) {
      dx[static_cast<int64_t>(r) * dim + i] =
          static_cast<T>(inv_std * (u[i] - mean_u - xhat[i] * mean_ux));
    }
  }
}

template <typename T>
void RopeBackward(T* x, int n, int64_t row_stride, int num_heads, int head_dim,
                  const int32_t* positions, const RopeSpec& rope) {
  const int half = head_dim / 2;
  for (int r = 0; r < n; ++r) {
    for (int h = 0; h < num_heads; ++h) {
      T* head = x + r * row_stride + static_cast<int64_t>(h) * head_dim;
      for (int p = 0; p < half; ++p) {
        const double angle = positions[r] * rope.Frequency(p, head_dim);
        const double c = std::cos(angle), s = std::sin(angle);
        const int ia = rope.style == RopeStyle::kAdjacentPairs ? 2 * p : p;
        const int ib = rope.style == RopeStyle::kAdjacentPairs ? 2 * p + 1 : p + half;
        const double ga = head[ia], gb = head[ib];
        // Rᵀ(θ) = R(−θ)
        head[ia] = static_cast<T>(ga * c + gb * s);
        head[ib] = static_cast<T>(-ga * s + gb * c);
      }
    }
  }
}

template <typename T>
void GeluBackward(const T* x, const T* dy, int64_t count, T* dx) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  for (int64_t i = 0; i < count; ++i) {
    const double v = x[i];
    const double t = std::tanh(k * (v + 0.044715 * v * v * v));
    const double d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * v * v);
    dx[i] = static_cast<T>(dy[i] * d);
  }
}

template <typename T>
void SwiGluBackward(const T* gate, const T* up, const T* dout, int64_t count, T* dgate, T* dup) {
  for (int64_t i = 0; i < count; ++i) {
    const double g = gate[i];
    const double sig = 1.0 / (1.0 + std::exp(-g));
    dgate[i] = static_cast<T>(dout[i] * static_cast<double>(up[i]) * sig * (1.0 + g * (1.0 - sig)));
    dup[i] = static_cast<T>(dout[i] * g * sig);
  }
}

template <typename T>
void GeGluBackward(const T* gate, const T* up, const T* dout, int64_t count, T* dgate, T* dup) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  for (int64_t i = 0; i < count; ++i) {
    const double g = gate[i];
    const double t = std::tanh(k * (g + 0.044715 * g * g * g));
    const double d = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g);
    dgate[i] = static_cast<T>(dout[i] * static_cast<double>(up[i]) * d);
    dup[i] = static_cast<T>(dout[i] * 0.5 * g * (1.0 + t));
  }
}

#define KVLENS_INSTANTIATE_BACKWARD(T)                                                             \
  template absl::Status AttentionBackward<T>(const AttentionBackwardArgs<T>&);                     \
  template void SoftmaxBackwardRow<T>(const T*, const T*, int, T*);                                \
  template void MatMulBackwardInput<T>(const T*, int, const WeightView&, T*);                      \
  template void MatMulBackwardWeight<T>(const T*, const T*, int, int64_t, int64_t, double*);       \
  template void RmsNormBackward<T>(const T*, int, int, const WeightView&, double, const T*, T*);   \
  template void LayerNormBackward<T>(const T*, int, int, const WeightView&, double, const T*, T*); \
  template void RopeBackward<T>(T*, int, int64_t, int, int, const int32_t*, const RopeSpec&);      \
  template void GeluBackward<T>(const T*, const T*, int64_t, T*);                                  \
  template void SwiGluBackward<T>(const T*, const T*, const T*, int64_t, T*, T*);                  \
  template void GeGluBackward<T>(const T*, const T*, const T*, int64_t, T*, T*);

KVLENS_INSTANTIATE_BACKWARD(float)
KVLENS_INSTANTIATE_BACKWARD(double)
#undef KVLENS_INSTANTIATE_BACKWARD

}  // namespace kvlens::kernels
