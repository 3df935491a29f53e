// kvlens-cli attention | probe | intervene | attribute | lens | sae --server HOST:PORT
// (patch: patch_command.cc):
// kvlens.v1.Interpret from the terminal. Output is plain text meant for reading (matrices with 3
// decimals, one table per call); the Python client (clients/python) is the tool for plots and
// arrays.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "clients/cli/args.h"
#include "clients/cli/commands.h"
#include "clients/cli/interpret_flags.h"
#include "clients/cli/rpc_call.h"
#include "clients/cli/server_tokens.h"
#include "kvlens/v1/interpret.grpc.pb.h"

namespace kvlens::cli {

int AttentionCommand(int argc, char** argv) {
  std::vector<FlagSpec> specs = CommonSpecs();
  specs.push_back({"layers", "", "layers, e.g. \"0 -1\" (negative: from the end; default: all)"});
  specs.push_back({"heads", "", "query heads (negative: from the end; default: all)"});
  specs.push_back({"fp16", "", "fp16 on the wire", true});
  specs.push_back({"summaries", "", "per-head entropy, previous-token, sink, induction", true});
  specs.push_back({"induction-period", "0", "repeat period P for the induction score"});
  specs.push_back({"induction-start", "0", "position of the first repeated token"});
  specs.push_back({"max-print", "24", "print matrices up to this many positions"});
  absl::StatusOr<Args> args;
  if (int code = Prepare(argc, argv, "attention",
                         "Prints attention probabilities [layer][head][query][key] and "
                         "optionally per-head summaries.",
                         specs, args);
      code >= 0) {
    return code;
  }
  v1::AttentionMapsRequest request;
  if (absl::Status s = FillInput(*args, request.mutable_input()); !s.ok()) {
    return Fail("attention", std::string(s.message()), 2);
  }
  auto layers = ParseInts(args->Str("layers"), "layers");
  auto heads = ParseInts(args->Str("heads"), "heads");
  auto period = args->Int("induction-period", 0, 1 << 20);
  auto start = args->Int("induction-start", 0, 1 << 20);
  auto max_print = args->Int("max-print", 0, 1 << 20);
  for (const absl::Status& s :
       {layers.status(), heads.status(), period.status(), start.status(), max_print.status()}) {
    if (!s.ok()) return Fail("attention", std::string(s.message()), 2);
  }
  request.mutable_layers()->Add(layers->begin(), layers->end());
  request.mutable_heads()->Add(heads->begin(), heads->end());
  request.set_precision(PrecisionOf(*args));
  if (args->Switch("fp16")) request.set_dtype(v1::DTYPE_FP16);
  request.set_head_summaries(args->Switch("summaries"));
  request.set_induction_period(static_cast<int>(*period));
  request.set_induction_start(static_cast<int>(*start));
  grpc::ClientContext context;
  auto stub = Connect(*args, context);
  if (int code = RefuseNonUtf8("attention", request); code >= 0) return code;
  auto reader = stub->AttentionMaps(&context, request);
  v1::AttentionMapsResponse m;
  std::vector<int> heads_shown;  // as the server resolved them (a head may count from the end)
  while (reader->Read(&m)) {
    if (m.has_info()) {
      heads_shown.assign(m.info().heads().begin(), m.info().heads().end());
      std::printf("precision %s, %d tokens, %lld bytes\n", PrecisionName(m.info().precision()),
                  m.info().token_ids_size(), static_cast<long long>(m.info().total_bytes()));
      // Which token each query and key index is, "[position] text", when the matrices print.
      const std::vector<int32_t> ids(m.info().token_ids().begin(), m.info().token_ids().end());
      if (static_cast<int64_t>(ids.size()) <= *max_print) {
        absl::StatusOr<std::map<int32_t, std::string>> texts = ServerTokenTexts(*args, ids);
        if (!texts.ok()) {
          context.TryCancel();
          return Fail("attention", std::string(texts.status().message()), 1);
        }
        std::printf("tokens:");
        for (size_t i = 0; i < ids.size(); ++i) {
          std::printf(" [%zu] %s", i, Quoted(texts->at(ids[i])).c_str());
        }
        std::printf("\n");
      }
    }
    if (m.has_chunk() && !m.chunk().probs().empty()) {
      const v1::AttentionChunk& c = m.chunk();
      const std::vector<double> p = Decode(c.probs(), c.dtype());
      const bool print = c.num_keys() <= *max_print;
      for (int h = 0; h < c.num_heads(); ++h) {
        const int head = h < static_cast<int>(heads_shown.size()) ? heads_shown[h] : h;
        std::printf("layer %d head %d, queries %d..%d, keys %d..%d%s\n", c.layer(), head,
                    c.query_begin(), c.query_begin() + c.num_queries() - 1, c.key_begin(),
                    c.key_begin() + c.num_keys() - 1, print ? ":" : " (use --max-print)");
        if (!print) continue;
        for (int q = 0; q < c.num_queries(); ++q) {
          for (int k = 0; k < c.num_keys(); ++k) {
            std::printf(" %5.3f",
                        p[(static_cast<size_t>(h) * c.num_queries() + q) * c.num_keys() + k]);
          }
          std::printf("\n");
        }
      }
    }
    if (m.head_summaries_size() > 0) {
      std::printf("%5s %4s %9s %10s %7s %9s\n", "layer", "head", "entropy", "prev_token", "sink",
                  "induction");
      for (const v1::HeadSummary& s : m.head_summaries()) {
        std::printf("%5d %4d %9.4f %10.4f %7.4f %9.4f\n", s.layer(), s.head(), s.entropy(),
                    s.prev_token(), s.sink(), s.induction());
      }
    }
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return Fail("attention", RpcErrorText(status), 1);
  return 0;
}

namespace {

// The k (layer, position, neuron) entries of largest |mlp_post × dJ/dmlp_post|, from the
// Activations' and the probe's mlp_post tensors of each layer ([positions, d_mlp] each).
void PrintTopNeurons(const v1::ActivationsResponse& acts, const v1::GradientProbeResponse& grads,
                     int64_t k) {
  struct Entry {
    int layer, position, neuron;
    double act, grad;
  };
  std::vector<Entry> entries;
  for (const v1::Tensor& g : grads.hook_gradients()) {
    for (const v1::Tensor& a : acts.tensors()) {
      if (a.layer() != g.layer() || a.shape_size() != 2) continue;
      const std::vector<double> av = Decode(a.data(), a.dtype()), gv = Decode(g.data(), g.dtype());
      const int64_t width = a.shape(1);
      for (size_t e = 0; e < av.size() && e < gv.size(); ++e) {
        entries.push_back(
            {g.layer(), static_cast<int>(e / width), static_cast<int>(e % width), av[e], gv[e]});
      }
    }
  }
  const size_t shown = std::min(entries.size(), static_cast<size_t>(k));
  std::partial_sort(entries.begin(), entries.begin() + shown, entries.end(),
                    [](const Entry& x, const Entry& y) {
                      return std::abs(x.act * x.grad) > std::abs(y.act * y.grad);
                    });
  std::printf("%5s %8s %7s %12s %12s %12s\n", "layer", "position", "neuron", "act", "grad",
              "act x grad");
  for (size_t i = 0; i < shown; ++i) {
    const Entry& e = entries[i];
    std::printf("%5d %8d %7d %12.6f %12.6f %12.6f\n", e.layer, e.position, e.neuron, e.act, e.grad,
                e.act * e.grad);
  }
}

}  // namespace

int ProbeCommand(int argc, char** argv) {
  std::vector<FlagSpec> specs = CommonSpecs();
  specs.push_back(
      {"target-position", "-1",
       "position whose next-token log-prob is J (negative: from the end, -1 the last)"});
  specs.push_back({"target-token", "", "the token id of J = log p(token | position)"});
  specs.push_back({"target-text", "", "or the token as text (one token, e.g. \" Paris\")"});
  specs.push_back({"verify", "0", "check K random entries per tensor by finite differences"});
  specs.push_back({"neurons", "0",
                   "also the K (layer, position, neuron) entries of largest |mlp_post x "
                   "dJ/dmlp_post|: each FFN neuron's first-order share of J"});
  absl::StatusOr<Args> args;
  if (int code = Prepare(argc, argv, "probe",
                         "Gradient probe: J = log p(target | position); prints J, input x "
                         "gradient saliency per token, with --neurons the FFN neurons of "
                         "largest activation x gradient, and with --verify the FD errors.",
                         specs, args);
      code >= 0) {
    return code;
  }
  v1::GradientProbeRequest request;
  if (absl::Status s = FillInput(*args, request.mutable_input()); !s.ok()) {
    return Fail("probe", std::string(s.message()), 2);
  }
  v1::TokenTarget* t = request.mutable_log_prob()->add_targets();
  if (int code = FillTarget(*args, "probe", t); code >= 0) return code;
  auto verify = args->Int("verify", 0, 1 << 10);
  if (!verify.ok()) return Fail("probe", std::string(verify.status().message()), 2);
  auto neurons = args->Int("neurons", 0, 1 << 20);
  if (!neurons.ok()) return Fail("probe", std::string(neurons.status().message()), 2);
  request.set_precision(PrecisionOf(*args));
  request.set_embeddings(true);
  if (*verify > 0) {
    request.set_verify(true);
    request.set_verify_samples(static_cast<int>(*verify));
  }
  if (*neurons > 0) request.add_hooks("mlp_post");
  grpc::ClientContext context;
  auto stub = Connect(*args, context);
  v1::GradientProbeResponse response;
  if (int code = RefuseNonUtf8("probe", request); code >= 0) return code;
  const grpc::Status status = stub->GradientProbe(&context, request, &response);
  if (!status.ok()) return Fail("probe", RpcErrorText(status), 1);
  // The activations the gradients multiply: mlp_post of every layer, same prompt and precision.
  v1::ActivationsResponse acts;
  if (*neurons > 0) {
    v1::ActivationsRequest a;
    *a.mutable_input() = request.input();
    a.set_precision(request.precision());
    a.add_hooks("mlp_post");
    grpc::ClientContext a_context;
    SetDeadline(*args, a_context);
    const grpc::Status a_status = stub->Activations(&a_context, a, &acts);
    if (!a_status.ok()) return Fail("probe", RpcErrorText(a_status), 1);
  }
  const std::vector<int32_t> ids(response.token_ids().begin(), response.token_ids().end());
  const int position =
      t->position() < 0 ? static_cast<int>(ids.size()) + t->position() : t->position();
  std::printf("precision %s, J = log p(%d | position %d) = %.6f\n",
              PrecisionName(response.precision()), t->token(), position, response.objective());
  absl::StatusOr<std::map<int32_t, std::string>> texts = ServerTokenTexts(*args, ids);
  if (!texts.ok()) return Fail("probe", std::string(texts.status().message()), 1);
  for (const v1::Tensor& tensor : response.tensors()) {
    if (tensor.name() != "saliency") continue;
    const std::vector<double> s = Decode(tensor.data(), tensor.dtype());
    std::printf("%8s %8s %12s  %s\n", "position", "token", "input x grad", "text");
    for (size_t i = 0; i < s.size() && i < ids.size(); ++i) {
      std::printf("%8zu %8d %12.6f  %s\n", i, ids[i], s[i], Quoted(texts->at(ids[i])).c_str());
    }
  }
  if (*neurons > 0) PrintTopNeurons(acts, response, *neurons);
  if (response.has_verify()) {
    std::printf("verify: max abs error %.3g, max rel error %.3g (%d fp64 forwards)\n",
                response.verify().max_abs_err(), response.verify().max_rel_err(),
                response.verify().num_forwards());
    for (const v1::VerifyTensorReport& tr : response.verify().tensors()) {
      if (tr.samples() == 0) {
        std::printf("  %s: not checked (no edit moves one entry alone)\n", tr.name().c_str());
      } else {
        std::printf("  %s: %d samples, max abs error %.3g, max rel error %.3g\n", tr.name().c_str(),
                    tr.samples(), tr.max_abs_err(), tr.max_rel_err());
      }
    }
  }
  return 0;
}

int InterveneCommand(int argc, char** argv) {
  std::vector<FlagSpec> specs = CommonSpecs();
  specs.push_back({"ablate", "", "heads to ablate, \"LAYER:HEAD ...\" (negative: from the end)"});
  specs.push_back({"ablate-neurons", "",
                   "FFN neurons to ablate (mlp.hook_post), \"LAYER:NEURON[:POSITION] ...\" "
                   "(every position without one; negative layer, position: from the end)"});
  specs.push_back({"mean", "", "mean-ablate (default: zero)", true});
  specs.push_back({"target-position", "-1",
                   "position whose next-token log-prob is reported (negative: from the end)"});
  specs.push_back({"target-token", "", "token id reported"});
  specs.push_back({"target-text", "", "or the token as text (one token, e.g. \" Paris\")"});
  absl::StatusOr<Args> args;
  if (int code = Prepare(argc, argv, "intervene",
                         "Ablates heads and FFN neurons and prints the clean and edited logit "
                         "and log-prob of the target token.",
                         specs, args);
      code >= 0) {
    return code;
  }
  v1::InterveneRequest request;
  if (absl::Status s = FillInput(*args, request.mutable_input()); !s.ok()) {
    return Fail("intervene", std::string(s.message()), 2);
  }
  for (absl::string_view lh : absl::StrSplit(args->Str("ablate"), ' ', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(lh, ':');
    int layer = 0, head = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &layer) ||
        !absl::SimpleAtoi(parts[1], &head)) {
      return Fail("intervene", "--ablate: '" + std::string(lh) + "' is not LAYER:HEAD", 2);
    }
    v1::HeadAblation* a = request.add_ablations();
    a->set_layer(layer);
    a->set_head(head);
    a->set_mode(args->Switch("mean") ? v1::HeadAblation::MODE_MEAN : v1::HeadAblation::MODE_ZERO);
  }
  for (absl::string_view ln : absl::StrSplit(args->Str("ablate-neurons"), ' ', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(ln, ':');
    int layer = 0, neuron = 0, position = 0;
    if ((parts.size() != 2 && parts.size() != 3) || !absl::SimpleAtoi(parts[0], &layer) ||
        !absl::SimpleAtoi(parts[1], &neuron) ||
        (parts.size() == 3 && !absl::SimpleAtoi(parts[2], &position))) {
      return Fail("intervene",
                  "--ablate-neurons: '" + std::string(ln) + "' is not LAYER:NEURON[:POSITION]", 2);
    }
    v1::NeuronAblation* a = request.add_neuron_ablations();
    a->set_layer(layer);
    a->set_neuron(neuron);
    if (parts.size() == 3) a->set_position(position);
    a->set_mode(args->Switch("mean") ? v1::HeadAblation::MODE_MEAN : v1::HeadAblation::MODE_ZERO);
  }
  if (request.ablations_size() == 0 && request.neuron_ablations_size() == 0) {
    return Fail("intervene", "give --ablate (heads) or --ablate-neurons (FFN neurons)", 2);
  }
  if (int code = FillTarget(*args, "intervene", request.add_targets()); code >= 0) return code;
  request.set_precision(PrecisionOf(*args));
  grpc::ClientContext context;
  auto stub = Connect(*args, context);
  v1::InterveneResponse response;
  if (int code = RefuseNonUtf8("intervene", request); code >= 0) return code;
  const grpc::Status status = stub->Intervene(&context, request, &response);
  if (!status.ok()) return Fail("intervene", RpcErrorText(status), 1);
  std::printf("precision %s, %d head and %d neuron ablation(s); max |logit change| %.6f\n",
              PrecisionName(response.precision()), request.ablations_size(),
              request.neuron_ablations_size(), response.max_abs_logit_change());
  for (const v1::TargetEffect& e : response.effects()) {
    std::printf("token %d at position %d: logit %.6f -> %.6f, log-prob %.6f -> %.6f\n",
                e.target().token(), e.target().position(), e.clean_logit(), e.edited_logit(),
                e.clean_logprob(), e.edited_logprob());
  }
  return 0;
}

int AttributeCommand(int argc, char** argv) {
  std::vector<FlagSpec> specs = CommonSpecs();
  specs.push_back({"token", "", "token id whose logit is attributed"});
  specs.push_back({"token-text", "", "or that token as text (one token, e.g. \" Paris\")"});
  specs.push_back({"baseline", "-1", "token id whose logit is subtracted (-1: none)"});
  specs.push_back({"baseline-text", "", "or that token as text"});
  specs.push_back(
      {"position", "-1",
       "position whose next-token logit is read (negative: from the end, -1 the last)"});
  specs.push_back({"heads", "", "also split each layer's attention by head", true});
  specs.push_back({"top-neurons", "0", "per layer, the FFN neurons of largest |share|"});
  specs.push_back({"top", "10", "print this many heads, largest |share| first"});
  absl::StatusOr<Args> args;
  if (int code = Prepare(argc, argv, "attribute",
                         "Direct logit attribution: the logit of --token (minus --baseline's) "
                         "split into what the embeddings and each layer's attention, heads, "
                         "FFN and neurons wrote into the residual stream (final norm's scale "
                         "frozen).",
                         specs, args);
      code >= 0) {
    return code;
  }
  v1::LogitAttributionRequest request;
  if (absl::Status s = FillInput(*args, request.mutable_input()); !s.ok()) {
    return Fail("attribute", std::string(s.message()), 2);
  }
  auto token = TokenFlag(*args, "token", "token-text", /*required=*/true);
  auto baseline = TokenFlag(*args, "baseline", "baseline-text", /*required=*/false);
  auto position = args->Int("position", -kMaxPosition, kMaxPosition);
  auto neurons = args->Int("top-neurons", 0, 1 << 20);
  auto top = args->Int("top", 0, 1 << 20);
  for (const absl::Status& s :
       {token.status(), baseline.status(), position.status(), neurons.status(), top.status()}) {
    if (!s.ok()) return Fail("attribute", s);
  }
  request.set_token(static_cast<int>(*token));
  if (*baseline >= 0) request.set_baseline_token(static_cast<int>(*baseline));
  request.set_position(static_cast<int>(*position));
  request.set_heads(args->Switch("heads"));
  request.set_top_neurons(static_cast<int>(*neurons));
  request.set_precision(PrecisionOf(*args));
  grpc::ClientContext context;
  auto stub = Connect(*args, context);
  v1::LogitAttributionResponse response;
  if (int code = RefuseNonUtf8("attribute", request); code >= 0) return code;
  const grpc::Status status = stub->LogitAttribution(&context, request, &response);
  if (!status.ok()) return Fail("attribute", RpcErrorText(status), 1);
  std::printf("precision %s, position %d: logit %.6f, sum of shares %.6f, final norm scale %.6g\n",
              PrecisionName(response.precision()), response.position(), response.logit(),
              response.total(), response.final_norm_scale());
  auto print = [](const v1::Attribution& a) {
    std::printf("%16s %5s %6s %12.6f\n", a.component().c_str(),
                a.layer() < 0 ? "-" : std::to_string(a.layer()).c_str(),
                a.index() < 0 ? "-" : std::to_string(a.index()).c_str(), a.value());
  };
  std::printf("%16s %5s %6s %12s\n", "component", "layer", "index", "share");
  for (const v1::Attribution& a : response.components()) print(a);
  if (response.heads_size() > 0) {
    std::vector<v1::Attribution> heads(response.heads().begin(), response.heads().end());
    std::erase_if(heads, [](const v1::Attribution& a) { return a.component() != "head"; });
    std::sort(heads.begin(), heads.end(), [](const v1::Attribution& a, const v1::Attribution& b) {
      return std::abs(a.value()) > std::abs(b.value());
    });
    std::printf("heads, largest |share| first:\n");
    for (size_t i = 0; i < heads.size() && i < static_cast<size_t>(*top); ++i) print(heads[i]);
  }
  if (response.neurons_size() > 0) {
    std::printf("neurons:\n");
    for (const v1::Attribution& a : response.neurons()) print(a);
  }
  return 0;
}

int LensCommand(int argc, char** argv) {
  std::vector<FlagSpec> specs = CommonSpecs();
  specs.push_back(
      {"positions", "",
       "positions whose next token is read, \"2 -1\" (negative: from the end; default: the last)"});
  specs.push_back({"top-k", "5", "tokens printed per layer, most likely first"});
  absl::StatusOr<Args> args;
  if (int code = Prepare(argc, argv, "lens",
                         "Logit lens: at each layer's residual stream (0: the embeddings; L: "
                         "the model's own output), the next tokens the final norm and "
                         "unembedding read from it, with their log-probabilities.",
                         specs, args);
      code >= 0) {
    return code;
  }
  v1::LogitLensRequest request;
  if (absl::Status s = FillInput(*args, request.mutable_input()); !s.ok()) {
    return Fail("lens", std::string(s.message()), 2);
  }
  auto positions = ParseInts(args->Str("positions"), "positions");
  auto top_k = args->Int("top-k", 1, 100);
  for (const absl::Status& s : {positions.status(), top_k.status()}) {
    if (!s.ok()) return Fail("lens", std::string(s.message()), 2);
  }
  request.mutable_positions()->Add(positions->begin(), positions->end());
  request.set_top_k(static_cast<int>(*top_k));
  request.set_precision(PrecisionOf(*args));
  if (int code = RefuseNonUtf8("lens", request); code >= 0) return code;
  grpc::ClientContext context;
  auto stub = Connect(*args, context);
  v1::LogitLensResponse response;
  const grpc::Status status = stub->LogitLens(&context, request, &response);
  if (!status.ok()) return Fail("lens", RpcErrorText(status), 1);
  std::printf("precision %s\n", PrecisionName(response.precision()));
  std::vector<int> order;  // the rows are layer-major: one table a position
  for (const v1::LensRow& row : response.rows()) {
    if (std::find(order.begin(), order.end(), row.position()) == order.end()) {
      order.push_back(row.position());
    }
  }
  std::vector<int32_t> ids;
  for (const v1::LensRow& row : response.rows()) {
    for (const v1::LensToken& t : row.top()) ids.push_back(t.token());
  }
  absl::StatusOr<std::map<int32_t, std::string>> texts = ServerTokenTexts(*args, ids);
  if (!texts.ok()) return Fail("lens", std::string(texts.status().message()), 1);
  for (int position : order) {
    std::printf("position %d:\n%6s  %s\n", position, "layer", "top tokens (log-prob)");
    for (const v1::LensRow& row : response.rows()) {
      if (row.position() != position) continue;
      std::printf("%6d ", row.layer());
      for (const v1::LensToken& t : row.top()) {
        std::printf(" %s %.3f", Quoted(texts->at(t.token())).c_str(), t.logprob());
      }
      std::printf("\n");
    }
  }
  return 0;
}

int SaeCommand(int argc, char** argv) {
  std::vector<FlagSpec> specs = CommonSpecs();
  specs.push_back({"list", "", "list the server's SAEs and exit", true});
  specs.push_back({"sae", "", "the SAE's name (empty: the only one loaded)"});
  specs.push_back({"top-k", "5", "strongest features printed per position"});
  specs.push_back({"features", "", "feature ids whose activations are printed at every position"});
  absl::StatusOr<Args> args;
  if (int code = Prepare(argc, argv, "sae",
                         "Sparse-autoencoder features (kvlens-server --sae) of each position of "
                         "a prompt (its token's id and text): active count, reconstruction "
                         "error, the strongest features.",
                         specs, args);
      code >= 0) {
    return code;
  }
  grpc::ClientContext context;
  auto stub = Connect(*args, context);
  if (args->Switch("list")) {
    v1::ListSaesResponse list;
    const grpc::Status status = stub->ListSaes(&context, v1::ListSaesRequest(), &list);
    if (!status.ok()) return Fail("sae", RpcErrorText(status), 1);
    for (const v1::SaeInfo& s : list.saes()) {
      std::printf("%s: %s, %d -> %d features on %s (%s)\n", s.name().c_str(),
                  s.architecture().c_str(), s.d_in(), s.d_sae(), s.hook().c_str(),
                  s.path().c_str());
    }
    return 0;
  }
  v1::SaeFeaturesRequest request;
  if (absl::Status s = FillInput(*args, request.mutable_input()); !s.ok()) {
    return Fail("sae", std::string(s.message()), 2);
  }
  auto top_k = args->Int("top-k", 1, 1 << 20);
  auto features = ParseInts(args->Str("features"), "features");
  for (const absl::Status& s : {top_k.status(), features.status()}) {
    if (!s.ok()) return Fail("sae", std::string(s.message()), 2);
  }
  request.set_sae(args->Str("sae"));
  request.set_top_k(static_cast<int>(*top_k));
  request.mutable_feature_ids()->Add(features->begin(), features->end());
  request.set_precision(PrecisionOf(*args));
  v1::SaeFeaturesResponse response;
  if (int code = RefuseNonUtf8("sae", request); code >= 0) return code;
  const grpc::Status status = stub->SaeFeatures(&context, request, &response);
  if (!status.ok()) return Fail("sae", RpcErrorText(status), 1);
  const v1::SaeInfo& info = response.sae();
  std::printf("SAE %s (%s, %d features) on %s, precision %s\n", info.name().c_str(),
              info.architecture().c_str(), info.d_sae(), info.hook().c_str(),
              PrecisionName(response.precision()));
  // Each row's token as its text too, in a column as wide as the widest.
  const std::vector<int32_t> ids(response.token_ids().begin(), response.token_ids().end());
  absl::StatusOr<std::map<int32_t, std::string>> texts = ServerTokenTexts(*args, ids);
  if (!texts.ok()) return Fail("sae", std::string(texts.status().message()), 1);
  int width = 4;
  for (const v1::SaeRow& row : response.rows()) {
    width = std::max(width, static_cast<int>(Quoted(texts->at(ids[row.position()])).size()));
  }
  std::printf("%8s %8s %-*s %6s %9s  %s\n", "position", "token", width, "text", "L0", "rel.err",
              "strongest features (index:activation)");
  for (const v1::SaeRow& row : response.rows()) {
    const int32_t id = ids[row.position()];
    std::printf("%8d %8d %-*s %6d %9.4f ", row.position(), id, width, Quoted(texts->at(id)).c_str(),
                row.l0(), row.relative_error());
    for (const v1::SaeFeature& f : row.top()) std::printf(" %d:%.3f", f.index(), f.activation());
    for (int i = 0; i < row.features_size(); ++i) {
      std::printf("  [%d]=%.3f", request.feature_ids(i), row.features(i));
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace kvlens::cli
