#include "server/metrics_http.h"

#include <chrono>
#include <string>

#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace kvlens::server {
namespace {

using testing::HttpExchange;

std::unique_ptr<MetricsHttpServer> StartOrDie(const std::string& body) {
  auto s = MetricsHttpServer::Start("127.0.0.1", 0, [body] { return body; });
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(MetricsHttpServer, ServesMetricsWithLengthAndContentType) {
  auto server = StartOrDie("kvlens_up 1\n");
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->port(), 0);
  const std::string r =
      HttpExchange(server->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << r;
  EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << r;
  EXPECT_NE(r.find("Content-Length: 12\r\n"), std::string::npos) << r;
  EXPECT_EQ(r.substr(r.size() - 12), "kvlens_up 1\n");
  // A query string is ignored; HEAD gets the headers only.
  EXPECT_EQ(
      HttpExchange(server->port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n").rfind("HTTP/1.1 200", 0),
      0u);
  const std::string head = HttpExchange(server->port(), "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u);
  EXPECT_EQ(head.find("kvlens_up"), std::string::npos);
}

TEST(MetricsHttpServer, BadRequestsGetClearStatuses) {
  auto server = StartOrDie("x\n");
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(HttpExchange(server->port(), "GET /nope HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0),
            0u);
  EXPECT_EQ(HttpExchange(server->port(), "POST /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405", 0),
            0u);
  EXPECT_EQ(HttpExchange(server->port(), "garbage\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  EXPECT_EQ(HttpExchange(server->port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(70000, 'a'))
                .rfind("HTTP/1.1 431", 0),
            0u);
  // A client that connects and says nothing does not wedge the server for others forever
  // (5 s timeout), and the server still answers afterwards.
  EXPECT_EQ(HttpExchange(server->port(), "").size(), 0u);
  EXPECT_EQ(HttpExchange(server->port(), "GET /metrics HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 200", 0),
            0u);
}

TEST(MetricsHttpServer, ErrorsNameTheAddressAndStopIsPrompt) {
  auto first = StartOrDie("x\n");
  ASSERT_NE(first, nullptr);
  auto taken = MetricsHttpServer::Start("127.0.0.1", first->port(), [] { return ""; });
  ASSERT_FALSE(taken.ok());
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(taken.status().message().find("127.0.0.1:" + std::to_string(first->port())),
            std::string::npos)
      << taken.status();
  auto bad_host = MetricsHttpServer::Start("no-such-host.invalid", 0, [] { return ""; });
  EXPECT_FALSE(bad_host.ok());
  EXPECT_NE(bad_host.status().message().find("no-such-host.invalid:0"), std::string::npos);
  auto bad_port = MetricsHttpServer::Start("127.0.0.1", 70000, [] { return ""; });
  EXPECT_FALSE(bad_port.ok());
  EXPECT_NE(bad_port.status().message().find("[0, 65535]"), std::string::npos);

  const auto t0 = std::chrono::steady_clock::now();
  first.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
}

}  // namespace
}  // namespace kvlens::server
