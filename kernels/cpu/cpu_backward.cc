// CpuBackend's BackwardOps (kernels/backward_ops.h): the interpretability backward's two
// heavy ops in fp32 on the thread pool, with this machine's vector width (compiled
// -march=native where allowed, as cpu_backend.cc); the input gradients of many rows
// through the forward's MatMul on W transposed. The reference loops
// (kernels/cpu/reference_backward.h) accumulate in double on one thread and stay the
// oracle; these accumulate in float (FMA where the machine has it) and are checked against
// them within fp32 rounding.
#include <algorithm>
#include <vector>

#include "kernels/attention_check.h"
#include "kernels/cpu/cpu_backend.h"

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

// Σ a[d] · b[d], in 8 interleaved partial sums (so the loop vectorizes), then added.
inline float Dot(const float* __restrict a, const float* __restrict b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int l = 0; l < 8; ++l) s[l] += a[d + l] * b[d + l];
  }
  for (; d < n; ++d) s[0] += a[d] * b[d];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
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
    constexpr int64_t kWidth = 256;  // a multiple of q8_0's 32-element blocks
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
  // the product: a task per panel of kWidth columns of W (every row of W decoded once
  // into a float panel), then kRows rows of dy at a time over it, their accumulators in
  // L1; each task owns its columns of dx.
  constexpr int64_t kWidth = 128;  // a multiple of q8_0's 32-element blocks
  constexpr int kRows = 16;
  const int64_t panels = (in + kWidth - 1) / kWidth;
  ForEachTask(*pool_, panels, n * out * in, [&](int64_t p) {
    const int64_t c0 = p * kWidth, width = std::min(kWidth, in - c0);
    thread_local std::vector<float> panel;
    panel.resize(static_cast<size_t>(out * width));
    for (int64_t o = 0; o < out; ++o) {
      const WeightView columns{w.row(o) + DTypeRowBytes(w.dtype, c0), w.dtype, 1, width};
      DequantizeRow(columns, 0, panel.data() + o * width);
    }
    alignas(64) float acc[kRows * kWidth];
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
  // A task per KV head: the query heads of its group, every row; dK and dV of that head
  // accumulate in the task's own [Tk, Dh] arrays (no other task writes them), dQ and the
  // maps' rows of its heads are its own too.
  const int64_t work = int64_t{tq} * tk * dh * b.num_heads;
  ForEachTask(*pool_, hkv, work, [&](int64_t task) {
    const int kvh = static_cast<int>(task);
    thread_local std::vector<float> dk, dv, da, ds, dq;
    dk.assign(static_cast<size_t>(tk) * dh, 0.0f);
    dv.assign(dk.size(), 0.0f);
    da.resize(static_cast<size_t>(tk));
    ds.resize(static_cast<size_t>(tk));
    dq.resize(static_cast<size_t>(dh));
    auto row = [&](const void* base, int j) {  // (validated: the activation type)
      return static_cast<const float*>(base) + b.kv.PhysicalRow(j) * b.kv.row_stride +
             static_cast<int64_t>(kvh) * dh;
    };
    const float scale = static_cast<float>(b.scale);
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
      for (int i = 0; i < tq; ++i) {
        const float* q = b.q + i * b.q_stride + static_cast<int64_t>(h) * dh;
        const float* g = b.dout + i * b.dout_stride + static_cast<int64_t>(h) * dh;
        const float* p = b.probs + (static_cast<int64_t>(h) * tq + i) * tk;
        const int end = CausalKeyEnd(a, i);
        std::fill(da.begin(), da.end(), 0.0f);
        std::fill(ds.begin(), ds.end(), 0.0f);
        // dA[j] = g · v_j on visible keys; dV[j] += A[j] g; mean = rowsum(A ⊙ dA)
        float mean = 0.0f;
        for (int j = 0; j < end; ++j) {
          if (!KeyVisible(a, i, j)) continue;  // never read a masked key's rows
          da[j] = Dot(g, row(b.kv.v, j), dh);
          mean += p[j] * da[j];
          Axpy(dv.data() + static_cast<int64_t>(j) * dh, p[j], g, dh);
        }
        // dS = A ⊙ (dA − mean); dQ = scale Σ_j dS[j] k_j; dK[j] += scale dS[j] q
        std::fill(dq.begin(), dq.end(), 0.0f);
        for (int j = 0; j < end; ++j) {
          ds[j] = KeyVisible(a, i, j) ? p[j] * (da[j] - mean) : 0.0f;
          if (ds[j] == 0.0f) continue;
          const float c = scale * ds[j];
          Axpy(dq.data(), c, row(b.kv.k, j), dh);
          Axpy(dk.data() + static_cast<int64_t>(j) * dh, c, q, dh);
        }
        std::copy(dq.begin(), dq.end(), b.dq + i * qw + static_cast<int64_t>(h) * dh);
        const int64_t map = (static_cast<int64_t>(h) * tq + i) * tk;
        if (b.dprobs != nullptr) std::copy(da.begin(), da.end(), b.dprobs + map);
        if (b.dscores != nullptr) std::copy(ds.begin(), ds.end(), b.dscores + map);
      }
    }
    for (int j = 0; j < tk; ++j) {
      const int64_t at = static_cast<int64_t>(j) * kvw + static_cast<int64_t>(kvh) * dh;
      std::copy_n(dk.data() + static_cast<int64_t>(j) * dh, dh, b.dk + at);
      std::copy_n(dv.data() + static_cast<int64_t>(j) * dh, dh, b.dv + at);
    }
  });
  return absl::OkStatus();
}

}  // namespace kvlens::kernels
