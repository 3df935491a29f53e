// The SAE shipped beside the default model (models/kjv-gpt2-4l-sae, trained by
// models/train_default_sae.py) read by kvlens: on the first 48 held-out tokens, every
// position's L0, five strongest features with their activations and relative error
// equal what the training script computed in float64 with its own torch model and SAE
// (training_log.json "check"), on both backends.
#include <cmath>
#include <fstream>
#include <string>

#include "engine/interpret/sae_file.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "nlohmann/json.hpp"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

template <typename T>
void ExpectTheTrainingScriptsCodes(const Model& m, const Sae& sae, kernels::Backend<T>& be,
                                   const nlohmann::json& check, double tol) {
  const std::vector<int32_t> tokens = check["tokens"].get<std::vector<int32_t>>();
  const int n = static_cast<int>(tokens.size());
  auto tape = RunForward(m, be, SequenceInput<T>{tokens});
  ASSERT_TRUE(tape.ok()) << tape.status();
  auto x = ReadHook(m, be, *tape, sae.hook, sae.layer, 0, n);
  ASSERT_TRUE(x.ok()) << x.status();
  const std::vector<T> f = SaeEncode(sae, be, x->data(), n);
  const std::vector<T> r = SaeDecode(sae, be, f.data(), n);
  const int ds = sae.d_sae, din = sae.d_in;
  for (int i = 0; i < n; ++i) {
    const T* fi = f.data() + int64_t{i} * ds;
    int l0 = 0;
    for (int j = 0; j < ds; ++j) l0 += fi[j] != T(0) ? 1 : 0;
    EXPECT_EQ(l0, check["l0"][i].get<int>()) << i;
    const auto want_idx = check["top_features"][i].get<std::vector<int>>();
    const auto want_act = check["top_activations"][i].get<std::vector<double>>();
    for (size_t k = 0; k < want_idx.size(); ++k) {
      // The same feature has the activation the script found (rank ties aside).
      EXPECT_NEAR(fi[want_idx[k]], want_act[k], tol * std::abs(want_act[0])) << i << " " << k;
    }
    double err = 0, norm = 0;
    for (int j = 0; j < din; ++j) {
      const double xv = (*x)[int64_t{i} * din + j], d = xv - r[int64_t{i} * din + j];
      err += d * d;
      norm += xv * xv;
    }
    EXPECT_NEAR(std::sqrt(norm), check["x_norm"][i].get<double>(), tol * std::sqrt(norm)) << i;
    EXPECT_NEAR(std::sqrt(err / norm), check["rel_error"][i].get<double>(), tol * 10) << i;
  }
}

TEST(DefaultSae, ReproducesTheTrainingScriptsCodes) {
  const std::string dir = testing::SourcePath("models/kjv-gpt2-4l-sae");
  KVLENS_REQUIRE_FILE(dir + "/cfg.json");
  auto m = LoadModel({testing::DefaultModelPath(), ""});
  ASSERT_TRUE(m.ok()) << m.status();
  auto sae = LoadSae(dir);
  ASSERT_TRUE(sae.ok()) << sae.status();
  EXPECT_EQ((*sae)->name, "blocks.2.hook_resid_post");
  EXPECT_EQ((*sae)->architecture, SaeArchitecture::kTopK);
  EXPECT_EQ((*sae)->k, 32);
  ASSERT_TRUE(CheckSaeFitsModel(**sae, (*m)->config).ok());
  std::ifstream in(dir + "/training_log.json");
  const nlohmann::json check = nlohmann::json::parse(in)["check"];
  ASSERT_EQ(check["hook_name"], "blocks.2.hook_resid_post");
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  ExpectTheTrainingScriptsCodes<double>(**m, **sae, ref, check, 1e-9);
  ExpectTheTrainingScriptsCodes<float>(**m, **sae, fast, check, 1e-4);
}

}  // namespace
}  // namespace kvlens::interpret
