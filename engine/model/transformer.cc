#include "engine/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvlens {

template <typename T>
Transformer<T>::Transformer(const Model& model, kernels::Backend<T>& backend)
    : model_(model),
      config_(model.config),
      backend_(backend),
      x_(backend.memory()),
      xn_(backend.memory()),
      q_(backend.memory()),
      k_(backend.memory()),
      v_(backend.memory()),
      att_(backend.memory()),
      proj_(backend.memory()),
      hidden_(backend.memory()),
      up_(backend.memory()),
      logits_(backend.memory()),
      probs_(backend.memory()),
      last_probs_(backend.memory()),
      probe_out_(backend.memory()),
      saved_q_(backend.memory()) {
  for (int l = 0; l < model.config.num_layers; ++l) {
    ropes_.push_back(RopeOf(model.config, model.weights, l));
  }
}

template <typename T>
absl::Status Transformer<T>::Validate(absl::Span<const BatchEntry> batch,
                                      const KvCacheStorage<T>& cache) const {
  if (batch.empty()) return absl::InvalidArgumentError("forward: empty batch");
  if (&cache.memory() != &backend_.memory()) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward: the KV cache is in ", std::string(cache.memory().name()),
                     " memory, the backend computes in ", std::string(backend_.memory().name())));
  }
  for (size_t e = 0; e < batch.size(); ++e) {
    const BatchEntry& b = batch[e];
    if (b.tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("batch entry ", e, ": tokens is empty"));
    }
    if (b.num_cached < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch entry ", e, ": num_cached = ", b.num_cached, " is negative"));
    }
    const int64_t total = b.num_cached + static_cast<int64_t>(b.tokens.size());
    if (total > config_.max_seq_len) {
      return absl::OutOfRangeError(absl::StrCat("batch entry ", e, ": ", total,
                                                " tokens exceed the context length ",
                                                config_.max_seq_len));
    }
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      if (b.tokens[i] < 0 || b.tokens[i] >= config_.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("batch entry ", e, ": token id ", b.tokens[i], " at index ", i,
                         " is outside the vocabulary [0, ", config_.vocab_size, ")"));
      }
    }
    const int64_t blocks_needed = (total + cache.block_size() - 1) / cache.block_size();
    if (static_cast<int64_t>(b.block_table.size()) < blocks_needed) {
      return absl::InvalidArgumentError(absl::StrCat("batch entry ", e, ": block_table has ",
                                                     b.block_table.size(), " blocks, ", total,
                                                     " tokens need ", blocks_needed));
    }
    for (int32_t id : b.block_table.subspan(0, blocks_needed)) {
      if (id < 0 || id >= cache.num_blocks()) {
        return absl::InvalidArgumentError(absl::StrCat("batch entry ", e, ": block id ", id,
                                                       " outside the pool [0, ", cache.num_blocks(),
                                                       ")"));
      }
    }
    if (!b.residual_adds.empty()) {  // (no field name built on every step otherwise)
      if (absl::Status s = CheckResidualAdds(b.residual_adds, config_,
                                             absl::StrCat("batch entry ", e, ": residual_adds"));
          !s.ok()) {
        return s;
      }
    }
    if (!b.score_next.empty()) {
      const size_t n = b.tokens.size();
      if (!b.all_logits || (b.score_next.size() != n && b.score_next.size() + 1 != n)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "batch entry ", e, ": score_next has ", b.score_next.size(),
            " tokens; an all_logits entry of ", n, " tokens takes ", n, " or ", n - 1));
      }
      for (size_t i = 0; i < b.score_next.size(); ++i) {
        if (b.score_next[i] < 0 || b.score_next[i] >= config_.vocab_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("batch entry ", e, ": score_next[", i, "] = ", b.score_next[i],
                           " is outside the vocabulary [0, ", config_.vocab_size, ")"));
        }
      }
      if (b.score_top < 0 || b.score_top > kernels::kMaxTopLogprobs) {
        return absl::InvalidArgumentError(
            absl::StrCat("batch entry ", e, ": score_top = ", b.score_top, " must be in [0, ",
                         kernels::kMaxTopLogprobs, "]"));
      }
    }
    if (!b.doc_ids.empty() && static_cast<int64_t>(b.doc_ids.size()) != total) {
      return absl::InvalidArgumentError(absl::StrCat(
          "batch entry ", e, ": doc_ids has ", b.doc_ids.size(), " entries, expected ", total));
    }
  }
  return absl::OkStatus();
}

template <typename T>
void Transformer<T>::Norm(const WeightView& weight, const WeightView& bias, int n, bool add_proj) {
  const int D = static_cast<int>(config_.dim);
  const double eps = config_.norm_eps;
  if (config_.arch == Architecture::kLlama) {
    if (add_proj) {
      backend_.AddRmsNorm(x_.data(), proj_.data(), n, D, weight, eps, xn_.data());
    } else {
      backend_.RmsNorm(x_.data(), n, D, weight, eps, xn_.data());
    }
  } else if (add_proj) {
    backend_.AddLayerNorm(x_.data(), proj_.data(), n, D, weight, bias, eps, xn_.data());
  } else {
    backend_.LayerNorm(x_.data(), n, D, weight, bias, eps, xn_.data());
  }
}

template <typename T>
bool Transformer<T>::FusedResiduals() const {
  return config_.arch == Architecture::kLlama && !config_.sandwich_norms;
}

template <typename T>
bool Transformer<T>::FeedForward(const LayerWeights& lw, int n, bool add_proj) {
  const ModelConfig& c = config_;
  if (FusedResiduals() && !add_proj) {
    if (c.gate_activation == GateActivation::kGeluTanh) {
      backend_.RmsNormMatMulGeGlu(x_.data(), n, static_cast<int>(c.dim), lw.ffn_norm, c.norm_eps,
                                  xn_.data(), lw.w_in, lw.w_up, up_.data(), hidden_.data());
    } else {
      backend_.RmsNormMatMulSwiGlu(x_.data(), n, static_cast<int>(c.dim), lw.ffn_norm, c.norm_eps,
                                   xn_.data(), lw.w_in, lw.w_up, up_.data(), hidden_.data());
    }
    backend_.MatMulAddTo(hidden_.data(), n, lw.w_out, lw.b_out, proj_.data(), x_.data());
    return false;
  }
  Norm(lw.ffn_norm, lw.ffn_norm_bias, n, add_proj);
  if (c.arch == Architecture::kLlama && c.gate_activation == GateActivation::kGeluTanh) {
    // GeGLU (Gemma): w_out · (gelu(w_in x) ⊙ w_up x)
    backend_.MatMulGeGlu(xn_.data(), n, lw.w_in, lw.w_up, up_.data(), hidden_.data());
  } else if (c.arch == Architecture::kLlama) {
    // SwiGLU: w_out · (silu(w_in x) ⊙ w_up x)
    backend_.MatMulSwiGlu(xn_.data(), n, lw.w_in, lw.w_up, up_.data(), hidden_.data());
  } else {
    // GPT-2: c_proj · gelu(c_fc x + b) + b
    backend_.MatMulGelu(xn_.data(), n, lw.w_in, lw.b_in, hidden_.data());
  }
  backend_.MatMul(hidden_.data(), n, lw.w_out, lw.b_out, proj_.data());
  if (c.sandwich_norms) {  // Gemma 2 and 3: the block's output norm
    backend_.RmsNorm(proj_.data(), n, c.dim, lw.post_ffn_norm, c.norm_eps, proj_.data());
  }
  return true;
}

template <typename T>
absl::Status Transformer<T>::AddResiduals(absl::Span<const BatchEntry> batch, int layer, bool mid,
                                          int n, bool* proj_pending) {
  const int64_t D = config_.dim;
  bool any = false;
  for (const BatchEntry& b : batch) {
    const int last = b.num_cached + static_cast<int>(b.tokens.size()) - 1;
    for (const ResidualAdd& a : b.residual_adds) {
      any = any || (a.layer == layer && a.mid == mid && a.from_position <= last);
    }
  }
  if (!any) return absl::OkStatus();
  if (*proj_pending) {
    backend_.Add(x_.data(), proj_.data(), n * D);
    *proj_pending = false;
  }
  // One row of sums for each run of an entry's rows that the same adds reach (from_position
  // only grows the set along the rows, so the count of adds reached names it), each row's
  // index into them, −1 where none reaches.
  steer_rows_.clear();
  steer_index_.assign(static_cast<size_t>(n), -1);
  int r0 = 0;
  for (const BatchEntry& b : batch) {
    const int tq = static_cast<int>(b.tokens.size());
    int reached_before = 0;
    for (int i = 0; i < tq; ++i) {
      const int position = b.num_cached + i;
      int reached = 0;
      for (const ResidualAdd& a : b.residual_adds) {
        reached += a.layer == layer && a.mid == mid && a.from_position <= position ? 1 : 0;
      }
      if (reached == 0) continue;
      if (reached != reached_before) {
        const size_t at = steer_rows_.size();
        steer_rows_.resize(at + static_cast<size_t>(D), T(0));
        for (const ResidualAdd& a : b.residual_adds) {
          if (a.layer != layer || a.mid != mid || a.from_position > position) continue;
          for (int64_t d = 0; d < D; ++d) {
            steer_rows_[at + static_cast<size_t>(d)] +=
                static_cast<T>(a.delta[static_cast<size_t>(d)]);
          }
        }
        reached_before = reached;
      }
      steer_index_[static_cast<size_t>(r0 + i)] =
          static_cast<int32_t>(steer_rows_.size() / static_cast<size_t>(D)) - 1;
    }
    r0 += tq;
  }
  return backend_.AddRows(x_.data(), n, D, steer_rows_.data(),
                          static_cast<int>(steer_rows_.size() / static_cast<size_t>(D)),
                          steer_index_.data());
}

template <typename T>
absl::Status Transformer<T>::Forward(absl::Span<const BatchEntry> batch, KvCacheStorage<T>& cache,
                                     ForwardOutput<T>& out,
                                     absl::Span<AttentionCapture<T>> captures) {
  if (absl::Status s = Validate(batch, cache); !s.ok()) return s;
  // A decode step (one token an entry) gets as many rows as the backend prefers (CUDA
  // graphs: one graph per bucket of batch sizes). The padding entries come last: token 0
  // at position 0, attending to key 0 of the first sequence, storing nothing (row −1) and
  // getting no logits.
  const int num_real = static_cast<int>(batch.size());
  // Full maps are copied out layer by layer: such a step runs op by op, unpadded. Last
  // query rows are computed after the step, from its queries saved as it goes (saved_q_).
  bool full_maps = false;
  for (const AttentionCapture<T>& cap : captures) full_maps = full_maps || !cap.last_query_only;
  std::vector<BatchEntry> padded;
  if (!full_maps) {
    bool decode = true;
    for (const BatchEntry& b : batch) decode = decode && b.tokens.size() == 1 && b.doc_ids.empty();
    if (const int rows = decode ? backend_.PaddedDecodeRows(num_real) : num_real; rows > num_real) {
      static constexpr int32_t kPadToken = 0;
      BatchEntry pad;
      pad.tokens = absl::Span<const int32_t>(&kPadToken, 1);
      pad.block_table = batch.front().block_table.first(1);
      padded.assign(batch.begin(), batch.end());
      padded.resize(static_cast<size_t>(rows), pad);
      batch = padded;
    }
  }
  const ModelConfig& c = config_;
  const Weights& w = model_.weights;
  const int64_t D = c.dim, QD = c.q_dim(), KVD = c.kv_dim(), F = c.hidden_dim, V = c.vocab_size;
  const int bs = cache.block_size();
  const bool host = backend_.memory().host_accessible();  // else logits/probs are copied out

  int n = 0;
  for (const BatchEntry& b : batch) n += static_cast<int>(b.tokens.size());
  if (absl::Status s = backend_.MakeCurrent(); !s.ok()) return s;
  // An earlier step's out of memory failed that step only.
  if (absl::Status s = backend_.Recover(); !s.ok()) return s;
  for (auto [buffer, size] : {std::pair{&x_, n * D},
                              {&xn_, n * D},
                              {&q_, n * std::max(D, QD)},  // also the logits rows' gather
                              {&k_, n * KVD},
                              {&v_, n * KVD},
                              {&att_, n * QD},
                              {&proj_, n * D},
                              {&hidden_, n * F},
                              {&up_, c.arch == Architecture::kLlama ? n * F : 0}}) {
    if (absl::Status s = buffer->Resize(size); !s.ok()) return s;
  }
  positions_.resize(n);
  rows_.resize(n);
  std::vector<int32_t> tokens(n);
  {
    int r = 0;
    for (size_t e = 0; e < batch.size(); ++e) {
      const BatchEntry& b = batch[e];
      for (size_t i = 0; i < b.tokens.size(); ++i, ++r) {
        tokens[r] = b.tokens[i];
        positions_[r] = b.num_cached + static_cast<int>(i);
        rows_[r] =
            e >= static_cast<size_t>(num_real)
                ? -1  // padding: stored nowhere
                : static_cast<int64_t>(b.block_table[positions_[r] / bs]) * bs + positions_[r] % bs;
      }
    }
  }
  // Each entry's capture (−1: none); each capture's layers' slots (−1: a layer not
  // captured), and, last query rows only, where its rows start in last_probs_ (on a
  // device) and its saved queries in saved_q_.
  struct CapturePlan {
    std::vector<int> slot;  // [L]
    int num_layers = 0;
    int64_t keys = 0;    // its entry's Tk
    int64_t offset = 0;  // in last_probs_
    int q_slot = 0;      // in saved_q_, of its first captured layer
  };
  std::vector<int> capture_of(batch.size(), -1);
  // The last queries' attention again, for their probabilities, after the step (one
  // AttentionBatch), and each one's batch entry and layer (for its error).
  std::vector<kernels::AttentionArgs<T>> reruns;
  std::vector<std::pair<int, int>> rerun_of;
  std::vector<CapturePlan> plans(captures.size());
  int64_t last_size = 0;  // last_probs_' elements (> 0: some capture wants last rows only)
  int saved_queries = 0;  // saved_q_'s rows
  for (size_t i = 0; i < captures.size(); ++i) {
    AttentionCapture<T>& cap = captures[i];
    if (cap.entry < 0 || cap.entry >= num_real) {
      return absl::InvalidArgumentError(absl::StrCat("attention capture: entry ", cap.entry,
                                                     " outside the batch's [0, ", num_real, ")"));
    }
    if (capture_of[static_cast<size_t>(cap.entry)] >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention capture: entry ", cap.entry, " captured twice"));
    }
    capture_of[static_cast<size_t>(cap.entry)] = static_cast<int>(i);
    CapturePlan& plan = plans[i];
    plan.slot.assign(static_cast<size_t>(c.num_layers), -1);
    std::vector<int> layers = cap.layers;
    if (layers.empty()) {
      layers.resize(static_cast<size_t>(c.num_layers));
      std::iota(layers.begin(), layers.end(), 0);
    }
    for (int l : layers) {
      if (l < 0 || l >= c.num_layers) {
        return absl::InvalidArgumentError(absl::StrCat(
            "attention capture: layer ", l, " outside the model's [0, ", c.num_layers, ")"));
      }
      if (int& slot = plan.slot[static_cast<size_t>(l)]; slot < 0) slot = plan.num_layers++;
    }
    const BatchEntry& b = batch[static_cast<size_t>(cap.entry)];
    plan.keys = b.num_cached + static_cast<int64_t>(b.tokens.size());
    if (cap.last_query_only) {
      plan.offset = last_size;
      last_size += plan.num_layers * c.num_heads * plan.keys;
      plan.q_slot = saved_queries;
      saved_queries += plan.num_layers;
    }
    cap.probs.assign(static_cast<size_t>(c.num_layers), {});
  }
  if (last_size > 0) {
    if (absl::Status s = probe_out_.Resize(saved_queries * QD); !s.ok()) return s;
    if (absl::Status s = saved_q_.Resize(saved_queries * QD); !s.ok()) return s;
    if (!host) {
      if (absl::Status s = last_probs_.Resize(last_size); !s.ok()) return s;
    }
  }

  // The layers are one step for the backend (a CUDA graph when an identical step ran
  // before), up to the logits, whose rows are gathered by memory copies. Not when full
  // maps are captured: those are copied out as the step goes.
  struct StepScope {
    kernels::Backend<T>* backend = nullptr;  // while the step is open
    ~StepScope() {
      if (backend != nullptr) (void)backend->EndStep(/*run=*/false);  // a failed step
    }
  } step;
  if (!full_maps) {
    backend_.BeginStep();
    step.backend = &backend_;
  }

  // token (and, for GPT-2, position) embeddings. A residual still to be added to x_ waits
  // in proj_ (proj_pending) and is added by the next norm, fused where the backend can
  // (FusedResiduals' layers add theirs as their products make them).
  backend_.Embedding(w.token_embedding, tokens.data(), n, x_.data());
  if (c.embedding_scale != 1.0) backend_.Scale(x_.data(), n * D, c.embedding_scale);
  bool proj_pending = false;
  if (c.arch == Architecture::kGpt2) {
    backend_.Embedding(w.position_embedding, positions_.data(), n, proj_.data());
    proj_pending = true;
  }

  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    if (absl::Status s = AddResiduals(batch, l, /*mid=*/false, n, &proj_pending); !s.ok()) return s;
    // (the previous block's residual and) attention norm, and the qkv projections for
    // every new token
    const kernels::MatMulOutput<T> qkv[] = {
        {lw.wq, lw.bq, q_.data()}, {lw.wk, lw.bk, k_.data()}, {lw.wv, lw.bv, v_.data()}};
    const bool rope = c.arch == Architecture::kLlama;
    const bool pre_norm = FusedResiduals() && !proj_pending;  // the norm in the products' call
    const bool fused_kv = rope && !c.qk_norm;  // rope and cache rows in it too (one GPU launch)
    kernels::QkvRopeStore kv;
    kv.q_heads = c.num_heads;
    kv.kv_heads = c.num_kv_heads;
    kv.head_dim = c.head_dim;
    kv.positions = positions_.data();
    kv.rope = &ropes_[l];
    kv.dst_rows = rows_.data();
    kv.k_cache = cache.k(l);
    kv.v_cache = cache.v(l);
    kv.cache_stride = KVD;
    kv.cache_dtype = cache.dtype();
    if (pre_norm && fused_kv) {
      backend_.RmsNormQkvRopeStoreKv(x_.data(), n, static_cast<int>(D), lw.attn_norm, c.norm_eps,
                                     xn_.data(), qkv, kv);
    } else if (pre_norm) {
      backend_.RmsNormMatMulMany(x_.data(), n, static_cast<int>(D), lw.attn_norm, c.norm_eps,
                                 xn_.data(), qkv);
    } else {
      Norm(lw.attn_norm, lw.attn_norm_bias, n, proj_pending);
      if (fused_kv) {
        backend_.MatMulQkvRopeStoreKv(xn_.data(), n, qkv, kv);  // Gemma 2
      } else {
        backend_.MatMulMany(xn_.data(), n, qkv);
      }
    }
    if (c.qk_norm) {  // Qwen3: RMSNorm over each head of q and k, in place
      backend_.RmsNorm(q_.data(), n * c.num_heads, c.head_dim, lw.q_norm, c.norm_eps, q_.data());
      backend_.RmsNorm(k_.data(), n * c.num_kv_heads, c.head_dim, lw.k_norm, c.norm_eps, k_.data());
    }
    // (rotary positions on q and k, and) new keys and values into the paged cache
    if (rope && !fused_kv) {
      backend_.RopeQKStoreKv(q_.data(), QD, c.num_heads, k_.data(), v_.data(), KVD, c.num_kv_heads,
                             n, c.head_dim, positions_.data(), ropes_[l], rows_.data(), cache.k(l),
                             cache.v(l), KVD, cache.dtype());
    } else if (!rope) {
      backend_.StoreKv(k_.data(), v_.data(), n, KVD, KVD, rows_.data(), cache.k(l), cache.v(l), KVD,
                       cache.dtype());
    }
    // attention per sequence, against all of its cached keys: one AttentionBatch for all
    // sequences but those whose full maps are captured (a call each, copied out after it)
    calls_.clear();
    call_entries_.clear();
    int r0 = 0;
    for (size_t e = 0; e < batch.size(); ++e) {
      const BatchEntry& b = batch[e];
      const int tq = static_cast<int>(b.tokens.size());
      kernels::AttentionArgs<T> a;
      a.q = q_.data() + r0 * QD;
      a.q_stride = QD;
      a.num_queries = tq;
      a.num_keys = b.num_cached + tq;
      a.num_heads = c.num_heads;
      a.num_kv_heads = c.num_kv_heads;
      a.head_dim = c.head_dim;
      a.query_offset = b.num_cached;
      a.causal = true;
      a.window = c.WindowOf(l);
      a.scale = c.AttentionScale();
      a.softcap = c.attention_softcap;
      if (!b.doc_ids.empty()) {
        a.q_doc_ids = b.doc_ids.data() + b.num_cached;
        a.k_doc_ids = b.doc_ids.data();
      }
      a.kv = cache.Source(l);
      a.kv.block_table = b.block_table.data();
      a.out = att_.data() + r0 * QD;
      a.out_stride = QD;
      const int ci = capture_of[e];
      AttentionCapture<T>* const capture = ci >= 0 ? &captures[static_cast<size_t>(ci)] : nullptr;
      const int slot = ci >= 0 ? plans[static_cast<size_t>(ci)].slot[static_cast<size_t>(l)] : -1;
      const bool captured = slot >= 0;
      const int64_t H = c.num_heads, Tk = a.num_keys, probs_size = H * tq * Tk;
      r0 += tq;
      if (!captured || capture->last_query_only) {
        calls_.push_back(a);
        call_entries_.push_back(static_cast<int>(e));
      }
      if (!captured) continue;
      if (capture->last_query_only) {
        // The last query is saved, and runs again alone after the step for its
        // probabilities (reruns). The layer's batched call makes the entry's output, so
        // the step computes what it would without the capture.
        const CapturePlan& plan = plans[static_cast<size_t>(ci)];
        const int64_t rerun_row = (plan.q_slot + slot) * QD;
        T* const saved = saved_q_.data() + rerun_row;
        backend_.Copy(saved, a.q + int64_t{tq - 1} * QD, QD);
        kernels::AttentionArgs<T> last = a;
        last.q = saved;
        last.num_queries = 1;
        last.query_offset = a.query_offset + tq - 1;
        if (a.q_doc_ids != nullptr) last.q_doc_ids = a.q_doc_ids + tq - 1;
        last.out = probe_out_.data() + rerun_row;
        capture->probs[l].resize(static_cast<size_t>(H * Tk));
        last.probs =
            host ? capture->probs[l].data() : last_probs_.data() + plan.offset + slot * H * Tk;
        reruns.push_back(last);
        rerun_of.emplace_back(static_cast<int>(e), l);
        continue;
      }
      // The full map: the kernel writes it on the host, or on a device where it is copied
      // out at once (the next captured layer reuses probs_).
      capture->probs[l].resize(static_cast<size_t>(probs_size));
      if (host) {
        a.probs = capture->probs[l].data();
      } else {
        if (absl::Status s = probs_.Resize(probs_size); !s.ok()) return s;
        a.probs = probs_.data();
      }
      if (absl::Status s = backend_.Attention(a); !s.ok()) {
        return absl::Status(s.code(),
                            absl::StrCat("batch entry ", e, ", layer ", l, ": ", s.message()));
      }
      if (!host) {
        if (absl::Status s = probs_.CopyToHost(capture->probs[l].data(), probs_size); !s.ok()) {
          return s;
        }
      }
    }
    if (!calls_.empty()) {
      int failed = 0;
      if (absl::Status s = backend_.AttentionBatch(calls_, &failed); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("batch entry ", call_entries_[failed],
                                                   ", layer ", l, ": ", s.message()));
      }
    }
    // output projection (Gemma 2 and 3: and its norm): its residual added into x_ now, or
    // left in proj_ for the next norm (attn_pending)
    bool attn_pending = !FusedResiduals();
    if (FusedResiduals()) {
      backend_.MatMulAddTo(att_.data(), n, lw.wo, lw.bo, proj_.data(), x_.data());
    } else {
      backend_.MatMul(att_.data(), n, lw.wo, lw.bo, proj_.data());
    }
    if (c.sandwich_norms) {
      backend_.RmsNorm(proj_.data(), n, c.dim, lw.post_attn_norm, c.norm_eps, proj_.data());
    }
    if (absl::Status s = AddResiduals(batch, l, /*mid=*/true, n, &attn_pending); !s.ok()) return s;
    // the feed-forward norm and block; its residual likewise
    proj_pending = FeedForward(lw, n, attn_pending);
  }
  if (absl::Status s = AddResiduals(batch, c.num_layers, /*mid=*/false, n, &proj_pending);
      !s.ok()) {
    return s;
  }
  if (proj_pending) backend_.Add(x_.data(), proj_.data(), n * D);
  // gather the rows that need logits (not the padding's), final norm, classifier
  std::vector<int> rows;
  out.logits_row.clear();
  {
    int r0 = 0;
    for (const BatchEntry& b : batch.first(static_cast<size_t>(num_real))) {
      const int tq = static_cast<int>(b.tokens.size());
      out.logits_row.push_back(static_cast<int>(rows.size()));
      for (int i = b.all_logits ? 0 : tq - 1; i < tq; ++i) rows.push_back(r0 + i);
      r0 += tq;
    }
  }
  const int m = static_cast<int>(rows.size());
  if (step.backend != nullptr) {
    step.backend = nullptr;
    if (absl::Status s = backend_.EndStep(/*run=*/true); !s.ok()) return s;
  }
  // The last queries' reruns, after the step (their keys' counts are new each step, which
  // a recorded step must not depend on), against the cache the step filled.
  // One batch (each its own output row), which a device backend may run as one launch.
  if (!reruns.empty()) {
    int failed = 0;
    if (absl::Status s = backend_.AttentionBatch(reruns, &failed); !s.ok()) {
      const auto [entry, layer] = rerun_of[static_cast<size_t>(failed)];
      return absl::Status(
          s.code(), absl::StrCat("batch entry ", entry, ", layer ", layer, ": ", s.message()));
    }
  }
  // The captured last query rows, of every capture and layer, in one copy out of the device.
  if (!host && last_size > 0) {
    std::vector<T> last(static_cast<size_t>(last_size));
    if (absl::Status s = last_probs_.CopyToHost(last.data(), last_size); !s.ok()) return s;
    for (size_t i = 0; i < captures.size(); ++i) {
      if (!captures[i].last_query_only) continue;
      const CapturePlan& plan = plans[i];
      const int64_t layer_size = c.num_heads * plan.keys;
      for (int l = 0; l < c.num_layers; ++l) {
        if (const int slot = plan.slot[static_cast<size_t>(l)]; slot >= 0) {
          std::copy_n(last.data() + plan.offset + slot * layer_size, layer_size,
                      captures[i].probs[l].data());
        }
      }
    }
  }

  // One copy per run of consecutive rows (a decode batch is one run): on a GPU each copy
  // is an operation of its own.
  for (int i = 0; i < m;) {
    int run = 1;
    while (i + run < m && rows[i + run] == rows[i] + run) ++run;
    if (absl::Status s =
            backend_.memory().Copy(q_.data() + i * D, x_.data() + rows[i] * D, run * D * sizeof(T));
        !s.ok()) {
      return s;
    }
    i += run;
  }
  if (c.arch == Architecture::kLlama) {
    backend_.RmsNorm(q_.data(), m, D, w.final_norm, c.norm_eps, xn_.data());
  } else {
    backend_.LayerNorm(q_.data(), m, D, w.final_norm, w.final_norm_bias, c.norm_eps, xn_.data());
  }
  out.logits.resize(static_cast<size_t>(m) * V);
  out.pick_token.clear();
  out.pick_logprob.clear();
  out.pick_top_token.clear();
  out.pick_top_logprob.clear();
  if (host) {
    backend_.MatMul(xn_.data(), m, w.output, WeightView{}, out.logits.data());
    if (c.final_softcap > 0.0) backend_.SoftCap(out.logits.data(), m * V, c.final_softcap);
    return backend_.Synchronize();
  }
  if (absl::Status s = logits_.Resize(m * V); !s.ok()) return s;
  backend_.MatMul(xn_.data(), m, w.output, WeightView{}, logits_.data());
  if (c.final_softcap > 0.0) backend_.SoftCap(logits_.data(), m * V, c.final_softcap);
  // The rows wanted on the host: all of them, or (when some entry wants only the tokens
  // its draws pick, or a scored prompt's log-probabilities) those of the other entries,
  // one copy per run of consecutive rows.
  std::vector<bool> wanted(static_cast<size_t>(m), true);
  std::vector<kernels::TokenDraw> draws(static_cast<size_t>(m));  // greedy unless asked
  bool any_pick = false;
  for (int e = 0; e < num_real; ++e) {
    const BatchEntry& b = batch[static_cast<size_t>(e)];
    if (!b.Picks()) continue;
    any_pick = true;
    const size_t row = static_cast<size_t>(out.logits_row[static_cast<size_t>(e)]);
    const size_t rows_of = b.all_logits ? b.tokens.size() : 1;
    for (size_t i = 0; i < rows_of; ++i) {
      wanted[row + i] = false;
      if (b.all_logits && i < b.score_next.size()) {
        draws[row + i].forced_token = b.score_next[i];
        draws[row + i].top_logprobs = b.score_top;
      } else {
        draws[row + i] = b.draw;
      }
    }
  }
  if (any_pick) {
    out.pick_token.resize(static_cast<size_t>(m));
    out.pick_logprob.resize(static_cast<size_t>(m));
    const bool any_top = std::any_of(
        draws.begin(), draws.end(), [](const kernels::TokenDraw& d) { return d.top_logprobs > 0; });
    if (any_top) {
      out.pick_top_token.resize(static_cast<size_t>(m) * kernels::kMaxTopLogprobs);
      out.pick_top_logprob.resize(static_cast<size_t>(m) * kernels::kMaxTopLogprobs);
    }
    if (absl::Status s = backend_.DrawTokens(logits_.data(), m, static_cast<int>(V), draws.data(),
                                             out.pick_token.data(), out.pick_logprob.data(),
                                             any_top ? out.pick_top_token.data() : nullptr,
                                             any_top ? out.pick_top_logprob.data() : nullptr);
        !s.ok()) {
      return s;
    }
  }
  for (int i = 0; i < m;) {
    if (!wanted[static_cast<size_t>(i)]) {
      ++i;
      continue;
    }
    int run = 1;
    while (i + run < m && wanted[static_cast<size_t>(i + run)]) ++run;
    if (absl::Status s = logits_.CopyToHost(out.logits.data() + static_cast<size_t>(i) * V, run * V,
                                            static_cast<int64_t>(i) * V);
        !s.ok()) {
      return s;
    }
    i += run;
  }
  return backend_.Synchronize();
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace kvlens
