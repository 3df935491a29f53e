// The Prometheus endpoint exports every metric name of ARCHITECTURE.md's table (a
// contract for dashboards and alerts), each with HELP text and its type.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

TEST(MetricsTest, EveryContractMetricIsExportedWithHelp) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  ASSERT_TRUE(RunGenerate(server.stub(), GreedyRequest("Once upon a time", 5)).status.ok());
  const std::string m = ScrapeMetrics(server.metrics_port());
  ASSERT_FALSE(m.empty());
  const std::vector<std::pair<std::string, std::string>> contract = {
      {"kvlens_requests_total", "counter"},
      {"kvlens_time_to_first_token_seconds", "histogram"},
      {"kvlens_inter_token_latency_seconds", "histogram"},
      {"kvlens_request_duration_seconds", "histogram"},
      {"kvlens_queue_duration_seconds", "histogram"},
      {"kvlens_prompt_tokens_total", "counter"},
      {"kvlens_generated_tokens_total", "counter"},
      {"kvlens_running_requests", "gauge"},
      {"kvlens_waiting_requests", "gauge"},
      {"kvlens_kv_cache_usage_ratio", "gauge"},
      {"kvlens_kv_cache_blocks", "gauge"},
      {"kvlens_prefix_cache_queries_total", "counter"},
      {"kvlens_prefix_cache_hits_total", "counter"},
      {"kvlens_preemptions_total", "counter"},
      {"kvlens_batch_tokens", "histogram"},
      {"kvlens_interp_requests_total", "counter"},
      {"kvlens_interp_duration_seconds", "histogram"},
      {"kvlens_interp_response_bytes_total", "counter"},
  };
  for (const auto& [name, type] : contract) {
    SCOPED_TRACE(name);
    const size_t help = m.find("# HELP " + name + " ");
    ASSERT_NE(help, std::string::npos);
    EXPECT_GT(m.find('\n', help) - help, ("# HELP " + name + " ").size() + 10) << "HELP text";
    EXPECT_NE(m.find("# TYPE " + name + " " + type + "\n"), std::string::npos);
  }
  // Every kvlens_ family is in the contract: nothing extra, nothing misspelled.
  for (size_t pos = m.find("# TYPE kvlens_"); pos != std::string::npos;
       pos = m.find("# TYPE kvlens_", pos + 1)) {
    const size_t start = pos + 7;
    const std::string name = m.substr(start, m.find(' ', start) - start);
    bool known = false;
    for (const auto& c : contract) known |= c.first == name;
    EXPECT_TRUE(known) << name;
  }

  EXPECT_EQ(MetricValue(m, R"(kvlens_requests_total{code="OK",rpc="Generate"})"), 1);
  EXPECT_EQ(MetricValue(m, "kvlens_prompt_tokens_total"), 5);
  EXPECT_EQ(MetricValue(m, "kvlens_generated_tokens_total"), 5);
  EXPECT_EQ(MetricValue(m, "kvlens_time_to_first_token_seconds_count"), 1);
  EXPECT_EQ(MetricValue(m, "kvlens_inter_token_latency_seconds_count"), 4);
  EXPECT_EQ(MetricValue(m, "kvlens_request_duration_seconds_count"), 1);
  EXPECT_EQ(MetricValue(m, "kvlens_queue_duration_seconds_count"), 1);
  EXPECT_EQ(MetricValue(m, "kvlens_prefix_cache_queries_total"), 5);
  EXPECT_GT(MetricValue(m, "kvlens_batch_tokens_count"), 0);
  EXPECT_EQ(MetricValue(m, R"(kvlens_interp_requests_total{kind="attention"})"), 0);

  // A failed call is counted under its code.
  v1::GenerateRequest bad = GreedyRequest("Once upon a time", 5);
  bad.mutable_sampling()->set_top_p(2);
  ASSERT_FALSE(RunGenerate(server.stub(), bad).status.ok());
  EXPECT_EQ(MetricValue(ScrapeMetrics(server.metrics_port()),
                        R"(kvlens_requests_total{code="INVALID_ARGUMENT",rpc="Generate"})"),
            1);
}

}  // namespace
}  // namespace kvlens::testing
