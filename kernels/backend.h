// The one interface between the engine and the compute backends.
//
// Legend (fixed for every op): N tokens in a batch (rows), D model width, H query heads,
// Hkv key/value heads, Dh head size, Tq queries and Tk keys of one attention call.
// Activations are row-major; T is the activation scalar: double for the reference
// backend (the oracle), float for served paths.
#ifndef KVLENS_KERNELS_BACKEND_H_
#define KVLENS_KERNELS_BACKEND_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/kv_dtype.h"
#include "kernels/memory.h"
#include "kernels/token_draw.h"
#include "kernels/weight.h"

namespace kvlens::kernels {

// Where the keys and values of one attention call live.
//
// Token t's key row (all Hkv heads, Hkv*Dh elements) starts at
//   k + physical_row(t) * row_stride,   physical_row(t) =
//       block_table ? block_table[t / block_size] * block_size + t % block_size : t
// and likewise for v. A paged KV cache is the block-table case; a plain contiguous
// [Tk, Hkv, Dh] array is block_table == nullptr with row_stride = Hkv*Dh.
//
//   k (paged):  block 0          block 1          …
//               [slot0|slot1|…]  [slot0|slot1|…]       slot = [Hkv, Dh]
template <typename T>
struct KvSource {
  const void* k = nullptr;  // elements of type `dtype`: T, or bf16 bits (uint16_t)
  const void* v = nullptr;
  int64_t row_stride = 0;                // elements between consecutive physical rows
  const int32_t* block_table = nullptr;  // [ceil(Tk / block_size)], or nullptr
  int block_size = 0;                    // tokens per block (with a block table)
  KvDtype dtype = KvDtype::kActivation;

  int64_t PhysicalRow(int64_t t) const {
    return block_table
               ? static_cast<int64_t>(block_table[t / block_size]) * block_size + t % block_size
               : t;
  }
  // Host backends: n elements of token t's key (or value) row from element `col` on, as
  // T: a pointer into `base` when it holds T, else `scratch` (n elements) widened.
  const T* Row(const void* base, int64_t t, int64_t col, int n, T* scratch) const {
    const int64_t at = PhysicalRow(t) * row_stride + col;
    if (dtype == KvDtype::kActivation) return static_cast<const T*>(base) + at;
    const uint16_t* bits = static_cast<const uint16_t*>(base) + at;  // bf16
    for (int e = 0; e < n; ++e) scratch[e] = static_cast<T>(BF16ToF32(bits[e]));
    return scratch;
  }
  const T* KeyRow(int64_t t, int64_t col, int n, T* scratch) const {
    return Row(k, t, col, n, scratch);
  }
  const T* ValueRow(int64_t t, int64_t col, int n, T* scratch) const {
    return Row(v, t, col, n, scratch);
  }
};

// Scaled dot-product attention for one sequence, all heads:
//   S = Q Kᵀ · scale + M,  A = softmax_rows(S),  O = A V
// M is 0 where a key is visible and −∞ where it is masked (never "value set to zero").
// Query row i is absolute position query_offset + i. It sees key j when
//   (!causal || j <= query_offset + i) && (doc ids absent || q_doc[i] == k_doc[j])
//   && (window == 0 || query_offset + i − j < window)
// (a sliding window: each query sees its last `window` positions, itself included).
// A row left with no visible key is an error (INVALID_ARGUMENT naming the row).
// Grouped-query attention: query head h reads KV head h / (H / Hkv).
template <typename T>
struct AttentionArgs {
  const T* q = nullptr;  // [Tq, H, Dh], rows q_stride elements apart
  int64_t q_stride = 0;
  int num_queries = 0;   // Tq
  int num_keys = 0;      // Tk: keys 0 … Tk-1 exist
  int num_heads = 0;     // H
  int num_kv_heads = 0;  // Hkv, divides H
  int head_dim = 0;      // Dh
  int query_offset = 0;  // absolute position of query row 0
  bool causal = true;
  int window = 0;      // > 0: sliding window (Mistral 7B v0.1: 4096)
  double scale = 0.0;  // usually 1/√Dh
  // > 0: each score is softcap · tanh(scale · q·k / softcap) (Gemma 2's attention logit
  // soft-capping: 50); the scores map holds these capped scores.
  double softcap = 0.0;
  const int32_t* q_doc_ids = nullptr;  // [Tq] document of each query, or nullptr
  const int32_t* k_doc_ids = nullptr;  // [Tk] document of each key (both or neither)
  KvSource<T> kv;
  T* out = nullptr;  // [Tq, H, Dh], rows out_stride elements apart
  int64_t out_stride = 0;
  T* probs = nullptr;   // optional [H, Tq, Tk]: the probabilities the forward used; masked = 0
  T* scores = nullptr;  // optional [H, Tq, Tk]: S before the softmax; masked = −∞
};

enum class RopeStyle : uint8_t {
  kAdjacentPairs,  // rotates (0,1), (2,3), … of each head (llama2.c, GGUF "llama")
  kHalfSplit,      // rotates (i, i + Dh/2) (GPT-NeoX, Hugging Face Llama)
};

// Rotary position embedding: pair p of a head at position pos turns by
//   pos · theta^(−2p/Dh) / freq_factors[p]
// (freq_factors null: no division). The factors are Llama 3.1's rope scaling ("llama3"),
// which slows the low frequencies by up to its factor (GGUF rope_freqs.weight).
struct RopeSpec {
  double theta = 10000.0;
  RopeStyle style = RopeStyle::kAdjacentPairs;
  const float* freq_factors = nullptr;  // [Dh/2], host memory outliving the call's work

  // Pair p's angle per position, in double (positions reach 1e5 rad and beyond).
  double Frequency(int p, int head_dim) const {
    const double f = std::pow(theta, -2.0 * p / head_dim);
    return freq_factors != nullptr ? f / static_cast<double>(freq_factors[p]) : f;
  }
};

// One product of Backend::MatMulMany: y[N, out] = x · wᵀ (+ bias when non-empty).
template <typename T>
struct MatMulOutput {
  WeightView w;
  WeightView bias;
  T* y = nullptr;
};

// A Llama layer's new keys and values on their way into the paged cache
// (RmsNormQkvRopeStoreKv): token i's q and k turned at positions[i] by `rope`, its k and v
// stored at cache row dst_rows[i] (StoreKv's contract: negative stores nothing).
struct QkvRopeStore {
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  const int32_t* positions = nullptr;  // [N], host
  const RopeSpec* rope = nullptr;
  const int64_t* dst_rows = nullptr;  // [N], host
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t cache_stride = 0;
  KvDtype cache_dtype = KvDtype::kActivation;
};

template <typename T>
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // Where this backend's activations, KV cache and probs/scores must live. The CPU
  // backends keep the default, host memory (their ops read and write plain pointers);
  // the CUDA backend returns its device memory. Index arrays and weights are always host.
  virtual Memory& memory() { return HostMemory(); }
  // Makes the backend usable from the calling thread (CUDA: its device becomes current
  // there). Cheap; the engine calls it before each forward pass.
  virtual absl::Status MakeCurrent() { return absl::OkStatus(); }
  // Waits for every op enqueued so far and returns the first failure of the void ops
  // (the CPU backends run ops synchronously and never fail one).
  virtual absl::Status Synchronize() { return absl::OkStatus(); }
  // Called before a unit of work (the Transformer: each forward pass; an interpretability
  // worker: each probe), on the thread that runs it. A failure an earlier unit left that
  // the backend recovers from is cleared, so that this unit's ops run: the CUDA backend's
  // out of memory (RESOURCE_EXHAUSTED: an allocation that did not fit leaves the device
  // usable). Any other failure (a kernel fault leaves a CUDA context unusable) is
  // returned, and the ops stay no-ops.
  virtual absl::Status Recover() { return absl::OkStatus(); }
  // The ops from BeginStep to EndStep are one forward step, which a backend may record and
  // run as a whole (the CUDA backend: as a CUDA graph when an identical step ran before).
  // Their results are defined only after EndStep(true); memory() copies in between run at
  // once, so the step must not rely on them. EndStep(false) drops a step that failed part
  // way (what of it had run already stays done; the rest never runs). Both return at once
  // on the CPU backends, which run every op when it is called.
  virtual void BeginStep() {}
  // How many rows a step of n one-token decode entries should have. More than n when the
  // backend runs a few fixed sizes faster (CUDA graphs: one graph for every batch size of
  // a bucket); the Transformer then adds padding entries that attend to one key of a real
  // sequence, store nothing (StoreKv row −1) and whose logits are dropped.
  virtual int PaddedDecodeRows(int n) const { return n; }
  virtual absl::Status EndStep(bool run) {
    (void)run;
    return absl::OkStatus();
  }

  // y[N, out] = x[N, in] · Wᵀ (+ bias[out] when bias is non-empty). W is [out, in].
  virtual void MatMul(const T* x, int n, const WeightView& w, const WeightView& bias, T* y) = 0;
  // out[N, D] = table[ids[i]] (table is [vocab, D]).
  virtual void Embedding(const WeightView& table, const int32_t* ids, int n, T* out) = 0;
  // y = x / sqrt(mean(x²) + eps) ⊙ weight, per row of D. y may be x (in place: Qwen3's
  // norm over each head of q and k).
  virtual void RmsNorm(const T* x, int n, int dim, const WeightView& weight, double eps, T* y) = 0;
  // y = (x − mean) / sqrt(var + eps) ⊙ weight + bias, per row of D (biased variance).
  virtual void LayerNorm(const T* x, int n, int dim, const WeightView& weight,
                         const WeightView& bias, double eps, T* y) = 0;
  // In place on x[N, heads, Dh] (rows row_stride elements apart); token i is at
  // positions[i]. Pair p of a head turns by positions[i] · rope.Frequency(p, Dh).
  virtual void Rope(T* x, int n, int64_t row_stride, int num_heads, int head_dim,
                    const int32_t* positions, const RopeSpec& rope) = 0;
  // x ← GELU(x), tanh approximation (GPT-2), elementwise over count values.
  virtual void Gelu(T* x, int64_t count) = 0;
  // out = silu(gate) ⊙ up, elementwise (SwiGLU).
  virtual void SwiGlu(const T* gate, const T* up, int64_t count, T* out) = 0;
  // out = GELU(gate) ⊙ up, elementwise, GELU's tanh approximation (GeGLU: Gemma's
  // gelu_pytorch_tanh). out may be gate.
  virtual void GeGlu(const T* gate, const T* up, int64_t count, T* out) = 0;
  // x ← factor · x, elementwise (Gemma's embeddings, times √D).
  virtual void Scale(T* x, int64_t count, double factor) = 0;
  // x ← cap · tanh(x / cap), elementwise (Gemma 2's final logit soft-capping: 30).
  virtual void SoftCap(T* x, int64_t count, double cap) = 0;
  // y += x, elementwise (residual connections).
  virtual void Add(T* y, const T* x, int64_t count) = 0;
  // dst ← src, count elements of this backend's memory, as an op of the step: a recorded
  // step records it, where memory().Copy runs at once. The default is memory().Copy (the
  // CPU backends' memcpy, which cannot fail).
  virtual void Copy(T* dst, const T* src, int64_t count) {
    (void)memory().Copy(dst, src, sizeof(T) * static_cast<size_t>(count));
  }
  // y[r] += rows[index[r]] for each of y's n rows (dim values each) whose index[r] is not
  // −1 (those stay as they are): activation steering's vectors, a handful of rows
  // [num_rows, dim] for a step's many. rows and index are host arrays, read when the op is
  // called, so a device backend may stage them as it does index arrays (the CUDA backend:
  // with a recorded step's, which a graph then replays with each step's values).
  // INVALID_ARGUMENT for an index outside [−1, num_rows) or a negative size, or the
  // upload's failure (a device backend may return an earlier op's, as Synchronize()
  // would). The default adds on the host where the memory is host-accessible, else adds a
  // dense copy of the rows uploaded to a scratch allocation.
  virtual absl::Status AddRows(T* y, int n, int64_t dim, const T* rows, int num_rows,
                               const int32_t* index) {
    if (absl::Status s = CheckAddRows(n, dim, num_rows, index); !s.ok()) return s;
    if (n == 0 || dim == 0 || num_rows == 0) return absl::OkStatus();
    const int64_t count = n * dim;
    if (memory().host_accessible()) {
      for (int r = 0; r < n; ++r) {
        if (index[r] < 0) continue;
        const T* add = rows + index[r] * dim;
        for (int64_t d = 0; d < dim; ++d) y[r * dim + d] += add[d];
      }
      return absl::OkStatus();
    }
    std::vector<T> dense(static_cast<size_t>(count), T(0));
    for (int r = 0; r < n; ++r) {
      if (index[r] >= 0) std::copy_n(rows + index[r] * dim, dim, dense.begin() + r * dim);
    }
    absl::StatusOr<void*> scratch = memory().Allocate(sizeof(T) * static_cast<size_t>(count));
    if (!scratch.ok()) return scratch.status();
    absl::Status s = memory().CopyFromHost(*scratch, dense.data(), sizeof(T) * dense.size());
    if (s.ok()) Add(y, static_cast<const T*>(*scratch), count);
    memory().Free(*scratch);
    return s;
  }
  // Copies N new rows of k and v (each row_elems = Hkv*Dh, src rows src_stride apart)
  // into cache rows dst_rows[i] (physical rows of a KvSource layout, cache_stride apart),
  // rounded to the cache's element type (kv_dtype.h). A negative dst_rows[i] stores
  // nothing (a padding row; see PaddedDecodeRows).
  virtual void StoreKv(const T* k, const T* v, int n, int64_t src_stride, int64_t row_elems,
                       const int64_t* dst_rows, void* k_cache, void* v_cache, int64_t cache_stride,
                       KvDtype cache_dtype) = 0;
  virtual absl::Status Attention(const AttentionArgs<T>& args) = 0;
  // Several independent Attention calls (distinct outputs), e.g. one per sequence of a
  // batch, which a backend may run as one launch. On error *failed is the index of the
  // call whose error is returned (and that call's output, and later ones', may be
  // unwritten). The default runs them one by one.
  virtual absl::Status AttentionBatch(absl::Span<const AttentionArgs<T>> calls, int* failed) {
    for (size_t i = 0; i < calls.size(); ++i) {
      if (absl::Status s = Attention(calls[i]); !s.ok()) {
        *failed = static_cast<int>(i);
        return s;
      }
    }
    return absl::OkStatus();
  }

  // Fusions of the engine's layer, for backends where every op is a kernel launch and a
  // pass over memory. The defaults run the plain ops in the same order, so a backend that
  // keeps them computes exactly what the separate calls would.
  //
  // Several products of the same x: outputs[i].y = x · outputs[i].wᵀ (+ its bias), e.g. a
  // layer's q, k and v projections.
  virtual void MatMulMany(const T* x, int n, absl::Span<const MatMulOutput<T>> outputs) {
    for (const MatMulOutput<T>& o : outputs) MatMul(x, n, o.w, o.bias, o.y);
  }
  // Rope on q [N, q_heads, Dh] and k [N, k_heads, Dh] (rows q_stride, k_stride apart),
  // both at positions[i].
  virtual void RopeQK(T* q, int64_t q_stride, int q_heads, T* k, int64_t k_stride, int k_heads,
                      int n, int head_dim, const int32_t* positions, const RopeSpec& rope) {
    Rope(q, n, q_stride, q_heads, head_dim, positions, rope);
    Rope(k, n, k_stride, k_heads, head_dim, positions, rope);
  }
  // RopeQK on q and k, then StoreKv of the rotated k and of v (rows kv_stride apart,
  // kv_heads · head_dim values each): a Llama layer's new keys and values.
  virtual void RopeQKStoreKv(T* q, int64_t q_stride, int q_heads, T* k, const T* v,
                             int64_t kv_stride, int kv_heads, int n, int head_dim,
                             const int32_t* positions, const RopeSpec& rope,
                             const int64_t* dst_rows, void* k_cache, void* v_cache,
                             int64_t cache_stride, KvDtype cache_dtype) {
    RopeQK(q, q_stride, q_heads, k, kv_stride, kv_heads, n, head_dim, positions, rope);
    StoreKv(k, v, n, kv_stride, int64_t{kv_heads} * head_dim, dst_rows, k_cache, v_cache,
            cache_stride, cache_dtype);
  }
  // x += residual, then y = RmsNorm(x): a residual connection followed by the next norm.
  virtual void AddRmsNorm(T* x, const T* residual, int n, int dim, const WeightView& weight,
                          double eps, T* y) {
    Add(x, residual, int64_t{n} * dim);
    RmsNorm(x, n, dim, weight, eps, y);
  }
  // y += x · wᵀ (+ bias): a product whose result is a residual, added into the residual
  // stream y [N, w.rows] (a Llama layer's attention output and feed-forward projection).
  // scratch [N, w.rows] may be overwritten.
  virtual void MatMulAddTo(const T* x, int n, const WeightView& w, const WeightView& bias,
                           T* scratch, T* y) {
    MatMul(x, n, w, bias, scratch);
    Add(y, scratch, int64_t{n} * w.rows);
  }
  // MatMulMany of xn = RmsNorm(x) [N, dim]: a pre-norm layer's q, k and v projections. xn
  // is scratch: a backend that fuses the norm into the products may leave it unwritten.
  virtual void RmsNormMatMulMany(const T* x, int n, int dim, const WeightView& norm, double eps,
                                 T* xn, absl::Span<const MatMulOutput<T>> outputs) {
    RmsNorm(x, n, dim, norm, eps, xn);
    MatMulMany(xn, n, outputs);
  }
  // RmsNormMatMulMany of a layer's q, k and v (qkv[0 … 2]: [N, q_heads·Dh] and twice
  // [N, kv_heads·Dh]), then RopeQKStoreKv of them: a pre-norm layer's attention inputs, up
  // to the cache.
  virtual void RmsNormQkvRopeStoreKv(const T* x, int n, int dim, const WeightView& norm, double eps,
                                     T* xn, absl::Span<const MatMulOutput<T>> qkv,
                                     const QkvRopeStore& kv) {
    RmsNormMatMulMany(x, n, dim, norm, eps, xn, qkv);
    RopeQKStoreKvOf(qkv, n, kv);
  }
  // The same without the norm (x already normalized: Gemma 2's norm adds the pending
  // residual first).
  virtual void MatMulQkvRopeStoreKv(const T* x, int n, absl::Span<const MatMulOutput<T>> qkv,
                                    const QkvRopeStore& kv) {
    MatMulMany(x, n, qkv);
    RopeQKStoreKvOf(qkv, n, kv);
  }
  // MatMulSwiGlu (MatMulGeGlu) of xn = RmsNorm(x), xn scratch as above: a pre-norm
  // layer's gated feed-forward half.
  virtual void RmsNormMatMulSwiGlu(const T* x, int n, int dim, const WeightView& norm, double eps,
                                   T* xn, const WeightView& w_gate, const WeightView& w_up,
                                   T* up_scratch, T* out) {
    RmsNorm(x, n, dim, norm, eps, xn);
    MatMulSwiGlu(xn, n, w_gate, w_up, up_scratch, out);
  }
  virtual void RmsNormMatMulGeGlu(const T* x, int n, int dim, const WeightView& norm, double eps,
                                  T* xn, const WeightView& w_gate, const WeightView& w_up,
                                  T* up_scratch, T* out) {
    RmsNorm(x, n, dim, norm, eps, xn);
    MatMulGeGlu(xn, n, w_gate, w_up, up_scratch, out);
  }
  // x += residual, then y = LayerNorm(x).
  virtual void AddLayerNorm(T* x, const T* residual, int n, int dim, const WeightView& weight,
                            const WeightView& bias, double eps, T* y) {
    Add(x, residual, int64_t{n} * dim);
    LayerNorm(x, n, dim, weight, bias, eps, y);
  }
  // out[N, F] = silu(x · W_gateᵀ) ⊙ (x · W_upᵀ), both weights [F, in]: the gated half of
  // a SwiGLU feed-forward. up_scratch [N, F] may be overwritten; out may not alias x.
  virtual void MatMulSwiGlu(const T* x, int n, const WeightView& w_gate, const WeightView& w_up,
                            T* up_scratch, T* out) {
    MatMul(x, n, w_gate, WeightView{}, out);
    MatMul(x, n, w_up, WeightView{}, up_scratch);
    SwiGlu(out, up_scratch, int64_t{n} * w_gate.rows, out);
  }
  // y[N, out] = gelu_tanh(x · wᵀ + bias): GPT-2's first feed-forward product and its
  // activation (Gelu's tanh form).
  virtual void MatMulGelu(const T* x, int n, const WeightView& w, const WeightView& bias, T* y) {
    MatMul(x, n, w, bias, y);
    Gelu(y, int64_t{n} * w.rows);
  }
  // out[N, F] = gelu_tanh(x · W_gateᵀ) ⊙ (x · W_upᵀ): GeGLU's gated half (Gemma), as
  // MatMulSwiGlu with GeGlu's activation; the same contract.
  virtual void MatMulGeGlu(const T* x, int n, const WeightView& w_gate, const WeightView& w_up,
                           T* up_scratch, T* out) {
    const MatMulOutput<T> gate_up[] = {{w_gate, WeightView{}, out},
                                       {w_up, WeightView{}, up_scratch}};
    MatMulMany(x, n, gate_up);
    GeGlu(out, up_scratch, int64_t{n} * w_gate.rows, out);
  }

  // The token draws[r] picks from row r of logits [rows, vocab] (this backend's memory),
  // into host arrays: token[r] = DrawToken(row r, draws[r]) (the greedy pick where
  // draws[r].temperature is 0) and logprob[r] = l[token] − LogSumExp(row r), in double,
  // and the row's draws[r].top_logprobs most likely tokens with theirs into top_token and
  // top_logprob ([rows, kMaxTopLogprobs]; may be null when no row asks): what
  // engine/sampler.h's SampleRow reports (DrawRows: the logit bias and the penalties over
  // draws[r].token_counts apply to the draw, not to the reported log-probabilities).
  // For a device backend this spares copying the rows out. Waits for the work before it
  // and returns the first failure of the void ops. The default copies the rows to the
  // host where they are not there already and draws there.
  virtual absl::Status DrawTokens(const T* logits, int rows, int vocab, const TokenDraw* draws,
                                  int32_t* token, float* logprob, int32_t* top_token,
                                  float* top_logprob) {
    if (absl::Status s = CheckDraws(rows, vocab, draws, top_token, top_logprob); !s.ok()) {
      return s;
    }
    if (absl::Status s = Synchronize(); !s.ok() || rows <= 0) return s;
    const size_t count = static_cast<size_t>(rows) * static_cast<size_t>(vocab);
    std::vector<T> copy;
    absl::StatusOr<const T*> rows_on_host = OnHost(logits, count, copy);
    if (!rows_on_host.ok()) return rows_on_host.status();
    const T* host = *rows_on_host;
    if constexpr (std::is_same_v<T, float>) {
      DrawRows(host, rows, vocab, draws, token, logprob, top_token, top_logprob);
    } else {
      const std::vector<float> rows_f(host, host + count);
      DrawRows(rows_f.data(), rows, vocab, draws, token, logprob, top_token, top_logprob);
    }
    return absl::OkStatus();
  }

 protected:
  // AddRows' checks: n, dim and num_rows at least 0, each index[r] in [−1, num_rows).
  static absl::Status CheckAddRows(int n, int64_t dim, int num_rows, const int32_t* index) {
    if (n < 0 || dim < 0 || num_rows < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AddRows: n = ", n, ", dim = ", dim, " and num_rows = ", num_rows, " must be >= 0"));
    }
    for (int r = 0; r < n; ++r) {
      if (index[r] < -1 || index[r] >= num_rows) {
        return absl::InvalidArgumentError(absl::StrCat(
            "AddRows: index[", r, "] = ", index[r], " is outside [-1, num_rows = ", num_rows, ")"));
      }
    }
    return absl::OkStatus();
  }
  // INVALID_ARGUMENT if a row asks for top log-probabilities (0 … kMaxTopLogprobs) that
  // there are no arrays for, or names a token outside [0, vocab) in its logit bias or its
  // penalties' token counts (or counts one fewer than once), or forces one outside it.
  static absl::Status CheckDraws(int rows, int vocab, const TokenDraw* draws,
                                 const int32_t* top_token, const float* top_logprob) {
    for (int r = 0; r < rows; ++r) {
      const int k = draws[r].top_logprobs;
      if (k < 0 || k > kMaxTopLogprobs) {
        return absl::InvalidArgumentError(absl::StrCat("DrawTokens: draws[", r,
                                                       "].top_logprobs = ", k, " must be in [0, ",
                                                       kMaxTopLogprobs, "]"));
      }
      if (k > 0 && (top_token == nullptr || top_logprob == nullptr)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "DrawTokens: draws[", r, "].top_logprobs = ", k, " but no top_token/top_logprob"));
      }
      if (const int32_t t = draws[r].forced_token; t < -1 || t >= vocab) {
        return absl::InvalidArgumentError(
            absl::StrCat("DrawTokens: draws[", r, "].forced_token = ", t,
                         " is outside the vocabulary [0, ", vocab, ") (or -1: draw)"));
      }
      for (const auto& [id, value] : draws[r].logit_bias) {
        if (id < 0 || id >= vocab) {
          return absl::InvalidArgumentError(
              absl::StrCat("DrawTokens: draws[", r, "].logit_bias names token ", id,
                           " outside the vocabulary [0, ", vocab, ")"));
        }
      }
      if (!draws[r].HasPenalties()) continue;
      for (const auto& [id, count] : draws[r].token_counts) {
        if (id < 0 || id >= vocab || count < 1) {
          return absl::InvalidArgumentError(absl::StrCat(
              "DrawTokens: draws[", r, "].token_counts has token ", id, " counted ", count,
              " times: the token must be in [0, ", vocab, ") and the count >= 1"));
        }
      }
    }
    return absl::OkStatus();
  }
  // `count` elements of this backend's memory, readable on the host: `data` itself where
  // the memory is host-accessible, else copied into `copy`.
  absl::StatusOr<const T*> OnHost(const T* data, size_t count, std::vector<T>& copy) {
    if (memory().host_accessible()) return data;
    copy.resize(count);
    if (absl::Status s = memory().CopyToHost(copy.data(), data, count * sizeof(T)); !s.ok()) {
      return s;
    }
    return static_cast<const T*>(copy.data());
  }
  // RopeQKStoreKv of q, k and v (qkv[0 … 2].y, rows as RmsNormQkvRopeStoreKv's) as kv
  // says: the second half of that call, for the backends that run it unfused.
  void RopeQKStoreKvOf(absl::Span<const MatMulOutput<T>> qkv, int n, const QkvRopeStore& kv) {
    RopeQKStoreKv(qkv[0].y, int64_t{kv.q_heads} * kv.head_dim, kv.q_heads, qkv[1].y, qkv[2].y,
                  int64_t{kv.kv_heads} * kv.head_dim, kv.kv_heads, n, kv.head_dim, kv.positions,
                  *kv.rope, kv.dst_rows, kv.k_cache, kv.v_cache, kv.cache_stride, kv.cache_dtype);
  }
};

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_BACKEND_H_
