// kvlens.v1.Interpret ListSaes and SaeFeatures end to end on the default model with two
// SAEs (a SAELens directory and a Gemma Scope .npz written at test time by
// tests/oracle/make_sae.py): every row's active count, strongest features, chosen features
// and reconstruction error against the PyTorch float64 oracle (oracle.py --sae, its own file
// readers), in fp64 and fp32; every malformed request refused naming its field; no SAE
// loaded is FAILED_PRECONDITION; calls counted under the metric kind "sae".
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "engine/interpret/sae_file.h"
#include "gtest/gtest.h"
#include "tests/server/interpret_test_util.h"
#include "tests/temp_dir.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

const std::vector<int32_t> kTokens = {4095, 34, 290, 1021, 17, 88, 5, 400, 61, 7};

class InterpretSae : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Exists(DefaultModelPath() + "/config.json")) GTEST_SKIP() << "no default model";
    if (!OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
    lens_ = Make("lens",
                 "--format saelens --architecture standard --d-in 192 --d-sae 96 "
                 "--hook blocks.2.hook_resid_post --seed 11");
    npz_ = Make("params.npz", "--format npz --d-in 192 --d-sae 80 --seed 12") +
           "@blocks.1.hook_resid_mid";
  }
  std::string Make(const std::string& name, const std::string& args) {
    const std::string out = dir_.File(name);
    EXPECT_TRUE(MakeSae(out, args)) << args;
    return out;
  }
  server::InterpretOptions WithSaes() {
    server::InterpretOptions o;
    for (const std::string& spec : {lens_, "scope=" + npz_}) {
      auto sae = interpret::LoadSae(spec);
      EXPECT_TRUE(sae.ok()) << sae.status();
      if (sae.ok()) o.saes.push_back(*sae);
    }
    return o;
  }
  ScopedTempDir dir_{"kvlens_server_sae"};
  std::string lens_, npz_;
};

grpc::Status CallSae(TestServer& server, const v1::SaeFeaturesRequest& r,
                     v1::SaeFeaturesResponse* out) {
  auto stub = InterpretStub(server);
  grpc::ClientContext context;
  SetDeadline(context);
  return stub->SaeFeatures(&context, r, out);
}

TEST_F(InterpretSae, FeaturesMatchTheOracle) {
  TestServer server(DefaultModelPath(), TestServer::DefaultOptions(), 1, WithSaes());
  ASSERT_TRUE(server.ok()) << server.error();
  {
    auto stub = InterpretStub(server);
    grpc::ClientContext context;
    SetDeadline(context);
    v1::ListSaesResponse list;
    ASSERT_TRUE(stub->ListSaes(&context, v1::ListSaesRequest(), &list).ok());
    ASSERT_EQ(list.saes_size(), 2);
    EXPECT_EQ(list.saes(0).name(), "blocks.2.hook_resid_post");
    EXPECT_EQ(list.saes(0).architecture(), "standard");
    EXPECT_EQ(list.saes(0).d_sae(), 96);
    EXPECT_TRUE(list.saes(0).apply_b_dec_to_input());
    EXPECT_EQ(list.saes(1).name(), "scope");
    EXPECT_EQ(list.saes(1).hook(), "blocks.1.hook_resid_mid");
    EXPECT_EQ(list.saes(1).layer(), 1);
    EXPECT_EQ(list.saes(1).architecture(), "jumprelu");
  }
  for (const auto& [name, spec] : {std::pair{std::string("scope"), npz_},
                                   std::pair{std::string("blocks.2.hook_resid_post"), lens_}}) {
    const OracleResult ref = RunOracleWith(DefaultModelPath(), kTokens, "--sae '" + spec + "'");
    ASSERT_TRUE(ref.error.empty()) << ref.error;
    const OracleArray& acts = ref.arrays.at("sae.acts");
    const OracleArray& input = ref.arrays.at("sae.input");
    const OracleArray& recon = ref.arrays.at("sae.recon");
    const int ds = static_cast<int>(acts.dims[1]), din = static_cast<int>(input.dims[1]);
    v1::SaeFeaturesRequest r;
    *r.mutable_input() = IdsInput(kTokens);
    r.set_sae(name);
    r.mutable_positions()->set_begin(2);
    r.mutable_positions()->set_end(8);
    r.set_top_k(5);
    for (int id : {0, 7, ds - 1}) r.add_feature_ids(id);
    for (const v1::Precision precision : {v1::PRECISION_FP64, v1::PRECISION_FP32}) {
      const double tol = precision == v1::PRECISION_FP64 ? 1e-9 : 1e-4;
      r.set_precision(precision);
      v1::SaeFeaturesResponse a;
      const grpc::Status s = CallSae(server, r, &a);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(a.sae().name(), name);
      ASSERT_EQ(a.rows_size(), 6);
      double scale = 0;
      for (double v : acts.data) scale = std::max(scale, std::abs(v));
      int active_rows = 0;
      for (const v1::SaeRow& row : a.rows()) {
        const int p = row.position();
        const double* f = acts.data.data() + int64_t{p} * ds;
        int l0 = 0;
        for (int j = 0; j < ds; ++j) l0 += f[j] != 0 ? 1 : 0;
        if (precision == v1::PRECISION_FP64) {
          EXPECT_EQ(row.l0(), l0) << name << " " << p;
        }
        active_rows += l0 > 0 ? 1 : 0;
        // The oracle's five strongest active features, in order.
        std::vector<int> order(ds);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return f[x] > f[y]; });
        ASSERT_EQ(row.top_size(), std::min(5, l0)) << name << " " << p;
        for (int k = 0; k < row.top_size(); ++k) {
          EXPECT_NEAR(row.top(k).activation(), f[order[k]], tol * scale) << name << " " << p;
          EXPECT_NEAR(f[row.top(k).index()], f[order[k]], tol * scale) << name << " " << p;
        }
        ASSERT_EQ(row.features_size(), 3);
        for (int i = 0; i < 3; ++i) {
          EXPECT_NEAR(row.features(i), f[r.feature_ids(i)], tol * scale);
        }
        double err = 0, norm = 0;
        for (int j = 0; j < din; ++j) {
          const double x = input.data[int64_t{p} * din + j];
          const double d = x - recon.data[int64_t{p} * din + j];
          err += d * d;
          norm += x * x;
        }
        EXPECT_NEAR(row.reconstruction_mse(), err / din, tol * std::max(1.0, err / din));
        EXPECT_NEAR(row.relative_error(), std::sqrt(err / norm), tol);
      }
      EXPECT_GT(active_rows, 3) << name;
    }
  }
}

// kvlens-cli sae prints what the RPC returns: the list, and per position its token's id and
// text (as the model's tokenizer decodes it alone, quoted and C-escaped, in a column as
// wide as the widest), L0 and the strongest features as index:activation (3 decimals)
// with the chosen ones.
TEST_F(InterpretSae, CliPrintsTheRpcsAnswer) {
  TestServer server(DefaultModelPath(), TestServer::DefaultOptions(), 1, WithSaes());
  ASSERT_TRUE(server.ok()) << server.error();
  const std::string cli =
      absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " sae --server ", server.address());
  const auto [list_code, list] = RunCommand(cli + " --list");
  EXPECT_EQ(list_code, 0) << list;
  EXPECT_NE(list.find("scope: jumprelu, 192 -> 80 features on blocks.1.hook_resid_mid"),
            std::string::npos)
      << list;
  const auto [code, out] =
      RunCommand(cli + " --sae scope --ids '4095 34 290 1021' --top-k 3 --features '0 5'");
  EXPECT_EQ(code, 0) << out;
  v1::SaeFeaturesRequest r;
  *r.mutable_input() = IdsInput({4095, 34, 290, 1021});
  r.set_sae("scope");
  r.set_top_k(3);
  r.add_feature_ids(0);
  r.add_feature_ids(5);
  v1::SaeFeaturesResponse a;
  ASSERT_TRUE(CallSae(server, r, &a).ok());
  std::vector<std::string> texts;
  size_t width = 4;
  for (int32_t id : a.token_ids()) {
    texts.push_back(
        absl::StrCat("\"", absl::Utf8SafeCHexEscape(server.model().tokenizer->Decode({id})), "\""));
    width = std::max(width, texts.back().size());
  }
  EXPECT_NE(out.find(absl::StrFormat("%8s %8s %-*s %6s", "position", "token", width, "text", "L0")),
            std::string::npos)
      << out;
  for (const v1::SaeRow& row : a.rows()) {
    std::string line =
        absl::StrFormat("%8d %8d %-*s %6d %9.4f ", row.position(), a.token_ids(row.position()),
                        width, texts[row.position()], row.l0(), row.relative_error());
    for (const v1::SaeFeature& f : row.top()) {
      absl::StrAppend(&line, absl::StrFormat(" %d:%.3f", f.index(), f.activation()));
    }
    absl::StrAppend(&line,
                    absl::StrFormat("  [0]=%.3f  [5]=%.3f\n", row.features(0), row.features(1)));
    EXPECT_NE(out.find(line), std::string::npos) << line << "\nin\n" << out;
  }
  const auto [bad_code, bad] = RunCommand(cli + " --sae nope --ids '1 2' 2>&1");
  EXPECT_EQ(bad_code, 1) << bad;
  EXPECT_NE(bad.find("kvlens-cli sae: sae = \"nope\" names none of the loaded SAEs"),
            std::string::npos)
      << bad;
}

TEST_F(InterpretSae, BadRequestsNameTheirField) {
  TestServer server(DefaultModelPath(), TestServer::DefaultOptions(), 1, WithSaes());
  ASSERT_TRUE(server.ok()) << server.error();
  auto with = [&](auto edit) {
    v1::SaeFeaturesRequest r;
    *r.mutable_input() = IdsInput(kTokens);
    r.set_sae("scope");
    edit(r);
    v1::SaeFeaturesResponse a;
    return CallSae(server, r, &a);
  };
  const auto invalid = grpc::StatusCode::INVALID_ARGUMENT;
  ExpectRefused(with([](auto& r) { r.set_sae("nope"); }), invalid,
                "sae = \"nope\" names none of the loaded SAEs: blocks.2.hook_resid_post, scope");
  ExpectRefused(with([](auto& r) { r.clear_sae(); }), invalid, "names none of the loaded SAEs");
  ExpectRefused(with([](auto& r) { r.set_top_k(81); }), invalid, "top_k = 81 must be in [1, 80]");
  ExpectRefused(with([](auto& r) { r.set_top_k(-1); }), invalid, "top_k = -1");
  ExpectRefused(with([](auto& r) { r.add_feature_ids(80); }), invalid,
                "feature_ids: 80 is outside [0, d_sae = 80)");
  ExpectRefused(with([](auto& r) { r.mutable_positions()->set_begin(11); }), invalid, "positions");
  v1::SaeFeaturesResponse a;
  v1::SaeFeaturesRequest ok;
  *ok.mutable_input() = IdsInput(kTokens);
  ok.set_sae("scope");
  ASSERT_TRUE(CallSae(server, ok, &a).ok());
  EXPECT_EQ(a.rows_size(), static_cast<int>(kTokens.size()));
  const std::string m = ScrapeMetrics(server.metrics_port());
  EXPECT_EQ(MetricValue(m, "kvlens_interp_requests_total{kind=\"sae\"}"), 7);
  EXPECT_EQ(MetricValue(m, R"(kvlens_requests_total{code="OK",rpc="SaeFeatures"})"), 1);

  TestServer bare(DefaultModelPath(), TestServer::DefaultOptions());
  ASSERT_TRUE(bare.ok()) << bare.error();
  ExpectRefused(CallSae(bare, ok, &a), grpc::StatusCode::FAILED_PRECONDITION,
                "no SAE is loaded: start kvlens-server with --sae");
}

}  // namespace
}  // namespace kvlens::testing
