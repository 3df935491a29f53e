#include "kernels/cpu/thread_pool.h"

#include <chrono>

namespace kvlens::kernels {
namespace {

thread_local bool tls_inside_pool_task = false;

// How long a thread polls before it sleeps on a condition variable: a step's parallel
// loops follow each other within microseconds, and on a virtual machine each futex
// sleep and wake-up costs a few microseconds of system call (the pool's futex calls took
// ~15% of a small model's serving time).
constexpr std::chrono::microseconds kSpin{50};

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (num_threads <= 0) num_threads = cores;
  if (num_threads <= 0) num_threads = 1;
  // Polling threads that outnumber the cores would take them from the threads they wait for.
  spin_ = cores > 0 && num_threads <= cores;
  workers_.reserve(num_threads - 1);
  for (int t = 1; t < num_threads; ++t) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true, std::memory_order_release);
  }
  start_cv_.notify_all();
  for (std::thread& w : workers_) w.join();
}

template <typename Pred>
bool ThreadPool::SpinUntil(Pred pred) const {
  if (!spin_) return pred();
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (int i = 1;; ++i) {
    if (pred()) return true;
    CpuRelax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() > deadline) return pred();
  }
}

void ThreadPool::RunTasks() {
  const bool was_inside = tls_inside_pool_task;
  tls_inside_pool_task = true;
  for (int64_t t; (t = next_task_.fetch_add(1, std::memory_order_relaxed)) < num_tasks_;) {
    (*fn_)(t);
  }
  tls_inside_pool_task = was_inside;
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  auto started = [&] {
    return stop_.load(std::memory_order_acquire) ||
           generation_.load(std::memory_order_acquire) != seen;
  };
  for (;;) {
    if (!SpinUntil(started)) {
      // generation_ and stop_ change under mu_, so the check and the sleep cannot miss one.
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, started);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    RunTasks();
    if (workers_busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Under mu_: the caller checks workers_busy_ under it before it sleeps.
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t num_tasks, const std::function<void(int64_t)>& fn) {
  if (num_tasks <= 0) return;
  if (num_tasks == 1 || workers_.empty() || tls_inside_pool_task) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  fn_ = &fn;
  num_tasks_ = num_tasks;
  next_task_.store(0, std::memory_order_relaxed);
  workers_busy_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);  // publishes the fields above
  }
  start_cv_.notify_all();  // no system call when no worker sleeps
  RunTasks();
  auto done = [&] { return workers_busy_.load(std::memory_order_acquire) == 0; };
  if (!SpinUntil(done)) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, done);
  }
  fn_ = nullptr;
}

}  // namespace kvlens::kernels
