// Runs a Python script against a live server in the tests: Debian's /usr/bin/python3 with
// the client (clients/python) on PYTHONPATH.
#ifndef KVLENS_TESTS_SERVER_PYTHON_SCRIPT_H_
#define KVLENS_TESTS_SERVER_PYTHON_SCRIPT_H_

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tests/server/server_test_util.h"

namespace kvlens::testing {

// Runs `script` (written to a temporary file `name`) with Debian's python3 and the client
// on PYTHONPATH, with `args`: exit code 0 and its stdout parsed as JSON, or a failure
// with the command and its output.
inline ::testing::AssertionResult RunScript(const std::string& name, const char* script,
                                            const std::string& args, nlohmann::json* out) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << script;
  const std::string cmd = absl::StrCat("PYTHONPATH=", KVLENS_SOURCE_DIR,
                                       "/clients/python /usr/bin/python3 ", path, " ", args);
  const auto [code, output] = RunCommand(cmd);
  std::remove(path.c_str());
  if (code != 0) return ::testing::AssertionFailure() << cmd << "\n" << output;
  *out = nlohmann::json::parse(output);
  return ::testing::AssertionSuccess();
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_SERVER_PYTHON_SCRIPT_H_
