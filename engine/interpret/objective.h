// Objectives a gradient probe differentiates, and the attributions built from gradients.
//
//   kLogProb       J = Σ_(row, token) log softmax(logits[row])[token]
//   kLogitDiff     J = logits[row][token_a] − logits[row][token_b]
//   kAttnOutProbe  J = Σ G ⊙ O[layer, :, head, :]   (G [n, Dh], O before W_O)
//
// Rows are query rows of the tape: row i is absolute position offset + i.
#ifndef KVLENS_ENGINE_INTERPRET_OBJECTIVE_H_
#define KVLENS_ENGINE_INTERPRET_OBJECTIVE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/interpret/tape.h"

namespace kvlens::interpret {

struct TokenTarget {
  int row = 0;
  int32_t token = 0;
};

struct Objective {
  enum class Kind : uint8_t { kLogProb, kLogitDiff, kAttnOutProbe };
  Kind kind = Kind::kLogProb;
  std::vector<TokenTarget> targets;  // kLogProb
  int row = 0;                       // kLogitDiff
  int32_t token_a = 0, token_b = 0;  // kLogitDiff
  int layer = 0, head = 0;           // kAttnOutProbe
  std::vector<double> g;             // kAttnOutProbe: G [n, Dh]

  static Objective LogProb(std::vector<TokenTarget> targets);
  static Objective LogitDiff(int row, int32_t token_a, int32_t token_b);
  static Objective AttnOutProbe(int layer, int head, std::vector<double> g);
};

// INVALID_ARGUMENT naming the field when rows, tokens, layer/head or G's size do not fit.
absl::Status ValidateObjective(const Objective& o, const ModelConfig& c, int num_rows);

// J on a (possibly edited) tape, accumulated in double.
template <typename T>
double EvaluateObjective(const Objective& o, const ModelConfig& c, const Tape<T>& tape);

// dJ/dlogits (kLogProb: onehot − softmax per target; kLogitDiff: ±1) or dJ/dO (the probe).
template <typename T>
absl::StatusOr<Seed<T>> SeedFor(const Objective& o, const ModelConfig& c, const Tape<T>& tape);

// SeedFor + Backward in one call.
template <typename T>
absl::StatusOr<Gradients<T>> ObjectiveGradients(const Model& model, const Tape<T>& tape,
                                                const Objective& o,
                                                const BackwardOptions& options = {},
                                                kernels::BackwardOps<T>* ops = nullptr);

// Input × gradient saliency per row: Σ_d x0[i, d] · dJ/dx0[i, d], x0 the input embedding.
template <typename T>
std::vector<double> InputTimesGradient(const Tape<T>& tape, const Gradients<T>& g, int dim);

// Attention × gradient of one layer: A ⊙ dJ/dA, [H, n, Tk] (masked entries 0).
template <typename T>
std::vector<double> AttentionTimesGradient(const Tape<T>& tape, const Gradients<T>& g, int layer);

// log softmax of one logits row, in double.
template <typename T>
std::vector<double> LogSoftmax(const T* logits, int vocab);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_OBJECTIVE_H_
