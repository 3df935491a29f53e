#include "clients/cli/server_tokens.h"

#include <grpcpp/grpcpp.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "clients/cli/rpc_call.h"
#include "clients/cli/utf8_fields.h"
#include "kvlens/v1/generation.grpc.pb.h"

namespace kvlens::cli {

absl::StatusOr<std::vector<int32_t>> ServerTokenize(const Args& args,
                                                    const v1::TokenizeRequest& request,
                                                    const std::string& why) {
  if (absl::Status s = CheckUtf8Fields(request); !s.ok()) return s;
  grpc::ClientContext context;
  SetDeadline(args, context);
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(args.Str("server"), grpc::InsecureChannelCredentials()));
  v1::TokenizeResponse response;
  const grpc::Status status = stub->Tokenize(&context, request, &response);
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("Tokenize (", why, "): ", RpcErrorText(status)));
  }
  return std::vector<int32_t>(response.token_ids().begin(), response.token_ids().end());
}

absl::StatusOr<std::map<int32_t, std::string>> ServerTokenTexts(const Args& args,
                                                                const std::vector<int32_t>& ids) {
  std::map<int32_t, std::string> texts;
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(args.Str("server"), grpc::InsecureChannelCredentials()));
  for (const int32_t id : ids) {
    if (texts.count(id) > 0) continue;
    grpc::ClientContext context;
    SetDeadline(args, context);
    absl::StatusOr<std::string> text = ServerTokenText(*stub, context, id);
    if (!text.ok()) return text.status();
    texts[id] = *std::move(text);
  }
  return texts;
}

absl::StatusOr<std::string> ServerTokenText(v1::Generation::Stub& stub,
                                            grpc::ClientContext& context, int32_t id) {
  v1::DetokenizeRequest request;
  request.add_token_ids(id);
  v1::DetokenizeResponse response;
  const grpc::Status status = stub.Detokenize(&context, request, &response);
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("Detokenize: ", RpcErrorText(status)));
  }
  return response.text();
}

absl::StatusOr<int32_t> TokenFlag(const Args& args, const std::string& id_flag,
                                  const std::string& text_flag, bool required) {
  const bool by_id = args.Has(id_flag);
  const bool by_text = args.Has(text_flag);
  if (by_id && by_text) {
    return absl::InvalidArgumentError(
        absl::StrCat("give --", id_flag, " or --", text_flag, ", not both"));
  }
  if (!by_id && !by_text) {
    if (!required) return -1;
    return absl::InvalidArgumentError(
        absl::StrCat("--", id_flag, " (a token id) or --", text_flag, " (its text) is required"));
  }
  if (by_id) {
    absl::StatusOr<int64_t> id = args.Int(id_flag, required ? 0 : -1, 1 << 30);
    if (!id.ok()) return id.status();
    return static_cast<int32_t>(*id);
  }
  return ServerOneToken(args, args.Str(text_flag), "--" + text_flag,
                        "give one token's text or --" + id_flag);
}

absl::StatusOr<int32_t> ServerOneToken(const Args& args, const std::string& text,
                                       const std::string& what, const std::string& hint) {
  v1::TokenizeRequest request;
  request.set_text(text);
  request.set_add_bos(false);
  absl::StatusOr<std::vector<int32_t>> ids = ServerTokenize(args, request, what);
  if (!ids.ok()) return ids.status();
  if (ids->size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(what, " = \"", text, "\" is ", ids->size(),
                                                   " tokens (", absl::StrJoin(*ids, " "),
                                                   "), not one; ", hint));
  }
  return ids->front();
}

}  // namespace kvlens::cli
