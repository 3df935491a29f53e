// The work behind each Interpret RPC: request (validated and converted by
// interpret_convert.h) → engine/interpret → response message. Runs on an interpretability
// worker with that worker's own backends, never the engine's: the fp64 ReferenceBackend
// (stateless) or a private CpuBackend (its own thread pool), so probes never contend with
// the serving step thread. Sessions are read through Engine::ReadSession. No gRPC here.
#ifndef KVLENS_SERVER_INTERPRET_RUNNER_H_
#define KVLENS_SERVER_INTERPRET_RUNNER_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/interpret/sae.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/staged_backend.h"
#include "kvlens/v1/interpret.pb.h"
#include "server/interpret_convert.h"

namespace kvlens::server {

// One worker's private backends.
struct InterpBackends {
  explicit InterpBackends(int cpu_threads) : f32(cpu_threads) {}
  kernels::ReferenceBackend f64;
  kernels::CpuBackend f32;  // fp32 probes and their backward ops; with a device, the host
                            // side of `staged`
  // --interp-device cuda[:N]: this worker's GPU backend, and fp32 probes' ops staged onto it
  // (the tape stays on the host; matrix products, norms, RoPE, activations, and in the
  // backward the input gradients of the products and the attention backward run on the GPU).
  std::unique_ptr<kernels::Backend<float>> device;
  std::unique_ptr<kernels::StagedBackend> staged;
  kernels::Backend<float>& fp32() {
    if (staged != nullptr) return *staged;
    return f32;
  }
};

// What every runner needs: the served model, the engine (for sessions), the limits, the
// loaded SAEs.
struct InterpContext {
  Engine& engine;
  const InterpLimits& limits;
  InterpBackends& backends;
  const std::vector<std::shared_ptr<const interpret::Sae>>* saes = nullptr;
  const Model& model() const { return engine.model(); }
};

// Every message of one AttentionMaps stream: info first, chunks (each ≤ ~1 MiB), head
// summaries last. Bytes (probs + scores) are checked against --max-interp-bytes first.
absl::StatusOr<std::vector<v1::AttentionMapsResponse>> RunAttentionMaps(
    const InterpContext& ctx, const v1::AttentionMapsRequest& request);

absl::Status RunGradientProbe(const InterpContext& ctx, const v1::GradientProbeRequest& request,
                              v1::GradientProbeResponse* response);

absl::Status RunCachedKvProbe(const InterpContext& ctx, const v1::CachedKvProbeRequest& request,
                              v1::CachedKvProbeResponse* response);

absl::Status RunIntervene(const InterpContext& ctx, const v1::InterveneRequest& request,
                          v1::InterveneResponse* response);

absl::Status RunLogitLens(const InterpContext& ctx, const v1::LogitLensRequest& request,
                          v1::LogitLensResponse* response);

// patch_sweep_runner.cc: an exact sweep's cells past --max-interp-sweep-runs are refused
// before any forward; `attribution` estimates them all from one backward instead.
absl::Status RunPatchSweep(const InterpContext& ctx, const v1::PatchSweepRequest& request,
                           v1::PatchSweepResponse* response);

absl::Status RunActivations(const InterpContext& ctx, const v1::ActivationsRequest& request,
                            v1::ActivationsResponse* response);

absl::Status RunListSaes(const InterpContext& ctx, v1::ListSaesResponse* response);

absl::Status RunSaeFeatures(const InterpContext& ctx, const v1::SaeFeaturesRequest& request,
                            v1::SaeFeaturesResponse* response);

absl::Status RunLogitAttribution(const InterpContext& ctx,
                                 const v1::LogitAttributionRequest& request,
                                 v1::LogitAttributionResponse* response);

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_INTERPRET_RUNNER_H_
