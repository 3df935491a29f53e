#include "clients/load/runner.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "clients/load/stats.h"

namespace kvlens::load {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The calls of one phase: who is in flight, what has finished. Callbacks arrive on gRPC
// threads; everything here is under mu_.
class Flight {
 public:
  // A conversation's turn that has ended: its request, whether it succeeded, its output.
  struct EndedTurn {
    RequestSpec spec;
    bool ok;
    std::vector<int32_t> output_ids;
  };

  // `turn`: the call is a conversation's turn with turns to come (Workload::WantsOutput).
  void Add(std::unique_ptr<Call> call, std::optional<RequestSpec> turn) {
    std::lock_guard<std::mutex> lock(mu_);
    Call* raw = call.get();
    in_flight_[raw] = std::move(call);
    if (turn) turns_[raw] = *std::move(turn);
    ++started_;
  }

  void Done(Call* call, CallResult result) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_flight_.find(call);
    finished_calls_.push_back(std::move(it->second));
    in_flight_.erase(it);
    if (auto turn = turns_.find(call); turn != turns_.end()) {
      ended_turns_.push_back({std::move(turn->second), result.code == grpc::StatusCode::OK,
                              std::move(result.output_ids)});
      turns_.erase(turn);
    }
    if (result.code != grpc::StatusCode::OK) ++errors_;
    output_tokens_ += result.output_tokens;
    last_done_ = Clock::now();
    results_.push_back(std::move(result));
    cv_.notify_all();
  }

  // Waits until fewer than `limit` calls are in flight or `deadline`; whether there is room.
  bool WaitForRoom(int limit, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock, deadline,
                          [&] { return static_cast<int>(in_flight_.size()) < limit; });
  }
  bool WaitEmpty(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_until(lock, deadline, [&] { return in_flight_.empty(); });
  }
  void WaitEmpty() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return in_flight_.empty(); });
  }
  int64_t CancelAll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [raw, call] : in_flight_) raw->Cancel();
    return static_cast<int64_t>(in_flight_.size());
  }
  int InFlight() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(in_flight_.size());
  }
  // Destroys finished reactors (never from inside their own OnDone).
  void Reap() {
    std::vector<std::unique_ptr<Call>> dead;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dead.swap(finished_calls_);
    }
  }
  Progress Snapshot() {
    std::lock_guard<std::mutex> lock(mu_);
    Progress p;
    p.started = started_;
    p.finished = static_cast<int64_t>(results_.size());
    p.errors = errors_;
    p.output_tokens = output_tokens_;
    p.in_flight = static_cast<int>(in_flight_.size());
    return p;
  }
  std::vector<EndedTurn> TakeEndedTurns() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(ended_turns_, {});
  }
  std::vector<CallResult> TakeResults(Clock::time_point& last_done) {
    std::lock_guard<std::mutex> lock(mu_);
    last_done = last_done_;
    return std::move(results_);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Call*, std::unique_ptr<Call>> in_flight_;
  std::map<Call*, RequestSpec> turns_;  // in flight, of conversations with turns to come
  std::vector<EndedTurn> ended_turns_;
  std::vector<std::unique_ptr<Call>> finished_calls_;
  std::vector<CallResult> results_;
  int64_t started_ = 0;
  int64_t errors_ = 0;
  int64_t output_tokens_ = 0;
  Clock::time_point last_done_;
};

}  // namespace

PhaseResult Runner::Run(const PhaseOptions& options,
                        const std::function<void(const Progress&)>& on_progress) {
  PhaseResult result;
  Flight flight;
  PoissonArrivals arrivals(options.rate > 0 ? options.rate : 1, options.seed);
  uint64_t request_seed = options.seed;
  size_t next_server = 0;
  const Clock::time_point start = Clock::now();
  const Clock::time_point end = start + options.duration;

  std::atomic<bool> running{true};
  std::thread reporter;
  if (on_progress) {
    reporter = std::thread([&] {
      while (running.load()) {
        Progress p = flight.Snapshot();
        p.elapsed_seconds = Seconds(Clock::now() - start);
        on_progress(p);
        std::this_thread::sleep_for(std::chrono::milliseconds(250));
      }
    });
  }

  Clock::time_point next_arrival = start;
  while (result.started < options.requests && Clock::now() < end) {
    if (options.mode == Mode::kClosed) {
      if (!flight.WaitForRoom(options.concurrency, end)) break;
    } else {
      if (next_arrival >= end) break;
      std::this_thread::sleep_until(next_arrival);  // late arrivals start at once
      next_arrival += std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(arrivals.NextGap()));
      if (flight.InFlight() >= options.max_in_flight) {
        ++result.dropped;
        continue;
      }
    }
    flight.Reap();
    for (Flight::EndedTurn& t : flight.TakeEndedTurns()) {
      workload_->Finished(t.spec, t.ok, t.output_ids);
    }
    RequestSpec spec = workload_->Next();
    const ServerStubs& stubs = (*servers_)[next_server++ % servers_->size()];
    const bool turns_to_come = workload_->WantsOutput(spec);
    std::unique_ptr<Call> call =
        spec.kind == Kind::kGenerate
            ? MakeGenerateCall(stubs.generation.get(),
                               workload_->ToGenerateRequest(spec, request_seed++),
                               options.request_timeout, turns_to_come)
            : MakeInterpretCall(stubs, spec, options.request_timeout);
    Call* raw = call.get();
    flight.Add(std::move(call),
               turns_to_come ? std::optional<RequestSpec>(std::move(spec)) : std::nullopt);
    ++result.started;
    raw->Start([&flight](Call* c, CallResult r) { flight.Done(c, std::move(r)); });
  }

  // Drain: let in-flight requests finish, then cancel the rest. Cancelled calls still
  // report (OnDone always runs), bounded by their own deadlines.
  if (!flight.WaitEmpty(Clock::now() + options.drain)) {
    result.cancelled_at_drain = flight.CancelAll();
    // gRPC runs OnDone promptly after TryCancel; the reactors must outlive it, so this
    // wait has no deadline of its own.
    flight.WaitEmpty();
  }
  running.store(false);
  if (reporter.joinable()) reporter.join();
  flight.Reap();

  Clock::time_point last_done;
  result.calls = flight.TakeResults(last_done);
  result.elapsed_seconds =
      last_done == Clock::time_point() ? Seconds(Clock::now() - start) : Seconds(last_done - start);
  return result;
}

}  // namespace kvlens::load
