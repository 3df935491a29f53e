// Engine: the continuous-batching core. Thread-safe Submit / Cancel from any thread; one
// step thread runs the scheduler and the model.
//
//   Submit ─▶ waiting queue ─▶ scheduler step ─▶ Transformer::Forward(batch) ─▶ sample
//                  ▲                │  decode tokens of all running sequences
//                  └── preempted ◀──┘  + prefill chunks of waiting ones, under a token budget
//
// Every step batches the decode tokens of all running sequences with chunks of pending
// prefills; there is no separate prefill phase. A request that can never fit (prompt +
// max_new_tokens beyond the context or the whole cache) is rejected at Submit; one that
// cannot fit now waits; running sequences are preempted (blocks freed, recomputed later)
// when decode needs blocks that are not there.
//
// A step that runs out of device memory (RESOURCE_EXHAUSTED from the forward: a buffer
// or workspace that did not grow) loses nothing: its sequences run again from where they
// were, under a step token budget of half its tokens (fewer sequences, shorter prompt
// chunks), which doubles back towards max_batch_tokens after every kStepsToRegrow steps
// that run. A
// lone token runs again once; if it runs out twice it fails its request with the
// allocation's error.
#ifndef KVLENS_ENGINE_ENGINE_H_
#define KVLENS_ENGINE_ENGINE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/model.h"
#include "engine/request.h"
#include "kernels/backend.h"

namespace kvlens {

struct EngineOptions {
  int num_blocks = 1024;  // KV-cache capacity in blocks
  int block_size = 16;    // tokens per block
  // The cache's element type: the activation type (float), or bf16 at half the bytes
  // (kernels/kv_dtype.h); num_blocks is the same either way.
  kernels::KvDtype kv_cache_dtype = kernels::KvDtype::kActivation;
  int max_batch_tokens = 512;  // token budget of one step (decode + prefill chunks)
  int max_running = 64;        // sequences decoding at once
  int max_waiting = 256;       // queue limit; beyond it Submit is RESOURCE_EXHAUSTED
  int max_sessions = 64;
  bool prefix_caching = true;
  // With a sliding window (ModelConfig::sliding_window), a sequence gives its blocks back
  // to the pool as they fall wholly out of the window of every query still to come (to
  // the prefix cache, when they are hashed), as vLLM does: its live blocks stay about a
  // window plus a step's chunk, however long it runs. Sessions keep every block (their
  // cached-KV probes read the whole history).
  bool release_out_of_window_blocks = true;
  // Threads that sample a step's rows (log-softmax, penalties, top-k/p, draw: ~0.2–1 ms a
  // row at a 32000-token vocabulary, which a GPU step of 64 rows would otherwise wait on).
  // 0: min(8, cores); 1: the step thread alone. Results do not depend on it.
  int sampling_threads = 0;
};

// What the engine reports to whoever watches it (metrics); called on the step thread.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  struct StepStats {
    int batch_tokens = 0;
    int running = 0;
    int waiting = 0;
    int blocks_used = 0;    // referenced by live sequences or sessions
    int blocks_cached = 0;  // unreferenced but holding a reusable prefix
    int blocks_free = 0;
  };
  virtual void OnStep(const StepStats& stats) = 0;
  virtual void OnPreemption() = 0;
  // A prompt's lookup in the prefix cache: tokens looked up, tokens found.
  virtual void OnPrefixLookup(int queried_tokens, int hit_tokens) = 0;
  // A step that ran out of device memory (see Engine above), before its next step.
  struct OutOfMemory {
    int batch_tokens = 0;         // the step's tokens
    int step_token_limit = 0;     // the budget of the steps after it
    bool request_failed = false;  // a lone token that ran out twice: its request failed
    absl::Status status;          // the allocation's error
  };
  virtual void OnOutOfMemory(const OutOfMemory&) {}
};

struct EngineStats {
  int running = 0;
  int waiting = 0;
  int blocks_used = 0;
  int blocks_cached = 0;
  int blocks_free = 0;
  int num_blocks = 0;
  int sessions = 0;
  // A step's token budget now: max_batch_tokens, less after steps that ran out of device
  // memory (steps_out_of_memory of them so far; the Engine comment says how it recovers).
  int step_token_limit = 0;
  int64_t steps_out_of_memory = 0;
};

class Engine {
 public:
  // The KV cache and activations live in backend.memory() (host for the CPU backends,
  // the GPU for CUDA). If the cache cannot be allocated there, status() says why and
  // Submit, OpenSession and ReadSession return that status.
  Engine(const Model& model, kernels::Backend<float>& backend, EngineOptions options,
         EngineObserver* observer = nullptr);
  // Steps that run, after a step ran out of device memory, before the step token budget
  // doubles back towards max_batch_tokens: at a size that keeps running out, at most one
  // step in this many is wasted.
  static constexpr int kStepsToRegrow = 32;
  ~Engine();  // stops the step thread; unfinished requests finish kCancelled
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues. INVALID_ARGUMENT naming the field (empty prompt, token id out
  // of range, sampling fields, top_logprobs, unknown session); OUT_OF_RANGE when prompt +
  // max_new_tokens exceeds the context; RESOURCE_EXHAUSTED naming the limit when the
  // request can never fit in the cache or the waiting queue is full; UNAVAILABLE after
  // Shutdown.
  absl::StatusOr<RequestId> Submit(GenerationRequest request);
  // OK once the engine holds its KV cache; else the allocation's failure.
  absl::Status status() const;
  // Finishes the request with kCancelled and frees its blocks (no-op when already done).
  void Cancel(RequestId id);

  // Sessions keep a conversation's tokens and KV blocks between requests: a request on a
  // session prefills only its new tokens, from the session's query offset.
  absl::StatusOr<SessionId> OpenSession();
  absl::Status CloseSession(SessionId id);  // NOT_FOUND for unknown; frees its blocks

  // Interpretability on the live cache: what an idle session holds.
  struct SessionView {
    absl::Span<const int32_t> tokens;       // every token so far (the last may be uncached)
    int num_cached = 0;                     // tokens[0, num_cached) have K/V in `cache`
    absl::Span<const int32_t> block_table;  // covers num_cached tokens
    // In the engine backend's memory: read it with cache->CopyRowsToHost (k()/v() are
    // device pointers under CUDA).
    const KvCacheStorage<float>* cache = nullptr;
  };
  // Calls fn(view) on the caller's thread with the session held: while fn runs, a Submit
  // or CloseSession on it fails as "in flight", so its blocks are neither written nor
  // freed (other sequences never write them either; the step thread keeps running).
  // NOT_FOUND for an unknown session; FAILED_PRECONDITION while a request runs on it.
  absl::Status ReadSession(SessionId id, const std::function<void(const SessionView&)>& fn);

  // Stops admitting (Submit → UNAVAILABLE); waits up to `drain` for running requests to
  // finish, then cancels the rest. Idempotent.
  void Shutdown(std::chrono::milliseconds drain);

  EngineStats Stats() const;
  const Model& model() const { return model_; }
  const EngineOptions& options() const { return options_; }

 private:
  struct Impl;
  const Model& model_;
  EngineOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_ENGINE_H_
