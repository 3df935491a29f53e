// InterpretWorkers: the small, bounded pool that runs interpretability requests apart from
// generation. Each worker owns its backends (InterpBackends), so a probe never shares the
// engine's CpuBackend or its thread pool, and at most `num_workers` probes run at once: the
// engine's step thread keeps its cores, and a flood of probes queues (up to `max_queued`,
// then RESOURCE_EXHAUSTED) instead of starving generation.
//
//   Submit(task) ─▶ queue (≤ max_queued) ─▶ worker k: task(&backends_k)
//   Stop()       ─▶ queued tasks run with nullptr (they answer UNAVAILABLE), workers join
#ifndef KVLENS_SERVER_INTERPRET_WORKERS_H_
#define KVLENS_SERVER_INTERPRET_WORKERS_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend_factory.h"
#include "server/interpret_runner.h"

namespace kvlens::server {

struct InterpretWorkerOptions {
  int num_workers = 2;  // --interp-workers: probes running at once
  int cpu_threads = 1;  // --interp-threads: threads of each worker's fp32 CpuBackend
  int max_queued = 16;  // --interp-queue: waiting probes beyond the running ones
  // --interp-device: where fp32 probes' ops run (fp64 always on the CPU reference). On a
  // GPU each worker gets its own backend (stream), sharing the uploaded weights of
  // `share_weights_with` (the engine's backend) when that is on the same GPU.
  kernels::DeviceSpec device;
  kernels::Backend<float>* share_weights_with = nullptr;
  // Tests: makes each worker's device backend instead of `device` (e.g. a device double).
  std::function<std::unique_ptr<kernels::Backend<float>>()> make_device;
};

class InterpretWorkers {
 public:
  // Called on a worker with its backends, or with nullptr when the pool stops first.
  using Task = std::function<void(InterpBackends*)>;

  explicit InterpretWorkers(const InterpretWorkerOptions& options);
  ~InterpretWorkers();  // Stop()
  InterpretWorkers(const InterpretWorkers&) = delete;
  InterpretWorkers& operator=(const InterpretWorkers&) = delete;

  // Queues the task; RESOURCE_EXHAUSTED naming --interp-queue when full, UNAVAILABLE after
  // Stop. On error the task is not run.
  absl::Status Submit(Task task);
  // Why a worker's --interp-device backend could not be created (then fp32 probes would
  // run on the CPU: the server refuses to start instead), else OK.
  const absl::Status& status() const { return status_; }
  // "cpu" or the device backend's description, e.g. "cuda:0 (NVIDIA H200)".
  const std::string& device_description() const { return device_description_; }
  // Runs what is running to the end, hands queued tasks nullptr, joins. Idempotent.
  void Stop();

 private:
  void Loop(int worker);

  const InterpretWorkerOptions options_;
  absl::Status status_;
  std::string device_description_ = "cpu";
  std::vector<std::unique_ptr<InterpBackends>> backends_;  // one per worker
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;  // guarded by mu_
  bool stop_ = false;       // guarded by mu_
};

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_INTERPRET_WORKERS_H_
