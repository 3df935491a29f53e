// Centred finite differences in float64: the check behind a probe's `verify` option.
//
// For K random entries of each requested tensor, the entry is perturbed as a leaf (the
// forward is re-run with that one intermediate shifted through an Edits perturbation;
// everything downstream is recomputed, everything upstream is not) and the centred
// difference
//   order 2:  fd = (J(x + h) − J(x − h)) / 2h                                 error O(h²)
//   order 4:  fd = (−J(x + 2h) + 8J(x + h) − 8J(x − h) + J(x − 2h)) / 12h     error O(h⁴)
// is compared with the probe's gradient g at that entry:
//   abs_err = |g − fd|,
//   rel_err = |g − fd| / max(|g|, |fd|, 1e-3 · max|g over the tensor|, noise)
//   noise   = 1000 · ε₆₄ · max|J(x ± m·h)| / h   (ε₆₄ = 2.2e-16)
// The floors keep entries whose true gradient is ~0 from dividing by rounding noise: the
// first where the tensor has larger entries, the second where the whole tensor is zero (a
// query that cannot tell its keys apart has dQ = 0; its fd is pure rounding, ~ε|J|/h). Order
// 4 (the default) lets h be large enough (1e-3) that float64 rounding in J (~1e-15 |J|)
// contributes ~1e-12 |J| instead of ~1e-10 |J| at h = 1e-5.
#ifndef KVLENS_ENGINE_INTERPRET_FINITE_DIFFERENCE_H_
#define KVLENS_ENGINE_INTERPRET_FINITE_DIFFERENCE_H_

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"

namespace kvlens::interpret {

// A tensor the check samples. before_rope (kQ and kK only): q or k before RoPE, as
// TurnBackRope gives them (TransformerLens's hook_q / hook_k). Its entry e is a direction
// of the tape's q or k, u = R·e (R the position's rotation: one entry, or two of a rotated
// pair), so the sample perturbs the tape along u and compares with the gradient's component
// g · u, which is the pre-RoPE gradient's entry (Rᵀ·g)[e]. On a model without RoPE, u = e.
struct FdTensor {
  TensorKind kind = TensorKind::kResidual;
  bool before_rope = false;
};

struct FdOptions {
  int samples_per_tensor = 8;  // K
  uint64_t seed = 1;
  int order = 4;       // 2 or 4
  double step = 1e-3;  // h
  std::vector<FdTensor> tensors = {
      {TensorKind::kScores}, {TensorKind::kProbs},   {TensorKind::kQ},       {TensorKind::kK},
      {TensorKind::kV},      {TensorKind::kAttnOut}, {TensorKind::kResidual}};
};

struct FdSample {
  Coord at;               // the entry (before RoPE with FdTensor::before_rope)
  double gradient = 0.0;  // the probe's value
  double fd = 0.0;        // the centred difference
};

struct FdTensorReport {
  TensorKind kind = TensorKind::kResidual;
  bool before_rope = false;
  std::vector<FdSample> samples;
  double max_abs_err = 0.0;
  double max_rel_err = 0.0;
};

struct FdReport {
  std::vector<FdTensorReport> tensors;  // one per requested tensor
  double max_abs_err = 0.0;             // over every sample
  double max_rel_err = 0.0;
  int num_forwards = 0;
};

// Checks `grads` (computed at precision G for `objective` on `input`) against float64
// centred differences of the same objective. Scores and probabilities are sampled among
// visible entries only. Errors: anything RunForward or ValidateObjective rejects.
template <typename G>
absl::StatusOr<FdReport> CheckByFiniteDifferences(const Model& model,
                                                  const SequenceInput<double>& input,
                                                  const Objective& objective,
                                                  const Gradients<G>& grads,
                                                  const FdOptions& options = {});

// The pieces of one sample, shared with the hooks' check (hook_finite_difference.h):
// the centred difference of J at the stencil's offsets m (J(x + m·h·u) = j_at(m)), with
// the largest |J| it saw; rel_err for a gradient g against it (the floors above, `floor`
// the tensor's); and the direction u of the tape's q or k (kQ / kK at `at`) that entry
// `at` before RoPE is, R·e as (entry, weight) pairs (two for a rotated pair, one for a
// dimension RoPE leaves alone, or on a model without RoPE).
struct Stencil {
  double fd = 0.0;
  double j_max = 0.0;
};
absl::StatusOr<Stencil> CentredDifference(
    const FdOptions& options, const std::function<absl::StatusOr<double>(double)>& j_at);
// J of the float64 forward of `input` under `edits`, counting the forward in *num_forwards.
absl::StatusOr<double> ObjectiveUnder(const Model& model, kernels::Backend<double>& be,
                                      const SequenceInput<double>& input,
                                      const Objective& objective, const Edits& edits,
                                      int* num_forwards);
double FdRelativeError(double gradient, const Stencil& st, double floor, const FdOptions& options);
std::vector<std::pair<Coord, double>> RopeDirection(const Model& model,
                                                    const SequenceInput<double>& in,
                                                    kernels::Backend<double>& be, const Coord& at);

// The same input at float64 (prefix K/V converted), for checking a float32 probe.
template <typename T>
SequenceInput<double> ToDouble(const SequenceInput<T>& in);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_FINITE_DIFFERENCE_H_
