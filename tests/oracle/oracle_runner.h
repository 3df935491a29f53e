// Runs the PyTorch float64 oracle (tests/oracle/oracle.py, Debian's /usr/bin/python3) as
// a separate process and reads its KVORACLE container: the golden values are computed at
// test time, independently of kvlens, never stored from our own output.
#ifndef KVLENS_TESTS_ORACLE_ORACLE_RUNNER_H_
#define KVLENS_TESTS_ORACLE_ORACLE_RUNNER_H_

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "tests/test_paths.h"

namespace kvlens::testing {

struct OracleArray {
  std::vector<int64_t> dims;
  std::vector<double> data;
};

// name → array, or an empty map with `error` set.
struct OracleResult {
  std::map<std::string, OracleArray> arrays;
  std::string error;
};

inline const char* OraclePython() { return "/usr/bin/python3"; }

inline bool OracleAvailable() {
  return std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
}

inline OracleResult ReadOracleContainer(const std::string& path) {
  OracleResult r;
  std::ifstream in(path, std::ios::binary);
  char magic[8];
  uint32_t version = 0, count = 0;
  in.read(magic, 8);
  in.read(reinterpret_cast<char*>(&version), 4);
  in.read(reinterpret_cast<char*>(&count), 4);
  if (!in || std::memcmp(magic, "KVORACLE", 8) != 0 || version != 1) {
    r.error = "bad oracle container " + path;
    return r;
  }
  for (uint32_t a = 0; a < count; ++a) {
    uint32_t name_len = 0, ndim = 0;
    in.read(reinterpret_cast<char*>(&name_len), 4);
    std::string name(name_len, '\0');
    in.read(name.data(), name_len);
    in.read(reinterpret_cast<char*>(&ndim), 4);
    OracleArray arr;
    arr.dims.resize(ndim);
    in.read(reinterpret_cast<char*>(arr.dims.data()), 8 * ndim);
    int64_t n = 1;
    for (int64_t d : arr.dims) n *= d;
    arr.data.resize(n);
    in.read(reinterpret_cast<char*>(arr.data.data()), 8 * n);
    if (!in) {
      r.error = "truncated oracle container " + path;
      return r;
    }
    r.arrays.emplace(name, std::move(arr));
  }
  return r;
}

// Runs tests/oracle/oracle.py on `tokens` with `args` appended and reads its container.
inline OracleResult RunOracleWith(const std::string& model, const std::vector<int32_t>& tokens,
                                  const std::string& args) {
  char tmpl[] = "/tmp/kvlens_interp_oracle_XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd >= 0) close(fd);
  const std::string cmd = std::string(OraclePython()) + " " + KVLENS_SOURCE_DIR +
                          "/tests/oracle/oracle.py --model '" + model + "' --tokens '" +
                          absl::StrJoin(tokens, " ") + "' --out " + tmpl + " " + args;
  OracleResult r;
  if (std::system(cmd.c_str()) != 0) {
    r.error = "oracle failed: " + cmd;
  } else {
    r = ReadOracleContainer(tmpl);
  }
  std::remove(tmpl);
  return r;
}

// The oracle's `n` greedy tokens after `prompt` (each step a full recompute); empty when
// it fails.
inline std::vector<int32_t> OracleGreedy(const std::string& model,
                                         const std::vector<int32_t>& prompt, int n) {
  const std::string cmd = std::string(OraclePython()) + " " + KVLENS_SOURCE_DIR +
                          "/tests/oracle/oracle.py --model '" + model + "' --generate " +
                          std::to_string(n) + " --prompt-tokens '" + absl::StrJoin(prompt, " ") +
                          "'";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return {};
  std::vector<int32_t> ids;
  for (int id; fscanf(pipe, "%d", &id) == 1;) ids.push_back(id);
  if (pclose(pipe) != 0) return {};
  return ids;
}

// Logits (and per-layer attention probabilities with `attention`) for `tokens`.
inline OracleResult RunOracle(const std::string& model, const std::vector<int32_t>& tokens,
                              bool attention, const std::vector<int32_t>& doc_ids = {}) {
  std::string args = attention ? "--attention" : "";
  if (!doc_ids.empty()) args += " --doc-ids '" + absl::StrJoin(doc_ids, " ") + "'";
  return RunOracleWith(model, tokens, args);
}

// Writes tests/oracle/make_quantized_gguf.py's model (a random Llama in every ggml block
// type; `args` are the script's flags) to a new temporary file and returns its path, or ""
// when that failed. The caller removes the file.
inline std::string MakeQuantizedModel(const std::string& args = "") {
  char tmpl[] = "/tmp/kvlens_quantized_XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return "";
  close(fd);
  const std::string cmd = std::string(OraclePython()) + " " + KVLENS_SOURCE_DIR +
                          "/tests/oracle/make_quantized_gguf.py --out " + tmpl + " " + args;
  if (std::system(cmd.c_str()) != 0) {
    std::remove(tmpl);
    return "";
  }
  return tmpl;
}

// A random model with stories260K's tokenizer whose GGUF holds a Jinja chat template of
// ChatML's family (so kvlens writes conversations as ChatML), for the chat tests; the
// file's path (the caller removes it), or "" when the script fails.
inline std::string MakeChatMlModel() {
  return MakeQuantizedModel("--tokenizer " + TestData("stories260K/stories260K.gguf") +
                            " --chat-template '{{ \"<|im_start|>\" + message.role }}'");
}

// Writes tests/oracle/make_sae.py's SAE (random weights; `args` are its flags: --format
// saelens|npz, sizes, architecture, …) to `out`; false when the script failed.
inline bool MakeSae(const std::string& out, const std::string& args) {
  const std::string cmd = std::string(OraclePython()) + " " + KVLENS_SOURCE_DIR +
                          "/tests/oracle/make_sae.py --out '" + out + "' " + args;
  return std::system(cmd.c_str()) == 0;
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_ORACLE_ORACLE_RUNNER_H_
