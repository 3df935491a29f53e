// kvlens-cli subcommands. Each returns the process exit code; output goes to stdout,
// diagnostics to stderr.
#ifndef KVLENS_CLIENTS_CLI_COMMANDS_H_
#define KVLENS_CLIENTS_CLI_COMMANDS_H_

namespace kvlens::cli {

int GenerateCommand(int argc, char** argv);    // argv[1] == "generate"
int TokenizeCommand(int argc, char** argv);    // argv[1] == "tokenize"
int PerplexityCommand(int argc, char** argv);  // argv[1] == "perplexity"
// kvlens.v1.Interpret against a kvlens-server (interpret_commands.cc, patch_command.cc).
int AttentionCommand(int argc, char** argv);  // argv[1] == "attention"
int ProbeCommand(int argc, char** argv);      // argv[1] == "probe"
int InterveneCommand(int argc, char** argv);  // argv[1] == "intervene"
int AttributeCommand(int argc, char** argv);  // argv[1] == "attribute"
int PatchCommand(int argc, char** argv);      // argv[1] == "patch"
int SaeCommand(int argc, char** argv);        // argv[1] == "sae"
int LensCommand(int argc, char** argv);       // argv[1] == "lens"
int HealthCommand(int argc, char** argv);     // argv[1] == "health"

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_COMMANDS_H_
