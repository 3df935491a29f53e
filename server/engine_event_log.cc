#include "server/engine_event_log.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace kvlens::server {

void EngineEventLog::OnOutOfMemory(const OutOfMemory& event) {
  next_.OnOutOfMemory(event);
  const std::string step = absl::StrCat("a step of ", event.batch_tokens,
                                        event.batch_tokens == 1 ? " token" : " tokens");
  const std::string line =
      event.request_failed
          ? absl::StrCat("kvlens-server: ", step,
                         " ran out of device memory twice in a row; its request failed: ",
                         event.status.message(), "\n")
          : absl::StrCat("kvlens-server: ", step, " ran out of device memory (",
                         event.status.message(), "); it runs again, steps taking at most ",
                         event.step_token_limit, " tokens for now\n");
  std::fputs(line.c_str(), log_);
  std::fflush(log_);
}

}  // namespace kvlens::server
