// The CUDA emulator's own contract, each check against values worked out by hand: a block
// barrier orders shared-memory writes before reads; warp shuffles and the block reduction
// of kernels/cuda/reduce.cuh give the exact sums; an all-gather gives every lane its
// (possibly partial) warp's values; mma.sync tiles (mma_sync.cuh, fp16 and bf16) loaded
// by the PTX ISA's fragment formulas multiply like a naive loop; ldmatrix .x4
// (async_copy.cuh), plain and .trans, from static and dynamic shared memory, gives every
// lane the words of the ISA's formulas, and movmatrix .trans (mma_sync.cuh) its row of the
// transpose; ex2.approx.ftz (Exp2Approx, exp2_approx.cuh) flushes subnormal inputs and
// results to zero, as the PTX ISA specifies; cp.async lands a group only at the wait that
// completes it (its destination reads as NaN from the issue to then), zero-fills past its
// source size and drops what a thread leaves queued; a divergent __syncthreads, an oversized block,
// dynamic shared memory over the limit, a host pointer passed as a kernel argument and a
// wrong-direction copy all fail as on a GPU; reading past an allocation faults, and so do
// misaligned or non-shared ldmatrix and cp.async addresses, and so does a warp collective
// whose member mask leaves out lanes of its warp (not emulated); a programmatic launch some
// thread of which never calls griddepcontrol.wait fails; captured work runs only when its
// graph is launched. (The order blocks and threads run in: schedule_checks.cc.)
// clang-format off
#include "tests/kernels/cuda/emu/emu_device.h"  // first: the device keywords reduce.cuh uses
// clang-format on
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/exp2_approx.cuh"
#include "kernels/cuda/mma_sync.cuh"
#include "kernels/cuda/reduce.cuh"
#include "tests/kernels/cuda/emu/emu_copies.h"

namespace kvlens::kernels::cuda {
namespace {

// Sums 1..n with every thread writing its own value to shared memory, then thread 0
// reading them all after the barrier (without it, thread 0 would read NaN/garbage).
void SharedSumKernel(int n, float* out) {
  __shared__ float values[1024];
  values[threadIdx.x] = static_cast<float>(threadIdx.x + 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (int i = 0; i < n; ++i) s += values[i];
    out[blockIdx.x] = s;
  }
}

void ReduceKernel(float* sum, float* max_out) {
  const float v = static_cast<float>(threadIdx.x) - 100.0f;
  const float s = BlockReduce(v, SumOp());
  const float m = BlockReduce(v, MaxOp());
  if (threadIdx.x == 0) {
    *sum = s;
    *max_out = m;
  }
}

void ShuffleKernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x);
  out[lane] = __shfl_xor_sync(0xffffffffu, lane * 10, 5);
  out[32 + lane] = __shfl_down_sync(0xffffffffu, lane, 3);
}

// out[t] = lane (t ^ 1)'s t · 10, shuffled with the member mask `last_mask` in the block's
// last warp, the full mask in the others.
void MaskedShuffleKernel(unsigned last_mask, int* out) {
  const int t = static_cast<int>(threadIdx.x);
  const bool last = t / 32 == static_cast<int>(blockDim.x - 1) / 32;
  out[t] = __shfl_xor_sync(last ? last_mask : 0xffffffffu, t * 10, 1);
}

// Two all-gathers back to back (the second's values differ), each thread writing what it
// got: out[(round * threads + thread) * 32 + lane].
void AllGatherKernel(uint64_t* out) {
  const int t = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  for (int round = 0; round < 2; ++round) {
    ::kvlens_emu::WarpAllGather(static_cast<uint64_t>(t * 10 + round),
                                &out[(round * threads + t) * 32]);
  }
}

void DivergentBarrierKernel(float* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

void EmptyKernel(float*) {}

void ReadPastEndKernel(const float* in, int n, float* out) { out[0] = in[n]; }

// T's value as float (fp16 or bf16).
inline float ToFloat(__half x) { return __half2float(x); }
inline float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

// Two values packed as the tensor cores' operand type, and the product on that type.
inline uint32_t PackAs(__half, float lo, float hi) { return PackHalf2(lo, hi); }
inline uint32_t PackAs(__nv_bfloat16, float lo, float hi) { return PackBf162(lo, hi); }
inline void MmaAs(__half, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  MmaF16(d, a, b);
}
inline void MmaAs(__nv_bfloat16, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  MmaBf16(d, a, b);
}

// D = A·B + 2C for one m16n8k16 tile through kernels/cuda/mma_sync.cuh, every lane
// loading and storing its fragments by the PTX ISA's formulas for element i (row-major A
// [16][16], B [16][8], C and D [16][8]):
//   A: row = g for i in {0, 1, 4, 5}, else g + 8;   col = 2t + (i & 1) + (i >= 4 ? 8 : 0)
//   B: row = 2t + (i & 1) + (i >= 2 ? 8 : 0);         col = g
//   C: row = g + (i >= 2 ? 8 : 0);                    col = 2t + (i & 1)
// T: __half (MmaF16) or __nv_bfloat16 (MmaBf16), the same formulas.
template <typename T>
void MmaSyncKernel(const T* a, const T* b, const float* c, float* d) {
  const int g = threadIdx.x / 4, t = threadIdx.x % 4;
  uint32_t fa[4], fb[2];
  float acc[4];
  for (int i = 0; i < 8; i += 2) {
    const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
    const int col = 2 * t + (i >= 4 ? 8 : 0);
    fa[i / 2] = PackAs(T{}, ToFloat(a[row * 16 + col]), ToFloat(a[row * 16 + col + 1]));
  }
  for (int i = 0; i < 4; i += 2) {
    const int row = 2 * t + (i >= 2 ? 8 : 0);
    fb[i / 2] = PackAs(T{}, ToFloat(b[row * 8 + g]), ToFloat(b[(row + 1) * 8 + g]));
  }
  for (int i = 0; i < 4; ++i) acc[i] = 2.0f * c[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)];
  MmaAs(T{}, acc, fa, fb);
  for (int i = 0; i < 4; ++i) d[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)] = acc[i];
}

// ldmatrix's four 8×8 matrices of 16-bit elements, element (m, row, col) = m·64 + row·8 +
// col, stored with rows kLdStride elements (48 bytes) apart, the padding 0xFFFF.
constexpr int kLdStride = 24;
constexpr int kLdElements = 4 * 8 * kLdStride;

uint32_t LdElement(int m, int row, int col) {
  return static_cast<uint32_t>(m * 64 + row * 8 + col);
}

// One warp loads the matrices from a __shared__ array (or dynamic shared memory) with
// ldmatrix .x4: .trans into out[0, 128), plain into out[128, 256) (lane L's r[i] at
// L * 4 + i). Right after the plain load every lane overwrites the row it addressed: the
// rows must have been read when the whole warp was at the ldmatrix (as on a GPU), not
// when each fiber resumes.
void LdMatrixKernel(bool dynamic, uint32_t* out) {
  __shared__ __align__(16) uint16_t static_tiles[kLdElements];
  uint16_t* tiles = dynamic ? static_cast<uint16_t*>(::kvlens_emu::DynamicShared()) : static_tiles;
  const int lane = static_cast<int>(threadIdx.x);
  for (int e = lane; e < kLdElements; e += 32) tiles[e] = 0xffff;
  __syncwarp();
  for (int e = lane; e < 256; e += 32) {
    tiles[(e / 8) * kLdStride + e % 8] =
        static_cast<uint16_t>(LdElement(e / 64, (e / 8) % 8, e % 8));
  }
  __syncwarp();
  uint16_t* row = &tiles[((lane / 8) * 8 + lane % 8) * kLdStride];  // matrix L / 8, row L % 8
  uint32_t r[4];
  LdMatrixX4<true>(r, row);
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
  LdMatrixX4<false>(r, row);
  for (int c = 0; c < 8; ++c) row[c] = 0;
  for (int i = 0; i < 4; ++i) out[128 + lane * 4 + i] = r[i];
}

// Element (row, col) of the 8×8 matrix MovMatrixKernel transposes.
uint32_t MovElement(int row, int col) { return static_cast<uint32_t>(100 + 8 * row + col); }

// Lane (g, t) passes M[g][2t, 2t+1] to movmatrix and writes what it gets to out[lane].
void MovMatrixKernel(uint32_t* out) {
  const int lane = static_cast<int>(threadIdx.x), g = lane / 4, t = lane % 4;
  out[lane] = MovMatrixTrans(MovElement(g, 2 * t) | MovElement(g, 2 * t + 1) << 16);
}

// out[i] = Exp2Approx(in[i]), a thread an element.
void Exp2ApproxKernel(const float* in, float* out) {
  out[threadIdx.x] = Exp2Approx(in[threadIdx.x]);
}

// Lane 5's row address is 8 bytes past a 16-byte boundary.
void MisalignedLdMatrixKernel(uint32_t* out) {
  auto* rows = static_cast<uint16_t*>(::kvlens_emu::DynamicShared());
  uint32_t r[4];
  LdMatrixX4<false>(r, rows + threadIdx.x * 8 + (threadIdx.x == 5 ? 4 : 0));
  out[threadIdx.x] = r[0];
}

// Every lane addresses a row of device memory instead of shared memory.
void GlobalLdMatrixKernel(uint32_t* out) {
  uint32_t r[4];
  LdMatrixX4<false>(r, out + threadIdx.x * 4);
  out[threadIdx.x] = r[0];
}

// cp.async from src + offset (in 32-bit words) to dynamic shared memory + offset.
void CpAsyncAtKernel(const uint32_t* src, int src_offset, int dst_offset) {
  auto* smem = static_cast<uint32_t*>(::kvlens_emu::DynamicShared());
  CpAsync16(smem + dst_offset, src + src_offset, 16);
}

// A cp.async into a thread's local array (its stack), not shared memory.
void CpAsyncToLocalKernel(const uint32_t* src, uint32_t* out) {
  alignas(16) uint32_t local[4] = {};
  CpAsync16(local, src, 16);
  CpAsyncCommit();
  CpAsyncWait<0>();
  out[0] = local[0];
}

// Each of 32 threads owns five 16-byte slots (4 words each) of dynamic shared memory and
// the same five of src; it copies slot 0 (16 bytes) and slot 2 (source size 0: zeros, src
// not read) in group A, slot 1 (16 bytes) and slot 3 (source size 8: two words, two zero
// words) in group B, and slot 4 in a group it commits only after the second wait. Its 20
// words go to out[stage][thread] (kCpWords each) at each stage: 0 before any wait, 1 after
// CpAsyncWait<1>, 2 after CpAsyncWait<0>, 3 after committing and waiting for slot 4. Then,
// after a __syncthreads, thread 0 writes thread 31's slots to out[4][0].
constexpr int kCpWords = 20;

void CpAsyncKernel(const uint32_t* src, uint32_t* out) {
  auto* smem = static_cast<uint32_t*>(::kvlens_emu::DynamicShared());
  const int t = static_cast<int>(threadIdx.x);
  uint32_t* mine = smem + t * kCpWords;
  const uint32_t* from = src + t * kCpWords;
  auto write_out = [&](int stage, const uint32_t* words) {
    for (int w = 0; w < kCpWords; ++w) out[(stage * 32 + t) * kCpWords + w] = words[w];
  };
  CpAsync16(mine + 0, from + 0, 16);  // group A
  CpAsync16(mine + 8, nullptr, 0);
  CpAsyncCommit();
  CpAsync16(mine + 4, from + 4, 16);  // group B
  CpAsync16(mine + 12, from + 12, 8);
  CpAsyncCommit();
  CpAsync16(mine + 16, from + 16, 16);  // not committed yet
  write_out(0, mine);
  CpAsyncWait<1>();
  write_out(1, mine);
  CpAsyncWait<0>();
  write_out(2, mine);
  CpAsyncCommit();
  CpAsyncWait<0>();
  write_out(3, mine);
  __syncthreads();
  if (t == 0) {
    for (int w = 0; w < kCpWords; ++w) out[4 * 32 * kCpWords + w] = smem[31 * kCpWords + w];
  }
}

// Block 0 queues and commits a copy but exits without waiting; block 1 (the same fibers,
// re-created) waits for everything and reads the slot: still NaN, nothing carried over.
void CpAsyncDroppedKernel(const uint32_t* src, uint32_t* out) {
  auto* smem = static_cast<uint32_t*>(::kvlens_emu::DynamicShared());
  if (blockIdx.x == 0) {
    CpAsync16(smem, src, 16);
    CpAsyncCommit();
    return;
  }
  CpAsyncWait<0>();
  out[0] = smem[0];
}

// A destination that held data reads as NaN once a copy into it is issued (the copy is in
// flight), and as the source after the wait: out = {before, in flight, landed}.
void CpAsyncInFlightKernel(const uint32_t* src, uint32_t* out) {
  auto* smem = static_cast<uint32_t*>(::kvlens_emu::DynamicShared());
  smem[0] = 7;
  out[0] = smem[0];
  CpAsync16(smem, src, 16);
  CpAsyncCommit();
  out[1] = smem[0];
  CpAsyncWait<0>();
  out[2] = smem[0];
}

// Launched as kernels/cuda/launch.cuh launches (programmatic dependent launch): thread 5
// forgets griddepcontrol.wait.
void GridWaitKernel(float* out) {
  if (threadIdx.x != 5) ::kvlens_emu::GridDependencyWait();
  out[threadIdx.x] = 1.0f;
}

TEST(CudaEmulator, CpAsyncDestinationIsNaNWhileInFlight) {
  uint32_t* src = DeviceCopy(std::vector<uint32_t>{41, 42, 43, 44});
  uint32_t* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, 3 * sizeof(uint32_t)), cudaSuccess);
  ::kvlens_emu::Launch(CpAsyncInFlightKernel, "CpAsyncInFlightKernel", 1, 1, 16)(src, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(HostCopy(out, 3), (std::vector<uint32_t>{7, 0xffffffffu, 41}));
  cudaFree(src);
  cudaFree(out);
}

TEST(CudaEmulator, AProgrammaticLaunchWithoutTheGridWaitFails) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 32 * sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(GridWaitKernel, "GridWaitKernel", 1, 32, 0, nullptr)(d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // an ordinary launch need not wait
  ::kvlens_emu::Launch(GridWaitKernel, "GridWaitKernel", 1, 32, 0, nullptr,
                       /*requires_grid_wait=*/true)(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  cudaFree(d);
}

TEST(CudaEmulator, BarrierOrdersSharedMemoryAcrossThreadsAndBlocks) {
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, 3 * sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(SharedSumKernel, "SharedSumKernel", 3, 200)(200, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (float v : HostCopy(out, 3)) EXPECT_EQ(v, 200.0f * 201.0f / 2.0f);  // 20100
  cudaFree(out);
}

TEST(CudaEmulator, BlockReduceGivesExactSumAndMax) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 2 * sizeof(float)), cudaSuccess);
  // 96 threads (3 warps): Σ (t − 100) for t < 96 = 4560 − 9600 = −5040; max = −5.
  ::kvlens_emu::Launch(ReduceKernel, "ReduceKernel", 1, 96)(d, d + 1);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> h = HostCopy(d, 2);
  EXPECT_EQ(h[0], -5040.0f);
  EXPECT_EQ(h[1], -5.0f);
  cudaFree(d);
}

TEST(CudaEmulator, ShufflesReadTheNamedLane) {
  int* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(int)), cudaSuccess);
  ::kvlens_emu::Launch(ShuffleKernel, "ShuffleKernel", 1, 32)(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<int> h = HostCopy(d, 64);
  for (int lane = 0; lane < 32; ++lane) {
    EXPECT_EQ(h[lane], (lane ^ 5) * 10) << lane;
    EXPECT_EQ(h[32 + lane], lane + 3 < 32 ? lane + 3 : lane) << lane;  // past the end: own
  }
  cudaFree(d);
}

TEST(CudaEmulator, WarpAllGatherGivesEveryLaneTheWholeWarp) {
  uint64_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 2 * 48 * 32 * sizeof(uint64_t)), cudaSuccess);
  ::kvlens_emu::Launch(AllGatherKernel, "AllGatherKernel", 1, 48)(d);  // warp 1: 16 lanes
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint64_t> h = HostCopy(d, 2 * 48 * 32);
  for (int round = 0; round < 2; ++round) {
    for (int t = 0; t < 48; ++t) {
      const int warp_start = t / 32 * 32, lanes = t < 32 ? 32 : 16;
      for (int l = 0; l < 32; ++l) {
        const uint64_t want = l < lanes ? static_cast<uint64_t>((warp_start + l) * 10 + round) : 0;
        EXPECT_EQ(h[(round * 48 + t) * 32 + l], want) << round << ", " << t << ", " << l;
      }
    }
  }
  cudaFree(d);
}

// Runs `kernel` (one warp: D = A·B + 2C by mma.sync) on A [16][16] and B [16][8] whose
// values are exactly fa and fb, and checks D against the naive product (exact: small
// integers, up to a power of two).
template <typename T>
void ExpectMmaTileEqualsNaive(void (*kernel)(const T*, const T*, const float*, float*),
                              const char* name, const std::vector<T>& a, const std::vector<T>& b,
                              const std::vector<float>& fa, const std::vector<float>& fb,
                              const std::vector<float>& c) {
  T* da = DeviceCopy(a);
  T* db = DeviceCopy(b);
  float* dc = DeviceCopy(c);
  float* dd = nullptr;
  ASSERT_EQ(cudaMalloc(&dd, 128 * sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(kernel, name, 1, 32)(da, db, dc, dd);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> d = HostCopy(dd, 128);
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 8; ++n) {
      float want = 2.0f * c[r * 8 + n];
      for (int k = 0; k < 16; ++k) want += fa[r * 16 + k] * fb[k * 8 + n];
      EXPECT_EQ(d[r * 8 + n], want) << name << " " << r << ", " << n;
    }
  }
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
  cudaFree(dd);
}

TEST(CudaEmulator, MmaSyncTileEqualsNaiveProduct) {
  std::vector<__half> a(256), b(128);
  std::vector<float> c(128), fa(256), fb(128);
  for (int i = 0; i < 256; ++i) {
    a[i] = __float2half_rn(static_cast<float>((i * 7) % 13) - 6.0f);  // small integers:
    fa[i] = __half2float(a[i]);                                       // exact in fp16/fp32
  }
  for (int i = 0; i < 128; ++i) {
    b[i] = __float2half_rn(static_cast<float>((i * 5) % 11) - 5.0f);
    fb[i] = __half2float(b[i]);
    c[i] = static_cast<float>(i % 9);
  }
  ExpectMmaTileEqualsNaive(MmaSyncKernel<__half>, "MmaSyncKernel<__half>", a, b, fa, fb, c);
}

TEST(CudaEmulator, MmaSyncBf16TileEqualsNaiveProduct) {
  std::vector<__nv_bfloat16> a(256), b(128);
  std::vector<float> c(128), fa(256), fb(128);
  for (int i = 0; i < 256; ++i) {
    // Small integers times 2^16 (beyond fp16's range), exact in bf16, as are the products
    // and their sums in fp32.
    fa[i] = (static_cast<float>((i * 7) % 13) - 6.0f) * 65536.0f;
    a[i] = __float2bfloat16_rn(fa[i]);
    ASSERT_EQ(__bfloat162float(a[i]), fa[i]);
  }
  for (int i = 0; i < 128; ++i) {
    fb[i] = (static_cast<float>((i * 5) % 11) - 5.0f) / 16.0f;
    b[i] = __float2bfloat16_rn(fb[i]);
    ASSERT_EQ(__bfloat162float(b[i]), fb[i]);
    c[i] = static_cast<float>(i % 9);
  }
  ExpectMmaTileEqualsNaive(MmaSyncKernel<__nv_bfloat16>, "MmaSyncKernel<__nv_bfloat16>", a, b, fa,
                           fb, c);
}

TEST(CudaEmulator, LdMatrixGivesEachLaneTheIsaFragments) {
  uint32_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 256 * sizeof(uint32_t)), cudaSuccess);
  for (const bool dynamic : {false, true}) {
    SCOPED_TRACE(dynamic ? "dynamic shared memory" : "__shared__ array");
    ::kvlens_emu::Launch(LdMatrixKernel, "LdMatrixKernel", 1, 32,
                         dynamic ? kLdElements * sizeof(uint16_t) : 0)(dynamic, d);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<uint32_t> h = HostCopy(d, 256);
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int i = 0; i < 4; ++i) {
        // .trans: M_i[2t][g], M_i[2t+1][g]; plain: M_i[g][2t], M_i[g][2t+1] (low half first).
        EXPECT_EQ(h[lane * 4 + i], LdElement(i, 2 * t, g) | LdElement(i, 2 * t + 1, g) << 16)
            << "trans, lane " << lane << ", r[" << i << "]";
        EXPECT_EQ(h[128 + lane * 4 + i], LdElement(i, g, 2 * t) | LdElement(i, g, 2 * t + 1) << 16)
            << "plain, lane " << lane << ", r[" << i << "]";
      }
    }
  }
  cudaFree(d);
}

TEST(CudaEmulator, MovMatrixGivesEachLaneItsRowOfTheTranspose) {
  uint32_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 32 * sizeof(uint32_t)), cudaSuccess);
  ::kvlens_emu::Launch(MovMatrixKernel, "MovMatrixKernel", 1, 32)(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint32_t> h = HostCopy(d, 32);
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    // Mᵀ[g][2t, 2t+1] = M[2t][g], M[2t+1][g] (low half first).
    EXPECT_EQ(h[lane], MovElement(2 * t, g) | MovElement(2 * t + 1, g) << 16) << "lane " << lane;
  }
  // A warp of 16 lanes is not a full warp's collective.
  EXPECT_DEATH(::kvlens_emu::Launch(MovMatrixKernel, "MovMatrixKernel", 1, 16)(d),
               "movmatrix: a warp collective of all 32 lanes, run in a warp of 16 threads");
  cudaFree(d);
}

TEST(CudaEmulator, Exp2ApproxFlushesSubnormalInputsAndResultsToZero) {
  // Powers of two from the definition; 2^-126 is float's smallest normal (kept), 2^-127
  // and 2^-149 are subnormal (flushed to 0, where exp2f would give them); an input of
  // 1e-40 (subnormal) is read as 0 (2^0 = 1, as exp2f gives too).
  const std::vector<float> in = {0.0f,    -3.0f,  10.0f,     -126.0f,  -127.0f,
                                 -149.0f, 1e-40f, -INFINITY, INFINITY, NAN};
  const std::vector<float> want = {
      1.0f, 0.125f, 1024.0f, std::ldexp(1.0f, -126), 0.0f, 0.0f, 1.0f, 0.0f, INFINITY, NAN};
  const int n = static_cast<int>(in.size());
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 2 * n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d, in.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ::kvlens_emu::Launch(Exp2ApproxKernel, "Exp2ApproxKernel", 1, n)(d, d + n);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> h = HostCopy(d + n, n);
  for (int i = 0; i < n; ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(h[i])) << "2^" << in[i];
    } else {
      EXPECT_EQ(h[i], want[i]) << "2^" << in[i];
    }
  }
  cudaFree(d);
}

TEST(CudaEmulator, CpAsyncLandsAGroupAtItsWait) {
  std::vector<uint32_t> src(32 * kCpWords);
  for (size_t i = 0; i < src.size(); ++i) src[i] = 0x01000000u + static_cast<uint32_t>(i);
  uint32_t* dsrc = DeviceCopy(src);
  uint32_t* dout = nullptr;
  const size_t out_words = (4 * 32 + 1) * kCpWords;
  ASSERT_EQ(cudaMalloc(&dout, out_words * sizeof(uint32_t)), cudaSuccess);
  ::kvlens_emu::Launch(CpAsyncKernel, "CpAsyncKernel", 1, 32, 32 * kCpWords * 4)(dsrc, dout);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint32_t> out = HostCopy(dout, out_words);
  constexpr uint32_t kNaN = 0xffffffffu;  // dynamic shared memory before any copy lands
  for (int t = 0; t < 32; ++t) {
    const uint32_t* s = &src[static_cast<size_t>(t) * kCpWords];
    // Slots 0 (A, 16 bytes), 1 (B, 16 bytes), 2 (A, source size 0), 3 (B, source size 8),
    // 4 (committed after the second wait); each stage as the kernel's comment says.
    auto slot0 = [&](int w) { return s[w]; };
    auto slot1 = [&](int w) { return s[4 + w]; };
    auto slot3 = [&](int w) { return w < 2 ? s[12 + w] : 0u; };
    auto slot4 = [&](int w) { return s[16 + w]; };
    const std::vector<std::vector<uint32_t>> want = [&] {
      std::vector<std::vector<uint32_t>> stages(5, std::vector<uint32_t>(kCpWords, kNaN));
      for (int w = 0; w < 4; ++w) {
        stages[1][w] = slot0(w);
        stages[1][8 + w] = 0;
        for (int stage = 2; stage <= 3; ++stage) {
          stages[stage][w] = slot0(w);
          stages[stage][4 + w] = slot1(w);
          stages[stage][8 + w] = 0;
          stages[stage][12 + w] = slot3(w);
        }
        stages[3][16 + w] = slot4(w);
      }
      return stages;
    }();
    for (int stage = 0; stage < 4; ++stage) {
      for (int w = 0; w < kCpWords; ++w) {
        EXPECT_EQ(out[(static_cast<size_t>(stage) * 32 + t) * kCpWords + w], want[stage][w])
            << "thread " << t << ", stage " << stage << ", word " << w;
      }
    }
    if (t == 31) {  // thread 0's view of thread 31's slots after the __syncthreads
      for (int w = 0; w < kCpWords; ++w) {
        EXPECT_EQ(out[4 * 32 * kCpWords + w], want[3][w]) << "thread 0 reading 31, word " << w;
      }
    }
  }
  ::kvlens_emu::Launch(CpAsyncDroppedKernel, "CpAsyncDroppedKernel", 2, 1, 16)(dsrc, dout);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(HostCopy(dout, 1)[0], kNaN);
  cudaFree(dsrc);
  cudaFree(dout);
}

TEST(CudaEmulator, DivergentSyncthreadsIsALaunchFailure) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(DivergentBarrierKernel, "DivergentBarrierKernel", 1, 64)(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // read once, then cleared
  cudaFree(d);
}

TEST(CudaEmulator, BadConfigurationsFailLikeAGpu) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 4), cudaSuccess);
  ::kvlens_emu::Launch(EmptyKernel, "EmptyKernel", 1, 1025)(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  ::kvlens_emu::Launch(EmptyKernel, "EmptyKernel", 1, 32, 64 * 1024)(d);  // > 48 KiB
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  ASSERT_EQ(
      cudaFuncSetAttribute(EmptyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024),
      cudaSuccess);
  ::kvlens_emu::Launch(EmptyKernel, "EmptyKernel", 1, 32, 64 * 1024)(d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  float host = 0;
  ::kvlens_emu::Launch(EmptyKernel, "EmptyKernel", 1, 32)(&host);  // a host pointer
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  cudaFree(d);
}

TEST(CudaEmulator, CopiesCheckTheirDirectionAndBounds) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 16 * sizeof(float)), cudaSuccess);
  std::vector<float> h(32, 1.0f);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 16 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 17 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);  // one float past the allocation
  EXPECT_EQ(cudaMemcpy(h.data(), d, 16 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);  // reversed
  EXPECT_EQ(cudaMemset(h.data(), 0, 4), cudaErrorInvalidValue);
  cudaGetLastError();
  EXPECT_EQ(cudaFree(h.data()), cudaErrorInvalidValue);
  cudaGetLastError();
  // Fresh device memory reads as NaN, like the garbage a GPU would return.
  float* fresh = nullptr;
  ASSERT_EQ(cudaMalloc(&fresh, sizeof(float)), cudaSuccess);
  EXPECT_TRUE(std::isnan(HostCopy(fresh, 1)[0]));
  cudaFree(fresh);
  cudaFree(d);
}

void AddOneKernel(float* x) { x[threadIdx.x] += 1.0f; }

// Stream capture: launches and copies on a capturing stream run only when the graph is
// launched (each launch again, the copy reading its source then); a call that would
// synchronise fails and invalidates the capture, as on a GPU.
TEST(CudaEmulator, CapturedWorkRunsWhenTheGraphIsLaunched) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 2 * sizeof(float)), cudaSuccess);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 2 * sizeof(float)), cudaSuccess);
  pinned[0] = 10.0f;
  pinned[1] = 20.0f;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d, pinned, 2 * sizeof(float), cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  ::kvlens_emu::Launch(AddOneKernel, "AddOneKernel", 1, 2, 0, stream)(d);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  EXPECT_TRUE(std::isnan(HostCopy(d, 2)[0]));  // nothing ran yet
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 2), (std::vector<float>{11.0f, 21.0f}));
  pinned[0] = 30.0f;  // the next launch copies the new value
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 2), (std::vector<float>{31.0f, 21.0f}));

  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  float* more = nullptr;
  EXPECT_EQ(cudaMalloc(&more, 4), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaErrorStreamCaptureUnsupported);
  cudaGraph_t refused = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &refused), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(refused, nullptr);
  cudaGetLastError();
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // out of capture again
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFreeHost(pinned);
  cudaFree(d);
  cudaStreamDestroy(stream);
}

TEST(CudaEmulatorDeathTest, ReadingPastAnAllocationFaults) {
  float* in = nullptr;
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&in, 64 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(ReadPastEndKernel, "ReadPastEndKernel", 1, 1)(in, 63, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  // Without ASan: a guard page right after the allocation's 256 bytes (SIGSEGV). With
  // ASan: every byte past the 64 floats is poisoned, and ASan names the overflow.
#ifdef __SANITIZE_ADDRESS__
  constexpr char kReport[] = "heap-buffer-overflow";
#else
  constexpr char kReport[] = "";
#endif
  EXPECT_DEATH(::kvlens_emu::Launch(ReadPastEndKernel, "ReadPastEndKernel", 1, 1)(in, 64, out),
               kReport);
  cudaFree(in);
  cudaFree(out);
}

// A warp collective's member mask names the lanes taking part; the emulator runs whole
// warps only, so it takes the full mask, or exactly a partial warp's lanes, and ends the
// process on any other rather than shuffling as if the mask were full.
TEST(CudaEmulatorDeathTest, AWarpCollectiveRunsOnlyWithTheWholeWarpsMask) {
  int* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 48 * sizeof(int)), cudaSuccess);
  // 48 threads: a full warp, then one of 16 lanes, named by 0xffff or by the full mask.
  for (unsigned last_mask : {0x0000ffffu, 0xffffffffu}) {
    ::kvlens_emu::Launch(MaskedShuffleKernel, "MaskedShuffleKernel", 1, 48)(last_mask, d);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<int> got = HostCopy(d, 48);
    for (int t = 0; t < 48; ++t) EXPECT_EQ(got[static_cast<size_t>(t)], (t ^ 1) * 10) << t;
  }
  EXPECT_DEATH(
      ::kvlens_emu::Launch(MaskedShuffleKernel, "MaskedShuffleKernel", 1, 32)(0x0000ffffu, d),
      "__shfl_xor_sync: member mask 0x0000ffff, the warp's lanes 0xffffffff: the emulator runs "
      "only collectives of the whole warp");
  EXPECT_DEATH(
      ::kvlens_emu::Launch(MaskedShuffleKernel, "MaskedShuffleKernel", 1, 48)(0x000000ffu, d),
      "member mask 0x000000ff, the warp's lanes 0x0000ffff");
  cudaFree(d);
}

// A GPU faults on a misaligned ldmatrix or cp.async address (cudaErrorMisalignedAddress)
// and on one outside the state space the instruction names; the emulator ends the process
// with a message naming the instruction and the address.
TEST(CudaEmulatorDeathTest, MisalignedOrNonSharedLdMatrixAndCpAsyncAbort) {
  uint32_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 256 * sizeof(uint32_t)), cudaSuccess);
  EXPECT_DEATH(::kvlens_emu::Launch(MisalignedLdMatrixKernel, "MisalignedLdMatrixKernel", 1, 32,
                                    32 * 16 + 16)(d),
               "ldmatrix: row address 0x[0-9a-f]+ is not 16-byte aligned");
  EXPECT_DEATH(::kvlens_emu::Launch(GlobalLdMatrixKernel, "GlobalLdMatrixKernel", 1, 32)(d),
               "ldmatrix: row address 0x[0-9a-f]+ is not 16 bytes of shared memory");
  EXPECT_DEATH(::kvlens_emu::Launch(CpAsyncAtKernel, "CpAsyncAtKernel", 1, 1, 64)(d, 0, 2),
               "cp.async: destination 0x[0-9a-f]+ is not 16-byte aligned");
  EXPECT_DEATH(::kvlens_emu::Launch(CpAsyncAtKernel, "CpAsyncAtKernel", 1, 1, 64)(d, 1, 0),
               "cp.async: source 0x[0-9a-f]+ is not 16-byte aligned");
  EXPECT_DEATH(::kvlens_emu::Launch(CpAsyncAtKernel, "CpAsyncAtKernel", 1, 1, 64)(d, 0, 16),
               "cp.async: destination 0x[0-9a-f]+ is not 16 bytes of shared memory");
  EXPECT_DEATH(::kvlens_emu::Launch(CpAsyncAtKernel, "CpAsyncAtKernel", 1, 1, 64)(d, 256, 0),
               "cp.async: source 0x[0-9a-f]+ is not 16 bytes of device memory");
  EXPECT_DEATH(::kvlens_emu::Launch(CpAsyncToLocalKernel, "CpAsyncToLocalKernel", 1, 1)(d, d),
               "cp.async: destination 0x[0-9a-f]+ is not 16 bytes of shared memory");
  cudaFree(d);
}

}  // namespace
}  // namespace kvlens::kernels::cuda
