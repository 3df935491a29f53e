// Where tests find third-party data (../shared/testdata) and the project's own files.
#ifndef KVLENS_TESTS_TEST_PATHS_H_
#define KVLENS_TESTS_TEST_PATHS_H_

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvlens::testing {

// $KVLENS_SHARED_DIR wins over the path baked in at configure time.
inline std::string SharedDir() {
  if (const char* env = std::getenv("KVLENS_SHARED_DIR")) return env;
  return KVLENS_SHARED_DIR;
}
inline std::string TestData(const std::string& rel) { return SharedDir() + "/testdata/" + rel; }
// $KVLENS_SOURCE_DIR likewise, for a test binary built on one machine and run on another
// (scripts/gpu-check.sh --prebuild).
inline std::string SourcePath(const std::string& rel) {
  if (const char* env = std::getenv("KVLENS_SOURCE_DIR")) return std::string(env) + "/" + rel;
  return std::string(KVLENS_SOURCE_DIR) + "/" + rel;
}
// llama.cpp's tokenizer vectors beyond ../shared/testdata (scripts/fetch-test-vocabs.sh
// puts them in $KVLENS_VOCAB_DIR, or ~/.cache/kvlens/llama-vocab).
inline std::string LlamaVocab(const std::string& name) {
  if (const char* env = std::getenv("KVLENS_VOCAB_DIR")) return std::string(env) + "/" + name;
  const char* cache = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::string base = cache != nullptr  ? std::string(cache)
                           : home != nullptr ? std::string(home) + "/.cache"
                                             : std::string("/nonexistent");
  return base + "/kvlens/llama-vocab/" + name;
}
// The project's own default model (GPT-2 family, safetensors + tokenizer.json).
inline std::string DefaultModelPath() { return SourcePath("models/kjv-gpt2-4l"); }
inline bool Exists(const std::string& p) { return std::filesystem::exists(p); }

}  // namespace kvlens::testing

// Skips the current test with a clear message when third-party data is absent.
#define KVLENS_REQUIRE_FILE(path)                                                            \
  do {                                                                                       \
    if (!::kvlens::testing::Exists(path)) GTEST_SKIP() << "test data not found: " << (path); \
  } while (0)

#endif  // KVLENS_TESTS_TEST_PATHS_H_
