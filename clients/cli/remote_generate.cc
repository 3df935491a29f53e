#include "clients/cli/remote_generate.h"

#include <grpcpp/grpcpp.h>

#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "clients/cli/conversation.h"
#include "clients/cli/logit_bias_flag.h"
#include "clients/cli/logprobs_table.h"
#include "clients/cli/rpc_call.h"
#include "clients/cli/server_tokens.h"
#include "clients/cli/steering_flag.h"
#include "clients/cli/utf8_fields.h"
#include "kvlens/v1/generation.grpc.pb.h"

namespace kvlens::cli {
namespace {

int Fail(const absl::Status& s, int code) {
  std::cerr << "kvlens-cli generate: " << s.message() << "\n";
  return code;
}

const char* FinishName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_EOS:
      return "eos";
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    case v1::FINISH_REASON_CONTEXT:
      return "context";
    default:
      return "unspecified";
  }
}

// The server's spelling of a token (Detokenize), or "#id" when it cannot say.
std::string ServerPiece(v1::Generation::Stub& stub, int32_t token) {
  grpc::ClientContext context;
  absl::StatusOr<std::string> text = ServerTokenText(stub, context, token);
  return text.ok() ? *std::move(text) : absl::StrCat("#", token);
}

// The conversation as Generate's chat prompt.
void AddChat(const Turns& turns, v1::GenerateRequest* request) {
  for (const auto& [role, content] : turns) {
    v1::ChatMessage* m = request->mutable_chat()->add_messages();
    m->set_role(role);
    m->set_content(content);
  }
}

// The wire's entries as the table printer takes them.
void AppendScored(const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& entries,
                  std::vector<ScoredToken>* out) {
  for (const v1::TokenLogprob& lp : entries) {
    ScoredToken& t = out->emplace_back();
    t.token = lp.token();
    t.logprob = lp.logprob();
    for (const v1::TopLogprob& top : lp.top()) t.top.emplace_back(top.token(), top.logprob());
  }
}

// The request the flags describe, without its prompt; INVALID_ARGUMENT naming a bad flag.
absl::StatusOr<v1::GenerateRequest> RequestFromFlags(const Args& args) {
  auto max_new = args.Int("max-new-tokens", 1, 1 << 20);
  auto min_new = args.Int("min-new-tokens", 0, 1 << 20);
  auto temperature = args.Double("temperature", 0, 100);
  auto top_k = args.Int("top-k", 0, 1 << 30);
  auto top_p = args.Double("top-p", 0, 1);
  auto min_p = args.Double("min-p", 0, 1);
  auto rep = args.Double("repetition-penalty", 0, 10);
  auto frequency = args.Double("frequency-penalty", -2, 2);
  auto presence = args.Double("presence-penalty", -2, 2);
  auto seed = args.Int("seed", 0, INT64_MAX);
  // No default: absent, the prompt is not scored.
  absl::StatusOr<int64_t> prompt_logprobs = int64_t{-1};
  if (args.Has("prompt-logprobs")) prompt_logprobs = args.Int("prompt-logprobs", 0, 20);
  absl::StatusOr<int64_t> logprobs = int64_t{-1};
  if (args.Has("logprobs")) logprobs = args.Int("logprobs", 0, 20);
  for (const absl::Status& s :
       {max_new.status(), min_new.status(), temperature.status(), top_k.status(), top_p.status(),
        min_p.status(), rep.status(), frequency.status(), presence.status(), seed.status(),
        prompt_logprobs.status(), logprobs.status()}) {
    if (!s.ok()) return s;
  }
  if (*min_new > *max_new) {
    return absl::InvalidArgumentError(
        absl::StrCat("--min-new-tokens = ", *min_new, " must be <= --max-new-tokens = ", *max_new));
  }
  if (args.Has("chat-template")) {
    return absl::InvalidArgumentError(
        "--chat-template applies to local models; start kvlens-server with it");
  }
  v1::GenerateRequest request;
  if (args.Switch("no-bos")) request.set_add_bos(false);  // else the model's own default
  request.set_parse_special(!args.Switch("no-parse-special"));
  v1::SamplingParams* sampling = request.mutable_sampling();
  sampling->set_temperature(*temperature);
  sampling->set_top_k(static_cast<int32_t>(*top_k));
  sampling->set_top_p(*top_p);
  sampling->set_min_p(*min_p);
  // Not given: the server applies the model's generation_config.json default.
  if (args.Has("repetition-penalty")) sampling->set_repetition_penalty(*rep);
  sampling->set_frequency_penalty(*frequency);
  sampling->set_presence_penalty(*presence);
  sampling->set_seed(static_cast<uint64_t>(*seed));
  if (args.Has("logit-bias")) {
    absl::StatusOr<std::vector<std::pair<int32_t, float>>> bias =
        ParseLogitBiasFlag(absl::StrJoin(args.All("logit-bias"), ","));
    if (!bias.ok()) return bias.status();
    for (const auto& [id, value] : *bias) (*sampling->mutable_logit_bias())[id] = value;
  }
  request.mutable_stopping()->set_max_new_tokens(static_cast<int32_t>(*max_new));
  request.mutable_stopping()->set_ignore_eos(args.Switch("ignore-eos"));
  request.mutable_stopping()->set_min_new_tokens(static_cast<int32_t>(*min_new));
  for (const std::string& stop : args.All("stop")) request.mutable_stopping()->add_stop(stop);
  if (args.Has("steer")) {
    absl::StatusOr<std::vector<SteeringSpec>> steer = ParseSteeringFlag(args.Str("steer"));
    if (!steer.ok()) return steer.status();
    AddSteering(*steer, &request);
  }
  if (*prompt_logprobs >= 0) {
    request.set_prompt_logprobs(static_cast<int32_t>(*prompt_logprobs));
  }
  if (*logprobs >= 0) {
    request.set_logprobs(true);
    request.set_top_logprobs(static_cast<int32_t>(*logprobs));
  }
  return request;
}

// Streams one request's reply to stdout (after `shown_prompt`, printed with the first
// message, so a refused request prints only its error), then the tables and stats the
// flags ask for on stderr. Returns the exit code; `reply` gets the streamed text.
int RunRequest(const Args& args, v1::Generation::Stub& stub, const v1::GenerateRequest& request,
               const std::string& shown_prompt, std::string* reply) {
  if (absl::Status s = CheckUtf8Fields(request); !s.ok()) return Fail(s, 2);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub.Generate(&context, request);
  bool shown = false;
  auto show_prompt = [&] {
    if (!shown) std::cout << shown_prompt << std::flush;
    shown = true;
  };
  v1::GenerateResponse chunk;
  v1::GenerateFinal final;
  std::vector<ScoredToken> scored, generated;
  while (reader->Read(&chunk)) {
    show_prompt();
    std::cout << chunk.text() << std::flush;
    reply->append(chunk.text());
    AppendScored(chunk.logprobs(), &generated);
    AppendScored(chunk.prompt_logprobs(), &scored);
    if (chunk.has_final()) final = chunk.final();
  }
  const grpc::Status status = reader->Finish();
  if (status.ok()) show_prompt();
  if (shown) std::cout << std::endl;  // (tables follow on stderr)
  if (!status.ok()) {
    std::cerr << "kvlens-cli generate: " << RpcErrorText(status) << "\n";
    return 1;
  }
  auto piece = [&](int32_t token) { return ServerPiece(stub, token); };
  if (request.has_prompt_logprobs()) PrintPromptLogprobs(std::cerr, scored, piece);
  if (request.logprobs()) {
    PrintLogprobsTable(std::cerr, generated, final.usage().prompt_tokens(), "generated", piece);
  }
  if (args.Switch("stats")) {
    const v1::Usage& u = final.usage();
    const v1::Timings& t = final.timings();
    const double decode_tps = u.generated_tokens() > 1 && t.decode_seconds() > 0
                                  ? (u.generated_tokens() - 1) / t.decode_seconds()
                                  : 0.0;
    std::cerr << absl::StrFormat(
        "server %s | prompt %d tokens (%d cached) | queue %.3f s, prefill %.3f s, first token "
        "%.3f s | generated %d tokens, decode %.1f tok/s | finish: %s\n",
        args.Str("server"), u.prompt_tokens(), u.cached_tokens(), t.queue_seconds(),
        t.prefill_seconds(), t.first_token_seconds(), u.generated_tokens(), decode_tps,
        FinishName(final.finish_reason()));
  }
  return 0;
}

}  // namespace

int RemoteGenerate(const Args& args) {
  absl::StatusOr<v1::GenerateRequest> request = RequestFromFlags(args);
  if (!request.ok()) return Fail(request.status(), 2);
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(args.Str("server"), grpc::InsecureChannelCredentials()));
  if (args.Switch("interactive")) {
    // Refused at once, not at every turn, when the server cannot write a conversation.
    v1::ModelInfo info;
    grpc::ClientContext context;
    if (const grpc::Status s = stub->GetModelInfo(&context, {}, &info); !s.ok()) {
      std::cerr << "kvlens-cli generate: " << RpcErrorText(s) << "\n";
      return 1;
    }
    if (info.chat_template().empty()) {
      return Fail(absl::FailedPreconditionError(
                      "--interactive: the server's model has no chat template "
                      "(GetModelInfo.chat_template); start kvlens-server with --chat-template"),
                  2);
    }
    return Converse(args, [&](const Turns& turns, std::string* reply) {
      v1::GenerateRequest turn = *request;
      AddChat(turns, &turn);
      return RunRequest(args, *stub, turn, "", reply);
    });
  }
  // As offline: the prompt, then the completion; with --chat the reply alone.
  const bool chat = args.Switch("chat") || args.Has("system");
  if (chat) {  // the server writes the conversation in the model's chat template
    Turns turns;
    if (args.Has("system")) turns.emplace_back("system", args.Str("system"));
    turns.emplace_back("user", args.Str("prompt"));
    AddChat(turns, &*request);
  } else {
    request->set_text(args.Str("prompt"));
  }
  std::string reply;
  return RunRequest(args, *stub, *request, chat ? "" : args.Str("prompt"), &reply);
}

}  // namespace kvlens::cli
