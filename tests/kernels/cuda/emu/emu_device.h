// kvlens CUDA emulator, device side: force-included (g++ -include) into kernels/cuda/*.cu
// after translate_cu.sh has rewritten their two non-C++ constructs (kernel<<<…>>>(…)
// launches and `extern __shared__` arrays). Each CUDA thread of a block runs as a fiber on
// the launching host thread; __syncthreads and warp collectives are real barriers between
// those fibers, so a divergent barrier deadlocks here as on a GPU, and is reported.
// `__shared__` variables become function statics: shared by the threads of a block (blocks
// run one after another). Dynamic shared memory is refilled with 0xFF (NaN) per block.
// The PTX the kernels reach through inline assembly on a GPU is emulated here too:
// mma.sync m16n8k16 with fp16 or bf16 inputs (MmaM16N8K16F16, MmaM16N8K16BF16),
// ldmatrix .x4 (LdMatrixX4, a warp collective reading the rows when the whole warp is at
// it) and cp.async (CpAsync16, CpAsyncCommit, CpAsyncWait: each thread's copies are queued
// and land only at the wait that completes their group; the destination reads as NaN
// from the issue until then), and griddepcontrol.wait (GridDependencyWait: kernels run one
// after another, so it only records that the thread waited, which a programmatic launch
// requires of every thread). Misaligned ldmatrix or cp.async addresses, and
// ones outside shared (destination) or device (cp.async source) memory, abort the process
// with a message, where a GPU would fault.
#ifndef KVLENS_TESTS_KERNELS_CUDA_EMU_EMU_DEVICE_H_
#define KVLENS_TESTS_KERNELS_CUDA_EMU_EMU_DEVICE_H_

#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
// translate_cu.sh moves kernels/cuda's kernels' bounds into their bodies
// (ExceedsLaunchBounds), in its .cu files and .cuh headers alike.
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict

namespace kvlens_emu {

struct ThreadContext {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};

// The emulated thread running on this host thread.
const ThreadContext& Ctx();
void SyncThreads();
void SyncWarp();
// Warp collective: every lane passes its value's bits and gets lane src_lane's.
uint64_t WarpExchange(uint64_t bits, int src_lane);
// Warp collective: every lane passes its value's bits and gets all of them, lane l's in
// out32[l] (0 for lanes past the end of a partial warp).
void WarpAllGather(uint64_t bits, uint64_t* out32);
int LaneId();
// A warp collective's member mask: the emulator runs collectives of the whole warp only,
// so a mask must name every lane of it (0xffffffff, or exactly a partial warp's lanes);
// any other faults, naming the instruction, rather than being run as if it were full.
void CheckWarpMask(const char* instruction, unsigned mask);
// Warp collective: bit l set where lane l's pred holds; *present the lanes of this warp.
uint32_t WarpBallot(bool pred, uint32_t* present);
void* DynamicShared();
// 768 floats per warp for the tensor-core emulation (MmaM16N8K16).
float* WarpScratch();

struct LaunchConfig {
  const void* func;
  const char* name;
  dim3 grid, block;
  size_t shared_bytes;
  cudaStream_t stream;
  // Launched as a programmatic dependent launch may be (kernels/cuda/launch.cuh): every
  // thread must call griddepcontrol.wait (GridDependencyWait) before it exits, else the
  // launch fails, since on a GPU it could have read its inputs before they were written.
  bool requires_grid_wait = false;
};

// A kernel's __launch_bounds__(max_threads, …), which translate_cu.sh makes the first
// statement of its body: true, and the thread returns at once, where the block has more
// threads than max_threads; the launch then fails with cudaErrorLaunchOutOfResources, as
// a GPU refuses it, having run nothing. (The other bounds, minimum blocks an SM and
// blocks a cluster, set ptxas's register budget: nothing to check here.)
bool ExceedsLaunchBounds(int max_threads, int min_blocks = 0, int max_blocks_per_cluster = 0);

// A `__shared__` variable of a kernels/cuda .cu file or .cuh header, which translate_cu.sh
// declares with this call after it: its bytes count towards the kernel's static shared
// memory (once, however many threads declare it), which the launch checks count with the
// dynamic: within 48 KiB together unless the kernel opted in (learned from a kernel's
// first launch, which fails after its block if it then turns out too large; later
// launches, before running). The block's first declaration fills it with NaN (0xFF
// bytes), as a block's dynamic shared memory starts: a GPU's starts undefined.
void StaticShared(void* variable, size_t bytes);

// Runs body once per thread of every block (sets the last error on a bad configuration,
// a pointer argument outside device memory, or a barrier deadlock).
void RunGrid(const LaunchConfig& config, const std::function<void()>& body);
// Records cudaErrorIllegalAddress (and says why) unless p is null or in device memory;
// else the launch accesses the rest of p's allocation (AccessDevice), a write where the
// kernel `writes` through p (a pointer to non-const data).
bool CheckPointerArgument(const LaunchConfig& config, int index, const void* p, bool writes);
// The same for the device pointers a kernel argument of class type (a parameter struct,
// `bytes` long at `arg`) carries: a declared struct's pointer fields, each a read or a
// write as declared (emu_struct_pointers.h); for another struct every 8-byte-aligned word
// that points into device memory, each taken as a write.
bool CheckStructArgument(const LaunchConfig& config, int index, const void* arg, size_t bytes,
                         const std::type_info& type);

template <typename... P>
class Launcher {
 public:
  Launcher(void (*func)(P...), LaunchConfig config) : func_(func), config_(config) {}

  template <typename... A>
  void operator()(A&&... args) const {
    std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    if (RecordIfCapturing(config_.stream, [self = *this, params] { self.Run(params); })) return;
    Run(params);
  }

 private:
  void Run(const std::tuple<std::decay_t<P>...>& params) const {
    if (!CheckPointers(params, std::index_sequence_for<P...>())) return;
    RunGrid(config_, [&] { std::apply(func_, params); });
  }

  template <typename Tuple, size_t... I>
  bool CheckPointers(const Tuple& t, std::index_sequence<I...>) const {
    bool ok = true;
    (
        [&] {
          using Param = std::tuple_element_t<I, Tuple>;
          if constexpr (std::is_pointer_v<Param>) {
            if (ok) {
              ok = CheckPointerArgument(config_, static_cast<int>(I),
                                        reinterpret_cast<const void*>(std::get<I>(t)),
                                        !std::is_const_v<std::remove_pointer_t<Param>>);
            }
          } else if constexpr (std::is_class_v<Param>) {
            if (ok) {
              ok = CheckStructArgument(config_, static_cast<int>(I), &std::get<I>(t), sizeof(Param),
                                       typeid(Param));
            }
          }
        }(),
        ...);
    return ok;
  }

  void (*func_)(P...);
  LaunchConfig config_;
};

template <typename... P>
Launcher<P...> Launch(void (*func)(P...), const char* name, dim3 grid, dim3 block,
                      size_t shared_bytes = 0, cudaStream_t stream = nullptr,
                      bool requires_grid_wait = false) {
  return Launcher<P...>(func, {reinterpret_cast<const void*>(func), name, grid, block, shared_bytes,
                               stream, requires_grid_wait});
}

// griddepcontrol.wait: kernels run one after another here, so there is nothing to wait
// for; it records that the thread waited (see LaunchConfig::requires_grid_wait).
void GridDependencyWait();
// prefetch.global.L2 (kernels/cuda/launch.cuh): nothing to bring in here; a GPU drops a
// prefetch of an address outside device memory silently, but here it is a fault, so that a
// kernel prefetching the wrong bytes fails its tests.
void PrefetchL2(const void* global);

// The bits of `from` read as a To (the __*_as_* intrinsics).
template <typename To, typename From>
To BitCast(From from) {
  static_assert(sizeof(To) == sizeof(From) && std::is_trivially_copyable_v<From>);
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

template <typename T>
T Exchange(T v, int src_lane) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = WarpExchange(bits, src_lane);
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// PTX `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`
// (kernels/cuda/mma_sync.cuh): d += a·b for a 16×16 A, a 16×8 B (16-bit elements, fp16 or
// bf16) and a 16×8 fp32 accumulator, with the fragment layout of the PTX ISA ("Matrix
// Fragments for mma.m16n8k16 with floating point type"). With g = lane / 4 and
// t = lane % 4, the lane holds
//   a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]
//   a[3] = A[g+8][2t+8, 2t+9]                       (low half first in each register)
//   b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   d[0..1] = D[g][2t, 2t+1]   d[2..3] = D[g+8][2t, 2t+1]
// A warp collective: the lanes pool A and B in the warp's scratch, each computes its four
// outputs in fp32 (products of fp16 or bf16 values are exact in fp32), and the warp meets
// again before the scratch is reused. `decode` turns a 16-bit element's bits into a float.
template <typename Decode>
inline void MmaM16N8K16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                        Decode decode) {
  auto half = [&](uint32_t reg, int upper) {
    return decode(static_cast<uint16_t>(reg >> (16 * upper)));
  };
  float* s = WarpScratch();  // A [16][16], B [16][8]
  const int g = LaneId() / 4, t = LaneId() % 4;
  for (int e = 0; e < 2; ++e) {
    s[g * 16 + 2 * t + e] = half(a[0], e);
    s[(g + 8) * 16 + 2 * t + e] = half(a[1], e);
    s[g * 16 + 2 * t + 8 + e] = half(a[2], e);
    s[(g + 8) * 16 + 2 * t + 8 + e] = half(a[3], e);
    s[256 + (2 * t + e) * 8 + g] = half(b[0], e);
    s[256 + (2 * t + 8 + e) * 8 + g] = half(b[1], e);
  }
  SyncWarp();
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc += s[row * 16 + k] * s[256 + k * 8 + col];
    out[e] = acc;
  }
  SyncWarp();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

// fp16 inputs.
inline void MmaM16N8K16F16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  MmaM16N8K16(d, a, b, [](uint16_t h) { return __half2float(__ushort_as_half(h)); });
}

// bf16 inputs: a bf16 is the upper half of a float's bits.
inline void MmaM16N8K16BF16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  MmaM16N8K16(d, a, b, [](uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  });
}

// PTX `movmatrix.sync.aligned.m8n8.trans.b16` (kernels/cuda/mma_sync.cuh), a warp
// collective (full warps only): with g = lane / 4 and t = lane % 4, lane (g, t) passes
// M[g][2t, 2t+1] of an 8×8 matrix of 16-bit elements and receives M[2t][g], M[2t+1][g]
// (low half first), row g of Mᵀ as the same lane would hold row g of M. Element g of rows
// 2t and 2t+1 comes from lanes 8t + g/2 and 8t + 4 + g/2, half g % 2 of their words.
uint32_t MovMatrixTrans(uint32_t a);

// PTX `ldmatrix.sync.aligned.m8n8.x4{,.trans}.shared.b16`, a warp collective (full warps
// only): lane L gives the address of row L % 8 of matrix L / 8 (eight 16-bit elements, 16
// bytes, 16-byte aligned, in shared memory), and with g = lane / 4, t = lane % 4 receives
// in r[i] (first element in the low half)
//   trans = false: M_i[g][2t], M_i[g][2t+1]     trans = true: M_i[2t][g], M_i[2t+1][g]
// The rows are read once the whole warp is at the collective.
void LdMatrixX4(uint32_t (&r)[4], const void* row_address, bool trans);

// PTX `cp.async.cg.shared.global` of 16 bytes with a source size: copies src_bytes (0 to
// 16) of src_global (device memory, not read when 0) and zero-fills the rest of the 16
// bytes at dst_shared (shared memory); both 16-byte aligned. Per thread, deferred: the
// copy (of the source as it is now) is queued in the thread's open group, CpAsyncCommit
// closes that group (possibly empty), and CpAsyncWait(n) lands every copy of every
// committed group but the newest n (copies not yet committed stay queued, as in PTX).
// What is still queued when the thread exits is dropped.
void CpAsync16(void* dst_shared, const void* src_global, int src_bytes);
void CpAsyncCommit();
void CpAsyncWait(int pending);

}  // namespace kvlens_emu

#define threadIdx (::kvlens_emu::Ctx().thread_idx)
#define blockIdx (::kvlens_emu::Ctx().block_idx)
#define blockDim (::kvlens_emu::Ctx().block_dim)
#define gridDim (::kvlens_emu::Ctx().grid_dim)

inline void __syncthreads() { ::kvlens_emu::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::kvlens_emu::CheckWarpMask("__syncwarp", mask);
  ::kvlens_emu::SyncWarp();
}

// Widths other than 32 split the warp into independent groups of `width` lanes.
template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  ::kvlens_emu::CheckWarpMask("__shfl_sync", mask);
  const int lane = ::kvlens_emu::LaneId();
  return ::kvlens_emu::Exchange(v, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  ::kvlens_emu::CheckWarpMask("__shfl_xor_sync", mask);
  const int lane = ::kvlens_emu::LaneId();
  const int src = lane ^ lane_mask;
  return ::kvlens_emu::Exchange(v, src < ((lane & ~(width - 1)) + width) ? src : lane);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  ::kvlens_emu::CheckWarpMask("__shfl_down_sync", mask);
  const int lane = ::kvlens_emu::LaneId();
  const int src = lane + static_cast<int>(delta);
  return ::kvlens_emu::Exchange(v, src < ((lane & ~(width - 1)) + width) ? src : lane);
}

template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  ::kvlens_emu::CheckWarpMask("__shfl_up_sync", mask);
  const int lane = ::kvlens_emu::LaneId();
  const int src = lane - static_cast<int>(delta);
  return ::kvlens_emu::Exchange(v, src >= (lane & ~(width - 1)) ? src : lane);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  ::kvlens_emu::CheckWarpMask("__ballot_sync", mask);
  uint32_t present = 0;
  return ::kvlens_emu::WarpBallot(pred != 0, &present);
}
inline int __all_sync(unsigned mask, int pred) {
  ::kvlens_emu::CheckWarpMask("__all_sync", mask);
  uint32_t present = 0;
  return ::kvlens_emu::WarpBallot(pred != 0, &present) == present;
}
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }

// Fibers switch only at barriers and warp collectives, so a plain read-modify-write is
// atomic here.
inline unsigned atomicAdd(unsigned* address, unsigned v) {
  const unsigned old = *address;
  *address = old + v;
  return old;
}
inline int atomicAdd(int* address, int v) {
  const int old = *address;
  *address = old + v;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long v) {
  const unsigned long long old = *address;
  *address = old + v;
  return old;
}

// Blocks run one after another here: every write is visible to the blocks after it.
inline void __threadfence() {}
template <typename T>
T __ldcg(const T* address) {
  return *address;
}

// Round-to-nearest float arithmetic that a GPU compiler never contracts into an FMA; the
// translated .cu files are compiled with -ffp-contract=off, so here neither.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __double2float_rn(double x) { return static_cast<float>(x); }
inline int __float_as_int(float x) { return ::kvlens_emu::BitCast<int>(x); }
inline float __int_as_float(int i) { return ::kvlens_emu::BitCast<float>(i); }
inline unsigned long long __float2ull_rn(float x) {
  return static_cast<unsigned long long>(std::nearbyint(x));
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline unsigned __float_as_uint(float x) { return ::kvlens_emu::BitCast<unsigned>(x); }
inline float __uint_as_float(unsigned u) { return ::kvlens_emu::BitCast<float>(u); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
  return b < a ? b : a;
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}

#endif  // KVLENS_TESTS_KERNELS_CUDA_EMU_EMU_DEVICE_H_
