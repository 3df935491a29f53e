#include "kernels/cuda/step_graph.h"

#include <algorithm>

#include "kernels/cuda/cuda_status.h"

namespace kvlens::kernels::cuda {

void AppendWords(Signature& s, const RopeSpec& r) {
  AppendWords(s, r.theta);
  AppendWords(s, r.style);
  AppendWords(s, r.freq_factors);
}

void AppendWords(Signature& s, const AttentionParams& p) {
  // Every field: a graph is replayed only when all of them are equal.
  AppendWords(s, p.q);
  AppendWords(s, p.q_stride);
  AppendWords(s, p.k);
  AppendWords(s, p.v);
  AppendWords(s, p.kv_row_stride);
  AppendWords(s, p.kv_dtype);
  AppendWords(s, p.block_table);
  AppendWords(s, p.block_size);
  AppendWords(s, p.q_doc);
  AppendWords(s, p.k_doc);
  AppendWords(s, p.out);
  AppendWords(s, p.out_stride);
  AppendWords(s, p.num_queries);
  AppendWords(s, p.num_keys);
  AppendWords(s, p.num_heads);
  AppendWords(s, p.num_kv_heads);
  AppendWords(s, p.head_dim);
  AppendWords(s, p.query_offset);
  AppendWords(s, p.causal);
  AppendWords(s, p.window);
  AppendWords(s, p.scale);
  AppendWords(s, p.softcap);
  AppendWords(s, p.row_key_end);
  AppendWords(s, p.row_table_offset);
  AppendWords(s, p.flash_tiles);
  AppendWords(s, p.num_flash_tiles);
  AppendWords(s, p.flash_head_group);
  AppendWords(s, p.prefetch);
}

void AppendWords(Signature& s, const MatVecProduct& p) {
  AppendWords(s, p.w);
  AppendWords(s, p.out);
  AppendWords(s, p.bias);
  AppendWords(s, p.bias_dtype);
  AppendWords(s, p.y);
  AppendWords(s, p.gelu);
  AppendWords(s, p.accumulate);
}

void AppendWords(Signature& s, const MatVecRopeStore& r) {
  AppendWords(s, r.positions);
  AppendWords(s, r.rope);
  AppendWords(s, r.head_dim);
  AppendWords(s, r.dst_rows);
  AppendWords(s, r.k_cache);
  AppendWords(s, r.v_cache);
  AppendWords(s, r.cache_stride);
  AppendWords(s, r.bf16_cache);
}

void AppendWords(Signature& s, const FlashBf16Layout& l) {
  AppendWords(s, l.tile_queries);
  AppendWords(s, l.warp_queries);
  AppendWords(s, l.stages);
  AppendWords(s, l.key_tile);
}

void AppendWords(Signature& s, const MatVecNorm& n) {
  AppendWords(s, n.weight);
  AppendWords(s, n.dtype);
  AppendWords(s, n.eps);
}

namespace {

// FNV-1a-like over the words in four interleaved lanes: one lane's chain of dependent
// multiplies took 6.2 us for a 7B-shaped decode step's 3763 words on this project's 2-core
// machine (g++ -O3), four lanes 2.0 (comparing the words with a stored step's: 0.6).
uint64_t Hash(const Signature& s) {
  constexpr uint64_t kBasis = 1469598103934665603ull, kPrime = 1099511628211ull;
  auto mix = [](uint64_t& h, uint64_t w) {
    h ^= w;
    h *= kPrime;
    h ^= h >> 29;
  };
  uint64_t lane[4] = {kBasis, kBasis + 1, kBasis + 2, kBasis + 3};
  const size_t n = s.size();
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) mix(lane[k], s[i + k]);
  }
  for (; i < n; ++i) mix(lane[0], s[i]);
  uint64_t h = n;
  for (uint64_t l : lane) mix(h, l);
  return h;
}

}  // namespace

void* StepArena::Allocate(size_t bytes, size_t align) {
  for (;; ++chunk_, used_ = 0) {
    if (chunk_ == chunks_.size()) {
      // 64 KiB: a 7B-shaped decode step's closures take 27 KiB (164 calls; 32 KiB with
      // its norms, residual adds and rope unfused).
      Chunk c;
      c.bytes = std::max<size_t>(size_t{64} << 10, bytes + align);
      c.data = std::make_unique<std::byte[]>(c.bytes);
      chunks_.push_back(std::move(c));
    }
    Chunk& c = chunks_[chunk_];
    const uintptr_t base = reinterpret_cast<uintptr_t>(c.data.get());
    const size_t offset = ((base + used_ + align - 1) & ~(uintptr_t{align} - 1)) - base;
    if (offset + bytes <= c.bytes) {
      used_ = offset + bytes;
      return c.data.get() + offset;
    }
  }
}

void StepArena::Reset() {
  chunk_ = 0;
  used_ = 0;
}

size_t StepArena::capacity() const {
  size_t n = 0;
  for (const Chunk& c : chunks_) n += c.bytes;
  return n;
}

StepGraph::StepGraph(int max_graphs, int max_signatures)
    : max_graphs_(std::max(max_graphs, 1)), max_signatures_(std::max(max_signatures, 1)) {}

StepGraph::~StepGraph() { Clear(); }

void StepGraph::Begin() {
  Drop();
  recording_ = true;
}

void StepGraph::Drop() {
  recording_ = false;
  signature_.clear();
  launches_.clear();
  first_ = 0;
  arena_.Reset();
}

void StepGraph::Clear() {
  Drop();
  for (auto& [hash, e] : entries_) {
    // An executable graph still running is freed when it completes.
    if (e.exec != nullptr) cudaGraphExecDestroy(e.exec);
  }
  entries_.clear();
}

int64_t StepGraph::NumGraphs() const {
  int64_t n = 0;
  for (const auto& [hash, e] : entries_) n += e.exec != nullptr ? 1 : 0;
  return n;
}

StepGraph::Stats StepGraph::stats() const {
  Stats s = stats_;
  s.graphs = NumGraphs();
  s.arena_bytes = static_cast<int64_t>(arena_.capacity());
  return s;
}

absl::Status StepGraph::RunEagerly(cudaStream_t stream) {
  ++stats_.eager;
  for (const Launch& launch : launches_) {
    if (absl::Status s = launch(stream); !s.ok()) return s;
  }
  return absl::OkStatus();
}

bool StepGraph::Capture(cudaStream_t stream, Entry& entry) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  bool ok = true;
  for (const Launch& launch : launches_) {
    if (!launch(stream).ok()) {
      ok = false;
      break;
    }
  }
  cudaGraph_t graph = nullptr;
  if (cudaStreamEndCapture(stream, &graph) != cudaSuccess) ok = false;
  if (ok && graph != nullptr && cudaGraphInstantiate(&entry.exec, graph, 0) != cudaSuccess) {
    entry.exec = nullptr;
    ok = false;
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!ok) {
    cudaGetLastError();  // capture errors are not sticky; clear the last error
    if (entry.exec != nullptr) cudaGraphExecDestroy(entry.exec);
    entry.exec = nullptr;
  }
  return ok && entry.exec != nullptr;
}

void StepGraph::Evict() {
  // Forget the least recently used signatures past max_signatures_, and destroy the least
  // recently used graphs past max_graphs_.
  auto oldest = [&](bool with_graph) {
    auto best = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (with_graph && it->second.exec == nullptr) continue;
      if (best == entries_.end() || it->second.last_use < best->second.last_use) best = it;
    }
    return best;
  };
  while (static_cast<int>(entries_.size()) > max_signatures_) {
    auto it = oldest(false);
    if (it->second.exec != nullptr) cudaGraphExecDestroy(it->second.exec);
    entries_.erase(it);
  }
  while (NumGraphs() > max_graphs_) {
    auto it = oldest(true);
    cudaGraphExecDestroy(it->second.exec);
    it->second.exec = nullptr;
  }
}

absl::Status StepGraph::End(cudaStream_t stream, std::mutex* capture_mutex) {
  if (!recording_) return absl::OkStatus();
  recording_ = false;
  ++stats_.steps;
  stats_.last_step_calls = static_cast<int64_t>(launches_.size());
  stats_.last_step_words = static_cast<int64_t>(signature_.size());
  // A decode step is most often the one before it again: compare with that step's signature
  // (a memcmp) before hashing this one. Each entry is held under its own signature's hash.
  auto it = entries_.find(last_hash_);
  uint64_t hash = last_hash_;
  if (it == entries_.end() || it->second.signature != signature_) {
    hash = Hash(signature_);
    it = entries_.find(hash);
  }
  last_hash_ = hash;
  absl::Status status;
  if (it == entries_.end() || it->second.signature != signature_) {
    // First sighting (or a hash collision, which replaces the older step): run it.
    Entry& e = entries_[hash];
    if (e.exec != nullptr) cudaGraphExecDestroy(e.exec);
    e = Entry();
    e.signature = signature_;
    e.last_use = stats_.steps;
    status = RunEagerly(stream);
  } else {
    Entry& e = it->second;
    e.last_use = stats_.steps;
    if (e.exec == nullptr && e.capturable) {
      std::unique_lock<std::mutex> lock;
      if (capture_mutex != nullptr) lock = std::unique_lock<std::mutex>(*capture_mutex);
      if (Capture(stream, e)) {
        ++stats_.captures;
      } else {
        ++stats_.capture_failures;
        e.capturable = false;
      }
    }
    if (e.exec != nullptr) {
      status = CudaStatus(cudaGraphLaunch(e.exec, stream), "cudaGraphLaunch", __FILE__, __LINE__);
      if (status.ok()) ++stats_.replays;
    } else {
      status = RunEagerly(stream);
    }
  }
  Drop();  // the recording, run or replayed, is let go as a dropped one is
  Evict();
  return status;
}

}  // namespace kvlens::kernels::cuda
