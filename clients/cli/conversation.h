// kvlens-cli generate --interactive: a conversation read from stdin, a line a turn, for a
// local model and a kvlens-server alike. Each turn hands the whole conversation so far
// (--system first, then the user's and assistant's turns, the new user line last) to
// `run_turn`, which streams the reply to stdout, appends its text to `reply` and returns
// an exit code; the reply becomes the assistant's turn. "/reset" forgets the turns (not
// --system), "/exit" or the end of input ends, an empty line is skipped, and a refused
// turn (code ≠ 0) is dropped, the conversation going on. On a terminal each turn is
// prompted with "> " on stderr.
#ifndef KVLENS_CLIENTS_CLI_CONVERSATION_H_
#define KVLENS_CLIENTS_CLI_CONVERSATION_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "clients/cli/args.h"

namespace kvlens::cli {

using Turns = std::vector<std::pair<std::string, std::string>>;  // (role, content)

// Returns 0, or the last refused turn's exit code.
int Converse(const Args& args, const std::function<int(const Turns&, std::string*)>& run_turn);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_CONVERSATION_H_
