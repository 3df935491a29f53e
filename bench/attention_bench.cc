// CpuBackend decode attention over a paged KV cache of fp32 or bf16 elements
// (--kv-cache-dtype): time per call and the cache bytes read per second, against this
// machine's memcpy bandwidth measured in the same run (bytes read + written per second).
// Prints a table, then one JSON line for scripts.
//
//   kvlens_bench_attention [threads=0 (all)] [min_seconds=0.5]
//
// Shape: a Llama-7B-like layer with grouped-query heads (H 32, Hkv 8, Dh 128), one query
// (decode) or 16 (a prefill chunk) at the end of 2k or 8k cached keys, blocks of 16
// tokens in shuffled order.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/bench_help.h"
#include "kernels/buffer.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/kv_dtype.h"

namespace {

using kvlens::kernels::AttentionArgs;
using kvlens::kernels::CpuBackend;
using kvlens::kernels::KvDtype;

// Seconds per call of fn, run for at least min_seconds after one warm-up call.
template <typename Fn>
double SecondsPerCall(double min_seconds, Fn&& fn) {
  fn();
  int64_t calls = 0;
  const auto start = std::chrono::steady_clock::now();
  double seconds = 0;
  do {
    fn();
    ++calls;
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (seconds < min_seconds);
  return seconds / calls;
}

}  // namespace

int main(int argc, char** argv) {
  if (kvlens::bench::PrintedHelp(
          argc, argv,
          "usage: kvlens_bench_attention [threads=0 (all)] [min_seconds=0.5]\n"
          "CpuBackend decode attention (H 32/8, Dh 128, paged blocks of 16, fp32 and bf16\n"
          "caches, 2k/8k keys, 1 or 16 queries): time per call and cache GB/s against this\n"
          "machine's memcpy in the same run. Prints a table, then one JSON line.\n"))
    return 0;
  const int threads = argc > 1 ? std::atoi(argv[1]) : 0;
  const double min_seconds = argc > 2 ? std::atof(argv[2]) : 0.5;
  CpuBackend cpu(threads);
  constexpr int kHeads = 32, kKvHeads = 8, kDh = 128, kBlock = 16;
  constexpr int64_t kRow = int64_t{kKvHeads} * kDh;

  // memcpy bandwidth over 256 MiB (out of every cache level).
  const size_t copy_bytes = size_t{256} << 20;
  std::vector<char> src(copy_bytes, 1), dst(copy_bytes, 0);
  const double copy_sec =
      SecondsPerCall(min_seconds, [&] { std::memcpy(dst.data(), src.data(), copy_bytes); });
  const double copy_bw = 2.0 * double(copy_bytes) / copy_sec;

  std::printf("CpuBackend decode attention  H=%d/%d Dh=%d blocks of %d  threads=%d  simd=%s\n",
              kHeads, kKvHeads, kDh, kBlock, cpu.num_threads(),
              std::string(CpuBackend::SimdName()).c_str());
  std::printf("memcpy: %.1f GB/s (read + written)\n", copy_bw / 1e9);
  std::printf("%-5s %6s %4s %10s %12s %9s\n", "cache", "keys", "Tq", "us/call", "cache GB/s",
              "of copy");
  std::string json =
      absl::StrFormat("{\"bench\":\"attention\",\"threads\":%d,\"copy_gbps\":%.2f,\"results\":[",
                      cpu.num_threads(), copy_bw / 1e9);
  bool first = true;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int tk : {2048, 8192}) {
    const int blocks = (tk + kBlock - 1) / kBlock;
    std::vector<int32_t> table(blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    std::vector<float> k(size_t(tk) * kRow), v(k.size());
    for (float& x : k) x = u(rng);
    for (float& x : v) x = u(rng);
    std::vector<int64_t> rows(tk);
    for (int t = 0; t < tk; ++t) rows[t] = int64_t{table[t / kBlock]} * kBlock + t % kBlock;
    for (KvDtype dtype : {KvDtype::kActivation, KvDtype::kBF16}) {
      const size_t cache_bytes =
          size_t(blocks) * kBlock * kRow * size_t(kvlens::kernels::KvElementBytes<float>(dtype));
      auto kc_or = kvlens::kernels::Buffer<unsigned char>::Allocate(kvlens::kernels::HostMemory(),
                                                                    int64_t(cache_bytes));
      auto vc_or = kvlens::kernels::Buffer<unsigned char>::Allocate(kvlens::kernels::HostMemory(),
                                                                    int64_t(cache_bytes));
      if (!kc_or.ok() || !vc_or.ok()) {
        std::fprintf(stderr, "cache allocation failed\n");
        return 1;
      }
      kvlens::kernels::Buffer<unsigned char>&kc = *kc_or, &vc = *vc_or;
      cpu.StoreKv(k.data(), v.data(), tk, kRow, kRow, rows.data(), kc.data(), vc.data(), kRow,
                  dtype);
      for (int tq : {1, 16}) {
        std::vector<float> q(size_t(tq) * kHeads * kDh), out(q.size());
        for (float& x : q) x = u(rng);
        AttentionArgs<float> a;
        a.q = q.data();
        a.q_stride = int64_t{kHeads} * kDh;
        a.num_queries = tq;
        a.num_keys = tk;
        a.num_heads = kHeads;
        a.num_kv_heads = kKvHeads;
        a.head_dim = kDh;
        a.query_offset = tk - tq;
        a.scale = 1.0 / std::sqrt(double(kDh));
        a.kv = {kc.data(), vc.data(), kRow, table.data(), kBlock, dtype};
        a.out = out.data();
        a.out_stride = a.q_stride;
        bool ok = true;
        const double sec = SecondsPerCall(min_seconds, [&] { ok = ok && cpu.Attention(a).ok(); });
        if (!ok) {
          std::fprintf(stderr, "attention failed\n");
          return 1;
        }
        // Bytes of K and V the call reads (every key, once per KV head's group).
        const double bytes =
            2.0 * double(tk) * kRow * kvlens::kernels::KvElementBytes<float>(dtype);
        const double bw = bytes / sec;
        const char* name = dtype == KvDtype::kBF16 ? "bf16" : "fp32";
        std::printf("%-5s %6d %4d %10.1f %12.2f %8.0f%%\n", name, tk, tq, sec * 1e6, bw / 1e9,
                    100.0 * bw / copy_bw);
        json += absl::StrFormat(
            "%s{\"cache\":\"%s\",\"keys\":%d,\"tq\":%d,\"us_per_call\":%.2f,\"cache_gbps\":%.3f}",
            first ? "" : ",", name, tk, tq, sec * 1e6, bw / 1e9);
        first = false;
      }
    }
  }
  std::printf("%s]}\n", json.c_str());
  return 0;
}
