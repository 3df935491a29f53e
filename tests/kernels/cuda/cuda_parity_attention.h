// Parity cases of the attention forward (cuda_parity.h): one call per shape over a paged,
// NaN-filled cache, and AttentionBatch over several sequences. One file of about 900
// lines: a third of it is the table of shapes (AttentionShapes), which the cases, the naive
// runs and the tests that rerun the table under each kernel option read together.
#ifndef KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_ATTENTION_H_
#define KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_ATTENTION_H_

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "tests/kernels/cuda/cuda_parity_util.h"

namespace kvlens::kernels::cuda::parity {

// ---------------------------------------------------------------------------------------
// Attention over a paged, NaN-filled cache with a shuffled block table.

struct AttnShape {
  std::string label;
  int tq = 1, tk = 1, heads = 1, kv_heads = 1, dh = 64, offset = 0;
  bool causal = true;
  std::vector<int> doc_lengths;  // documents packed in order over the Tk keys; empty: none
  int window = 0;                // a sliding window (each row sees its last `window` keys)
  int block_size = 16;
  int kv_pad = 4;          // floats past a cache row's heads (not a multiple of 4: scalar loads)
  bool want_maps = false;  // request probs and scores (materialising kernel)
  bool want_probs_only = false;
  bool bf16_cache = false;  // K and V stored in bf16 (the reference reads the rounded values)
  double softcap = 0.0;     // Gemma 2's soft-capped scores (cap · tanh(s / cap)); 0: none
  double scale = 0.0;       // the scores' scale; 0: 1 / sqrt(dh)
};

// Whether query row i of shape s sees key j: the mask written out on its own (causal with
// the shape's offset, the same document, within the window), for the naive runs.
inline bool NaiveSees(const AttnShape& s, const std::vector<int32_t>& docs, int i, int j) {
  return (!s.causal || j <= s.offset + i) && (docs.empty() || docs[s.offset + i] == docs[j]) &&
         (s.window == 0 || s.offset + i - j < s.window);
}

// Which precision the backend's path for a call rounds Q, K, P and V to: fp16 for the flash
// kernel, bf16 for its bf16 twin (a bf16 cache in 16-byte pieces), bf16 or fp16 (the
// cache's) for split-KV on tensor cores (SetSplitKvTensorCores, where it applies), fp32
// otherwise (maps included).
inline DType AttentionPathDType(const CudaBackend& gpu, const AttentionArgs<float>& a, bool flash) {
  AttentionParams p;
  p.q = a.q;
  p.q_stride = a.q_stride;
  p.k = a.kv.k;
  p.v = a.kv.v;
  p.kv_row_stride = a.kv.row_stride;
  p.kv_dtype = a.kv.dtype;
  p.head_dim = a.head_dim;
  p.softcap = static_cast<float>(a.softcap);
  if (!flash) {
    const bool maps = a.probs != nullptr || a.scores != nullptr;
    if (maps || !gpu.split_kv_tensor_cores() || !SplitKvMmaSupports(p)) return DType::kF32;
    return p.kv_dtype == KvDtype::kBF16 ? DType::kBF16 : DType::kF16;
  }
  return gpu.flash_bf16() && FlashPrefillBf16Supports(p) ? DType::kBF16 : DType::kF16;
}

// The host naive run of the path the backend picks: Q, K, P, V rounded to `path` (fp16 or
// bf16 on the flash kernels, unrounded fp32 otherwise) with an fp32 softmax.
inline std::vector<double> NaiveAttention(const AttnShape& s, DType path,
                                          const std::vector<double>& q,
                                          const std::vector<double>& k,
                                          const std::vector<double>& v,
                                          const std::vector<int32_t>& docs, double scale) {
  auto rd = [&](double x) { return RoundTo(path, x); };
  // q, k and v as the path stores them, rounded once here rather than in the loops (the
  // same floats: the rounding in the loops was most of this function's time).
  auto rounded = [&](const std::vector<double>& x) {
    std::vector<float> r(x.size());
    for (size_t e = 0; e < x.size(); ++e) r[e] = static_cast<float>(rd(x[e]));
    return r;
  };
  const std::vector<float> qr = rounded(q), kr = rounded(k), vr = rounded(v);
  const int group = s.heads / s.kv_heads;
  std::vector<double> out(size_t(s.tq) * s.heads * s.dh);
  std::vector<float> sc(s.tk);
  std::vector<bool> vis(s.tk);
  for (int h = 0; h < s.heads; ++h) {
    const int g = h / group;
    for (int i = 0; i < s.tq; ++i) {
      float m = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < s.tk; ++j) {
        vis[j] = NaiveSees(s, docs, i, j);
        if (!vis[j]) continue;
        float dot = 0.0f;
        for (int d = 0; d < s.dh; ++d) {
          dot += qr[(size_t(i) * s.heads + h) * s.dh + d] *
                 kr[(size_t(j) * s.kv_heads + g) * s.dh + d];
        }
        sc[j] = dot * static_cast<float>(scale);
        if (s.softcap > 0.0) {
          const float cap = static_cast<float>(s.softcap);
          sc[j] = cap * std::tanh(sc[j] / cap);
        }
        m = std::max(m, sc[j]);
      }
      float l = 0.0f;
      std::vector<float> acc(s.dh, 0.0f);
      for (int j = 0; j < s.tk; ++j) {
        if (!vis[j]) continue;
        const float p = std::exp(sc[j] - m);
        l += p;
        for (int d = 0; d < s.dh; ++d) {
          acc[d] += static_cast<float>(rd(p)) * vr[(size_t(j) * s.kv_heads + g) * s.dh + d];
        }
      }
      for (int d = 0; d < s.dh; ++d) out[(size_t(i) * s.heads + h) * s.dh + d] = acc[d] / l;
    }
  }
  return out;
}

// The naive maps [H, Tq, Tk] of the materialising kernel's maths: fp32 scores (capped as
// NaiveAttention caps them), masked ones −∞, and their fp32 softmax (masked keys 0).
struct NaiveMaps {
  std::vector<double> probs, scores;
};
inline NaiveMaps NaiveAttentionMaps(const AttnShape& s, const std::vector<double>& q,
                                    const std::vector<double>& k, const std::vector<int32_t>& docs,
                                    double scale) {
  const size_t map_size = size_t(s.heads) * s.tq * s.tk;
  NaiveMaps n{std::vector<double>(map_size, 0.0), std::vector<double>(map_size)};
  for (size_t row = 0; row < map_size / s.tk; ++row) {
    const int h = static_cast<int>(row / s.tq), i = static_cast<int>(row % s.tq);
    const int g = h / (s.heads / s.kv_heads);
    float m = -std::numeric_limits<float>::infinity(), z = 0.0f;
    for (int j = 0; j < s.tk; ++j) {
      const bool vis = NaiveSees(s, docs, i, j);
      float dot = 0.0f;
      for (int d = 0; d < s.dh; ++d) {
        dot += static_cast<float>(q[(size_t(i) * s.heads + h) * s.dh + d]) *
               static_cast<float>(k[(size_t(j) * s.kv_heads + g) * s.dh + d]);
      }
      float sc = dot * static_cast<float>(scale);
      if (s.softcap > 0.0) {
        const float cap = static_cast<float>(s.softcap);
        sc = cap * std::tanh(sc / cap);
      }
      n.scores[row * s.tk + j] = vis ? sc : -kInf;
      if (vis) m = std::max(m, sc);
    }
    for (int j = 0; j < s.tk; ++j) {
      if (std::isinf(n.scores[row * s.tk + j])) continue;
      const float e = std::exp(static_cast<float>(n.scores[row * s.tk + j]) - m);
      n.probs[row * s.tk + j] = e;
      z += e;
    }
    for (int j = 0; j < s.tk; ++j)
      n.probs[row * s.tk + j] = static_cast<float>(n.probs[row * s.tk + j]) / z;
  }
  return n;
}

// Random inputs of one attention shape, contiguous (for the naive runs) and laid out as
// the backends read them: q rows padded with NaN, K and V in a paged cache of twice the
// blocks needed, NaN everywhere but the sequence's rows, its blocks shuffled.
struct AttnInputs {
  int64_t q_width = 0, kv_width = 0, q_stride = 0, kv_stride = 0;
  double scale = 0.0;
  std::vector<double> q, k, v;  // [Tq, H, Dh], [Tk, Hkv, Dh], [Tk, Hkv, Dh]
  std::vector<int32_t> docs;    // [offset + Tq] = [Tk] document of each position, or empty
  std::vector<int32_t> q_docs;  // [Tq]
  std::vector<int32_t> table;   // the sequence's blocks
  std::vector<double> kc, vc;   // the paged cache
  std::vector<double> qs;       // [Tq, q_stride]
};

inline AttnInputs MakeAttnInputs(const AttnShape& s, std::mt19937_64& rng) {
  AttnInputs in;
  in.q_width = int64_t{s.heads} * s.dh;
  in.kv_width = int64_t{s.kv_heads} * s.dh;
  in.q_stride = in.q_width + 8;
  in.kv_stride = in.kv_width + s.kv_pad;
  in.scale = s.scale != 0.0 ? s.scale : 1.0 / std::sqrt(static_cast<double>(s.dh));
  in.q = kernels::testing::RandomFloatExact(rng, size_t(s.tq) * in.q_width, -2, 2);
  in.k = kernels::testing::RandomFloatExact(rng, size_t(s.tk) * in.kv_width, -2, 2);
  in.v = kernels::testing::RandomFloatExact(rng, size_t(s.tk) * in.kv_width);
  if (s.bf16_cache) {  // what a bf16 cache holds: the reference and naive runs read these
    for (std::vector<double>* x : {&in.k, &in.v}) {
      for (double& e : *x) e = RoundTo(DType::kBF16, e);
    }
  }
  for (size_t d = 0; d < s.doc_lengths.size(); ++d)
    in.docs.insert(in.docs.end(), s.doc_lengths[d], int32_t(d));
  const int needed = (s.tk + s.block_size - 1) / s.block_size;
  const int num_blocks = 2 * needed + 1;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  in.table.assign(perm.begin(), perm.begin() + needed);
  in.kc.assign(size_t(num_blocks) * s.block_size * in.kv_stride, kNaN);
  in.vc = in.kc;
  in.qs.assign(size_t(s.tq) * in.q_stride, kNaN);
  for (int j = 0; j < s.tk; ++j) {
    const int64_t row = int64_t{in.table[j / s.block_size]} * s.block_size + j % s.block_size;
    std::copy_n(in.k.begin() + j * in.kv_width, in.kv_width, in.kc.begin() + row * in.kv_stride);
    std::copy_n(in.v.begin() + j * in.kv_width, in.kv_width, in.vc.begin() + row * in.kv_stride);
  }
  for (int i = 0; i < s.tq; ++i)
    std::copy_n(in.q.begin() + i * in.q_width, in.q_width, in.qs.begin() + i * in.q_stride);
  if (!in.docs.empty()) {
    in.q_docs.assign(in.docs.begin() + s.offset, in.docs.begin() + s.offset + s.tq);
  }
  return in;
}

inline std::string ShapeName(const char* op, const AttnShape& s) {
  return absl::StrCat(op, " ", s.label, " (Tq=", s.tq, " Tk=", s.tk, " H=", s.heads, "/",
                      s.kv_heads, " Dh=", s.dh, " off=", s.offset, ")",
                      s.bf16_cache ? " bf16 cache" : "");
}

// The arguments of s's call over `in`'s layout: Q rows `q` (in.qs's layout), the paged
// cache k/v of `cache_dtype` (a bf16 cache's device copy; the reference reads the rounded
// values as stored, kActivation), output rows `out` (in.q_stride apart), the documents
// when the shape has them; no maps.
template <typename T>
AttentionArgs<T> AttnArgsOf(const AttnShape& s, const AttnInputs& in, const T* q, const void* k,
                            const void* v, KvDtype cache_dtype, T* out) {
  AttentionArgs<T> a;
  a.q = q;
  a.q_stride = in.q_stride;
  a.num_queries = s.tq;
  a.num_keys = s.tk;
  a.num_heads = s.heads;
  a.num_kv_heads = s.kv_heads;
  a.head_dim = s.dh;
  a.query_offset = s.offset;
  a.causal = s.causal;
  a.window = s.window;
  a.scale = in.scale;
  a.softcap = s.softcap;
  if (!in.docs.empty()) {
    a.q_doc_ids = in.q_docs.data();
    a.k_doc_ids = in.docs.data();
  }
  a.kv = KvSource<T>{k, v, in.kv_stride, in.table.data(), s.block_size, cache_dtype};
  a.out = out;
  a.out_stride = in.q_stride;
  return a;
}

// s's call on the device: Q and the cache uploaded (bf16 when s.bf16_cache), O NaN-filled.
struct DeviceAttnCall {
  DeviceBuffer q, k, v, out;
  AttentionArgs<float> args;
};
inline absl::StatusOr<DeviceAttnCall> UploadAttnCall(const AttnShape& s, const AttnInputs& in) {
  auto dq = ToDevice(in.qs);
  auto dk = s.bf16_cache ? ToDeviceBf16(in.kc) : ToDevice(in.kc);
  auto dv = s.bf16_cache ? ToDeviceBf16(in.vc) : ToDevice(in.vc);
  auto dout = ToDevice(std::vector<double>(in.qs.size(), kNaN));
  for (const auto* b : {&dq, &dk, &dv, &dout}) {
    if (!b->ok()) return b->status();
  }
  DeviceAttnCall c{*std::move(dq), *std::move(dk), *std::move(dv), *std::move(dout), {}};
  c.args =
      AttnArgsOf<float>(s, in, c.q.as<float>(), c.k.get(), c.v.get(),
                        s.bf16_cache ? KvDtype::kBF16 : KvDtype::kActivation, c.out.as<float>());
  return c;
}

inline std::vector<ParityResult> AttentionCase(CudaBackend& gpu, std::mt19937_64& rng,
                                               const AttnShape& s) {
  const std::string name = ShapeName("Attention", s);
  const AttnInputs in = MakeAttnInputs(s, rng);
  const int64_t q_width = in.q_width, q_stride = in.q_stride;
  const double scale = in.scale;
  const std::vector<double>&q = in.q, &k = in.k, &v = in.v, &kc = in.kc, &vc = in.vc, &qs = in.qs;
  const std::vector<int32_t>& docs = in.docs;

  const size_t map_size = size_t(s.heads) * s.tq * s.tk;
  const bool maps = s.want_maps || s.want_probs_only;
  // Reference (double) on the same paged layout.
  std::vector<double> ref_out(size_t(s.tq) * q_stride, kNaN), ref_probs(map_size),
      ref_scores(map_size);
  AttentionArgs<double> ra = AttnArgsOf<double>(s, in, qs.data(), kc.data(), vc.data(),
                                                KvDtype::kActivation, ref_out.data());
  ra.probs = ref_probs.data();
  ra.scores = ref_scores.data();
  if (absl::Status st = ReferenceBackend().Attention(ra); !st.ok()) return {Failed(name, st)};

  auto call = UploadAttnCall(s, in);
  auto dprobs = ToDevice(std::vector<double>(maps ? map_size : 1, kNaN));
  auto dscores = ToDevice(std::vector<double>(maps ? map_size : 1, kNaN));
  if (!call.ok() || !dprobs.ok() || !dscores.ok()) {
    return {Failed(name, absl::InternalError("device upload failed"))};
  }
  AttentionArgs<float>& a = call->args;
  if (maps) a.probs = dprobs->as<float>();
  if (s.want_maps) a.scores = dscores->as<float>();
  if (absl::Status st = gpu.Attention(a); !st.ok()) return {Failed(name, st)};
  auto out = FromDevice(gpu, call->out, size_t(s.tq) * q_stride);
  if (!out.ok()) return {Failed(name, out.status())};

  // Compare the heads' columns only; the row padding must stay NaN (never written).
  std::vector<double> got, want, naive_rows;
  const bool flash = !maps && s.tq >= kFlashMinQueries && FlashPrefillSupports(s.dh);
  const DType path = AttentionPathDType(gpu, a, flash);
  const std::vector<double> naive = NaiveAttention(s, path, q, k, v, docs, scale);
  for (int i = 0; i < s.tq; ++i) {
    for (int64_t c = 0; c < q_stride; ++c) {
      got.push_back((*out)[i * q_stride + c]);
      want.push_back(ref_out[i * q_stride + c]);
      naive_rows.push_back(c < q_width ? naive[i * q_width + c] : kNaN);
    }
  }
  const char* kernel = maps                            ? " materialised"
                       : flash && path == DType::kBF16 ? " flash bf16"
                       : flash                         ? " flash"
                       : path != DType::kF32           ? " split-KV tensor cores"
                                                       : " split-KV";
  std::vector<ParityResult> results = {Judge(name + kernel, got, naive_rows, want)};
  if (maps) {
    auto probs = FromDevice(gpu, *dprobs, map_size);
    if (!probs.ok()) return {Failed(name, probs.status())};
    const NaiveMaps naive_maps = NaiveAttentionMaps(s, q, k, docs, scale);
    results.push_back(Judge(name + " probs", *probs, naive_maps.probs, ref_probs));
    if (s.want_maps) {
      auto scores = FromDevice(gpu, *dscores, map_size);
      if (!scores.ok()) return {Failed(name, scores.status())};
      results.push_back(Judge(name + " scores", *scores, naive_maps.scores, ref_scores));
    }
  }
  return results;
}

// ---------------------------------------------------------------------------------------
// AttentionBatch: sequences (tq, tk, doc_lengths of each) in one call over one shared
// paged cache (NaN elsewhere, blocks shuffled), their q and out rows one after another as
// the engine lays them out. Against the reference's Attention per sequence; naive = the
// path each sequence takes alone (fp16-rounded for the flash kernel, fp32 otherwise).
// A sequence with want_maps or want_probs_only also asks for its [H, Tq, Tk] maps, judged
// against NaiveAttentionMaps; the result is the outputs' unless a map's fails.
// index_uploads (if not null): how many index uploads AttentionBatch made, one per launch.
// recorded_steps > 0: the batch runs as that many forward steps (BeginStep … EndStep: with
// CUDA graphs, eager, then captured, then replayed), the outputs and maps NaN-filled again
// before each, and the last step's results are judged.
inline ParityResult AttentionBatchCase(CudaBackend& gpu, std::mt19937_64& rng,
                                       const std::string& name, std::vector<AttnShape> seqs,
                                       int heads, int kv_heads, int dh,
                                       int* index_uploads = nullptr, bool bf16_cache = false,
                                       int recorded_steps = 0) {
  const int bs = 16;
  // A bf16 cache's rows padded to 16-byte pieces (the bf16 flash kernel's copies).
  const int64_t qw = heads * dh, kvw = kv_heads * dh, q_stride = qw + 8,
                kv_stride = kvw + (bf16_cache ? 8 : 4);
  const double scale = 1.0 / std::sqrt(double(dh));
  int total_blocks = 0, total_rows = 0;
  for (AttnShape& s : seqs) {
    s.heads = heads;
    s.kv_heads = kv_heads;
    s.dh = dh;
    s.block_size = bs;
    s.offset = s.tk - s.tq;
    total_blocks += (s.tk + bs - 1) / bs;
    total_rows += s.tq;
  }
  const int num_blocks = 2 * total_blocks + 1;
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<double> kc(size_t(num_blocks) * bs * kv_stride, kNaN), vc = kc;
  std::vector<double> qs(size_t(total_rows) * q_stride, kNaN), want(qs.size(), kNaN),
      naive_rows(qs.size(), kNaN);
  std::vector<std::vector<int32_t>> tables(seqs.size()), docs(seqs.size());
  std::vector<std::vector<double>> qv(seqs.size()), kv(seqs.size()), vv(seqs.size());
  int next_block = 0, row0 = 0;
  for (size_t e = 0; e < seqs.size(); ++e) {
    const AttnShape& s = seqs[e];
    qv[e] = kernels::testing::RandomFloatExact(rng, size_t(s.tq) * qw, -2, 2);
    kv[e] = kernels::testing::RandomFloatExact(rng, size_t(s.tk) * kvw, -2, 2);
    vv[e] = kernels::testing::RandomFloatExact(rng, size_t(s.tk) * kvw);
    if (bf16_cache) {  // what a bf16 cache holds: the reference and naive runs read these
      for (std::vector<double>* x : {&kv[e], &vv[e]}) {
        for (double& v : *x) v = RoundTo(DType::kBF16, v);
      }
    }
    for (size_t d = 0; d < s.doc_lengths.size(); ++d)
      docs[e].insert(docs[e].end(), s.doc_lengths[d], int32_t(d));
    for (int b = 0; b * bs < s.tk; ++b) tables[e].push_back(perm[next_block++]);
    for (int j = 0; j < s.tk; ++j) {
      const int64_t row = int64_t{tables[e][j / bs]} * bs + j % bs;
      std::copy_n(kv[e].begin() + j * kvw, kvw, kc.begin() + row * kv_stride);
      std::copy_n(vv[e].begin() + j * kvw, kvw, vc.begin() + row * kv_stride);
    }
    for (int i = 0; i < s.tq; ++i)
      std::copy_n(qv[e].begin() + i * qw, qw, qs.begin() + (row0 + i) * q_stride);
    row0 += s.tq;
  }
  auto args = [&](auto* q, auto* k, auto* v, auto* out, size_t e, int r0) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(q)>>;
    const AttnShape& s = seqs[e];
    AttentionArgs<T> a;
    a.q = q + int64_t{r0} * q_stride;
    a.q_stride = q_stride;
    a.num_queries = s.tq;
    a.num_keys = s.tk;
    a.num_heads = heads;
    a.num_kv_heads = kv_heads;
    a.head_dim = dh;
    a.query_offset = s.offset;
    a.window = s.window;
    a.scale = scale;
    a.softcap = s.softcap;
    if (!docs[e].empty()) {
      a.q_doc_ids = docs[e].data() + s.offset;
      a.k_doc_ids = docs[e].data();
    }
    a.kv = KvSource<T>{k, v, kv_stride, tables[e].data(), bs};
    if constexpr (std::is_same_v<T, float>) {
      if (bf16_cache) a.kv.dtype = KvDtype::kBF16;
    }
    a.out = out + int64_t{r0} * q_stride;
    a.out_stride = q_stride;
    return a;
  };
  auto dq = ToDevice(qs);
  auto dk = bf16_cache ? ToDeviceBf16(kc) : ToDevice(kc);
  auto dv = bf16_cache ? ToDeviceBf16(vc) : ToDevice(vc);
  auto dout = ToDevice(std::vector<double>(qs.size(), kNaN));
  if (!dq.ok() || !dk.ok() || !dv.ok() || !dout.ok()) {
    return Failed(name, absl::InternalError("device upload failed"));
  }
  std::vector<AttentionArgs<float>> calls;
  // Each sequence's maps: the reference's, and the device's (NaN-filled; empty if unasked).
  std::vector<std::vector<double>> ref_probs(seqs.size()), ref_scores(seqs.size());
  std::vector<DeviceBuffer> dprobs, dscores;
  row0 = 0;
  for (size_t e = 0; e < seqs.size(); ++e) {
    const AttnShape& s = seqs[e];
    const bool maps = s.want_maps || s.want_probs_only;
    const size_t map_size = maps ? size_t(heads) * s.tq * s.tk : 0;
    AttentionArgs<double> ra = args(qs.data(), kc.data(), vc.data(), want.data(), e, row0);
    calls.push_back(
        args(dq->as<float>(), dk->as<float>(), dv->as<float>(), dout->as<float>(), e, row0));
    if (maps) {
      ref_probs[e].assign(map_size, kNaN);
      ref_scores[e].assign(map_size, kNaN);
      ra.probs = ref_probs[e].data();
      ra.scores = ref_scores[e].data();
      for (std::vector<DeviceBuffer>* d : {&dprobs, &dscores}) {
        auto b = ToDevice(std::vector<double>(map_size, kNaN));
        if (!b.ok()) return Failed(name, b.status());
        d->push_back(*std::move(b));
      }
      calls.back().probs = dprobs.back().as<float>();
      if (s.want_maps) calls.back().scores = dscores.back().as<float>();
    } else {
      dprobs.emplace_back();
      dscores.emplace_back();
    }
    if (absl::Status st = ReferenceBackend().Attention(ra); !st.ok()) return Failed(name, st);
    const bool flash = !maps && s.tq >= kFlashMinQueries && FlashPrefillSupports(dh);
    const std::vector<double> naive = NaiveAttention(
        seqs[e], AttentionPathDType(gpu, calls.back(), flash), qv[e], kv[e], vv[e], docs[e], scale);
    for (int i = 0; i < seqs[e].tq; ++i)
      std::copy_n(naive.begin() + i * qw, qw, naive_rows.begin() + (row0 + i) * q_stride);
    row0 += seqs[e].tq;
  }
  // What a step writes, NaN-filled again before each step after the first, so that the
  // last step's results are its own.
  std::vector<DeviceBuffer*> results = {&*dout};
  for (std::vector<DeviceBuffer>* maps : {&dprobs, &dscores}) {
    for (DeviceBuffer& b : *maps) {
      if (b.bytes() > 0) results.push_back(&b);
    }
  }
  int failed = -1;
  const CudaBackend::IndexUploadStats before = gpu.index_upload_stats();
  for (int step = 0; step < std::max(recorded_steps, 1); ++step) {
    if (step > 0) {
      for (DeviceBuffer* b : results) {
        if (absl::Status st = gpu.memory().Memset(b->get(), 0xFF, b->bytes()); !st.ok()) {
          return Failed(name, st);
        }
      }
    }
    if (recorded_steps > 0) gpu.BeginStep();
    absl::Status st = gpu.AttentionBatch(calls, &failed);
    if (recorded_steps > 0) {
      absl::Status end = gpu.EndStep(/*run=*/st.ok());
      if (st.ok()) st = end;
    }
    if (!st.ok()) {
      return Failed(name, absl::Status(st.code(), absl::StrCat("step ", step, ", call ", failed,
                                                               ": ", st.message())));
    }
  }
  const CudaBackend::IndexUploadStats after = gpu.index_upload_stats();
  if (index_uploads != nullptr) {
    *index_uploads = static_cast<int>(after.copies - before.copies + after.reused - before.reused);
  }
  auto got = FromDevice(gpu, *dout, qs.size());
  if (!got.ok()) return Failed(name, got.status());
  ParityResult result = Judge(name, *got, naive_rows, want);
  for (size_t e = 0; e < seqs.size() && result.pass(); ++e) {
    const AttnShape& s = seqs[e];
    if (ref_probs[e].empty()) continue;
    const NaiveMaps naive = NaiveAttentionMaps(s, qv[e], kv[e], docs[e], scale);
    auto probs = FromDevice(gpu, dprobs[e], ref_probs[e].size());
    if (!probs.ok()) return Failed(name, probs.status());
    result = Judge(absl::StrCat(name, ": sequence ", e, "'s probabilities"), *probs, naive.probs,
                   ref_probs[e]);
    if (result.pass() && s.want_maps) {
      auto scores = FromDevice(gpu, dscores[e], ref_scores[e].size());
      if (!scores.ok()) return Failed(name, scores.status());
      result = Judge(absl::StrCat(name, ": sequence ", e, "'s scores"), *scores, naive.scores,
                     ref_scores[e]);
    }
  }
  return result;
}

// Five decode-like sequences; the third has documents, so it runs alone and splits the
// others into two batched split-KV launches.
inline ParityResult AttentionBatchSplitKvCase(CudaBackend& gpu, std::mt19937_64& rng,
                                              bool bf16_cache = false) {
  return AttentionBatchCase(gpu, rng,
                            absl::StrCat("AttentionBatch 5 sequences (Tq 1/5/3/1/2, Tk "
                                         "300/40/30/700/9, H=8/2 Dh=64, one with documents)",
                                         bf16_cache ? " bf16 cache" : ""),
                            {{.tq = 1, .tk = 300},
                             {.tq = 5, .tk = 40},
                             {.tq = 3, .tk = 30, .doc_lengths = {12, 18}},
                             {.tq = 1, .tk = 700},
                             {.tq = 2, .tk = 9}},
                            8, 2, 64, nullptr, bf16_cache);
}

// Prefill chunks: the first three go out as one flash launch (their 64-query tiles, a
// partial one each, longest first), the fourth (documents) alone, then a decode row, then
// the last two as a second flash launch.
inline ParityResult AttentionBatchFlashCase(CudaBackend& gpu, std::mt19937_64& rng,
                                            int* index_uploads = nullptr, bool bf16_cache = false) {
  return AttentionBatchCase(gpu, rng,
                            absl::StrCat("AttentionBatch 7 sequences (Tq 40/100/33/50/1/64/70, "
                                         "Tk 40/300/133/90/60/64/250, H=8/2 Dh=128, prefill "
                                         "chunks)",
                                         bf16_cache ? " bf16 cache" : ""),
                            {{.tq = 40, .tk = 40},
                             {.tq = 100, .tk = 300},
                             {.tq = 33, .tk = 133},
                             {.tq = 50, .tk = 90, .doc_lengths = {45, 45}},
                             {.tq = 1, .tk = 60},
                             {.tq = 64, .tk = 64},
                             {.tq = 70, .tk = 250}},
                            8, 2, 128, index_uploads, bf16_cache);
}

// Sliding windows (every sequence of a model has the same one): decode rows and prefill
// chunks of several sequences, each batched launch masking each row to its own window;
// the last chunk's flash tile starts 4 key tiles in (its first row, position 336, sees
// keys from 287 on).
inline ParityResult AttentionBatchWindowCase(CudaBackend& gpu, std::mt19937_64& rng) {
  return AttentionBatchCase(gpu, rng,
                            "AttentionBatch 6 sequences in a sliding window of 50 (Tq "
                            "1/2/40/1/64/64, Tk 300/30/140/700/64/400, H=8/2 Dh=64)",
                            {{.tq = 1, .tk = 300, .window = 50},
                             {.tq = 2, .tk = 30, .window = 50},
                             {.tq = 40, .tk = 140, .window = 50},
                             {.tq = 1, .tk = 700, .window = 50},
                             {.tq = 64, .tk = 64, .window = 50},
                             {.tq = 64, .tk = 400, .window = 50}},
                            8, 2, 64);
}

// Gemma 2's attention (head size 256, GQA 8/4, a sliding window, soft-capped scores):
// prefill chunks on the flash kernel around a decode row on split-KV, each launch capping
// and windowing every row; with bf16_cache, over a bf16 cache in 16-byte pieces (the bf16
// flash kernel's 32-key tiles, Q in shared memory).
inline ParityResult AttentionBatchGemmaCase(CudaBackend& gpu, std::mt19937_64& rng,
                                            bool bf16_cache = false) {
  std::vector<AttnShape> seqs = {{.tq = 40, .tk = 40},
                                 {.tq = 100, .tk = 260},
                                 {.tq = 1, .tk = 300},
                                 {.tq = 70, .tk = 70},
                                 {.tq = 33, .tk = 180}};
  for (AttnShape& s : seqs) {
    s.window = 50;
    s.softcap = 1.0;
  }
  return AttentionBatchCase(gpu, rng,
                            "AttentionBatch 5 sequences, Gemma 2's attention (Tq 40/100/1/70/33, "
                            "Tk 40/260/300/70/180, H=8/4 Dh=256, window 50, soft cap 1)" +
                                std::string(bf16_cache ? " bf16 cache" : ""),
                            std::move(seqs), 8, 4, 256, nullptr, bf16_cache);
}

inline std::vector<AttnShape> AttentionShapes() {
  std::vector<AttnShape> shapes;
  auto add = [&](AttnShape s) { shapes.push_back(std::move(s)); };
  add({.label = "prefill causal", .tq = 150, .tk = 150, .heads = 4, .kv_heads = 4, .dh = 64});
  add({.label = "prefill offset GQA 8/4",
       .tq = 70,
       .tk = 200,
       .heads = 8,
       .kv_heads = 4,
       .dh = 128,
       .offset = 130});
  add({.label = "prefill docs GQA 8/1",
       .tq = 130,
       .tk = 130,
       .heads = 8,
       .kv_heads = 1,
       .dh = 128,
       .doc_lengths = {40, 50, 40}});
  add({.label = "prefill non-causal docs",
       .tq = 64,
       .tk = 64,
       .heads = 2,
       .kv_heads = 2,
       .dh = 64,
       .causal = false,
       .doc_lengths = {10, 54}});
  // Keys end mid-tile without a causal mask; cache rows 3 floats apart past the heads, so
  // the flash kernel's K/V tile loads go float by float.
  add({.label = "prefill non-causal odd stride GQA 4/2",
       .tq = 90,
       .tk = 77,
       .heads = 4,
       .kv_heads = 2,
       .dh = 128,
       .causal = false,
       .kv_pad = 3});
  add({.label = "chunk with docs and offset",
       .tq = 40,
       .tk = 100,
       .heads = 8,
       .kv_heads = 4,
       .dh = 64,
       .offset = 60,
       .doc_lengths = {70, 30},
       .block_size = 8});
  add({.label = "decode long GQA 8/1",
       .tq = 1,
       .tk = 3000,
       .heads = 8,
       .kv_heads = 1,
       .dh = 128,
       .offset = 2999});
  // Cache blocks of 12 rows, not a power of two: the split-KV kernel's block-table lookups
  // divide rather than shift (BlockShift); its 4-key steps stay within a block.
  add({.label = "decode GQA 8/2 blocks of 12",
       .tq = 1,
       .tk = 500,
       .heads = 8,
       .kv_heads = 2,
       .dh = 128,
       .offset = 499,
       .block_size = 12});
  add({.label = "decode GQA 8/4",
       .tq = 1,
       .tk = 37,
       .heads = 8,
       .kv_heads = 4,
       .dh = 64,
       .offset = 36,
       .block_size = 4});
  // The split-KV head tile follows the group: 1 (MHA, 8 keys a step), 4 for a group of 3.
  add({.label = "decode MHA 4/4",
       .tq = 1,
       .tk = 333,
       .heads = 4,
       .kv_heads = 4,
       .dh = 128,
       .offset = 332,
       .kv_pad = 0});
  add({.label = "decode GQA 6/2",
       .tq = 2,
       .tk = 97,
       .heads = 6,
       .kv_heads = 2,
       .dh = 64,
       .offset = 95,
       .block_size = 8,
       .kv_pad = 0});
  add({.label = "short chunk",
       .tq = 5,
       .tk = 600,
       .heads = 4,
       .kv_heads = 2,
       .dh = 128,
       .offset = 595});
  add({.label = "prefill head size 80 GQA 4/2",
       .tq = 100,
       .tk = 100,
       .heads = 4,
       .kv_heads = 2,
       .dh = 80});
  add({.label = "prefill head size 96 offset",
       .tq = 33,
       .tk = 120,
       .heads = 3,
       .kv_heads = 3,
       .dh = 96,
       .offset = 87});
  // Head size 256 (Gemma; Q in shared memory, 64-query blocks): one partial block; two
  // blocks with an offset and keys ending mid-tile; documents; Gemma 2's soft cap under a
  // sliding window (the cap binds: 1).
  add({.label = "prefill head size 256 GQA 2/1",
       .tq = 40,
       .tk = 40,
       .heads = 2,
       .kv_heads = 1,
       .dh = 256});
  add({.label = "prefill head size 256 offset GQA 8/4",
       .tq = 100,
       .tk = 230,
       .heads = 8,
       .kv_heads = 4,
       .dh = 256,
       .offset = 130});
  add({.label = "prefill head size 256 docs GQA 4/1",
       .tq = 64,
       .tk = 64,
       .heads = 4,
       .kv_heads = 1,
       .dh = 256,
       .doc_lengths = {20, 44}});
  add({.label = "prefill head size 256 softcap 1 sliding window 70 GQA 4/2",
       .tq = 150,
       .tk = 400,
       .heads = 4,
       .kv_heads = 2,
       .dh = 256,
       .offset = 250,
       .window = 70,
       .softcap = 1.0});
  add({.label = "fallback head size 256 decode",
       .tq = 3,
       .tk = 700,
       .heads = 2,
       .kv_heads = 1,
       .dh = 256,
       .offset = 697});
  // Split-KV head tiles: 12 heads = a tile of 8 and one of 4, floats read one by one
  // (Dh 50 is no multiple of 4); Dh 256 takes 4 heads a tile, float4 loads.
  add({.label = "decode scalar loads GQA 12/1",
       .tq = 1,
       .tk = 900,
       .heads = 12,
       .kv_heads = 1,
       .dh = 50,
       .offset = 899,
       .block_size = 8});
  add({.label = "decode head size 256 GQA 8/1",
       .tq = 2,
       .tk = 520,
       .heads = 8,
       .kv_heads = 1,
       .dh = 256,
       .offset = 518});
  add({.label = "maps docs offset GQA 8/4",
       .tq = 20,
       .tk = 60,
       .heads = 8,
       .kv_heads = 4,
       .dh = 128,
       .offset = 40,
       .doc_lengths = {35, 25},
       .want_maps = true});
  // Sliding windows: the flash kernel (a window ending mid-tile, with an offset), split-KV
  // decode over a long context (its splits share the window's keys) and the materialising
  // kernel's maps.
  add({.label = "prefill sliding window 37 offset GQA 8/4",
       .tq = 100,
       .tk = 160,
       .heads = 8,
       .kv_heads = 4,
       .dh = 128,
       .offset = 60,
       .window = 37});
  // A window far shorter than the context: most of each block's key tiles lie wholly
  // before it (not visited), the first one visited starts before it (masked in part).
  add({.label = "prefill sliding window 70 long context GQA 8/2",
       .tq = 200,
       .tk = 700,
       .heads = 8,
       .kv_heads = 2,
       .dh = 64,
       .offset = 500,
       .window = 70});
  add({.label = "decode sliding window 100 GQA 8/2",
       .tq = 1,
       .tk = 2000,
       .heads = 8,
       .kv_heads = 2,
       .dh = 64,
       .offset = 1999,
       .window = 100});
  // Gemma 2's soft-capped scores (a cap of 1, which binds on these scores): split-KV decode,
  // a chunk on the flash kernel (over a bf16 cache too, below), and maps.
  add({.label = "decode softcap 1 GQA 8/2",
       .tq = 1,
       .tk = 300,
       .heads = 8,
       .kv_heads = 2,
       .dh = 128,
       .offset = 299,
       .softcap = 1.0});
  add({.label = "prefill softcap 1 GQA 4/2",
       .tq = 40,
       .tk = 90,
       .heads = 4,
       .kv_heads = 2,
       .dh = 64,
       .offset = 50,
       .softcap = 1.0});
  add({.label = "maps softcap 1 GQA 4/2",
       .tq = 5,
       .tk = 20,
       .heads = 4,
       .kv_heads = 2,
       .dh = 64,
       .offset = 15,
       .want_maps = true,
       .softcap = 1.0});
  add({.label = "maps sliding window 9 GQA 4/2",
       .tq = 20,
       .tk = 50,
       .heads = 4,
       .kv_heads = 2,
       .dh = 64,
       .offset = 30,
       .window = 9,
       .want_maps = true});
  add({.label = "probs only (flash-sized)",
       .tq = 48,
       .tk = 48,
       .heads = 2,
       .kv_heads = 1,
       .dh = 64,
       .want_probs_only = true});
  // Copies of the shapes named on a bf16 cache, changed by `change`. (A label not found
  // adds nothing, and the count in RunParitySuite's test then fails.)
  auto add_variants = [&](std::initializer_list<const char*> labels,
                          const std::function<void(AttnShape&)>& change) {
    for (const char* label : labels) {
      const auto it = std::find_if(shapes.begin(), shapes.end(),
                                   [&](const AttnShape& s) { return s.label == label; });
      if (it == shapes.end()) continue;
      AttnShape v = *it;
      v.bf16_cache = true;
      change(v);
      shapes.push_back(std::move(v));
    }
  };
  // A bf16 cache (--kv-cache-dtype bf16): each kernel's loads of four bf16 (8 bytes) or of
  // single values (odd strides, Dh 50), widened to fp32 as they arrive; the same shapes.
  add_variants(
      {"prefill offset GQA 8/4", "prefill non-causal odd stride GQA 4/2", "decode long GQA 8/1",
       "decode scalar loads GQA 12/1", "decode head size 256 GQA 8/1", "maps docs offset GQA 8/4"},
      [](AttnShape&) {});
  // Decode on a bf16 cache with 8 keys a split-KV step (head tiles of 1, 2 and 4): block
  // sizes of 4 (a step spans two blocks), 8 and 16, several splits, odd head counts.
  add_variants({"decode GQA 8/4", "decode MHA 4/4", "decode GQA 6/2", "short chunk",
                "decode sliding window 100 GQA 8/2", "decode GQA 8/2 blocks of 12"},
               [](AttnShape&) {});
  // The prefill shapes again on a bf16 cache whose rows are 16-byte pieces (8 bf16 of
  // padding): the bf16 flash kernel's cp.async and ldmatrix path, every head size, with
  // offsets, documents, GQA, keys ending mid-tile, 64- and 128-query blocks and the soft
  // cap; at head size 256 (32-key tiles, Q in shared memory) one partial block, offsets,
  // documents, and the cap in a sliding window.
  add_variants(
      {"prefill causal", "prefill offset GQA 8/4", "prefill docs GQA 8/1",
       "prefill non-causal docs", "prefill head size 80 GQA 4/2", "prefill head size 96 offset",
       "chunk with docs and offset", "prefill sliding window 37 offset GQA 8/4",
       "prefill sliding window 70 long context GQA 8/2", "prefill softcap 1 GQA 4/2",
       "prefill head size 256 offset GQA 8/4", "prefill head size 256 GQA 2/1",
       "prefill head size 256 docs GQA 4/1",
       "prefill head size 256 softcap 1 sliding window 70 GQA 4/2"},
      [](AttnShape& v) {
        v.label += ", rows in 16-byte pieces";
        v.kv_pad = 8;
      });
  // Cache blocks of 12 rows, not a power of two: the bf16 flash kernel's block-table
  // lookups divide rather than shift (BlockShift).
  add_variants({"prefill offset GQA 8/4"}, [](AttnShape& v) {
    v.label += ", rows in 16-byte pieces, blocks of 12";
    v.kv_pad = 8;
    v.block_size = 12;
  });
  // Keys ending mid-tile without a causal mask (no multiple of 64 keys: the last tile's
  // copies zero-fill), GQA 4/2: the odd-stride shape with its rows in 16-byte pieces.
  add_variants({"prefill non-causal odd stride GQA 4/2"}, [](AttnShape& v) {
    v.label = "prefill non-causal keys mid-tile, rows in 16-byte pieces";
    v.kv_pad = 8;
  });
  return shapes;
}

}  // namespace kvlens::kernels::cuda::parity

#endif  // KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_ATTENTION_H_
