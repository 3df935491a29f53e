// Reading SAEs (sae.h) from the files their trainers publish:
//   - a SAELens directory: cfg.json (architecture standard | jumprelu | topk, d_in, d_sae,
//     hook_name, apply_b_dec_to_input, normalize_activations "none", activation_fn_kwargs.k)
//     + sae_weights.safetensors (W_enc [d_in, d_sae], b_enc, W_dec [d_sae, d_in], b_dec,
//     threshold for jumprelu; f32, f16 or bf16);
//   - a Gemma Scope params.npz (np.savez: W_enc, W_dec, b_enc, b_dec, threshold in f32):
//     JumpReLU, the input not centred by b_dec, no hook in the file.
// Weights are widened to f32 (exactly) and transposed for the backend's products.
#ifndef KVLENS_ENGINE_INTERPRET_SAE_FILE_H_
#define KVLENS_ENGINE_INTERPRET_SAE_FILE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/interpret/sae.h"

namespace kvlens::interpret {

// spec: [NAME=]PATH[@HOOK]. HOOK, a TransformerLens name (blocks.20.hook_resid_post), wins
// over the cfg's hook_name and is required for an .npz; NAME (what requests call the SAE)
// defaults to the hook name. NOT_FOUND for a missing path; INVALID_ARGUMENT naming the file
// and the field (missing or misshapen tensor, unknown architecture or normalisation, a
// truncated file) otherwise.
absl::StatusOr<std::shared_ptr<const Sae>> LoadSae(const std::string& spec);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_SAE_FILE_H_
