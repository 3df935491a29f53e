// `kvlens-cli generate --server HOST:PORT`: the same command against a kvlens-server,
// streaming the completion to the terminal as it arrives.
#ifndef KVLENS_CLIENTS_CLI_REMOTE_GENERATE_H_
#define KVLENS_CLIENTS_CLI_REMOTE_GENERATE_H_

#include "clients/cli/args.h"

namespace kvlens::cli {

// Uses the generate flags that make sense remotely (prompt, sampling, stopping, steering,
// prompt log-probabilities, stats; --interactive: a conversation read from stdin);
// returns the process exit code.
int RemoteGenerate(const Args& args);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_REMOTE_GENERATE_H_
