// kvlens-load's interpretability kinds against a live server (stories260K): with
// --patch-share 1 every request is a PatchSweep (each head's z in the last layer, all
// positions, from the prompt's ids reversed), and each must come back whole: per request a
// response holding one cell per head, which the report counts under "patch".
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

TEST(LoadInterpret, PatchSweepsComeBackWhole) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  const LoadRun run =
      RunLoad(server.address(),
              "--mode closed --concurrency 2 --requests 6 --prompt-tokens 12:20 --patch-share 1 "
              "--seed 3 --metrics none --progress=false");
  ASSERT_EQ(run.code, 0) << run.output;
  const nlohmann::json report = nlohmann::json::parse(run.report);
  const nlohmann::json& patch = report["interpret"]["patch"];
  EXPECT_EQ(patch["ok"], 6) << report.dump(2);
  EXPECT_EQ(patch["errors"], 0) << report.dump(2);
  EXPECT_EQ(report["requests"]["ok"], 0) << report.dump(2);  // no generate requests
  EXPECT_EQ(report["config"]["patch_share"], 1.0);
  // Each response carries at least its 8 heads' cells (8 doubles) and the prompt's ids.
  EXPECT_GE(patch["response_bytes"].get<int64_t>(), 6 * (8 * 8 + 12)) << report.dump(2);

  const auto [bad_code, bad] =
      RunCommand(absl::StrCat(KVLENS_LOAD_PATH, " --patch-share 0.6 --probe-share 0.5 --server ",
                              server.address(), " 2>&1"));
  EXPECT_EQ(bad_code, 2) << bad;
  EXPECT_NE(bad.find("--patch-share must be >= 0 with a sum <= 1"), std::string::npos) << bad;
}

}  // namespace
}  // namespace kvlens::testing
