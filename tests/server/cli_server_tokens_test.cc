// kvlens-cli asking the server's tokenizer (clients/cli/server_tokens.h): tokenize
// --server prints the ids tokenize --model prints for the same model; the Interpret
// commands given text where they need tokens: a --text prompt with the position flags'
// default (-1, the last position, which the server resolves) and --target-text /
// --token-text / --baseline-text. Each run prints what
// the same command prints given the ids, encoded here by the model's tokenizer; text that is not
// one token, or both or neither of a token's flags, is refused by name (exit code 2).
// The default model's GPT-2 vocabulary has " created" and " said" as single tokens.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/tokenizer/unicode.h"
#include "gtest/gtest.h"
#include "tests/server/interpret_test_util.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

// The numbers on the line of `out` that starts with `label` (right-aligned in 10 columns, as
// kvlens-cli patch prints a grid's rows); empty when there is none.
std::vector<double> GridRow(const std::string& out, const std::string& label) {
  const std::string start = absl::StrFormat("%10s", label);
  size_t at = out.find("\n" + start);
  if (at == std::string::npos) return {};
  at += 1 + start.size();
  std::vector<double> row;
  const char* p = out.c_str() + at;
  char* end = nullptr;
  for (double v = std::strtod(p, &end); end != p; v = std::strtod(p, &end)) {
    row.push_back(v);
    p = end;
  }
  return row;
}

class CliServerTokens : public ::testing::Test {
 protected:
  void SetUp() override {
    KVLENS_REQUIRE_FILE(DefaultModelPath() + "/config.json");
    ASSERT_TRUE(server_.ok()) << server_.error();
  }

  std::pair<int, std::string> Cli(const std::string& command, const std::string& flags) {
    return RunCommand(absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " ", command, " --server ",
                                   server_.address(), " ", flags, " 2>&1"));
  }
  std::vector<int32_t> Encode(const std::string& text, bool add_bos) {
    return server_.model().tokenizer->Encode(text, add_bos);
  }
  // The prompt as the server encodes --text (the model's BOS setting).
  std::string PromptIds() {
    return absl::StrJoin(Encode(kPrompt, server_.model().tokenizer->adds_bos()), " ");
  }
  int LastPosition() {
    return static_cast<int>(Encode(kPrompt, server_.model().tokenizer->adds_bos()).size()) - 1;
  }
  int32_t OneToken(const std::string& text) {
    const std::vector<int32_t> ids = Encode(text, false);
    EXPECT_EQ(ids.size(), 1u) << text;
    return ids.empty() ? -1 : ids.front();
  }

  static constexpr char kPrompt[] = "In the beginning God";
  TestServer server_{DefaultModelPath(), TestServer::DefaultOptions()};
};

TEST_F(CliServerTokens, TokenizeOnTheServerIsTheLocalModels) {
  for (const std::string& flags :
       {std::string("--text 'In the beginning God<|endoftext|>'"),
        std::string("--text 'In the beginning God<|endoftext|>' --bos --no-parse-special"),
        std::string("--text ''")}) {
    const auto [code, out] = Cli("tokenize", flags);
    ASSERT_EQ(code, 0) << flags << "\n" << out;
    const auto [local_code, local] = RunCommand(absl::StrCat(
        KVLENS_CLI_PATH, " tokenize --model ", DefaultModelPath(), " ", flags, " 2>&1"));
    ASSERT_EQ(local_code, 0) << local;
    EXPECT_EQ(out, local) << flags;
  }
  // <|endoftext|> is the vocabulary's special token, parsed as such by default.
  const std::string eos = absl::StrCat(server_.model().tokenizer->eos_id());
  const auto [code, out] = Cli("tokenize", "--text 'God<|endoftext|>'");
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(out, absl::StrCat(OneToken("God"), " ", eos, "\n"));
  const auto [both_code, both] =
      Cli("tokenize", absl::StrCat("--model ", DefaultModelPath(), " --text x"));
  EXPECT_EQ(both_code, 2) << both;
  EXPECT_NE(both.find("give --server or --model, not both"), std::string::npos) << both;
}

TEST_F(CliServerTokens, ProbeTakesTheLastPositionAndATextTarget) {
  const auto [code, out] =
      Cli("probe", absl::StrCat("--text '", kPrompt, "' --target-text ' created'"));
  ASSERT_EQ(code, 0) << out;
  const auto [ids_code, ids_out] =
      Cli("probe", absl::StrCat("--ids '", PromptIds(), "' --target-position ", LastPosition(),
                                " --target-token ", OneToken(" created")));
  ASSERT_EQ(ids_code, 0) << ids_out;
  EXPECT_EQ(out, ids_out);
  EXPECT_NE(out.find(absl::StrCat("| position ", LastPosition(), ") =")), std::string::npos) << out;
  // The saliency table names each token by its text: the last is " God".
  const std::vector<int32_t> ids = Encode(kPrompt, server_.model().tokenizer->adds_bos());
  EXPECT_NE(out.find(absl::StrFormat("%8d %8d ", LastPosition(), ids.back())), std::string::npos)
      << out;
  EXPECT_NE(out.find("  \" God\"\n"), std::string::npos) << out;
}

// probe --verify K: the totals, then a line per tensor kind and per hook asked (--neurons
// asks for mlp_post at every layer, which no edit moves one entry of alone).
TEST_F(CliServerTokens, ProbeVerifyPrintsEachTensorAndHook) {
  const auto [code, out] =
      Cli("probe", absl::StrCat("--ids '", PromptIds(), "' --target-token ", OneToken(" created"),
                                " --precision fp64 --neurons 1 --verify 2"));
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("verify: max abs error "), std::string::npos) << out;
  EXPECT_NE(out.find("\n  residual: 2 samples, max abs error "), std::string::npos) << out;
  for (int l = 0; l < server_.model().config.num_layers; ++l) {
    EXPECT_NE(out.find(absl::StrCat("\n  blocks.", l,
                                    ".mlp.hook_post: not checked (no edit moves one entry alone)")),
              std::string::npos)
        << out;
  }
}

// probe --neurons K: the K (layer, position, neuron) entries of largest |mlp_post × its
// gradient|, each line as the Activations and GradientProbe RPCs give the two factors
// (fp64) for the same prompt and target.
TEST_F(CliServerTokens, ProbeNeuronsAreTheLargestActivationTimesGradient) {
  const std::vector<int32_t> ids = Encode(kPrompt, server_.model().tokenizer->adds_bos());
  const int32_t target = OneToken(" created");
  const auto [code, out] = Cli("probe", absl::StrCat("--ids '", PromptIds(), "' --target-token ",
                                                     target, " --precision fp64 --neurons 3"));
  ASSERT_EQ(code, 0) << out;
  v1::GradientProbeRequest g;
  *g.mutable_input() = IdsInput(ids);
  v1::TokenTarget* t = g.mutable_log_prob()->add_targets();
  t->set_position(LastPosition());
  t->set_token(target);
  g.set_precision(v1::PRECISION_FP64);
  g.add_hooks("mlp_post");
  const v1::GradientProbeResponse grads = CallGradientProbe(server_, g);
  v1::ActivationsRequest a;
  *a.mutable_input() = IdsInput(ids);
  a.set_precision(v1::PRECISION_FP64);
  a.add_hooks("mlp_post");
  v1::ActivationsResponse acts;
  ASSERT_TRUE(CallInterpret(server_, &v1::Interpret::Stub::Activations, a, &acts).ok());
  const ModelConfig& c = server_.model().config;
  ASSERT_EQ(grads.hook_gradients_size(), c.num_layers);
  ASSERT_EQ(acts.tensors_size(), c.num_layers);
  std::vector<std::pair<double, std::string>> lines;
  for (int l = 0; l < c.num_layers; ++l) {
    const std::vector<double> av = DecodeTensor(acts.tensors(l)),
                              gv = DecodeTensor(grads.hook_gradients(l));
    ASSERT_EQ(av.size(), ids.size() * c.hidden_dim);
    ASSERT_EQ(gv.size(), av.size());
    for (size_t e = 0; e < av.size(); ++e) {
      lines.emplace_back(
          std::abs(av[e] * gv[e]),
          absl::StrFormat("%5d %8d %7d %12.6f %12.6f %12.6f\n", l,
                          static_cast<int>(e / c.hidden_dim), static_cast<int>(e % c.hidden_dim),
                          av[e], gv[e], av[e] * gv[e]));
    }
  }
  std::sort(lines.begin(), lines.end(),
            [](const auto& x, const auto& y) { return x.first > y.first; });
  const size_t table = out.find("act x grad\n");
  ASSERT_NE(table, std::string::npos) << out;
  EXPECT_EQ(out.substr(table + 11, lines[0].second.size() * 3),
            lines[0].second + lines[1].second + lines[2].second)
      << out;
}

TEST_F(CliServerTokens, InterveneAndAttributeTakeTextTokens) {
  const auto [code, out] = Cli(
      "intervene", absl::StrCat("--text '", kPrompt, "' --ablate '0:0' --target-text ' created'"));
  ASSERT_EQ(code, 0) << out;
  const auto [ids_code, ids_out] =
      Cli("intervene", absl::StrCat("--ids '", PromptIds(), "' --ablate '0:0' --target-position ",
                                    LastPosition(), " --target-token ", OneToken(" created")));
  ASSERT_EQ(ids_code, 0) << ids_out;
  EXPECT_EQ(out, ids_out);
  // FFN neurons too: text and ids alike, counted in the summary line; a malformed entry is
  // refused by its flag's name.
  const auto [n_code, n_out] = Cli("intervene", absl::StrCat("--text '", kPrompt,
                                                             "' --ablate-neurons '0:3 -1:7:-1' "
                                                             "--target-text ' created'"));
  ASSERT_EQ(n_code, 0) << n_out;
  const auto [n_ids_code, n_ids_out] =
      Cli("intervene", absl::StrCat("--ids '", PromptIds(), "' --ablate-neurons '0:3 -1:7:-1' ",
                                    "--target-position ", LastPosition(), " --target-token ",
                                    OneToken(" created")));
  ASSERT_EQ(n_ids_code, 0) << n_ids_out;
  EXPECT_EQ(n_out, n_ids_out);
  EXPECT_NE(n_out.find("0 head and 2 neuron ablation(s)"), std::string::npos) << n_out;
  const auto [bad_code, bad_out] = Cli(
      "intervene", absl::StrCat("--text '", kPrompt, "' --ablate-neurons '0' --target-token 5"));
  EXPECT_EQ(bad_code, 2) << bad_out;
  EXPECT_NE(bad_out.find("--ablate-neurons: '0' is not LAYER:NEURON[:POSITION]"), std::string::npos)
      << bad_out;
  const auto [a_code, a_out] =
      Cli("attribute",
          absl::StrCat("--text '", kPrompt, "' --token-text ' created' --baseline-text ' said'"));
  ASSERT_EQ(a_code, 0) << a_out;
  const auto [b_code, b_out] =
      Cli("attribute", absl::StrCat("--text '", kPrompt, "' --token ", OneToken(" created"),
                                    " --baseline ", OneToken(" said")));
  ASSERT_EQ(b_code, 0) << b_out;
  EXPECT_EQ(a_out, b_out);
}

// kvlens-cli patch: the last layer's resid_post at the scored position is the source's
// final stream, so that cell recovers all (1.000) and the others nothing; text and ids
// print the same; z prints a row per head, k one per KV head; every position at once
// recovers all; prompts of different lengths are
// refused.
TEST_F(CliServerTokens, PatchPrintsTheRecoveredGrid) {
  const int n = LastPosition() + 1, L = server_.model().config.num_layers;
  ASSERT_EQ(Encode("In the beginning man", server_.model().tokenizer->adds_bos()).size(),
            static_cast<size_t>(n));
  const std::string scored = " --token-text ' created' --baseline-text ' said' --precision fp64";
  // the prompt patched from "In the beginning man" (as many tokens), scored
  auto patch = [&](const std::string& flags) {
    return Cli("patch", absl::StrCat("--text '", kPrompt, "' --source-text 'In the beginning man' ",
                                     flags, scored));
  };
  const auto [code, out] = patch("--hook resid_post --layers -1");
  ASSERT_EQ(code, 0) << out;
  std::string row = absl::StrFormat("%10s", absl::StrCat("layer ", L - 1));
  for (int p = 0; p < n; ++p) absl::StrAppend(&row, p + 1 < n ? "    0.000" : "    1.000");
  EXPECT_NE(out.find(row + "\n"), std::string::npos) << row << "\n" << out;
  EXPECT_NE(out.find("hook resid_post; logit difference: clean "), std::string::npos) << out;
  const auto [ids_code, ids_out] = Cli(
      "patch",
      absl::StrCat(
          "--ids '", PromptIds(), "' --source-ids '",
          absl::StrJoin(Encode("In the beginning man", server_.model().tokenizer->adds_bos()), " "),
          "' --hook resid_post --layers -1", scored));
  ASSERT_EQ(ids_code, 0) << ids_out;
  EXPECT_EQ(out, ids_out);
  const auto [z_code, z_out] = patch("--hook z --layers 0");
  ASSERT_EQ(z_code, 0) << z_out;
  const int H = server_.model().config.num_heads;
  EXPECT_NE(z_out.find(absl::StrFormat("%10s", absl::StrCat("L0H", H - 1))), std::string::npos)
      << z_out;
  EXPECT_EQ(z_out.find(absl::StrFormat("%10s", absl::StrCat("L0H", H))), std::string::npos);
  const auto [k_code, k_out] = patch("--hook k --layers 0");
  ASSERT_EQ(k_code, 0) << k_out;
  const int KV = server_.model().config.num_kv_heads;
  EXPECT_NE(k_out.find("a row per layer and KV head"), std::string::npos) << k_out;
  EXPECT_NE(k_out.find(absl::StrFormat("%10s", absl::StrCat("L0KV", KV - 1))), std::string::npos)
      << k_out;
  // every position of the stream entering a layer from the source is the source's run
  const auto [atp_code, atp_out] = patch("--hook z --layers 0 --attribution");
  ASSERT_EQ(atp_code, 0) << atp_out;
  EXPECT_NE(atp_out.find("hook z (attribution patching estimates); logit difference"),
            std::string::npos)
      << atp_out;
  EXPECT_NE(atp_out.find(absl::StrFormat("%10s", absl::StrCat("L0H", H - 1))), std::string::npos)
      << atp_out;
  const auto [qk_code, qk_out] = patch("--hook k --layers 0 --attribution --qk-fix");
  ASSERT_EQ(qk_code, 0) << qk_out;
  EXPECT_NE(qk_out.find("hook k (QK-fixed attribution patching estimates); logit difference"),
            std::string::npos)
      << qk_out;
  const auto [all_code, all_out] = patch("--layers '0 -1' --all-positions");
  ASSERT_EQ(all_code, 0) << all_out;
  EXPECT_NE(all_out.find(absl::StrCat("one column: positions 0 to ", n - 1, " patched at once")),
            std::string::npos)
      << all_out;
  for (int l : {0, L - 1}) {
    EXPECT_NE(all_out.find(absl::StrFormat("%10s", absl::StrCat("layer ", l)) + "    1.000\n"),
              std::string::npos)
        << all_out;
  }
  // --pairs: a second pair (the prompts swapped, other names scored) averaged in; the last
  // layer's stream still recovers all at the scored position and nothing before it.
  const std::string pairs = ::testing::TempDir() + "kvlens_cli_pairs.tsv";
  {
    std::ofstream f(pairs);
    f << "# text\tsource\ttoken\tbaseline\n\nIn the beginning man\t" << kPrompt
      << "\t the\t said\n";
  }
  const auto [pairs_code, pairs_out] = patch("--hook resid_post --layers -1 --pairs " + pairs);
  ASSERT_EQ(pairs_code, 0) << pairs_out;
  EXPECT_NE(pairs_out.find("logit difference, mean over 2 pairs: clean "), std::string::npos)
      << pairs_out;
  EXPECT_NE(pairs_out.find(row + "\n"), std::string::npos) << row << "\n" << pairs_out;
  EXPECT_NE(pairs_out, out);
  // --per-pair: each pair's clean and source (the first pair's are the lone run's), and the
  // mean of each pair's own shares, which recover the same way here
  const auto [per_code, per_out] =
      patch("--hook resid_post --layers -1 --per-pair --pairs " + pairs);
  ASSERT_EQ(per_code, 0) << per_out;
  const size_t clean_at = out.find("clean ");
  ASSERT_NE(clean_at, std::string::npos) << out;
  const std::string lone = out.substr(clean_at, out.find('\n', clean_at) - clean_at + 1);
  EXPECT_NE(per_out.find("\n  pair 0: " + lone), std::string::npos) << lone << per_out;
  EXPECT_NE(per_out.find("\n  pair 1: clean "), std::string::npos) << per_out;
  EXPECT_EQ(per_out.find("  pair 2:"), std::string::npos) << per_out;
  EXPECT_NE(per_out.find("each pair's own recovered (patched - clean)"), std::string::npos)
      << per_out;
  EXPECT_NE(per_out.find(row + "\n"), std::string::npos) << row << "\n" << per_out;
  // where the pairs' shares differ (a head of layer 0), each cell is the mean of the shares
  // each pair's own lone run prints (to their 3 decimals)
  const std::string head = absl::StrCat("L0H", H - 1);
  const auto [zper_code, zper_out] = patch("--hook z --layers 0 --per-pair --pairs " + pairs);
  ASSERT_EQ(zper_code, 0) << zper_out;
  const auto [swapped_code, swapped_out] =
      Cli("patch", absl::StrCat("--text 'In the beginning man' --source-text '", kPrompt,
                                "' --hook z --layers 0 --token-text ' the' --baseline-text ' said'"
                                " --precision fp64"));
  ASSERT_EQ(swapped_code, 0) << swapped_out;
  const std::vector<double> mean = GridRow(zper_out, head), first = GridRow(z_out, head),
                            second = GridRow(swapped_out, head);
  ASSERT_EQ(mean.size(), static_cast<size_t>(n)) << zper_out;
  ASSERT_EQ(first.size(), mean.size()) << z_out;
  ASSERT_EQ(second.size(), mean.size()) << swapped_out;
  EXPECT_NE(first, second);
  for (size_t p = 0; p < mean.size(); ++p) {
    EXPECT_NEAR(mean[p], (first[p] + second[p]) / 2, 0.0011) << p;
  }
  {
    std::ofstream f(pairs);
    f << "In the beginning man\t" << kPrompt << "\t the\n";
  }
  const auto [short_code, short_out] = patch("--hook resid_post --layers -1 --pairs " + pairs);
  EXPECT_EQ(short_code, 2) << short_out;
  EXPECT_NE(
      short_out.find(absl::StrCat("--pairs ", pairs,
                                  " line 1: 3 tab-separated fields; "
                                  "expected TEXT, SOURCE_TEXT, TOKEN_TEXT and BASELINE_TEXT")),
      std::string::npos)
      << short_out;
  std::remove(pairs.c_str());
  const auto [bad_code, bad_out] =
      Cli("patch", absl::StrCat("--text '", kPrompt, "' --source-text 'In the beginning'", scored));
  EXPECT_EQ(bad_code, 1) << bad_out;
  EXPECT_NE(bad_out.find(absl::StrCat("patch_source has ", n - 1, " tokens and input ", n)),
            std::string::npos)
      << bad_out;
}

TEST_F(CliServerTokens, TokenFlagsAreRefusedByName) {
  const std::vector<int32_t> two = Encode(" created said", false);
  ASSERT_EQ(two.size(), 2u);
  const std::string text = absl::StrCat("--text '", kPrompt, "' ");
  const struct {
    std::string command, flags, message;
  } cases[] = {
      {"probe", text + "--target-text ' created said'",
       absl::StrCat("--target-text = \" created said\" is 2 tokens (", two[0], " ", two[1],
                    "), not one")},
      {"probe", text + "--target-text ' created' --target-token 5",
       "give --target-token or --target-text, not both"},
      {"intervene", text + "--ablate 0:0",
       "--target-token (a token id) or --target-text (its text) is required"},
      {"attribute", text + "--baseline-text ' said'",
       "--token (a token id) or --token-text (its text) is required"},
  };
  for (const auto& c : cases) {
    const auto [code, out] = Cli(c.command, c.flags);
    EXPECT_EQ(code, 2) << c.flags << "\n" << out;
    EXPECT_NE(out.find(c.message), std::string::npos) << out;
  }
  // An empty prompt reaches the server (the position is -1 whatever its length), which
  // refuses it by name.
  const auto [code, out] = Cli("probe", "--ids '' --target-token 5");
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("kvlens-cli probe: input: no tokens"), std::string::npos) << out;
}

// kvlens-cli lens prints the LogitLens RPC's rows, one table a position, each token as the
// text the model's tokenizer makes of it alone (a lone byte of a longer character as
// U+FFFD, as Detokenize sends it), quoted and C-escaped (the newline after "said" as
// \n), with its log-probability (3 decimals).
TEST_F(CliServerTokens, LensPrintsTheRpcsRowsAsText) {
  const std::string text = "And God said\nAnd";  // (a shell's $(…) keeps an inner newline)
  const auto [code, out] =
      Cli("lens", "--text \"$(printf 'And God said\\nAnd')\" --positions '1 4' --top-k 3");
  ASSERT_EQ(code, 0) << out;
  v1::LogitLensRequest request;
  request.mutable_input()->set_text(text);
  request.add_positions(1);
  request.add_positions(4);
  request.set_top_k(3);
  v1::LogitLensResponse response;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status s = InterpretStub(server_)->LogitLens(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  const Tokenizer& tokenizer = *server_.model().tokenizer;
  std::string want = "precision fp32\n";
  for (const int position : {1, 4}) {
    absl::StrAppend(&want, "position ", position, ":\n", " layer  top tokens (log-prob)\n");
    for (const v1::LensRow& row : response.rows()) {
      if (row.position() != position) continue;
      absl::StrAppendFormat(&want, "%6d ", row.layer());
      for (const v1::LensToken& t : row.top()) {
        const std::string piece = unicode::SanitizeUtf8(tokenizer.Decode({t.token()}));
        absl::StrAppendFormat(&want, " \"%s\" %.3f", absl::Utf8SafeCHexEscape(piece), t.logprob());
      }
      want += "\n";
    }
  }
  EXPECT_EQ(out, want);
  // Layer 0 (the embeddings through the tied unembedding) ranks the newline itself first,
  // printed escaped.
  EXPECT_NE(out.find("     0  \"\\n\" "), std::string::npos) << out;
}

// kvlens-cli attention prints the RPC's probabilities (3 decimals) under a legend of the
// tokens, "[position] text", each the text the model's tokenizer makes of it alone.
TEST_F(CliServerTokens, AttentionPrintsTheRpcsMapsUnderTheTokens) {
  const auto [code, out] =
      Cli("attention", absl::StrCat("--text '", kPrompt, "' --layers 1 --heads 2"));
  ASSERT_EQ(code, 0) << out;
  v1::AttentionMapsRequest request;
  request.mutable_input()->set_text(kPrompt);
  request.add_layers(1);
  request.add_heads(2);
  const AttentionResult maps = RunAttentionMaps(*InterpretStub(server_), request);
  ASSERT_TRUE(maps.status.ok()) << maps.status.error_message();
  const std::vector<int32_t> ids(maps.info.token_ids().begin(), maps.info.token_ids().end());
  EXPECT_EQ(ids, Encode(kPrompt, server_.model().tokenizer->adds_bos()));
  std::string legend = "tokens:";
  for (size_t i = 0; i < ids.size(); ++i) {
    absl::StrAppend(&legend, " [", i, "] \"", server_.model().tokenizer->Decode({ids[i]}), "\"");
  }
  EXPECT_NE(out.find(legend + "\n"), std::string::npos) << legend << "\nin\n" << out;
  EXPECT_NE(out.find("[4] \" God\""), std::string::npos) << out;
  const size_t n = ids.size();
  std::string matrix =
      absl::StrCat("layer 1 head 2, queries 0..", n - 1, ", keys 0..", n - 1, ":\n");
  for (size_t q = 0; q < n; ++q) {
    for (size_t k = 0; k < n; ++k) absl::StrAppendFormat(&matrix, " %5.3f", maps.probs[q * n + k]);
    matrix += "\n";
  }
  EXPECT_NE(out.find(matrix), std::string::npos) << matrix << "\nin\n" << out;
}

}  // namespace
}  // namespace kvlens::testing
