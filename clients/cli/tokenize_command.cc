#include <cstdio>
#include <iostream>

#include "absl/strings/str_join.h"
#include "clients/cli/args.h"
#include "clients/cli/commands.h"
#include "clients/cli/server_tokens.h"
#include "engine/model/model.h"

namespace kvlens::cli {

int TokenizeCommand(int argc, char** argv) {
  const std::vector<FlagSpec> specs = {
      {"model", "",
       "a GGUF (a vocabulary-only GGUF is enough), a llama2.c .bin or a Hugging Face "
       "directory"},
      {"server", "", "or a kvlens-server HOST:PORT: its model's tokenizer (Generation.Tokenize)"},
      {"timeout", "120", "seconds before the call to --server is abandoned"},
      {"tokenizer", "", "llama2.c tokenizer .bin (default: found beside a .bin model)"},
      {"text", "", "the text to tokenize"},
      {"bos", "", "prepend the BOS token", true},
      {"no-parse-special", "",
       "encode special-token spellings (\"<|endoftext|>\", \"<s>\") as plain text; by default "
       "they become those tokens",
       true},
  };
  auto args = Args::Parse(argc, argv, 2, specs);
  if (!args.ok()) {
    std::cerr << "kvlens-cli tokenize: " << args.status().message() << "\n";
    return 2;
  }
  if (args->help()) {
    std::cout << Args::Usage("tokenize", "Prints the token ids of --text on one line.", specs);
    return 0;
  }
  if (args->Has("server")) {
    if (args->Has("model") || args->Has("tokenizer")) {
      std::cerr << "kvlens-cli tokenize: give --server or --model, not both\n";
      return 2;
    }
    v1::TokenizeRequest request;
    request.set_text(args->Str("text"));
    request.set_add_bos(args->Switch("bos"));
    request.set_parse_special(!args->Switch("no-parse-special"));
    absl::StatusOr<std::vector<int32_t>> ids = ServerTokenize(*args, request, args->Str("server"));
    if (!ids.ok()) {
      std::cerr << "kvlens-cli tokenize: " << ids.status().message() << "\n";
      return ids.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
    std::cout << absl::StrJoin(*ids, " ") << "\n";
    return 0;
  }
  if (!args->Has("model") && !args->Has("tokenizer")) {
    std::cerr << "kvlens-cli tokenize: --model (or --server) is required\n";
    return 2;
  }
  auto tok = LoadTokenizer({args->Str("model"), args->Str("tokenizer")});
  if (!tok.ok()) {
    std::cerr << "kvlens-cli tokenize: " << tok.status().message() << "\n";
    return 1;
  }
  const std::vector<int32_t> ids =
      args->Switch("no-parse-special")
          ? (*tok)->Encode(args->Str("text"), args->Switch("bos"))
          : (*tok)->EncodeWithSpecialTokens(args->Str("text"), args->Switch("bos"));
  std::cout << absl::StrJoin(ids, " ") << "\n";
  return 0;
}

}  // namespace kvlens::cli
