// RetainFreedMemory: keeps memory the process frees for its next allocations, rather than
// handing it back to the kernel and faulting it in again. A gradient probe allocates tens
// of MB of maps per call (scores, probabilities and their gradients per layer: 40 MB for
// 256 tokens of stories260K); with glibc's defaults every such block larger than its
// dynamic mmap threshold is mapped and unmapped per call, and the heap's top is trimmed,
// so each call paid its size again in page faults (a probe took ~200 ms, ~50 ms with
// this). Costs: up to 256 MB of freed heap kept, and blocks below 32 MB taken from the
// heap (the KV cache and weights, larger, are still mapped on their own). Header-only, for
// the binaries' main(); a no-op outside glibc.
#ifndef KVLENS_COMMON_MALLOC_TUNING_H_
#define KVLENS_COMMON_MALLOC_TUNING_H_

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kvlens {

inline void RetainFreedMemory() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
}

}  // namespace kvlens

#endif  // KVLENS_COMMON_MALLOC_TUNING_H_
