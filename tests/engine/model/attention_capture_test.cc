// Attention captures that ask for less than every layer's full map (AttentionCapture's
// layers and last_query_only: what the engine streams as attention rows), on stories260K,
// on the CPU backend and on a "device" whose memory the host cannot read: the chosen
// layers' last query rows equal those rows of the full maps, the other layers stay empty,
// the logits are bit for bit those of the step without a capture, and on the device the
// rows of every chosen layer come out in one copy, where full maps take one a layer.
#include <cmath>
#include <vector>

#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/engine/random_tokens.h"
#include "tests/engine/stories_model_test.h"
#include "tests/kernels/fake_device_backend.h"

namespace kvlens {
namespace {

class AttentionCaptureTest : public testing::StoriesModelTest {
 protected:
  struct Captured {
    absl::Status status;
    std::vector<std::vector<float>> probs;
    std::vector<float> logits;
    int copies_out = 0;  // the fake device's copies to the host during the captured Forward
  };

  // Prefills tokens [0, kCached) without a capture, then runs the next `tq` tokens with
  // `capture` (null: none) on a fresh NaN-filled cache in the backend's memory.
  Captured Run(kernels::Backend<float>& be, int tq, AttentionCapture<float>* capture,
               testing::FakeDeviceMemory* counted = nullptr) {
    Captured r;
    const ModelConfig& c = model_->config;
    auto cache = KvCacheStorage<float>::Create(be.memory(), c.num_layers, 8, 4, c.kv_dim(), true);
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return r;
    const std::vector<int32_t> tokens = testing::RandomTokens(kCached + tq, 9, c.vocab_size);
    const std::vector<int32_t> table = {5, 1, 6, 2, 7, 3};
    Transformer<float> tr(*model_, be);
    ForwardOutput<float> out;
    BatchEntry prefix{absl::MakeConstSpan(tokens).first(kCached), 0, table};
    EXPECT_TRUE(tr.Forward({&prefix, 1}, *cache, out).ok());
    BatchEntry next{absl::MakeConstSpan(tokens).subspan(kCached), kCached, table};
    const int before = counted != nullptr ? counted->copies_to_host.load() : 0;
    r.status = tr.Forward({&next, 1}, *cache, out, capture);
    if (counted != nullptr) r.copies_out = counted->copies_to_host - before;
    if (capture != nullptr) r.probs = capture->probs;
    r.logits = out.logits;
    return r;
  }

  static constexpr int kCached = 9;
};

TEST_F(AttentionCaptureTest, LastQueryRowsOfChosenLayersEqualThoseOfTheFullMaps) {
  const int L = model_->config.num_layers, H = model_->config.num_heads;
  ASSERT_GE(L, 4);
  kernels::CpuBackend cpu(1);
  testing::FakeDeviceBackend device(1);
  for (kernels::Backend<float>* be : {static_cast<kernels::Backend<float>*>(&cpu),
                                      static_cast<kernels::Backend<float>*>(&device)}) {
    for (int tq : {1, 5}) {
      SCOPED_TRACE(::testing::Message() << be->name() << ", " << tq << " new tokens");
      const int tk = kCached + tq;
      AttentionCapture<float> full;
      const Captured all = Run(*be, tq, &full);
      ASSERT_TRUE(all.status.ok()) << all.status;
      AttentionCapture<float> chosen;
      chosen.layers = {3, 1, 3};
      chosen.last_query_only = true;
      const Captured last = Run(*be, tq, &chosen);
      ASSERT_TRUE(last.status.ok()) << last.status;
      const Captured none = Run(*be, tq, nullptr);
      ASSERT_TRUE(none.status.ok()) << none.status;
      ASSERT_FALSE(none.logits.empty());
      EXPECT_EQ(last.logits, none.logits);  // the rows are read beside the step, not in it
      ASSERT_EQ(last.probs.size(), size_t(L));
      for (int l = 0; l < L; ++l) {
        ASSERT_EQ(all.probs[l].size(), size_t(H) * tq * tk) << "layer " << l;
        if (l != 1 && l != 3) {
          EXPECT_TRUE(last.probs[l].empty()) << "layer " << l;
          continue;
        }
        ASSERT_EQ(last.probs[l].size(), size_t(H) * tk) << "layer " << l;
        for (int h = 0; h < H; ++h) {
          double sum = 0.0;
          for (int k = 0; k < tk; ++k) {
            const float want = all.probs[l][(size_t(h) * tq + tq - 1) * tk + k];
            const float got = last.probs[l][size_t(h) * tk + k];
            ASSERT_NEAR(got, want, 1e-6) << "layer " << l << ", head " << h << ", key " << k;
            sum += got;
          }
          EXPECT_NEAR(sum, 1.0, 1e-5) << "layer " << l << ", head " << h;  // a softmax row
        }
      }
    }
  }
}

// Copies to the host during the captured step, counted against the same step without a
// capture: full maps add one a layer, the last rows of two layers one in all, whether the
// step has one query or five.
TEST_F(AttentionCaptureTest, OnADeviceTheLastRowsOfAllChosenLayersComeOutInOneCopy) {
  testing::FakeDeviceBackend device(1);
  const int L = model_->config.num_layers;
  for (int tq : {1, 5}) {
    SCOPED_TRACE(::testing::Message() << tq << " new tokens");
    const Captured none = Run(device, tq, nullptr, &device.fake_memory());
    ASSERT_TRUE(none.status.ok()) << none.status;
    AttentionCapture<float> full;
    const Captured all = Run(device, tq, &full, &device.fake_memory());
    ASSERT_TRUE(all.status.ok()) << all.status;
    EXPECT_EQ(all.copies_out, none.copies_out + L);
    AttentionCapture<float> chosen;
    chosen.layers = {0, 2};
    chosen.last_query_only = true;
    const Captured last = Run(device, tq, &chosen, &device.fake_memory());
    ASSERT_TRUE(last.status.ok()) << last.status;
    EXPECT_EQ(last.copies_out, none.copies_out + 1);
  }
}

// Three sequences in one step, each captured its own way (the first's last query rows of
// layer 2, the second's full maps, the third's last query rows of layers 1 and 2, after the
// first's on a device), against each alone with the same capture: the same probabilities
// and logits (within 1e-6 and 1e-5: one batched attention call against three).
TEST_F(AttentionCaptureTest, CapturesOfThreeEntriesInOneStepEqualEachAlone) {
  const ModelConfig& c = model_->config;
  const int L = c.num_layers;
  const std::vector<int32_t> tokens[3] = {testing::RandomTokens(7, 3, c.vocab_size),
                                          testing::RandomTokens(4, 4, c.vocab_size),
                                          testing::RandomTokens(6, 5, c.vocab_size)};
  const std::vector<int32_t> tables[3] = {{3, 0}, {5}, {1, 7}};
  auto capture = [](int entry, int kind) {
    AttentionCapture<float> a;
    a.entry = entry;
    if (kind != 1) {
      a.layers = kind == 0 ? std::vector<int>{2} : std::vector<int>{2, 1};
      a.last_query_only = true;
    }
    return a;
  };
  kernels::CpuBackend cpu(1);
  testing::FakeDeviceBackend device(1);
  for (kernels::Backend<float>* be : {static_cast<kernels::Backend<float>*>(&cpu),
                                      static_cast<kernels::Backend<float>*>(&device)}) {
    SCOPED_TRACE(be->name());
    auto forward = [&](std::vector<BatchEntry> batch, std::vector<AttentionCapture<float>>& caps,
                       ForwardOutput<float>& out) {
      auto cache = KvCacheStorage<float>::Create(be->memory(), L, 8, 4, c.kv_dim(), true);
      EXPECT_TRUE(cache.ok()) << cache.status();
      Transformer<float> tr(*model_, *be);
      return tr.Forward(batch, *cache, out, absl::MakeSpan(caps));
    };
    std::vector<AttentionCapture<float>> all = {capture(0, 0), capture(1, 1), capture(2, 2)};
    ForwardOutput<float> out;
    ASSERT_TRUE(
        forward({{tokens[0], 0, tables[0]}, {tokens[1], 0, tables[1]}, {tokens[2], 0, tables[2]}},
                all, out)
            .ok());
    for (int i = 0; i < 3; ++i) {
      std::vector<AttentionCapture<float>> one = {capture(0, i)};
      ForwardOutput<float> alone;
      ASSERT_TRUE(forward({{tokens[i], 0, tables[i]}}, one, alone).ok());
      const int V = c.vocab_size;
      for (int v = 0; v < V; ++v) {
        ASSERT_NEAR(out.logits[size_t(out.logits_row[i]) * V + v], alone.logits[v], 1e-5)
            << "entry " << i << ", logit " << v;
      }
      for (int l = 0; l < L; ++l) {
        ASSERT_EQ(all[i].probs[l].size(), one[0].probs[l].size())
            << "entry " << i << " layer " << l;
        const bool wanted = i == 1 || l == 2 || (i == 2 && l == 1);
        EXPECT_EQ(all[i].probs[l].empty(), !wanted) << "entry " << i << " layer " << l;
        for (size_t k = 0; k < one[0].probs[l].size(); ++k) {
          ASSERT_NEAR(all[i].probs[l][k], one[0].probs[l][k], 1e-6)
              << "entry " << i << ", layer " << l << ", " << k;
        }
      }
    }
  }
}

TEST_F(AttentionCaptureTest, RejectsALayerOutsideTheModel) {
  kernels::CpuBackend cpu(1);
  const int L = model_->config.num_layers;
  AttentionCapture<float> capture;
  capture.layers = {0, L};
  capture.last_query_only = true;
  const Captured r = Run(cpu, 1, &capture);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status.message().find("layer " + std::to_string(L)), std::string::npos) << r.status;
}

// An entry outside the batch, and one entry captured twice.
TEST_F(AttentionCaptureTest, RejectsAnEntryOutsideTheBatchOrCapturedTwice) {
  kernels::CpuBackend cpu(1);
  const ModelConfig& c = model_->config;
  KvCacheStorage<float> cache(c.num_layers, 4, 4, c.kv_dim(), true);
  Transformer<float> tr(*model_, cpu);
  const std::vector<int32_t> tokens = {1, 2, 3}, table = {0};
  BatchEntry e{tokens, 0, table};
  ForwardOutput<float> out;
  std::vector<AttentionCapture<float>> caps(1);
  caps[0].entry = 1;
  absl::Status s = tr.Forward({&e, 1}, cache, out, absl::MakeSpan(caps));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("entry 1 outside the batch's [0, 1)"), std::string::npos) << s;
  caps.assign(2, {});
  s = tr.Forward({&e, 1}, cache, out, absl::MakeSpan(caps));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("entry 0 captured twice"), std::string::npos) << s;
}

}  // namespace
}  // namespace kvlens
