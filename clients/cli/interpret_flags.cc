#include "clients/cli/interpret_flags.h"

#include <cstring>
#include <iostream>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "clients/cli/rpc_call.h"
#include "clients/cli/server_tokens.h"
#include "clients/cli/utf8_fields.h"
#include "kernels/dtype.h"

namespace kvlens::cli {

std::vector<FlagSpec> CommonSpecs() {
  return {
      {"server", "", "kvlens-server address HOST:PORT (required)"},
      {"text", "", "prompt text (tokenized by the server, BOS added)"},
      {"ids", "", "prompt token ids, space-separated (instead of --text)"},
      {"precision", "fp32", "fp32 or fp64"},
      {"timeout", "120", "seconds before the call is abandoned"},
  };
}

int Fail(const char* command, const std::string& message, int code) {
  std::cerr << "kvlens-cli " << command << ": " << message << "\n";
  return code;
}

// A flag's error (exit code 2), or a failed Tokenize call's (1).
int Fail(const char* command, const absl::Status& s) {
  return Fail(command, std::string(s.message()),
              s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
}

// "1 2 3" or "1,2,3" → ints.
absl::StatusOr<std::vector<int>> ParseInts(const std::string& s, const char* flag) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(s, absl::ByAnyChar(" ,"), absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(std::string("--") + flag + ": '" + std::string(part) +
                                        "' is not an integer");
    }
    out.push_back(v);
  }
  return out;
}

absl::Status FillInput(const Args& args, v1::PromptInput* in) {
  if (args.Has("ids")) {
    auto ids = ParseInts(args.Str("ids"), "ids");
    if (!ids.ok()) return ids.status();
    in->mutable_token_ids()->mutable_ids()->Add(ids->begin(), ids->end());
  } else if (args.Has("text")) {
    in->set_text(args.Str("text"));
  } else {
    return absl::InvalidArgumentError("give --text or --ids");
  }
  return absl::OkStatus();
}

v1::Precision PrecisionOf(const Args& args) {
  return args.Str("precision") == "fp64" ? v1::PRECISION_FP64 : v1::PRECISION_FP32;
}

const char* PrecisionName(v1::Precision p) { return p == v1::PRECISION_FP64 ? "fp64" : "fp32"; }

std::unique_ptr<v1::Interpret::Stub> Connect(const Args& args, grpc::ClientContext& context) {
  SetDeadline(args, context);
  // Probe tensors (a layer's weight gradients: H·Dh × D doubles each) pass gRPC's default
  // 4 MiB limit on what a client receives; the server bounds them (--max-interp-bytes).
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(-1);
  return v1::Interpret::NewStub(grpc::CreateCustomChannel(
      args.Str("server"), grpc::InsecureChannelCredentials(), channel_args));
}

std::vector<double> Decode(const std::string& bytes, v1::DType dtype) {
  std::vector<double> out;
  const int size = dtype == v1::DTYPE_FP16 ? 2 : dtype == v1::DTYPE_FP64 ? 8 : 4;
  for (size_t i = 0; i + size <= bytes.size(); i += size) {
    if (size == 2) {
      uint16_t h;
      std::memcpy(&h, bytes.data() + i, 2);
      out.push_back(kernels::F16ToF32(h));
    } else if (size == 8) {
      double d;
      std::memcpy(&d, bytes.data() + i, 8);
      out.push_back(d);
    } else {
      float f;
      std::memcpy(&f, bytes.data() + i, 4);
      out.push_back(f);
    }
  }
  return out;
}

// A token's text in double quotes, C-escaped (\n, \", \x01), UTF-8 left as it is.
std::string Quoted(const std::string& piece) {
  return absl::StrCat("\"", absl::Utf8SafeCHexEscape(piece), "\"");
}

// Parses common flags; returns an exit code ≥ 0 to stop, or −1 to go on.
int Prepare(int argc, char** argv, const char* command, const std::string& summary,
            std::vector<FlagSpec> specs, absl::StatusOr<Args>& args) {
  args = Args::Parse(argc, argv, 2, specs);
  if (!args.ok()) return Fail(command, std::string(args.status().message()), 2);
  if (args->help()) {
    std::cout << Args::Usage(command, summary, specs);
    return 0;
  }
  if (!args->Has("server")) return Fail(command, "--server HOST:PORT is required", 2);
  return -1;
}

// Exit code 2 with the field's name when a string field of `request` is not UTF-8 (which
// gRPC would refuse without a word), else −1.
int RefuseNonUtf8(const char* command, const google::protobuf::Message& request) {
  const absl::Status s = CheckUtf8Fields(request);
  return s.ok() ? -1 : Fail(command, std::string(s.message()), 2);
}

// A TokenTarget from --target-position (-1: the prompt's last) and --target-token or
// --target-text; returns an exit code ≥ 0 to stop, or −1 to go on.
int FillTarget(const Args& args, const char* command, v1::TokenTarget* target) {
  absl::StatusOr<int64_t> position = args.Int("target-position", -kMaxPosition, kMaxPosition);
  if (!position.ok()) return Fail(command, std::string(position.status().message()), 2);
  absl::StatusOr<int32_t> token = TokenFlag(args, "target-token", "target-text", /*required=*/true);
  if (!token.ok()) return Fail(command, token.status());
  target->set_position(static_cast<int>(*position));
  target->set_token(*token);
  return -1;
}

}  // namespace kvlens::cli
