// Reverse-mode counterparts of the Backend ops, as naive loops (the oracle for any faster
// backward later). Each `XBackward` takes the same arguments as its forward op in the same
// order, plus the upstream gradient, and returns the gradient of its inputs. T is double
// (the reference) or float (served probes); every reduction accumulates in double.
//
// Legend as in kernels/backend.h: N rows, D width, H query heads, Hkv KV heads, Dh head
// size, Tq queries, Tk keys, F feed-forward width.
//
// Attention backward: the maths and the arguments are in kernels/attention_backward.h.
#ifndef KVLENS_KERNELS_CPU_REFERENCE_BACKWARD_H_
#define KVLENS_KERNELS_CPU_REFERENCE_BACKWARD_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/attention_backward.h"
#include "kernels/backend.h"
#include "kernels/weight.h"

namespace kvlens::kernels {

// INVALID_ARGUMENT naming the field for bad shapes or missing pointers.
template <typename T>
absl::Status AttentionBackward(const AttentionBackwardArgs<T>& args);

// One softmax row: ds = p ⊙ (dp − Σ_j p_j dp_j). n values each.
template <typename T>
void SoftmaxBackwardRow(const T* p, const T* dp, int n, T* ds);

// dx[N, in] += dy[N, out] · W   (W is [out, in]: the backward of y = x · Wᵀ + b).
template <typename T>
void MatMulBackwardInput(const T* dy, int n, const WeightView& w, T* dx);
// dw[out, in] += dyᵀ · x (double, dense): the weight gradient of y = x · Wᵀ.
template <typename T>
void MatMulBackwardWeight(const T* dy, const T* x, int n, int64_t out, int64_t in, double* dw);

// dx[N, D] = RMSNorm backward at x (y = x · r ⊙ g, r = (mean(x²) + eps)^−½):
//   dx = r (g ⊙ dy) − x r³/D · Σ x ⊙ g ⊙ dy
template <typename T>
void RmsNormBackward(const T* x, int n, int dim, const WeightView& weight, double eps, const T* dy,
                     T* dx);
// dx[N, D] = LayerNorm backward (x̂ = (x − μ) r, y = x̂ ⊙ g + b, u = g ⊙ dy):
//   dx = r (u − mean(u) − x̂ · mean(u ⊙ x̂))
template <typename T>
void LayerNormBackward(const T* x, int n, int dim, const WeightView& weight, double eps,
                       const T* dy, T* dx);
// In place on g[N, heads, Dh]: the transpose of Rope's rotation, i.e. the inverse rotation
// (each pair turns by −angle). Same arguments as Backend::Rope.
template <typename T>
void RopeBackward(T* g, int n, int64_t row_stride, int num_heads, int head_dim,
                  const int32_t* positions, const RopeSpec& rope);
// dx = dy · GELU'(x) (tanh approximation), x the pre-activation. count values.
template <typename T>
void GeluBackward(const T* x, const T* dy, int64_t count, T* dx);
// out = silu(gate) ⊙ up:  dgate = dout ⊙ up ⊙ σ(g)(1 + g(1 − σ(g))),  dup = dout ⊙ silu(g).
template <typename T>
void SwiGluBackward(const T* gate, const T* up, const T* dout, int64_t count, T* dgate, T* dup);
// out = GELU(gate) ⊙ up (tanh approximation):  dgate = dout ⊙ up ⊙ GELU'(g),
// dup = dout ⊙ GELU(g).
template <typename T>
void GeGluBackward(const T* gate, const T* up, const T* dout, int64_t count, T* dgate, T* dup);

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_REFERENCE_BACKWARD_H_
