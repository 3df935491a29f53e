// Every string field of a request must be UTF-8 before it goes over gRPC. protobuf's C++
// runtime only logs an invalid one as it serializes, and the server's parse then fails,
// which gRPC's C++ server reports as UNIMPLEMENTED with no message. So kvlens-cli checks
// each request it sends and names the field instead.
#ifndef KVLENS_CLIENTS_CLI_UTF8_FIELDS_H_
#define KVLENS_CLIENTS_CLI_UTF8_FIELDS_H_

#include <google/protobuf/message.h>

#include "absl/status/status.h"

namespace kvlens::cli {

// INVALID_ARGUMENT naming the first string field (its path, e.g. "stopping.stop[1]" or
// "chat.messages[0].content"), the byte offset and the byte where it stops being UTF-8;
// OK when every string field, nested and repeated ones included, is UTF-8.
absl::Status CheckUtf8Fields(const google::protobuf::Message& request);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_UTF8_FIELDS_H_
