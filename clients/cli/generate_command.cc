#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "clients/cli/args.h"
#include "clients/cli/commands.h"
#include "clients/cli/conversation.h"
#include "clients/cli/local_backend.h"
#include "clients/cli/logit_bias_flag.h"
#include "clients/cli/logprobs_table.h"
#include "clients/cli/remote_generate.h"
#include "clients/cli/steering_flag.h"
#include "engine/generator.h"
#include "engine/model/model.h"
#include "engine/stop_matcher.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/reference_backend.h"

namespace kvlens::cli {
namespace {

const std::vector<FlagSpec>& Specs() {
  static const std::vector<FlagSpec> specs = {
      {"model", "",
       "a GGUF file, a llama2.c .bin or a Hugging Face directory (config.json, *.safetensors, "
       "tokenizer.json); required unless --server"},
      {"server", "",
       "HOST:PORT of a kvlens-server: generate there and stream the reply "
       "(model, device, precision, threads, prefill and block flags do not apply)"},
      {"tokenizer", "",
       "llama2.c tokenizer .bin (default: tokenizer.bin or tok<V>.bin beside the model)"},
      {"prompt", "", "prompt text; the output is the prompt followed by the completion"},
      {"chat", "",
       "--prompt is a user message: the prompt is the conversation as the model's chat "
       "template writes it (GGUF tokenizer.chat_template, tokenizer_config.json), and only the "
       "reply is printed",
       true},
      {"system", "", "with --chat: a system message before the user's"},
      {"interactive", "",
       "a conversation in the model's chat template, read from stdin a line a turn "
       "(\"/reset\" forgets the turns, \"/exit\" or end of input ends); each reply is "
       "streamed and kept as the assistant's turn; each turn runs the whole conversation "
       "(with --server the prefix cache holds the earlier turns; locally it is recomputed)",
       true},
      {"chat-template", "",
       "with --chat, local models: the format to write the conversation in instead of the "
       "model's own (chatml, llama3, mistral-v7, gemma, phi3, ...; kvlens-server's "
       "--chat-template lists them all)"},
      {"max-new-tokens", "64", "tokens to generate at most"},
      {"stop", "",
       "end the output before the first occurrence of this text (not printed; with --stats "
       "the finish is \"stop\"): Generate's stopping.stop; may be given more than once"},
      {"min-new-tokens", "0",
       "generate at least this many tokens: until then EOS (unless --ignore-eos) is never "
       "drawn (HF's min_new_tokens, vLLM's min_tokens)"},
      {"temperature", "0", "sampling temperature; 0 is greedy"},
      {"top-k", "0", "keep the k most likely tokens (0: off)"},
      {"top-p", "1", "nucleus sampling mass (1: off)"},
      {"min-p", "0", "drop tokens below min-p times the top probability (0: off)"},
      {"repetition-penalty", "1",
       "CTRL-style repetition penalty (1: off); when not given, the model's "
       "generation_config.json value applies if it has one (as in Hugging Face and vLLM)"},
      {"frequency-penalty", "0",
       "subtract VALUE (-2 ... 2) times the count of a token in the prompt and the output so "
       "far from its logit (OpenAI's and vLLM's frequency_penalty)"},
      {"presence-penalty", "0",
       "subtract VALUE (-2 ... 2) from the logit of every token in the prompt and the output "
       "so far (OpenAI's and vLLM's presence_penalty)"},
      {"seed", "0", "random seed for sampling"},
      {"logit-bias", "",
       "\"ID:BIAS[,ID:BIAS...]\": add BIAS (-100 ... 100) to token ID's logit before each "
       "draw (-100 bans it, 100 forces it; reported log-probabilities stay the model's); may "
       "be given more than once"},
      {"steer", "",
       "activation steering, \"SPEC[;SPEC...]\": HOOK:PATH[:COEF] adds COEF times the "
       "d_model numbers in file PATH to the residual stream at HOOK (blocks.L.hook_resid_pre, "
       "hook_resid_mid or hook_resid_post) at every position (with @START appended: from "
       "position START on; the prompt's token count steers the generated tokens only, -1 "
       "from the prompt's last position, whose row reads the first generated token); with "
       "--server also sae:NAME:FEATURE[:COEF][@START], that feature's decoder direction of "
       "the server's SAE NAME (kvlens-cli sae --list)"},
      {"logprobs", "",
       "also print to stderr each generated token's log-probability and the N (0 … 20) most "
       "likely tokens there, then their sum and perplexity (with --server: Generate's "
       "logprobs and top_logprobs)"},
      {"prompt-logprobs", "",
       "also print to stderr each prompt token's log-probability given the tokens before it "
       "and the N (0 … 20) most likely tokens there, then their sum and perplexity (with "
       "--server: Generate's prompt_logprobs)"},
      {"prefill-chunk", "512", "prompt tokens per prefill step"},
      {"block-size", "16", "KV-cache block size in tokens"},
      {"no-bos", "",
       "do not prepend the BOS token (models whose GGUF says tokenizer.ggml.add_bos_token = "
       "false, such as Qwen2, never get one)",
       true},
      {"no-parse-special", "",
       "encode special-token spellings in the prompt (\"<|endoftext|>\", \"<s>\") as plain "
       "text; by default they become those tokens, as in Hugging Face and llama.cpp",
       true},
      {"ignore-eos", "", "keep generating past the EOS token", true},
      {"stats", "", "print timing and tokens/s to stderr", true},
  };
  static const std::vector<FlagSpec> all = [] {
    std::vector<FlagSpec> v = specs;
    for (FlagSpec& f : LocalBackendFlags()) v.push_back(std::move(f));
    return v;
  }();
  return all;
}

template <typename T>
int Run(const Model& model, kernels::Backend<T>& backend, std::string_view backend_description,
        const std::vector<int32_t>& prompt, const std::string& prompt_text,
        const GenerateOptions& options, const std::vector<std::string>& stops, bool stats,
        std::vector<ScoredToken>* generated, std::string* reply = nullptr,
        GenerateCache<T>* reuse = nullptr) {
  IncrementalDecoder decoder(*model.tokenizer);
  for (int32_t id : prompt) decoder.Push(id);  // the prompt is printed as given
  // The prompt is printed with the first token (or at the end), so a request the generator
  // refuses prints only its error.
  bool shown = false;
  auto show_prompt = [&] {
    if (!shown) std::cout << prompt_text << std::flush;
    shown = true;
  };
  // Text that may begin a stop string is held back until it cannot (StopMatcher, as the
  // engine streams it); a completed one ends the generation.
  StopMatcher stop_matcher(stops);
  bool stopped = false;
  auto result = Generate<T>(
      model, backend, prompt, options,
      [&](int32_t token) {
        const StopMatcher::Result text = stop_matcher.Push(decoder.Push(token));
        show_prompt();
        std::cout << text.emit << std::flush;
        if (reply != nullptr) reply->append(text.emit);
        stopped = text.matched;
        return !stopped;
      },
      reuse);
  if (!result.ok()) {
    if (shown) std::cout << std::endl;
    std::cerr << "kvlens-cli generate: " << result.status().message() << "\n";
    return 1;
  }
  show_prompt();
  if (stopped) result->finish_reason = FinishReason::kStop;
  const std::string tail = stopped ? "" : stop_matcher.Flush(decoder.Flush());
  if (reply != nullptr) reply->append(tail);
  std::cout << tail << std::endl;  // (tables follow on stderr)
  for (size_t i = 0; generated != nullptr && i < result->tokens.size(); ++i) {
    ScoredToken& t = generated->emplace_back();
    t.token = result->tokens[i];
    t.logprob = result->logprobs[i];
    if (i < result->top_logprobs.size()) {
      for (const TokenLogprob& x : result->top_logprobs[i]) t.top.emplace_back(x.token, x.logprob);
    }
  }
  if (stats) {
    const int n = static_cast<int>(result->tokens.size());
    const double decode_tps = n > 1 ? (n - 1) / result->decode_seconds : 0.0;
    const int cached = result->cached_prompt_tokens;  // (the rate is of the tokens computed)
    std::cerr << absl::StrFormat(
        "backend %s | prompt %d tokens (%d cached) in %.3f s (%.1f tok/s) | generated %d "
        "tokens, decode %.1f tok/s | finish: %s\n",
        backend_description, prompt.size(), cached, result->prefill_seconds,
        (prompt.size() - cached) / std::max(result->prefill_seconds, 1e-9), n, decode_tps,
        FinishReasonName(result->finish_reason));
  }
  return 0;
}

}  // namespace

int GenerateCommand(int argc, char** argv) {
  auto fail = [](const absl::Status& s, int code) {
    std::cerr << "kvlens-cli generate: " << s.message() << "\n";
    return code;
  };
  auto args = Args::Parse(argc, argv, 2, Specs());
  if (!args.ok()) return fail(args.status(), 2);
  if (args->help()) {
    std::cout << Args::Usage(
        "generate",
        "Generates a completion of --prompt and prints prompt + completion (with --chat: the "
        "reply to --prompt as a user message).",
        Specs());
    return 0;
  }
  if (args->Has("server")) return RemoteGenerate(*args);
  if (!args->Has("model")) return fail(absl::InvalidArgumentError("--model is required"), 2);

  GenerateOptions options;
  auto max_new = args->Int("max-new-tokens", 0, 1 << 20);
  auto min_new = args->Int("min-new-tokens", 0, 1 << 20);
  auto temperature = args->Double("temperature", 0, 100);
  auto top_k = args->Int("top-k", 0, 1 << 30);
  auto top_p = args->Double("top-p", 0, 1);
  auto min_p = args->Double("min-p", 0, 1);
  auto rep = args->Double("repetition-penalty", 0, 10);
  auto frequency = args->Double("frequency-penalty", -2, 2);
  auto presence = args->Double("presence-penalty", -2, 2);
  auto seed = args->Int("seed", 0, INT64_MAX);
  auto chunk = args->Int("prefill-chunk", 1, 1 << 20);
  auto block = args->Int("block-size", 1, 1024);
  for (const absl::Status& s :
       {max_new.status(), min_new.status(), temperature.status(), top_k.status(), top_p.status(),
        min_p.status(), rep.status(), frequency.status(), presence.status(), seed.status(),
        chunk.status(), block.status()}) {
    if (!s.ok()) return fail(s, 2);
  }
  if (*min_new > *max_new) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
                    "--min-new-tokens = ", *min_new, " must be <= --max-new-tokens = ", *max_new)),
                2);
  }
  LocalBackend local;
  absl::Status error;
  if (const int code = MakeLocalBackend(*args, &local, &error); code != 0) return fail(error, code);
  options.max_new_tokens = static_cast<int>(*max_new);
  options.min_new_tokens = static_cast<int>(*min_new);
  options.sampling.temperature = *temperature;
  options.sampling.top_k = static_cast<int>(*top_k);
  options.sampling.top_p = *top_p;
  options.sampling.min_p = *min_p;
  options.sampling.repetition_penalty = *rep;
  options.sampling.frequency_penalty = *frequency;
  options.sampling.presence_penalty = *presence;
  options.sampling.seed = static_cast<uint64_t>(*seed);
  options.prefill_chunk = static_cast<int>(*chunk);
  options.block_size = static_cast<int>(*block);
  options.kv_cache_dtype = local.kv_cache_dtype;
  options.stop_at_eos = !args->Switch("ignore-eos");

  auto model = LoadModel({args->Str("model"), args->Str("tokenizer")});
  if (!model.ok()) return fail(model.status(), 1);
  if ((*model)->tokenizer == nullptr) {
    return fail(absl::NotFoundError("the model has no tokenizer (pass --tokenizer)"), 1);
  }
  if (!args->Has("repetition-penalty") && (*model)->generation_config.repetition_penalty) {
    options.sampling.repetition_penalty = *(*model)->generation_config.repetition_penalty;
  }
  if (args->Has("logit-bias")) {
    auto bias = ParseLogitBiasFlag(absl::StrJoin(args->All("logit-bias"), ","));
    if (!bias.ok()) return fail(bias.status(), 2);
    options.sampling.logit_bias = *std::move(bias);
  }
  // Steering's starts may count from the prompt's end: resolved against each prompt.
  std::vector<SteeringSpec> steering;
  if (args->Has("steer")) {
    auto specs = ParseSteeringFlag(args->Str("steer"));
    if (!specs.ok()) return fail(specs.status(), 2);
    steering = *std::move(specs);
  }
  if (absl::Status s =
          TuneLocalBackend(local, (*model)->config, options.block_size, options.prefill_chunk);
      !s.ok()) {
    return fail(s, 1);
  }
  auto steer = [&](const std::vector<int32_t>& prompt) {
    auto adds = ToResidualAdds(steering, (*model)->config, static_cast<int>(prompt.size()));
    if (adds.ok()) options.steering = *std::move(adds);
    return adds.status();
  };
  const Tokenizer& tok = *(*model)->tokenizer;
  std::string prompt_text = args->Str("prompt");
  std::string shown = prompt_text;  // what is printed before the completion
  bool parse_special = !args->Switch("no-parse-special");
  const bool interactive = args->Switch("interactive");
  if (args->Switch("chat") || args->Has("system") || interactive) {
    if (args->Has("chat-template")) {
      auto f = ChatFormatByName(args->Str("chat-template"));
      if (!f.ok()) return fail(f.status(), 2);
      (*model)->chat_format = *f;
    }
    if (!(*model)->chat_format) {
      return fail(absl::FailedPreconditionError(
                      "--chat: the model's chat template is missing or none kvlens writes; "
                      "name one with --chat-template"),
                  2);
    }
  }
  if (interactive) {
    // Each turn hands the whole conversation to the generator, whose cache (GenerateCache)
    // still holds the earlier turns' tokens, as kvlens-server's prefix cache does: only the
    // new ones are computed. The exit code is the last refused turn's, else 0.
    const bool bos = !args->Switch("no-bos") && tok.adds_bos();
    const std::vector<std::string> stops = args->All("stop");
    kernels::ReferenceBackend reference;  // (fp64: one for the conversation, as its cache)
    GenerateCache<double> reference_cache;
    GenerateCache<float> cache;
    return Converse(*args, [&](const Turns& turns, std::string* reply) {
      std::vector<ChatMessage> messages;
      for (const auto& [role, content] : turns) messages.push_back({role, content});
      auto text = ApplyChatTemplate(*(*model)->chat_format, messages, true);
      if (!text.ok()) return fail(text.status(), 2);
      const std::vector<int32_t> prompt = tok.EncodeWithSpecialTokens(*text, bos);
      // (A start from the end moves with each turn's prompt: the generator's cache then
      // computes again from the earlier of the two starts.)
      if (absl::Status s = steer(prompt); !s.ok()) return fail(s, 2);
      if (local.fp64) {
        return Run<double>(**model, reference, reference.name(), prompt, "", options, stops,
                           args->Switch("stats"), nullptr, reply, &reference_cache);
      }
      return Run<float>(**model, *local.fp32.backend, local.fp32.description, prompt, "", options,
                        stops, args->Switch("stats"), nullptr, reply, &cache);
    });
  }
  if (args->Switch("chat") || args->Has("system")) {
    std::vector<ChatMessage> messages;
    if (args->Has("system")) messages.push_back({"system", args->Str("system")});
    messages.push_back({"user", prompt_text});
    auto text = ApplyChatTemplate(*(*model)->chat_format, messages, true);
    if (!text.ok()) return fail(text.status(), 2);
    prompt_text = *text;
    shown.clear();
    parse_special = true;  // the template's <|im_start|>, [INST], … are special tokens
  }
  std::vector<int32_t> prompt =
      !parse_special
          ? tok.Encode(prompt_text, !args->Switch("no-bos") && tok.adds_bos())
          : tok.EncodeWithSpecialTokens(prompt_text, !args->Switch("no-bos") && tok.adds_bos());
  if (prompt.empty()) {
    return fail(absl::InvalidArgumentError("the prompt is empty and the model has no BOS token"),
                2);
  }
  if (absl::Status s = steer(prompt); !s.ok()) return fail(s, 2);
  std::vector<ScoredToken> scored;
  if (args->Has("prompt-logprobs")) {
    auto top = args->Int("prompt-logprobs", 0, 20);
    if (!top.ok()) return fail(top.status(), 2);
    options.prompt_logprobs = static_cast<int>(*top);
    options.on_prompt_logprobs = [&scored](const PromptLogprobsEvent& e) {
      for (size_t i = 0; i < e.tokens.size(); ++i) {
        ScoredToken& t = scored.emplace_back();
        t.token = e.tokens[i];
        t.logprob = e.logprobs[i];
        if (!e.top.empty()) {
          for (const TokenLogprob& x : e.top[i]) t.top.emplace_back(x.token, x.logprob);
        }
      }
    };
  }
  const bool stats = args->Switch("stats");
  const std::vector<std::string> stops = args->All("stop");
  std::vector<ScoredToken> generated;
  std::vector<ScoredToken>* want_generated = nullptr;
  if (args->Has("logprobs")) {
    auto top = args->Int("logprobs", 0, 20);
    if (!top.ok()) return fail(top.status(), 2);
    options.top_logprobs = static_cast<int>(*top);
    want_generated = &generated;
  }
  int code = 0;
  if (local.fp64) {
    kernels::ReferenceBackend backend;
    code = Run<double>(**model, backend, backend.name(), prompt, shown, options, stops, stats,
                       want_generated);
  } else {
    code = Run<float>(**model, *local.fp32.backend, local.fp32.description, prompt, shown, options,
                      stops, stats, want_generated);
  }
  auto piece = [&](int32_t token) { return tok.Decode({token}); };
  if (code == 0 && options.prompt_logprobs >= 0) PrintPromptLogprobs(std::cerr, scored, piece);
  if (code == 0 && want_generated != nullptr) {
    PrintLogprobsTable(std::cerr, generated, static_cast<int>(prompt.size()), "generated", piece);
  }
  return code;
}

}  // namespace kvlens::cli
