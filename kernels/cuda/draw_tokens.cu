// Token draws where the logits are: kernels/token_draw.h's DrawToken, one block a row.
//
// The host sorts the candidates by key = (~weight bits) << 32 | id (ascending: weight desc,
// id asc) and walks the sorted order. Here nothing is sorted: every question the draw asks
// of that order is "which candidate is at rank r" (top-k) or "which is the first whose
// running mass reaches X" (top-p, the draw), and each is answered by a radix descent over
// the keys: a 256-bin histogram of the next 8 key bits among the candidates that match the
// bits fixed so far (count, and mass), the bin where the running total crosses, and so on,
// 4 levels for the weight bits, then the ids within a run of equal weights (one level less
// per pass where the rank within the run is 0). Each pass recomputes the weights from the
// logits (one row of a few hundred KB at most: L1 and L2 hold it), or, for rows of up to
// 40960 tokens, reads them from shared memory, where the first pass put them; the kernel
// needs no scratch memory. A sampled row takes ~15 passes over its weights.
//
// Masses are sums of 42-bit fixed-point weights (w · 2^42 rounded) in 64-bit integers:
// exact, so the same whatever order the threads add them in (a seed gives the same token
// on every run), and a bin's mass is exactly the sum of its sub-bins' at the next level.
// The host sums the same float weights in double; the two differ by at most vocab · 2^−43
// against a kept mass of at least 1 (the largest weight is e^0).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/draw_tokens.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/reduce.cuh"

namespace kvlens::kernels::cuda {

DeviceDraw ToDeviceDraw(const TokenDraw& draw) {
  DeviceDraw d;
  // 0 is greedy: a temperature of 0, or one whose 1/T overflows float (DrawToken's rule).
  const float inv = draw.temperature == 0.0 ? 0.0f : static_cast<float>(1.0 / draw.temperature);
  d.inv_temperature = std::isinf(inv) ? 0.0f : inv;
  d.min_p = static_cast<float>(draw.min_p);
  d.top_k = draw.top_k;
  d.top_p = draw.top_p;
  d.u01 = draw.u01;
  d.top_logprobs = draw.top_logprobs;
  d.forced_token = draw.forced_token;
  if (draw.forced_token < 0 && draw.HasPenalties()) {  // (else penalty_count stays 0: none applies)
    d.repetition_penalty = draw.repetition_penalty;
    d.frequency_penalty = draw.frequency_penalty;
    d.presence_penalty = draw.presence_penalty;
  }
  return d;
}

namespace {

constexpr int kDrawThreads = 512;
constexpr int kDrawWarps = kDrawThreads / 32;
constexpr int kBins = 256;
constexpr int kHistograms = 8;  // warp w adds into histogram w % 8: less contention
constexpr unsigned kFull = 0xffffffffu;
constexpr uint64_t kAllKeys = ~uint64_t{0};
using u64 = unsigned long long;

// kernels/fast_exp.h's ExpNegated, operation by operation, with round-to-nearest
// intrinsics that the compiler never contracts into FMAs (the host's is compiled with
// -ffp-contract=off): the weights are the host's, bit for bit.
__device__ __forceinline__ float ExpNegatedExact(float y) {
  constexpr int kCapBits = 0x42ae999a;      // 87.3f
  int yb = __float_as_int(y) & 0x7fffffff;  // NaN of either sign past the cap, −0 is 0
  const bool small = yb < kCapBits;         // (NaN and +inf have larger bits)
  yb = small ? yb : kCapBits;
  const float x = -__int_as_float(yb);
  constexpr float kRound = 12582912.0f;
  const float n = __fsub_rn(__fadd_rn(__fmul_rn(x, 1.44269504f), kRound), kRound);
  const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, 0.693145752f)), __fmul_rn(n, 1.42860677e-6f));
  float p = __fadd_rn(1.0f / 120, __fmul_rn(r, 1.0f / 720));
  p = __fadd_rn(1.0f / 24, __fmul_rn(r, p));
  p = __fadd_rn(1.0f / 6, __fmul_rn(r, p));
  p = __fadd_rn(0.5f, __fmul_rn(r, p));
  p = __fadd_rn(1.0f, __fmul_rn(r, p));
  p = __fadd_rn(1.0f, __fmul_rn(r, p));
  const int bits = small ? (static_cast<int>(n) + 127) << 23 : 0;  // 2^n, or 0
  return __fmul_rn(p, __int_as_float(bits));
}

__device__ __forceinline__ u64 FixedMass(float w) { return __float2ull_rn(__fmul_rn(w, 0x1p42f)); }

__device__ __forceinline__ uint64_t KeyOf(float w, int j) {
  return static_cast<uint64_t>(~__float_as_uint(w)) << 32 | static_cast<uint32_t>(j);
}

// A logit's key for the top log-probabilities: ascending is (logit desc, id asc), the bits
// of any float mapped to an unsigned order first (negative: all flipped; else the sign
// set); NaN last.
__device__ __forceinline__ uint64_t LogitKeyOf(float l, int j) {
  const uint32_t b = __float_as_uint(l);
  const uint32_t ordered = (b & 0x80000000u) != 0 ? ~b : b | 0x80000000u;
  const uint32_t high = l != l ? 0xffffffffu : ~ordered;
  return static_cast<uint64_t>(high) << 32 | static_cast<uint32_t>(j);
}

// The row as the draw sees it: weight w_j = e^((max − l_j) · −1/T), TemperatureWeights',
// read from `cache` (shared memory) where the row's weights fit there, else recomputed.
struct Row {
  const float* x;
  int vocab;
  float max;
  float inv_t;
  const float* cache;
  __device__ __forceinline__ float Compute(int j) const {
    return ExpNegatedExact(__fmul_rn(__fsub_rn(max, x[j]), inv_t));
  }
  __device__ __forceinline__ float Weight(int j) const {
    return cache != nullptr ? cache[j] : Compute(j);
  }
};

struct Smem {
  unsigned count[kHistograms][kBins];
  u64 mass[kHistograms][kBins];
  unsigned bin_count[kBins];
  u64 bin_mass[kBins];
  u64 partial[kDrawWarps];
  double partial_d[kDrawWarps];
  int pick;             // FindBin's bin, −1 for none
  u64 pick_before;      // the running total before it (count or mass)
  unsigned pick_count;  // its candidates
};

struct MinU64 {
  __device__ u64 operator()(u64 a, u64 b) const { return a < b ? a : b; }
};
struct MaxU64 {
  __device__ u64 operator()(u64 a, u64 b) const { return a > b ? a : b; }
};
struct SumU64 {
  __device__ u64 operator()(u64 a, u64 b) const { return a + b; }
};

// Every thread gets the result; warps combined in a fixed order (deterministic).
template <typename Op>
__device__ u64 BlockReduceU64(u64 v, Op op, Smem& s) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFull, v, o));
  __syncthreads();  // the previous call's readers are done with s.partial
  if ((threadIdx.x & 31) == 0) s.partial[threadIdx.x >> 5] = v;
  __syncthreads();
  v = s.partial[0];
  for (int w = 1; w < kDrawWarps; ++w) v = op(v, s.partial[w]);
  return v;
}

__device__ double BlockSumDouble(double v, Smem& s) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s.partial_d[threadIdx.x >> 5] = v;
  __syncthreads();
  v = s.partial_d[0];
  for (int w = 1; w < kDrawWarps; ++w) v += s.partial_d[w];
  return v;
}

// Counts (and with kMass sums the fixed-point masses of) the candidates with key <= limit
// whose key agrees with `prefix` above bit shift + 8, by their key bits shift … shift + 7,
// into s.bin_count (s.bin_mass).
template <bool kMass>
__device__ void Histogram(const Row& row, uint64_t prefix, int shift, uint64_t limit, Smem& s) {
  for (int b = threadIdx.x; b < kHistograms * kBins; b += blockDim.x) {
    (&s.count[0][0])[b] = 0;
    if (kMass) (&s.mass[0][0])[b] = 0;
  }
  __syncthreads();
  const int h = (threadIdx.x >> 5) % kHistograms, lane = threadIdx.x & 31;
  const int high = shift + 8;
  for (int j0 = 0; j0 < row.vocab; j0 += blockDim.x) {  // every lane of a warp iterates
    const int j = j0 + static_cast<int>(threadIdx.x);
    int bin = -1;
    u64 f = 0;
    if (j < row.vocab) {
      const float w = row.Weight(j);
      const uint64_t key = KeyOf(w, j);
      if (key <= limit && (high >= 64 || (key >> high) == (prefix >> high))) {
        bin = static_cast<int>((key >> shift) & 0xff);
        if (kMass) f = FixedMass(w);
      }
    }
    // A warp whose 32 candidates share a bin (a run of zero weights; at the top level,
    // weights of one binade) adds once.
    const int bin0 = __shfl_sync(kFull, bin, 0);
    if (__all_sync(kFull, bin == bin0)) {
      if (bin0 >= 0) {
        if (kMass) {
          for (int o = 16; o > 0; o >>= 1) f += __shfl_xor_sync(kFull, f, o);
        }
        if (lane == 0) {
          atomicAdd(&s.count[h][bin0], 32u);
          if (kMass && f != 0) atomicAdd(&s.mass[h][bin0], f);
        }
      }
    } else if (bin >= 0) {
      atomicAdd(&s.count[h][bin], 1u);
      if (kMass && f != 0) atomicAdd(&s.mass[h][bin], f);
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
    unsigned c = 0;
    u64 m = 0;
    for (int k = 0; k < kHistograms; ++k) {
      c += s.count[k][b];
      if (kMass) m += s.mass[k][b];
    }
    s.bin_count[b] = c;
    s.bin_mass[b] = m;
  }
  __syncthreads();
}

// The first bin (ascending) at which `reached(before + the running total through it)`
// holds, totals of bin_mass (kMass) or bin_count: s.pick, with the running total before it
// in s.pick_before and its count in s.pick_count; s.pick = −1 if no bin reaches. `reached`
// must be monotone in the total.
template <bool kMass, typename Reached>
__device__ void FindBin(u64 before, Reached reached, Smem& s) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    u64 v[kBins / 32];
    u64 local = 0;
#pragma unroll
    for (int k = 0; k < kBins / 32; ++k) {
      const int b = lane * (kBins / 32) + k;
      v[k] = kMass ? s.bin_mass[b] : s.bin_count[b];
      local += v[k];
    }
    u64 inclusive = local;
    for (int o = 1; o < 32; o <<= 1) {
      const u64 t = __shfl_up_sync(kFull, inclusive, o);
      if (lane >= o) inclusive += t;
    }
    const unsigned hits = __ballot_sync(kFull, reached(before + inclusive));
    if (hits == 0) {
      if (lane == 0) s.pick = -1;
    } else if (lane == __ffs(hits) - 1) {
      u64 at = before + inclusive - local;
      int k = 0;
      while (k < kBins / 32 - 1 && !reached(at + v[k])) at += v[k++];
      const int b = lane * (kBins / 32) + k;
      s.pick = b;
      s.pick_before = at;
      s.pick_count = s.bin_count[b];
    }
  }
  __syncthreads();
}

// Fixes prefix's key bits from_shift + 7 down to to_shift, 8 at a time, so that they are
// those of the candidate of rank r (0-based, over the keys <= limit that agree with prefix
// above them); r becomes its rank among the candidates that agree with the new prefix.
__device__ uint64_t DescendByRank(const Row& row, uint64_t prefix, int from_shift, int to_shift,
                                  uint64_t limit, unsigned& r, Smem& s) {
  for (int shift = from_shift; shift >= to_shift; shift -= 8) {
    Histogram<false>(row, prefix, shift, limit, s);
    const unsigned rank = r;
    FindBin<false>(
        0, [rank](u64 c) { return c > rank; }, s);
    prefix |= static_cast<uint64_t>(s.pick) << shift;
    r -= static_cast<unsigned>(s.pick_before);
  }
  return prefix;
}

// Over the candidates with key <= limit that agree with prefix's top 32 bits (one
// weight), the key of rank r (0: the lowest id).
__device__ uint64_t RankInRun(const Row& row, uint64_t prefix, uint64_t limit, unsigned r,
                              Smem& s) {
  if (r == 0) {
    u64 best = kAllKeys;
    for (int j = threadIdx.x; j < row.vocab; j += blockDim.x) {
      const uint64_t key = KeyOf(row.Weight(j), j);
      if (key <= limit && (key >> 32) == (prefix >> 32) && key < best) best = key;
    }
    return BlockReduceU64(best, MinU64(), s);
  }
  // ids < kDrawMaxVocab = 2^21: key bits 24 … 31 are 0, the ids' levels start at bit 16.
  return DescendByRank(row, prefix, 16, 0, limit, r, s);
}

// The key of rank r (0-based) among the candidates with key <= limit (r < their count).
__device__ uint64_t SelectByRank(const Row& row, uint64_t limit, unsigned r, Smem& s) {
  const uint64_t prefix = DescendByRank(row, 0, 56, 32, limit, r, s);  // the weight's bits
  return RankInRun(row, prefix, limit, r, s);
}

// The last key (largest) among the candidates with key <= limit whose weight reaches
// min_weight (>= 0: all of them), 0 if there is none.
__device__ uint64_t LastKeyWithin(const Row& row, uint64_t limit, float min_weight, Smem& s) {
  u64 last = 0;
  for (int j = threadIdx.x; j < row.vocab; j += blockDim.x) {
    const float w = row.Weight(j);
    const uint64_t key = KeyOf(w, j);
    if (key <= limit && w >= min_weight && key > last) last = key;
  }
  return BlockReduceU64(last, MaxU64(), s);
}

// The first candidate (ascending keys <= limit) at which the running mass reaches x
// (>= x, or > x when strict); false if the whole mass does not.
__device__ bool SelectByMass(const Row& row, uint64_t limit, double x, bool strict, uint64_t* key,
                             Smem& s) {
  auto reached = [x, strict](u64 total) {
    const double t = static_cast<double>(total);
    return strict ? t > x : t >= x;
  };
  uint64_t prefix = 0;
  u64 before = 0;
  for (int shift = 56; shift >= 32; shift -= 8) {
    Histogram<true>(row, prefix, shift, limit, s);
    FindBin<true>(before, reached, s);
    // A bin's sub-bins hold exactly its mass, so only the top level can miss.
    if (s.pick < 0) return false;
    prefix |= static_cast<uint64_t>(s.pick) << shift;
    before = s.pick_before;
  }
  // A run of `run` candidates of one weight (ids ascending), each of mass f: the first n
  // whose running mass before + (n + 1) · f reaches x.
  const unsigned run = s.pick_count;
  const u64 f = FixedMass(__uint_as_float(~static_cast<uint32_t>(prefix >> 32)));
  unsigned n = 0;
  if (f > 0 && run > 1) {
    const double estimate = (x - static_cast<double>(before)) / static_cast<double>(f) - 1.0;
    n = estimate <= 0.0 ? 0u : static_cast<unsigned>(fmin(estimate, static_cast<double>(run - 1)));
    while (n > 0 && reached(before + static_cast<u64>(n) * f)) --n;
    while (n + 1 < run && !reached(before + static_cast<u64>(n + 1) * f)) ++n;
  }
  *key = RankInRun(row, prefix, limit, n, s);
  return true;
}

// Σ of the fixed-point masses of the candidates with key <= limit.
__device__ u64 MassWithin(const Row& row, uint64_t limit, Smem& s) {
  u64 sum = 0;
  for (int j = threadIdx.x; j < row.vocab; j += blockDim.x) {
    const float w = row.Weight(j);
    if (KeyOf(w, j) <= limit) sum += FixedMass(w);
  }
  return BlockReduceU64(sum, SumU64(), s);
}

// token_draw.h's PenalizedLogit, each operation rounded on its own as the host's.
__device__ float PenalizedLogit(float l, int32_t count, const DeviceDraw& d) {
  if (d.repetition_penalty != 1.0) {
    const double wide = static_cast<double>(l);
    l = __double2float_rn(l > 0 ? __ddiv_rn(wide, d.repetition_penalty)
                                : __dmul_rn(wide, d.repetition_penalty));
  }
  const double scaled = __dmul_rn(d.frequency_penalty, static_cast<double>(count));
  return __fsub_rn(l, __double2float_rn(__dadd_rn(scaled, d.presence_penalty)));
}

// Block r: row r's draw (DrawToken) and its log-probability.
__global__ void __launch_bounds__(kDrawThreads)
    DrawTokensKernel(const float* logits, int vocab, const DeviceDraw* draws,
                     const DeviceBias* bias, const DevicePenalty* penalties, float* adjusted,
                     bool cache_weights, int32_t* token, float* logprob, int32_t* top_token,
                     float* top_logprob) {
  WaitForPriorGrids();  // first: see launch.cuh
  __shared__ Smem s;
  extern __shared__ float draw_weights[];  // [vocab] with cache_weights
  const float* x = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  const DeviceDraw d = draws[blockIdx.x];
  // MaxLogit (NaN ignored) and LogSumExp: max + log Σ e^(l − max), the exponentials as
  // the host's (ExpNegated), summed in double.
  float m = -INFINITY;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, x[j]);
  m = BlockReduce(m, MaxOp());
  double sum = 0.0;
  if (m != -INFINITY) {
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
      sum += static_cast<double>(ExpNegatedExact(__fsub_rn(m, x[j])));
    }
  }
  sum = BlockSumDouble(sum, s);
  const double lse =
      m == -INFINITY ? -static_cast<double>(INFINITY) : static_cast<double>(m) + log(sum);
  // The logits the draw sees: the row, or with a logit bias or penalties its adjusted
  // copy (in shared memory, or past kDrawCachedVocab its row of `adjusted`: a
  // block's global writes are visible to its threads after a barrier as well), with their
  // own max. The bias entries are added in turn by one thread, as ApplyLogitBias; the
  // penalized tokens are distinct, so each thread takes its own.
  const bool forced = d.forced_token >= 0;  // (the same for the whole block)
  const float* xd = x;
  float md = m;
  if (!forced && (d.bias_count > 0 || d.penalty_count > 0)) {
    float* xa =
        cache_weights ? draw_weights : adjusted + static_cast<int64_t>(d.adjusted_row) * vocab;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) xa[j] = x[j];
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int b = d.bias_offset; b < d.bias_offset + d.bias_count; ++b) {
        xa[bias[b].id] = __fadd_rn(xa[bias[b].id], bias[b].value);
      }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < d.penalty_count; p += blockDim.x) {
      const DevicePenalty e = penalties[d.penalty_offset + p];
      xa[e.id] = PenalizedLogit(xa[e.id], e.count, d);
    }
    __syncthreads();
    xd = xa;
    md = -INFINITY;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) md = fmaxf(md, xd[j]);
    md = BlockReduce(md, MaxOp());
  }
  uint64_t picked = 0;  // the chosen key (its low 32 bits the token)
  if (forced) {
    picked = static_cast<uint64_t>(d.forced_token);
  } else if (d.inv_temperature == 0.0f) {
    // ArgMax: the first l == max (0 if none, a row of NaN).
    u64 first = static_cast<u64>(vocab);
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
      if (xd[j] == md && static_cast<u64>(j) < first) first = static_cast<u64>(j);
    }
    first = BlockReduceU64(first, MinU64(), s);
    picked = first < static_cast<u64>(vocab) ? first : 0;
  } else {
    Row row{xd, vocab, md, d.inv_temperature, nullptr};
    if (cache_weights) {
      // (A thread overwrites only the adjusted logits it reads itself.)
      for (int j = threadIdx.x; j < vocab; j += blockDim.x) draw_weights[j] = row.Compute(j);
      __syncthreads();
      row.cache = draw_weights;
    }
    uint64_t limit = kAllKeys;  // the kept candidates: key <= limit
    if (d.top_k > 0 && d.top_k < vocab) {
      limit = SelectByRank(row, kAllKeys, static_cast<unsigned>(d.top_k - 1), s);
    }
    const u64 kept_mass = MassWithin(row, limit, s);
    bool cut = false;
    // (With no mass the host's running share is 0 / 0: top-p cuts nothing.)
    if (d.top_p < 1.0 && kept_mass > 0) {
      uint64_t key = 0;
      if (SelectByMass(row, limit, d.top_p * static_cast<double>(kept_mass), false, &key, s) &&
          key < limit) {
        limit = key;
        cut = true;
      }
    }
    if (d.min_p > 0.0f) {
      // The kept candidates whose weight reaches min_p · the largest weight (the first
      // candidate's: it always stays); the last of them in key order is the new limit.
      float w_max = 0.0f;
      for (int j = threadIdx.x; j < vocab; j += blockDim.x) w_max = fmaxf(w_max, row.Weight(j));
      w_max = BlockReduce(w_max, MaxOp());
      const uint64_t last = LastKeyWithin(row, limit, __fmul_rn(d.min_p, w_max), s);
      if (last < limit) {
        limit = last;
        cut = true;
      }
    }
    const u64 total = cut ? MassWithin(row, limit, s) : kept_mass;
    // The first candidate whose running mass exceeds u = u01 · total; the last kept one
    // if none does (no mass at all).
    if (!SelectByMass(row, limit, d.u01 * static_cast<double>(total), true, &picked, s)) {
      picked = LastKeyWithin(row, limit, 0.0f, s);
    }
  }
  if (threadIdx.x == 0) {
    const int t = static_cast<int>(static_cast<uint32_t>(picked));
    token[blockIdx.x] = t;
    logprob[blockIdx.x] = static_cast<float>(static_cast<double>(x[t]) - lse);
  }
  // The top log-probabilities: k passes, each the smallest key past the last one taken.
  const int k = min(min(d.top_logprobs, vocab), kMaxTopLogprobs);
  u64 taken = 0;
  for (int t = 0; t < k; ++t) {
    u64 best = kAllKeys;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
      const u64 key = LogitKeyOf(x[j], j);
      if ((t == 0 || key > taken) && key < best) best = key;
    }
    taken = BlockReduceU64(best, MinU64(), s);
    if (threadIdx.x == 0) {
      const int id = static_cast<int>(static_cast<uint32_t>(taken));
      const int64_t at = static_cast<int64_t>(blockIdx.x) * kMaxTopLogprobs + t;
      top_token[at] = id;
      top_logprob[at] = static_cast<float>(static_cast<double>(x[id]) - lse);
    }
  }
}

}  // namespace

absl::Status LaunchDrawTokens(const float* logits, int rows, int vocab, const DeviceDraw* draws,
                              const DeviceBias* bias, const DevicePenalty* penalties,
                              float* adjusted, int32_t* token, float* logprob, int32_t* top_token,
                              float* top_logprob, cudaStream_t stream) {
  if (vocab < 1 || vocab > kDrawMaxVocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchDrawTokens: vocab = ", vocab, " must be in [1, ", kDrawMaxVocab, "]"));
  }
  if (rows <= 0) return absl::OkStatus();
  const bool cache_weights = vocab <= kDrawCachedVocab;
  if ((bias != nullptr || penalties != nullptr) && !cache_weights && adjusted == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("LaunchDrawTokens: a logit bias or penalties past vocab = ", kDrawCachedVocab,
                     " need `adjusted` [adjusted rows, vocab] (vocab = ", vocab, ")"));
  }
  const size_t cache_bytes = cache_weights ? sizeof(float) * static_cast<size_t>(vocab) : 0;
  if (cache_bytes > 0) {
    // Past 48 KiB of shared memory, static and dynamic together, a kernel must opt in, and
    // the histograms take 27 KiB of them: a row of more than about 5300 tokens. Opted in
    // to the largest row it keeps, at every launch, as the opt-in belongs to the device's
    // context (the rows of a 160 KB cache and the histograms within an SM's 227 KiB).
    KVLENS_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(DrawTokensKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(sizeof(float) * kDrawCachedVocab)));
  }
  LaunchKernel("DrawTokensKernel", DrawTokensKernel, static_cast<unsigned>(rows), kDrawThreads,
               cache_bytes, stream, logits, vocab, draws, bias, penalties, adjusted, cache_weights,
               token, logprob, top_token, top_logprob);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("DrawTokensKernel");
  return absl::OkStatus();
}

}  // namespace kvlens::kernels::cuda
