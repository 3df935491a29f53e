// kvlens-cli patch --server HOST:PORT: Interpret.PatchSweep from the terminal, printed as the
// recovered share of each cell (one row per layer, or per layer and head).
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "clients/cli/args.h"
#include "clients/cli/commands.h"
#include "clients/cli/interpret_flags.h"
#include "clients/cli/rpc_call.h"
#include "clients/cli/server_tokens.h"
#include "engine/interpret/patch_sweep.h"
#include "kvlens/v1/interpret.grpc.pb.h"

namespace kvlens::cli {
namespace {

// --pairs FILE into request.more_pairs: each line's prompt and source as text, its token (and
// baseline, as the first pair has one or not) turned into ids by the server, scored at
// `position`. INVALID_ARGUMENT naming the file and line.
absl::Status AddPairs(const Args& args, bool baseline, int position,
                      v1::PatchSweepRequest& request) {
  const std::string path = args.Str("pairs");
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError("--pairs: cannot read " + path);
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> f = absl::StrSplit(line, '\t');
    const std::string where = absl::StrCat("--pairs ", path, " line ", number);
    if (f.size() != (baseline ? 4u : 3u)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", f.size(), " tab-separated fields; expected TEXT, SOURCE_TEXT, TOKEN_TEXT",
          baseline ? " and BASELINE_TEXT (the first pair has a baseline)"
                   : " (no baseline: the first pair has none)"));
    }
    v1::PatchSweepPair* p = request.add_more_pairs();
    p->mutable_input()->set_text(f[0]);
    p->mutable_patch_source()->set_text(f[1]);
    auto token = ServerOneToken(args, f[2], where + " token", "give one token's text");
    if (!token.ok()) return token.status();
    if (baseline) {
      auto base = ServerOneToken(args, f[3], where + " baseline", "give one token's text");
      if (!base.ok()) return base.status();
      p->mutable_logit_diff()->set_position(position);
      p->mutable_logit_diff()->set_token_a(*token);
      p->mutable_logit_diff()->set_token_b(*base);
    } else {
      v1::TokenTarget* t = p->mutable_log_prob()->add_targets();
      t->set_position(position);
      t->set_token(*token);
    }
  }
  return absl::OkStatus();
}

}  // namespace

int PatchCommand(int argc, char** argv) {
  std::vector<FlagSpec> specs = CommonSpecs();
  specs.push_back({"source-text", "", "the prompt patched from (as many tokens as the prompt)"});
  specs.push_back({"source-ids", "", "or its token ids, space-separated"});
  specs.push_back({"hook", "resid_pre",
                   "resid_pre, resid_mid, resid_post, attn_out, mlp_out, or per head q, z "
                   "(its query, output) or pattern (its attention row), or per KV head k, v"});
  specs.push_back({"layers", "", "layers, e.g. \"0 -1\" (negative: from the end; default: all)"});
  specs.push_back({"token", "", "token id whose log-prob (or logit, with --baseline) is scored"});
  specs.push_back({"token-text", "", "or that token as text (one token, e.g. \" Paris\")"});
  specs.push_back({"baseline", "-1", "token id whose logit is subtracted (-1: score log p)"});
  specs.push_back({"baseline-text", "", "or that token as text"});
  specs.push_back(
      {"position", "-1", "position whose next token is scored (negative: from the end)"});
  specs.push_back(
      {"all-positions", "", "one cell per layer (and head): every position patched at once", true});
  specs.push_back({"attribution", "",
                   "estimate every cell by attribution patching (one backward pass) instead of "
                   "running it",
                   true});
  specs.push_back({"qk-fix", "",
                   "with --attribution and --hook q or k: AtP*'s QK fix (each cell's attention "
                   "pattern recomputed exactly, only its effect to first order)",
                   true});
  specs.push_back({"pairs", "",
                   "a file of more prompt pairs, one a line: TEXT<tab>SOURCE_TEXT<tab>TOKEN_TEXT"
                   "[<tab>BASELINE_TEXT] (a baseline on every line or on none, as --baseline; "
                   "# comments); the grid is then the mean over all pairs"});
  specs.push_back({"per-pair", "",
                   "with --pairs: print each pair's clean and source, and per cell the mean of "
                   "the pairs' own recovered shares (each pair weighed alike) instead of the "
                   "share of the means",
                   true});
  absl::StatusOr<Args> args;
  if (int code =
          Prepare(argc, argv, "patch",
                  "Activation patching swept over layers x positions (x heads for q, k, v, z, "
                  "pattern): "
                  "per cell, the prompt's run with that one activation taken from the "
                  "source's at the same position, scored; prints each cell's recovered "
                  "share (patched - clean) / (source - clean).",
                  specs, args);
      code >= 0) {
    return code;
  }
  v1::PatchSweepRequest request;
  if (absl::Status s = FillInput(*args, request.mutable_input()); !s.ok()) {
    return Fail("patch", std::string(s.message()), 2);
  }
  v1::PromptInput* source = request.mutable_patch_source();
  if (args->Has("source-ids")) {
    auto ids = ParseInts(args->Str("source-ids"), "source-ids");
    if (!ids.ok()) return Fail("patch", std::string(ids.status().message()), 2);
    source->mutable_token_ids()->mutable_ids()->Add(ids->begin(), ids->end());
  } else if (args->Has("source-text")) {
    source->set_text(args->Str("source-text"));
  } else {
    return Fail("patch", "give --source-text or --source-ids", 2);
  }
  auto layers = ParseInts(args->Str("layers"), "layers");
  auto token = TokenFlag(*args, "token", "token-text", /*required=*/true);
  auto baseline = TokenFlag(*args, "baseline", "baseline-text", /*required=*/false);
  auto position = args->Int("position", -kMaxPosition, kMaxPosition);
  for (const absl::Status& s :
       {layers.status(), token.status(), baseline.status(), position.status()}) {
    if (!s.ok()) return Fail("patch", s);
  }
  request.set_hook(args->Str("hook"));
  request.set_all_positions(args->Switch("all-positions"));
  request.set_attribution(args->Switch("attribution"));
  request.set_qk_fix(args->Switch("qk-fix"));
  request.mutable_layers()->Add(layers->begin(), layers->end());
  if (*baseline >= 0) {
    request.mutable_logit_diff()->set_position(static_cast<int>(*position));
    request.mutable_logit_diff()->set_token_a(*token);
    request.mutable_logit_diff()->set_token_b(*baseline);
  } else {
    v1::TokenTarget* t = request.mutable_log_prob()->add_targets();
    t->set_position(static_cast<int>(*position));
    t->set_token(*token);
  }
  if (args->Has("pairs")) {
    if (absl::Status s = AddPairs(*args, *baseline >= 0, static_cast<int>(*position), request);
        !s.ok()) {
      return Fail("patch", s);
    }
  }
  request.set_per_pair(args->Switch("per-pair"));
  request.set_precision(PrecisionOf(*args));
  grpc::ClientContext context;
  auto stub = Connect(*args, context);
  v1::PatchSweepResponse response;
  if (int code = RefuseNonUtf8("patch", request); code >= 0) return code;
  const grpc::Status status = stub->PatchSweep(&context, request, &response);
  if (!status.ok()) return Fail("patch", RpcErrorText(status), 1);
  const std::vector<int32_t> ids(response.token_ids().begin(), response.token_ids().end());
  absl::StatusOr<std::map<int32_t, std::string>> texts = ServerTokenTexts(*args, ids);
  if (!texts.ok()) return Fail("patch", std::string(texts.status().message()), 1);
  const int begin = response.positions().begin(), end = response.positions().end();
  const std::optional<interpret::PatchTarget> target = interpret::PatchTargetByName(request.hook());
  const bool per_head = target.has_value() && target->per_head();
  const bool per_kv_head = target.has_value() && target->per_kv_head();
  std::printf("precision %s, hook %s%s; %s%s: clean %.6f, source %.6f\n",
              PrecisionName(response.precision()), request.hook().c_str(),
              request.qk_fix()        ? " (QK-fixed attribution patching estimates)"
              : request.attribution() ? " (attribution patching estimates)"
                                      : "",
              *baseline >= 0 ? "logit difference" : "log-prob",
              response.num_pairs() > 1
                  ? absl::StrCat(", mean over ", response.num_pairs(), " pairs").c_str()
                  : "",
              response.clean(), response.source());
  for (int k = 0; k < response.pairs_size(); ++k) {
    std::printf("  pair %d: clean %.6f, source %.6f\n", k, response.pairs(k).clean(),
                response.pairs(k).source());
  }
  const bool all = request.all_positions();
  std::printf(
      "%srecovered (patched - clean) / (source - clean), a row per %s, %s:\n",
      response.pairs_size() > 0 ? "each pair's own " : "",
      per_kv_head ? "layer and KV head"
      : per_head  ? "layer and head"
                  : "layer",
      all ? absl::StrCat("one column: positions ", begin, " to ", end - 1, " patched at once")
                .c_str()
          : "a column per position");
  if (!all) {
    std::printf("%10s", "");
    for (int p = begin; p < end; ++p) std::printf(" %8d", p);
    std::printf("\n%10s", "");
    for (int p = begin; p < end; ++p) {
      std::string piece = Quoted(texts->at(ids[p]));
      if (piece.size() > 8) {  // cut at a character's first byte, never inside one
        size_t cut = 8;
        while (cut > 0 && (static_cast<unsigned char>(piece[cut]) & 0xC0) == 0x80) --cut;
        piece.resize(cut);
      }
      std::printf(" %8s", piece.c_str());
    }
    std::printf("\n");
  }
  // (m - clean) / (source - clean) of cell e: of the means, or the mean of each pair's own
  auto share = [](double m, double clean, double src) {
    return src != clean ? (m - clean) / (src - clean) + 0.0 : 0.0;
  };
  auto recovered = [&](int e) {
    if (response.pairs_size() == 0) {
      return share(response.metric(e), response.clean(), response.source());
    }
    double sum = 0.0;
    for (const v1::PatchSweepPairResult& p : response.pairs()) {
      sum += share(p.metric(e), p.clean(), p.source());
    }
    return sum / response.pairs_size() + 0.0;
  };
  const int width = all ? 1 : end - begin;
  for (int li = 0; li < response.layers_size(); ++li) {
    for (int h = 0; h < response.num_heads(); ++h) {
      const std::string label =
          per_head ? absl::StrCat("L", response.layers(li), per_kv_head ? "KV" : "H", h)
                   : absl::StrCat("layer ", response.layers(li));
      std::printf("%10s", label.c_str());
      for (int p = 0; p < width; ++p) {
        std::printf(" %8.3f", recovered((li * response.num_heads() + h) * width + p));
      }
      std::printf("\n");
    }
  }
  return 0;
}

}  // namespace kvlens::cli
