// The one place where absl::Status (engine, validation) becomes grpc::Status (the wire).
#ifndef KVLENS_SERVER_STATUS_UTIL_H_
#define KVLENS_SERVER_STATUS_UTIL_H_

#include <grpcpp/support/status.h>

#include <string_view>

#include "absl/status/status.h"

namespace kvlens::server {

// Same code (absl and gRPC share the canonical numbering), same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

// "OK", "INVALID_ARGUMENT", …: the `code` label of kvlens_requests_total.
std::string_view GrpcCodeName(grpc::StatusCode code);

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_STATUS_UTIL_H_
