// What the host and other streams see of a stream's order on the emulator
// (emu_runtime.cc, Pending), as on a GPU:
//   - a copy between device memory and pinned host memory is asynchronous for the host:
//     its destination reads NaN until the host synchronizes with the copy's stream, and a
//     host that writes a pending copy's pinned bytes ends the process;
//   - a stream's device accesses (kernels', copies', memsets', cuBLAS's) are pending for
//     the streams not ordered after it (a non-blocking stream and any other) until the
//     host synchronizes with it: work there reading bytes one writes, or writing bytes one
//     reads or writes, ends the process (cudaMemcpy from pageable memory returns once its
//     source is staged, so even its write is pending).
// Until 2026-12-07 every copy completed within its call here, so a host that read a
// result before synchronizing, or a stream that read an upload still in flight, passed CI.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/ops.h"
#include "tests/kernels/cuda/emu/emu_copies.h"
#include "tests/kernels/cuda/emu/emu_device.h"  // first: threadIdx for CopyPairKernel

namespace kvlens::kernels::cuda {
namespace {

// Four floats of pinned memory and of device memory holding {1, 2, 3, 4}, and a stream.
class CudaEmulatorPinnedCopy : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned_), 4 * sizeof(float)), cudaSuccess);
    device_ = DeviceCopy(std::vector<float>{1, 2, 3, 4});
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    cudaStreamDestroy(stream_);
    cudaFree(device_);
    cudaFreeHost(pinned_);
  }
  std::vector<float> Pinned() const { return std::vector<float>(pinned_, pinned_ + 4); }
  static bool AllNaN(const std::vector<float>& v) {
    for (float x : v) {
      if (!std::isnan(x)) return false;
    }
    return true;
  }

  float* pinned_ = nullptr;
  float* device_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

const std::vector<float> kValues = {1, 2, 3, 4};

TEST_F(CudaEmulatorPinnedCopy, ACopyToPinnedMemoryLandsWhenItsStreamIsSynchronized) {
  ASSERT_EQ(cudaMemcpyAsync(pinned_, device_, 16, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  EXPECT_TRUE(AllNaN(Pinned()));
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(Pinned(), kValues);
}

TEST_F(CudaEmulatorPinnedCopy, ACopyToPageableMemoryLandsWithinTheCall) {
  std::vector<float> pageable(4, 0.0f);
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), device_, 16, cudaMemcpyDeviceToHost, stream_),
            cudaSuccess);
  EXPECT_EQ(pageable, kValues);
}

TEST_F(CudaEmulatorPinnedCopy, ACopyReadsTheDeviceAsItIsWhenEnqueued) {
  // The device's side is made in stream order: a later write of the device buffer does not
  // reach the pending copy.
  ASSERT_EQ(cudaMemcpyAsync(pinned_, device_, 16, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(device_, 0, 16, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(Pinned(), kValues);
  EXPECT_EQ(HostCopy(device_, 4), std::vector<float>(4, 0.0f));
}

TEST_F(CudaEmulatorPinnedCopy, AnEventSettlesOnlyTheCopiesBeforeItsRecord) {
  float* second = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&second), 16), cudaSuccess);
  cudaEvent_t event = nullptr;
  ASSERT_EQ(cudaEventCreate(&event), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned_, device_, 16, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(event, stream_), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(second, device_, 16, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaEventSynchronize(event), cudaSuccess);
  EXPECT_EQ(Pinned(), kValues);
  EXPECT_TRUE(AllNaN(std::vector<float>(second, second + 4)));
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(std::vector<float>(second, second + 4), kValues);
  cudaEventDestroy(event);
  cudaFreeHost(second);
}

TEST_F(CudaEmulatorPinnedCopy, ASynchronousCopyWaitsForBlockingStreamsOnly) {
  // cudaMemcpy runs on the legacy stream, which a non-blocking stream's work is not
  // ordered with; a blocking stream's is.
  cudaStream_t blocking = nullptr;
  ASSERT_EQ(cudaStreamCreate(&blocking), cudaSuccess);
  float* second = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&second), 16), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned_, device_, 16, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(second, device_, 16, cudaMemcpyDeviceToHost, blocking), cudaSuccess);
  EXPECT_EQ(HostCopy(device_, 4), kValues);  // a cudaMemcpy
  EXPECT_TRUE(AllNaN(Pinned()));
  EXPECT_EQ(std::vector<float>(second, second + 4), kValues);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(Pinned(), kValues);
  cudaFreeHost(second);
  cudaStreamDestroy(blocking);
}

TEST_F(CudaEmulatorPinnedCopy, AGraphsCopyIsPendingOnTheStreamItIsLaunchedOn) {
  cudaStream_t capture = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(capture, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned_, device_, 16, cudaMemcpyDeviceToHost, capture), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(capture, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph), cudaSuccess);
  std::memset(pinned_, 0, 16);  // nothing pending yet: the host may write
  ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  EXPECT_TRUE(AllNaN(Pinned()));
  ASSERT_EQ(cudaStreamSynchronize(capture), cudaSuccess);  // not the stream it runs on
  EXPECT_TRUE(AllNaN(Pinned()));
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(Pinned(), kValues);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(capture);
}

TEST_F(CudaEmulatorPinnedCopy, ACopyToTheDeviceMayReuseItsPinnedSourceOnceSynchronized) {
  const float values[4] = {5, 6, 7, 8};
  std::memcpy(pinned_, values, 16);
  ASSERT_EQ(cudaMemcpyAsync(device_, pinned_, 16, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(HostCopy(device_, 4), std::vector<float>(values, values + 4));
  pinned_[1] = 9;  // synchronized: the source may change, and be copied again
  ASSERT_EQ(cudaMemcpyAsync(device_, pinned_, 16, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(HostCopy(device_, 4), (std::vector<float>{5, 9, 7, 8}));
}

TEST_F(CudaEmulatorPinnedCopy, AStreamMayCopyIntoASourceItHasYetToRead) {
  // In the stream's order the copy to the device reads the bytes before the copy to the
  // host overwrites them: no race, and the pinned bytes end as the device's.
  float* other = DeviceCopy(std::vector<float>{0, 0, 0, 0});
  std::memcpy(pinned_, std::vector<float>{5, 6, 7, 8}.data(), 16);
  ASSERT_EQ(cudaMemcpyAsync(other, pinned_, 16, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned_, device_, 16, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(Pinned(), kValues);
  EXPECT_EQ(HostCopy(other, 4), (std::vector<float>{5, 6, 7, 8}));
  cudaFree(other);
}

// Device accesses across streams, most of them of x, which WriteX fills with
// {10, 20, 30, 40} by a cudaMemcpy on the legacy stream; the fixture's device_
// ({1, 2, 3, 4}) was waited for.
class CudaEmulatorLegacyWrite : public CudaEmulatorPinnedCopy {
 protected:
  void SetUp() override {
    CudaEmulatorPinnedCopy::SetUp();
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&x_), 16), cudaSuccess);
  }
  void TearDown() override {
    cudaFree(x_);
    CudaEmulatorPinnedCopy::TearDown();
  }
  void WriteX() { WriteInto(x_); }
  // x_values_ into the first 16 bytes of d, by cudaMemcpy.
  void WriteInto(float* d) {
    ASSERT_EQ(cudaMemcpy(d, x_values_.data(), 16, cudaMemcpyHostToDevice), cudaSuccess);
  }

  const std::vector<float> x_values_ = {10, 20, 30, 40};
  float* x_ = nullptr;
};

TEST_F(CudaEmulatorLegacyWrite, ANonBlockingStreamMayReadItOnceTheHostSynchronizes) {
  WriteX();
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  ASSERT_TRUE(LaunchAdd(device_, x_, 4, stream_).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(HostCopy(device_, 4), (std::vector<float>{11, 22, 33, 44}));
}

TEST_F(CudaEmulatorLegacyWrite, ABlockingStreamIsOrderedAfterIt) {
  cudaStream_t blocking = nullptr;
  ASSERT_EQ(cudaStreamCreate(&blocking), cudaSuccess);
  WriteX();
  ASSERT_TRUE(LaunchAdd(device_, x_, 4, blocking).ok());
  ASSERT_EQ(cudaStreamSynchronize(blocking), cudaSuccess);
  EXPECT_EQ(HostCopy(device_, 4), (std::vector<float>{11, 22, 33, 44}));
  cudaStreamDestroy(blocking);
}

TEST_F(CudaEmulatorLegacyWrite, ACopyThatReturnsOnceMadeSettlesTheLegacyStream) {
  // From pinned memory to the device, and from the device to the host, cudaMemcpy returns
  // once the copy is made, after the legacy stream's earlier writes.
  WriteX();
  EXPECT_EQ(HostCopy(x_, 4), x_values_);
  ASSERT_TRUE(LaunchAdd(device_, x_, 4, stream_).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);  // done reading x_
  std::memcpy(pinned_, x_values_.data(), 16);
  ASSERT_EQ(cudaMemcpy(x_, pinned_, 16, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(LaunchAdd(device_, x_, 4, stream_).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(HostCopy(device_, 4), (std::vector<float>{21, 42, 63, 84}));
}

using CudaEmulatorLegacyWriteDeathTest = CudaEmulatorLegacyWrite;

TEST_F(CudaEmulatorLegacyWriteDeathTest,
       AKernelOnANonBlockingStreamMustNotReadItBeforeTheHostWaits) {
  WriteX();
  EXPECT_DEATH((void)LaunchAdd(device_, x_, 4, stream_),
               "AddKernel's pointer argument 1, on a non-blocking stream, reads device memory .* "
               "\\(16 bytes\\) that cudaMemcpy's destination, on the legacy stream, may still "
               "be writing \\(16 bytes at .*\\) \\(from pageable memory cudaMemcpy returns "
               "once its source is staged\\)");
}

TEST_F(CudaEmulatorLegacyWriteDeathTest, AMemsetIsAsynchronousToo) {
  ASSERT_EQ(cudaMemset(x_, 0, 16), cudaSuccess);
  EXPECT_DEATH(cudaMemcpyAsync(pinned_, x_, 16, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync's source, on a non-blocking stream, reads device memory .* that "
               "cudaMemset, on the legacy stream, may still be writing");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned_, x_, 16, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(Pinned(), std::vector<float>(4, 0.0f));
}

// A kernel's writes (through its pointers to non-const data) are pending in the same way
// for streams not ordered after its own: here AddKernel's y on a non-blocking stream.
TEST_F(CudaEmulatorLegacyWrite, AKernelsOutputMayBeReadOnceTheHostSynchronizesItsStream) {
  WriteX();
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  ASSERT_TRUE(LaunchAdd(device_, x_, 4, stream_).ok());
  EXPECT_EQ(HostCopy(x_, 4), x_values_);  // only read by the kernel (const float*)
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(HostCopy(device_, 4), (std::vector<float>{11, 22, 33, 44}));
}

TEST_F(CudaEmulatorLegacyWriteDeathTest, ACopyOnTheLegacyStreamMustNotReadAKernelsOutputEarly) {
  WriteX();
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  ASSERT_TRUE(LaunchAdd(device_, x_, 4, stream_).ok());
  EXPECT_DEATH(HostCopy(device_, 4),
               "cudaMemcpy's source, on the legacy stream, reads device memory .* that "
               "AddKernel's pointer argument 0, on a non-blocking stream, may still be writing");
}

TEST_F(CudaEmulatorLegacyWriteDeathTest, TwoNonBlockingStreamsAreNotOrdered) {
  WriteX();
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  float* sum = DeviceCopy(std::vector<float>(4, 0.0f));
  ASSERT_TRUE(LaunchAdd(x_, device_, 4, stream_).ok());  // x += device_ on one stream
  EXPECT_DEATH((void)LaunchAdd(sum, x_, 4, other),       // sum += x on the other
               "AddKernel's pointer argument 1, on a non-blocking stream, reads device memory "
               ".* that AddKernel's pointer argument 0, on a non-blocking stream, may still be "
               "writing");
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  ASSERT_TRUE(LaunchAdd(sum, x_, 4, other).ok());
  ASSERT_EQ(cudaStreamSynchronize(other), cudaSuccess);
  EXPECT_EQ(HostCopy(sum, 4), (std::vector<float>{11, 22, 33, 44}));
  cudaFree(sum);
  cudaStreamDestroy(other);
}

TEST_F(CudaEmulatorLegacyWriteDeathTest, AWriteMustNotOverwriteWhatAnotherStreamMayStillRead) {
  WriteX();
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  ASSERT_TRUE(LaunchAdd(device_, x_, 4, stream_).ok());  // reads x_
  EXPECT_DEATH(WriteX(),
               "cudaMemcpy's destination, on the legacy stream, writes device memory .* that "
               "AddKernel's pointer argument 1, on a non-blocking stream, may still be reading");
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  WriteX();  // the kernel is done with it
  EXPECT_EQ(HostCopy(device_, 4), (std::vector<float>{11, 22, 33, 44}));
}

// The pointers a kernel's parameter struct carries are accessed as its pointer arguments
// are (emu_struct_pointers.h). AttentionParams is declared: MaterializedKernel reads q, k
// and v and writes out. Here one query row at position 1 over two equal keys (softmax
// weights 1/2 each) and value rows of 1s and 3s: out is 2 in every column.
class CudaEmulatorStructPointers : public CudaEmulatorLegacyWrite {
 protected:
  void SetUp() override {
    CudaEmulatorLegacyWrite::SetUp();
    q_ = DeviceCopy(std::vector<float>{1, 0, 0, 0});
    k_ = DeviceCopy(std::vector<float>{1, 0, 0, 0, 1, 0, 0, 0});
    v_ = DeviceCopy(std::vector<float>{1, 1, 1, 1, 3, 3, 3, 3});
    out_ = DeviceCopy(std::vector<float>(4, 0.0f));
    maps_ = DeviceCopy(std::vector<float>(4, 0.0f));  // scores, then probabilities
    p_.q = q_;
    p_.q_stride = 4;
    p_.k = k_;
    p_.v = v_;
    p_.kv_row_stride = 4;
    p_.out = out_;
    p_.out_stride = 4;
    p_.num_queries = 1;
    p_.num_keys = 2;
    p_.num_heads = 1;
    p_.num_kv_heads = 1;
    p_.head_dim = 4;
    p_.query_offset = 1;
    p_.scale = 1.0f;
  }
  void TearDown() override {
    for (float* d : {q_, k_, v_, out_, maps_}) cudaFree(d);
    CudaEmulatorLegacyWrite::TearDown();
  }
  absl::Status Launch() { return LaunchMaterialized(p_, maps_, maps_ + 2, stream_); }

  float *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *out_ = nullptr, *maps_ = nullptr;
  AttentionParams p_;
};

TEST_F(CudaEmulatorStructPointers, ADeclaredStructsInputsMayBeReadEarlyItsOutputOnceWaited) {
  ASSERT_TRUE(Launch().ok());
  EXPECT_EQ(HostCopy(k_, 2), (std::vector<float>{1, 0}));  // AttentionParams::k: read only
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(HostCopy(out_, 4), std::vector<float>(4, 2.0f));
  EXPECT_EQ(HostCopy(maps_ + 2, 2), (std::vector<float>{0.5f, 0.5f}));
}

TEST_F(CudaEmulatorStructPointers, ADeclaredPointerOutsideDeviceMemoryFailsTheLaunch) {
  const std::vector<float> host_keys(8, 1.0f);
  p_.k = host_keys.data();
  ::testing::internal::CaptureStderr();
  const absl::Status s = Launch();
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(s.message().find("cudaErrorIllegalAddress"), std::string::npos) << s;
  EXPECT_NE(said.find("MaterializedKernel: AttentionParams::k (argument 0) (0x"), std::string::npos)
      << said;
  EXPECT_NE(said.find(") is not in device memory"), std::string::npos) << said;
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(HostCopy(out_, 4), std::vector<float>(4, 0.0f));  // nothing ran
}

using CudaEmulatorStructPointersDeathTest = CudaEmulatorStructPointers;

TEST_F(CudaEmulatorStructPointersDeathTest, ADeclaredOutputMustNotBeReadEarly) {
  ASSERT_TRUE(Launch().ok());
  EXPECT_DEATH(HostCopy(out_, 4),
               "cudaMemcpy's source, on the legacy stream, reads device memory .* that "
               "MaterializedKernel's AttentionParams::out \\(argument 0\\), on a non-blocking "
               "stream, may still be writing");
}

TEST_F(CudaEmulatorStructPointersDeathTest, ADeclaredInputMustNotBeOverwrittenEarly) {
  ASSERT_TRUE(Launch().ok());
  EXPECT_DEATH(WriteInto(q_),
               "cudaMemcpy's destination, on the legacy stream, writes device memory .* that "
               "MaterializedKernel's AttentionParams::q \\(argument 0\\), on a non-blocking "
               "stream, may still be reading");
}

// A struct not declared: each of its words that points into device memory counts as a
// pointer the kernel writes through.
struct CopyPair {
  const float* from;
  int64_t n;
  float* to;
};

void CopyPairKernel(CopyPair p) {
  if (threadIdx.x < p.n) p.to[threadIdx.x] = p.from[threadIdx.x];
}

TEST_F(CudaEmulatorLegacyWriteDeathTest, AnUndeclaredStructsPointersAreWrites) {
  WriteX();
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  ::kvlens_emu::Launch(CopyPairKernel, "CopyPairKernel", 1, 4, 0,
                       stream_)(CopyPair{x_, 4, device_});
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_DEATH(HostCopy(device_, 4),
               "cudaMemcpy's source, on the legacy stream, reads device memory .* that "
               "CopyPairKernel's argument 0, the device pointer at its byte 16, on a "
               "non-blocking stream, may still be writing");
  EXPECT_DEATH(HostCopy(x_, 4), "CopyPairKernel's argument 0, the device pointer at its byte 0");
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(HostCopy(device_, 4), x_values_);
}

using CudaEmulatorPinnedCopyDeathTest = CudaEmulatorPinnedCopy;

TEST_F(CudaEmulatorPinnedCopyDeathTest, WritingAPendingCopysSourceEndsTheProcess) {
  std::memset(pinned_, 0, 16);
  ASSERT_EQ(cudaMemcpyAsync(device_, pinned_, 16, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  EXPECT_DEATH(
      {
        pinned_[1] = 5;  // bytes 4 to 7: 0x40a00000, little-endian, so 6 and 7 change
        cudaStreamSynchronize(stream_);
      },
      "cudaMemcpyAsync of 16 bytes to the device: the host changed byte 6 of its source, .* "
      "before synchronizing with the copy's stream");
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);  // here the host left it alone
}

TEST_F(CudaEmulatorPinnedCopyDeathTest, WritingAPendingCopysDestinationEndsTheProcess) {
  ASSERT_EQ(cudaMemcpyAsync(pinned_, device_, 16, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  EXPECT_DEATH(
      {
        pinned_[3] = 0.0f;  // bytes 12 to 15
        cudaDeviceSynchronize();
      },
      "cudaMemcpyAsync of 16 bytes to the host: the host wrote byte 12 of its destination, "
      ".* before synchronizing with the copy's stream");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // here the host left it alone
  EXPECT_EQ(Pinned(), kValues);
}

}  // namespace
}  // namespace kvlens::kernels::cuda
