// Reductions over one row of logits for the engine's sampling (engine/sampler.h), compiled
// for the build machine's instruction set (as cpu_backend.cc) so their loops vectorise,
// but without contracting a·b + c into one FMA: each result is the same on every machine,
// so a seeded request draws the same token everywhere. log Σ_i e^(l_i) (the
// log-probabilities; exponentials in float by ExpNegated, summed in double), the max and
// the greedy pick, and the weights of a temperature draw.
#ifndef KVLENS_KERNELS_CPU_ROW_REDUCE_H_
#define KVLENS_KERNELS_CPU_ROW_REDUCE_H_

#include <cstdint>

#include "absl/types/span.h"

namespace kvlens::kernels {

// The largest logit (NaN ignored; −inf for an empty row).
float MaxLogit(absl::Span<const float> logits);

// max_i l_i + log Σ_i e^(l_i − max): −inf for an empty row or one of −inf only; a −inf
// logit adds nothing.
double LogSumExp(absl::Span<const float> logits);

// The index of the largest logit, the first one if several tie (std::max_element's
// answer; a NaN logit is never picked). 0 for an empty row, or one of −inf or NaN only.
int32_t ArgMax(absl::Span<const float> logits);

// out[i] = e^((l_i − max_l) / temperature) in float (ExpNegated: 0 for a −inf logit and
// wherever the weight is below e^−87.3): a row's unnormalised sampling weights at
// temperature > 0, max_l its largest logit. out holds logits.size() floats.
void TemperatureWeights(absl::Span<const float> logits, float max_l, double temperature,
                        float* out);

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_ROW_REDUCE_H_
