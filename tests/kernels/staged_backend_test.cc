// StagedBackend over a device double (CPU kernels over memory that is not host-accessible):
// every op equals the CPU backend's bitwise (the same kernels run; only the staging
// differs), outputs come back through the device memory's copies, in-place ops (RoPE
// with padded rows, GELU, Add) keep what they do not touch, and a failing device
// allocation is reported by Synchronize with the outputs left alone.
#include "kernels/staged_backend.h"

#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/kernels/fake_device_backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels {
namespace {

using testing::OwnedWeight;

std::vector<float> Random(std::mt19937_64& rng, size_t n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

std::vector<double> RandomD(std::mt19937_64& rng, size_t n) {
  const std::vector<float> f = Random(rng, n);
  return std::vector<double>(f.begin(), f.end());
}

// One attention call over a paged cache (blocks 3 and 0 of 4, block size 4), GQA 4/2, an
// offset of 3 and two documents, q and out rows padded.
struct PagedCall {
  static constexpr int tq = 4, tk = 7, h = 4, hkv = 2, dh = 8, bs = 4, off = 3;
  static constexpr int64_t q_stride = h * dh + 3, kv_stride = hkv * dh + 1;
  std::vector<int32_t> table = {3, 0}, docs = {0, 0, 1, 1, 1, 1, 1};
  std::vector<float> q, kc, vc;

  explicit PagedCall(std::mt19937_64& rng)
      : q(Random(rng, size_t(tq) * q_stride)),
        kc(Random(rng, size_t(4 * bs) * kv_stride)),
        vc(Random(rng, size_t(4 * bs) * kv_stride)) {}
  // The call writing out [tq, q_stride] and, when non-null, probs and scores [h, tq, tk].
  AttentionArgs<float> Args(float* out, float* probs, float* scores) const {
    AttentionArgs<float> f;
    f.q = q.data();
    f.q_stride = q_stride;
    f.num_queries = tq;
    f.num_keys = tk;
    f.num_heads = h;
    f.num_kv_heads = hkv;
    f.head_dim = dh;
    f.query_offset = off;
    f.scale = 0.3;
    f.q_doc_ids = docs.data() + off;
    f.k_doc_ids = docs.data();
    f.kv = KvSource<float>{kc.data(), vc.data(), kv_stride, table.data(), bs};
    f.out = out;
    f.out_stride = q_stride;
    f.probs = probs;
    f.scores = scores;
    return f;
  }
};

class StagedBackendTest : public ::testing::Test {
 protected:
  kvlens::testing::FakeDeviceBackend device_;
  CpuBackend host_{1};
  StagedBackend staged_{device_, host_};
  CpuBackend cpu_{1};
  std::mt19937_64 rng_{42};
};

TEST_F(StagedBackendTest, MatrixAndRowOpsEqualTheCpuBackend) {
  const int n = 5, in = 64, out = 48;
  const OwnedWeight w(RandomD(rng_, size_t(out) * in), out, in, DType::kBF16);
  const OwnedWeight b(RandomD(rng_, out), 1, out, DType::kF32);
  const OwnedWeight g(RandomD(rng_, in), 1, in, DType::kF32);
  const std::vector<float> x = Random(rng_, size_t(n) * in);
  const int before = device_.fake_memory().copies_to_host;
  std::vector<float> want(size_t(n) * out), got(want.size(), -7.0f);
  cpu_.MatMul(x.data(), n, w.view(), b.view(), want.data());
  staged_.MatMul(x.data(), n, w.view(), b.view(), got.data());
  EXPECT_EQ(got, want);
  EXPECT_GT(device_.fake_memory().copies_to_host, before);  // the result came back

  std::vector<float> want_n(x.size()), got_n(x.size());
  cpu_.RmsNorm(x.data(), n, in, g.view(), 1e-5, want_n.data());
  staged_.RmsNorm(x.data(), n, in, g.view(), 1e-5, got_n.data());
  EXPECT_EQ(got_n, want_n);
  cpu_.LayerNorm(x.data(), n, in, g.view(), g.view(), 1e-5, want_n.data());
  staged_.LayerNorm(x.data(), n, in, g.view(), g.view(), 1e-5, got_n.data());
  EXPECT_EQ(got_n, want_n);

  const std::vector<int32_t> ids = {3, 0, 47};
  std::vector<float> want_e(size_t(3) * in), got_e(want_e.size());
  cpu_.Embedding(w.view(), ids.data(), 3, want_e.data());
  staged_.Embedding(w.view(), ids.data(), 3, got_e.data());
  EXPECT_EQ(got_e, want_e);
  EXPECT_TRUE(staged_.Synchronize().ok());
}

TEST_F(StagedBackendTest, InPlaceOpsEqualTheCpuBackendAndKeepThePadding) {
  // Two rows of 2 heads × 8, 20 floats apart: the 4 padding floats of row 0 must survive.
  const int n = 2, heads = 2, dh = 8;
  const int64_t stride = 20;
  std::vector<float> want = Random(rng_, size_t(stride) * n), got = want;
  const std::vector<int32_t> pos = {5, 900};
  cpu_.Rope(want.data(), n, stride, heads, dh, pos.data(),
            RopeSpec{10000.0, RopeStyle::kHalfSplit});
  staged_.Rope(got.data(), n, stride, heads, dh, pos.data(),
               RopeSpec{10000.0, RopeStyle::kHalfSplit});
  EXPECT_EQ(got, want);

  std::vector<float> a = Random(rng_, 100), a2 = a;
  const std::vector<float> c = Random(rng_, 100);
  cpu_.Gelu(a.data(), 100);
  staged_.Gelu(a2.data(), 100);
  EXPECT_EQ(a2, a);
  cpu_.Add(a.data(), c.data(), 100);
  staged_.Add(a2.data(), c.data(), 100);
  EXPECT_EQ(a2, a);
  std::vector<float> s(100), s2(100, 3.0f);
  cpu_.SwiGlu(a.data(), c.data(), 100, s.data());
  staged_.SwiGlu(a.data(), c.data(), 100, s2.data());
  EXPECT_EQ(s2, s);
  cpu_.GeGlu(a.data(), c.data(), 100, s.data());
  staged_.GeGlu(a.data(), c.data(), 100, s2.data());
  EXPECT_EQ(s2, s);
  cpu_.Scale(a.data(), 100, 3.5);
  staged_.Scale(a2.data(), 100, 3.5);
  EXPECT_EQ(a2, a);
  cpu_.SoftCap(a.data(), 100, 0.5);
  staged_.SoftCap(a2.data(), 100, 0.5);
  EXPECT_EQ(a2, a);
  EXPECT_TRUE(staged_.Synchronize().ok());
}

// The backward ops staged onto the device double (whose ops are the CPU backend's): the
// CPU backend's results bitwise.
TEST_F(StagedBackendTest, BackwardOpsStagedOntoTheDeviceEqualTheCpuBackends) {
  StagedBackend staged(device_, host_, &device_);
  const int n = 3, in = 40, out = 24;
  const OwnedWeight w(RandomD(rng_, size_t(out) * in), out, in, DType::kF32);
  const std::vector<float> dy = Random(rng_, size_t(n) * out);
  std::vector<float> want = Random(rng_, size_t(n) * in), got = want;  // accumulated into
  ASSERT_TRUE(cpu_.MatMulBackwardInput(dy.data(), n, w.view(), want.data()).ok());
  ASSERT_TRUE(staged.MatMulBackwardInput(dy.data(), n, w.view(), got.data()).ok());
  EXPECT_EQ(got, want);

  // Attention backward over PagedCall's paged cache; q and dout rows padded.
  const PagedCall call(rng_);
  const int tq = call.tq, tk = call.tk, h = call.h, hkv = call.hkv, dh = call.dh;
  const int64_t q_stride = call.q_stride;
  const std::vector<float> g = Random(rng_, size_t(tq) * q_stride);
  std::vector<float> o(size_t(tq) * q_stride), probs(size_t(h) * tq * tk);
  const AttentionArgs<float> f = call.Args(o.data(), probs.data(), nullptr);
  ASSERT_TRUE(cpu_.Attention(f).ok());
  struct Out {
    std::vector<float> dq, dk, dv, da, ds;
  };
  // The backward call writing into r (zeroed); without probs when `no_probs`.
  auto args = [&](Out& r, bool no_probs) {
    r.dq.assign(size_t(tq) * h * dh, 0.0f);
    r.dk.assign(size_t(tk) * hkv * dh, 0.0f);
    r.dv = r.dk;
    r.da.assign(probs.size(), 0.0f);
    r.ds = r.da;
    AttentionBackwardArgs<float> b = BackwardArgsOf(f);
    if (no_probs) b.probs = nullptr;
    b.dout = g.data();
    b.dout_stride = q_stride;
    b.dq = r.dq.data();
    b.dk = r.dk.data();
    b.dv = r.dv.data();
    b.dprobs = r.da.data();
    b.dscores = r.ds.data();
    return b;
  };
  Out a, b, c;
  ASSERT_TRUE(cpu_.AttentionBackward(args(a, false)).ok());
  ASSERT_TRUE(staged.AttentionBackward(args(b, false)).ok());
  EXPECT_EQ(b.dq, a.dq);
  EXPECT_EQ(b.dk, a.dk);
  EXPECT_EQ(b.dv, a.dv);
  EXPECT_EQ(b.da, a.da);
  EXPECT_EQ(b.ds, a.ds);

  // The reference's argument errors, and the backend stays usable.
  const absl::Status s = staged.AttentionBackward(args(c, true));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(staged.Synchronize().ok());
}

// Attention staged onto the device (the interpretability tape's forward): PagedCall (the
// padding of out kept), with probabilities and scores: the CPU backend's results bitwise,
// computed by the device; a bf16 cache's call runs on the host instead; a call with a row
// that sees no key is refused as the CPU backend refuses it.
TEST_F(StagedBackendTest, AttentionRunsOnTheDeviceAndEqualsTheCpuBackend) {
  const PagedCall call(rng_);
  const int tq = call.tq, tk = call.tk, h = call.h, dh = call.dh;
  const int64_t q_stride = call.q_stride;
  struct Result {
    std::vector<float> out, probs, scores;
  };
  auto run = [&](Backend<float>& be, Result& r) {
    r.out.assign(size_t(tq) * q_stride, -5.0f);  // the padding must stay -5
    r.probs.assign(size_t(h) * tq * tk, -6.0f);
    r.scores.assign(r.probs.size(), -7.0f);
    return be.Attention(call.Args(r.out.data(), r.probs.data(), r.scores.data()));
  };
  Result want, got;
  ASSERT_TRUE(run(cpu_, want).ok());
  const int copies = device_.fake_memory().copies_to_host;
  ASSERT_TRUE(run(staged_, got).ok());
  EXPECT_EQ(device_.attention_calls.load(), 1);
  EXPECT_GE(device_.fake_memory().copies_to_host - copies, 3);  // out, probs, scores
  EXPECT_EQ(got.out, want.out);
  EXPECT_EQ(got.probs, want.probs);
  EXPECT_EQ(got.scores, want.scores);
  EXPECT_EQ(got.out[h * dh], -5.0f);
  // row 0 (document 1) against key 0 (document 0): masked
  EXPECT_EQ(got.scores[0], -std::numeric_limits<float>::infinity());

  // A bf16 cache: the host backend's call.
  std::vector<uint16_t> kb(call.kc.size()), vb(call.vc.size());
  for (size_t e = 0; e < kb.size(); ++e)
    kb[e] = F32ToBF16(call.kc[e]), vb[e] = F32ToBF16(call.vc[e]);
  std::vector<float> out_cpu(size_t(tq) * q_stride), out_staged(out_cpu.size());
  AttentionArgs<float> b = call.Args(out_cpu.data(), nullptr, nullptr);
  b.kv.k = kb.data();
  b.kv.v = vb.data();
  b.kv.dtype = KvDtype::kBF16;
  ASSERT_TRUE(cpu_.Attention(b).ok());
  b.out = out_staged.data();
  ASSERT_TRUE(staged_.Attention(b).ok());
  EXPECT_EQ(out_staged, out_cpu);
  EXPECT_EQ(device_.attention_calls.load(), 1);

  // Row 0 at offset 0 with keys of another document only: refused, and still usable.
  const std::vector<int32_t> apart = {1, 0, 0, 0, 0, 0, 0};
  b = call.Args(out_staged.data(), nullptr, nullptr);
  b.query_offset = 0;
  b.num_keys = 4;
  b.q_doc_ids = apart.data();
  const absl::Status s = staged_.Attention(b);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(staged_.Synchronize().ok());
}

// A device whose allocations fail: the op does nothing and Synchronize says why.
class NoMemory final : public Memory {
 public:
  std::string_view name() const override { return "full"; }
  bool host_accessible() const override { return false; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    return absl::ResourceExhaustedError(absl::StrCat("no room for ", bytes, " bytes"));
  }
  void Free(void*) override {}
  absl::Status CopyFromHost(void*, const void*, size_t) override { return absl::OkStatus(); }
  absl::Status CopyToHost(void*, const void*, size_t) override { return absl::OkStatus(); }
  absl::Status Copy(void*, const void*, size_t) override { return absl::OkStatus(); }
  absl::Status Memset(void*, int, size_t) override { return absl::OkStatus(); }
};

class FullDevice final : public Backend<float> {
 public:
  std::string_view name() const override { return "full"; }
  Memory& memory() override { return memory_; }
  void MatMul(const float*, int, const WeightView&, const WeightView&, float*) override {
    ADD_FAILURE() << "ran without staged inputs";
  }
  void Embedding(const WeightView&, const int32_t*, int, float*) override {}
  void RmsNorm(const float*, int, int, const WeightView&, double, float*) override {}
  void LayerNorm(const float*, int, int, const WeightView&, const WeightView&, double,
                 float*) override {}
  void Rope(float*, int, int64_t, int, int, const int32_t*, const RopeSpec&) override {}
  void Gelu(float*, int64_t) override {}
  void SwiGlu(const float*, const float*, int64_t, float*) override {}
  void GeGlu(const float*, const float*, int64_t, float*) override {}
  void Scale(float*, int64_t, double) override {}
  void SoftCap(float*, int64_t, double) override {}
  void Add(float*, const float*, int64_t) override {}
  void StoreKv(const float*, const float*, int, int64_t, int64_t, const int64_t*, void*, void*,
               int64_t, KvDtype) override {}
  absl::Status Attention(const AttentionArgs<float>&) override { return absl::OkStatus(); }

 private:
  NoMemory memory_;
};

TEST(StagedBackendErrors, FailedDeviceAllocationIsReportedAndOutputsAreLeftAlone) {
  FullDevice device;
  CpuBackend host(1);
  StagedBackend staged(device, host);
  std::mt19937_64 rng(1);
  const OwnedWeight w(RandomD(rng, 16 * 8), 16, 8, DType::kF32);
  const std::vector<float> x(8, 1.0f);
  std::vector<float> y(16, -1.0f);
  staged.MatMul(x.data(), 1, w.view(), WeightView{}, y.data());
  EXPECT_EQ(y, std::vector<float>(16, -1.0f));
  const absl::Status s = staged.Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(staged.name(), "staged:full");
}

}  // namespace
}  // namespace kvlens::kernels
