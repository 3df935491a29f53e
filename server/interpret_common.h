// What the Interpret runners share (interpret_runner.cc, readout_runner.cc,
// sae_runner.cc): the backend of a precision, the request's sequence, its tape input, and
// the working memory of its tapes. Server-internal; no gRPC here.
#ifndef KVLENS_SERVER_INTERPRET_COMMON_H_
#define KVLENS_SERVER_INTERPRET_COMMON_H_

#include <string>
#include <type_traits>

#include "absl/status/statusor.h"
#include "engine/interpret/tape.h"
#include "server/interpret_runner.h"

namespace kvlens::server {

// The backend a request of precision T runs its tape on: the fp64 reference, or the
// worker's fp32 backend (staged onto its GPU with --interp-device).
template <typename T>
kernels::Backend<T>& BackendOf(InterpBackends& b) {
  if constexpr (std::is_same_v<T, double>) {
    return b.f64;
  } else {
    return b.fp32();
  }
}

// The backward's heavy ops for fp32 requests: staged onto the GPU with --interp-device, else
// the CPU backend's (threaded, in float); fp64 requests: null, the reference loops.
template <typename T>
kernels::BackwardOps<T>* BackwardOpsOf(InterpBackends& b) {
  if constexpr (std::is_same_v<T, double>) {
    return nullptr;
  } else {
    if (b.staged != nullptr) return b.staged.get();
    return &b.f32;
  }
}

inline v1::Precision PrecisionOf(bool fp64) {
  return fp64 ? v1::PRECISION_FP64 : v1::PRECISION_FP32;
}

// The sequence of `input`: text, ids, or (when allowed) an open session's tokens.
absl::StatusOr<SequenceSpec> Resolve(const InterpContext& ctx, const v1::PromptInput& input,
                                     const std::string& field, bool allow_session);

template <typename T>
interpret::SequenceInput<T> InputOf(const SequenceSpec& seq) {
  interpret::SequenceInput<T> in;
  in.tokens = seq.tokens;
  in.doc_ids = seq.doc_ids;
  return in;
}

// Bytes of `tapes` forward tapes of n positions over num_keys keys in T, one of them also
// differentiated when `backward` (with the parameter gradients of one layer when asked).
template <typename T>
int64_t WorkBytes(const ModelConfig& c, int n, int num_keys, int tapes, bool backward,
                  bool param_grads = false) {
  const int e = static_cast<int>(sizeof(T));
  int64_t bytes = tapes * interpret::TapeBytes(c, n, num_keys, e, false);
  if (backward) {
    bytes += interpret::TapeBytes(c, n, num_keys, e, true) -
             interpret::TapeBytes(c, n, num_keys, e, false);
  }
  if (param_grads) {
    bytes += int64_t{8} * 2 * (int64_t{c.q_dim()} + c.kv_dim()) * c.dim;  // wq, wk, wv, wo
  }
  return bytes;
}

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_INTERPRET_COMMON_H_
