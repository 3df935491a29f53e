// Tape: a forward pass over one sequence that keeps every activation the reverse pass
// needs, and Backward, which propagates an objective's gradient through the whole model
// (unembedding, norms, FFN, attention, RoPE, Q/K/V projections, embeddings).
//
// Legend: L layers, n new tokens (query rows), Tk = offset + n keys, D width, H query
// heads, Hkv KV heads, Dh head size, F FFN width, V vocab. Row i is absolute position
// offset + i. Everything is per sequence; batching belongs to Transformer.
//
//   x_l ─┬─ norm ─ xn ─ W_Q/W_K/W_V ─ (q/k head norms) ─ RoPE ─ q,k,v ─ S = q kᵀ/√Dh ─ A =
//   softmax(S) ─ O = A v
//        │                                                                              │
//        └───────────────────────────── + ◀── W_O ◀─────────────────────────────────────┘
//                                       h ─┬─ norm ─ hn ─ FFN ─ f ─┐
//                                          └──────────── + ◀──────┘ = x_{l+1}
//
// The forward uses the Backend's ops for matrix products, norms, RoPE and activations (so
// it reproduces Transformer<T>::Forward) and its own attention loop, which records scores
// and probabilities and accepts Edits: perturbations of any intermediate (finite
// differences), head ablations, attention-row overrides, residual patches and patches of
// one head's q, k, v or output (interventions). Backward uses
// kernels/cpu/reference_backward.h, or a BackwardOps (kernels/backward_ops.h) for its two
// heavy ops.
#ifndef KVLENS_ENGINE_INTERPRET_TAPE_H_
#define KVLENS_ENGINE_INTERPRET_TAPE_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/model.h"
#include "kernels/backend.h"
#include "kernels/backward_ops.h"

namespace kvlens::interpret {

// The tensors a probe can return (and finite differences can perturb).
enum class TensorKind : uint8_t {
  kScores,    // S [L][H, n, Tk], masked = −∞ (gradient 0)
  kProbs,     // A [L][H, n, Tk], masked = 0 (gradient reported as 0)
  kQ,         // [L][n, H, Dh]   post-RoPE
  kK,         // [L][Tk, Hkv, Dh] post-RoPE, every key including a cached prefix
  kV,         // [L][Tk, Hkv, Dh]
  kAttnOut,   // O [L][n, H, Dh] per head, before W_O
  kResidual,  // [L + 1][n, D]: input of layer l; l = 0 is the input embedding (token +
              // GPT-2 position; Gemma's times √D), l = L the stream entering the final norm
};
std::string_view TensorKindName(TensorKind kind);
// A head's own vector, which a HeadPatch may set: q, k, v, attn_out. Of those, k and v are
// one per KV head.
bool IsHeadVector(TensorKind kind);
bool IsPerKvHead(TensorKind kind);
// Where head `head`'s vector of such a kind at new-token row `row` starts in its layer's
// tensor, on a tape and in the gradients alike: [n, H·Dh] for q and attn_out, [Tk, Hkv·Dh]
// for k and v, whose `offset` cached keys come first.
int64_t HeadVectorAt(const ModelConfig& c, TensorKind kind, int offset, int row, int head);

// One entry of a tensor above:
//   kScores/kProbs: (layer, head, row = query row, col = key)
//   kQ/kAttnOut:    (layer, row = query row, head, col = dim)
//   kK/kV:          (layer, row = key, head = KV head, col = dim)
//   kResidual:      (layer 0 … L, row = query row, col = dim); head unused
struct Coord {
  TensorKind kind = TensorKind::kResidual;
  int layer = 0;
  int head = 0;
  int row = 0;
  int col = 0;
};

// Edits the forward applies on the fly. A tape recorded with edits cannot be
// differentiated (Backward returns FAILED_PRECONDITION).
struct Perturbation {  // value at `at` += delta (masked scores/probs are left alone)
  Coord at;
  double delta = 0.0;
};
enum class AblationMode : uint8_t {
  kZero,  // O[:, head] = 0
  kMean,  // O[:, head] = mean over this sequence's rows of O[:, head]
};
struct HeadAblation {
  int layer = 0;
  int head = 0;
  AblationMode mode = AblationMode::kZero;
};
// One FFN neuron's hidden activation (TransformerLens's mlp.hook_post[:, row, neuron]) at
// query row `row`, or every row with row = −1, set to 0 or to its mean over this sequence's
// rows, before W_out reads it.
struct NeuronAblation {
  int layer = 0;
  int neuron = 0;
  int row = -1;
  AblationMode mode = AblationMode::kZero;
};
// Between softmax and A·V for (layer, head, query row): either replace the row by `probs`
// ([Tk]; masked keys must be 0) or, with `probs` empty, set `masked_keys` to 0 and
// renormalise the rest (the same as masking their scores with −∞).
struct RowOverride {
  int layer = 0;
  int head = 0;
  int row = 0;
  std::vector<double> probs;
  std::vector<int> masked_keys;
};
// Where a ResidualPatch writes, under TransformerLens's hook names: the stream entering
// layer `layer` (resid_pre, 0 … L, as kResidual), the stream after its attention
// (resid_mid), or what its attention / FFN adds to the stream (attn_out, mlp_out: after
// b_O and Gemma 2/3's block-output norms, before the add).
enum class PatchSite : uint8_t { kResidPre, kResidMid, kAttnOut, kMlpOut };
std::string_view PatchSiteName(PatchSite site);
// The `site` of layer `layer` at query row `row` := value [D].
struct ResidualPatch {
  int layer = 0;
  int row = 0;
  std::vector<double> value;
  PatchSite site = PatchSite::kResidPre;
};
// One head's vector at query row `row` of layer `layer` := value [Dh], TransformerLens's
// patching of attn.hook_z / hook_q / hook_k / hook_v by position and head. `kind`:
//   kAttnOut: the head's output O[row, head] (z, before W_O), after the layer's ablations;
//   kQ: its query (post-RoPE);
//   kK, kV: KV head `head`'s key / value of the new token at `row` (key offset + row), which
//     every later query of the group reads; post-RoPE for k.
// A patch with another run's value at the same position is the same patch before or after
// RoPE (rotation by position is one bijection), so q and k match TransformerLens's hook_q /
// hook_k, which are taken before it. Patches apply before perturbations of the same tensor.
struct HeadPatch {
  int layer = 0;
  int head = 0;
  int row = 0;
  std::vector<double> value;
  TensorKind kind = TensorKind::kAttnOut;
};
struct Edits {
  std::vector<Perturbation> perturbations;
  std::vector<HeadAblation> ablations;
  std::vector<RowOverride> row_overrides;
  std::vector<ResidualPatch> patches;
  std::vector<HeadPatch> head_patches;
  std::vector<NeuronAblation> neuron_ablations;
  bool empty() const {
    return perturbations.empty() && ablations.empty() && row_overrides.empty() && patches.empty() &&
           head_patches.empty() && neuron_ablations.empty();
  }
};

// The sequence a tape runs on: n new tokens at positions offset … offset + n − 1. With
// offset > 0 the keys and values of positions 0 … offset − 1 come from `prefix_k/v`
// (e.g. read from the KV cache) and are leaves: the prefix is never recomputed.
template <typename T>
struct SequenceInput {
  std::vector<int32_t> tokens;  // [n]
  int offset = 0;
  std::vector<int32_t> doc_ids;          // [offset + n], or empty
  std::vector<std::vector<T>> prefix_k;  // [L][offset, Hkv·Dh] post-RoPE, when offset > 0
  std::vector<std::vector<T>> prefix_v;  // [L][offset, Hkv·Dh]
};

template <typename T>
struct LayerTape {
  std::vector<T> x;           // [n, D]     layer input (residual stream)
  std::vector<T> xn;          // [n, D]     attention norm
  std::vector<T> q_pre;       // [n, H·Dh]  W_Q·xn (+ b), before the per-head norm (Qwen3 only)
  std::vector<T> k_pre;       // [n, Hkv·Dh] the new tokens' W_K·xn, before the norm (Qwen3 only)
  std::vector<T> q;           // [n, H·Dh]  post-RoPE
  std::vector<T> k, v;        // [Tk, Hkv·Dh] every key (prefix rows first), post-RoPE
  std::vector<T> scores;      // [H, n, Tk] masked = −∞
  std::vector<T> probs;       // [H, n, Tk] masked = 0
  std::vector<T> att;         // [n, H·Dh]  O, heads concatenated (after edits)
  std::vector<T> attn_proj;   // [n, D]  O·W_Oᵀ before its norm (sandwich_norms only)
  std::vector<T> attn_delta;  // [n, D]     what attention adds to the stream: O·W_Oᵀ (+ b_O),
                              //            after its norm with sandwich_norms
  std::vector<T> h;           // [n, D]     x + attn_delta
  std::vector<T> hn;          // [n, D]     FFN norm
  std::vector<T> pre;         // [n, F]     W_in·hn (+ b): SwiGLU gate / GELU input
  std::vector<T> up;          // [n, F]     W_up·hn (Llama only)
  std::vector<T> act;         // [n, F]     FFN hidden: silu(pre) ⊙ up, or gelu(pre)
  std::vector<T> ffn_out;     // [n, D]   W_out·act before its norm (sandwich_norms only)
  std::vector<T> ffn_delta;   // [n, D]   what the FFN adds: W_out·act (+ b), after its norm
};

// A layer's tensor of a head-vector kind (IsHeadVector): q, k, v or att.
template <typename T>
const std::vector<T>& HeadTensor(const LayerTape<T>& lt, TensorKind kind) {
  switch (kind) {
    case TensorKind::kQ:
      return lt.q;
    case TensorKind::kK:
      return lt.k;
    case TensorKind::kV:
      return lt.v;
    default:
      return lt.att;
  }
}

template <typename T>
struct Tape {
  SequenceInput<T> input;
  int n = 0;                         // new tokens
  int num_keys = 0;                  // Tk = offset + n
  std::vector<int32_t> positions;    // [n] offset + i
  std::vector<LayerTape<T>> layers;  // [L]
  std::vector<T> x_final;            // [n, D] residual entering the final norm
  std::vector<T> xf;                 // [n, D] final norm
  std::vector<T> logits;             // [n, V]
  bool edited = false;
};

// Bytes of the activations a tape of n new tokens over num_keys keys (offset = num_keys − n
// cached ones, whose keys and values it copies) holds, elements of elem_bytes each; with
// `backward` also those of the Gradients that Backward returns, less the parameter
// gradients. What a probe's working memory grows with: 4·L·H·n·Tk of it are the score and
// probability maps and their gradients. The server refuses requests past
// --max-interp-tape-bytes with it, before allocating.
int64_t TapeBytes(const ModelConfig& c, int n, int num_keys, int elem_bytes, bool backward);
// Bytes the FFN's gradients of `layers` layers add (BackwardOptions::ffn_layers), which
// TapeBytes leaves out: mlp_pre, mlp_post and mlp_pre_linear, 3 · layers · n · F elements
// (GPT-2 keeps two of them, so this bounds its share from above).
int64_t FfnGradientBytes(const ModelConfig& c, int n, int elem_bytes, int layers);

// Runs the forward. Errors (INVALID_ARGUMENT / OUT_OF_RANGE naming the field): empty or
// out-of-vocabulary tokens, positions past the context, doc_ids or prefix of the wrong
// size, a query row without a visible key, edits naming entries that do not exist.
template <typename T>
absl::StatusOr<Tape<T>> RunForward(const Model& model, kernels::Backend<T>& backend,
                                   const SequenceInput<T>& input, const Edits& edits = {});

// RunForward(clean.input, edits) from layer `first_layer` (0 … L) on: the layers before it
// are copied from `clean`, an unedited tape of the same model, and the stream entering it
// taken from there, so edits at `first_layer` and after cost only the layers they reach
// (a patching sweep's cells). The same tape as RunForward's, bit for bit; with
// `copy_skipped` false, the layers before `first_layer` are left empty instead, for a caller
// that reads only the logits and the later layers (the copy costs a memory pass of each).
// INVALID_ARGUMENT when `clean` is edited, or an edit acts before `first_layer`.
template <typename T>
absl::StatusOr<Tape<T>> RunForwardFrom(const Model& model, kernels::Backend<T>& backend,
                                       const Tape<T>& clean, int first_layer, const Edits& edits,
                                       bool copy_skipped = true);

// Upstream gradients Backward starts from (at least one non-empty).
template <typename T>
struct Seed {
  std::vector<T> dlogits;     // [n, V], or empty
  int probe_layer = -1;       // with probe_dout: gradient added at O of this layer
  std::vector<T> probe_dout;  // [n, H·Dh], or empty
};

struct BackwardOptions {
  // Parameter gradients of this layer (W_Q, W_K, W_V, W_O), or −1 for none.
  int param_layer = -1;
  // Key/value rows of positions < kv_leaf_end are leaves: their gradients are reported
  // but do not flow back into the projections (the cached-KV view of a full tape).
  int kv_leaf_end = 0;
  // Keep the feed-forward's gradients (Gradients::mlp_pre, mlp_post, mlp_pre_linear) of
  // these layers (each in [0, L), at most once; empty: none): FfnGradientBytes more, which
  // TapeBytes does not count.
  std::vector<int> ffn_layers;
};

// dJ/dθ for one layer's attention parameters, dense, [out, in] like the weights.
struct ParamGradients {
  int layer = -1;
  std::vector<double> wq, wk, wv, wo;  // [H·Dh, D], [Hkv·Dh, D], [Hkv·Dh, D], [D, H·Dh]
};

// Gradients of the objective, laid out like the tape (see TensorKind for shapes).
template <typename T>
struct Gradients {
  std::vector<std::vector<T>> scores, probs, q, k, v, attn_out;  // [L][…]
  std::vector<std::vector<T>> residual;                          // [L + 1][n, D]
  // [L][n, D]: the stream after layer l's attention (h, resid_mid), which is also the
  // gradient w.r.t. what the attention adds to it (attn_out)
  std::vector<std::vector<T>> resid_mid;
  // [L][n, F] for BackwardOptions::ffn_layers, empty for the other layers (and [] without
  // any): the FFN's hidden (act, mlp_post), its gate / GELU input (pre, mlp_pre) and a gated
  // FFN's up projection (up, mlp_pre_linear; empty for GPT-2)
  std::vector<std::vector<T>> mlp_pre, mlp_post, mlp_pre_linear;
  // [n, D]: the final norm's output (what the unembedding reads; after any final soft-cap's
  // derivative), TransformerLens's ln_final.hook_normalized
  std::vector<T> ln_final;
  ParamGradients params;
  // residual[0]: the gradient w.r.t. the input embeddings.
  const std::vector<T>& embeddings() const { return residual[0]; }
};

// ops: where the matrix products' input gradients and the attention backward run (e.g.
// a StagedBackend over a GPU); null: the reference loops on the host.
template <typename T>
absl::StatusOr<Gradients<T>> Backward(const Model& model, const Tape<T>& tape, const Seed<T>& seed,
                                      const BackwardOptions& options = {},
                                      kernels::BackwardOps<T>* ops = nullptr);

// In place on `rows` [count, heads·Dh], rows row_begin … of layer `layer`'s kQ (query rows,
// at tape.positions) or kK (keys, at their index: a cached prefix first): each pair turned
// back by −angle, RoPE's transpose and inverse. It takes the tape's q and k to
// TransformerLens's hook_q / hook_k (before RoPE, after Qwen3/Gemma 3's head norms), and
// their gradients likewise, since a rotation's transpose carries a gradient back through
// it. Models without RoPE (GPT-2): left alone.
template <typename T>
void TurnBackRope(const Model& model, const Tape<T>& tape, TensorKind kind, int layer,
                  int row_begin, int count, T* rows);

// The value of a tensor entry on the tape / in the gradients (for checks and tests).
template <typename T>
T TapeValue(const Tape<T>& tape, const ModelConfig& c, const Coord& at);
template <typename T>
T GradientValue(const Gradients<T>& g, int num_queries, int num_keys, const ModelConfig& c,
                const Coord& at);
// Flat index of `at` in its [L][…] tensor, or −1 when out of range.
int64_t FlatIndex(const ModelConfig& c, int num_queries, int num_keys, const Coord& at);

// Whether query row i (absolute position offset + i) sees key j: causal, with doc ids the
// same document, and with a sliding window (ModelConfig::sliding_window > 0) one of the
// last `window` positions.
template <typename T>
bool KeyVisible(const SequenceInput<T>& in, int i, int j, int window) {
  if (j > in.offset + i) return false;
  if (window > 0 && in.offset + i - j >= window) return false;
  return in.doc_ids.empty() || in.doc_ids[in.offset + i] == in.doc_ids[j];
}

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_TAPE_H_
