// What --attention-tune times for a model (engine/attention_tune_shape.h): its heads, head
// size and soft cap, and prompts and contexts capped by the model's context and a step's
// prefill.
#include "engine/attention_tune_shape.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvlens {
namespace {

TEST(AttentionTuneShapeTest, TakesTheModelsHeadsAndCapsTheLengths) {
  ModelConfig c;
  c.num_heads = 16;
  c.num_kv_heads = 8;
  c.head_dim = 256;
  c.max_seq_len = 8192;
  c.attention_softcap = 50.0;  // Gemma 2 9B
  kernels::AttentionTuneShape z = AttentionTuneShapeFor(c, kernels::KvDtype::kBF16, 16, 4096, 64);
  EXPECT_EQ(z.num_heads, 16);
  EXPECT_EQ(z.num_kv_heads, 8);
  EXPECT_EQ(z.head_dim, 256);
  EXPECT_EQ(z.softcap, 50.0);
  EXPECT_EQ(z.cache_dtype, kernels::KvDtype::kBF16);
  EXPECT_EQ(z.block_size, 16);
  EXPECT_EQ(z.prefill_tokens, 2048);
  EXPECT_EQ(z.decode_keys, 4096);
  // One sequence, and a step of --max-running 64 under load.
  EXPECT_EQ(z.decode_batches, (std::vector<int>{1, 64}));
  EXPECT_TRUE(z.Validate().ok());
  // A step's prefill of 512 tokens, a context of 1024 (GPT-2's).
  c.max_seq_len = 1024;
  z = AttentionTuneShapeFor(c, kernels::KvDtype::kActivation, 32, 512, 1000);
  EXPECT_EQ(z.prefill_tokens, 512);
  // --max-running 1000: the batch is capped at kMaxDecodeBatch.
  EXPECT_EQ(z.decode_batches, (std::vector<int>{1, 256}));
  EXPECT_EQ(z.decode_keys, 1024);
  EXPECT_EQ(z.block_size, 32);
  z = AttentionTuneShapeFor(c, kernels::KvDtype::kActivation, 16, 1 << 20, 1000);
  EXPECT_EQ(z.prefill_tokens, 1024);
  // Steps of 100 tokens decode at most 100 sequences; the CLI's one sequence is timed once.
  EXPECT_EQ(AttentionTuneShapeFor(c, kernels::KvDtype::kActivation, 16, 100, 1000).decode_batches,
            (std::vector<int>{1, 100}));
  EXPECT_EQ(AttentionTuneShapeFor(c, kernels::KvDtype::kActivation, 16, 512, 1).decode_batches,
            (std::vector<int>{1}));
}

}  // namespace
}  // namespace kvlens
