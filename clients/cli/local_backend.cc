#include "clients/cli/local_backend.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/attention_tune_shape.h"

namespace kvlens::cli {

std::vector<FlagSpec> LocalBackendFlags() {
  return {
      {"device", "cpu",
       "cpu, or cuda[:N] for GPU N (default 0; builds with -DKVLENS_CUDA=ON): where the model "
       "runs, its activations and KV cache included (fp32 only)"},
      {"precision", "fp32",
       "fp32 (fast path, on --device) or fp64 (the double-precision CPU reference)"},
      {"threads", "0", "CPU threads (0: all cores; --device cpu)"},
      {"int8-activations", "",
       "products with block-quantised weights (q8_0, q4_K, ...) round their activations to "
       "8 bits, as llama.cpp does: faster, no longer exact (--device cpu, --precision fp32)",
       true},
      {"attention-tensor-cores", "",
       "decode attention on tensor cores at head sizes 64, 128 and 256: Q, K, P and V "
       "rounded to bf16 on a bf16 KV cache, to fp16 on fp32, as prefill rounds them; off "
       "until timed on a GPU (--device cuda)",
       true},
      {"programmatic-launches", "",
       "launch kernels as programmatic dependent launches (Hopper): each may start while the "
       "one before drains, prefetching its first weights or keys; the same results, off "
       "until timed on a GPU (--device cuda)",
       true},
      {"attention-tune", "",
       "before running, time prefill attention's layouts and decode attention's kernels on "
       "this GPU at the model's shapes, check each against the default's output and keep "
       "the fastest (kvlens-server --attention-tune; --device cuda, not with "
       "--attention-tensor-cores)",
       true},
      {"kv-cache-dtype", "auto",
       "KV-cache element type: auto (the activations': fp32, fp64 with --precision fp64) or "
       "bf16 (keys and values rounded to bf16 as they are stored)"},
  };
}

int MakeLocalBackend(const Args& args, LocalBackend* out, absl::Status* error) {
  auto threads = args.Int("threads", 0, 1024);
  if (!threads.ok()) {
    *error = threads.status();
    return 2;
  }
  const std::string precision = args.Str("precision");
  if (precision != "fp32" && precision != "fp64") {
    *error = absl::InvalidArgumentError("--precision must be fp32 or fp64");
    return 2;
  }
  auto kv_dtype = kernels::ParseKvDtype(args.Str("kv-cache-dtype"));
  if (!kv_dtype.ok()) {
    *error =
        absl::InvalidArgumentError(absl::StrCat("--kv-cache-dtype: ", kv_dtype.status().message()));
    return 2;
  }
  const std::string device_flag = args.Str("device");
  auto device = kernels::ParseDevice(device_flag);
  if (!device.ok()) {
    *error = absl::InvalidArgumentError(absl::StrCat("--device: ", device.status().message()));
    return 2;
  }
  if (precision == "fp64" && device->kind != kernels::DeviceSpec::Kind::kCpu) {
    *error = absl::InvalidArgumentError(
        absl::StrCat("--precision fp64 runs on the CPU only, not --device ", device_flag));
    return 2;
  }
  device->int8_activations = args.Switch("int8-activations");
  if (device->int8_activations &&
      (precision == "fp64" || device->kind != kernels::DeviceSpec::Kind::kCpu)) {
    *error = absl::InvalidArgumentError(
        "--int8-activations applies to --device cpu with --precision fp32 (fp64 is the exact "
        "reference; CUDA multiplies f16 copies of quantised weights)");
    return 2;
  }
  device->attention_tensor_cores = args.Switch("attention-tensor-cores");
  if (device->attention_tensor_cores && device->kind != kernels::DeviceSpec::Kind::kCuda) {
    *error = absl::InvalidArgumentError(
        "--attention-tensor-cores applies to --device cuda (the CPU backends' attention is "
        "fp32 or fp64)");
    return 2;
  }
  device->programmatic_launches = args.Switch("programmatic-launches");
  if (device->programmatic_launches && device->kind != kernels::DeviceSpec::Kind::kCuda) {
    *error = absl::InvalidArgumentError(
        "--programmatic-launches applies to --device cuda (the CPU backends launch no "
        "kernels)");
    return 2;
  }
  out->tune = args.Switch("attention-tune");
  if (out->tune && device->kind != kernels::DeviceSpec::Kind::kCuda) {
    *error = absl::InvalidArgumentError(
        "--attention-tune applies to --device cuda (the CPU backends have one attention "
        "kernel)");
    return 2;
  }
  if (out->tune && device->attention_tensor_cores) {
    *error = absl::InvalidArgumentError(
        "--attention-tune chooses decode attention's kernel itself: give it or "
        "--attention-tensor-cores, not both");
    return 2;
  }
  out->kv_cache_dtype = *kv_dtype;
  out->fp64 = precision == "fp64";
  if (out->fp64) return 0;
  auto backend = kernels::CreateBackend(*device, static_cast<int>(*threads));
  if (!backend.ok()) {
    *error = absl::Status(backend.status().code(),
                          absl::StrCat("--device ", device_flag, ": ", backend.status().message()));
    return 1;
  }
  out->fp32 = *std::move(backend);
  return 0;
}

absl::Status TuneLocalBackend(LocalBackend& local, const ModelConfig& config, int block_size,
                              int max_prefill_tokens) {
  if (!local.tune || local.fp32.backend == nullptr) return absl::OkStatus();
  auto report = kernels::TuneAttention(
      *local.fp32.backend,
      AttentionTuneShapeFor(config, local.kv_cache_dtype, block_size, max_prefill_tokens,
                            /*max_decode_batch=*/1));  // the CLI decodes one sequence
  if (!report.ok()) {
    return absl::Status(report.status().code(),
                        absl::StrCat("--attention-tune: ", report.status().message()));
  }
  std::fputs(report->ToString().c_str(), stderr);
  return absl::OkStatus();
}

}  // namespace kvlens::cli
