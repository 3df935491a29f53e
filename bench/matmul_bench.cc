// CpuBackend::MatMul throughput: y[N, out] = x[N, in] · Wᵀ for a square weight in each
// stored dtype. Prints a table, then one JSON line for scripts.
//
//   kvlens_bench_matmul [dim=2048] [threads=0 (all)] [min_seconds=0.5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_help.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/ggml_quants.h"

namespace {

using kvlens::kernels::CpuBackend;
using kvlens::kernels::DType;
using kvlens::kernels::WeightView;

// Random weights in dtype's storage (a ggml block type: random bytes, small scales).
std::vector<uint8_t> MakeWeight(DType dt, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint8_t> bytes(static_cast<size_t>(kvlens::kernels::DTypeRowBytes(dt, cols) * rows));
  const int64_t n = rows * cols;
  switch (dt) {
    case DType::kF32:
      for (int64_t i = 0; i < n; ++i) reinterpret_cast<float*>(bytes.data())[i] = u(rng);
      break;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        reinterpret_cast<uint16_t*>(bytes.data())[i] = kvlens::kernels::F32ToF16(u(rng));
      }
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        reinterpret_cast<uint16_t*>(bytes.data())[i] = kvlens::kernels::F32ToBF16(u(rng));
      }
      break;
    default: {  // ggml blocks: random quants and scales, f16 fields small and finite
      const kvlens::kernels::DTypeBlock shape = kvlens::kernels::DTypeBlockOf(dt);
      const kvlens::kernels::BlockHalves at = kvlens::kernels::BlockHalvesOf(dt);
      const uint16_t d = kvlens::kernels::F32ToF16(1.0f / 1024);
      for (size_t b = 0; b < bytes.size(); b += shape.bytes) {
        for (int i = 0; i < shape.bytes; ++i) bytes[b + i] = static_cast<uint8_t>(rng());
        std::memcpy(&bytes[b + at.d_at], &d, 2);
        if (at.min_at >= 0) std::memcpy(&bytes[b + at.min_at], &d, 2);
      }
      break;
    }
  }
  return bytes;
}

// Bytes per second that `threads` threads read from a 256 MiB buffer (out of every cache
// level), each summing its share: the weights' roofline for a one-row product. Best of 5.
double ReadBandwidth(int threads) {
  const size_t words = (size_t{256} << 20) / sizeof(uint64_t);
  std::vector<uint64_t> buf(words, 1);
  std::vector<uint64_t> sums(static_cast<size_t>(threads));
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const size_t b = words * t / threads, e = words * (t + 1) / threads;
        uint64_t s = 0;
        for (size_t i = b; i < e; ++i) s += buf[i];
        sums[static_cast<size_t>(t)] = s;
      });
    }
    for (std::thread& th : pool) th.join();
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, double(words * sizeof(uint64_t)) / sec);
  }
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;
  if (total != words) std::fprintf(stderr, "read check failed\n");
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (kvlens::bench::PrintedHelp(
          argc, argv,
          "usage: kvlens_bench_matmul [dim=2048] [threads=0 (all)] [min_seconds=0.5] [dtypes=all]\n"
          "CpuBackend::MatMul y[N, dim] = x[N, dim] · Wᵀ for a square weight in each stored\n"
          "dtype (f32, f16, bf16, and ggml's block types q8_0, q4_0 … q5_1, q2_K … q6_K,\n"
          "iq4_nl, iq4_xs),\n"
          "N = 1, 4, 16 and 64: ms per call, GFLOP/s, and the weight's bytes per second\n"
          "against this machine's read bandwidth (threads summing 256 MiB, same run).\n"
          "dim must be a multiple of 256. dtypes: a comma-separated list (q4_K,q6_K).\n"
          "Block types run twice: act=f32 (exact, the default) and act=int8\n"
          "(CpuBackend::SetInt8Activations, the server's --int8-activations).\n"
          "Prints a table, then one JSON line.\n")) {
    return 0;
  }
  const int dim = argc > 1 ? std::atoi(argv[1]) : 2048;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 0;
  const double min_seconds = argc > 3 ? std::atof(argv[3]) : 0.5;
  const std::string only = argc > 4 ? "," + std::string(argv[4]) + "," : "";
  if (dim <= 0 || dim % 256 != 0) {
    std::fprintf(stderr, "dim must be a positive multiple of 256 (a k-quant block), got %d\n", dim);
    return 2;
  }
  CpuBackend cpu(threads);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);

  std::printf("CpuBackend MatMul  weight %dx%d  threads=%d  simd=%s\n", dim, dim, cpu.num_threads(),
              std::string(CpuBackend::SimdName()).c_str());
  const double read_bw = ReadBandwidth(cpu.num_threads());
  std::printf("read bandwidth: %.1f GB/s (%d threads)\n", read_bw / 1e9, cpu.num_threads());
  std::printf("%-6s %-5s %5s %12s %10s %10s %8s\n", "dtype", "act", "N", "ms/call", "GFLOP/s",
              "weight GB/s", "of read");
  std::string json = "{\"bench\":\"matmul\",\"dim\":" + std::to_string(dim) +
                     ",\"threads\":" + std::to_string(cpu.num_threads()) + ",\"simd\":\"" +
                     std::string(CpuBackend::SimdName()) +
                     "\",\"read_gbps\":" + std::to_string(read_bw / 1e9) + ",\"results\":[";
  bool first = true;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1,
                   DType::kQ5_0, DType::kQ5_1, DType::kQ2_K, DType::kQ3_K, DType::kQ4_K,
                   DType::kQ5_K, DType::kQ6_K, DType::kIQ4_NL, DType::kIQ4_XS}) {
    if (!only.empty() &&
        only.find("," + std::string(kvlens::kernels::DTypeName(dt)) + ",") == std::string::npos) {
      continue;
    }
    const std::vector<uint8_t> w_bytes = MakeWeight(dt, dim, dim, rng);
    const WeightView w{w_bytes.data(), dt, dim, dim};
    const bool blocks = kvlens::kernels::DTypeIsBlockQuantized(dt);
    for (const bool int8 : {false, true}) {
      if (int8 && !blocks) continue;
      cpu.SetInt8Activations(int8);
      const char* act = int8 ? "int8" : "f32";
      for (int n : {1, 4, 16, 64, 256}) {
        std::vector<float> x(static_cast<size_t>(n) * dim), y(static_cast<size_t>(n) * dim);
        for (float& v : x) v = u(rng);
        cpu.MatMul(x.data(), n, w, WeightView{}, y.data());  // warm up caches and threads
        int64_t calls = 0;
        const auto start = std::chrono::steady_clock::now();
        double seconds = 0;
        do {
          cpu.MatMul(x.data(), n, w, WeightView{}, y.data());
          ++calls;
          seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        } while (seconds < min_seconds);
        const double per_call = seconds / calls;
        const double gflops = 2.0 * n * dim * static_cast<double>(dim) / per_call * 1e-9;
        const std::string name(kvlens::kernels::DTypeName(dt));
        const double weight_bw = double(w_bytes.size()) / per_call;
        std::printf("%-6s %-5s %5d %12.3f %10.2f %11.1f %7.0f%%\n", name.c_str(), act, n,
                    per_call * 1e3, gflops, weight_bw / 1e9, 100 * weight_bw / read_bw);
        char item[224];
        std::snprintf(item, sizeof(item),
                      "%s{\"dtype\":\"%s\",\"act\":\"%s\",\"n\":%d,\"ms\":%.4f,\"gflops\":%.3f,"
                      "\"weight_gbps\":%.3f}",
                      first ? "" : ",", name.c_str(), act, n, per_call * 1e3, gflops,
                      weight_bw / 1e9);
        json += item;
        first = false;
      }
    }
  }
  json += "]}";
  std::printf("%s\n", json.c_str());
  return 0;
}
