#include "kernels/cpu/thread_pool.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::kernels {
namespace {

TEST(ThreadPoolTest, RunsEveryTaskExactlyOnce) {
  for (int threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](int64_t t) { hits[t].fetch_add(1); });
      for (int64_t t = 0; t < n; ++t) EXPECT_EQ(hits[t].load(), 1) << threads << " " << n;
    }
  }
}

TEST(ThreadPoolTest, ZeroMeansHardwareConcurrency) {
  ThreadPool pool(0);
  EXPECT_EQ(pool.num_threads(),
            static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

TEST(ThreadPoolTest, ManyCallsInARowAndNestedCallsRunInline) {
  ThreadPool pool(3);
  std::atomic<int64_t> sum{0};
  for (int round = 0; round < 2000; ++round) {
    pool.ParallelFor(
        4, [&](int64_t t) { pool.ParallelFor(3, [&](int64_t u) { sum.fetch_add(t * 3 + u); }); });
  }
  EXPECT_EQ(sum.load(), 2000 * 66);  // Σ 0…11
}

// Calls far apart (longer than the ~50 µs a worker polls) find the workers asleep on the
// condition variable, calls back to back find them polling; and a worker's task that
// outlasts the caller's poll puts the caller to sleep until the worker wakes it. Every
// task must run, and every call return, either way.
TEST(ThreadPoolTest, CallsAfterTheWorkersFellAsleepAndBackToBack) {
  ThreadPool pool(2);
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int64_t> sum{0};
  for (int round = 0; round < 40; ++round) {
    std::this_thread::sleep_for(std::chrono::microseconds(round % 2 == 0 ? 500 : 0));
    const bool slow_worker = round % 4 == 1;
    pool.ParallelFor(2, [&](int64_t t) {
      if (slow_worker) {
        const bool on_caller = std::this_thread::get_id() == caller;
        std::this_thread::sleep_for(std::chrono::microseconds(on_caller ? 100 : 400));
      }
      sum.fetch_add(t + 1);
    });
  }
  EXPECT_EQ(sum.load(), 40 * 3);
}

TEST(ThreadPoolTest, ConcurrentCallersAreSerialised) {
  ThreadPool pool(3);
  std::atomic<int64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int round = 0; round < 200; ++round) {
        pool.ParallelFor(10, [&](int64_t t) { sum.fetch_add(t); });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4 * 200 * 45);
}

}  // namespace
}  // namespace kvlens::kernels
