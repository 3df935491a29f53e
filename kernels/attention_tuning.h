// Tuning the CUDA backend's attention kernels on the GPU at hand (CUDA-free types: the
// shape asked for and the report; the tuner is kernels/cuda/attention_tuner.h, reached
// through kernels/backend_factory.h's TuneAttention).
//
// The kernels' defaults (kernels/cuda/attention.h, cuda_backend.h) were chosen on one GPU,
// and some options have never been timed on any. Tuning times each candidate layout of
// prefill attention and each decode attention kernel at the model's shapes, checks each
// candidate's output against the default's on the same inputs, and keeps the fastest that
// agrees, as cuDNN's benchmark mode or Triton's autotuner pick a kernel on the device that
// runs it.
#ifndef KVLENS_KERNELS_ATTENTION_TUNING_H_
#define KVLENS_KERNELS_ATTENTION_TUNING_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/kv_dtype.h"

namespace kvlens::kernels {

// The attention calls timed: one prompt of prefill_tokens (causal, over a paged cache of
// blocks of block_size rows), and for each of decode_batches a decode call of that many
// sequences: one of decode_keys keys, or rows whose keys are spread evenly up to
// decode_keys (keys · (r + 1) / batch), as a loaded server's sequences are at all stages (a
// server's decode runs from one sequence, where latency counts, to --max-running of them
// under load, where the blocks are many and the key splits few: a kernel may win at one
// and lose at the other).
struct AttentionTuneShape {
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  KvDtype cache_dtype = KvDtype::kActivation;
  int block_size = 16;
  double softcap = 0.0;
  int prefill_tokens = 2048;  // 0: prefill is not tuned
  int decode_keys = 4096;     // 0: decode is not tuned
  std::vector<int> decode_batches = {1};

  static constexpr int kMaxHeadDim = 512;
  static constexpr int kMaxTokens = 1 << 17;
  static constexpr int kMaxDecodeBatch = 256;
  static constexpr int kMaxDecodeBatches = 4;
  // INVALID_ARGUMENT naming the field and its limit.
  absl::Status Validate() const;
};

// One timed candidate: a kernel layout and how it did.
struct TunedCandidate {
  std::string name;  // e.g. "flash: 128-query blocks of 8 warps (default)"
  // A call's time, for each call of the phase (prefill: one; decode: one per decode batch).
  std::vector<double> seconds;
  // Of the call where the candidate came closest to its tolerance: max |output − the
  // default's output| and the error allowed (relative to the default's largest output).
  double max_error = 0.0;
  double tolerance = 0.0;
  std::string failure;  // why the candidate could not run here (then not timed)
  bool chosen = false;

  // Ran and agreed with the default (a NaN error does not).
  bool accepted() const { return failure.empty() && max_error <= tolerance; }
  // Each call's time in µs, "/"-separated ("12.5 / 40.0").
  std::string Microseconds() const;
};

// Each candidate's time relative to the first that ran (the default, which the tuner lists
// first, unless the backend refused it): the mean over the phase's calls of its seconds
// over that one's, so that each decode batch counts alike however long its calls take;
// 0 for a candidate that did not run (or timed other calls than the reference).
std::vector<double> RelativeTimes(absl::Span<const TunedCandidate> candidates);
// The index of the accepted candidate of least relative time (with one call a phase: the
// fastest), -1 when none is. The default agrees with itself.
int FastestAccepted(absl::Span<const TunedCandidate> candidates);

struct AttentionTuneReport {
  std::vector<TunedCandidate> prefill;  // empty when prefill was not tuned
  std::vector<TunedCandidate> decode;   // empty when decode was not tuned
  std::string shape;                    // what was timed, in words

  // One line a candidate: "prefill  <name>  <µs a call>  <× the default's>  error <e> of
  // <tol>  [chosen]" (decode: µs at each batch, "/"-separated).
  std::string ToString() const;
  // What was kept, for a backend's description: "prefill <name>; decode <name>" (a phase
  // not tuned, or where none agreed, left out; "" when neither).
  std::string Choice() const;
};

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_ATTENTION_TUNING_H_
