// StopMatcher: finds stop strings in streamed text without ever emitting text that a
// later token could turn into a stop string. Text that could be the start of a stop
// string is held back until it either completes one or cannot anymore.
#ifndef KVLENS_ENGINE_STOP_MATCHER_H_
#define KVLENS_ENGINE_STOP_MATCHER_H_

#include <string>
#include <string_view>
#include <vector>

namespace kvlens {

class StopMatcher {
 public:
  StopMatcher() = default;
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  struct Result {
    std::string emit;      // safe to send now
    bool matched = false;  // a stop string completed; `emit` is the text before it
  };
  // Appends a text delta (complete UTF-8).
  Result Push(std::string_view delta);
  // Everything still held back, followed by `tail` (at the end of generation).
  std::string Flush(std::string_view tail);

 private:
  std::vector<std::string> stops_;
  std::string held_;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_STOP_MATCHER_H_
