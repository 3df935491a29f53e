// The attention backward's arguments, shared by every implementation (the reference in
// kernels/cpu/reference_backward.h, CudaBackend::AttentionBackward), and the checks they
// all make first, so that every one rejects the same calls with the same messages.
//
// Per head (the contract in ARCHITECTURE.md, never a Jacobian):
//   dV = Aᵀ G          [Tk, Dh]   (a KV head sums over the H/Hkv query heads reading it)
//   dA = G Vᵀ          [Tq, Tk]   (visible entries; masked entries are reported as 0)
//   dS = A ⊙ (dA − rowsum(A ⊙ dA))    (the scores the softmax saw: capped ones with softcap)
//   dR = dS ⊙ (1 − tanh²(R / softcap)) with softcap, R = scale · QKᵀ; else dR = dS
//   dQ = dR K · scale  [Tq, Dh]
//   dK = dRᵀ Q · scale [Tk, Dh]
#ifndef KVLENS_KERNELS_ATTENTION_BACKWARD_H_
#define KVLENS_KERNELS_ATTENTION_BACKWARD_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/attention_check.h"
#include "kernels/backend.h"

namespace kvlens::kernels {

template <typename T>
struct AttentionBackwardArgs {
  // The forward call's inputs (same meaning as AttentionArgs).
  const T* q = nullptr;  // [Tq, H, Dh], rows q_stride apart
  int64_t q_stride = 0;
  int num_queries = 0;
  int num_keys = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int query_offset = 0;
  bool causal = true;
  int window = 0;
  double scale = 0.0;
  double softcap = 0.0;
  const int32_t* q_doc_ids = nullptr;  // [Tq] or nullptr
  const int32_t* k_doc_ids = nullptr;  // [Tk] or nullptr
  KvSource<T> kv;
  const T* probs = nullptr;  // [H, Tq, Tk]: the probabilities the forward used
  // Upstream gradient of the output.
  const T* dout = nullptr;  // [Tq, H, Dh], rows dout_stride apart
  int64_t dout_stride = 0;
  // Results (overwritten). dq/dk/dv are required; the maps are optional.
  T* dq = nullptr;       // [Tq, H, Dh] contiguous
  T* dk = nullptr;       // [Tk, Hkv, Dh] contiguous
  T* dv = nullptr;       // [Tk, Hkv, Dh] contiguous
  T* dprobs = nullptr;   // optional [H, Tq, Tk]
  T* dscores = nullptr;  // optional [H, Tq, Tk]
};

// The forward AttentionArgs a backward call mirrors (for the shared checks and the mask).
template <typename T>
AttentionArgs<T> ForwardArgsOf(const AttentionBackwardArgs<T>& b) {
  AttentionArgs<T> a;
  a.q = b.q;
  a.q_stride = b.q_stride;
  a.num_queries = b.num_queries;
  a.num_keys = b.num_keys;
  a.num_heads = b.num_heads;
  a.num_kv_heads = b.num_kv_heads;
  a.head_dim = b.head_dim;
  a.query_offset = b.query_offset;
  a.causal = b.causal;
  a.window = b.window;
  a.scale = b.scale;
  a.softcap = b.softcap;
  a.q_doc_ids = b.q_doc_ids;
  a.k_doc_ids = b.k_doc_ids;
  a.kv = b.kv;
  a.out = const_cast<T*>(b.dout);  // only checked for null and stride, never written
  a.out_stride = b.dout_stride;
  return a;
}

// A backward call's inputs from the forward call it differentiates: q, the shape, the mask,
// the cache and the probabilities the forward wrote. dout and the results are left unset.
template <typename T>
AttentionBackwardArgs<T> BackwardArgsOf(const AttentionArgs<T>& f) {
  AttentionBackwardArgs<T> b;
  b.q = f.q;
  b.q_stride = f.q_stride;
  b.num_queries = f.num_queries;
  b.num_keys = f.num_keys;
  b.num_heads = f.num_heads;
  b.num_kv_heads = f.num_kv_heads;
  b.head_dim = f.head_dim;
  b.query_offset = f.query_offset;
  b.causal = f.causal;
  b.window = f.window;
  b.scale = f.scale;
  b.softcap = f.softcap;
  b.q_doc_ids = f.q_doc_ids;
  b.k_doc_ids = f.k_doc_ids;
  b.kv = f.kv;
  b.probs = f.probs;
  return b;
}

// The forward's shape checks (ValidateAttentionArgs, with dout as the output), then the
// backward's own: INVALID_ARGUMENT naming the field. Does not check that every row sees a
// key (CheckEveryRowSeesAKey does, in O(Tq·Tk)).
template <typename T>
absl::Status ValidateAttentionBackwardArgs(const AttentionBackwardArgs<T>& b) {
  if (absl::Status s = ValidateAttentionArgs(ForwardArgsOf(b)); !s.ok()) return s;
  if (b.probs == nullptr) return absl::InvalidArgumentError("AttentionBackwardArgs.probs is null");
  if (b.dq == nullptr || b.dk == nullptr || b.dv == nullptr) {
    return absl::InvalidArgumentError("AttentionBackwardArgs.dq, dk and dv must all be set");
  }
  if (b.kv.dtype != KvDtype::kActivation) {  // the tapes keep their K and V in T
    return absl::InvalidArgumentError(
        absl::StrCat("AttentionBackwardArgs.kv.dtype must be the activation type, got ",
                     std::string(KvDtypeName(b.kv.dtype))));
  }
  return absl::OkStatus();
}

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_ATTENTION_BACKWARD_H_
