// Invariants of the forward pass on a real trained model (stories260K, Llama family with
// grouped-query attention): incremental decoding through the paged cache equals a full
// recomputation, the future never changes the past, unused cache slots are never read,
// batching changes nothing, and the fast fp32 path tracks the double reference.
#include "engine/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <numeric>
#include <random>

#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/random_tokens.h"
#include "tests/engine/stories_model_test.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

using testing::TestData;

const std::string kGguf = TestData("stories260K/stories260K.gguf");

// max |a − b| / max |b|: error relative to the scale of the reference values.
template <typename A, typename B>
double RelErr(const std::vector<A>& a, const std::vector<B>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    den = std::max(den, std::abs(static_cast<double>(b[i])));
  }
  return num / den;
}

// A deterministic token sequence from the vocabulary (BOS first).
// A block table of `blocks` distinct ids drawn at random from a pool twice that size, so
// a sequence's blocks are scattered and half the pool is never written (NaN stays).
std::vector<int32_t> ScatteredTable(int blocks, uint32_t seed) {
  std::vector<int32_t> ids(2 * blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
  ids.resize(blocks);
  return ids;
}

// All-position logits from one forward over the whole sequence (no cache reuse).
template <typename T>
std::vector<T> FullLogits(const Model& m, kernels::Backend<T>& be, const std::vector<int32_t>& t,
                          int block_size = 16,
                          kernels::KvDtype cache_dtype = kernels::KvDtype::kActivation) {
  const int blocks = (static_cast<int>(t.size()) + block_size - 1) / block_size;
  KvCacheStorage<T> cache(m.config.num_layers, 2 * blocks, block_size, m.config.kv_dim(), true,
                          cache_dtype);
  const std::vector<int32_t> table = ScatteredTable(blocks, 7);
  Transformer<T> tr(m, be);
  BatchEntry e{t, 0, table, /*all_logits=*/true};
  ForwardOutput<T> out;
  EXPECT_TRUE(tr.Forward({&e, 1}, cache, out).ok());
  return out.logits;
}

// The same logits from chunked prefill, then one decode step per remaining token.
template <typename T>
std::vector<T> IncrementalLogits(const Model& m, kernels::Backend<T>& be,
                                 const std::vector<int32_t>& t, std::vector<int> chunks,
                                 int block_size,
                                 kernels::KvDtype cache_dtype = kernels::KvDtype::kActivation) {
  const int blocks = (static_cast<int>(t.size()) + block_size - 1) / block_size;
  KvCacheStorage<T> cache(m.config.num_layers, 2 * blocks, block_size, m.config.kv_dim(), true,
                          cache_dtype);
  const std::vector<int32_t> table = ScatteredTable(blocks, 11);
  Transformer<T> tr(m, be);
  std::vector<T> all;
  int done = 0;
  size_t c = 0;
  while (done < static_cast<int>(t.size())) {
    const int n = c < chunks.size() ? std::min<int>(chunks[c++], t.size() - done) : 1;
    BatchEntry e{absl::MakeConstSpan(t).subspan(done, n), done, table, true};
    ForwardOutput<T> out;
    const absl::Status s = tr.Forward({&e, 1}, cache, out);
    EXPECT_TRUE(s.ok()) << s;
    all.insert(all.end(), out.logits.begin(), out.logits.end());
    done += n;
  }
  return all;
}

class TransformerTest : public testing::StoriesModelTest {
 protected:
};

TEST_F(TransformerTest, IncrementalEqualsFullRecomputationDouble) {
  kernels::ReferenceBackend be;
  const auto t = testing::RandomTokens(41, 1, model_->config.vocab_size);
  const auto full = FullLogits<double>(*model_, be, t);
  for (int bs : {1, 7, 16}) {
    const auto inc = IncrementalLogits<double>(*model_, be, t, {5, 9, 3}, bs);
    EXPECT_LE(RelErr(inc, full), 1e-12) << "block size " << bs;
  }
}

TEST_F(TransformerTest, IncrementalEqualsFullRecomputationFp32) {
  kernels::CpuBackend be(2);
  const auto t = testing::RandomTokens(57, 2, model_->config.vocab_size);
  const auto full = FullLogits<float>(*model_, be, t);
  for (int bs : {1, 7, 16}) {
    const auto inc = IncrementalLogits<float>(*model_, be, t, {16, 4, 17}, bs);
    EXPECT_LE(RelErr(inc, full), 1e-5) << "block size " << bs;
  }
}

// A bf16 cache: a forward reads every key and value as stored (rounded once), so
// incremental decoding still equals a full recomputation on the same cache type.
TEST_F(TransformerTest, IncrementalEqualsFullRecomputationOnABf16Cache) {
  constexpr auto kBf16 = kernels::KvDtype::kBF16;
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  const auto t = testing::RandomTokens(45, 3, model_->config.vocab_size);
  const auto full_ref = FullLogits<double>(*model_, ref, t, 16, kBf16);
  const auto full = FullLogits<float>(*model_, fast, t, 16, kBf16);
  for (int bs : {1, 16}) {
    EXPECT_LE(RelErr(IncrementalLogits<double>(*model_, ref, t, {5, 9}, bs, kBf16), full_ref),
              1e-12)
        << "block size " << bs;
    EXPECT_LE(RelErr(IncrementalLogits<float>(*model_, fast, t, {16, 4}, bs, kBf16), full), 1e-5)
        << "block size " << bs;
  }
}

// What the bf16 cache changes: each key and value moves by at most 2^-9 of itself, which
// five layers of this small model carry to about 1% of the logits' scale (measured 0.97%);
// and the fp32 path on a bf16 cache agrees with the double reference on a bf16 cache two
// orders of magnitude more closely than that (measured 1.5e-5: a key that float and
// double round to neighbouring bf16 values costs a little more than fp32's 1e-5).
TEST_F(TransformerTest, Bf16CacheMovesLogitsByItsRoundingOnly) {
  constexpr auto kBf16 = kernels::KvDtype::kBF16;
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  const auto t = testing::RandomTokens(64, 6, model_->config.vocab_size);
  const auto ref_exact = FullLogits<double>(*model_, ref, t);
  const auto ref_bf16 = FullLogits<double>(*model_, ref, t, 16, kBf16);
  const auto fast_bf16 = FullLogits<float>(*model_, fast, t, 16, kBf16);
  const double moved = RelErr(ref_bf16, ref_exact);
  const double tracked = RelErr(fast_bf16, ref_bf16);
  std::cerr << "bf16 cache: logits moved " << moved << ", fp32 path against the reference "
            << tracked << "\n";
  EXPECT_GT(moved, 1e-4);  // the cache type is in effect
  EXPECT_LT(moved, 0.05);
  EXPECT_LE(tracked, moved / 100);
}

TEST_F(TransformerTest, FutureTokensNeverChangeEarlierLogits) {
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  auto a = testing::RandomTokens(30, 3, model_->config.vocab_size);
  auto b = a;
  for (int i = 20; i < 30; ++i) b[i] = (b[i] + 17) % model_->config.vocab_size;
  const int V = model_->config.vocab_size;
  const auto ra = FullLogits<double>(*model_, ref, a), rb = FullLogits<double>(*model_, ref, b);
  const auto fa = FullLogits<float>(*model_, fast, a), fb = FullLogits<float>(*model_, fast, b);
  for (int i = 0; i < 20 * V; ++i) {
    ASSERT_EQ(ra[i], rb[i]) << "reference, position " << i / V;
    ASSERT_EQ(fa[i], fb[i]) << "fp32, position " << i / V;
  }
  // and the changed positions do change
  EXPECT_NE(ra[25 * V], rb[25 * V]);
}

TEST_F(TransformerTest, BatchingChangesNothing) {
  kernels::CpuBackend be(2);
  const int V = model_->config.vocab_size;
  const auto t1 = testing::RandomTokens(19, 4, V), t2 = testing::RandomTokens(33, 5, V);
  const auto alone1 = FullLogits<float>(*model_, be, t1),
             alone2 = FullLogits<float>(*model_, be, t2);
  // both sequences in one forward, each with its own blocks of one pool
  const int bs = 8;
  KvCacheStorage<float> cache(model_->config.num_layers, 16, bs, model_->config.kv_dim(), true);
  const std::vector<int32_t> table1 = {9, 2, 14}, table2 = {0, 11, 5, 7, 3};
  Transformer<float> tr(*model_, be);
  BatchEntry e[2] = {{t1, 0, table1, true}, {t2, 0, table2, true}};
  ForwardOutput<float> out;
  ASSERT_TRUE(tr.Forward(e, cache, out).ok());
  std::vector<float> got1(out.logits.begin(), out.logits.begin() + 19 * V);
  std::vector<float> got2(out.logits.begin() + 19 * V, out.logits.end());
  EXPECT_LE(RelErr(got1, alone1), 1e-6);
  EXPECT_LE(RelErr(got2, alone2), 1e-6);
}

// Entries that want only their last row's logits next to ones that want all: the rows
// gathered for the classifier are runs (18..23, then 34), each entry's logits at its
// logits_row, equal to running the sequence alone.
TEST_F(TransformerTest, MixedLogitRowsChangeNothing) {
  kernels::CpuBackend be(2);
  const int V = model_->config.vocab_size;
  const std::vector<std::vector<int32_t>> t = {testing::RandomTokens(19, 4, V),
                                               testing::RandomTokens(5, 5, V),
                                               testing::RandomTokens(11, 6, V)};
  const bool all[3] = {false, true, false};
  const int bs = 8;
  KvCacheStorage<float> cache(model_->config.num_layers, 16, bs, model_->config.kv_dim(), true);
  const std::vector<int32_t> tables[3] = {{9, 2, 14}, {0}, {11, 5}};
  Transformer<float> tr(*model_, be);
  std::vector<BatchEntry> e;
  for (int i = 0; i < 3; ++i) e.push_back({t[i], 0, tables[i], all[i]});
  ForwardOutput<float> out;
  ASSERT_TRUE(tr.Forward(e, cache, out).ok());
  ASSERT_EQ(out.logits.size(), size_t{1 + 5 + 1} * V);
  for (int i = 0; i < 3; ++i) {
    const std::vector<float> alone = FullLogits<float>(*model_, be, t[i]);
    const size_t rows = all[i] ? t[i].size() : 1;
    const auto first = out.logits.begin() + size_t(out.logits_row[i]) * V;
    const std::vector<float> got(first, first + rows * V);
    const std::vector<float> want(alone.end() - rows * V, alone.end());
    EXPECT_LE(RelErr(got, want), 1e-6) << "entry " << i;
  }
}

TEST_F(TransformerTest, Fp32TracksDoubleReference) {
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  const auto t = testing::RandomTokens(64, 6, model_->config.vocab_size);
  EXPECT_LE(RelErr(FullLogits<float>(*model_, fast, t), FullLogits<double>(*model_, ref, t)), 1e-5);
}

// Steering vectors whose from_position falls inside a chunk reach only the rows from there
// on: two sequences in one forward (the first steered at layer 1 by v from position 0 and
// by w from 5, the second at layer 2's resid_mid by u from 2) give the logits of each run
// alone in the chunks on either side of those positions, steered from their first row by
// what reaches it (v, then v and w; nothing, then u).
TEST_F(TransformerTest, SteeringFromAPositionInsideAChunkEqualsChunksSteeredWhole) {
  kernels::ReferenceBackend be;
  const int V = model_->config.vocab_size, D = model_->config.dim;
  const auto ta = testing::RandomTokens(12, 4, V), tb = testing::RandomTokens(9, 5, V);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto vector = [&] {
    std::vector<float> x(static_cast<size_t>(D));
    for (float& e : x) e = normal(rng);
    return x;
  };
  const ResidualAdd v{1, false, vector()}, w{1, false, vector(), 5}, u{2, true, vector(), 2};
  ResidualAdd w_whole = w, u_whole = u;
  w_whole.from_position = u_whole.from_position = 0;
  const int bs = 4, L = model_->config.num_layers, KVD = model_->config.kv_dim();
  const std::vector<int32_t> table_a = {6, 1, 3}, table_b = {0, 7, 4};

  KvCacheStorage<double> together(L, 8, bs, KVD, true);
  Transformer<double> tr(*model_, be);
  const std::vector<ResidualAdd> adds_a = {v, w}, adds_b = {u};
  BatchEntry e[2] = {{ta, 0, table_a, true}, {tb, 0, table_b, true}};
  e[0].residual_adds = adds_a;
  e[1].residual_adds = adds_b;
  ForwardOutput<double> out;
  ASSERT_TRUE(tr.Forward(e, together, out).ok());

  // One sequence in two chunks split at `split`, steered by `before` then `after`.
  auto in_chunks = [&](const std::vector<int32_t>& t, const std::vector<int32_t>& table, int split,
                       const std::vector<ResidualAdd>& before,
                       const std::vector<ResidualAdd>& after) {
    KvCacheStorage<double> alone(L, 8, bs, KVD, true);
    std::vector<double> all;
    for (int part = 0; part < 2; ++part) {
      const int from = part == 0 ? 0 : split;
      const int end = part == 0 ? split : static_cast<int>(t.size());
      BatchEntry c{absl::MakeConstSpan(t).subspan(from, end - from), from, table, true};
      c.residual_adds = part == 0 ? before : after;
      ForwardOutput<double> o;
      EXPECT_TRUE(tr.Forward({&c, 1}, alone, o).ok());
      all.insert(all.end(), o.logits.begin(), o.logits.end());
    }
    return all;
  };
  const std::vector<double> got_a(out.logits.begin(), out.logits.begin() + 12 * V);
  const std::vector<double> got_b(out.logits.begin() + 12 * V, out.logits.end());
  const std::vector<double> want_a = in_chunks(ta, table_a, 5, {v}, {v, w_whole});
  const std::vector<double> want_b = in_chunks(tb, table_b, 2, {}, {u_whole});
  EXPECT_LE(RelErr(got_a, want_a), 1e-12);
  EXPECT_LE(RelErr(got_b, want_b), 1e-12);
  // w and u move the rows they reach: a table row reused past its run would be seen.
  EXPECT_GT(RelErr(got_a, in_chunks(ta, table_a, 5, {v}, {v})), 1e-3);
  EXPECT_GT(RelErr(got_b, in_chunks(tb, table_b, 2, {}, {})), 1e-3);
}

TEST_F(TransformerTest, GgufAndLlama2cAreTheSameModel) {
  KVLENS_REQUIRE_FILE(kGguf);
  auto g = LoadModel({kGguf, ""});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->config.num_kv_heads, 4);
  EXPECT_EQ((*g)->config.hidden_dim, 172);
  kernels::ReferenceBackend ref;
  const auto t = testing::RandomTokens(25, 8, model_->config.vocab_size);
  EXPECT_LE(RelErr(FullLogits<double>(**g, ref, t), FullLogits<double>(*model_, ref, t)), 1e-12);
}

TEST_F(TransformerTest, RejectsBadBatches) {
  kernels::CpuBackend be(1);
  KvCacheStorage<float> cache(model_->config.num_layers, 4, 16, model_->config.kv_dim(), true);
  Transformer<float> tr(*model_, be);
  ForwardOutput<float> out;
  const std::vector<int32_t> table = {0, 1};
  const std::vector<int32_t> bad_token = {1, 512};
  BatchEntry e{bad_token, 0, table};
  absl::Status s = tr.Forward({&e, 1}, cache, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token id 512"), std::string::npos) << s;

  const std::vector<int32_t> ok_tokens(20, 5);
  const std::vector<int32_t> short_table = {0};
  e = BatchEntry{ok_tokens, 0, short_table};
  s = tr.Forward({&e, 1}, cache, out);
  EXPECT_NE(s.message().find("block_table"), std::string::npos) << s;

  e = BatchEntry{ok_tokens, 500, table};
  s = tr.Forward({&e, 1}, cache, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_NE(s.message().find("context length 512"), std::string::npos) << s;

  // score_next: only with all_logits, one token a row (or one fewer), each in the
  // vocabulary; score_top within the API's limit.
  const std::vector<int32_t> tokens = {1, 2, 3};
  const std::vector<int32_t> next_ok = {2, 3}, next_long = {2, 3, 4, 5}, next_bad = {2, 512};
  e = BatchEntry{tokens, 0, table, /*all_logits=*/false};
  e.score_next = next_ok;
  s = tr.Forward({&e, 1}, cache, out);
  EXPECT_NE(s.message().find("score_next has 2 tokens"), std::string::npos) << s;
  e.all_logits = true;
  e.score_next = next_long;
  s = tr.Forward({&e, 1}, cache, out);
  EXPECT_NE(s.message().find("takes 3 or 2"), std::string::npos) << s;
  e.score_next = next_bad;
  s = tr.Forward({&e, 1}, cache, out);
  EXPECT_NE(s.message().find("score_next[1] = 512"), std::string::npos) << s;
  e.score_next = next_ok;
  e.score_top = 21;
  s = tr.Forward({&e, 1}, cache, out);
  EXPECT_NE(s.message().find("score_top = 21"), std::string::npos) << s;
  e.score_top = 20;
  EXPECT_TRUE(tr.Forward({&e, 1}, cache, out).ok());  // (a host backend: the rows)
  EXPECT_EQ(out.logits.size(), 3u * model_->config.vocab_size);
  EXPECT_TRUE(out.pick_token.empty());
}

}  // namespace
}  // namespace kvlens
