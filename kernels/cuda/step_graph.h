// CUDA graphs for the forward step (CudaBackend::BeginStep … EndStep).
//
// Between Begin and End every launch the backend makes (kernels, cuBLAS GEMMs, the index
// uploads' host-to-device copies) goes through Run(), which records it instead of
// launching it: a closure, and the launch's signature, which is the launcher's address and
// every argument it passes to the GPU (pointers, sizes, scalars, the attention parameter
// struct field by field). End() then runs the step one of three ways:
//   - a graph captured from an earlier step with the same signature exists: launch it
//     (one cudaGraphLaunch for the whole step);
//   - the signature was seen once before: capture the closures into a graph
//     (cudaStreamBeginCapture … EndCapture), instantiate it and launch it;
//   - otherwise (first sighting, or capture failed): run the closures one by one.
// A replayed graph is exactly the launches the step would have made: the signatures are
// equal, so every kernel gets the same arguments. What differs from step to step is data
// the kernels read from memory at the same addresses: the activations, the KV cache and
// the index arrays (token ids, positions, cache rows, block tables, key ends), which the
// backend writes into its pinned staging ring at the same offsets before End, so the
// graph's copy nodes upload this step's values.
//
// Outside Begin … End, Run() launches at once (the eager path, as without graphs).
#ifndef KVLENS_KERNELS_CUDA_STEP_GRAPH_H_
#define KVLENS_KERNELS_CUDA_STEP_GRAPH_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/matvec.h"

namespace kvlens::kernels::cuda {

// The signature words of one launch argument.
using Signature = std::vector<uint64_t>;
template <typename T>
void AppendWords(Signature& s, const T& v) {
  if constexpr (std::is_pointer_v<T>) {
    s.push_back(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(v)));
  } else if constexpr (std::is_enum_v<T>) {
    s.push_back(static_cast<uint64_t>(v));
  } else {
    static_assert(std::is_arithmetic_v<T> && sizeof(T) <= sizeof(uint64_t),
                  "give this argument type an AppendWords overload");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    s.push_back(bits);
  }
}
void AppendWords(Signature& s, const AttentionParams& p);
void AppendWords(Signature& s, const FlashBf16Layout& l);
void AppendWords(Signature& s, const MatVecProduct& p);
void AppendWords(Signature& s, const MatVecNorm& n);
void AppendWords(Signature& s, const MatVecRopeStore& r);
void AppendWords(Signature& s, const RopeSpec& r);
template <typename T>
void AppendWords(Signature& s, absl::Span<const T> v) {
  s.push_back(v.size());
  for (const T& x : v) AppendWords(s, x);
}

// Memory for a step's recorded launches: chunks kept from step to step, so that recording
// a step allocates nothing once its first recordings have grown them (each closure in a
// std::function of its own, and each kept span in a vector, was a heap allocation and a
// free: a third of a recorded call's host time).
class StepArena {
 public:
  // `bytes` at an address that is a multiple of `align` (a power of two), valid until Reset.
  void* Allocate(size_t bytes, size_t align);
  // Everything allocated is free again; the chunks stay.
  void Reset();
  size_t capacity() const;  // bytes of all chunks

 private:
  struct Chunk {
    std::unique_ptr<std::byte[]> data;
    size_t bytes = 0;
  };
  std::vector<Chunk> chunks_;
  size_t chunk_ = 0;  // the chunk allocating now
  size_t used_ = 0;   // its bytes in use
};

// How a launch argument is kept in a recorded closure: a span's elements copied into the
// step's arena (the caller's array may be gone by End), everything else by value.
template <typename T>
struct Kept {
  using type = T;
  static const T& Keep(StepArena&, const T& v) { return v; }
  static const T& Pass(const T& v) { return v; }
};
template <typename U>
struct Kept<absl::Span<const U>> {
  static_assert(std::is_trivially_copyable_v<U> && std::is_trivially_destructible_v<U>,
                "a recorded span's elements are copied as bytes and never destroyed");
  using type = absl::Span<const U>;
  static absl::Span<const U> Keep(StepArena& arena, absl::Span<const U> v) {
    if (v.empty()) return {};
    void* at = arena.Allocate(sizeof(U) * v.size(), alignof(U));
    std::memcpy(at, v.data(), sizeof(U) * v.size());
    return {static_cast<const U*>(at), v.size()};
  }
  static absl::Span<const U> Pass(absl::Span<const U> v) { return v; }
};

class StepGraph {
 public:
  struct Stats {
    int64_t steps = 0;     // Ends
    int64_t eager = 0;     // steps run launch by launch
    int64_t captures = 0;  // graphs captured and instantiated
    int64_t replays = 0;   // steps run by a graph (the capturing one included)
    int64_t capture_failures = 0;
    int64_t graphs = 0;  // instantiated graphs held now
    // Launcher calls (a kernel, a cuBLAS product or a copy each; split-KV attention's is
    // its two kernels) of the last step recorded.
    int64_t last_step_calls = 0;
    int64_t last_step_words = 0;  // its signature's 64-bit words
    int64_t arena_bytes = 0;      // the recordings' arena (the largest step's closures)
  };

  // Keeps at most max_graphs instantiated graphs (least recently used go first) and
  // remembers at most max_signatures steps.
  explicit StepGraph(int max_graphs = 32, int max_signatures = 128);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  bool recording() const { return recording_; }
  // Starts recording (dropping a recording in progress).
  void Begin();
  // Drops the recording: nothing of it runs.
  void Drop();
  // Runs the step recorded since Begin on `stream` (see the top of the file). A capture
  // holds `capture_mutex` (if given): other threads' work on the stream waits for it
  // rather than being captured into the graph.
  absl::Status End(cudaStream_t stream, std::mutex* capture_mutex = nullptr);
  // Destroys every graph and forgets every signature (e.g. when weights are freed).
  void Clear();
  Stats stats() const;

  // fn(args..., stream) now, or recorded until End. fn returns absl::Status.
  template <typename Fn, typename... Args>
  absl::Status Run(cudaStream_t stream, Fn* fn, const Args&... args) {
    if (!recording_) return fn(args..., stream);
    AppendWords(signature_, reinterpret_cast<uintptr_t>(fn));
    (AppendWords(signature_, args), ...);
    using Closure = Recorded<Fn, Args...>;
    static_assert(std::is_trivially_destructible_v<Closure>,
                  "a recorded launch's arguments stay in the arena and are never destroyed");
    void* at = arena_.Allocate(sizeof(Closure), alignof(Closure));
    launches_.push_back(
        {&Invoke<Fn, Args...>, new (at) Closure(fn, Kept<Args>::Keep(arena_, args)...)});
    return absl::OkStatus();
  }
  // As Run, but while recording the launch goes before every launch recorded so far other
  // than earlier RunFirst ones (which stay in their order): a step's prologue, such as
  // the one copy of its staged index arrays that its kernels read.
  template <typename Fn, typename... Args>
  absl::Status RunFirst(cudaStream_t stream, Fn* fn, const Args&... args) {
    const bool recording = recording_;
    if (absl::Status s = Run(stream, fn, args...); !s.ok() || !recording) return s;
    std::rotate(launches_.begin() + first_, launches_.end() - 1, launches_.end());
    ++first_;
    return absl::OkStatus();
  }
  // Adds words to the signature of the step being recorded (nothing otherwise): what a
  // step's launches depend on that their own arguments do not show.
  template <typename... Args>
  void Sign(const Args&... args) {
    if (recording_) (AppendWords(signature_, args), ...);
  }

 private:
  struct Entry {
    Signature signature;
    cudaGraphExec_t exec = nullptr;
    bool capturable = true;
    int64_t last_use = 0;
  };
  // A recorded launch's closure, in arena_: the launcher and its kept arguments.
  template <typename Fn, typename... Args>
  using Recorded = std::tuple<Fn*, typename Kept<Args>::type...>;
  // A recorded launch: its closure and the function that calls the launcher with them.
  struct Launch {
    absl::Status (*invoke)(const void* closure, cudaStream_t stream);
    const void* closure;
    absl::Status operator()(cudaStream_t stream) const { return invoke(closure, stream); }
  };
  template <typename Fn, typename... Args>
  static absl::Status Invoke(const void* closure, cudaStream_t stream) {
    const auto& c = *static_cast<const Recorded<Fn, Args...>*>(closure);
    return std::apply([&](Fn* fn, const auto&... a) { return fn(Kept<Args>::Pass(a)..., stream); },
                      c);
  }
  absl::Status RunEagerly(cudaStream_t stream);
  // Captures launches_ into entry.exec; false (and the stream out of capture mode, the
  // error cleared) when the runtime refused.
  bool Capture(cudaStream_t stream, Entry& entry);
  void Evict();
  int64_t NumGraphs() const;  // instantiated graphs held

  bool recording_ = false;
  Signature signature_;
  StepArena arena_;
  std::vector<Launch> launches_;
  size_t first_ = 0;                             // RunFirst's launches at the front of launches_
  std::unordered_map<uint64_t, Entry> entries_;  // by hash of the signature
  uint64_t last_hash_ = 0;                       // the last step's
  int max_graphs_;
  int max_signatures_;
  Stats stats_;
};

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_STEP_GRAPH_H_
