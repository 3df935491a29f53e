// kvlens_gpu_check: what scripts/gpu-check.sh runs on a machine with an NVIDIA GPU. One
// file of about 1300 lines: one program whose benchmarks share its table, sizes, timing
// and allocation helpers, and whose sources a GPU machine's standalone build lists by
// name (kernels/cuda/standalone/CMakeLists.txt), each benchmark a function of its own.
//   1. the parity table (tests/kernels/cuda/cuda_parity.h) against the CPU reference;
//   2. benchmarks: prefill attention TFLOP/s (vs PyTorch SDPA numbers passed in with
//      --sdpa FILE: lines "BACKEND TOKENS TFLOPS" for flash, cudnn, efficient and default,
//      PyTorch's own choice, and "kernel TOKENS NAME", the kernel that choice ran; the
//      target's reference is the flash backend), decode attention bandwidth (fp32 and bf16 KV
//      caches; Llama's head size 128 and Gemma's 256) vs a measured device-to-device copy,
//      the reruns of a batch streaming attention rows (one launch vs one call a row),
//      the attention tuner's candidates and choice (--attention-tune) at the decode heads,
//      end-to-end decode tokens/s of a Llama-7B-shaped model with random bf16 weights at batch 1,
//      16, 64 vs the weight-bandwidth roofline (fp32 cache without and with CUDA graphs, bf16 cache
//      with; both with programmatic dependent launches too).
// Prints one table at the end, each row also to stderr as it is measured ("[row] …"), so a
// hang or a failed benchmark keeps the rows before it; exits 1 when a parity case fails, 2 when no
// device is usable, 3 when a benchmark's CUDA call fails.
//
//   kvlens_gpu_check [--parity-only] [--sdpa FILE] [--quick | --smoke]
//                    [--only prefill|decode|tune|matmul|e2e ...]
//
// --only NAME: that benchmark alone (repeatable) and no parity table: for a profiler
// (ncu -k regex:SplitKv … kvlens_gpu_check --quick --only decode).
// --quick: one shape per benchmark, batch 1. --smoke: every benchmark on tiny shapes (a
// 2-layer model of width 256): the code paths, not the numbers; CI runs it on the CUDA
// emulator (tests/kernels/cuda/emu) so that a GPU session never meets an untried path.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/attention_tuner.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/stream_timing.h"
#include "tests/kernels/cuda/cuda_parity.h"

namespace kvlens::kernels::cuda {
namespace {

struct Row {
  std::string check, shape, measured, reference, ratio, target;
};

// The rows of the final table, each also written to stderr as it is measured, so that a
// benchmark that hangs or exits (Must) does not take the rows before it along.
class Table {
 public:
  void Add(Row r) {
    std::fprintf(stderr, "[row] %s | %s | %s | %s | %s | %s\n", r.check.c_str(), r.shape.c_str(),
                 r.measured.c_str(), r.reference.c_str(), r.ratio.c_str(), r.target.c_str());
    std::fflush(stderr);
    rows_.push_back(std::move(r));
  }
  const std::vector<Row>& rows() const { return rows_; }

 private:
  std::vector<Row> rows_;
};

void PrintTable(const std::vector<Row>& rows) {
  const Row head{"check", "shape", "measured", "reference", "ratio", "target"};
  size_t w[6] = {0, 0, 0, 0, 0, 0};
  auto cells = [](const Row& r) {
    return std::vector<const std::string*>{&r.check,     &r.shape, &r.measured,
                                           &r.reference, &r.ratio, &r.target};
  };
  for (const Row* r : {&head}) {
    for (int i = 0; i < 6; ++i) w[i] = std::max(w[i], cells(*r)[i]->size());
  }
  for (const Row& r : rows) {
    for (int i = 0; i < 6; ++i) w[i] = std::max(w[i], cells(r)[i]->size());
  }
  auto print = [&](const Row& r) {
    std::string line = "|";
    for (int i = 0; i < 6; ++i) {
      line += " " + *cells(r)[i] + std::string(w[i] - cells(r)[i]->size(), ' ') + " |";
    }
    std::printf("%s\n", line.c_str());
  };
  print(head);
  std::string sep = "|";
  for (int i = 0; i < 6; ++i) sep += std::string(w[i] + 2, '-') + "|";
  std::printf("%s\n", sep.c_str());
  for (const Row& r : rows) print(r);
}

bool Check(const absl::Status& s, const char* what) {
  if (!s.ok()) std::fprintf(stderr, "%s: %s\n", what, std::string(s.message()).c_str());
  return s.ok();
}

// A benchmark's op must succeed: its timing means nothing otherwise.
void Must(const absl::Status& s, const char* what) {
  if (!Check(s, what)) std::exit(3);
}

// The benchmarks' shapes: full (the issue's), --quick (one of each), --smoke (tiny).
struct Sizes {
  int prefill_heads = 32, prefill_dh = 128;
  std::vector<int> prefill_tokens = {4096, 8192, 16384};
  int decode_heads = 32, decode_kv_heads = 8, decode_dh = 128, decode_block = 16;
  std::vector<int> decode_keys = {8192, 32768};
  // Llama-7B: D 4096, 32 layers, 32 heads of 128, FFN 11008, vocab 32000.
  int d = 4096, layers = 32, heads = 32, dh = 128, ffn = 11008, vocab = 32000;
  int context = 512, steps = 8;
  std::vector<int> batches = {1, 16, 64};
  size_t copy_bytes = size_t{2} << 30;
  std::string model = "Llama-7B shape";
  int big_vocab = 128256;  // the draws past kDrawCachedVocab: Llama 3's vocabulary
};

Sizes QuickSizes() {
  Sizes s;
  s.prefill_tokens = {4096};
  s.decode_keys = {8192};
  s.steps = 3;
  s.batches = {1};
  return s;
}

Sizes SmokeSizes() {
  Sizes s;
  s.prefill_heads = 4;
  s.prefill_tokens = {200};
  s.decode_heads = 4;
  s.decode_kv_heads = 2;
  s.decode_keys = {700};
  s.d = 256;
  s.layers = 2;
  s.heads = 4;
  s.dh = 64;
  s.ffn = 512;
  s.vocab = 1000;
  s.context = 40;
  s.steps = 2;
  s.batches = {1, 3};
  s.copy_bytes = size_t{1} << 20;
  s.model = "smoke: D=256 L=2";
  s.big_vocab = 41000;
  return s;
}

#define GC_CUDA(expr) Check(KVLENS_CUDA_STATUS(expr), "CUDA")

// Device allocation that aborts the benchmark cleanly on failure.
float* Alloc(size_t floats) {
  void* p = nullptr;
  if (!GC_CUDA(cudaMalloc(&p, std::max<size_t>(floats, 1) * sizeof(float)))) std::exit(3);
  return static_cast<float*>(p);
}

// A KV cache array of `elems` elements of type d: fp32, or bf16 in half the bytes. The
// stored type LaunchFillRandom writes into it is KvStoredDType(d).
float* AllocCache(size_t elems, KvDtype d) {
  const size_t bytes = elems * size_t(KvElementBytes<float>(d));
  return Alloc((bytes + sizeof(float) - 1) / sizeof(float));
}

// How often the timing helpers below run a call. --smoke runs every benchmark's code
// paths on the CUDA emulator, where the times mean nothing: there each call runs twice
// (a graph of two, replayed once), not 20 or 120 times, which kept the smoke test under
// ASan past its CI time limit (2026-12-06).
struct Repetitions {
  int max_iters = 1 << 30;  // TimeIt's iterations at most
  int graph_calls = 20;     // ReplaySeconds: calls in the graph …
  int replays = 5;          // … and its measured launches
};
Repetitions g_repetitions;

// Seconds per call of fn (after one warm-up), timed with events on the backend's stream.
template <typename Fn>
double TimeIt(CudaBackend& b, int iters, Fn&& fn) {
  fn();
  if (!Check(b.Synchronize(), "warm-up")) std::exit(3);
  iters = std::min(iters, g_repetitions.max_iters);
  const absl::StatusOr<double> sec = EventSeconds(b.stream(), iters, [&] {
    fn();
    return absl::OkStatus();
  });
  if (!Check(sec.status(), "timing") || !Check(b.Synchronize(), "benchmark")) std::exit(3);
  return *sec;
}

// Seconds per call of fn on the GPU alone: 20 calls captured in a CUDA graph, replayed 5
// times (after an unmeasured launch; g_repetitions). One call runs first, outside the
// capture: it sizes the backend's workspaces.
template <typename Fn>
double ReplaySeconds(CudaBackend& b, Fn&& fn) {
  fn();
  if (!Check(b.Synchronize(), "warm-up")) std::exit(3);
  const absl::StatusOr<double> sec =
      ReplayedSeconds(b.stream(), g_repetitions.graph_calls, g_repetitions.replays, [&] {
        fn();
        return absl::OkStatus();
      });
  if (!Check(sec.status(), "graph replay") || !Check(b.Synchronize(), "benchmark")) std::exit(3);
  return *sec;
}

// Device-to-device copy bandwidth (bytes read + written per second).
double CopyBandwidth(CudaBackend& b, size_t bytes) {
  float* src = Alloc(bytes / 4);
  float* dst = Alloc(bytes / 4);
  const double t = TimeIt(
      b, 10, [&] { cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b.stream()); });
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * bytes / t;
}

void Fill(void* p, DType dtype, int64_t count, uint64_t seed, float scale, cudaStream_t stream) {
  if (!Check(LaunchFillRandom(p, dtype, count, seed, scale, stream), "fill")) std::exit(3);
}

std::string Fmt(double v, const char* unit) { return absl::StrFormat("%.1f %s", v, unit); }
std::string Pct(double r) { return absl::StrFormat("%.0f%%", 100.0 * r); }

// What scripts/gpu-check.sh measured of PyTorch's SDPA on the prefill shapes.
struct SdpaReference {
  std::map<std::string, std::map<int, double>> tflops;  // backend → tokens → TFLOP/s
  std::map<int, std::string> kernel;                    // tokens → what "default" ran
};

// Lines "BACKEND TOKENS TFLOPS", "kernel TOKENS NAME", or "TOKENS TFLOPS" (earlier
// scripts: PyTorch's default).
SdpaReference ReadSdpa(const char* path) {
  SdpaReference r;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string first;
    if (!(words >> first)) continue;
    int t = 0;
    if (first == "kernel") {
      std::string name;
      if (words >> t >> name) r.kernel[t] = name;
    } else if (std::isdigit(static_cast<unsigned char>(first[0]))) {
      double v = 0;
      if (words >> v) r.tflops["default"][std::atoi(first.c_str())] = v;
    } else {
      double v = 0;
      if (words >> t >> v) r.tflops[first][t] = v;
    }
  }
  return r;
}

// SDPA's flash backend (the target's reference: "SDPA's flash path") for t tokens, or
// PyTorch's default where the flash backend was not measured; its label, or null.
std::pair<double, const char*> SdpaTarget(const SdpaReference& sdpa, int t) {
  for (const char* backend : {"flash", "default"}) {
    const auto it = sdpa.tflops.find(backend);
    if (it == sdpa.tflops.end()) continue;
    if (const auto jt = it->second.find(t); jt != it->second.end()) {
      return {jt->second,
              std::string(backend) == "flash" ? "TFLOP/s SDPA flash" : "TFLOP/s SDPA default"};
    }
  }
  return {0.0, nullptr};
}

// Causal self-attention over t tokens, H heads of dh (no GQA): contiguous q, k and v
// (random; k and v a cache of cache_dtype) and o in device memory, freed with the call.
struct PrefillCall {
  PrefillCall(CudaBackend& b, int t, int heads, int dh, KvDtype cache_dtype) {
    const size_t n = size_t(t) * heads * dh;
    q = Alloc(n);
    k = AllocCache(n, cache_dtype);
    v = AllocCache(n, cache_dtype);
    o = Alloc(n);
    for (float* p : {q, k, v}) {
      Fill(p, p == q ? DType::kF32 : KvStoredDType(cache_dtype), int64_t(n),
           reinterpret_cast<uintptr_t>(p), 1.0f, b.stream());
    }
    args.q = q;
    args.q_stride = int64_t{heads} * dh;
    args.num_queries = args.num_keys = t;
    args.num_heads = args.num_kv_heads = heads;
    args.head_dim = dh;
    args.causal = true;
    args.scale = 1.0 / std::sqrt(double(dh));
    args.kv = KvSource<float>{k, v, int64_t{heads} * dh, nullptr, 0, cache_dtype};
    args.out = o;
    args.out_stride = args.q_stride;
  }
  ~PrefillCall() {
    for (float* p : {q, k, v, o}) cudaFree(p);
  }
  PrefillCall(const PrefillCall&) = delete;
  PrefillCall& operator=(const PrefillCall&) = delete;

  float *q, *k, *v, *o;
  AttentionArgs<float> args;
};

void PrefillBench(CudaBackend& b, const SdpaReference& sdpa, const Sizes& z, Table& rows) {
  const int heads = z.prefill_heads, dh = z.prefill_dh;
  // PyTorch's numbers first (gpu-check.sh measures H 32, Dh 128): every backend it ran, the
  // flash one first, and which kernel its own choice took.
  std::vector<std::string> order = {"flash", "cudnn", "efficient", "default"};
  for (const auto& entry : sdpa.tflops) {
    if (std::find(order.begin(), order.end(), entry.first) == order.end()) {
      order.push_back(entry.first);
    }
  }
  for (const std::string& backend : order) {
    const auto found = sdpa.tflops.find(backend);
    if (found == sdpa.tflops.end()) continue;
    for (const auto& [t, tflops] : found->second) {
      std::string shape = absl::StrCat("T=", t, " H=32 Dh=128");
      if (const auto it = sdpa.kernel.find(t); backend == "default" && it != sdpa.kernel.end()) {
        absl::StrAppend(&shape, ", ran ", it->second);
      }
      rows.Add({absl::StrCat("PyTorch SDPA, ", backend, " backend (bf16, causal)"), shape,
                Fmt(tflops, "TFLOP/s"), "-", "-", "-"});
    }
  }
  // A row of a T-token prompt's TFLOP/s against SDPA's flash backend at T (the target).
  auto add_prefill_row = [&](std::string what, std::string shape, double tflops, int t) {
    Row r{std::move(what),     std::move(shape), Fmt(tflops, "TFLOP/s"), "-", "-",
          ">= 0.8x SDPA flash"};
    if (const auto [ref, label] = SdpaTarget(sdpa, t); label != nullptr) {
      r.reference = Fmt(ref, label);
      r.ratio = absl::StrFormat("%.2fx", tflops / ref);
    }
    rows.Add(r);
  };
  // 64- and 128-query blocks on an fp32 cache, then on a bf16 cache: the fp16 kernel
  // (converting each element, as on fp32), then the bf16 kernel (cp.async, ldmatrix; the
  // default there) with 128-query blocks of 4 warps of 32 queries and of 8 warps of 16 (the
  // default), each with two K/V stages (the default) and three, the 8 warps also at 32
  // keys a tile (two blocks an SM), with 192-query blocks (12 warps of 16) of two and three
  // stages, and with 64-query blocks (4 warps of 16). And on the fp32 cache, the bf16
  // kernel's loop on an fp16 copy of the blocks (SetFlashF16Copy; the copy's launch timed
  // with it) in its default layout, with three stages, 32-key tiles and 192-query blocks.
  struct FlashConfig {
    bool bf16_cache, bf16_kernel;
    FlashBf16Layout layout;  // {tile queries, warp queries, stages, key tile}
    bool f16_copy = false;   // fp32 cache only
  };
  const FlashConfig configs[] = {{false, false, {64}},
                                 {false, false, {128}},
                                 {false, false, {128, 16, 2}, true},
                                 {false, false, {128, 16, 3}, true},
                                 {false, false, {128, 16, 2, 32}, true},
                                 {false, false, {192, 16, 2}, true},
                                 {true, false, {128}},
                                 {true, true, {128, 32, 2}},
                                 {true, true, {128, 16, 2}},
                                 {true, true, {128, 32, 3}},
                                 {true, true, {128, 16, 3}},
                                 {true, true, {128, 16, 2, 32}},
                                 {true, true, {128, 16, 3, 32}},
                                 {true, true, {192, 16, 2}},
                                 {true, true, {192, 16, 3}},
                                 {true, true, {64, 16, 2}}};
  for (const FlashConfig& config : configs) {
    const FlashBf16Layout& layout = config.layout;
    const int tile = layout.tile_queries, warp_queries = layout.warp_queries;
    const bool bf16 = config.bf16_cache, bf16_kernel = config.bf16_kernel;
    const bool copy = config.f16_copy;
    const KvDtype cache_dtype = bf16 ? KvDtype::kBF16 : KvDtype::kActivation;
    b.SetFlashBf16(bf16_kernel);
    b.SetFlashF16Copy(copy);
    Must(b.SetFlashLayout(layout), "flash layout");
    for (int t : z.prefill_tokens) {
      const PrefillCall call(b, t, heads, dh, cache_dtype);
      const double sec = TimeIt(b, 3, [&] { Must(b.Attention(call.args), "prefill attention"); });
      const double tflops = 4.0 * heads * dh * (double(t) * t / 2) / sec / 1e12;  // causal half
      add_prefill_row(
          bf16_kernel ? "prefill attention (causal, fp32 q, bf16 cache, bf16 TC, cp.async)"
          : bf16      ? "prefill attention (causal, fp32 q, bf16 cache, fp16 TC)"
          : copy      ? "prefill attention (causal, fp32 in, fp16 copy, fp16 TC, cp.async)"
                      : "prefill attention (causal, fp32 in, fp16 TC)",
          absl::StrCat("T=", t, " H=", heads, " Dh=", dh, ", ", tile, "-query blocks",
                       bf16_kernel || copy ? absl::StrCat(" of ", tile / warp_queries, " warps")
                                           : std::string(),
                       layout.stages != kFlashDefaultStages
                           ? absl::StrCat(", ", layout.stages, " K/V stages")
                           : std::string(),
                       layout.key_tile != kFlashDefaultKeyTile
                           ? absl::StrCat(", ", layout.key_tile, "-key tiles")
                           : std::string(),
                       tile == kFlashDefaultTileQueries && !copy &&
                               (!bf16_kernel || (warp_queries == kFlashDefaultWarpQueries &&
                                                 layout.stages == kFlashDefaultStages &&
                                                 layout.key_tile == kFlashDefaultKeyTile))
                           ? " (default)"
                           : ""),
          tflops, t);
    }
  }
  b.SetFlashBf16(true);
  b.SetFlashF16Copy(false);
  Must(b.SetFlashLayout(FlashBf16Layout{}), "flash layout");

  // The default kernel (bf16 cache) with its blocks in other orders (FlashGrid): head by
  // head is the rows above; here the longest blocks first across the heads whose K/V fit
  // in L2 (FlashHeadGroup), across 4, 8 and all of them. A greedy model of the launch's
  // waves puts head by head 14% past the ideal makespan at 4k tokens and 6% at 8k, the
  // others within 1%; what L2 makes of it is what these rows measure.
  for (int asked : {kFlashAutoHeadGroup, 4, 8, heads}) {
    Must(b.SetFlashHeadGroup(asked), "flash head group");
    for (int t : z.prefill_tokens) {
      const PrefillCall call(b, t, heads, dh, KvDtype::kBF16);
      const int group = FlashHeadGroup(HostAttentionParams(call.args), asked, t, b.l2_bytes());
      const double sec = TimeIt(b, 3, [&] { Must(b.Attention(call.args), "prefill attention"); });
      const double tflops = 4.0 * heads * dh * (double(t) * t / 2) / sec / 1e12;
      add_prefill_row(
          "prefill attention, block order (bf16 cache, default layout)",
          absl::StrCat("T=", t, " H=", heads, " Dh=", dh, ", longest first across ", group,
                       " heads", asked == kFlashAutoHeadGroup ? " (sized to L2)" : ""),
          tflops, t);
    }
  }
  Must(b.SetFlashHeadGroup(1), "flash head group");

  // The longest prompt again in sliding windows of a quarter and an eighth of it (Mistral
  // 7B v0.1's 4096 at 16k), default kernel on a bf16 cache: the blocks skip the tiles
  // before their window, so the time should follow the (row, key) pairs the rows see
  // ("keys seen"); TFLOP/s counts those pairs only.
  const int t = z.prefill_tokens.back();
  PrefillCall call(b, t, heads, dh, KvDtype::kBF16);
  double full_sec = 0;
  for (int window : {0, t / 4, t / 8}) {
    call.args.window = window;
    const double sec =
        TimeIt(b, 3, [&] { Must(b.Attention(call.args), "windowed prefill attention"); });
    if (window == 0) full_sec = sec;
    double pairs = 0;  // (row, key) pairs seen
    for (int i = 0; i < t; ++i) pairs += window > 0 ? std::min(i + 1, window) : i + 1;
    const double all = double(t) * (t + 1) / 2;
    rows.Add({"prefill attention in a sliding window (bf16 cache, default kernel)",
              absl::StrCat("T=", t, " H=", heads, " Dh=", dh, " window=", window,
                           absl::StrFormat(", keys seen %.2f", pairs / all)),
              Fmt(4.0 * heads * dh * pairs / sec / 1e12, "TFLOP/s"),
              absl::StrFormat("%.0f us a call unwindowed", full_sec * 1e6),
              absl::StrFormat("%.2fx the time", sec / full_sec), "time ~ keys seen"});
  }

  // Gemma's head size 256 (64-query blocks, Q in shared memory) on the same FLOPs (half the
  // heads), plain and under Gemma 2's soft cap of 50 (a tanh a score), against the head size
  // 128 default on a bf16 cache: on a bf16 cache the bf16 kernel (the default there; 32-key
  // tiles) and the fp16 kernel; on an fp32 cache the fp16 kernel (the default there) and
  // the bf16 kernel's loop on an fp16 copy (SetFlashF16Copy, 32-key tiles too).
  const int gemma_heads = std::max(1, heads / 2);
  struct Dh256Config {
    KvDtype cache;
    bool bf16_kernel, copy, is_default;
    const char* what;
  };
  const Dh256Config dh256[] = {
      {KvDtype::kBF16, true, false, true, "bf16 cache, bf16 TC"},
      {KvDtype::kBF16, false, false, false, "bf16 cache, fp16 TC"},
      {KvDtype::kActivation, true, false, true, "fp32 in, fp16 TC"},
      {KvDtype::kActivation, true, true, false, "fp32 in, fp16 copy, fp16 TC"}};
  for (const Dh256Config& config : dh256) {
    PrefillCall gemma(b, t, gemma_heads, 256, config.cache);
    b.SetFlashBf16(config.bf16_kernel);
    b.SetFlashF16Copy(config.copy);
    for (double cap : {0.0, 50.0}) {
      gemma.args.softcap = cap;
      const double sec =
          TimeIt(b, 3, [&] { Must(b.Attention(gemma.args), "head size 256 prefill attention"); });
      const double tflops = 4.0 * gemma_heads * 256 * (double(t) * t / 2) / sec / 1e12;
      rows.Add({absl::StrCat("prefill attention, head size 256 (causal, ", config.what, ")"),
                absl::StrCat("T=", t, " H=", gemma_heads, " Dh=256", cap > 0 ? ", soft cap 50" : "",
                             config.is_default ? " (default)" : ""),
                Fmt(tflops, "TFLOP/s"),
                absl::StrFormat("%.0f us a call at Dh=%d", full_sec * 1e6, dh),
                absl::StrFormat("%.2fx the time", sec / full_sec), "-"});
    }
  }
  b.SetFlashBf16(true);
  b.SetFlashF16Copy(false);
}

// One decode row over a paged cache of tk keys in blocks of bs rows, shuffled.
struct DecodeCall {
  DecodeCall(CudaBackend& b, int tk, int heads, int kv_heads, int dh, int bs, KvDtype cache_dtype) {
    const int blocks = (tk + bs - 1) / bs;
    const size_t cache = size_t(blocks) * bs * kv_heads * dh;
    cache_bytes = double(cache) * KvElementBytes<float>(cache_dtype);
    kc = AllocCache(cache, cache_dtype);
    vc = AllocCache(cache, cache_dtype);
    q = Alloc(size_t(heads) * dh);
    o = Alloc(size_t(heads) * dh);
    Fill(q, DType::kF32, int64_t{heads} * dh, 7, 1.0f, b.stream());
    for (float* p : {kc, vc})
      Fill(p, KvStoredDType(cache_dtype), int64_t(cache), 7, 1.0f, b.stream());
    table.resize(blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(1));
    args.q = q;
    args.q_stride = int64_t{heads} * dh;
    args.num_queries = 1;
    args.num_keys = tk;
    args.query_offset = tk - 1;
    args.num_heads = heads;
    args.num_kv_heads = kv_heads;
    args.head_dim = dh;
    args.scale = 1.0 / std::sqrt(double(dh));
    args.kv = KvSource<float>{kc, vc, int64_t{kv_heads} * dh, table.data(), bs, cache_dtype};
    args.out = o;
    args.out_stride = args.q_stride;
  }
  ~DecodeCall() {
    for (float* p : {kc, vc, q, o}) cudaFree(p);
  }
  DecodeCall(const DecodeCall&) = delete;
  DecodeCall& operator=(const DecodeCall&) = delete;

  float *kc, *vc, *q, *o;
  std::vector<int32_t> table;
  double cache_bytes;  // K's, V's as many
  AttentionArgs<float> args;
};

void UnequalDecodeBench(CudaBackend& b, double copy_bw, const Sizes& z, Table& rows);
void StreamedRowsBench(CudaBackend& b, const Sizes& z, Table& rows);

void DecodeAttentionBench(CudaBackend& b, double copy_bw, const Sizes& z, Table& rows) {
  const int heads = z.decode_heads, kv_heads = z.decode_kv_heads, dh = z.decode_dh,
            bs = z.decode_block;
  for (int tk : z.decode_keys)
    for (KvDtype cache_dtype : {KvDtype::kActivation, KvDtype::kBF16}) {
      const bool bf16 = cache_dtype == KvDtype::kBF16;
      DecodeCall decode(b, tk, heads, kv_heads, dh, bs, cache_dtype);
      const AttentionArgs<float>& a = decode.args;
      const double cache_bytes = decode.cache_bytes;
      // One call at a time, each with its host-side checks and launches …
      const double call_sec = TimeIt(b, 20, [&] { Must(b.Attention(a), "decode attention"); });
      // … and the GPU's time alone: 20 calls captured in a CUDA graph, replayed. A model's
      // step makes its calls while the GPU works (or replays them, with --cuda-graphs), so
      // the host's part is not in a layer's time; at 8k keys it would be most of this one's.
      const auto call = [&] { Must(b.Attention(a), "decode attention"); };
      const double sec = ReplaySeconds(b, call);
      const double bw = 2.0 * cache_bytes / sec;
      // The same call with each fixed number of key splits: which split count the kernel
      // wants here, against ChooseNumSplits' choice above. "8: GB/s, 16: GB/s, …".
      const auto sweep_of = [&](std::initializer_list<int> counts) {
        std::string sweep;
        for (int splits : counts) {
          Must(b.SetSplitKvSplits(splits), "split-KV splits");
          absl::StrAppend(
              &sweep, sweep.empty() ? "" : ", ", splits, ": ",
              absl::StrFormat("%.0f", 2.0 * cache_bytes / ReplaySeconds(b, call) / 1e9));
        }
        Must(b.SetSplitKvSplits(0), "split-KV splits");
        return sweep;
      };
      const std::string sweep = sweep_of({8, 16, 32, 64, 96, 128});
      // With programmatic dependent launch: each kernel (the combine after the splits, the
      // next call's splits after the combine) is scheduled while its predecessor drains.
      // (Since 2026-12-06 each split-KV warp prefetches its first K and V rows before the
      // wait; the launches without those prefetches tell the two apart.)
      b.SetProgrammaticLaunches(true);
      const double pdl_sec = ReplaySeconds(b, call);
      b.SetLaunchPrefetches(false);
      const double pdl_plain_sec = ReplaySeconds(b, call);
      b.SetLaunchPrefetches(true);
      b.SetProgrammaticLaunches(false);
      // The splits merged by the split-KV launch itself (no combine launch), without and
      // with PDL.
      b.SetSplitKvFusedCombine(true);
      const double fused_sec = ReplaySeconds(b, call);
      b.SetProgrammaticLaunches(true);
      const double fused_pdl_sec = ReplaySeconds(b, call);
      b.SetProgrammaticLaunches(false);
      b.SetSplitKvFusedCombine(false);
      rows.Add(
          {bf16 ? "decode attention (paged, bf16 cache)" : "decode attention (paged, fp32 cache)",
           absl::StrFormat("Tk=%d H=%d/%d Dh=%d bs=%d, graph replay %.1f us (with PDL: %.1f us, "
                           "%.0f GB/s, without its prefetches %.1f us; fused combine: %.1f us, "
                           "%.0f GB/s, with PDL %.1f us, %.0f GB/s; one call with the host's "
                           "part: %.0f us, %.0f GB/s)",
                           tk, heads, kv_heads, dh, bs, sec * 1e6, pdl_sec * 1e6,
                           2.0 * cache_bytes / pdl_sec / 1e9, pdl_plain_sec * 1e6, fused_sec * 1e6,
                           2.0 * cache_bytes / fused_sec / 1e9, fused_pdl_sec * 1e6,
                           2.0 * cache_bytes / fused_pdl_sec / 1e9, call_sec * 1e6,
                           2.0 * cache_bytes / call_sec / 1e9),
           Fmt(bw / 1e9, "GB/s"), Fmt(copy_bw / 1e9, "GB/s d2d copy"), Pct(bw / copy_bw),
           ">= 70%"});
      rows.Add({bf16 ? "decode attention, fixed splits (bf16 cache)"
                     : "decode attention, fixed splits (fp32 cache)",
                absl::StrFormat("Tk=%d, splits: GB/s = %s", tk, sweep), "-", "-", "-", "-"});
      // Blocks of 16 warps (one an SM, a quarter of the splits): with the combine launch,
      // merging their own splits, and at fixed split counts.
      Must(b.SetSplitKvWarps(kSplitKvWideWarps), "split-KV warps");
      const double wide_sec = ReplaySeconds(b, call);
      b.SetSplitKvFusedCombine(true);
      const double wide_fused_sec = ReplaySeconds(b, call);
      b.SetSplitKvFusedCombine(false);
      const std::string wide_sweep = sweep_of({8, 16, 32});
      Must(b.SetSplitKvWarps(kSplitKvWarps), "split-KV warps");
      const double wide_bw = 2.0 * cache_bytes / std::min(wide_sec, wide_fused_sec);
      rows.Add({bf16 ? "decode attention, 16-warp blocks (bf16 cache)"
                     : "decode attention, 16-warp blocks (fp32 cache)",
                absl::StrFormat("Tk=%d, graph replay %.1f us (%.0f GB/s); fused combine %.1f us "
                                "(%.0f GB/s); fixed splits: GB/s = %s",
                                tk, wide_sec * 1e6, 2.0 * cache_bytes / wide_sec / 1e9,
                                wide_fused_sec * 1e6, 2.0 * cache_bytes / wide_fused_sec / 1e9,
                                wide_sweep),
                Fmt(wide_bw / 1e9, "GB/s"), Fmt(copy_bw / 1e9, "GB/s d2d copy"),
                Pct(wide_bw / copy_bw), ">= 70%"});
      // Split-KV on tensor cores (bf16 products on a bf16 cache in 16-key steps, fp16 on
      // fp32 in 8-key steps): with the combine launch, merging its own splits, and at fixed
      // split counts.
      b.SetSplitKvTensorCores(true);
      const double mma_sec = ReplaySeconds(b, call);
      b.SetSplitKvFusedCombine(true);
      const double mma_fused_sec = ReplaySeconds(b, call);
      b.SetSplitKvFusedCombine(false);
      const std::string mma_sweep = sweep_of({16, 32, 64});
      b.SetSplitKvTensorCores(false);
      const double mma_bw = 2.0 * cache_bytes / std::min(mma_sec, mma_fused_sec);
      rows.Add(
          {bf16 ? "decode attention, tensor cores (bf16 cache)"
                : "decode attention, tensor cores (fp32 cache, fp16 products)",
           absl::StrFormat("Tk=%d, graph replay %.1f us (%.0f GB/s); fused combine %.1f us "
                           "(%.0f GB/s); fixed splits: GB/s = %s",
                           tk, mma_sec * 1e6, 2.0 * cache_bytes / mma_sec / 1e9,
                           mma_fused_sec * 1e6, 2.0 * cache_bytes / mma_fused_sec / 1e9, mma_sweep),
           Fmt(mma_bw / 1e9, "GB/s"), Fmt(copy_bw / 1e9, "GB/s d2d copy"), Pct(mma_bw / copy_bw),
           ">= 70%"});
    }
  // Gemma 2 9B's decode (head size 256, 16 heads over 8 KV heads at full size) at the first
  // key count: SplitKvKernel (the default) against tensor cores, on both caches.
  for (KvDtype cache_dtype : {KvDtype::kActivation, KvDtype::kBF16}) {
    const bool bf16 = cache_dtype == KvDtype::kBF16;
    const int tk = z.decode_keys.front(), gemma_heads = std::max(1, heads / 2);
    DecodeCall gemma(b, tk, gemma_heads, kv_heads, 256, bs, cache_dtype);
    const auto call = [&] { Must(b.Attention(gemma.args), "head size 256 decode attention"); };
    const double sec = ReplaySeconds(b, call);
    b.SetSplitKvTensorCores(true);
    const double mma_sec = ReplaySeconds(b, call);
    b.SetSplitKvTensorCores(false);
    const double bw = 2.0 * gemma.cache_bytes / std::min(sec, mma_sec);
    rows.Add({bf16 ? "decode attention, head size 256 (bf16 cache)"
                   : "decode attention, head size 256 (fp32 cache)",
              absl::StrFormat("Tk=%d H=%d/%d Dh=256 bs=%d, graph replay: CUDA cores %.1f us (%.0f "
                              "GB/s, the default), tensor cores %.1f us (%.0f GB/s)",
                              tk, gemma_heads, kv_heads, bs, sec * 1e6,
                              2.0 * gemma.cache_bytes / sec / 1e9, mma_sec * 1e6,
                              2.0 * gemma.cache_bytes / mma_sec / 1e9),
              Fmt(bw / 1e9, "GB/s"), Fmt(copy_bw / 1e9, "GB/s d2d copy"), Pct(bw / copy_bw),
              ">= 70%"});
  }
  UnequalDecodeBench(b, copy_bw, z, rows);
  StreamedRowsBench(b, z, rows);
}

// A decode step of the end-to-end benchmark's largest batch (64) in one launch
// (AttentionBatch), its sequences' keys unequal: one of the first key count and the rest of
// 1/32 of it (a long conversation among short ones), against the same keys in all split
// evenly. Each row divides its keys among the launch's splits, and the splits are chosen
// for one wave of the batch's blocks (at 64 rows of 8 KV heads: one split), so the long
// row's blocks may run alone at the end: the ratio of the two times shows what that costs
// (1.0x: nothing), and the same batch with the splits of its imbalance
// (SetSplitKvBalanced) what more splits for every row win back; per-row split counts (a
// work list, as FlashInfer plans its decode) would be the next step.
void UnequalDecodeBench(CudaBackend& b, double copy_bw, const Sizes& z, Table& rows) {
  const int batch = z.batches.back(), longest = z.decode_keys.front();
  const int shortest = std::max(16, longest / 32);
  const int total = longest + (batch - 1) * shortest;
  const int even = total / batch;
  for (KvDtype cache_dtype : {KvDtype::kActivation, KvDtype::kBF16}) {
    DecodeCall decode(b, longest, z.decode_heads, z.decode_kv_heads, z.decode_dh, z.decode_block,
                      cache_dtype);
    const int64_t row_floats = int64_t{z.decode_heads} * z.decode_dh;
    float* q = Alloc(size_t(batch * row_floats));
    float* o = Alloc(size_t(batch * row_floats));
    Fill(q, DType::kF32, batch * row_floats, 9, 1.0f, b.stream());
    // Every row reads a prefix of the one cache (the table's first blocks).
    auto calls_of = [&](bool unequal) {
      std::vector<AttentionArgs<float>> calls(batch, decode.args);
      for (int r = 0; r < batch; ++r) {
        calls[r].q = q + r * row_floats;
        calls[r].out = o + r * row_floats;
        calls[r].num_keys = unequal ? (r == 0 ? longest : shortest) : even;
        calls[r].query_offset = calls[r].num_keys - 1;
      }
      return calls;
    };
    const std::vector<AttentionArgs<float>> unequal = calls_of(true), evenly = calls_of(false);
    auto seconds = [&](const std::vector<AttentionArgs<float>>& calls) {
      return ReplaySeconds(b, [&] {
        int failed = 0;
        Must(b.AttentionBatch(calls, &failed), "batched decode attention");
      });
    };
    const double unequal_sec = seconds(unequal), even_sec = seconds(evenly);
    b.SetSplitKvBalanced(true);  // the splits of the batch's imbalance (attention.h)
    const double balanced_sec = seconds(unequal);
    b.SetSplitKvBalanced(false);
    // K and V of the keys the rows read (the even split reads batch · even <= total).
    const double row_bytes =  // a key's K and V
        2.0 * z.decode_kv_heads * z.decode_dh * KvElementBytes<float>(cache_dtype);
    const double bw = row_bytes * total / unequal_sec;
    rows.Add({cache_dtype == KvDtype::kBF16 ? "decode attention, unequal batch (bf16 cache)"
                                            : "decode attention, unequal batch (fp32 cache)",
              absl::StrFormat("batch %d: 1 x %d + %d x %d keys, graph replay %.1f us (balanced "
                              "splits, SetSplitKvBalanced: %.1f us, %.2fx the even time); the "
                              "same keys evenly (%d x %d) %.1f us (%.0f GB/s)",
                              batch, longest, batch - 1, shortest, unequal_sec * 1e6,
                              balanced_sec * 1e6, balanced_sec / even_sec, batch, even,
                              even_sec * 1e6, row_bytes * batch * even / even_sec / 1e9),
              Fmt(bw / 1e9, "GB/s"), Fmt(copy_bw / 1e9, "GB/s d2d copy"),
              absl::StrFormat("%.2fx the even batch's time", unequal_sec / even_sec), "~1.0x"});
    for (float* ptr : {q, o}) cudaFree(ptr);
  }
}

// The reruns of requests streaming their attention rows (the Transformer saves each
// streamed layer's last queries in the step and runs their attention again after it,
// probabilities [H, Tk] out) for the end-to-end benchmark's largest batch, every sequence
// streaming one layer at the first key count: all the rows' maps in one launch
// (AttentionBatch's materialised rows, since 2026-12-06) against one call a row (as the
// engine ran them before), beside the same batch's decode attention (one split-KV launch):
// what a streamed layer adds to a step's, and what the one launch saved.
void StreamedRowsBench(CudaBackend& b, const Sizes& z, Table& rows) {
  const int batch = z.batches.back(), tk = z.decode_keys.front();
  DecodeCall decode(b, tk, z.decode_heads, z.decode_kv_heads, z.decode_dh, z.decode_block,
                    KvDtype::kActivation);
  const int64_t row_floats = int64_t{z.decode_heads} * z.decode_dh;
  const int64_t map_floats = int64_t{z.decode_heads} * tk;
  float* q = Alloc(size_t(batch * row_floats));
  float* o = Alloc(size_t(batch * row_floats));
  float* probs = Alloc(size_t(batch * map_floats));
  Fill(q, DType::kF32, batch * row_floats, 11, 1.0f, b.stream());
  std::vector<AttentionArgs<float>> step(batch, decode.args);
  for (int r = 0; r < batch; ++r) {
    step[r].q = q + r * row_floats;
    step[r].out = o + r * row_floats;
  }
  std::vector<AttentionArgs<float>> reruns = step;
  for (int r = 0; r < batch; ++r) reruns[r].probs = probs + r * map_floats;
  const auto batched = [&](const std::vector<AttentionArgs<float>>& calls) {
    int failed = 0;
    Must(b.AttentionBatch(calls, &failed), "batched attention");
  };
  const double step_sec = ReplaySeconds(b, [&] { batched(step); });
  const double batched_sec = ReplaySeconds(b, [&] { batched(reruns); });
  const double one_by_one_sec = ReplaySeconds(b, [&] {
    for (const AttentionArgs<float>& call : reruns) Must(b.Attention(call), "attention row");
  });
  rows.Add(
      {"streamed attention rows (fp32 cache)",
       absl::StrFormat("batch %d x Tk=%d H=%d/%d Dh=%d, graph replay: the step's decode "
                       "attention %.1f us; every row's [H, Tk] again, one launch %.1f us "
                       "(%.2fx the step's), one call a row %.1f us",
                       batch, tk, z.decode_heads, z.decode_kv_heads, z.decode_dh, step_sec * 1e6,
                       batched_sec * 1e6, batched_sec / step_sec, one_by_one_sec * 1e6),
       Fmt(batched_sec * 1e6, "us"), Fmt(one_by_one_sec * 1e6, "us one call a row"),
       absl::StrFormat("%.2fx", one_by_one_sec / batched_sec), "-"});
  for (float* ptr : {q, o, probs}) cudaFree(ptr);
}

// One bf16 weight of the model's FFN shape [ffn, d], read per product: n up to
// kMatVecMaxRows takes the matvec kernel, larger n cuBLAS. Weight bytes per second against the
// copy: the ceiling of a decode step's products (batch-1 decode is ~all weight reads). Then
// the gated products (a second weight as W_up): SwiGLU's, and GeGLU's (Gemma) through the
// same launch, and SwiGLU's with its RMSNorm fused in (RmsNormMatMulSwiGlu: each block
// normalizes x into shared memory first; 1 and 2 rows, the most a row of 4096 allows).
// Last a layer's q, k and v ([d, d] each, heads of dh) in one launch, plain (MatMulMany)
// and with its norm, rope and cache rows (RmsNormQkvRopeStoreKv): what the epilogue costs.
void MatMulBench(CudaBackend& b, double copy_bw, const Sizes& z, Table& rows) {
  const int64_t out = z.ffn, in = z.d;
  void* data = nullptr;
  if (!GC_CUDA(cudaMalloc(&data, size_t(out * in) * 2))) std::exit(3);
  Fill(data, DType::kBF16, out * in, 17, 0.02f, b.stream());
  void* up_data = nullptr;
  if (!GC_CUDA(cudaMalloc(&up_data, size_t(out * in) * 2))) std::exit(3);
  Fill(up_data, DType::kBF16, out * in, 19, 0.02f, b.stream());
  void* norm_data = nullptr;
  if (!GC_CUDA(cudaMalloc(&norm_data, size_t(in) * 2))) std::exit(3);
  Fill(norm_data, DType::kBF16, in, 20, 1.0f, b.stream());
  const unsigned char key[3] = {};  // host keys of the adopted device weights, never read
  if (!Check(b.AdoptWeight(&key[0], data, DType::kBF16, out, in), "adopt") ||
      !Check(b.AdoptWeight(&key[1], up_data, DType::kBF16, out, in), "adopt") ||
      !Check(b.AdoptWeight(&key[2], norm_data, DType::kBF16, 1, in), "adopt")) {
    std::exit(3);
  }
  const WeightView w{&key[0], DType::kBF16, out, in}, w_up{&key[1], DType::kBF16, out, in},
      norm{&key[2], DType::kBF16, 1, in};
  const int max_n = 16;
  float *x = Alloc(size_t(max_n) * in), *y = Alloc(size_t(max_n) * out),
        *up = Alloc(size_t(max_n) * out), *xn = Alloc(size_t(max_n) * in);
  Fill(x, DType::kF32, max_n * in, 18, 1.0f, b.stream());
  for (int n : {1, kMatVecMaxRows, max_n}) {
    const double sec = TimeIt(b, 20, [&] { b.MatMul(x, n, w, WeightView{}, y); });
    const double bw = double(out * in) * 2 / sec;
    rows.Add({"matmul (bf16 weights)",
              absl::StrCat("n=", n, " [", out, " x ", in, "], ",
                           n <= kMatVecMaxRows ? "matvec kernel" : "cuBLAS"),
              Fmt(bw / 1e9, "GB/s weights"), Fmt(copy_bw / 1e9, "GB/s d2d copy"), Pct(bw / copy_bw),
              "-"});
  }
  for (const bool geglu : {false, true}) {
    for (int n : {1, kMatVecMaxRows}) {
      const double sec = TimeIt(b, 20, [&] {
        if (geglu) {
          b.MatMulGeGlu(x, n, w, w_up, up, y);
        } else {
          b.MatMulSwiGlu(x, n, w, w_up, up, y);
        }
      });
      const double bw = double(out * in) * 4 / sec;
      rows.Add({geglu ? "matmul GeGLU (bf16 gate + up)" : "matmul SwiGLU (bf16 gate + up)",
                absl::StrCat("n=", n, " 2 x [", out, " x ", in, "], gated matvec kernel"),
                Fmt(bw / 1e9, "GB/s weights"), Fmt(copy_bw / 1e9, "GB/s d2d copy"),
                Pct(bw / copy_bw), "-"});
    }
  }
  for (int n : {1, 2}) {
    const double sec = TimeIt(b, 20, [&] {
      b.RmsNormMatMulSwiGlu(x, n, static_cast<int>(in), norm, 1e-5, xn, w, w_up, up, y);
    });
    const double bw = double(out * in) * 4 / sec;
    rows.Add({"matmul SwiGLU, RMSNorm fused (bf16)",
              absl::StrCat("n=", n, " 2 x [", out, " x ", in, "], ",
                           MatVecNormFits(n, in) ? "x normalized in the matvec"
                                                 : "RmsNorm launch, then the matvec"),
              Fmt(bw / 1e9, "GB/s weights"), Fmt(copy_bw / 1e9, "GB/s d2d copy"), Pct(bw / copy_bw),
              "-"});
  }
  const int64_t d = in;
  const unsigned char qkv_key[3] = {};
  for (int i = 0; i < 3; ++i) {  // (each adopted allocation is freed by ForgetWeights)
    void* part = nullptr;
    if (!GC_CUDA(cudaMalloc(&part, size_t(d * in) * 2))) std::exit(3);
    Fill(part, DType::kBF16, d * in, 21 + i, 0.02f, b.stream());
    if (!Check(b.AdoptWeight(&qkv_key[i], part, DType::kBF16, d, in), "adopt")) std::exit(3);
  }
  float *q = Alloc(size_t(kMatVecMaxRows) * d), *k = Alloc(size_t(kMatVecMaxRows) * d),
        *v = Alloc(size_t(kMatVecMaxRows) * d), *kc = Alloc(size_t(kMatVecMaxRows) * d),
        *vc = Alloc(size_t(kMatVecMaxRows) * d);
  const MatMulOutput<float> qkv[] = {{WeightView{&qkv_key[0], DType::kBF16, d, in}, {}, q},
                                     {WeightView{&qkv_key[1], DType::kBF16, d, in}, {}, k},
                                     {WeightView{&qkv_key[2], DType::kBF16, d, in}, {}, v}};
  const RopeSpec rope{10000.0, RopeStyle::kHalfSplit};
  const std::vector<int32_t> positions = {511, 300, 77, 4000};
  const std::vector<int64_t> dst_rows = {0, 1, 2, 3};
  QkvRopeStore new_kv;
  new_kv.q_heads = new_kv.kv_heads = static_cast<int>(d / z.dh);
  new_kv.head_dim = z.dh;
  new_kv.positions = positions.data();
  new_kv.rope = &rope;
  new_kv.dst_rows = dst_rows.data();
  new_kv.k_cache = kc;
  new_kv.v_cache = vc;
  new_kv.cache_stride = d;
  for (const bool fused : {false, true}) {
    for (int n : {1, kMatVecMaxRows}) {
      const double sec = TimeIt(b, 20, [&] {
        if (fused) {
          b.RmsNormQkvRopeStoreKv(x, n, static_cast<int>(in), norm, 1e-5, xn, qkv, new_kv);
        } else {
          b.MatMulMany(x, n, qkv);
        }
      });
      const double bw = double(3 * d * in) * 2 / sec;
      rows.Add({fused ? "matmul q/k/v, RMSNorm, rope and cache rows fused (bf16)"
                      : "matmul q/k/v (bf16)",
                absl::StrCat("n=", n, " 3 x [", d, " x ", in, "], Dh ", z.dh, ", ",
                             fused ? "RmsNormQkvRopeStoreKv" : "MatMulMany"),
                Fmt(bw / 1e9, "GB/s weights"), Fmt(copy_bw / 1e9, "GB/s d2d copy"),
                Pct(bw / copy_bw), "-"});
    }
  }
  b.ForgetWeights();  // frees the adopted weights
  for (float* p : {x, y, up, xn, q, k, v, kc, vc}) cudaFree(p);
}

// A Llama-shaped model (Sizes: Llama-7B unless --smoke) with random bf16 weights.
void EndToEndBench(CudaBackend& b, double copy_bw, const Sizes& z, Table& rows) {
  const int D = z.d, L = z.layers, H = z.heads, Dh = z.dh, F = z.ffn, V = z.vocab, bs = 16;
  const int ctx = z.context, steps = z.steps;
  const int max_batch = *std::max_element(z.batches.begin(), z.batches.end());
  // Host keys for the adopted device weights: one byte each, never read.
  std::vector<unsigned char> keys(size_t(L) * 9 + 3);
  int next_key = 0;
  int64_t streamed_bytes = 0;  // bytes read per step (all but the embedding table)
  auto weight = [&](int64_t rows_, int64_t cols) {
    void* data = nullptr;
    const size_t bytes = size_t(rows_ * cols) * 2;
    if (!GC_CUDA(cudaMalloc(&data, bytes))) std::exit(3);
    Fill(data, DType::kBF16, rows_ * cols, 100 + next_key, 0.02f, b.stream());
    const void* key = &keys[next_key++];
    if (!Check(b.AdoptWeight(key, data, DType::kBF16, rows_, cols), "adopt")) std::exit(3);
    return WeightView{key, DType::kBF16, rows_, cols};
  };
  struct Layer {
    WeightView attn_norm, wq, wk, wv, wo, ffn_norm, w1, w3, w2;
  };
  std::vector<Layer> layers;
  const WeightView embedding = weight(V, D);
  for (int l = 0; l < L; ++l) {
    Layer y{weight(1, D), weight(D, D), weight(D, D), weight(D, D), weight(D, D),
            weight(1, D), weight(F, D), weight(F, D), weight(D, F)};
    layers.push_back(y);
    streamed_bytes += 2 * (4 * int64_t{D} * D + 3 * int64_t{F} * D + 2 * D);
  }
  const WeightView final_norm = weight(1, D), output = weight(V, D);
  streamed_bytes += 2 * (int64_t{V} * D + D);

  const int max_tokens = ctx + steps + 2;
  const int blocks_per_seq = (max_tokens + bs - 1) / bs;
  const size_t cache_rows = size_t(max_batch) * blocks_per_seq * bs;
  // Both caches, fp32 and bf16 (--kv-cache-dtype bf16), of every layer.
  std::vector<float*> kc(L), vc(L), kc16(L), vc16(L);
  for (int l = 0; l < L; ++l) {
    kc[l] = Alloc(cache_rows * D);
    vc[l] = Alloc(cache_rows * D);
    kc16[l] = AllocCache(cache_rows * D, KvDtype::kBF16);
    vc16[l] = AllocCache(cache_rows * D, KvDtype::kBF16);
    Fill(kc[l], DType::kF32, int64_t(cache_rows) * D, 1000 + l, 1.0f, b.stream());
    Fill(vc[l], DType::kF32, int64_t(cache_rows) * D, 2000 + l, 1.0f, b.stream());
    Fill(kc16[l], DType::kBF16, int64_t(cache_rows) * D, 3000 + l, 1.0f, b.stream());
    Fill(vc16[l], DType::kBF16, int64_t(cache_rows) * D, 4000 + l, 1.0f, b.stream());
  }
  float *x = Alloc(size_t(max_batch) * D), *xn = Alloc(size_t(max_batch) * D),
        *q = Alloc(size_t(max_batch) * D), *k = Alloc(size_t(max_batch) * D),
        *v = Alloc(size_t(max_batch) * D), *att = Alloc(size_t(max_batch) * D),
        *proj = Alloc(size_t(max_batch) * D), *h1 = Alloc(size_t(max_batch) * F),
        *h3 = Alloc(size_t(max_batch) * F), *logits = Alloc(size_t(max_batch) * V);

  // Per batch: fp32 cache without and with graphs, the bf16 cache with graphs, then both
  // caches with graphs and programmatic dependent launches (launch.h), then the fp32 cache
  // with graphs, PDL and split-KV's fused combine (SetSplitKvFusedCombine), then the fp32
  // cache with graphs and each RMSNorm and residual add a launch of its own (as the engine
  // ran them before 2026-12-04's fusion into the matvec), then the bf16 and the fp32 cache
  // with graphs and split-KV on tensor cores (SetSplitKvTensorCores), then the fp32 cache
  // with graphs and PDL but without the kernels' prefetches before their wait
  // (SetLaunchPrefetches), so that the PDL rows' gain can be told from the launches'. At
  // batch 1 also the fp32 cache with graphs and a vector added to the residual stream at
  // the middle layer each step (AddRows, as a steered request's steps do: recorded and
  // replayed since 2026-12-06, where before such a step ran without a graph).
  for (int batch : z.batches)
    for (int run = 0; run < (batch == 1 ? 11 : 10); ++run) {
      const bool graphs = run > 0;
      const bool steered = run == 10;
      const bool bf16_cache = run == 2 || run == 4 || run == 7;
      const bool pdl = (run >= 3 && run <= 5) || run == 9;
      const bool prefetches = run != 9;
      const bool fused_combine = run == 5;
      const bool fused_norms = run != 6;
      const bool tensor_cores = run == 7 || run == 8;
      b.SetSplitKvFusedCombine(fused_combine);
      b.SetSplitKvTensorCores(tensor_cores);
      const KvDtype cache_dtype = bf16_cache ? KvDtype::kBF16 : KvDtype::kActivation;
      const std::vector<float*>& kcs = bf16_cache ? kc16 : kc;
      const std::vector<float*>& vcs = bf16_cache ? vc16 : vc;
      b.SetCudaGraphs(graphs);
      b.SetProgrammaticLaunches(pdl);
      b.SetLaunchPrefetches(prefetches);
      std::vector<std::vector<int32_t>> tables(batch);
      for (int s = 0; s < batch; ++s) {
        tables[s].resize(blocks_per_seq);
        std::iota(tables[s].begin(), tables[s].end(), s * blocks_per_seq);
      }
      int pos = ctx;
      std::vector<int32_t> ids(batch, 1), positions(batch), picks(batch);
      std::vector<float> pick_logprobs(batch);
      const std::vector<TokenDraw> greedy(static_cast<size_t>(batch));  // temperature 0
      std::vector<int64_t> dst(batch);
      std::vector<AttentionArgs<float>> calls;
      const std::vector<float> steer_row(static_cast<size_t>(D), 0.01f);
      const std::vector<int32_t> steer_index(static_cast<size_t>(batch), 0);
      double host_sec = 0;
      // record_only: the layers' calls recorded and dropped (EndStep(false)), nothing run.
      auto step = [&](bool record_only = false) {
        for (int s = 0; s < batch; ++s) {
          positions[s] = pos;
          dst[s] = int64_t{tables[s][pos / bs]} * bs + pos % bs;
        }
        // The ops the engine's Transformer::Forward makes: the attention norm, q, k and v,
        // their rope and the cache rows in one RmsNormQkvRopeStoreKv, each residual added by the
        // product that makes it (MatMulAddTo), the feed-forward norm and SwiGLU's two products in
        // one RmsNormMatMulSwiGlu; the layers as one step (a CUDA graph when graphs are on), then
        // the logits and their greedy pick (DrawTokens), copied back as the engine's greedy
        // decode does (so every step ends synchronised; the host sampling path's whole-row
        // copy and the device's seeded draws are timed below). Without fused_norms: the
        // engine's ops before, a norm launch (with the residual's add) before each product
        // and RopeQKStoreKv after the products.
        const auto host_start = std::chrono::steady_clock::now();
        b.BeginStep();
        b.Embedding(embedding, ids.data(), batch, x);
        for (int l = 0; l < L; ++l) {
          const Layer& w = layers[l];
          if (steered && l == L / 2) {  // x is whole here: each product added its residual
            Must(b.AddRows(x, batch, D, steer_row.data(), 1, steer_index.data()), "steering");
          }
          const MatMulOutput<float> qkv[] = {
              {w.wq, WeightView{}, q}, {w.wk, WeightView{}, k}, {w.wv, WeightView{}, v}};
          const RopeSpec rope{10000.0, RopeStyle::kHalfSplit};
          if (fused_norms) {
            QkvRopeStore new_kv;
            new_kv.q_heads = new_kv.kv_heads = H;
            new_kv.head_dim = Dh;
            new_kv.positions = positions.data();
            new_kv.rope = &rope;
            new_kv.dst_rows = dst.data();
            new_kv.k_cache = kcs[l];
            new_kv.v_cache = vcs[l];
            new_kv.cache_stride = D;
            new_kv.cache_dtype = cache_dtype;
            b.RmsNormQkvRopeStoreKv(x, batch, D, w.attn_norm, 1e-5, xn, qkv, new_kv);
          } else {
            if (l == 0) {
              b.RmsNorm(x, batch, D, w.attn_norm, 1e-5, xn);
            } else {
              b.AddRmsNorm(x, proj, batch, D, w.attn_norm, 1e-5, xn);
            }
            b.MatMulMany(xn, batch, qkv);
            b.RopeQKStoreKv(q, D, H, k, v, D, H, batch, Dh, positions.data(), rope, dst.data(),
                            kcs[l], vcs[l], D, cache_dtype);
          }
          calls.clear();
          for (int s = 0; s < batch; ++s) {
            AttentionArgs<float>& a = calls.emplace_back();
            a.q = q + size_t(s) * D;
            a.q_stride = D;
            a.num_queries = 1;
            a.num_keys = pos + 1;
            a.query_offset = pos;
            a.num_heads = a.num_kv_heads = H;
            a.head_dim = Dh;
            a.scale = 1.0 / std::sqrt(double(Dh));
            a.kv = KvSource<float>{kcs[l], vcs[l], D, tables[s].data(), bs, cache_dtype};
            a.out = att + size_t(s) * D;
            a.out_stride = D;
          }
          int failed = 0;
          Must(b.AttentionBatch(calls, &failed), "attention");  // as the engine: one launch
          if (fused_norms) {
            b.MatMulAddTo(att, batch, w.wo, WeightView{}, proj, x);
            b.RmsNormMatMulSwiGlu(x, batch, D, w.ffn_norm, 1e-5, xn, w.w1, w.w3, h3, h1);
            b.MatMulAddTo(h1, batch, w.w2, WeightView{}, proj, x);
          } else {
            b.MatMul(att, batch, w.wo, WeightView{}, proj);
            b.AddRmsNorm(x, proj, batch, D, w.ffn_norm, 1e-5, xn);
            b.MatMulSwiGlu(xn, batch, w.w1, w.w3, h3, h1);
            b.MatMul(h1, batch, w.w2, WeightView{}, proj);
          }
        }
        if (!fused_norms) b.Add(x, proj, int64_t{batch} * D);
        // Host time making the layers' calls (with graphs: recording them, the GPU idle).
        host_sec +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count();
        if (record_only) {
          Must(b.EndStep(/*run=*/false), "dropping a recorded step");
          return;
        }
        Must(b.EndStep(/*run=*/true), "step");
        b.RmsNorm(x, batch, D, final_norm, 1e-5, xn);
        b.MatMul(xn, batch, output, WeightView{}, logits);
        Must(b.DrawTokens(logits, batch, V, greedy.data(), picks.data(), pick_logprobs.data(),
                          nullptr, nullptr),
             "greedy pick");
        ++pos;
      };
      step();  // a first step (with graphs: seen once, so the next one is captured)
      if (run == 1) {
        // The host's share of a graph-replayed step, alone: what the layers' calls cost to
        // record (a replayed step records them all before its one launch, the GPU idle).
        const StepGraph::Stats recorded = b.graph_stats();
        const int records = 200;
        const auto record_start = std::chrono::steady_clock::now();
        for (int i = 0; i < records; ++i) step(/*record_only=*/true);
        const double us =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - record_start).count() *
            1e6 / records;
        rows.Add({"recording a decode step (host, graphs)",
                  absl::StrFormat("%s, batch %d: %d launcher calls, %d signature words, %d KiB "
                                  "of recorded closures",
                                  z.model, batch, recorded.last_step_calls,
                                  recorded.last_step_words, recorded.arena_bytes >> 10),
                  absl::StrFormat("%.1f us/step (%.0f ns a call)", us,
                                  1e3 * us / std::max<int64_t>(recorded.last_step_calls, 1)),
                  "-", "-", "-"});
      }
      const int64_t copies_before = b.index_upload_stats().copies;
      const StepGraph::Stats graphs_before = b.graph_stats();
      host_sec = 0;
      const double sec = TimeIt(b, steps, step);  // steps + 1 calls (one warm-up: the capture)
      const double copies_per_step =
          double(b.index_upload_stats().copies - copies_before) / (steps + 1);
      const int64_t replayed = b.graph_stats().replays - graphs_before.replays;
      const double tok_s = batch / sec;
      // Every weight byte read once per step at the copy's DRAM rate (KV reads not counted).
      const double roofline = batch * copy_bw / double(streamed_bytes);
      // … and with each row's cache read too (K and V of every layer, at the steps' mean
      // context): at batch 64 and context 512 the fp32 cache's reads outweigh the weights.
      const double cache_bytes =
          double(batch) * (ctx + steps / 2.0) * L * 2.0 * D * KvElementBytes<float>(cache_dtype);
      const double full_roofline = batch * copy_bw / (double(streamed_bytes) + cache_bytes);
      rows.Add(
          {absl::StrCat("end-to-end decode (", z.model, ", bf16 weights",
                        bf16_cache ? ", bf16 KV cache)" : ")"),
           absl::StrFormat(
               "batch %d, context %d, %s%s, host %.0f us/step (%.1f%% of the step), %.0f index "
               "copies/step, %.0f%% of %.0f tok/s counting the cache's reads",
               batch, ctx,
               graphs ? absl::StrFormat("graphs (%d of %d steps replayed, %d launcher calls)",
                                        replayed, steps + 1, b.graph_stats().last_step_calls)
                      : std::string("no graphs"),
               std::string(pdl ? (prefetches ? ", PDL" : ", PDL without prefetches") : "") +
                   (fused_combine ? ", fused split-KV combine" : "") +
                   (fused_norms ? "" : ", norms, residual adds and rope unfused") +
                   (tensor_cores ? ", split-KV on tensor cores" : "") +
                   (steered ? ", steered at one layer (AddRows)" : ""),
               host_sec * 1e6 / (steps + 1), 100.0 * host_sec / (steps + 1) / sec, copies_per_step,
               100.0 * tok_s / full_roofline, full_roofline),
           Fmt(tok_s, "tok/s"), Fmt(roofline, "tok/s roofline"), Pct(tok_s / roofline),
           batch == 1 ? ">= 70%" : "-"});
      if (run == 5) {
        // What a step whose rows are sampled on the host adds instead of the pick: every
        // logits row copied to pageable host memory, as the Transformer does.
        std::vector<float> host_logits(size_t(batch) * V);
        const double copy_sec = TimeIt(b, 20, [&] {
          Must(b.memory().CopyToHost(host_logits.data(), logits, host_logits.size() * 4),
               "logits copy");
        });
        rows.Add({"logits to the host (host sampling's copy)",
                  absl::StrFormat("batch %d x %d floats, pageable memory", batch, V),
                  absl::StrFormat("%.0f us (%.1f GB/s)", copy_sec * 1e6,
                                  host_logits.size() * 4 / copy_sec / 1e9),
                  "-", "-", "-"});
        // A step of seeded draws (temperature 0.8, top-p 0.95) on the device, as the engine
        // runs them (CudaBackend::DrawTokens), against a copy of the rows plus DrawRows on
        // the host (one thread; the engine spreads a step's rows over up to 8): plain, with
        // repetition, frequency and presence penalties over 1000 counted tokens a row, and
        // those on Llama 3's 128256-token vocabulary (past the shared-memory rows: adjusted
        // rows in global scratch; Gaussian logits, sigma 3); then a scored prompt's rows
        // (prompt_logprobs: each row's next token forced, with its top 5). The tokens must
        // agree.
        std::vector<std::pair<int32_t, int32_t>> counts;
        for (int32_t i = 0; i < 1000; ++i) counts.push_back({(i * 7919) % V, 1 + i % 5});
        std::vector<float> big_host(static_cast<size_t>(batch) * z.big_vocab);
        {
          std::mt19937 rng(3);
          std::normal_distribution<float> normal(0.0f, 3.0f);
          for (float& l : big_host) l = normal(rng);
        }
        float* big = Alloc(big_host.size());
        // On the backend's stream, so its draws come after the copy.
        Must(b.memory().CopyFromHost(big, big_host.data(), big_host.size() * 4),
             "large-vocabulary logits upload");
        std::vector<int32_t> top_token(static_cast<size_t>(batch) * kMaxTopLogprobs);
        std::vector<float> top_logprob(top_token.size());
        for (int kind = 0; kind < 4; ++kind) {
          const int vocab = kind == 2 ? z.big_vocab : V;
          const float* rows_dev = kind == 2 ? big : logits;
          std::vector<TokenDraw> draws(static_cast<size_t>(batch));
          for (int s = 0; s < batch; ++s) {
            draws[s].temperature = 0.8;
            draws[s].top_p = 0.95;
            draws[s].u01 = (s + 0.5) / batch;
            if (kind == 3) {
              draws[s].forced_token = (s * 7919) % V;
              draws[s].top_logprobs = 5;
            } else if (kind > 0) {
              draws[s].repetition_penalty = 1.1;
              draws[s].frequency_penalty = 0.2;
              draws[s].presence_penalty = 0.1;
              draws[s].token_counts = counts;
            }
          }
          std::vector<float> rows_host(static_cast<size_t>(batch) * vocab);
          const double rows_copy_sec = TimeIt(b, 20, [&] {
            Must(b.memory().CopyToHost(rows_host.data(), rows_dev, rows_host.size() * 4),
                 "logits copy");
          });
          const double draw_sec = TimeIt(b, 20, [&] {
            Must(b.DrawTokens(rows_dev, batch, vocab, draws.data(), picks.data(),
                              pick_logprobs.data(), top_token.data(), top_logprob.data()),
                 "draw");
          });
          std::vector<int32_t> host_picks(static_cast<size_t>(batch));
          std::vector<float> host_logprobs(static_cast<size_t>(batch));
          std::vector<int32_t> host_top(top_token.size());
          std::vector<float> host_top_lp(top_token.size());
          constexpr int kHostReps = 3;
          const auto host_start = std::chrono::steady_clock::now();
          for (int i = 0; i < kHostReps; ++i) {
            DrawRows(rows_host.data(), batch, vocab, draws.data(), host_picks.data(),
                     host_logprobs.data(), host_top.data(), host_top_lp.data());
          }
          const double host_draw_sec =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count() /
              kHostReps;
          int differ = 0;
          for (int s = 0; s < batch; ++s) differ += picks[s] != host_picks[s] ? 1 : 0;
          for (int s = 0; kind == 3 && s < batch; ++s) {  // (and their top tokens)
            for (int t = 0; t < 5; ++t) {
              const size_t at = static_cast<size_t>(s) * kMaxTopLogprobs + t;
              differ += top_token[at] != host_top[at] ? 1 : 0;
            }
          }
          const char* what[4] = {"token draws on the device (T 0.8, top-p 0.95)",
                                 "token draws on the device, with penalties",
                                 "token draws on the device, penalties, large vocabulary",
                                 "prompt scoring on the device (forced tokens, top 5)"};
          const char* detail[4] = {"", ", 1000 tokens counted", ", 1000 tokens counted", ""};
          rows.Add(
              {what[kind],
               absl::StrFormat("batch %d x %d, one block a row%s; %d of %d tokens differ "
                               "from the host's",
                               batch, vocab, detail[kind], differ, kind == 3 ? 6 * batch : batch),
               absl::StrFormat("%.0f us", draw_sec * 1e6),
               absl::StrFormat("%.0f us copy + %.0f us host draws (1 thread)", rows_copy_sec * 1e6,
                               host_draw_sec * 1e6),
               absl::StrFormat("%.1fx", (rows_copy_sec + host_draw_sec) / draw_sec), "-"});
          if (differ > 0) std::printf("warning: %d device draws differ from the host's\n", differ);
        }
        GC_CUDA(cudaFree(big));
      }
    }
  b.SetCudaGraphs(true);
  b.SetProgrammaticLaunches(false);
  b.SetLaunchPrefetches(true);
  b.SetSplitKvFusedCombine(false);
  b.SetSplitKvTensorCores(false);
  for (const std::vector<float*>* c : {&kc, &vc, &kc16, &vc16}) {
    for (float* p : *c) cudaFree(p);
  }
  for (float* p : {x, xn, q, k, v, att, proj, h1, h3, logits}) cudaFree(p);
}

// The attention tuner (the server's --attention-tune) at the decode benchmark's heads on a
// bf16 and an fp32 cache, decoding one sequence and the end-to-end benchmark's largest
// batch (the server's default --max-running is 64): each candidate's time at each against
// the default's, its agreement, and which it keeps. The backend's defaults are restored
// after.
void TuneBench(CudaBackend& b, const Sizes& z, Table& rows) {
  for (KvDtype cache : {KvDtype::kBF16, KvDtype::kActivation}) {
    AttentionTuneShape shape;
    shape.num_heads = z.decode_heads;
    shape.num_kv_heads = z.decode_kv_heads;
    shape.head_dim = z.decode_dh;
    shape.cache_dtype = cache;
    shape.block_size = z.decode_block;
    shape.prefill_tokens = z.prefill_tokens.front();
    shape.decode_keys = z.decode_keys.front();
    if (z.batches.back() > 1) shape.decode_batches = {1, z.batches.back()};
    absl::StatusOr<AttentionTuneReport> r = TuneAttention(b, shape);
    Must(r.status(), "attention tuning");
    const char* what =
        cache == KvDtype::kBF16 ? "attention tuning (bf16 cache)" : "attention tuning (fp32 cache)";
    const std::string heads =
        absl::StrCat(" H=", shape.num_heads, "/", shape.num_kv_heads, " Dh=", shape.head_dim, ": ");
    for (const auto& [phase, list] :
         {std::pair{absl::StrCat("prefill T=", shape.prefill_tokens), &r->prefill},
          std::pair{absl::StrCat("decode Tk=", shape.decode_keys, " batch ",
                                 absl::StrJoin(shape.decode_batches, " / ")),
                    &r->decode}}) {
      const std::vector<double> relative = RelativeTimes(*list);
      for (size_t i = 0; i < list->size(); ++i) {
        const TunedCandidate& c = (*list)[i];
        rows.Add({what, absl::StrCat(phase, heads, c.name),
                  c.failure.empty() ? absl::StrCat(c.Microseconds(), " us") : c.failure,
                  absl::StrFormat("err %.2g of %.2g", c.max_error, c.tolerance),
                  absl::StrFormat("%.2fx the default's time", relative[i]),
                  c.chosen ? "chosen" : (c.accepted() ? "-" : "rejected")});
      }
    }
    Must(b.SetAttentionKernels(AttentionKernels{}), "restoring the default attention kernels");
  }
}

int Main(int argc, char** argv) {
  bool parity_only = false;
  std::set<std::string> only;
  Sizes sizes;
  SdpaReference sdpa;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--parity-only") == 0) {
      parity_only = true;
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      sizes = QuickSizes();
    } else if (std::strcmp(argv[i], "--smoke") == 0) {
      sizes = SmokeSizes();
      g_repetitions = Repetitions{.max_iters = 2, .graph_calls = 2, .replays = 1};
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc &&
               std::set<std::string>{"prefill", "decode", "tune", "matmul", "e2e"}.count(
                   argv[i + 1])) {
      only.insert(argv[++i]);
    } else if (std::strcmp(argv[i], "--sdpa") == 0 && i + 1 < argc) {
      sdpa = ReadSdpa(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--parity-only] [--quick | --smoke] [--sdpa FILE] "
                   "[--only prefill|decode|tune|matmul|e2e ...]\n",
                   argv[0]);
      return 64;
    }
  }
  absl::StatusOr<std::unique_ptr<CudaBackend>> created = CudaBackend::Create(0);
  if (!created.ok()) {
    std::fprintf(stderr, "kvlens_gpu_check: %s\n", std::string(created.status().message()).c_str());
    return 2;
  }
  CudaBackend& b = **created;
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / double(1 << 30));

  Table rows;
  int failures = 0;
  const auto run = [&only](const char* name) { return only.empty() || only.count(name) > 0; };
  for (const parity::ParityResult& r :
       only.empty() ? parity::RunParitySuite(b) : std::vector<parity::ParityResult>{}) {
    const bool ok = r.pass();
    failures += ok ? 0 : 1;
    rows.Add({"parity", r.name,
              r.status.ok() ? absl::StrFormat("err %.3g", r.err) : std::string(r.status.message()),
              absl::StrFormat("naive err %.3g", r.naive_err), ok ? "PASS" : "FAIL",
              absl::StrFormat("<= %.3g", r.tol)});
  }
  if (!parity_only) {
    const double copy_bw = CopyBandwidth(b, sizes.copy_bytes);
    rows.Add({"device-to-device copy", absl::StrCat(sizes.copy_bytes >> 20, " MiB"),
              Fmt(copy_bw / 1e9, "GB/s"), "-", "-", "-"});
    if (run("prefill")) PrefillBench(b, sdpa, sizes, rows);
    if (run("decode")) DecodeAttentionBench(b, copy_bw, sizes, rows);
    if (run("tune")) TuneBench(b, sizes, rows);
    if (run("matmul")) MatMulBench(b, copy_bw, sizes, rows);
    if (run("e2e")) EndToEndBench(b, copy_bw, sizes, rows);
  }
  PrintTable(rows.rows());
  std::printf("parity: %d case(s) failed\n", failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvlens::kernels::cuda

int main(int argc, char** argv) { return kvlens::kernels::cuda::Main(argc, argv); }
