// A hand-built one-layer GPT-2 (Hugging Face directory: config.json, model.safetensors,
// tokenizer.json) whose layer-0 head 0 is the seeds' two-position attention example:
//
//   tokens a, b, c (ids 0, 1, 2; 3 = <|endoftext|>), embeddings
//     a = [1, −1, 1, −1], b = [1, 1, −1, −1], c = [1, −1, −1, 1]
//   (mean 0, variance 1, mutually orthogonal, |x|² = 4), position embeddings 0, LayerNorm
//   weight 1, bias 0, eps 1e-12: the normalised rows are the embeddings themselves.
//   head dim 2 (scale 1/√2), α = √2·ln 3, M = 10⁴:
//     W_Q columns α/4·b, α/4·c        → Q(b) = [α, 0], Q(c) = [0, α], Q(a) = 0
//     W_K columns a/4, b/4 − M/4·c    → K(a) = [1, 0], K(b) = [0, 1], K(c) = [0, −M]
//     W_V columns a/2, b              → V(a) = [2, 0], V(b) = [0, 4], V(c) = 0
//   On the prompt a b c, queries 1 and 2 see keys 0 and 1 with scores [ln 3, 0] and
//   [0, ln 3] (key 2's score −M·ln 3 underflows to probability 0): A rows [3/4, 1/4] and
//   [1/4, 3/4], the seeds' example. With identical_keys, W_K columns are (a+b)/4 and
//   (a+b)/4 − M/4·c: K(a) = K(b) = [1, 1].
//   Head 1, the MLP and everything else are zero (attention projection: identity).
#ifndef KVLENS_TESTS_SERVER_SEED_MODEL_H_
#define KVLENS_TESTS_SERVER_SEED_MODEL_H_

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/engine/model/safetensors_test_writer.h"

namespace kvlens::testing {

inline constexpr double kSeedM = 1e4;

// Writes the model into `dir` (created) and returns `dir`.
inline std::string WriteSeedModel(const std::string& dir, bool identical_keys) {
  std::filesystem::create_directories(dir);
  constexpr int D = 4, V = 4, P = 8;
  const double alpha = std::sqrt(2.0) * std::log(3.0);
  const double a[D] = {1, -1, 1, -1}, b[D] = {1, 1, -1, -1}, c[D] = {1, -1, -1, 1};
  std::vector<float> wte(V * D, 0.0f);
  for (int i = 0; i < D; ++i) {
    wte[0 * D + i] = static_cast<float>(a[i]);
    wte[1 * D + i] = static_cast<float>(b[i]);
    wte[2 * D + i] = static_cast<float>(c[i]);
  }
  // Conv1D layout [in = D, out = 3D]: Q columns 0..3 (head 0: 0, 1), K 4..7, V 8..11.
  std::vector<float> c_attn(D * 3 * D, 0.0f);
  auto column = [&](int col, auto f) {
    for (int i = 0; i < D; ++i) c_attn[i * 3 * D + col] = static_cast<float>(f(i));
  };
  column(0, [&](int i) { return alpha / 4 * b[i]; });
  column(1, [&](int i) { return alpha / 4 * c[i]; });
  if (identical_keys) {
    column(4, [&](int i) { return (a[i] + b[i]) / 4; });
    column(5, [&](int i) { return (a[i] + b[i]) / 4 - kSeedM / 4 * c[i]; });
  } else {
    column(4, [&](int i) { return a[i] / 4; });
    column(5, [&](int i) { return b[i] / 4 - kSeedM / 4 * c[i]; });
  }
  column(8, [&](int i) { return a[i] / 2; });
  column(9, [&](int i) { return b[i]; });
  std::vector<float> identity(D * D, 0.0f);
  for (int i = 0; i < D; ++i) identity[i * D + i] = 1.0f;
  const std::vector<float> ones(D, 1.0f), zeros(D, 0.0f), zeros_dd(D * D, 0.0f);
  SafetensorsWriter w;
  w.AddF32("transformer.wte.weight", {V, D}, wte);
  w.AddF32("transformer.wpe.weight", {P, D}, std::vector<float>(P * D, 0.0f));
  w.AddF32("transformer.h.0.ln_1.weight", {D}, ones);
  w.AddF32("transformer.h.0.ln_1.bias", {D}, zeros);
  w.AddF32("transformer.h.0.attn.c_attn.weight", {D, 3 * D}, c_attn);
  w.AddF32("transformer.h.0.attn.c_attn.bias", {3 * D}, std::vector<float>(3 * D));
  w.AddF32("transformer.h.0.attn.c_proj.weight", {D, D}, identity);
  w.AddF32("transformer.h.0.attn.c_proj.bias", {D}, zeros);
  w.AddF32("transformer.h.0.ln_2.weight", {D}, ones);
  w.AddF32("transformer.h.0.ln_2.bias", {D}, zeros);
  w.AddF32("transformer.h.0.mlp.c_fc.weight", {D, D}, zeros_dd);
  w.AddF32("transformer.h.0.mlp.c_fc.bias", {D}, zeros);
  w.AddF32("transformer.h.0.mlp.c_proj.weight", {D, D}, zeros_dd);
  w.AddF32("transformer.h.0.mlp.c_proj.bias", {D}, zeros);
  w.AddF32("transformer.ln_f.weight", {D}, ones);
  w.AddF32("transformer.ln_f.bias", {D}, zeros);
  const std::string bytes = w.Bytes();
  std::ofstream(dir + "/model.safetensors", std::ios::binary).write(bytes.data(), bytes.size());
  std::ofstream(dir + "/config.json")
      << R"({"model_type": "gpt2", "n_embd": 4, "n_layer": 1, "n_head": 2, "n_positions": 8,
  "n_inner": 4, "vocab_size": 4, "layer_norm_epsilon": 1e-12,
  "activation_function": "gelu_new", "bos_token_id": 3, "eos_token_id": 3})";
  std::ofstream(dir + "/tokenizer.json")
      << R"({"version": "1.0", "added_tokens": [{"id": 3, "content": "<|endoftext|>",
  "special": true}], "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false},
  "decoder": {"type": "ByteLevel"}, "model": {"type": "BPE",
  "vocab": {"a": 0, "b": 1, "c": 2, "<|endoftext|>": 3}, "merges": []}})";
  return dir;
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_SERVER_SEED_MODEL_H_
