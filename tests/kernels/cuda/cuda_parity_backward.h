// Parity cases of the attention backward (cuda_parity.h).
#ifndef KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_BACKWARD_H_
#define KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_BACKWARD_H_

#include <random>
#include <string>
#include <vector>

#include "tests/kernels/cuda/cuda_parity_attention.h"
#include "tests/kernels/cuda/cuda_parity_util.h"

namespace kvlens::kernels::cuda::parity {

// ---------------------------------------------------------------------------------------
// Attention backward: CudaBackend::AttentionBackward against the double reference's
// AttentionBackward (kernels/cpu/reference_backward.h), given the reference forward's
// probabilities rounded to fp32. The naive run is the same maths in fp32 on the host.

struct BackwardGrads {
  std::vector<double> dq, dk, dv, dprobs, dscores;
};

inline BackwardGrads NaiveAttentionBackward(const AttnShape& s, const AttnInputs& in,
                                            const std::vector<double>& probs,
                                            const std::vector<double>& g) {
  const int group = s.heads / s.kv_heads;
  BackwardGrads r;
  r.dq.assign(size_t(s.tq) * in.q_width, 0.0);
  r.dprobs.assign(size_t(s.heads) * s.tq * s.tk, 0.0);
  r.dscores = r.dprobs;
  std::vector<float> dk(size_t(s.tk) * in.kv_width, 0.0f), dv(dk.size(), 0.0f);
  const float scale = static_cast<float>(in.scale);
  for (int h = 0; h < s.heads; ++h) {
    const int kv = h / group;
    for (int i = 0; i < s.tq; ++i) {
      const size_t qrow = (size_t(i) * s.heads + h) * s.dh, map = (size_t(h) * s.tq + i) * s.tk;
      std::vector<float> da(s.tk, 0.0f);
      std::vector<bool> vis(s.tk);
      float mean = 0.0f;
      for (int j = 0; j < s.tk; ++j) {
        vis[j] = NaiveSees(s, in.docs, i, j);
        if (!vis[j]) continue;
        const size_t krow = (size_t(j) * s.kv_heads + kv) * s.dh;
        for (int d = 0; d < s.dh; ++d) {
          da[j] += static_cast<float>(g[qrow + d]) * static_cast<float>(in.v[krow + d]);
        }
        mean += static_cast<float>(probs[map + j]) * da[j];
      }
      std::vector<float> dq(s.dh, 0.0f);
      for (int j = 0; j < s.tk; ++j) {
        if (!vis[j]) continue;
        const float a = static_cast<float>(probs[map + j]);
        const float ds = a * (da[j] - mean);
        r.dprobs[map + j] = da[j];
        r.dscores[map + j] = ds;
        const size_t krow = (size_t(j) * s.kv_heads + kv) * s.dh;
        float dr = ds;  // through a soft-cap: dS (1 − tanh²(scale q·k / cap))
        if (s.softcap > 0.0) {
          float dot = 0.0f;
          for (int d = 0; d < s.dh; ++d) {
            dot += static_cast<float>(in.q[qrow + d]) * static_cast<float>(in.k[krow + d]);
          }
          const float t = std::tanh(dot * scale / static_cast<float>(s.softcap));
          dr = ds * (1.0f - t * t);
        }
        for (int d = 0; d < s.dh; ++d) {
          dq[d] += dr * static_cast<float>(in.k[krow + d]);
          dk[krow + d] += scale * dr * static_cast<float>(in.q[qrow + d]);
          dv[krow + d] += a * static_cast<float>(g[qrow + d]);
        }
      }
      for (int d = 0; d < s.dh; ++d) r.dq[qrow + d] = scale * dq[d];
    }
  }
  r.dk.assign(dk.begin(), dk.end());
  r.dv.assign(dv.begin(), dv.end());
  return r;
}

inline std::vector<ParityResult> AttentionBackwardCase(CudaBackend& gpu, std::mt19937_64& rng,
                                                       const AttnShape& s) {
  const std::string name = ShapeName("AttentionBackward", s);
  const AttnInputs in = MakeAttnInputs(s, rng);
  const std::vector<double> g =
      kernels::testing::RandomFloatExact(rng, size_t(s.tq) * in.q_width, -1, 1);
  std::vector<double> gs(size_t(s.tq) * in.q_stride, kNaN);  // rows padded like q
  for (int i = 0; i < s.tq; ++i)
    std::copy_n(g.begin() + i * in.q_width, in.q_width, gs.begin() + i * in.q_stride);
  const size_t map_size = size_t(s.heads) * s.tq * s.tk;
  const size_t q_size = size_t(s.tq) * in.q_width, kv_size = size_t(s.tk) * in.kv_width;

  // Reference forward for the probabilities, then the reference backward (double).
  std::vector<double> out(size_t(s.tq) * in.q_stride, kNaN), probs(map_size);
  AttentionArgs<double> fa;
  fa.q = in.qs.data();
  fa.q_stride = in.q_stride;
  fa.num_queries = s.tq;
  fa.num_keys = s.tk;
  fa.num_heads = s.heads;
  fa.num_kv_heads = s.kv_heads;
  fa.head_dim = s.dh;
  fa.query_offset = s.offset;
  fa.causal = s.causal;
  fa.window = s.window;
  fa.scale = in.scale;
  fa.softcap = s.softcap;
  if (!in.docs.empty()) {
    fa.q_doc_ids = in.q_docs.data();
    fa.k_doc_ids = in.docs.data();
  }
  fa.kv = KvSource<double>{in.kc.data(), in.vc.data(), in.kv_stride, in.table.data(), s.block_size};
  fa.out = out.data();
  fa.out_stride = in.q_stride;
  fa.probs = probs.data();
  if (absl::Status st = ReferenceBackend().Attention(fa); !st.ok()) return {Failed(name, st)};
  for (double& p : probs) p = static_cast<float>(p);  // what the GPU is given

  BackwardGrads want;
  want.dq.resize(q_size);
  want.dk.resize(kv_size);
  want.dv.resize(kv_size);
  want.dprobs.resize(map_size);
  want.dscores.resize(map_size);
  AttentionBackwardArgs<double> rb = BackwardArgsOf(fa);  // probs: the rounded ones
  rb.dout = gs.data();
  rb.dout_stride = in.q_stride;
  rb.dq = want.dq.data();
  rb.dk = want.dk.data();
  rb.dv = want.dv.data();
  rb.dprobs = want.dprobs.data();
  rb.dscores = want.dscores.data();
  if (absl::Status st = AttentionBackward(rb); !st.ok()) return {Failed(name, st)};

  // The GPU, every output NaN-filled first.
  auto dq_in = ToDevice(in.qs);
  auto dkc = ToDevice(in.kc);
  auto dvc = ToDevice(in.vc);
  auto dprobs_in = ToDevice(probs);
  auto dg = ToDevice(gs);
  auto ddq = ToDevice(std::vector<double>(q_size, kNaN));
  auto ddk = ToDevice(std::vector<double>(kv_size, kNaN));
  auto ddv = ToDevice(std::vector<double>(kv_size, kNaN));
  auto dda = ToDevice(std::vector<double>(map_size, kNaN));
  auto dds = ToDevice(std::vector<double>(map_size, kNaN));
  for (const auto* b : {&dq_in, &dkc, &dvc, &dprobs_in, &dg, &ddq, &ddk, &ddv, &dda, &dds}) {
    if (!b->ok()) return {Failed(name, b->status())};
  }
  AttentionBackwardArgs<float> b;
  b.q = dq_in->as<float>();
  b.q_stride = in.q_stride;
  b.num_queries = s.tq;
  b.num_keys = s.tk;
  b.num_heads = s.heads;
  b.num_kv_heads = s.kv_heads;
  b.head_dim = s.dh;
  b.query_offset = s.offset;
  b.causal = s.causal;
  b.window = s.window;
  b.scale = in.scale;
  b.softcap = s.softcap;
  b.q_doc_ids = fa.q_doc_ids;
  b.k_doc_ids = fa.k_doc_ids;
  b.kv = KvSource<float>{dkc->as<float>(), dvc->as<float>(), in.kv_stride, in.table.data(),
                         s.block_size};
  b.probs = dprobs_in->as<float>();
  b.dout = dg->as<float>();
  b.dout_stride = in.q_stride;
  b.dq = ddq->as<float>();
  b.dk = ddk->as<float>();
  b.dv = ddv->as<float>();
  b.dprobs = dda->as<float>();
  b.dscores = dds->as<float>();
  if (absl::Status st = gpu.AttentionBackward(b); !st.ok()) return {Failed(name, st)};

  const BackwardGrads naive = NaiveAttentionBackward(s, in, probs, g);
  std::vector<ParityResult> results;
  const std::pair<const char*, const DeviceBuffer*> parts[] = {
      {"dQ", &*ddq}, {"dK", &*ddk}, {"dV", &*ddv}, {"dA", &*dda}, {"dS", &*dds}};
  const std::vector<double>* wants[] = {&want.dq, &want.dk, &want.dv, &want.dprobs, &want.dscores};
  const std::vector<double>* naives[] = {&naive.dq, &naive.dk, &naive.dv, &naive.dprobs,
                                         &naive.dscores};
  for (int t = 0; t < 5; ++t) {
    auto got = FromDevice(gpu, *parts[t].second, wants[t]->size());
    if (!got.ok()) return {Failed(name, got.status())};
    results.push_back(Judge(absl::StrCat(name, " ", parts[t].first), *got, *naives[t], *wants[t]));
  }
  return results;
}

inline std::vector<AttnShape> AttentionBackwardShapes() {
  return {
      {.label = "causal docs offset GQA 8/4",
       .tq = 20,
       .tk = 60,
       .heads = 8,
       .kv_heads = 4,
       .dh = 64,
       .offset = 40,
       .doc_lengths = {35, 25},
       .block_size = 8},
      {.label = "non-causal GQA 2/1",
       .tq = 33,
       .tk = 33,
       .heads = 2,
       .kv_heads = 1,
       .dh = 128,
       .causal = false},
      {.label = "decode head size 80",
       .tq = 1,
       .tk = 300,
       .heads = 4,
       .kv_heads = 2,
       .dh = 80,
       .offset = 299},
      {.label = "chunk head size 32",
       .tq = 7,
       .tk = 50,
       .heads = 6,
       .kv_heads = 6,
       .dh = 32,
       .offset = 43},
      {.label = "sliding window 9 docs offset GQA 4/1",  // dA is 0 outside the window
       .tq = 16,
       .tk = 40,
       .heads = 4,
       .kv_heads = 1,
       .dh = 64,
       .offset = 24,
       .doc_lengths = {30, 10},
       .window = 9},
      {.label = "softcap 1 offset GQA 4/2",  // Gemma 2's: dS through the cap for dQ, dK
       .tq = 12,
       .tk = 30,
       .heads = 4,
       .kv_heads = 2,
       .dh = 64,
       .offset = 18,
       .softcap = 1.0},
  };
}

}  // namespace kvlens::kernels::cuda::parity

#endif  // KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_BACKWARD_H_
