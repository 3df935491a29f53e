// CpuBackend decode attention over a paged KV cache of fp32 or bf16 elements
// (--kv-cache-dtype): time per call and the cache bytes read per second, against this
// machine's memcpy bandwidth measured in the same run (bytes read + written per second).
// Prints a table, then one JSON line for scripts.
//
//   kvlens_bench_attention [threads=0 (all)] [min_seconds=0.5]
//
// Shape: a Llama-7B-like layer with grouped-query heads (H 32, Hkv 8, Dh 128), one query
// (decode) or 16 (a prefill chunk) at the end of 2k or 8k cached keys, blocks of 16
// tokens in shuffled order. On the 8k fp32 cache, a chunk of 64 queries again under
// sliding windows (Mistral 7B v0.1's 4096, and 1024): the tiled path reads only the keys
// from the earliest row's window on, so its time should follow the keys the rows see.
//
// Then a decode step, as the engine runs it (one AttentionBatch of one call per sequence,
// each a single query row over its own paged cache): the default model's layer (H 6/6,
// Dh 32, 64 sequences), a Llama-7B MHA layer (H 32/32, Dh 128) and a GQA one (H 32/8,
// Dh 128), 8 sequences each, over 200–455 keys, and the GQA layer for 16 sequences over
// 600–1400 keys (split over the keys): time per step and per (head, key). Steps go round
// several layers' caches, 96 MiB or more in all, so that the cache is read from memory as
// a served model's is, not from the last-level cache.
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
#include "absl/types/span.h"
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
          "machine's memcpy in the same run; a 64-query chunk at the end of 8k keys under\n"
          "sliding windows of 4096 and 1024 against none; then a decode step of many sequences "
          "over\n"
          "short and long contexts (AttentionBatch; H 6/6 Dh 32, H 32/32 and 32/8 Dh 128):\n"
          "time per step and per (head, key). Prints tables, then one JSON line.\n"))
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
  std::string window_table, window_json;  // the sliding-window rows, printed after the table
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
      // tq query rows (q, out) at the end of the cached keys.
      auto args_at_end = [&](const std::vector<float>& q, std::vector<float>& out, int tq) {
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
        return a;
      };
      for (int tq : {1, 16}) {
        std::vector<float> q(size_t(tq) * kHeads * kDh), out(q.size());
        for (float& x : q) x = u(rng);
        const AttentionArgs<float> a = args_at_end(q, out, tq);
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
      if (tk != 8192 || dtype != KvDtype::kActivation) continue;
      // A 64-query chunk at the end of the keys, without a window and in windows of 4096
      // and 1024: time per call against the unwindowed call's, next to the share of
      // (row, key) pairs the rows see.
      constexpr int kChunk = 64;
      std::vector<float> q(size_t(kChunk) * kHeads * kDh), out(q.size());
      for (float& x : q) x = u(rng);
      double full_sec = 0;
      for (int window : {0, 4096, 1024}) {
        AttentionArgs<float> a = args_at_end(q, out, kChunk);
        a.causal = true;
        a.window = window;
        bool ok = true;
        const double sec = SecondsPerCall(min_seconds, [&] { ok = ok && cpu.Attention(a).ok(); });
        if (!ok) {
          std::fprintf(stderr, "windowed attention failed\n");
          return 1;
        }
        if (window == 0) full_sec = sec;
        int64_t seen = 0, all = 0;  // (row, key) pairs shown, with and without the window
        for (int i = 0; i < kChunk; ++i) {
          const int end = a.query_offset + i + 1;
          all += end;
          seen += window > 0 ? std::min(end, window) : end;
        }
        window_table += absl::StrFormat("%6d %6d %4d %10.1f %10.2f %10.2f\n", window, tk, kChunk,
                                        sec * 1e6, sec / full_sec, double(seen) / double(all));
        window_json += absl::StrFormat(
            "%s{\"window\":%d,\"keys\":%d,\"tq\":%d,\"us_per_call\":%.2f,\"of_full\":%.3f}",
            window_json.empty() ? "" : ",", window, tk, kChunk, sec * 1e6, sec / full_sec);
      }
    }
  }
  std::printf("\nprefill chunk in a sliding window (fp32 cache; 0: no window)\n");
  std::printf("%6s %6s %4s %10s %10s %10s\n", "window", "keys", "Tq", "us/call", "of full",
              "keys seen");
  std::printf("%s", window_table.c_str());
  json += "],\"window_chunk\":[" + window_json;
  json += "],\"decode_batch\":[";
  first = true;
  std::printf("\ndecode step (AttentionBatch, one query row a sequence)\n");
  std::printf("%-18s %4s %9s %10s %12s %12s\n", "shape", "seqs", "keys", "us/step", "ns/head-key",
              "cache GB/s");
  struct Shape {
    const char* name;
    int heads, kv_heads, dh, seqs, min_keys, max_keys;
  };
  for (const Shape& sh :
       {Shape{"H6/6 Dh32", 6, 6, 32, 64, 200, 455}, Shape{"H32/32 Dh128", 32, 32, 128, 8, 200, 455},
        Shape{"H32/8 Dh128", 32, 8, 128, 8, 200, 455},
        Shape{"H32/8 Dh128", 32, 8, 128, 16, 600, 1400}}) {
    const int64_t row = int64_t{sh.kv_heads} * sh.dh;
    // Sequence s holds min + (max − min)·s/(seqs − 1) keys, its blocks shuffled among
    // every sequence's.
    std::vector<int> keys(sh.seqs);
    int total_blocks = 0;
    for (int i = 0; i < sh.seqs; ++i) {
      keys[i] = sh.min_keys + (sh.max_keys - sh.min_keys) * i / std::max(1, sh.seqs - 1);
      total_blocks += (keys[i] + kBlock - 1) / kBlock;
    }
    std::vector<int32_t> ids(total_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<std::vector<int32_t>> tables(sh.seqs);
    int next = 0;
    int64_t head_keys = 0;
    for (int i = 0; i < sh.seqs; ++i) {
      for (int b = 0; b < (keys[i] + kBlock - 1) / kBlock; ++b) tables[i].push_back(ids[next++]);
      head_keys += int64_t{keys[i]} * sh.heads;
    }
    const size_t cache_floats = size_t(total_blocks) * kBlock * row;
    const int layers = static_cast<int>((size_t{96} << 20) / (2 * 4 * cache_floats) + 1);
    std::vector<float> kc(cache_floats * layers), vc(kc.size());
    for (float& x : kc) x = u(rng);
    for (float& x : vc) x = u(rng);
    std::vector<float> q(size_t(sh.seqs) * sh.heads * sh.dh), out(q.size());
    for (float& x : q) x = u(rng);
    std::vector<AttentionArgs<float>> calls(size_t(sh.seqs) * layers);
    for (int c = 0; c < sh.seqs * layers; ++c) {
      const int i = c % sh.seqs;
      const size_t layer_off = size_t(c / sh.seqs) * cache_floats;
      AttentionArgs<float>& a = calls[c];
      a.q = q.data() + size_t(i) * sh.heads * sh.dh;
      a.q_stride = int64_t{sh.heads} * sh.dh;
      a.num_queries = 1;
      a.num_keys = keys[i];
      a.num_heads = sh.heads;
      a.num_kv_heads = sh.kv_heads;
      a.head_dim = sh.dh;
      a.query_offset = keys[i] - 1;
      a.scale = 1.0 / std::sqrt(double(sh.dh));
      a.kv = {kc.data() + layer_off, vc.data() + layer_off, row, tables[i].data(), kBlock,
              KvDtype::kActivation};
      a.out = out.data() + size_t(i) * sh.heads * sh.dh;
      a.out_stride = a.q_stride;
    }
    bool ok = true;
    int layer = 0;
    const double sec = SecondsPerCall(min_seconds, [&] {
      int failed = -1;
      ok = ok && cpu.AttentionBatch(absl::MakeConstSpan(calls).subspan(size_t(layer) * sh.seqs,
                                                                       size_t(sh.seqs)),
                                    &failed)
                     .ok();
      layer = (layer + 1) % layers;
    });
    if (!ok) {
      std::fprintf(stderr, "attention batch failed\n");
      return 1;
    }
    int64_t cache_bytes = 0;  // K and V rows each sequence reads
    for (int i = 0; i < sh.seqs; ++i) cache_bytes += 2 * int64_t{keys[i]} * row * 4;
    const double ns_per = sec * 1e9 / double(head_keys);
    std::printf("%-18s %4d %4d–%-4d %10.1f %12.2f %12.2f\n", sh.name, sh.seqs, keys.front(),
                keys.back(), sec * 1e6, ns_per, double(cache_bytes) / sec / 1e9);
    json += absl::StrFormat(
        "%s{\"shape\":\"%s\",\"seqs\":%d,\"keys\":[%d,%d],\"us_per_step\":%.2f,"
        "\"ns_per_head_key\":%.3f}",
        first ? "" : ",", sh.name, sh.seqs, keys.front(), keys.back(), sec * 1e6, ns_per);
    first = false;
  }
  std::printf("%s]}\n", json.c_str());
  return 0;
}
