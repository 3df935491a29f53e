// A tiny model with random f32 weights built in memory (owned buffers), for either
// family: GPT-2 (LayerNorm, GELU, biases, learned positions) or Llama (RMSNorm, SwiGLU,
// RoPE of either style, grouped-query attention; optionally Qwen3's norms over each head of
// q and k, and heads whose width is not dim / heads). Buffers are mutable through Param() so
// tests can take finite differences in the weights themselves.
#ifndef KVLENS_TESTS_ENGINE_INTERPRET_TINY_MODEL_H_
#define KVLENS_TESTS_ENGINE_INTERPRET_TINY_MODEL_H_

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "engine/model/model.h"

namespace kvlens::testing {

struct TinySpec {
  Architecture arch = Architecture::kGpt2;
  kernels::RopeStyle rope_style = kernels::RopeStyle::kHalfSplit;
  int dim = 16, heads = 4, kv_heads = 4, hidden = 24, layers = 2, vocab = 23, max_seq = 32;
  int head_dim = 0;      // 0: dim / heads
  bool qk_norm = false;  // Llama only
  int window = 0;        // sliding window (0: none)
  bool gemma = false;    // Llama only: GeGLU feed-forward, embeddings times √dim
  // Gemma 3 (with gemma, qk_norm and a window): norms on each block's outputs, layer 1
  // over the whole context with RoPE base 1e6 (the windowed layers 1e4), scores times 0.3.
  bool gemma3 = false;
  // Gemma 2 (with gemma and a window): norms on each block's outputs, layer 1 over the whole
  // context, scores times 0.3 soft-capped at 1, logits soft-capped at 2.
  bool gemma2 = false;
  uint32_t seed = 1;
};

inline std::unique_ptr<Model> MakeTinyModel(const TinySpec& s) {
  auto m = std::make_unique<Model>();
  ModelConfig& c = m->config;
  c.arch = s.arch;
  c.dim = s.dim;
  c.hidden_dim = s.hidden;
  c.num_layers = s.layers;
  c.num_heads = s.heads;
  c.num_kv_heads = s.kv_heads;
  c.head_dim = s.head_dim > 0 ? s.head_dim : s.dim / s.heads;
  c.qk_norm = s.qk_norm;
  c.vocab_size = s.vocab;
  c.max_seq_len = s.max_seq;
  c.sliding_window = s.window;
  c.rope_style = s.rope_style;
  c.norm_eps = 1e-5;
  if (s.gemma) {
    c.gate_activation = GateActivation::kGeluTanh;
    c.embedding_scale = std::sqrt(static_cast<double>(s.dim));
  }
  if (s.gemma2 || s.gemma3) {
    c.sandwich_norms = true;
    c.windowed_layers.assign(s.layers, true);
    c.windowed_layers[1] = false;
    c.attention_scale = 0.3;
  }
  if (s.gemma2) {
    c.attention_softcap = 1.0;
    c.final_softcap = 2.0;
  }
  if (s.gemma3) {
    c.rope_theta = 1e6;
    c.rope_theta_windowed = 1e4;
  }
  c.tied_embeddings = false;
  c.name = "tiny";
  m->format = "memory";
  std::mt19937 rng(s.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // A [rows, cols] f32 matrix of N(mean, scale²) values, owned by the model.
  auto mat = [&](int64_t rows, int64_t cols, float scale, float mean = 0.0f) {
    auto buf = std::make_shared<std::vector<float>>(rows * cols);
    for (float& x : *buf) x = mean + scale * nd(rng);
    m->weights.storage.push_back(buf);
    return kernels::WeightView{buf->data(), kernels::DType::kF32, rows, cols};
  };
  const int D = c.dim, QD = c.q_dim(), KVD = c.kv_dim(), F = c.hidden_dim;
  const bool gpt2 = s.arch == Architecture::kGpt2;
  const float w = 1.0f / std::sqrt(static_cast<float>(D));
  Weights& wt = m->weights;
  wt.token_embedding = mat(c.vocab_size, D, 1.0f);
  if (gpt2) wt.position_embedding = mat(c.max_seq_len, D, 0.5f);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights lw;
    lw.attn_norm = mat(1, D, 0.2f, 1.0f);
    lw.wq = mat(QD, D, 2 * w);
    lw.wk = mat(KVD, D, 2 * w);
    lw.wv = mat(KVD, D, w);
    lw.wo = mat(D, QD, w);
    lw.ffn_norm = mat(1, D, 0.2f, 1.0f);
    lw.w_in = mat(F, D, w);
    lw.w_out = mat(D, F, 1.0f / std::sqrt(static_cast<float>(F)));
    if (gpt2) {
      lw.attn_norm_bias = mat(1, D, 0.1f);
      lw.bq = mat(1, D, 0.1f);
      lw.bk = mat(1, KVD, 0.1f);
      lw.bv = mat(1, KVD, 0.1f);
      lw.bo = mat(1, D, 0.1f);
      lw.ffn_norm_bias = mat(1, D, 0.1f);
      lw.b_in = mat(1, F, 0.1f);
      lw.b_out = mat(1, D, 0.1f);
    } else {
      lw.w_up = mat(F, D, w);
    }
    if (s.qk_norm) {
      lw.q_norm = mat(1, c.head_dim, 0.3f, 1.0f);
      lw.k_norm = mat(1, c.head_dim, 0.3f, 1.0f);
    }
    if (s.gemma2 || s.gemma3) {
      lw.post_attn_norm = mat(1, D, 0.2f, 1.0f);
      lw.post_ffn_norm = mat(1, D, 0.2f, 1.0f);
    }
    wt.layers.push_back(lw);
  }
  wt.final_norm = mat(1, D, 0.2f, 1.0f);
  if (gpt2) wt.final_norm_bias = mat(1, D, 0.1f);
  wt.output = mat(c.vocab_size, D, w);
  return m;
}

// One tiny model of each family, 0 … kTinyFamilies − 1: 0 GPT-2, then Llamas (1: half-split
// RoPE and grouped-query attention, 2: adjacent pairs and one KV head, 3: Qwen3's head
// norms and heads of 6, 4: a window of 3), 5 Gemma, 6 Gemma 3, 7 Gemma 2.
constexpr int kTinyFamilies = 8;
inline TinySpec TinyFamilySpec(int i) {
  TinySpec s;
  if (i == 1) {  // Llama, half-split RoPE, grouped-query attention
    s.arch = Architecture::kLlama;
    s.rope_style = kernels::RopeStyle::kHalfSplit;
    s.kv_heads = 2;
    s.seed = 2;
  } else if (i == 2) {  // Llama, adjacent pairs, one KV head
    s.arch = Architecture::kLlama;
    s.rope_style = kernels::RopeStyle::kAdjacentPairs;
    s.kv_heads = 1;
    s.seed = 3;
  } else if (i == 3) {  // Qwen3: norms over each head of q and k, heads of 6 (q: 24 ≠ 16)
    s.arch = Architecture::kLlama;
    s.rope_style = kernels::RopeStyle::kHalfSplit;
    s.kv_heads = 2;
    s.head_dim = 6;
    s.qk_norm = true;
    s.seed = 4;
  } else if (i == 4) {  // Mistral 7B v0.1: a sliding window, here of 3 positions
    s.arch = Architecture::kLlama;
    s.rope_style = kernels::RopeStyle::kHalfSplit;
    s.kv_heads = 2;
    s.window = 3;
    s.seed = 5;
  } else if (i == 5) {  // Gemma: GeGLU, embeddings times √16 = 4, one KV head
    s.arch = Architecture::kLlama;
    s.rope_style = kernels::RopeStyle::kHalfSplit;
    s.kv_heads = 1;
    s.gemma = true;
    s.seed = 6;
  } else if (i == 6) {  // Gemma 3: norms around each block, head norms, layer 0 windowed
    s.arch = Architecture::kLlama;
    s.rope_style = kernels::RopeStyle::kHalfSplit;
    s.kv_heads = 2;
    s.gemma = true;
    s.gemma3 = true;
    s.qk_norm = true;
    s.window = 3;
    s.seed = 7;
  } else if (i == 7) {  // Gemma 2: norms around each block, soft-capped scores and logits
    s.arch = Architecture::kLlama;
    s.rope_style = kernels::RopeStyle::kHalfSplit;
    s.kv_heads = 2;
    s.gemma = true;
    s.gemma2 = true;
    s.window = 3;
    s.seed = 8;
  }
  return s;
}

// A mutable pointer to element (r, c) of an f32 weight (tests only).
inline float* Param(const kernels::WeightView& w, int64_t r, int64_t col) {
  return const_cast<float*>(static_cast<const float*>(w.data)) + r * w.cols + col;
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_ENGINE_INTERPRET_TINY_MODEL_H_
