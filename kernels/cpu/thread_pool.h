// A small persistent thread pool for data-parallel kernels: one ParallelFor at a time,
// the calling thread works too, and a call made from inside a task runs inline.
#ifndef KVLENS_KERNELS_CPU_THREAD_POOL_H_
#define KVLENS_KERNELS_CPU_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvlens::kernels {

class ThreadPool {
 public:
  // num_threads counts the caller; 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(t) once for every t in [0, num_tasks) and returns when all are done. Tasks
  // are handed out dynamically, so uneven tasks balance. Safe to call from several
  // threads (calls are serialised) and from inside fn (runs inline).
  void ParallelFor(int64_t num_tasks, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunTasks();

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one ParallelFor at a time

  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;  // bumped for every ParallelFor; guarded by mu_
  int workers_busy_ = 0;     // workers still inside the current generation; guarded by mu_
  bool stop_ = false;

  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
};

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_THREAD_POOL_H_
