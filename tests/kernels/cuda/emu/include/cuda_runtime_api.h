// kvlens CUDA emulator: the subset of the CUDA runtime API that kvlens uses, served by
// tests/kernels/cuda/emu/emu_runtime.cc on the CPU ("device" memory is host memory behind
// guard pages; kernels run as one fiber per CUDA thread). Declared in namespace kvlens_emu
// (so a binary may also link the real libcudart) and made visible to unqualified calls.
// Only the build of the emulated tests puts this folder on the include path.
#ifndef KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_RUNTIME_API_H_
#define KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_RUNTIME_API_H_

#include <cstddef>
#include <cstdint>
#include <functional>

namespace kvlens_emu {

struct uint3 {
  unsigned x, y, z;
};

// vector_types.h: 16-byte aligned, so a misaligned float4 load is reported by UBSan as
// it would fault on a GPU.
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
// 8-byte aligned, as in CUDA (the fused rope's cos and sin).
struct alignas(8) float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
// 8-byte aligned, as in CUDA (a bf16 KV cache's four-element loads).
struct alignas(8) uint2 {
  unsigned int x, y;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return uint4{x, y, z, w};
}

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
};
using cudaError = cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};
constexpr int cudaSharedmemCarveoutMaxShared = 100;

struct CUstream_st;
struct CUevent_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;
constexpr unsigned cudaStreamNonBlocking = 0x01;

// Stream capture and graphs. While a stream captures, launches, cuBLAS calls and async
// copies on it are recorded into the graph instead of run; a call that would synchronise
// (cudaMalloc, cudaFree, cudaMemcpy, cudaStreamSynchronize, …) from the capturing thread
// fails with cudaErrorStreamCaptureUnsupported and invalidates the capture, as under
// cudaStreamCaptureModeGlobal/ThreadLocal on a GPU. A graph replays its nodes in order.
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};
struct CUgraph_st;
struct CUgraphExec_st;
using cudaGraph_t = CUgraph_st*;
using cudaGraphExec_t = CUgraphExec_st*;
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
// For the emulator's launch paths: when `stream` is capturing, appends `node` to its graph
// and returns true (the caller does not run it now).
bool RecordIfCapturing(cudaStream_t stream, std::function<void()> node);
// For tests: the prefetch.global.L2 instructions kernels have executed in this process
// (kernels/cuda/launch.cuh, PrefetchL2), one a thread that issues it.
int64_t PrefetchesIssued();
// For tests: the next `n` calls of cudaMalloc (on any thread) run as usual, and every one
// after them fails (cudaErrorMemoryAllocation, as on a full device) until this is called
// again; n < 0: none fails (the default).
void FailDeviceAllocationsAfter(int64_t n);
// For tests: the next `n` calls of cudaMalloc run as usual, the one after them fails, and
// the rest run (a moment's shortage, as when another process held the memory); n < 0: none.
void FailOneDeviceAllocationAfter(int64_t n);
// The order the emulator runs a launch's blocks in, and a block's threads: of the threads
// that can run, the first in the order runs until it waits at a barrier or exits (so one
// warp may run far ahead of the others, up to a block barrier). A GPU may take any such
// order, so a kernel's results must not depend on it; one that reads what another thread
// writes with no barrier (or atomic hand-over) between them gets whatever the order
// gives, and a test run in another order then fails. kForward: block 0 first, thread 0
// first (the default); kReverse: the last block and the last thread first; kShuffle: the
// blocks, and each block's threads, in an order drawn from `seed`. The process starts
// with KVLENS_EMU_SCHEDULE's (forward, reverse or shuffle:SEED; unset is forward).
enum class Schedule { kForward, kReverse, kShuffle };
void SetSchedule(Schedule schedule, uint64_t seed = 0);
// Back to KVLENS_EMU_SCHEDULE's order (read again at the next launch).
void UseEnvironmentSchedule();

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  size_t sharedMemPerBlockOptin;
  int maxThreadsPerBlock;
  int multiProcessorCount;
  int major, minor;
  int memoryClockRate;  // kHz
  int memoryBusWidth;   // bits
  int l2CacheSize;
};

// The emulated device's limits (those of sm_90: H100/H200).
constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kDefaultDynamicSharedBytes = 48 * 1024;
constexpr size_t kMaxDynamicSharedBytes = 227 * 1024;
constexpr int kNumSms = 4;  // few, so that split-KV attention really splits in tests

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t e);
const char* cudaGetErrorString(cudaError_t e);

cudaError_t cudaMalloc(void** ptr, size_t bytes);
template <typename T>
cudaError_t cudaMalloc(T** ptr, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMallocHost(void** ptr, size_t bytes);
template <typename T>
cudaError_t cudaMallocHost(T** ptr, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(ptr), bytes);
}
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* dst, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream = nullptr);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

cudaError_t FuncSetAttribute(const void* func, cudaFuncAttribute attr, int value);
template <typename F>
cudaError_t cudaFuncSetAttribute(F* func, cudaFuncAttribute attr, int value) {
  return FuncSetAttribute(reinterpret_cast<const void*>(func), attr, value);
}

// Blocks of `func` that fit on one SM: the emulator has no register file to divide, so it
// answers 2 for every kernel (a value the GPU kernels' register counts give on sm_90).
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* num_blocks, const void* func,
                                                          int block_size, size_t shared_bytes);

// For the emulator's own tests: whether [p, p + bytes) lies in one device allocation.
bool IsDeviceRange(const void* p, size_t bytes);
// `who`'s access (a call, or a kernel's pointer `argument`; `who` of static storage) to
// [p, p + bytes) on `stream` (a write, or a read): ends the process with a message naming
// both if, on a GPU, it could run before or while pending work of a stream it is not
// ordered after (a non-blocking stream and any other) touching those bytes, a write there
// or, for a write, a read, which the host has not synchronized with since; then notes it
// as pending until the host synchronizes with `stream` (`record`: false for an access made
// before the call returns). The emulator's launches, copies and cuBLAS call it
// (emu_runtime.cc, Pending).
void AccessDevice(cudaStream_t stream, const void* p, size_t bytes, bool write, const char* who,
                  int argument = -1, bool record = true);

}  // namespace kvlens_emu

using namespace kvlens_emu;  // NOLINT: stands in for the runtime's global declarations

#endif  // KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_RUNTIME_API_H_
