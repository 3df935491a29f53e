// Runs the kvlens-cli binary (KVLENS_CLI_PATH) for the end-to-end CLI tests.
#ifndef KVLENS_TESTS_CLIENTS_CLI_RUN_CLI_H_
#define KVLENS_TESTS_CLIENTS_CLI_RUN_CLI_H_

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace kvlens::testing {

struct RunResult {
  int exit_code = -1;
  std::string out;  // stdout only; stderr goes to the test log
};

inline RunResult RunCli(const std::string& args) {
  const std::string cmd = std::string(KVLENS_CLI_PATH) + " " + args;
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_CLIENTS_CLI_RUN_CLI_H_
