// Generate's steering vectors end to end against the PyTorch float64 oracle (oracle.py
// --steer, which adds the vector in its own forward): on the default model (GPT-2) and
// stories260K (Llama), at hook_resid_pre, hook_resid_mid and hook_resid_post (the last
// block's: entering the final norm), each generated token is the oracle's steered argmax
// and its log-probability the oracle's; an SAE feature's steering (the shipped SAE's
// feature 347) equals its decoder row, read by the oracle's own SAE reader, given as a
// vector; every malformed steering field is refused naming it.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/interpret/sae_file.h"
#include "gtest/gtest.h"
#include "server/request_convert.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/server/server_test_util.h"
#include "tests/temp_dir.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

std::string DefaultSaePath() { return SourcePath("models/kjv-gpt2-4l-sae"); }

std::vector<float> RandomVector(int dim, double norm, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> v(static_cast<size_t>(dim));
  double sq = 0;
  for (double& x : v) {
    x = normal(rng);
    sq += x * x;
  }
  std::vector<float> out;
  for (double x : v) out.push_back(static_cast<float>(x * norm / std::sqrt(sq)));
  return out;
}

// The floats as the oracle reads them (shortest round-trip text).
std::string WriteVector(const ScopedTempDir& dir, const std::string& name,
                        const std::vector<float>& v) {
  const std::string path = dir.File(name);
  std::ofstream out(path);
  for (float x : v) out << absl::StrFormat("%.9g\n", x);
  return path;
}

// The generated tokens and log-probabilities of a greedy Generate under `steering`.
StreamResult SteeredGreedy(TestServer& server, const std::vector<int32_t>& prompt, int max_new,
                           const std::vector<v1::SteeringVector>& steering) {
  v1::GenerateRequest r;
  for (int32_t t : prompt) r.mutable_token_ids()->add_ids(t);
  r.mutable_stopping()->set_max_new_tokens(max_new);
  r.mutable_stopping()->set_ignore_eos(true);
  r.mutable_sampling()->set_repetition_penalty(1.0);  // not the default model's 1.3: argmax
  r.set_logprobs(true);
  for (const v1::SteeringVector& s : steering) *r.add_steering() = s;
  return RunGenerate(server.stub(), r);
}

// Each generated token is the oracle's argmax of its steered logits at the row before it
// (unless the oracle's top two are within 1e-4: a tie a float run may break either way;
// then the rest of the chain is not compared), and its log-probability is the oracle's
// within 2e-4 (fp32 forward).
void ExpectOracleChain(const std::string& model, const std::vector<int32_t>& prompt,
                       const StreamResult& got, const std::string& steer_args) {
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  ASSERT_FALSE(got.tokens.empty());
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), got.tokens.begin(), got.tokens.end());
  const OracleResult o = RunOracleWith(model, all, steer_args);
  ASSERT_TRUE(o.error.empty()) << o.error;
  const OracleArray& logits = o.arrays.at("logits");
  const int64_t V = logits.dims[1];
  for (size_t i = 0; i < got.tokens.size(); ++i) {
    const double* row = logits.data.data() + (prompt.size() - 1 + i) * V;
    int64_t best = 0;
    for (int64_t t = 1; t < V; ++t) best = row[t] > row[best] ? t : best;
    double second = -INFINITY, z = 0;
    for (int64_t t = 0; t < V; ++t) {
      if (t != best) second = std::max(second, row[t]);
    }
    for (int64_t t = 0; t < V; ++t) z += std::exp(row[t] - row[best]);
    const double logprob = row[got.tokens[i]] - row[best] - std::log(z);
    EXPECT_NEAR(got.logprobs[i].logprob(), logprob, 2e-4) << "token " << i;
    if (row[best] - second < 1e-4) return;
    EXPECT_EQ(got.tokens[i], best) << "token " << i;
  }
}

// The models steered against the oracle, each with a prompt and a vector norm that
// changes its continuation: the default model (GPT-2) and stories260K (Llama), when present.
struct OracleCase {
  std::string model;
  std::vector<int32_t> prompt;
  double norm;
};
std::vector<OracleCase> OracleCases() {
  std::vector<OracleCase> cases;
  if (Exists(DefaultModelPath() + "/config.json")) {
    cases.push_back({DefaultModelPath(), {4095, 34, 290, 1021, 17, 88}, 40.0});
  }
  if (Exists(Stories260KPath())) cases.push_back({Stories260KPath(), {1, 403, 407, 261}, 6.0});
  return cases;
}

class SteeringRpc : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  }
  ScopedTempDir dir_{"kvlens_steering"};
};

v1::SteeringVector Vector(const std::string& hook, const std::vector<float>& v,
                          double coefficient) {
  v1::SteeringVector s;
  s.set_hook(hook);
  for (float x : v) s.add_vector(x);
  s.set_coefficient(static_cast<float>(coefficient));
  return s;
}

// Three hooks at once on each model (the oracle adds each at its own point), and the last
// block's resid_post alone; a norm that changes the continuation.
TEST_F(SteeringRpc, GreedyTokensAndLogprobsMatchTheOracleAtEveryResidualHook) {
  const std::vector<OracleCase> cases = OracleCases();
  if (cases.empty()) GTEST_SKIP() << "no test model";
  for (const OracleCase& c : cases) {
    SCOPED_TRACE(c.model);
    TestServer server(c.model, TestServer::DefaultOptions());
    ASSERT_TRUE(server.ok()) << server.error();
    const int D = static_cast<int>(server.model().config.dim);
    const int L = server.model().config.num_layers;
    const std::vector<float> a = RandomVector(D, c.norm, 1), b = RandomVector(D, c.norm, 2),
                             e = RandomVector(D, c.norm, 3);
    const std::string fa = WriteVector(dir_, "a", a), fb = WriteVector(dir_, "b", b),
                      fe = WriteVector(dir_, "e", e);
    const std::string pre = "blocks.0.hook_resid_pre", mid = "blocks.1.hook_resid_mid",
                      post = absl::StrCat("blocks.", L - 1, ".hook_resid_post");
    const StreamResult plain = SteeredGreedy(server, c.prompt, 10, {});
    const StreamResult three = SteeredGreedy(
        server, c.prompt, 10, {Vector(pre, a, 1.0), Vector(mid, b, 0.5), Vector(post, e, -1.0)});
    EXPECT_NE(three.tokens, plain.tokens);
    ExpectOracleChain(c.model, c.prompt, three,
                      absl::StrCat("--steer ", pre, ":", fa, " --steer ", mid, ":", fb,
                                   ":0.5 --steer ", post, ":", fe, ":-1"));
    const StreamResult last = SteeredGreedy(server, c.prompt, 10, {Vector(post, e, 2.0)});
    ExpectOracleChain(c.model, c.prompt, last, absl::StrCat("--steer ", post, ":", fe, ":2"));
  }
}

// start_position: one vector from inside the prompt (position 3) and one on the generated
// tokens only (from the prompt's length), against the oracle adding each to its rows from
// that start on (kvlens-cli's @START: SaeFeatureSteeringIsItsDecoderRow).
TEST_F(SteeringRpc, StartPositionsMatchTheOracle) {
  const std::vector<OracleCase> cases = OracleCases();
  if (cases.empty()) GTEST_SKIP() << "no test model";
  for (const OracleCase& c : cases) {
    SCOPED_TRACE(c.model);
    TestServer server(c.model, TestServer::DefaultOptions());
    ASSERT_TRUE(server.ok()) << server.error();
    const int D = static_cast<int>(server.model().config.dim);
    const int L = server.model().config.num_layers;
    const int n = static_cast<int>(c.prompt.size());
    const std::vector<float> a = RandomVector(D, c.norm, 4), e = RandomVector(D, c.norm, 5);
    const std::string fa = WriteVector(dir_, "a", a), fe = WriteVector(dir_, "e", e);
    const std::string pre = "blocks.0.hook_resid_pre",
                      post = absl::StrCat("blocks.", L - 1, ".hook_resid_post");
    v1::SteeringVector in_prompt = Vector(pre, a, 1.0), generated = Vector(post, e, -1.0);
    in_prompt.set_start_position(3);
    generated.set_start_position(n);
    const StreamResult plain = SteeredGreedy(server, c.prompt, 10, {});
    const StreamResult got = SteeredGreedy(server, c.prompt, 10, {in_prompt, generated});
    EXPECT_NE(got.tokens, plain.tokens);
    ExpectOracleChain(
        c.model, c.prompt, got,
        absl::StrCat("--steer ", pre, ":", fa, ":1:3 --steer ", post, ":", fe, ":-1:", n));
    // The generated tokens only: the first token is read from the unsteered row n − 1.
    const StreamResult late = SteeredGreedy(server, c.prompt, 10, {generated});
    ASSERT_FALSE(late.tokens.empty());
    EXPECT_EQ(late.tokens[0], plain.tokens[0]);
    ExpectOracleChain(c.model, c.prompt, late, absl::StrCat("--steer ", post, ":", fe, ":-1:", n));
    // From the end of the prompt: -1 is row n − 1 (the oracle's start n − 1), -n row 0.
    v1::SteeringVector last_row = generated, first_row = in_prompt;
    last_row.set_start_position(-1);
    first_row.set_start_position(-n);
    const StreamResult from_last = SteeredGreedy(server, c.prompt, 10, {last_row, first_row});
    ExpectOracleChain(
        c.model, c.prompt, from_last,
        absl::StrCat("--steer ", pre, ":", fa, ":1:0 --steer ", post, ":", fe, ":-1:", n - 1));
  }
}

// The shipped SAE's feature 347 (" saith") by name, against its W_dec row as read by the
// oracle's SAE reader and given as a plain vector at the SAE's hook.
TEST_F(SteeringRpc, SaeFeatureSteeringIsItsDecoderRow) {
  if (!Exists(DefaultModelPath() + "/config.json") || !Exists(DefaultSaePath() + "/cfg.json")) {
    GTEST_SKIP() << "no default model or SAE";
  }
  const std::string row_file = dir_.File("w_dec_347");
  const auto [rc, out] = RunCommand(absl::StrCat(
      OraclePython(), " -c \"import sys; sys.path.insert(0, '", KVLENS_SOURCE_DIR,
      "/tests/oracle'); from kvlens_oracle.sae import load_sae; s = load_sae('", DefaultSaePath(),
      "'); open('", row_file, "', 'w').write(' '.join(repr(float(x)) for x in s.W_dec[347]))\""));
  ASSERT_EQ(rc, 0) << out;
  server::InterpretOptions o;
  auto sae = interpret::LoadSae(DefaultSaePath());
  ASSERT_TRUE(sae.ok()) << sae.status();
  const std::string name = (*sae)->name, hook = (*sae)->hook_name;
  o.saes.push_back(*sae);
  TestServer server(DefaultModelPath(), TestServer::DefaultOptions(), 1, o);
  ASSERT_TRUE(server.ok()) << server.error();
  const std::vector<int32_t> prompt = {4095, 34, 290, 1021, 17, 88};
  v1::SteeringVector feature;
  feature.set_sae(name);
  feature.set_feature(347);
  feature.set_coefficient(12.0f);
  const StreamResult got = SteeredGreedy(server, prompt, 10, {feature});
  EXPECT_NE(got.tokens, SteeredGreedy(server, prompt, 10, {}).tokens);
  ExpectOracleChain(DefaultModelPath(), prompt, got,
                    absl::StrCat("--steer ", hook, ":", row_file, ":12"));
  feature.set_hook(hook);  // the SAE's own hook may be named
  EXPECT_EQ(SteeredGreedy(server, prompt, 10, {feature}).tokens, got.tokens);

  // kvlens-cli generate --steer prints the steered RPC's text: the SAE feature, and the
  // same direction from a file at the hook, both with coefficient 12, through the server
  // and on the local model.
  v1::GenerateRequest text_request = GreedyRequest("And God said", 12);
  *text_request.add_steering() = feature;
  const StreamResult text = RunGenerate(server.stub(), text_request);
  ASSERT_TRUE(text.status.ok()) << text.status.error_message();
  const std::string cli =
      absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " generate --server ", server.address(),
                   " --prompt 'And God said' --max-new-tokens 12");
  for (const std::string& steer :
       {absl::StrCat("sae:", name, ":347:12"), absl::StrCat(hook, ":", row_file, ":12")}) {
    const auto [code, printed] = RunCommand(absl::StrCat(cli, " --steer '", steer, "'"));
    EXPECT_EQ(code, 0) << printed;
    EXPECT_EQ(printed, "And God said" + text.text + "\n") << steer;
  }
  // On the local model (no server) the file's vector steers the same way; SAE features
  // need the server's SAEs.
  const std::string local =
      absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " generate --model ", DefaultModelPath(),
                   " --prompt 'And God said' --max-new-tokens 12");
  const auto [local_code, local_text] =
      RunCommand(absl::StrCat(local, " --steer '", hook, ":", row_file, ":12'"));
  EXPECT_EQ(local_code, 0) << local_text;
  EXPECT_EQ(local_text, "And God said" + text.text + "\n");
  // @START: from position 6 on (the third generated token's row), through the server (the
  // SAE feature) and locally (the file): another text than steering every position.
  // Both terminals steering from `at` print "And God said" and `want`.
  const auto expect_both_print = [&](const std::string& at, const std::string& want) {
    for (const std::string& command :
         {absl::StrCat(cli, " --steer 'sae:", name, ":347:12", at, "'"),
          absl::StrCat(local, " --steer '", hook, ":", row_file, ":12", at, "'")}) {
      const auto [code, printed] = RunCommand(command);
      EXPECT_EQ(code, 0) << printed;
      EXPECT_EQ(printed, "And God said" + want + "\n") << command;
    }
  };
  v1::GenerateRequest late_request = text_request;
  late_request.mutable_steering(0)->set_start_position(6);
  const StreamResult late = RunGenerate(server.stub(), late_request);
  ASSERT_TRUE(late.status.ok()) << late.status.error_message();
  EXPECT_NE(late.text, text.text);
  expect_both_print("@6", late.text);
  // @-1: from the prompt's last position (the first generated token steered too), resolved
  // by the server and locally against the prompt: the RPC's text with the absolute start.
  v1::GenerateRequest last_request = text_request;
  last_request.mutable_steering(0)->set_start_position(
      static_cast<int>(server::EncodeText(*server.model().tokenizer, text_request).size()) - 1);
  const StreamResult last = RunGenerate(server.stub(), last_request);
  ASSERT_TRUE(last.status.ok()) << last.status.error_message();
  EXPECT_NE(last.text, late.text);
  expect_both_print("@-1", last.text);
  const auto [sae_code, sae_text] = RunCommand(local + " --steer 'sae:x:3' 2>&1");
  EXPECT_EQ(sae_code, 2) << sae_text;
  EXPECT_NE(sae_text.find("SAE features need --server"), std::string::npos) << sae_text;
  const auto [len_code, len_text] =
      RunCommand(absl::StrCat(local, " --steer 'blocks.9.hook_resid_pre:", row_file, "' 2>&1"));
  EXPECT_EQ(len_code, 2) << len_text;
  EXPECT_NE(len_text.find("layer 9 is outside [0, 4)"), std::string::npos) << len_text;
  const auto [bad_code, bad] = RunCommand(cli + " --steer 'sae:x:y' 2>&1");
  EXPECT_EQ(bad_code, 2) << bad;
  EXPECT_NE(bad.find("--steer \"sae:x:y\": feature \"y\" is not an integer"), std::string::npos)
      << bad;
}

TEST_F(SteeringRpc, RejectsMalformedSteeringNamingTheField) {
  if (!Exists(DefaultModelPath() + "/config.json") || !Exists(DefaultSaePath() + "/cfg.json")) {
    GTEST_SKIP() << "no default model or SAE";
  }
  server::InterpretOptions o;
  auto sae = interpret::LoadSae(DefaultSaePath());
  ASSERT_TRUE(sae.ok()) << sae.status();
  const std::string name = (*sae)->name;
  o.saes.push_back(*sae);
  TestServer server(DefaultModelPath(), TestServer::DefaultOptions(), 1, o);
  ASSERT_TRUE(server.ok()) << server.error();
  const int D = static_cast<int>(server.model().config.dim);
  const std::vector<float> ok(D, 0.25f);
  auto by_sae = [&](const std::string& sae_name, int feature, const std::string& hook = "") {
    v1::SteeringVector s;
    s.set_sae(sae_name);
    s.set_feature(feature);
    s.set_hook(hook);
    return s;
  };
  std::vector<float> nan = ok;
  nan[5] = NAN;
  v1::SteeringVector both = Vector("blocks.0.hook_resid_pre", ok, 1.0);
  both.set_sae(name);
  v1::SteeringVector inf_coefficient = Vector("blocks.0.hook_resid_pre", ok, 1.0);
  inf_coefficient.set_coefficient(INFINITY);
  v1::SteeringVector negative_start = Vector("blocks.0.hook_resid_pre", ok, 1.0);
  negative_start.set_start_position(-3);  // the prompt has 2 tokens
  struct Case {
    std::vector<v1::SteeringVector> steering;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{Vector("blocks.0.hook_attn_out", ok, 1)}, "steering[0].hook = \"blocks.0.hook_attn_out\""},
      {{Vector("resid_pre", ok, 1)}, "must be blocks.{layer}.hook_resid_pre"},
      {{Vector("blocks.4.hook_resid_pre", ok, 1)}, "layer 4 is outside [0, 4)"},
      {{Vector("", ok, 1)}, "steering[0].hook: required with vector"},
      {{Vector("blocks.0.hook_resid_pre", std::vector<float>(D + 1, 0.0f), 1)},
       absl::StrCat("steering[0].vector has ", D + 1, " values, the model's d_model is ", D)},
      {{Vector("blocks.0.hook_resid_pre", ok, 1), Vector("blocks.0.hook_resid_pre", nan, 1)},
       "steering[1].vector[5] = nan must be finite"},
      {{inf_coefficient}, "steering[0].coefficient = inf must be finite"},
      {{negative_start},
       "steering[0].start_position = -3 must be >= -2 (negative: from the end of the 2-token "
       "prompt, -1 its last)"},
      {{both}, "steering[0]: give either vector"},
      {{v1::SteeringVector()}, "steering[0]: give either vector"},
      {{by_sae("nope", 1)}, "steering[0].sae = \"nope\" is not an SAE this server loaded"},
      {{by_sae(name, 1536)}, "steering[0].feature = 1536 must be in [0, 1536)"},
      {{by_sae(name, -1)}, "steering[0].feature = -1 must be in [0, 1536)"},
      {{by_sae(name, 3, "blocks.1.hook_resid_post")}, "is not the hook of SAE"},
      {std::vector<v1::SteeringVector>(17, Vector("blocks.0.hook_resid_pre", ok, 1)),
       "steering: 17 vectors, at most 16"},
  };
  for (const Case& c : cases) {
    const StreamResult r = SteeredGreedy(server, {4095, 34}, 2, c.steering);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.message;
    EXPECT_NE(r.status.error_message().find(c.message), std::string::npos)
        << r.status.error_message() << "\n  wanted: " << c.message;
  }
  v1::GenerateRequest with_session;
  with_session.mutable_token_ids()->add_ids(4095);
  with_session.set_session_id(5);
  *with_session.add_steering() = Vector("blocks.0.hook_resid_pre", ok, 1);
  const StreamResult r = RunGenerate(server.stub(), with_session);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("steering: not with session_id"), std::string::npos)
      << r.status.error_message();
}

}  // namespace
}  // namespace kvlens::testing
