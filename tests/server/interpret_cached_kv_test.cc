// CachedKvProbe on a live session against the PyTorch float64 oracle, on both model
// families: the gradient of log p(target | the next token) with respect to the session's
// cached keys and values, taken as leaves (tests/oracle: --grad-cached-kv). The cache
// holds the engine's fp32 K/V, so both precisions are held to the fp32 tolerance (1e-4).
#include "gtest/gtest.h"
#include "tests/server/interpret_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

struct SessionModel {
  const char* name;
  std::string (*path)();
  const char* prompt;
};
const SessionModel kSessionModels[] = {{"stories260K", Stories260KPath, "Once upon a time"},
                                       {"kjv_gpt2_4l", DefaultModelPath, "And God said"}};

class InterpretCachedKvOracle : public ::testing::TestWithParam<SessionModel> {};
INSTANTIATE_TEST_SUITE_P(Models, InterpretCachedKvOracle, ::testing::ValuesIn(kSessionModels),
                         [](const auto& p) { return std::string(p.param.name); });

TEST_P(InterpretCachedKvOracle, GradientsMatchOracleWithCacheAsLeaves) {
  const std::string path = GetParam().path();
  KVLENS_REQUIRE_FILE(path);
  if (!OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  TestServer server(path, TestServer::DefaultOptions());
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const ModelConfig& c = server.model().config;
  const GeneratedSession session = OpenSessionAndGenerate(server, GetParam().prompt, 8);
  ASSERT_TRUE(session.error.empty()) << session.error;
  const std::vector<int32_t>& tokens = session.tokens;
  const int cached = session.cached;
  ASSERT_EQ(cached + 1, static_cast<int>(tokens.size()));  // the last token is not cached yet
  const int32_t target = 42;
  const OracleResult ref = RunCachedKvOracle(path, tokens, target, cached);
  ASSERT_TRUE(ref.error.empty()) << ref.error;

  for (const v1::Precision p : {v1::PRECISION_FP64, v1::PRECISION_FP32}) {
    v1::CachedKvProbeRequest r;
    r.set_session_id(session.id);
    r.set_target(target);
    r.set_precision(p);
    v1::CachedKvProbeResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status s = stub->CachedKvProbe(&context, r, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(response.num_cached(), cached);
    EXPECT_NEAR(response.objective(), ref.arrays.at("objective").data[0], 1e-4);
    double worst = 0;
    for (int l = 0; l < c.num_layers; ++l) {
      for (const char* name : {"cached_k", "cached_v"}) {
        const v1::Tensor* t = FindTensor(response.tensors(), absl::StrCat("grad.", name), l, -1);
        ASSERT_NE(t, nullptr) << name << " layer " << l;
        const std::vector<double>& want = ref.arrays.at(absl::StrCat("grad.", name, ".", l)).data;
        ASSERT_EQ(want.size(), static_cast<size_t>(cached) * c.kv_dim());
        const double e = RelErr(DecodeTensor(*t), want);
        EXPECT_LE(e, 1e-4) << name << " layer " << l;
        worst = std::max(worst, e);
      }
    }
    std::printf("[interp] %s CachedKvProbe %s (P = %d): worst relative error vs oracle %.3g\n",
                GetParam().name, p == v1::PRECISION_FP64 ? "fp64" : "fp32", cached, worst);
  }
}

}  // namespace
}  // namespace kvlens::testing
