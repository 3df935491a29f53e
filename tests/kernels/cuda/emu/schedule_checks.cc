// The order the CUDA emulator runs a launch's blocks and a block's threads in
// (kvlens_emu::SetSchedule, KVLENS_EMU_SCHEDULE; docs/cuda.md, "The CUDA emulator"), each
// check against values worked out by hand: each order's tickets; a read of another
// thread's write with no barrier between gives another result in another order, and with
// a barrier the same; a warp runs ahead of the next up to a block barrier; an unknown
// order in the environment names the choices.
// clang-format off
#include "tests/kernels/cuda/emu/emu_device.h"  // first: the device keywords
// clang-format on
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/cuda/emu/emu_copies.h"

namespace kvlens::kernels::cuda {
namespace {

// Each thread takes the next ticket: the order the emulator ran the grid's threads in.
void TicketKernel(unsigned* counter, unsigned* tickets) {
  tickets[blockIdx.x * blockDim.x + threadIdx.x] = atomicAdd(counter, 1u);
}

// Thread t writes t + 1 to shared memory, then reads its neighbour's slot: with a barrier
// between, thread t reads t + 2 (the last thread 1); without one it races, and reads what
// the order left there (dynamic shared memory starts as NaN).
void NeighbourKernel(bool barrier, float* out) {
  float* values = static_cast<float*>(::kvlens_emu::DynamicShared());
  const unsigned t = threadIdx.x, n = blockDim.x;
  values[t] = static_cast<float>(t + 1);
  if (barrier) __syncthreads();
  out[t] = values[(t + 1) % n];
}

// Every thread reads a shared slot thread 0 set before a barrier; then thread 0 sets it
// again, with (barrier) or without a barrier after the reads. Without one, warp 0 can run
// past its __syncwarp and overwrite the slot before warp 1 has read it.
void RunAheadKernel(bool barrier, float* out) {
  __shared__ float slot;
  if (threadIdx.x == 0) slot = 1.0f;
  __syncthreads();
  const float seen = slot;
  __syncwarp();
  if (barrier) __syncthreads();
  if (threadIdx.x == 0) slot = 2.0f;
  out[threadIdx.x] = seen;
}

// Runs launch() in `schedule`'s order (seed: kShuffle's), then goes back to the
// environment's order, so the suites' reversed run (KVLENS_EMU_SCHEDULE) stays reversed.
template <typename Launch>
void InOrder(::kvlens_emu::Schedule schedule, uint64_t seed, Launch&& launch) {
  ::kvlens_emu::SetSchedule(schedule, seed);
  launch();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ::kvlens_emu::UseEnvironmentSchedule();
}

// Tickets of a grid of 3 blocks of 40 threads (a partial second warp) under each order:
// block by block, each block's threads one after another (no barrier to switch at).
std::vector<unsigned> Tickets(::kvlens_emu::Schedule schedule, uint64_t seed) {
  unsigned* counter = DeviceCopy(std::vector<unsigned>{0});
  unsigned* tickets = nullptr;
  EXPECT_EQ(cudaMalloc(&tickets, 120 * sizeof(unsigned)), cudaSuccess);
  InOrder(schedule, seed,
          [&] { ::kvlens_emu::Launch(TicketKernel, "TicketKernel", 3, 40)(counter, tickets); });
  std::vector<unsigned> h = HostCopy(tickets, 120);
  cudaFree(counter);
  cudaFree(tickets);
  return h;
}

TEST(CudaEmulator, BlocksAndThreadsRunInTheScheduledOrder) {
  using ::kvlens_emu::Schedule;
  std::vector<unsigned> forward(120), reverse(120);
  for (unsigned b = 0; b < 3; ++b) {
    for (unsigned t = 0; t < 40; ++t) {
      forward[b * 40 + t] = b * 40 + t;
      reverse[b * 40 + t] = (2 - b) * 40 + (39 - t);
    }
  }
  EXPECT_EQ(Tickets(Schedule::kForward, 0), forward);
  EXPECT_EQ(Tickets(Schedule::kReverse, 0), reverse);
  const std::vector<unsigned> shuffled = Tickets(Schedule::kShuffle, 7);
  EXPECT_EQ(Tickets(Schedule::kShuffle, 7), shuffled);  // a seed's order is the same each time
  EXPECT_NE(Tickets(Schedule::kShuffle, 8), shuffled);
  EXPECT_NE(shuffled, forward);
  EXPECT_NE(shuffled, reverse);
  // Still a permutation, and a block's threads run together (blocks run one at a time).
  std::vector<unsigned> sorted = shuffled;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, forward);
  for (unsigned b = 0; b < 3; ++b) {
    const auto first = shuffled.begin() + b * 40;
    EXPECT_EQ(*std::max_element(first, first + 40) - *std::min_element(first, first + 40), 39u)
        << "block " << b;
  }
}

// What running the tests in another order (KVLENS_EMU_SCHEDULE) is for: a kernel that
// reads another thread's write without a barrier gets another answer in another order.
TEST(CudaEmulator, ARaceGivesAnotherResultInAnotherOrderAndABarrierTheSame) {
  using ::kvlens_emu::Schedule;
  constexpr unsigned kThreads = 48;
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, kThreads * sizeof(float)), cudaSuccess);
  auto run = [&](Schedule schedule, bool barrier) {
    InOrder(schedule, 3, [&] {
      ::kvlens_emu::Launch(NeighbourKernel, "NeighbourKernel", 1, kThreads,
                           kThreads * sizeof(float))(barrier, out);
    });
    return HostCopy(out, kThreads);
  };
  for (Schedule schedule : {Schedule::kForward, Schedule::kReverse, Schedule::kShuffle}) {
    const std::vector<float> got = run(schedule, /*barrier=*/true);
    for (unsigned t = 0; t < kThreads; ++t)
      EXPECT_EQ(got[t], static_cast<float>((t + 1) % kThreads + 1));
  }
  // Forward: each thread reads its neighbour's slot before the neighbour has run (NaN),
  // but the last reads slot 0, written. Reverse: each has run, but not thread 0 when the
  // last one reads it.
  const std::vector<float> forward = run(Schedule::kForward, /*barrier=*/false);
  const std::vector<float> reverse = run(Schedule::kReverse, /*barrier=*/false);
  for (unsigned t = 0; t + 1 < kThreads; ++t) {
    EXPECT_TRUE(std::isnan(forward[t])) << t;
    EXPECT_EQ(reverse[t], static_cast<float>(t + 2)) << t;
  }
  EXPECT_EQ(forward[kThreads - 1], 1.0f);
  EXPECT_TRUE(std::isnan(reverse[kThreads - 1]));
  cudaFree(out);
}

// The first thread in the order that can run runs until it waits: warp 0 (forward) runs
// through its warp barrier to the end while most of warp 1 has not yet left the block
// barrier before it.
TEST(CudaEmulator, AWarpRunsAheadOfTheNextUntilABlockBarrier) {
  using ::kvlens_emu::Schedule;
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, 64 * sizeof(float)), cudaSuccess);
  auto run = [&](Schedule schedule, bool barrier) {
    InOrder(schedule, 5,
            [&] { ::kvlens_emu::Launch(RunAheadKernel, "RunAheadKernel", 1, 64)(barrier, out); });
    return HostCopy(out, 64);
  };
  const std::vector<float> ones(64, 1.0f);
  for (Schedule schedule : {Schedule::kForward, Schedule::kReverse, Schedule::kShuffle}) {
    EXPECT_EQ(run(schedule, /*barrier=*/true), ones);
  }
  // Forward: thread 63, the last to reach the first barrier, reads at once and waits at
  // its warp's; then warp 0 runs to the end, thread 0 setting the slot to 2 before
  // threads 32–62 have read it.
  std::vector<float> raced(64, 2.0f);
  std::fill(raced.begin(), raced.begin() + 32, 1.0f);
  raced[63] = 1.0f;
  EXPECT_EQ(run(Schedule::kForward, /*barrier=*/false), raced);
  EXPECT_EQ(run(Schedule::kReverse, /*barrier=*/false), ones);  // warp 1 read first
  cudaFree(out);
}

TEST(CudaEmulatorDeathTest, AnUnknownScheduleInTheEnvironmentNamesTheChoices) {
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, 32 * sizeof(float)), cudaSuccess);
  EXPECT_DEATH(
      {
        setenv("KVLENS_EMU_SCHEDULE", "shuffle:x", 1);
        ::kvlens_emu::UseEnvironmentSchedule();
        ::kvlens_emu::Launch(NeighbourKernel, "NeighbourKernel", 1, 32, 32 * sizeof(float))(true,
                                                                                            out);
      },
      "KVLENS_EMU_SCHEDULE=shuffle:x: expected forward, reverse or shuffle:SEED");
  cudaFree(out);
}

}  // namespace
}  // namespace kvlens::kernels::cuda
