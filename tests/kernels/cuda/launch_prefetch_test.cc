// The prefetches a programmatically launched kernel makes before it waits for the previous
// grid (launch.cuh, PrefetchL2): the matvec's first weight rows of each block (matvec.cu)
// and split-KV's first K and V rows of each warp (split_kv_common.cuh, PrefetchFirstStep).
// They must change no result, and must ask for memory the kernel then reads: the CUDA
// emulator faults a prefetch outside device memory. The matvec's weights here are
// allocated to the byte, so a row past a product's last one, or a row's start read past
// its end, fails the test there. The device suite is CudaBackend*, labelled `gpu`
// (kernels/cuda/gpu_test_labels.cmake.in).
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/matvec.h"
#include "kernels/dtype.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"
#include "tests/kernels/cuda/cuda_parity_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels::cuda {
namespace {

// bf16 weights [rows, in] in an allocation of exactly their bytes (DeviceBuffer::Reserve
// would leave half as much again after them), and the values they hold.
struct ExactWeight {
  DeviceBuffer buffer;
  std::vector<double> values;  // as rounded to bf16
};

ExactWeight MakeWeight(std::mt19937_64& rng, int64_t rows, int64_t in) {
  ExactWeight w;
  const std::vector<double> v = kernels::testing::RandomVector(rng, static_cast<size_t>(rows * in));
  std::vector<uint16_t> bits(v.size());
  w.values.resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    bits[i] = F32ToBF16(static_cast<float>(v[i]));
    w.values[i] = BF16ToF32(bits[i]);
  }
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, bits.size() * sizeof(uint16_t)), cudaSuccess);
  w.buffer = DeviceBuffer::Adopt(p, bits.size() * sizeof(uint16_t));
  EXPECT_TRUE(parity::CopyToDeviceAndWait(p, bits.data(), bits.size() * sizeof(uint16_t)).ok());
  return w;
}

class CudaBackendPrefetchTest : public CudaBackendTest {
 protected:
  void TearDown() override {
    if (backend_ == nullptr) return;
    backend_->SetProgrammaticLaunches(false);
    backend_->SetLaunchPrefetches(true);
  }
};

// Plain products (two of one x, 5 and 7 rows: units left partial) and gated ones (5
// outputs), with and without the fused norm, for 1 to 4 rows of x, at widths under and
// over the 4096 values a row that a block prefetches (517: the unvectorized loop). The same
// bits with the prefetch as without, and both within float rounding of a double product
// of the same bf16 weights (so that neither run is left unwritten).
TEST_F(CudaBackendPrefetchTest, PrefetchedProductsGiveTheSameBits) {
  std::mt19937_64 rng(53);
  for (int64_t in : {517, 520, 4104}) {
    const ExactWeight a = MakeWeight(rng, 5, in), b = MakeWeight(rng, 7, in);
    const std::vector<double> norm_values = kernels::testing::RandomVector(rng, in, 0.5, 1.5);
    auto norm_weight = parity::ToDevice(norm_values);
    ASSERT_TRUE(norm_weight.ok());
    for (int n = 1; n <= kMatVecMaxRows; ++n) {
      const std::vector<double> x = kernels::testing::RandomVector(rng, size_t(n) * in);
      auto dx = parity::ToDevice(x);
      ASSERT_TRUE(dx.ok());
      for (bool gated : {false, true}) {
        for (bool norm : {false, true}) {
          SCOPED_TRACE(::testing::Message()
                       << "in " << in << ", n " << n << ", gated " << gated << ", norm " << norm);
          const MatVecNorm fused{norm ? norm_weight->get() : nullptr, DType::kF32, 1e-5f};
          // y for a product of `rows` outputs, then y of the other (plain only).
          std::vector<std::vector<double>> runs;
          for (bool prefetch : {false, true}) {
            backend_->SetProgrammaticLaunches(prefetch);
            auto ya = parity::ToDevice(std::vector<double>(size_t(n) * 5, parity::kNaN));
            auto yb = parity::ToDevice(std::vector<double>(size_t(n) * 7, parity::kNaN));
            ASSERT_TRUE(ya.ok() && yb.ok());
            absl::Status s;
            if (gated) {
              s = LaunchMatVecGated(dx->as<float>(), n, in, fused, a.buffer.get(), a.buffer.get(),
                                    DType::kBF16, 5, GateActivation::kSilu, ya->as<float>(),
                                    nullptr);
            } else {
              const MatVecProduct products[] = {
                  {a.buffer.get(), 5, nullptr, DType::kF32, ya->as<float>()},
                  {b.buffer.get(), 7, nullptr, DType::kF32, yb->as<float>()}};
              s = LaunchMatVec(dx->as<float>(), n, in, fused, products, DType::kBF16, nullptr);
            }
            ASSERT_TRUE(s.ok()) << s;
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            auto ha = parity::FromDevice(*backend_, *ya, size_t(n) * 5);
            auto hb = parity::FromDevice(*backend_, *yb, size_t(n) * 7);
            ASSERT_TRUE(ha.ok() && hb.ok());
            std::vector<double> y = *ha;
            if (!gated) y.insert(y.end(), hb->begin(), hb->end());
            runs.push_back(y);
          }
          ASSERT_EQ(runs[0].size(), runs[1].size());
          for (size_t i = 0; i < runs[0].size(); ++i) {
            ASSERT_TRUE(std::isfinite(runs[1][i])) << "value " << i;
            ASSERT_EQ(runs[1][i], runs[0][i]) << "value " << i;
          }
          // The reference: x (normalized) · W in double, silu(g) · u for the gated ones.
          for (int r = 0; r < n; ++r) {
            std::vector<double> xr(x.begin() + r * in, x.begin() + (r + 1) * in);
            if (norm) {
              double sq = 0.0;
              for (double v : xr) sq += v * v;
              const double inv = 1.0 / std::sqrt(sq / double(in) + 1e-5);
              for (int64_t i = 0; i < in; ++i) xr[i] *= inv * norm_values[i];
            }
            auto dot = [&](const ExactWeight& w, int64_t o) {
              double sum = 0.0;
              for (int64_t i = 0; i < in; ++i) sum += xr[i] * w.values[o * in + i];
              return sum;
            };
            for (int64_t o = 0; o < 5; ++o) {
              const double g = dot(a, o);
              const double want = gated ? g / (1.0 + std::exp(-g)) * g : g;
              EXPECT_NEAR(runs[1][r * 5 + o], want, 1e-4 * (1.0 + std::fabs(want)))
                  << "row " << r << ", output " << o;
            }
            for (int64_t o = 0; !gated && o < 7; ++o) {
              const double want = dot(b, o);
              EXPECT_NEAR(runs[1][n * 5 + r * 7 + o], want, 1e-4 * (1.0 + std::fabs(want)))
                  << "row " << r << ", output " << o << " of the second product";
            }
          }
        }
      }
    }
  }
}

// Split-KV launched programmatically, on CUDA cores and tensor cores, over fp32 and bf16
// caches (paged, NaN-filled unused rows, shuffled block tables): batched decode rows of
// unequal lengths (one call with documents), a long decode call at head size 128, blocks
// of 12 rows (steps across blocks: not prefetched), and rows in a sliding window, within
// the parity tolerance of the double reference, with no prefetch outside device memory.
TEST_F(CudaBackendPrefetchTest, PrefetchingSplitKvWithinTolerance) {
  CudaBackend& b = *backend_;
  b.SetProgrammaticLaunches(true);
  std::mt19937_64 rng(59);
  std::vector<parity::ParityResult> results;
  for (bool tensor_cores : {false, true}) {
    b.SetSplitKvTensorCores(tensor_cores);
    for (bool bf16_cache : {false, true}) {
      results.push_back(parity::AttentionBatchSplitKvCase(b, rng, bf16_cache));
      for (int block_size : {16, 12}) {
        const parity::AttnShape s{.label = "prefetched split-KV",
                                  .tq = 2,
                                  .tk = 700,
                                  .heads = 8,
                                  .kv_heads = 2,
                                  .dh = 128,
                                  .offset = 698,
                                  .block_size = block_size,
                                  .kv_pad = 0,
                                  .bf16_cache = bf16_cache};
        for (parity::ParityResult& r : parity::AttentionCase(b, rng, s)) {
          results.push_back(std::move(r));
        }
      }
    }
    results.push_back(parity::AttentionBatchWindowCase(b, rng));
  }
  b.SetSplitKvTensorCores(false);
  for (const parity::ParityResult& r : results) {
    EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
  }
  EXPECT_GE(results.size(), 10u);
}

// The prefetches come with programmatic launches only, and SetLaunchPrefetches(false)
// drops them while the launches stay programmatic (so that one run can time the two
// apart). Counted by the CUDA emulator; a GPU counts none. One row of x through products
// of 5 and 7 bf16 rows of 517 values: units of 2 rows, so 3 + 4 blocks, each prefetching
// both rows of its first unit (the 5-row product's last unit its one row twice), 1034
// bytes a row in 128-byte lines, 9 of them: 7 · 2 · 9 = 126 prefetches a launch.
TEST_F(CudaBackendPrefetchTest, PrefetchesOnlyWhenLaunchedProgrammaticallyAndSwitchedOn) {
#ifndef KVLENS_CUDA_EMULATOR
  GTEST_SKIP() << "counts the CUDA emulator's prefetch instructions";
#else
  CudaBackend& b = *backend_;
  std::mt19937_64 rng(61);
  const int64_t in = 517;
  const ExactWeight wa = MakeWeight(rng, 5, in), wb = MakeWeight(rng, 7, in);
  auto x = parity::ToDevice(kernels::testing::RandomVector(rng, in));
  auto ya = parity::ToDevice(std::vector<double>(5));
  auto yb = parity::ToDevice(std::vector<double>(7));
  ASSERT_TRUE(x.ok() && ya.ok() && yb.ok());
  const MatVecProduct products[] = {{wa.buffer.get(), 5, nullptr, DType::kF32, ya->as<float>()},
                                    {wb.buffer.get(), 7, nullptr, DType::kF32, yb->as<float>()}};
  const parity::AttnShape decode{.label = "split-KV, counting prefetches",
                                 .tq = 1,
                                 .tk = 300,
                                 .heads = 4,
                                 .kv_heads = 2,
                                 .dh = 64,
                                 .offset = 299,
                                 .block_size = 16,
                                 .kv_pad = 0,
                                 .bf16_cache = false};
  struct Mode {
    bool programmatic, prefetches;
    int64_t matvec, attention;  // prefetches counted
  };
  std::vector<Mode> modes = {{false, true}, {true, false}, {true, true}};
  for (Mode& m : modes) {
    b.SetProgrammaticLaunches(m.programmatic);
    b.SetLaunchPrefetches(m.prefetches);
    int64_t before = ::kvlens_emu::PrefetchesIssued();
    ASSERT_TRUE(
        LaunchMatVec(x->as<float>(), 1, in, MatVecNorm{}, products, DType::kBF16, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    m.matvec = ::kvlens_emu::PrefetchesIssued() - before;
    before = ::kvlens_emu::PrefetchesIssued();
    for (const parity::ParityResult& r : parity::AttentionCase(b, rng, decode)) {
      EXPECT_TRUE(r.pass()) << r.name << ": " << r.status << ", error " << r.err << " > " << r.tol;
    }
    m.attention = ::kvlens_emu::PrefetchesIssued() - before;
  }
  EXPECT_EQ(modes[0].matvec, 0) << "without programmatic launches";
  EXPECT_EQ(modes[0].attention, 0) << "without programmatic launches";
  EXPECT_EQ(modes[1].matvec, 0) << "prefetches switched off";
  EXPECT_EQ(modes[1].attention, 0) << "prefetches switched off";
  EXPECT_EQ(modes[2].matvec, 7 * 2 * 9);
  EXPECT_GT(modes[2].attention, 0);
#endif
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(CudaBackendPrefetchTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
