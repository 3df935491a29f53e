#include "engine/model/llama2c.h"

#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/model/mapped_file.h"
#include "engine/tokenizer/tokenizer_factory.h"

namespace kvlens {
namespace {

constexpr int64_t kHeaderBytes = 7 * 4;

std::string DefaultTokenizerPath(const std::string& model_path, int vocab_size) {
  const std::filesystem::path dir = std::filesystem::path(model_path).parent_path();
  for (const std::string& name :
       {std::string("tokenizer.bin"), absl::StrCat("tok", vocab_size, ".bin")}) {
    const auto candidate = dir / name;
    if (std::filesystem::exists(candidate)) return candidate.string();
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> LoadLlama2c(const LoadOptions& options) {
  auto file_or = MappedFile::Open(options.path);
  if (!file_or.ok()) return file_or.status();
  std::shared_ptr<MappedFile> file = *std::move(file_or);
  const std::string& path = options.path;
  if (file->size() < static_cast<size_t>(kHeaderBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("llama2.c checkpoint ", path,
                                                   ": truncated: ", file->size(),
                                                   " bytes, header needs ", kHeaderBytes));
  }
  int32_t h[7];
  std::memcpy(h, file->data(), sizeof(h));
  const bool shared_classifier = h[5] > 0;

  auto model = std::make_unique<Model>();
  model->format = "llama2c";
  ModelConfig& c = model->config;
  c.arch = Architecture::kLlama;
  c.family = "llama";
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.num_layers = h[2];
  c.num_heads = h[3];
  c.num_kv_heads = h[4];
  c.vocab_size = h[5] < 0 ? -h[5] : h[5];
  c.max_seq_len = h[6];
  c.head_dim = c.num_heads > 0 ? c.dim / c.num_heads : 0;
  c.norm_eps = static_cast<double>(1e-5f);  // run.c uses the float literal
  c.rope_theta = 10000.0;
  c.rope_style = kernels::RopeStyle::kAdjacentPairs;
  c.tied_embeddings = shared_classifier;
  c.name = std::filesystem::path(path).stem().string();
  if (absl::Status s = c.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("llama2.c checkpoint ", path, ": bad header: ", s.message()));
  }

  const int64_t D = c.dim, F = c.hidden_dim, L = c.num_layers, V = c.vocab_size, KVD = c.kv_dim(),
                S = c.max_seq_len, Dh = c.head_dim;
  const int64_t floats = V * D + L * D + L * D * D + 2 * L * KVD * D + L * D * D + L * D +
                         3 * L * F * D + D + S * Dh + (shared_classifier ? 0 : V * D);
  const int64_t expected = kHeaderBytes + floats * 4;
  if (static_cast<int64_t>(file->size()) < expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama2.c checkpoint ", path, ": truncated: ", file->size(), " bytes, the header (dim=", D,
        " hidden_dim=", F, " n_layers=", L, " n_heads=", c.num_heads, " n_kv_heads=",
        c.num_kv_heads, " vocab_size=", h[5], " seq_len=", S, ") needs ", expected));
  }

  const uint8_t* p = file->data() + kHeaderBytes;
  auto take = [&p](int64_t rows, int64_t cols) {
    WeightView w{p, kernels::DType::kF32, rows, cols};
    p += rows * cols * 4;
    return w;
  };
  Weights& w = model->weights;
  w.layers.resize(L);
  w.token_embedding = take(V, D);
  for (auto& l : w.layers) l.attn_norm = take(1, D);
  for (auto& l : w.layers) l.wq = take(D, D);
  for (auto& l : w.layers) l.wk = take(KVD, D);
  for (auto& l : w.layers) l.wv = take(KVD, D);
  for (auto& l : w.layers) l.wo = take(D, D);
  for (auto& l : w.layers) l.ffn_norm = take(1, D);
  for (auto& l : w.layers) l.w_in = take(F, D);
  for (auto& l : w.layers) l.w_out = take(D, F);
  for (auto& l : w.layers) l.w_up = take(F, D);
  w.final_norm = take(1, D);
  take(S, Dh);  // RoPE tables: recomputed, never read
  w.output = shared_classifier ? w.token_embedding : take(V, D);
  w.storage.push_back(file);

  std::string tok_path = options.tokenizer_path;
  if (tok_path.empty()) tok_path = DefaultTokenizerPath(path, c.vocab_size);
  if (!tok_path.empty()) {
    auto tok = TokenizerFromLlama2c(tok_path, c.vocab_size);
    if (!tok.ok()) return tok.status();
    model->tokenizer = *std::move(tok);
  }
  if (absl::Status s = model->ValidateWeights(); !s.ok()) return s;
  return model;
}

}  // namespace kvlens
