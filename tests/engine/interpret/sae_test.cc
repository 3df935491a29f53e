// SAE arithmetic on a hand-built 2 → 3 autoencoder, every value worked out by hand below,
// on both backends; hook names an SAE may read; an SAE that does not fit the model.
//
//   W_enc columns: f0 = (1, 0), f1 = (0, 1), f2 = (1, 1); b_enc = (0, −1, −0.5)
//   W_dec rows:    (1, 0), (0, 2), (1, 1);                b_dec = (0.5, −0.5)
//   x = (2, 1):    pre = (2, 0, 2.5)
//   x − b_dec = (1.5, 1.5): pre = (1.5, 0.5, 2.5)
#include "engine/interpret/sae.h"

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/interpret/tiny_model.h"

namespace kvlens::interpret {
namespace {

Sae HandSae(SaeArchitecture arch, bool centre = false, int k = 0) {
  Sae s;
  s.name = "hand";
  s.architecture = arch;
  s.d_in = 2;
  s.d_sae = 3;
  s.k = k;
  s.apply_b_dec_to_input = centre;
  s.enc = {1, 0, 0, 1, 1, 1};  // [d_sae, d_in] = W_encᵀ
  s.b_enc = {0, -1, -0.5};
  s.dec = {1, 0, 1, 0, 2, 1};  // [d_in, d_sae] = W_decᵀ
  s.b_dec = {0.5, -0.5};
  s.threshold = {2.5, -1, 1};
  return s;
}

template <typename T>
void ExpectCodes(kernels::Backend<T>& be) {
  const T x[2] = {2, 1};
  using V = std::vector<T>;
  EXPECT_EQ(SaeEncode(HandSae(SaeArchitecture::kStandard), be, x, 1), (V{2, 0, 2.5}));
  // f0: 2 ≤ its threshold 2.5; f1: pre 0 passes −1, relu(0) = 0; f2: 2.5 > 1.
  EXPECT_EQ(SaeEncode(HandSae(SaeArchitecture::kJumpRelu), be, x, 1), (V{0, 0, 2.5}));
  EXPECT_EQ(SaeEncode(HandSae(SaeArchitecture::kTopK, false, 1), be, x, 1), (V{0, 0, 2.5}));
  EXPECT_EQ(SaeEncode(HandSae(SaeArchitecture::kTopK, false, 2), be, x, 1), (V{2, 0, 2.5}));
  EXPECT_EQ(SaeEncode(HandSae(SaeArchitecture::kStandard, true), be, x, 1), (V{1.5, 0.5, 2.5}));
  // topk keeps the k largest pre-activations, then relu: with x = (−2, −3), pre = (−2, −4,
  // −5.5): the top one is f0, relu'd to 0.
  const T neg[2] = {-2, -3};
  EXPECT_EQ(SaeEncode(HandSae(SaeArchitecture::kTopK, false, 1), be, neg, 1), (V{0, 0, 0}));
  // x̂ of f = (2, 0, 2.5): (2 + 2.5, 2.5) + b_dec = (5, 2); two rows at once.
  const T f[6] = {2, 0, 2.5, 0, 1, 0};
  EXPECT_EQ(SaeDecode(HandSae(SaeArchitecture::kStandard), be, f, 2), (V{5, 2, 0.5, 1.5}));
}

TEST(Sae, HandWorkedCodesOnBothBackends) {
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  ExpectCodes<double>(ref);
  ExpectCodes<float>(fast);
}

TEST(Sae, HookNames) {
  Hook hook;
  int layer = -1;
  for (auto [name, want, l] : {std::tuple{"blocks.0.hook_resid_pre", Hook::kResidPre, 0},
                               std::tuple{"blocks.12.hook_resid_mid", Hook::kResidMid, 12},
                               std::tuple{"blocks.20.hook_resid_post", Hook::kResidPost, 20},
                               std::tuple{"blocks.3.hook_attn_out", Hook::kAttnOut, 3},
                               std::tuple{"blocks.3.hook_mlp_out", Hook::kMlpOut, 3},
                               std::tuple{"blocks.7.attn.hook_z", Hook::kZ, 7}}) {
    ASSERT_TRUE(ParseSaeHook(name, &hook, &layer).ok()) << name;
    EXPECT_EQ(hook, want) << name;
    EXPECT_EQ(layer, l) << name;
  }
  for (const char* bad :
       {"blocks.x.hook_resid_post", "blocks..hook_resid_post", "resid_post", "blocks.1.hook_q",
        "blocks.-1.hook_resid_pre", "blocks.1.hook_resid_post ", "blocks.1.attn.hook_q",
        "ln_final.hook_normalized"}) {
    const absl::Status s = ParseSaeHook(bad, &hook, &layer);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("blocks.{layer}.hook_resid_pre"), std::string::npos) << s;
  }
}

TEST(Sae, MustFitTheModel) {
  auto m = testing::MakeTinyModel(testing::TinyFamilySpec(3));  // D 16, H 4 × Dh 6 = 24
  Sae s = HandSae(SaeArchitecture::kStandard);
  s.hook_name = "blocks.1.hook_resid_post";
  s.hook = Hook::kResidPost;
  s.layer = 1;
  s.d_in = 16;
  EXPECT_TRUE(CheckSaeFitsModel(s, m->config).ok());
  s.layer = 2;
  EXPECT_NE(CheckSaeFitsModel(s, m->config).message().find("reads layer 2; the model has 2"),
            std::string::npos);
  s.layer = 1;
  s.hook = Hook::kZ;
  s.hook_name = "blocks.1.attn.hook_z";
  EXPECT_NE(CheckSaeFitsModel(s, m->config)
                .message()
                .find("d_in = 16, but the model's blocks.1.attn.hook_z rows have 24 values"),
            std::string::npos)
      << CheckSaeFitsModel(s, m->config);
  s.d_in = 24;
  EXPECT_TRUE(CheckSaeFitsModel(s, m->config).ok());
}

}  // namespace
}  // namespace kvlens::interpret
