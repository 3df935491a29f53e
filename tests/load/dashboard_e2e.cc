// The dashboard against live data: kvlens-server and Debian's Prometheus on loopback
// (Prometheus scraping the server every second), about 20 s of kvlens-load, then every
// PromQL expression of docker/grafana/dashboards/kvlens.json must return data through
// Prometheus' HTTP API. Also: promtool accepts docker/prometheus/*.yml. Every child
// process is killed when the test ends, pass or fail (and dies with the test process).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "clients/load/http_get.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

// A child process with stdout+stderr in a log file; killed (TERM, then KILL) on scope exit.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::string& log) : log_(log) {
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execvp(args[0], args.data());
      _exit(127);
    }
  }
  ~Child() { Stop(); }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  // SIGTERM, up to 5 s to exit, then SIGKILL.
  void Stop() {
    if (pid_ <= 0 || exited_) return;
    kill(pid_, SIGTERM);
    if (WaitExit(seconds(5)) == kStillRunning) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      exited_ = true;
    }
  }

  static constexpr int kStillRunning = -1000;
  // The exit code within `timeout`; -signal if killed by one; kStillRunning.
  int WaitExit(milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    do {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
      std::this_thread::sleep_for(milliseconds(50));
    } while (Clock::now() < deadline);
    return kStillRunning;
  }
  bool running() { return !exited_ && WaitExit(milliseconds(0)) == kStillRunning; }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  bool exited_ = false;
};

// A loopback port free right now (bind to 0, read it back, release it).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

std::string FindProgram(const std::string& name) {
  for (const char* dir : {"/usr/bin", "/usr/local/bin", "/bin"}) {
    const std::string p = absl::StrCat(dir, "/", name);
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every "expr" under a "targets" array, anywhere in the dashboard (rows nest panels).
void CollectExprs(const nlohmann::json& j, std::vector<std::string>& out) {
  if (j.is_object()) {
    if (j.contains("targets") && j["targets"].is_array()) {
      for (const auto& t : j["targets"]) {
        if (t.contains("expr") && t["expr"].is_string()) out.push_back(t["expr"]);
      }
    }
    for (const auto& [key, value] : j.items()) {
      if (key != "targets") CollectExprs(value, out);
    }
  } else if (j.is_array()) {
    for (const auto& v : j) CollectExprs(v, out);
  }
}

// Grafana's interval variables → a fixed 30s window; template variables (only used in
// =~ matchers) → ".*".
std::string SubstituteGrafanaVariables(std::string expr) {
  for (const char* v : {"${__rate_interval}", "$__rate_interval", "${__interval}", "$__interval",
                        "${__range}", "$__range"}) {
    for (size_t at; (at = expr.find(v)) != std::string::npos;) {
      expr.replace(at, std::string(v).size(), "30s");
    }
  }
  return std::regex_replace(expr, std::regex(R"(\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)"), ".*");
}

int RunCommand(const std::string& command, std::string& output) {
  FILE* p = popen(absl::StrCat("timeout 60 ", command, " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) output.append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(DashboardTest, PromtoolAcceptsConfigAndRules) {
  const std::string promtool = FindProgram("promtool");
  if (promtool.empty()) GTEST_SKIP() << "promtool not found (scripts/install-deps.sh installs it)";
  std::string out;
  EXPECT_EQ(RunCommand(absl::StrCat(promtool, " check config ",
                                    SourcePath("docker/prometheus/prometheus.yml")),
                       out),
            0)
      << out;
  out.clear();
  EXPECT_EQ(
      RunCommand(
          absl::StrCat(promtool, " check rules ", SourcePath("docker/prometheus/alerts.yml")), out),
      0)
      << out;
  out.clear();
  // The alerts' own unit tests (synthetic series → which alerts fire); promtool resolves
  // rule_files beside the test file.
  EXPECT_EQ(RunCommand(absl::StrCat(promtool, " test rules ",
                                    SourcePath("docker/prometheus/alerts_test.yml")),
                       out),
            0)
      << out;
}

TEST(DashboardTest, EveryPanelQueryReturnsDataAfterALoadRun) {
  const std::string prometheus = FindProgram("prometheus");
  if (prometheus.empty()) {
    GTEST_SKIP() << "prometheus not found (scripts/install-deps.sh installs it)";
  }
  std::string model = DefaultModelPath();
  if (!Exists(model + "/config.json")) model = TestData("stories260K/stories260K.gguf");
  KVLENS_REQUIRE_FILE(model);

  const nlohmann::json dashboard =
      nlohmann::json::parse(ReadFile(SourcePath("docker/grafana/dashboards/kvlens.json")));
  std::vector<std::string> exprs;
  CollectExprs(dashboard, exprs);
  ASSERT_GE(exprs.size(), 14u) << "the dashboard lost panels?";

  std::string tmp = ::testing::TempDir() + "/kvlens_dashboard_XXXXXX";
  ASSERT_NE(mkdtemp(tmp.data()), nullptr);
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{tmp};

  // kvlens-server on ephemeral ports; its first line names them.
  Child server({KVLENS_SERVER_PATH, "--model", model, "--host", "127.0.0.1", "--port", "0",
                "--metrics-port", "0", "--threads", "1", "--drain-timeout", "2s"},
               tmp + "/server.log");
  int port = 0, metrics_port = 0;
  for (auto deadline = Clock::now() + seconds(60); Clock::now() < deadline && port == 0;) {
    const std::string log = server.Log();
    const size_t at = log.find(" on 127.0.0.1:");
    if (at != std::string::npos && log.find('\n', at) != std::string::npos) {
      std::sscanf(log.c_str() + at, " on 127.0.0.1:%d, metrics on 127.0.0.1:%d", &port,
                  &metrics_port);
    }
    ASSERT_TRUE(server.running()) << server.Log();
    std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_GT(port, 0) << server.Log();
  ASSERT_GT(metrics_port, 0) << server.Log();

  // Prometheus scraping it every second, with the project's alert rules loaded too.
  const int prom_port = FreePort();
  ASSERT_GT(prom_port, 0);
  {
    std::ofstream config(tmp + "/prometheus.yml");
    config << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
           << "rule_files:\n  - " << SourcePath("docker/prometheus/alerts.yml") << "\n"
           << "scrape_configs:\n  - job_name: kvlens\n    static_configs:\n"
           << "      - targets: ['127.0.0.1:" << metrics_port << "']\n";
  }
  Child prom({prometheus, "--config.file=" + tmp + "/prometheus.yml",
              "--storage.tsdb.path=" + tmp + "/data",
              absl::StrCat("--web.listen-address=127.0.0.1:", prom_port), "--log.level=warn"},
             tmp + "/prometheus.log");
  bool ready = false;
  for (auto deadline = Clock::now() + seconds(30); Clock::now() < deadline && !ready;) {
    ASSERT_TRUE(prom.running()) << prom.Log();
    ready = load::HttpGet("127.0.0.1", prom_port, "/-/ready", milliseconds(1000)).ok();
    if (!ready) std::this_thread::sleep_for(milliseconds(200));
  }
  ASSERT_TRUE(ready) << prom.Log();

  // ~20 s of load: mixed lengths, a shared prefix (prefix-cache hits) and, where the
  // stubs exist, a little interpretability traffic for the interp_* panels.
  std::vector<std::string> load_args = {KVLENS_LOAD_PATH,
                                        absl::StrCat("--server=127.0.0.1:", port),
                                        absl::StrCat("--metrics=127.0.0.1:", metrics_port),
                                        "--mode=closed",
                                        "--concurrency=4",
                                        "--requests=100000",
                                        "--duration=20s",
                                        "--warmup=2",
                                        "--prompt-tokens=16:48",
                                        "--output-tokens=16:48",
                                        "--shared-prefix-tokens=16",
                                        "--request-timeout=30s",
                                        "--drain-timeout=10s",
                                        "--json-out=" + tmp + "/report.json"};
#ifdef KVLENS_LOAD_INTERPRET
  load_args.push_back("--attention-share=0.05");
  load_args.push_back("--probe-share=0.05");
  load_args.push_back("--activations-share=0.03");
  load_args.push_back("--attribution-share=0.03");
  load_args.push_back("--patch-share=0.02");
#endif
  Child load(load_args, tmp + "/load.log");
  const int load_exit = load.WaitExit(seconds(120));
  ASSERT_EQ(load_exit, 0) << load.Log() << "\nserver:\n" << server.Log();
  const nlohmann::json report = nlohmann::json::parse(ReadFile(tmp + "/report.json"));
  EXPECT_GT(report["requests"]["ok"].get<int64_t>(), 0) << report.dump(2);
  EXPECT_GT(report["ttft_ms"]["count"].get<int64_t>(), 0) << report.dump(2);
  EXPECT_FALSE(report["server"].is_null()) << report.dump(2);

  // Two more scrapes so the last samples are in, then every expression at "now".
  std::this_thread::sleep_for(seconds(3));
  int with_data = 0;
  for (const std::string& expr : exprs) {
    const std::string q = SubstituteGrafanaVariables(expr);
    ASSERT_EQ(q.find('$'), std::string::npos) << "unsubstituted variable in: " << q;
    auto body = load::HttpGet("127.0.0.1", prom_port, "/api/v1/query?query=" + load::UrlEncode(q),
                              seconds(10));
    ASSERT_TRUE(body.ok()) << q << ": " << body.status();
    const nlohmann::json j = nlohmann::json::parse(*body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << q << ": " << *body;
    ASSERT_EQ(j.value("status", ""), "success") << q << ": " << *body;
    const bool has_data = !j["data"]["result"].empty();
    EXPECT_TRUE(has_data) << "no data for dashboard query: " << q;
    with_data += has_data;
  }
  EXPECT_EQ(with_data, static_cast<int>(exprs.size()));
  prom.Stop();
  server.Stop();
}

}  // namespace
}  // namespace kvlens::testing
