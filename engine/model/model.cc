#include "engine/model/model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "engine/model/gguf.h"
#include "engine/model/gguf_model.h"
#include "engine/model/hf_model.h"
#include "engine/model/llama2c.h"
#include "engine/tokenizer/tokenizer_factory.h"
#include "engine/tokenizer/tokenizer_json.h"

namespace kvlens {

absl::Status Model::ValidateWeights() const {
  const ModelConfig& c = config;
  const Weights& w = weights;
  const int64_t D = c.dim, QD = c.q_dim(), F = c.hidden_dim, KVD = c.kv_dim(), V = c.vocab_size;
  const bool gpt2 = c.arch == Architecture::kGpt2;
  if (static_cast<int>(w.layers.size()) != c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model has ", w.layers.size(), " layers of weights, config says ", c.num_layers));
  }
  struct Check {
    std::string name;
    const WeightView* view;
    int64_t rows, cols;
  };
  std::vector<Check> checks = {{"token_embedding", &w.token_embedding, V, D},
                               {"final_norm", &w.final_norm, 1, D},
                               {"output", &w.output, V, D}};
  if (gpt2) {
    checks.push_back({"position_embedding", &w.position_embedding, c.max_seq_len, D});
    checks.push_back({"final_norm_bias", &w.final_norm_bias, 1, D});
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    const std::string p = absl::StrCat("layers.", l, ".");
    checks.insert(checks.end(), {{p + "attn_norm", &lw.attn_norm, 1, D},
                                 {p + "wq", &lw.wq, QD, D},
                                 {p + "wk", &lw.wk, KVD, D},
                                 {p + "wv", &lw.wv, KVD, D},
                                 {p + "wo", &lw.wo, D, QD},
                                 {p + "ffn_norm", &lw.ffn_norm, 1, D},
                                 {p + "w_in", &lw.w_in, F, D},
                                 {p + "w_out", &lw.w_out, D, F}});
    if (gpt2) {
      checks.insert(checks.end(), {{p + "attn_norm_bias", &lw.attn_norm_bias, 1, D},
                                   {p + "bq", &lw.bq, 1, D},
                                   {p + "bk", &lw.bk, 1, KVD},
                                   {p + "bv", &lw.bv, 1, KVD},
                                   {p + "bo", &lw.bo, 1, D},
                                   {p + "ffn_norm_bias", &lw.ffn_norm_bias, 1, D},
                                   {p + "b_in", &lw.b_in, 1, F},
                                   {p + "b_out", &lw.b_out, 1, D}});
    } else {
      checks.push_back({p + "w_up", &lw.w_up, F, D});
      if (c.qkv_bias) {  // Qwen2
        checks.insert(
            checks.end(),
            {{p + "bq", &lw.bq, 1, QD}, {p + "bk", &lw.bk, 1, KVD}, {p + "bv", &lw.bv, 1, KVD}});
      }
      if (c.qk_norm) {  // Qwen3
        checks.insert(checks.end(), {{p + "q_norm", &lw.q_norm, 1, c.head_dim},
                                     {p + "k_norm", &lw.k_norm, 1, c.head_dim}});
      }
    }
  }
  for (const Check& ch : checks) {
    if (absl::Status s = CheckShape(ch.name, *ch.view, ch.rows, ch.cols); !s.ok()) return s;
  }
  if (!w.rope_freqs.empty()) {
    if (gpt2) return absl::InvalidArgumentError("rope_freqs: GPT-2 models have no RoPE");
    const int half = c.head_dim / 2;
    if (absl::Status s = CheckShape("rope_freqs", w.rope_freqs, 1, half); !s.ok()) return s;
    if (w.rope_freqs.dtype != kernels::DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat("rope_freqs: dtype ", std::string(kernels::DTypeName(w.rope_freqs.dtype)),
                       " (must be f32)"));
    }
    const auto* f = static_cast<const float*>(w.rope_freqs.data);
    for (int p = 0; p < half; ++p) {
      if (!(f[p] > 0.0f) || !std::isfinite(f[p])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rope_freqs[", p, "] = ", f[p], ": frequency factors must be positive and finite"));
      }
    }
  }
  return absl::OkStatus();
}

namespace {
bool HasGgufMagic(const std::string& path) {
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  in.read(magic, 4);
  return in.gcount() == 4 && std::memcmp(magic, "GGUF", 4) == 0;
}
}  // namespace

absl::StatusOr<std::unique_ptr<Model>> LoadModel(const LoadOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(options.path, ec)) {
    return absl::NotFoundError(absl::StrCat("model path not found: ", options.path));
  }
  absl::StatusOr<std::unique_ptr<Model>> model;
  if (fs::is_directory(options.path, ec)) {
    model = LoadHfModel(options.path);
  } else if (HasGgufMagic(options.path)) {
    auto gguf = GgufFile::Open(options.path);
    if (!gguf.ok()) return gguf.status();
    model = LoadGgufModel(*std::move(gguf));
  } else {
    model = LoadLlama2c(options);
  }
  if (model.ok() && (*model)->tokenizer != nullptr) {
    auto format = DetectChatFormat((*model)->tokenizer->chat_template());
    if (format.ok()) (*model)->chat_format = *format;
  }
  return model;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const LoadOptions& options) {
  if (!options.path.empty() && std::filesystem::is_directory(options.path)) {
    return TokenizerFromJson((std::filesystem::path(options.path) / "tokenizer.json").string());
  }
  if (!options.path.empty() && HasGgufMagic(options.path)) {
    auto gguf = GgufFile::Open(options.path);
    if (!gguf.ok()) return gguf.status();
    return TokenizerFromGguf(**gguf);
  }
  if (!options.tokenizer_path.empty() || !options.path.empty()) {
    // A llama2.c checkpoint brings its tokenizer beside it; load the model to find it.
    if (options.tokenizer_path.empty()) {
      auto model = LoadModel(options);
      if (!model.ok()) return model.status();
      if ((*model)->tokenizer == nullptr) {
        return absl::NotFoundError(
            absl::StrCat("no tokenizer found for ", options.path, " (pass a tokenizer file)"));
      }
      return std::move((*model)->tokenizer);
    }
    return TokenizerFromLlama2c(options.tokenizer_path, /*vocab_size=*/0);
  }
  return absl::InvalidArgumentError("no model or tokenizer path given");
}

}  // namespace kvlens
