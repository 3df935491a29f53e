#include "tests/server/server_test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_paths.h"

namespace kvlens::testing {

std::string Stories260KPath() { return TestData("stories260K/stories260K.gguf"); }

EngineOptions TestServer::DefaultOptions() {
  EngineOptions o;
  o.num_blocks = 256;
  o.block_size = 16;
  o.max_batch_tokens = 256;
  return o;
}

TestServer::TestServer(EngineOptions options, int threads, server::InterpretOptions interpret)
    : TestServer(Stories260KPath(), options, threads, interpret) {}

TestServer::TestServer(const std::string& model_path, EngineOptions options, int threads,
                       server::InterpretOptions interpret) {
  auto model = LoadModel({model_path, ""});
  if (!model.ok()) {
    error_ = absl::StrCat("cannot load ", model_path, ": ", model.status().ToString());
    return;
  }
  model_ = std::move(*model);
  backend_ = std::make_unique<kernels::CpuBackend>(threads);
  metrics_ = std::make_unique<server::Metrics>();
  if (absl::Status s = metrics_->StartExposer("127.0.0.1", 0); !s.ok()) {
    error_ = std::string(s.message());
    return;
  }
  engine_ = std::make_unique<Engine>(*model_, *backend_, options, metrics_.get());
  server::GrpcServerOptions server_options;
  server_options.address = "127.0.0.1:0";
  server_options.backend_name = std::string(backend_->name());
  server_options.interpret = interpret;
  auto server = server::GrpcServer::Start(server_options, *engine_, *metrics_);
  if (!server.ok()) {
    error_ = std::string(server.status().message());
    return;
  }
  server_ = std::move(*server);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // probe tensors pass gRPC's default 4 MiB (as the CLI's)
  channel_ = grpc::CreateCustomChannel(address(), grpc::InsecureChannelCredentials(), args);
  stub_ = v1::Generation::NewStub(channel_);
  health_ = grpc::health::v1::Health::NewStub(channel_);
}

TestServer::~TestServer() {
  // The server first: its shutdown drains the engine, which must still be alive.
  if (server_) server_->Shutdown(std::chrono::milliseconds(2000));
  server_.reset();
  engine_.reset();
}

std::string TestServer::address() const { return absl::StrCat("127.0.0.1:", server_->port()); }

void SetDeadline(grpc::ClientContext& context, std::chrono::seconds s) {
  context.set_deadline(std::chrono::system_clock::now() + s);
}

StreamResult RunGenerate(v1::Generation::Stub& stub, const v1::GenerateRequest& request) {
  StreamResult r;
  grpc::ClientContext context;
  SetDeadline(context);
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse chunk;
  while (reader->Read(&chunk)) {
    if (r.messages++ == 0) r.request_id = chunk.request_id();
    r.tokens.insert(r.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    r.text += chunk.text();
    r.logprobs.insert(r.logprobs.end(), chunk.logprobs().begin(), chunk.logprobs().end());
    if (!chunk.prompt_logprobs().empty()) {
      r.prompt_logprobs_after_tokens =
          r.prompt_logprobs_after_tokens ||
          r.tokens.size() > static_cast<size_t>(chunk.token_ids_size());
      r.prompt_logprobs.insert(r.prompt_logprobs.end(), chunk.prompt_logprobs().begin(),
                               chunk.prompt_logprobs().end());
      r.prompt_logprobs_messages.emplace_back(chunk.prompt_logprobs_position(),
                                              chunk.prompt_logprobs_size());
    }
    if (chunk.has_final()) {
      r.final = chunk.final();
      r.has_final = true;
    }
  }
  r.status = reader->Finish();
  return r;
}

v1::GenerateRequest GreedyRequest(const std::string& text, int max_new_tokens) {
  v1::GenerateRequest request;
  request.set_text(text);
  request.mutable_stopping()->set_max_new_tokens(max_new_tokens);
  return request;
}

std::string HttpExchange(int port, const std::string& raw) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval timeout{10, 0};  // a stuck server fails the test instead of hanging it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    send(fd, raw.data(), raw.size(), MSG_NOSIGNAL);
    char buf[16384];
    for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) response.append(buf, n);
  }
  close(fd);
  return response;
}

std::string ScrapeMetrics(int port) {
  const std::string response =
      HttpExchange(port, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

double MetricValue(const std::string& exposition, const std::string& series) {
  std::istringstream in(exposition);
  for (std::string line; std::getline(in, line);) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 &&
        line[series.size()] == ' ') {
      return std::strtod(line.c_str() + series.size() + 1, nullptr);
    }
  }
  return -1;
}

std::pair<int, std::string> RunCommand(const std::string& command) {
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return {-1, ""};
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

LoadRun RunLoad(const std::string& address, const std::string& flags) {
  static std::atomic<int> runs{0};
  const std::string json =
      absl::StrCat(::testing::TempDir(), "kvlens_load_", getpid(), "_", runs++, ".json");
  LoadRun r;
  std::tie(r.code, r.output) =
      RunCommand(absl::StrCat("timeout 120 ", KVLENS_LOAD_PATH, " --server ", address, " ", flags,
                              " --json-out ", json, " 2>&1"));
  std::stringstream text;
  text << std::ifstream(json).rdbuf();
  r.report = text.str();
  std::remove(json.c_str());
  return r;
}

}  // namespace kvlens::testing
