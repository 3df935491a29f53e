#include "clients/load/prom_text.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace kvlens::load {
namespace {

// As prometheus-cpp exposes kvlens-server's metrics (abridged), plus the format's corners.
constexpr char kExposition[] =
    R"(# HELP kvlens_requests_total Finished RPCs by method and gRPC status code.
# TYPE kvlens_requests_total counter
kvlens_requests_total{rpc="Generate",code="OK"} 12
kvlens_requests_total{rpc="Generate",code="RESOURCE_EXHAUSTED"} 3
kvlens_requests_total{rpc="Tokenize",code="OK"} 2
# TYPE kvlens_batch_tokens histogram
kvlens_batch_tokens_count 4
kvlens_batch_tokens_sum 40.5
kvlens_batch_tokens_bucket{le="1"} 0
kvlens_batch_tokens_bucket{le="+Inf"} 4
kvlens_kv_cache_usage_ratio 0.25
kvlens_kv_cache_blocks{state="used"} 10
kvlens_kv_cache_blocks{state="free"} 30

  spaced_metric   7   1712345678000
escaped{path="C:\\dir",quote="say \"hi\"",nl="a\nb",} 1e3
empty_labels{} -Inf
not_a_number NaN
)";

TEST(PromTextTest, ParsesSamplesLabelsAndSpecialValues) {
  auto samples = ParsePromText(kExposition);
  ASSERT_TRUE(samples.ok()) << samples.status();
  ASSERT_EQ(samples->size(), 14u);
  EXPECT_EQ((*samples)[0].name, "kvlens_requests_total");
  EXPECT_EQ((*samples)[0].labels.at("rpc"), "Generate");
  EXPECT_EQ((*samples)[0].labels.at("code"), "OK");
  EXPECT_EQ((*samples)[0].value, 12);
  EXPECT_EQ((*samples)[6].labels.at("le"), "+Inf");
  EXPECT_EQ((*samples)[10].name, "spaced_metric");
  EXPECT_EQ((*samples)[10].value, 7);  // the timestamp is not the value
  const PromSample& e = (*samples)[11];
  EXPECT_EQ(e.labels.at("path"), "C:\\dir");
  EXPECT_EQ(e.labels.at("quote"), "say \"hi\"");
  EXPECT_EQ(e.labels.at("nl"), "a\nb");
  EXPECT_EQ(e.value, 1000);
  EXPECT_TRUE((*samples)[12].labels.empty());
  EXPECT_TRUE(std::isinf((*samples)[12].value) && (*samples)[12].value < 0);
  EXPECT_TRUE(std::isnan((*samples)[13].value));
}

TEST(PromTextTest, SnapshotSumsBySubsetAndLabel) {
  auto samples = ParsePromText(kExposition);
  ASSERT_TRUE(samples.ok());
  const MetricSnapshot m(*std::move(samples));
  EXPECT_TRUE(m.Has("kvlens_batch_tokens_count"));
  EXPECT_FALSE(m.Has("kvlens_batch_tokens"));
  EXPECT_EQ(m.Sum("kvlens_requests_total"), 17);
  EXPECT_EQ(m.Sum("kvlens_requests_total", {{"rpc", "Generate"}}), 15);
  EXPECT_EQ(m.Sum("kvlens_requests_total", {{"rpc", "Generate"}, {"code", "OK"}}), 12);
  EXPECT_EQ(m.Sum("absent_metric"), 0);
  const auto by_code = m.SumBy("kvlens_requests_total", "code", {{"rpc", "Generate"}});
  ASSERT_EQ(by_code.size(), 2u);
  EXPECT_EQ(by_code.at("RESOURCE_EXHAUSTED"), 3);
  EXPECT_EQ(m.SumBy("kvlens_kv_cache_blocks", "state").at("free"), 30);
  EXPECT_DOUBLE_EQ(m.Sum("kvlens_batch_tokens_sum") / m.Sum("kvlens_batch_tokens_count"), 10.125);
}

TEST(PromTextTest, RejectsMalformedLinesNamingThem) {
  for (const char* bad : {"metric", "metric{a=\"1\" 2", "metric{a=1} 2", "metric{a=\"1} 2",
                          "9metric 1", "metric 1 2 3", "metric one", "metric{=\"x\"} 1"}) {
    auto samples = ParsePromText(std::string("ok_metric 1\n") + bad + "\n");
    ASSERT_FALSE(samples.ok()) << bad;
    EXPECT_NE(samples.status().message().find("line 2"), std::string::npos) << samples.status();
  }
  EXPECT_TRUE(ParsePromText("").ok());
  EXPECT_TRUE(ParsePromText("# only a comment\n\n").ok());
  EXPECT_TRUE(ParsePromText("crlf_metric 1\r\n").ok());
}

}  // namespace
}  // namespace kvlens::load
