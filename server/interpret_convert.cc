#include "server/interpret_convert.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "server/request_convert.h"

namespace kvlens::server {
namespace {

absl::Status CheckToken(const std::string& field, int64_t id, int32_t vocab_size) {
  if (id < 0 || id >= vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = ", id, " must be a token id in [0, ", vocab_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckCount(const std::string& field, int64_t count, const InterpLimits& limits) {
  if (count > limits.max_targets) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " has ", count, " entries, more than the server allows (", limits.max_targets, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SequenceSpec> ToSequence(const v1::PromptInput& input, const Model& model,
                                        const InterpLimits& limits, const std::string& field,
                                        const std::vector<int32_t>* session_tokens) {
  const ModelConfig& c = model.config;
  SequenceSpec seq;
  switch (input.prompt_case()) {
    case v1::PromptInput::kText: {
      if (model.tokenizer == nullptr) {
        return absl::FailedPreconditionError("the model has no tokenizer; send token_ids");
      }
      seq.tokens = EncodeText(*model.tokenizer, input);
      break;
    }
    case v1::PromptInput::kTokenIds:
      seq.tokens.assign(input.token_ids().ids().begin(), input.token_ids().ids().end());
      break;
    case v1::PromptInput::kChat: {
      auto ids =
          EncodeChat(model, input.chat(),
                     input.has_add_bos() ? std::optional<bool>(input.add_bos()) : std::nullopt,
                     field + ".chat");
      if (!ids.ok()) return ids.status();
      seq.tokens = *std::move(ids);
      break;
    }
    case v1::PromptInput::kSessionId:
      if (session_tokens == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".session_id is not accepted by this RPC"));
      }
      seq.tokens = *session_tokens;
      break;
    case v1::PromptInput::PROMPT_NOT_SET:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": set one of text, token_ids, session_id"));
  }
  if (seq.tokens.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": no tokens"));
  const int64_t n = static_cast<int64_t>(seq.tokens.size());
  if (n > limits.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " has ", n, " tokens, more than --max-interp-positions = ", limits.max_positions));
  }
  if (n > c.max_seq_len) {
    return absl::OutOfRangeError(
        absl::StrCat(field, " has ", n, " tokens, more than the context length ", c.max_seq_len));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (absl::Status s = CheckToken(absl::StrCat(field, " token ", i), seq.tokens[i], c.vocab_size);
        !s.ok()) {
      return s;
    }
  }
  if (input.doc_ids_size() > 0) {
    if (input.doc_ids_size() != n) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".doc_ids has ", input.doc_ids_size(),
                                                     " entries for ", n, " tokens"));
    }
    seq.doc_ids.assign(input.doc_ids().begin(), input.doc_ids().end());
  }
  return seq;
}

absl::StatusOr<PositionRange> ToRange(const v1::Range& range, int n, const std::string& field) {
  // Each bound from the end when negative; end 0 is n.
  const int64_t begin = range.begin() < 0 ? int64_t{range.begin()} + n : range.begin();
  const int64_t end =
      range.end() < 0 ? int64_t{range.end()} + n : (range.end() == 0 ? n : range.end());
  if (begin < 0 || begin >= n || end <= begin || end > n) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " = [", range.begin(), ", ", range.end(), ") must be a non-empty range within [0, ",
        n, ") (negative bounds: from the end; end 0: to the end)"));
  }
  return PositionRange{static_cast<int>(begin), static_cast<int>(end)};
}

absl::Status CheckLayerHeads(int64_t layers, int64_t heads, const InterpLimits& limits) {
  if (layers * heads > limits.max_layer_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat(layers, " layers x ", heads, " heads = ", layers * heads,
                     " exceeds --max-interp-layer-heads = ", limits.max_layer_heads));
  }
  return absl::OkStatus();
}

absl::Status CheckBytes(int64_t bytes, const InterpLimits& limits, const char* what) {
  if (bytes > limits.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " would return ", bytes, " bytes, more than --max-interp-bytes = ", limits.max_bytes,
        "; ask for fewer layers, heads or positions, or fp16"));
  }
  return absl::OkStatus();
}

absl::Status CheckTapeBytes(int64_t bytes, int positions, const InterpLimits& limits,
                            const std::string& what) {
  if (bytes > limits.max_tape_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " over ", positions, " positions needs ", bytes,
        " bytes of working memory (activations, attention maps and their gradients grow with "
        "layers x heads x positions^2), more than --max-interp-tape-bytes = ",
        limits.max_tape_bytes, "; ask for fewer positions"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<interpret::TokenTarget>> ToTargets(
    const google::protobuf::RepeatedPtrField<v1::TokenTarget>& targets, const ModelConfig& c, int n,
    const InterpLimits& limits, const std::string& field) {
  if (absl::Status s = CheckCount(field, targets.size(), limits); !s.ok()) return s;
  std::vector<interpret::TokenTarget> out;
  for (int k = 0; k < targets.size(); ++k) {
    const std::string name = absl::StrCat(field, "[", k, "]");
    absl::StatusOr<int> position = ToIndex(targets[k].position(), n, name + ".position");
    if (!position.ok()) return position.status();
    if (absl::Status s = CheckToken(name + ".token", targets[k].token(), c.vocab_size); !s.ok()) {
      return s;
    }
    out.push_back({*position, targets[k].token()});
  }
  return out;
}

absl::StatusOr<interpret::Objective> ToLogProbObjective(const v1::LogProbObjective& lp,
                                                        const ModelConfig& c, int n,
                                                        const InterpLimits& limits) {
  auto targets = ToTargets(lp.targets(), c, n, limits, "log_prob.targets");
  if (!targets.ok()) return targets.status();
  if (targets->empty()) return absl::InvalidArgumentError("log_prob.targets: none given");
  return interpret::Objective::LogProb(*std::move(targets));
}

absl::StatusOr<interpret::Objective> ToLogitDiffObjective(const v1::LogitDiffObjective& d,
                                                          const ModelConfig& c, int n) {
  absl::StatusOr<int> position = ToIndex(d.position(), n, "logit_diff.position");
  if (!position.ok()) return position.status();
  if (absl::Status s = CheckToken("logit_diff.token_a", d.token_a(), c.vocab_size); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckToken("logit_diff.token_b", d.token_b(), c.vocab_size); !s.ok()) {
    return s;
  }
  return interpret::Objective::LogitDiff(*position, d.token_a(), d.token_b());
}

absl::StatusOr<interpret::Objective> ToObjective(const v1::GradientProbeRequest& request,
                                                 const ModelConfig& c, int n,
                                                 const InterpLimits& limits) {
  interpret::Objective o;
  switch (request.objective_case()) {
    case v1::GradientProbeRequest::kLogProb: {
      auto lp = ToLogProbObjective(request.log_prob(), c, n, limits);
      if (!lp.ok()) return lp.status();
      o = *std::move(lp);
      break;
    }
    case v1::GradientProbeRequest::kLogitDiff: {
      auto diff = ToLogitDiffObjective(request.logit_diff(), c, n);
      if (!diff.ok()) return diff.status();
      o = *std::move(diff);
      break;
    }
    case v1::GradientProbeRequest::kAttnOutProbe: {
      const v1::AttnOutProbeObjective& p = request.attn_out_probe();
      absl::StatusOr<int> layer = ToIndex(p.layer(), c.num_layers, "attn_out_probe.layer");
      if (!layer.ok()) return layer.status();
      absl::StatusOr<int> head = ToIndex(p.head(), c.num_heads, "attn_out_probe.head");
      if (!head.ok()) return head.status();
      const int64_t want = int64_t{n} * c.head_dim;
      if (p.g_size() != want) {
        return absl::InvalidArgumentError(absl::StrCat("attn_out_probe.g has ", p.g_size(),
                                                       " values; G is [positions = ", n,
                                                       ", head_dim = ", c.head_dim, "] = ", want));
      }
      o = interpret::Objective::AttnOutProbe(*layer, *head,
                                             std::vector<double>(p.g().begin(), p.g().end()));
      break;
    }
    case v1::GradientProbeRequest::OBJECTIVE_NOT_SET:
      return absl::InvalidArgumentError(
          "objective: set one of log_prob, logit_diff, attn_out_probe");
  }
  if (absl::Status s = interpret::ValidateObjective(o, c, n); !s.ok()) return s;
  return o;
}

absl::StatusOr<std::vector<std::pair<interpret::Hook, int>>> ToHookReads(
    const google::protobuf::RepeatedPtrField<std::string>& hooks, const ModelConfig& c,
    const std::vector<int>& layers) {
  std::vector<std::pair<interpret::Hook, int>> reads;
  for (const std::string& name : hooks) {
    const std::optional<interpret::NamedHook> named = interpret::ParseHookName(name);
    if (!named.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("hooks: unknown hook \"", name, "\"; known: ", interpret::HookNameList(),
                       ", or TransformerLens's full names (blocks.{layer}.attn.hook_pattern, …)"));
    }
    if (absl::Status s = interpret::CheckModelHasHook(c, named->hook); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("hooks: ", s.message()));
    }
    if (named->layer.has_value() && *named->layer >= c.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("hooks: \"", name, "\": layer ", *named->layer,
                                                     " is outside [0, ", c.num_layers, ")"));
    }
    const std::vector<int> at = !interpret::HookIsPerLayer(named->hook) ? std::vector<int>{-1}
                                : named->layer.has_value() ? std::vector<int>{*named->layer}
                                                           : layers;
    for (int l : at) {
      if (std::find(reads.begin(), reads.end(), std::pair{named->hook, l}) != reads.end()) {
        return absl::InvalidArgumentError(absl::StrCat("hooks: \"", name, "\" asks again for ",
                                                       interpret::HookFullName(named->hook, l)));
      }
      reads.emplace_back(named->hook, l);
    }
  }
  return reads;
}

absl::StatusOr<interpret::PatchTarget> ToPatchTarget(const std::string& hook,
                                                     const std::string& field, bool heads_allowed) {
  const std::optional<interpret::PatchTarget> t = interpret::PatchTargetByName(hook);
  if (t.has_value() && (heads_allowed || !t->per_head())) return *t;
  return absl::InvalidArgumentError(absl::StrCat(
      field, " = \"", hook, "\": not a patching site (",
      heads_allowed
          ? std::string(interpret::PatchTargetNames())
          : "resid_pre, resid_mid, resid_post, attn_out, mlp_out; a head's q, k, v or z is a "
            "head_patches entry, its pattern a row_overrides one",
      ")"));
}

absl::StatusOr<interpret::Edits> ToEdits(const v1::InterveneRequest& request, const ModelConfig& c,
                                         int n, const InterpLimits& limits) {
  interpret::Edits edits;
  if (absl::Status s = CheckCount("ablations", request.ablations_size(), limits); !s.ok()) {
    return s;
  }
  for (const auto& [field, count] :
       {std::pair{"row_overrides", request.row_overrides_size()},
        std::pair{"patches", request.patches_size()},
        std::pair{"head_patches", request.head_patches_size()},
        std::pair{"neuron_ablations", request.neuron_ablations_size()}}) {
    if (absl::Status s = CheckCount(field, count, limits); !s.ok()) return s;
  }
  for (int k = 0; k < request.ablations_size(); ++k) {
    const v1::HeadAblation& a = request.ablations(k);
    const std::string name = absl::StrCat("ablations[", k, "]");
    absl::StatusOr<int> layer = ToIndex(a.layer(), c.num_layers, name + ".layer");
    if (!layer.ok()) return layer.status();
    absl::StatusOr<int> head = ToIndex(a.head(), c.num_heads, name + ".head");
    if (!head.ok()) return head.status();
    edits.ablations.push_back({*layer, *head,
                               a.mode() == v1::HeadAblation::MODE_MEAN
                                   ? interpret::AblationMode::kMean
                                   : interpret::AblationMode::kZero});
  }
  for (int k = 0; k < request.neuron_ablations_size(); ++k) {
    const v1::NeuronAblation& a = request.neuron_ablations(k);
    const std::string name = absl::StrCat("neuron_ablations[", k, "]");
    absl::StatusOr<int> layer = ToIndex(a.layer(), c.num_layers, name + ".layer");
    if (!layer.ok()) return layer.status();
    if (a.neuron() < 0 || a.neuron() >= c.hidden_dim) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".neuron = ", a.neuron(), " must be in [0, ", c.hidden_dim, ")"));
    }
    int position = -1;
    if (a.has_position()) {
      absl::StatusOr<int> p = ToIndex(a.position(), n, name + ".position");
      if (!p.ok()) return p.status();
      position = *p;
    }
    edits.neuron_ablations.push_back({*layer, a.neuron(), position,
                                      a.mode() == v1::HeadAblation::MODE_MEAN
                                          ? interpret::AblationMode::kMean
                                          : interpret::AblationMode::kZero});
  }
  for (int k = 0; k < request.row_overrides_size(); ++k) {
    const v1::RowOverride& r = request.row_overrides(k);
    const std::string name = absl::StrCat("row_overrides[", k, "]");
    absl::StatusOr<int> layer = ToIndex(r.layer(), c.num_layers, name + ".layer");
    if (!layer.ok()) return layer.status();
    absl::StatusOr<int> head = ToIndex(r.head(), c.num_heads, name + ".head");
    if (!head.ok()) return head.status();
    absl::StatusOr<int> position = ToIndex(r.position(), n, name + ".position");
    if (!position.ok()) return position.status();
    if (r.probs_size() > 0 && r.probs_size() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".probs has ", r.probs_size(), " values; give one per key (", n, ")"));
    }
    if (r.probs_size() == 0 && r.masked_keys_size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": set probs or masked_keys"));
    }
    std::vector<int> masked_keys;
    for (int j = 0; j < r.masked_keys_size(); ++j) {
      absl::StatusOr<int> key =
          ToIndex(r.masked_keys(j), n, absl::StrCat(name, ".masked_keys[", j, "]"));
      if (!key.ok()) return key.status();
      masked_keys.push_back(*key);
    }
    edits.row_overrides.push_back({*layer, *head, *position,
                                   std::vector<double>(r.probs().begin(), r.probs().end()),
                                   std::move(masked_keys)});
  }
  return edits;
}

absl::StatusOr<v1::DType> ToWireDType(v1::DType requested, const std::string& field) {
  switch (requested) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_FP32:
      return v1::DTYPE_FP32;
    case v1::DTYPE_FP16:
      return v1::DTYPE_FP16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(field, " must be DTYPE_FP32 or DTYPE_FP16"));
  }
}

int DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP16:
      return 2;
    case v1::DTYPE_FP64:
      return 8;
    default:
      return 4;
  }
}

template <typename T>
void AppendValues(absl::Span<const T> values, v1::DType dtype, std::string* out) {
  // The wire is little-endian, as every host kvlens builds for (x86-64, aarch64).
  const size_t at = out->size();
  out->resize(at + values.size() * DTypeBytes(dtype));
  char* p = out->data() + at;
  for (const T x : values) {
    if (dtype == v1::DTYPE_FP16) {
      const uint16_t h = kernels::F32ToF16(static_cast<float>(x));
      std::memcpy(p, &h, 2);
      p += 2;
    } else if (dtype == v1::DTYPE_FP64) {
      const double d = static_cast<double>(x);
      std::memcpy(p, &d, 8);
      p += 8;
    } else {
      const float f = static_cast<float>(x);
      std::memcpy(p, &f, 4);
      p += 4;
    }
  }
}

template <typename T>
void AddTensor(const std::string& name, int layer, int head, std::vector<int64_t> shape,
               absl::Span<const T> values, v1::DType dtype,
               google::protobuf::RepeatedPtrField<v1::Tensor>* out) {
  v1::Tensor* t = out->Add();
  t->set_name(name);
  t->set_layer(layer);
  t->set_head(head);
  for (int64_t d : shape) t->add_shape(d);
  t->set_dtype(dtype);
  AppendValues(values, dtype, t->mutable_data());
}

template void AppendValues<float>(absl::Span<const float>, v1::DType, std::string*);
template void AppendValues<double>(absl::Span<const double>, v1::DType, std::string*);
template void AddTensor<float>(const std::string&, int, int, std::vector<int64_t>,
                               absl::Span<const float>, v1::DType,
                               google::protobuf::RepeatedPtrField<v1::Tensor>*);
template void AddTensor<double>(const std::string&, int, int, std::vector<int64_t>,
                                absl::Span<const double>, v1::DType,
                                google::protobuf::RepeatedPtrField<v1::Tensor>*);

}  // namespace kvlens::server
