// Hugging Face model directories: tiny GPT-2 and Llama checkpoints written here tensor by
// tensor, loaded, read back, and run. The expected logits come from a naive double-precision
// forward pass below, written from the Hugging Face modelling code's equations over the
// values this test wrote (GPT-2's Conv1D [in, out] weights used as stored), never from
// kvlens' own weight mapping. (About 900 lines: both families, Qwen2 and Llama 3.1's rope
// scaling among the Llama cases, share the writer, the reference ops and the error helpers,
// and read best side by side.)
#include "engine/model/hf_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "nlohmann/json.hpp"
#include "tests/engine/model/gguf_test_writer.h"
#include "tests/engine/model/safetensors_test_writer.h"
#include "tests/temp_dir.h"

namespace kvlens {
namespace {

namespace fs = std::filesystem;
using ::kvlens::testing::ExactBf16;
using ::kvlens::testing::ExactF16;
using ::kvlens::testing::HasSubstr;
using ::kvlens::testing::SafetensorsWriter;
using nlohmann::json;

struct Tensor {
  std::string dtype;  // "F32", "F16" or "BF16"
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major, exactly representable in dtype
  float at(int64_t r, int64_t c) const { return values[r * shape.back() + c]; }
};
using Tensors = std::map<std::string, Tensor>;

// Random values in [-0.5, 0.5) (distinct with overwhelming probability), or, for f16/bf16,
// multiples of 1/64 in [-1, 1] (7 significant bits: exact in both).
Tensor Random(std::vector<int64_t> shape, uint32_t seed, const std::string& dtype = "F32") {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) {
    x = dtype == "F32" ? std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng)
                       : static_cast<float>(static_cast<int>(rng() % 129) - 64) / 64.0f;
  }
  return {dtype, std::move(shape), std::move(v)};
}

std::string FreshDir(const std::string& name) {
  const std::string dir = testing::ProcessTempDir().File("kvlens_hf_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

void WriteSafetensors(const std::string& path, const Tensors& ts,
                      const std::set<std::string>& only = {}) {
  SafetensorsWriter w;
  for (const auto& [name, t] : ts) {
    if (!only.empty() && !only.count(name)) continue;
    if (t.dtype == "F16") {
      w.AddF16(name, t.shape, t.values);
    } else if (t.dtype == "BF16") {
      w.AddBF16(name, t.shape, t.values);
    } else {
      w.AddF32(name, t.shape, t.values);
    }
  }
  const std::string bytes = w.Bytes();
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
}

// ---- GPT-2: D = 8, H = 2 (Dh = 4), F = 4·D = 32 (n_inner absent), V = 10, 16 positions.

constexpr int kD = 8, kH = 2, kF = 32, kV = 10, kP = 16;

json Gpt2Config(int layers) {
  return {{"model_type", "gpt2"}, {"n_embd", kD},
          {"n_layer", layers},    {"n_head", kH},
          {"n_positions", kP},    {"vocab_size", kV},
          {"n_inner", nullptr},   {"layer_norm_epsilon", 1e-5}};
}

// Every tensor GPT2LMHeadModel saves (bar the attention-mask buffers), named with `prefix`.
Tensors Gpt2Tensors(int layers, const std::string& prefix = "transformer.") {
  Tensors ts;
  uint32_t seed = 1;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    ts[prefix + name] = Random(std::move(shape), seed++);
  };
  add("wte.weight", {kV, kD});
  add("wpe.weight", {kP, kD});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    add(p + "ln_1.weight", {kD});
    add(p + "ln_1.bias", {kD});
    add(p + "attn.c_attn.weight", {kD, 3 * kD});  // Conv1D: [in, out]
    add(p + "attn.c_attn.bias", {3 * kD});
    add(p + "attn.c_proj.weight", {kD, kD});
    add(p + "attn.c_proj.bias", {kD});
    add(p + "ln_2.weight", {kD});
    add(p + "ln_2.bias", {kD});
    add(p + "mlp.c_fc.weight", {kD, kF});
    add(p + "mlp.c_fc.bias", {kF});
    add(p + "mlp.c_proj.weight", {kF, kD});
    add(p + "mlp.c_proj.bias", {kD});
  }
  add("ln_f.weight", {kD});
  add("ln_f.bias", {kD});
  return ts;
}

std::string WriteGpt2Dir(const std::string& name, const Tensors& ts, int layers) {
  const std::string dir = FreshDir(name);
  WriteText(dir + "/config.json", Gpt2Config(layers).dump());
  WriteSafetensors(dir + "/model.safetensors", ts);
  return dir;
}

using Matrix = std::vector<std::vector<double>>;  // [rows][cols]

// y = x · W (+ b) with W stored [in, out] (Conv1D), or x · Wᵀ with W stored [out, in].
Matrix Linear(const Matrix& x, const Tensor& w, const Tensor* b, bool stored_out_in) {
  const int64_t out = stored_out_in ? w.shape[0] : w.shape[1];
  const int64_t in = stored_out_in ? w.shape[1] : w.shape[0];
  Matrix y(x.size(), std::vector<double>(out, 0.0));
  for (size_t i = 0; i < x.size(); ++i) {
    for (int64_t o = 0; o < out; ++o) {
      double s = b ? b->values[o] : 0.0;
      for (int64_t k = 0; k < in; ++k) s += x[i][k] * (stored_out_in ? w.at(o, k) : w.at(k, o));
      y[i][o] = s;
    }
  }
  return y;
}

Matrix LayerNorm(const Matrix& x, const Tensor& g, const Tensor& b, double eps) {
  Matrix y = x;
  for (auto& row : y) {
    double mean = 0, var = 0;
    for (double v : row) mean += v / row.size();
    for (double v : row) var += (v - mean) * (v - mean) / row.size();
    for (size_t k = 0; k < row.size(); ++k)
      row[k] = (row[k] - mean) / std::sqrt(var + eps) * g.values[k] + b.values[k];
  }
  return y;
}

Matrix RmsNorm(const Matrix& x, const Tensor& g, double eps) {
  Matrix y = x;
  for (auto& row : y) {
    double ms = 0;
    for (double v : row) ms += v * v / row.size();
    for (size_t k = 0; k < row.size(); ++k) row[k] = row[k] / std::sqrt(ms + eps) * g.values[k];
  }
  return y;
}

void AddTo(Matrix& x, const Matrix& y) {
  for (size_t i = 0; i < x.size(); ++i)
    for (size_t k = 0; k < x[i].size(); ++k) x[i][k] += y[i][k];
}

// Causal attention: q [T][H·Dh] at column offset q0, k/v [T][Hkv·Dh] at offsets k0/v0;
// query head h reads key/value head h / (H / Hkv).
Matrix Attention(const Matrix& q, const Matrix& k, const Matrix& v, int heads, int kv_heads, int dh,
                 int q0 = 0, int k0 = 0, int v0 = 0) {
  const size_t T = q.size();
  Matrix out(T, std::vector<double>(heads * dh, 0.0));
  for (int h = 0; h < heads; ++h) {
    const int kvh = h / (heads / kv_heads);
    for (size_t i = 0; i < T; ++i) {
      std::vector<double> score(i + 1);
      double mx = -1e300, sum = 0;
      for (size_t j = 0; j <= i; ++j) {
        double s = 0;
        for (int d = 0; d < dh; ++d) s += q[i][q0 + h * dh + d] * k[j][k0 + kvh * dh + d];
        score[j] = s / std::sqrt(static_cast<double>(dh));
        mx = std::max(mx, score[j]);
      }
      for (double& s : score) sum += (s = std::exp(s - mx));
      for (size_t j = 0; j <= i; ++j)
        for (int d = 0; d < dh; ++d) out[i][h * dh + d] += score[j] / sum * v[j][v0 + kvh * dh + d];
    }
  }
  return out;
}

// GPT2LMHeadModel's logits [T][V], tied output head.
Matrix Gpt2Reference(const Tensors& ts, int layers, const std::vector<int32_t>& tokens,
                     const std::string& t = "transformer.") {
  const double eps = 1e-5;
  Matrix x(tokens.size(), std::vector<double>(kD));
  for (size_t i = 0; i < tokens.size(); ++i)
    for (int k = 0; k < kD; ++k)
      x[i][k] = static_cast<double>(ts.at(t + "wte.weight").at(tokens[i], k)) +
                ts.at(t + "wpe.weight").at(i, k);
  for (int l = 0; l < layers; ++l) {
    const std::string p = t + "h." + std::to_string(l) + ".";
    auto T = [&](const std::string& n) -> const Tensor& { return ts.at(p + n); };
    const Matrix h = LayerNorm(x, T("ln_1.weight"), T("ln_1.bias"), eps);
    const Matrix qkv = Linear(h, T("attn.c_attn.weight"), &T("attn.c_attn.bias"), false);
    const Matrix a = Attention(qkv, qkv, qkv, kH, kH, kD / kH, 0, kD, 2 * kD);
    AddTo(x, Linear(a, T("attn.c_proj.weight"), &T("attn.c_proj.bias"), false));
    Matrix f = Linear(LayerNorm(x, T("ln_2.weight"), T("ln_2.bias"), eps), T("mlp.c_fc.weight"),
                      &T("mlp.c_fc.bias"), false);
    for (auto& row : f)
      for (double& v : row)
        v = 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::acos(-1.0)) * (v + 0.044715 * v * v * v)));
    AddTo(x, Linear(f, T("mlp.c_proj.weight"), &T("mlp.c_proj.bias"), false));
  }
  return Linear(LayerNorm(x, ts.at(t + "ln_f.weight"), ts.at(t + "ln_f.bias"), eps),
                ts.at(t + "wte.weight"), nullptr, /*stored_out_in=*/true);
}

// All-position logits of one forward over `tokens` through kvlens.
template <typename T>
std::vector<T> KvlensLogits(const Model& m, kernels::Backend<T>& backend,
                            const std::vector<int32_t>& tokens) {
  const int bs = 4, blocks = (static_cast<int>(tokens.size()) + bs - 1) / bs;
  KvCacheStorage<T> cache(m.config.num_layers, blocks, bs, m.config.kv_dim(), true);
  std::vector<int32_t> table(blocks);
  for (int i = 0; i < blocks; ++i) table[i] = i;
  Transformer<T> tr(m, backend);
  BatchEntry e{tokens, 0, table, /*all_logits=*/true};
  ForwardOutput<T> out;
  const absl::Status s = tr.Forward({&e, 1}, cache, out);
  EXPECT_TRUE(s.ok()) << s;
  return out.logits;
}

// max |got − want| / max |want| over the flattened [T][V] logits.
template <typename T>
double RelErr(const std::vector<T>& got, const Matrix& want) {
  double num = 0, den = 0;
  size_t i = 0;
  for (const auto& row : want) {
    for (double w : row) {
      if (i >= got.size()) return INFINITY;
      num = std::max(num, std::abs(static_cast<double>(got[i++]) - w));
      den = std::max(den, std::abs(w));
    }
  }
  return i == got.size() ? num / den : INFINITY;
}

void ExpectLogitsMatch(const Model& m, const Matrix& want, const std::vector<int32_t>& tokens) {
  kernels::ReferenceBackend ref;
  EXPECT_LE(RelErr(KvlensLogits(m, ref, tokens), want), 1e-12);
  kernels::CpuBackend cpu(1);
  EXPECT_LE(RelErr(KvlensLogits(m, cpu, tokens), want), 1e-5);
}

const std::vector<int32_t> kTokens = {3, 1, 4, 1, 5, 9, 2, 6};

// Element (r, c) of an f32 view, read from its bytes.
float F32At(const WeightView& w, int64_t r, int64_t c) {
  EXPECT_EQ(w.dtype, kernels::DType::kF32);
  float f;
  std::memcpy(&f, w.row(r) + 4 * c, 4);
  return f;
}

// Every element of `w` [rows, cols] equals `want(r, c)`, bit for bit.
template <typename F>
void ExpectView(const WeightView& w, int64_t rows, int64_t cols, F want, const std::string& what) {
  ASSERT_EQ(w.rows, rows) << what;
  ASSERT_EQ(w.cols, cols) << what;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(F32At(w, r, c), want(r, c)) << what << " (" << r << ", " << c << ")";
}

void ExpectError(const absl::StatusOr<std::unique_ptr<Model>>& r, absl::StatusCode code,
                 const std::vector<std::string>& what) {
  ASSERT_FALSE(r.ok()) << "expected an error mentioning " << what.front();
  EXPECT_EQ(r.status().code(), code) << r.status();
  for (const std::string& w : what) EXPECT_TRUE(HasSubstr(std::string(r.status().message()), w));
}

TEST(HfModelTest, Gpt2LoadsAndRunsAsTheReference) {
  const Tensors ts = Gpt2Tensors(2);
  auto m = LoadHfModel(WriteGpt2Dir("gpt2", ts, 2));
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config;
  EXPECT_EQ(c.arch, Architecture::kGpt2);
  EXPECT_EQ(c.dim, kD);
  EXPECT_EQ(c.hidden_dim, kF);  // 4 · n_embd when n_inner is null
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, kH);
  EXPECT_EQ(c.num_kv_heads, kH);
  EXPECT_EQ(c.head_dim, kD / kH);
  EXPECT_EQ(c.vocab_size, kV);
  EXPECT_EQ(c.max_seq_len, kP);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_EQ(c.name, "kvlens_hf_gpt2");
  EXPECT_EQ((*m)->format, "safetensors");
  EXPECT_EQ((*m)->tokenizer, nullptr);  // no tokenizer.json
  ExpectLogitsMatch(**m, Gpt2Reference(ts, 2, kTokens), kTokens);
}

// Conv1D weights are stored [in, out]; kvlens holds [out, in]: loaded (r, c) == file (c, r).
TEST(HfModelTest, Gpt2Conv1DWeightsAreTransposed) {
  const Tensors ts = Gpt2Tensors(1);
  const std::string dir = WriteGpt2Dir("gpt2_transpose", ts, 1);
  auto m = LoadHfModel(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  const Weights& w = (*m)->weights;
  const LayerWeights& lw = w.layers[0];
  const Tensor& c_attn = ts.at("transformer.h.0.attn.c_attn.weight");  // [D, 3D]
  ASSERT_EQ(std::set<float>(c_attn.values.begin(), c_attn.values.end()).size(),
            c_attn.values.size())
      << "values must be distinct for the check to mean anything";
  // Q, K, V are column blocks [0, D), [D, 2D), [2D, 3D) of the file's matrix.
  ExpectView(
      lw.wq, kD, kD, [&](int64_t r, int64_t c) { return c_attn.at(c, r); }, "wq");
  ExpectView(
      lw.wk, kD, kD, [&](int64_t r, int64_t c) { return c_attn.at(c, kD + r); }, "wk");
  ExpectView(
      lw.wv, kD, kD, [&](int64_t r, int64_t c) { return c_attn.at(c, 2 * kD + r); }, "wv");
  const Tensor& bias = ts.at("transformer.h.0.attn.c_attn.bias");
  ExpectView(
      lw.bq, 1, kD, [&](int64_t, int64_t c) { return bias.values[c]; }, "bq");
  ExpectView(
      lw.bk, 1, kD, [&](int64_t, int64_t c) { return bias.values[kD + c]; }, "bk");
  ExpectView(
      lw.bv, 1, kD, [&](int64_t, int64_t c) { return bias.values[2 * kD + c]; }, "bv");
  const Tensor& c_proj = ts.at("transformer.h.0.attn.c_proj.weight");
  ExpectView(
      lw.wo, kD, kD, [&](int64_t r, int64_t c) { return c_proj.at(c, r); }, "wo");
  const Tensor& c_fc = ts.at("transformer.h.0.mlp.c_fc.weight");  // [D, F]
  ExpectView(
      lw.w_in, kF, kD, [&](int64_t r, int64_t c) { return c_fc.at(c, r); }, "w_in");
  const Tensor& mlp_proj = ts.at("transformer.h.0.mlp.c_proj.weight");  // [F, D]
  ExpectView(
      lw.w_out, kD, kF, [&](int64_t r, int64_t c) { return mlp_proj.at(c, r); }, "w_out");
  // Embeddings are [rows, D] as stored; the output head is the embedding (tied).
  const Tensor& wte = ts.at("transformer.wte.weight");
  ExpectView(
      w.token_embedding, kV, kD, [&](int64_t r, int64_t c) { return wte.at(r, c); }, "wte");
  EXPECT_EQ(w.output.data, w.token_embedding.data);
  const Tensor& wpe = ts.at("transformer.wpe.weight");
  ExpectView(
      w.position_embedding, kP, kD, [&](int64_t r, int64_t c) { return wpe.at(r, c); }, "wpe");
  const Tensor& ln_f = ts.at("transformer.ln_f.bias");
  ExpectView(
      w.final_norm_bias, 1, kD, [&](int64_t, int64_t c) { return ln_f.values[c]; }, "ln_f");
}

// Checkpoints saved from the bare GPT2Model (openai-community/gpt2 itself) have no
// "transformer." prefix.
TEST(HfModelTest, Gpt2WithoutTheTransformerPrefix) {
  const Tensors ts = Gpt2Tensors(1, "");
  auto m = LoadHfModel(WriteGpt2Dir("gpt2_bare", ts, 1));
  ASSERT_TRUE(m.ok()) << m.status();
  ExpectLogitsMatch(**m, Gpt2Reference(ts, 1, kTokens, ""), kTokens);
}

TEST(HfModelTest, Gpt2UntiedOutputHead) {
  Tensors ts = Gpt2Tensors(1);
  ts["lm_head.weight"] = Random({kV, kD}, 99);
  const std::string dir = FreshDir("gpt2_untied");
  json cfg = Gpt2Config(1);
  cfg["tie_word_embeddings"] = false;
  WriteText(dir + "/config.json", cfg.dump());
  WriteSafetensors(dir + "/model.safetensors", ts);
  auto m = LoadHfModel(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  const Tensor& head = ts.at("lm_head.weight");
  ExpectView((*m)->weights.output, kV, kD, [&](int64_t r, int64_t c) { return head.at(r, c); },
             "lm_head");
}

// tie_word_embeddings false promises an lm_head.weight: its absence is an error naming it
// (not a silent fall-back to the token embedding).
TEST(HfModelTest, Gpt2UntiedWithoutHeadIsAnError) {
  const std::string dir = FreshDir("gpt2_untied_no_head");
  json cfg = Gpt2Config(1);
  cfg["tie_word_embeddings"] = false;
  WriteText(dir + "/config.json", cfg.dump());
  WriteSafetensors(dir + "/model.safetensors", Gpt2Tensors(1));
  auto m = LoadHfModel(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("lm_head.weight"), std::string::npos) << m.status();
}

// Shards: every tensor of layer 0 in the second file, the rest in the first.
struct Sharded {
  std::string dir;
  json index;
  Tensors ts;
};
Sharded WriteShardedGpt2(const std::string& name) {
  Sharded s{FreshDir(name), json::object(), Gpt2Tensors(2)};
  WriteText(s.dir + "/config.json", Gpt2Config(2).dump());
  std::set<std::string> first, second;
  json map = json::object();
  for (const auto& [n, t] : s.ts) {
    const bool layer0 = n.rfind("transformer.h.0.", 0) == 0;
    (layer0 ? second : first).insert(n);
    map[n] = layer0 ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  }
  WriteSafetensors(s.dir + "/model-00001-of-00002.safetensors", s.ts, first);
  WriteSafetensors(s.dir + "/model-00002-of-00002.safetensors", s.ts, second);
  s.index = {{"metadata", {{"total_size", 0}}}, {"weight_map", map}};
  WriteText(s.dir + "/model.safetensors.index.json", s.index.dump());
  return s;
}

TEST(HfModelTest, ShardedCheckpointLoads) {
  const Sharded s = WriteShardedGpt2("sharded");
  auto m = LoadHfModel(s.dir);
  ASSERT_TRUE(m.ok()) << m.status();
  ExpectLogitsMatch(**m, Gpt2Reference(s.ts, 2, kTokens), kTokens);
}

TEST(HfModelTest, ShardedIndexErrors) {
  {  // a shard the index names is missing
    const Sharded s = WriteShardedGpt2("shard_missing");
    fs::remove(s.dir + "/model-00002-of-00002.safetensors");
    ExpectError(LoadHfModel(s.dir), absl::StatusCode::kNotFound,
                {"model-00002-of-00002.safetensors"});
  }
  {  // the index puts a tensor in the wrong shard (it is in the first)
    Sharded s = WriteShardedGpt2("shard_wrong");
    s.index["weight_map"]["transformer.wte.weight"] = "model-00002-of-00002.safetensors";
    WriteText(s.dir + "/model.safetensors.index.json", s.index.dump());
    ExpectError(LoadHfModel(s.dir), absl::StatusCode::kInvalidArgument,
                {"model.safetensors.index.json", "transformer.wte.weight",
                 "model-00002-of-00002.safetensors", "does not hold it"});
  }
  {  // the index lists a tensor no shard has
    Sharded s = WriteShardedGpt2("shard_phantom");
    s.index["weight_map"]["transformer.h.9.ln_1.weight"] = "model-00001-of-00002.safetensors";
    WriteText(s.dir + "/model.safetensors.index.json", s.index.dump());
    ExpectError(LoadHfModel(s.dir), absl::StatusCode::kInvalidArgument,
                {"transformer.h.9.ln_1.weight", "model-00001-of-00002.safetensors"});
  }
  {  // a tensor in two shards
    Sharded s = WriteShardedGpt2("shard_twice");
    WriteSafetensors(s.dir + "/model-00002-of-00002.safetensors", s.ts,
                     {"transformer.wte.weight", "transformer.h.0.ln_1.weight"});
    ExpectError(LoadHfModel(s.dir), absl::StatusCode::kInvalidArgument,
                {"transformer.wte.weight", "two shards"});
  }
  {  // a layer-0 tensor the index does not list at all: its shard still holds it, so the
     // model loads (the index says where to look; it is not a filter)
    Sharded s = WriteShardedGpt2("shard_unlisted");
    s.index["weight_map"].erase("transformer.h.0.ln_1.bias");
    WriteText(s.dir + "/model.safetensors.index.json", s.index.dump());
    EXPECT_TRUE(LoadHfModel(s.dir).ok());
  }
  {
    Sharded s = WriteShardedGpt2("shard_no_map");
    WriteText(s.dir + "/model.safetensors.index.json", R"({"metadata": {}})");
    ExpectError(LoadHfModel(s.dir), absl::StatusCode::kInvalidArgument, {"missing weight_map"});
  }
  {
    Sharded s = WriteShardedGpt2("shard_path");
    s.index["weight_map"]["transformer.wte.weight"] = "../model-00001-of-00002.safetensors";
    WriteText(s.dir + "/model.safetensors.index.json", s.index.dump());
    ExpectError(LoadHfModel(s.dir), absl::StatusCode::kInvalidArgument,
                {"../model-00001-of-00002.safetensors", "plain file name"});
  }
  {
    Sharded s = WriteShardedGpt2("shard_not_name");
    s.index["weight_map"]["transformer.wte.weight"] = 1;
    WriteText(s.dir + "/model.safetensors.index.json", s.index.dump());
    ExpectError(LoadHfModel(s.dir), absl::StatusCode::kInvalidArgument,
                {"weight_map.transformer.wte.weight", "not a file name"});
  }
}

TEST(HfModelTest, MissingOrMisshapenTensor) {
  Tensors ts = Gpt2Tensors(2);
  ts.erase("transformer.h.1.mlp.c_fc.bias");
  ExpectError(LoadHfModel(WriteGpt2Dir("gpt2_missing", ts, 2)), absl::StatusCode::kNotFound,
              {"missing tensor transformer.h.1.mlp.c_fc.bias"});

  ts = Gpt2Tensors(1);
  ts["transformer.h.0.attn.c_attn.weight"].shape = {3 * kD, kD};  // nn.Linear's layout
  ExpectError(
      LoadHfModel(WriteGpt2Dir("gpt2_shape", ts, 1)), absl::StatusCode::kInvalidArgument,
      {"tensor transformer.h.0.attn.c_attn.weight", "expected shape [8, 24]", "got [24, 8]"});

  // The config says 2 layers, the file has 1.
  ExpectError(LoadHfModel(WriteGpt2Dir("gpt2_layers", Gpt2Tensors(1), 2)),
              absl::StatusCode::kNotFound, {"transformer.h.1.ln_1.weight"});

  ts = Gpt2Tensors(1);
  ts["transformer.wte.weight"].shape = {kV, kD, 1};
  ExpectError(LoadHfModel(WriteGpt2Dir("gpt2_3d", ts, 1)), absl::StatusCode::kInvalidArgument,
              {"tensor transformer.wte.weight", "expected shape [10, 8]", "got [10, 8, 1]"});
}

TEST(HfModelTest, DirectoryErrors) {
  const std::string empty = FreshDir("empty");
  ExpectError(LoadHfModel(empty), absl::StatusCode::kNotFound, {"config.json"});

  const std::string no_weights = FreshDir("no_weights");
  WriteText(no_weights + "/config.json", Gpt2Config(1).dump());
  ExpectError(LoadHfModel(no_weights), absl::StatusCode::kNotFound, {"no *.safetensors files"});

  const std::string bad_file = WriteGpt2Dir("bad_file", Gpt2Tensors(1), 1);
  WriteText(bad_file + "/model.safetensors", std::string(4, 'x'));
  ExpectError(LoadHfModel(bad_file), absl::StatusCode::kInvalidArgument,
              {"model.safetensors", "needs 8"});

  const std::string bad_tok = WriteGpt2Dir("bad_tokenizer", Gpt2Tensors(1), 1);
  WriteText(bad_tok + "/tokenizer.json", "{");
  ExpectError(LoadHfModel(bad_tok), absl::StatusCode::kInvalidArgument,
              {"tokenizer.json", "invalid JSON"});
}

TEST(HfModelTest, LoadsTheTokenizerBesideTheWeights) {
  const std::string dir = WriteGpt2Dir("with_tokenizer", Gpt2Tensors(1), 1);
  WriteText(dir + "/tokenizer.json", R"({"model": {"type": "BPE",
    "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
    "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"}})");
  auto m = LoadHfModel(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_NE((*m)->tokenizer, nullptr);
  EXPECT_EQ((*m)->tokenizer->Encode("ab", false), (std::vector<int32_t>{2}));
  EXPECT_TRUE((*m)->tokenizer->adds_bos());  // no tokenizer_config.json: BOS by default

  // tokenizer_config.json: add_bos_token decides; a null bos_token (Qwen2) means none.
  const std::pair<std::string, bool> configs[] = {{R"({"add_bos_token": false})", false},
                                                  {R"({"add_bos_token": true})", true},
                                                  {R"({"bos_token": null})", false},
                                                  {R"({"bos_token": "<s>"})", true}};
  for (const auto& [text, adds] : configs) {
    WriteText(dir + "/tokenizer_config.json", text);
    auto with_config = LoadHfModel(dir);
    ASSERT_TRUE(with_config.ok()) << with_config.status();
    EXPECT_EQ((*with_config)->tokenizer->adds_bos(), adds) << text;
  }
  WriteText(dir + "/tokenizer_config.json", R"({"add_bos_token": "yes"})");
  ExpectError(LoadHfModel(dir), absl::StatusCode::kInvalidArgument,
              {"tokenizer_config.json: add_bos_token is not a bool"});

  // chat_template: a string, or named templates of which "default" is the model's.
  WriteText(dir + "/tokenizer_config.json", R"({"chat_template": "<|im_start|>{{ x }}"})");
  auto chat = LoadModel({dir, ""});
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ((*chat)->tokenizer->chat_template(), "<|im_start|>{{ x }}");
  ASSERT_TRUE((*chat)->chat_format.has_value());
  EXPECT_EQ(ChatFormatName(*(*chat)->chat_format), "chatml");
  WriteText(dir + "/tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "t"},
                                  {"name": "default", "template": "[INST] d"}]})");
  chat = LoadModel({dir, ""});
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ((*chat)->tokenizer->chat_template(), "[INST] d");
  WriteText(dir + "/tokenizer_config.json", R"({"chat_template": 3})");
  ExpectError(LoadHfModel(dir), absl::StatusCode::kInvalidArgument,
              {"tokenizer_config.json: chat_template is neither a string nor a list"});
}

// A config.json edit → the error it must give (code and words).
struct ConfigCase {
  std::string name;
  json edit;  // merged into the valid config (null values delete the key)
  absl::StatusCode code;
  std::vector<std::string> what;
};

TEST(HfModelTest, Gpt2ConfigErrors) {
  const Tensors ts = Gpt2Tensors(1);
  const std::vector<ConfigCase> cases = {
      {"no_head",
       {{"n_head", nullptr}},
       absl::StatusCode::kInvalidArgument,
       {"config.json", "missing n_head"}},
      {"head_string",
       {{"n_head", "2"}},
       absl::StatusCode::kInvalidArgument,
       {"config.json", "n_head is not an integer"}},
      {"head_float",
       {{"n_head", 2.5}},
       absl::StatusCode::kInvalidArgument,
       {"n_head is not an integer"}},
      {"head_divides",
       {{"n_head", 3}},
       absl::StatusCode::kInvalidArgument,
       {"config.json", "n_embd = 8", "not a multiple of n_head = 3"}},
      {"head_zero", {{"n_head", 0}}, absl::StatusCode::kInvalidArgument, {"num_heads = 0"}},
      {"layers_negative",
       {{"n_layer", -1}},
       absl::StatusCode::kInvalidArgument,
       {"num_layers = -1", "[1, 1048576]"}},
      // 2^32 + 1 would wrap to 1 through int
      {"layers_wrap",
       {{"n_layer", 4294967297LL}},
       absl::StatusCode::kInvalidArgument,
       {"config.json", "n_layer = 4294967297", "range of int"}},
      {"layers_huge",
       {{"n_layer", uint64_t{1} << 63}},
       absl::StatusCode::kInvalidArgument,
       {"n_layer = 9223372036854775808", "range of int"}},
      {"no_positions",
       {{"n_positions", nullptr}},
       absl::StatusCode::kInvalidArgument,
       {"missing n_positions"}},
      {"type_missing",
       {{"model_type", nullptr}},
       absl::StatusCode::kUnimplemented,
       {"model_type \"\"", "gpt2, llama"}},
      {"type_bert",
       {{"model_type", "bert"}},
       absl::StatusCode::kUnimplemented,
       {"model_type \"bert\""}},
      {"type_number",
       {{"model_type", 2}},
       absl::StatusCode::kInvalidArgument,
       {"config.json", "model_type is not a string"}},
      {"act_relu",
       {{"activation_function", "relu"}},
       absl::StatusCode::kUnimplemented,
       {"activation_function \"relu\""}},
      {"act_number",
       {{"activation_function", 1}},
       absl::StatusCode::kInvalidArgument,
       {"activation_function is not a string"}},
      {"tie_string",
       {{"tie_word_embeddings", "yes"}},
       absl::StatusCode::kInvalidArgument,
       {"tie_word_embeddings is not a bool"}},
      {"eps_zero",
       {{"layer_norm_epsilon", 0}},
       absl::StatusCode::kInvalidArgument,
       {"norm_eps = 0", "(0, 1)"}},
  };
  for (const ConfigCase& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = WriteGpt2Dir("cfg_" + c.name, ts, 1);
    json cfg = Gpt2Config(1);
    cfg.merge_patch(c.edit);
    WriteText(dir + "/config.json", cfg.dump());
    ExpectError(LoadHfModel(dir), c.code, c.what);
  }
  // n_ctx stands in for n_positions (older configs)
  const std::string dir = WriteGpt2Dir("cfg_n_ctx", ts, 1);
  json cfg = Gpt2Config(1);
  cfg.erase("n_positions");
  cfg["n_ctx"] = kP;
  WriteText(dir + "/config.json", cfg.dump());
  EXPECT_TRUE(LoadHfModel(dir).ok());

  for (const std::string& text : {std::string("{\"model_type\": "), std::string("[1, 2]")}) {
    const std::string bad = WriteGpt2Dir("cfg_not_object", ts, 1);
    WriteText(bad + "/config.json", text);
    ExpectError(LoadHfModel(bad), absl::StatusCode::kInvalidArgument, {"config.json"});
  }
}

// ---- Llama: D = 8, H = 2, Hkv = 1 (grouped-query), Dh = 4, F = 12, V = 10; weights in
// f16 and bf16, norms in f32, an untied output head.

constexpr int kLD = 8, kLH = 2, kLKv = 1, kLDh = 4, kLF = 12;

json LlamaConfig() {
  return {{"model_type", "llama"},         {"hidden_size", kLD},
          {"intermediate_size", kLF},      {"num_hidden_layers", 1},
          {"num_attention_heads", kLH},    {"num_key_value_heads", kLKv},
          {"max_position_embeddings", kP}, {"vocab_size", kV},
          {"rms_norm_eps", 1e-5},          {"rope_theta", 10000.0},
          {"tie_word_embeddings", false}};
}

Tensors LlamaTensors() {
  Tensors ts;
  ts["model.embed_tokens.weight"] = Random({kV, kLD}, 1, "BF16");
  ts["model.layers.0.input_layernorm.weight"] = Random({kLD}, 2);
  ts["model.layers.0.self_attn.q_proj.weight"] = Random({kLD, kLD}, 3, "F16");
  ts["model.layers.0.self_attn.k_proj.weight"] = Random({kLKv * kLDh, kLD}, 4, "BF16");
  ts["model.layers.0.self_attn.v_proj.weight"] = Random({kLKv * kLDh, kLD}, 5, "F16");
  ts["model.layers.0.self_attn.o_proj.weight"] = Random({kLD, kLD}, 6, "BF16");
  ts["model.layers.0.post_attention_layernorm.weight"] = Random({kLD}, 7);
  ts["model.layers.0.mlp.gate_proj.weight"] = Random({kLF, kLD}, 8, "F16");
  ts["model.layers.0.mlp.up_proj.weight"] = Random({kLF, kLD}, 9, "BF16");
  ts["model.layers.0.mlp.down_proj.weight"] = Random({kLD, kLF}, 10, "F16");
  ts["model.norm.weight"] = Random({kLD}, 11, "BF16");
  ts["lm_head.weight"] = Random({kV, kLD}, 12, "F16");
  return ts;
}

// Hugging Face's rotate_half RoPE: x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁]
// over the two halves of each head, angle pos · θ^(−2i/Dh) / divisors[i] for pair i.
void Rope(Matrix& x, int heads, int dh, double theta, const std::vector<double>& divisors = {}) {
  for (size_t pos = 0; pos < x.size(); ++pos) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < dh / 2; ++i) {
        const double a =
            pos * std::pow(theta, -2.0 * i / dh) / (divisors.empty() ? 1.0 : divisors[i]);
        double& x1 = x[pos][h * dh + i];
        double& x2 = x[pos][h * dh + i + dh / 2];
        const double r1 = x1 * std::cos(a) - x2 * std::sin(a);
        const double r2 = x2 * std::cos(a) + x1 * std::sin(a);
        x1 = r1;
        x2 = r2;
      }
    }
  }
}

Matrix LlamaReference(const Tensors& ts, const std::vector<int32_t>& tokens,
                      const std::vector<double>& rope_divisors = {}) {
  const double eps = 1e-5;
  auto T = [&](const std::string& n) -> const Tensor& { return ts.at(n); };
  Matrix x(tokens.size(), std::vector<double>(kLD));
  for (size_t i = 0; i < tokens.size(); ++i)
    for (int k = 0; k < kLD; ++k) x[i][k] = T("model.embed_tokens.weight").at(tokens[i], k);
  const std::string p = "model.layers.0.";
  const Matrix h = RmsNorm(x, T(p + "input_layernorm.weight"), eps);
  // Qwen2's q, k and v biases, where the tensors hold them.
  auto B = [&](const std::string& n) { return ts.count(n) ? &ts.at(n) : nullptr; };
  Matrix q = Linear(h, T(p + "self_attn.q_proj.weight"), B(p + "self_attn.q_proj.bias"), true);
  Matrix k = Linear(h, T(p + "self_attn.k_proj.weight"), B(p + "self_attn.k_proj.bias"), true);
  const Matrix v =
      Linear(h, T(p + "self_attn.v_proj.weight"), B(p + "self_attn.v_proj.bias"), true);
  Rope(q, kLH, kLDh, 10000.0, rope_divisors);
  Rope(k, kLKv, kLDh, 10000.0, rope_divisors);
  const Matrix a = Attention(q, k, v, kLH, kLKv, kLDh);
  AddTo(x, Linear(a, T(p + "self_attn.o_proj.weight"), nullptr, true));
  const Matrix h2 = RmsNorm(x, T(p + "post_attention_layernorm.weight"), eps);
  const Matrix g = Linear(h2, T(p + "mlp.gate_proj.weight"), nullptr, true);
  Matrix u = Linear(h2, T(p + "mlp.up_proj.weight"), nullptr, true);
  for (size_t i = 0; i < u.size(); ++i)
    for (size_t j = 0; j < u[i].size(); ++j) u[i][j] *= g[i][j] / (1 + std::exp(-g[i][j]));
  AddTo(x, Linear(u, T(p + "mlp.down_proj.weight"), nullptr, true));
  return Linear(RmsNorm(x, T("model.norm.weight"), eps), T("lm_head.weight"), nullptr, true);
}

std::string WriteLlamaDir(const std::string& name, const Tensors& ts,
                          const json& cfg = LlamaConfig()) {
  const std::string dir = FreshDir(name);
  WriteText(dir + "/config.json", cfg.dump());
  WriteSafetensors(dir + "/model.safetensors", ts);
  return dir;
}

TEST(HfModelTest, LlamaF16Bf16LoadsAndRunsAsTheReference) {
  const Tensors ts = LlamaTensors();
  auto m = LoadHfModel(WriteLlamaDir("llama", ts));
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config;
  EXPECT_EQ(c.arch, Architecture::kLlama);
  EXPECT_EQ(c.dim, kLD);
  EXPECT_EQ(c.hidden_dim, kLF);
  EXPECT_EQ(c.num_heads, kLH);
  EXPECT_EQ(c.num_kv_heads, kLKv);
  EXPECT_EQ(c.head_dim, kLDh);
  EXPECT_EQ(c.rope_style, kernels::RopeStyle::kHalfSplit);
  EXPECT_FALSE(c.tied_embeddings);

  // Weights stay in their stored type, bit for bit.
  const Weights& w = (*m)->weights;
  const Tensor& q = ts.at("model.layers.0.self_attn.q_proj.weight");
  ASSERT_EQ(w.layers[0].wq.dtype, kernels::DType::kF16);
  for (int64_t r = 0; r < kLD; ++r) {
    for (int64_t col = 0; col < kLD; ++col) {
      uint16_t bits;
      std::memcpy(&bits, w.layers[0].wq.row(r) + 2 * col, 2);
      ASSERT_EQ(bits, ExactF16(q.at(r, col))) << r << ", " << col;
    }
  }
  const Tensor& emb = ts.at("model.embed_tokens.weight");
  ASSERT_EQ(w.token_embedding.dtype, kernels::DType::kBF16);
  for (int64_t r = 0; r < kV; ++r) {
    for (int64_t col = 0; col < kLD; ++col) {
      uint16_t bits;
      std::memcpy(&bits, w.token_embedding.row(r) + 2 * col, 2);
      ASSERT_EQ(bits, ExactBf16(emb.at(r, col))) << r << ", " << col;
    }
  }
  EXPECT_NE(w.output.data, w.token_embedding.data);  // untied: lm_head.weight

  ExpectLogitsMatch(**m, LlamaReference(ts, kTokens), kTokens);
}

// Llama 3.1's rope_scaling ("llama3"): per-pair divisors of the frequencies. Dh 4 with θ
// 10000: frequencies 1 and 0.01, wavelengths 2π and 628.3. With original 1024, low 1,
// high 4: pair 0 is under 1024/4 (divisor 1); pair 1 lies between 256 and 1024, so
// s = (1024/628.3 − 1)/3 = 0.20992 and the divisor is 1/((1 − s)/8 + s) = 3.23964.
TEST(HfModelTest, LlamaRopeScalingDividesTheLowFrequencies) {
  const Tensors ts = LlamaTensors();
  json cfg = LlamaConfig();
  cfg["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 1024}};
  auto m = LoadHfModel(WriteLlamaDir("llama_rope_scaling", ts, cfg));
  ASSERT_TRUE(m.ok()) << m.status();
  const kernels::WeightView& f = (*m)->weights.rope_freqs;
  ASSERT_EQ(f.cols, kLDh / 2);
  const auto* factors = static_cast<const float*>(f.data);
  EXPECT_EQ(factors[0], 1.0f);
  EXPECT_NEAR(factors[1], 3.2396418, 1e-6);
  // (The divisors are stored as floats, as GGUF's rope_freqs.)
  const double divisor = static_cast<float>(3.2396418468652604);
  ExpectLogitsMatch(**m, LlamaReference(ts, kTokens, {1.0, divisor}), kTokens);
}

// Qwen2: a Llama with biases on q, k and v (bf16 here, as Qwen2's checkpoints store them).
TEST(HfModelTest, Qwen2AddsTheQkvBiases) {
  Tensors ts = LlamaTensors();
  ts["model.layers.0.self_attn.q_proj.bias"] = Random({kLD}, 21, "BF16");
  ts["model.layers.0.self_attn.k_proj.bias"] = Random({kLD / kLH * kLKv}, 22, "BF16");
  ts["model.layers.0.self_attn.v_proj.bias"] = Random({kLD / kLH * kLKv}, 23, "BF16");
  json cfg = LlamaConfig();
  cfg["model_type"] = "qwen2";
  cfg["use_sliding_window"] = false;
  auto m = LoadHfModel(WriteLlamaDir("qwen2", ts, cfg));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->config.qkv_bias);
  ExpectLogitsMatch(**m, LlamaReference(ts, kTokens), kTokens);

  ts.erase("model.layers.0.self_attn.v_proj.bias");
  ExpectError(LoadHfModel(WriteLlamaDir("qwen2_no_bias", ts, cfg)), absl::StatusCode::kNotFound,
              {"missing tensor model.layers.0.self_attn.v_proj.bias"});
  cfg["use_sliding_window"] = true;
  ExpectError(LoadHfModel(WriteLlamaDir("qwen2_sliding", LlamaTensors(), cfg)),
              absl::StatusCode::kUnimplemented, {"use_sliding_window = true is not supported"});
}

TEST(HfModelTest, LlamaErrors) {
  Tensors ts = LlamaTensors();
  ts.erase("lm_head.weight");  // untied, so the head is required
  ExpectError(LoadHfModel(WriteLlamaDir("llama_no_head", ts)), absl::StatusCode::kNotFound,
              {"missing tensor lm_head.weight"});
  json tied = LlamaConfig();
  tied["tie_word_embeddings"] = true;
  auto m = LoadHfModel(WriteLlamaDir("llama_tied", ts, tied));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->weights.output.data, (*m)->weights.token_embedding.data);

  ts = LlamaTensors();
  ts["model.layers.0.self_attn.k_proj.weight"].shape = {kLD, kLD / 2};  // [in, out]: wrong
  ExpectError(
      LoadHfModel(WriteLlamaDir("llama_kshape", ts)), absl::StatusCode::kInvalidArgument,
      {"tensor model.layers.0.self_attn.k_proj.weight", "expected shape [4, 8]", "got [8, 4]"});

  // A dtype safetensors knows but kvlens does not serve.
  SafetensorsWriter f64;
  for (const auto& [name, t] : LlamaTensors()) {
    if (name == "model.norm.weight") {
      std::string b;
      for (float v : t.values) b += ::kvlens::testing::Le(static_cast<double>(v));
      f64.Add(name, "F64", t.shape, b);
    } else {
      f64.AddF32(name, t.shape, t.values);
    }
  }
  const std::string dir = WriteLlamaDir("llama_f64", LlamaTensors());
  const std::string bytes = f64.Bytes();
  std::ofstream(dir + "/model.safetensors", std::ios::binary | std::ios::trunc)
      .write(bytes.data(), bytes.size());
  ExpectError(LoadHfModel(dir), absl::StatusCode::kUnimplemented,
              {"tensor model.norm.weight", "F64"});

  const std::vector<ConfigCase> cases = {
      {"kv_heads",
       {{"num_key_value_heads", 3}},
       absl::StatusCode::kInvalidArgument,
       {"num_heads = 2", "num_kv_heads = 3"}},
      {"heads",
       {{"num_attention_heads", 3}},
       absl::StatusCode::kInvalidArgument,
       {"config.json", "hidden_size = 8", "not a multiple of num_attention_heads = 3"}},
      {"no_intermediate",
       {{"intermediate_size", nullptr}},
       absl::StatusCode::kInvalidArgument,
       {"missing intermediate_size"}},
      {"rope_scaling",
       {{"rope_scaling", {{"type", "dynamic"}, {"factor", 2.0}}}},
       absl::StatusCode::kUnimplemented,
       {"rope_scaling.rope_type \"dynamic\" is not supported (llama3, linear)"}},
      {"rope_scaling_factor",
       {{"rope_scaling",
         {{"rope_type", "llama3"},
          {"low_freq_factor", 1.0},
          {"high_freq_factor", 4.0},
          {"original_max_position_embeddings", 8192}}}},
       absl::StatusCode::kInvalidArgument,
       {"rope_scaling.factor must be a positive number"}},
      {"theta", {{"rope_theta", -1.0}}, absl::StatusCode::kInvalidArgument, {"rope_theta = -1"}},
      {"tie",
       {{"tie_word_embeddings", 1}},
       absl::StatusCode::kInvalidArgument,
       {"tie_word_embeddings is not a bool"}},
  };
  for (const ConfigCase& c : cases) {
    SCOPED_TRACE(c.name);
    json cfg = LlamaConfig();
    cfg.merge_patch(c.edit);
    ExpectError(LoadHfModel(WriteLlamaDir("llama_cfg_" + c.name, LlamaTensors(), cfg)), c.code,
                c.what);
  }
}

}  // namespace
}  // namespace kvlens
