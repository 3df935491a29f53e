// The load loop of kvlens-load. Closed loop: keep `concurrency` requests in flight, a new
// one as each ends. Open loop: start requests at Poisson arrival times of `rate` per
// second whatever the server's pace (at most max_in_flight at once; arrivals beyond it
// are counted as dropped). Every phase ends by itself: after `requests` starts or
// `duration`, whichever comes first; in-flight requests then get `drain` to finish and
// are cancelled after it (each also carries its own deadline). A conversation's turn
// (Workload, turns > 1) goes back to the workload when it ends, so its next turn can be
// drawn: in the closed loop each freed slot takes a ready turn before a new prompt.
#ifndef KVLENS_CLIENTS_LOAD_RUNNER_H_
#define KVLENS_CLIENTS_LOAD_RUNNER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "clients/load/calls.h"
#include "clients/load/workload.h"

namespace kvlens::load {

enum class Mode { kClosed, kOpen };

struct PhaseOptions {
  Mode mode = Mode::kClosed;
  int concurrency = 4;      // closed loop
  double rate = 4;          // open loop, requests per second
  int max_in_flight = 256;  // open loop
  int64_t requests = 100;   // starts at most
  std::chrono::milliseconds duration{60000};
  std::chrono::milliseconds drain{30000};
  std::chrono::milliseconds request_timeout{120000};
  uint64_t seed = 1;  // arrivals and per-request sampling seeds
};

struct PhaseResult {
  std::vector<CallResult> calls;  // in completion order
  double elapsed_seconds = 0;     // first start → last completion
  int64_t started = 0;
  int64_t dropped = 0;  // open loop: arrivals over max_in_flight
  int64_t cancelled_at_drain = 0;
};

// Progress of a running phase, for the progress bar.
struct Progress {
  int64_t started = 0;
  int64_t finished = 0;
  int64_t errors = 0;
  int64_t output_tokens = 0;
  int in_flight = 0;
  double elapsed_seconds = 0;
};

class Runner {
 public:
  // Requests go round-robin over `servers` (one stub set per address).
  Runner(std::vector<ServerStubs>* servers, Workload* workload)
      : servers_(servers), workload_(workload) {}

  // Runs one phase to its end; `on_progress` (optional) is called about 4 times a second
  // from a helper thread.
  PhaseResult Run(const PhaseOptions& options,
                  const std::function<void(const Progress&)>& on_progress = nullptr);

 private:
  std::vector<ServerStubs>* servers_;
  Workload* workload_;
};

}  // namespace kvlens::load

#endif  // KVLENS_CLIENTS_LOAD_RUNNER_H_
