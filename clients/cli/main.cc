// kvlens-cli: run a model offline from the terminal.
#include <cstdio>
#include <cstring>
#include <string>

#include "clients/cli/commands.h"
#include "common/malloc_tuning.h"

namespace {
constexpr char kUsage[] =
    "usage: kvlens-cli COMMAND [flags]\n"
    "\n"
    "commands:\n"
    "  generate   generate text from a prompt with a local model (GGUF or llama2.c .bin),\n"
    "             or with a kvlens-server (--server HOST:PORT)\n"
    "  tokenize   print the token ids of a text (a local model's or a server's tokenizer)\n"
    "  perplexity a local model's perplexity on a text file\n"
    "  attention  attention maps and per-head scores from a kvlens-server\n"
    "  probe      gradient probe (log-prob of a token; saliency; --verify) on a server\n"
    "  intervene  ablate heads on a server; clean vs edited log-probs\n"
    "  attribute  direct logit attribution (embeddings, layers, heads, neurons) on a server\n"
    "  patch      activation patching swept over layers x positions on a server\n"
    "  sae        sparse-autoencoder features of a prompt on a server (--sae)\n"
    "  lens       logit lens: each layer's likeliest next tokens on a server\n"
    "  health     exit 0 when a kvlens-server answers grpc.health.v1 with SERVING\n"
    "\n"
    "Run 'kvlens-cli COMMAND --help' for a command's flags.\n";
}  // namespace

int main(int argc, char** argv) {
  kvlens::RetainFreedMemory();  // before anything is allocated: see malloc_tuning.h
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  if (command == "generate") return kvlens::cli::GenerateCommand(argc, argv);
  if (command == "tokenize") return kvlens::cli::TokenizeCommand(argc, argv);
  if (command == "perplexity") return kvlens::cli::PerplexityCommand(argc, argv);
  if (command == "attention") return kvlens::cli::AttentionCommand(argc, argv);
  if (command == "probe") return kvlens::cli::ProbeCommand(argc, argv);
  if (command == "intervene") return kvlens::cli::InterveneCommand(argc, argv);
  if (command == "attribute") return kvlens::cli::AttributeCommand(argc, argv);
  if (command == "patch") return kvlens::cli::PatchCommand(argc, argv);
  if (command == "sae") return kvlens::cli::SaeCommand(argc, argv);
  if (command == "lens") return kvlens::cli::LensCommand(argc, argv);
  if (command == "health") return kvlens::cli::HealthCommand(argc, argv);
  std::fprintf(stderr, "kvlens-cli: unknown command '%s'\n\n%s", command.c_str(), kUsage);
  return 2;
}
