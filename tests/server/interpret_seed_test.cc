// The seeds' worked attention examples through the Interpret RPCs, on the hand-built model
// of seed_model.h: every expected number is the seeds' (or follows from them by hand).
//
// Two positions (queries 1, 2 over keys 0, 1), S rows [ln 3, 0] and [0, ln 3],
// V rows [2, 0] and [0, 4], probe G rows [1, 0] and [0, 2] on head 0's output:
//   A rows [3/4, 1/4], [1/4, 3/4]; O rows [3/2, 1], [1/2, 3]; J = 3/2 + 2·3 = 15/2
//   dA = G Vᵀ rows [2, 0], [0, 8]; dS rows [3/8, −3/8], [−3/2, 3/2]
//   dQ = dS K/√2; dK = dSᵀ Q/√2 = ln 3 · dSᵀ; dV = Aᵀ G rows [3/4, 1/2], [1/4, 3/2]
// Identical keys [1, 1]: A rows [1/2, 1/2]; J = 1 + 2·2 = 5; dS rows [1/2, −1/2], [−2, 2];
//   dQ = 0 while dK rows [ln 3/2, −2 ln 3], [−ln 3/2, 2 ln 3].
// Position 0 (token a, query 0) sees only itself and carries no gradient; position 2's own
// key has score −M·ln 3 (probability 0 in any precision).
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "gtest/gtest.h"
#include "tests/server/interpret_test_util.h"
#include "tests/server/seed_model.h"

namespace kvlens::testing {
namespace {

const double kLn3 = std::log(3.0);
const double kRoot2 = std::sqrt(2.0);

class SeedModelServer {
 public:
  explicit SeedModelServer(bool identical_keys) {
    dir_ = absl::StrCat(std::filesystem::temp_directory_path().string(), "/kvlens_seed_model_",
                        getpid(), identical_keys ? "_same_keys" : "");
    server_ = std::make_unique<TestServer>(WriteSeedModel(dir_, identical_keys),
                                           TestServer::DefaultOptions());
  }
  ~SeedModelServer() {
    server_.reset();
    std::filesystem::remove_all(dir_);
  }
  TestServer& server() { return *server_; }

 private:
  std::string dir_;
  std::unique_ptr<TestServer> server_;
};

v1::GradientProbeRequest SeedProbe(v1::Precision precision) {
  v1::GradientProbeRequest r;
  *r.mutable_input() = IdsInput({0, 1, 2});
  v1::AttnOutProbeObjective* probe = r.mutable_attn_out_probe();
  probe->set_layer(0);
  probe->set_head(0);
  for (double g : {0.0, 0.0, 1.0, 0.0, 0.0, 2.0}) probe->add_g(g);  // G rows 0, 1, 2
  r.set_precision(precision);
  r.add_layers(0);
  r.add_heads(0);
  r.set_scores(true);
  r.set_probs(true);
  r.set_q(true);
  r.set_k(true);
  r.set_v(true);
  r.set_attn_out(true);
  r.set_verify(true);
  r.set_verify_samples(16);
  return r;
}

// `want` row-major; entries of `masked` (causal: column > row, for [T, T] tensors) skipped.
void ExpectTensor(const v1::GradientProbeResponse& response, const std::string& name,
                  const std::vector<double>& want, double tol, bool causal = false) {
  const v1::Tensor* t = FindTensor(response.tensors(), name, 0, 0);
  ASSERT_NE(t, nullptr) << name;
  const std::vector<double> got = DecodeTensor(*t);
  ASSERT_EQ(got.size(), want.size()) << name;
  for (size_t i = 0; i < want.size(); ++i) {
    if (causal && i % 3 > i / 3) continue;
    EXPECT_NEAR(got[i], want[i], tol) << name << " entry " << i;
  }
}

TEST(InterpretSeeds, TwoByTwoAttentionMaps) {
  SeedModelServer seed(false);
  ASSERT_TRUE(seed.server().ok()) << seed.server().error();
  auto stub = InterpretStub(seed.server());
  v1::AttentionMapsRequest request;
  *request.mutable_input() = IdsInput({0, 1, 2});
  request.set_precision(v1::PRECISION_FP64);
  request.set_scores(true);
  const AttentionResult r = RunAttentionMaps(*stub, request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.probs.size(), 2u * 3 * 3);  // 1 layer, 2 heads, 3 × 3
  const double head0[9] = {1, 0, 0, 0.75, 0.25, 0, 0.25, 0.75, 0};
  const double head1[9] = {1, 0, 0, 0.5, 0.5, 0, 1.0 / 3, 1.0 / 3, 1.0 / 3};  // Q = K = 0
  for (int i = 0; i < 9; ++i) {
    EXPECT_NEAR(r.probs[i], head0[i], 1e-7) << "head 0 entry " << i;
    EXPECT_NEAR(r.probs[9 + i], head1[i], 1e-7) << "head 1 entry " << i;
  }
  // Scores S = QKᵀ/√2: row 1 [ln 3, 0], row 2 [0, ln 3, −M ln 3]; masked entries −∞.
  EXPECT_NEAR(r.scores[3], kLn3, 1e-7);
  EXPECT_NEAR(r.scores[4], 0, 1e-7);
  EXPECT_NEAR(r.scores[6], 0, 1e-7);
  EXPECT_NEAR(r.scores[7], kLn3, 1e-7);
  EXPECT_NEAR(r.scores[8] / (-kSeedM * kLn3), 1, 1e-6);
  EXPECT_TRUE(std::isinf(r.scores[5]) && r.scores[5] < 0);
}

TEST(InterpretSeeds, TwoByTwoGradientProbe) {
  SeedModelServer seed(false);
  ASSERT_TRUE(seed.server().ok()) << seed.server().error();
  for (const v1::Precision p : {v1::PRECISION_FP64, v1::PRECISION_FP32}) {
    SCOPED_TRACE(p == v1::PRECISION_FP64 ? "fp64" : "fp32");
    const double tol = p == v1::PRECISION_FP64 ? 1e-6 : 1e-4;
    const v1::GradientProbeResponse r = CallGradientProbe(seed.server(), SeedProbe(p));
    EXPECT_NEAR(r.objective(), 15.0 / 2, tol);
    ExpectTensor(r, "grad.scores", {0, 0, 0, 3.0 / 8, -3.0 / 8, 0, -1.5, 1.5, 0}, tol, true);
    ExpectTensor(r, "grad.probs", {0, 0, 0, 2, 0, 0, 0, 8, 0}, tol, true);
    ExpectTensor(r, "grad.attn_out", {0, 0, 1, 0, 0, 2}, tol);
    ExpectTensor(r, "grad.q",
                 {0, 0, 3 / 8.0 / kRoot2, -3 / 8.0 / kRoot2, -1.5 / kRoot2, 1.5 / kRoot2}, tol);
    ExpectTensor(r, "grad.k", {3 * kLn3 / 8, -1.5 * kLn3, -3 * kLn3 / 8, 1.5 * kLn3, 0, 0}, tol);
    ExpectTensor(r, "grad.v", {0.75, 0.5, 0.25, 1.5, 0, 0}, tol);
    // The server's own finite-difference check agrees.
    ASSERT_GT(r.verify().num_forwards(), 0);
    EXPECT_LE(r.verify().max_rel_err(), 1e-5);
    // Each dS row sums to zero: a shift of a whole score row changes nothing.
    const std::vector<double> ds = DecodeTensor(*FindTensor(r.tensors(), "grad.scores", 0, 0));
    for (int i = 0; i < 3; ++i) EXPECT_NEAR(ds[3 * i] + ds[3 * i + 1] + ds[3 * i + 2], 0, tol);
  }
}

TEST(InterpretSeeds, IdenticalKeysGiveZeroQueryGradient) {
  SeedModelServer seed(true);
  ASSERT_TRUE(seed.server().ok()) << seed.server().error();
  for (const v1::Precision p : {v1::PRECISION_FP64, v1::PRECISION_FP32}) {
    SCOPED_TRACE(p == v1::PRECISION_FP64 ? "fp64" : "fp32");
    const double tol = p == v1::PRECISION_FP64 ? 1e-6 : 1e-4;
    const v1::GradientProbeResponse r = CallGradientProbe(seed.server(), SeedProbe(p));
    EXPECT_NEAR(r.objective(), 5, tol);
    ExpectTensor(r, "grad.probs", {0, 0, 0, 2, 0, 0, 0, 8, 0}, tol, true);
    ExpectTensor(r, "grad.scores", {0, 0, 0, 0.5, -0.5, 0, -2, 2, 0}, tol, true);
    // The query cannot tell the keys apart: dQ = 0 exactly (up to rounding) …
    ExpectTensor(r, "grad.q", {0, 0, 0, 0, 0, 0}, p == v1::PRECISION_FP64 ? 1e-12 : 1e-6);
    // … while the keys' gradients are not zero.
    ExpectTensor(r, "grad.k", {kLn3 / 2, -2 * kLn3, -kLn3 / 2, 2 * kLn3, 0, 0}, tol);
    ExpectTensor(r, "grad.v", {0.5, 1, 0.5, 1, 0, 0}, tol);  // Aᵀ G, A rows ½ ½ (and 1)
    // Finite differences agree, dQ = 0 included (its fd is rounding noise, ~ε·J/h).
    ASSERT_GT(r.verify().tensors_size(), 0);
    for (const v1::VerifyTensorReport& t : r.verify().tensors()) {
      std::printf("[interp] identical keys, verify %s: max abs %.3g, max rel %.3g\n",
                  t.name().c_str(), t.max_abs_err(), t.max_rel_err());
      EXPECT_LE(t.max_abs_err(), 1e-7) << t.name();
      // q: g = 0 and fd is rounding, measured against the noise floor 1000·ε·J/h.
      EXPECT_LE(t.max_rel_err(), t.name() == "q" ? 1e-2 : 1e-5) << t.name();
    }
  }
}

}  // namespace
}  // namespace kvlens::testing
