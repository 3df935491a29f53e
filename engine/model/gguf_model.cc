#include "engine/model/gguf_model.h"

#include <cmath>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "engine/tokenizer/tokenizer_factory.h"

namespace kvlens {
namespace {

// Reads an integer metadata field that must be present.
absl::Status ReadInt(const GgufFile& f, const std::string& key, int& out) {
  auto v = f.GetInt(key);
  if (!v.ok()) return v.status();
  if (*v <= 0 || *v > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF metadata ", key, " = ", *v, " is out of range [1, 2^30]"));
  }
  out = static_cast<int>(*v);
  return absl::OkStatus();
}

// Gemma 2 and 3 as llama.cpp runs them. With attention.sliding_window, Gemma 2 windows
// its even layers (the odd ones see the whole context), Gemma 3 five layers of six (the
// sixth sees it all) turning with an unscaled RoPE base of 10000 (rope.freq_base and
// rope.scaling are the full layers'). Scores times 1/√head_dim, but 1/√(D/H) for the
// 27Bs (Gemma 2's 46 layers, Gemma 3's 62: Hugging Face's query_pre_attn_scalar 144 and
// 168). Gemma 2 soft-caps its scores and logits (attn_logit_softcapping,
// final_logit_softcapping: 50 and 30 when absent, as llama.cpp has them); Gemma 3 its
// logits only where final_logit_softcapping says so.
absl::Status ReadGemma23Layers(const GgufFile& f, const std::string& a, ModelConfig& c) {
  const bool gemma2 = a == "gemma2";
  c.attention_softcap = gemma2 ? 50.0 : 0.0;
  c.final_softcap = gemma2 ? 30.0 : 0.0;
  for (auto [key, out] :
       {std::pair<std::string, double*>{a + ".attn_logit_softcapping", &c.attention_softcap},
        {a + ".final_logit_softcapping", &c.final_softcap}}) {
    if (f.Find(key) != nullptr) KVLENS_ASSIGN_OR_RETURN(*out, f.GetFloat(key));
  }
  if (f.Find(a + ".attention.sliding_window") != nullptr) {
    if (auto s = ReadInt(f, a + ".attention.sliding_window", c.sliding_window); !s.ok()) {
      return s;
    }
    const int pattern = gemma2 ? 2 : 6;
    for (int l = 0; l < c.num_layers; ++l) c.windowed_layers.push_back((l + 1) % pattern != 0);
    if (!gemma2) c.rope_theta_windowed = 1e4;
  }
  if (c.num_layers == (gemma2 ? 46 : 62)) {
    c.attention_scale = 1.0 / std::sqrt(static_cast<double>(c.dim / c.num_heads));
  }
  return absl::OkStatus();
}

// {arch}.rope.scaling.type: "none", or "linear" (positions divided by rope.scaling.factor:
// every frequency's divisor in w.rope_freqs, which must not be there already).
absl::Status ReadRopeScaling(const GgufFile& f, const std::string& a, const ModelConfig& c,
                             Weights& w) {
  const std::string key = a + ".rope.scaling.type";
  if (f.Find(key) == nullptr) return absl::OkStatus();
  std::string_view type;
  KVLENS_ASSIGN_OR_RETURN(type, f.GetString(key));
  if (type == "none") return absl::OkStatus();
  if (type != "linear") {
    return absl::UnimplementedError(absl::StrCat("GGUF ", key, " = \"", std::string(type),
                                                 "\" is not supported (none, linear)"));
  }
  double factor = 0.0;
  KVLENS_ASSIGN_OR_RETURN(factor, f.GetFloat(a + ".rope.scaling.factor"));
  if (!(factor > 0.0 && factor < 1e6)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF ", a, ".rope.scaling.factor = ", factor, " must be in (0, 1e6)"));
  }
  if (!w.rope_freqs.empty()) {
    return absl::UnimplementedError(
        absl::StrCat("GGUF ", key, " = \"linear\" together with rope_freqs.weight"));
  }
  const int half = c.head_dim / 2;
  auto factors = std::shared_ptr<float[]>(new float[half]);
  for (int p = 0; p < half; ++p) factors[p] = static_cast<float>(factor);
  w.rope_freqs = WeightView{factors.get(), kernels::DType::kF32, 1, half};
  w.storage.push_back(std::shared_ptr<const void>(factors, factors.get()));
  return absl::OkStatus();
}

class TensorGetter {
 public:
  explicit TensorGetter(const GgufFile& f) : f_(f) {}
  // Required tensor with an exact shape.
  absl::StatusOr<WeightView> Get(const std::string& name, int64_t rows, int64_t cols) const {
    auto w = Optional(name);
    if (!w.ok()) return w.status();
    if (w->empty()) return absl::NotFoundError(absl::StrCat("GGUF: missing tensor ", name));
    if (absl::Status s = CheckShape(name, *w, rows, cols); !s.ok()) return s;
    return *w;
  }
  // Empty view when absent.
  absl::StatusOr<WeightView> Optional(const std::string& name) const {
    const GgufTensor* t = f_.FindTensor(name);
    if (t == nullptr) return WeightView{};
    return GgufWeightView(*t);
  }

 private:
  const GgufFile& f_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> LoadGgufModel(std::unique_ptr<GgufFile> gguf) {
  const GgufFile& f = *gguf;
  auto arch_name = f.GetString("general.architecture");
  if (!arch_name.ok()) return arch_name.status();
  const std::string a(*arch_name);
  auto model = std::make_unique<Model>();
  model->format = "gguf";
  ModelConfig& c = model->config;
  // Qwen2 is a Llama with biases on q, k and v, whose RoPE rotates half-split pairs
  // (llama.cpp's converter leaves its q and k rows unpermuted and runs NEOX rope). Qwen3
  // drops the biases and normalises each head of q and k (RMSNorm) before RoPE.
  // Phi-3 fuses q, k and v (attn_qkv) and gate and up (ffn_up), and rotates half-split
  // pairs; its sliding window (attention.sliding_window) is applied as Hugging Face applies
  // it (llama.cpp ignores it).
  // Gemma gates its feed-forward with GELU (tanh), multiplies the embeddings by √D and
  // rotates half-split pairs; llama.cpp's converter stores its RMSNorm weights plus one,
  // so they scale as a Llama's do. Gemma 3 adds RMSNorms over each head of q and k and on
  // the attention and feed-forward outputs, and layers windowed as llama.cpp has them
  // (ReadGemma23Layers). Gemma 2 has the block-output norms but no head norms, windows
  // every other layer and soft-caps its attention scores and logits.
  const bool qwen2 = a == "qwen2", qwen3 = a == "qwen3", phi3 = a == "phi3";
  const bool gemma3 = a == "gemma3", gemma23 = gemma3 || a == "gemma2";
  const bool gemma = a == "gemma" || gemma23;
  if (a == "llama" || qwen2 || qwen3 || phi3 || gemma) {
    c.arch = Architecture::kLlama;
    c.qkv_bias = qwen2;
    c.qk_norm = qwen3 || gemma3;
    c.sandwich_norms = gemma23;
    if (gemma) c.gate_activation = GateActivation::kGeluTanh;
  } else if (a == "gpt2") {
    c.arch = Architecture::kGpt2;

  } else {
    return absl::UnimplementedError(absl::StrCat(
        "GGUF general.architecture = \"", a,
        "\" is not supported (llama, qwen2, qwen3, phi3, gemma, gemma2, gemma3, gpt2)"));
  }
  c.family = a;
  if (f.tensors().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF ", f.path(), " holds no tensors (a vocabulary-only file?)"));
  }
  if (auto s = ReadInt(f, a + ".embedding_length", c.dim); !s.ok()) return s;
  if (auto s = ReadInt(f, a + ".feed_forward_length", c.hidden_dim); !s.ok()) return s;
  if (auto s = ReadInt(f, a + ".block_count", c.num_layers); !s.ok()) return s;
  if (auto s = ReadInt(f, a + ".attention.head_count", c.num_heads); !s.ok()) return s;
  if (auto s = ReadInt(f, a + ".context_length", c.max_seq_len); !s.ok()) return s;
  c.num_kv_heads = c.num_heads;
  if (f.Find(a + ".attention.head_count_kv") != nullptr) {
    if (auto s = ReadInt(f, a + ".attention.head_count_kv", c.num_kv_heads); !s.ok()) return s;
  }
  // The head size: attention.key_length where the file has it (Qwen3: 128 with a width
  // of 1024 and 16 heads), else D / H.
  c.head_dim = c.dim / c.num_heads;
  if (f.Find(a + ".attention.key_length") != nullptr) {
    if (auto s = ReadInt(f, a + ".attention.key_length", c.head_dim); !s.ok()) return s;
    int value_length = c.head_dim;
    if (f.Find(a + ".attention.value_length") != nullptr) {
      if (auto s = ReadInt(f, a + ".attention.value_length", value_length); !s.ok()) return s;
    }
    if (value_length != c.head_dim) {
      return absl::UnimplementedError(absl::StrCat(
          "GGUF ", a, ".attention.value_length = ", value_length, " differs from key_length = ",
          c.head_dim, " (heads whose values are another size are not supported)"));
    }
  }
  const std::string eps_key = c.arch == Architecture::kLlama
                                  ? a + ".attention.layer_norm_rms_epsilon"
                                  : a + ".attention.layer_norm_epsilon";
  if (f.Find(eps_key) != nullptr) KVLENS_ASSIGN_OR_RETURN(c.norm_eps, f.GetFloat(eps_key));
  if (f.Find(a + ".rope.freq_base") != nullptr) {
    KVLENS_ASSIGN_OR_RETURN(c.rope_theta, f.GetFloat(a + ".rope.freq_base"));
  }
  if (c.arch == Architecture::kLlama && f.Find(a + ".rope.dimension_count") != nullptr) {
    int rope_dims = 0;
    if (auto s = ReadInt(f, a + ".rope.dimension_count", rope_dims); !s.ok()) return s;
    if (rope_dims != c.head_dim) {
      return absl::UnimplementedError(absl::StrCat(
          "GGUF ", a, ".rope.dimension_count = ", rope_dims,
          ": partial rotary embeddings are not supported (head size ", c.head_dim, ")"));
    }
  }
  // llama.cpp's converter permutes Q/K rows so that "llama" rotates adjacent pairs.
  c.rope_style = qwen2 || qwen3 || phi3 || gemma ? kernels::RopeStyle::kHalfSplit
                                                 : kernels::RopeStyle::kAdjacentPairs;
  if (gemma) c.embedding_scale = std::sqrt(static_cast<double>(c.dim));
  if (gemma23) {
    if (absl::Status s = ReadGemma23Layers(f, a, c); !s.ok()) return s;
  }
  if (phi3 && f.Find("phi3.attention.sliding_window") != nullptr) {
    if (auto s = ReadInt(f, "phi3.attention.sliding_window", c.sliding_window); !s.ok()) return s;
    if (c.sliding_window >= c.max_seq_len) c.sliding_window = 0;  // hides nothing
  }
  if (f.Find("general.name") != nullptr) {
    auto name = f.GetString("general.name");
    if (name.ok()) c.name = std::string(*name);
  }
  if (c.name.empty()) c.name = std::filesystem::path(f.path()).stem().string();

  const TensorGetter t(f);
  Weights& w = model->weights;
  WeightView emb;
  KVLENS_ASSIGN_OR_RETURN(emb, t.Optional("token_embd.weight"));
  if (emb.empty()) return absl::NotFoundError("GGUF: missing tensor token_embd.weight");
  c.vocab_size = static_cast<int>(emb.rows);
  if (absl::Status s = c.Validate(); !s.ok()) return s;

  const int64_t D = c.dim, QD = c.q_dim(), F = c.hidden_dim, KVD = c.kv_dim(), V = c.vocab_size;
  KVLENS_ASSIGN_OR_RETURN(w.token_embedding, t.Get("token_embd.weight", V, D));
  w.layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& lw = w.layers[l];
    const std::string p = absl::StrCat("blk.", l, ".");
    KVLENS_ASSIGN_OR_RETURN(lw.attn_norm, t.Get(p + "attn_norm.weight", 1, D));
    KVLENS_ASSIGN_OR_RETURN(lw.wo, t.Get(p + "attn_output.weight", D, QD));
    KVLENS_ASSIGN_OR_RETURN(lw.ffn_norm, t.Get(p + "ffn_norm.weight", 1, D));
    KVLENS_ASSIGN_OR_RETURN(lw.w_out, t.Get(p + "ffn_down.weight", D, F));
    if (phi3) {
      // Rows q | k | v of attn_qkv (or separate tensors, as some converters write them),
      // and gate | up of ffn_up.
      WeightView qkv, up;
      KVLENS_ASSIGN_OR_RETURN(qkv, t.Optional(p + "attn_qkv.weight"));
      if (!qkv.empty()) {
        if (absl::Status s = CheckShape(p + "attn_qkv.weight", qkv, QD + 2 * KVD, D); !s.ok()) {
          return s;
        }
        lw.wq = qkv.Rows(0, QD);
        lw.wk = qkv.Rows(QD, KVD);
        lw.wv = qkv.Rows(QD + KVD, KVD);
      } else {
        KVLENS_ASSIGN_OR_RETURN(lw.wq, t.Get(p + "attn_q.weight", QD, D));
        KVLENS_ASSIGN_OR_RETURN(lw.wk, t.Get(p + "attn_k.weight", KVD, D));
        KVLENS_ASSIGN_OR_RETURN(lw.wv, t.Get(p + "attn_v.weight", KVD, D));
      }
      KVLENS_ASSIGN_OR_RETURN(up, t.Get(p + "ffn_up.weight", 2 * F, D));
      lw.w_in = up.Rows(0, F);
      lw.w_up = up.Rows(F, F);
    } else if (c.arch == Architecture::kLlama) {
      KVLENS_ASSIGN_OR_RETURN(lw.wq, t.Get(p + "attn_q.weight", QD, D));
      KVLENS_ASSIGN_OR_RETURN(lw.wk, t.Get(p + "attn_k.weight", KVD, D));
      KVLENS_ASSIGN_OR_RETURN(lw.wv, t.Get(p + "attn_v.weight", KVD, D));
      KVLENS_ASSIGN_OR_RETURN(lw.w_in, t.Get(p + "ffn_gate.weight", F, D));
      KVLENS_ASSIGN_OR_RETURN(lw.w_up, t.Get(p + "ffn_up.weight", F, D));
      if (c.qkv_bias) {  // Qwen2
        const struct {
          const char* name;
          WeightView* view;
          int64_t size;
        } biases[] = {{"attn_q.bias", &lw.bq, QD},
                      {"attn_k.bias", &lw.bk, KVD},
                      {"attn_v.bias", &lw.bv, KVD}};
        for (const auto& b : biases) {
          KVLENS_ASSIGN_OR_RETURN(*b.view, t.Get(p + b.name, 1, b.size));
          if (b.view->dtype != kernels::DType::kF32) {
            return absl::UnimplementedError(absl::StrCat(
                "GGUF tensor ", p, b.name, ": dtype ",
                std::string(kernels::DTypeName(b.view->dtype)), " (biases must be f32)"));
          }
        }
      }
      if (c.qk_norm) {  // Qwen3, Gemma 3
        KVLENS_ASSIGN_OR_RETURN(lw.q_norm, t.Get(p + "attn_q_norm.weight", 1, c.head_dim));
        KVLENS_ASSIGN_OR_RETURN(lw.k_norm, t.Get(p + "attn_k_norm.weight", 1, c.head_dim));
      }
      if (c.sandwich_norms) {  // Gemma 2, 3
        KVLENS_ASSIGN_OR_RETURN(lw.post_attn_norm, t.Get(p + "post_attention_norm.weight", 1, D));
        KVLENS_ASSIGN_OR_RETURN(lw.post_ffn_norm, t.Get(p + "post_ffw_norm.weight", 1, D));
      }
    } else {
      // GPT-2 keeps Q, K and V fused: rows [0, D) are Q, [D, 2D) K, [2D, 3D) V.
      WeightView qkv, qkv_b;
      KVLENS_ASSIGN_OR_RETURN(qkv, t.Get(p + "attn_qkv.weight", 3 * D, D));
      KVLENS_ASSIGN_OR_RETURN(qkv_b, t.Get(p + "attn_qkv.bias", 1, 3 * D));
      if (qkv_b.dtype != kernels::DType::kF32) {
        return absl::UnimplementedError(absl::StrCat("GGUF tensor ", p, "attn_qkv.bias: dtype ",
                                                     std::string(kernels::DTypeName(qkv_b.dtype)),
                                                     " (biases must be f32)"));
      }
      lw.wq = qkv.Rows(0, D);
      lw.wk = qkv.Rows(D, D);
      lw.wv = qkv.Rows(2 * D, D);
      const auto* bias = static_cast<const float*>(qkv_b.data);
      lw.bq = WeightView{bias, kernels::DType::kF32, 1, D};
      lw.bk = WeightView{bias + D, kernels::DType::kF32, 1, D};
      lw.bv = WeightView{bias + 2 * D, kernels::DType::kF32, 1, D};
      KVLENS_ASSIGN_OR_RETURN(lw.attn_norm_bias, t.Get(p + "attn_norm.bias", 1, D));
      KVLENS_ASSIGN_OR_RETURN(lw.bo, t.Get(p + "attn_output.bias", 1, D));
      KVLENS_ASSIGN_OR_RETURN(lw.ffn_norm_bias, t.Get(p + "ffn_norm.bias", 1, D));
      KVLENS_ASSIGN_OR_RETURN(lw.w_in, t.Get(p + "ffn_up.weight", F, D));
      KVLENS_ASSIGN_OR_RETURN(lw.b_in, t.Get(p + "ffn_up.bias", 1, F));
      KVLENS_ASSIGN_OR_RETURN(lw.b_out, t.Get(p + "ffn_down.bias", 1, D));
    }
  }
  KVLENS_ASSIGN_OR_RETURN(w.final_norm, t.Get("output_norm.weight", 1, D));
  if (c.arch == Architecture::kLlama) {
    // Llama 3.1's rope scaling: per-pair divisors of the frequencies (ModelConfig checks
    // the shape, type and values).
    KVLENS_ASSIGN_OR_RETURN(w.rope_freqs, t.Optional("rope_freqs.weight"));
    if (absl::Status s = ReadRopeScaling(f, a, c, w); !s.ok()) return s;
  }
  for (const char* name : {"rope_factors_long.weight", "rope_factors_short.weight"}) {
    WeightView factors;
    KVLENS_ASSIGN_OR_RETURN(factors, t.Optional(name));
    if (!factors.empty()) {
      return absl::UnimplementedError(
          absl::StrCat("GGUF tensor ", name,
                       ": LongRoPE (Phi-3's 128k-context variants, Phi-3.5) is not supported"));
    }
  }
  if (c.arch == Architecture::kGpt2) {
    KVLENS_ASSIGN_OR_RETURN(w.final_norm_bias, t.Get("output_norm.bias", 1, D));
    KVLENS_ASSIGN_OR_RETURN(w.position_embedding, t.Get("position_embd.weight", c.max_seq_len, D));
  }
  KVLENS_ASSIGN_OR_RETURN(w.output, t.Optional("output.weight"));
  c.tied_embeddings = w.output.empty();
  if (c.tied_embeddings) {
    w.output = w.token_embedding;
  } else if (absl::Status s = CheckShape("output.weight", w.output, V, D); !s.ok()) {
    return s;
  }
  w.storage.push_back(f.file());

  if (f.Find("tokenizer.ggml.model") != nullptr) {
    auto tok = TokenizerFromGguf(f);
    if (!tok.ok()) return tok.status();
    model->tokenizer = *std::move(tok);
  }
  if (absl::Status s = model->ValidateWeights(); !s.ok()) return s;
  return model;
}

}  // namespace kvlens
