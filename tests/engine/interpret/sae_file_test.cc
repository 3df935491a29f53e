// Reading SAEs as SAELens and Gemma Scope publish them (files written at test time by
// tests/oracle/make_sae.py), checked against the PyTorch float64 oracle (oracle.py --sae,
// which reads the files with its own readers): every feature and the reconstruction on the
// default model's residual stream, for each architecture and stored type, both backends;
// the two formats of the same weights give the same features; every broken file refused
// naming what is wrong.
#include "engine/interpret/sae_file.h"

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/temp_dir.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

namespace fs = std::filesystem;

class SaeFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  }
  // Writes an SAE with tests/oracle/make_sae.py (`args` are its flags) to dir/name.
  std::string Make(const std::string& name, const std::string& args) {
    const std::string out = dir_.File(name);
    EXPECT_TRUE(testing::MakeSae(out, args)) << args;
    return out;
  }
  testing::ScopedTempDir dir_{"kvlens_sae"};
};

// The oracle's features and reconstruction against ours on `model`, worst relative
// errors (fp64, fp32) of the two tensors together.
std::pair<double, double> AgainstOracle(const std::string& model_path, const std::string& spec,
                                        const std::vector<int32_t>& tokens) {
  auto m = LoadModel({model_path, ""});
  EXPECT_TRUE(m.ok()) << m.status();
  auto sae = LoadSae(spec);
  EXPECT_TRUE(sae.ok()) << sae.status();
  if (!m.ok() || !sae.ok()) return {1, 1};
  EXPECT_TRUE(CheckSaeFitsModel(**sae, (*m)->config).ok());
  const testing::OracleResult ref =
      testing::RunOracleWith(model_path, tokens, absl::StrCat("--sae '", spec, "'"));
  EXPECT_TRUE(ref.error.empty()) << ref.error;
  if (!ref.error.empty()) return {1, 1};
  const int n = static_cast<int>(tokens.size());
  auto worst = [&](auto& be, auto zero) {
    using T = decltype(zero);
    auto tape = RunForward(**m, be, SequenceInput<T>{tokens});
    EXPECT_TRUE(tape.ok()) << tape.status();
    auto x = ReadHook(**m, be, *tape, (*sae)->hook, (*sae)->layer, 0, n);
    EXPECT_TRUE(x.ok()) << x.status();
    const std::vector<T> f = SaeEncode(**sae, be, x->data(), n);
    const std::vector<T> r = SaeDecode(**sae, be, f.data(), n);
    double e = 0;
    int active = 0;
    for (const auto& [name, ours] : {std::pair{"sae.acts", &f}, std::pair{"sae.recon", &r}}) {
      const testing::OracleArray& want = ref.arrays.at(name);
      EXPECT_EQ(ours->size(), want.data.size()) << name;
      double num = 0, den = 0;
      for (size_t i = 0; i < ours->size() && i < want.data.size(); ++i) {
        num = std::max(num, std::abs(static_cast<double>((*ours)[i]) - want.data[i]));
        den = std::max(den, std::abs(want.data[i]));
        if (name == std::string("sae.acts") && want.data[i] != 0) ++active;
      }
      e = std::max(e, den > 0 ? num / den : num);
    }
    EXPECT_GT(active, 0) << "no feature fires: the test would not see the encoder";
    return e;
  };
  kernels::ReferenceBackend ref_be;
  kernels::CpuBackend fast(2);
  const double e64 = worst(ref_be, 0.0), e32 = worst(fast, 0.0f);
  EXPECT_LE(e64, 1e-9) << spec;
  EXPECT_LE(e32, 1e-4) << spec;
  return {e64, e32};
}

const std::vector<int32_t> kTokens = {4095, 34, 290, 1021, 17, 88, 5, 400, 61, 7};

TEST_F(SaeFileTest, EveryArchitectureAndTypeMatchesTheOracle) {
  const std::string model = testing::DefaultModelPath();
  KVLENS_REQUIRE_FILE(model + "/config.json");
  for (const auto& [name, args] :
       {std::pair{"standard", "--architecture standard --hook blocks.2.hook_resid_post"},
        std::pair{"jumprelu_bf16",
                  "--architecture jumprelu --dtype bf16 --hook blocks.1.hook_resid_pre"},
        std::pair{"topk_f16", "--architecture topk --k 7 --dtype f16 --hook blocks.3.hook_mlp_out"},
        std::pair{"z", "--architecture standard --d-in 192 --hook blocks.0.attn.hook_z"}}) {
    const std::string path =
        Make(name, absl::StrCat("--format saelens --d-in 192 --d-sae 96 --seed 3 ", args));
    const auto [e64, e32] = AgainstOracle(model, path, kTokens);
    std::printf("[oracle] SAE %s on kjv-gpt2-4l: worst relative error fp64 %.3g, fp32 %.3g\n", name,
                e64, e32);
  }
}

// Gemma Scope's params.npz and the same weights as a SAELens jumprelu directory (b_dec not
// applied to the input) give the same features, bit for bit on the same backend.
TEST_F(SaeFileTest, GemmaScopeNpzEqualsTheSameWeightsInSaeLens) {
  const std::string model = testing::DefaultModelPath();
  KVLENS_REQUIRE_FILE(model + "/config.json");
  const std::string npz = Make("params.npz", "--format npz --d-in 192 --d-sae 64 --seed 5");
  const std::string dir = Make(
      "same", absl::StrCat("--format saelens --hook blocks.2.hook_resid_post --same-as ", npz));
  const std::string spec = npz + "@blocks.2.hook_resid_post";
  AgainstOracle(model, spec, kTokens);
  auto a = LoadSae(spec);
  auto b = LoadSae(dir);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  EXPECT_EQ((*a)->name, "blocks.2.hook_resid_post");
  EXPECT_EQ((*a)->architecture, SaeArchitecture::kJumpRelu);
  EXPECT_FALSE((*a)->apply_b_dec_to_input);
  EXPECT_EQ((*a)->enc, (*b)->enc);
  EXPECT_EQ((*a)->dec, (*b)->dec);
  EXPECT_EQ((*a)->threshold, (*b)->threshold);
  EXPECT_EQ((*b)->apply_b_dec_to_input, false);
  // NAME= and @HOOK in a spec.
  auto named = LoadSae("mine=" + dir + "@blocks.1.hook_resid_mid");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ((*named)->name, "mine");
  EXPECT_EQ((*named)->hook, Hook::kResidMid);
  EXPECT_EQ((*named)->layer, 1);
}

void ExpectRefused(const std::string& spec, const std::string& needle,
                   absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  const auto s = LoadSae(spec);
  EXPECT_EQ(s.status().code(), code) << spec << ": " << s.status();
  EXPECT_NE(s.status().message().find(needle), std::string::npos) << s.status();
}

TEST_F(SaeFileTest, BrokenFilesAreRefusedNamingTheField) {
  const std::string base = "--format saelens --d-in 8 --d-sae 6 --hook blocks.0.hook_resid_post ";
  ExpectRefused(Make("a", base + "--corrupt missing-tensor"), "tensor W_dec is missing");
  ExpectRefused(Make("b", base + "--corrupt wrong-shape"),
                "tensor W_enc: expected shape [8, 6], got [8, 7]");
  ExpectRefused(Make("c", base + "--corrupt truncated"), "sae_weights.safetensors");
  ExpectRefused(Make("d", base + "--corrupt bad-architecture"),
                "architecture \"gated\" is not one kvlens runs");
  ExpectRefused(Make("e", base + "--corrupt bad-normalize"),
                "normalize_activations \"expected_average_only_in\"");
  ExpectRefused(Make("f", base + "--corrupt no-hook"), "hook_name is missing");
  ExpectRefused(Make("g", base) + "@blocks.1.hook_q", "is none an SAE can read");
  const std::string npz = Make("p.npz", "--format npz --d-in 8 --d-sae 6");
  ExpectRefused(npz, "names no hook");
  ExpectRefused(dir_.File("nothing"), "does not exist", absl::StatusCode::kNotFound);
  // Compressed, and missing an array: written by numpy directly.
  const std::string packed = dir_.File("packed.npz"), partial = dir_.File("partial.npz");
  const std::string cmd = absl::StrCat(
      testing::OraclePython(),
      " -c \"import numpy as np; z = np.zeros((8, 6), np.float32); "
      "v = np.zeros(6, np.float32); np.savez_compressed('",
      packed,
      "', W_enc=z, W_dec=z.T.copy(), b_enc=v, b_dec=np.zeros(8, np.float32), threshold=v); "
      "np.savez('",
      partial, "', W_enc=z, W_dec=z.T.copy(), b_enc=v, b_dec=np.zeros(8, np.float32))\"");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  ExpectRefused(packed + "@blocks.0.hook_resid_post", "np.savez_compressed");
  ExpectRefused(partial + "@blocks.0.hook_resid_post", "array threshold is missing");
  // Not a zip at all.
  const std::string junk = dir_.File("junk.npz");
  std::FILE* f = std::fopen(junk.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fputs("this is not an archive, just some bytes long enough to look for a record", f);
  std::fclose(f);
  ExpectRefused(junk + "@blocks.0.hook_resid_post", "no zip end-of-central-directory record");
  const std::string other = dir_.File("weights.bin");
  fs::copy_file(junk, other);
  ExpectRefused(other + "@blocks.0.hook_resid_post",
                "is neither a SAELens directory (cfg.json + sae_weights.safetensors) nor a Gemma "
                "Scope .npz");
}

}  // namespace
}  // namespace kvlens::interpret
