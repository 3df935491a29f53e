// Engine (engine.h): Submit, Cancel, sessions and Shutdown on the callers' threads, and
// the step thread's loop: cancellations, scheduling under the token budget (with
// preemption, the prefix cache and the budget's halving after a step that ran out of
// device memory), one Transformer::Forward, sampling, and streaming and finishing each
// request. One file past 800 lines because every part reads and writes Impl's queues and
// block pool on the step thread; what stands alone is already elsewhere (BlockPool,
// Sampler, StopMatcher, prompt_logprobs, Transformer).
#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/kv_cache/block_pool.h"
#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/transformer.h"
#include "engine/prompt_logprobs.h"
#include "engine/stop_matcher.h"
#include "engine/tokenizer/tokenizer.h"
#include "kernels/cpu/thread_pool.h"

namespace kvlens {
namespace {

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Whether a request's blocks go back to the pool as they leave the model's sliding window
// (EngineOptions::release_out_of_window_blocks; never a session's; not when some layer
// sees the whole context, as Gemma 3's every sixth does).
bool ReleasesOutOfWindow(const ModelConfig& c, const EngineOptions& o, SessionId session) {
  return c.CommonWindow() > 0 && o.release_out_of_window_blocks && session == 0;
}

}  // namespace

// One request in flight. Invariant (vLLM's): tokens[0, num_computed) have keys/values in
// the cache at `blocks`; a step computes tokens[num_computed, num_computed + n); when it
// reaches tokens.size() the logits of the last token give the next token.
struct Sequence {
  RequestId id = 0;
  GenerationRequest request;
  std::vector<int32_t> tokens;  // session history + prompt + generated
  int num_prompt = 0;           // tokens before the first generated one
  int num_computed = 0;
  int num_generated = 0;
  int num_cached_prompt = 0;  // prompt tokens found cached (prefix cache or session)
  int num_hashed_blocks = 0;  // leading full blocks registered in the prefix cache
  BlockHash last_hash = 0;    // hash of block num_hashed_blocks − 1
  std::vector<BlockId> blocks;
  // Leading blocks given back as they left the sliding window (ReleaseOutOfWindow): their
  // entries of `blocks` alias the first live block, whose own reference they do not hold.
  int num_released_blocks = 0;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<IncrementalDecoder> decoder;
  StopMatcher stop_matcher;
  bool prefix_looked_up = false;
  // With prompt_logprobs: the logits rows of positions 0 … num_prompt_scored − 1 were
  // scored and their events sent (a preempted sequence recomputes them, sending none).
  int num_prompt_scored = 0;
  // With min_new_tokens: the logit bias of the draws before it (the stopping tokens −∞).
  std::vector<std::pair<int32_t, float>> early_bias;
  Clock::time_point arrival, scheduled, prompt_done, first_token, last_token;
  bool was_scheduled = false;
};

struct Session {
  std::vector<int32_t> tokens;
  std::vector<BlockId> blocks;
  int num_computed = 0;
  bool busy = false;
};

struct Engine::Impl {
  Impl(const Model& m, kernels::Backend<float>& b, const EngineOptions& o, EngineObserver* obs)
      : model(m),
        options(o),
        observer(obs),
        pool(o.num_blocks),
        transformer(m, b),
        step_token_limit(o.max_batch_tokens) {
    // In the backend's memory: host for the CPU backends, the GPU for CUDA.
    auto c =
        KvCacheStorage<float>::Create(b.memory(), m.config.num_layers, o.num_blocks, o.block_size,
                                      m.config.kv_dim(), /*fill_nan=*/false, o.kv_cache_dtype);
    if (c.ok()) {
      cache = std::make_unique<KvCacheStorage<float>>(*std::move(c));
    } else {
      init_status = c.status();
    }
    int threads = o.sampling_threads;
    if (threads <= 0) {
      threads = std::min(8, std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
    }
    if (threads > 1) sampling_pool = std::make_unique<kernels::ThreadPool>(threads);
  }

  // --- step thread only ---
  void Loop();
  void Step();
  bool EnsureBlocks(Sequence& s, int num_tokens);
  void FreeBlocks(Sequence& s);
  void ReleaseBlocks(Sequence& s);
  void ReleaseOutOfWindow(Sequence& s);
  void Preempt(Sequence& s);
  void RegisterFullBlocks(Sequence& s);
  void LookupPrefix(Sequence& s);
  TokenEvent AfterForward(Sequence& s, RowSample sampled);
  // The prompt rows of a step's chunk that a prompt_logprobs request scores: positions
  // [begin, end) of the chunk [num_computed, num_computed + n), end ≤ num_prompt − 1.
  std::pair<int, int> RowsToScore(const Sequence& s, int n) const;
  void FillAttentionRow(const Sequence& s, const std::vector<std::vector<float>>& probs,
                        TokenEvent& ev) const;
  void Finish(std::unique_ptr<Sequence> s, FinishReason reason, absl::Status status = {});
  void ReturnToSession(Sequence& s);
  EngineObserver::StepStats CurrentStats() const;

  const Model& model;
  const EngineOptions options;
  EngineObserver* observer;
  BlockPool pool;
  std::unique_ptr<KvCacheStorage<float>> cache;  // null when init_status is not OK
  absl::Status init_status;                      // the cache allocation's failure
  Transformer<float> transformer;
  std::vector<std::unique_ptr<Sequence>> running;  // admission order
  std::deque<std::unique_ptr<Sequence>> waiting;   // step thread's queue (preempted first)
  ForwardOutput<float> out;
  std::unique_ptr<kernels::ThreadPool> sampling_pool;  // null: sample on the step thread
  // The token budget of a step: max_batch_tokens, halved by each step that runs out of
  // device memory (Step) and doubled back after every Engine::kStepsToRegrow steps that run.
  int step_token_limit;
  int steps_since_out_of_memory = 0;
  bool last_step_ran_out = false;
  int64_t steps_out_of_memory = 0;

  // --- shared, under mu ---
  mutable std::mutex mu;
  std::condition_variable cv;       // wakes the step thread
  std::condition_variable drained;  // running + waiting became empty
  std::deque<std::unique_ptr<Sequence>> incoming;
  std::vector<RequestId> cancelled;
  absl::flat_hash_map<SessionId, Session> sessions;
  std::vector<BlockId> blocks_to_release;  // from closed sessions
  int64_t in_flight = 0;                   // submitted and not finished
  RequestId next_id = 1;
  SessionId next_session = 1;
  bool accepting = true;
  bool stop = false;
  EngineStats stats;
  std::thread thread;
};

Engine::Engine(const Model& model, kernels::Backend<float>& backend, EngineOptions options,
               EngineObserver* observer)
    : model_(model), options_(options) {
  impl_ = std::make_unique<Impl>(model, backend, options, observer);
  impl_->stats.num_blocks = options.num_blocks;
  impl_->stats.blocks_free = options.num_blocks;
  impl_->stats.step_token_limit = options.max_batch_tokens;
  impl_->thread = std::thread([this] { impl_->Loop(); });
}

Engine::~Engine() {
  Shutdown(std::chrono::milliseconds(0));
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
}

absl::Status Engine::status() const { return impl_->init_status; }

absl::StatusOr<RequestId> Engine::Submit(GenerationRequest request) {
  if (!impl_->init_status.ok()) return impl_->init_status;
  const ModelConfig& c = model_.config;
  if (model_.tokenizer == nullptr) {
    return absl::FailedPreconditionError("the model has no tokenizer; the engine needs one");
  }
  if (absl::Status s = request.Validate(c.vocab_size); !s.ok()) return s;

  auto seq = std::make_unique<Sequence>();
  seq->arrival = Clock::now();
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->accepting) return absl::UnavailableError("the engine is shutting down");
  size_t history = 0;
  if (request.session != 0) {
    auto it = impl_->sessions.find(request.session);
    if (it == impl_->sessions.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("session_id ", request.session, " is not an open session"));
    }
    if (it->second.busy) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", request.session, " already has a request in flight"));
    }
    history = it->second.tokens.size();
  }
  if (absl::Status s = request.attention_rows.Validate(c.num_layers, c.num_heads); !s.ok()) {
    return s;
  }
  if (!request.steering.empty() && request.session != 0) {
    return absl::InvalidArgumentError(
        "steering: not with a session (its earlier tokens were computed unsteered)");
  }
  if (absl::Status s = CheckResidualAdds(request.steering, c, "steering"); !s.ok()) return s;
  if (request.prompt_logprobs >= 0 && request.session != 0) {
    return absl::InvalidArgumentError(
        "prompt_logprobs: not with a session (its history's logits are gone)");
  }
  const int64_t used = static_cast<int64_t>(history + request.prompt.size());
  if (request.stop.max_new_tokens == 0) {  // as many as the context leaves
    if (used >= c.max_seq_len) {
      return absl::OutOfRangeError(absl::StrCat("the prompt (", used,
                                                " tokens with the session history) fills the "
                                                "context length ",
                                                c.max_seq_len));
    }
    request.stop.max_new_tokens = static_cast<int>(c.max_seq_len - used);
    if (absl::Status s = request.stop.Validate(); !s.ok()) return s;  // min_new_tokens
  }
  const int64_t total = used + request.stop.max_new_tokens;
  if (total > c.max_seq_len) {
    return absl::OutOfRangeError(absl::StrCat(
        history > 0 ? absl::StrCat("session history (", history, " tokens) + ") : "", "prompt (",
        request.prompt.size(), " tokens) + max_new_tokens (", request.stop.max_new_tokens,
        ") = ", total, " exceeds the context length ", c.max_seq_len));
  }
  // Tokens whose blocks the request holds at once: all of them, or under a sliding window
  // whose blocks are released (ReleaseOutOfWindow) at most a window, a step's chunk and a
  // block either side.
  int64_t live = total;
  if (ReleasesOutOfWindow(c, options_, request.session)) {
    live = std::min<int64_t>(total, std::min<int64_t>(total, options_.max_batch_tokens) +
                                        c.CommonWindow() - 1 + options_.block_size);
  }
  const int64_t blocks_needed = (live + options_.block_size - 1) / options_.block_size;
  if (blocks_needed > options_.num_blocks) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request needs ", blocks_needed, " KV-cache blocks (", live, " tokens",
        live < total ? absl::StrCat(" at once of ", total, " in its sliding window") : "",
        "), the cache holds only ", options_.num_blocks, " blocks of ", options_.block_size,
        " tokens"));
  }
  if (static_cast<int>(impl_->incoming.size()) + impl_->stats.waiting >= options_.max_waiting) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the waiting queue is full (max_waiting = ", options_.max_waiting, ")"));
  }
  if (request.session != 0) {
    Session& s = impl_->sessions[request.session];
    s.busy = true;
    seq->tokens = std::move(s.tokens);
    seq->blocks = std::move(s.blocks);
    seq->num_computed = s.num_computed;
    seq->num_cached_prompt = s.num_computed;
    s = Session{{}, {}, 0, true};
  }
  seq->id = impl_->next_id++;
  seq->tokens.insert(seq->tokens.end(), request.prompt.begin(), request.prompt.end());
  seq->num_prompt = static_cast<int>(seq->tokens.size());
  seq->sampler = std::make_unique<Sampler>(request.sampling);
  seq->decoder = std::make_unique<IncrementalDecoder>(
      *model_.tokenizer, seq->num_prompt > 0 ? seq->tokens.back() : -1);
  seq->stop_matcher = StopMatcher(request.stop.stop_strings);
  if (request.stop.min_new_tokens > 0) {
    std::vector<int32_t> stoppers = request.stop.stop_token_ids;
    if (!request.stop.ignore_eos) {
      for (int32_t id : model_.tokenizer->EndOfGenerationIds()) stoppers.push_back(id);
    }
    seq->early_bias = BiasBanning(request.sampling.logit_bias, stoppers);
  }
  seq->request = std::move(request);
  const RequestId id = seq->id;
  impl_->incoming.push_back(std::move(seq));
  ++impl_->in_flight;
  impl_->cv.notify_all();
  return id;
}

absl::Status Engine::ReadSession(SessionId id, const std::function<void(const SessionView&)>& fn) {
  if (!impl_->init_status.ok()) return impl_->init_status;
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto it = impl_->sessions.find(id);
  if (it == impl_->sessions.end()) {
    return absl::NotFoundError(absl::StrCat("session_id ", id, " is not an open session"));
  }
  if (it->second.busy) {
    return absl::FailedPreconditionError(absl::StrCat("session ", id, " has a request in flight"));
  }
  // Held busy (as a request would hold it) so fn can read without the lock: the session's
  // blocks stay referenced and unwritten, and flat_hash_map may rehash, so copy the view.
  Session& s = it->second;
  s.busy = true;
  const std::vector<int32_t> tokens = s.tokens;
  const std::vector<BlockId> blocks = s.blocks;
  const int num_cached = s.num_computed;
  lock.unlock();
  fn(SessionView{tokens, num_cached, blocks, impl_->cache.get()});
  lock.lock();
  impl_->sessions[id].busy = false;
  return absl::OkStatus();
}

void Engine::Cancel(RequestId id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cancelled.push_back(id);
  impl_->cv.notify_all();
}

absl::StatusOr<SessionId> Engine::OpenSession() {
  if (!impl_->init_status.ok()) return impl_->init_status;
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->accepting) return absl::UnavailableError("the engine is shutting down");
  if (static_cast<int>(impl_->sessions.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("too many open sessions (max_sessions = ", options_.max_sessions, ")"));
  }
  const SessionId id = impl_->next_session++;
  impl_->sessions[id] = Session{};
  impl_->stats.sessions = static_cast<int>(impl_->sessions.size());
  return id;
}

absl::Status Engine::CloseSession(SessionId id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->sessions.find(id);
  if (it == impl_->sessions.end()) {
    return absl::NotFoundError(absl::StrCat("session_id ", id, " is not an open session"));
  }
  if (it->second.busy) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", id, " has a request in flight; cancel it first"));
  }
  // The pool belongs to the step thread: it releases the blocks.
  for (BlockId b : it->second.blocks) impl_->blocks_to_release.push_back(b);
  impl_->sessions.erase(it);
  impl_->cv.notify_all();
  return absl::OkStatus();
}

void Engine::Shutdown(std::chrono::milliseconds drain) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->accepting = false;
  impl_->drained.wait_for(lock, drain, [this] { return impl_->in_flight == 0; });
  if (impl_->in_flight == 0) return;
  // cancel whatever is left: running, waiting and not yet picked up
  impl_->cancelled.push_back(-1);  // −1: everything
  impl_->cv.notify_all();
  impl_->drained.wait(lock, [this] { return impl_->in_flight == 0; });
}

EngineStats Engine::Stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  EngineStats s = impl_->stats;
  s.waiting += static_cast<int>(impl_->incoming.size());
  s.sessions = static_cast<int>(impl_->sessions.size());
  return s;
}

// ---------------------------------------------------------------------------------------
// Step thread

void Engine::Impl::Loop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [this] {
        return stop || !incoming.empty() || !cancelled.empty() || !blocks_to_release.empty() ||
               !running.empty() || !waiting.empty();
      });
      if (stop && running.empty() && waiting.empty() && incoming.empty()) return;
    }
    Step();
  }
}

EngineObserver::StepStats Engine::Impl::CurrentStats() const {
  EngineObserver::StepStats s;
  s.running = static_cast<int>(running.size());
  s.waiting = static_cast<int>(waiting.size());
  s.blocks_used = pool.num_used();
  s.blocks_cached = pool.num_cached();
  s.blocks_free = pool.num_free();
  return s;
}

// Gives every block the sequence still holds back to the pool (not the released ones'
// aliases); its block table is then empty.
void Engine::Impl::ReleaseBlocks(Sequence& s) {
  for (size_t b = static_cast<size_t>(s.num_released_blocks); b < s.blocks.size(); ++b) {
    pool.Release(s.blocks[b]);
  }
  s.blocks.clear();
  s.num_released_blocks = 0;
}

// Under a sliding window W, every query still to come (positions ≥ num_computed) sees
// keys from num_computed − W + 1 on: the blocks wholly before that go back to the pool
// (hashed ones stay in the prefix cache). Their table entries then alias the first live
// block, so the table still covers keys 0 …: a kernel that reads masked keys just before
// the window (the CPU's split-key spans, the GPU's first tile) reads finite rows it then
// masks, never a block another sequence may be writing. Sessions keep their blocks.
void Engine::Impl::ReleaseOutOfWindow(Sequence& s) {
  const int window = model.config.CommonWindow();
  if (!ReleasesOutOfWindow(model.config, options, s.request.session) || s.blocks.empty()) return;
  const int first_seen = std::max(0, s.num_computed - window + 1);
  const int dead = std::min(first_seen / options.block_size, static_cast<int>(s.blocks.size()) - 1);
  if (dead <= s.num_released_blocks) return;
  for (int b = s.num_released_blocks; b < dead; ++b) pool.Release(s.blocks[b]);
  std::fill(s.blocks.begin(), s.blocks.begin() + dead, s.blocks[dead]);
  s.num_released_blocks = dead;
}

void Engine::Impl::FreeBlocks(Sequence& s) {
  ReleaseBlocks(s);
  s.num_computed = 0;
  s.num_hashed_blocks = 0;
  s.last_hash = 0;
  s.prefix_looked_up = false;
}

bool Engine::Impl::EnsureBlocks(Sequence& s, int num_tokens) {
  const int needed = (num_tokens + options.block_size - 1) / options.block_size -
                     static_cast<int>(s.blocks.size());
  if (needed <= 0) return true;
  if (needed > pool.num_available()) return false;
  for (int i = 0; i < needed; ++i) s.blocks.push_back(*pool.Allocate());
  return true;
}

void Engine::Impl::Preempt(Sequence& s) {
  FreeBlocks(s);  // full blocks stay in the prefix cache: recomputation may find them
  if (observer) observer->OnPreemption();
}

void Engine::Impl::LookupPrefix(Sequence& s) {
  s.prefix_looked_up = true;
  if (!options.prefix_caching || s.num_computed > 0 || !s.blocks.empty()) return;
  const int bs = options.block_size;
  // Never the block holding the last token: it must be computed to yield logits.
  int max_blocks = (static_cast<int>(s.tokens.size()) - 1) / bs;
  // A steered sequence's keys and values are its own from its first steered position on
  // (ResidualAdd): it shares only the blocks wholly before it.
  max_blocks = std::min(max_blocks, FirstSteeredPosition(s.request.steering) / bs);
  // A prompt being scored takes only the blocks whose rows it scored already (after a
  // preemption): every other row must be computed to yield its logits.
  if (s.request.prompt_logprobs >= 0 && s.num_prompt_scored < s.num_prompt - 1) {
    max_blocks = std::min(max_blocks, s.num_prompt_scored / bs);
  }
  BlockHash h = 0;
  int hit = 0;
  for (int b = 0; b < max_blocks; ++b) {
    const auto tokens = absl::MakeConstSpan(s.tokens).subspan(b * bs, bs);
    const BlockHash next = HashBlock(h, tokens);
    auto id = pool.Lookup(next, tokens);
    if (!id) break;
    s.blocks.push_back(*id);
    h = next;
    ++hit;
  }
  s.num_computed = hit * bs;
  s.num_hashed_blocks = hit;
  s.last_hash = h;
  if (!s.was_scheduled) s.num_cached_prompt = std::max(s.num_cached_prompt, s.num_computed);
  ReleaseOutOfWindow(s);  // a long cached prefix holds only its window
}

void Engine::Impl::RegisterFullBlocks(Sequence& s) {
  if (!options.prefix_caching) return;
  const int bs = options.block_size;
  const int64_t unsteered = FirstSteeredPosition(s.request.steering);  // see LookupPrefix
  while ((s.num_hashed_blocks + 1) * bs <= std::min<int64_t>(s.num_computed, unsteered)) {
    const auto tokens = absl::MakeConstSpan(s.tokens).subspan(s.num_hashed_blocks * bs, bs);
    s.last_hash = HashBlock(s.last_hash, tokens);
    pool.SetHash(s.blocks[s.num_hashed_blocks], s.last_hash, tokens);
    ++s.num_hashed_blocks;
  }
}

void Engine::Impl::ReturnToSession(Sequence& s) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = sessions.find(s.request.session);
  if (it == sessions.end()) {  // closed meanwhile (cannot happen while busy) — release
    ReleaseBlocks(s);
    return;
  }
  Session& sess = it->second;
  sess.tokens = s.tokens;
  sess.num_computed = s.num_computed;
  sess.blocks = std::move(s.blocks);
  sess.busy = false;
  s.blocks.clear();
}

void Engine::Impl::Finish(std::unique_ptr<Sequence> s, FinishReason reason, absl::Status status) {
  if (s->request.session != 0) {
    ReturnToSession(*s);
  } else {
    ReleaseBlocks(*s);
  }
  FinishEvent ev;
  ev.reason = reason;
  ev.status = std::move(status);
  ev.usage.prompt_tokens = s->num_prompt;
  ev.usage.generated_tokens = s->num_generated;
  ev.usage.cached_tokens = s->num_cached_prompt;
  const Clock::time_point now = Clock::now();
  if (s->was_scheduled) {
    ev.timings.queue_seconds = Seconds(s->arrival, s->scheduled);
    if (s->num_generated > 0) {
      ev.timings.prefill_seconds = Seconds(s->scheduled, s->prompt_done);
      ev.timings.first_token_seconds = Seconds(s->arrival, s->first_token);
      ev.timings.decode_seconds = Seconds(s->first_token, s->last_token);
    }
  } else {
    ev.timings.queue_seconds = Seconds(s->arrival, now);
  }
  if (reason != FinishReason::kStop) {
    ev.text = s->stop_matcher.Flush(s->decoder->Flush());
  }
  if (s->request.callbacks.on_finish) s->request.callbacks.on_finish(ev);
  std::lock_guard<std::mutex> lock(mu);
  --in_flight;
  if (in_flight == 0) drained.notify_all();
}

TokenEvent Engine::Impl::AfterForward(Sequence& s, RowSample sampled) {
  TokenEvent ev;
  const int32_t token = sampled.token;
  const Clock::time_point now = Clock::now();
  if (s.num_generated == 0) {
    s.prompt_done = now;
    s.first_token = now;
  }
  s.last_token = now;
  s.tokens.push_back(token);
  ++s.num_generated;
  ev.token = token;
  ev.logprob = sampled.logprob;
  ev.time = now;
  ev.top_logprobs = std::move(sampled.top_logprobs);
  return ev;
}

std::pair<int, int> Engine::Impl::RowsToScore(const Sequence& s, int n) const {
  if (s.request.prompt_logprobs < 0) return {0, 0};
  const int begin = std::max(s.num_computed, s.num_prompt_scored);
  const int end = std::min(s.num_computed + n, s.num_prompt - 1);
  return {begin, std::max(begin, end)};
}

// After the step: the query is the last computed token (position num_computed − 1), its
// keys 0 … num_computed − 1; probs[l] is [H, num_computed] (AttentionCapture's
// last_query_only).
void Engine::Impl::FillAttentionRow(const Sequence& s, const std::vector<std::vector<float>>& probs,
                                    TokenEvent& ev) const {
  const int tk = s.num_computed;
  ev.attention_keys = tk;
  for (int l : s.request.attention_rows.layers) {
    for (int h : s.request.attention_rows.heads) {
      const float* row = probs[l].data() + static_cast<size_t>(h) * tk;
      ev.attention.insert(ev.attention.end(), row, row + tk);
    }
  }
}

void Engine::Impl::Step() {
  // 1. take new requests, cancellations and session closes
  std::vector<RequestId> to_cancel;
  {
    std::lock_guard<std::mutex> lock(mu);
    while (!incoming.empty()) {
      waiting.push_back(std::move(incoming.front()));
      incoming.pop_front();
    }
    to_cancel.swap(cancelled);
    for (BlockId b : blocks_to_release) pool.Release(b);
    blocks_to_release.clear();
  }
  if (!to_cancel.empty()) {
    const bool all = std::find(to_cancel.begin(), to_cancel.end(), -1) != to_cancel.end();
    auto hit = [&](const std::unique_ptr<Sequence>& s) {
      return all || std::find(to_cancel.begin(), to_cancel.end(), s->id) != to_cancel.end();
    };
    for (auto& s : running) {
      if (hit(s)) Finish(std::move(s), FinishReason::kCancelled);
    }
    running.erase(std::remove(running.begin(), running.end(), nullptr), running.end());
    for (auto& s : waiting) {
      if (hit(s)) Finish(std::move(s), FinishReason::kCancelled);
    }
    waiting.erase(std::remove(waiting.begin(), waiting.end(), nullptr), waiting.end());
  }

  // 2. schedule. Running sequences first, oldest first: each computes its remaining
  //    prompt chunk or its one decode token. When the pool runs dry the most recently
  //    admitted sequence is preempted (recomputed later). Then waiting sequences are
  //    admitted under the remaining token budget.
  int budget = step_token_limit;
  std::vector<std::pair<Sequence*, int>> plan;  // sequence, tokens to compute this step
  bool preempted = false;
  size_t i = 0;
  while (i < running.size() && budget > 0) {
    Sequence& s = *running[i];
    const int n = std::min<int>(static_cast<int>(s.tokens.size()) - s.num_computed, budget);
    if (!EnsureBlocks(s, s.num_computed + n)) {
      preempted = true;
      Preempt(*running.back());
      waiting.push_front(std::move(running.back()));
      running.pop_back();
      continue;  // retry s (unless it was the one preempted: then the loop ends)
    }
    plan.emplace_back(&s, n);
    budget -= n;
    ++i;
  }
  const Clock::time_point now = Clock::now();
  while (!preempted && budget > 0 && !waiting.empty() &&
         static_cast<int>(running.size()) < options.max_running) {
    Sequence& s = *waiting.front();
    if (!s.prefix_looked_up) LookupPrefix(s);
    const int n = std::min<int>(static_cast<int>(s.tokens.size()) - s.num_computed, budget);
    if (!EnsureBlocks(s, s.num_computed + n)) {
      FreeBlocks(s);  // give back prefix references while it waits
      break;
    }
    if (!s.was_scheduled) {
      s.was_scheduled = true;
      s.scheduled = now;
      if (observer) observer->OnPrefixLookup(s.num_prompt, s.num_computed);
    }
    plan.emplace_back(&s, n);
    budget -= n;
    running.push_back(std::move(waiting.front()));
    waiting.pop_front();
  }

  int batch_tokens = 0;
  for (const auto& p : plan) batch_tokens += p.second;
  if (!plan.empty()) {
    // 3. one forward over every planned chunk
    std::vector<BatchEntry> batch;
    batch.reserve(plan.size());
    for (const auto& [s, n] : plan) {
      BatchEntry e;
      e.tokens = absl::MakeConstSpan(s->tokens).subspan(s->num_computed, n);
      e.num_cached = s->num_computed;
      e.block_table = s->blocks;
      e.residual_adds = s->request.steering;
      // A device backend then copies out no logits row: a chunk that samples nothing (a
      // prompt's middle) wants none, and one that samples has its next token drawn where
      // the logits are (penalties from the counts of the tokens so far).
      const bool samples = s->num_computed + n == static_cast<int>(s->tokens.size());
      // A scored prompt chunk wants every row: a device reads each row's log-probability
      // of the token after it (score_next) where the logits are, a host scores the rows.
      const auto [score_begin, score_end] = RowsToScore(*s, n);
      e.all_logits = score_begin < score_end;
      e.pick_only = !e.all_logits;
      if (e.all_logits) {
        e.score_next =
            absl::MakeConstSpan(s->tokens).subspan(s->num_computed + 1, n - (samples ? 1 : 0));
        e.score_top = s->request.prompt_logprobs;
      }
      if (samples) {
        // With the number the host's Sample would take next; a host path that samples
        // this row after all takes the same one.
        e.draw = s->sampler->ReserveDraw(s->tokens);
        e.draw.top_logprobs = s->request.top_logprobs;
        if (s->num_generated < s->request.stop.min_new_tokens) e.draw.logit_bias = s->early_bias;
      }
      batch.push_back(e);
    }
    // Sequences streaming attention rows that sample this step capture the rows they
    // stream, the chosen layers' last query rows, in the same Forward as the others (which
    // computes what it would without them).
    std::vector<AttentionCapture<float>> captures;
    std::vector<int> capture_of(plan.size(), -1);
    for (size_t k = 0; k < plan.size(); ++k) {
      const Sequence& s = *plan[k].first;
      if (!s.request.attention_rows.layers.empty() &&
          s.num_computed + plan[k].second == static_cast<int>(s.tokens.size())) {
        capture_of[k] = static_cast<int>(captures.size());
        AttentionCapture<float>& capture = captures.emplace_back();
        capture.entry = static_cast<int>(k);
        capture.layers = s.request.attention_rows.layers;
        capture.last_query_only = true;
      }
    }
    const absl::Status status = transformer.Forward(batch, *cache, out, absl::MakeSpan(captures));
    // A step that ran out of device memory (an activation buffer or workspace that did not
    // grow, Backend::Recover having cleared it) runs again in halves: its sequences stay as
    // they were (the cache rows it wrote are rewritten, a reserved draw is kept), and the
    // next steps' budget is half its tokens, so the same sequences go in fewer and shorter
    // chunks. A step of one token runs again once, as it was (the memory may have been
    // another process's for a moment); if it runs out again it fails its request.
    const bool ran_out = status.code() == absl::StatusCode::kResourceExhausted;
    const bool run_again = ran_out && (batch_tokens > 1 || !last_step_ran_out);
    last_step_ran_out = ran_out;
    if (ran_out) {
      if (run_again) {
        step_token_limit = std::max(1, batch_tokens / 2);
        steps_since_out_of_memory = 0;
        ++steps_out_of_memory;
      }
      if (observer) observer->OnOutOfMemory({batch_tokens, step_token_limit, !run_again, status});
    } else if (status.ok() && step_token_limit < options.max_batch_tokens &&
               ++steps_since_out_of_memory >= Engine::kStepsToRegrow) {
      step_token_limit = std::min(options.max_batch_tokens, 2 * step_token_limit);
      steps_since_out_of_memory = 0;
    }
    // 4. sample every row that completes its sequence's tokens (in parallel: rows are
    // independent), then advance, stream, finish in order
    std::vector<RowSample> sampled(plan.size());
    if (status.ok()) {
      std::vector<size_t> rows;
      for (size_t k = 0; k < plan.size(); ++k) {
        const Sequence& s = *plan[k].first;
        if (s.num_computed + plan[k].second == static_cast<int>(s.tokens.size())) rows.push_back(k);
      }
      const int V = model.config.vocab_size;
      // The row a sequence samples from: its entry's last (all_logits: one per new token).
      auto last_row = [&](size_t k) {
        return static_cast<size_t>(out.logits_row[k]) +
               (batch[k].all_logits ? batch[k].tokens.size() - 1 : 0);
      };
      auto sample = [&](int64_t r) {
        const size_t k = rows[static_cast<size_t>(r)];
        Sequence& s = *plan[k].first;
        if (batch[k].Picks() && !out.pick_token.empty()) {
          // The device's pick: what DrawRow gives on the host.
          const size_t row = last_row(k);
          sampled[k].token = out.pick_token[row];
          sampled[k].logprob = out.pick_logprob[row];
          for (int t = 0; t < std::min(s.request.top_logprobs, V); ++t) {
            const size_t at = row * kernels::kMaxTopLogprobs + static_cast<size_t>(t);
            sampled[k].top_logprobs.push_back({out.pick_top_token[at], out.pick_top_logprob[at]});
          }
          s.sampler->ClearReserved();  // its number was the device's draw
          return;
        }
        // The reserved draw on the host (bias and penalties from the kept counts). Rows of
        // different sequences touch different samplers: safe on any thread.
        sampled[k] = DrawRow(
            *s.sampler, absl::MakeConstSpan(out.logits.data() + last_row(k) * V, V), batch[k].draw);
      };
      if (sampling_pool != nullptr && rows.size() > 1) {
        sampling_pool->ParallelFor(static_cast<int64_t>(rows.size()), sample);
      } else {
        for (size_t r = 0; r < rows.size(); ++r) sample(static_cast<int64_t>(r));
      }
    }
    for (size_t k = 0; k < plan.size() && !run_again; ++k) {
      Sequence& s = *plan[k].first;
      bool done = false;
      FinishReason reason = FinishReason::kLength;
      if (!status.ok()) {
        done = true;
        reason = FinishReason::kError;
      } else {
        if (const auto [begin, end] = RowsToScore(s, plan[k].second); begin < end) {
          const PromptLogprobsEvent ev = ScoreForwardRows(
              out, static_cast<size_t>(out.logits_row[k] + (begin - s.num_computed)),
              model.config.vocab_size, begin,
              absl::MakeConstSpan(s.tokens).subspan(begin + 1, end - begin),
              s.request.prompt_logprobs, sampling_pool.get());
          s.num_prompt_scored = end;
          if (s.request.callbacks.on_prompt_logprobs) s.request.callbacks.on_prompt_logprobs(ev);
        }
        s.num_computed += plan[k].second;
        RegisterFullBlocks(s);
        ReleaseOutOfWindow(s);
        if (s.num_computed == static_cast<int>(s.tokens.size())) {
          TokenEvent ev = AfterForward(s, std::move(sampled[k]));
          if (capture_of[k] >= 0) FillAttentionRow(s, captures[capture_of[k]].probs, ev);
          const StopParams& stop = s.request.stop;
          const bool eos =
              !stop.ignore_eos && model.tokenizer && model.tokenizer->IsEndOfGeneration(ev.token);
          const bool stop_token = std::find(stop.stop_token_ids.begin(), stop.stop_token_ids.end(),
                                            ev.token) != stop.stop_token_ids.end();
          const StopMatcher::Result text =
              s.stop_matcher.Push(eos || stop_token ? std::string() : s.decoder->Push(ev.token));
          ev.text = text.emit;
          if (s.request.callbacks.on_token) s.request.callbacks.on_token(ev);
          done = true;
          if (text.matched || stop_token) {
            reason = FinishReason::kStop;
          } else if (eos) {
            reason = FinishReason::kEos;
          } else if (s.num_generated >= stop.max_new_tokens) {
            reason = FinishReason::kLength;
          } else if (static_cast<int>(s.tokens.size()) >= model.config.max_seq_len) {
            reason = FinishReason::kContext;
          } else {
            done = false;
          }
        }
      }
      if (done) {
        auto it = std::find_if(running.begin(), running.end(),
                               [&](const auto& p) { return p.get() == &s; });
        std::unique_ptr<Sequence> owned = std::move(*it);
        running.erase(it);
        Finish(std::move(owned), reason, status);
      }
    }
  }
  EngineObserver::StepStats st = CurrentStats();
  st.batch_tokens = batch_tokens;
  if (observer && !plan.empty()) observer->OnStep(st);
  std::lock_guard<std::mutex> lock(mu);
  stats.running = st.running;
  stats.waiting = st.waiting;
  stats.blocks_used = st.blocks_used;
  stats.blocks_cached = st.blocks_cached;
  stats.blocks_free = st.blocks_free;
  stats.step_token_limit = step_token_limit;
  stats.steps_out_of_memory = steps_out_of_memory;
  if (plan.empty() && !waiting.empty() && running.empty()) {
    // Nothing can run: the front request does not fit even in an empty pool (sessions
    // hold the rest). Fail it rather than spin.
    std::unique_ptr<Sequence> s = std::move(waiting.front());
    waiting.pop_front();
    mu.unlock();
    Finish(std::move(s), FinishReason::kError,
           absl::ResourceExhaustedError("the KV cache is held by open sessions; close some"));
    mu.lock();
  }
}

}  // namespace kvlens
