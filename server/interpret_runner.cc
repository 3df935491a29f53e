#include "server/interpret_runner.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/interpret/activations.h"
#include "engine/interpret/finite_difference.h"
#include "engine/interpret/head_scores.h"
#include "engine/interpret/hook_finite_difference.h"
#include "engine/interpret/hook_gradients.h"
#include "engine/interpret/interventions.h"
#include "engine/interpret/kv_probe.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"
#include "server/interpret_common.h"

namespace kvlens::server {
namespace {

using interpret::Gradients;
using interpret::SequenceInput;
using interpret::Tape;

constexpr int kDefaultVerifySamples = 8;
constexpr int kDefaultTopK = 5;

// Rows [r0, r1) × keys [k0, k1) of head h of a [H, n, Tk] map, appended to `out`.
template <typename T>
void AppendSlab(const std::vector<T>& map, int h, int n, int tk, int r0, int r1, int k0, int k1,
                v1::DType dtype, std::string* out) {
  for (int i = r0; i < r1; ++i) {
    const T* row = map.data() + (static_cast<int64_t>(h) * n + i) * tk;
    AppendValues(absl::MakeConstSpan(row + k0, row + k1), dtype, out);
  }
}

// [rows, heads, hd] → head h's [rows, hd].
template <typename T>
std::vector<T> HeadSlice(const std::vector<T>& x, int rows, int heads, int hd, int h) {
  std::vector<T> out(static_cast<size_t>(rows) * hd);
  for (int i = 0; i < rows; ++i) {
    std::copy_n(x.begin() + (static_cast<int64_t>(i) * heads + h) * hd, hd,
                out.begin() + static_cast<int64_t>(i) * hd);
  }
  return out;
}

// Head h's [n, Tk] of a [H, n, Tk] map.
template <typename T>
absl::Span<const T> MapSlice(const std::vector<T>& map, int h, int n, int tk) {
  return absl::MakeConstSpan(map).subspan(static_cast<size_t>(h) * n * tk,
                                          static_cast<size_t>(n) * tk);
}

template <typename T>
absl::Status AttentionMapsAt(const InterpContext& ctx, const v1::AttentionMapsRequest& request,
                             const SequenceSpec& seq, const std::vector<int>& layers,
                             const std::vector<int>& heads, PositionRange qr, PositionRange kr,
                             v1::DType dtype, std::vector<v1::AttentionMapsResponse>& out) {
  const ModelConfig& c = ctx.model().config;
  const int num = static_cast<int>(seq.tokens.size());
  if (absl::Status s =
          CheckTapeBytes(WorkBytes<T>(c, num, num, 1, false), num, ctx.limits, "AttentionMaps");
      !s.ok()) {
    return s;
  }
  auto tape = interpret::RunForward(ctx.model(), BackendOf<T>(ctx.backends), InputOf<T>(seq));
  if (!tape.ok()) return tape.status();
  const int n = tape->n;
  const bool probs = !request.probabilities_off();
  const bool scores = request.scores();
  const int64_t row_bytes = static_cast<int64_t>(heads.size()) * kr.size() * DTypeBytes(dtype) *
                            ((probs ? 1 : 0) + (scores ? 1 : 0));
  if (row_bytes > 0) {
    // Chunks: one layer, all chosen heads, as many query rows as fit (at least one).
    const int rows_per_chunk =
        static_cast<int>(std::clamp<int64_t>(ctx.limits.chunk_bytes / row_bytes, 1, qr.size()));
    for (int l : layers) {
      for (int r0 = qr.begin; r0 < qr.end; r0 += rows_per_chunk) {
        const int r1 = std::min(qr.end, r0 + rows_per_chunk);
        v1::AttentionChunk* chunk = out.emplace_back().mutable_chunk();
        chunk->set_layer(l);
        chunk->set_num_heads(static_cast<int>(heads.size()));
        chunk->set_query_begin(r0);
        chunk->set_num_queries(r1 - r0);
        chunk->set_key_begin(kr.begin);
        chunk->set_num_keys(kr.size());
        chunk->set_dtype(dtype);
        for (int h : heads) {
          if (probs) {
            AppendSlab(tape->layers[l].probs, h, n, n, r0, r1, kr.begin, kr.end, dtype,
                       chunk->mutable_probs());
          }
          if (scores) {
            AppendSlab(tape->layers[l].scores, h, n, n, r0, r1, kr.begin, kr.end, dtype,
                       chunk->mutable_scores());
          }
        }
      }
    }
  }
  if (request.head_summaries()) {
    const interpret::InductionLayout induction{request.induction_period(),
                                               request.induction_start()};
    if (out.size() == 1) out.emplace_back();  // summaries travel after the info message
    v1::AttentionMapsResponse& last = out.back();
    for (int l : layers) {
      const std::vector<interpret::HeadScores> s =
          interpret::ScoreHeads(tape->layers[l].probs, c.num_heads, n, n, 0, induction);
      for (int h : heads) {
        v1::HeadSummary* hs = last.add_head_summaries();
        hs->set_layer(l);
        hs->set_head(h);
        hs->set_entropy(s[h].entropy);
        hs->set_prev_token(s[h].prev_token);
        hs->set_sink(s[h].sink);
        hs->set_induction(s[h].induction);
      }
    }
  }
  return absl::OkStatus();
}

// The asked-for gradient tensors of one probe.
template <typename T>
absl::Status AddGradientTensors(const v1::GradientProbeRequest& request, const Model& model,
                                const Tape<T>& tape, const Gradients<T>& g,
                                const std::vector<int>& layers, const std::vector<int>& heads,
                                v1::DType dtype, v1::GradientProbeResponse* response) {
  const ModelConfig& c = model.config;
  auto* out = response->mutable_tensors();
  const int n = tape.n, tk = tape.num_keys, H = c.num_heads, hd = c.head_dim;
  const int group = c.num_heads / c.num_kv_heads;
  std::set<int> kv_heads;
  for (int h : heads) kv_heads.insert(h / group);
  for (int l : layers) {
    const std::vector<double> atg = request.attention_times_gradient()
                                        ? interpret::AttentionTimesGradient(tape, g, l)
                                        : std::vector<double>();
    // q and k before RoPE: the gradients at hook_q / hook_k
    std::vector<T> pre_q, pre_k;
    for (auto [asked, hook, pre] : {std::tuple{request.q(), interpret::Hook::kQ, &pre_q},
                                    std::tuple{request.k(), interpret::Hook::kK, &pre_k}}) {
      if (!asked) continue;
      auto x = interpret::ReadHookGradient(model, tape, g, hook, l);
      if (!x.ok()) return x.status();
      *pre = *std::move(x);
    }
    for (int h : heads) {
      if (request.scores()) {
        AddTensor("grad.scores", l, h, {n, tk}, MapSlice(g.scores[l], h, n, tk), dtype, out);
      }
      if (request.probs()) {
        AddTensor("grad.probs", l, h, {n, tk}, MapSlice(g.probs[l], h, n, tk), dtype, out);
      }
      if (request.q()) {
        const std::vector<T> x = HeadSlice(pre_q, n, H, hd, h);
        AddTensor("grad.q", l, h, {n, hd}, absl::MakeConstSpan(x), dtype, out);
      }
      if (request.rot_q()) {
        const std::vector<T> x = HeadSlice(g.q[l], n, H, hd, h);
        AddTensor("grad.rot_q", l, h, {n, hd}, absl::MakeConstSpan(x), dtype, out);
      }
      if (request.attn_out()) {
        const std::vector<T> x = HeadSlice(g.attn_out[l], n, H, hd, h);
        AddTensor("grad.attn_out", l, h, {n, hd}, absl::MakeConstSpan(x), dtype, out);
      }
      if (request.attention_times_gradient()) {
        AddTensor("attention_x_gradient", l, h, {n, tk}, MapSlice(atg, h, n, tk), dtype, out);
      }
    }
    for (int kvh : kv_heads) {
      if (request.k()) {
        const std::vector<T> x = HeadSlice(pre_k, tk, c.num_kv_heads, hd, kvh);
        AddTensor("grad.k", l, kvh, {tk, hd}, absl::MakeConstSpan(x), dtype, out);
      }
      if (request.rot_k()) {
        const std::vector<T> x = HeadSlice(g.k[l], tk, c.num_kv_heads, hd, kvh);
        AddTensor("grad.rot_k", l, kvh, {tk, hd}, absl::MakeConstSpan(x), dtype, out);
      }
      if (request.v()) {
        const std::vector<T> x = HeadSlice(g.v[l], tk, c.num_kv_heads, hd, kvh);
        AddTensor("grad.v", l, kvh, {tk, hd}, absl::MakeConstSpan(x), dtype, out);
      }
    }
  }
  if (request.residual()) {
    std::vector<int> resid_layers = layers;
    resid_layers.push_back(c.num_layers);
    for (int l : resid_layers) {
      AddTensor("grad.residual", l, -1, {n, c.dim}, absl::MakeConstSpan(g.residual[l]), dtype, out);
    }
  }
  if (request.embeddings()) {
    AddTensor("grad.embeddings", -1, -1, {n, c.dim}, absl::MakeConstSpan(g.embeddings()), dtype,
              out);
    const std::vector<double> saliency = interpret::InputTimesGradient(tape, g, c.dim);
    AddTensor("saliency", -1, -1, {n}, absl::MakeConstSpan(saliency), dtype, out);
  }
  if (request.has_param_layer()) {
    // Parameter gradients are accumulated in double whatever the precision.
    const interpret::ParamGradients& p = g.params;
    const int64_t D = c.dim, QD = c.q_dim(), KVD = c.kv_dim();
    AddTensor("grad.wq", p.layer, -1, {QD, D}, absl::MakeConstSpan(p.wq), v1::DTYPE_FP64, out);
    AddTensor("grad.wk", p.layer, -1, {KVD, D}, absl::MakeConstSpan(p.wk), v1::DTYPE_FP64, out);
    AddTensor("grad.wv", p.layer, -1, {KVD, D}, absl::MakeConstSpan(p.wv), v1::DTYPE_FP64, out);
    AddTensor("grad.wo", p.layer, -1, {D, QD}, absl::MakeConstSpan(p.wo), v1::DTYPE_FP64, out);
  }
  return absl::OkStatus();
}

// The tensor kinds `verify` samples: those returned (the residual when none is).
std::vector<interpret::FdTensor> VerifyKinds(const v1::GradientProbeRequest& r) {
  using K = interpret::TensorKind;
  std::vector<interpret::FdTensor> kinds;
  if (r.scores()) kinds.push_back({K::kScores});
  if (r.probs() || r.attention_times_gradient()) kinds.push_back({K::kProbs});
  if (r.q()) kinds.push_back({K::kQ, /*before_rope=*/true});
  if (r.k()) kinds.push_back({K::kK, /*before_rope=*/true});
  if (r.rot_q()) kinds.push_back({K::kQ});
  if (r.rot_k()) kinds.push_back({K::kK});
  if (r.v()) kinds.push_back({K::kV});
  if (r.attn_out()) kinds.push_back({K::kAttnOut});
  if (r.residual() || r.embeddings() || kinds.empty()) kinds.push_back({K::kResidual});
  return kinds;
}

template <typename T>
absl::Status ProbeAt(const InterpContext& ctx, const v1::GradientProbeRequest& request,
                     const SequenceSpec& seq, const interpret::Objective& objective,
                     const std::vector<int>& layers, const std::vector<int>& heads,
                     std::optional<int> param_layer,
                     const std::vector<std::pair<interpret::Hook, int>>& hook_reads,
                     v1::GradientProbeResponse* response) {
  const Model& model = ctx.model();
  const ModelConfig& c = model.config;
  const SequenceInput<T> in = InputOf<T>(seq);
  const int num = static_cast<int>(seq.tokens.size());
  // With verify, the finite differences' fp64 tapes come one at a time beside this one; the
  // FFN's gradients are kept for the layers whose mlp_ hooks are asked for.
  interpret::BackwardOptions options;
  if (param_layer.has_value()) options.param_layer = *param_layer;
  for (const auto& [hook, l] : hook_reads) {
    if (interpret::HookGradientNeedsFfn(hook) &&
        std::find(options.ffn_layers.begin(), options.ffn_layers.end(), l) ==
            options.ffn_layers.end()) {
      options.ffn_layers.push_back(l);
    }
  }
  const int64_t work = WorkBytes<T>(c, num, num, 1, true, param_layer.has_value()) +
                       (request.verify() ? WorkBytes<double>(c, num, num, 1, false) : 0) +
                       interpret::FfnGradientBytes(c, num, static_cast<int>(sizeof(T)),
                                                   static_cast<int>(options.ffn_layers.size()));
  if (absl::Status s = CheckTapeBytes(work, num, ctx.limits, "GradientProbe"); !s.ok()) return s;
  auto tape = interpret::RunForward(model, BackendOf<T>(ctx.backends), in);
  if (!tape.ok()) return tape.status();
  auto g = interpret::ObjectiveGradients(model, *tape, objective, options,
                                         BackwardOpsOf<T>(ctx.backends));
  if (!g.ok()) return g.status();
  response->set_objective(interpret::EvaluateObjective(objective, model.config, *tape));
  const v1::DType dtype = std::is_same_v<T, double> ? v1::DTYPE_FP64 : v1::DTYPE_FP32;
  if (absl::Status s =
          AddGradientTensors(request, model, *tape, *g, layers, heads, dtype, response);
      !s.ok()) {
    return s;
  }
  std::vector<std::vector<double>> hook_values;  // for verify
  for (const auto& [hook, l] : hook_reads) {
    auto values = interpret::ReadHookGradient(model, *tape, *g, hook, l);
    if (!values.ok()) return values.status();
    AddTensor(std::string(interpret::HookName(hook)), l, -1,
              interpret::HookShape(model.config, hook, num, num), absl::MakeConstSpan(*values),
              dtype, response->mutable_hook_gradients());
    if (request.verify()) hook_values.emplace_back(values->begin(), values->end());
  }
  if (absl::Status s = CheckBytes(static_cast<int64_t>(response->ByteSizeLong()), ctx.limits,
                                  "the gradient probe");
      !s.ok()) {
    return s;
  }
  if (request.verify()) {
    interpret::FdOptions fd;
    fd.samples_per_tensor =
        request.verify_samples() > 0 ? request.verify_samples() : kDefaultVerifySamples;
    fd.seed = request.verify_seed() != 0 ? request.verify_seed() : 1;
    fd.tensors = VerifyKinds(request);
    const SequenceInput<double> in64 = interpret::ToDouble(in);
    auto report = interpret::CheckByFiniteDifferences(model, in64, objective, *g, fd);
    if (!report.ok()) return report.status();
    v1::VerifyReport* v = response->mutable_verify();
    v->set_max_abs_err(report->max_abs_err);
    v->set_max_rel_err(report->max_rel_err);
    v->set_num_forwards(report->num_forwards);
    for (const interpret::FdTensorReport& t : report->tensors) {
      v1::VerifyTensorReport* tr = v->add_tensors();
      const bool rotated =
          (t.kind == interpret::TensorKind::kQ || t.kind == interpret::TensorKind::kK) &&
          !t.before_rope;
      tr->set_name(
          absl::StrCat(rotated ? "rot_" : "", std::string(interpret::TensorKindName(t.kind))));
      tr->set_samples(static_cast<int>(t.samples.size()));
      tr->set_max_abs_err(t.max_abs_err);
      tr->set_max_rel_err(t.max_rel_err);
    }
    // The hooks', each at its layer; those no edit moves one entry of alone get 0 samples.
    for (size_t k = 0; k < hook_reads.size(); ++k) {
      const auto& [hook, l] = hook_reads[k];
      v1::VerifyTensorReport* tr = v->add_tensors();
      tr->set_name(interpret::HookFullName(hook, l));
      if (!interpret::HookHasFiniteDifference(hook)) continue;
      auto h = interpret::CheckHookGradientByFiniteDifferences(model, in64, objective, hook, l,
                                                               hook_values[k], fd);
      if (!h.ok()) return h.status();
      tr->set_samples(static_cast<int>(h->samples.size()));
      tr->set_max_abs_err(h->max_abs_err);
      tr->set_max_rel_err(h->max_rel_err);
      v->set_max_abs_err(std::max(v->max_abs_err(), h->max_abs_err));
      v->set_max_rel_err(std::max(v->max_rel_err(), h->max_rel_err));
      v->set_num_forwards(v->num_forwards() + h->num_forwards);
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status InterveneAt(const InterpContext& ctx, const v1::InterveneRequest& request,
                         const SequenceSpec& seq, interpret::Edits edits,
                         const std::vector<interpret::TokenTarget>& targets,
                         v1::InterveneResponse* response) {
  const Model& model = ctx.model();
  const ModelConfig& c = model.config;
  kernels::Backend<T>& be = BackendOf<T>(ctx.backends);
  const int n = static_cast<int>(seq.tokens.size());
  // The clean and the edited tapes are alive together.
  if (absl::Status s = CheckTapeBytes(WorkBytes<T>(c, n, n, 2, false), n, ctx.limits, "Intervene");
      !s.ok()) {
    return s;
  }
  if (request.patches_size() > 0 || request.head_patches_size() > 0) {
    auto source = Resolve(ctx, request.patch_source(), "patch_source", true);
    if (!source.ok()) return source.status();
    const int sn = static_cast<int>(source->tokens.size());
    if (absl::Status s = CheckTapeBytes(WorkBytes<T>(c, sn, sn, 1, false), sn, ctx.limits,
                                        "Intervene's patch_source");
        !s.ok()) {
      return s;
    }
    auto source_tape = interpret::RunForward(model, be, InputOf<T>(*source));
    if (!source_tape.ok()) return source_tape.status();
    for (int k = 0; k < request.patches_size(); ++k) {
      const v1::ResidualPatch& p = request.patches(k);
      const std::string name = absl::StrCat("patches[", k, "]");
      auto target = ToPatchTarget(p.hook(), name + ".hook", false);
      if (!target.ok()) return target.status();
      int64_t layer = p.layer() < 0 ? int64_t{p.layer()} + c.num_layers : p.layer();
      if (target->site == interpret::PatchSite::kResidPre && !target->next_layer) {
        // 0 … L (L: the model's output); negative counts from L as every layer does (−1:
        // the stream entering the last layer).
        if (layer < 0 || layer > c.num_layers) {
          return absl::InvalidArgumentError(
              absl::StrCat(name, ".layer = ", p.layer(), " must be in [-", c.num_layers, ", ",
                           c.num_layers, "] (negative: from the end, -1 the last)"));
        }
      } else {
        absl::StatusOr<int> l = ToIndex(p.layer(), c.num_layers, name + ".layer");
        if (!l.ok()) return l.status();
        layer = *l + (target->next_layer ? 1 : 0);  // resid_post of l is resid_pre of l + 1
      }
      absl::StatusOr<int> position = ToIndex(p.position(), n, name + ".position");
      if (!position.ok()) return position.status();
      absl::StatusOr<int> source_position =
          ToIndex(p.source_position(), source_tape->n, name + ".source_position");
      if (!source_position.ok()) return source_position.status();
      auto patch = interpret::PatchFrom(*source_tape, c, static_cast<int>(layer), *source_position,
                                        *position, target->site);
      if (!patch.ok()) return patch.status();
      edits.patches.push_back(*std::move(patch));
    }
    for (int k = 0; k < request.head_patches_size(); ++k) {
      const v1::HeadPatch& p = request.head_patches(k);
      const std::string name = absl::StrCat("head_patches[", k, "]");
      auto target = ToPatchTarget(p.hook().empty() ? "z" : p.hook(), name + ".hook", true);
      if (!target.ok()) return target.status();
      if (target->kind != interpret::PatchTarget::Kind::kHeadVector) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ".hook = \"", p.hook(),
                         "\": not a head's vector (q, k, v, z; a pattern is a row_overrides "
                         "entry, a stream site a patches one)"));
      }
      absl::StatusOr<int> layer = ToIndex(p.layer(), c.num_layers, name + ".layer");
      if (!layer.ok()) return layer.status();
      absl::StatusOr<int> head = ToIndex(p.head(), target->Heads(c), name + ".head");
      if (!head.ok()) return head.status();
      absl::StatusOr<int> position = ToIndex(p.position(), n, name + ".position");
      if (!position.ok()) return position.status();
      absl::StatusOr<int> source_position =
          ToIndex(p.source_position(), source_tape->n, name + ".source_position");
      if (!source_position.ok()) return source_position.status();
      auto patch = interpret::HeadPatchFrom(*source_tape, c, *layer, *head, *source_position,
                                            *position, target->tensor);
      if (!patch.ok()) return patch.status();
      edits.head_patches.push_back(*std::move(patch));
    }
  }
  auto r = interpret::Intervene(model, be, InputOf<T>(seq), edits, targets);
  if (!r.ok()) return r.status();
  const int64_t V = c.vocab_size;
  for (size_t k = 0; k < targets.size(); ++k) {
    v1::TargetEffect* e = response->add_effects();
    e->mutable_target()->set_position(targets[k].row);
    e->mutable_target()->set_token(targets[k].token);
    const int64_t at = targets[k].row * V + targets[k].token;
    e->set_clean_logit(r->clean_logits[at]);
    e->set_edited_logit(r->edited_logits[at]);
    e->set_clean_logprob(r->clean_logprobs[k]);
    e->set_edited_logprob(r->edited_logprobs[k]);
  }
  double change = 0;
  for (size_t i = 0; i < r->clean_logits.size(); ++i) {
    change = std::max(change, std::abs(r->clean_logits[i] - r->edited_logits[i]));
  }
  response->set_max_abs_logit_change(change);
  return absl::OkStatus();
}

template <typename T>
absl::Status LensAt(const InterpContext& ctx, const SequenceSpec& seq,
                    const std::vector<int>& positions, int k, v1::LogitLensResponse* response) {
  const Model& model = ctx.model();
  kernels::Backend<T>& be = BackendOf<T>(ctx.backends);
  const int num = static_cast<int>(seq.tokens.size());
  if (absl::Status s = CheckTapeBytes(WorkBytes<T>(model.config, num, num, 1, false), num,
                                      ctx.limits, "LogitLens");
      !s.ok()) {
    return s;
  }
  auto tape = interpret::RunForward(model, be, InputOf<T>(seq));
  if (!tape.ok()) return tape.status();
  auto lens = interpret::LogitLens(model, be, *tape, k);
  if (!lens.ok()) return lens.status();
  for (size_t l = 0; l < lens->size(); ++l) {
    for (int p : positions) {
      v1::LensRow* row = response->add_rows();
      row->set_layer(static_cast<int>(l));
      row->set_position(p);
      for (const interpret::LensEntry& e : (*lens)[l][p]) {
        v1::LensToken* t = row->add_top();
        t->set_token(e.token);
        if (model.tokenizer != nullptr) t->set_piece(std::string(model.tokenizer->Piece(e.token)));
        t->set_logit(e.logit);
        t->set_logprob(e.logprob);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<v1::AttentionMapsResponse>> RunAttentionMaps(
    const InterpContext& ctx, const v1::AttentionMapsRequest& request) {
  const ModelConfig& c = ctx.model().config;
  auto seq = Resolve(ctx, request.input(), "input", true);
  if (!seq.ok()) return seq.status();
  const int n = static_cast<int>(seq->tokens.size());
  auto layers = ToIndexList(request.layers(), c.num_layers, "layers");
  if (!layers.ok()) return layers.status();
  auto heads = ToIndexList(request.heads(), c.num_heads, "heads");
  if (!heads.ok()) return heads.status();
  if (absl::Status s = CheckLayerHeads(layers->size(), heads->size(), ctx.limits); !s.ok()) {
    return s;
  }
  auto qr = ToRange(request.queries(), n, "queries");
  if (!qr.ok()) return qr.status();
  auto kr = ToRange(request.keys(), n, "keys");
  if (!kr.ok()) return kr.status();
  auto dtype = ToWireDType(request.dtype(), "dtype");
  if (!dtype.ok()) return dtype.status();
  const bool probs = !request.probabilities_off();
  if (!probs && !request.scores() && !request.head_summaries()) {
    return absl::InvalidArgumentError(
        "nothing asked for: probabilities_off without scores or head_summaries");
  }
  if (request.induction_period() < 0 || request.induction_start() < 0 ||
      (request.induction_period() > 0 &&
       int64_t{request.induction_start()} + 2 * int64_t{request.induction_period()} > n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "induction_start = ", request.induction_start(), " and induction_period = ",
        request.induction_period(), " must satisfy start + 2 * period <= ", n, " positions"));
  }
  const int64_t bytes = static_cast<int64_t>(layers->size()) * heads->size() * qr->size() *
                        kr->size() * DTypeBytes(*dtype) *
                        ((probs ? 1 : 0) + (request.scores() ? 1 : 0));
  if (absl::Status s = CheckBytes(bytes, ctx.limits, "the attention maps"); !s.ok()) return s;

  std::vector<v1::AttentionMapsResponse> out(1);
  v1::AttentionInfo* info = out[0].mutable_info();
  const bool fp64 = WantsFp64(request.precision());
  info->set_precision(PrecisionOf(fp64));
  info->set_dtype(*dtype);
  info->mutable_token_ids()->Add(seq->tokens.begin(), seq->tokens.end());
  info->mutable_layers()->Add(layers->begin(), layers->end());
  info->mutable_heads()->Add(heads->begin(), heads->end());
  info->mutable_queries()->set_begin(qr->begin);
  info->mutable_queries()->set_end(qr->end);
  info->mutable_keys()->set_begin(kr->begin);
  info->mutable_keys()->set_end(kr->end);
  info->set_total_bytes(bytes);
  const absl::Status s =
      fp64 ? AttentionMapsAt<double>(ctx, request, *seq, *layers, *heads, *qr, *kr, *dtype, out)
           : AttentionMapsAt<float>(ctx, request, *seq, *layers, *heads, *qr, *kr, *dtype, out);
  if (!s.ok()) return s;
  return out;
}

absl::Status RunGradientProbe(const InterpContext& ctx, const v1::GradientProbeRequest& request,
                              v1::GradientProbeResponse* response) {
  const ModelConfig& c = ctx.model().config;
  auto seq = Resolve(ctx, request.input(), "input", false);
  if (!seq.ok()) return seq.status();
  const int n = static_cast<int>(seq->tokens.size());
  auto objective = ToObjective(request, c, n, ctx.limits);
  if (!objective.ok()) return objective.status();
  auto layers = ToIndexList(request.layers(), c.num_layers, "layers");
  if (!layers.ok()) return layers.status();
  auto heads = ToIndexList(request.heads(), c.num_heads, "heads");
  if (!heads.ok()) return heads.status();
  if (absl::Status s = CheckLayerHeads(layers->size(), heads->size(), ctx.limits); !s.ok()) {
    return s;
  }
  std::optional<int> param_layer;
  if (request.has_param_layer()) {
    absl::StatusOr<int> l = ToIndex(request.param_layer(), c.num_layers, "param_layer");
    if (!l.ok()) return l.status();
    param_layer = *l;
  }
  for (auto [asked, hook] : {std::pair{request.rot_q(), interpret::Hook::kRotQ},
                             std::pair{request.rot_k(), interpret::Hook::kRotK}}) {
    if (absl::Status s = interpret::CheckModelHasHook(c, hook); asked && !s.ok()) return s;
  }
  if (request.verify_samples() < 0 || request.verify_samples() > ctx.limits.max_verify_samples) {
    return absl::InvalidArgumentError(absl::StrCat("verify_samples = ", request.verify_samples(),
                                                   " must be in [0, ",
                                                   ctx.limits.max_verify_samples, "]"));
  }
  auto hook_reads = ToHookReads(request.hooks(), c, *layers);
  if (!hook_reads.ok()) return hook_reads.status();
  for (const auto& [hook, l] : *hook_reads) {
    if (absl::Status s = interpret::CheckHookHasGradient(hook); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("hooks: ", s.message()));
    }
  }
  const bool fp64 = WantsFp64(request.precision());
  response->set_precision(PrecisionOf(fp64));
  response->mutable_token_ids()->Add(seq->tokens.begin(), seq->tokens.end());
  return fp64 ? ProbeAt<double>(ctx, request, *seq, *objective, *layers, *heads, param_layer,
                                *hook_reads, response)
              : ProbeAt<float>(ctx, request, *seq, *objective, *layers, *heads, param_layer,
                               *hook_reads, response);
}

absl::Status RunCachedKvProbe(const InterpContext& ctx, const v1::CachedKvProbeRequest& request,
                              v1::CachedKvProbeResponse* response) {
  const Model& model = ctx.model();
  const ModelConfig& c = model.config;
  if (request.target() < 0 || request.target() >= c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target = ", request.target(), " must be a token id in [0, ", c.vocab_size, ")"));
  }
  for (int i = 0; i < request.new_tokens_size(); ++i) {
    if (request.new_tokens(i) < 0 || request.new_tokens(i) >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("new_tokens[", i, "] = ", request.new_tokens(i),
                       " must be a token id in [0, ", c.vocab_size, ")"));
    }
  }
  const bool fp64 = WantsFp64(request.precision());
  response->set_precision(PrecisionOf(fp64));
  absl::Status status;
  const absl::Status read =
      ctx.engine.ReadSession(request.session_id(), [&](const Engine::SessionView& v) {
        const int P = v.num_cached;
        if (P < 1) {
          status = absl::FailedPreconditionError(absl::StrCat(
              "session ", request.session_id(), " has no cached tokens yet (run Generate on it)"));
          return;
        }
        // Without new tokens, the session's uncached tail (e.g. its last generated token).
        std::vector<int32_t> tokens(request.new_tokens().begin(), request.new_tokens().end());
        if (tokens.empty()) tokens.assign(v.tokens.begin() + P, v.tokens.end());
        if (tokens.empty()) {
          status = absl::InvalidArgumentError(
              "new_tokens: none given and the session has none uncached");
          return;
        }
        const int64_t total = P + static_cast<int64_t>(tokens.size());
        if (total > ctx.limits.max_positions || total > c.max_seq_len) {
          status = absl::InvalidArgumentError(
              absl::StrCat("session (", P, " cached) + new_tokens (", tokens.size(), ") = ", total,
                           " positions exceeds --max-interp-positions = ", ctx.limits.max_positions,
                           " or the context length ", c.max_seq_len));
          return;
        }
        const int num = static_cast<int>(tokens.size()), keys = static_cast<int>(total);
        status = CheckTapeBytes(fp64 ? WorkBytes<double>(c, num, keys, 1, true)
                                     : WorkBytes<float>(c, num, keys, 1, true),
                                keys, ctx.limits, "CachedKvProbe");
        if (!status.ok()) return;
        interpret::KvProbeRequest kr;
        kr.block_table = v.block_table;
        kr.num_cached = P;
        kr.new_tokens = tokens;
        kr.target = request.target();
        const int KVD = c.kv_dim();
        response->set_num_cached(P);
        if (!fp64) {
          // The worker's fp32 backend: its GPU (staged) with --interp-device cuda.
          auto r = interpret::CachedKvProbe(model, ctx.backends.fp32(), *v.cache, kr,
                                            BackwardOpsOf<float>(ctx.backends));
          if (!r.ok()) {
            status = r.status();
            return;
          }
          response->set_objective(r->objective);
          for (int l = 0; l < c.num_layers; ++l) {
            AddTensor("grad.cached_k", l, -1, {P, KVD}, absl::MakeConstSpan(r->dk[l]),
                      v1::DTYPE_FP32, response->mutable_tensors());
            AddTensor("grad.cached_v", l, -1, {P, KVD}, absl::MakeConstSpan(r->dv[l]),
                      v1::DTYPE_FP32, response->mutable_tensors());
          }
          return;
        }
        // fp64: the cached fp32 K/V, widened, as leaves of a double tape over the new tokens.
        auto in32 = interpret::InputFromCache(c, *v.cache, kr);
        if (!in32.ok()) {
          status = in32.status();
          return;
        }
        const SequenceInput<double> in = interpret::ToDouble(*in32);
        auto tape = interpret::RunForward(model, ctx.backends.f64, in);
        if (!tape.ok()) {
          status = tape.status();
          return;
        }
        const interpret::Objective o = interpret::Objective::LogProb(
            {{static_cast<int>(tokens.size()) - 1, request.target()}});
        auto g = interpret::ObjectiveGradients(model, *tape, o);
        if (!g.ok()) {
          status = g.status();
          return;
        }
        response->set_objective(interpret::EvaluateObjective(o, c, *tape));
        for (int l = 0; l < c.num_layers; ++l) {
          AddTensor("grad.cached_k", l, -1, {P, KVD},
                    absl::MakeConstSpan(g->k[l]).subspan(0, static_cast<size_t>(P) * KVD),
                    v1::DTYPE_FP64, response->mutable_tensors());
          AddTensor("grad.cached_v", l, -1, {P, KVD},
                    absl::MakeConstSpan(g->v[l]).subspan(0, static_cast<size_t>(P) * KVD),
                    v1::DTYPE_FP64, response->mutable_tensors());
        }
      });
  if (!read.ok()) return read;
  if (!status.ok()) return status;
  return CheckBytes(static_cast<int64_t>(response->ByteSizeLong()), ctx.limits,
                    "the cached-KV probe");
}

absl::Status RunIntervene(const InterpContext& ctx, const v1::InterveneRequest& request,
                          v1::InterveneResponse* response) {
  const ModelConfig& c = ctx.model().config;
  auto seq = Resolve(ctx, request.input(), "input", true);
  if (!seq.ok()) return seq.status();
  const int n = static_cast<int>(seq->tokens.size());
  auto edits = ToEdits(request, c, n, ctx.limits);
  if (!edits.ok()) return edits.status();
  auto targets = ToTargets(request.targets(), c, n, ctx.limits, "targets");
  if (!targets.ok()) return targets.status();
  if ((request.patches_size() > 0 || request.head_patches_size() > 0) &&
      request.patch_source().prompt_case() == v1::PromptInput::PROMPT_NOT_SET) {
    return absl::InvalidArgumentError("patch_source: required with patches or head_patches");
  }
  const bool fp64 = WantsFp64(request.precision());
  response->set_precision(PrecisionOf(fp64));
  return fp64 ? InterveneAt<double>(ctx, request, *seq, *std::move(edits), *targets, response)
              : InterveneAt<float>(ctx, request, *seq, *std::move(edits), *targets, response);
}

absl::Status RunLogitLens(const InterpContext& ctx, const v1::LogitLensRequest& request,
                          v1::LogitLensResponse* response) {
  const ModelConfig& c = ctx.model().config;
  auto seq = Resolve(ctx, request.input(), "input", true);
  if (!seq.ok()) return seq.status();
  const int n = static_cast<int>(seq->tokens.size());
  std::vector<int> positions = {n - 1};
  if (request.positions_size() > 0) {
    if (request.positions_size() > ctx.limits.max_targets) {
      return absl::InvalidArgumentError(absl::StrCat("positions has ", request.positions_size(),
                                                     " entries, more than the server allows (",
                                                     ctx.limits.max_targets, ")"));
    }
    auto p = ToIndexList(request.positions(), n, "positions");
    if (!p.ok()) return p.status();
    positions = *std::move(p);
  }
  const int k = request.top_k() == 0 ? kDefaultTopK : request.top_k();
  if (k < 1 || k > std::min(ctx.limits.max_top_k, c.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat("top_k = ", request.top_k(), " must be in [1, ",
                                                   std::min(ctx.limits.max_top_k, c.vocab_size),
                                                   "]"));
  }
  const bool fp64 = WantsFp64(request.precision());
  response->set_precision(PrecisionOf(fp64));
  return fp64 ? LensAt<double>(ctx, *seq, positions, k, response)
              : LensAt<float>(ctx, *seq, positions, k, response);
}

}  // namespace kvlens::server
