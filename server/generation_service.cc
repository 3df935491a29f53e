#include "server/generation_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/model/weights.h"
#include "kernels/kv_dtype.h"
#include "server/generate_stream.h"
#include "server/request_convert.h"
#include "server/status_util.h"

namespace kvlens::server {
namespace {

const absl::Status& Draining() {
  static const absl::Status s = absl::UnavailableError("the server is shutting down");
  return s;
}

}  // namespace

GenerationService::GenerationService(Engine& engine, Metrics& metrics, std::string backend_name,
                                     std::vector<std::shared_ptr<const interpret::Sae>> saes)
    : engine_(engine),
      metrics_(metrics),
      backend_name_(std::move(backend_name)),
      saes_(std::move(saes)) {}

grpc::ServerUnaryReactor* GenerationService::FinishUnary(grpc::CallbackServerContext* context,
                                                         const char* rpc,
                                                         const absl::Status& status) {
  const grpc::Status grpc_status = ToGrpcStatus(status);
  metrics_.RecordRpc(rpc, grpc_status.error_code());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc_status);
  return reactor;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* GenerationService::Generate(
    grpc::CallbackServerContext* /*context*/, const v1::GenerateRequest* request) {
  auto* stream = new GenerateStream(*this, Clock::now());  // deletes itself (see its header)
  stream->Start(*request);
  return stream;
}

grpc::ServerUnaryReactor* GenerationService::Cancel(grpc::CallbackServerContext* context,
                                                    const v1::CancelRequest* request,
                                                    v1::CancelResponse* /*response*/) {
  // Cancel stays open while draining: it only shortens what the drain waits for.
  const RequestId id = request->request_id();
  bool running = false;
  {
    std::lock_guard<std::mutex> lock(active_mu_);
    running = active_.contains(id);
  }
  if (!running) {
    return FinishUnary(
        context, "Cancel",
        absl::NotFoundError(absl::StrCat("request_id = ", id, " is not a running request")));
  }
  engine_.Cancel(id);  // outside active_mu_: the engine may call back into the stream
  return FinishUnary(context, "Cancel", absl::OkStatus());
}

grpc::ServerUnaryReactor* GenerationService::Tokenize(grpc::CallbackServerContext* context,
                                                      const v1::TokenizeRequest* request,
                                                      v1::TokenizeResponse* response) {
  if (draining()) return FinishUnary(context, "Tokenize", Draining());
  const Tokenizer* tok = engine_.model().tokenizer.get();
  if (tok == nullptr) {
    return FinishUnary(context, "Tokenize",
                       absl::FailedPreconditionError("the model has no tokenizer"));
  }
  std::vector<int32_t> ids;
  if (request->has_chat()) {
    auto chat = EncodeChat(
        engine_.model(), request->chat(),
        request->has_add_bos() ? std::optional<bool>(request->add_bos()) : std::nullopt, "chat");
    if (!chat.ok()) return FinishUnary(context, "Tokenize", chat.status());
    ids = *std::move(chat);
  } else {
    ids = EncodeText(*tok, *request);
  }
  for (int32_t id : ids) {
    response->add_token_ids(id);
    response->add_pieces(std::string(tok->Piece(id)));
  }
  return FinishUnary(context, "Tokenize", absl::OkStatus());
}

grpc::ServerUnaryReactor* GenerationService::Detokenize(grpc::CallbackServerContext* context,
                                                        const v1::DetokenizeRequest* request,
                                                        v1::DetokenizeResponse* response) {
  if (draining()) return FinishUnary(context, "Detokenize", Draining());
  const Tokenizer* tok = engine_.model().tokenizer.get();
  if (tok == nullptr) {
    return FinishUnary(context, "Detokenize",
                       absl::FailedPreconditionError("the model has no tokenizer"));
  }
  if (absl::Status s = ValidateTokenIds(request->token_ids(), "token_ids", tok->vocab_size());
      !s.ok()) {
    return FinishUnary(context, "Detokenize", s);
  }
  // Through the incremental decoder so invalid UTF-8 becomes U+FFFD (proto3 strings must
  // be valid UTF-8).
  IncrementalDecoder decoder(*tok);
  std::string text;
  for (int32_t id : request->token_ids()) text += decoder.Push(id);
  text += decoder.Flush();
  response->set_text(std::move(text));
  return FinishUnary(context, "Detokenize", absl::OkStatus());
}

grpc::ServerUnaryReactor* GenerationService::GetModelInfo(
    grpc::CallbackServerContext* context, const v1::GetModelInfoRequest* /*request*/,
    v1::ModelInfo* response) {
  if (draining()) return FinishUnary(context, "GetModelInfo", Draining());
  const Model& model = engine_.model();
  const ModelConfig& c = model.config;
  response->set_name(c.name);
  response->set_architecture(std::string(ArchitectureName(c.arch)));
  response->set_format(model.format);
  response->set_num_layers(c.num_layers);
  response->set_num_heads(c.num_heads);
  response->set_num_kv_heads(c.num_kv_heads);
  response->set_head_dim(c.head_dim);
  response->set_dim(c.dim);
  response->set_family(c.family);
  response->set_q_dim(c.q_dim());
  response->set_sliding_window(c.sliding_window);
  response->set_hidden_dim(c.hidden_dim);
  response->set_context_length(c.max_seq_len);
  response->set_vocab_size(c.vocab_size);
  response->set_bos_id(model.tokenizer ? model.tokenizer->bos_id() : -1);
  response->set_eos_id(model.tokenizer ? model.tokenizer->eos_id() : -1);
  response->set_dtype(LinearWeightDTypes(model.weights));
  response->set_backend(backend_name_);
  response->set_block_size(engine_.options().block_size);
  if (model.generation_config.repetition_penalty) {
    response->set_default_repetition_penalty(*model.generation_config.repetition_penalty);
  }
  response->set_num_blocks(engine_.options().num_blocks);
  response->set_kv_cache_dtype(engine_.options().kv_cache_dtype == kernels::KvDtype::kBF16 ? "bf16"
                                                                                           : "f32");
  if (model.chat_format)
    response->set_chat_template(std::string(ChatFormatName(*model.chat_format)));
  return FinishUnary(context, "GetModelInfo", absl::OkStatus());
}

grpc::ServerUnaryReactor* GenerationService::OpenSession(grpc::CallbackServerContext* context,
                                                         const v1::OpenSessionRequest* /*request*/,
                                                         v1::OpenSessionResponse* response) {
  if (draining()) return FinishUnary(context, "OpenSession", Draining());
  absl::StatusOr<SessionId> id = engine_.OpenSession();
  if (id.ok()) response->set_session_id(*id);
  return FinishUnary(context, "OpenSession", id.status());
}

grpc::ServerUnaryReactor* GenerationService::CloseSession(grpc::CallbackServerContext* context,
                                                          const v1::CloseSessionRequest* request,
                                                          v1::CloseSessionResponse* /*response*/) {
  if (draining()) return FinishUnary(context, "CloseSession", Draining());
  if (request->session_id() <= 0) {
    return FinishUnary(context, "CloseSession",
                       absl::InvalidArgumentError(
                           absl::StrCat("session_id = ", request->session_id(), " must be > 0")));
  }
  return FinishUnary(context, "CloseSession", engine_.CloseSession(request->session_id()));
}

void GenerationService::AddActive(RequestId id) {
  std::lock_guard<std::mutex> lock(active_mu_);
  active_.insert(id);
}

void GenerationService::RemoveActive(RequestId id) {
  std::lock_guard<std::mutex> lock(active_mu_);
  active_.erase(id);
}

}  // namespace kvlens::server
