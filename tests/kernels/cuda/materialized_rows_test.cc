// CudaBackend::AttentionBatch over materialised calls of one query row each (the engine's
// last-query reruns for streamed attention rows, one a request and layer): one launch for
// a run of them (MaterializedRowsKernel, one upload of their parameters and tables), each
// call's output, probabilities and scores the very bits of the call run alone, whatever
// its cache, keys, offset, window, soft cap, head size and maps; a run ends at another
// cache type or head count. Suites named CudaBackend* need a device (ctest label `gpu`;
// they skip with the reason without one).
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"

namespace kvlens::kernels::cuda {
namespace {

// One call's device buffers: its inputs (parity::UploadAttnCall) and NaN-filled maps, the
// probabilities asked for and the scores too where s.want_maps.
struct RowCall {
  parity::AttnShape shape;
  parity::AttnInputs in;
  parity::DeviceAttnCall call;
  DeviceBuffer probs, scores;
};

RowCall MakeRowCall(const parity::AttnShape& s, std::mt19937_64& rng) {
  RowCall r{s, parity::MakeAttnInputs(s, rng), {}, {}, {}};
  auto call = parity::UploadAttnCall(s, r.in);
  EXPECT_TRUE(call.ok()) << call.status();
  if (call.ok()) r.call = *std::move(call);
  const std::vector<double> nan(size_t(s.heads) * s.tk, parity::kNaN);
  auto probs = parity::ToDevice(nan);
  auto scores = parity::ToDevice(nan);
  EXPECT_TRUE(probs.ok() && scores.ok());
  if (probs.ok()) r.probs = *std::move(probs);
  if (scores.ok()) r.scores = *std::move(scores);
  r.call.args.probs = r.probs.as<float>();  // want_probs_only, or want_maps: both
  if (s.want_maps) r.call.args.scores = r.scores.as<float>();
  return r;
}

// What a call wrote: its output rows, probabilities and scores (NaN where not written).
std::vector<double> Written(CudaBackend& b, const RowCall& r) {
  std::vector<double> all;
  for (const DeviceBuffer* d : {&r.call.out, &r.probs, &r.scores}) {
    const size_t n = d == &r.call.out ? r.in.qs.size() : size_t(r.shape.heads) * r.shape.tk;
    auto h = parity::FromDevice(b, *d, n);
    EXPECT_TRUE(h.ok()) << h.status();
    if (h.ok()) all.insert(all.end(), h->begin(), h->end());
  }
  return all;
}

// The calls of `shapes` run alone (Attention) and together (AttentionBatch), each on its
// own copy of the inputs: the same bits. Returns the index uploads the batch made (copied,
// or reusing an equal upload's copy).
int64_t ExpectBatchGivesTheBitsOfEachAlone(CudaBackend& b,
                                           const std::vector<parity::AttnShape>& shapes) {
  std::vector<RowCall> alone, together;
  std::mt19937_64 rng(5);
  for (const parity::AttnShape& s : shapes) alone.push_back(MakeRowCall(s, rng));
  rng.seed(5);
  for (const parity::AttnShape& s : shapes) together.push_back(MakeRowCall(s, rng));
  for (RowCall& r : alone) EXPECT_TRUE(b.Attention(r.call.args).ok()) << r.shape.label;
  std::vector<AttentionArgs<float>> args;
  for (RowCall& r : together) args.push_back(r.call.args);
  auto uploads_so_far = [&b] {
    const CudaBackend::IndexUploadStats u = b.index_upload_stats();
    return u.copies + u.reused;
  };
  const int64_t uploads_before = uploads_so_far();
  int failed = -1;
  const absl::Status s = b.AttentionBatch(args, &failed);
  EXPECT_TRUE(s.ok()) << s << " (call " << failed << ")";
  EXPECT_TRUE(b.Synchronize().ok());
  const int64_t uploads = uploads_so_far() - uploads_before;
  for (size_t c = 0; c < shapes.size(); ++c) {
    SCOPED_TRACE(parity::ShapeName("materialised row", shapes[c]));
    const std::vector<double> want = Written(b, alone[c]);
    const std::vector<double> got = Written(b, together[c]);
    EXPECT_EQ(got.size(), want.size());
    for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
      // Both NaN (never written) or the same bits.
      const bool same = want[i] != want[i] ? got[i] != got[i] : got[i] == want[i];
      EXPECT_TRUE(same) << "element " << i << ": " << got[i] << " against " << want[i];
      if (!same) break;
    }
  }
  return uploads;
}

// A last query row of `tk` keys (its offset tk − 1), H = 6.
parity::AttnShape LastRow(const char* label, int tk, int kv_heads, int dh) {
  return parity::AttnShape{.label = label,
                           .tq = 1,
                           .tk = tk,
                           .heads = 6,
                           .kv_heads = kv_heads,
                           .dh = dh,
                           .offset = tk - 1,
                           .want_maps = false,
                           .want_probs_only = true};
}

TEST_F(CudaBackendTest, MaterializedRowsInOneLaunchGiveTheBitsOfEachAlone) {
  for (bool bf16_cache : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "bf16 cache " << bf16_cache);
    std::vector<parity::AttnShape> shapes = {
        LastRow("probabilities", 37, 2, 64),
        LastRow("grouped 6/3, blocks of 12", 300, 3, 64),
        LastRow("head size 128, scores too", 129, 6, 128),
        LastRow("a window", 200, 2, 64),
        LastRow("soft-capped", 90, 2, 64),
        LastRow("an earlier row (offset 40 of 90 keys)", 90, 2, 64),
    };
    shapes[1].block_size = 12;
    shapes[2].want_maps = true;
    shapes[3].window = 64;
    shapes[4].softcap = 30.0;
    shapes[5].offset = 40;
    for (parity::AttnShape& s : shapes) s.bf16_cache = bf16_cache;
    // One launch: one upload of the parameters and every table.
    EXPECT_EQ(ExpectBatchGivesTheBitsOfEachAlone(*backend_, shapes), 1);
  }
}

TEST_F(CudaBackendTest, MaterializedRowRunsEndAtAnotherCacheTypeOrHeadCount) {
  std::vector<parity::AttnShape> shapes = {
      LastRow("fp32", 40, 2, 64),    LastRow("fp32", 70, 2, 64), LastRow("bf16", 50, 2, 64),
      LastRow("4 heads", 60, 2, 64), LastRow("fp32", 30, 2, 64),
  };
  shapes[2].bf16_cache = true;
  shapes[3].heads = 4;
  // Runs [0, 2), [2], [3], [4]: the lone calls take Attention's own upload each.
  EXPECT_EQ(ExpectBatchGivesTheBitsOfEachAlone(*backend_, shapes), 4);
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_HAVE_CUDA
