// What the kvlens-cli commands of kvlens.v1.Interpret share (interpret_commands.cc,
// patch_command.cc): their common flags, the prompt and precision flags turned into request
// fields, the channel, tensor bytes decoded, and their error exits (code 2 for a bad flag,
// 1 for a failed call).
#ifndef KVLENS_CLIENTS_CLI_INTERPRET_FLAGS_H_
#define KVLENS_CLIENTS_CLI_INTERPRET_FLAGS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "clients/cli/args.h"
#include "kvlens/v1/interpret.grpc.pb.h"

namespace kvlens::cli {

// --server, --text, --ids, --precision, --timeout.
std::vector<FlagSpec> CommonSpecs();
// "kvlens-cli COMMAND: message" on stderr; returns `code`.
int Fail(const char* command, const std::string& message, int code);
// A flag's error (exit code 2), or a failed Tokenize call's (1).
int Fail(const char* command, const absl::Status& s);
// "1 2 3" or "1,2,3" → ints; INVALID_ARGUMENT naming --flag.
absl::StatusOr<std::vector<int>> ParseInts(const std::string& s, const char* flag);
// --ids or --text into `in`.
absl::Status FillInput(const Args& args, v1::PromptInput* in);
v1::Precision PrecisionOf(const Args& args);
const char* PrecisionName(v1::Precision p);
// An Interpret stub on --server, `context`'s deadline from --timeout.
std::unique_ptr<v1::Interpret::Stub> Connect(const Args& args, grpc::ClientContext& context);
// A Tensor's bytes of `dtype` → doubles.
std::vector<double> Decode(const std::string& bytes, v1::DType dtype);
// A token's text in double quotes, C-escaped (\n, \", \x01), UTF-8 left as it is.
std::string Quoted(const std::string& piece);
// Parses common flags; returns an exit code ≥ 0 to stop, or −1 to go on.
int Prepare(int argc, char** argv, const char* command, const std::string& summary,
            std::vector<FlagSpec> specs, absl::StatusOr<Args>& args);
// Exit code 2 with the field's name when a string field of `request` is not UTF-8 (which
// gRPC would refuse without a word), else −1.
int RefuseNonUtf8(const char* command, const google::protobuf::Message& request);

// Positions as the flags take them: from 0, or from the end (-1: the last), which the server
// resolves.
constexpr int64_t kMaxPosition = 1 << 20;

// A TokenTarget from --target-position (-1: the prompt's last) and --target-token or
// --target-text; returns an exit code ≥ 0 to stop, or −1 to go on.
int FillTarget(const Args& args, const char* command, v1::TokenTarget* target);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_INTERPRET_FLAGS_H_
