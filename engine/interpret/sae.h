// Sparse autoencoders (SAEs) over one hook's activations, as SAELens and Gemma Scope train
// them: features f = σ(pre), pre = (x − b_dec if apply_b_dec_to_input, else x) · W_enc +
// b_enc, and the reconstruction x̂ = f · W_dec + b_dec, where σ is
//   standard: relu(pre)
//   jumprelu: relu(pre) · [pre > threshold]           (Gemma Scope)
//   topk:     relu of the k largest pre-activations, 0 elsewhere (ties: lower index)
// Loading the files is sae_file.h; here the arithmetic, on a Backend (the two products
// are the backend's MatMul, so fp32 requests run on the CPU backend's threaded kernels and
// fp64 ones exactly on the reference backend).
#ifndef KVLENS_ENGINE_INTERPRET_SAE_H_
#define KVLENS_ENGINE_INTERPRET_SAE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "engine/interpret/activations.h"
#include "kernels/backend.h"

namespace kvlens::interpret {

enum class SaeArchitecture : uint8_t { kStandard, kJumpRelu, kTopK };
std::string_view SaeArchitectureName(SaeArchitecture a);

struct Sae {
  std::string name;  // what requests call it
  std::string path;  // where it was read from
  Hook hook = Hook::kResidPost;
  int layer = 0;
  std::string hook_name;  // TransformerLens's: "blocks.20.hook_resid_post"
  SaeArchitecture architecture = SaeArchitecture::kStandard;
  int d_in = 0, d_sae = 0;
  int k = 0;  // topk only
  bool apply_b_dec_to_input = false;
  // f32, laid out for the backend's y = x · Wᵀ (+ b):
  std::vector<float> enc;        // [d_sae, d_in] = W_encᵀ
  std::vector<float> b_enc;      // [d_sae]
  std::vector<float> dec;        // [d_in, d_sae] = W_decᵀ
  std::vector<float> b_dec;      // [d_in]
  std::vector<float> threshold;  // [d_sae], jumprelu only

  kernels::WeightView EncView() const;
  kernels::WeightView BEncView() const;
  kernels::WeightView DecView() const;
  kernels::WeightView BDecView() const;
};

// (hook, layer) of a TransformerLens hook name an SAE may read: blocks.{l}.hook_resid_pre,
// hook_resid_mid, hook_resid_post, hook_attn_out, hook_mlp_out, attn.hook_z.
// INVALID_ARGUMENT naming the accepted forms otherwise.
absl::Status ParseSaeHook(std::string_view name, Hook* hook, int* layer);

// OK when `sae` reads a hook the model has (its layer exists, d_in = the hook's row width:
// D, or H·Dh for z); else INVALID_ARGUMENT naming the SAE, the field and both values.
absl::Status CheckSaeFitsModel(const Sae& sae, const ModelConfig& c);

// Feature activations [rows, d_sae] of the hook rows x [rows, d_in].
template <typename T>
std::vector<T> SaeEncode(const Sae& sae, kernels::Backend<T>& backend, const T* x, int rows);

// The reconstruction [rows, d_in] of features f [rows, d_sae].
template <typename T>
std::vector<T> SaeDecode(const Sae& sae, kernels::Backend<T>& backend, const T* f, int rows);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_SAE_H_
