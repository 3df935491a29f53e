// Memory: where a backend's activations and KV cache live, and the copies in and out.
//
// The CPU backends compute on host memory: HostMemory() allocates with operator new and
// copies with memcpy, so an engine written against Memory costs nothing extra on the CPU
// path (no staging, no copies beyond those the engine asked for before). The CUDA
// backend's memory is device memory (kernels/cuda/cuda_memory.h): plain cudaMalloc, and
// copies ordered on the backend's stream.
//
// Every pointer given to these calls must come from this Memory's Allocate, except the
// host side of CopyFromHost / CopyToHost.
#ifndef KVLENS_KERNELS_MEMORY_H_
#define KVLENS_KERNELS_MEMORY_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvlens::kernels {

class Memory {
 public:
  virtual ~Memory() = default;
  // "host", "cuda:0", …
  virtual std::string_view name() const = 0;
  // True when allocations are plain host memory the caller may read and write directly.
  virtual bool host_accessible() const = 0;

  // `bytes` of uninitialised memory (nullptr for 0 bytes). RESOURCE_EXHAUSTED when out of
  // memory. Alignment: at least 64 bytes.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  // Frees an allocation (nullptr is a no-op). Work still using it finishes first.
  virtual void Free(void* p) = 0;

  // dst (this memory) ← src (host). May return before the copy is done, but src may be
  // reused as soon as it returns; later work of the backend sees the data.
  virtual absl::Status CopyFromHost(void* dst, const void* src, size_t bytes) = 0;
  // dst (host) ← src (this memory), after all work enqueued before it; returns when dst
  // holds the data. Safe from a thread other than the one driving the backend, as long as
  // no work in flight writes src.
  virtual absl::Status CopyToHost(void* dst, const void* src, size_t bytes) = 0;
  // dst ← src, both in this memory, ordered with the backend's work.
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes) = 0;
  // Every byte of dst[0, bytes) ← `byte` (0xFF fills float and double with NaN).
  virtual absl::Status Memset(void* dst, int byte, size_t bytes) = 0;

  // Free and total bytes of the device behind this memory, as its driver counts them
  // (other processes' allocations included). UNIMPLEMENTED for memory without such a
  // budget (the host's).
  struct Usage {
    size_t free = 0, total = 0;
  };
  virtual absl::StatusOr<Usage> usage() const {
    return absl::UnimplementedError(absl::StrCat("memory \"", std::string(name()),
                                                 "\" does not report its free and total bytes"));
  }
};

// The process's host memory (the CPU backends' memory): one shared instance.
Memory& HostMemory();

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_MEMORY_H_
