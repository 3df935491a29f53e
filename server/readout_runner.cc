// Interpret.Activations and Interpret.LogitAttribution: reading the residual stream of a
// tape (engine/interpret/activations.h, logit_attribution.h) into their responses.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/interpret/activations.h"
#include "engine/interpret/logit_attribution.h"
#include "server/interpret_common.h"

namespace kvlens::server {
namespace {

template <typename T>
absl::Status ActivationsAt(const InterpContext& ctx, const SequenceSpec& seq,
                           const std::vector<std::pair<interpret::Hook, int>>& reads,
                           PositionRange rows, v1::DType dtype, v1::ActivationsResponse* response) {
  const Model& model = ctx.model();
  kernels::Backend<T>& be = BackendOf<T>(ctx.backends);
  const int num = static_cast<int>(seq.tokens.size());
  if (absl::Status s = CheckTapeBytes(WorkBytes<T>(model.config, num, num, 1, false), num,
                                      ctx.limits, "Activations");
      !s.ok()) {
    return s;
  }
  auto tape = interpret::RunForward(model, be, InputOf<T>(seq));
  if (!tape.ok()) return tape.status();
  for (const auto& [hook, l] : reads) {
    auto values = interpret::ReadHook(model, be, *tape, hook, l, rows.begin, rows.end);
    if (!values.ok()) return values.status();
    AddTensor(std::string(interpret::HookName(hook)), l, -1,
              interpret::HookShape(model.config, hook, rows.size(), tape->num_keys),
              absl::MakeConstSpan(*values), dtype, response->mutable_tensors());
  }
  return absl::OkStatus();
}

void AddShare(const char* component, int layer, int index, double value,
              google::protobuf::RepeatedPtrField<v1::Attribution>* out) {
  v1::Attribution* a = out->Add();
  a->set_component(component);
  a->set_layer(layer);
  a->set_index(index);
  a->set_value(value);
}

template <typename T>
absl::Status AttributionAt(const InterpContext& ctx, const v1::LogitAttributionRequest& request,
                           const SequenceSpec& seq, int position,
                           v1::LogitAttributionResponse* response) {
  const Model& model = ctx.model();
  const ModelConfig& c = model.config;
  const int num = static_cast<int>(seq.tokens.size());
  if (absl::Status s =
          CheckTapeBytes(WorkBytes<T>(c, num, num, 1, false), num, ctx.limits, "LogitAttribution");
      !s.ok()) {
    return s;
  }
  auto tape = interpret::RunForward(model, BackendOf<T>(ctx.backends), InputOf<T>(seq));
  if (!tape.ok()) return tape.status();
  interpret::AttributionOptions options;
  options.heads = request.heads();
  options.top_neurons = request.top_neurons();
  auto r = interpret::AttributeLogit(model, *tape, position, request.token(),
                                     request.has_baseline_token() ? request.baseline_token() : -1,
                                     options);
  if (!r.ok()) return r.status();
  response->set_logit(r->logit);
  response->set_total(r->Total());
  response->set_final_norm_scale(r->scale);
  auto* parts = response->mutable_components();
  AddShare("embed", -1, -1, r->embed, parts);
  if (c.arch == Architecture::kGpt2) AddShare("pos_embed", -1, -1, r->pos_embed, parts);
  for (int l = 0; l < c.num_layers; ++l) {
    AddShare("attn", l, -1, r->attn[l], parts);
    AddShare("mlp", l, -1, r->mlp[l], parts);
  }
  if (c.arch == Architecture::kGpt2) AddShare("final_norm_bias", -1, -1, r->final_norm_bias, parts);
  if (options.heads) {
    for (int l = 0; l < c.num_layers; ++l) {
      for (int h = 0; h < c.num_heads; ++h) {
        AddShare("head", l, h, r->heads[int64_t{l} * c.num_heads + h], response->mutable_heads());
      }
      AddShare("attn_bias", l, -1, r->attn_bias[l], response->mutable_heads());
    }
  }
  if (options.top_neurons > 0) {
    for (const interpret::NeuronShare& s : r->neurons) {
      AddShare("neuron", s.layer, s.neuron, s.value, response->mutable_neurons());
    }
    for (int l = 0; l < c.num_layers; ++l) {
      AddShare("mlp_bias", l, -1, r->mlp_bias[l], response->mutable_neurons());
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunActivations(const InterpContext& ctx, const v1::ActivationsRequest& request,
                            v1::ActivationsResponse* response) {
  const ModelConfig& c = ctx.model().config;
  auto seq = Resolve(ctx, request.input(), "input", true);
  if (!seq.ok()) return seq.status();
  const int n = static_cast<int>(seq->tokens.size());
  if (request.hooks_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hooks: name at least one of ", interpret::HookNameList()));
  }
  auto layers = ToIndexList(request.layers(), c.num_layers, "layers");
  if (!layers.ok()) return layers.status();
  auto reads = ToHookReads(request.hooks(), c, *layers);
  if (!reads.ok()) return reads.status();
  auto rows = ToRange(request.positions(), n, "positions");
  if (!rows.ok()) return rows.status();
  const bool fp64 = WantsFp64(request.precision());
  v1::DType dtype = request.dtype();
  if (dtype == v1::DTYPE_UNSPECIFIED) dtype = fp64 ? v1::DTYPE_FP64 : v1::DTYPE_FP32;
  if (dtype != v1::DTYPE_FP16 && dtype != v1::DTYPE_FP32 && dtype != v1::DTYPE_FP64) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype = ", request.dtype(), " must be DTYPE_FP16, DTYPE_FP32 or DTYPE_FP64"));
  }
  // What the tensors will weigh, before anything runs.
  int64_t bytes = 0;
  for (const auto& [hook, l] : *reads) {
    bytes += rows->size() * interpret::HookRowElements(c, hook, n) * DTypeBytes(dtype);
  }
  if (absl::Status s = CheckBytes(bytes, ctx.limits, "the activations"); !s.ok()) return s;
  response->set_precision(PrecisionOf(fp64));
  response->mutable_token_ids()->Assign(seq->tokens.begin(), seq->tokens.end());
  response->mutable_positions()->set_begin(rows->begin);
  response->mutable_positions()->set_end(rows->end);
  return fp64 ? ActivationsAt<double>(ctx, *seq, *reads, *rows, dtype, response)
              : ActivationsAt<float>(ctx, *seq, *reads, *rows, dtype, response);
}

absl::Status RunLogitAttribution(const InterpContext& ctx,
                                 const v1::LogitAttributionRequest& request,
                                 v1::LogitAttributionResponse* response) {
  const ModelConfig& c = ctx.model().config;
  auto seq = Resolve(ctx, request.input(), "input", true);
  if (!seq.ok()) return seq.status();
  const int n = static_cast<int>(seq->tokens.size());
  absl::StatusOr<int> resolved =
      ToIndex(request.has_position() ? request.position() : -1, n, "position");
  if (!resolved.ok()) return resolved.status();
  const int position = *resolved;
  if (request.token() < 0 || request.token() >= c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token = ", request.token(), " is outside the vocabulary [0, ", c.vocab_size, ")"));
  }
  if (request.has_baseline_token() &&
      (request.baseline_token() < 0 || request.baseline_token() >= c.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat("baseline_token = ", request.baseline_token(),
                                                   " is outside the vocabulary [0, ", c.vocab_size,
                                                   ")"));
  }
  if (request.top_neurons() < 0 || request.top_neurons() > c.hidden_dim) {
    return absl::InvalidArgumentError(absl::StrCat("top_neurons = ", request.top_neurons(),
                                                   " must be in [0, ", c.hidden_dim, "]"));
  }
  const int64_t shares = 2 * c.num_layers + 3 +
                         (request.heads() ? int64_t{c.num_layers} * (c.num_heads + 1) : 0) +
                         int64_t{c.num_layers} * (request.top_neurons() + 1);
  if (absl::Status s = CheckBytes(shares * 32, ctx.limits, "the attribution"); !s.ok()) return s;
  const bool fp64 = WantsFp64(request.precision());
  response->set_precision(PrecisionOf(fp64));
  response->mutable_token_ids()->Assign(seq->tokens.begin(), seq->tokens.end());
  response->set_position(position);
  return fp64 ? AttributionAt<double>(ctx, request, *seq, position, response)
              : AttributionAt<float>(ctx, request, *seq, position, response);
}

}  // namespace kvlens::server
