// kvlens-server: serves one model over gRPC (kvlens.v1.Generation and Interpret, health,
// reflection) with Prometheus metrics on a second port. SIGTERM / SIGINT drain gracefully
// (see grpc_server.h) and exit 0.
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/flag_names.h"
#include "common/malloc_tuning.h"
#include "engine/attention_tune_shape.h"
#include "engine/engine.h"
#include "engine/interpret/sae_file.h"
#include "engine/kv_cache/kv_cache_sizing.h"
#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/model.h"
#include "kernels/backend_factory.h"
#include "kernels/kv_dtype.h"
#include "server/engine_event_log.h"
#include "server/grpc_server.h"
#include "server/metrics.h"

ABSL_FLAG(std::string, model, "",
          "Model to serve: a .gguf file, a llama2.c .bin checkpoint, or a Hugging Face "
          "model directory (config.json + *.safetensors). Required.");
ABSL_FLAG(std::string, tokenizer, "",
          "llama2.c only: its tokenizer .bin (default: tokenizer.bin or tok<V>.bin beside "
          "the model).");
ABSL_FLAG(std::string, host, "0.0.0.0",
          "Address both ports listen on (127.0.0.1 for loopback only).");
ABSL_FLAG(int32_t, port, 50051, "gRPC port (0: any free port; the chosen one is printed).");
ABSL_FLAG(int32_t, metrics_port, 9464,
          "Prometheus /metrics HTTP port (0: any free port; -1: no metrics endpoint).");
ABSL_FLAG(int64_t, kv_cache_tokens, 0,
          "KV-cache capacity in tokens (rounded down to whole blocks). 0: use "
          "--kv_cache_bytes.");
ABSL_FLAG(int64_t, kv_cache_bytes, 0,
          "KV-cache capacity in bytes (K and V, all layers, of --kv-cache-dtype) when "
          "--kv_cache_tokens "
          "is 0. 0: 256 MiB on the CPU; on a GPU, --gpu-memory-utilization decides.");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "On a GPU (--device cuda) when neither --kv-cache-tokens nor --kv-cache-bytes is "
          "given: the KV cache gets what is left of this fraction of the GPU's memory after "
          "what is already in use, the weights and two profiled steps, one of "
          "--max-batch-tokens prompt tokens and one decoding --max-running sequences "
          "(vLLM's --gpu-memory-utilization). 0: --kv-cache-bytes as on the CPU.");
ABSL_FLAG(std::string, kv_cache_dtype, "auto",
          "KV-cache element type: auto (fp32, the activations' type) or bf16 (half the bytes: "
          "twice the tokens in the same memory; keys and values rounded to bf16 as they are "
          "stored, vLLM's --kv-cache-dtype).");
ABSL_FLAG(int32_t, block_size, 16, "KV-cache block size in tokens (the prefix-cache unit).");
ABSL_FLAG(std::string, chat_template, "auto",
          "How GenerateRequest.chat becomes a prompt: auto (the family of the model's own Jinja "
          "chat template, recognised as llama.cpp's built-in templates are; chat prompts are "
          "refused when it is none of them) or one of: chatml, llama3, llama2, llama2-sys, "
          "llama2-sys-bos, llama2-sys-strip, mistral-v1, mistral-v3, mistral-v3-tekken, "
          "mistral-v7, phi3, phi4, gemma, command-r, deepseek2, deepseek-coder, vicuna, "
          "vicuna-orca, minicpm.");
ABSL_FLAG(int32_t, max_batch_tokens, 512,
          "Token budget of one engine step: decode tokens of all running sequences plus "
          "prefill chunks. A step that runs out of device memory runs again under half "
          "its tokens, a budget that doubles back after every 32 steps that run.");
ABSL_FLAG(int32_t, max_running, 64, "Sequences decoding at once.");
ABSL_FLAG(int32_t, max_waiting, 256, "Queue limit: requests beyond it get RESOURCE_EXHAUSTED.");
ABSL_FLAG(int32_t, max_sessions, 64, "Open sessions at most.");
ABSL_FLAG(bool, prefix_caching, true, "Reuse cached KV blocks of shared prompt prefixes.");
ABSL_FLAG(std::string, device, "cpu",
          "Where generation runs: cpu (threaded fp32 CPU backend) or cuda[:N] (GPU N, default "
          "0; builds with -DKVLENS_CUDA=ON). On cuda the KV cache and activations live on the "
          "GPU (--kv-cache-bytes is GPU memory); interpretability requests run where "
          "--interp-device says, reading a session's KV cache back from the GPU.");
ABSL_FLAG(bool, cuda_graphs, true,
          "--device cuda: run each forward step's launches as a CUDA graph, captured the "
          "second time an identical step runs (decode steps of an unchanged batch) and "
          "replayed after that; false launches every kernel one by one.");
ABSL_FLAG(bool, attention_tensor_cores, false,
          "--device cuda: decode attention (split-KV) on tensor cores at head sizes 64, 128 "
          "and 256: Q, K, P and V rounded to bf16 on a bf16 KV cache, to fp16 on an fp32 one, "
          "as prefill rounds them, with fp32 sums. Off by default until timed on a GPU. "
          "Interpretability requests keep fp32 attention.");
ABSL_FLAG(bool, programmatic_launches, false,
          "--device cuda: launch kernels as programmatic dependent launches (Hopper, sm_90): "
          "each may be scheduled while the one before drains, the small-batch products "
          "prefetching their first weights into L2 and decode attention its first keys and "
          "values meanwhile. The same results. Off by default until timed on a GPU.");
ABSL_FLAG(
    bool, attention_tune, false,
    "--device cuda: before serving, time prefill attention's layouts and block orders "
    "(one prompt of up to 2048 tokens; on an fp32 cache also on an fp16 copy of its "
    "blocks) and decode attention's kernels (split-KV with 4 or 16 "
    "warps a block, its combine fused or not, on CUDA cores or tensor cores; up to 4096 keys, "
    "for one sequence and for min(--max-running, --max-batch-tokens, 256) of them) "
    "on this GPU at the model's shapes, check each one's output against the "
    "default's (within 2% of its largest value), and keep the fastest (each decode "
    "batch counting alike); prints what it timed. Chooses --attention-tensor-cores "
    "itself.");
ABSL_FLAG(int32_t, threads, 0, "CPU backend threads (0: all cores; --device cpu only).");
ABSL_FLAG(bool, int8_activations, false,
          "--device cpu: generation's products with block-quantised weights (q8_0, q4_K, ...) "
          "round their activations to 8 bits (per 32, or per 256 for the k-quants), as "
          "llama.cpp does: faster, no longer exact. Interpretability requests keep exact "
          "activations.");
ABSL_FLAG(int32_t, interp_workers, 2,
          "Interpretability requests (attention maps, probes, interventions, lens) running "
          "at once, each on its own backends apart from generation.");
ABSL_FLAG(int32_t, interp_threads, 1, "Threads of each interpretability worker's fp32 backend.");
ABSL_FLAG(std::string, interp_device, "cpu",
          "Where fp32 interpretability requests compute: cpu, or cuda[:N] (each worker gets "
          "its own GPU stream; the tape stays in host memory and its matrix products, norms, "
          "RoPE and activations run on the GPU, sharing the weights --device uploaded when it "
          "is the same GPU; their device scratch is not in --gpu-memory-utilization's profile, "
          "so it comes out of the fraction's margin). fp64 requests always run on the CPU "
          "reference.");
ABSL_FLAG(int32_t, interp_queue, 16,
          "Interpretability requests waiting beyond the running ones; more get "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(int32_t, max_interp_positions, 1024, "Tokens of one interpretability request.");
ABSL_FLAG(int64_t, max_interp_layer_heads, 4096,
          "Layers x heads one interpretability request may ask for.");
ABSL_FLAG(int64_t, max_interp_bytes, int64_t{64} << 20,
          "Bytes one interpretability response may return (all chunks of an attention map).");
ABSL_FLAG(int64_t, max_interp_tape_bytes, int64_t{8} << 30,
          "Working memory one interpretability request may take (its activations, attention "
          "maps and their gradients: about 4 x layers x heads x positions^2 elements for a "
          "probe); larger requests are refused before they allocate.");
ABSL_FLAG(int32_t, max_interp_sweep_runs, 4096,
          "Cells of one exact Interpret.PatchSweep (layers x positions, x heads for q, k, v, z "
          "and pattern, x prompt pairs with more_pairs): each is one forward pass over a "
          "prompt (attribution sweeps, one backward for every cell, are not limited by it).");
ABSL_FLAG(std::vector<std::string>, sae, {},
          "Sparse autoencoders for Interpret.SaeFeatures and Generate's SAE-feature "
          "steering, comma-separated, each "
          "[NAME=]PATH[@HOOK]: a SAELens directory (cfg.json + sae_weights.safetensors) or a "
          "Gemma Scope params.npz; HOOK, a TransformerLens name such as "
          "blocks.20.hook_resid_post, is required for .npz and overrides the cfg's hook_name; "
          "NAME defaults to the hook name.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "On SIGTERM/SIGINT, how long running requests may finish before they are "
          "cancelled (e.g. 30s, 500ms).");

namespace {

constexpr char kUsage[] =
    "kvlens-server --model PATH [--device cpu|cuda[:N]] [--port P] [--metrics-port Q] "
    "[flags]\n\n"
    "Serves a decoder-only transformer over gRPC (kvlens.v1.Generation and Interpret, "
    "grpc.health.v1, server reflection) with Prometheus metrics on a separate HTTP port. Flag "
    "names take "
    "'-' or '_' alike (--metrics-port = --metrics_port). SIGTERM/SIGINT drain and exit 0.";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvlens-server: %s\n", std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  kvlens::RetainFreedMemory();  // before anything is allocated: see malloc_tuning.h
  absl::SetProgramUsageMessage(kUsage);
  absl::FlagsUsageConfig usage_config;
  // --help lists this file's flags (absl's default looks for a file named like the binary).
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "server/main.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  std::vector<std::string> storage;
  std::vector<char*> args = kvlens::NormalizeFlagNames(argc, argv, storage);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());

  using kvlens::server::GrpcServer;
  if (absl::GetFlag(FLAGS_model).empty()) {
    return Fail(absl::InvalidArgumentError("--model is required (see --help)"));
  }
  // SIGTERM/SIGINT are taken by sigwait below; blocked before any thread starts so that
  // every thread inherits the mask and none is interrupted.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const std::string device_flag = absl::GetFlag(FLAGS_device);
  auto device = kvlens::kernels::ParseDevice(device_flag);
  if (!device.ok())
    return Fail(absl::InvalidArgumentError(absl::StrCat("--device: ", device.status().message())));
  device->cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  device->attention_tensor_cores = absl::GetFlag(FLAGS_attention_tensor_cores);
  device->programmatic_launches = absl::GetFlag(FLAGS_programmatic_launches);
  device->int8_activations = absl::GetFlag(FLAGS_int8_activations);
  const bool tune = absl::GetFlag(FLAGS_attention_tune);
  if (tune && device->kind != kvlens::kernels::DeviceSpec::Kind::kCuda) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--attention-tune is a --device cuda option (--device ", device_flag,
                     ": the CPU backend has one attention kernel)")));
  }
  if (tune && device->attention_tensor_cores) {
    return Fail(absl::InvalidArgumentError(
        "--attention-tune chooses decode attention's kernel itself: give it or "
        "--attention-tensor-cores, not both"));
  }
  auto backend = kvlens::kernels::CreateBackend(*device, absl::GetFlag(FLAGS_threads));
  if (!backend.ok()) {
    return Fail(absl::Status(backend.status().code(), absl::StrCat("--device ", device_flag, ": ",
                                                                   backend.status().message())));
  }

  auto model = kvlens::LoadModel({absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_tokenizer)});
  if (!model.ok()) return Fail(model.status());
  const kvlens::ModelConfig& config = (*model)->config;
  if (const std::string chat = absl::GetFlag(FLAGS_chat_template); chat != "auto") {
    auto format = kvlens::ChatFormatByName(chat);
    if (!format.ok()) {
      return Fail(
          absl::InvalidArgumentError(absl::StrCat("--chat-template: ", format.status().message())));
    }
    (*model)->chat_format = *format;
  }

  kvlens::EngineOptions options;
  auto kv_dtype = kvlens::kernels::ParseKvDtype(absl::GetFlag(FLAGS_kv_cache_dtype));
  if (!kv_dtype.ok()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-dtype: ", kv_dtype.status().message())));
  }
  options.kv_cache_dtype = *kv_dtype;
  options.block_size = absl::GetFlag(FLAGS_block_size);
  if (options.block_size < 1 || options.block_size > 1024) {
    return Fail(absl::InvalidArgumentError("--block-size must be in [1, 1024]"));
  }
  if (tune) {
    // Before the cache is sized: the tuner's inputs are freed by then, and the workspaces
    // its calls grew count as memory in use.
    const kvlens::kernels::AttentionTuneShape shape = kvlens::AttentionTuneShapeFor(
        config, options.kv_cache_dtype, options.block_size, absl::GetFlag(FLAGS_max_batch_tokens),
        absl::GetFlag(FLAGS_max_running));
    auto report = kvlens::kernels::TuneAttention(*backend->backend, shape);
    if (!report.ok()) {
      return Fail(absl::Status(report.status().code(),
                               absl::StrCat("--attention-tune: ", report.status().message())));
    }
    std::fprintf(stderr, "kvlens-server: %s", report->ToString().c_str());
    // GetModelInfo's backend then says which kernels serve.
    if (const std::string choice = report->Choice(); !choice.empty()) {
      absl::StrAppend(&backend->description, ", attention tuned: ", choice);
    }
  }
  if (const double u = absl::GetFlag(FLAGS_gpu_memory_utilization); !(u >= 0.0 && u <= 1.0)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--gpu-memory-utilization must be in [0, 1], got ", u)));
  }
  int64_t tokens = absl::GetFlag(FLAGS_kv_cache_tokens);
  int64_t cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  if (tokens < 0 || cache_bytes < 0) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        tokens < 0 ? "--kv-cache-tokens" : "--kv-cache-bytes", " must be >= 0 (0: the default)")));
  }
  const bool kv_size_given = tokens > 0 || cache_bytes > 0;
  const double utilization = absl::GetFlag(FLAGS_gpu_memory_utilization);
  if (!kv_size_given && utilization != 0.0 && !backend->backend->memory().host_accessible()) {
    auto sizing = kvlens::SizeKvCacheForUtilization(
        **model, *backend->backend,
        {.block_size = absl::GetFlag(FLAGS_block_size),
         .max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens),
         .max_running = absl::GetFlag(FLAGS_max_running)},
        utilization, options.kv_cache_dtype);
    if (!sizing.ok()) {
      return Fail(absl::Status(sizing.status().code(),
                               absl::StrCat("--gpu-memory-utilization: ", sizing.status().message(),
                                            " (or give --kv-cache-bytes)")));
    }
    tokens = sizing->tokens;
    std::fprintf(stderr,
                 "kvlens-server: KV cache %.2f GiB (%lld tokens) = %.2f x %.2f GiB - %.2f GiB in "
                 "use before - %.2f GiB weights and steps of %d tokens and %d sequences\n",
                 sizing->cache_bytes / double(1 << 30), static_cast<long long>(sizing->tokens),
                 utilization, sizing->total / double(1 << 30),
                 sizing->in_use_before / double(1 << 30), sizing->model_and_step / double(1 << 30),
                 absl::GetFlag(FLAGS_max_batch_tokens), absl::GetFlag(FLAGS_max_running));
  }
  if (tokens <= 0) {
    const int64_t bytes_per_token = kvlens::KvCacheStorage<float>::BlockBytes(
        config.num_layers, 1, config.kv_dim(), options.kv_cache_dtype);
    if (cache_bytes <= 0) cache_bytes = int64_t{256} << 20;
    tokens = cache_bytes / std::max<int64_t>(bytes_per_token, 1);
  }
  options.num_blocks = static_cast<int>(std::min<int64_t>(tokens / options.block_size, 1 << 24));
  if (options.num_blocks < 1) {
    return Fail(absl::InvalidArgumentError(
        "the KV cache holds less than one block (raise --kv-cache-tokens or --kv-cache-bytes)"));
  }
  if (const int64_t cache_tokens = int64_t{options.num_blocks} * options.block_size;
      cache_tokens < config.max_seq_len) {
    // vLLM refuses to start here; a request that fits still runs, and one that needs more
    // blocks at once than the cache has is refused when it arrives (RESOURCE_EXHAUSTED).
    std::fprintf(stderr,
                 "kvlens-server: warning: the KV cache holds %lld tokens, fewer than the model's "
                 "max_seq_len %d: requests needing more at once are refused\n",
                 static_cast<long long>(cache_tokens), config.max_seq_len);
  }
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.max_running = absl::GetFlag(FLAGS_max_running);
  options.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  options.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.prefix_caching = absl::GetFlag(FLAGS_prefix_caching);

  kvlens::server::Metrics metrics;
  const std::string host = absl::GetFlag(FLAGS_host);
  if (absl::GetFlag(FLAGS_metrics_port) >= 0) {
    if (absl::Status s = metrics.StartExposer(host, absl::GetFlag(FLAGS_metrics_port)); !s.ok()) {
      return Fail(s);
    }
  }
  // Metrics, and to stderr what they do not count (steps that ran out of device memory).
  kvlens::server::EngineEventLog engine_events(metrics, stderr);
  kvlens::Engine engine(**model, *backend->backend, options, &engine_events);
  if (!engine.status().ok()) return Fail(engine.status());

  const std::string interp_device_flag = absl::GetFlag(FLAGS_interp_device);
  auto interp_device = kvlens::kernels::ParseDevice(interp_device_flag);
  if (!interp_device.ok()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--interp-device: ", interp_device.status().message())));
  }

  kvlens::server::GrpcServerOptions server_options;
  for (const std::string& spec : absl::GetFlag(FLAGS_sae)) {
    auto sae = kvlens::interpret::LoadSae(spec);
    if (!sae.ok()) {
      return Fail(absl::Status(sae.status().code(),
                               absl::StrCat("--sae ", spec, ": ", sae.status().message())));
    }
    if (absl::Status s = kvlens::interpret::CheckSaeFitsModel(**sae, config); !s.ok()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("--sae ", spec, ": ", s.message())));
    }
    for (const auto& other : server_options.interpret.saes) {
      if (other->name == (*sae)->name) {
        return Fail(absl::InvalidArgumentError(absl::StrCat("--sae ", spec, ": a second SAE named ",
                                                            other->name, " (give NAME=PATH)")));
      }
    }
    std::fprintf(stderr, "kvlens-server: SAE %s: %s, %d features on %s (%s)\n",
                 (*sae)->name.c_str(),
                 std::string(kvlens::interpret::SaeArchitectureName((*sae)->architecture)).c_str(),
                 (*sae)->d_sae, (*sae)->hook_name.c_str(), (*sae)->path.c_str());
    server_options.interpret.saes.push_back(*std::move(sae));
  }
  server_options.address = absl::StrCat(host, ":", absl::GetFlag(FLAGS_port));
  server_options.backend_name = backend->description;
  kvlens::server::InterpretOptions& interp = server_options.interpret;
  interp.workers.num_workers = std::max(1, absl::GetFlag(FLAGS_interp_workers));
  interp.workers.cpu_threads = std::max(1, absl::GetFlag(FLAGS_interp_threads));
  interp.workers.max_queued = std::max(0, absl::GetFlag(FLAGS_interp_queue));
  interp.workers.device = *interp_device;
  interp.workers.share_weights_with = backend->backend.get();
  interp.limits.max_positions = absl::GetFlag(FLAGS_max_interp_positions);
  interp.limits.max_layer_heads = absl::GetFlag(FLAGS_max_interp_layer_heads);
  interp.limits.max_bytes = absl::GetFlag(FLAGS_max_interp_bytes);
  interp.limits.max_tape_bytes = absl::GetFlag(FLAGS_max_interp_tape_bytes);
  interp.limits.max_sweep_runs = std::max(1, absl::GetFlag(FLAGS_max_interp_sweep_runs));
  // An attention map stream's chunks are ~1 MiB; other responses are single messages.
  server_options.max_message_bytes = static_cast<int>(std::clamp<int64_t>(
      interp.limits.max_bytes + (1 << 20), server_options.max_message_bytes, int64_t{1} << 30));
  auto server = GrpcServer::Start(server_options, engine, metrics);
  if (!server.ok()) return Fail(server.status());
  std::fprintf(
      stderr,
      "kvlens-server: serving %s (%s, %d layers, context %d) on %s:%d, metrics on "
      "%s:%d, KV cache %d blocks x %d tokens (%s), backend %s, interpretability fp32 "
      "on %s\n",
      config.name.c_str(),
      (config.family.empty() ? std::string(kvlens::ArchitectureName(config.arch)) : config.family)
          .c_str(),
      config.num_layers, config.max_seq_len, host.c_str(), (*server)->port(), host.c_str(),
      metrics.exposer_port(), options.num_blocks, options.block_size,
      options.kv_cache_dtype == kvlens::kernels::KvDtype::kBF16 ? "bf16" : "fp32",
      backend->description.c_str(), (*server)->interp_device().c_str());
  const kvlens::GenerationConfig& config_defaults = (*model)->generation_config;
  if (config_defaults.repetition_penalty) {
    std::fprintf(stderr,
                 "kvlens-server: requests without sampling.repetition_penalty get %g "
                 "(the model's generation_config.json)\n",
                 *config_defaults.repetition_penalty);
  }

  int sig = 0;
  sigwait(&signals, &sig);
  const auto drain = absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_drain_timeout));
  std::fprintf(stderr, "kvlens-server: %s, draining (up to %lld ms)\n", strsignal(sig),
               static_cast<long long>(drain.count()));
  (*server)->Shutdown(drain);
  (*server)->Wait();
  std::fprintf(stderr, "kvlens-server: stopped\n");
  return 0;
}
