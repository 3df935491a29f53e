#include "clients/cli/conversation.h"

#include <unistd.h>

#include <iostream>

namespace kvlens::cli {

int Converse(const Args& args, const std::function<int(const Turns&, std::string*)>& run_turn) {
  Turns turns;
  if (args.Has("system")) turns.emplace_back("system", args.Str("system"));
  const size_t kept = turns.size();
  const bool terminal = isatty(STDIN_FILENO) != 0;
  int code = 0;
  std::string line;
  while (true) {
    if (terminal) std::cerr << "> " << std::flush;
    if (!std::getline(std::cin, line) || line == "/exit") break;
    if (line == "/reset") {
      turns.resize(kept);
      continue;
    }
    if (line.empty()) continue;
    turns.emplace_back("user", line);
    std::string reply;
    if (const int turn = run_turn(turns, &reply); turn != 0) {
      code = turn;
      turns.pop_back();
      continue;
    }
    turns.emplace_back("assistant", reply);
  }
  return code;
}

}  // namespace kvlens::cli
