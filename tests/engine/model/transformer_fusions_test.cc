// Which of the Backend's fusions Transformer::Forward asks for, by family: a backend that
// counts the fused calls (and runs the defaults, so the logits are the plain ops') sees a
// Llama-family layer without sandwich norms hand both RMSNorms to the products that read
// them, its q and k's rope and the new cache rows to the q/k/v call, and add both residuals
// as its products make them (what the CUDA matvec fuses); Qwen3's head norms come between
// the products and the rope, so its rope stays a call of its own. GPT-2's and Gemma 2/3's
// layers keep the residual pending for the next norm (Gemma 2's q/k/v call still takes
// the rope and cache rows). The counts are the layer
// structure's: per forward, one of each call a layer (two MatMulAddTo).
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "tests/engine/interpret/tiny_model.h"
#include "tests/kernels/cpu_forwarding_backend.h"

namespace kvlens {
namespace {

class CountingBackend : public testing::CpuForwardingBackend {
 public:
  CountingBackend() : CpuForwardingBackend(1) {}
  std::string_view name() const override { return "counting"; }
  std::map<std::string, int> calls;

  void MatMulAddTo(const float* x, int n, const kernels::WeightView& w,
                   const kernels::WeightView& bias, float* scratch, float* y) override {
    ++calls["MatMulAddTo"];
    Backend<float>::MatMulAddTo(x, n, w, bias, scratch, y);
  }
  // (its default calls RmsNormMatMulMany, counted too, and then RopeQKStoreKv)
  void RmsNormQkvRopeStoreKv(const float* x, int n, int dim, const kernels::WeightView& norm,
                             double eps, float* xn,
                             absl::Span<const kernels::MatMulOutput<float>> qkv,
                             const kernels::QkvRopeStore& kv) override {
    ++calls["RmsNormQkvRopeStoreKv"];
    Backend<float>::RmsNormQkvRopeStoreKv(x, n, dim, norm, eps, xn, qkv, kv);
  }
  void MatMulQkvRopeStoreKv(const float* x, int n,
                            absl::Span<const kernels::MatMulOutput<float>> qkv,
                            const kernels::QkvRopeStore& kv) override {
    ++calls["MatMulQkvRopeStoreKv"];
    Backend<float>::MatMulQkvRopeStoreKv(x, n, qkv, kv);
  }
  void RopeQKStoreKv(float* q, int64_t q_stride, int q_heads, float* k, const float* v,
                     int64_t kv_stride, int kv_heads, int n, int head_dim, const int32_t* positions,
                     const kernels::RopeSpec& rope, const int64_t* dst_rows, void* k_cache,
                     void* v_cache, int64_t cache_stride, kernels::KvDtype cache_dtype) override {
    ++calls["RopeQKStoreKv"];
    Backend<float>::RopeQKStoreKv(q, q_stride, q_heads, k, v, kv_stride, kv_heads, n, head_dim,
                                  positions, rope, dst_rows, k_cache, v_cache, cache_stride,
                                  cache_dtype);
  }
  void RmsNormMatMulMany(const float* x, int n, int dim, const kernels::WeightView& norm,
                         double eps, float* xn,
                         absl::Span<const kernels::MatMulOutput<float>> outputs) override {
    ++calls["RmsNormMatMulMany"];
    Backend<float>::RmsNormMatMulMany(x, n, dim, norm, eps, xn, outputs);
  }
  void RmsNormMatMulSwiGlu(const float* x, int n, int dim, const kernels::WeightView& norm,
                           double eps, float* xn, const kernels::WeightView& w_gate,
                           const kernels::WeightView& w_up, float* up_scratch,
                           float* out) override {
    ++calls["RmsNormMatMulSwiGlu"];
    Backend<float>::RmsNormMatMulSwiGlu(x, n, dim, norm, eps, xn, w_gate, w_up, up_scratch, out);
  }
  void RmsNormMatMulGeGlu(const float* x, int n, int dim, const kernels::WeightView& norm,
                          double eps, float* xn, const kernels::WeightView& w_gate,
                          const kernels::WeightView& w_up, float* up_scratch, float* out) override {
    ++calls["RmsNormMatMulGeGlu"];
    Backend<float>::RmsNormMatMulGeGlu(x, n, dim, norm, eps, xn, w_gate, w_up, up_scratch, out);
  }
  void AddRmsNorm(float* x, const float* residual, int n, int dim, const kernels::WeightView& w,
                  double eps, float* y) override {
    ++calls["AddRmsNorm"];
    Backend<float>::AddRmsNorm(x, residual, n, dim, w, eps, y);
  }
  void AddLayerNorm(float* x, const float* residual, int n, int dim, const kernels::WeightView& w,
                    const kernels::WeightView& b, double eps, float* y) override {
    ++calls["AddLayerNorm"];
    Backend<float>::AddLayerNorm(x, residual, n, dim, w, b, eps, y);
  }
};

// The fused calls of one forward of 5 tokens through tiny family `family`, with its logits
// (which must equal the CpuBackend's, whose fusions are the defaults too).
std::map<std::string, int> CallsOfOneForward(int family) {
  const std::unique_ptr<Model> model = testing::MakeTinyModel(testing::TinyFamilySpec(family));
  const ModelConfig& c = model->config;
  const std::vector<int32_t> tokens = {1, 5, 2, 7, 3};
  const std::vector<int32_t> table = {0};
  CountingBackend counting;
  kernels::CpuBackend cpu(1);
  std::vector<std::vector<float>> logits;
  for (kernels::Backend<float>* be : {static_cast<kernels::Backend<float>*>(&counting),
                                      static_cast<kernels::Backend<float>*>(&cpu)}) {
    KvCacheStorage<float> cache(c.num_layers, 1, c.max_seq_len, c.kv_dim(), true);
    Transformer<float> tr(*model, *be);
    BatchEntry e{tokens, 0, table, /*all_logits=*/true};
    ForwardOutput<float> out;
    const absl::Status s = tr.Forward({&e, 1}, cache, out);
    EXPECT_TRUE(s.ok()) << s;
    logits.push_back(out.logits);
  }
  EXPECT_EQ(logits[0], logits[1]);
  return counting.calls;
}

TEST(TransformerFusions, PreNormLayersHandTheirNormsToTheProductsAndAddResidualsAsMade) {
  for (int family = 0; family < testing::kTinyFamilies; ++family) {
    SCOPED_TRACE(family);
    const testing::TinySpec spec = testing::TinyFamilySpec(family);
    const int L = spec.layers;
    const std::map<std::string, int> calls = CallsOfOneForward(family);
    if (spec.arch == Architecture::kGpt2) {
      // LayerNorm: each residual waits in proj for the next norm, layer 0's attention norm
      // adding the position embeddings
      EXPECT_EQ(calls, (std::map<std::string, int>{{"AddLayerNorm", 2 * L}}));
    } else if (spec.gemma3) {
      // the block outputs' norms come before the add: every norm but the first adds; the
      // rope after the head norms
      EXPECT_EQ(calls,
                (std::map<std::string, int>{{"AddRmsNorm", 2 * L - 1}, {"RopeQKStoreKv", L}}));
    } else if (spec.gemma2) {
      // as Gemma 3, but no head norms: the rope and cache rows go with the products (whose
      // default runs RopeQKStoreKv)
      EXPECT_EQ(calls,
                (std::map<std::string, int>{
                    {"AddRmsNorm", 2 * L - 1}, {"MatMulQkvRopeStoreKv", L}, {"RopeQKStoreKv", L}}));
    } else if (spec.qk_norm) {
      EXPECT_EQ(calls, (std::map<std::string, int>{{"RmsNormMatMulMany", L},
                                                   {"RopeQKStoreKv", L},
                                                   {"RmsNormMatMulSwiGlu", L},
                                                   {"MatMulAddTo", 2 * L}}));
    } else {
      // RmsNormQkvRopeStoreKv's default runs RmsNormMatMulMany and RopeQKStoreKv
      EXPECT_EQ(calls, (std::map<std::string, int>{
                           {"RmsNormQkvRopeStoreKv", L},
                           {"RmsNormMatMulMany", L},
                           {"RopeQKStoreKv", L},
                           {spec.gemma ? "RmsNormMatMulGeGlu" : "RmsNormMatMulSwiGlu", L},
                           {"MatMulAddTo", 2 * L}}));
    }
  }
}

}  // namespace
}  // namespace kvlens
