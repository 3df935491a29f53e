#include "server/interpret_workers.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvlens::server {

InterpretWorkers::InterpretWorkers(const InterpretWorkerOptions& options) : options_(options) {
  const int n = std::max(1, options.num_workers);
  for (int k = 0; k < n; ++k) {
    auto b = std::make_unique<InterpBackends>(std::max(1, options.cpu_threads));
    if (options.make_device) {
      b->device = options.make_device();
      device_description_ = std::string(b->device->name());
      b->staged = std::make_unique<kernels::StagedBackend>(
          *b->device, b->f32, dynamic_cast<kernels::BackwardOps<float>*>(b->device.get()));
    } else if (options.device.kind != kernels::DeviceSpec::Kind::kCpu && status_.ok()) {
      auto created = kernels::CreateBackend(options.device, 1, options.share_weights_with);
      if (created.ok()) {
        device_description_ = created->description;
        b->device = std::move(created->backend);
        b->staged = std::make_unique<kernels::StagedBackend>(
            *b->device, b->f32, dynamic_cast<kernels::BackwardOps<float>*>(b->device.get()));
      } else {
        status_ = absl::Status(created.status().code(),
                               absl::StrCat("--interp-device ", options.device.ToString(), ": ",
                                            created.status().message()));
      }
    }
    backends_.push_back(std::move(b));
  }
  for (int k = 0; k < n; ++k) threads_.emplace_back([this, k] { Loop(k); });
}

InterpretWorkers::~InterpretWorkers() { Stop(); }

absl::Status InterpretWorkers::Submit(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return absl::UnavailableError("the server is shutting down");
    if (static_cast<int>(queue_.size()) >= options_.max_queued) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "too many interpretability requests waiting (--interp-queue = ", options_.max_queued,
          ", --interp-workers = ", threads_.size(), "); retry later"));
    }
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return absl::OkStatus();
}

void InterpretWorkers::Stop() {
  std::deque<Task> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && threads_.empty()) return;
    stop_ = true;
    left.swap(queue_);
  }
  cv_.notify_all();
  for (Task& t : left) t(nullptr);
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

void InterpretWorkers::Loop(int worker) {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    // An earlier probe's out of memory on the device failed that probe only.
    if (InterpBackends& b = *backends_[worker]; b.staged != nullptr) (void)b.staged->Recover();
    task(backends_[worker].get());
  }
}

}  // namespace kvlens::server
