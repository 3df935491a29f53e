#include "engine/model/hf_model.h"

#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <set>
#include <tuple>
#include <type_traits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/model/safetensors.h"
#include "engine/status_macros.h"
#include "engine/tokenizer/tokenizer_json.h"
#include "kernels/weight.h"
#include "nlohmann/json.hpp"

namespace kvlens {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

absl::StatusOr<json> ReadJson(const fs::path& p) {
  std::ifstream in(p);
  if (!in) return absl::NotFoundError(absl::StrCat("missing ", p.string()));
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(p.string(), ": invalid JSON: ", e.what()));
  }
}

// An integer config field: required unless `fallback` is given.
absl::Status ConfigInt(const json& cfg, std::initializer_list<const char*> keys, int& out,
                       std::optional<int> fallback = std::nullopt) {
  for (const char* k : keys) {
    if (cfg.contains(k) && !cfg[k].is_null()) {
      if (!cfg[k].is_number_integer()) {
        return absl::InvalidArgumentError(absl::StrCat("config.json: ", k, " is not an integer"));
      }
      // get<int>() would wrap a value past int silently (2^32 + 8 → 8)
      const bool fits = cfg[k].is_number_unsigned()
                            ? cfg[k].get<uint64_t>() <= INT_MAX
                            : cfg[k].get<int64_t>() >= INT_MIN && cfg[k].get<int64_t>() <= INT_MAX;
      if (!fits) {
        return absl::InvalidArgumentError(
            absl::StrCat("config.json: ", k, " = ", cfg[k].dump(), " is outside the range of int"));
      }
      out = cfg[k].get<int>();
      return absl::OkStatus();
    }
  }
  if (fallback) {
    out = *fallback;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("config.json: missing ", *keys.begin()));
}

double ConfigFloat(const json& cfg, const char* key, double fallback) {
  return cfg.contains(key) && cfg[key].is_number() ? cfg[key].get<double>() : fallback;
}

// A string or bool config field, `fallback` when absent or null. (json::value() would
// throw on a value of another type.)
template <typename T>
absl::Status ConfigValue(const json& cfg, const char* key, T& out, T fallback) {
  out = fallback;
  if (!cfg.contains(key) || cfg[key].is_null()) return absl::OkStatus();
  const bool ok = std::is_same_v<T, bool> ? cfg[key].is_boolean() : cfg[key].is_string();
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " is not a ",
                                                   std::is_same_v<T, bool> ? "bool" : "string"));
  }
  out = cfg[key].get<T>();
  return absl::OkStatus();
}

// All tensors of a directory by name, from one file or from the shards an index lists.
class TensorSet {
 public:
  absl::Status Open(const fs::path& dir) {
    std::set<std::string> files;
    std::map<std::string, std::string> weight_map;  // tensor → shard, as the index says
    const fs::path index = dir / "model.safetensors.index.json";
    if (fs::exists(index)) {
      auto j = ReadJson(index);
      if (!j.ok()) return j.status();
      if (!j->contains("weight_map") || !(*j)["weight_map"].is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(index.string(), ": missing weight_map"));
      }
      for (auto it = (*j)["weight_map"].begin(); it != (*j)["weight_map"].end(); ++it) {
        if (!it.value().is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(index.string(), ": weight_map.", it.key(), " is not a file name"));
        }
        const std::string f = it.value().get<std::string>();
        if (f.find('/') != std::string::npos || f.find("..") != std::string::npos) {
          return absl::InvalidArgumentError(
              absl::StrCat(index.string(), ": shard name ", f, " must be a plain file name"));
        }
        files.insert(f);
        weight_map.emplace(it.key(), f);
      }
    } else {
      for (const auto& e : fs::directory_iterator(dir)) {
        if (e.path().extension() == ".safetensors") files.insert(e.path().filename().string());
      }
    }
    if (files.empty()) {
      return absl::NotFoundError(absl::StrCat("no *.safetensors files in ", dir.string()));
    }
    std::map<std::string, const SafetensorsFile*> by_file;
    for (const std::string& f : files) {
      auto st = SafetensorsFile::Open((dir / f).string());
      if (!st.ok()) return st.status();
      by_file[f] = st->get();
      for (const auto& [name, t] : (*st)->tensors()) {
        if (!by_name_.emplace(name, &t).second) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor ", name, " appears in two shards"));
        }
      }
      files_.push_back(*std::move(st));
    }
    // An index that disagrees with its shards is a broken download or a hand-edited file.
    for (const auto& [name, f] : weight_map) {
      if (by_file.at(f)->Find(name) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(index.string(), ": weight_map puts tensor ",
                                                       name, " in ", f,
                                                       ", which does not hold it"));
      }
    }
    return absl::OkStatus();
  }

  const SafetensorsTensor* Find(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
  }

  // A tensor that must exist with `shape`.
  absl::StatusOr<WeightView> Get(const std::string& name, std::vector<int64_t> shape) const {
    const SafetensorsTensor* t = Find(name);
    if (t == nullptr) return absl::NotFoundError(absl::StrCat("missing tensor ", name));
    if (t->shape != shape) {
      auto dims = [](const std::vector<int64_t>& s) {
        std::string out = "[";
        for (size_t i = 0; i < s.size(); ++i) absl::StrAppend(&out, i ? ", " : "", s[i]);
        return out + "]";
      };
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": expected shape ",
                                                     dims(shape), ", got ", dims(t->shape)));
    }
    return SafetensorsWeightView(*t);
  }

  void KeepAlive(std::vector<std::shared_ptr<const void>>& storage) const {
    for (const auto& f : files_) storage.push_back(f->file());
  }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsTensor*> by_name_;
};

// GPT-2's Conv1D stores [in, out]; kvlens wants [out, in]. Copies transposed, same dtype.
WeightView Transposed(const WeightView& w, std::vector<std::shared_ptr<const void>>& storage) {
  const int64_t elem = kernels::DTypeRowBytes(w.dtype, 1);
  auto buf = std::shared_ptr<uint8_t[]>(new uint8_t[w.rows * w.cols * elem]);
  const auto* src = static_cast<const uint8_t*>(w.data);
  for (int64_t r = 0; r < w.rows; ++r) {
    for (int64_t c = 0; c < w.cols; ++c) {
      std::memcpy(buf.get() + (c * w.rows + r) * elem, src + (r * w.cols + c) * elem, elem);
    }
  }
  storage.push_back(std::shared_ptr<const void>(buf, buf.get()));
  return WeightView{buf.get(), w.dtype, w.cols, w.rows};
}

// Columns [first, first + count) of a one-row vector (unquantised dtypes only).
WeightView VectorSlice(const WeightView& v, int64_t first, int64_t count) {
  const int64_t elem = kernels::DTypeRowBytes(v.dtype, 1);
  return WeightView{static_cast<const uint8_t*>(v.data) + first * elem, v.dtype, 1, count};
}

// Gemma's RMSNorm scales by (1 + weight), computed in float32 (Hugging Face's
// GemmaRMSNorm): an f32 copy of the vector holding 1 + weight.
WeightView OnePlus(const WeightView& v, std::vector<std::shared_ptr<const void>>& storage) {
  auto buf = std::shared_ptr<float[]>(new float[v.cols]);
  kernels::DequantizeRow(v, 0, buf.get());
  for (int64_t i = 0; i < v.cols; ++i) buf[i] = 1.0f + buf[i];
  storage.push_back(std::shared_ptr<const void>(buf, buf.get()));
  return WeightView{buf.get(), kernels::DType::kF32, 1, v.cols};
}

absl::Status LoadGpt2Weights(const TensorSet& ts, const ModelConfig& c, Weights& w) {
  const int64_t D = c.dim, F = c.hidden_dim, V = c.vocab_size;
  // Checkpoints saved from GPT2LMHeadModel name tensors "transformer.wte.weight", …; those
  // saved from the bare GPT2Model (openai-community/gpt2 itself) have no prefix.
  const std::string t =
      ts.Find("transformer.wte.weight") == nullptr && ts.Find("wte.weight") != nullptr
          ? ""
          : "transformer.";
  WeightView tmp;
  KVLENS_ASSIGN_OR_RETURN(w.token_embedding, ts.Get(t + "wte.weight", {V, D}));
  KVLENS_ASSIGN_OR_RETURN(w.position_embedding, ts.Get(t + "wpe.weight", {c.max_seq_len, D}));
  w.layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& lw = w.layers[l];
    const std::string p = absl::StrCat(t, "h.", l, ".");
    KVLENS_ASSIGN_OR_RETURN(lw.attn_norm, ts.Get(p + "ln_1.weight", {D}));
    KVLENS_ASSIGN_OR_RETURN(lw.attn_norm_bias, ts.Get(p + "ln_1.bias", {D}));
    KVLENS_ASSIGN_OR_RETURN(tmp, ts.Get(p + "attn.c_attn.weight", {D, 3 * D}));
    const WeightView qkv = Transposed(tmp, w.storage);  // [3D, D]: Q rows, K rows, V rows
    lw.wq = qkv.Rows(0, D);
    lw.wk = qkv.Rows(D, D);
    lw.wv = qkv.Rows(2 * D, D);
    KVLENS_ASSIGN_OR_RETURN(tmp, ts.Get(p + "attn.c_attn.bias", {3 * D}));
    lw.bq = VectorSlice(tmp, 0, D);
    lw.bk = VectorSlice(tmp, D, D);
    lw.bv = VectorSlice(tmp, 2 * D, D);
    KVLENS_ASSIGN_OR_RETURN(tmp, ts.Get(p + "attn.c_proj.weight", {D, D}));
    lw.wo = Transposed(tmp, w.storage);
    KVLENS_ASSIGN_OR_RETURN(lw.bo, ts.Get(p + "attn.c_proj.bias", {D}));
    KVLENS_ASSIGN_OR_RETURN(lw.ffn_norm, ts.Get(p + "ln_2.weight", {D}));
    KVLENS_ASSIGN_OR_RETURN(lw.ffn_norm_bias, ts.Get(p + "ln_2.bias", {D}));
    KVLENS_ASSIGN_OR_RETURN(tmp, ts.Get(p + "mlp.c_fc.weight", {D, F}));
    lw.w_in = Transposed(tmp, w.storage);
    KVLENS_ASSIGN_OR_RETURN(lw.b_in, ts.Get(p + "mlp.c_fc.bias", {F}));
    KVLENS_ASSIGN_OR_RETURN(tmp, ts.Get(p + "mlp.c_proj.weight", {F, D}));
    lw.w_out = Transposed(tmp, w.storage);
    KVLENS_ASSIGN_OR_RETURN(lw.b_out, ts.Get(p + "mlp.c_proj.bias", {D}));
  }
  KVLENS_ASSIGN_OR_RETURN(w.final_norm, ts.Get(t + "ln_f.weight", {D}));
  KVLENS_ASSIGN_OR_RETURN(w.final_norm_bias, ts.Get(t + "ln_f.bias", {D}));
  // Tied unless config.json says otherwise; an untied head must be in the files.
  w.output = w.token_embedding;
  if (!c.tied_embeddings || ts.Find("lm_head.weight") != nullptr) {
    KVLENS_ASSIGN_OR_RETURN(w.output, ts.Get("lm_head.weight", {V, D}));
  }
  return absl::OkStatus();
}

absl::Status LoadLlamaWeights(const TensorSet& ts, const ModelConfig& c, Weights& w) {
  const int64_t D = c.dim, QD = c.q_dim(), F = c.hidden_dim, V = c.vocab_size, KVD = c.kv_dim();
  // Gemma 3's multimodal checkpoints keep the language model under a prefix of its own.
  std::string m = "model.";
  for (const char* prefix : {"language_model.model.", "model.language_model."}) {
    if (ts.Find(m + "embed_tokens.weight") == nullptr &&
        ts.Find(absl::StrCat(prefix, "embed_tokens.weight")) != nullptr) {
      m = prefix;
    }
  }
  KVLENS_ASSIGN_OR_RETURN(w.token_embedding, ts.Get(m + "embed_tokens.weight", {V, D}));
  w.layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& lw = w.layers[l];
    const std::string p = absl::StrCat(m, "layers.", l, ".");
    KVLENS_ASSIGN_OR_RETURN(lw.attn_norm, ts.Get(p + "input_layernorm.weight", {D}));
    if (c.family == "phi3") {  // rows q | k | v of qkv_proj, gate | up of gate_up_proj
      WeightView qkv, gate_up;
      KVLENS_ASSIGN_OR_RETURN(qkv, ts.Get(p + "self_attn.qkv_proj.weight", {QD + 2 * KVD, D}));
      KVLENS_ASSIGN_OR_RETURN(gate_up, ts.Get(p + "mlp.gate_up_proj.weight", {2 * F, D}));
      lw.wq = qkv.Rows(0, QD);
      lw.wk = qkv.Rows(QD, KVD);
      lw.wv = qkv.Rows(QD + KVD, KVD);
      lw.w_in = gate_up.Rows(0, F);
      lw.w_up = gate_up.Rows(F, F);
    } else {
      KVLENS_ASSIGN_OR_RETURN(lw.wq, ts.Get(p + "self_attn.q_proj.weight", {QD, D}));
      KVLENS_ASSIGN_OR_RETURN(lw.wk, ts.Get(p + "self_attn.k_proj.weight", {KVD, D}));
      KVLENS_ASSIGN_OR_RETURN(lw.wv, ts.Get(p + "self_attn.v_proj.weight", {KVD, D}));
      KVLENS_ASSIGN_OR_RETURN(lw.w_in, ts.Get(p + "mlp.gate_proj.weight", {F, D}));
      KVLENS_ASSIGN_OR_RETURN(lw.w_up, ts.Get(p + "mlp.up_proj.weight", {F, D}));
    }
    KVLENS_ASSIGN_OR_RETURN(lw.wo, ts.Get(p + "self_attn.o_proj.weight", {D, QD}));
    if (c.sandwich_norms) {  // Gemma 2, 3: post_attention_layernorm is the attention output's
      KVLENS_ASSIGN_OR_RETURN(lw.post_attn_norm,
                              ts.Get(p + "post_attention_layernorm.weight", {D}));
      KVLENS_ASSIGN_OR_RETURN(lw.ffn_norm, ts.Get(p + "pre_feedforward_layernorm.weight", {D}));
      KVLENS_ASSIGN_OR_RETURN(lw.post_ffn_norm,
                              ts.Get(p + "post_feedforward_layernorm.weight", {D}));
    } else {
      KVLENS_ASSIGN_OR_RETURN(lw.ffn_norm, ts.Get(p + "post_attention_layernorm.weight", {D}));
    }
    KVLENS_ASSIGN_OR_RETURN(lw.w_out, ts.Get(p + "mlp.down_proj.weight", {D, F}));
    if (c.qkv_bias) {  // Qwen2
      KVLENS_ASSIGN_OR_RETURN(lw.bq, ts.Get(p + "self_attn.q_proj.bias", {QD}));
      KVLENS_ASSIGN_OR_RETURN(lw.bk, ts.Get(p + "self_attn.k_proj.bias", {KVD}));
      KVLENS_ASSIGN_OR_RETURN(lw.bv, ts.Get(p + "self_attn.v_proj.bias", {KVD}));
    }
    if (c.qk_norm) {  // Qwen3
      KVLENS_ASSIGN_OR_RETURN(lw.q_norm, ts.Get(p + "self_attn.q_norm.weight", {c.head_dim}));
      KVLENS_ASSIGN_OR_RETURN(lw.k_norm, ts.Get(p + "self_attn.k_norm.weight", {c.head_dim}));
    }
  }
  KVLENS_ASSIGN_OR_RETURN(w.final_norm, ts.Get(m + "norm.weight", {D}));
  if (absl::StartsWith(c.family, "gemma")) {  // Gemma's norms (1, 2, 3): 1 + weight
    for (LayerWeights& lw : w.layers) {
      for (WeightView* v : {&lw.attn_norm, &lw.ffn_norm, &lw.post_attn_norm, &lw.post_ffn_norm,
                            &lw.q_norm, &lw.k_norm}) {
        if (!v->empty()) *v = OnePlus(*v, w.storage);
      }
    }
    w.final_norm = OnePlus(w.final_norm, w.storage);
  }
  w.output = w.token_embedding;
  if (!c.tied_embeddings || ts.Find("lm_head.weight") != nullptr) {
    KVLENS_ASSIGN_OR_RETURN(w.output, ts.Get("lm_head.weight", {V, D}));
  }
  return absl::OkStatus();
}

// Gemma's gate: hidden_activation where config.json has it (gelu_pytorch_tanh, or its
// twin gelu_new), else GELU's tanh approximation whatever hidden_act says, as Hugging
// Face's Gemma has done since its first configs said "gelu" (and llama.cpp does).
absl::Status ReadGemmaActivation(const json& cfg) {
  std::string act;
  if (auto s = ConfigValue<std::string>(cfg, "hidden_activation", act, "gelu_pytorch_tanh");
      !s.ok())
    return s;
  if (act != "gelu_pytorch_tanh" && act != "gelu_new") {
    return absl::UnimplementedError(absl::StrCat("config.json: hidden_activation \"", act,
                                                 "\" is not supported (gelu_pytorch_tanh)"));
  }
  return absl::OkStatus();
}

// Gemma 3 (config.json's model_type "gemma3_text", or the text_config of a multimodal
// "gemma3"; fields it leaves out take Gemma3TextConfig's defaults): a Gemma whose q and k
// heads are RMS-normed, whose attention and feed-forward outputs are normed before their
// residual adds, whose attention scale is query_pre_attn_scalar^−1/2, and whose layers
// attend within sliding_window but every sliding_window_pattern-th (layer_types, where
// given) over the whole context, rotating with rope_local_base_freq in the window and
// rope_theta (and rope_scaling) outside it.
// Gemma 2 (model_type "gemma2", Gemma2Config's defaults) is the same without the head norms
// or a RoPE base of its own for the window, every other layer windowed (the first one
// too), and its attention scores and logits soft-capped (attn_logit_softcapping 50,
// final_logit_softcapping 30; null: none).
absl::Status ReadGemma23Config(const json& t, bool gemma2, ModelConfig& c) {
  if (!t.is_object())
    return absl::InvalidArgumentError("config.json: text_config is not an object");
  for (auto [key, out, fallback] :
       {std::tuple<const char*, double*, double>{"attn_logit_softcapping", &c.attention_softcap,
                                                 gemma2 ? 50.0 : 0.0},
        {"final_logit_softcapping", &c.final_softcap, gemma2 ? 30.0 : 0.0}}) {
    *out = fallback;
    if (t.contains(key) && !t[key].is_null()) {
      if (!t[key].is_number() || !(t[key].get<double>() > 0.0)) {
        return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, " = ", t[key].dump(),
                                                       " (a positive number or null)"));
      }
      *out = t[key].get<double>();
    } else if (t.contains(key)) {
      *out = 0.0;  // null: none
    }
  }
  if (absl::Status s = ReadGemmaActivation(t); !s.ok()) return s;
  c.arch = Architecture::kLlama;
  c.gate_activation = GateActivation::kGeluTanh;
  c.qk_norm = !gemma2;
  c.sandwich_norms = true;
  c.rope_style = kernels::RopeStyle::kHalfSplit;
  for (const auto& [key, out, fallback] :
       {std::tuple<const char*, int*, int>{"hidden_size", &c.dim, 2304},
        {"intermediate_size", &c.hidden_dim, 9216},
        {"num_hidden_layers", &c.num_layers, 26},
        {"num_attention_heads", &c.num_heads, 8},
        {"num_key_value_heads", &c.num_kv_heads, 4},
        {"head_dim", &c.head_dim, 256},
        {"vocab_size", &c.vocab_size, gemma2 ? 256000 : 262208},
        {"max_position_embeddings", &c.max_seq_len, gemma2 ? 8192 : 131072},
        {"sliding_window", &c.sliding_window, 4096}}) {
    if (absl::Status s = ConfigInt(t, {key}, *out, fallback); !s.ok()) return s;
  }
  if (c.sliding_window <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: sliding_window = ", c.sliding_window, " (a positive number of keys)"));
  }
  if (c.num_layers > 0 && t.contains("layer_types") && !t["layer_types"].is_null()) {
    const json& types = t["layer_types"];
    if (!types.is_array() || static_cast<int>(types.size()) != c.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: layer_types must list one type per layer (", c.num_layers, ")"));
    }
    for (const json& type : types) {
      if (type != "sliding_attention" && type != "full_attention") {
        return absl::InvalidArgumentError(absl::StrCat("config.json: layer_types entry ",
                                                       type.dump(),
                                                       " (sliding_attention or full_attention)"));
      }
      c.windowed_layers.push_back(type == "sliding_attention");
    }
  } else if (c.num_layers > 0) {
    int pattern = gemma2 ? 2 : 6;
    if (absl::Status s = ConfigInt(t, {"sliding_window_pattern"}, pattern, pattern); !s.ok()) {
      return s;
    }
    if (pattern <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: sliding_window_pattern = ", pattern, " must be positive"));
    }
    for (int l = 0; l < c.num_layers; ++l) c.windowed_layers.push_back((l + 1) % pattern != 0);
  }
  c.norm_eps = ConfigFloat(t, "rms_norm_eps", 1e-6);
  c.rope_theta = ConfigFloat(t, "rope_theta", gemma2 ? 1e4 : 1e6);
  c.rope_theta_windowed = gemma2 ? 0.0 : ConfigFloat(t, "rope_local_base_freq", 1e4);
  const double query_scalar = ConfigFloat(t, "query_pre_attn_scalar", 256.0);
  if (!(query_scalar > 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: query_pre_attn_scalar = ", query_scalar, " must be positive"));
  }
  c.attention_scale = 1.0 / std::sqrt(query_scalar);
  if (auto s = ConfigValue(t, "tie_word_embeddings", c.tied_embeddings, true); !s.ok()) return s;
  c.embedding_scale = std::sqrt(static_cast<double>(c.dim));
  return absl::OkStatus();
}

// The config whose fields describe the language model: a multimodal Gemma 3's text_config,
// else the file's own.
const json& TextConfig(const json& cfg) {
  if (cfg.is_object() && cfg.value("model_type", json()) == "gemma3" &&
      cfg.contains("text_config")) {
    return cfg["text_config"];
  }
  return cfg;
}

absl::Status ReadConfig(const json& cfg, ModelConfig& c) {
  if (!cfg.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  std::string type;
  if (auto s = ConfigValue<std::string>(cfg, "model_type", type, ""); !s.ok()) return s;
  const char* dim_key = "hidden_size";
  const char* heads_key = "num_attention_heads";
  if (type == "gemma2" || type == "gemma3_text" || type == "gemma3") {
    if (type == "gemma3" && !cfg.contains("text_config")) {
      return absl::InvalidArgumentError("config.json: model_type gemma3 without a text_config");
    }
    if (absl::Status s = ReadGemma23Config(TextConfig(cfg), type == "gemma2", c); !s.ok()) {
      return s;
    }
  } else if (type == "gpt2") {
    dim_key = "n_embd";
    heads_key = "n_head";
    c.arch = Architecture::kGpt2;
    if (auto s = ConfigInt(cfg, {"n_embd"}, c.dim); !s.ok()) return s;
    if (auto s = ConfigInt(cfg, {"n_layer"}, c.num_layers); !s.ok()) return s;
    if (auto s = ConfigInt(cfg, {"n_head"}, c.num_heads); !s.ok()) return s;
    if (auto s = ConfigInt(cfg, {"n_positions", "n_ctx"}, c.max_seq_len); !s.ok()) return s;
    if (auto s = ConfigInt(cfg, {"vocab_size"}, c.vocab_size); !s.ok()) return s;
    if (auto s = ConfigInt(cfg, {"n_inner"}, c.hidden_dim, 4 * c.dim); !s.ok()) return s;
    c.num_kv_heads = c.num_heads;
    c.norm_eps = ConfigFloat(cfg, "layer_norm_epsilon", 1e-5);
    std::string act;
    if (auto s = ConfigValue<std::string>(cfg, "activation_function", act, "gelu_new"); !s.ok())
      return s;
    if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
      return absl::UnimplementedError(absl::StrCat("config.json: activation_function \"", act,
                                                   "\" is not supported (gelu_new)"));
    }
    if (auto s = ConfigValue(cfg, "tie_word_embeddings", c.tied_embeddings, true); !s.ok())
      return s;
  } else if (type == "llama" || type == "qwen2" || type == "qwen3" || type == "mistral" ||
             type == "phi3" || type == "gemma") {
    // Qwen2: a Llama with biases on q, k and v; Qwen3: no biases, an RMSNorm over each head
    // of q and k; Mistral: a Llama, with a sliding window in 7B v0.1; Phi-3: a Llama whose
    // q, k, v and gate, up are fused, with a sliding window (Qwen2's per-layer windows,
    // use_sliding_window, are not implemented); Gemma: a Llama with a GeGLU feed-forward,
    // embeddings times √hidden_size, RMSNorms scaling by 1 + weight (LoadLlamaWeights)
    // and, by default, tied embeddings.
    c.arch = Architecture::kLlama;
    if (type == "gemma") {
      if (absl::Status s = ReadGemmaActivation(cfg); !s.ok()) return s;
      c.gate_activation = GateActivation::kGeluTanh;
    }
    c.qkv_bias = type == "qwen2";
    c.qk_norm = type == "qwen3";
    bool sliding = false;
    if (auto s = ConfigValue(cfg, "use_sliding_window", sliding, false); !s.ok()) return s;
    if (sliding) {
      return absl::UnimplementedError("config.json: use_sliding_window = true is not supported");
    }
    bool attention_bias = false;
    if (auto s = ConfigValue(cfg, "attention_bias", attention_bias, false); !s.ok()) return s;
    if (attention_bias && type != "qwen2") {
      return absl::UnimplementedError("config.json: attention_bias = true is not supported");
    }
    const double rotary = ConfigFloat(cfg, "partial_rotary_factor", 1.0);
    if (rotary != 1.0) {  // Phi-4-mini: 0.75
      return absl::UnimplementedError(absl::StrCat("config.json: partial_rotary_factor = ", rotary,
                                                   " is not supported (RoPE over the whole head)"));
    }
    if (auto s = ConfigInt(cfg, {"hidden_size"}, c.dim); !s.ok()) return s;
    if (auto s = ConfigInt(cfg, {"intermediate_size"}, c.hidden_dim); !s.ok()) return s;
    if (auto s = ConfigInt(cfg, {"num_hidden_layers"}, c.num_layers); !s.ok()) return s;
    if (auto s = ConfigInt(cfg, {"num_attention_heads"}, c.num_heads); !s.ok()) return s;
    if (auto s = ConfigInt(cfg, {"num_key_value_heads"}, c.num_kv_heads, c.num_heads); !s.ok())
      return s;
    if (auto s = ConfigInt(cfg, {"max_position_embeddings"}, c.max_seq_len); !s.ok()) return s;
    // Mistral 7B v0.1 lets a query see only its last sliding_window positions (4096; v0.2
    // and later set null), Phi-3 mini its last 2047; a window as long as the context hides
    // nothing.
    if (type == "mistral" || type == "phi3") {
      int window = 0;
      if (auto s = ConfigInt(cfg, {"sliding_window"}, window, 0); !s.ok()) return s;
      if (window < 0 ||
          (window == 0 && cfg.contains("sliding_window") && !cfg["sliding_window"].is_null())) {
        return absl::InvalidArgumentError(absl::StrCat("config.json: sliding_window = ", window,
                                                       " (a positive number of keys, or null)"));
      }
      if (window > 0 && window < c.max_seq_len) c.sliding_window = window;
    }
    if (auto s = ConfigInt(cfg, {"vocab_size"}, c.vocab_size); !s.ok()) return s;
    c.norm_eps = ConfigFloat(cfg, "rms_norm_eps", 1e-6);
    c.rope_theta = ConfigFloat(cfg, "rope_theta", 10000.0);
    c.rope_style = kernels::RopeStyle::kHalfSplit;
    if (auto s = ConfigValue(cfg, "tie_word_embeddings", c.tied_embeddings, type == "gemma");
        !s.ok())
      return s;
    if (type == "gemma") c.embedding_scale = std::sqrt(static_cast<double>(c.dim));
  } else {
    return absl::UnimplementedError(absl::StrCat(
        "config.json: model_type \"", type,
        "\" is not supported (gemma, gemma2, gemma3, gemma3_text, gpt2, llama, mistral, "
        "phi3, qwen2, qwen3)"));
  }
  c.family = type;
  // The head size: head_dim where config.json has it (Qwen3: 128 with hidden_size 1024
  // and 16 heads), else hidden_size / heads.
  const bool own_head_dim =
      c.arch == Architecture::kLlama && cfg.contains("head_dim") && !cfg["head_dim"].is_null();
  if (type == "gemma2" || type == "gemma3_text" || type == "gemma3") {
    // ReadGemma23Config read head_dim (the default: 256)
  } else if (own_head_dim) {
    if (auto s = ConfigInt(cfg, {"head_dim"}, c.head_dim); !s.ok()) return s;
  } else {
    if (c.num_heads > 0 && c.dim % c.num_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: ", dim_key, " = ", c.dim,
                                                     " is not a multiple of ", heads_key, " = ",
                                                     c.num_heads));
    }
    c.head_dim = c.num_heads > 0 ? c.dim / c.num_heads : 0;
  }
  return c.Validate();
}

}  // namespace

// config.json's rope_scaling for a Llama: null, or Llama 3.1's "llama3" (rope_type, or the
// older "type"), whose per-pair divisors of the frequencies it computes into w.rope_freqs
// (as Hugging Face's _compute_llama3_parameters and llama.cpp's converter do): 1 where a
// pair's wavelength 2π/freq is under original/high_freq_factor, `factor` where it is over
// original/low_freq_factor, and 1/((1 − s)/factor + s) between them, s = (original/wavelength
// − low) / (high − low); or "linear" (Gemma 3's global layers), which divides every
// frequency by `factor` (positions divided by it). Other rope types are UNIMPLEMENTED,
// naming them.
absl::Status ReadRopeScaling(const json& cfg, const ModelConfig& c, Weights& w) {
  if (!cfg.contains("rope_scaling") || cfg["rope_scaling"].is_null()) return absl::OkStatus();
  const json& rs = cfg["rope_scaling"];
  if (!rs.is_object()) {
    return absl::InvalidArgumentError("config.json: rope_scaling is not an object");
  }
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    if (absl::Status s = ConfigValue<std::string>(rs, key, type, type); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: rope_scaling.", key, " is not a string"));
    }
    if (!type.empty()) break;
  }
  const int half = c.head_dim / 2;
  auto factors = std::shared_ptr<float[]>(new float[half]);
  auto keep = [&] {
    w.rope_freqs = WeightView{factors.get(), kernels::DType::kF32, 1, half};
    w.storage.push_back(std::shared_ptr<const void>(factors, factors.get()));
    return absl::OkStatus();
  };
  if (type == "linear") {
    if (!rs.contains("factor") || !rs["factor"].is_number() || !(rs["factor"].get<double>() > 0)) {
      return absl::InvalidArgumentError(
          "config.json: rope_scaling.factor must be a positive number");
    }
    for (int p = 0; p < half; ++p) factors[p] = static_cast<float>(rs["factor"].get<double>());
    return keep();
  }
  if (type != "llama3") {
    return absl::UnimplementedError(absl::StrCat("config.json: rope_scaling.rope_type \"", type,
                                                 "\" is not supported (llama3, linear)"));
  }
  double v[4];
  const char* keys[4] = {"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"};
  for (int i = 0; i < 4; ++i) {
    if (!rs.contains(keys[i]) || !rs[keys[i]].is_number() || !(rs[keys[i]].get<double>() > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: rope_scaling.", keys[i], " must be a positive number"));
    }
    v[i] = rs[keys[i]].get<double>();
  }
  const double factor = v[0], low = v[1], high = v[2], original = v[3];
  if (!(high > low)) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: rope_scaling.high_freq_factor = ",
                                                   high, " must exceed low_freq_factor = ", low));
  }
  for (int p = 0; p < half; ++p) {
    const double wavelength =
        2.0 * std::numbers::pi / kernels::RopeSpec{c.rope_theta}.Frequency(p, c.head_dim);
    double divisor = 1.0;
    if (wavelength > original / low) {
      divisor = factor;
    } else if (wavelength >= original / high) {
      const double s = (original / wavelength - low) / (high - low);
      divisor = 1.0 / ((1.0 - s) / factor + s);
    }
    factors[p] = static_cast<float>(divisor);
  }
  return keep();
}

absl::StatusOr<std::unique_ptr<Model>> LoadHfModel(const std::string& dir) {
  auto cfg = ReadJson(fs::path(dir) / "config.json");
  if (!cfg.ok()) return cfg.status();
  auto model = std::make_unique<Model>();
  model->format = "safetensors";
  ModelConfig& c = model->config;
  if (absl::Status s = ReadConfig(*cfg, c); !s.ok()) return s;
  c.name = fs::path(dir).filename().string();
  if (c.name.empty()) c.name = fs::path(dir).parent_path().filename().string();

  TensorSet ts;
  if (absl::Status s = ts.Open(dir); !s.ok()) return s;
  absl::Status s = c.arch == Architecture::kGpt2 ? LoadGpt2Weights(ts, c, model->weights)
                                                 : LoadLlamaWeights(ts, c, model->weights);
  if (!s.ok()) return s;
  ts.KeepAlive(model->weights.storage);
  if (c.arch == Architecture::kLlama) {
    if (absl::Status r = ReadRopeScaling(TextConfig(*cfg), c, model->weights); !r.ok()) return r;
  }

  const fs::path tok = fs::path(dir) / "tokenizer.json";
  if (fs::exists(tok)) {
    auto t = TokenizerFromJson(tok.string());
    if (!t.ok()) return t.status();
    model->tokenizer = *std::move(t);
    // tokenizer_config.json's BOS default: its add_bos_token, or none when it sets
    // bos_token to null (Qwen2's, whose <|endoftext|> is never prepended).
    const fs::path tok_cfg = fs::path(dir) / "tokenizer_config.json";
    if (fs::exists(tok_cfg)) {
      auto tc = ReadJson(tok_cfg);
      if (!tc.ok()) return tc.status();
      if (tc->is_object() && tc->contains("add_bos_token")) {
        if (!(*tc)["add_bos_token"].is_boolean()) {
          return absl::InvalidArgumentError("tokenizer_config.json: add_bos_token is not a bool");
        }
        model->tokenizer->set_adds_bos((*tc)["add_bos_token"].get<bool>());
      } else if (tc->is_object() && tc->contains("bos_token") && (*tc)["bos_token"].is_null()) {
        model->tokenizer->set_adds_bos(false);
      }
      // chat_template: a string, or a list of {name, template} whose "default" is the one.
      if (tc->is_object() && tc->contains("chat_template")) {
        const auto& ct = (*tc)["chat_template"];
        if (ct.is_string()) {
          model->tokenizer->set_chat_template(ct.get<std::string>());
        } else if (ct.is_array()) {
          for (const auto& named : ct) {
            if (named.is_object() && named.value("name", "") == "default" &&
                named.contains("template") && named["template"].is_string()) {
              model->tokenizer->set_chat_template(named["template"].get<std::string>());
            }
          }
        } else if (!ct.is_null()) {
          return absl::InvalidArgumentError(
              "tokenizer_config.json: chat_template is neither a string nor a list of "
              "{name, template}");
        }
      }
    }
  }
  KVLENS_ASSIGN_OR_RETURN(
      model->generation_config,
      ReadGenerationConfig((fs::path(dir) / "generation_config.json").string()));
  if (absl::Status v = model->ValidateWeights(); !v.ok()) return v;
  return model;
}

}  // namespace kvlens
