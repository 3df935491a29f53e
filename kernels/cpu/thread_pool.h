// A small persistent thread pool for data-parallel kernels: one ParallelFor at a time,
// the calling thread works too, and a call made from inside a task runs inline. Idle
// workers, and a caller waiting for them, poll for ~50 µs before they sleep (unless the
// pool has more threads than the machine has cores).
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
  // Polls pred until it holds (true) or the spin time is over (pred's last value).
  template <typename Pred>
  bool SpinUntil(Pred pred) const;

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one ParallelFor at a time

  bool spin_ = false;

  std::mutex mu_;  // held for every change of generation_ and stop_
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  std::atomic<uint64_t> generation_{0};  // bumped for every ParallelFor
  std::atomic<int> workers_busy_{0};     // workers still inside the current generation
  std::atomic<bool> stop_{false};

  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
};

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_CPU_THREAD_POOL_H_
