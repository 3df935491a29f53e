#include "kernels/cuda/launch.h"

#include <atomic>

namespace kvlens::kernels::cuda {
namespace {
std::atomic<bool> g_programmatic{false};
}  // namespace

void SetProgrammaticLaunches(bool on) { g_programmatic.store(on, std::memory_order_relaxed); }

bool ProgrammaticLaunches() { return g_programmatic.load(std::memory_order_relaxed); }

}  // namespace kvlens::kernels::cuda
