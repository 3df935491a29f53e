// kvlens CUDA emulator, host side: the runtime API subset of include/cuda_runtime_api.h
// and the block scheduler behind emu_device.h (cuBLAS is emu_cublas.cc).
// One file (past 900 lines) because its parts share file-local state that must not leak
// into the emulated code: the allocation table, the thread's last error and capture state,
// the work pending for the host and other streams (Pending), and the fiber scheduler the
// barriers and the launch paths switch through.
//
// Device memory is host memory from mmap, 0xFF-filled (NaN) like uninitialised device
// memory, ending at an inaccessible guard page: a kernel reading more than 255 bytes past
// an allocation faults. Under AddressSanitizer it is heap memory instead, and every byte
// past the requested size is poisoned (as is dynamic shared memory past the launch's
// size): ASan then reports the first out-of-bounds access of a kernel, as compute-
// sanitizer's memcheck would; the fiber switches are announced to ASan. Copies check their
// direction (a host pointer given as device memory is an error), and so do kernel pointer
// arguments and declared parameter-struct fields; a launch checks its block against the
// kernel's __launch_bounds__ (ExceedsLaunchBounds) and its shared memory, static
// (StaticShared) and dynamic together, against the limit (CheckConfig). Streams run their work as
// it is enqueued, but what the host and other streams may see of it waits for a synchronization
// (Pending): a host that reads a pinned copy's destination, or writes its source, too early gets
// NaN or ends the process, and so does work on one stream touching device bytes another wrote
// before the host synchronized with it, as on a GPU either would race.
//
// Kernels run one block at a time on the launching host thread (launches from several
// threads are serialised), one fiber per CUDA thread, switched only at barriers
// (__syncthreads, warp collectives), in the order SetSchedule names (block 0 and thread 0
// first by default; reversed or shuffled to expose races): a barrier that can never complete,
// because threads wait at different barriers or have exited, is reported as a failed launch.
// A thread that begins to wait switches straight to the next thread in that order where the
// scheduler's search would pick it (HandOff), else back to the scheduler. The device side's PTX
// stand-ins live here too: ldmatrix (one warp round: the last lane to arrive reads the 32 rows) and
// cp.async (a queue per fiber, emptied by the waits). A misaligned or out-of-place address there
// aborts the process with a message, as a GPU kernel faults.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "tests/kernels/cuda/emu/emu_device.h"
#include "tests/kernels/cuda/emu/emu_struct_pointers.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define KVLENS_EMU_ASAN 1
#endif

#if !defined(__x86_64__)
#error "the kvlens CUDA emulator's fiber switch is written for x86-64"
#endif

// The program's zero-initialised static storage (from the linker), where the function
// statics that stand for `__shared__` variables live.
extern "C" char __bss_start, _end;

struct kvlens_emu::CUstream_st {
  bool non_blocking = false;  // cudaStreamNonBlocking: not ordered with the legacy stream
  bool capturing = false;
  bool invalidated = false;
  std::vector<std::function<void()>> nodes;  // the graph being captured
};
struct kvlens_emu::CUgraph_st {
  std::vector<std::function<void()>> nodes;
};
struct kvlens_emu::CUgraphExec_st {
  std::vector<std::function<void()>> nodes;
};
struct kvlens_emu::CUevent_st {
  std::chrono::steady_clock::time_point time;
  // Where cudaEventRecord put it: its stream (null: the legacy stream), after the pending
  // work numbered below `after` (Pending::sequence).
  const CUstream_st* stream = nullptr;
  uint64_t after = 0;
};

// void kvlens_emu_switch(void** save_sp, void* load_sp): saves the callee-saved registers
// on the current stack, stores its pointer in *save_sp, and resumes the fiber whose saved
// stack pointer is load_sp.
extern "C" void kvlens_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl kvlens_emu_switch
  .type kvlens_emu_switch, @function
kvlens_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kvlens_emu_switch, .-kvlens_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace kvlens_emu {
namespace {

thread_local cudaError_t t_last_error = cudaSuccess;

cudaError_t Fail(cudaError_t e, const std::string& why) {
  std::fprintf(stderr, "[cuda-emu] %s\n", why.c_str());
  t_last_error = e;
  return e;
}

// The stream this thread is capturing (not in relaxed mode), if any.
thread_local CUstream_st* t_capturing = nullptr;

// For calls that are not allowed while this thread captures: invalidates the capture.
cudaError_t RefuseDuringCapture(const char* what) {
  if (t_capturing == nullptr) return cudaSuccess;
  t_capturing->invalidated = true;
  return Fail(cudaErrorStreamCaptureUnsupported,
              std::string(what) + " during stream capture (invalidates the capture)");
}

// ---- device memory ----------------------------------------------------------------
constexpr size_t kDeviceBytes = size_t{16} << 30;  // the emulated device's capacity
constexpr size_t kAlign = 256;

struct Allocation {
  size_t bytes;
  void* map;
  size_t map_bytes;
};

std::mutex g_memory_mutex;
std::map<uintptr_t, Allocation> g_device;  // by start address
size_t g_device_used = 0;
int64_t g_allocations_left = -1;              // FailDeviceAllocationsAfter; < 0: no limit
int64_t g_allocations_before_one_fails = -1;  // FailOneDeviceAllocationAfter; < 0: none
std::map<uintptr_t, size_t> g_pinned;

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The entry of `allocations` (keyed by start address; `size` gives an entry's bytes)
// holding [p, p + bytes), or end(). Caller holds g_memory_mutex.
template <typename Map, typename Size>
typename Map::const_iterator Holding(const Map& allocations, const void* p, size_t bytes,
                                     Size size) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = allocations.upper_bound(a);
  if (it == allocations.begin()) return allocations.end();
  --it;
  return a + bytes <= it->first + size(it->second) ? it : allocations.end();
}

size_t AllocationBytes(const Allocation& a) { return a.bytes; }

// The allocation holding [p, p + bytes), or null. Caller holds g_memory_mutex.
const Allocation* FindDevice(const void* p, size_t bytes) {
  auto it = Holding(g_device, p, bytes, AllocationBytes);
  return it == g_device.end() ? nullptr : &it->second;
}

std::string Hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

// ---- what the host and other streams see of a stream's order -------------------------
// Work runs when it is enqueued here, but on a GPU two things of it are asynchronous and
// pending here (Pending) until a synchronization reaches them (Settle):
//   - a copy between device memory and pinned host memory (cudaMallocHost): the host may
//     read its destination, or write its source, only once it has synchronized with the
//     copy's stream (cudaStreamSynchronize, cudaEventSynchronize on an event recorded
//     after it, cudaDeviceSynchronize, or a synchronous call that waits for that stream).
//     To the host: the destination holds NaN (0xFF bytes) until then, and the copied
//     bytes land then; the host must not write it in between. To the device: the device's
//     bytes are written at once, from the source as it is now, which must still hold them
//     then. A host that broke either rule ends the process (HostRace): on a GPU the copy
//     might have overwritten what it wrote, or read what it changed.
//   - an access to device memory: a kernel's (through each pointer argument, from there
//     to its allocation's end: a write where it points to non-const data, else a read;
//     and through the pointers its parameter structs carry, CheckStructArgument), a
//     copy's, a memset's or cuBLAS's, synchronous cudaMemcpy from pageable memory and
//     cudaMemset included (the first returns once its source is staged, the second at
//     once). Work on a stream not ordered after the accessing one's (OrderedBy: a
//     non-blocking stream and any other; the legacy stream and a blocking one are ordered
//     both ways) reading bytes it writes, or writing bytes it reads or writes, before the
//     host has synchronized with its stream ends the process (AccessDevice): on a GPU the
//     two could run in either order, or at once.
// A copy to or from pageable memory completes for the host within the call, as the
// runtime stages it on a GPU. The legacy stream (null) waits for a blocking stream's work,
// not for a non-blocking stream's, so a synchronous cudaMemcpy does not settle the
// latter's work.
// Who accesses device memory, for the messages: a call or a kernel (`who`, static
// storage), and for a kernel its argument: a pointer, a declared field of a parameter
// struct (`field`, emu_struct_pointers.h), or another struct's pointer at byte `byte`.
struct Accessor {
  const char* who;
  int argument = -1;
  const char* field = nullptr;
  int byte = -1;
};

struct Pending {
  enum Kind { kToHost, kToDevice, kDeviceRead, kDeviceWrite };
  Kind kind;
  const CUstream_st* stream;  // null: the legacy stream
  uint64_t sequence;          // its place among all pending work (events record it)
  unsigned char* bytes_at;    // pinned bytes (the copy's destination or source), or device bytes
  size_t bytes;
  std::vector<unsigned char> data;  // to the host: the bytes to land; to the device: those read
  Accessor by;                      // a device access: who made it
};

std::mutex g_pending_mutex;
std::vector<Pending> g_pending;  // in the order enqueued
uint64_t g_enqueued = 0;         // pending work so far (the next one's sequence)
// The stream a graph being launched runs on (cudaGraphLaunch): its recorded copies are
// enqueued there.
thread_local CUstream_st* t_graph_stream = nullptr;

// Whether [p, p + bytes) lies in one pinned allocation. Caller holds g_memory_mutex.
bool FindPinned(const void* p, size_t bytes) {
  return Holding(g_pinned, p, bytes, [](size_t n) { return n; }) != g_pinned.end();
}

// Whether synchronizing with stream `waited` (null: the legacy stream) waits for the work
// enqueued earlier on `s`, and whether work on `waited` runs after it: on s itself, and
// between the legacy stream and any blocking stream.
bool OrderedBy(const CUstream_st* waited, const CUstream_st* s) {
  return waited == s || (waited == nullptr && (s == nullptr || !s->non_blocking)) ||
         (s == nullptr && !waited->non_blocking);
}

// Whether c's bytes and [p, p + bytes) overlap.
bool Overlaps(const Pending& c, const unsigned char* p, size_t bytes) {
  return c.bytes_at < p + bytes && p < c.bytes_at + c.bytes;
}

[[noreturn]] void HostRace(const Pending& c, size_t byte) {
  const bool to_host = c.kind == Pending::kToHost;
  const std::string side = std::string(to_host ? "to the host: the host wrote byte "
                                               : "to the device: the host changed byte ") +
                           std::to_string(byte) + " of its " +
                           (to_host ? "destination, " : "source, ") + Hex(c.bytes_at) + ",";
  std::fprintf(stderr,
               "[cuda-emu] cudaMemcpyAsync of %zu bytes %s before synchronizing with the "
               "copy's stream (pinned memory: on a GPU the copy may %s)\n",
               c.bytes, side.c_str(),
               to_host ? "land after the host's write" : "read either value");
  std::fflush(stderr);
  std::abort();
}

// Completes, for the host, the pending work `settled` selects: checks that the host left
// the copies' pinned bytes alone (all of them first: two copies may land in the same
// bytes, in order), then lands those to the host.
void Settle(const std::function<bool(const Pending&)>& settled) {
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  std::vector<Pending> done, left;
  for (Pending& c : g_pending) (settled(c) ? done : left).push_back(std::move(c));
  g_pending = std::move(left);
  for (const Pending& c : done) {
    if (c.kind != Pending::kToHost && c.kind != Pending::kToDevice) continue;
    for (size_t i = 0; i < c.bytes; ++i) {
      if (c.bytes_at[i] != (c.kind == Pending::kToHost ? 0xff : c.data[i])) HostRace(c, i);
    }
  }
  for (const Pending& c : done) {
    if (c.kind == Pending::kToHost) std::memcpy(c.bytes_at, c.data.data(), c.bytes);
  }
}

void SettleStream(const CUstream_st* waited) {
  Settle([waited](const Pending& c) { return OrderedBy(waited, c.stream); });
}

void SettleAll() {
  Settle([](const Pending&) { return true; });
}

// A copy from device memory `device` into pinned `host` (kToHost), or from pinned `host`
// into `device` (kToDevice), on `stream`, after the checks: makes the device's side now.
void EnqueuePinnedCopy(const CUstream_st* stream, unsigned char* host, unsigned char* device,
                       size_t bytes, Pending::Kind kind) {
  // The stream's earlier copies touching these bytes come first, in its order (a copy
  // into a source the stream has yet to read, or the other way round, is no race).
  Settle([&](const Pending& c) {
    return (c.kind == Pending::kToHost || c.kind == Pending::kToDevice) && c.stream == stream &&
           Overlaps(c, host, bytes);
  });
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  Pending c{kind, stream, g_enqueued++, host, bytes, {}, "cudaMemcpyAsync", -1};
  if (kind == Pending::kToHost) {
    c.data.assign(device, device + bytes);
    std::memset(host, 0xff, bytes);
  } else {
    std::memcpy(device, host, bytes);
    c.data.assign(host, host + bytes);
  }
  g_pending.push_back(std::move(c));
}

// A kernel's argument that an access went through: "pointer argument 1",
// "AttentionParams::out (argument 0)", or "argument 0, the device pointer at its byte 16".
std::string ArgumentName(const Accessor& by) {
  const std::string argument = std::to_string(by.argument);
  if (by.field != nullptr) return by.field + (" (argument " + argument + ")");
  if (by.byte >= 0) {
    return "argument " + argument + ", the device pointer at its byte " + std::to_string(by.byte);
  }
  return "pointer argument " + argument;
}

// Names an access for a message: "cudaMemset", "AddKernel's pointer argument 1", or
// "SplitKvKernel's AttentionParams::out (argument 0)".
std::string Whose(const Accessor& by) {
  return by.argument < 0 ? by.who : by.who + ("'s " + ArgumentName(by));
}

const char* StreamKind(const CUstream_st* s) {
  return s == nullptr ? "the legacy stream"
                      : (s->non_blocking ? "a non-blocking stream" : "a blocking stream");
}

// AccessDevice, by any accessor.
void Access(cudaStream_t stream, const void* p, size_t bytes, bool write, const Accessor& by,
            bool record) {
  auto* begin = static_cast<unsigned char*>(const_cast<void*>(p));
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  for (const Pending& c : g_pending) {
    const bool conflicts =
        c.kind == Pending::kDeviceWrite || (write && c.kind == Pending::kDeviceRead);
    if (!conflicts || OrderedBy(stream, c.stream) || !Overlaps(c, begin, bytes)) continue;
    const std::string whose = Whose(c.by);
    const char* why = whose == "cudaMemcpy's destination"
                          ? " (from pageable memory cudaMemcpy returns once its source is staged)"
                      : whose == "cudaMemset" ? " (cudaMemset returns at once)"
                                              : "";
    std::fprintf(stderr,
                 "[cuda-emu] %s, on %s, %s device memory %s (%zu bytes) that %s, on %s, may "
                 "still be %s (%zu bytes at %s)%s: the host has not synchronized with that "
                 "stream since, and this one does not wait for it\n",
                 Whose(by).c_str(), StreamKind(stream), write ? "writes" : "reads", Hex(p).c_str(),
                 bytes, whose.c_str(), StreamKind(c.stream),
                 c.kind == Pending::kDeviceWrite ? "writing" : "reading", c.bytes,
                 Hex(c.bytes_at).c_str(), why);
    std::fflush(stderr);
    std::abort();
  }
  if (!record) return;
  g_pending.push_back({write ? Pending::kDeviceWrite : Pending::kDeviceRead,
                       stream,
                       g_enqueued++,
                       begin,
                       bytes,
                       {},
                       by});
}

}  // namespace

void AccessDevice(cudaStream_t stream, const void* p, size_t bytes, bool write, const char* who,
                  int argument, bool record) {
  Access(stream, p, bytes, write, {who, argument}, record);
}

namespace {

// ---- fibers and blocks -------------------------------------------------------------
constexpr size_t kStackBytes = 256 * 1024;

enum class FiberState { kReady, kWaiting, kDone };

// A queued cp.async: the 16 bytes it will write (the source read when it was issued,
// zero-filled past its source size) and the commit group it belongs to.
struct AsyncCopy {
  void* dst;
  uint64_t group;
  unsigned char bytes[16];
};

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;
  void* fake_stack = nullptr;  // ASan's, while switched out
  ThreadContext ctx;
  int linear = 0;
  int position = 0;  // in the block's run order (RunGrid)
  FiberState state = FiberState::kReady;
  int waiting_on = -1;
  uint64_t wait_generation = 0;
  uint64_t exchanges = 0;           // warp rounds so far: their parity picks the slots
  std::vector<AsyncCopy> cp_async;  // queued, oldest first
  uint64_t cp_async_groups = 0;     // commit groups closed so far
  bool waited_for_grids = false;    // called GridDependencyWait
};

constexpr int kNoPosition = std::numeric_limits<int>::max();

struct Barrier {
  int expected = 0;
  int arrived = 0;
  uint64_t generation = 0;
  int first_waiter = kNoPosition;  // the earliest run-order position waiting on it
};

struct Block {
  std::vector<Fiber> fibers;
  uint64_t completions = 0;         // barriers completed: may wake waiting fibers
  int woken_from = kNoPosition;     // the earliest position they woke since the scheduler looked
  const int* order = nullptr;       // the threads in run order (RunGrid)
  std::vector<Barrier> barriers;    // [0] the block, [1 + w] warp w
  std::vector<uint64_t> exchange;   // [warp][2][32]
  std::vector<float> warp_scratch;  // [warp][768]
  std::vector<unsigned char> ldmatrix_rows;  // [warp][2][32][16]
  unsigned char* dynamic_shared = nullptr;
  size_t shared_bytes = 0;     // of dynamic_shared
  const char* name = nullptr;  // the kernel's
  void* scheduler_sp = nullptr;
  const void* scheduler_stack = nullptr;  // ASan: the launching thread's stack
  size_t scheduler_stack_bytes = 0;
  const std::function<void()>* body = nullptr;
  int exceeded_bound = 0;  // the kernel's __launch_bounds__, where the block is larger
  std::vector<const void*> static_objects;  // the __shared__ variables declared so far
  size_t static_bytes = 0;                  // and their bytes (StaticShared)
  std::vector<const void*> block_objects;   // those declared so far in this block
};

thread_local Block* t_block = nullptr;
thread_local Fiber* t_fiber = nullptr;

std::mutex g_launch_mutex;
std::vector<char*> g_stacks;  // kept for the process's life, guarded by g_launch_mutex
std::vector<unsigned char> g_dynamic_shared;

// The order blocks and threads run in (SetSchedule), guarded by g_launch_mutex: taken from
// KVLENS_EMU_SCHEDULE at the first launch unless a test set it before.
struct ScheduleState {
  bool set = false;
  Schedule schedule = Schedule::kForward;
  std::mt19937_64 rng;
};
ScheduleState g_schedule;

void ScheduleFromEnvironment() {
  g_schedule.set = true;
  const char* env = std::getenv("KVLENS_EMU_SCHEDULE");
  if (env == nullptr || std::strcmp(env, "forward") == 0) return;
  if (std::strcmp(env, "reverse") == 0) {
    g_schedule.schedule = Schedule::kReverse;
    return;
  }
  char* end = nullptr;
  if (std::strncmp(env, "shuffle:", 8) == 0 && env[8] >= '0' && env[8] <= '9') {
    const unsigned long long seed = std::strtoull(env + 8, &end, 10);
    if (*end == '\0') {
      g_schedule.schedule = Schedule::kShuffle;
      g_schedule.rng.seed(seed);
      return;
    }
  }
  std::fprintf(stderr,
               "kvlens CUDA emulator: KVLENS_EMU_SCHEDULE=%s: expected forward, reverse or "
               "shuffle:SEED (SEED a decimal number)\n",
               env);
  std::abort();
}

// The k-th block of n to run, as a linear index (x fastest): k itself, n - 1 - k, or, when
// shuffled, (k · a + c) mod n with a coprime to n, drawn for the launch.
__extension__ using Uint128 = unsigned __int128;  // k · a may pass 2^64

struct BlockOrder {
  uint64_t n, a = 1, c = 0;
  Schedule schedule;
  uint64_t operator()(uint64_t k) const {
    switch (schedule) {
      case Schedule::kForward:
        return k;
      case Schedule::kReverse:
        return n - 1 - k;
      case Schedule::kShuffle:
        break;
    }
    return static_cast<uint64_t>((Uint128{k} * a + c) % n);
  }
};

BlockOrder DrawBlockOrder(uint64_t n) {
  BlockOrder order{n};
  order.schedule = g_schedule.schedule;
  if (order.schedule == Schedule::kShuffle && n > 1) {
    order.a = 1 + g_schedule.rng() % (n - 1);
    while (std::gcd(order.a, n) != 1) order.a = order.a % (n - 1) + 1;
    order.c = g_schedule.rng() % n;
  }
  return order;
}

// The two directions of a switch. ASan tracks which stack is current: each switch is
// announced (start) and completed (finish), and a finished fiber's fake stack is dropped.
void SwitchToFiber(Block& b, Fiber& f) {
#ifdef KVLENS_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
  kvlens_emu_switch(&b.scheduler_sp, f.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  kvlens_emu_switch(&b.scheduler_sp, f.sp);
#endif
}

void SwitchToScheduler(Fiber& f, bool exiting) {
  Block& b = *t_block;
#ifdef KVLENS_EMU_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.fake_stack, b.scheduler_stack,
                                 b.scheduler_stack_bytes);
#endif
  void* unused = nullptr;
  kvlens_emu_switch(exiting ? &unused : &f.sp, b.scheduler_sp);
#ifdef KVLENS_EMU_ASAN
  // Resumed by the scheduler or by another thread (HandOff): neither's stack is kept.
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

// Whether f can run: ready, or waiting at a barrier that has completed since (then it is
// made ready).
bool Runnable(Block& b, Fiber& f) {
  if (f.state == FiberState::kWaiting &&
      b.barriers[static_cast<size_t>(f.waiting_on)].generation != f.wait_generation) {
    f.state = FiberState::kReady;
  }
  return f.state == FiberState::kReady;
}

// The thread the scheduler would run after `f`, which has just begun to wait, where it can
// tell without the scheduler's search: no barrier has completed since the scheduler last
// looked, so that search would go on from f's position, and the thread there can run.
Fiber* NextWithoutScheduler(Block& b, const Fiber& f) {
  if (b.woken_from != kNoPosition || static_cast<size_t>(f.position) + 1 >= b.fibers.size()) {
    return nullptr;
  }
  Fiber& n = b.fibers[static_cast<size_t>(b.order[f.position + 1])];
  return Runnable(b, n) ? &n : nullptr;
}

// From waiting thread f straight to thread `next`, as the scheduler would have switched
// (one switch, not two, and no search).
void HandOff(Fiber& f, Fiber& next) {
  t_fiber = &next;
#ifdef KVLENS_EMU_ASAN
  __sanitizer_start_switch_fiber(&f.fake_stack, next.stack, kStackBytes);
#endif
  kvlens_emu_switch(&f.sp, next.sp);
#ifdef KVLENS_EMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

[[noreturn]] void FiberMain() {
#ifdef KVLENS_EMU_ASAN
  // Started by the scheduler (the launch's first thread always is: its stack is kept for
  // the switches back) or by another thread (HandOff).
  const void* from = nullptr;
  size_t from_bytes = 0;
  __sanitizer_finish_switch_fiber(nullptr, &from, &from_bytes);
  if (t_block->scheduler_stack == nullptr) {
    t_block->scheduler_stack = from;
    t_block->scheduler_stack_bytes = from_bytes;
  }
#endif
  (*t_block->body)();
  t_fiber->state = FiberState::kDone;
  SwitchToScheduler(*t_fiber, /*exiting=*/true);
  __builtin_unreachable();
}

void* InitialStack(char* stack) {
#ifdef KVLENS_EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(stack, kStackBytes);  // frames a deadlocked block left behind
#endif
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + kStackBytes) & ~uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                              // FiberMain's (absent) return address
  *--sp = reinterpret_cast<void*>(&FiberMain);  // where the switch's ret goes
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
  return sp;
}

void Arrive(int index) {
  Block* b = t_block;
  Barrier& bar = b->barriers[static_cast<size_t>(index)];
  if (++bar.arrived == bar.expected) {
    bar.arrived = 0;
    ++bar.generation;
    ++b->completions;
    b->woken_from = std::min(b->woken_from, bar.first_waiter);
    bar.first_waiter = kNoPosition;
    return;
  }
  Fiber* f = t_fiber;
  bar.first_waiter = std::min(bar.first_waiter, f->position);
  f->state = FiberState::kWaiting;
  f->waiting_on = index;
  f->wait_generation = bar.generation;
  if (Fiber* next = NextWithoutScheduler(*b, *f)) {
    HandOff(*f, *next);
  } else {
    SwitchToScheduler(*f, /*exiting=*/false);
  }
}

std::string Dim(const dim3& d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

std::mutex g_attr_mutex;
std::unordered_map<const void*, int> g_max_dynamic_shared;
// A kernel's static shared memory, as far as its launches have shown it (StaticShared).
std::unordered_map<const void*, size_t> g_static_shared;

size_t StaticSharedOf(const void* func) {
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  const auto it = g_static_shared.find(func);
  return it == g_static_shared.end() ? 0 : it->second;
}

// "" when the launch configuration is valid on sm_90. Shared memory: static and dynamic
// together within 48 KiB, unless the kernel opted in to X bytes of dynamic shared memory
// (cudaFuncAttributeMaxDynamicSharedMemorySize), then dynamic within X and X + static
// within 227 KiB.
std::string CheckConfig(const LaunchConfig& c) {
  const uint64_t threads = uint64_t{c.block.x} * c.block.y * c.block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || c.block.z > 64) {
    return "block " + Dim(c.block) + " has " + std::to_string(threads) +
           " threads (1 to 1024, z at most 64)";
  }
  if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || c.grid.x > 0x7fffffffu ||
      c.grid.y > 65535 || c.grid.z > 65535) {
    return "grid " + Dim(c.grid) + " is out of range";
  }
  const size_t static_bytes = StaticSharedOf(c.func);
  int opted_in = -1;
  {
    std::lock_guard<std::mutex> lock(g_attr_mutex);
    if (auto it = g_max_dynamic_shared.find(c.func); it != g_max_dynamic_shared.end()) {
      opted_in = it->second;
    }
  }
  const std::string bytes = std::to_string(c.shared_bytes) + " bytes of dynamic shared memory";
  const std::string with_static = static_bytes == 0 ? std::string()
                                                    : " (with " + std::to_string(static_bytes) +
                                                          " bytes of static shared memory)";
  if (opted_in < 0 && static_bytes + c.shared_bytes > kDefaultDynamicSharedBytes) {
    return bytes + with_static + ", over the " + std::to_string(kDefaultDynamicSharedBytes) +
           "-byte limit (raise it with cudaFuncAttributeMaxDynamicSharedMemorySize)";
  }
  if (opted_in >= 0 && c.shared_bytes > static_cast<size_t>(opted_in)) {
    return bytes + ", over the " + std::to_string(opted_in) +
           "-byte limit set with cudaFuncAttributeMaxDynamicSharedMemorySize";
  }
  if (opted_in >= 0 && static_bytes + static_cast<size_t>(opted_in) > kMaxDynamicSharedBytes) {
    return std::to_string(opted_in) + " bytes of dynamic shared memory opted in" + with_static +
           ", over the " + std::to_string(kMaxDynamicSharedBytes) + "-byte limit";
  }
  return "";
}

}  // namespace

const ThreadContext& Ctx() { return t_fiber->ctx; }

void SyncThreads() { Arrive(0); }

void SyncWarp() { Arrive(1 + t_fiber->linear / 32); }

int LaneId() { return t_fiber->linear % 32; }

namespace {

int WarpLanes() {
  return t_block->barriers[static_cast<size_t>(1 + t_fiber->linear / 32)].expected;
}

// One round of a warp collective: posts bits in the lane's slot and returns the warp's
// slots once every lane has posted. Rounds alternate between two sets of slots (by the
// parity of the fiber's `exchanges`): a lane that runs ahead into the next round cannot
// overwrite what its warp still reads from this one, so the slots stay valid until the
// lane's next warp barrier. The last lane to arrive first runs complete(slots, parity),
// while the whole warp is at the collective.
template <typename Complete>
const uint64_t* WarpRound(uint64_t bits, Complete&& complete) {
  Fiber* f = t_fiber;
  const int warp = f->linear / 32, lane = f->linear % 32;
  const size_t parity = f->exchanges & 1;
  uint64_t* slots = &t_block->exchange[(static_cast<size_t>(warp) * 2 + parity) * 32];
  slots[lane] = bits;
  const Barrier& bar = t_block->barriers[static_cast<size_t>(1 + warp)];
  if (bar.arrived + 1 == bar.expected) complete(static_cast<const uint64_t*>(slots), parity);
  Arrive(1 + warp);
  ++f->exchanges;
  return slots;
}

// Ends the process with a message naming the instruction, the kernel and the thread.
[[noreturn]] void DeviceFault(const char* instruction, const std::string& why) {
  const ThreadContext& c = t_fiber->ctx;
  std::fprintf(stderr, "[cuda-emu] %s: %s (kernel %s, block (%u, %u, %u), thread (%u, %u, %u))\n",
               instruction, why.c_str(), t_block->name, c.block_idx.x, c.block_idx.y, c.block_idx.z,
               c.thread_idx.x, c.thread_idx.y, c.thread_idx.z);
  std::fflush(stderr);
  std::abort();
}

void CheckAligned16(const char* instruction, const char* role, const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return;
  DeviceFault(instruction, std::string(role) + " " + Hex(p) +
                               " is not 16-byte aligned (cudaErrorMisalignedAddress on a GPU)");
}

// [p, p + bytes) lies in the block's dynamic shared memory or in static storage (a
// `__shared__` function static), not on a fiber's stack, in device memory or on the heap.
void CheckShared(const char* instruction, const char* role, const void* p, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t dynamic = reinterpret_cast<uintptr_t>(t_block->dynamic_shared);
  if (a >= dynamic && a + bytes <= dynamic + t_block->shared_bytes) return;
  if (a >= reinterpret_cast<uintptr_t>(&__bss_start) &&
      a + bytes <= reinterpret_cast<uintptr_t>(&_end)) {
    return;
  }
  DeviceFault(instruction, std::string(role) + " " + Hex(p) + " is not " + std::to_string(bytes) +
                               " bytes of shared memory (the block's " +
                               std::to_string(t_block->shared_bytes) +
                               " bytes of dynamic shared memory or a __shared__ variable)");
}

}  // namespace

void CheckWarpMask(const char* instruction, unsigned mask) {
  const int lanes = WarpLanes();
  const unsigned present = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  if (mask == 0xffffffffu || mask == present) return;
  char names[64];
  std::snprintf(names, sizeof(names), "member mask 0x%08x, the warp's lanes 0x%08x", mask, present);
  DeviceFault(instruction,
              std::string(names) + ": the emulator runs only collectives of the whole warp");
}

uint64_t WarpExchange(uint64_t bits, int src_lane) {
  const uint64_t* slots = WarpRound(bits, [](const uint64_t*, size_t) {});
  return src_lane >= 0 && src_lane < WarpLanes() ? slots[src_lane] : bits;
}

void WarpAllGather(uint64_t bits, uint64_t* out32) {
  const uint64_t* slots = WarpRound(bits, [](const uint64_t*, size_t) {});
  const int lanes = WarpLanes();
  for (int l = 0; l < 32; ++l) out32[l] = l < lanes ? slots[l] : 0;
}

uint32_t WarpBallot(bool pred, uint32_t* present) {
  uint64_t slots[32];
  WarpAllGather(pred ? 1u : 0u, slots);
  const int lanes = WarpLanes();
  uint32_t ballot = 0;
  for (int l = 0; l < lanes; ++l) ballot |= static_cast<uint32_t>(slots[l] != 0) << l;
  *present = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  return ballot;
}

void LdMatrixX4(uint32_t (&r)[4], const void* row_address, bool trans) {
  CheckAligned16("ldmatrix", "row address", row_address);
  CheckShared("ldmatrix", "row address", row_address, 16);
  if (WarpLanes() != 32) {
    DeviceFault("ldmatrix", "a warp collective of all 32 lanes, run in a warp of " +
                                std::to_string(WarpLanes()) + " threads");
  }
  const size_t warp = static_cast<size_t>(t_fiber->linear / 32);
  const size_t parity = t_fiber->exchanges & 1;
  // The last lane to arrive copies the 32 rows (matrix i's row j from lane 8i + j).
  WarpRound(reinterpret_cast<uintptr_t>(row_address), [warp](const uint64_t* slots, size_t p) {
    unsigned char* rows = &t_block->ldmatrix_rows[(warp * 2 + p) * 512];
    for (int l = 0; l < 32; ++l) {
      std::memcpy(rows + 16 * l, reinterpret_cast<const void*>(slots[l]), 16);
    }
  });
  const unsigned char* rows = &t_block->ldmatrix_rows[(warp * 2 + parity) * 512];
  const int g = LaneId() / 4, t = LaneId() % 4;
  for (int i = 0; i < 4; ++i) {
    if (!trans) {  // row g, elements 2t and 2t+1: the row's 32-bit word t
      std::memcpy(&r[i], rows + 16 * (8 * i + g) + 4 * t, 4);
    } else {  // element g of rows 2t and 2t+1
      uint16_t lo, hi;
      std::memcpy(&lo, rows + 16 * (8 * i + 2 * t) + 2 * g, 2);
      std::memcpy(&hi, rows + 16 * (8 * i + 2 * t + 1) + 2 * g, 2);
      r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
}

uint32_t MovMatrixTrans(uint32_t a) {
  if (WarpLanes() != 32) {
    DeviceFault("movmatrix", "a warp collective of all 32 lanes, run in a warp of " +
                                 std::to_string(WarpLanes()) + " threads");
  }
  const int g = LaneId() / 4, t = LaneId() % 4;
  const uint64_t row_lo = WarpExchange(a, 8 * t + g / 2),
                 row_hi = WarpExchange(a, 8 * t + 4 + g / 2);
  const int shift = 16 * (g % 2);
  return static_cast<uint32_t>(((row_lo >> shift) & 0xffffu) |
                               (((row_hi >> shift) & 0xffffu) << 16));
}

void CpAsync16(void* dst_shared, const void* src_global, int src_bytes) {
  if (src_bytes < 0 || src_bytes > 16) {
    DeviceFault("cp.async", "source size " + std::to_string(src_bytes) + " is not 0 to 16");
  }
  CheckAligned16("cp.async", "destination", dst_shared);
  CheckAligned16("cp.async", "source", src_global);
  CheckShared("cp.async", "destination", dst_shared, 16);
  if (src_bytes > 0 && !IsDeviceRange(src_global, static_cast<size_t>(src_bytes))) {
    DeviceFault("cp.async", "source " + Hex(src_global) + " is not " + std::to_string(src_bytes) +
                                " bytes of device memory (cudaErrorIllegalAddress on a GPU)");
  }
  // In flight the destination is undefined: it reads as NaN (0xFF bytes) from the issue to
  // the wait, so a thread still reading a tile's old contents after another thread has
  // begun overwriting it (a missing barrier before the issue) reads NaN, as it may read
  // the new bytes half-written on a GPU.
  std::memset(dst_shared, 0xff, 16);
  Fiber& f = *t_fiber;
  AsyncCopy& c = f.cp_async.emplace_back();
  c.dst = dst_shared;
  c.group = f.cp_async_groups;
  std::memset(c.bytes, 0, sizeof(c.bytes));
  if (src_bytes > 0) std::memcpy(c.bytes, src_global, static_cast<size_t>(src_bytes));
}

void CpAsyncCommit() { ++t_fiber->cp_async_groups; }

void GridDependencyWait() { t_fiber->waited_for_grids = true; }

namespace {
std::atomic<int64_t> g_prefetches{0};
}  // namespace

void PrefetchL2(const void* global) {
  if (!IsDeviceRange(global, 1)) {
    DeviceFault("prefetch.global.L2", "address " + Hex(global) + " is not device memory");
  }
  g_prefetches.fetch_add(1, std::memory_order_relaxed);
}

int64_t PrefetchesIssued() { return g_prefetches.load(std::memory_order_relaxed); }

void CpAsyncWait(int pending) {
  if (pending < 0) DeviceFault("cp.async.wait_group", std::to_string(pending) + " groups");
  Fiber& f = *t_fiber;
  // Groups [0, landed) land; the queue holds copies in group order.
  const uint64_t keep = static_cast<uint64_t>(pending);
  const uint64_t landed = f.cp_async_groups > keep ? f.cp_async_groups - keep : 0;
  size_t n = 0;
  for (; n < f.cp_async.size() && f.cp_async[n].group < landed; ++n) {
    std::memcpy(f.cp_async[n].dst, f.cp_async[n].bytes, sizeof(f.cp_async[n].bytes));
  }
  f.cp_async.erase(f.cp_async.begin(), f.cp_async.begin() + static_cast<std::ptrdiff_t>(n));
}

void* DynamicShared() { return t_block->dynamic_shared; }

float* WarpScratch() {
  return &t_block->warp_scratch[static_cast<size_t>(t_fiber->linear / 32) * 768];
}

namespace {

// The bytes from p to the end of the device allocation holding it, which a kernel given p
// may touch; 0 where p is not device memory.
size_t DeviceBytesFrom(const void* p) {
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  auto it = Holding(g_device, p, 0, AllocationBytes);
  return it == g_device.end() ? 0 : it->first + it->second.bytes - reinterpret_cast<uintptr_t>(p);
}

// A kernel's access through p (a pointer argument, or a declared struct field): an illegal
// address unless p is null or device memory.
bool AccessThrough(const LaunchConfig& config, const void* p, bool writes, const Accessor& by) {
  if (p == nullptr) return true;
  if (const size_t to_end = DeviceBytesFrom(p); to_end > 0) {
    Access(config.stream, p, to_end, writes, by, true);
    return true;
  }
  Fail(cudaErrorIllegalAddress, std::string(config.name) + ": " + ArgumentName(by) + " (" + Hex(p) +
                                    ") is not in device memory");
  return false;
}

}  // namespace

bool CheckPointerArgument(const LaunchConfig& config, int index, const void* p, bool writes) {
  return AccessThrough(config, p, writes, {config.name, index});
}

bool CheckStructArgument(const LaunchConfig& config, int index, const void* arg, size_t bytes,
                         const std::type_info& type) {
  auto pointer_at = [&](size_t offset) {
    const void* p = nullptr;
    std::memcpy(&p, static_cast<const unsigned char*>(arg) + offset, sizeof p);
    return p;
  };
  if (const std::vector<StructPointer>* fields = DeclaredPointers(type)) {
    for (const StructPointer& f : *fields) {
      if (!AccessThrough(config, pointer_at(f.offset), f.writes,
                         {config.name, index, f.name.c_str()})) {
        return false;
      }
    }
    return true;
  }
  for (size_t offset = 0; offset + sizeof(void*) <= bytes; offset += alignof(void*)) {
    const void* p = pointer_at(offset);
    if (const size_t to_end = DeviceBytesFrom(p); to_end > 0) {
      Access(config.stream, p, to_end, true,
             {config.name, index, nullptr, static_cast<int>(offset)}, true);
    }
  }
  return true;
}

void SetSchedule(Schedule schedule, uint64_t seed) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  g_schedule.set = true;
  g_schedule.schedule = schedule;
  g_schedule.rng.seed(seed);
}

void UseEnvironmentSchedule() {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  g_schedule = ScheduleState();
}

void RunGrid(const LaunchConfig& c, const std::function<void()>& body) {
  if (const std::string bad = CheckConfig(c); !bad.empty()) {
    Fail(cudaErrorInvalidConfiguration, std::string(c.name) + ": " + bad);
    return;
  }
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  if (!g_schedule.set) ScheduleFromEnvironment();
  const int threads = static_cast<int>(c.block.x * c.block.y * c.block.z);
  const int warps = (threads + 31) / 32;
  while (g_stacks.size() < static_cast<size_t>(threads)) {
    void* m = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      Fail(cudaErrorMemoryAllocation, std::string(c.name) + ": no memory for fiber stacks");
      return;
    }
    g_stacks.push_back(static_cast<char*>(m));
  }
#ifdef KVLENS_EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(g_dynamic_shared.data(), g_dynamic_shared.size());
#endif
  if (g_dynamic_shared.size() < c.shared_bytes + 128) g_dynamic_shared.resize(c.shared_bytes + 128);
  Block b;
  b.fibers.resize(static_cast<size_t>(threads));
  b.barriers.resize(static_cast<size_t>(1 + warps));
  b.barriers[0].expected = threads;
  for (int w = 0; w < warps; ++w) {
    b.barriers[static_cast<size_t>(1 + w)].expected = std::min(32, threads - 32 * w);
  }
  b.exchange.resize(static_cast<size_t>(warps) * 64);
  b.warp_scratch.resize(static_cast<size_t>(warps) * 768);
  b.ldmatrix_rows.resize(static_cast<size_t>(warps) * 2 * 512);
  b.dynamic_shared = reinterpret_cast<unsigned char*>(
      RoundUp(reinterpret_cast<uintptr_t>(g_dynamic_shared.data()), 128));
  b.shared_bytes = c.shared_bytes;
  b.name = c.name;
  b.body = &body;
#ifdef KVLENS_EMU_ASAN
  {  // past the launch's dynamic shared memory: out of bounds
    unsigned char* end = b.dynamic_shared + c.shared_bytes;
    ASAN_POISON_MEMORY_REGION(
        end, static_cast<size_t>(g_dynamic_shared.data() + g_dynamic_shared.size() - end));
  }
#endif
  Block* const saved_block = t_block;
  Fiber* const saved_fiber = t_fiber;
  t_block = &b;
  // The threads' priority (SetSchedule), and the blocks' order.
  std::vector<int> order(static_cast<size_t>(threads));
  std::iota(order.begin(), order.end(), 0);
  if (g_schedule.schedule == Schedule::kReverse) std::reverse(order.begin(), order.end());
  b.order = order.data();  // shuffled in place per block, below
  const uint64_t gx = c.grid.x, gy = c.grid.y, blocks = gx * gy * c.grid.z;
  const BlockOrder block_order = DrawBlockOrder(blocks);
  for (uint64_t k = 0; k < blocks; ++k) {
    const uint64_t linear = block_order(k);
    const auto bx = static_cast<unsigned>(linear % gx);
    const auto by = static_cast<unsigned>(linear / gx % gy);
    const auto bz = static_cast<unsigned>(linear / (gx * gy));
    for (Barrier& bar : b.barriers) {
      bar.arrived = 0;
      bar.first_waiter = kNoPosition;
    }
    b.woken_from = kNoPosition;
    std::memset(b.dynamic_shared, 0xff, c.shared_bytes);
    b.block_objects.clear();  // static shared memory: refilled as it is declared
    for (int t = 0; t < threads; ++t) {
      Fiber& f = b.fibers[static_cast<size_t>(t)];
      f = Fiber();
      f.linear = t;
      f.ctx.thread_idx = {t % c.block.x, (t / c.block.x) % c.block.y, t / (c.block.x * c.block.y)};
      f.ctx.block_idx = {bx, by, bz};
      f.ctx.block_dim = c.block;
      f.ctx.grid_dim = c.grid;
      f.stack = g_stacks[static_cast<size_t>(t)];
      f.sp = InitialStack(f.stack);
    }
    // The first thread in `order` that can run runs next, until it waits or exits; a
    // barrier that completes may wake one before it, so the search starts again, from the
    // earliest position it woke (Barrier::first_waiter) if that is before the current
    // one: every thread before the current one had been passed over as waiting, or run
    // until it waited or exited, and only a completion wakes one. (It started from 0
    // until 2026-12-07, and the scan was a third of a matvec-heavy test's time: each warp
    // round woke its 32 threads, and the search passed all earlier warps' threads first.)
    if (g_schedule.schedule == Schedule::kShuffle) {
      std::shuffle(order.begin(), order.end(), g_schedule.rng);
    }
    for (int p = 0; p < threads; ++p) b.fibers[static_cast<size_t>(order[p])].position = p;
    int done = 0;
    size_t i = 0, idle = 0;  // idle: fibers looked at since one last ran
    while (done < threads) {
      Fiber& f = b.fibers[static_cast<size_t>(order[i])];
      if (Runnable(b, f)) {
        const uint64_t completions = b.completions;
        t_fiber = &f;
        SwitchToFiber(b, f);
        // Back from f, or from the last thread f handed off to (HandOff), which then ran
        // in f's place in the search: only that one may have exited.
        i = static_cast<size_t>(t_fiber->position);
        idle = 0;
        if (t_fiber->state == FiberState::kDone) ++done;
        if (b.completions != completions) {
          i = std::min(i, static_cast<size_t>(b.woken_from));
          b.woken_from = kNoPosition;
          continue;
        }
      } else if (++idle == order.size()) {
        int at_block = 0, at_warp = 0;
        for (const Fiber& w : b.fibers) {
          if (w.state != FiberState::kWaiting) continue;
          (w.waiting_on == 0 ? at_block : at_warp)++;
        }
        t_block = saved_block;
        t_fiber = saved_fiber;
        Fail(cudaErrorLaunchFailure, std::string(c.name) + ": barrier deadlock in block " +
                                         Dim({bx, by, bz}) + ": " + std::to_string(at_block) +
                                         " threads wait at __syncthreads, " +
                                         std::to_string(at_warp) + " at a warp collective, " +
                                         std::to_string(done) + " have exited");
        return;
      }
      if (++i == order.size()) i = 0;
    }
    if (b.static_bytes > StaticSharedOf(c.func)) {  // learned now: the launch was invalid?
      {
        std::lock_guard<std::mutex> attr_lock(g_attr_mutex);
        g_static_shared[c.func] = b.static_bytes;
      }
      if (const std::string bad = CheckConfig(c); !bad.empty()) {
        t_block = saved_block;
        t_fiber = saved_fiber;
        Fail(cudaErrorInvalidConfiguration, std::string(c.name) + ": " + bad +
                                                " (seen as its block " + Dim({bx, by, bz}) +
                                                " ran; a later launch fails before running)");
        return;
      }
    }
    if (b.exceeded_bound > 0) {  // every thread returned at once: nothing ran
      t_block = saved_block;
      t_fiber = saved_fiber;
      Fail(cudaErrorLaunchOutOfResources,
           std::string(c.name) + ": a block of " + std::to_string(threads) +
               " threads, more than the kernel's __launch_bounds__ (" +
               std::to_string(b.exceeded_bound) + ")");
      return;
    }
    if (c.requires_grid_wait) {
      for (const Fiber& f : b.fibers) {
        if (f.waited_for_grids) continue;
        t_block = saved_block;
        t_fiber = saved_fiber;
        Fail(cudaErrorLaunchFailure,
             std::string(c.name) + ": thread " + std::to_string(f.linear) + " of block " +
                 Dim({bx, by, bz}) +
                 " exited without griddepcontrol.wait, but the kernel may be launched "
                 "before the previous one has finished (programmatic dependent launch)");
        return;
      }
    }
  }
  t_block = saved_block;
  t_fiber = saved_fiber;
}

void StaticShared(void* variable, size_t bytes) {
  Block& b = *t_block;
  // A block's shared memory starts undefined on a GPU, its static part too: NaN (0xFF
  // bytes) here, as the dynamic part, rather than what the block before left. The block's
  // first thread to declare the variable fills it: no thread can have used it before
  // declaring it, and the threads after find it listed (and already counted).
  if (std::find(b.block_objects.begin(), b.block_objects.end(), variable) !=
      b.block_objects.end()) {
    return;
  }
  b.block_objects.push_back(variable);
  std::memset(variable, 0xff, bytes);
  if (std::find(b.static_objects.begin(), b.static_objects.end(), variable) ==
      b.static_objects.end()) {
    b.static_objects.push_back(variable);
    b.static_bytes += bytes;
  }
}

bool ExceedsLaunchBounds(int max_threads, int /*min_blocks*/, int /*max_blocks_per_cluster*/) {
  if (static_cast<int>(t_block->fibers.size()) <= max_threads) return false;
  t_block->exceeded_bound = max_threads;
  return true;
}

// ---- runtime API -------------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device != 0)
    return Fail(cudaErrorInvalidDevice, "cudaSetDevice: no device " + std::to_string(device));
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: no device");
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "kvlens CUDA emulator (CPU)");
  prop->totalGlobalMem = kDeviceBytes;
  prop->sharedMemPerBlock = kDefaultDynamicSharedBytes;
  prop->sharedMemPerBlockOptin = kMaxDynamicSharedBytes;
  prop->maxThreadsPerBlock = kMaxThreadsPerBlock;
  prop->multiProcessorCount = kNumSms;
  prop->major = 9;
  prop->minor = 0;
  prop->memoryClockRate = 1000000;
  prop->memoryBusWidth = 64;
  prop->l2CacheSize = 1 << 20;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return Fail(cudaErrorInvalidDevice, "cudaDeviceGetAttribute: no device");
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock:
      *value = kMaxThreadsPerBlock;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = static_cast<int>(kDefaultDynamicSharedBytes);
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = kNumSms;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(kMaxDynamicSharedBytes);
      return cudaSuccess;
  }
  return Fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: unknown attribute");
}

cudaError_t cudaDeviceSynchronize() {
  if (const cudaError_t e = RefuseDuringCapture("cudaDeviceSynchronize"); e != cudaSuccess) {
    return e;
  }
  SettleAll();
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() { return t_last_error; }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInsufficientDriver:
      return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources:
      return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources:
      return "too many resources requested for launch";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    default:
      return "emulated CUDA error";
  }
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  *ptr = nullptr;
  if (const cudaError_t e = RefuseDuringCapture("cudaMalloc"); e != cudaSuccess) return e;
  if (bytes == 0) return cudaSuccess;
  const size_t data = RoundUp(bytes, kAlign);
  const size_t map_bytes = RoundUp(data, PageSize()) + PageSize();
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  const bool fail_one = g_allocations_before_one_fails == 0;
  if (g_allocations_before_one_fails >= 0) --g_allocations_before_one_fails;
  if (g_device_used + data > kDeviceBytes || g_allocations_left == 0 || fail_one) {
    return Fail(cudaErrorMemoryAllocation,
                "cudaMalloc: " + std::to_string(bytes) + " bytes exceed the emulated device");
  }
  if (g_allocations_left > 0) --g_allocations_left;
#ifdef KVLENS_EMU_ASAN
  (void)map_bytes;
  char* p = static_cast<char*>(std::aligned_alloc(kAlign, data));
  if (p == nullptr) return Fail(cudaErrorMemoryAllocation, "cudaMalloc: out of host memory");
  std::memset(p, 0xff, bytes);
  ASAN_POISON_MEMORY_REGION(p + bytes, data - bytes);
  g_device[reinterpret_cast<uintptr_t>(p)] = {bytes, p, 0};
#else
  void* map = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) return Fail(cudaErrorMemoryAllocation, "cudaMalloc: mmap failed");
  char* guard = static_cast<char*>(map) + map_bytes - PageSize();
  mprotect(guard, PageSize(), PROT_NONE);
  char* p = guard - data;  // page-aligned minus a multiple of 256: 256-aligned
  std::memset(p, 0xff, data);
  g_device[reinterpret_cast<uintptr_t>(p)] = {bytes, map, map_bytes};
#endif
  g_device_used += data;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (const cudaError_t e = RefuseDuringCapture("cudaFree"); e != cudaSuccess) return e;
  if (ptr == nullptr) return cudaSuccess;
  SettleAll();  // it waits for the device
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  auto it = g_device.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == g_device.end()) {
    return Fail(cudaErrorInvalidValue, "cudaFree: " + Hex(ptr) + " is not a device allocation");
  }
  g_device_used -= RoundUp(it->second.bytes, kAlign);
#ifdef KVLENS_EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(it->second.map, RoundUp(it->second.bytes, kAlign));
  std::free(it->second.map);
#else
  munmap(it->second.map, it->second.map_bytes);
#endif
  g_device.erase(it);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  if (const cudaError_t e = RefuseDuringCapture("cudaMallocHost"); e != cudaSuccess) return e;
  *ptr = std::aligned_alloc(kAlign, RoundUp(std::max<size_t>(bytes, 1), kAlign));
  if (*ptr == nullptr) return Fail(cudaErrorMemoryAllocation, "cudaMallocHost failed");
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  g_pinned[reinterpret_cast<uintptr_t>(*ptr)] = bytes;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (const cudaError_t e = RefuseDuringCapture("cudaFreeHost"); e != cudaSuccess) return e;
  if (ptr == nullptr) return cudaSuccess;
  SettleAll();  // it waits for the device
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  if (g_pinned.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
    return Fail(cudaErrorInvalidValue, "cudaFreeHost: " + Hex(ptr) + " is not pinned memory");
  }
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  *free_bytes = kDeviceBytes - g_device_used;
  *total_bytes = kDeviceBytes;
  return cudaSuccess;
}

void FailDeviceAllocationsAfter(int64_t n) {
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  g_allocations_left = n < 0 ? -1 : n;
}

void FailOneDeviceAllocationAfter(int64_t n) {
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  g_allocations_before_one_fails = n < 0 ? -1 : n;
}

bool IsDeviceRange(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  return FindDevice(p, bytes) != nullptr;
}

namespace {

// cudaMemcpyAsync on `stream`; `host_waits`: cudaMemcpy on the legacy stream, whose host
// side is never pending, pinned memory or not (its device side may be: below).
cudaError_t Memcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                   cudaStream_t stream, bool host_waits) {
  bool pinned_dst = false, pinned_src = false, dst_device = false, src_device = false;
  {
    std::lock_guard<std::mutex> lock(g_memory_mutex);
    dst_device = FindDevice(dst, bytes) != nullptr;
    src_device = FindDevice(src, bytes) != nullptr;
    const bool dst_any = FindDevice(dst, 0) != nullptr, src_any = FindDevice(src, 0) != nullptr;
    std::string bad;
    switch (kind) {
      case cudaMemcpyHostToDevice:
        if (!dst_device)
          bad = "the destination is not " + std::to_string(bytes) + " bytes of device memory";
        if (src_any) bad = "the source is device memory";
        break;
      case cudaMemcpyDeviceToHost:
        if (!src_device)
          bad = "the source is not " + std::to_string(bytes) + " bytes of device memory";
        if (dst_any) bad = "the destination is device memory";
        break;
      case cudaMemcpyDeviceToDevice:
        if (!dst_device || !src_device) bad = "source and destination must both be device memory";
        break;
      case cudaMemcpyHostToHost:
        if (dst_any || src_any) bad = "host-to-host copy of device memory";
        break;
      case cudaMemcpyDefault:
        if ((dst_any && !dst_device) || (src_any && !src_device))
          bad = "copy runs past an allocation";
        break;
    }
    if (!bad.empty()) {
      return Fail(cudaErrorInvalidValue, "cudaMemcpy(" + Hex(dst) + ", " + Hex(src) + ", " +
                                             std::to_string(bytes) + ", kind " +
                                             std::to_string(kind) + "): " + bad);
    }
    pinned_dst = src_device && !dst_any && FindPinned(dst, bytes);
    pinned_src = dst_device && !src_any && FindPinned(src, bytes);
  }
  CUstream_st* on = stream != nullptr ? stream : t_graph_stream;
  // cudaMemcpy: from pageable memory to the device it first waits for the legacy stream,
  // then returns once the source is staged, its write pending; between device buffers it
  // does not wait at all; else it returns once the copy is made, and so after the legacy
  // stream's earlier work.
  const bool returns_at_once = !host_waits || (dst_device && (src_device || !pinned_src));
  if (host_waits && dst_device && !src_device && !pinned_src) SettleStream(nullptr);
  if (src_device) {
    AccessDevice(on, src, bytes, false,
                 host_waits ? "cudaMemcpy's source" : "cudaMemcpyAsync's source", -1,
                 returns_at_once);
  }
  if (dst_device) {
    AccessDevice(on, dst, bytes, true,
                 host_waits ? "cudaMemcpy's destination" : "cudaMemcpyAsync's destination", -1,
                 returns_at_once);
  }
  if (host_waits) {
    std::memmove(dst, src, bytes);
    if (!returns_at_once) SettleStream(nullptr);
    return cudaSuccess;
  }
  if (pinned_dst || pinned_src) {
    auto* d = static_cast<unsigned char*>(dst);
    auto* s = static_cast<unsigned char*>(const_cast<void*>(src));
    if (pinned_dst) {
      EnqueuePinnedCopy(on, d, s, bytes, Pending::kToHost);
    } else {
      EnqueuePinnedCopy(on, s, d, bytes, Pending::kToDevice);
    }
    return cudaSuccess;
  }
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

}  // namespace

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  // Captured: checked and made when the graph runs (reading the source then).
  if (RecordIfCapturing(stream, [=] { cudaMemcpyAsync(dst, src, bytes, kind, nullptr); })) {
    return cudaSuccess;
  }
  return Memcpy(dst, src, bytes, kind, stream, false);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (const cudaError_t e = RefuseDuringCapture("cudaMemcpy"); e != cudaSuccess) return e;
  if (bytes == 0) return cudaSuccess;
  return Memcpy(dst, src, bytes, kind, nullptr, true);  // on the legacy stream
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (RecordIfCapturing(stream, [=] { cudaMemsetAsync(dst, value, bytes, nullptr); })) {
    return cudaSuccess;
  }
  {
    std::lock_guard<std::mutex> lock(g_memory_mutex);
    if (FindDevice(dst, bytes) == nullptr) {
      return Fail(cudaErrorInvalidValue,
                  "cudaMemset(" + Hex(dst) + ", " + std::to_string(bytes) + "): not device memory");
    }
  }
  CUstream_st* on = stream != nullptr ? stream : t_graph_stream;
  AccessDevice(on, dst, bytes, true, "cudaMemset");
  std::memset(dst, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  // Asynchronous for the host on a GPU, as cudaMemsetAsync on the legacy stream.
  if (const cudaError_t e = RefuseDuringCapture("cudaMemset"); e != cudaSuccess) return e;
  return cudaMemsetAsync(dst, value, bytes, nullptr);
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = new CUstream_st;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  *stream = new CUstream_st;
  (*stream)->non_blocking = (flags & cudaStreamNonBlocking) != 0;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  // Its pending work completes for the host now (the address may name a new stream next).
  Settle([stream](const Pending& c) { return c.stream == stream; });
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (stream != nullptr && stream->capturing) {
    stream->invalidated = true;
    return Fail(cudaErrorStreamCaptureUnsupported,
                "cudaStreamSynchronize on a capturing stream (invalidates the capture)");
  }
  if (const cudaError_t e = RefuseDuringCapture("cudaStreamSynchronize"); e != cudaSuccess) {
    return e;
  }
  SettleStream(stream);
  return cudaSuccess;
}

bool RecordIfCapturing(cudaStream_t stream, std::function<void()> node) {
  if (stream == nullptr || !stream->capturing) return false;
  stream->nodes.push_back(std::move(node));
  return true;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  if (stream == nullptr) {
    return Fail(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture on the legacy stream");
  }
  if (stream->capturing) {
    return Fail(cudaErrorInvalidValue, "cudaStreamBeginCapture: the stream already captures");
  }
  stream->capturing = true;
  stream->invalidated = false;
  stream->nodes.clear();
  if (mode != cudaStreamCaptureModeRelaxed) t_capturing = stream;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  *graph = nullptr;
  if (stream == nullptr || !stream->capturing) {
    return Fail(cudaErrorInvalidValue, "cudaStreamEndCapture: the stream is not capturing");
  }
  stream->capturing = false;
  if (t_capturing == stream) t_capturing = nullptr;
  std::vector<std::function<void()>> nodes = std::move(stream->nodes);
  stream->nodes.clear();
  if (stream->invalidated) {
    return Fail(cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture: capture invalidated");
  }
  *graph = new CUgraph_st{std::move(nodes)};
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (graph == nullptr) return Fail(cudaErrorInvalidValue, "cudaGraphInstantiate: no graph");
  *exec = new CUgraphExec_st{graph->nodes};
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return Fail(cudaErrorInvalidValue, "cudaGraphLaunch: no graph");
  if (stream != nullptr && stream->capturing) {
    return Fail(cudaErrorStreamCaptureUnsupported, "cudaGraphLaunch into a capture");
  }
  t_graph_stream = stream;
  for (const auto& node : exec->nodes) {
    node();
    if (const cudaError_t e = cudaPeekAtLastError(); e != cudaSuccess) {
      t_graph_stream = nullptr;
      return e;
    }
  }
  t_graph_stream = nullptr;
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  event->time = std::chrono::steady_clock::now();
  event->stream = stream;
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  event->after = g_enqueued;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  Settle([event](const Pending& c) {
    return c.sequence < event->after && OrderedBy(event->stream, c.stream);
  });
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->time - start->time).count();
  return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* num_blocks, const void* func,
                                                          int block_size, size_t shared_bytes) {
  if (num_blocks == nullptr || func == nullptr || block_size < 1 || block_size > 1024 ||
      shared_bytes > 227 * 1024) {
    return Fail(cudaErrorInvalidValue,
                "cudaOccupancyMaxActiveBlocksPerMultiprocessor: a bad argument");
  }
  *num_blocks = 2;
  return cudaSuccess;
}

cudaError_t FuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) {  // a hint: -1 or 0 … 100
    return func != nullptr && value >= -1 && value <= 100
               ? cudaSuccess
               : Fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: carveout " +
                                                 std::to_string(value) + " (-1 or 0 … 100)");
  }
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > kMaxDynamicSharedBytes) {
    return Fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: " + std::to_string(value) +
                                           " bytes of dynamic shared memory (at most " +
                                           std::to_string(kMaxDynamicSharedBytes) + ")");
  }
  if (const size_t static_bytes = StaticSharedOf(func);
      static_bytes + static_cast<size_t>(value) > kMaxDynamicSharedBytes) {
    return Fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: " + std::to_string(value) +
                                           " bytes of dynamic shared memory and the kernel's " +
                                           std::to_string(static_bytes) + " static, over " +
                                           std::to_string(kMaxDynamicSharedBytes));
  }
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  g_max_dynamic_shared[func] = value;
  return cudaSuccess;
}

}  // namespace kvlens_emu
