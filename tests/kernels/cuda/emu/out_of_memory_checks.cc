// Device memory running out, on the CUDA emulator, whose allocations a test can make fail
// (kvlens_emu::FailDeviceAllocationsAfter, FailOneDeviceAllocationAfter; a GPU's cannot be
// made to, so these run in cuda_emu_tests only). An allocation that does not fit fails what needed
// it with RESOURCE_EXHAUSTED, naming the bytes, and nothing else: not the next kernel launch (a
// failed cudaMalloc leaves its error as the thread's last one), not the next unit of work
// once Backend::Recover() has run (on the CUDA backend, and on a StagedBackend over it),
// and, in the engine, no request unless a lone token runs out twice: the failed step runs
// again, and requests get the tokens they get with memory to spare (the CPU engine's). A kernel
// fault, which on a GPU leaves the context unusable, is kept.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/staged_backend.h"
#include "tests/engine/serve_together.h"
#include "tests/kernels/cuda/cuda_parity.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

using kernels::cuda::CudaBackend;

// Until destroyed, every device allocation fails.
class NoMoreDeviceMemory {
 public:
  NoMoreDeviceMemory() { kvlens_emu::FailDeviceAllocationsAfter(0); }
  ~NoMoreDeviceMemory() { kvlens_emu::FailDeviceAllocationsAfter(-1); }
  NoMoreDeviceMemory(const NoMoreDeviceMemory&) = delete;
  NoMoreDeviceMemory& operator=(const NoMoreDeviceMemory&) = delete;
};

std::unique_ptr<CudaBackend> Backend() {
  auto b = CudaBackend::Create(0);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// Device floats holding `values`.
float* DeviceFloats(kernels::Memory& memory, std::vector<float> values) {
  auto p = memory.Allocate(sizeof(float) * values.size());
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return nullptr;
  EXPECT_TRUE(memory.CopyFromHost(*p, values.data(), sizeof(float) * values.size()).ok());
  return static_cast<float*>(*p);
}

std::vector<float> HostFloats(kernels::Memory& memory, const float* device, size_t n) {
  std::vector<float> out(n);
  EXPECT_TRUE(memory.CopyToHost(out.data(), device, sizeof(float) * n).ok());
  return out;
}

TEST(CudaOutOfMemory, AFailedAllocationIsNotTheNextLaunchsFailure) {
  std::unique_ptr<CudaBackend> b = Backend();
  ASSERT_NE(b, nullptr);
  kernels::Memory& memory = b->memory();
  float* x = DeviceFloats(memory, {1, 2, 3, 4});
  float* y = DeviceFloats(memory, {10, 20, 30, 40});
  ASSERT_TRUE(x != nullptr && y != nullptr);
  {
    NoMoreDeviceMemory full;
    absl::StatusOr<void*> big = memory.Allocate(1 << 20);
    ASSERT_FALSE(big.ok());
    EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
    EXPECT_NE(big.status().message().find("cudaMalloc of 1048576 bytes"), std::string::npos)
        << big.status();
  }
  b->Add(y, x, 4);
  ASSERT_TRUE(b->Synchronize().ok()) << b->Synchronize();
  EXPECT_EQ(HostFloats(memory, y, 4), (std::vector<float>{11, 22, 33, 44}));
  memory.Free(x);
  memory.Free(y);
}

TEST(CudaOutOfMemory, AnOpThatRanOutFailsUntilRecoverAndThenRuns) {
  std::unique_ptr<CudaBackend> b = Backend();
  ASSERT_NE(b, nullptr);
  kernels::Memory& memory = b->memory();
  const std::vector<float> table = {0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23};  // [3, 4]
  const kernels::WeightView view{table.data(), kernels::DType::kF32, 3, 4};
  const std::vector<int32_t> ids = {2, 0};
  float* out = DeviceFloats(memory, std::vector<float>(8, -1.0f));
  float* one = DeviceFloats(memory, std::vector<float>(8, 1.0f));
  ASSERT_TRUE(out != nullptr && one != nullptr);
  {
    NoMoreDeviceMemory full;
    b->Embedding(view, ids.data(), 2, out);  // the table's upload does not fit
  }
  const absl::Status failed = b->Synchronize();
  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
  EXPECT_NE(failed.message().find("cudaMalloc of"), std::string::npos) << failed;
  // Kept until the next unit of work: a later op of the failed one does nothing.
  b->Add(out, one, 8);
  EXPECT_EQ(b->Synchronize().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(HostFloats(memory, out, 8), std::vector<float>(8, -1.0f));

  ASSERT_TRUE(b->Recover().ok());
  b->Embedding(view, ids.data(), 2, out);
  b->Add(out, one, 8);
  ASSERT_TRUE(b->Synchronize().ok()) << b->Synchronize();
  EXPECT_EQ(HostFloats(memory, out, 8), (std::vector<float>{21, 22, 23, 24, 1, 2, 3, 4}));
  memory.Free(out);
  memory.Free(one);
}

// The interpretability workers' backend: host arrays, the products on the device.
TEST(CudaOutOfMemory, AStagedBackendRecoversWithItsDevice) {
  std::unique_ptr<CudaBackend> b = Backend();
  ASSERT_NE(b, nullptr);
  kernels::CpuBackend host(1);
  kernels::StagedBackend staged(*b, host, b.get());
  const std::vector<float> w = {1, 0, 2, 0, 1, 3};  // [2, 3]
  const kernels::WeightView view{w.data(), kernels::DType::kF32, 2, 3};
  const std::vector<float> x = {1, 2, 3};
  std::vector<float> y(2, -1.0f);
  {
    NoMoreDeviceMemory full;
    staged.MatMul(x.data(), 1, view, kernels::WeightView{}, y.data());
  }
  EXPECT_EQ(staged.Synchronize().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(y, std::vector<float>(2, -1.0f));
  ASSERT_TRUE(staged.Recover().ok());
  staged.MatMul(x.data(), 1, view, kernels::WeightView{}, y.data());
  ASSERT_TRUE(staged.Synchronize().ok()) << staged.Synchronize();
  EXPECT_EQ(y, (std::vector<float>{7, 11}));  // [1·1 + 0·2 + 2·3, 0·1 + 1·2 + 3·3]
}

TEST(CudaOutOfMemory, AKernelFaultIsKept) {
  std::unique_ptr<CudaBackend> b = Backend();
  ASSERT_NE(b, nullptr);
  std::vector<float> host(4, 1.0f);
  b->Add(host.data(), host.data(), 4);  // host memory as a kernel's pointer: a fault
  const absl::Status fault = b->Synchronize();
  ASSERT_EQ(fault.code(), absl::StatusCode::kInternal) << fault;
  EXPECT_EQ(b->Recover(), fault);
  EXPECT_EQ(b->Synchronize(), fault);
}

// run(), with no device memory left where without_memory.
absl::Status RunWithMemory(bool without_memory, const std::function<absl::Status()>& run) {
  if (!without_memory) return run();
  NoMoreDeviceMemory none;
  return run();
}

// The heads' columns of the first tq rows of a call's output `out` (the rows' padding
// stays NaN, never written).
std::vector<double> HeadColumns(CudaBackend& b, const kernels::cuda::DeviceBuffer& out, int tq,
                                const kernels::cuda::parity::AttnInputs& in) {
  auto got = kernels::cuda::parity::FromDevice(b, out, in.qs.size());
  EXPECT_TRUE(got.ok()) << got.status();
  std::vector<double> rows;
  for (int i = 0; got.ok() && i < tq; ++i) {
    rows.insert(rows.end(), got->begin() + i * in.q_stride,
                got->begin() + i * in.q_stride + in.q_width);
  }
  return rows;
}

// One flash call's output (the heads' columns, row by row) on `b`, the fp16 copy on or off.
std::vector<double> FlashOutput(CudaBackend& b, bool f16_copy,
                                const kernels::cuda::parity::AttnShape& s,
                                const kernels::cuda::parity::AttnInputs& in,
                                const kernels::cuda::parity::DeviceAttnCall& call,
                                bool without_memory = false) {
  b.SetFlashF16Copy(f16_copy);
  const absl::Status st = RunWithMemory(without_memory, [&] { return b.Attention(call.args); });
  EXPECT_TRUE(st.ok()) << st;
  return HeadColumns(b, call.out, s.tq, in);
}

// The fp32 cache's flash prefill on an fp16 copy (SetFlashF16Copy) is a matter of speed:
// where the copies' workspace cannot grow (a call over more blocks than any before, with
// no device memory left), the call runs on the fp16 kernel, its bits, and nothing fails;
// once memory is back the copy runs again (the same bits: 128-query blocks, head size 64).
TEST(CudaOutOfMemory, FlashOnAnF16CopyRunsOnTheFp16KernelWhereItsCopiesDoNotFit) {
  namespace parity = kernels::cuda::parity;
  std::unique_ptr<CudaBackend> b = Backend();
  ASSERT_NE(b, nullptr);
  const parity::AttnShape small{.tq = 64, .tk = 150, .heads = 4, .kv_heads = 2, .offset = 86};
  const parity::AttnShape large{.tq = 64, .tk = 280, .heads = 4, .kv_heads = 2, .offset = 216};
  std::mt19937_64 rng(3);
  const parity::AttnInputs small_in = parity::MakeAttnInputs(small, rng);
  const parity::AttnInputs in = parity::MakeAttnInputs(large, rng);
  auto small_call = parity::UploadAttnCall(small, small_in);
  auto call = parity::UploadAttnCall(large, in);
  ASSERT_TRUE(small_call.ok() && call.ok());
  FlashOutput(*b, true, small, small_in, *small_call);  // the copies' workspace for 150 keys
  const std::vector<double> fp16_kernel = FlashOutput(*b, false, large, in, *call);
  EXPECT_EQ(b->flash_f16_copy_fallbacks(), 0);
  EXPECT_EQ(FlashOutput(*b, true, large, in, *call, /*without_memory=*/true), fp16_kernel);
  EXPECT_EQ(b->flash_f16_copy_fallbacks(), 1);
  EXPECT_TRUE(b->status().ok()) << b->status();
  EXPECT_EQ(FlashOutput(*b, true, large, in, *call), fp16_kernel);
  EXPECT_EQ(b->flash_f16_copy_fallbacks(), 1);

  // AttentionBatch's one launch over the call's rows as two chunks of 32 on a new backend,
  // whose copies' workspace has never grown: without memory, the fp16 kernel on the tables
  // as they are (not renumbered to copies never made), its bits.
  std::unique_ptr<CudaBackend> fresh = Backend();
  ASSERT_NE(fresh, nullptr);
  std::vector<kernels::AttentionArgs<float>> chunks(2, call->args);
  for (int c = 0; c < 2; ++c) {
    chunks[c].num_queries = 32;
    chunks[c].query_offset = large.offset + 32 * c;
    chunks[c].q += 32 * c * in.q_stride;
    chunks[c].out += 32 * c * in.q_stride;
  }
  auto batched = [&](bool f16_copy, bool without_memory) {
    fresh->SetFlashF16Copy(f16_copy);
    int failed = -1;
    const absl::Status st =
        RunWithMemory(without_memory, [&] { return fresh->AttentionBatch(chunks, &failed); });
    EXPECT_TRUE(st.ok()) << st << " (call " << failed << ")";
    return HeadColumns(*fresh, call->out, large.tq, in);
  };
  const std::vector<double> fp16_batched = batched(false, false);
  ASSERT_FALSE(fp16_batched.empty());
  EXPECT_EQ(batched(true, true), fp16_batched);
  EXPECT_EQ(fresh->flash_f16_copy_fallbacks(), 1);
  EXPECT_TRUE(fresh->status().ok()) << fresh->status();
}

// The engine on stories260K over the emulated GPU: a short prompt's request served first
// (it sizes what a step of its few tokens needs), then a prompt longer than any before,
// whose steps grow the activations, the index ring and the backend's scratch: the
// allocations the tests below make fail. `want` is what the CPU engine streams for each.
class CudaEngineOutOfMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = testing::TestData("stories260K/stories260K.bin");
    KVLENS_REQUIRE_FILE(path);
    auto model = LoadModel({path, ""});
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
    for (int i = 0; i < 12; ++i) long_prompt_ += "Once upon a time, there was a little dog. ";
    kernels::CpuBackend cpu(2);
    want_ = testing::ServeTogether(*model_, cpu, {Request(kShortPrompt), Request(long_prompt_)});
  }
  GenerationRequest Request(const std::string& prompt) const {
    GenerationRequest r;
    r.prompt = model_->tokenizer->Encode(prompt, true);
    r.stop.max_new_tokens = 6;
    r.stop.ignore_eos = true;
    return r;
  }
  // A fresh engine that served the short prompt (with the CPU engine's tokens).
  std::unique_ptr<Engine> WarmEngine(CudaBackend& cuda) {
    auto engine = std::make_unique<Engine>(*model_, cuda, EngineOptions{});
    EXPECT_TRUE(engine->status().ok()) << engine->status();
    EXPECT_EQ(testing::ServeOn(*engine, {Request(kShortPrompt)})[0].tokens, want_[0].tokens);
    return engine;
  }

  static constexpr const char* kShortPrompt = "Once upon a time";
  std::unique_ptr<Model> model_;
  std::string long_prompt_;
  std::vector<testing::Served> want_;
};

// The n-th allocation from the long prompt's submission on fails, and only it, for n = 0,
// 1, … until none of its steps' allocations is left to fail: each time the step it was in
// runs again (Engine: in halves, a lone token once as it was) and the request streams the
// CPU engine's tokens, all blocks free again after it.
TEST_F(CudaEngineOutOfMemory, AnAllocationThatFailsOnceCostsNoRequest) {
  int failures = 0;
  for (int n = 0; n < 200; ++n) {
    SCOPED_TRACE(::testing::Message() << "allocations before the one that fails: " << n);
    std::unique_ptr<CudaBackend> cuda = Backend();
    ASSERT_NE(cuda, nullptr);
    std::unique_ptr<Engine> engine = WarmEngine(*cuda);
    kvlens_emu::FailOneDeviceAllocationAfter(n);
    const testing::Served run = testing::ServeOn(*engine, {Request(long_prompt_)})[0];
    kvlens_emu::FailOneDeviceAllocationAfter(-1);
    EXPECT_EQ(run.finish.reason, FinishReason::kLength) << run.finish.status;
    EXPECT_EQ(run.tokens, want_[1].tokens);
    const EngineStats stats = testing::StatsWhenIdle(*engine);
    EXPECT_EQ(stats.blocks_used, 0);
    EXPECT_EQ(stats.blocks_free + stats.blocks_cached, stats.num_blocks);
    EXPECT_LE(stats.steps_out_of_memory, 1);
    if (::testing::Test::HasFailure() || stats.steps_out_of_memory == 0) break;
    ++failures;
  }
  // The long prompt's steps allocate: some of those allocations failed.
  EXPECT_GT(failures, 0);
  std::cerr << "[ CUDA     ] the long prompt's request completed with each of its first "
            << failures << " device allocations failing once\n";
}

// The n-th allocation from the long prompt's submission on and every one after it fail,
// for n = 0, 1, … until the request completes: each time its steps run again in halves
// down to a lone token (which may fit in what the short prompt left) and, where even that
// runs out twice, the request fails with RESOURCE_EXHAUSTED after a prefix of the CPU
// engine's tokens, its blocks free again; the next request, memory to spare again, streams
// the CPU engine's tokens.
TEST_F(CudaEngineOutOfMemory, MemoryThatStaysShortFailsTheRequestAndServingGoesOn) {
  int failed_requests = 0;
  for (int n = 0; n < 200; ++n) {
    SCOPED_TRACE(::testing::Message() << "allocations that succeed: " << n);
    std::unique_ptr<CudaBackend> cuda = Backend();
    ASSERT_NE(cuda, nullptr);
    std::unique_ptr<Engine> engine = WarmEngine(*cuda);
    kvlens_emu::FailDeviceAllocationsAfter(n);
    const testing::Served run = testing::ServeOn(*engine, {Request(long_prompt_)})[0];
    kvlens_emu::FailDeviceAllocationsAfter(-1);
    if (run.finish.reason != FinishReason::kError) {
      EXPECT_EQ(run.finish.reason, FinishReason::kLength);
      EXPECT_EQ(run.tokens, want_[1].tokens);
      break;
    }
    ++failed_requests;
    EXPECT_EQ(run.finish.status.code(), absl::StatusCode::kResourceExhausted) << run.finish.status;
    EXPECT_NE(run.finish.status.message().find("cudaMalloc of"), std::string::npos)
        << run.finish.status;
    ASSERT_LE(run.tokens.size(), want_[1].tokens.size());
    EXPECT_TRUE(std::equal(run.tokens.begin(), run.tokens.end(), want_[1].tokens.begin()));
    const EngineStats stats = testing::StatsWhenIdle(*engine);
    EXPECT_EQ(stats.blocks_used, 0);
    EXPECT_EQ(stats.blocks_free + stats.blocks_cached, stats.num_blocks);

    const testing::Served after = testing::ServeOn(*engine, {Request(kShortPrompt)})[0];
    EXPECT_EQ(after.finish.reason, FinishReason::kLength) << after.finish.status;
    EXPECT_EQ(after.tokens, want_[0].tokens);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GT(failed_requests, 0);
  std::cerr << "[ CUDA     ] the long prompt's request failed with every device allocation "
               "failing from each of its first "
            << failed_requests << " on\n";
}

}  // namespace
}  // namespace kvlens
