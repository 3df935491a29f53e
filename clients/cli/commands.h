// kvlens-cli subcommands. Each returns the process exit code; output goes to stdout,
// diagnostics to stderr.
#ifndef KVLENS_CLIENTS_CLI_COMMANDS_H_
#define KVLENS_CLIENTS_CLI_COMMANDS_H_

namespace kvlens::cli {

int GenerateCommand(int argc, char** argv);  // argv[1] == "generate"
int TokenizeCommand(int argc, char** argv);  // argv[1] == "tokenize"
int HealthCommand(int argc, char** argv);    // argv[1] == "health"

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_COMMANDS_H_
