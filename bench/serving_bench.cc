// kvlens_bench_serving: end-to-end serving throughput and latency. Starts an in-process
// kvlens server (engine + gRPC on 127.0.0.1) on the default model and drives it over TCP
// with C concurrent clients for C in 1, 4, 16, 64, each sending streaming Generate calls
// back to back. Reports aggregate generated tokens/s and p50/p99 time to first token (as
// a client sees it: call start → first chunk with a token), as a table and a JSON line.
//
//   kvlens_bench_serving [--model PATH] [--requests-per-client N] [--max-new-tokens N]
//                        [--threads N] [--attention-rows]
//
// --attention-rows: every request streams the attention row of head 0 of every layer with
// each token (GenerateRequest.attention_rows); a request missing a token's row fails.
//
// Default model: the first models/*/config.json directory of the source tree (the
// project's own GPT-2), else ../shared/testdata/stories260K/stories260K.gguf.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_help.h"
#include "common/malloc_tuning.h"
#include "engine/engine.h"
#include "engine/model/model.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvlens/v1/generation.grpc.pb.h"
#include "server/grpc_server.h"
#include "server/metrics.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kConcurrency[] = {1, 4, 16, 64};

std::string DefaultModel() {
  namespace fs = std::filesystem;
  std::vector<std::string> dirs;
  const fs::path models = fs::path(KVLENS_SOURCE_DIR) / "models";
  if (fs::is_directory(models)) {
    for (const auto& e : fs::directory_iterator(models)) {
      if (e.is_directory() && fs::exists(e.path() / "config.json")) dirs.push_back(e.path());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  if (!dirs.empty()) return dirs.front();
  return (fs::path(KVLENS_SHARED_DIR) / "testdata/stories260K/stories260K.gguf").lexically_normal();
}

struct Level {
  int concurrency = 0;
  int requests = 0;
  int failed = 0;
  int64_t tokens = 0;
  double seconds = 0;
  double ttft_p50 = 0, ttft_p99 = 0;
  double tokens_per_second() const { return seconds > 0 ? tokens / seconds : 0; }
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

// Distinct prompts so that the prefix cache does not turn the benchmark into a cache test.
std::string Prompt(int i) {
  static const char* kStarts[] = {"Once upon a time", "And it came to pass",    "In the beginning",
                                  "The little dog",   "Then said he unto them", "One day Lily"};
  return absl::StrCat(kStarts[i % 6], ", ", i, " ");
}

Level RunLevel(kvlens::v1::Generation::Stub& stub, int concurrency, int per_client,
               int max_new_tokens, bool attention_rows) {
  Level level;
  level.concurrency = concurrency;
  std::mutex mu;
  std::vector<double> ttfts;
  std::vector<std::thread> clients;
  const Clock::time_point start = Clock::now();
  for (int c = 0; c < concurrency; ++c) {
    clients.emplace_back([&, c] {
      for (int r = 0; r < per_client; ++r) {
        const int index = c * per_client + r;
        kvlens::v1::GenerateRequest request;
        request.set_text(Prompt(index));
        request.mutable_sampling()->set_temperature(0.8);
        request.mutable_sampling()->set_seed(index);
        request.mutable_stopping()->set_max_new_tokens(max_new_tokens);
        request.mutable_stopping()->set_ignore_eos(true);  // every request the same length
        if (attention_rows) request.mutable_attention_rows()->add_heads(0);  // every layer's
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
        const Clock::time_point sent = Clock::now();
        auto reader = stub.Generate(&context, request);
        kvlens::v1::GenerateResponse chunk;
        double ttft = -1;
        int64_t tokens = 0, rows = 0;
        while (reader->Read(&chunk)) {
          if (ttft < 0 && chunk.token_ids_size() > 0) {
            ttft = std::chrono::duration<double>(Clock::now() - sent).count();
          }
          tokens += chunk.token_ids_size();
          rows += chunk.attention_rows_size();
        }
        const bool ok = reader->Finish().ok() && (!attention_rows || rows == tokens);
        std::lock_guard<std::mutex> lock(mu);
        ++level.requests;
        if (!ok) ++level.failed;
        level.tokens += tokens;
        if (ttft >= 0) ttfts.push_back(ttft);
      }
    });
  }
  for (std::thread& t : clients) t.join();
  level.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  level.ttft_p50 = Percentile(ttfts, 0.50);
  level.ttft_p99 = Percentile(ttfts, 0.99);
  return level;
}

int Arg(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  if (kvlens::bench::PrintedHelp(
          argc, argv,
          "usage: kvlens_bench_serving [--model PATH] [--requests-per-client N=4]\n"
          "                            [--max-new-tokens N=64] [--threads N=0 (all)]\n"
          "                            [--attention-rows]\n"
          "Starts an in-process kvlens server on 127.0.0.1 and drives it with 1, 4, 16 and 64\n"
          "concurrent streaming clients: generated tokens/s and p50/p99 time to first token.\n"
          "--attention-rows: each request streams head 0's attention row of every layer with\n"
          "each token (a request missing one counts as failed).\n"
          "Default model: the first models/*/config.json directory of the source tree, else\n"
          "../shared/testdata/stories260K/stories260K.gguf. Prints a table, then one JSON "
          "line.\n")) {
    return 0;
  }
  kvlens::RetainFreedMemory();  // as kvlens-server does (common/malloc_tuning.h)
  std::string model_path = DefaultModel();
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--model") == 0) model_path = argv[i + 1];
  }
  const int per_client = Arg(argc, argv, "--requests-per-client", 4);
  const int max_new_tokens = Arg(argc, argv, "--max-new-tokens", 64);
  const int threads = Arg(argc, argv, "--threads", 0);
  bool attention_rows = false;
  for (int i = 1; i < argc; ++i) attention_rows |= std::strcmp(argv[i], "--attention-rows") == 0;

  auto model = kvlens::LoadModel({model_path, ""});
  if (!model.ok()) {
    std::fprintf(stderr, "kvlens_bench_serving: %s\n",
                 std::string(model.status().message()).c_str());
    return 1;
  }
  const kvlens::ModelConfig& config = (*model)->config;
  kvlens::EngineOptions options;
  options.block_size = 16;
  options.max_running = 64;
  options.max_batch_tokens = 512;
  // Room for 64 sequences of prompt + output at once: the benchmark measures batching,
  // not preemption.
  options.num_blocks = 64 * ((32 + max_new_tokens + 15) / 16 + 1);
  kvlens::kernels::CpuBackend backend(threads);
  kvlens::server::Metrics metrics;
  kvlens::Engine engine(**model, backend, options, &metrics);
  kvlens::server::GrpcServerOptions server_options;
  server_options.backend_name = std::string(backend.name());
  auto server = kvlens::server::GrpcServer::Start(server_options, engine, metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "kvlens_bench_serving: %s\n",
                 std::string(server.status().message()).c_str());
    return 1;
  }
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = kvlens::v1::Generation::NewStub(channel);

  std::printf(
      "model %s (%s, %d layers, dim %d, vocab %d) | backend %s, %d threads | %d "
      "requests per client, %d new tokens each%s\n",
      model_path.c_str(), std::string(kvlens::ArchitectureName(config.arch)).c_str(),
      config.num_layers, config.dim, config.vocab_size, std::string(backend.name()).c_str(),
      backend.num_threads(), per_client, max_new_tokens,
      attention_rows ? ", each streaming head 0's attention rows of every layer" : "");
  RunLevel(*stub, 1, 1, 8, attention_rows);  // warm-up: connection, thread pool, page faults
  std::printf(
      "| concurrency | requests | failed | generated tokens | seconds | tokens/s | "
      "TTFT p50 (ms) | TTFT p99 (ms) |\n|---|---|---|---|---|---|---|---|\n");
  std::string json = "{\"bench\":\"serving\",\"model\":\"" + model_path +
                     "\",\"attention_rows\":" + (attention_rows ? "true" : "false") +
                     ",\"levels\":[";
  for (int c : kConcurrency) {
    const Level l = RunLevel(*stub, c, per_client, max_new_tokens, attention_rows);
    std::printf("| %d | %d | %d | %lld | %.2f | %.1f | %.1f | %.1f |\n", l.concurrency, l.requests,
                l.failed, static_cast<long long>(l.tokens), l.seconds, l.tokens_per_second(),
                l.ttft_p50 * 1e3, l.ttft_p99 * 1e3);
    std::fflush(stdout);
    absl::StrAppend(&json, c == kConcurrency[0] ? "" : ",",
                    absl::StrFormat("{\"concurrency\":%d,\"requests\":%d,\"failed\":%d,"
                                    "\"tokens\":%d,\"seconds\":%.4f,\"tokens_per_second\":%.2f,"
                                    "\"ttft_p50_ms\":%.3f,\"ttft_p99_ms\":%.3f}",
                                    l.concurrency, l.requests, l.failed, l.tokens, l.seconds,
                                    l.tokens_per_second(), l.ttft_p50 * 1e3, l.ttft_p99 * 1e3));
  }
  std::printf("%s]}\n", json.c_str());
  (*server)->Shutdown(std::chrono::milliseconds(1000));
  return 0;
}
