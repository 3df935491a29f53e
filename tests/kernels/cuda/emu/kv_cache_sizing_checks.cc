// SizeKvCacheForUtilization on the CUDA backend, over the emulator, whose device memory
// use is exact (cudaMemGetInfo counts every cudaMalloc; a GPU's also counts other
// processes, so this runs in cuda_emu_tests only). The server's promise: once the cache is
// allocated, no step of a loaded engine needs more device memory than the profile steps
// measured (KvCacheSizing::model_and_step). Checked by serving what asks most of the
// backend's workspaces (tests/engine/kv_cache/kv_cache_sizing_test.cc checks the
// arithmetic on the device path's test double, which has none of them): --max-running
// sequences decoding at a temperature with a logit bias, penalties and the top
// log-probabilities, one of them near max_seq_len and the rest short, on balanced
// split-KV launches (SetSplitKvBalanced: the most partials, for a long row beside short
// ones), the long one's prompt scored with its top log-probabilities (steps of
// max_batch_tokens rows of logits, the largest activations, so that what the profile
// measured of them leaves no margin to hide a workspace in).
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/kv_cache/kv_cache_sizing.h"
#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/engine/serve_together.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

using kernels::cuda::CudaBackend;

int64_t DeviceBytesInUse(kernels::Memory& memory) {
  absl::StatusOr<kernels::Memory::Usage> usage = memory.usage();
  EXPECT_TRUE(usage.ok()) << usage.status();
  return usage.ok() ? static_cast<int64_t>(usage->total - usage->free) : 0;
}

TEST(CudaKvCacheSizing, ALoadedEngineNeedsNoMoreThanTheProfileStepsMeasured) {
  const std::string path = testing::TestData("stories260K/stories260K.bin");
  KVLENS_REQUIRE_FILE(path);
  auto model = LoadModel({path, ""});
  ASSERT_TRUE(model.ok()) << model.status();
  auto cuda = CudaBackend::Create(0);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  kernels::Memory& memory = (*cuda)->memory();
  (*cuda)->SetSplitKvBalanced(true);  // as --attention-tune may leave it

  const KvCacheSizingLimits limits{.block_size = 16, .max_batch_tokens = 64, .max_running = 8};
  // 0.1% of the emulated 16 GiB: about 16 MiB, 13 thousand tokens of stories260K's cache.
  auto sizing = SizeKvCacheForUtilization(**model, **cuda, limits, 0.001);
  ASSERT_TRUE(sizing.ok()) << sizing.status();
  // Their cache and activations freed; the weights and the backend's workspaces stay.
  ASSERT_LT(DeviceBytesInUse(memory), sizing->in_use_before + sizing->model_and_step);

  EngineOptions options;
  options.num_blocks = static_cast<int>(sizing->tokens / limits.block_size);
  options.block_size = limits.block_size;
  options.max_batch_tokens = limits.max_batch_tokens;
  options.max_running = limits.max_running;
  Engine engine(**model, **cuda, options);
  ASSERT_TRUE(engine.status().ok()) << engine.status();

  // stories260K reads 512 tokens: a prompt of about 440 and 8 more keep the first
  // sequence near that while seven short ones decode beside it.
  std::string long_text;
  for (int i = 0; i < 40; ++i) long_text += "Once upon a time, there was a little dog. ";
  std::vector<GenerationRequest> requests;
  for (int r = 0; r < limits.max_running; ++r) {
    GenerationRequest q;
    q.prompt = (*model)->tokenizer->Encode(r == 0 ? long_text : "Once upon a time", true);
    q.sampling.temperature = 0.8;
    q.sampling.top_p = 0.95;
    q.sampling.seed = 7 + r;
    q.sampling.logit_bias = {{5, 2.0f}};
    q.sampling.repetition_penalty = 1.2;
    q.sampling.frequency_penalty = 0.5;
    q.top_logprobs = 20;
    q.prompt_logprobs = r == 0 ? 20 : -1;
    q.stop.max_new_tokens = 8;
    q.stop.ignore_eos = true;
    requests.push_back(std::move(q));
  }
  ASSERT_LT(requests[0].prompt.size() + 8, size_t{512});
  ASSERT_GT(requests[0].prompt.size(), size_t{400});
  // What the CPU engine streams for them: the profile steps leave nothing behind in the
  // backend (a recorded step, a workspace's contents) that changes a token.
  kernels::CpuBackend cpu(2);
  const std::vector<testing::Served> want = testing::ServeTogether(**model, cpu, requests, options);
  const std::vector<testing::Served> served = testing::ServeOn(engine, std::move(requests));
  for (size_t r = 0; r < served.size(); ++r) {
    SCOPED_TRACE(r);
    EXPECT_EQ(served[r].finish.reason, FinishReason::kLength) << served[r].finish.status;
    ASSERT_EQ(want[r].tokens.size(), 8u);
    EXPECT_EQ(served[r].tokens, want[r].tokens);
  }
  ASSERT_EQ(served[0].prompt_logprobs.size(), want[0].prompt_logprobs.size());
  for (size_t i = 0; i < want[0].prompt_logprobs.size(); ++i) {
    EXPECT_NEAR(served[0].prompt_logprobs[i], want[0].prompt_logprobs[i], 1e-4) << i;
  }
  EXPECT_EQ(testing::StatsWhenIdle(engine).steps_out_of_memory, 0);

  // Everything on the device beyond what was there before and the cache: the weights, the
  // engine's activations and every workspace its steps grew.
  const int64_t beyond_cache =
      DeviceBytesInUse(memory) - sizing->in_use_before - sizing->cache_bytes;
  EXPECT_LE(beyond_cache, sizing->model_and_step)
      << "the loaded engine grew the device's buffers " << beyond_cache - sizing->model_and_step
      << " bytes past what the profile steps measured";
}

}  // namespace
}  // namespace kvlens
