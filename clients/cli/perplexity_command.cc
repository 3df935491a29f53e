// kvlens-cli perplexity: a model's perplexity on a text file (engine/perplexity.h), in the
// manner of llama.cpp's llama-perplexity (--scoring second-half scores as it does); to
// compare precisions, quantisations and --int8-activations on the same text.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "clients/cli/args.h"
#include "clients/cli/commands.h"
#include "clients/cli/local_backend.h"
#include "engine/model/model.h"
#include "engine/perplexity.h"
#include "kernels/cpu/reference_backend.h"

namespace kvlens::cli {
namespace {

const std::vector<FlagSpec>& Specs() {
  static const std::vector<FlagSpec> all = [] {
    std::vector<FlagSpec> v = {
        {"model", "", "model file or directory (GGUF, llama2.c .bin, Hugging Face)"},
        {"tokenizer", "", "llama2.c tokenizer.bin (llama2.c .bin models)"},
        {"file", "", "the text to score (UTF-8)"},
        {"ctx", "0",
         "tokens per window: each window of ctx + 1 tokens predicts its last ctx from the "
         "earlier ones, from an empty cache; windows overlap by one token (0: 512, or the "
         "model's context length if shorter)"},
        {"scoring", "all",
         "all: every token of each window (windows of ctx + 1 overlapping by one), as the "
         "default model's training script scores; second-half: as llama.cpp's "
         "llama-perplexity, disjoint windows of ctx tokens, each starting with BOS (unless "
         "--no-bos), scoring only tokens ctx/2 + 1 ... ctx - 1 (comparable with its numbers "
         "at the same context)"},
        {"max-windows", "0", "score at most this many windows (0: all)"},
        {"chunk", "512", "tokens per forward step within a window"},
        {"block-size", "16", "KV-cache block size in tokens"},
        {"no-bos", "", "do not prepend the BOS token to the text", true},
        {"no-parse-special", "",
         "encode special-token spellings in the text (\"<|endoftext|>\", \"<s>\") as plain "
         "text; by default they become those tokens",
         true},
        {"progress", "", "print each window's running perplexity to stderr", true},
        {"json", "", "print one JSON line instead of the summary", true},
    };
    for (FlagSpec& f : LocalBackendFlags()) v.push_back(std::move(f));
    return v;
  }();
  return all;
}

}  // namespace

int PerplexityCommand(int argc, char** argv) {
  auto fail = [](const absl::Status& s, int code) {
    std::cerr << "kvlens-cli perplexity: " << s.message() << "\n";
    return code;
  };
  auto args = Args::Parse(argc, argv, 2, Specs());
  if (!args.ok()) return fail(args.status(), 2);
  if (args->help()) {
    std::cout << Args::Usage("perplexity",
                             "Prints a model's perplexity on --file: exp of the mean negative "
                             "log-likelihood per predicted token.",
                             Specs());
    return 0;
  }
  if (!args->Has("model")) return fail(absl::InvalidArgumentError("--model is required"), 2);
  if (!args->Has("file")) return fail(absl::InvalidArgumentError("--file is required"), 2);
  auto ctx = args->Int("ctx", 0, 1 << 20);
  auto max_windows = args->Int("max-windows", 0, 1 << 30);
  auto chunk = args->Int("chunk", 1, 1 << 20);
  auto block = args->Int("block-size", 1, 1024);
  for (const absl::Status& s :
       {ctx.status(), max_windows.status(), chunk.status(), block.status()}) {
    if (!s.ok()) return fail(s, 2);
  }
  const std::string scoring = args->Str("scoring");
  if (scoring != "all" && scoring != "second-half") {
    return fail(absl::InvalidArgumentError(
                    absl::StrCat("--scoring must be all or second-half, got \"", scoring, "\"")),
                2);
  }
  LocalBackend local;
  absl::Status error;
  if (const int code = MakeLocalBackend(*args, &local, &error); code != 0) return fail(error, code);

  std::ifstream in(args->Str("file"), std::ios::binary);
  if (!in)
    return fail(absl::NotFoundError(absl::StrCat("cannot read --file ", args->Str("file"))), 1);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto model = LoadModel({args->Str("model"), args->Str("tokenizer")});
  if (!model.ok()) return fail(model.status(), 1);
  if ((*model)->tokenizer == nullptr) {
    return fail(absl::NotFoundError("the model has no tokenizer (pass --tokenizer)"), 1);
  }
  const Tokenizer& tok = *(*model)->tokenizer;
  const bool bos = !args->Switch("no-bos") && tok.adds_bos();
  const std::vector<int32_t> tokens = args->Switch("no-parse-special")
                                          ? tok.Encode(text, bos)
                                          : tok.EncodeWithSpecialTokens(text, bos);
  const int max_len = (*model)->config.max_seq_len;
  if (*ctx > max_len) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
                    "--ctx ", *ctx, " is more than the model's context length ", max_len)),
                2);
  }
  PerplexityOptions options;
  options.context = *ctx > 0 ? static_cast<int>(*ctx) : std::min(512, max_len);
  options.max_windows = static_cast<int>(*max_windows);
  options.chunk = static_cast<int>(*chunk);
  options.block_size = static_cast<int>(*block);
  options.kv_cache_dtype = local.kv_cache_dtype;
  if (absl::Status s = TuneLocalBackend(local, (*model)->config, options.block_size, options.chunk);
      !s.ok()) {
    return fail(s, 1);
  }
  if (scoring == "second-half") {
    options.scoring = PerplexityScoring::kSecondHalf;
    options.bos_token = bos ? tok.bos_id() : -1;
  }
  const bool progress = args->Switch("progress");
  auto on_window = [&](const PerplexityResult& r) {
    if (progress) {
      std::cerr << absl::StrFormat("[%d] %.4f\n", r.windows, r.perplexity());
    }
  };
  absl::StatusOr<PerplexityResult> result;
  std::string backend_name;
  if (local.fp64) {
    kernels::ReferenceBackend backend;
    backend_name = std::string(backend.name());
    result = EvaluatePerplexity<double>(**model, backend, tokens, options, on_window);
  } else {
    backend_name = local.fp32.description;
    result = EvaluatePerplexity<float>(**model, *local.fp32.backend, tokens, options, on_window);
  }
  if (!result.ok()) {
    const absl::Status& s = result.status();
    return fail(s, s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
  }
  const double tps = static_cast<double>(result->tokens) / std::max(result->seconds, 1e-9);
  if (args->Switch("json")) {
    std::cout << absl::StrFormat(
        "{\"perplexity\":%.6f,\"mean_nll\":%.8f,\"tokens\":%d,\"windows\":%d,\"ctx\":%d,"
        "\"scoring\":\"%s\",\"text_tokens\":%d,\"backend\":\"%s\",\"seconds\":%.3f,"
        "\"tokens_per_second\":%.1f}\n",
        result->perplexity(), result->mean_nll(), result->tokens, result->windows, options.context,
        scoring, tokens.size(), backend_name, result->seconds, tps);
  } else {
    std::cout << absl::StrFormat(
        "perplexity %.4f (mean NLL %.6f nats/token) over %d tokens: %d windows of %d%s "
        "(the text has %d tokens)\nbackend %s | %.2f s, %.0f tokens/s\n",
        result->perplexity(), result->mean_nll(), result->tokens, result->windows, options.context,
        scoring == "all" ? "" : ", second halves scored", tokens.size(), backend_name,
        result->seconds, tps);
  }
  return 0;
}

}  // namespace kvlens::cli
