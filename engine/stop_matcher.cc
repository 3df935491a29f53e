#include "engine/stop_matcher.h"

#include <algorithm>

namespace kvlens {

StopMatcher::Result StopMatcher::Push(std::string_view delta) {
  held_.append(delta);
  Result r;
  if (stops_.empty()) {
    r.emit.swap(held_);
    return r;
  }
  size_t first = std::string::npos;
  for (const std::string& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    r.emit = held_.substr(0, first);
    r.matched = true;
    held_.clear();
    return r;
  }
  // hold back the longest suffix that is a proper prefix of some stop string
  size_t keep = 0;
  for (const std::string& s : stops_) {
    for (size_t len = std::min(s.size() - 1, held_.size()); len > keep; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
    }
  }
  r.emit = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return r;
}

std::string StopMatcher::Flush(std::string_view tail) {
  std::string out;
  out.swap(held_);
  out.append(tail);
  return out;
}

}  // namespace kvlens
