// Backward over a Tape: the reverse of RunForward, layer by layer (see tape.h).
//
//   dlogits ─ W_outᵀ ─ final-norm' ─▶ dx_L
//   for l = L−1 … 0:                  (Gemma 2, 3: each block's output norm' first)
//     dx_{l+1} ─┬─ W_out' ─ act' ─ W_in'/W_up' ─ ffn-norm' ─┐
//               └──────────────────────────────────────── + ─▶ dh
//     dh ─┬─ W_O' ─▶ dO ─ attention' ─▶ dQ, dK, dV ─ RoPE' ─ head norms' ─ W_Q'/W_K'/W_V' ┐
//         │                                                     (Qwen3)                 │
//         └──────────────────────────────────────────────────── + ◀── attn-norm' ◀──────┘ ─▶ dx_l
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/interpret/tape.h"
#include "kernels/cpu/reference_backward.h"

namespace kvlens::interpret {
namespace {

using kernels::WeightView;

template <typename T>
void NormBackward(const ModelConfig& c, const WeightView& w, const T* x, int n, const T* dy,
                  T* dx) {
  if (c.arch == Architecture::kLlama) {
    kernels::RmsNormBackward(x, n, c.dim, w, c.norm_eps, dy, dx);
  } else {
    kernels::LayerNormBackward(x, n, c.dim, w, c.norm_eps, dy, dx);
  }
}

}  // namespace

template <typename T>
absl::StatusOr<Gradients<T>> Backward(const Model& model, const Tape<T>& t, const Seed<T>& seed,
                                      const BackwardOptions& opt, kernels::BackwardOps<T>* ops) {
  // dx += dy · W and the attention backward: on `ops`, or the reference loops here.
  auto matmul_dx = [ops](const T* dy, int rows, const WeightView& wv, T* out) {
    if (ops != nullptr) return ops->MatMulBackwardInput(dy, rows, wv, out);
    kernels::MatMulBackwardInput(dy, rows, wv, out);
    return absl::OkStatus();
  };
  const ModelConfig& c = model.config;
  const Weights& w = model.weights;
  if (t.edited) {
    return absl::FailedPreconditionError("backward needs a tape recorded without edits");
  }
  const int n = t.n, tk = t.num_keys, L = c.num_layers, off = t.input.offset;
  const int64_t D = c.dim, QD = c.q_dim(), KVD = c.kv_dim(), F = c.hidden_dim, V = c.vocab_size;
  if (!seed.dlogits.empty() && static_cast<int64_t>(seed.dlogits.size()) != n * V) {
    return absl::InvalidArgumentError(
        absl::StrCat("seed dlogits has ", seed.dlogits.size(), " values, expected ", n * V));
  }
  if (!seed.probe_dout.empty()) {
    if (seed.probe_layer < 0 || seed.probe_layer >= L) {
      return absl::InvalidArgumentError(
          absl::StrCat("probe layer ", seed.probe_layer, " outside [0, ", L, ")"));
    }
    if (static_cast<int64_t>(seed.probe_dout.size()) != n * QD) {
      return absl::InvalidArgumentError(absl::StrCat("seed probe_dout has ", seed.probe_dout.size(),
                                                     " values, expected ", n * QD));
    }
  }
  if (opt.param_layer < -1 || opt.param_layer >= L) {
    return absl::InvalidArgumentError(
        absl::StrCat("param_layer ", opt.param_layer, " outside [-1, ", L, ")"));
  }

  std::vector<bool> keep_ffn(L, false);
  for (size_t k = 0; k < opt.ffn_layers.size(); ++k) {
    const int l = opt.ffn_layers[k];
    if (l < 0 || l >= L || keep_ffn[l]) {
      return absl::InvalidArgumentError(
          absl::StrCat("ffn_layers[", k, "] = ", l,
                       l < 0 || l >= L ? absl::StrCat(" outside [0, ", L, ")") : " twice"));
    }
    keep_ffn[l] = true;
  }

  Gradients<T> g;
  for (auto* v : {&g.scores, &g.probs, &g.q, &g.k, &g.v, &g.attn_out, &g.resid_mid}) v->resize(L);
  g.residual.resize(L + 1);
  if (!opt.ffn_layers.empty()) {
    for (auto* v : {&g.mlp_pre, &g.mlp_post, &g.mlp_pre_linear}) v->resize(L);
  }

  // classifier and final norm
  std::vector<T> dx(n * D, T(0));
  if (!seed.dlogits.empty()) {
    std::vector<T> dxf(n * D, T(0));
    const T* dlogits = seed.dlogits.data();
    std::vector<T> draw;  // through a final soft-cap: dl · (1 − (logit / cap)²)
    if (c.final_softcap > 0.0) {
      draw.resize(seed.dlogits.size());
      for (size_t e = 0; e < draw.size(); ++e) {
        const double u = static_cast<double>(t.logits[e]) / c.final_softcap;
        draw[e] = static_cast<T>(seed.dlogits[e] * (1.0 - u * u));
      }
      dlogits = draw.data();
    }
    if (absl::Status s = matmul_dx(dlogits, n, w.output, dxf.data()); !s.ok()) return s;
    NormBackward(c, w.final_norm, t.x_final.data(), n, dxf.data(), dx.data());
    g.ln_final = std::move(dxf);
  } else {
    g.ln_final.assign(n * D, T(0));  // a probe's seed on O: nothing flows through the logits
  }
  g.residual[L] = dx;

  std::vector<T> dact(n * F), dpre(n * F), dup(n * F), dhn(n * D), dh(n * D), tmp(n * D);
  std::vector<T> dsandwich(c.sandwich_norms ? n * D : 0), dproj(c.sandwich_norms ? n * D : 0);
  for (int l = L - 1; l >= 0; --l) {
    const LayerWeights& lw = w.layers[l];
    const LayerTape<T>& lt = t.layers[l];
    // feed-forward: dx flows to dh directly and through the FFN (and its norm)
    const T* dffn = dx.data();
    if (c.sandwich_norms) {
      kernels::RmsNormBackward(lt.ffn_out.data(), n, c.dim, lw.post_ffn_norm, c.norm_eps, dx.data(),
                               dsandwich.data());
      dffn = dsandwich.data();
    }
    std::fill(dact.begin(), dact.end(), T(0));
    if (absl::Status s = matmul_dx(dffn, n, lw.w_out, dact.data()); !s.ok()) return s;
    std::fill(dhn.begin(), dhn.end(), T(0));
    if (c.arch == Architecture::kLlama) {
      (c.gate_activation == GateActivation::kGeluTanh
           ? kernels::GeGluBackward<T>
           : kernels::SwiGluBackward<T>)(lt.pre.data(), lt.up.data(), dact.data(), n * F,
                                         dpre.data(), dup.data());
      if (absl::Status s = matmul_dx(dup.data(), n, lw.w_up, dhn.data()); !s.ok()) return s;
    } else {
      kernels::GeluBackward(lt.pre.data(), dact.data(), n * F, dpre.data());
    }
    if (absl::Status s = matmul_dx(dpre.data(), n, lw.w_in, dhn.data()); !s.ok()) return s;
    if (keep_ffn[l]) {  // handed over; the next layer's start from fresh buffers
      g.mlp_post[l] = std::exchange(dact, std::vector<T>(n * F));
      g.mlp_pre[l] = std::exchange(dpre, std::vector<T>(n * F));
      if (c.arch == Architecture::kLlama)
        g.mlp_pre_linear[l] = std::exchange(dup, std::vector<T>(n * F));
    }
    NormBackward(c, lw.ffn_norm, lt.h.data(), n, dhn.data(), tmp.data());
    for (int64_t e = 0; e < n * D; ++e) dh[e] = dx[e] + tmp[e];
    g.resid_mid[l] = dh;

    // output projection (and its norm; plus a probe's seed on O)
    const T* dattn_proj = dh.data();
    if (c.sandwich_norms) {
      kernels::RmsNormBackward(lt.attn_proj.data(), n, c.dim, lw.post_attn_norm, c.norm_eps,
                               dh.data(), dproj.data());
      dattn_proj = dproj.data();
    }
    std::vector<T>& datt = g.attn_out[l];
    datt.assign(n * QD, T(0));
    if (absl::Status s = matmul_dx(dattn_proj, n, lw.wo, datt.data()); !s.ok()) return s;
    if (!seed.probe_dout.empty() && seed.probe_layer == l) {
      for (int64_t e = 0; e < n * QD; ++e) datt[e] += seed.probe_dout[e];
    }

    // attention
    g.q[l].resize(n * QD);
    g.k[l].resize(tk * KVD);
    g.v[l].resize(tk * KVD);
    g.scores[l].resize(int64_t{c.num_heads} * n * tk);
    g.probs[l].resize(int64_t{c.num_heads} * n * tk);
    kernels::AttentionBackwardArgs<T> a;
    a.q = lt.q.data();
    a.q_stride = QD;
    a.num_queries = n;
    a.num_keys = tk;
    a.num_heads = c.num_heads;
    a.num_kv_heads = c.num_kv_heads;
    a.head_dim = c.head_dim;
    a.query_offset = off;
    a.causal = true;
    a.window = c.WindowOf(l);
    a.scale = c.AttentionScale();
    a.softcap = c.attention_softcap;
    if (!t.input.doc_ids.empty()) {
      a.q_doc_ids = t.input.doc_ids.data() + off;
      a.k_doc_ids = t.input.doc_ids.data();
    }
    a.kv.k = lt.k.data();
    a.kv.v = lt.v.data();
    a.kv.row_stride = KVD;
    a.probs = lt.probs.data();
    a.dout = datt.data();
    a.dout_stride = QD;
    a.dq = g.q[l].data();
    a.dk = g.k[l].data();
    a.dv = g.v[l].data();
    a.dprobs = g.probs[l].data();
    a.dscores = g.scores[l].data();
    if (absl::Status s = ops != nullptr ? ops->AttentionBackward(a) : kernels::AttentionBackward(a);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("layer ", l, ": ", s.message()));
    }

    // back through RoPE to the projections of the new tokens; leaf K/V rows stop here
    std::vector<T> dq = g.q[l];
    std::vector<T> dk(g.k[l].begin() + off * KVD, g.k[l].end());
    std::vector<T> dv(g.v[l].begin() + off * KVD, g.v[l].end());
    for (int i = 0; i < n && off + i < opt.kv_leaf_end; ++i) {
      std::fill_n(dk.begin() + i * KVD, KVD, T(0));
      std::fill_n(dv.begin() + i * KVD, KVD, T(0));
    }
    if (c.arch == Architecture::kLlama) {
      const kernels::RopeSpec rope = RopeOf(c, w, l);
      kernels::RopeBackward(dq.data(), n, QD, c.num_heads, c.head_dim, t.positions.data(), rope);
      kernels::RopeBackward(dk.data(), n, KVD, c.num_kv_heads, c.head_dim, t.positions.data(),
                            rope);
    }
    if (c.qk_norm) {  // back through the per-head norms to W_Q·xn and W_K·xn
      std::vector<T> d_pre(dq.size());
      kernels::RmsNormBackward(lt.q_pre.data(), n * c.num_heads, c.head_dim, lw.q_norm, c.norm_eps,
                               dq.data(), d_pre.data());
      dq.swap(d_pre);
      d_pre.resize(dk.size());
      kernels::RmsNormBackward(lt.k_pre.data(), n * c.num_kv_heads, c.head_dim, lw.k_norm,
                               c.norm_eps, dk.data(), d_pre.data());
      dk.swap(d_pre);
    }
    std::fill(dhn.begin(), dhn.end(), T(0));
    if (absl::Status s = matmul_dx(dq.data(), n, lw.wq, dhn.data()); !s.ok()) return s;
    if (absl::Status s = matmul_dx(dk.data(), n, lw.wk, dhn.data()); !s.ok()) return s;
    if (absl::Status s = matmul_dx(dv.data(), n, lw.wv, dhn.data()); !s.ok()) return s;
    if (opt.param_layer == l) {
      ParamGradients& p = g.params;
      p.layer = l;
      p.wq.assign(QD * D, 0.0);
      p.wk.assign(KVD * D, 0.0);
      p.wv.assign(KVD * D, 0.0);
      p.wo.assign(D * QD, 0.0);
      kernels::MatMulBackwardWeight(dq.data(), lt.xn.data(), n, QD, D, p.wq.data());
      kernels::MatMulBackwardWeight(dk.data(), lt.xn.data(), n, KVD, D, p.wk.data());
      kernels::MatMulBackwardWeight(dv.data(), lt.xn.data(), n, KVD, D, p.wv.data());
      kernels::MatMulBackwardWeight(dattn_proj, lt.att.data(), n, D, QD, p.wo.data());
    }
    NormBackward(c, lw.attn_norm, lt.x.data(), n, dhn.data(), tmp.data());
    for (int64_t e = 0; e < n * D; ++e) dx[e] = dh[e] + tmp[e];
    g.residual[l] = dx;
  }
  return g;
}

template absl::StatusOr<Gradients<float>> Backward<float>(const Model&, const Tape<float>&,
                                                          const Seed<float>&,
                                                          const BackwardOptions&,
                                                          kernels::BackwardOps<float>*);
template absl::StatusOr<Gradients<double>> Backward<double>(const Model&, const Tape<double>&,
                                                            const Seed<double>&,
                                                            const BackwardOptions&,
                                                            kernels::BackwardOps<double>*);

}  // namespace kvlens::interpret
