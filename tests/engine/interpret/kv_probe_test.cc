// The cached-KV probe on stories260K: the prefix is prefilled by Transformer::Forward into
// a scattered, NaN-filled paged cache; the probe runs only the new tokens. Its gradients
// w.r.t. the cached K/V equal a full tape's gradients for those tensors when the full tape
// treats them as leaves, and match float64 differences taken in the cached tensors.
#include "engine/interpret/kv_probe.h"

#include <cmath>
#include <random>

#include "engine/interpret/finite_difference.h"
#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/random_tokens.h"
#include "tests/engine/stories_model_test.h"
#include "tests/kernels/fake_device_backend.h"
#include "tests/test_paths.h"

namespace kvlens::interpret {
namespace {

template <typename T>
double MaxDiff(const std::vector<T>& a, const std::vector<T>& b, double* scale = nullptr) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0, s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    s = std::max(s, std::abs(static_cast<double>(b[i])));
  }
  if (scale) *scale = s;
  return m;
}

class KvProbeTest : public testing::StoriesModelTest {
 protected:
  void SetUp() override {
    StoriesModelTest::SetUp();
    if (NoModel()) return;
    tokens_ = testing::RandomTokens(kP + kN, 3, model_->config.vocab_size);
  }

  // Prefills tokens 0 … P−1 into a fresh cache (blocks of 4, scattered, NaN elsewhere).
  template <typename T>
  std::unique_ptr<KvCacheStorage<T>> Prefill(kernels::Backend<T>& be) {
    auto cache = std::make_unique<KvCacheStorage<T>>(model_->config.num_layers, 12, 4,
                                                     model_->config.kv_dim(), true);
    Transformer<T> tr(*model_, be);
    BatchEntry e{absl::MakeConstSpan(tokens_).subspan(0, kP), 0, table_};
    ForwardOutput<T> out;
    EXPECT_TRUE(tr.Forward({&e, 1}, *cache, out).ok());
    return cache;
  }

  KvProbeRequest Request() const {
    return KvProbeRequest{table_, kP, absl::MakeConstSpan(tokens_).subspan(kP), kTarget};
  }

  static constexpr int kP = 13, kN = 3;
  static constexpr int32_t kTarget = 77;
  std::vector<int32_t> table_ = {7, 2, 10, 5};
  std::vector<int32_t> tokens_;
};

TEST_F(KvProbeTest, EqualsFullTapeWithCachedKvAsLeaves) {
  kernels::ReferenceBackend be;
  auto cache = Prefill<double>(be);
  auto probe = CachedKvProbe(*model_, be, *cache, Request());
  ASSERT_TRUE(probe.ok()) << probe.status();

  // The full sequence on one tape; the objective at its last row.
  auto full = RunForward(*model_, be, SequenceInput<double>{tokens_});
  ASSERT_TRUE(full.ok());
  const int V = model_->config.vocab_size, n = kP + kN;
  const Objective o = Objective::LogProb({{n - 1, kTarget}});
  EXPECT_NEAR(probe->objective, EvaluateObjective(o, model_->config, *full), 1e-12);
  const std::vector<double> last(full->logits.end() - V, full->logits.end());
  EXPECT_LE(MaxDiff(probe->logits, last), 1e-12);

  auto leaves = ObjectiveGradients(*model_, *full, o, BackwardOptions{-1, kP});
  auto total = ObjectiveGradients(*model_, *full, o);
  ASSERT_TRUE(leaves.ok() && total.ok());
  const int64_t KVD = model_->config.kv_dim();
  const int L = model_->config.num_layers;
  for (int l = 0; l < L; ++l) {
    // The cached rows hold exactly the full tape's K/V …
    const std::vector<double> k_full(full->layers[l].k.begin(),
                                     full->layers[l].k.begin() + kP * KVD);
    EXPECT_LE(MaxDiff(probe->input.prefix_k[l], k_full), 1e-13) << "layer " << l;
    // … and their gradients agree with the leaf view of the full tape.
    const std::vector<double> dk(leaves->k[l].begin(), leaves->k[l].begin() + kP * KVD);
    const std::vector<double> dv(leaves->v[l].begin(), leaves->v[l].begin() + kP * KVD);
    double sk = 0, sv = 0;
    const double ek = MaxDiff(probe->dk[l], dk, &sk), ev = MaxDiff(probe->dv[l], dv, &sv);
    EXPECT_LE(ek, 1e-12 * sk) << "layer " << l;
    EXPECT_LE(ev, 1e-12 * sv) << "layer " << l;
    EXPECT_GT(sk, 0.0);
    EXPECT_GT(sv, 0.0);
    // Without the stop, earlier layers' K also reach J through later prefix layers.
    const std::vector<double> dk_total(total->k[l].begin(), total->k[l].begin() + kP * KVD);
    double st = 0;
    const double diff = MaxDiff(probe->dk[l], dk_total, &st);
    if (l == L - 1) {
      EXPECT_LE(diff, 1e-12 * st) << "last layer";
    } else {
      EXPECT_GT(diff, 1e-6 * st) << "layer " << l;
    }
  }
}

TEST_F(KvProbeTest, MatchesFiniteDifferencesInTheCachedTensors) {
  kernels::ReferenceBackend be;
  auto cache = Prefill<double>(be);
  auto probe = CachedKvProbe(*model_, be, *cache, Request());
  ASSERT_TRUE(probe.ok());
  FdOptions opt;
  opt.tensors = {{TensorKind::kK}, {TensorKind::kV}};
  opt.samples_per_tensor = 12;
  const Objective o = Objective::LogProb({{kN - 1, kTarget}});
  auto r = CheckByFiniteDifferences(*model_, probe->input, o, probe->grads, opt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LE(r->max_rel_err, 1e-6);
  std::printf("[kv probe fd] max abs %.3g, max rel %.3g\n", r->max_abs_err, r->max_rel_err);
}

TEST_F(KvProbeTest, Fp32ProbeTracksFp64) {
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  auto cd = Prefill<double>(ref);
  auto cf = Prefill<float>(fast);
  auto pd = CachedKvProbe(*model_, ref, *cd, Request());
  auto pf = CachedKvProbe(*model_, fast, *cf, Request());
  ASSERT_TRUE(pd.ok() && pf.ok());
  for (int l = 0; l < model_->config.num_layers; ++l) {
    std::vector<double> dkf(pf->dk[l].begin(), pf->dk[l].end());
    double s = 0;
    const double e = MaxDiff(dkf, pd->dk[l], &s);
    EXPECT_LE(e, 1e-4 * s) << "layer " << l;
    EXPECT_GT(s, 0.0);
  }
}

TEST_F(KvProbeTest, RejectsShortBlockTables) {
  kernels::ReferenceBackend be;
  auto cache = Prefill<double>(be);
  KvProbeRequest r = Request();
  const std::vector<int32_t> short_table = {7, 2};
  r.block_table = short_table;
  const auto s = CachedKvProbe(*model_, be, *cache, r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("block_table"), std::string::npos) << s;
}

// The prefix is read out of non-host memory one run of consecutive block ids at a time,
// each row landing where its token belongs: row (l, t) of the input is physical row
// table[t / 4] · 4 + t % 4 of layer l, whose values say which row they are.
TEST(KvProbeInputTest, ReadsEachRunOfConsecutiveBlocksInOneCopy) {
  ModelConfig c;
  c.num_layers = 3;
  c.num_kv_heads = 2;
  c.head_dim = 3;
  const int KVD = c.kv_dim(), bs = 4, num_blocks = 12;
  testing::FakeDeviceMemory memory;
  auto cache = KvCacheStorage<float>::Create(memory, c.num_layers, num_blocks, bs, KVD, true);
  ASSERT_TRUE(cache.ok()) << cache.status();
  auto value = [&](int l, int64_t row, int e, bool v) {
    return static_cast<float>(l * 100000 + row * 100 + e + (v ? 50 : 0));
  };
  for (int l = 0; l < c.num_layers; ++l) {
    std::vector<float> k(int64_t{num_blocks} * bs * KVD), v(k.size());
    for (int64_t row = 0; row < num_blocks * bs; ++row) {
      for (int e = 0; e < KVD; ++e) {
        k[row * KVD + e] = value(l, row, e, false);
        v[row * KVD + e] = value(l, row, e, true);
      }
    }
    ASSERT_TRUE(memory.CopyFromHost(cache->k(l), k.data(), k.size() * sizeof(float)).ok());
    ASSERT_TRUE(memory.CopyFromHost(cache->v(l), v.data(), v.size() * sizeof(float)).ok());
  }
  // 18 cached tokens fill 4½ blocks: runs {3, 4} and {8, 9, 10}, the last half full; 11
  // follows 10 but holds nothing cached.
  const std::vector<int32_t> table = {3, 4, 8, 9, 10, 11};
  const std::vector<int32_t> new_tokens = {1};
  const int P = 18;
  const int before = memory.copies_to_host;
  auto in = InputFromCache(c, *cache, KvProbeRequest{table, P, new_tokens, 0});
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(memory.copies_to_host - before, 2 * 2 * c.num_layers);  // runs · {K, V} · layers
  for (int l = 0; l < c.num_layers; ++l) {
    ASSERT_EQ(in->prefix_k[l].size(), size_t{P} * KVD);
    for (int t = 0; t < P; ++t) {
      const int64_t row = int64_t{table[t / bs]} * bs + t % bs;
      for (int e = 0; e < KVD; ++e) {
        ASSERT_EQ(in->prefix_k[l][t * KVD + e], value(l, row, e, false)) << l << " " << t;
        ASSERT_EQ(in->prefix_v[l][t * KVD + e], value(l, row, e, true)) << l << " " << t;
      }
    }
  }
}

}  // namespace
}  // namespace kvlens::interpret
