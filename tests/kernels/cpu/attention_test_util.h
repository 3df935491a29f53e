// A small attention problem in doubles, and a runner for any Backend<T>.
#ifndef KVLENS_TESTS_KERNELS_CPU_ATTENTION_TEST_UTIL_H_
#define KVLENS_TESTS_KERNELS_CPU_ATTENTION_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels::testing {

// Contiguous layouts: q [Tq, H, Dh], k and v [Tk, Hkv, Dh].
struct AttnProblem {
  int tq = 1, tk = 1, heads = 1, kv_heads = 1, dh = 1;
  int offset = 0;
  bool causal = false;
  int window = 0;
  double scale = 1.0;
  double softcap = 0.0;
  std::vector<double> q, k, v;
  std::vector<int32_t> q_doc, k_doc;  // both empty, or [Tq] and [Tk]
};

struct AttnResult {
  absl::Status status;
  std::vector<double> out;     // [Tq, H, Dh]
  std::vector<double> probs;   // [H, Tq, Tk]
  std::vector<double> scores;  // [H, Tq, Tk]
  double O(int i, int h, int d, const AttnProblem& p) const {
    return out[(static_cast<size_t>(i) * p.heads + h) * p.dh + d];
  }
  double P(int h, int i, int j, const AttnProblem& p) const {
    return probs[(static_cast<size_t>(h) * p.tq + i) * p.tk + j];
  }
  double S(int h, int i, int j, const AttnProblem& p) const {
    return scores[(static_cast<size_t>(h) * p.tq + i) * p.tk + j];
  }
};

template <typename T>
T ScalarOf(Backend<T>*);

constexpr double kUntouched = 12345.0;

// p's call over contiguous K/V (rows of kv_heads · dh) with q, k, v, out and maps (null:
// none) where the caller keeps them; the document ids are p's own.
template <typename T>
AttentionArgs<T> ContiguousArgs(const AttnProblem& p, const T* q, const T* k, const T* v, T* out,
                                T* probs, T* scores) {
  AttentionArgs<T> a;
  a.q = q;
  a.q_stride = static_cast<int64_t>(p.heads) * p.dh;
  a.num_queries = p.tq;
  a.num_keys = p.tk;
  a.num_heads = p.heads;
  a.num_kv_heads = p.kv_heads;
  a.head_dim = p.dh;
  a.query_offset = p.offset;
  a.causal = p.causal;
  a.window = p.window;
  a.scale = p.scale;
  a.softcap = p.softcap;
  if (!p.q_doc.empty()) {
    a.q_doc_ids = p.q_doc.data();
    a.k_doc_ids = p.k_doc.data();
  }
  a.kv.k = k;
  a.kv.v = v;
  a.kv.row_stride = static_cast<int64_t>(p.kv_heads) * p.dh;
  a.out = out;
  a.out_stride = a.q_stride;
  a.probs = probs;
  a.scores = scores;
  return a;
}

// Runs p on backend with contiguous K/V; out/probs/scores start as kUntouched so that a
// failing call can be checked to have written nothing.
template <typename B>
AttnResult RunAttention(B& backend, const AttnProblem& p) {
  using T = decltype(ScalarOf(static_cast<B*>(nullptr)));
  const std::vector<T> q = Cast<T>(p.q), k = Cast<T>(p.k), v = Cast<T>(p.v);
  // Sizes clamp at 0 so that deliberately invalid shapes still reach the backend.
  auto count = [](int64_t a, int64_t b, int64_t c) {
    return static_cast<size_t>(std::max<int64_t>(a, 0) * std::max<int64_t>(b, 0) *
                               std::max<int64_t>(c, 0));
  };
  std::vector<T> out(count(p.tq, p.heads, p.dh), static_cast<T>(kUntouched));
  std::vector<T> probs(count(p.heads, p.tq, p.tk), static_cast<T>(kUntouched));
  std::vector<T> scores(probs.size(), static_cast<T>(kUntouched));
  const AttentionArgs<T> a =
      ContiguousArgs<T>(p, q.data(), k.data(), v.data(), out.data(), probs.data(), scores.data());
  AttnResult r;
  r.status = backend.Attention(a);
  r.out = ToDouble(out);
  r.probs = ToDouble(probs);
  r.scores = ToDouble(scores);
  return r;
}

}  // namespace kvlens::kernels::testing

#endif  // KVLENS_TESTS_KERNELS_CPU_ATTENTION_TEST_UTIL_H_
