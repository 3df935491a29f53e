// The --device parser and backend creation: "cpu", "cuda", "cuda:N"; anything else is an
// error naming the accepted forms. Without a GPU (or without CUDA in the build) asking
// for cuda is FAILED_PRECONDITION, never a crash.
#include "kernels/backend_factory.h"

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#ifdef KVLENS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/launch.h"
#endif

namespace kvlens::kernels {
namespace {

TEST(BackendFactoryTest, ParsesCpuAndCuda) {
  auto cpu = ParseDevice("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->kind, DeviceSpec::Kind::kCpu);
  EXPECT_EQ(cpu->ToString(), "cpu");
  auto cuda = ParseDevice("cuda");
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ(cuda->kind, DeviceSpec::Kind::kCuda);
  EXPECT_EQ(cuda->index, 0);
  auto cuda3 = ParseDevice("cuda:3");
  ASSERT_TRUE(cuda3.ok()) << cuda3.status();
  EXPECT_EQ(cuda3->index, 3);
  EXPECT_EQ(cuda3->ToString(), "cuda:3");
}

TEST(BackendFactoryTest, RejectsEverythingElseNamingTheForms) {
  for (const char* bad : {"", "bogus", "CPU", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x",
                          "cuda:99999999999", " cpu", "cuda0"}) {
    auto d = ParseDevice(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(d.status().message().find("cpu, cuda, cuda:N"), std::string_view::npos) << d.status();
  }
}

TEST(BackendFactoryTest, CpuBackendIsHostMemory) {
  auto b = CreateBackend({DeviceSpec::Kind::kCpu, 0}, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->description, "cpu-f32");
  EXPECT_TRUE(b->backend->memory().host_accessible());
  EXPECT_EQ(&b->backend->memory(), &HostMemory());
}

// --int8-activations reaches the CPU backend and its description; CUDA refuses it by name,
// with or without a GPU.
TEST(BackendFactoryTest, Int8ActivationsAreACpuOption) {
  DeviceSpec cpu{DeviceSpec::Kind::kCpu, 0};
  cpu.int8_activations = true;
  auto b = CreateBackend(cpu, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->description, "cpu-f32 (int8 activations for quantised weights)");
  auto* backend = dynamic_cast<CpuBackend*>(b->backend.get());
  ASSERT_NE(backend, nullptr);
  EXPECT_TRUE(backend->int8_activations());
  DeviceSpec cuda{DeviceSpec::Kind::kCuda, 0};
  cuda.int8_activations = true;
  auto c = CreateBackend(cuda, 1);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("int8 activations are a CPU option"), std::string_view::npos)
      << c.status();
}

// --attention-tensor-cores is a CUDA option: the CPU backend refuses it by name.
TEST(BackendFactoryTest, TensorCoreAttentionIsACudaOption) {
  DeviceSpec cpu{DeviceSpec::Kind::kCpu, 0};
  cpu.attention_tensor_cores = true;
  auto b = CreateBackend(cpu, 1);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_NE(b.status().message().find("tensor-core attention is a CUDA option"),
            std::string_view::npos)
      << b.status();
}

// --programmatic-launches likewise.
TEST(BackendFactoryTest, ProgrammaticLaunchesAreACudaOption) {
  DeviceSpec cpu{DeviceSpec::Kind::kCpu, 0};
  cpu.programmatic_launches = true;
  auto b = CreateBackend(cpu, 1);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_NE(b.status().message().find("programmatic launches are a CUDA option"),
            std::string_view::npos)
      << b.status();
}

// --attention-tune: the CPU backend has one attention kernel, nothing to choose; a bad
// shape is named before that.
TEST(BackendFactoryTest, AttentionTuningIsACudaOption) {
  auto b = CreateBackend({DeviceSpec::Kind::kCpu, 0}, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  AttentionTuneShape shape;
  shape.num_heads = 4;
  shape.num_kv_heads = 2;
  shape.head_dim = 64;
  auto r = TuneAttention(*b->backend, shape);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(r.status().message(),
            "attention tuning is a CUDA option: the CPU backend has one attention kernel");
  shape.head_dim = 0;
  r = TuneAttention(*b->backend, shape);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(r.status().message(), "attention tuning: head_dim 0 must be in [1, 512]");
}

TEST(BackendFactoryTest, CudaWithoutAGpuIsFailedPrecondition) {
  auto b = CreateBackend({DeviceSpec::Kind::kCuda, 0}, 1);
  if (b.ok()) GTEST_SKIP() << "a CUDA device is present: " << b->description;
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
  if (!HasCudaSupport()) {
    EXPECT_EQ(b.status().message(),
              "this build has no CUDA support (configure with -DKVLENS_CUDA=ON)");
  }
}

#ifdef KVLENS_HAVE_CUDA
// --cuda-graphs reaches the backend (a GPU test: named CudaBackend* for the `gpu` label).
TEST(CudaBackendFactory, CudaGraphsFollowTheDeviceSpec) {
  for (bool graphs : {true, false}) {
    DeviceSpec spec{DeviceSpec::Kind::kCuda, 0};
    spec.cuda_graphs = graphs;
    auto b = CreateBackend(spec, 1);
    if (!b.ok()) GTEST_SKIP() << "no CUDA backend: " << b.status();
    auto* cuda = dynamic_cast<cuda::CudaBackend*>(b->backend.get());
    ASSERT_NE(cuda, nullptr);
    EXPECT_EQ(cuda->cuda_graphs(), graphs);
  }
}

// --attention-tensor-cores reaches the backend and its description.
TEST(CudaBackendFactory, TensorCoreAttentionFollowsTheDeviceSpec) {
  for (bool on : {false, true}) {
    DeviceSpec spec{DeviceSpec::Kind::kCuda, 0};
    spec.attention_tensor_cores = on;
    auto b = CreateBackend(spec, 1);
    if (!b.ok()) GTEST_SKIP() << "no CUDA backend: " << b.status();
    auto* cuda = dynamic_cast<cuda::CudaBackend*>(b->backend.get());
    ASSERT_NE(cuda, nullptr);
    EXPECT_EQ(cuda->split_kv_tensor_cores(), on);
    EXPECT_EQ(b->description.find("decode attention on tensor cores") != std::string::npos, on)
        << b->description;
  }
}

// --programmatic-launches turns the process-wide switch on (kernels/cuda/launch.h) and is
// named in the description; a backend made without it leaves the switch as it was (another
// backend of the process may be launching so).
TEST(CudaBackendFactory, ProgrammaticLaunchesFollowTheDeviceSpec) {
  ASSERT_FALSE(cuda::ProgrammaticLaunches());  // the default
  DeviceSpec spec{DeviceSpec::Kind::kCuda, 0};
  spec.programmatic_launches = true;
  auto on = CreateBackend(spec, 1);
  if (!on.ok()) GTEST_SKIP() << "no CUDA backend: " << on.status();
  EXPECT_TRUE(cuda::ProgrammaticLaunches());
  EXPECT_NE(on->description.find(", programmatic launches"), std::string::npos) << on->description;
  spec.programmatic_launches = false;
  auto plain = CreateBackend(spec, 1);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(cuda::ProgrammaticLaunches());
  EXPECT_EQ(plain->description.find("programmatic"), std::string::npos) << plain->description;
  cuda::SetProgrammaticLaunches(false);
}

// A backend made to share another's weights (the interpretability workers') runs the
// other's attention kernels (the serving backend's, as --attention-tune left them).
TEST(CudaBackendFactory, AWeightSharingBackendTakesItsPeersAttentionKernels) {
  const DeviceSpec spec{DeviceSpec::Kind::kCuda, 0};
  auto serving = CreateBackend(spec, 1);
  if (!serving.ok()) GTEST_SKIP() << "no CUDA backend: " << serving.status();
  auto* peer = dynamic_cast<cuda::CudaBackend*>(serving->backend.get());
  ASSERT_NE(peer, nullptr);
  cuda::AttentionKernels tuned;
  tuned.flash_layout.stages = cuda::kFlashMaxStages;
  tuned.flash_head_group = 4;
  tuned.split_kv_warps = cuda::kSplitKvWideWarps;
  tuned.split_kv_fused_combine = tuned.split_kv_tensor_cores = tuned.split_kv_balanced = true;
  ASSERT_TRUE(peer->SetAttentionKernels(tuned).ok());
  auto worker = CreateBackend(spec, 1, peer);
  ASSERT_TRUE(worker.ok()) << worker.status();
  auto* cuda = dynamic_cast<cuda::CudaBackend*>(worker->backend.get());
  ASSERT_NE(cuda, nullptr);
  const cuda::AttentionKernels got = cuda->attention_kernels();
  EXPECT_EQ(got.flash_layout.stages, cuda::kFlashMaxStages);
  EXPECT_EQ(got.flash_head_group, 4);
  EXPECT_EQ(got.split_kv_warps, cuda::kSplitKvWideWarps);
  EXPECT_TRUE(got.split_kv_fused_combine && got.split_kv_tensor_cores && got.split_kv_balanced);
  // Not sharing: the defaults.
  auto alone = CreateBackend(spec, 1);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(dynamic_cast<cuda::CudaBackend*>(alone->backend.get())->flash_head_group(), 1);
}
#endif

}  // namespace
}  // namespace kvlens::kernels
