#include "engine/interpret/kv_probe.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvlens::interpret {

template <typename T>
absl::StatusOr<SequenceInput<T>> InputFromCache(const ModelConfig& c,
                                                const KvCacheStorage<T>& cache,
                                                const KvProbeRequest& r) {
  if (r.num_cached < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv probe: num_cached = ", r.num_cached, " (needs at least 1)"));
  }
  if (r.new_tokens.empty()) return absl::InvalidArgumentError("kv probe: new_tokens is empty");
  if (cache.kv_dim() != c.kv_dim()) {
    return absl::InvalidArgumentError(absl::StrCat("kv probe: cache rows hold ", cache.kv_dim(),
                                                   " values, the model ", c.kv_dim()));
  }
  const int bs = cache.block_size();
  const int64_t blocks = (r.num_cached + bs - 1) / bs;
  if (static_cast<int64_t>(r.block_table.size()) < blocks) {
    return absl::InvalidArgumentError(absl::StrCat("kv probe: block_table has ",
                                                   r.block_table.size(), " blocks, ", r.num_cached,
                                                   " cached tokens need ", blocks));
  }
  for (int64_t b = 0; b < blocks; ++b) {
    if (r.block_table[b] < 0 || r.block_table[b] >= cache.num_blocks()) {
      return absl::InvalidArgumentError(absl::StrCat("kv probe: block id ", r.block_table[b],
                                                     " outside the pool [0, ", cache.num_blocks(),
                                                     ")"));
    }
  }
  const int64_t KVD = c.kv_dim();
  SequenceInput<T> in;
  in.tokens.assign(r.new_tokens.begin(), r.new_tokens.end());
  in.offset = r.num_cached;
  in.doc_ids.assign(r.doc_ids.begin(), r.doc_ids.end());
  in.prefix_k.assign(c.num_layers, std::vector<T>(r.num_cached * KVD));
  in.prefix_v.assign(c.num_layers, std::vector<T>(r.num_cached * KVD));
  // One copy per run of consecutive block ids, whose rows are contiguous: on a GPU each
  // copy out waits for the stream (the engine's, with its queued steps), and a pool that
  // hands out blocks in order makes a whole prefill one run.
  for (int l = 0; l < c.num_layers; ++l) {
    for (int64_t b = 0; b < blocks;) {
      int64_t e = b + 1;
      while (e < blocks && r.block_table[e] == r.block_table[e - 1] + 1) ++e;
      const int64_t t = b * bs, rows = std::min<int64_t>(e * bs, r.num_cached) - t;
      const int64_t row = int64_t{r.block_table[b]} * bs;
      if (absl::Status s = cache.CopyRowsToHost(l, row, rows, in.prefix_k[l].data() + t * KVD,
                                                in.prefix_v[l].data() + t * KVD);
          !s.ok()) {
        return s;
      }
      b = e;
    }
  }
  return in;
}

template <typename T>
absl::StatusOr<KvProbeResult<T>> CachedKvProbe(const Model& model, kernels::Backend<T>& be,
                                               const KvCacheStorage<T>& cache,
                                               const KvProbeRequest& r,
                                               kernels::BackwardOps<T>* ops) {
  const ModelConfig& c = model.config;
  auto in = InputFromCache(c, cache, r);
  if (!in.ok()) return in.status();
  auto tape = RunForward(model, be, *in);
  if (!tape.ok()) return tape.status();
  const int n = tape->n, P = r.num_cached;
  const Objective o = Objective::LogProb({{n - 1, r.target}});
  auto g = ObjectiveGradients(model, *tape, o, BackwardOptions{}, ops);
  if (!g.ok()) return g.status();
  KvProbeResult<T> out;
  out.objective = EvaluateObjective(o, c, *tape);
  out.logits.assign(tape->logits.end() - c.vocab_size, tape->logits.end());
  const int64_t KVD = c.kv_dim();
  for (int l = 0; l < c.num_layers; ++l) {
    out.dk.emplace_back(g->k[l].begin(), g->k[l].begin() + P * KVD);
    out.dv.emplace_back(g->v[l].begin(), g->v[l].begin() + P * KVD);
  }
  out.input = *std::move(in);
  out.grads = *std::move(g);
  return out;
}

template absl::StatusOr<SequenceInput<float>> InputFromCache<float>(const ModelConfig&,
                                                                    const KvCacheStorage<float>&,
                                                                    const KvProbeRequest&);
template absl::StatusOr<SequenceInput<double>> InputFromCache<double>(const ModelConfig&,
                                                                      const KvCacheStorage<double>&,
                                                                      const KvProbeRequest&);
template absl::StatusOr<KvProbeResult<float>> CachedKvProbe<float>(const Model&,
                                                                   kernels::Backend<float>&,
                                                                   const KvCacheStorage<float>&,
                                                                   const KvProbeRequest&,
                                                                   kernels::BackwardOps<float>*);
template absl::StatusOr<KvProbeResult<double>> CachedKvProbe<double>(const Model&,
                                                                     kernels::Backend<double>&,
                                                                     const KvCacheStorage<double>&,
                                                                     const KvProbeRequest&,
                                                                     kernels::BackwardOps<double>*);

}  // namespace kvlens::interpret
