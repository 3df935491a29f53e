// What kvlens-cli prints for a failed RPC: the server's message, or, where gRPC gives none
// (a request the server could not parse comes back UNIMPLEMENTED and empty), the code.
#ifndef KVLENS_CLIENTS_CLI_RPC_ERROR_H_
#define KVLENS_CLIENTS_CLI_RPC_ERROR_H_

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvlens::cli {

inline std::string RpcErrorText(const grpc::Status& status) {
  if (!status.error_message().empty()) return status.error_message();
  return absl::StrCat("the call failed with gRPC status ",
                      absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                      " and no message");
}

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_RPC_ERROR_H_
