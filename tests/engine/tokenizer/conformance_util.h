// Reads llama.cpp's tokenizer conformance vectors (tests/test-tokenizer-0 format): the .inp
// file holds strings separated by "\n__ggml_vocab_test__\n" (the file ends with one), the
// .out file one line of space-separated ids per string.
#ifndef KVLENS_TESTS_ENGINE_TOKENIZER_CONFORMANCE_UTIL_H_
#define KVLENS_TESTS_ENGINE_TOKENIZER_CONFORMANCE_UTIL_H_

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace kvlens::testing {

struct ConformanceCase {
  std::string text;
  std::vector<int32_t> ids;
};

inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Empty when the files are missing or their counts disagree (the caller asserts).
inline std::vector<ConformanceCase> ReadConformance(const std::string& inp_path,
                                                    const std::string& out_path) {
  const std::string raw = ReadWholeFile(inp_path);
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  for (size_t pos = 0; pos < raw.size();) {
    const size_t next = raw.find(sep, pos);
    if (next == std::string::npos) {
      texts.push_back(raw.substr(pos));
      break;
    }
    texts.push_back(raw.substr(pos, next - pos));
    pos = next + sep.size();
  }
  std::ifstream out(out_path);
  std::vector<ConformanceCase> cases;
  std::string line;
  for (size_t i = 0; std::getline(out, line); ++i) {
    if (i >= texts.size()) return {};
    ConformanceCase c{texts[i], {}};
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
    cases.push_back(std::move(c));
  }
  if (cases.size() != texts.size()) return {};
  return cases;
}

// " 1 2 3", the .out files' own spelling, so a mismatch prints readably.
inline std::string IdString(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) {
    s += ' ';
    s += std::to_string(id);
  }
  return s;
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_ENGINE_TOKENIZER_CONFORMANCE_UTIL_H_
