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

}  // namespace
}  // namespace kvlens::interpret
