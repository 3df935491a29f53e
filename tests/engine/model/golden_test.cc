// Golden tests: kvlens' logits at every position and per-layer attention probabilities
// match the independent PyTorch float64 oracle (tests/oracle), computed at test time, for
// stories260K (llama2.c .bin and GGUF) and the embedded default model (GPT-2 family,
// safetensors). Tolerances: max relative error ≤ 1e-5 with fp32 activations, ≤ 1e-9 for
// the double-precision reference.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>

#include "engine/generator.h"
#include "engine/model/model.h"
#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/kernels/cpu_forwarding_backend.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

using testing::OracleArray;

template <typename T>
double RelErr(const std::vector<T>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(got[i]) - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  return num / den;
}

// The default model directory: models/*/ holding config.json.
std::string DefaultModelDir() {
  const std::filesystem::path models = testing::SourcePath("models");
  if (!std::filesystem::exists(models)) return "";
  for (const auto& e : std::filesystem::directory_iterator(models)) {
    if (e.is_directory() && std::filesystem::exists(e.path() / "config.json"))
      return e.path().string();
  }
  return "";
}

struct Case {
  std::string model;
  std::vector<std::string> prompts;
};

template <typename T>
void CompareWithOracle(const Model& model, kernels::Backend<T>& backend,
                       const std::vector<int32_t>& tokens, const testing::OracleResult& oracle,
                       double tolerance, const std::vector<int32_t>& doc_ids = {}) {
  const int n = static_cast<int>(tokens.size());
  const int bs = 16;
  const int blocks = (n + bs - 1) / bs;
  KvCacheStorage<T> cache(model.config.num_layers, blocks, bs, model.config.kv_dim(), true);
  std::vector<int32_t> table(blocks);
  for (int i = 0; i < blocks; ++i) table[i] = blocks - 1 - i;  // reversed: not the identity
  Transformer<T> tr(model, backend);
  BatchEntry e{tokens, 0, table, /*all_logits=*/true, doc_ids};
  ForwardOutput<T> out;
  AttentionCapture<T> capture;
  ASSERT_TRUE(tr.Forward({&e, 1}, cache, out, &capture).ok());
  const OracleArray& logits = oracle.arrays.at("logits");
  ASSERT_EQ(logits.data.size(), out.logits.size());
  EXPECT_LE(RelErr(out.logits, logits.data), tolerance) << backend.name() << " logits";
  for (int l = 0; l < model.config.num_layers; ++l) {
    const OracleArray& attn = oracle.arrays.at("attn." + std::to_string(l));
    ASSERT_EQ(attn.data.size(), capture.probs[l].size());
    EXPECT_LE(RelErr(capture.probs[l], attn.data), tolerance) << backend.name() << " layer " << l;
  }
}

// The oracle on the model file at `path` (which it then removes), against the reference
// backend (1e-9) and the fp32 CPU backend (1e-5): logits and every layer's attention.
void ExpectBothBackendsMatchTheOracle(const Model& model, const std::string& path,
                                      const std::vector<int32_t>& tokens) {
  const testing::OracleResult oracle = testing::RunOracle(path, tokens, /*attention=*/true);
  std::remove(path.c_str());
  ASSERT_TRUE(oracle.error.empty()) << oracle.error;
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  CompareWithOracle<double>(model, ref, tokens, oracle, 1e-9);
  CompareWithOracle<float>(model, fast, tokens, oracle, 1e-5);
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, LogitsAndAttentionMatchTheOracle) {
  std::string path = GetParam();
  if (path == "default") path = DefaultModelDir();
  if (path.empty()) GTEST_SKIP() << "no default model under models/";
  KVLENS_REQUIRE_FILE(path);
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_NE((*model)->tokenizer, nullptr);
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  for (const char* prompt :
       {"Once upon a time", "And God said, Let there be light: and there was light.",
        "The quick brown fox jumps over the lazy dog; 12345 !?"}) {
    const std::vector<int32_t> tokens = (*model)->tokenizer->Encode(prompt, true);
    SCOPED_TRACE(prompt);
    const testing::OracleResult oracle = testing::RunOracle(path, tokens, /*attention=*/true);
    ASSERT_TRUE(oracle.error.empty()) << oracle.error;
    CompareWithOracle<double>(**model, ref, tokens, oracle, 1e-9);
    CompareWithOracle<float>(**model, fast, tokens, oracle, 1e-5);
  }
}

// Packed documents: each token attends only to earlier tokens of its own document.
TEST_P(GoldenTest, PackedDocumentsMatchTheOracle) {
  std::string path = GetParam();
  if (path == "default") path = DefaultModelDir();
  if (path.empty()) GTEST_SKIP() << "no default model under models/";
  KVLENS_REQUIRE_FILE(path);
  ASSERT_TRUE(testing::OracleAvailable());
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> tokens = (*model)->tokenizer->Encode("One little story.", true);
  const std::vector<int32_t> second = (*model)->tokenizer->Encode("Another one here", true);
  std::vector<int32_t> docs(tokens.size(), 0);
  tokens.insert(tokens.end(), second.begin(), second.end());
  docs.resize(tokens.size(), 1);
  const testing::OracleResult oracle = testing::RunOracle(path, tokens, true, docs);
  ASSERT_TRUE(oracle.error.empty()) << oracle.error;
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  CompareWithOracle<double>(**model, ref, tokens, oracle, 1e-9, docs);
  CompareWithOracle<float>(**model, fast, tokens, oracle, 1e-5, docs);
}

// A model in every ggml block type (q8_0, q4_0 … q5_1, q2_K … q6_K, iq4_nl, iq4_xs; written by
// tests/oracle/make_quantized_gguf.py): kvlens' decoders and the oracle's own (numpy, from
// the layouts) read the same bytes, so the tolerances are those of an f32 model.
TEST(QuantizedGoldenTest, EveryBlockTypeMatchesTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = testing::MakeQuantizedModel();
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  std::set<kernels::DType> types;
  const LayerWeights& l0 = (*model)->weights.layers[0];
  const LayerWeights& l1 = (*model)->weights.layers[1];
  for (const kernels::WeightView* w :
       {&l0.wq, &l0.wk, &l0.wv, &l0.wo, &l0.w_in, &l0.w_up, &l0.w_out, &l1.wq, &l1.wk, &l1.wv,
        &l1.wo, &l1.w_in, &l1.w_up, &l1.w_out}) {
    types.insert(w->dtype);
  }
  EXPECT_EQ(types.size(), 12u);  // every block type
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128, 3};
  ExpectBothBackendsMatchTheOracle(**model, path, tokens);
}

// Llama 3.1's rope scaling (GGUF rope_freqs.weight, per-pair divisors of the frequencies)
// against the oracle, which applies the factors it reads from the same file. Prompt
// positions run to 250 (the model's context is 256), where the slowed low frequencies turn
// by visibly less.
TEST(RopeScalingGoldenTest, Llama31FrequencyFactorsMatchTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = testing::MakeQuantizedModel("--f32 --rope-freqs");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ((*model)->weights.rope_freqs.cols, 32);
  EXPECT_EQ(RopeOf((*model)->config, (*model)->weights, 0).freq_factors,
            static_cast<const float*>((*model)->weights.rope_freqs.data));
  std::vector<int32_t> tokens;
  for (int i = 0; i < 250; ++i) tokens.push_back((i * 97 + 5) % 384);
  ExpectBothBackendsMatchTheOracle(**model, path, tokens);
}

// A Qwen2 GGUF: a Llama with biases on q, k and v and RoPE on half-split pairs (llama.cpp's
// converter leaves Qwen2's q and k rows unpermuted), against the oracle reading the same
// file as a Qwen2.
TEST(Qwen2GoldenTest, BiasesAndHalfSplitRopeMatchTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = testing::MakeQuantizedModel("--f32 --qwen2");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->config.rope_style, kernels::RopeStyle::kHalfSplit);
  EXPECT_EQ((*model)->weights.layers[1].bk.cols, (*model)->config.kv_dim());
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128, 3};
  ExpectBothBackendsMatchTheOracle(**model, path, tokens);

  const std::string no_bias = testing::MakeQuantizedModel("--f32 --qwen2 --drop blk.1.attn_v.bias");
  ASSERT_FALSE(no_bias.empty());
  auto bad = LoadModel({no_bias, ""});
  std::remove(no_bias.c_str());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound) << bad.status();
  EXPECT_NE(std::string(bad.status().message()).find("missing tensor blk.1.attn_v.bias"),
            std::string::npos)
      << bad.status();
}

// A Qwen3 GGUF in every block type: no biases, an RMSNorm over each head of q and k before
// RoPE on half-split pairs, and heads of 128, so that the 4 query heads (512 wide) are
// twice the residual stream's width (256) and W_O's rows are 512 long; against the oracle
// reading the same file as a Qwen3.
TEST(Qwen3GoldenTest, HeadNormsAndWideHeadsMatchTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = testing::MakeQuantizedModel("--qwen3");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config;
  EXPECT_EQ(c.family, "qwen3");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.rope_style, kernels::RopeStyle::kHalfSplit);
  EXPECT_EQ(c.dim, 256);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.q_dim(), 512);
  EXPECT_EQ((*model)->weights.layers[0].wo.cols, 512);
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128, 3, 64};
  ExpectBothBackendsMatchTheOracle(**model, path, tokens);
}

// A Hugging Face directory that tests/oracle/make_quantized_gguf.py writes with `args`
// (f32), loaded by kvlens and by the oracle's own reader; "" or the load's error.
std::string HfDirectory(const std::string& args, absl::StatusOr<std::unique_ptr<Model>>& model) {
  char dir_template[] = "/tmp/kvlens_hf_XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return "";
  const std::string dir = dir_template;
  const std::string gguf = testing::MakeQuantizedModel("--f32 --hf " + dir + " " + args);
  if (gguf.empty()) return "";
  std::remove(gguf.c_str());
  model = LoadModel({dir, ""});
  return dir;
}

void ExpectHfDirectoryMatchesTheOracle(const std::string& args, const std::string& family,
                                       int q_dim) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  absl::StatusOr<std::unique_ptr<Model>> model = absl::UnknownError("not loaded");
  const std::string dir = HfDirectory(args, model);
  ASSERT_FALSE(dir.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->format, "safetensors");
  EXPECT_EQ((*model)->config.family, family);
  EXPECT_EQ((*model)->config.q_dim(), q_dim);
  EXPECT_EQ((*model)->config.max_seq_len, 256);  // max_position_embeddings
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256};
  const testing::OracleResult oracle = testing::RunOracle(dir, tokens, /*attention=*/true);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(oracle.error.empty()) << oracle.error;
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  CompareWithOracle<double>(**model, ref, tokens, oracle, 1e-9);
  CompareWithOracle<float>(**model, fast, tokens, oracle, 1e-5);
}

// A model file make_quantized_gguf.py writes with `args` (or, with `hf`, the Hugging Face
// directory it writes) is refused with `code` and a message containing `message`.
struct LoadError {
  std::string args;
  absl::StatusCode code;
  std::string message;
  bool hf = false;
};
void ExpectLoadErrors(const std::string& base, std::initializer_list<LoadError> cases) {
  for (const LoadError& tc : cases) {
    SCOPED_TRACE(tc.args);
    absl::StatusOr<std::unique_ptr<Model>> bad = absl::UnknownError("not loaded");
    if (tc.hf) {
      const std::string dir = HfDirectory(base + " " + tc.args, bad);
      ASSERT_FALSE(dir.empty());
      std::filesystem::remove_all(dir);
    } else {
      const std::string path = testing::MakeQuantizedModel(base + " " + tc.args);
      ASSERT_FALSE(path.empty());
      bad = LoadModel({path, ""});
      std::remove(path.c_str());
    }
    EXPECT_EQ(bad.status().code(), tc.code) << bad.status();
    EXPECT_NE(std::string(bad.status().message()).find(tc.message), std::string::npos)
        << bad.status();
  }
}

// The same architecture from a Hugging Face directory (config.json's model_type "qwen3" and
// head_dim; q_norm and k_norm tensors), against the oracle's own reading of the directory.
TEST(Qwen3GoldenTest, HuggingFaceDirectoryMatchesTheOracle) {
  ExpectHfDirectoryMatchesTheOracle("--qwen3", "qwen3", 512);
}

// Mistral's config.json (model_type "mistral") is a Llama's; sliding_window null or as long
// as the context (4096 against 256 positions) is no window. A window of 0 is refused by name.
TEST(MistralGoldenTest, HuggingFaceDirectoryMatchesTheOracle) {
  ExpectHfDirectoryMatchesTheOracle("--hf-type mistral --hf-config '{\"sliding_window\": null}'",
                                    "mistral", 256);
  ExpectHfDirectoryMatchesTheOracle("--hf-type mistral --hf-config '{\"sliding_window\": 4096}'",
                                    "mistral", 256);
  ExpectLoadErrors("--hf-type mistral",
                   {{"--hf-config '{\"sliding_window\": 0}'", absl::StatusCode::kInvalidArgument,
                     "sliding_window = 0", /*hf=*/true}});
}

// Mistral 7B v0.1's sliding window (each query sees its last sliding_window positions), here
// 3 so that it binds: the logits and every layer's attention over 11 tokens, and 12 greedy
// tokens generated from the cache in prompt chunks of 2 (decode rows and chunks with
// offsets), on both backends, against the oracle, which applies the window itself
// (Hugging Face's eager rule) and recomputes every greedy step from scratch.
TEST(MistralGoldenTest, SlidingWindowMatchesTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  absl::StatusOr<std::unique_ptr<Model>> model = absl::UnknownError("not loaded");
  const std::string dir =
      HfDirectory("--hf-type mistral --hf-config '{\"sliding_window\": 3}'", model);
  ASSERT_FALSE(dir.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->config.sliding_window, 3);
  EXPECT_EQ((*model)->config.max_seq_len, 256);
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256};
  const testing::OracleResult oracle = testing::RunOracle(dir, tokens, /*attention=*/true);
  const std::vector<int32_t> prompt = {1, 5, 300, 17, 42};
  const std::vector<int32_t> greedy = testing::OracleGreedy(dir, prompt, 12);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(greedy.size(), 12u) << "oracle.py --generate failed";
  ASSERT_TRUE(oracle.error.empty()) << oracle.error;
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  CompareWithOracle<double>(**model, ref, tokens, oracle, 1e-9);
  CompareWithOracle<float>(**model, fast, tokens, oracle, 1e-5);
  // Rows past the window see exactly 3 keys: the oracle's maps are not plain causal ones.
  EXPECT_EQ(oracle.arrays.at("attn.0").data[10 * 11 + 0], 0.0);
  GenerateOptions options;
  options.max_new_tokens = 12;
  options.prefill_chunk = 2;
  options.block_size = 4;
  options.stop_at_eos = false;
  auto r64 = Generate<double>(**model, ref, prompt, options);
  ASSERT_TRUE(r64.ok()) << r64.status();
  EXPECT_EQ(r64->tokens, greedy);
  auto r32 = Generate<float>(**model, fast, prompt, options);
  ASSERT_TRUE(r32.ok()) << r32.status();
  EXPECT_EQ(r32->tokens, greedy);
}

// A Qwen3 file without a head norm, or whose values are not the keys' size, or whose RoPE
// covers part of a head, is refused by name.
TEST(Qwen3GoldenTest, LoaderErrorsNameTheTensorOrField) {
  ExpectLoadErrors(
      "--f32 --qwen3",
      {{"--drop blk.1.attn_k_norm.weight", absl::StatusCode::kNotFound,
        "missing tensor blk.1.attn_k_norm.weight"},
       {"--set qwen3.attention.value_length=64", absl::StatusCode::kUnimplemented,
        "qwen3.attention.value_length = 64 differs from key_length = 128"},
       {"--set qwen3.rope.dimension_count=64", absl::StatusCode::kUnimplemented,
        "qwen3.rope.dimension_count = 64: partial rotary embeddings are not supported (head "
        "size 128)"}});
}

// Phi-3: q, k and v fused in attn_qkv (rows q | k | v) and gate and up in ffn_up, read as
// row views of the stored (quantised: every block type) tensors; half-split RoPE; its
// sliding window (here 5, so that it binds) from phi3.attention.sliding_window. Both
// backends against the oracle, which splits the fused tensors itself. Then the same values
// as a Hugging Face directory (qkv_proj, gate_up_proj, config.json's sliding_window).
TEST(Phi3GoldenTest, FusedTensorsAndSlidingWindowMatchTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path =
      testing::MakeQuantizedModel("--phi3 --set phi3.attention.sliding_window=5");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config;
  EXPECT_EQ(c.family, "phi3");
  EXPECT_EQ(c.rope_style, kernels::RopeStyle::kHalfSplit);
  EXPECT_EQ(c.sliding_window, 5);
  const LayerWeights& lw = (*model)->weights.layers[0];
  EXPECT_EQ(lw.wk.data, lw.wq.row(c.q_dim()));  // views into attn_qkv
  EXPECT_EQ(lw.w_up.rows, c.hidden_dim);
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128, 3, 64};
  ExpectBothBackendsMatchTheOracle(**model, path, tokens);
  ExpectHfDirectoryMatchesTheOracle("--phi3 --hf-config '{\"sliding_window\": 5}'", "phi3", 256);
}

// A Phi-3 without its fused FFN tensor, with a partial rotary factor (Phi-4-mini) or with
// LongRoPE's factors (the 128k variants) is refused by name.
TEST(Phi3GoldenTest, LoaderErrorsNameTheTensorOrField) {
  ExpectLoadErrors(
      "--f32 --phi3",
      {{"--drop blk.1.ffn_up.weight", absl::StatusCode::kNotFound,
        "missing tensor blk.1.ffn_up.weight"},
       {"--long-rope", absl::StatusCode::kUnimplemented,
        "rope_factors_long.weight: LongRoPE (Phi-3's 128k-context variants, Phi-3.5) is not "
        "supported"},
       {"--hf-config '{\"partial_rotary_factor\": 0.75}'", absl::StatusCode::kUnimplemented,
        "partial_rotary_factor = 0.75", /*hf=*/true}});
}

// Linear RoPE scaling (positions divided by 4): a Llama GGUF's rope.scaling.type "linear"
// with rope.scaling.factor, and config.json's rope_scaling {rope_type linear, factor}, each
// against the oracle over 250 positions.
TEST(RopeScalingGoldenTest, LinearScalingMatchesTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = testing::MakeQuantizedModel("--f32 --rope-scaling-linear 4");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ((*model)->weights.rope_freqs.cols, 32);
  EXPECT_EQ(RopeOf((*model)->config, (*model)->weights, 0).freq_factors[31], 4.0f);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 250; ++i) tokens.push_back((i * 89 + 7) % 384);
  ExpectBothBackendsMatchTheOracle(**model, path, tokens);
  ExpectHfDirectoryMatchesTheOracle("--hf-type llama --rope-scaling-linear 4", "llama", 256);
}

// Gemma: a GELU(tanh)-gated feed-forward, embeddings times √256 = 16, heads of 256 (the
// 4 query heads 1024 wide against a stream of 256), half-split RoPE, tied embeddings and
// the GGUF's norms holding 1 + weight (llama.cpp's converter); every block type, both
// backends against the oracle. Then the same values as a Hugging Face directory, whose
// norms hold the weight alone (GemmaRMSNorm adds the 1).
TEST(GemmaGoldenTest, GeGluScaledEmbeddingsAndWideHeadsMatchTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = testing::MakeQuantizedModel("--gemma");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config;
  EXPECT_EQ(c.family, "gemma");
  EXPECT_EQ(c.gate_activation, GateActivation::kGeluTanh);
  EXPECT_EQ(c.embedding_scale, 16.0);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rope_style, kernels::RopeStyle::kHalfSplit);
  EXPECT_TRUE(c.tied_embeddings);
  const std::vector<int32_t> tokens = {1, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128, 3, 64};
  ExpectBothBackendsMatchTheOracle(**model, path, tokens);
  ExpectHfDirectoryMatchesTheOracle("--gemma", "gemma", 1024);
}

// A Gemma whose config.json asks for the exact GELU, or that leaves out a norm, or names
// an architecture kvlens does not know is refused by name.
TEST(GemmaGoldenTest, LoaderErrorsNameTheTensorOrField) {
  ExpectLoadErrors(
      "--f32 --gemma",
      {{"--drop blk.1.ffn_norm.weight", absl::StatusCode::kNotFound,
        "missing tensor blk.1.ffn_norm.weight"},
       {"--hf-config '{\"hidden_activation\": \"gelu\"}'", absl::StatusCode::kUnimplemented,
        "hidden_activation \"gelu\" is not supported (gelu_pytorch_tanh)",
        /*hf=*/true},
       {"--set-str general.architecture=gemma1", absl::StatusCode::kUnimplemented,
        "general.architecture = \"gemma1\" is not supported (llama, qwen2, qwen3, phi3, gemma, "
        "gemma2, gemma3, gpt2)"}});
}

// Gemma 3's text model from a Hugging Face directory (model_type gemma3_text): RMSNorms over
// each head of q and k, norms on the attention and feed-forward outputs, scores times
// query_pre_attn_scalar^−1/2 (here 100: 0.1, not 1/√256), layer 0 windowed (3 keys, so it
// binds) with RoPE base 1e4 and layer 1 over every key with base 1e6 and linear scaling by
// 8; both backends against the oracle.
const char kGemma3Args[] =
    "--gemma3 --hf-config '{\"sliding_window\": 3, \"sliding_window_pattern\": 2, "
    "\"query_pre_attn_scalar\": 100, \"rope_theta\": 1000000.0, \"rope_local_base_freq\": "
    "10000.0, \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 8.0}}'";

TEST(Gemma3GoldenTest, SandwichNormsAndLocalGlobalLayersMatchTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  absl::StatusOr<std::unique_ptr<Model>> model = absl::UnknownError("not loaded");
  const std::string dir = HfDirectory(kGemma3Args, model);
  ASSERT_FALSE(dir.empty());
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config;
  EXPECT_TRUE(c.sandwich_norms && c.qk_norm);
  EXPECT_EQ(c.windowed_layers, (std::vector<bool>{true, false}));
  EXPECT_EQ(c.WindowOf(0), 3);
  EXPECT_EQ(c.WindowOf(1), 0);
  EXPECT_EQ(c.CommonWindow(), 0);  // layer 1 keeps every block alive
  EXPECT_DOUBLE_EQ(c.AttentionScale(), 0.1);
  const Weights& w = (*model)->weights;
  EXPECT_EQ(RopeOf(c, w, 0).theta, 1e4);
  EXPECT_EQ(RopeOf(c, w, 0).freq_factors, nullptr);
  EXPECT_EQ(RopeOf(c, w, 1).theta, 1e6);
  ASSERT_NE(RopeOf(c, w, 1).freq_factors, nullptr);
  EXPECT_EQ(RopeOf(c, w, 1).freq_factors[5], 8.0f);
  ExpectHfDirectoryMatchesTheOracle(kGemma3Args, "gemma3_text", 1024);
}

// Gemma 3 as llama.cpp writes it (architecture gemma3, every block type, 6 layers, norms
// holding 1 + weight, attention.sliding_window 3, rope.scaling.type linear by 8) and reads
// it: layers 0–4 windowed with RoPE base 1e4, layer 5 over every key with rope.freq_base
// and the scaling; both backends against the oracle's own reading of the file.
TEST(Gemma3GoldenTest, GgufAsLlamaCppReadsItMatchesTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = testing::MakeQuantizedModel(
      "--gemma3 --layers 6 --set gemma3.attention.sliding_window=3 --rope-scaling-linear 8");
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config;
  EXPECT_EQ(c.family, "gemma3");
  EXPECT_TRUE(c.sandwich_norms && c.qk_norm);
  EXPECT_EQ(c.windowed_layers, (std::vector<bool>{true, true, true, true, true, false}));
  EXPECT_EQ(c.sliding_window, 3);
  EXPECT_DOUBLE_EQ(c.AttentionScale(), 1.0 / 16);
  EXPECT_EQ(RopeOf(c, (*model)->weights, 4).theta, 1e4);
  EXPECT_EQ(RopeOf(c, (*model)->weights, 5).freq_factors[0], 8.0f);
  const std::vector<int32_t> tokens = {2, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128, 3, 64};
  ExpectBothBackendsMatchTheOracle(**model, path, tokens);
}

// A Gemma 3 missing a block-output norm, with a RoPE scaling other than linear, or a
// negative logit soft-cap is refused by name.
TEST(Gemma3GoldenTest, LoaderErrorsNameTheTensorOrField) {
  ExpectLoadErrors(
      "--f32 --gemma3",
      {{"--drop blk.1.post_ffw_norm.weight", absl::StatusCode::kNotFound,
        "missing tensor blk.1.post_ffw_norm.weight"},
       {"--set-str gemma3.rope.scaling.type=yarn", absl::StatusCode::kUnimplemented,
        "gemma3.rope.scaling.type = \"yarn\" is not supported (none, linear)"},
       {"--hf-config '{\"final_logit_softcapping\": -1.0}'", absl::StatusCode::kInvalidArgument,
        "final_logit_softcapping = -1.0 (a positive number or null)", /*hf=*/true},
       {"--hf-config '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}}'",
        absl::StatusCode::kUnimplemented,
        "rope_scaling.rope_type \"yarn\" is not supported (llama3, linear)", /*hf=*/true}});
}

// Gemma 2 as llama.cpp writes it (every block type; norms on each block's outputs, layer 0
// windowed to 3 keys and layer 1 not, one RoPE base) with soft-caps that bind: scores at
// 2 (split-KV on CUDA, the tiles' scores capped on the CPU), logits at 3; both backends
// against the oracle, then the same values as a Hugging Face directory (model_type
// gemma2, attn_logit_softcapping, final_logit_softcapping).
constexpr char kGemma2Args[] =
    "--gemma2 --set gemma2.attention.sliding_window=3 --set-float "
    "gemma2.attn_logit_softcapping=2 --set-float gemma2.final_logit_softcapping=3";

TEST(Gemma2GoldenTest, SoftCappedScoresAndLogitsMatchTheOracle) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = testing::MakeQuantizedModel(kGemma2Args);
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config;
  EXPECT_EQ(c.family, "gemma2");
  EXPECT_TRUE(c.sandwich_norms);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.windowed_layers, (std::vector<bool>{true, false}));
  EXPECT_EQ(c.attention_softcap, 2.0);
  EXPECT_EQ(c.final_softcap, 3.0);
  EXPECT_EQ(RopeOf(c, (*model)->weights, 0).theta, RopeOf(c, (*model)->weights, 1).theta);
  const std::vector<int32_t> tokens = {2, 5, 300, 17, 42, 383, 0, 9, 9, 77, 256, 128, 3, 64};
  ExpectBothBackendsMatchTheOracle(**model, path, tokens);
  ExpectHfDirectoryMatchesTheOracle(std::string(kGemma2Args) + " --f32", "gemma2", 1024);
}

// CpuBackend with int8 activations, every matrix product checked as it runs: the output
// must be the product of the input rounded by the mode's rules (ggml's quantize_row_q8_0,
// or q8_K's granularity for the 256-element types; written here from their definitions) with the
// exact weights (DequantizeRow<double>, checked against ggml), in double. Each product is checked
// on its own input, so the check does not depend on how the fp32 activations before it rounded (an
// input within ~1e-7 of a rounding boundary lands on either side in another build; a whole-model
// comparison with an oracle rounding its own activations is not stable).
class Int8CheckingBackend final : public testing::CpuForwardingBackend {
 public:
  Int8CheckingBackend() : CpuForwardingBackend(2) { cpu().SetInt8Activations(true); }
  std::string_view name() const override { return "int8-checking"; }
  int block_products() const { return block_products_; }
  double worst() const { return worst_; }

  void MatMul(const float* x, int n, const kernels::WeightView& w, const kernels::WeightView& bias,
              float* y) override {
    CpuForwardingBackend::MatMul(x, n, w, bias, y);
    if (!kernels::DTypeIsBlockQuantized(w.dtype)) return;
    ++block_products_;
    const int64_t in = w.cols;
    std::vector<double> rounded(static_cast<size_t>(n * in)), row(static_cast<size_t>(in));
    // Per 32 elements rounding halves away from zero (q8_0), or for the 256-element types
    // per 256 to even (q8_K).
    const int64_t block = kernels::DTypeBlockSize(w.dtype) == 256 ? 256 : 32;
    for (int64_t b = 0; b < n * in; b += block) {
      float amax = 0.0f;
      for (int64_t i = b; i < b + block; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float d = amax / 127.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
      for (int64_t i = b; i < b + block; ++i) {
        rounded[i] = double{d} * (block == 32 ? std::round(x[i] * id) : std::nearbyint(x[i] * id));
      }
    }
    for (int64_t o = 0; o < w.rows; ++o) {
      kernels::DequantizeRow(w, o, row.data());
      for (int r = 0; r < n; ++r) {
        double want = 0.0, mag = 0.0;
        for (int64_t i = 0; i < in; ++i) {
          want += row[i] * rounded[r * in + i];
          mag += std::abs(row[i] * rounded[r * in + i]);
        }
        worst_ = std::max(worst_, std::abs(y[r * w.rows + o] - want) / mag);
      }
    }
  }

 private:
  int block_products_ = 0;
  double worst_ = 0.0;
};

TEST(QuantizedGoldenTest, Int8ActivationsRoundEveryProductsInputAsGgml) {
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = testing::MakeQuantizedModel();
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  auto model = LoadModel({path, ""});
  std::remove(path.c_str());
  ASSERT_TRUE(model.ok()) << model.status();
  // 20 tokens: from 16 rows on the 256-element types' products take their tile.
  const std::vector<int32_t> tokens = {1,   5,   300, 17,  42,  383, 0,   9,   9,  77,
                                       256, 128, 3,   100, 200, 300, 301, 302, 12, 34};
  Int8CheckingBackend backend;
  KvCacheStorage<float> cache((*model)->config.num_layers, 2, 16, (*model)->config.kv_dim(), true);
  const std::vector<int32_t> table = {0, 1};
  Transformer<float> tr(**model, backend);
  BatchEntry e{tokens, 0, table, /*all_logits=*/true, {}};
  ForwardOutput<float> out;
  const absl::Status st = tr.Forward({&e, 1}, cache, out, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  // 7 products a layer in 2 layers, and the logits' (q6_K).
  EXPECT_EQ(backend.block_products(), 15);
  EXPECT_LE(backend.worst(), 1e-6);
  // And the mode is on: the logits are not the exact model's.
  kernels::CpuBackend exact(2);
  Transformer<float> tr_exact(**model, exact);
  ForwardOutput<float> out_exact;
  ASSERT_TRUE(tr_exact.Forward({&e, 1}, cache, out_exact, nullptr).ok());
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < out.logits.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(out.logits[i]) - out_exact.logits[i]));
    scale = std::max(scale, std::abs(static_cast<double>(out_exact.logits[i])));
  }
  EXPECT_GT(diff, 1e-3 * scale);
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenTest,
                         ::testing::Values(testing::TestData("stories260K/stories260K.bin"),
                                           testing::TestData("stories260K/stories260K.gguf"),
                                           "default"),
                         [](const ::testing::TestParamInfo<std::string>& param_info) {
                           const std::string& p = param_info.param;
                           if (p == "default") return std::string("DefaultModel");
                           return p.find(".gguf") != std::string::npos ? std::string("StoriesGguf")
                                                                       : std::string("StoriesBin");
                         });

}  // namespace
}  // namespace kvlens
