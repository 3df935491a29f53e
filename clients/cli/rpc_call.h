// kvlens-cli's side of an RPC: the deadline its --timeout flag sets, and what it prints for
// a failed call (the server's message, or, where gRPC gives none — a request the server
// could not parse comes back UNIMPLEMENTED and empty — the code).
#ifndef KVLENS_CLIENTS_CLI_RPC_CALL_H_
#define KVLENS_CLIENTS_CLI_RPC_CALL_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "clients/cli/args.h"

namespace kvlens::cli {

// --timeout seconds from now (120 when the flag is malformed).
inline void SetDeadline(const Args& args, grpc::ClientContext& context) {
  auto seconds = args.Int("timeout", 1, 86400);
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(seconds.ok() ? *seconds : 120));
}

inline std::string RpcErrorText(const grpc::Status& status) {
  if (!status.error_message().empty()) return status.error_message();
  return absl::StrCat("the call failed with gRPC status ",
                      absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                      " and no message");
}

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_RPC_CALL_H_
