// A fresh directory under the test's temporary folder, removed with everything in it when
// the object goes out of scope: for tests that write files (SAEs, archives) at test time;
// and ProcessTempDir, one for the process.
#ifndef KVLENS_TESTS_TEMP_DIR_H_
#define KVLENS_TESTS_TEMP_DIR_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

namespace kvlens::testing {

class ScopedTempDir {
 public:
  explicit ScopedTempDir(const std::string& prefix) {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::path(::testing::TempDir()) /
            (prefix + "_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~ScopedTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  // dir/name, as a string.
  std::string File(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// One directory for the whole test process (its pid in the name), removed at exit: for
// helpers that write files by fixed names, so that test processes run side by side
// (ctest -j) never write the same file and nothing is left in the temporary folder.
inline const ScopedTempDir& ProcessTempDir() {
  static const ScopedTempDir dir("kvlens_test");
  return dir;
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_TEMP_DIR_H_
