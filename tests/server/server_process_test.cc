// The real kvlens-server binary in its own process on loopback: it comes up SERVING,
// streams to kvlens-cli and to a gRPC client, and on SIGTERM drains and exits 0.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/backend_factory.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

class ServerProcess {
 public:
  // Starts kvlens-server on ephemeral loopback ports and reads them from its first line.
  explicit ServerProcess(const std::string& model) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      execl(KVLENS_SERVER_PATH, KVLENS_SERVER_PATH, "--model", model.c_str(), "--host", "127.0.0.1",
            "--port", "0", "--metrics-port", "0", "--kv-cache-tokens", "4096", "--threads", "1",
            "--drain-timeout", "5s", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    out_ = fds[0];
    // Bounded: 30 s for the "serving … on 127.0.0.1:P, metrics on 127.0.0.1:Q" line.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline && port_ == 0) {
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[4096];
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) break;
      log_.append(buf, n);
      const size_t at = log_.find(" on 127.0.0.1:");
      if (at != std::string::npos && log_.find('\n', at) != std::string::npos) {
        std::sscanf(log_.c_str() + at, " on 127.0.0.1:%d, metrics on 127.0.0.1:%d", &port_,
                    &metrics_port_);
      }
    }
  }

  ~ServerProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }

  int port() const { return port_; }
  const std::string& log() const { return log_; }
  void Signal(int sig) { kill(pid_, sig); }

  // Waits up to `timeout` for the process to exit; its exit code, or -1.
  int WaitExit(std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        DrainLog();
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  void DrainLog() {
    char buf[4096];
    for (ssize_t n; (n = read(out_, buf, sizeof(buf))) > 0;) log_.append(buf, n);
  }

  pid_t pid_ = -1;
  int out_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  bool exited_ = false;
  std::string log_;
};

// Runs kvlens-server to its exit (it must fail before serving); stdout and stderr.
std::pair<int, std::string> RunServerToExit(const std::string& flags) {
  return RunCommand(absl::StrCat("timeout 60 ", KVLENS_SERVER_PATH, " --model ", Stories260KPath(),
                                 " --port 0 --metrics-port -1 ", flags, " 2>&1"));
}

TEST(ServerProcessTest, DeviceCudaWithoutAGpuIsAClearError) {
  if (kernels::CreateBackend({kernels::DeviceSpec::Kind::kCuda, 0}, 1).ok()) {
    GTEST_SKIP() << "a CUDA device is present";
  }
  const auto [code, out] = RunServerToExit("--device cuda");
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.rfind("kvlens-server: --device cuda: ", 0), 0u) << out;
  EXPECT_TRUE(out.find("no CUDA support (configure with -DKVLENS_CUDA=ON)") != std::string::npos ||
              out.find("CUDA device") != std::string::npos)
      << out;
}

TEST(ServerProcessTest, InterpDeviceCudaWithoutAGpuIsAClearError) {
  if (kernels::CreateBackend({kernels::DeviceSpec::Kind::kCuda, 0}, 1).ok()) {
    GTEST_SKIP() << "a CUDA device is present";
  }
  const auto [code, out] = RunServerToExit("--interp-device cuda");
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.rfind("kvlens-server: --interp-device cuda:0: ", 0), 0u) << out;
}

// --int8-activations is a CPU option: with --device cuda the server stops before it loads
// anything, GPU or not.
TEST(ServerProcessTest, Int8ActivationsOnCudaAreRefusedByName) {
  const auto [code, out] = RunServerToExit("--device cuda --int8-activations");
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.rfind("kvlens-server: --device cuda: int8 activations are a CPU option", 0), 0u)
      << out;
}

// --attention-tensor-cores is a CUDA option: with --device cpu the server stops before it
// loads anything.
TEST(ServerProcessTest, TensorCoreAttentionOnCpuIsRefusedByName) {
  const auto [code, out] = RunServerToExit("--device cpu --attention-tensor-cores");
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.rfind("kvlens-server: --device cpu: tensor-core attention is a CUDA option", 0), 0u)
      << out;
}

// --programmatic-launches likewise.
TEST(ServerProcessTest, ProgrammaticLaunchesOnCpuAreRefusedByName) {
  const auto [code, out] = RunServerToExit("--device cpu --programmatic-launches");
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.rfind("kvlens-server: --device cpu: programmatic launches are a CUDA option", 0),
            0u)
      << out;
}

// --attention-tune likewise; and with --attention-tensor-cores it would overrule the flag,
// so the two together are refused.
TEST(ServerProcessTest, AttentionTuningOnCpuIsRefusedByName) {
  auto [code, out] = RunServerToExit("--device cpu --attention-tune");
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.rfind("kvlens-server: --attention-tune is a --device cuda option (--device cpu: "
                      "the CPU backend has one attention kernel)",
                      0),
            0u)
      << out;
  std::tie(code, out) = RunServerToExit("--device cuda --attention-tune --attention-tensor-cores");
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.rfind("kvlens-server: --attention-tune chooses decode attention's kernel itself: "
                      "give it or --attention-tensor-cores, not both",
                      0),
            0u)
      << out;
}

TEST(ServerProcessTest, InterpDeviceBogusIsRejectedNamingTheFlag) {
  const auto [code, out] = RunServerToExit("--interp-device gpu");
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("--interp-device: device \"gpu\" is not one of cpu, cuda, cuda:N"),
            std::string::npos)
      << out;
}

TEST(ServerProcessTest, DeviceBogusIsRejectedNamingTheFlag) {
  const auto [code, out] = RunServerToExit("--device bogus");
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("--device: device \"bogus\" is not one of cpu, cuda, cuda:N"),
            std::string::npos)
      << out;
}

TEST(ServerProcessTest, KvCacheDtypeBogusIsRejectedNamingTheFlag) {
  const auto [code, out] = RunServerToExit("--kv-cache-dtype fp8");
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("--kv-cache-dtype: kv_cache_dtype: unknown type \"fp8\" (expected auto or "
                     "bf16)"),
            std::string::npos)
      << out;
}

// A KV cache smaller than one max_seq_len sequence (the stories260K GGUF's
// llama.context_length, 128 in its metadata) is worth a warning at startup (vLLM refuses
// to start): requests needing more are refused when they arrive. The missing SAE stops
// the server after the cache's size is settled, as it does below.
TEST(ServerProcessTest, ACacheShorterThanMaxSeqLenIsWarnedOf) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  auto [code, out] = RunServerToExit("--kv-cache-tokens 64 --sae /nonexistent/sae");
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("warning: the KV cache holds 64 tokens, fewer than the model's "
                     "max_seq_len 128"),
            std::string::npos)
      << out;
  std::tie(code, out) = RunServerToExit("--kv-cache-tokens 128 --sae /nonexistent/sae");
  EXPECT_EQ(code, 1) << out;
  EXPECT_EQ(out.find("warning: the KV cache"), std::string::npos) << out;
}

// --sae: a missing file, and an SAE whose width is not the hook's, stop the server naming
// the flag (stories260K's residual stream has 64 values; the SAE reads 32).
TEST(ServerProcessTest, SaeThatCannotServeIsRejectedNamingTheFlag) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  auto [code, out] = RunServerToExit("--sae /nonexistent/sae");
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("--sae /nonexistent/sae: SAE /nonexistent/sae does not exist"),
            std::string::npos)
      << out;
  if (!OracleAvailable()) GTEST_SKIP() << "python3 with numpy not available";
  const std::string npz = ::testing::TempDir() + "kvlens_process_sae.npz";
  ASSERT_TRUE(MakeSae(npz, "--format npz --d-in 32 --d-sae 8"));
  std::tie(code, out) = RunServerToExit("--sae " + npz + "@blocks.1.hook_resid_post");
  std::remove(npz.c_str());
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("d_in = 32, but the model's blocks.1.hook_resid_post rows have 64 values"),
            std::string::npos)
      << out;
}

TEST(ServerProcessTest, ServesThenDrainsOnSigtermAndExitsZero) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  ServerProcess server(Stories260KPath());
  ASSERT_GT(server.port(), 0) << server.log();
  const std::string address = absl::StrCat("127.0.0.1:", server.port());
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  bool serving = false;
  for (int i = 0; i < 300 && !serving; ++i) {  // ≤ 30 s
    grpc::ClientContext context;
    SetDeadline(context, std::chrono::seconds(1));
    grpc::health::v1::HealthCheckResponse response;
    serving = health->Check(&context, {}, &response).ok() &&
              response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    if (!serving) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(serving) << server.log();

  // kvlens-cli generate --server streams the same text as offline generation.
  const auto [cli_code, cli_out] =
      RunCommand(absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " generate --server ", address,
                              " --prompt 'Once upon a time' --max-new-tokens 40"));
  EXPECT_EQ(cli_code, 0);
  EXPECT_EQ(cli_out.rfind(kReferenceText, 0), 0u) << cli_out;

  // A stream in flight when SIGTERM arrives still ends with its final message.
  auto stub = v1::Generation::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(context);
  v1::GenerateRequest request = GreedyRequest("Once upon a time", 100);
  request.mutable_stopping()->set_ignore_eos(true);
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  server.Signal(SIGTERM);
  bool has_final = false;
  while (reader->Read(&chunk)) has_final |= chunk.has_final();
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(has_final);

  EXPECT_EQ(server.WaitExit(std::chrono::seconds(30)), 0) << server.log();
  EXPECT_NE(server.log().find("draining"), std::string::npos) << server.log();
  EXPECT_NE(server.log().find("stopped"), std::string::npos) << server.log();
}

}  // namespace
}  // namespace kvlens::testing
