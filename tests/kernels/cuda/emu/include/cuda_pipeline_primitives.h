// kvlens CUDA emulator: the cp.async primitives of <cuda_pipeline_primitives.h>, with their
// asynchrony kept. __pipeline_memcpy_async reads the source when it is issued (the kernels
// copy from memory nothing writes during the kernel) but writes the destination only when
// a later __pipeline_wait_prior retires its group, so a kernel that reads shared memory
// before waiting for the copy reads stale data here too, and its test fails.
#ifndef KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_PIPELINE_PRIMITIVES_H_
#define KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_PIPELINE_PRIMITIVES_H_

#include <cstddef>
#include <cstring>
#include <deque>
#include <vector>

namespace kvlens_emu {

struct PendingCopy {
  void* dst;
  unsigned char bytes[16];
  size_t size;
};

// Per emulated thread of the running block: committed groups, oldest first, and the group
// being filled. Fibers of one block share the host thread, so the key is the thread index.
struct CopyPipeline {
  std::deque<std::vector<PendingCopy>> committed;
  std::vector<PendingCopy> open;
};

inline CopyPipeline& ThisThreadsPipeline() {
  thread_local std::vector<CopyPipeline> pipelines;
  const ThreadContext& c = Ctx();
  const size_t id =
      c.thread_idx.x + size_t{c.block_dim.x} * (c.thread_idx.y + size_t{c.block_dim.y} * c.thread_idx.z);
  if (pipelines.size() <= id) pipelines.resize(id + 1);
  return pipelines[id];
}

}  // namespace kvlens_emu

// size_and_align: 4, 8 or 16 bytes; zfill: bytes at the end written as zeros, not read.
inline void __pipeline_memcpy_async(void* dst_shared, const void* src_global, size_t size_and_align,
                                    size_t zfill = 0) {
  kvlens_emu::PendingCopy c{dst_shared, {}, size_and_align};
  if (size_and_align > zfill) std::memcpy(c.bytes, src_global, size_and_align - zfill);
  kvlens_emu::ThisThreadsPipeline().open.push_back(c);
}

inline void __pipeline_commit() {
  kvlens_emu::CopyPipeline& p = kvlens_emu::ThisThreadsPipeline();
  p.committed.push_back(std::move(p.open));
  p.open.clear();
}

// Retires every committed group but the newest `prior`.
inline void __pipeline_wait_prior(size_t prior) {
  kvlens_emu::CopyPipeline& p = kvlens_emu::ThisThreadsPipeline();
  while (p.committed.size() > prior) {
    for (const kvlens_emu::PendingCopy& c : p.committed.front()) std::memcpy(c.dst, c.bytes, c.size);
    p.committed.pop_front();
  }
}

#endif  // KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_PIPELINE_PRIMITIVES_H_
