#include "kernels/cuda/attention_tuner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/stream_timing.h"

namespace kvlens::kernels::cuda {
namespace {

// A candidate: what it sets (the flash layout and block order, the split-KV options).
struct Candidate {
  std::string name;
  AttentionKernels settings;
};

bool SameLayout(const FlashBf16Layout& x, const FlashBf16Layout& y) {
  return x.tile_queries == y.tile_queries && x.warp_queries == y.warp_queries &&
         x.stages == y.stages && x.key_tile == y.key_tile;
}

// `asked` as the kernel runs it for p: ResolvedFlashBf16Layout, or on the fp16 kernel its
// block size alone.
FlashBf16Layout Resolved(const AttentionParams& p, const FlashBf16Layout& asked, bool bf16_kernel) {
  if (bf16_kernel) return ResolvedFlashBf16Layout(p, asked);
  FlashBf16Layout r;
  r.tile_queries = FlashTileQueries(p.head_dim, std::min(asked.tile_queries, 128));
  return r;
}

std::string DescribeLayout(const FlashBf16Layout& r, bool bf16_kernel) {
  if (!bf16_kernel) return absl::StrCat("flash (fp16 kernel), ", r.tile_queries, "-query blocks");
  return absl::StrCat("flash, ", r.tile_queries, "-query blocks of ",
                      r.tile_queries / r.warp_queries, " warps, ", r.stages, " K/V stages, ",
                      r.key_tile, "-key tiles");
}

// The layouts kvlens_gpu_check times, the default first, each once as it runs for p (at
// head size 256 or under a soft cap several resolve alike; on the fp16 kernel only the
// block size applies); on an fp32 cache then the bf16 kernel's layouts again on an fp16
// copy of the blocks (SetFlashF16Copy).
std::vector<Candidate> PrefillCandidates(const AttentionKernels& base, const AttentionParams& p,
                                         bool bf16_kernel) {
  const FlashBf16Layout asked[] = {FlashBf16Layout{},
                                   FlashBf16Layout{128, 16, 3, 64},
                                   FlashBf16Layout{128, 16, 2, 32},
                                   FlashBf16Layout{128, 16, 3, 32},
                                   FlashBf16Layout{128, 32, 2, 64},
                                   FlashBf16Layout{192, 16, 2, 64},
                                   FlashBf16Layout{192, 16, 3, 64},
                                   FlashBf16Layout{64, 16, 2, 64}};
  std::vector<Candidate> out;
  auto add = [&](bool bf16_loop, bool f16_copy) {
    std::vector<FlashBf16Layout> seen;
    for (const FlashBf16Layout& l : asked) {
      const FlashBf16Layout r = Resolved(p, l, bf16_loop);
      if (std::any_of(seen.begin(), seen.end(), [&](const auto& x) { return SameLayout(x, r); })) {
        continue;
      }
      seen.push_back(r);
      AttentionKernels s = base;
      s.flash_layout = l;
      s.flash_f16_copy = f16_copy;
      out.push_back({absl::StrCat(f16_copy ? "on an fp16 copy, " : "", DescribeLayout(r, bf16_loop),
                                  out.empty() ? " (default)" : ""),
                     s});
    }
  };
  add(bf16_kernel, false);
  if (!bf16_kernel && p.kv_dtype == KvDtype::kActivation) add(true, true);
  return out;
}

// A candidate's name without the default's mark, for a variant of it.
std::string VariantOf(const std::string& name, const std::string& what) {
  return absl::StrCat(name.substr(0, name.rfind(" (default)")), what);
}

// The prefill layout `best` with its blocks in other orders (FlashGrid): the longest
// blocks first across the group of heads sized to the L2 cache (kept as asked, so it is
// sized again for each call's keys), across 4 heads, and across all of them, each once as
// it resolves for p's kv_keys (none that resolves to head by head, `best`'s own order).
std::vector<Candidate> HeadGroupCandidates(const Candidate& best, const AttentionParams& p,
                                           int64_t kv_keys, int64_t l2_bytes) {
  std::vector<Candidate> out;
  std::vector<int> seen = {1};
  for (int asked : {kFlashAutoHeadGroup, 4, p.num_heads}) {
    const int group = FlashHeadGroup(p, asked, kv_keys, l2_bytes);
    if (std::find(seen.begin(), seen.end(), group) != seen.end()) continue;
    seen.push_back(group);
    Candidate c = best;
    c.settings.flash_head_group = asked;
    c.name =
        VariantOf(best.name, absl::StrCat("; longest first across ", group, " heads",
                                          asked == kFlashAutoHeadGroup ? " (sized to L2)" : ""));
    out.push_back(std::move(c));
  }
  return out;
}

// The split-KV kernels, the default first: those that differ from it for p.
std::vector<Candidate> DecodeCandidates(const AttentionKernels& base, const AttentionParams& p) {
  auto with = [&](int warps, bool fused, bool tc) {
    AttentionKernels s = base;
    s.split_kv_warps = warps;
    s.split_kv_fused_combine = fused;
    s.split_kv_tensor_cores = tc;
    return s;
  };
  std::vector<Candidate> out = {
      {"split-KV, 4 warps a block (default)", with(kSplitKvWarps, false, false)},
      {"split-KV, 4 warps a block, fused combine", with(kSplitKvWarps, true, false)}};
  if (SplitKvVariant(p, kSplitKvWideWarps) != SplitKvVariant(p, kSplitKvWarps)) {
    out.push_back({"split-KV, 16 warps a block", with(kSplitKvWideWarps, false, false)});
  }
  if (SplitKvMmaSupports(p)) {
    out.push_back({"split-KV on tensor cores", with(kSplitKvWarps, false, true)});
    out.push_back({"split-KV on tensor cores, fused combine", with(kSplitKvWarps, true, true)});
  }
  return out;
}

// The random inputs: a paged cache of the longer call's keys (blocks in shuffled order, as
// a pool hands them out) and the query and output rows of the larger call.
struct Inputs {
  DeviceBuffer q, k, v, out;
  std::vector<int32_t> table;
  int64_t out_floats = 0;
};

absl::Status MakeInputs(CudaBackend& b, const AttentionTuneShape& z, Inputs* in) {
  const int rows = std::max(z.prefill_tokens, z.decode_keys);
  const int blocks = (rows + z.block_size - 1) / z.block_size;
  const int64_t cache = int64_t{blocks} * z.block_size * z.num_kv_heads * z.head_dim;
  const int64_t q_rows = std::max(
      z.prefill_tokens, *std::max_element(z.decode_batches.begin(), z.decode_batches.end()));
  in->out_floats = q_rows * z.num_heads * z.head_dim;
  const DType cache_type = KvStoredDType(z.cache_dtype);
  const size_t cache_bytes = static_cast<size_t>(cache * KvElementBytes<float>(z.cache_dtype));
  for (DeviceBuffer* buf : {&in->k, &in->v}) {
    if (absl::Status s = buf->Reserve(cache_bytes); !s.ok()) return s;
  }
  for (DeviceBuffer* buf : {&in->q, &in->out}) {
    if (absl::Status s = buf->Reserve(sizeof(float) * in->out_floats); !s.ok()) return s;
  }
  // Queries of 8× the keys' scale: scores of a few units, so that the softmax is peaked
  // and a kernel that mixes up keys moves the outputs well past the rounding.
  if (absl::Status s =
          LaunchFillRandom(in->q.get(), DType::kF32, in->out_floats, 1, 8.0f, b.stream());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = LaunchFillRandom(in->k.get(), cache_type, cache, 2, 1.0f, b.stream());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = LaunchFillRandom(in->v.get(), cache_type, cache, 3, 1.0f, b.stream());
      !s.ok()) {
    return s;
  }
  in->table.resize(blocks);
  std::iota(in->table.begin(), in->table.end(), 0);
  std::shuffle(in->table.begin(), in->table.end(), std::mt19937(4));
  return b.Synchronize();
}

AttentionArgs<float> BaseArgs(const AttentionTuneShape& z, const Inputs& in) {
  AttentionArgs<float> a;
  a.q = in.q.as<float>();
  a.q_stride = int64_t{z.num_heads} * z.head_dim;
  a.num_heads = z.num_heads;
  a.num_kv_heads = z.num_kv_heads;
  a.head_dim = z.head_dim;
  a.causal = true;
  a.scale = 1.0 / std::sqrt(static_cast<double>(z.head_dim));
  a.softcap = z.softcap;
  a.kv = KvSource<float>{in.k.as<float>(), in.v.as<float>(), int64_t{z.num_kv_heads} * z.head_dim,
                         in.table.data(),  z.block_size,     z.cache_dtype};
  a.out = in.out.as<float>();
  a.out_stride = a.q_stride;
  return a;
}

// Row r's keys in a decode batch of `batch` rows: all of them alone; in a batch, spread
// evenly up to them (keys · (r + 1) / batch, at least 1), a mean of about half the longest.
int DecodeRowKeys(int keys, int r, int batch) {
  return batch == 1 ? keys : std::max(1, static_cast<int>(int64_t{keys} * (r + 1) / batch));
}

// One call a candidate is timed on, and the floats of output it writes (from in.out).
struct TimedCall {
  std::function<absl::Status()> run;
  int64_t out_floats = 0;
};

// The output of each call from the first candidate that ran it (the default, unless the
// backend refused it), and the error allowed against it.
struct References {
  std::vector<std::vector<float>> out;
  std::vector<double> tolerance;
};

// Runs each candidate once on each call (its output against the reference), then times it;
// appends it to `report` in the candidates' order.
absl::Status TimeCandidates(CudaBackend& b, const std::vector<Candidate>& candidates,
                            const std::vector<TimedCall>& calls, const Inputs& in, bool replay,
                            References* refs, std::vector<TunedCandidate>* report) {
  std::vector<std::vector<float>>& reference = refs->out;
  std::vector<double>& tolerance = refs->tolerance;
  reference.resize(calls.size());
  tolerance.resize(calls.size(), 0.0);
  for (const Candidate& c : candidates) {
    TunedCandidate t;
    t.name = c.name;
    if (absl::Status s = b.SetAttentionKernels(c.settings); !s.ok()) return s;
    double worst = -1.0;  // the largest error / tolerance over the calls
    for (size_t j = 0; j < calls.size(); ++j) {
      std::vector<float> out(static_cast<size_t>(calls[j].out_floats));
      // NaN in the output first: a kernel that leaves rows unwritten cannot agree.
      absl::Status s = KVLENS_CUDA_STATUS(
          cudaMemsetAsync(in.out.get(), 0xFF, sizeof(float) * out.size(), b.stream()));
      if (s.ok()) s = calls[j].run();
      if (s.code() == absl::StatusCode::kInvalidArgument) {
        t.failure = std::string(s.message());
        t.seconds.clear();
        break;
      }
      if (s.ok()) {
        s = KVLENS_CUDA_STATUS(cudaMemcpyAsync(out.data(), in.out.get(), sizeof(float) * out.size(),
                                               cudaMemcpyDeviceToHost, b.stream()));
      }
      if (s.ok()) s = b.Synchronize();
      if (!s.ok()) return s;
      if (reference[j].empty()) {
        double largest = 0.0;
        for (float r : out) largest = std::max(largest, std::fabs(static_cast<double>(r)));
        tolerance[j] = kTuneRelativeTolerance * largest;
        reference[j] = out;
      }
      double err = 0.0;
      for (size_t i = 0; i < out.size(); ++i) {
        const double d = std::fabs(static_cast<double>(out[i]) - reference[j][i]);
        if (std::isnan(d)) {
          err = d;
          break;
        }
        err = std::max(err, d);
      }
      // A NaN error is the worst there is (and is kept: nothing exceeds infinity).
      const double ratio = std::isnan(err) ? std::numeric_limits<double>::infinity()
                                           : err / std::max(tolerance[j], 1e-300);
      if (ratio > worst) {
        worst = ratio;
        t.max_error = err;
        t.tolerance = tolerance[j];
      }
      // Decode as graph replays: a decode call's host part would otherwise time the host.
      absl::StatusOr<double> sec = replay ? ReplayedSeconds(b.stream(), 16, 4, calls[j].run)
                                          : EventSeconds(b.stream(), 3, calls[j].run);
      if (!sec.ok()) return sec.status();
      t.seconds.push_back(*sec);
    }
    report->push_back(t);
  }
  return absl::OkStatus();
}

// Marks the candidate kept (FastestAccepted) in `report` and returns its index, -1 if none.
int Choose(std::vector<TunedCandidate>& report) {
  const int best = FastestAccepted(report);
  if (best >= 0) report[best].chosen = true;
  return best;
}

absl::StatusOr<AttentionTuneReport> Tune(CudaBackend& b, const AttentionTuneShape& z,
                                         AttentionKernels* chosen) {
  Inputs in;
  if (absl::Status s = MakeInputs(b, z, &in); !s.ok()) return s;
  AttentionTuneReport report;
  const char* cache = z.cache_dtype == KvDtype::kBF16 ? "bf16" : "fp32";
  report.shape = absl::StrCat(
      "prefill ", z.prefill_tokens, " tokens, decode ", absl::StrJoin(z.decode_batches, " / "),
      " sequences of up to ", z.decode_keys, " keys; heads ", z.num_heads, "/", z.num_kv_heads,
      ", head size ", z.head_dim, ", ", cache, " cache in blocks of ", z.block_size,
      z.softcap > 0.0 ? absl::StrCat(", soft cap ", z.softcap) : "");
  const AttentionArgs<float> base = BaseArgs(z, in);
  // Every candidate is the defaults but for what it tries, whatever the backend was set to.
  const AttentionKernels defaults;

  AttentionArgs<float> prefill = base;
  prefill.num_queries = prefill.num_keys = z.prefill_tokens;
  const AttentionParams p = HostAttentionParams(prefill);  // for the Supports functions
  if (z.prefill_tokens >= kFlashMinQueries && FlashPrefillSupports(z.head_dim)) {
    const bool bf16_kernel = b.flash_bf16() && FlashPrefillBf16Supports(p);
    std::vector<Candidate> candidates = PrefillCandidates(defaults, p, bf16_kernel);
    const std::vector<TimedCall> calls = {{[&] { return b.Attention(prefill); },
                                           int64_t{z.prefill_tokens} * z.num_heads * z.head_dim}};
    References refs;
    if (absl::Status s =
            TimeCandidates(b, candidates, calls, in, /*replay=*/false, &refs, &report.prefill);
        !s.ok()) {
      return s;
    }
    // Then the fastest layout in the other block orders (one layout's orders, not every
    // layout's: the order moves when blocks start, not what a block does).
    if (const int layout = FastestAccepted(report.prefill); layout >= 0) {
      const std::vector<Candidate> orders =
          HeadGroupCandidates(candidates[layout], p, z.prefill_tokens, b.l2_bytes());
      if (absl::Status s =
              TimeCandidates(b, orders, calls, in, /*replay=*/false, &refs, &report.prefill);
          !s.ok()) {
        return s;
      }
      candidates.insert(candidates.end(), orders.begin(), orders.end());
    }
    if (const int best = Choose(report.prefill); best >= 0) {
      chosen->flash_layout = candidates[best].settings.flash_layout;
      chosen->flash_head_group = candidates[best].settings.flash_head_group;
      chosen->flash_f16_copy = candidates[best].settings.flash_f16_copy;
    }
  }

  if (z.decode_keys > 0) {
    // Per batch, its sequences' calls: one sequence over z.decode_keys keys; a batch's rows
    // over keys spread evenly up to z.decode_keys (a server's sequences are at all stages),
    // each a prefix of the one cache.
    std::vector<std::vector<AttentionArgs<float>>> batches;
    for (int batch : z.decode_batches) {
      std::vector<AttentionArgs<float>>& rows = batches.emplace_back(batch, base);
      for (int r = 0; r < batch; ++r) {
        AttentionArgs<float>& a = rows[r];
        a.q = base.q + r * base.q_stride;
        a.out = base.out + r * base.out_stride;
        a.num_queries = 1;
        a.num_keys = DecodeRowKeys(z.decode_keys, r, batch);
        a.query_offset = a.num_keys - 1;
      }
    }
    std::vector<Candidate> candidates =
        DecodeCandidates(defaults, HostAttentionParams(batches.front().front()));
    std::vector<TimedCall> calls;
    for (const std::vector<AttentionArgs<float>>& rows : batches) {
      calls.push_back({[&b, &rows]() -> absl::Status {
                         int failed = 0;
                         return b.AttentionBatch(rows, &failed);
                       },
                       int64_t{static_cast<int>(rows.size())} * z.num_heads* z.head_dim});
    }
    References refs;
    if (absl::Status s =
            TimeCandidates(b, candidates, calls, in, /*replay=*/true, &refs, &report.decode);
        !s.ok()) {
      return s;
    }
    // Then the fastest kernel splitting the unequal batch by its imbalance (SplitKvImbalance;
    // one sequence's launch is the same either way, so only where a batch has more rows).
    const bool unequal = std::any_of(z.decode_batches.begin(), z.decode_batches.end(),
                                     [](int batch) { return batch > 1; });
    if (const int kernel = FastestAccepted(report.decode); kernel >= 0 && unequal) {
      Candidate c = candidates[kernel];
      c.name = VariantOf(c.name, "; splits by the batch's imbalance");
      c.settings.split_kv_balanced = true;
      if (absl::Status s =
              TimeCandidates(b, {c}, calls, in, /*replay=*/true, &refs, &report.decode);
          !s.ok()) {
        return s;
      }
      candidates.push_back(c);
    }
    if (const int best = Choose(report.decode); best >= 0) {
      const AttentionKernels& s = candidates[best].settings;
      chosen->split_kv_warps = s.split_kv_warps;
      chosen->split_kv_fused_combine = s.split_kv_fused_combine;
      chosen->split_kv_tensor_cores = s.split_kv_tensor_cores;
      chosen->split_kv_balanced = s.split_kv_balanced;
    }
  }
  return report;
}

}  // namespace

absl::StatusOr<AttentionTuneReport> TuneAttention(CudaBackend& b, const AttentionTuneShape& shape) {
  if (absl::Status s = shape.Validate(); !s.ok()) return s;
  if (absl::Status s = b.status(); !s.ok()) return s;
  const AttentionKernels before = b.attention_kernels();
  AttentionKernels chosen = before;  // what a phase does not tune stays as it was
  absl::StatusOr<AttentionTuneReport> report = Tune(b, shape, &chosen);
  if (absl::Status s = b.SetAttentionKernels(report.ok() ? chosen : before); !s.ok()) return s;
  return report;
}

}  // namespace kvlens::kernels::cuda
