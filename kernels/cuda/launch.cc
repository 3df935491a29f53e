#include "kernels/cuda/launch.h"

#include <atomic>

namespace kvlens::kernels::cuda {
namespace {
std::atomic<bool> g_programmatic{false};
std::atomic<bool> g_prefetches{true};
}  // namespace

void SetProgrammaticLaunches(bool on) { g_programmatic.store(on, std::memory_order_relaxed); }

bool ProgrammaticLaunches() { return g_programmatic.load(std::memory_order_relaxed); }

void SetLaunchPrefetches(bool on) { g_prefetches.store(on, std::memory_order_relaxed); }

bool PrefetchBeforeWait() {
  return ProgrammaticLaunches() && g_prefetches.load(std::memory_order_relaxed);
}

}  // namespace kvlens::kernels::cuda
